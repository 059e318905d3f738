"""Reductions over axes (ReduceSum, ...). Axes come as an attribute or a constant input."""
from __future__ import annotations

import numpy as np

from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import axes_of, norm_axis


def reduce_axes(node: Node, ins: list, rank: int) -> tuple[int, ...]:
    axes = axes_of(node, ins)
    if not axes:
        # No axes: reduce everything, unless noop_with_empty_axes says leave it alone.
        return () if node.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(sorted(norm_axis(a, rank) for a in axes))


def _reduced_shape(shape, axes, keepdims):
    return tuple((1 if i in axes else d) for i, d in enumerate(shape) if keepdims or i not in axes)


def _reduce_infer(node, ins):
    axes = reduce_axes(node, ins, ins[0].rank)
    return [TensorInfo(ins[0].dtype, _reduced_shape(ins[0].shape, axes, node.attr("keepdims", 1)))]


def _reduce_sum_forward(node, ins):
    axes = reduce_axes(node, ins, ins[0].ndim)
    return np.sum(ins[0], axis=axes, keepdims=bool(node.attr("keepdims", 1))).astype(ins[0].dtype)


def expand_back(g: GradContext, grad: str) -> str:
    """Broadcast a reduction's gradient back to the input shape."""
    x = g.x[0]
    axes = reduce_axes(g.node, [g.info(i) if i else None for i in g.x], len(g.shape(x)))
    kept = g.reshape(grad, _reduced_shape(g.shape(x), axes, True))
    return g.op("Expand", [kept, g.const(np.array(g.shape(x), np.int64), np.int64, "shape")])


defop("ReduceSum", infer=_reduce_infer, forward=_reduce_sum_forward, nondiff=[1],
      grad=lambda g: [expand_back(g, g.dy), None])
