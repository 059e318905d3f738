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


def adaptive_avg_pool2d(x, output_size) -> Tensor:
    """Output 1 is GlobalAveragePool; other sizes must divide the input (one AveragePool)."""
    x = _t(x)
    spatial = x.shape[2:]
    size = output_size if isinstance(output_size, (tuple, list)) else (output_size, output_size)
    out = [s if o is None else int(o) for o, s in zip(size, spatial)]  # None keeps the input size
    if all(o == 1 for o in out):
        return x._unary("GlobalAveragePool")
    if any(isinstance(s, SymInt) for s in spatial) or any(int(s) % int(o) for s, o in zip(spatial, out)):
        raise AnygradError(
            f"adaptive_avg_pool2d: output size {out} does not divide the input's spatial size "
            f"{tuple(spatial)}; only 1 or exact divisors are supported"
        )
    kernel = [int(s) // int(o) for s, o in zip(spatial, out)]
    return x.tracer.op("AveragePool", [x], kernel_shape=kernel, strides=kernel, pads=[0, 0, 0, 0])


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
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """BatchNormalization; PyTorch's momentum m is ONNX's 1 - m (weight of the old statistics)."""
    x = _t(x)
    if momentum is None:
        raise ConfigError("batch_norm with momentum=None (cumulative average) is not supported")
    channels = int(x.shape[1])
    scale = _t(weight) if weight is not None else x.tracer.const(np.ones(channels, np.float32))
    shift = _t(bias) if bias is not None else x.tracer.const(np.zeros(channels, np.float32))
    return x.tracer.op(
        "BatchNormalization",
        [x, scale, shift, _t(running_mean), _t(running_var)],
        epsilon=float(eps),
        momentum=float(1.0 - momentum),
    )


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


def embedding(indices, weight) -> Tensor:
    idx, w = _t(indices), _t(weight)
    return w.tracer.op("Gather", [w, idx], axis=0)


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
        consts = [np.array(v, np.int64) for v in (starts, ends, axes, steps)]
        y = x.tracer.op("Slice", [x] + [x.tracer.const(c, np.int64) for c in consts])
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
