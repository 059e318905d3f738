"""Neural-network lowerings: convolutions and their gradients, pooling, BatchNorm, Dropout,
Softmax. Windows (pads, auto_pad, strides, dilations) are resolved by `ops.nn.window`, the
same rule the reference kernels use; asymmetric pads become an explicit pad of the input."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import settings
from ...ops.nn import Window
from . import rng
from .lowering import Site, is_float, lowering


def _pad_list(win: Window) -> list[int]:
    """F.pad's (last dim first) pads from a window's begin/end pads."""
    out: list[int] = []
    for b, e in reversed(list(zip(win.begin, win.end))):
        out += [b, e]
    return out


def _symmetric(win: Window) -> bool:
    return tuple(win.begin) == tuple(win.end)


def _pad(x: Any, win: Window, value: float = 0.0) -> Any:
    """x padded to the window's padded shape (begin pads, then end pads and any overhang)."""
    import torch.nn.functional as F
    pads: list[int] = []
    for i, b, p in reversed(list(zip(win.spatial, win.begin, win.padded))):
        pads += [b, p - i - b]
    return F.pad(x, pads, value=value) if any(pads) else x


def _crop(xp: Any, win: Window) -> Any:
    return xp[win.interior]


def _conv_fn(nd: int) -> Any:
    import torch.nn.functional as F
    return {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}.get(nd)


@lowering("Conv")
def _conv(site: Site):
    x_shape = site.shape(0)
    nd = len(x_shape) - 2
    if _conv_fn(nd) is None or not is_float(site.dtype(0)):
        return None
    win = Window.of(site.node, x_shape[2:])
    group, conv = int(site.attr("group", 1)), _conv_fn(nd)
    sym = _symmetric(win)
    has_b = site.has(2)
    same = site.dtype(1) == site.dtype(0)  # else the weight is cast per step

    def run(ins):
        x, w = ins[0], ins[1] if same else ins[1].to(ins[0].dtype)
        b = ins[2] if has_b else None
        if sym:
            return [conv(x, w, b, win.strides, list(win.begin), win.dilations, group)]
        return [conv(_pad(x, win), w, b, win.strides, 0, win.dilations, group)]
    return run


def _stand_in(site: Site, shape: tuple) -> Any:
    """fn(dy) -> a tensor of `shape` whose values are never read (an operand a backward kernel
    takes for its shape): one element expanded (torch.nn.grad's way), kept per device and dtype
    in an eager executable, made in the traced function under torch.compile (Site.memo is None)."""
    if site.memo is None:
        return lambda dy: dy.new_empty(1).expand(shape)
    made: dict[tuple, Any] = {}

    def get(dy: Any) -> Any:
        key = (dy.device, dy.dtype)
        t = made.get(key)
        if t is None:
            t = made[key] = dy.new_empty(1).expand(shape)
        return t
    return get


def _conv_backward(site: Site, nd: int, stride: Any, padding: Any, dilation: Any, group: int, which: int,
                   shape: tuple) -> Any:
    """aten.convolution_backward for one gradient (0: input, 1: weight) of `shape`, as a function
    of (dy, the other operand); the operand whose gradient is wanted is read for its shape only."""
    import torch
    backward = torch.ops.aten.convolution_backward
    mask = (which == 0, which == 1, False)
    stride, padding, dilation, zeros = list(stride), list(padding), list(dilation), [0] * nd
    stand_in = _stand_in(site, shape)

    def run(dy: Any, other: Any) -> Any:
        x, w = (stand_in(dy), other) if which == 0 else (other, stand_in(dy))
        return backward(dy, x, w, None, stride, padding, dilation, False, zeros, group, mask)[which]
    return run


@lowering("ConvGradInput")
def _conv_grad_input(site: Site):
    shape = tuple(int(d) for d in site.attr("input_shape"))
    nd = len(shape) - 2
    if not 1 <= nd <= 3 or not is_float(site.dtype(0)):
        return None
    win = Window.of(site.node, shape[2:])
    group = int(site.attr("group", 1))
    padded = shape[:2] + tuple(win.padded)
    same = site.dtype(1) == site.dtype(0)
    if _symmetric(win) and padded == tuple(s + b + e for s, b, e in zip(shape, (0, 0) + win.begin, (0, 0) + win.end)):
        grad = _conv_backward(site, nd, win.strides, win.begin, win.dilations, group, 0, shape)
        return lambda ins: [grad(ins[0], ins[1] if same else ins[1].to(ins[0].dtype))]
    grad = _conv_backward(site, nd, win.strides, [0] * nd, win.dilations, group, 0, padded)
    return lambda ins: [_crop(grad(ins[0], ins[1] if same else ins[1].to(ins[0].dtype)), win)]


@lowering("ConvGradWeight")
def _conv_grad_weight(site: Site):
    w_shape = tuple(int(d) for d in site.attr("weight_shape"))
    x_shape = site.shape(1)
    nd = len(x_shape) - 2
    if not 1 <= nd <= 3 or not is_float(site.dtype(0)):
        return None
    win = Window.of(site.node, x_shape[2:])
    group = int(site.attr("group", 1))
    same = site.dtype(1) == site.dtype(0)
    if _symmetric(win):
        grad = _conv_backward(site, nd, win.strides, win.begin, win.dilations, group, 1, w_shape)
        return lambda ins: [grad(ins[0], ins[1] if same else ins[1].to(ins[0].dtype))]
    grad = _conv_backward(site, nd, win.strides, [0] * nd, win.dilations, group, 1, w_shape)
    return lambda ins: [grad(ins[0], _pad(ins[1] if same else ins[1].to(ins[0].dtype), win))]


# -- pooling -----------------------------------------------------------------------------------
def _pool_window(site: Site) -> Window | None:
    kernel = site.attr("kernel_shape")
    if kernel is None:
        return None
    return Window.of(site.node, site.shape(1 if site.node.op == "MaxPoolGrad" else 0)[2:])


def _as_2d(x: Any, nd: int) -> Any:
    return x.unsqueeze(2) if nd == 1 else x


def _pool_args(win: Window) -> tuple:
    """(kernel, stride, dilation) for torch's 2-D/3-D pools (1-D pools run as 2-D, height 1)."""
    if win.nd == 1:
        return (1,) + win.kernel, (1,) + win.strides, (1,) + win.dilations
    return win.kernel, win.strides, win.dilations


@lowering("MaxPool")
def _max_pool(site: Site):
    win = _pool_window(site)
    if win is None or win.nd > 3 or not is_float(site.dtype(0)) or len([o for o in site.node.outputs if o]) > 1:
        return None
    import torch.nn.functional as F
    pool = F.max_pool3d if win.nd == 3 else F.max_pool2d
    kernel, stride, dilation = _pool_args(win)
    out = tuple(win.out)
    nd = win.nd

    def run(ins):
        xp = _as_2d(_pad(ins[0], win, -math.inf), nd)
        y = pool(xp, kernel, stride, 0, dilation)
        y = y.squeeze(2) if nd == 1 else y
        return [y[(slice(None), slice(None)) + tuple(slice(0, o) for o in out)]]
    return run


@lowering("MaxPoolGrad")
def _max_pool_grad(site: Site):
    win = _pool_window(site)
    if win is None or win.nd > 3 or not is_float(site.dtype(0)):
        return None
    import torch
    kernel, stride, dilation = _pool_args(win)
    nd = win.nd
    if nd == 3:
        fwd, bwd = torch.ops.aten.max_pool3d_with_indices, torch.ops.aten.max_pool3d_with_indices_backward
    else:
        fwd, bwd = torch.ops.aten.max_pool2d_with_indices, torch.ops.aten.max_pool2d_with_indices_backward

    def run(ins):
        dy, x = ins
        xp = _as_2d(_pad(x, win, -math.inf), nd)
        y, idx = fwd(xp, kernel, stride, 0, dilation, False)
        dy = _as_2d(dy, nd)
        if tuple(dy.shape) != tuple(y.shape):  # ceil_mode's dropped last window: no gradient
            full = dy.new_zeros(y.shape)
            full[tuple(slice(0, s) for s in dy.shape)] = dy
            dy = full
        dxp = bwd(dy, xp, kernel, stride, 0, dilation, False, idx)
        return [_crop(dxp.squeeze(2) if nd == 1 else dxp, win)]
    return run


@lowering("AveragePool")
def _avg_pool(site: Site):
    win = _pool_window(site)
    if (win is None or not 1 <= win.nd <= 3 or not is_float(site.dtype(0)) or any(d != 1 for d in win.dilations)
            or not _symmetric(win) or any(2 * b > k for b, k in zip(win.begin, win.kernel))):
        return None
    import torch.nn.functional as F
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[win.nd]
    ceil, include = bool(site.attr("ceil_mode", 0)), bool(site.attr("count_include_pad", 0))
    out = tuple(win.out)

    def run(ins):
        y = pool(ins[0], win.kernel, win.strides, list(win.begin), ceil, include)
        return [y if tuple(y.shape[2:]) == out else y[(slice(None), slice(None)) + tuple(slice(0, o) for o in out)]]
    return run


@lowering("AveragePoolGrad")
def _avg_pool_grad(site: Site):
    """aten's average-pool backward, under the forward lowering's conditions (symmetric pads
    within half a window, no dilation) and where torch's pooled shape is the node's (ceil_mode
    may give torch one more window: the reference kernel runs)."""
    import torch
    shape = tuple(int(d) for d in site.attr("input_shape"))
    kernel = site.attr("kernel_shape")
    if kernel is None or not is_float(site.dtype(0)):
        return None
    win = Window.of(site.node, shape[2:])
    if (not 1 <= win.nd <= 3 or any(d != 1 for d in win.dilations) or not _symmetric(win)
            or any(2 * b > k for b, k in zip(win.begin, win.kernel))):
        return None
    ceil, include = bool(site.attr("ceil_mode", 0)), bool(site.attr("count_include_pad", 0))
    nd = win.nd
    as_nd = 2 if nd == 1 else nd  # 1-D pools run as 2-D ones of height 1
    k, st, pad = ((1,) + win.kernel, (1,) + win.strides, (0,) + tuple(win.begin)) if nd == 1 else (
        win.kernel, win.strides, tuple(win.begin))
    shape_nd = shape[:2] + (1,) + shape[2:] if nd == 1 else shape
    pool = {2: torch.nn.functional.avg_pool2d, 3: torch.nn.functional.avg_pool3d}[as_nd]
    pooled = pool(torch.empty(shape_nd, device="meta"), k, st, pad, ceil, include).shape
    if tuple(pooled[2:]) != (1,) * (nd == 1) + tuple(win.out):
        return None
    backward = {2: torch.ops.aten.avg_pool2d_backward, 3: torch.ops.aten.avg_pool3d_backward}[as_nd]
    stand_in = _stand_in(site, shape_nd)  # the input is read for its shape only

    def run(ins):
        dy = ins[0].unsqueeze(2) if nd == 1 else ins[0]
        dx = backward(dy, stand_in(dy), k, st, pad, ceil, include, None)
        return [dx.squeeze(2) if nd == 1 else dx]
    return run


@lowering("GlobalAveragePool")
def _global_avg(site: Site):
    if not is_float(site.dtype(0)):
        return None
    dims = list(range(2, len(site.shape(0))))
    return lambda ins: [ins[0].mean(dim=dims, keepdim=True)]


# -- BatchNormalization ------------------------------------------------------------------------
def _channel(v: Any, rank: int) -> Any:
    return v.reshape((1, -1) + (1,) * (rank - 2))


def _memo_stats(cell: list | None, x, compute) -> tuple:
    """The statistics the forward kernel left in `cell` for this same tensor x (taken once: the
    same bits as computing them again), else compute()."""
    if cell is not None and cell[0] is not None and cell[0][0] is x:
        stats, cell[0] = cell[0][1:], None
        return tuple(stats)
    return tuple(compute())


def _stats_cell(site: Site, x: str, axes: list[int]) -> list | None:
    """Where BatchNormalization leaves its batch statistics of `x` for BatchNormGrad (on CPU,
    computing them is as costly as the normalisation itself); None when the executable shares
    nothing."""
    if site.memo is None:
        return None
    return site.memo.setdefault(("batch_stats", x, tuple(axes)), [None])


def _fused_norms() -> Callable[[Any, Any], bool]:
    """Whether a training batch norm of (x, scale) runs through aten's fused kernels (2 passes
    forward, 2 backward, where the double-precision path below takes ~10 launches each:
    ResNet-18's torch step made 1,462 kernel launches against PyTorch's 365, and its host time
    was the step). On GPUs by default; on the CPU the double path, whose trajectories match the
    numpy backend's to float32 tolerance. ANYGRAD_TORCH_FUSED_NORMS=1/0 forces either; it is
    read when the kernel is built, the device is seen when it runs."""
    forced = settings.get("ANYGRAD_TORCH_FUSED_NORMS")
    return lambda x, scale: (x.device.type != "cpu" if forced is None else forced) \
        and x.dtype == scale.dtype and x.dim() >= 2


# BatchNormalization and BatchNormGrad keep the reference's per-channel arithmetic in double
# (torch's fused batch-norm kernels, float32 throughout, move a weight of the founding CNN by
# ~1e-4 of its scale from the numpy backend's over 10 SGD steps with momentum: past the
# trajectory tests' float32 tolerance). The batch statistics are var_mean's, computed once in
# the forward and handed to BatchNormGrad when the executable shares values (Site.memo), else
# recomputed by the same op: the same bits either way.
@lowering("BatchNormalization")
def _batch_norm(site: Site):
    if not is_float(site.dtype(0)):
        return None
    import torch
    shape = site.shape(0)
    rank, axes = len(shape), [0] + list(range(2, len(shape)))
    eps = float(site.attr("epsilon", 1e-5))
    momentum = float(site.attr("momentum", 0.9))
    training = bool(site.attr("training_mode", 0))
    n = int(np.prod(shape)) // shape[1]
    n_out = len(site.node.outputs)
    cell = _stats_cell(site, site.node.inputs[0], axes)
    fused = _fused_norms()

    def run(ins):
        x, scale, bias, mean, var = ins[:5]
        dt = x.dtype
        if not training:
            a = scale.double() * (1.0 / torch.sqrt(var.double() + eps))
            y = x * _channel(a.to(dt), rank) + _channel((bias - mean * a).to(dt), rank)
            return [y, mean, var][:n_out]
        if fused(x, scale):
            rm, rv = mean.clone(), var.clone()  # aten updates them in place, as PyTorch's momentum does
            if cell is None:  # nothing to hand the backward: it recomputes the statistics
                y = torch.ops.aten.native_batch_norm(x, scale, bias, rm, rv, True, 1.0 - momentum, eps)[0]
                return [y, rm, rv][:n_out]
            # PyTorch's own choice of implementation (cuDNN's kernels for 4-D CUDA input, 1.3x
            # faster than aten's native ones on the founding CNN), whose saved values and
            # implementation index the backward takes
            y, *saved = torch.ops.aten._batch_norm_impl_index(x, scale, bias, rm, rv, True, 1.0 - momentum,
                                                              eps, True)
            cell[0] = (x, *saved)
            return [y, rm, rv][:n_out]
        batch_var, batch_mean = torch.var_mean(x, dim=axes, correction=0)
        if cell is not None:
            cell[0] = (x, batch_var, batch_mean)
        bm64, bv64 = batch_mean.double(), batch_var.double()
        a = scale.double() * (1.0 / torch.sqrt(bv64 + eps))
        y = (x - _channel(batch_mean, rank)) * _channel(a.to(dt), rank) + _channel(bias.to(dt), rank)
        if n_out == 1:
            return [y]
        # PyTorch semantics: the running variance tracks the unbiased batch variance
        unbiased = bv64 * (n / max(n - 1, 1))
        running_mean = mean * momentum + bm64 * (1 - momentum)
        running_var = var * momentum + unbiased * (1 - momentum)
        return [y, running_mean, running_var][:n_out]
    return run


@lowering("BatchNormGrad")
def _batch_norm_grad(site: Site):
    """(dy, x, scale[, mean, var]) -> (dx, d scale, d bias): the per-channel arithmetic in double,
    as the reference does it. (aten's fused backward, float32 throughout, moves a small dx by
    ~1e-3 of itself where its terms cancel, and SGD's momentum carries that on.)"""
    if not is_float(site.dtype(0)):
        return None
    import torch
    shape = site.shape(1)
    rank, axes = len(shape), [0] + list(range(2, len(shape)))
    eps = float(site.attr("epsilon", 1e-5))
    training = bool(site.attr("training", 1))
    n = int(np.prod(shape)) // shape[1]
    cell = _stats_cell(site, site.node.inputs[1], axes) if training else None
    fused = _fused_norms()

    def run(ins):
        dy, x, scale = ins[:3]
        dt = x.dtype
        if training and fused(x, scale):
            def stats():  # as aten's native kernels save them (implementation 0)
                var, mean = torch.var_mean(x, dim=axes, correction=0)
                return mean, torch.rsqrt(var + eps), x.new_empty(0), 0
            save_mean, save_invstd, reserve, impl = _memo_stats(cell, x, stats)
            return list(torch.ops.aten._batch_norm_impl_index_backward(
                impl, x, dy, scale, None, None, save_mean, save_invstd, True, eps, [True, True, True], reserve))
        if training:
            var, mean = _memo_stats(cell, x, lambda: torch.var_mean(x, dim=axes, correction=0))
            var = var.double()
        else:
            mean, var = ins[3].to(dt), ins[4].double()
        centered = x - _channel(mean, rank)
        dbias = dy.sum(dim=axes).double()
        dot = (dy * centered).sum(dim=axes).double()
        inv = 1.0 / torch.sqrt(var + eps)
        k = scale.double() * inv
        dscale = dot * inv
        dparams = [dscale, dbias]
        if not training:
            return [dy * _channel(k.to(dt), rank)] + dparams
        # -(k * inv * dscale) / n is (k * inv * dscale) / -n, bit for bit: one op fewer each
        alpha, beta = (k * inv * dscale / -n).to(dt), (k * dbias / -n).to(dt)
        dx = dy * _channel(k.to(dt), rank) + (centered * _channel(alpha, rank) + _channel(beta, rank))
        return [dx] + dparams
    return run


# -- Dropout -----------------------------------------------------------------------------------
@lowering("Dropout")
def _dropout(site: Site):
    ratio, training = site.attr("ratio"), site.attr("training_mode")
    if ratio is None or training is None:
        return None  # a ratio or training flag known only at run time: the reference kernel decides
    ratio, training = float(ratio), bool(training)
    import torch
    if not training or ratio == 0:
        return lambda ins: [ins[0], torch.ones(ins[0].shape, dtype=torch.bool, device=ins[0].device)]
    if not site.has(3):
        return None  # the reference kernel raises the error that explains it
    salt, shape = int(site.attr("salt", 0)), site.shape(0)
    size = int(np.prod(shape))
    scale = float(np.float32(1.0 / (1.0 - ratio)))  # ops.nn.dropout_scale
    ratio32 = float(np.float32(ratio))

    least = rng.at_least(ratio32)  # u >= ratio  <=>  word >= least: no float draws made

    def run(ins):
        x, state = ins[0], ins[3]  # the state, or its key where the host holds the state
        mask = (rng.uniform_bits(state, salt, size, x.device) >= least).reshape(shape)
        return [x * (mask.to(x.dtype) * scale), mask]
    run.host_inputs = {3: functools.partial(rng.host_key, salt=salt)}  # type: ignore[attr-defined]
    return run


@lowering("DropoutGrad")
def _dropout_grad(site: Site):
    scale = float(np.float32(1.0 / (1.0 - float(site.attr("ratio", 0.5)))))
    return lambda ins: [ins[0] * (ins[1].to(ins[0].dtype) * scale)]


# -- Softmax -------------------------------------------------------------------------------------
@lowering("Softmax", "LogSoftmax", "SoftmaxGrad", "LogSoftmaxGrad")
def _softmax(site: Site):
    if not is_float(site.dtype(0)):
        return None
    import torch
    axis = int(site.resolved("axis"))
    op = site.node.op
    if op == "Softmax":
        return lambda ins: [torch.softmax(ins[0], dim=axis)]
    if op == "LogSoftmax":
        return lambda ins: [torch.log_softmax(ins[0], dim=axis)]
    if op == "SoftmaxGrad":
        # (dy, y) -> y * (dy - sum(dy * y)): aten's one-kernel backward (the written-out form took 4
        # launches per attention layer). LogSoftmaxGrad, once per model (the loss), keeps the
        # reference's own arithmetic: aten's moved an MNIST weight past the trajectory tolerance.
        return lambda ins: [torch._softmax_backward_data(ins[0], ins[1], axis, ins[1].dtype)]
    return lambda ins: [ins[0] - torch.exp(ins[1]) * ins[0].sum(dim=axis, keepdim=True)]


# -- LayerNormalization ---------------------------------------------------------------------------
def _layer_norm_setup(site: Site, stash_type: int = 1):
    """(normalised axes, epsilon, compute dtype) as ops.norm reads them: the axes from `axis` to
    the last; float64 inputs (or stash_type 11, double) compute in float64, all else in float32.
    None where torch cannot run the node (x, or a gradient's dy, x and scale, not floats; an axis
    out of range)."""
    import torch
    x_slot = 0 if site.node.op in ("LayerNormalization", "RMSNormalization") else 1  # else a gradient: dy first
    if not all(is_float(site.dtype(k)) for k in ((0,) if x_slot == 0 else (0, 1, 2))):
        return None
    rank = len(site.shape(x_slot))
    axis = int(site.resolved("axis"))
    if not 0 <= axis < rank:
        return None
    x_dtype = site.dtype(x_slot)
    double = x_dtype == np.float64 or int(stash_type) == 11
    return list(range(axis, rank)), float(site.attr("epsilon", 1e-5)), torch.float64 if double else torch.float32


def _standardize(x: Any, axes: list[int], eps: float) -> tuple[Any, Any, Any]:
    """(xhat, mean, 1/std) over `axes`, kept dims: the reference's mean of squared deviations."""
    import torch
    mean = x.mean(dim=axes, keepdim=True)
    centered = x - mean
    inv = torch.rsqrt((centered * centered).mean(dim=axes, keepdim=True) + eps)
    return centered * inv, mean, inv


def _fused_layer_norm(site: Site, x_slot: int, dt: Any) -> bool:
    """Whether torch's fused layer-norm kernels compute this node: statistics in the data's own
    dtype (not float16 data with float32 statistics), every input of that dtype, scale and bias
    of exactly the normalised shape (not merely broadcastable to it)."""
    import torch
    x = site.dtype(x_slot)
    norm = site.shape(x_slot)[_layer_norm_setup(site)[0][0]:] if x_slot else None
    return (dt == {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}.get(x)
            and all(site.dtype(k) == x for k in range(len(site.ins)) if site.has(k))
            and (norm is None or site.shape(2) == norm))


def _ln_cell(site: Site, x: str, axes: list[int], eps: float) -> list | None:
    """Where LayerNormalization leaves (x, mean, 1/std) for LayerNormGrad (see _stats_cell)."""
    if site.memo is None:
        return None
    return site.memo.setdefault(("layer_stats", x, tuple(axes), eps), [None])


# LayerNormalization and LayerNormGrad run on torch's fused kernels (aten.native_layer_norm and
# its backward: one launch each, where the per-op form below takes 9 and 18) when the statistics
# are computed in the data's dtype. The gradient takes the forward's mean and 1/std of the same
# tensor (Site.memo), else gets them from the same fused forward: the same bits either way.
@lowering("LayerNormalization")
def _layer_norm(site: Site):
    """(x, scale, bias?) -> y [, mean, 1/std] in the stash dtype (the runtime casts)."""
    setup = _layer_norm_setup(site, site.attr("stash_type", 1))
    if setup is None:
        return None
    axes, eps, dt = setup
    norm = list(site.shape(0)[axes[0]:])
    if not _fused_layer_norm(site, 0, dt) or any(list(site.shape(k)) != norm for k in (1, 2) if site.has(k)):
        return _layer_norm_ops(axes, eps, dt)
    import torch
    fused = torch.ops.aten.native_layer_norm
    cell = _ln_cell(site, site.node.inputs[0], axes, eps)

    def layer_norm(ins):
        x = ins[0]
        y, mean, inv = fused(x, norm, ins[1], ins[2] if len(ins) > 2 else None, eps)
        if cell is not None:
            cell[0] = (x, mean, inv)
        return [y, mean, inv]
    return layer_norm


def _layer_norm_ops(axes: list[int], eps: float, dt: Any):
    def layer_norm(ins):
        x, scale = ins[0], ins[1]
        bias = ins[2] if len(ins) > 2 else None
        xhat, mean, inv = _standardize(x.to(dt), axes, eps)
        y = xhat * scale.to(dt)
        if bias is not None:
            y = y + bias.to(dt)
        return [y, mean, inv]
    return layer_norm


@lowering("LayerNormGrad")
def _layer_norm_grad(site: Site):
    """(dy, x, scale) -> dx, d scale and d bias over x.shape[axis:] (summed over the leading,
    batch-like axes). Recomputes the statistics from x, as the reference kernel does."""
    setup = _layer_norm_setup(site)
    if setup is None:
        return None
    axes, eps, dt = setup
    if not _fused_layer_norm(site, 1, dt):
        return _layer_norm_grad_ops(axes, eps, dt)
    import torch
    fused, backward = torch.ops.aten.native_layer_norm, torch.ops.aten.native_layer_norm_backward
    norm = list(site.shape(1)[axes[0]:])
    cell = _ln_cell(site, site.node.inputs[1], axes, eps)
    mask = [True, True, True]

    def layer_norm_grad(ins):
        dy, x, scale = ins
        mean, inv = _memo_stats(cell, x, lambda: fused(x, norm, None, None, eps)[1:])
        # the bias argument only shapes d bias (sum of dy): scale has its shape and dtype
        return list(backward(dy, x, norm, mean, inv, scale, scale, mask))
    return layer_norm_grad


# RMSNormalization and RMSNormGrad (ops/norm.py's formulas; aten has no fused backward to reuse)
@lowering("RMSNormalization")
def _rms_norm(site: Site):
    """(x, scale) -> x / sqrt(mean(x^2) + eps) * scale over x.shape[axis:]."""
    setup = _layer_norm_setup(site, site.attr("stash_type", 1))
    if setup is None:
        return None
    axes, eps, dt = setup
    import torch

    def rms_norm(ins):
        x = ins[0].to(dt)
        return [x * torch.rsqrt((x * x).mean(dim=axes, keepdim=True) + eps) * ins[1].to(dt)]
    return rms_norm


@lowering("RMSNormGrad")
def _rms_norm_grad(site: Site):
    """(dy, x, scale) -> dx = inv * (g - xhat * mean(g * xhat)) with g = dy * scale, and d scale
    (dy * xhat summed over the leading axes)."""
    setup = _layer_norm_setup(site)
    if setup is None:
        return None
    axes, eps, dt = setup
    lead = list(range(axes[0]))
    import torch

    def rms_norm_grad(ins):
        dy, x = ins[0].to(dt), ins[1].to(dt)
        inv = torch.rsqrt((x * x).mean(dim=axes, keepdim=True) + eps)
        xhat = x * inv
        g = dy * ins[2].to(dt)
        dx = inv * (g - xhat * (g * xhat).mean(dim=axes, keepdim=True))
        return [dx, (dy * xhat).sum(dim=lead) if lead else dy * xhat]
    return rms_norm_grad


def _layer_norm_grad_ops(axes: list[int], eps: float, dt: Any):
    lead = list(range(axes[0]))

    def layer_norm_grad(ins):
        dy, x, scale = ins
        xhat, _, inv = _standardize(x.to(dt), axes, eps)
        dy = dy.to(dt)
        g = dy * scale.to(dt)
        dx = inv * (g - g.mean(dim=axes, keepdim=True) - xhat * (g * xhat).mean(dim=axes, keepdim=True))
        dxhat = dy * xhat
        # sum(dim=[]) would reduce every axis: with no leading axes there is nothing to sum
        return [dx, dxhat.sum(dim=lead) if lead else dxhat, dy.sum(dim=lead) if lead else dy]
    return layer_norm_grad


# -- GroupNormalization / InstanceNormalization -------------------------------------------------------
def _gn_setup(site: Site, x_slot: int) -> tuple | None:
    """(N, C, spatial size, groups) for torch's fused group-norm kernels, or None where they do
    not compute what the reference does: statistics in another dtype than the data's (float16
    data, or stash_type double), inputs of mixed dtypes."""
    shape = site.shape(x_slot)
    x = site.dtype(x_slot)
    if x not in (np.dtype(np.float32), np.dtype(np.float64)) or len(shape) < 2:
        return None
    if int(site.attr("stash_type", 1)) == 11 and x != np.dtype(np.float64):
        return None
    if any(site.dtype(k) != x for k in range(len(site.ins)) if site.has(k)):
        return None
    if site.node.op == "InstanceNormalization":
        groups = shape[1]
    else:
        groups = int(site.attr("num_groups"))
    return shape[0], shape[1], int(np.prod(shape[2:])), groups


def _gn_cell(site: Site, x: str, groups: int, eps: float) -> list | None:
    """Where the forward leaves (x, mean, 1/std) for GroupNormGrad (see _stats_cell)."""
    if site.memo is None:
        return None
    return site.memo.setdefault(("group_stats", x, groups, eps), [None])


@lowering("GroupNormalization", "InstanceNormalization")
def _group_norm(site: Site):
    """aten.native_group_norm (one launch); per-group scale and bias (GroupNormalization 18-20)
    repeated per channel first."""
    setup = _gn_setup(site, 0)
    if setup is None:
        return None
    import torch
    n, c, hw, groups = setup
    eps = float(site.attr("epsilon", 1e-5))
    fused = torch.ops.aten.native_group_norm
    per_group = [site.has(k) and site.shape(k)[0] != c for k in (1, 2)]
    cell = _gn_cell(site, site.node.inputs[0], groups, eps)

    def group_norm(ins):
        x = ins[0]
        scale, bias = (p.repeat_interleave(c // groups) if pg else p for p, pg in zip(ins[1:3], per_group))
        y, mean, inv = fused(x, scale, bias, n, c, hw, groups, eps)
        if cell is not None:
            cell[0] = (x, mean, inv)
        return [y]
    return group_norm


@lowering("GroupNormGrad")
def _group_norm_grad(site: Site):
    """aten.native_group_norm_backward with the forward's mean and 1/std of the same tensor
    (Site.memo), else with those of the fused forward run again: the same bits either way."""
    setup = _gn_setup(site, 1)
    if setup is None:
        return None
    import torch
    n, c, hw, groups = setup
    eps = float(site.attr("epsilon", 1e-5))
    fused, backward = torch.ops.aten.native_group_norm, torch.ops.aten.native_group_norm_backward
    n_scale, n_bias = site.shape(2)[0], int(site.attr("bias_shape")[0])
    cell = _gn_cell(site, site.node.inputs[1], groups, eps)
    mask = [True, True, True]

    def per(p, k: int):  # per-group parameters sum their channels
        return p if k == c else p.reshape(k, -1).sum(dim=1)

    def group_norm_grad(ins):
        dy, x, scale = ins
        mean, inv = _memo_stats(cell, x, lambda: fused(x, None, None, n, c, hw, groups, eps)[1:])
        weight = scale if n_scale == c else scale.repeat_interleave(c // groups)
        dx, dscale, dbias = backward(dy, x, mean, inv, weight, n, c, hw, groups, mask)
        return [dx, per(dscale, n_scale), per(dbias, n_bias)]
    return group_norm_grad
