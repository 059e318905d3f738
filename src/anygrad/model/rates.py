"""A Model's learning rates: the optimizer's parameter groups over its trainable parameters, each
group's rate (a host copy, and the device buffer the step programs read), and the schedule that
moves them.

Separate from the Model class because rates change between steps without a recompile: this is
the only place that writes the rate buffers, so the host copies and the device stay equal.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError
from ..optim.groups import resolve_groups as _resolve
from ..optim.schedulers import GroupSchedule

if TYPE_CHECKING:
    from .core import Model


def resolve_groups(model: Model, keep_rates: bool) -> None:
    """The optimizer's parameter groups over the trainable parameters (optim/groups.py); each
    group's rate starts at its base_lr, or (`keep_rates`, after a freeze) stays where it was."""
    g = model.graph
    before = model._group_lrs
    model.param_groups = _resolve(model.optimizer, g.params, {p: tuple(g.initializers[p].shape)
                                                              for p in g.params}, model.parameter_aliases())
    model._group_lrs = [before[i] if keep_rates and i < len(before) else grp.base_lr
                        for i, grp in enumerate(model.param_groups)]


def set_lr(model: Model, value: float) -> None:
    """The Model.lr setter: every group scaled by value / the first group's base_lr."""
    model.require_compiled()
    value = float(value)
    bases = [grp.base_lr for grp in model.param_groups]
    if len(bases) == 1 or bases[0] == 0:
        set_group_lrs(model, [value] * len(bases))
    else:
        set_group_lrs(model, [b * (value / bases[0]) for b in bases])
    model._group_lrs[0] = value  # exactly what was set (the scaling may round the first)


def set_group_lrs(model: Model, values: Iterable[float]) -> None:
    """The Model.group_lrs setter: check the rates, write the device buffers and the host copies."""
    backend = model.require_compiled()
    values = list(values)
    if len(values) != len(model.param_groups):
        raise ConfigError(f"group_lrs: {len(values)} rates for {len(model.param_groups)} parameter groups")
    for group, v in zip(model.param_groups, values):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not (np.isfinite(v) and v >= 0):
            raise ConfigError(f"group_lrs: the rate of {group.label} must be a finite number >= 0, got {v!r}")
    for group, v in zip(model.param_groups, values):
        backend.set_state(group.lr_state, np.array(v, np.float32))
    model._group_lrs = [float(v) for v in values]
    if len(values) == 1:
        model.optimizer.lr = model._group_lrs[0]  # the optimizer shows the rate, as before groups


def lr_states(model: Model) -> dict[str, np.ndarray]:
    """Each group's rate buffer as a checkpoint holds it (name -> float32 scalar)."""
    return {grp.lr_state: np.array(lr, np.float32) for grp, lr in zip(model.param_groups, model._group_lrs)}


def set_scheduler(model: Model, scheduler: Any, interval: str | None) -> GroupSchedule | None:
    """Model.set_scheduler: the schedule over every group's rate, its first rates written."""
    model.require_compiled()
    if scheduler is None:
        model.scheduler = None
        return None
    model.scheduler = GroupSchedule.build(scheduler, model.base_lrs, interval)
    set_group_lrs(model, model.scheduler.lrs)
    return model.scheduler


def step_scheduler(model: Model, metric: float | None = None) -> list[float]:
    """Model.step_scheduler: advance the schedule and write the rates it gives."""
    if model.scheduler is None:
        raise ConfigError("step_scheduler: this model has no schedule; compile(..., scheduler=...) first")
    set_group_lrs(model, model.scheduler.step(metric))
    return model.group_lrs


def after_update(model: Model) -> None:
    """A per-step schedule moves after each optimizer update (not after an accumulated
    micro-batch: with accumulate=k a step is k batches, as in PyTorch)."""
    if model.scheduler is not None and model.scheduler.interval == "step" and model.micro_step == 0:
        set_group_lrs(model, model.scheduler.step())
