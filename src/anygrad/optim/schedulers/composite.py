"""Composite schedules, several schedulers on one shared rate as torch's drive one optimizer:
SequentialLR (each child from its milestone on) and ChainedScheduler (every child each step).
Separate because they drive other Schedulers through the base class's _initial/_advance/_restart
hooks and hold their children's state.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from .base import Scheduler


def _check_children(owner: Scheduler, children: list[Any]) -> list[Scheduler]:
    owner._require(len(children) > 0, "schedulers must list at least one scheduler")
    for i, child in enumerate(children):
        owner._require(isinstance(child, Scheduler),
                       f"schedulers[{i}] is {child!r}, not an anygrad Scheduler")
        owner._require(not child.needs_metric, f"schedulers[{i}] is '{child.name}', which steps on a metric; "
                       "torch cannot chain it either: use it on its own")
    # every child scales the same groups from the same initial rate
    return [c if c.base_lr == owner.base_lr else c.for_group(0, owner.base_lr) for c in children]


def _composite_config(sched: Scheduler) -> dict[str, Any]:
    cfg = {f.name: getattr(sched, f.name) for f in fields(sched)}
    return {"name": sched.name, **cfg, "schedulers": [c.config() for c in sched.schedulers]}


@dataclass
class SequentialLR(Scheduler):
    """torch.optim.lr_scheduler.SequentialLR: schedulers[i] runs from milestones[i-1] on,
    restarted at its milestone as torch does (its closed form at epoch 0)."""

    schedulers: list[Any] = field(default_factory=list)
    milestones: list[int] = field(default_factory=list)

    name = "sequential"

    def _validate(self) -> None:
        self.schedulers = _check_children(self, self.schedulers)
        self._require(len(self.milestones) == len(self.schedulers) - 1,
                      f"milestones must list one step fewer than schedulers "
                      f"({len(self.schedulers) - 1}), got {self.milestones}")
        self._require(list(self.milestones) == sorted(self.milestones),
                      f"milestones must be in increasing order, got {self.milestones}")

    def _initial(self, lr: float) -> float:
        for child in self.schedulers:  # torch's recursive_undo: not started yet
            child._initial(lr)
            child.steps = -1
        self.steps = 0
        self.lr = self.schedulers[bisect.bisect_right(self.milestones, 0)]._initial(self.base_lr)
        return self.lr

    def _advance(self, lr: float) -> float:
        t = self.steps + 1
        idx = bisect.bisect_right(self.milestones, t)
        child = self.schedulers[idx]
        self.lr = child._restart(lr) if idx > 0 and self.milestones[idx - 1] == t else child._advance(lr)
        self.steps = t
        return self.lr

    def for_group(self, index: int, base_lr: float) -> Scheduler:
        if index == 0 and base_lr == self.base_lr:
            return self
        lane = dataclasses.replace(self, base_lr=base_lr,
                                   schedulers=[c.for_group(index, base_lr) for c in self.schedulers])
        for _ in range(self.steps):
            lane.step()
        return lane

    def _extra_state(self) -> dict[str, Any]:
        return {"schedulers": [c.state_dict() for c in self.schedulers]}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        saved = state["schedulers"]
        if len(saved) != len(self.schedulers):
            raise ValueError(f"{len(saved)} scheduler states for {len(self.schedulers)} schedulers")
        for child, child_state in zip(self.schedulers, saved):
            child.load_state_dict(child_state)

    def config(self) -> dict[str, Any]:
        return _composite_config(self)


@dataclass
class ChainedScheduler(Scheduler):
    """torch.optim.lr_scheduler.ChainedScheduler: every step, each scheduler in turn steps the
    shared rate (their factors compose)."""

    schedulers: list[Any] = field(default_factory=list)

    name = "chained"

    def _validate(self) -> None:
        self.schedulers = _check_children(self, self.schedulers)

    def _initial(self, lr: float) -> float:
        for child in self.schedulers:  # each one's construction step, in order, on the shared rate
            lr = child._initial(lr)
        self.steps, self.lr = 0, lr
        return lr

    def _advance(self, lr: float) -> float:
        for child in self.schedulers:
            lr = child._advance(lr)
        self.steps, self.lr = self.steps + 1, lr
        return lr

    for_group = SequentialLR.for_group
    _extra_state = SequentialLR._extra_state
    _load_extra_state = SequentialLR._load_extra_state
    config = SequentialLR.config
