"""GroupSchedule: what a compiled model runs, one lane (a Scheduler) per parameter group, as one
torch scheduler drives every group of its optimizer. Separate because it is not a Scheduler
itself but the adapter between schedules (anygrad's, converted torch ones, plain functions) and
a model's parameter groups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...coerce import to_lower_str
from ...errors import ConfigError
from .base import INTERVALS, Scheduler
from .lambdas import LambdaLR


@dataclass
class GroupSchedule:
    """A learning-rate schedule over a model's parameter groups, as one torch scheduler drives
    every group of its optimizer: lane i is the schedule on group i's own initial rate (torch's
    base_lrs[i]). `interval`: "step" advances it per optimizer update, "epoch" per epoch of fit
    (or per `Model.step_scheduler()` call). Build it with `GroupSchedule.build`."""

    lanes: list[Scheduler]
    interval: str = "step"
    from_fit: bool = False  # fit(scheduler=NAME) set it for its run (compile's stays)

    @classmethod
    def build(cls, scheduler: Any, base_lrs: list[float], interval: str | None = None) -> GroupSchedule:
        """From an anygrad Scheduler (spread over the groups from their initial rates), a
        GroupSchedule (one lane per group already, e.g. from anygrad.optim.from_torch), or a plain
        function `step -> factor of the initial rate` (LambdaLR)."""
        if interval is not None and to_lower_str(interval) not in INTERVALS:
            raise ConfigError(f"scheduler_interval must be one of {', '.join(INTERVALS)}, got {interval!r}")
        interval = None if interval is None else to_lower_str(interval)
        schedule = cls._build(scheduler, base_lrs, interval)
        if schedule.needs_metric and schedule.interval != "epoch":
            raise ConfigError(f"scheduler '{schedule.name}' steps on a validation metric, once per epoch: "
                              "scheduler_interval must be 'epoch' (fit feeds it the monitored metric)")
        return schedule

    @classmethod
    def _build(cls, scheduler: Any, base_lrs: list[float], interval: str | None) -> GroupSchedule:
        if isinstance(scheduler, GroupSchedule):
            if len(scheduler.lanes) != len(base_lrs):
                raise ConfigError(f"scheduler: it schedules {len(scheduler.lanes)} parameter groups, the "
                                  f"model's optimizer has {len(base_lrs)}; convert the scheduler of the "
                                  "optimizer you converted")
            for i, (lane, lr) in enumerate(zip(scheduler.lanes, base_lrs)):
                if not math.isclose(lane.base_lr, lr, rel_tol=1e-12, abs_tol=0.0):
                    raise ConfigError(f"scheduler: parameter group {i} starts at lr {lr:g} in the optimizer "
                                      f"but {lane.base_lr:g} in the schedule (torch's initial_lr); convert "
                                      "the scheduler of the optimizer you compile with")
            return cls(scheduler.lanes, interval or scheduler.interval)
        if isinstance(scheduler, Scheduler):
            fns = getattr(scheduler, "lr_lambda", None)
            if isinstance(fns, (list, tuple)) and len(fns) != len(base_lrs):
                raise ConfigError(f"scheduler '{scheduler.name}': {len(fns)} lr_lambda functions for "
                                  f"{len(base_lrs)} parameter groups; give one, or one per group")
            lanes = [scheduler.for_group(i, lr) for i, lr in enumerate(base_lrs)]
            return cls(lanes, interval or scheduler.interval)
        if callable(scheduler):
            return cls([LambdaLR(lr, lr_lambda=scheduler) for lr in base_lrs], interval or "step")
        raise ConfigError("scheduler must be an anygrad Scheduler (anygrad.optim.get_scheduler), a "
                          "converted torch scheduler (anygrad.optim.from_torch) or a function step -> lr "
                          f"factor; got {type(scheduler).__name__}")

    @property
    def name(self) -> str:
        return self.lanes[0].name

    @property
    def needs_metric(self) -> bool:
        return self.lanes[0].needs_metric

    @property
    def steps(self) -> int:
        return self.lanes[0].steps

    @property
    def lrs(self) -> list[float]:
        """The rate of each group for the next optimizer update."""
        return [lane.lr for lane in self.lanes]

    @property
    def lr(self) -> float:
        return self.lanes[0].lr

    def step(self, metric: float | None = None) -> list[float]:
        """Advance every group one step (or epoch); returns the new rates."""
        for lane in self.lanes:
            lane.step(metric)
        return self.lrs

    def config(self) -> dict[str, Any]:
        cfg = {**self.lanes[0].config(), "interval": self.interval}
        return cfg if len(self.lanes) == 1 else {**cfg, "groups": len(self.lanes),
                                                 "base_lrs": [lane.base_lr for lane in self.lanes]}

    def state_dict(self) -> dict[str, Any]:
        """One group: its lane's state (the format of a lone Scheduler's); several: every lane's."""
        if len(self.lanes) == 1:
            return self.lanes[0].state_dict()
        return {"name": self.name, "groups": [lane.state_dict() for lane in self.lanes]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        groups = state.get("groups") if isinstance(state, dict) else None
        if groups is None:
            groups = [state]
        if not isinstance(groups, list) or len(groups) != len(self.lanes):
            count = len(groups) if isinstance(groups, list) else "?"
            raise ConfigError(f"scheduler state for {count} parameter groups, this schedule has "
                              f"{len(self.lanes)}")
        for lane, lane_state in zip(self.lanes, groups):
            lane.load_state_dict(lane_state)
