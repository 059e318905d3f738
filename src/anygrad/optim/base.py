"""The optimizer interface: an optimizer turns (param, grad, state) into Graph nodes.

State tensors (momentum buffers, accumulators) become graph buffers named
`optim.<slot>.<param>`, so they live on the device, are updated in place by the step, and are
saved in checkpoints like any other state. The learning rate and the step count are graph
buffers too (groups.LR_STATE, STEP_STATE), so a scheduler changes the rate without recompiling.
Parameter groups (`param_groups`, optim/groups.py) give each group its own settings and rate.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError, ShapeError
from ..ir.builder import Builder
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from .groups import as_group

STEP_STATE = "anygrad.step"  # optimizer steps taken before this one, float32 scalar


@dataclass
class Optimizer(ABC):
    lr: float
    # torch.optim's groups: [{"params": glob | [globs] | (name, shape) -> bool, setting: value}, ...]
    # (keyword-only, so the settings keep their positions); see optim/groups.py.
    param_groups: list = field(default_factory=list, kw_only=True)

    name = "optimizer"

    @abstractmethod
    def init_state(self, param: np.ndarray) -> dict[str, np.ndarray]:
        """Initial state for one parameter, keyed by slot name ({} when stateless)."""

    @abstractmethod
    def update(self, b: Builder, param: str, grad: str, state: dict[str, str], lr: str, step: str
               ) -> tuple[str, dict[str, str]]:
        """Emit the update; return (new param value, {slot: new state value}). `step` is the
        1-based index of this update (float32 scalar value), `lr` the current learning rate."""

    def settings(self) -> dict[str, Any]:
        """The hyperparameters by name (lr included, the groups not)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "param_groups"}

    def config(self) -> dict:
        """Name and settings as JSON (config.json); a group's predicate appears by its name."""
        settings = self.settings()
        groups = [as_group(e, i) for i, e in enumerate(self.param_groups)]
        return {"name": self.name, **settings,
                **({"param_groups": [{"params": g.describe(), **({"name": g.name} if g.name else {}),
                                       **g.options} for g in groups]} if groups else {})}


# -- optimizers whose whole update is one elementwise op ----------------------------------------
SlotsFn = Callable[[dict], list[str]]
KernelFn = Callable[[dict, np.ndarray, np.ndarray, dict, float, float], tuple[np.ndarray, dict]]


def defupdate(op: str, slots: SlotsFn, kernel: KernelFn) -> None:
    """Register `op(param, grad, *slots, lr, step) -> (param', *slots')` as an internal op.

    `slots(attrs)` names the state tensors the hyperparameters need, in input order; the numpy
    kernel(attrs, param, grad, {slot: array}, lr, step) returns (param', {slot: array'}). The
    update is elementwise, so a backend can run all parameters' updates as one fused kernel.
    """
    def infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
        n = len(slots(node.attrs))
        if len(ins) != n + 4:
            raise ShapeError(f"{node.label}: expects param, grad, {n} state tensor(s), lr, step")
        for i, inf in enumerate(ins[1:n + 2], 1):
            if tuple(inf.shape) != tuple(ins[0].shape):
                raise ShapeError(f"{node.label}: input {i} has shape {tuple(inf.shape)}, "
                                 f"the parameter {tuple(ins[0].shape)}")
        return [TensorInfo(ins[0].dtype, ins[0].shape) for _ in range(n + 1)]

    def forward(node: Node, ins: list[np.ndarray]) -> list[np.ndarray]:
        names = slots(node.attrs)
        param, grad, lr, step = ins[0], ins[1], ins[-2], ins[-1]
        state = dict(zip(names, ins[2:2 + len(names)]))
        # Scalars as Python floats, tensors in float32: the arithmetic PyTorch's optimizers do.
        new_param, new_state = kernel(node.attrs, param, grad, state, float(lr), float(step))
        return [np.asarray(new_param, param.dtype)] + [np.asarray(new_state[s], param.dtype) for s in names]

    defop(op, infer=infer, forward=forward, internal=True, foldable=False)


@dataclass
class ElementwiseOptimizer(Optimizer):
    """An optimizer whose update is one registered update op (see `defupdate`).

    Subclasses name the op, its hyperparameter attributes and the slots' initial values.
    """

    op: ClassVar[str] = ""
    slots_of: ClassVar[SlotsFn]

    def attrs(self) -> dict[str, Any]:
        """Hyperparameters as op attributes (everything but lr, which is a graph buffer, and the
        groups, each of which is an optimizer of its own settings: optim/groups.py)."""
        return {k: v for k, v in self.settings().items() if k != "lr"}

    def initial_value(self, slot: str) -> float:
        return 0.0

    def init_state(self, param: np.ndarray) -> dict[str, np.ndarray]:
        return {s: _filled(param, self.initial_value(s)) for s in type(self).slots_of(self.attrs())}

    def update(self, b: Builder, param: str, grad: str, state: dict[str, str], lr: str, step: str
               ) -> tuple[str, dict[str, str]]:
        names = type(self).slots_of(self.attrs())
        outs = b.ops(self.op, [param, grad, *(state[s] for s in names), lr, step], 1 + len(names),
                     **self.attrs())
        return outs[0], dict(zip(names, outs[1:]))

    def _check(self, **bounds: tuple[float, float | None]) -> None:
        """Raise ConfigError unless each named hyperparameter lies in [low, high)."""
        for key, (low, high) in bounds.items():
            v = getattr(self, key)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{self.name}: {key} must be a finite number, got {v}")
            if not (v >= low and (high is None or v < high)):
                span = f">= {low}" if high is None else f"in [{low}, {high})"
                raise ConfigError(f"{self.name}: {key} must be {span}, got {v}")


def lerp(a: np.ndarray, b: np.ndarray, w: float) -> np.ndarray:
    """torch.lerp's formula (which branch depends on the weight), for bit-compatible averages."""
    w32 = np.float32(w)
    return a + w32 * (b - a) if abs(w) < 0.5 else b - (b - a) * (np.float32(1) - w32)


def _filled(param: np.ndarray, value: float) -> np.ndarray:
    """A slot of param's shape and dtype holding `value`; zeros (most slots) as np.zeros, whose
    pages stay untouched until written (GPT-2 small's momentum is 650 MB of them)."""
    return np.zeros(param.shape, param.dtype) if value == 0 else np.full(param.shape, value, param.dtype)
