"""The scheduler interface: RunFacts (what a training loop tells a scheduler about its run) and
Scheduler, the base class every schedule derives from (configuration as dataclass fields, running
state `steps` and `lr`, state_dict/config, the hooks a composite drives its children through),
with the option coercion all of them share. Separate because every other module of the package
builds on it and it holds no schedule of its own.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from ...coerce import ErrorBuilder, coerce_fields, to_float, to_int, to_lower_str
from ...errors import ConfigError

INTERVALS = ("epoch", "step")


# -- option coercion: config files and the CLI hand over strings and loose numbers ---------------
# Option words (mode, interval, anneal_strategy) are compared lower-cased: 'Max' is 'max'.
_BASE = {"str": (to_lower_str, "a string", "strings")}


def _option_error(scheduler: str) -> ErrorBuilder:
    """The error for an option value of the wrong type (by coerce.convert)."""
    return lambda option, what, value: ConfigError(
        f"scheduler '{scheduler}': option {option} must be {what}, got {value!r}")


# -- the interface ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunFacts:
    """What a training loop knows about the run a scheduler drives; it fills the options the user
    leaves unset (see Scheduler.run_defaults) and lets a scheduler reject a run it cannot cover
    before the first step (Scheduler.check_run)."""

    epochs: int
    updates_per_epoch: int  # optimizer updates per epoch (batches / accumulate, rounded up)
    mode: str = "min"       # direction of the monitored metric: "min" (losses) or "max" (accuracies)


@dataclass
class Scheduler:
    """Base class. Dataclass fields are the configuration; `steps` and `lr` the running state.

    `lr` is the learning rate for the next optimizer step: after construction the value for
    the first step (torch's value right after constructing the scheduler), after n calls of
    `step()` torch's value after n `scheduler.step()` calls.
    """

    base_lr: float
    interval: str = field(default="epoch", kw_only=True)

    name: ClassVar[str] = "scheduler"
    needs_metric: ClassVar[bool] = False

    def __post_init__(self) -> None:
        coerce_fields(self, _option_error(self.name), _BASE)
        self._require(self.interval in INTERVALS, f"interval must be one of {', '.join(INTERVALS)}, "
                      f"got {self.interval!r}")
        self._require(self.base_lr >= 0 and math.isfinite(self.base_lr),
                      f"base_lr must be a finite number >= 0, got {self.base_lr}")
        self._validate()
        self.reset()

    # -- subclass hooks -----------------------------------------------------------------
    @classmethod
    def run_defaults(cls, run: RunFacts, options: dict[str, Any]) -> dict[str, Any]:
        """Options taken from the run when `options` (the user's) do not set them."""
        return {}

    def check_run(self, run: RunFacts) -> None:
        """Raise ConfigError when this schedule cannot drive the whole of `run`."""

    def _validate(self) -> None:
        """Raise ConfigError (through `_require`) for option values torch would reject or
        that make the schedule meaningless."""

    def _next(self, lr: float, t: int) -> float:
        """torch's get_lr: the rate after the t-th step from the rate `lr` before it
        (t = 0 is the scheduler's construction, applied to base_lr)."""
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # -- how a composite (SequentialLR, ChainedScheduler) drives this one on a shared rate ----
    def _initial(self, lr: float) -> float:
        """torch's construction step applied to the shared rate `lr` (last_epoch becomes 0)."""
        self.steps = 0
        self.lr = self._next(lr, 0)
        return self.lr

    def _advance(self, lr: float) -> float:
        """torch's step(): the rate after one more step from the shared rate `lr`."""
        self.lr = self._next(lr, self.steps + 1)  # first, so that a refused step changes nothing
        self.steps += 1
        return self.lr

    def _restart(self, lr: float) -> float:
        """What SequentialLR does at this scheduler's milestone (torch's `_update_lr(0)`): the
        closed form at epoch 0 where torch has one (from base_lr), else get_lr at epoch 0."""
        self.steps = 0
        self.lr = self._next(self.base_lr, 0)
        return self.lr

    def for_group(self, index: int, base_lr: float) -> Scheduler:
        """This schedule for parameter group `index`, whose initial rate is `base_lr` (torch's
        base_lrs[index]), at the same position; `self` where nothing differs."""
        if index == 0 and base_lr == self.base_lr:
            return self
        if self.steps and self.needs_metric:
            raise ConfigError(f"scheduler '{self.name}' was already stepped with metrics, so it cannot be "
                              "spread over parameter groups; pass it before its first step")
        lane = dataclasses.replace(self, base_lr=base_lr)
        for _ in range(self.steps):
            lane.step()
        return lane

    # -- public API -------------------------------------------------------------------------
    def reset(self) -> None:
        """Back to the start of the schedule."""
        self._initial(self.base_lr)

    def step(self, metric: float | None = None) -> float:
        """Advance one epoch/batch (per `interval`); returns the rate for the next step.
        `metric` is only used by schedulers with `needs_metric` (reduce-on-plateau)."""
        return self._advance(self.lr)

    def lr_at(self, step: int) -> float:
        """The rate after `step` calls of step() from the start (replays the recursion, as
        torch would have computed it), without changing this scheduler."""
        step = self._check_step(step)
        if step == self.steps:
            return self.lr
        replay = copy.deepcopy(self)  # composites hold their children's state
        replay.reset()
        for _ in range(step):
            replay.step()
        return replay.lr

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable running state (the configuration is `config()`)."""
        return {"name": self.name, "steps": self.steps, "lr": self.lr, **self._extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ConfigError(f"scheduler '{self.name}': state must be a dict, got {type(state).__name__}")
        if state.get("name") != self.name:
            raise ConfigError(f"scheduler state is for '{state.get('name')}', not '{self.name}'; "
                              f"build the scheduler from the checkpoint's config")
        try:
            steps, lr = to_int(state["steps"]), to_float(state["lr"])
            self._load_extra_state(state)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"scheduler '{self.name}': corrupt state ({e!r}); "
                              f"expected the dict state_dict() returns") from None
        self.steps, self.lr = steps, lr

    def config(self) -> dict[str, Any]:
        """Name and options; `get_scheduler(**sched.config())` builds an equal scheduler."""
        return {"name": self.name, **asdict(self)}

    # -- helpers ------------------------------------------------------------------------------
    def _require(self, ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(f"scheduler '{self.name}': {message}")

    def _check_step(self, step: int) -> int:
        try:
            step = to_int(step)
        except (TypeError, ValueError):
            step = -1
        self._require(step >= 0, f"step must be an integer >= 0, got {step!r}")
        return step
