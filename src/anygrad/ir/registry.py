"""The op registry: one entry per op holds its shape rule, numpy reference kernel and gradient rule.

Entries are defined in `anygrad.ops` (one module per family). Everything that needs to know what
an op does (shape inference, constant folding, autodiff, the numpy backend, importers) asks here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .graph import Graph, Node, TensorInfo

if TYPE_CHECKING:
    from .builder import GradContext

InferFn = Callable[[Node, list[TensorInfo]], list[TensorInfo]]
ForwardFn = Callable[[Node, list[np.ndarray]], Sequence[np.ndarray] | np.ndarray]
GradFn = Callable[["GradContext"], Sequence[str | None]]
ModeFn = Callable[[Graph, Node, bool], None]


@dataclass(frozen=True)
class OpDef:
    """What one op is.

    infer:    output TensorInfos from input TensorInfos (absent optional inputs are None). It
              may set `.const` when the output is known at compile time (e.g. Shape).
    forward:  the numpy reference kernel: inputs (None for absent) -> output array(s).
    grad:     builds gradient nodes (see GradContext); None for ops that are not differentiable.
    nondiff:  input slots that never receive a gradient (shapes, indices, running statistics...).
    foldable: constant folding may evaluate it when all its inputs are constant.
    internal: not an ONNX op (emitted by autodiff, losses, optimizers); never exported.
    set_mode: rewrites the node in place for training (True) or inference (False), for ops that
              behave differently (BatchNormalization, Dropout); may add outputs, inputs and
              graph.state_updates (see anygrad.ir.passes.set_training_mode).
    """

    name: str
    infer: InferFn
    forward: ForwardFn
    grad: GradFn | None = None
    nondiff: frozenset[int] = field(default_factory=frozenset)
    foldable: bool = True
    internal: bool = False
    set_mode: ModeFn | None = None

    def run(self, node: Node, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        out = self.forward(node, inputs)
        if isinstance(out, (list, tuple)):
            return [np.asarray(o) for o in out]
        return [np.asarray(out)]


_REGISTRY: dict[str, OpDef] = {}


def defop(name: str, *, infer: InferFn, forward: ForwardFn, grad: GradFn | None = None,
          nondiff: Sequence[int] = (), foldable: bool = True, internal: bool = False,
          set_mode: ModeFn | None = None) -> OpDef:
    """Register an op. Redefining a name is a programming error."""
    if name in _REGISTRY:
        raise ValueError(f"op {name} registered twice")
    op = OpDef(name, infer, forward, grad, frozenset(nondiff), foldable, internal, set_mode)
    _REGISTRY[name] = op
    return op


def get_op(name: str) -> OpDef | None:
    return _REGISTRY.get(name)


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)
