"""Normalisations over the features of each sample: LayerNormalization, RMSNormalization,
GroupNormalization, InstanceNormalization (BatchNormalization, which normalises over the batch,
lives in nn.py).

All three standardise x over some axes and apply a scale and bias. Their backward passes share
one formula (see `_normalize_backward`) and are two internal ops: LayerNormGrad and
GroupNormGrad (InstanceNormalization is GroupNormalization with one channel per group). The
backward ops recompute the statistics from x, so they work whether or not the forward node
exposes its Mean and InvStdDev outputs.
"""
from __future__ import annotations

import numpy as np

from ..errors import AnygradError, ShapeError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import norm_axis, onnx_dtype


def _standardize(x: np.ndarray, axes: tuple, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xhat, mean, 1/std) over `axes`, statistics with kept dims."""
    mean = x.mean(axis=axes, keepdims=True)
    centered = x - mean
    inv = 1.0 / np.sqrt(np.mean(centered * centered, axis=axes, keepdims=True) + eps)
    return centered * inv, mean, inv


def _normalize_backward(g_hat: np.ndarray, xhat: np.ndarray, inv: np.ndarray, axes: tuple) -> np.ndarray:
    """dx from d xhat, for xhat standardised over `axes`:
    dx = inv * (g - mean(g) - xhat * mean(g * xhat))."""
    return inv * (g_hat - g_hat.mean(axis=axes, keepdims=True)
                  - xhat * np.mean(g_hat * xhat, axis=axes, keepdims=True))


def _compute_dtype(x: np.ndarray, stash_type: int = 1) -> np.dtype:
    """float64 inputs (or stash_type double) compute in float64, everything else in float32."""
    return np.dtype(np.float64) if x.dtype == np.float64 or int(stash_type) == 11 else np.dtype(np.float32)


# -- LayerNormalization ------------------------------------------------------------------------
def _ln_axes(node: Node, rank: int) -> tuple[int, ...]:
    axis = norm_axis(int(node.attr("axis", -1)), rank)
    if not 0 <= axis < rank:
        raise ShapeError(f"{node.label}: axis {node.attr('axis', -1)} is out of range for rank {rank}")
    return tuple(range(axis, rank))


def _ln_infer(node, ins):
    shape = tuple(ins[0].shape)
    axes = _ln_axes(node, len(shape))
    stats = tuple(1 if i in axes else d for i, d in enumerate(shape))
    stash = onnx_dtype(node.attr("stash_type", 1), node)
    return [TensorInfo(ins[0].dtype, shape), TensorInfo(stash, stats), TensorInfo(stash, stats)]


def _ln_forward(node, ins):
    x, scale = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    dt = _compute_dtype(x, node.attr("stash_type", 1))
    xhat, mean, inv = _standardize(x.astype(dt), _ln_axes(node, x.ndim), float(node.attr("epsilon", 1e-5)))
    y = xhat * scale.astype(dt)
    if bias is not None:
        y = y + bias.astype(dt)
    stash = onnx_dtype(node.attr("stash_type", 1), node)
    return y.astype(x.dtype), mean.astype(stash), inv.astype(stash)


def _no_stat_grads(g: GradContext) -> None:
    if any(d is not None for d in g.dys[1:]):
        raise AnygradError(f"{g.node.label}: gradients through the Mean/InvStdDev outputs of {g.node.op} "
                           "are not supported")


def _ln_grad(g: GradContext):
    _no_stat_grads(g)
    x, scale = g.x[0], g.x[1]
    dx, dscale, dbias = g.ops("LayerNormGrad", [g.dy, x, scale], 3, axis=int(g.node.attr("axis", -1)),
                              epsilon=float(g.node.attr("epsilon", 1e-5)))
    grads = [dx if g.need(0) else None, g.unbroadcast(dscale, g.shape(scale)) if g.need(1) else None]
    if len(g.x) > 2 and g.x[2]:
        grads.append(g.unbroadcast(dbias, g.shape(g.x[2])) if g.need(2) else None)
    return grads


def _ln_grad_forward(node, ins):
    dy, x, scale = ins
    axes = _ln_axes(node, x.ndim)
    dt = _compute_dtype(x)
    xhat, _, inv = _standardize(x.astype(dt), axes, float(node.attr("epsilon", 1e-5)))
    dy = dy.astype(dt)
    lead = tuple(range(axes[0]))  # the batch-like axes dscale and dbias sum over
    dx = _normalize_backward(dy * scale.astype(dt), xhat, inv, axes)
    return dx.astype(x.dtype), np.sum(dy * xhat, axis=lead).astype(x.dtype), np.sum(dy, axis=lead).astype(x.dtype)


def _ln_grad_infer(node, ins):
    shape = tuple(ins[1].shape)
    norm = shape[_ln_axes(node, len(shape))[0]:]
    return [TensorInfo(ins[1].dtype, shape), TensorInfo(ins[1].dtype, norm), TensorInfo(ins[1].dtype, norm)]


defop("LayerNormalization", infer=_ln_infer, forward=_ln_forward, grad=_ln_grad)
# Inputs dy, x, scale (attrs axis, epsilon) -> dx, and d scale / d bias over x.shape[axis:]
# (the rule sums those down to the scale's and bias's own, possibly broadcast, shapes).
defop("LayerNormGrad", internal=True, infer=_ln_grad_infer, forward=_ln_grad_forward)


# -- RMSNormalization (ONNX opset 23; Llama's, T5's and Mistral's norm) ------------------------------
# LayerNorm without the mean: y = x / sqrt(mean(x^2) + eps) * scale, over x.shape[axis:]. A
# primitive, not an expansion into Pow/ReduceMean/Sqrt/Div, so that its forward is one read of
# each row and its backward one RMSNormGrad; ir/rmsnorm.py turns the exporters' written-out form
# into it.
def _rms(x: np.ndarray, axes: tuple, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(xhat, 1/rms) over `axes`, the statistic with kept dims."""
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)
    return x * inv, inv


def _rms_forward(node, ins):
    x, scale = ins[0], ins[1]
    dt = _compute_dtype(x, node.attr("stash_type", 1))
    xhat, _ = _rms(x.astype(dt), _ln_axes(node, x.ndim), float(node.attr("epsilon", 1e-5)))
    return (xhat * scale.astype(dt)).astype(x.dtype)


def _rms_grad(g: GradContext):
    x, scale = g.x[0], g.x[1]
    dx, dscale = g.ops("RMSNormGrad", [g.dy, x, scale], 2, axis=int(g.node.attr("axis", -1)),
                       epsilon=float(g.node.attr("epsilon", 1e-5)))
    return [dx if g.need(0) else None, g.unbroadcast(dscale, g.shape(scale)) if g.need(1) else None]


def _rms_grad_forward(node, ins):
    """dx = inv * (g - xhat * mean(g * xhat)) with g = dy * scale (the LayerNorm formula with no
    mean term); dscale = sum of dy * xhat over the leading axes."""
    dy, x, scale = ins
    axes = _ln_axes(node, x.ndim)
    dt = _compute_dtype(x)
    xhat, inv = _rms(x.astype(dt), axes, float(node.attr("epsilon", 1e-5)))
    dy = dy.astype(dt)
    gh = dy * scale.astype(dt)
    dx = inv * (gh - xhat * np.mean(gh * xhat, axis=axes, keepdims=True))
    return dx.astype(x.dtype), np.sum(dy * xhat, axis=tuple(range(axes[0]))).astype(x.dtype)


def _rms_grad_infer(node, ins):
    return _ln_grad_infer(node, ins)[:2]


defop("RMSNormalization", infer=lambda node, ins: [TensorInfo(ins[0].dtype, tuple(ins[0].shape))],
      forward=_rms_forward, grad=_rms_grad)
# Inputs dy, x, scale (attrs axis, epsilon) -> dx, and d scale over x.shape[axis:].
defop("RMSNormGrad", internal=True, infer=_rms_grad_infer, forward=_rms_grad_forward)


# -- GroupNormalization / InstanceNormalization ------------------------------------------------
def _groups(node: Node, shape: tuple) -> int:
    if node.op == "InstanceNormalization":
        return int(shape[1])
    g = node.attr("num_groups")
    if g is None or len(shape) < 2 or int(g) < 1 or (isinstance(shape[1], int) and shape[1] % int(g)):
        raise ShapeError(f"{node.label}: num_groups {g} must divide the channels of input {tuple(shape)}")
    return int(g)


def _check_affine(node: Node, shape: tuple, groups: int, params: list) -> None:
    """Scale and bias hold one value per channel (ONNX 21, InstanceNormalization) or per group
    (GroupNormalization 18-20); the length tells which (they agree when groups == channels)."""
    for p in params:
        if p is not None and tuple(p.shape) not in ((shape[1],), (groups,)):
            raise ShapeError(f"{node.label}: scale/bias of shape {tuple(p.shape)} must hold one value per "
                             f"channel ({shape[1]}) or per group ({groups})")


def _per_channel(p: np.ndarray, channels: int) -> np.ndarray:
    """A per-group parameter repeated for each channel of its group."""
    return p if p.shape[0] == channels else np.repeat(p, channels // p.shape[0])


def _channel_view(p: np.ndarray, rank: int) -> np.ndarray:
    return p.reshape((-1,) + (1,) * (rank - 2))


def _group_standardize(x: np.ndarray, groups: int, eps: float):
    """xhat and 1/std over the (N, groups, rest) view of x."""
    grouped = x.reshape((x.shape[0], groups, -1))
    xhat, _, inv = _standardize(grouped, (2,), eps)
    return xhat, inv


def _gn_infer(node, ins):
    shape = tuple(ins[0].shape)
    groups = _groups(node, shape)
    _check_affine(node, shape, groups, ins[1:3])
    return [TensorInfo(ins[0].dtype, shape)]


def _gn_forward(node, ins):
    x, scale, bias = ins[:3]
    groups = _groups(node, x.shape)
    dt = _compute_dtype(x, node.attr("stash_type", 1))
    xhat, _ = _group_standardize(x.astype(dt), groups, float(node.attr("epsilon", 1e-5)))
    c = x.shape[1]
    y = (xhat.reshape(x.shape) * _channel_view(_per_channel(scale, c).astype(dt), x.ndim)
         + _channel_view(_per_channel(bias, c).astype(dt), x.ndim))
    return y.astype(x.dtype)


def _gn_grad(g: GradContext):
    x, scale, bias = g.x[:3]
    groups = _groups(g.node, g.shape(x))
    dx, dscale, dbias = g.ops("GroupNormGrad", [g.dy, x, scale], 3, num_groups=groups,
                              epsilon=float(g.node.attr("epsilon", 1e-5)), bias_shape=list(g.shape(bias)))
    return [dx if g.need(0) else None, dscale if g.need(1) else None, dbias if g.need(2) else None]


def _gn_grad_forward(node, ins):
    dy, x, scale = ins
    groups, c = int(node.attr("num_groups")), x.shape[1]
    dt = _compute_dtype(x)
    xhat, inv = _group_standardize(x.astype(dt), groups, float(node.attr("epsilon", 1e-5)))
    dy = dy.astype(dt)
    g_hat = (dy * _channel_view(_per_channel(scale, c).astype(dt), x.ndim)).reshape(xhat.shape)
    dx = _normalize_backward(g_hat, xhat, inv, (2,)).reshape(x.shape)
    sum_axes = (0,) + tuple(range(2, x.ndim))
    dscale_c = np.sum(dy * xhat.reshape(x.shape), axis=sum_axes)
    dbias_c = np.sum(dy, axis=sum_axes)

    def to(p: np.ndarray, n: int) -> np.ndarray:  # per-group parameters sum their channels
        return p if n == c else p.reshape(n, -1).sum(axis=1)
    return (dx.astype(x.dtype), to(dscale_c, scale.shape[0]).astype(x.dtype),
            to(dbias_c, int(node.attr("bias_shape")[0])).astype(x.dtype))


def _gn_grad_infer(node, ins):
    x, scale = ins[1], ins[2]
    return [TensorInfo(x.dtype, tuple(x.shape)), TensorInfo(x.dtype, tuple(scale.shape)),
            TensorInfo(x.dtype, tuple(node.attr("bias_shape")))]


for _name in ("GroupNormalization", "InstanceNormalization"):
    defop(_name, infer=_gn_infer, forward=_gn_forward, grad=_gn_grad)
# Inputs dy, x, scale (attrs num_groups, epsilon, bias_shape) -> dx, d scale, d bias, the last two
# per channel or per group like the forward's parameters.
defop("GroupNormGrad", internal=True, infer=_gn_grad_infer, forward=_gn_grad_forward)
