"""anygrad.nn.functional: PyTorch's functional API, each call appending the ONNX nodes that
PyTorch's exporter (opset 17) would emit for it.

Training/inference differences (dropout, batch statistics) are not decided here: Dropout and
BatchNormalization nodes are emitted as in an inference export, and the Model rewrites them for
training (`set_training_mode`), exactly as it does for an imported ONNX file.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import AnygradError, ConfigError
from ..ir.registry import get_op
from .tracing import Operand, SymInt, Tensor, as_tensor

# -- helpers ------------------------------------------------------------------------------------------


def _t(x: Any) -> Tensor:
    if not isinstance(x, Operand):
        raise AnygradError(f"expected a tensor, got {type(x).__name__}")
    return x._t()


def _ints(v: int | Sequence[int], n: int, what: str) -> list[int]:
    if isinstance(v, (int, np.integer)):
        return [int(v)] * n
    v = [int(i) for i in v]
    if len(v) != n:
        raise ConfigError(f"{what} must be an int or {n} ints, got {v}")
    return v


def _axis(dim: int, rank: int) -> int:
    if not -rank <= dim < rank:
        raise AnygradError(f"dim {dim} is out of range for a tensor of rank {rank}")
    return dim % rank


def _axes_const(x: Tensor, axes: Sequence[int]) -> Tensor:
    return x.tracer.const(np.array(list(axes), np.int64), np.int64)


# -- activations ----------------------------------------------------------------------------------
def relu(x) -> Tensor:
    return _t(x)._unary("Relu")


def leaky_relu(x, negative_slope: float = 0.01) -> Tensor:
    return _t(x)._unary("LeakyRelu", alpha=float(negative_slope))


def sigmoid(x) -> Tensor:
    return _t(x)._unary("Sigmoid")


def tanh(x) -> Tensor:
    return _t(x)._unary("Tanh")


def elu(x, alpha: float = 1.0) -> Tensor:
    return _t(x)._unary("Elu", alpha=float(alpha))


def gelu(x, approximate: str = "none") -> Tensor:
    """As the exporter writes it below opset 20: x * 0.5 * (1 + erf(x / sqrt 2)), or the tanh form."""
    x = _t(x)
    if approximate == "none":
        inner = (x / math.sqrt(2.0))._unary("Erf")
    elif approximate == "tanh":
        inner = ((x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi))._unary("Tanh")
    else:
        raise ConfigError(f"gelu: approximate must be 'none' or 'tanh', not '{approximate}'")
    return x * ((inner + 1.0) * 0.5)


def silu(x) -> Tensor:
    x = _t(x)
    return x * x._unary("Sigmoid")


def hardtanh(x, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """Clip(x, min_val, max_val), as the exporter writes it. The gradient passes at the bounds
    themselves (ONNX Clip's rule), where PyTorch's is zero: it differs only for inputs exactly
    equal to a bound."""
    x = _t(x)
    if min_val > max_val:
        raise ConfigError(f"hardtanh: min_val {min_val} must not be larger than max_val {max_val}")
    return x.tracer.op("Clip", [x, as_tensor(float(min_val), x), as_tensor(float(max_val), x)])


def relu6(x) -> Tensor:
    return hardtanh(x, 0.0, 6.0)


def hardswish(x) -> Tensor:
    return _t(x)._unary("HardSwish")


def hardsigmoid(x) -> Tensor:
    return _t(x)._unary("HardSigmoid", alpha=1.0 / 6.0, beta=0.5)


# Above this threshold PyTorch's linear branch equals softplus to float32 precision
# (log1p(exp(-t)) / t < 1e-10), so the exporter's plain Softplus is exact.
_SOFTPLUS_EXACT_THRESHOLD = 20.0


def softplus(x, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """log(1 + exp(beta x)) / beta; x itself where beta x > threshold (PyTorch's linear branch,
    which the exporter drops: it is kept here when it changes the numbers)."""
    x = _t(x)
    if beta <= 0:
        raise ConfigError(f"softplus: beta must be positive, got {beta}")
    bx = x if beta == 1 else x * float(beta)
    y = bx._unary("Softplus")
    y = y if beta == 1 else y / float(beta)
    if threshold >= _SOFTPLUS_EXACT_THRESHOLD:
        return y
    linear = x.tracer.op("Greater", [bx, as_tensor(float(threshold), x)])
    return x.tracer.op("Where", [linear, x, y])


def mish(x) -> Tensor:
    """x * tanh(softplus(x)), as the exporter writes it below opset 18."""
    x = _t(x)
    return x * x._unary("Softplus")._unary("Tanh")


def selu(x) -> Tensor:
    return _t(x)._unary("Selu")  # ONNX's default alpha and gamma are PyTorch's constants in float32


def celu(x, alpha: float = 1.0) -> Tensor:
    if alpha == 0:
        raise ConfigError("celu: alpha must not be 0")
    return _t(x)._unary("Celu", alpha=float(alpha))


def softsign(x) -> Tensor:
    return _t(x)._unary("Softsign")


def logsigmoid(x) -> Tensor:
    """-softplus(-x): the exporter's Log(Sigmoid(x)) underflows to -inf below x = -88."""
    return -softplus(-_t(x))


def prelu(x, weight) -> Tensor:
    """PRelu with the slope over dim 1 (PyTorch's channel dim): a (C,) weight is reshaped to
    (C, 1, ...) for inputs of rank 3 and more, so that it broadcasts as in PyTorch."""
    x, w = _t(x), _t(weight)
    rank, n = len(x.shape), int(np.prod(w.shape))
    if n != 1 and (rank < 2 or int(x.shape[1]) != n):
        raise ConfigError(f"prelu: {n} slopes for an input of shape {tuple(x.shape)}; give one slope, or "
                          "one per channel (dim 1)")
    if n != 1 and rank > 2:
        w = reshape(w, [n] + [1] * (rank - 2))
    return x.tracer.op("PRelu", [x, w])


def softmax(x, dim: int) -> Tensor:
    x = _t(x)
    if dim is None:
        raise ConfigError("softmax needs dim= (the axis the probabilities sum over)")
    return x._unary("Softmax", axis=_axis(dim, len(x.shape)))


def log_softmax(x, dim: int) -> Tensor:
    x = _t(x)
    if dim is None:
        raise ConfigError("log_softmax needs dim= (the axis the probabilities sum over)")
    return x._unary("LogSoftmax", axis=_axis(dim, len(x.shape)))


# -- layers -------------------------------------------------------------------------------------
def linear(x, weight, bias=None) -> Tensor:
    """y = x W^T + b; Gemm for 2-D input (as the exporter), MatMul + Add otherwise."""
    x, w = _t(x), _t(weight)
    if len(x.shape) == 2:
        ins = [x, w] + ([_t(bias)] if bias is not None else [])
        return x.tracer.op("Gemm", ins, alpha=1.0, beta=1.0, transB=1)
    y = x @ w.tracer.op("Transpose", [w], perm=[1, 0])
    return y + bias if bias is not None else y


def _conv_pads(
    padding: Any, kernel: Sequence[int], dilation: Sequence[int], stride: Sequence[int]
) -> list[int]:
    nd = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return [0] * (2 * nd)
        if padding != "same":
            raise ConfigError(f"conv padding must be an int, a tuple, 'same' or 'valid', not '{padding}'")
        if any(s != 1 for s in stride):
            raise ConfigError("padding='same' needs stride 1 (as in PyTorch)")
        # PyTorch puts the odd pad at the end
        total = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return [t // 2 for t in total] + [t - t // 2 for t in total]
    p = _ints(padding, nd, "padding")
    return p + p


def conv(
    x, weight, bias=None, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1
) -> Tensor:
    """N-d convolution (conv1d/conv2d/conv3d by the weight's rank)."""
    x, w = _t(x), _t(weight)
    kernel = list(w.shape[2:])
    nd = len(kernel)
    strides, dilations = _ints(stride, nd, "stride"), _ints(dilation, nd, "dilation")
    pads = _conv_pads(padding, kernel, dilations, strides)
    ins = [x, w] + ([_t(bias)] if bias is not None else [])
    return x.tracer.op(
        "Conv", ins, dilations=dilations, group=int(groups), kernel_shape=kernel, pads=pads, strides=strides
    )


conv1d = conv2d = conv3d = conv


def conv_transpose(
    x, weight, bias=None, stride: Any = 1, padding: Any = 0, output_padding: Any = 0, groups: int = 1,
    dilation: Any = 1,
) -> Tensor:
    """N-d transposed convolution (PyTorch's argument order: groups before dilation)."""
    x, w = _t(x), _t(weight)
    kernel = list(w.shape[2:])
    nd = len(kernel)
    strides, dilations = _ints(stride, nd, "stride"), _ints(dilation, nd, "dilation")
    pads, out_pad = _ints(padding, nd, "padding"), _ints(output_padding, nd, "output_padding")
    if any(p >= s and p >= d for p, s, d in zip(out_pad, strides, dilations)):
        raise ConfigError(f"output_padding {out_pad} must be smaller than stride {strides} or dilation "
                          f"{dilations} (as in PyTorch)")
    ins = [x, w] + ([_t(bias)] if bias is not None else [])
    return x.tracer.op("ConvTranspose", ins, dilations=dilations, group=int(groups), kernel_shape=kernel,
                       pads=pads + pads, strides=strides, output_padding=out_pad)


conv_transpose1d = conv_transpose2d = conv_transpose3d = conv_transpose


def _pool_args(x: Tensor, kernel_size, stride, padding, nd: int) -> dict:
    kernel = _ints(kernel_size, nd, "kernel_size")
    strides = kernel if stride is None or stride == [] else _ints(stride, nd, "stride")
    pads = _ints(padding, nd, "padding")
    if any(2 * p > k for p, k in zip(pads, kernel)):
        raise ConfigError(f"pool padding {pads} must be at most half the kernel {kernel}")
    return {"kernel_shape": kernel, "pads": pads + pads, "strides": strides}


def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False) -> Tensor:
    x = _t(x)
    attrs = _pool_args(x, kernel_size, stride, padding, 2)
    dil = _ints(dilation, 2, "dilation")
    if dil != [1, 1]:
        attrs["dilations"] = dil
    return x.tracer.op("MaxPool", [x], ceil_mode=int(ceil_mode), **attrs)


def avg_pool2d(
    x, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True
) -> Tensor:
    x = _t(x)
    attrs = _pool_args(x, kernel_size, stride, padding, 2)
    return x.tracer.op(
        "AveragePool", [x], ceil_mode=int(ceil_mode), count_include_pad=int(count_include_pad), **attrs
    )


def _adaptive_sizes(x: Tensor, output_size: Any, nd: int, what: str) -> tuple[list[int], list[int]]:
    """(input spatial sizes, output sizes); None in output_size keeps the input's size."""
    spatial = list(x.shape[2:])
    if len(spatial) != nd:
        raise ConfigError(f"{what} expects an input of rank {nd + 2} (N, C, {nd} spatial dims), "
                          f"got shape {tuple(x.shape)}")
    size = list(output_size) if isinstance(output_size, (tuple, list)) else [output_size] * nd
    if len(size) != nd:
        raise ConfigError(f"{what}: output_size must be an int or {nd} ints, got {output_size}")
    if any(isinstance(s, SymInt) for s in spatial):
        raise AnygradError(f"{what}: the input's spatial size {tuple(spatial)} depends on a symbolic "
                           "dim; give the spatial dims as numbers in input_shape")
    out = [int(s) if o is None else int(o) for o, s in zip(size, spatial)]
    if any(o < 1 for o in out):
        raise ConfigError(f"{what}: output_size {out} must be positive")
    return [int(s) for s in spatial], out


# adaptive pools: (global op, fixed-window op, reduction over one bin)
_ADAPTIVE = {"avg": ("GlobalAveragePool", "AveragePool", "ReduceMean"),
             "max": ("GlobalMaxPool", "MaxPool", "ReduceMax")}


def _adaptive_pool(x, output_size, nd: int, kind: str) -> Tensor:
    """PyTorch's adaptive pooling: output i of a dim of size n -> out reads the bin
    [floor(i n / out), ceil((i + 1) n / out)). Output 1 is the global pool, sizes that divide
    the input one pooling window (as the exporter writes both); other sizes are composed per dim
    (bins are rectangles, so pooling dim by dim gives the same result): a Slice and a reduction
    per bin, concatenated."""
    x = _t(x)
    global_op, window_op, reduce_op = _ADAPTIVE[kind]
    spatial, out = _adaptive_sizes(x, output_size, nd, f"adaptive_{kind}_pool{nd}d")
    if all(o == 1 for o in out):
        return x._unary(global_op)
    if all(s % o == 0 for s, o in zip(spatial, out)):
        kernel = [s // o for s, o in zip(spatial, out)]
        return x.tracer.op(window_op, [x], kernel_shape=kernel, strides=kernel, pads=[0] * (2 * nd))
    for axis, (n, o) in enumerate(zip(spatial, out), start=2):
        if n == o:
            continue
        bins = []
        for i in range(o):
            start, end = (i * n) // o, -((-(i + 1) * n) // o)
            part = _slice(x, [start], [end], [axis])
            bins.append(part._unary(reduce_op, axes=[axis], keepdims=1))
        x = bins[0] if len(bins) == 1 else x.tracer.op("Concat", bins, axis=axis)
    return x


def _slice(x: Tensor, starts: list[int], ends: list[int], axes: list[int], steps: list[int] | None = None) -> Tensor:
    """ONNX Slice over `axes` (steps only when given: the input is optional)."""
    consts = [starts, ends, axes] + ([steps] if steps is not None else [])
    return x.tracer.op("Slice", [x] + [x.tracer.const(np.array(c, np.int64), np.int64) for c in consts])


def _no_indices(who: str, return_indices: bool) -> None:
    """Refuse adaptive max pooling's return_indices: the graph gives the values only."""
    if return_indices:
        raise ConfigError(f"{who}: return_indices=True is not supported")


def adaptive_avg_pool1d(x, output_size) -> Tensor:
    return _adaptive_pool(x, output_size, 1, "avg")


def adaptive_avg_pool2d(x, output_size) -> Tensor:
    return _adaptive_pool(x, output_size, 2, "avg")


def adaptive_max_pool1d(x, output_size, return_indices: bool = False) -> Tensor:
    _no_indices("adaptive_max_pool1d", return_indices)
    return _adaptive_pool(x, output_size, 1, "max")


def adaptive_max_pool2d(x, output_size, return_indices: bool = False) -> Tensor:
    _no_indices("adaptive_max_pool2d", return_indices)
    return _adaptive_pool(x, output_size, 2, "max")


def dropout(x, p: float = 0.5, training: bool = True) -> Tensor:
    """Dropout(x, ratio): identity in inference, masked and scaled in training (graph mode)."""
    x = _t(x)
    if not 0 <= p < 1:
        raise ConfigError(f"dropout probability must be in [0, 1), got {p}")
    if not training:
        return x
    return x.tracer.op("Dropout", [x, x.tracer.const(np.array(p, np.float32))])


def batch_norm(
    x,
    running_mean,
    running_var,
    weight=None,
    bias=None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """BatchNormalization; PyTorch's momentum m is ONNX's 1 - m (weight of the old statistics).

    Whether batch or running statistics are used is the Model's decision (training steps or
    predict), as for an imported file, so `training` is not read. Without running statistics
    (track_running_stats=False) the batch statistics are used always: composed from reductions."""
    x = _t(x)
    channels = int(x.shape[1])
    if running_mean is None or running_var is None:
        if (running_mean is None) != (running_var is None):
            raise ConfigError("batch_norm: give both running_mean and running_var, or neither")
        return _batch_statistics_norm(x, weight, bias, eps)
    if momentum is None:
        raise ConfigError(
            "batch_norm: momentum=None (a cumulative average of the running statistics) cannot be "
            "expressed by the BatchNormalization op, whose momentum is fixed; pass a number such as "
            "momentum=0.1"
        )
    scale = _t(weight) if weight is not None else x.tracer.const(np.ones(channels, np.float32))
    shift = _t(bias) if bias is not None else x.tracer.const(np.zeros(channels, np.float32))
    return x.tracer.op(
        "BatchNormalization",
        [x, scale, shift, _t(running_mean), _t(running_var)],
        epsilon=float(eps),
        momentum=float(1.0 - momentum),
    )


def _batch_statistics_norm(x: Tensor, weight, bias, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the batch and spatial dims (biased
    variance, as PyTorch normalises), in training and inference alike."""
    rank = len(x.shape)
    axes = [0] + list(range(2, rank))
    centered = x - mean(x, axes, keepdim=True)
    y = centered / (mean(centered * centered, axes, keepdim=True) + float(eps))._unary("Sqrt")
    per_channel = [int(x.shape[1])] + [1] * (rank - 2)  # (C, 1, ...) broadcasts over dim 1
    if weight is not None:
        y = y * (reshape(weight, per_channel) if rank > 2 else weight)
    if bias is not None:
        y = y + (reshape(bias, per_channel) if rank > 2 else bias)
    return y


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """LayerNormalization (opset 17) when the registry has it, else composed from
    ReduceMean/Sub/Mul/Add/Sqrt/Div (the form older exporters emit)."""
    x = _t(x)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    n = len(shape)
    if get_op("LayerNormalization") is not None:
        scale = _t(weight) if weight is not None else x.tracer.const(np.ones(shape, x.dtype), x.dtype)
        ins = [x, scale] + ([_t(bias)] if bias is not None else [])
        return x.tracer.op("LayerNormalization", ins, axis=-n, epsilon=float(eps))
    axes = list(range(len(x.shape) - n, len(x.shape)))
    centered = x - mean(x, axes, keepdim=True)
    var = mean(centered * centered, axes, keepdim=True)
    y = centered / (var + float(eps))._unary("Sqrt")
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _embedding_options(who: str, max_norm: float | None, scale_grad_by_freq: bool) -> None:
    """Refuse the Embedding options the graph cannot express."""
    if max_norm is not None or scale_grad_by_freq:
        option = "max_norm" if max_norm is not None else "scale_grad_by_freq"
        raise ConfigError(f"{who}: {option} is not supported (it rewrites the weights or gradients "
                          "outside the graph); leave it at its default")


def _padding_row(who: str, padding_idx: int, rows: int) -> int:
    """padding_idx as a row of a table of `rows` (a negative one counts from the end, as in PyTorch)."""
    if not -rows <= padding_idx < rows:
        raise ConfigError(f"{who}: padding_idx {padding_idx} is outside the {rows} embeddings")
    return padding_idx % rows


def embedding(indices, weight, padding_idx: int | None = None, max_norm: float | None = None,
              norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """Gather(weight, indices). With padding_idx, that row gets no gradient (as in PyTorch):
    the lookup is Where(indices == padding_idx, 0, row), which reads the padding row as the
    zeros PyTorch initialises it to; a Parameter whose padding row is not zero is refused, as
    the graph could not give its values. `sparse` only changes how PyTorch stores gradients."""
    _embedding_options("embedding", max_norm, scale_grad_by_freq)
    w = _t(weight)
    idx = _t(indices) if isinstance(indices, Operand) else as_tensor(np.asarray(indices, np.int64), w)
    out = w.tracer.op("Gather", [w, idx], axis=0)
    if padding_idx is None:
        return out
    padding_idx = _padding_row("embedding", padding_idx, int(w.shape[0]))
    data = getattr(weight, "data", None)  # a Parameter's values (a traced Tensor has none)
    if isinstance(data, np.ndarray) and np.any(data[padding_idx] != 0):
        raise AnygradError(
            f"embedding: row {padding_idx} (padding_idx) of the weight is not zero; anygrad keeps the "
            "padding row at zero, as PyTorch initialises it. Zero it before tracing "
            "(module.weight.data[padding_idx] = 0) or drop padding_idx"
        )
    is_pad = unsqueeze(w.tracer.op("Equal", [idx, as_tensor(np.array(padding_idx, idx.dtype), idx)]), -1)
    return w.tracer.op("Where", [is_pad, as_tensor(0.0, w), out])


# -- padding and resampling ---------------------------------------------------------------------
# PyTorch's pad modes -> ONNX Pad's ("circular" is composed: ONNX's "wrap" needs opset 19)
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


def pad(x, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Tensor:
    """PyTorch's F.pad: `pad` lists (before, after) pairs from the last dim backwards; negative
    amounts crop. One Pad node with the amounts of every dim (ONNX's order: all befores, then
    all afters), or slices and a Concat per dim for mode="circular"."""
    x = _t(x)
    amounts = [int(p) for p in pad]
    rank = len(x.shape)
    if len(amounts) % 2 or len(amounts) > 2 * rank:
        raise ConfigError(f"pad: {len(amounts)} amounts for a tensor of rank {rank}; give (before, after) "
                          "pairs for at most every dim, last dim first")
    if mode != "constant" and value not in (None, 0, 0.0):
        raise ConfigError(f"pad: value is only used with mode='constant', not '{mode}'")
    per_dim = [(0, 0)] * rank
    for k in range(len(amounts) // 2):
        per_dim[rank - 1 - k] = (amounts[2 * k], amounts[2 * k + 1])
    if mode == "circular":
        return _circular_pad(x, per_dim)
    if mode not in _PAD_MODES:
        raise ConfigError(f"pad: mode '{mode}' is not supported; use one of constant, reflect, replicate, "
                          "circular")
    pads = x.tracer.const(np.array([b for b, _ in per_dim] + [a for _, a in per_dim], np.int64), np.int64)
    ins = [x, pads] + ([as_tensor(float(value), x)] if mode == "constant" and value else [])
    return x.tracer.op("Pad", ins, mode=_PAD_MODES[mode])


def _circular_pad(x: Tensor, per_dim: list[tuple[int, int]]) -> Tensor:
    for axis, (before, after) in enumerate(per_dim):
        if (before, after) == (0, 0):
            continue
        n = x.shape[axis]
        if isinstance(n, SymInt) or max(before, after) > n or min(before, after) < 0:
            raise ConfigError(f"pad: circular padding ({before}, {after}) of dim {axis} needs a static dim "
                              f"of at least that size and no cropping (dim {axis} is {n})")
        parts = ([_slice(x, [n - before], [n], [axis])] if before else []) + [x] + (
            [_slice(x, [0], [after], [axis])] if after else [])
        x = x.tracer.op("Concat", parts, axis=axis)
    return x


# PyTorch's interpolate modes -> (spatial rank or None for any, ONNX Resize attributes); the
# coordinate mode of the linear ones depends on align_corners.
_INTERPOLATE = {
    "nearest": (None, {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                       "nearest_mode": "floor"}),
    # floor((dst + 0.5) * scale): round half up of half_pixel's source coordinate
    "nearest-exact": (None, {"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
                             "nearest_mode": "round_prefer_ceil"}),
    "linear": (1, {"mode": "linear"}),
    "bilinear": (2, {"mode": "linear"}),
    "trilinear": (3, {"mode": "linear"}),
    "bicubic": (2, {"mode": "cubic", "cubic_coeff_a": -0.75}),
}


def interpolate(x, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None, antialias: bool = False) -> Tensor:
    """PyTorch's F.interpolate as one Resize node, as the exporter writes it: constant scales
    for scale_factor (PyTorch then samples with 1/scale_factor, as Resize does), the sizes
    Concat(Shape(x)[:2], size) for size (batch and channels stay as they are)."""
    x = _t(x)
    if mode not in _INTERPOLATE:
        raise ConfigError(f"interpolate: mode '{mode}' is not supported; use one of {', '.join(_INTERPOLATE)}")
    nd, attrs = _INTERPOLATE[mode]
    spatial = list(x.shape[2:])
    if nd is not None and len(spatial) != nd:
        raise ConfigError(f"interpolate: mode '{mode}' needs an input with {nd} spatial dims, got shape "
                          f"{tuple(x.shape)}")
    attrs = dict(attrs)
    if attrs["mode"] != "nearest":
        attrs["coordinate_transformation_mode"] = "align_corners" if align_corners else "half_pixel"
    elif align_corners is not None:
        raise ConfigError("interpolate: align_corners is only for the linear and cubic modes (as in PyTorch)")
    if antialias:
        raise ConfigError("interpolate: antialias=True is not supported (Resize's antialias needs opset 18)")
    if (size is None) == (scale_factor is None):
        raise ConfigError("interpolate: give exactly one of size and scale_factor")
    if any(isinstance(d, SymInt) for d in spatial):
        raise AnygradError(f"interpolate: the input's spatial size {tuple(spatial)} depends on a symbolic dim; "
                           "give the spatial dims as numbers in input_shape")
    n = len(spatial)
    if scale_factor is not None:
        scales = [float(f) for f in (scale_factor if isinstance(scale_factor, (tuple, list)) else [scale_factor] * n)]
        if len(scales) != n or any(f <= 0 for f in scales):
            raise ConfigError(f"interpolate: scale_factor must be a positive number or {n} of them, got {scale_factor}")
        # PyTorch's output size, computed in double; Resize computes it in float32
        sizes = [math.floor(int(d) * f) for d, f in zip(spatial, scales)]
        if recompute_scale_factor:  # PyTorch then samples as if the size had been given
            size, scale_factor = sizes, None
        elif sizes != [int(np.floor(np.float32(d) * np.float32(f))) for d, f in zip(spatial, scales)]:
            raise ConfigError(f"interpolate: scale_factor {scale_factor} gives output size {sizes} in PyTorch but "
                              "a different one in float32 (ONNX Resize); pass size= or recompute_scale_factor=True")
    empty = x.tracer.const(np.zeros(0, np.float32))
    if scale_factor is not None:
        scales_const = x.tracer.const(np.array([1.0, 1.0] + scales, np.float32))
        return x.tracer.op("Resize", [x, empty, scales_const], **attrs)
    size = [int(s) for s in (size if isinstance(size, (tuple, list)) else [size] * n)]
    if len(size) != n or any(s < 1 for s in size):
        raise ConfigError(f"interpolate: size must be a positive int or {n} of them, got {size}")
    leading = x.tracer.op("Shape", [x], start=0, end=2)
    sizes_t = x.tracer.op("Concat", [leading, x.tracer.const(np.array(size, np.int64), np.int64)], axis=0)
    return x.tracer.op("Resize", [x, empty, empty, sizes_t], **attrs)


# -- losses (usable inside forward; the training loss itself is compile(loss=...)) ------------------
_REDUCTIONS = ("mean", "sum", "none")


def _reduction(reduction: str, what: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ConfigError(f"{what}: reduction must be one of {', '.join(_REDUCTIONS)}, not '{reduction}'")
    return reduction


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    return (mean if reduction == "mean" else sum)(loss)


def _class_loss(op: str, what: str, x, target, weight, ignore_index: int, reduction: str) -> Tensor:
    x = _t(x)
    t = _t(target) if isinstance(target, Operand) else as_tensor(np.asarray(target, np.int64), x)
    ins = [x, t] + ([_t(weight) if isinstance(weight, Operand) else as_tensor(np.asarray(weight, x.dtype), x)]
                    if weight is not None else [])
    return x.tracer.op(op, ins, ignore_index=int(ignore_index), reduction=_reduction(reduction, what))


def cross_entropy(x, target, weight=None, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """SoftmaxCrossEntropyLoss over class scores (N, C, ...) and class indices (N, ...), as the
    exporter writes it; class probabilities (a float target of x's shape) are composed from
    LogSoftmax."""
    if label_smoothing:
        raise ConfigError("cross_entropy: label_smoothing is not supported inside forward (the ONNX op has "
                          "none); for the training loss use compile(loss='cross_entropy', label_smoothing=...)")
    x = _t(x)
    target = target if isinstance(target, Operand) else np.asarray(target)
    if np.dtype(target.dtype).kind == "f":  # class probabilities
        if weight is not None:
            raise ConfigError("cross_entropy: weight with class-probability targets is not supported")
        per_sample = -sum(log_softmax(x, 1) * as_tensor(target, x), 1)
        return _reduce(per_sample, _reduction(reduction, "cross_entropy"))
    return _class_loss("SoftmaxCrossEntropyLoss", "cross_entropy", x, target, weight, ignore_index, reduction)


def nll_loss(x, target, weight=None, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    return _class_loss("NegativeLogLikelihoodLoss", "nll_loss", x, target, weight, ignore_index, reduction)


def mse_loss(x, target, reduction: str = "mean") -> Tensor:
    d = _t(x) - target
    return _reduce(d * d, _reduction(reduction, "mse_loss"))


def l1_loss(x, target, reduction: str = "mean") -> Tensor:
    return _reduce((_t(x) - target)._unary("Abs"), _reduction(reduction, "l1_loss"))


def binary_cross_entropy_with_logits(x, target, weight=None, reduction: str = "mean", pos_weight=None) -> Tensor:
    """PyTorch's stable form (1 - y) x + (1 + (p - 1) y) softplus(-x); the exporter's
    Log(Sigmoid) form underflows for large |x|."""
    x = _t(x)
    y = as_tensor(target, x)
    log_term = softplus(-x)
    if pos_weight is not None:
        log_term = ((y * (as_tensor(pos_weight, x) - 1.0)) + 1.0) * log_term
    loss = (1.0 - y) * x + log_term
    if weight is not None:
        loss = loss * as_tensor(weight, x)
    return _reduce(loss, _reduction(reduction, "binary_cross_entropy_with_logits"))


# -- attention ------------------------------------------------------------------------------------
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """softmax(q k^T * scale + mask) v, composed as the exporter writes it: q and k^T are each
    scaled by sqrt(scale), a boolean mask becomes 0 / -inf added to the scores, is_causal a
    constant lower-triangular one. dropout_p applies a Dropout node (active in training steps
    only, as with `dropout_p=p if self.training else 0` in PyTorch)."""
    q, k, v = _t(query), _t(key), _t(value)
    if enable_gqa:
        raise ConfigError("scaled_dot_product_attention: enable_gqa is not supported; repeat the key/value "
                          "heads to the query's count instead")
    if is_causal and attn_mask is not None:
        raise ConfigError("scaled_dot_product_attention: pass attn_mask or is_causal, not both (as in PyTorch)")
    e = q.shape[-1]
    if isinstance(e, SymInt):
        raise AnygradError("scaled_dot_product_attention: the embedding dim (last dim) must be static")
    c = math.sqrt(1.0 / math.sqrt(int(e)) if scale is None else float(scale))
    scores = (q * c) @ (transpose(k, -2, -1) * c)
    if is_causal:
        rows, cols = q.shape[-2], k.shape[-2]
        if isinstance(rows, SymInt) or isinstance(cols, SymInt):
            raise AnygradError("scaled_dot_product_attention: is_causal needs static sequence lengths; give "
                               "them as numbers in input_shape")
        keep = np.tril(np.ones((int(rows), int(cols)), bool))
        scores = scores + np.where(keep, 0.0, -np.inf).astype(scores.dtype)
    elif attn_mask is not None:
        mask = attn_mask._t() if isinstance(attn_mask, Operand) else as_tensor(np.asarray(attn_mask), q)
        if mask.dtype == np.bool_:  # True: take part in the attention
            mask = q.tracer.op("Where", [mask, as_tensor(0.0, q), as_tensor(-np.inf, q)])
        scores = scores + mask
    weights = softmax(scores, -1)
    if dropout_p:
        weights = dropout(weights, dropout_p)
    return weights @ v


# -- shape ----------------------------------------------------------------------------------------
def reshape(x, *shape) -> Tensor:
    x = _t(x)
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    spec = x.tracer.reshape_spec(x, shape)
    return x.tracer.op("Reshape", [x, x.tracer.const(np.array(spec, np.int64), np.int64)])


view = reshape


def flatten(x, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    x = _t(x)
    rank = len(x.shape)
    s, e = _axis(start_dim, rank) if rank else 0, _axis(end_dim, rank) if rank else 0
    if s == 1 and e == rank - 1:
        return x._unary("Flatten", axis=1)  # what the exporter emits for torch.flatten(x, 1)
    shape = x.shape
    merged = 1
    for d in shape[s : e + 1]:
        merged = d * merged
    return reshape(x, *(tuple(shape[:s]) + (merged,) + tuple(shape[e + 1 :])))


def transpose(x, dim0: int, dim1: int) -> Tensor:
    x = _t(x)
    perm = list(range(len(x.shape)))
    a, b = _axis(dim0, len(perm)), _axis(dim1, len(perm))
    perm[a], perm[b] = perm[b], perm[a]
    return x._unary("Transpose", perm=perm)


def permute(x, *dims) -> Tensor:
    x = _t(x)
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return x._unary("Transpose", perm=[_axis(d, len(x.shape)) for d in dims])


def unsqueeze(x, dim: int) -> Tensor:
    x = _t(x)
    return x.tracer.op("Unsqueeze", [x, _axes_const(x, [_axis(dim, len(x.shape) + 1)])])


def squeeze(x, dim: int | None = None) -> Tensor:
    x = _t(x)
    if dim is None:
        return x.tracer.op("Squeeze", [x])
    axis = _axis(dim, len(x.shape))
    if x.shape[axis] != 1:  # PyTorch leaves a dim that is not 1 alone
        return x
    return x.tracer.op("Squeeze", [x, _axes_const(x, [axis])])


def cat(tensors: Sequence[Any], dim: int = 0) -> Tensor:
    ts = [_t(t) for t in tensors]
    return ts[0].tracer.op("Concat", ts, axis=_axis(dim, len(ts[0].shape)))


def getitem(x: Tensor, index: Any) -> Tensor:
    """Basic indexing: ints, slices (step > 0), None and Ellipsis, as Slice/Squeeze/Unsqueeze."""
    index = index if isinstance(index, tuple) else (index,)
    if builtins.sum(i is Ellipsis for i in index) > 1:
        raise AnygradError("an index can have only one Ellipsis")
    rank = len(x.shape)
    used = builtins.sum(1 for i in index if i is not None and i is not Ellipsis)
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (rank - used) + index[k + 1 :]
    starts, ends, axes, steps, squeeze_axes, unsqueeze_at = [], [], [], [], [], []
    axis = 0
    for pos, i in enumerate(index):
        if i is None:
            unsqueeze_at.append(pos)
            continue
        if isinstance(i, (int, np.integer)):
            starts.append(int(i))
            ends.append(int(i) + 1 if int(i) != -1 else np.iinfo(np.int64).max)
            steps.append(1)
            axes.append(axis)
            squeeze_axes.append(axis)
        elif isinstance(i, slice):
            if i != slice(None):
                step = 1 if i.step is None else int(i.step)
                if step <= 0:
                    raise AnygradError("slices with a step <= 0 are not supported while tracing")
                starts.append(0 if i.start is None else int(i.start))
                ends.append(np.iinfo(np.int64).max if i.stop is None else int(i.stop))
                steps.append(step)
                axes.append(axis)
        else:
            raise AnygradError(
                f"indexing a traced tensor with {type(i).__name__} is not supported "
                "(ints, slices, None and ... are)"
            )
        axis += 1
    if axis > rank:
        raise AnygradError(f"too many indices for a tensor of rank {rank}")
    y = x
    if axes:
        y = _slice(x, starts, ends, axes, steps)
    if squeeze_axes:
        y = y.tracer.op("Squeeze", [y, _axes_const(y, squeeze_axes)])
    if unsqueeze_at:
        # positions of None in the result: count the kept dims before each
        out_pos, kept = [], 0
        for pos, i in enumerate(index):
            if i is None:
                out_pos.append(kept + len(out_pos))
            elif not isinstance(i, (int, np.integer)):
                kept += 1
        y = y.tracer.op("Unsqueeze", [y, _axes_const(y, out_pos)])
    return y


# -- reductions ------------------------------------------------------------------------------------
def _reduce_axes(x: Tensor, dim) -> list[int]:
    rank = len(x.shape)
    if dim is None:
        return list(range(rank))
    dims = [dim] if isinstance(dim, (int, np.integer)) else list(dim)
    return sorted(_axis(int(d), rank) for d in dims)


def sum(x, dim=None, keepdim: bool = False) -> Tensor:
    x = _t(x)
    return x.tracer.op("ReduceSum", [x, _axes_const(x, _reduce_axes(x, dim))], keepdims=int(keepdim))


def mean(x, dim=None, keepdim: bool = False) -> Tensor:
    x = _t(x)  # opset 17: ReduceMean takes its axes as an attribute
    return x._unary("ReduceMean", axes=_reduce_axes(x, dim), keepdims=int(keepdim))


def amax(x, dim=None, keepdim: bool = False) -> Tensor:
    x = _t(x)
    return x._unary("ReduceMax", axes=_reduce_axes(x, dim), keepdims=int(keepdim))


def matmul(a, b) -> Tensor:
    return _t(a) @ b


def add(a, b) -> Tensor:
    return a + b if isinstance(a, Operand) else _t(b).__radd__(a)


def exp(x) -> Tensor:
    return _t(x)._unary("Exp")


def log(x) -> Tensor:
    return _t(x)._unary("Log")


def sqrt(x) -> Tensor:
    return _t(x)._unary("Sqrt")


def constant(value: Any, like) -> Tensor:
    """A constant tensor in the traced graph (dtype of `like` for Python numbers)."""
    return as_tensor(value, _t(like))


def onnx_op(op: str, *inputs: Any, n_out: int = 1, **attrs: Any) -> Tensor | list[Tensor]:
    """Any registered op by its ONNX name and attributes: the escape hatch for ops that have no
    PyTorch-style function here (`anygrad codegen` emits it for those). Inputs are tensors,
    numpy arrays (constants, dtype kept) or None (an absent optional input); n_out > 1 returns
    a list."""
    if get_op(op) is None:
        raise AnygradError(f"onnx_op: '{op}' is not an op anygrad knows")
    like = next((i._t() for i in inputs if isinstance(i, Operand)), None)
    tensors = [None if i is None else as_tensor(i, like) for i in inputs]
    tracer = like.tracer if like is not None else next(t.tracer for t in tensors if t is not None)
    outs = tracer.ops(op, tensors, n_out, **attrs)
    return outs[0] if n_out == 1 else outs
