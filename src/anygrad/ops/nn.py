"""Neural-network ops: Conv, pooling, BatchNormalization, Dropout, Softmax / LogSoftmax.

Every sliding-window op (Conv and the pools) shares one geometry (`Window`): ONNX attributes plus
the input's spatial shape resolve to explicit begin/end pads and the output shape, for any number
of spatial dims. Gradient helpers are internal ops with explicit pads (auto_pad already resolved),
so a backend implements exactly: ConvGradInput, ConvGradWeight, MaxPoolGrad, AveragePoolGrad,
BatchNormGrad, DropoutGrad, SoftmaxGrad, LogSoftmaxGrad.

The kernels here are the plain reference (Conv and its gradients tap by tap, BatchNormalization
over the whole batch); the numpy backend runs im2col, blocked and threaded kernels of the same
values (backends/numpy/conv.py, fastpaths.py).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from .. import rng
from ..errors import AnygradError, ShapeError, UnsupportedOpError
from ..ir.builder import GradContext
from ..ir.graph import Graph, Node, TensorInfo, info_of
from ..ir.passes import RNG_STATE
from ..ir.registry import defop
from ._util import norm_axis, same_as_first


# -- window geometry -------------------------------------------------------------------------
def _str_attr(node: Node, key: str, default: str) -> str:
    value = node.attr(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Window:
    """Where each output of a sliding-window op reads its input, per spatial dim."""

    spatial: tuple[int, ...]    # input spatial shape
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]      # explicit pads (auto_pad resolved)
    end: tuple[int, ...]
    out: tuple[int, ...]

    @property
    def nd(self) -> int:
        return len(self.kernel)

    @property
    def extent(self) -> tuple[int, ...]:
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations))

    @property
    def pads(self) -> list[int]:
        return list(self.begin) + list(self.end)

    @property
    def padded(self) -> tuple[int, ...]:
        """Padded spatial shape, including the overhang of ceil_mode's last window."""
        return tuple(max(i + b + e, (o - 1) * s + x) for i, b, e, o, s, x in
                     zip(self.spatial, self.begin, self.end, self.out, self.strides, self.extent))

    def taps(self):
        """(kernel offset, slice of the padded input that offset reads for every output)."""
        for idx in itertools.product(*(range(k) for k in self.kernel)):
            yield idx, (slice(None), slice(None)) + tuple(
                slice(i * d, i * d + (o - 1) * s + 1, s)
                for i, d, o, s in zip(idx, self.dilations, self.out, self.strides))

    def pad(self, x: np.ndarray, value: float = 0.0) -> np.ndarray:
        widths = [(0, 0), (0, 0)] + [(b, p - i - b) for i, b, p in zip(self.spatial, self.begin, self.padded)]
        if not any(w for pair in widths for w in pair):
            return x
        return np.pad(x, widths, constant_values=value)

    @property
    def interior(self) -> tuple[slice, ...]:
        """Where the input lies in a padded (N, C, *padded) array."""
        return (slice(None), slice(None)) + tuple(slice(b, b + i) for b, i in zip(self.begin, self.spatial))

    def crop(self, xp: np.ndarray) -> np.ndarray:
        return xp[self.interior]

    @classmethod
    def of(cls, node: Node, spatial) -> Window:
        """The window of a node with resolved attributes (ops/resolve.py: explicit kernel_shape,
        strides, dilations, pads, ceil_mode; no auto_pad) over an input of `spatial` dims: arithmetic
        on those, what a backend needs to lay out a windowed op."""
        if node.attr("kernel_shape") is None or node.attr("pads") is None or node.attr("auto_pad") is not None:
            raise ShapeError(f"{node.label}: attributes are not resolved (anygrad.ir.passes.resolve_attributes)")
        return window(node, spatial, tuple(node.attr("kernel_shape")), bool(node.attr("ceil_mode", 0)))

    def attrs(self) -> dict:
        """Explicit attributes for the internal gradient ops (no auto_pad left to resolve)."""
        return {"kernel_shape": list(self.kernel), "strides": list(self.strides),
                "dilations": list(self.dilations), "pads": self.pads}


def window(node: Node, spatial, kernel, ceil_mode: bool = False) -> Window:
    """Resolve a node's strides/dilations/pads/auto_pad against an input spatial shape."""
    nd = len(kernel)
    spatial, kernel = tuple(int(d) for d in spatial), tuple(int(k) for k in kernel)
    strides = tuple(int(s) for s in (node.attr("strides") or [1] * nd))
    dilations = tuple(int(d) for d in (node.attr("dilations") or [1] * nd))
    if len(strides) != nd or len(dilations) != nd:
        raise ShapeError(f"{node.label}: strides {list(strides)} / dilations {list(dilations)} do not "
                         f"match the {nd} spatial dims")
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    auto_pad = _str_attr(node, "auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = tuple(-(-i // s) for i, s in zip(spatial, strides))
        total = [max(0, (o - 1) * s + x - i) for o, s, x, i in zip(out, strides, extent, spatial)]
        # SAME_UPPER puts the odd pad at the end, SAME_LOWER at the beginning.
        begin = tuple(t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total)
        end = tuple(t - b for t, b in zip(total, begin))
        return Window(spatial, kernel, strides, dilations, begin, end, out)
    if auto_pad == "VALID":
        pads = [0] * (2 * nd)
    elif auto_pad == "NOTSET":
        pads = [int(p) for p in (node.attr("pads") or [0] * (2 * nd))]
    else:
        raise ShapeError(f"{node.label}: unknown auto_pad '{auto_pad}'")
    if len(pads) != 2 * nd:
        raise ShapeError(f"{node.label}: pads {pads} must have 2 x {nd} entries")
    begin, end = tuple(pads[:nd]), tuple(pads[nd:])
    out = []
    for i, b, e, x, s in zip(spatial, begin, end, extent, strides):
        span = i + b + e - x
        o = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (o - 1) * s >= i + b:
            o -= 1  # the last window would start in the end padding (PyTorch and ONNX drop it)
        out.append(o)
    if any(o < 1 for o in out):
        raise ShapeError(f"{node.label}: kernel {list(kernel)} (dilations {list(dilations)}) does not fit "
                         f"input {list(spatial)} with pads {pads}")
    return Window(spatial, kernel, strides, dilations, begin, end, tuple(out))


# -- Conv ------------------------------------------------------------------------------------
def _conv_window(node: Node, x_shape, w_shape) -> Window:
    kernel = tuple(w_shape[2:])
    if node.attr("kernel_shape") is not None and tuple(node.attr("kernel_shape")) != kernel:
        raise ShapeError(f"{node.label}: kernel_shape {list(node.attr('kernel_shape'))} differs from the "
                         f"weight's {list(kernel)}")
    return window(node, x_shape[2:], kernel)


def _conv_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    x, w = ins[0], ins[1]
    if x.rank < 3 or w.rank != x.rank:
        raise ShapeError(f"{node.label}: Conv needs X (N, C, ...) and W (M, C/group, ...) of equal rank, "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    group = int(node.attr("group", 1))
    if x.shape[1] != w.shape[1] * group or w.shape[0] % group:
        raise ShapeError(f"{node.label}: X has {x.shape[1]} channels but W {tuple(w.shape)} with "
                         f"group={group} "
                         f"expects {w.shape[1] * group}")
    if len(ins) > 2 and ins[2] is not None and tuple(ins[2].shape) != (w.shape[0],):
        raise ShapeError(f"{node.label}: bias shape {tuple(ins[2].shape)} is not ({w.shape[0]},)")
    win = _conv_window(node, x.shape, w.shape)
    return [TensorInfo(x.dtype, (x.shape[0], w.shape[0]) + win.out)]


# The reference kernels: one contraction per kernel tap, over the strided slice of the padded
# input that tap reads for every output (Window.taps). The numpy backend runs im2col kernels of
# the same values (backends/numpy/conv.py).
def _groups(a: np.ndarray, group: int) -> np.ndarray:
    """(N, C, ...) as (N, group, C / group, ...)."""
    return a.reshape((a.shape[0], group, a.shape[1] // group) + a.shape[2:])


def conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, win: Window, group: int) -> np.ndarray:
    """Y = W * X (+ b)."""
    n, m = x.shape[0], w.shape[0]
    xp, wg = win.pad(x), w.reshape((group, m // group) + w.shape[1:])
    y = np.zeros((n, group, m // group) + win.out, np.result_type(x, w))
    for idx, sl in win.taps():
        # (N, G, Cg, *out) x (G, Mg, Cg) -> (N, G, Mg, *out)
        y += np.einsum("ngc...,gmc->ngm...", _groups(xp[sl], group), wg[(slice(None),) * 3 + idx])
    y = y.reshape((n, m) + win.out)
    if b is not None:
        y += b.reshape((m,) + (1,) * win.nd)
    return y.astype(x.dtype, copy=False)


def conv_grad_input(dy: np.ndarray, w: np.ndarray, win: Window, group: int, x_shape) -> np.ndarray:
    """dX: each output's gradient spread back over the inputs its window read, tap by tap."""
    n, c, m = x_shape[0], x_shape[1], w.shape[0]
    wg = w.reshape((group, m // group) + w.shape[1:])
    dxp = np.zeros((n, group, c // group) + win.padded, np.result_type(dy, w))
    dyg = _groups(dy, group)
    for idx, sl in win.taps():
        # within one tap the outputs read distinct inputs, so a strided += is exact
        dxp[(slice(None),) * 3 + sl[2:]] += np.einsum("ngm...,gmc->ngc...", dyg, wg[(slice(None),) * 3 + idx])
    return win.crop(dxp.reshape((n, c) + win.padded)).astype(dy.dtype, copy=False)


def conv_grad_weight(dy: np.ndarray, x: np.ndarray, win: Window, group: int, w_shape) -> np.ndarray:
    """dW: for each tap, dY against the input slice that tap read, summed over batch and pixels."""
    m = w_shape[0]
    xp, dyg = win.pad(x), _groups(dy, group)
    dw = np.zeros((group, m // group) + tuple(w_shape[1:]), np.result_type(dy, x))
    nd = win.nd
    pixels = "".join("xyzuvw"[:nd])
    for idx, sl in win.taps():
        dw[(slice(None),) * 3 + idx] = np.einsum(f"ngm{pixels},ngc{pixels}->gmc", dyg, _groups(xp[sl], group))
    return dw.reshape(w_shape).astype(dy.dtype, copy=False)


def _conv_forward(node, ins):
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    return conv(x, w.astype(x.dtype, copy=False), b, _conv_window(node, x.shape, w.shape), int(node.attr("group", 1)))


def _explicit(node: Node, win: Window, **extra) -> dict:
    return {**win.attrs(), "group": int(node.attr("group", 1)), **extra}


def _conv_grad(g: GradContext):
    x, w = g.x[0], g.x[1]
    xs, ws = g.shape(x), g.shape(w)
    attrs = _explicit(g.node, _conv_window(g.node, xs, ws))
    dx = g.op("ConvGradInput", [g.dy, w], **attrs, input_shape=list(xs)) if g.need(0) else None
    dw = g.op("ConvGradWeight", [g.dy, x], **attrs, weight_shape=list(ws)) if g.need(1) else None
    db = None
    if g.need(2) and g.node.input(2):
        axes = [0] + list(range(2, len(xs)))
        db = g.op("ReduceSum", [g.dy, g.const(np.array(axes, np.int64), np.int64, "axes")], keepdims=0)
    return [dx, dw, db]


defop("Conv", infer=_conv_infer, forward=_conv_forward, grad=_conv_grad)


def _grad_input_infer(node, ins):
    return [TensorInfo(ins[0].dtype, tuple(int(d) for d in node.attr("input_shape")))]


def _conv_grad_input_forward(node, ins):
    dy, w = ins
    shape = tuple(node.attr("input_shape"))
    return conv_grad_input(dy, w.astype(dy.dtype, copy=False), window(node, shape[2:], w.shape[2:]),
                           int(node.attr("group", 1)), shape)


def _conv_grad_weight_forward(node, ins):
    dy, x = ins
    shape = tuple(node.attr("weight_shape"))
    return conv_grad_weight(dy, x, window(node, x.shape[2:], shape[2:]), int(node.attr("group", 1)), shape)


def _conv_grad_input_grad(g: GradContext):
    """ConvGradInput is linear in dY and in W: a Conv of the incoming gradient for dY, the weight
    gradient with input and output swapped for W (ConvTranspose and double backward use this)."""
    attrs = {k: v for k in ("kernel_shape", "strides", "dilations", "pads", "group")
             if (v := g.node.attr(k)) is not None}
    dy, w = g.x[0], g.x[1]
    ddy = g.op("Conv", [g.dy, w], **attrs) if g.need(0) else None
    dw = g.op("ConvGradWeight", [dy, g.dy], **attrs, weight_shape=list(g.shape(w))) if g.need(1) else None
    return [ddy, dw]


defop("ConvGradInput", infer=_grad_input_infer, forward=_conv_grad_input_forward, grad=_conv_grad_input_grad,
      internal=True)
defop("ConvGradWeight", internal=True, forward=_conv_grad_weight_forward,
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, tuple(int(d) for d in node.attr("weight_shape")))])


# -- pooling -----------------------------------------------------------------------------------
def _pool_window(node: Node, x_shape) -> Window:
    kernel = node.attr("kernel_shape")
    if kernel is None:
        raise ShapeError(f"{node.label}: {node.op} needs the kernel_shape attribute")
    return window(node, x_shape[2:], kernel, bool(node.attr("ceil_mode", 0)))


def _pool_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    if len(node.outputs) > 1 and node.outputs[1]:
        raise UnsupportedOpError(f"{node.label}: the Indices output of MaxPool is not supported; export "
                                 "the model without return_indices")
    x = ins[0]
    win = _pool_window(node, x.shape)
    return [TensorInfo(x.dtype, tuple(x.shape[:2]) + win.out)]


def _max_pool_forward(node, ins):
    x = ins[0]
    win = _pool_window(node, x.shape)
    lowest = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min  # padding never wins
    xp = win.pad(x, lowest)
    y = None
    for _, sl in win.taps():
        y = xp[sl].copy() if y is None else np.maximum(y, xp[sl], out=y)
    return y


def _max_pool_grad_forward(node, ins):
    """Each output's gradient goes to the first maximum of its window (row-major), as PyTorch."""
    dy, x = ins
    win = _pool_window(node, x.shape)
    xp = win.pad(x, -np.inf)
    taps = list(win.taps())
    best = xp[taps[0][1]].copy()
    arg = np.zeros(best.shape, np.int32)
    for t, (_, sl) in enumerate(taps[1:], start=1):
        better = xp[sl] > best  # strict: ties keep the earlier tap
        np.copyto(best, xp[sl], where=better)
        arg[better] = t
    dxp = np.zeros(xp.shape, dy.dtype)
    for t, (_, sl) in enumerate(taps):
        dxp[sl] += np.where(arg == t, dy, 0)
    return win.crop(dxp)


def _pool_attrs(node: Node, win: Window) -> dict:
    return {**win.attrs(), "ceil_mode": int(node.attr("ceil_mode", 0)),
            "count_include_pad": int(node.attr("count_include_pad", 0))}


def _max_pool_grad(g: GradContext):
    win = _pool_window(g.node, g.shape(g.x[0]))
    return [g.op("MaxPoolGrad", [g.dy, g.x[0]], **_pool_attrs(g.node, win))]


defop("MaxPool", infer=_pool_infer, forward=_max_pool_forward, grad=_max_pool_grad)
defop("MaxPoolGrad", infer=lambda node, ins: [TensorInfo(ins[0].dtype, ins[1].shape)],
      forward=_max_pool_grad_forward, internal=True)


def _window_counts(node: Node, win: Window) -> np.ndarray:
    """How many elements each average divides by, shape (*out).

    count_include_pad counts the explicit padding but never ceil_mode's overhang (PyTorch)."""
    inside = np.zeros(win.padded, np.float32)
    if node.attr("count_include_pad", 0):
        inside[tuple(slice(0, i + b + e) for i, b, e in zip(win.spatial, win.begin, win.end))] = 1
    else:
        inside[tuple(slice(b, b + i) for i, b in zip(win.spatial, win.begin))] = 1
    inside = inside[None, None]
    counts = sum(inside[sl] for _, sl in win.taps())
    return np.maximum(counts[0, 0], 1)


def _avg_pool_forward(node, ins):
    x = ins[0]
    win = _pool_window(node, x.shape)
    xp = win.pad(x)
    total = np.zeros(x.shape[:2] + win.out, x.dtype)
    for _, sl in win.taps():
        total += xp[sl]
    return (total / _window_counts(node, win)).astype(x.dtype)


def _avg_pool_grad_forward(node, ins):
    dy = ins[0]
    shape = tuple(node.attr("input_shape"))
    win = _pool_window(node, shape)
    share = (dy / _window_counts(node, win)).astype(dy.dtype)
    dxp = np.zeros(shape[:2] + win.padded, dy.dtype)
    for _, sl in win.taps():
        dxp[sl] += share
    return win.crop(dxp)


def _avg_pool_grad(g: GradContext):
    xs = g.shape(g.x[0])
    win = _pool_window(g.node, xs)
    return [g.op("AveragePoolGrad", [g.dy], **_pool_attrs(g.node, win), input_shape=list(xs))]


defop("AveragePool", infer=_pool_infer, forward=_avg_pool_forward, grad=_avg_pool_grad)
defop("AveragePoolGrad", infer=_grad_input_infer, forward=_avg_pool_grad_forward, internal=True)


def _global_avg_infer(node, ins):
    x = ins[0]
    return [TensorInfo(x.dtype, tuple(x.shape[:2]) + (1,) * (x.rank - 2))]


def _global_avg_grad(g: GradContext):
    xs = g.shape(g.x[0])
    scaled = g.op("Mul", [g.dy, g.const(1.0 / math.prod(xs[2:]), g.dtype(g.dy))])
    return [g.op("Expand", [scaled, g.const(np.array(xs, np.int64), np.int64, "shape")])]


def _global_avg_forward(node, ins):
    x = ins[0]
    return x.mean(axis=tuple(range(2, x.ndim)), keepdims=True).astype(x.dtype)


defop("GlobalAveragePool", infer=_global_avg_infer, forward=_global_avg_forward, grad=_global_avg_grad)


# -- BatchNormalization --------------------------------------------------------------------------
def _channel(v: np.ndarray, rank: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast against (N, C, ...)."""
    return v.reshape((1, -1) + (1,) * (rank - 2))


def _bn_axes(rank: int) -> tuple[int, ...]:
    return (0,) + tuple(range(2, rank))


def _bn_infer(node, ins):
    x = ins[0]
    if x.rank < 2:
        raise ShapeError(f"{node.label}: BatchNormalization needs (N, C, ...) input, got {tuple(x.shape)}")
    for slot in range(1, 5):
        if ins[slot] is not None and tuple(ins[slot].shape) != (x.shape[1],):
            raise ShapeError(f"{node.label}: input {slot} has shape {tuple(ins[slot].shape)}, expected "
                             f"({x.shape[1]},)")
    per_channel = [d for i, d in enumerate(x.shape) if i != 1]
    if node.attr("training_mode", 0) and all(isinstance(d, int) for d in per_channel) \
            and int(np.prod(per_channel)) == 1:  # batch statistics of one value: x - mean = 0, no variance
        raise ShapeError(f"{node.label}: training needs more than 1 value per channel, got input shape "
                         f"{tuple(x.shape)} (PyTorch: 'Expected more than 1 value per channel when training'). "
                         "Train with batches of 2 or more; if the last batch of an epoch holds one sample, "
                         "drop it (--drop-last, or fit(..., drop_last=True))")
    outs = [TensorInfo(x.dtype, x.shape)]
    for slot in (3, 4)[:len(node.outputs) - 1]:
        outs.append(TensorInfo(ins[slot].dtype, ins[slot].shape))
    return outs


def _bn_forward(node, ins):
    """The reference: batch statistics in double over every axis but the channel axis (the
    variance of x - mean, biased); the numpy backend runs a blocked, threaded kernel of the same
    values (backends/numpy/fastpaths.py)."""
    x, scale, bias, mean, var = ins[:5]
    eps = float(node.attr("epsilon", 1e-5))
    training = bool(node.attr("training_mode", 0))
    if training:
        axes, xd = _bn_axes(x.ndim), x.astype(np.float64)
        batch_mean = xd.mean(axis=axes)
        batch_var = np.square(xd - _channel(batch_mean, x.ndim)).mean(axis=axes)
        a = scale * (1.0 / np.sqrt(batch_var + eps))
        y = ((xd - _channel(batch_mean, x.ndim)) * _channel(a, x.ndim) + _channel(bias, x.ndim)).astype(x.dtype)
    else:
        a = scale * (1.0 / np.sqrt(var.astype(np.float64) + eps))
        y = (x * _channel(a.astype(x.dtype), x.ndim)
             + _channel((bias - mean * a).astype(x.dtype), x.ndim)).astype(x.dtype, copy=False)
    return batch_norm_outputs(node, y, mean, var, (batch_mean, batch_var) if training else None, x.size // x.shape[1])


def batch_norm_outputs(node: Node, y: np.ndarray, mean: np.ndarray, var: np.ndarray,
                       batch: tuple[np.ndarray, np.ndarray] | None, n: int) -> list[np.ndarray]:
    """BatchNormalization's outputs from its normalised y: y alone, or with the running mean and
    variance, passed through at inference (batch None) or updated in training from the batch's
    (mean, biased variance) over n values per channel. Shared by the reference kernel and the numpy
    backend's blocked one (backends/numpy/fastpaths.py) so the two cannot drift apart."""
    if len(node.outputs) == 1:
        return [y]
    if batch is None:
        return [y, mean.copy(), var.copy()][:len(node.outputs)]
    return [y, *batch_norm_running_stats(node, mean, var, *batch, n)][:len(node.outputs)]


def batch_norm_running_stats(node: Node, mean: np.ndarray, var: np.ndarray, batch_mean: np.ndarray,
                             batch_var: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """BatchNorm's new running mean and variance after a batch of n values per channel.
    PyTorch semantics, not ONNX's: the running variance tracks the UNBIASED batch variance
    (n / (n - 1)), as torch.nn.BatchNorm does, while normalisation uses the biased one."""
    momentum = float(node.attr("momentum", 0.9))
    unbiased = batch_var * (n / max(n - 1, 1))
    running_mean = mean * momentum + batch_mean * (1 - momentum)
    running_var = var * momentum + unbiased * (1 - momentum)
    return running_mean.astype(mean.dtype), running_var.astype(var.dtype)


def _bn_grad_forward(node, ins):
    """(dX, dscale, dbias); batch statistics recomputed (training) or given (training=0).
    The reference in double; the numpy backend's blocked kernel: backends/numpy/fastpaths.py."""
    dy, x, scale = ins[:3]
    eps = float(node.attr("epsilon", 1e-5))
    training = bool(node.attr("training", 1))
    axes, xd, dyd = _bn_axes(x.ndim), x.astype(np.float64), dy.astype(np.float64)
    if training:
        mean = xd.mean(axis=axes)
        var = np.square(xd - _channel(mean, x.ndim)).mean(axis=axes)
    else:
        mean, var = ins[3].astype(np.float64), ins[4].astype(np.float64)
    inv = 1.0 / np.sqrt(var + eps)
    xhat = (xd - _channel(mean, x.ndim)) * _channel(inv, x.ndim)
    dbias, dscale = dyd.sum(axis=axes), (dyd * xhat).sum(axis=axes)
    k = scale * inv
    dparams = [dscale.astype(scale.dtype), dbias.astype(scale.dtype)]
    if not training:
        return [(dyd * _channel(k, x.ndim)).astype(x.dtype)] + dparams
    # The batch statistics depend on x too (mean and variance terms of the chain rule):
    # dx = k * (dy - dbias / n - xhat * dscale / n).
    n = x.size // x.shape[1]
    dx = _channel(k, x.ndim) * (dyd - _channel(dbias / n, x.ndim) - xhat * _channel(dscale / n, x.ndim))
    return [dx.astype(x.dtype)] + dparams


def _bn_grad(g: GradContext):
    x, scale = g.x[0], g.x[1]
    eps = float(g.node.attr("epsilon", 1e-5))
    if g.node.attr("training_mode", 0):
        outs = g.ops("BatchNormGrad", [g.dy, x, scale], 3, epsilon=eps)
    else:
        outs = g.ops("BatchNormGrad", [g.dy, x, scale, g.x[3], g.x[4]], 3, epsilon=eps, training=0)
    return outs + [None, None]


def _bn_set_mode(graph: Graph, node: Node, training: bool) -> None:
    if not training:
        node.attrs["training_mode"] = 0
        for out in node.outputs[1:]:
            graph.state_updates.pop(out, None)
        del node.outputs[1:]
        return
    node.attrs["training_mode"] = 1
    while len(node.outputs) < 3:
        node.outputs.append("")
    base = node.name or node.outputs[0]
    for slot, hint in ((1, "running_mean"), (2, "running_var")):
        if not node.outputs[slot]:
            node.outputs[slot] = graph.fresh(f"{base}.{hint}")
        state = node.inputs[slot + 2]
        graph.state_updates[node.outputs[slot]] = state
        if state in graph.params:
            graph.params.remove(state)
        if state not in graph.buffers:
            graph.buffers.append(state)


def _bn_grad_infer(node, ins):
    return [TensorInfo(ins[1].dtype, ins[1].shape), TensorInfo(ins[2].dtype, ins[2].shape),
            TensorInfo(ins[2].dtype, ins[2].shape)]


defop("BatchNormalization", infer=_bn_infer, forward=_bn_forward, grad=_bn_grad, nondiff=[3, 4],
      set_mode=_bn_set_mode)
defop("BatchNormGrad", infer=_bn_grad_infer, forward=_bn_grad_forward, internal=True)


# -- Dropout -------------------------------------------------------------------------------------
def _const_input(value, node: Node, slot: int, default):
    """The value of a constant optional input (TensorInfo at infer time, array at run time)."""
    if value is None:
        return default
    if isinstance(value, TensorInfo):
        if value.const is None:
            raise ShapeError(f"{node.label}: input {slot} must be a constant (known when the model "
                             "is compiled)")
        value = value.const
    return np.asarray(value).reshape(()).item()


def dropout_ratio(node: Node, value) -> float:
    """The drop probability: input 1 (opset 12+), else the `ratio` attribute of opsets 7-11, else
    0.5. `value` is input 1's TensorInfo (compile time) or array (run time), None when absent."""
    return float(_const_input(value, node, 1, node.attr("ratio", 0.5)))


def _dropout_infer(node, ins):
    ratio = dropout_ratio(node, ins[1] if len(ins) > 1 else None)
    if not 0 <= ratio < 1:
        raise ShapeError(f"{node.label}: dropout ratio {ratio} must be in [0, 1)")
    x = ins[0]
    return [TensorInfo(x.dtype, x.shape), TensorInfo(np.dtype(bool), x.shape)][:max(1, len(node.outputs))]


def dropout_scale(ratio: float) -> np.float32:
    """Kept elements are multiplied by this: float32(1 / (1 - ratio)), computed in double."""
    return np.float32(1.0 / (1.0 - ratio))


def _dropout_forward(node, ins):
    x = ins[0]
    ratio = dropout_ratio(node, ins[1] if len(ins) > 1 else None)
    training = bool(_const_input(ins[2] if len(ins) > 2 else None, node, 2, False))
    if not training or ratio == 0:
        return [x.copy(), np.ones(x.shape, bool)]
    state = ins[3] if len(ins) > 3 else None
    if state is None:
        raise AnygradError(f"{node.label}: Dropout in training mode needs the RNG state input "
                           f"'{RNG_STATE}'; prepare the graph with set_training_mode")
    seed, counter = (int(v) for v in np.asarray(state).reshape(-1)[:2])
    u = rng.uniform(seed, counter, int(node.attr("salt", 0)), x.size).reshape(x.shape)
    mask = u >= np.float32(ratio)
    return [(x * (mask * dropout_scale(ratio))).astype(x.dtype), mask]


def _dropout_grad(g: GradContext):
    ratio = dropout_ratio(g.node, g.info(g.x[1]) if g.node.input(1) else None)
    training = bool(_const_input(g.info(g.x[2]) if g.node.input(2) else None, g.node, 2, False))
    if not training or ratio == 0:
        return [g.dy]
    if len(g.y) < 2 or not g.y[1]:
        raise AnygradError(f"{g.node.label}: training-mode Dropout needs its mask output for the gradient; "
                           "prepare the graph with set_training_mode")
    return [g.op("DropoutGrad", [g.dy, g.y[1]], ratio=ratio)]


def _dropout_set_mode(graph: Graph, node: Node, training: bool) -> None:
    inputs = node.inputs[:2]
    if not training:
        while inputs and not inputs[-1]:
            inputs.pop()
        node.inputs = inputs
        return
    inputs += [""] * (2 - len(inputs))
    flag = np.array(True)
    name = graph.fresh(f"{node.name or node.outputs[0]}.training_mode")
    graph.initializers[name] = flag
    graph.info[name] = info_of(flag)
    node.inputs = inputs + [name, RNG_STATE]
    # A stable per-node salt: this node's position among the graph's Dropout nodes.
    dropouts = [n for n in graph.nodes if n.op == "Dropout"]
    node.attrs["salt"] = next(i for i, n in enumerate(dropouts) if n is node)
    if len(node.outputs) < 2 or not node.outputs[1]:
        node.outputs[1:] = [graph.fresh(f"{node.name or node.outputs[0]}.mask")]


defop("Dropout", infer=_dropout_infer, forward=_dropout_forward, grad=_dropout_grad,
      nondiff=[1, 2, 3], foldable=False, set_mode=_dropout_set_mode)
def _dropout_grad_forward(node, ins):
    dy, mask = ins
    return (dy * (mask * dropout_scale(float(node.attr("ratio", 0.5))))).astype(dy.dtype)


defop("DropoutGrad", infer=same_as_first, forward=_dropout_grad_forward, internal=True)


# -- Softmax / LogSoftmax ------------------------------------------------------------------------
def _axis(node: Node, x: np.ndarray) -> int:
    return norm_axis(int(node.attr("axis", -1)), x.ndim)


def _softmax(node, ins):
    x = ins[0]
    e = np.exp(x - x.max(axis=_axis(node, x), keepdims=True))
    return (e / e.sum(axis=_axis(node, x), keepdims=True)).astype(x.dtype)


def _log_softmax(node, ins):
    x = ins[0]
    shifted = x - x.max(axis=_axis(node, x), keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=_axis(node, x), keepdims=True))).astype(x.dtype)


def _softmax_grad_forward(node, ins):
    dy, y = ins
    return (y * (dy - (dy * y).sum(axis=_axis(node, y), keepdims=True))).astype(dy.dtype)


def _log_softmax_grad_forward(node, ins):
    dy, y = ins
    return (dy - np.exp(y) * dy.sum(axis=_axis(node, y), keepdims=True)).astype(dy.dtype)


def _grad_via(op: str):
    return lambda g: [g.op(op, [g.dy, g.y[0]], axis=int(g.node.attr("axis", -1)))]


defop("Softmax", infer=same_as_first, forward=_softmax, grad=_grad_via("SoftmaxGrad"))
defop("LogSoftmax", infer=same_as_first, forward=_log_softmax, grad=_grad_via("LogSoftmaxGrad"))
defop("SoftmaxGrad", infer=same_as_first, forward=_softmax_grad_forward, internal=True)
defop("LogSoftmaxGrad", infer=same_as_first, forward=_log_softmax_grad_forward, internal=True)
