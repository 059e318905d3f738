"""A Model's state as host arrays: its weights (parameters and buffers), the full device state a
checkpoint holds and restores bit for bit, a replica taking another Model's state, and the
fingerprint that tells whether a checkpoint fits this model.

Separate from the Model class because it is the boundary between the device's named state and
the host: what is saved, in which names, and what is checked when it is written back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError
from ..ir.passes import RNG_STATE
from .freezing import state_as_imported
from .metrics import metric_buffers

if TYPE_CHECKING:
    from .core import Model


def state_dict(model: Model) -> dict[str, np.ndarray]:
    """Parameters and buffers (running statistics) by graph name, as host arrays."""
    if model.backend is None:
        return {n: np.array(model.graph.initializers[n]) for n in model.graph.state_names}
    return {n: model.backend.get_state(n) if model.backend.has_state(n) else np.array(model.graph.initializers[n])
            for n in model.graph.state_names}


def full_state(model: Model) -> dict[str, np.ndarray]:
    """Model.full_state: every persistent device state by name."""
    backend = model.require_compiled()
    names = set(model.graph.state_names) | {RNG_STATE} | {g.lr_state for g in model.param_groups}
    for exe in model._programs.values():
        names.update(exe.graph.state_names)
    names.update(metric_buffers(model))
    return {n: backend.get_state(n) for n in sorted(names) if backend.has_state(n)}


def load_full_state(model: Model, state: dict[str, np.ndarray]) -> None:
    """Model.load_full_state: write a full_state() back, checking the model's state is all there."""
    backend = model.require_compiled()
    for name in model.graph.state_names:
        if name not in state:
            raise ConfigError(f"the saved state lacks '{name}' of this model")
    for name, value in state.items():
        info = model.graph.info.get(name)
        if info is not None and name in model.graph.state_names and tuple(info.shape) != tuple(value.shape):
            raise ConfigError(f"saved '{name}' has shape {tuple(value.shape)}, the model's is {tuple(info.shape)}")
        backend.set_state(name, np.asarray(value))
    for i, group in enumerate(model.param_groups):  # else keep the host's exact value (0.002, not its float32)
        if group.lr_state in state and np.float32(model._group_lrs[i]) != np.float32(state[group.lr_state]):
            model._group_lrs[i] = float(state[group.lr_state])
    if len(model.param_groups) == 1:
        model.optimizer.lr = model._group_lrs[0]
    model.strategy.state_loaded(model)


def take_state(model: Model, source: Model) -> None:
    """Model.take_state: `model`'s backend takes `source`'s full state and learning rates."""
    state = full_state(source)
    for name in source.graph.state_names:
        state.setdefault(name, source.graph.initializers[name])
    for name, value in state.items():
        model.backend.set_state(name, value)
    model.optimizer.lr = source.optimizer.lr
    model._group_lrs = source.group_lrs


def fingerprint(model: Model) -> str:
    """Model.fingerprint: a hash of the graph's structure and its state's names, shapes, dtypes."""
    import hashlib
    import json
    g = model.graph
    desc = {"inputs": list(g.inputs), "outputs": list(g.outputs),
            "nodes": [[n.op, list(n.inputs), list(n.outputs)] for n in g.nodes],
            "state": [[n, str(np.asarray(g.initializers[n]).dtype), list(np.shape(g.initializers[n]))]
                      for n in state_as_imported(model)]}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
