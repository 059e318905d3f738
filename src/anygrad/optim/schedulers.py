"""Learning-rate schedulers that reproduce torch.optim.lr_scheduler value for value.

A scheduler is a small pure-Python object, independent of any backend: it holds the learning
rate to use for the next optimizer step (`.lr`) and advances with `step(metric=None)`. The
trainer copies the value into the model (`model.lr = sched.step()`, a device-buffer write, no
recompile), once per epoch or once per batch as `interval` says.

PyTorch computes most schedules recursively (each value from the previous one, e.g.
CosineAnnealingLR's ratio-of-cosines update), which differs from the closed form in the last
bits. Every `_next` here performs the same float operations in the same order as torch's
`get_lr`, so the sequences agree exactly in float64, and `state_dict()` keeps the current value
itself (not just the step count) so a resumed run continues the very same sequence.

Usage:
    sched = get_scheduler("cosine", base_lr=0.1, T_max=50, warmup_steps=5)
    model.lr = sched.lr                  # value for the first step
    for epoch in range(50):
        ...train one epoch...
        model.lr = sched.step(val_loss)  # the metric is only read by "plateau"
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from ..coerce import ErrorBuilder, coerce_fields, convert, to_float, to_int, to_lower_str
from ..errors import ConfigError

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


# -- epoch schedules (torch's chainable forms) --------------------------------------------------------
@dataclass
class StepLR(Scheduler):
    """torch.optim.lr_scheduler.StepLR: multiply by gamma every step_size epochs."""

    step_size: int | None = None
    gamma: float = 0.1

    name = "step"

    def _validate(self) -> None:
        self._require(self.step_size is not None, "needs step_size (decay every step_size epochs)")
        self._require(self.step_size >= 1, f"step_size must be >= 1, got {self.step_size}")
        self._require(self.gamma > 0, f"gamma must be > 0, got {self.gamma}")

    def _next(self, lr: float, t: int) -> float:
        if t == 0 or t % self.step_size != 0:
            return lr
        return lr * self.gamma


@dataclass
class MultiStepLR(Scheduler):
    """torch.optim.lr_scheduler.MultiStepLR: multiply by gamma at each milestone epoch
    (by gamma**n at a milestone listed n times)."""

    milestones: list[int] = field(default_factory=list)
    gamma: float = 0.1

    name = "multistep"

    def _validate(self) -> None:
        self._require(len(self.milestones) > 0, "milestones must list at least one epoch, e.g. [30, 60]")
        self._require(all(m >= 0 for m in self.milestones),
                      f"milestones must be epochs >= 0, got {self.milestones}")
        self._require(self.gamma > 0, f"gamma must be > 0, got {self.gamma}")
        self.milestones = sorted(self.milestones)
        self._counts = Counter(self.milestones)

    def _next(self, lr: float, t: int) -> float:
        if t not in self._counts:
            return lr
        return lr * self.gamma ** self._counts[t]


@dataclass
class ExponentialLR(Scheduler):
    """torch.optim.lr_scheduler.ExponentialLR: multiply by gamma every epoch."""

    gamma: float | None = None

    name = "exponential"

    def _validate(self) -> None:
        self._require(self.gamma is not None, "needs gamma (the factor per epoch, e.g. 0.95)")
        self._require(self.gamma > 0, f"gamma must be > 0, got {self.gamma}")

    def _next(self, lr: float, t: int) -> float:
        return lr if t == 0 else lr * self.gamma


def _linear_next(lr: float, t: int, start: float, end: float, total: int) -> float:
    """LinearLR.get_lr."""
    if t == 0:
        return lr * start
    if t > total:
        return lr
    return lr * (1.0 + (end - start) / (total * start + (t - 1) * (end - start)))


def _cosine_next(lr: float, t: int, base_lr: float, eta_min: float, T_max: int) -> float:
    """CosineAnnealingLR.get_lr (t >= 1): the recursive update, with torch's special case where
    the previous cosine term is -1 and the ratio would divide by zero."""
    if (t - 1 - T_max) % (2 * T_max) == 0:
        return lr + (base_lr - eta_min) * (1 - math.cos(math.pi / T_max)) / 2
    return ((1 + math.cos(math.pi * t / T_max)) / (1 + math.cos(math.pi * (t - 1) / T_max))
            * (lr - eta_min) + eta_min)


@dataclass
class LinearLR(Scheduler):
    """torch.optim.lr_scheduler.LinearLR: scale base_lr by a factor moving linearly from
    start_factor to end_factor over total_iters epochs (a linear warmup with the defaults)."""

    start_factor: float = 1.0 / 3
    end_factor: float = 1.0
    total_iters: int = 5

    name = "linear"

    def _validate(self) -> None:
        self._require(0 < self.start_factor <= 1, f"start_factor must be in (0, 1], got {self.start_factor}")
        self._require(0 <= self.end_factor <= 1, f"end_factor must be in [0, 1], got {self.end_factor}")
        self._require(self.total_iters >= 1, f"total_iters must be >= 1, got {self.total_iters}")

    def _next(self, lr: float, t: int) -> float:
        return _linear_next(lr, t, self.start_factor, self.end_factor, self.total_iters)


@dataclass
class CosineLR(Scheduler):
    """torch.optim.lr_scheduler.CosineAnnealingLR over T_max epochs down to eta_min.

    With warmup_steps > 0 it is SequentialLR([LinearLR(start_factor=warmup_start_factor,
    total_iters=warmup_steps), CosineAnnealingLR(T_max, eta_min)], milestones=[warmup_steps]):
    a linear warmup, then a cosine phase of T_max epochs (T_max does not include the warmup).
    Past T_max the rate rises again, as torch's does (cosine without restarts).
    """

    T_max: int | None = None
    eta_min: float = 0.0
    warmup_steps: int = 0
    warmup_start_factor: float = 1.0 / 3

    name = "cosine"

    def _validate(self) -> None:
        self._require(self.T_max is not None, "needs T_max (the length of the cosine phase in epochs, "
                      "usually the number of epochs minus warmup_steps)")
        self._require(self.T_max >= 1, f"T_max must be >= 1, got {self.T_max}")
        self._require(self.eta_min >= 0, f"eta_min must be >= 0, got {self.eta_min}")
        self._require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        self._require(0 < self.warmup_start_factor <= 1,
                      f"warmup_start_factor must be in (0, 1], got {self.warmup_start_factor}")

    def _next(self, lr: float, t: int) -> float:
        w = self.warmup_steps
        if w == 0:
            return lr if t == 0 else _cosine_next(lr, t, self.base_lr, self.eta_min, self.T_max)
        if t < w:
            return _linear_next(lr, t, self.warmup_start_factor, 1.0, w)
        if t == w:  # SequentialLR restarts the cosine scheduler with its closed form at epoch 0
            return self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * 0 / self.T_max)) / 2
        return _cosine_next(lr, t - w, self.base_lr, self.eta_min, self.T_max)

    def _restart(self, lr: float) -> float:
        if self.warmup_steps:
            return super()._restart(lr)
        self.steps = 0  # CosineAnnealingLR._get_closed_form_lr at epoch 0
        self.lr = self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * 0 / self.T_max)) / 2
        return self.lr


@dataclass
class CosineAnnealingWarmRestarts(Scheduler):
    """torch.optim.lr_scheduler.CosineAnnealingWarmRestarts (SGDR): a cosine from base_lr down to
    eta_min over T_0 steps, then again over T_0 * T_mult, T_0 * T_mult**2, ... (integer steps)."""

    T_0: int | None = None
    T_mult: int = 1
    eta_min: float = 0.0

    name = "cosine_restarts"

    def _validate(self) -> None:
        self._require(self.T_0 is not None, "needs T_0 (the length of the first cosine cycle)")
        self._require(self.T_0 >= 1, f"T_0 must be >= 1, got {self.T_0}")
        self._require(self.T_mult >= 1, f"T_mult must be an integer >= 1, got {self.T_mult}")

    def _cycle(self, t: int) -> tuple[int, int]:
        """(T_cur, T_i) after t steps: torch's recursion, in exact integers."""
        t_cur, t_i = t, self.T_0
        while t_cur >= t_i:
            t_cur, t_i = t_cur - t_i, t_i * self.T_mult
        return t_cur, t_i

    def _next(self, lr: float, t: int) -> float:
        t_cur, t_i = self._cycle(t)
        return self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * t_cur / t_i)) / 2


# -- schedules written as Python functions (called on the host, once per step) ---------------------
def _check_lambdas(sched: Scheduler, option: str) -> None:
    """lr_lambda: one function step -> factor, or a list of them (one per parameter group)."""
    fns = sched.lr_lambda if isinstance(sched.lr_lambda, (list, tuple)) else [sched.lr_lambda]
    sched._require(len(fns) > 0 and all(callable(f) for f in fns),
                   f"{option} must be a function of the step returning a factor (e.g. lambda step: "
                   f"0.95 ** step), or a list of them, one per parameter group; got {sched.lr_lambda!r}")
    sched._require(isinstance(sched.group, int) and 0 <= sched.group < len(fns),
                   f"group {sched.group!r} has no function among the {len(fns)} lr_lambda functions")


def _factor(sched: Scheduler, t: int) -> float:
    fns = sched.lr_lambda if isinstance(sched.lr_lambda, (list, tuple)) else [sched.lr_lambda]
    value = fns[sched.group](t)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"scheduler '{sched.name}': lr_lambda({t}) returned {value!r}, "
                          "not a number") from None


def _lambda_for_group(sched: Scheduler, index: int, base_lr: float) -> Scheduler:
    """A list of functions gives group `index` its own one (torch's lr_lambdas[index])."""
    if not isinstance(sched.lr_lambda, (list, tuple)) or index == sched.group:
        return Scheduler.for_group(sched, index, base_lr)
    lane = dataclasses.replace(sched, base_lr=base_lr, group=index)
    for _ in range(sched.steps):
        lane.step()
    return lane


def _lambda_config(sched: Scheduler) -> dict[str, Any]:
    """config() with the functions by name (config.json is JSON)."""
    fns = sched.lr_lambda if isinstance(sched.lr_lambda, (list, tuple)) else [sched.lr_lambda]
    names = [getattr(getattr(f, "func", f), "__qualname__", repr(f)) for f in fns]
    cfg = {f.name: getattr(sched, f.name) for f in fields(sched)}
    several = isinstance(sched.lr_lambda, (list, tuple))
    return {"name": sched.name, **cfg, "lr_lambda": names if several else names[0]}


@dataclass
class LambdaLR(Scheduler):
    """torch.optim.lr_scheduler.LambdaLR: the rate after t steps is base_lr * lr_lambda(t).
    `lr_lambda` may be a list with one function per parameter group (`group` picks this lane's)."""

    lr_lambda: Any = None
    group: int = 0
    interval: str = field(default="step", kw_only=True)

    name = "lambda"

    def _validate(self) -> None:
        _check_lambdas(self, "lr_lambda")

    def _next(self, lr: float, t: int) -> float:
        return self.base_lr * _factor(self, t)

    def _restart(self, lr: float) -> float:
        return self._initial(lr)

    def for_group(self, index: int, base_lr: float) -> Scheduler:
        return _lambda_for_group(self, index, base_lr)

    def config(self) -> dict[str, Any]:
        return _lambda_config(self)


@dataclass
class MultiplicativeLR(Scheduler):
    """torch.optim.lr_scheduler.MultiplicativeLR: each step multiplies the rate by lr_lambda(t)."""

    lr_lambda: Any = None
    group: int = 0

    name = "multiplicative"

    def _validate(self) -> None:
        _check_lambdas(self, "lr_lambda")

    def _next(self, lr: float, t: int) -> float:
        return lr if t == 0 else lr * _factor(self, t)

    def _restart(self, lr: float) -> float:
        self.steps = 0  # no closed form: get_lr at epoch 0 outside the construction step
        self.lr = lr * _factor(self, 0)
        return self.lr

    def for_group(self, index: int, base_lr: float) -> Scheduler:
        return _lambda_for_group(self, index, base_lr)

    def config(self) -> dict[str, Any]:
        return _lambda_config(self)


# -- batch schedule (closed form) -------------------------------------------------------------------
_ANNEAL: dict[str, Callable[[float, float, float], float]] = {
    # OneCycleLR._annealing_cos / _annealing_linear, operation for operation.
    "cos": lambda start, end, pct: end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1),
    "linear": lambda start, end, pct: (end - start) * pct + start,
}


@dataclass
class OneCycleLR(Scheduler):
    """torch.optim.lr_scheduler.OneCycleLR (learning rate only; momentum is not cycled).

    Warms up from max_lr/div_factor to max_lr over pct_start of total_steps, then anneals to
    max_lr/div_factor/final_div_factor (three_phase: back down to the initial rate first).
    max_lr defaults to base_lr; total_steps may be given as epochs * steps_per_epoch. In a training
    run (get_scheduler(..., run=...)) options left unset span the run: total_steps = its epochs x
    its optimizer updates per epoch. Note the first rate is max_lr/div_factor, so set
    `model.lr = sched.lr` before training.
    """

    max_lr: float | None = None
    total_steps: int | None = None
    epochs: int | None = None
    steps_per_epoch: int | None = None
    pct_start: float = 0.3
    anneal_strategy: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False
    interval: str = field(default="step", kw_only=True)

    name = "onecycle"

    @classmethod
    def run_defaults(cls, run: RunFacts, options: dict[str, Any]) -> dict[str, Any]:
        # Without a length of its own, the cycle spans the run: its epochs, each of its optimizer
        # updates a step (interval "step"), or each epoch one (interval "epoch").
        if options.get("total_steps") is not None:
            return {}
        per_step = to_lower_str(options.get("interval", "step")) == "step"
        return {"epochs": run.epochs, "steps_per_epoch": run.updates_per_epoch if per_step else 1}

    def check_run(self, run: RunFacts) -> None:
        needed = run.epochs * (run.updates_per_epoch if self.interval == "step" else 1)
        what = "optimizer updates" if self.interval == "step" else "epochs"
        self._require(self.total_steps >= needed,
                      f"the run takes {needed} {what} ({run.epochs} epochs"
                      + (f" x {run.updates_per_epoch} updates" if self.interval == "step" else "")
                      + f") but the cycle has only total_steps={self.total_steps}; raise total_steps (or epochs, "
                      "steps_per_epoch), or leave all three unset and the cycle spans the run")

    def _validate(self) -> None:
        if self.max_lr is None:
            self.max_lr = self.base_lr
        self._require(self.max_lr > 0 and math.isfinite(self.max_lr), f"max_lr must be > 0, got {self.max_lr}")
        if self.total_steps is None:
            self._require(self.epochs is not None and self.steps_per_epoch is not None,
                          "give total_steps, or epochs and steps_per_epoch")
            self._require(self.epochs >= 1 and self.steps_per_epoch >= 1,
                          f"epochs and steps_per_epoch must be >= 1, got {self.epochs} and {self.steps_per_epoch}")
            self.total_steps = self.epochs * self.steps_per_epoch
        self._require(self.total_steps >= 1, f"total_steps must be >= 1, got {self.total_steps}")
        self._require(0 <= self.pct_start <= 1, f"pct_start must be in [0, 1], got {self.pct_start}")
        self._require(self.anneal_strategy in _ANNEAL,
                      f"anneal_strategy must be one of {', '.join(_ANNEAL)}, got {self.anneal_strategy!r}")
        self._require(self.div_factor > 0 and self.final_div_factor > 0,
                      f"div_factor and final_div_factor must be > 0, got {self.div_factor} and "
                      f"{self.final_div_factor}")
        initial = self.max_lr / self.div_factor
        rates = {"initial_lr": initial, "max_lr": self.max_lr, "min_lr": initial / self.final_div_factor}
        n = self.total_steps
        if self.three_phase:
            table = [(float(self.pct_start * n) - 1, "initial_lr", "max_lr"),
                     (float(2 * self.pct_start * n) - 2, "max_lr", "initial_lr"),
                     (n - 1, "initial_lr", "min_lr")]
        else:
            table = [(float(self.pct_start * n) - 1, "initial_lr", "max_lr"),
                     (n - 1, "max_lr", "min_lr")]
        self._phases = [(end, rates[a], rates[b]) for end, a, b in table]
        # torch divides by the phase length: a zero-length phase it reaches is a ZeroDivisionError there.
        self._require(self._phases[0][0] != 0 and self._phases[-1][0] != self._phases[-2][0],
                      f"pct_start={self.pct_start} with total_steps={n} leaves a phase of zero length; "
                      f"change pct_start or total_steps")

    def _rate(self, t: int) -> float:
        """OneCycleLR.get_lr at last_epoch = t."""
        start_step = 0.0
        for i, (end_step, start_lr, end_lr) in enumerate(self._phases):
            if t <= end_step or i == len(self._phases) - 1:
                pct = (t - start_step) / (end_step - start_step)
                return _ANNEAL[self.anneal_strategy](start_lr, end_lr, pct)
            start_step = end_step
        raise AssertionError("unreachable")

    def _check_step(self, step: int) -> int:
        step = super()._check_step(step)
        self._require(step <= self.total_steps,
                      f"stepped {step} times but total_steps is {self.total_steps}; raise total_steps "
                      f"(or epochs) to cover the whole run")
        return step

    def _next(self, lr: float, t: int) -> float:
        return self._rate(self._check_step(t))

    def lr_at(self, step: int) -> float:
        return self._rate(self._check_step(step))


# -- metric-driven schedule ---------------------------------------------------------------------------
_IS_BETTER: dict[tuple[str, str], Callable[[float, float, float], bool]] = {
    # ReduceLROnPlateau._is_better, by (mode, threshold_mode).
    ("min", "rel"): lambda a, best, th: a < best * (1.0 - th),
    ("min", "abs"): lambda a, best, th: a < best - th,
    ("max", "rel"): lambda a, best, th: a > best * (th + 1.0),
    ("max", "abs"): lambda a, best, th: a > best + th,
}


@dataclass
class ReduceLROnPlateau(Scheduler):
    """torch.optim.lr_scheduler.ReduceLROnPlateau: multiply by factor when the metric passed to
    step() has not improved (mode "min": decreased, "max": increased) for more than patience
    epochs; then wait cooldown epochs; never below min_lr, and skip reductions smaller than eps.
    """

    mode: str = "min"
    factor: float = 0.1
    patience: int = 10
    threshold: float = 1e-4
    threshold_mode: str = "rel"
    cooldown: int = 0
    min_lr: float = 0.0
    eps: float = 1e-8

    name = "plateau"
    needs_metric = True

    @classmethod
    def run_defaults(cls, run: RunFacts, options: dict[str, Any]) -> dict[str, Any]:
        # The metric it is fed is the run's monitored one: an accuracy must rise, a loss fall.
        return {"mode": run.mode}

    def _validate(self) -> None:
        self._require(self.mode in ("min", "max"), f"mode must be 'min' or 'max', got {self.mode!r}")
        self._require(self.threshold_mode in ("rel", "abs"),
                      f"threshold_mode must be 'rel' or 'abs', got {self.threshold_mode!r}")
        self._require(0 < self.factor < 1, f"factor must be in (0, 1), got {self.factor}")
        self._require(self.patience >= 0, f"patience must be >= 0, got {self.patience}")
        self._require(self.cooldown >= 0, f"cooldown must be >= 0, got {self.cooldown}")
        self._require(self.threshold >= 0, f"threshold must be >= 0, got {self.threshold}")
        self._require(self.min_lr >= 0, f"min_lr must be >= 0, got {self.min_lr}")
        self._require(self.eps >= 0, f"eps must be >= 0, got {self.eps}")

    @property
    def _worse(self) -> float:
        return math.inf if self.mode == "min" else -math.inf

    def reset(self) -> None:
        self.steps = 0
        self.lr = self.base_lr
        self.best = self._worse
        self.num_bad_epochs = 0
        self.cooldown_counter = 0

    def step(self, metric: float | None = None) -> float:
        if metric is None:
            raise ConfigError("scheduler 'plateau' needs the monitored metric: call step(metric), "
                              "e.g. step(validation_loss)")
        try:
            current = float(metric)
        except (TypeError, ValueError):
            raise ConfigError(f"scheduler 'plateau': metric must be a number, got {metric!r}") from None
        self.steps += 1
        if _IS_BETTER[self.mode, self.threshold_mode](current, self.best, self.threshold):
            self.best = current
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0  # bad epochs during the cooldown do not count
        if self.num_bad_epochs > self.patience:
            new_lr = max(self.lr * self.factor, self.min_lr)
            if self.lr - new_lr > self.eps:
                self.lr = new_lr
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        return self.lr

    def lr_at(self, step: int) -> float:
        raise ConfigError("scheduler 'plateau' depends on the metrics it is fed, so it has no "
                          "rate for an arbitrary step; read .lr after step(metric)")

    def _extra_state(self) -> dict[str, Any]:
        # None stands for "no best yet" (±inf), which strict JSON cannot hold.
        best = None if math.isinf(self.best) else self.best
        return {"best": best, "num_bad_epochs": self.num_bad_epochs, "cooldown_counter": self.cooldown_counter}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        best = state["best"]
        self.best = self._worse if best is None else to_float(best)
        self.num_bad_epochs = to_int(state["num_bad_epochs"])
        self.cooldown_counter = to_int(state["cooldown_counter"])


# -- composites: schedulers on one shared rate, as torch's drive one optimizer ------------------------
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


# -- what a compiled model runs: one lane per parameter group -------------------------------------------
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


# -- the name table ------------------------------------------------------------------------------------
SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (StepLR, MultiStepLR, ExponentialLR, CosineLR, LinearLR, OneCycleLR,
                              ReduceLROnPlateau, CosineAnnealingWarmRestarts, LambdaLR, MultiplicativeLR,
                              SequentialLR, ChainedScheduler)
}

# Other spellings people use (compared after dropping '-', '_' and spaces, lower-cased).
_ALIASES: dict[str, str] = {
    "steplr": "step", "multisteplr": "multistep", "exp": "exponential", "exponentiallr": "exponential",
    "cosineannealing": "cosine", "cosineannealinglr": "cosine", "linearlr": "linear", "warmup": "linear",
    "linearwarmup": "linear", "onecyclelr": "onecycle", "reduceonplateau": "plateau",
    "reducelronplateau": "plateau", "cosineannealingwarmrestarts": "cosine_restarts",
    "cosinerestarts": "cosine_restarts", "sgdr": "cosine_restarts", "lambdalr": "lambda",
    "multiplicativelr": "multiplicative", "sequentiallr": "sequential", "chainedscheduler": "chained",
}


def _canonical(name: str) -> str:
    key = "".join(c for c in str(name).lower() if c not in "-_ ")
    return _ALIASES.get(key, key)


def check_options(name: str, options: dict[str, Any]) -> type[Scheduler]:
    """The scheduler class for `name`, after checking that it takes each of `options` and that
    each value has the option's type (ranges and run-dependent checks come when it is built)."""
    key = _canonical(name)
    if key not in SCHEDULERS:
        raise ConfigError(f"unknown learning-rate scheduler '{name}'; choose one of {', '.join(SCHEDULERS)}")
    cls = SCHEDULERS[key]
    types = {f.name: str(f.type) for f in fields(cls) if f.name != "base_lr"}
    unknown = sorted(set(options) - set(types))
    if unknown:
        raise ConfigError(f"scheduler '{key}' does not take option(s) {', '.join(unknown)}; "
                          f"its options are {', '.join(sorted(types))}")
    for option, value in options.items():
        convert(option, types[option], value, _option_error(key), _BASE)
    return cls


def get_scheduler(name: str, base_lr: float, *, run: RunFacts | None = None, **options: Any) -> Scheduler:
    """A scheduler by CLI/config name ("step", "multistep", "exponential", "cosine", "linear",
    "onecycle", "plateau") with torch.optim.lr_scheduler's option names. With `run` (what the
    training loop knows), options left unset are taken from the run (plateau's mode from the
    monitored metric, onecycle's length) and a schedule too short for the run is an error now."""
    cls = check_options(name, options)
    if run is not None:
        options = {**cls.run_defaults(run, options), **options}
    scheduler = cls(base_lr, **options)
    if run is not None:
        scheduler.check_run(run)
    return scheduler


__all__ = [
    "SCHEDULERS",
    "ChainedScheduler",
    "CosineAnnealingWarmRestarts",
    "CosineLR",
    "ExponentialLR",
    "GroupSchedule",
    "LambdaLR",
    "LinearLR",
    "MultiStepLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "ReduceLROnPlateau",
    "RunFacts",
    "Scheduler",
    "SequentialLR",
    "StepLR",
    "check_options",
    "get_scheduler",
]
