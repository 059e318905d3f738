"""Schedules written as Python functions, called on the host once per step: LambdaLR (the rate is
base_lr * f(step)) and MultiplicativeLR (each step multiplies the rate by f(step)), with one
function per parameter group when given a list. Separate because they carry callables, which
need their own validation, per-group selection and a JSON-safe config().
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from ...errors import ConfigError
from .base import Scheduler


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
