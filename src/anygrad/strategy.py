"""Training strategies: how a Model's training steps reach its devices.

A strategy drives a compiled Model through the Model's public methods (train_program,
next_phase, update_program, metric_buffers, replica). The Model keeps one (`model.strategy`)
and hands it every training step and metric read; it never knows which one it holds.

- SingleDevice (the default): the model's one backend runs each step program whole.
- anygrad.distributed.DataParallel: the batch shared by several devices of this process and by
  the ranks of a torch.distributed job. That package registers it here as the strategy for
  several devices (register_several_devices), so that `compile(device="wgpu:0,wgpu:1")` gets
  it without the Model importing the layer above it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .batch import Batch
from .errors import ConfigError


class TrainStrategy(Protocol):
    """What a Model asks of its strategy. `model` is the Model that holds it."""

    world_size: int   # processes sharing each global batch (1: not distributed)
    is_writer: bool   # whether this process writes artifacts (rank 0)

    def train_step(self, model: Any, inputs: Batch, targets: Batch, flush: bool,
                   fetch_loss: bool) -> float | None:
        """One micro-batch (an update every `accumulate`, or at `flush`); the batch's mean loss
        before the update with `fetch_loss`, else None and no readback."""

    def metric_sums(self, model: Any, names: Sequence[str]) -> dict[str, float]:
        """The metric buffers `names` summed over every device the strategy trains on."""

    def reset_metrics(self, model: Any, names: Sequence[str]) -> None:
        """Zero the metric buffers `names` everywhere."""

    def state_loaded(self, model: Any) -> None:
        """The model's state was overwritten (load_full_state): devices besides its own take it."""

    def agree(self, flag: bool) -> bool:
        """Whether any process raised `flag` (every process calls it at the same step)."""


class SingleDevice:
    """The model's own backend runs each training step program whole."""

    world_size = 1
    is_writer = True

    def train_step(self, model: Any, inputs: Batch, targets: Batch, flush: bool,
                   fetch_loss: bool) -> float | None:
        exe = model.train_program(inputs, targets, model.next_phase(flush))
        loss = exe.graph.outputs[0]
        out = exe.run({**inputs, **targets}, fetch=[loss] if fetch_loss else [])
        return float(out[loss]) if fetch_loss else None

    def metric_sums(self, model: Any, names: Sequence[str]) -> dict[str, float]:
        backend = model.require_compiled()
        return {k: float(backend.get_state(k)) for k in names}

    def reset_metrics(self, model: Any, names: Sequence[str]) -> None:
        backend = model.require_compiled()
        for name in names:
            backend.set_state(name, np.zeros((), np.float32))

    def state_loaded(self, model: Any) -> None:
        return None

    def agree(self, flag: bool) -> bool:
        return flag


# Several devices: a factory (model, backends) -> TrainStrategy, which anygrad.distributed registers.
_several_devices: list[Callable[[Any, list], TrainStrategy]] = []


def register_several_devices(factory: Callable[[Any, list], TrainStrategy]) -> None:
    """The strategy compile() gives a model compiled for several devices (the last registered)."""
    _several_devices.append(factory)


def for_devices(model: Any, backends: list) -> TrainStrategy:
    """SingleDevice for one backend; for several, the registered strategy (DataParallel)."""
    if len(backends) == 1:
        return SingleDevice()
    if not _several_devices:
        raise ConfigError("training on several devices needs anygrad.distributed: import it first "
                          "(import anygrad does)")
    return _several_devices[-1](model, list(backends))
