"""Convolution (conv, conv_transpose, 1-3 d) and pooling (max, average, adaptive) functions, with
PyTorch's padding/stride/dilation arguments turned into ONNX attributes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import AnygradError, ConfigError
from ..tracing import SymInt, Tensor
from ._util import _ints, _slice, _t


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
