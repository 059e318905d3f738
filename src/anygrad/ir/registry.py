"""The op registry: one entry per op holds its shape rule, numpy reference kernel and gradient rule.

Entries are defined in `anygrad.ops` (one module per family). Everything that needs to know what
an op does (shape inference, constant folding, autodiff, the numpy backend, importers) asks here.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .graph import Graph, Node, TensorInfo

if TYPE_CHECKING:
    from .builder import Builder, GradContext

InferFn = Callable[[Node, list[TensorInfo]], list[TensorInfo]]
ForwardFn = Callable[[Node, list[np.ndarray]], Sequence[np.ndarray] | np.ndarray]
GradFn = Callable[["GradContext"], Sequence[str | None]]
ModeFn = Callable[[Graph, Node, bool], None]
ExpandFn = Callable[["Builder", Node], Sequence[str]]
ResolveFn = Callable[[Node, list[TensorInfo | None]], dict[str, Any]]


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
    expand:   for composite ops (LSTM, Attention...): builds the node's outputs from other ops once
              input shapes are static, returning one value name per output ("" for an absent
              one). `specialize` replaces such nodes by their expansion, so autodiff and every
              backend only ever see the primitive ops; `forward` defaults to running the
              expansion, and `grad` is not needed.
    grad_attrs: anygrad's own attributes that only the gradient rule reads (Gather's padding_idx:
              PyTorch semantics an ONNX file cannot carry); never written to ONNX.
    resolve:  the node's attributes with everything explicit, from its input TensorInfos: opset
              defaults filled in, negative axes made non-negative, auto_pad turned into pads,
              constant inputs (axes, pads, starts...) copied into attributes. Backends read only
              these (see anygrad.ir.passes.resolve_attributes); it must be idempotent, and the
              reference kernel must give the same result on the resolved node.
    reads_half: input slots that may hold float16 although the op computes in float32 (a fused
              loss, as cuDNN's): its float outputs stay float32 whatever those inputs' dtype, so
              a float32 Cast of a float16 value into such a slot is only a copy, and the training
              step lets the op read the float16 value instead (program.py).
    """

    name: str
    infer: InferFn
    forward: ForwardFn
    grad: GradFn | None = None
    nondiff: frozenset[int] = field(default_factory=frozenset)
    foldable: bool = True
    internal: bool = False
    set_mode: ModeFn | None = None
    expand: ExpandFn | None = None
    grad_attrs: frozenset[str] = field(default_factory=frozenset)
    resolve: ResolveFn | None = None
    reads_half: frozenset[int] = field(default_factory=frozenset)

    def run(self, node: Node, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        """forward's outputs as a list of arrays."""
        out = self.forward(node, inputs)
        if isinstance(out, (list, tuple)):
            return [np.asarray(o) for o in out]
        return [np.asarray(out)]


_REGISTRY: dict[str, OpDef] = {}


def defop(name: str, *, infer: InferFn, forward: ForwardFn | None = None, grad: GradFn | None = None,
          nondiff: Sequence[int] = (), foldable: bool = True, internal: bool = False,
          set_mode: ModeFn | None = None, expand: ExpandFn | None = None,
          grad_attrs: Sequence[str] = (), resolve: ResolveFn | None = None,
          reads_half: Sequence[int] = ()) -> OpDef:
    """Register an op. Redefining a name is a programming error."""
    if name in _REGISTRY:
        raise ValueError(f"op {name} registered twice")
    if forward is None:   # a composite's kernel runs its expansion: ir/composite.defcomposite
        raise ValueError(f"op {name} needs a forward kernel (a composite op registers through defcomposite)")
    op = OpDef(name, infer, forward, grad, frozenset(nondiff), foldable, internal, set_mode, expand,
               frozenset(grad_attrs), resolve, frozenset(reads_half))
    _REGISTRY[name] = op
    return op


def set_resolve(names: Sequence[str], resolve: ResolveFn) -> None:
    """Give registered ops an attribute resolver: op families whose ops share one (every op with
    an `axis`, every windowed op) set it from one table instead of at each defop."""
    for name in names:
        _REGISTRY[name] = replace(_REGISTRY[name], resolve=resolve)


def get_op(name: str) -> OpDef | None:
    return _REGISTRY.get(name)


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)
