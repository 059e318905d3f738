"""The epoch schedules torch computes recursively (its chainable `get_lr` forms): StepLR,
MultiStepLR, ExponentialLR, LinearLR, CosineLR (CosineAnnealingLR, optionally after a linear
warmup) and CosineAnnealingWarmRestarts. Each `_next` performs torch's float operations in
torch's order. Separate from the schedules that call user functions (lambdas.py), the batch
cycle (onecycle.py) and the metric-driven one (plateau.py).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from .base import Scheduler


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
