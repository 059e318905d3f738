"""Reductions over axes (ReduceSum, ReduceMean, ...) and ArgMax/ArgMin.

Axes come as an attribute (older opsets) or a constant input (ReduceSum from opset 13, the others
from 18). Each reduction is one table row: numpy kernel and gradient rule. As in ONNX's reference,
noop_with_empty_axes with no axes skips only the reduction: ReduceL2 still takes sqrt(x^2).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import ONNX_CODES, axes_of, norm_axis


def reduce_axes(node: Node, ins: list, rank: int) -> tuple[int, ...]:
    axes = axes_of(node, ins)
    if not axes:
        # No axes: reduce everything, unless noop_with_empty_axes says leave it alone.
        return () if node.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    axes = tuple(sorted(norm_axis(a, rank) for a in axes))
    if len(set(axes)) != len(axes) or any(not 0 <= a < rank for a in axes):
        raise ShapeError(f"{node.label}: invalid axes {list(axes_of(node, ins))} for rank {rank}")
    return axes


def _reduced_shape(shape, axes, keepdims):
    return tuple((1 if i in axes else d) for i, d in enumerate(shape) if keepdims or i not in axes)


def _reduce_infer(node, ins):
    axes = reduce_axes(node, ins, ins[0].rank)
    return [TensorInfo(ins[0].dtype, _reduced_shape(ins[0].shape, axes, node.attr("keepdims", 1)))]


def expand_back(g: GradContext, grad: str) -> str:
    """Broadcast a reduction's gradient back to the input shape."""
    x = g.x[0]
    return g.op("Expand", [kept_dims(g, grad), g.const(np.array(g.shape(x), np.int64), np.int64, "shape")])


def _axes(g: GradContext) -> tuple[int, ...]:
    return reduce_axes(g.node, [g.info(i) if i else None for i in g.x], len(g.shape(g.x[0])))


def kept_dims(g: GradContext, v: str) -> str:
    """A reduction-shaped value (its output or its gradient) with the reduced axes kept as 1s,
    so it broadcasts against the input."""
    return g.reshape(v, _reduced_shape(g.shape(g.x[0]), _axes(g), True))


def _extreme(x: np.ndarray, low: bool):
    """The identity of max (low) / min over an empty set, as ONNX defines it: -inf / +inf
    for floats, the type's range limit for integers."""
    if np.issubdtype(x.dtype, np.floating):
        return -np.inf if low else np.inf
    info = np.iinfo(x.dtype) if np.issubdtype(x.dtype, np.integer) else None
    return (info.min if low else info.max) if info else (not low)


def _logsumexp(x, axes, keepdims):
    if not axes:
        return x.copy()
    m = np.max(x, axis=axes, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0)  # all -inf rows stay -inf instead of becoming nan
    with np.errstate(divide="ignore"):  # log(0) of an all -inf (or empty) row is -inf, by design
        out = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axes)


# -- gradient rules (dy is reduction-shaped; x the input, y the output) ----------------------
def _grad_sum(g: GradContext):
    return expand_back(g, g.dy)


def _grad_mean(g: GradContext):
    shape = g.shape(g.x[0])
    count = int(np.prod([shape[a] for a in _axes(g)], dtype=np.int64))
    return g.op("Mul", [expand_back(g, g.dy), g.const(1.0 / max(count, 1), g.dtype(g.dy))])


def _grad_select(g: GradContext):
    """Max/Min: split evenly between the elements equal to the result (as torch.amax/amin)."""
    x = g.x[0]
    mask = g.op("Cast", [g.op("Equal", [x, kept_dims(g, g.y[0])])], to=ONNX_CODES[g.dtype(x)])
    share = kept_dims(g, g.dy)
    if _axes(g):  # (noop_with_empty_axes: every element is its own maximum)
        axes = g.const(np.array(_axes(g), np.int64), np.int64, "axes")
        share = g.op("Div", [share, g.op("ReduceSum", [mask, axes], keepdims=1)])
    return g.op("Mul", [share, mask])


def _grad_prod(g: GradContext):
    """dx = dy * (the product of the other elements of x's group). Built from exclusive running
    products from both ends rather than y / x, so zeros are exact as in PyTorch's prod backward
    (one zero: only it gets a gradient; two or more: none) instead of inf/nan."""
    x, axes = g.x[0], _axes(g)
    if not axes:  # noop_with_empty_axes: y is x
        return expand_back(g, g.dy)
    shape = g.shape(x)
    kept = [i for i in range(len(shape)) if i not in axes]
    perm = kept + list(axes)  # the reduced axes last, flattened into one
    inverse = [perm.index(i) for i in range(len(shape))]
    xt = g.op("Transpose", [x], perm=perm) if perm != sorted(perm) else x
    group = int(np.prod([shape[a] for a in axes], dtype=np.int64))
    flat = g.reshape(xt, tuple(shape[k] for k in kept) + (group,))
    axis = g.const(np.array(len(kept), np.int64), np.int64, "axis")
    before = g.op("CumProd", [flat, axis], exclusive=1)
    after = g.op("CumProd", [flat, axis], exclusive=1, reverse=1)
    dy = g.reshape(g.dy, tuple(shape[k] for k in kept) + (1,))
    dflat = g.op("Mul", [g.op("Mul", [before, after]), dy])
    dxt = g.reshape(dflat, tuple(shape[p] for p in perm))
    return g.op("Transpose", [dxt], perm=inverse) if perm != sorted(perm) else dxt


def _grad_l1(g: GradContext):
    return g.op("Mul", [kept_dims(g, g.dy), g.op("Sign", [g.x[0]])])


def _grad_l2(g: GradContext):
    # x / |x|, and 0 where the norm is 0 (as PyTorch's norm backward)
    y = kept_dims(g, g.y[0])
    zero = g.const(0.0, g.dtype(y), "zero")
    safe = g.op("Where", [g.op("Equal", [y, zero]), g.const(1.0, g.dtype(y)), y])
    return g.op("Mul", [g.op("Div", [kept_dims(g, g.dy), safe]), g.x[0]])


def _grad_sum_square(g: GradContext):
    return g.op("Mul", [kept_dims(g, g.dy), g.op("Mul", [g.x[0], g.const(2.0, g.dtype(g.x[0]))])])


def _grad_log_sum(g: GradContext):
    return expand_back(g, g.op("Div", [g.dy, g.op("Exp", [g.y[0]])]))  # 1 / sum(x) = exp(-y)


def _grad_logsumexp(g: GradContext):
    return g.op("Mul", [kept_dims(g, g.dy), g.op("Exp", [g.op("Sub", [g.x[0], kept_dims(g, g.y[0])])])])


@dataclass(frozen=True)
class Reduction:
    kernel: Callable[[np.ndarray, tuple, bool], np.ndarray]  # (x, axes, keepdims) -> y
    grad: Callable[[GradContext], str] | None


REDUCTIONS = {
    "ReduceSum": Reduction(lambda x, a, k: np.sum(x, axis=a, keepdims=k), _grad_sum),
    "ReduceMean": Reduction(lambda x, a, k: np.mean(x, axis=a, keepdims=k), _grad_mean),
    "ReduceMax": Reduction(lambda x, a, k: np.max(x, axis=a, keepdims=k, initial=_extreme(x, True)), _grad_select),
    "ReduceMin": Reduction(lambda x, a, k: np.min(x, axis=a, keepdims=k, initial=_extreme(x, False)), _grad_select),
    "ReduceProd": Reduction(lambda x, a, k: np.prod(x, axis=a, keepdims=k), _grad_prod),
    "ReduceL1": Reduction(lambda x, a, k: np.sum(np.abs(x), axis=a, keepdims=k), _grad_l1),
    "ReduceL2": Reduction(lambda x, a, k: np.sqrt(np.sum(np.square(x), axis=a, keepdims=k)), _grad_l2),
    "ReduceSumSquare": Reduction(lambda x, a, k: np.sum(np.square(x), axis=a, keepdims=k), _grad_sum_square),
    "ReduceLogSum": Reduction(lambda x, a, k: np.log(np.sum(x, axis=a, keepdims=k)), _grad_log_sum),
    "ReduceLogSumExp": Reduction(_logsumexp, _grad_logsumexp),
}


def _reduce_forward(kernel):
    def forward(node, ins):
        axes = reduce_axes(node, ins, ins[0].ndim)
        return np.asarray(kernel(ins[0], axes, bool(node.attr("keepdims", 1)))).astype(ins[0].dtype)
    return forward


def _x_grad(rule):
    return None if rule is None else lambda g: [rule(g), None]  # the axes input gets none


for _name, _r in REDUCTIONS.items():
    defop(_name, infer=_reduce_infer, forward=_reduce_forward(_r.kernel), nondiff=[1], grad=_x_grad(_r.grad))


# -- ArgMax / ArgMin -------------------------------------------------------------------------
def _arg_axis(node: Node, rank: int) -> int:
    axis = norm_axis(node.attr("axis", 0), rank)
    if not 0 <= axis < rank:
        raise ShapeError(f"{node.label}: axis {node.attr('axis', 0)} is out of range for rank {rank}")
    return axis


def _arg_infer(node, ins):
    axis = _arg_axis(node, ins[0].rank)
    return [TensorInfo(np.dtype(np.int64), _reduced_shape(ins[0].shape, (axis,), node.attr("keepdims", 1)))]


def _arg_forward(fn):
    def forward(node, ins):
        x = ins[0]
        axis = _arg_axis(node, x.ndim)
        if node.attr("select_last_index", 0):  # ties: the last index instead of the first
            idx = x.shape[axis] - 1 - fn(np.flip(x, axis), axis=axis, keepdims=True)
        else:
            idx = fn(x, axis=axis, keepdims=True)
        return (idx if node.attr("keepdims", 1) else np.squeeze(idx, axis)).astype(np.int64)
    return forward


for _name, _fn in [("ArgMax", np.argmax), ("ArgMin", np.argmin)]:
    defop(_name, infer=_arg_infer, forward=_arg_forward(_fn), nondiff=[0])


# -- FoundInf: the loss scaler's test --------------------------------------------------------
def _found_inf_infer(node, ins):
    if not ins or any(i.dtype.kind != "f" for i in ins):
        raise ShapeError(f"{node.label}: FoundInf reads one or more floating-point tensors")
    return [TensorInfo(np.dtype(np.bool_), ())]


def _found_inf(node, ins):
    """True when some element of some input is inf or NaN: torch.amp.GradScaler's found_inf, an
    elementwise test, not a test of a sum (a sum of finite float32 values can overflow)."""
    return np.asarray(any(not np.isfinite(x).all() for x in ins))


# FoundInf(x1, ..., xn) -> bool scalar. Built after the gradients (grad_scaler.found_inf), so it
# has no gradient rule; backends may test a whole gradient arena at once (wgpu fusion).
defop("FoundInf", infer=_found_inf_infer, forward=_found_inf, internal=True, foldable=False)
