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

The package, by module: base (RunFacts, the Scheduler base class and its state), epoch (torch's
recursive epoch schedules: step, multistep, exponential, linear, cosine, cosine_restarts),
lambdas (LambdaLR, MultiplicativeLR: user functions), onecycle (OneCycleLR), plateau
(ReduceLROnPlateau: metric-driven), composite (SequentialLR, ChainedScheduler), group
(GroupSchedule: one lane per parameter group) and registry (the name table, get_scheduler).
"""
from __future__ import annotations

from .base import RunFacts, Scheduler
from .epoch import CosineAnnealingWarmRestarts, CosineLR, ExponentialLR, LinearLR, MultiStepLR, StepLR
from .lambdas import LambdaLR, MultiplicativeLR
from .onecycle import OneCycleLR
from .plateau import ReduceLROnPlateau
from .composite import ChainedScheduler, SequentialLR
from .group import GroupSchedule
from .registry import SCHEDULERS, check_options, get_scheduler

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
