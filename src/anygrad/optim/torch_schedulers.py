"""A PyTorch LR scheduler as anygrad's: torch.optim.lr_scheduler objects -> GroupSchedule.

The conversion reads what the torch object holds: its class, its settings (attributes), the
optimizer's groups' `initial_lr` (torch's base_lrs), and where it stands (last_epoch, the current
rates, ReduceLROnPlateau's counters, a composite's children), so a scheduler already stepped
continues from the same position. Each group becomes one lane (see schedulers.GroupSchedule),
built by the entry of `CONVERTERS` for the torch class name. Nothing here imports torch: the
objects are read by attribute, so this module loads without it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .schedulers import (
    ChainedScheduler,
    CosineAnnealingWarmRestarts,
    CosineLR,
    ExponentialLR,
    GroupSchedule,
    LambdaLR,
    LinearLR,
    MultiplicativeLR,
    MultiStepLR,
    OneCycleLR,
    ReduceLROnPlateau,
    Scheduler,
    SequentialLR,
    StepLR,
)

# (torch scheduler, group index, the group's base_lr) -> that group's lane
Converter = Callable[[Any, int, float], Scheduler]


def _lambdas(ts: Any, g: int, base_lr: float, cls: type[Scheduler]) -> Scheduler:
    fns = list(ts.lr_lambdas)
    return cls(base_lr, lr_lambda=fns, group=g)


def _multistep(ts: Any, g: int, base_lr: float) -> Scheduler:
    ms = ts.milestones  # a Counter in torch (a milestone listed twice counts twice)
    milestones = sorted(ms.elements()) if hasattr(ms, "elements") else sorted(ms)
    return MultiStepLR(base_lr, milestones=milestones, gamma=ts.gamma)


def _round_trip(value: float, rebuild: Callable[[float], float], target: float) -> float:
    """A factor f with rebuild(f) == target bit for bit (torch stores the rates, not the factors):
    `value` or one of its float neighbours."""
    for candidate in (value, math.nextafter(value, math.inf), math.nextafter(value, -math.inf)):
        if rebuild(candidate) == target:
            return candidate
    return value


def _onecycle(ts: Any, g: int, base_lr: float) -> Scheduler:
    if getattr(ts, "cycle_momentum", False):
        raise ConfigError("OneCycleLR(cycle_momentum=True) also cycles the optimizer's momentum (beta1), "
                          "which anygrad does not; build the torch scheduler with cycle_momentum=False")
    group = ts.optimizer.param_groups[g]
    max_lr, initial, low = float(group["max_lr"]), float(group["initial_lr"]), float(group["min_lr"])
    phases = ts._schedule_phases
    n = int(ts.total_steps)
    div = _round_trip(max_lr / initial, lambda d: max_lr / d, initial)
    final = _round_trip(initial / low, lambda f: initial / f, low)
    pct = _round_trip((phases[0]["end_step"] + 1) / n, lambda p: float(p * n) - 1, phases[0]["end_step"])
    lane = OneCycleLR(base_lr, max_lr=max_lr, total_steps=n, pct_start=pct,
                      anneal_strategy=getattr(ts, "_anneal_func_type", "cos"), div_factor=div,
                      final_div_factor=final, three_phase=len(phases) == 3)
    # the phases exactly as torch holds them (its rates per group, its end steps)
    lane._phases = [(ph["end_step"], float(group[ph["start_lr"]]), float(group[ph["end_lr"]]))
                    for ph in phases]
    return lane


def _plateau(ts: Any, g: int, base_lr: float) -> Scheduler:
    return ReduceLROnPlateau(base_lr, mode=ts.mode, factor=ts.factor, patience=ts.patience,
                             threshold=ts.threshold, threshold_mode=ts.threshold_mode, cooldown=ts.cooldown,
                             min_lr=float(ts.min_lrs[g]), eps=ts.eps)


def _children(ts: Any, g: int, base_lr: float) -> list[Scheduler]:
    return [_lane(child, g, base_lr) for child in ts._schedulers]


CONVERTERS: dict[str, Converter] = {
    "LambdaLR": lambda ts, g, lr: _lambdas(ts, g, lr, LambdaLR),
    "MultiplicativeLR": lambda ts, g, lr: _lambdas(ts, g, lr, MultiplicativeLR),
    "StepLR": lambda ts, g, lr: StepLR(lr, step_size=ts.step_size, gamma=ts.gamma),
    "MultiStepLR": _multistep,
    "ExponentialLR": lambda ts, g, lr: ExponentialLR(lr, gamma=ts.gamma),
    "LinearLR": lambda ts, g, lr: LinearLR(lr, start_factor=ts.start_factor, end_factor=ts.end_factor,
                                           total_iters=ts.total_iters),
    "CosineAnnealingLR": lambda ts, g, lr: CosineLR(lr, T_max=ts.T_max, eta_min=ts.eta_min),
    "CosineAnnealingWarmRestarts": lambda ts, g, lr: CosineAnnealingWarmRestarts(
        lr, T_0=ts.T_0, T_mult=ts.T_mult, eta_min=ts.eta_min),
    "OneCycleLR": _onecycle,
    "ReduceLROnPlateau": _plateau,
    "SequentialLR": lambda ts, g, lr: SequentialLR(lr, schedulers=_children(ts, g, lr),
                                                   milestones=list(ts._milestones)),
    "ChainedScheduler": lambda ts, g, lr: ChainedScheduler(lr, schedulers=_children(ts, g, lr)),
}


def _kind(ts: Any) -> str:
    """The torch class this object is (or derives from, for a user's subclass of one)."""
    for cls in type(ts).__mro__:
        if cls.__name__ in CONVERTERS and cls.__module__.startswith("torch."):
            return cls.__name__
    raise ConfigError(f"anygrad.optim.from_torch: the scheduler {type(ts).__name__} is not one anygrad "
                      f"converts; supported: {', '.join(CONVERTERS)} (or pass compile(scheduler=) a function "
                      "step -> lr factor)")


def _position(lane: Scheduler, ts: Any, g: int) -> None:
    """Put `lane` where torch's `ts` stands for group g: its step count and current rate, and
    what else its class keeps (plateau's counters, a composite's children)."""
    kind = _kind(ts)
    if kind in ("SequentialLR", "ChainedScheduler"):
        for child_lane, child in zip(lane.schedulers, ts._schedulers):
            _position(child_lane, child, g)
        steps = ts.last_epoch if kind == "SequentialLR" else ts._schedulers[-1].last_epoch
    else:
        steps = ts.last_epoch
    if float(steps) != int(steps):
        raise ConfigError(f"anygrad.optim.from_torch: {kind} was stepped to epoch {steps}, a fraction; "
                          "anygrad schedules count whole steps")
    lane.steps = int(steps)
    if lane.steps >= 0:  # a SequentialLR child not started yet keeps torch's -1 and no rate of its own
        lane.lr = float(ts.get_last_lr()[g])
    if kind == "ReduceLROnPlateau":
        lane.best = float(ts.best)
        lane.num_bad_epochs = int(ts.num_bad_epochs)
        lane.cooldown_counter = int(ts.cooldown_counter)
        lane.lr = float(ts.optimizer.param_groups[g]["lr"])  # what its next reduction starts from


def _lane(ts: Any, g: int, base_lr: float) -> Scheduler:
    try:
        return CONVERTERS[_kind(ts)](ts, g, base_lr)
    except ConfigError as e:
        raise ConfigError(f"anygrad.optim.from_torch: {type(ts).__name__}: {e}") from None


def is_torch_scheduler(obj: Any) -> bool:
    """Whether `obj` is a torch LR scheduler (by its classes; torch is not imported)."""
    return any(c.__module__.startswith("torch.optim.lr_scheduler") for c in type(obj).__mro__)


def scheduler_from_torch(ts: Any, module: Any = None, interval: str | None = None) -> GroupSchedule:
    """anygrad's schedule for the torch LR scheduler `ts`: one lane per group of its optimizer,
    each from the group's `initial_lr`, at the position `ts` has reached. `module` (the model the
    optimizer trains) is not needed to convert a schedule; it is accepted for the same call as
    for optimizers. `interval`: "step" (per optimizer update, how per-step schedules such as
    transformers' get_*_schedule_with_warmup are stepped) or "epoch" (fit steps it per epoch);
    default "step", and "epoch" for ReduceLROnPlateau, which steps on the validation metric."""
    optimizer = getattr(ts, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        raise ConfigError(f"anygrad.optim.from_torch: {type(ts).__name__} has no optimizer with parameter "
                          "groups")
    _kind(ts)
    lanes = []
    for g, group in enumerate(groups):
        base_lr = float(group.get("initial_lr", group["lr"]))
        lane = _lane(ts, g, base_lr)
        _position(lane, ts, g)
        lanes.append(lane)
    default = "epoch" if lanes[0].needs_metric else "step"
    return GroupSchedule.build(GroupSchedule(lanes, default), [lane.base_lr for lane in lanes], interval)


__all__ = ["CONVERTERS", "is_torch_scheduler", "scheduler_from_torch"]
