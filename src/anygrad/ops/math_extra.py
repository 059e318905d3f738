"""More math ops: trigonometric / hyperbolic functions, small activations, normalizations and pools
written as expansions, cumulative product, Hardmax, EyeLike, window functions, Det...

Where an op is a composition of existing primitives (Swish, Shrink, LpNormalization, LpPool, LRN,
GlobalMaxPool, Compress...) it is registered with `expand`: `specialize` replaces it by those
primitives, so it differentiates and runs on every backend without new kernels.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..ir.builder import Builder, GradContext
from ..ir.composite import defcomposite
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop, get_op
from ._util import ints_of, norm_axis, onnx_dtype, same_as_first


def _i64(b: Builder, values) -> str:
    return b.const(np.asarray(values, np.int64), np.int64, "ints")


def _scalar(b: Builder, value: float, like: str) -> str:
    return b.const(np.asarray(value, b.dtype(like)), b.dtype(like), "scalar")


# -- trigonometric and hyperbolic functions --------------------------------------------------
# name: (numpy kernel, gradient rule(ctx, x, y) -> dx built from primitive ops)
def _sq(g: GradContext, x: str) -> str:
    return g.op("Mul", [x, x])


def _one(g: GradContext, x: str) -> str:
    return _scalar(g, 1.0, x)


TRIG = {
    "Tan": (np.tan, lambda g, x, y: g.op("Mul", [g.dy, g.op("Add", [_one(g, x), _sq(g, y)])])),
    "Asin": (np.arcsin, lambda g, x, y: g.op("Div", [g.dy, g.op("Sqrt", [g.op("Sub", [_one(g, x), _sq(g, x)])])])),
    "Acos": (np.arccos, lambda g, x, y: g.op("Neg", [g.op("Div", [g.dy, g.op("Sqrt", [
        g.op("Sub", [_one(g, x), _sq(g, x)])])])])),
    "Atan": (np.arctan, lambda g, x, y: g.op("Div", [g.dy, g.op("Add", [_one(g, x), _sq(g, x)])])),
    "Sinh": (np.sinh, lambda g, x, y: g.op("Mul", [g.dy, g.op("Cosh", [x])])),
    "Cosh": (np.cosh, lambda g, x, y: g.op("Mul", [g.dy, g.op("Sinh", [x])])),
    "Asinh": (np.arcsinh, lambda g, x, y: g.op("Div", [g.dy, g.op("Sqrt", [g.op("Add", [_sq(g, x), _one(g, x)])])])),
    "Acosh": (np.arccosh, lambda g, x, y: g.op("Div", [g.dy, g.op("Sqrt", [g.op("Sub", [_sq(g, x), _one(g, x)])])])),
    "Atanh": (np.arctanh, lambda g, x, y: g.op("Div", [g.dy, g.op("Sub", [_one(g, x), _sq(g, x)])])),
}

for _name, (_fn, _rule) in TRIG.items():
    defop(_name, infer=same_as_first,
          forward=lambda node, ins, f=_fn: np.asarray(f(ins[0])).astype(ins[0].dtype),
          grad=lambda g, r=_rule: [r(g, g.x[0], g.y[0])])


# -- activations as expansions ---------------------------------------------------------------
def _swish(b: Builder, node: Node) -> list[str]:
    x = node.inputs[0]
    alpha = _scalar(b, float(node.attr("alpha", 1.0)), x)
    return [b.op("Mul", [x, b.op("Sigmoid", [b.op("Mul", [x, alpha])])])]


def _thresholded_relu(b: Builder, node: Node) -> list[str]:
    x = node.inputs[0]
    keep = b.op("Greater", [x, _scalar(b, float(node.attr("alpha", 1.0)), x)])
    return [b.op("Where", [keep, x, _scalar(b, 0, x)])]


def _shrink(b: Builder, node: Node) -> list[str]:
    x = node.inputs[0]
    lambd, bias = float(node.attr("lambd", 0.5)), float(node.attr("bias", 0.0))
    low = b.op("Less", [x, _scalar(b, -lambd, x)])
    high = b.op("Greater", [x, _scalar(b, lambd, x)])
    zero = _scalar(b, 0, x)
    if bias:
        return [b.op("Where", [low, b.op("Add", [x, _scalar(b, bias, x)]),
                               b.op("Where", [high, b.op("Sub", [x, _scalar(b, bias, x)]), zero])])]
    return [b.op("Where", [b.op("Or", [low, high]), x, zero])]


for _name, _expand in [("Swish", _swish), ("ThresholdedRelu", _thresholded_relu), ("Shrink", _shrink)]:
    defcomposite(_name, infer=same_as_first, expand=_expand)


# -- normalizations as expansions --------------------------------------------------------------
def _lp_normalization(b: Builder, node: Node) -> list[str]:
    x = node.inputs[0]
    p = int(node.attr("p", 2))
    if p not in (1, 2):
        raise UnsupportedOpError(f"{node.label}: p={p}; LpNormalization supports p=1 and p=2")
    axis = norm_axis(int(node.attr("axis", -1)), len(b.shape(x)))
    norm = b.op("ReduceL2" if p == 2 else "ReduceL1", [x, _i64(b, [axis])], keepdims=1)
    # a zero vector stays zero (ONNX), instead of 0/0
    safe = b.op("Where", [b.op("Equal", [norm, _scalar(b, 0, x)]), _scalar(b, 1, x), norm])
    return [b.op("Div", [x, safe])]


def _mvn(b: Builder, node: Node) -> list[str]:
    # ONNX's function body: (X - E[X]) / (sqrt(E[X^2] - E[X]^2) + 1e-9)
    x = node.inputs[0]
    axes = _i64(b, node.attr("axes", [0, 2, 3]))
    mean = b.op("ReduceMean", [x, axes], keepdims=1)
    mean_sq = b.op("ReduceMean", [b.op("Mul", [x, x]), axes], keepdims=1)
    std = b.op("Sqrt", [b.op("Sub", [mean_sq, b.op("Mul", [mean, mean])])])
    return [b.op("Div", [b.op("Sub", [x, mean]), b.op("Add", [std, _scalar(b, 1e-9, x)])])]


defcomposite("LpNormalization", infer=same_as_first, expand=_lp_normalization)
defcomposite("MeanVarianceNormalization", infer=same_as_first, expand=_mvn)


def _lrn(b: Builder, node: Node) -> list[str]:
    """x / (bias + alpha/size * sum of x^2 over a window of channels)^beta. The channel window sum
    is an AveragePool (count_include_pad) over a (N, 1, C, rest) view, times the window size."""
    x = node.inputs[0]
    shape = b.shape(x)
    size = int(node.attr("size"))
    alpha, beta, bias = float(node.attr("alpha", 1e-4)), float(node.attr("beta", 0.75)), float(node.attr("bias", 1.0))
    n, c = shape[0], shape[1]
    rest = int(np.prod(shape[2:], dtype=np.int64))
    sq = b.reshape(b.op("Mul", [x, x]), (n, 1, c, rest))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    avg = b.op("AveragePool", [sq], kernel_shape=[size, 1], pads=[lo, 0, hi, 0], count_include_pad=1)
    # avg * size * alpha / size = avg * alpha
    scale = b.op("Add", [_scalar(b, bias, x), b.op("Mul", [avg, _scalar(b, alpha, x)])])
    return [b.op("Div", [x, b.reshape(b.op("Pow", [scale, _scalar(b, beta, x)]), shape)])]


defcomposite("LRN", infer=same_as_first, expand=_lrn)


# -- pools as expansions ---------------------------------------------------------------------
def _global_pool_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    shape = tuple(ins[0].shape)
    return [TensorInfo(ins[0].dtype, shape[:2] + (1,) * (len(shape) - 2))]


def _global_max_pool(b: Builder, node: Node) -> list[str]:
    x = node.inputs[0]
    return [b.op("ReduceMax", [x, _i64(b, list(range(2, len(b.shape(x)))))], keepdims=1)]


defcomposite("GlobalMaxPool", infer=_global_pool_infer, expand=_global_max_pool)


def _lp_pool_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    return get_op("AveragePool").infer(_lp_pool_as_avg(node), ins)


def _lp_pool_as_avg(node: Node) -> Node:
    attrs = {k: v for k, v in node.attrs.items() if k != "p"}
    return Node("AveragePool", node.inputs, node.outputs, {**attrs, "count_include_pad": 1}, node.name)


def _lp_pool(b: Builder, node: Node) -> list[str]:
    """(sum over the window of |x|^p)^(1/p): a zero-padded AveragePool of |x|^p times the window size."""
    x = node.inputs[0]
    p = float(node.attr("p", 2))
    powered = b.op("Mul", [x, x]) if p == 2 else b.op("Pow", [b.op("Abs", [x]), _scalar(b, p, x)])
    avg = _lp_pool_as_avg(node)
    pooled = b.op("AveragePool", [powered], **avg.attrs)
    total = b.op("Mul", [pooled, _scalar(b, float(np.prod(node.attr("kernel_shape"))), x)])
    return [b.op("Sqrt", [total]) if p == 2 else b.op("Pow", [total, _scalar(b, 1.0 / p, x)])]


defcomposite("LpPool", infer=_lp_pool_infer, expand=_lp_pool)


# -- Compress: a Gather with indices known at compile time -------------------------------------
def _compress_indices(node: Node, cond) -> np.ndarray:
    if isinstance(cond, TensorInfo):
        if cond.const is None:
            raise ShapeError(f"{node.label}: the condition must be known when the model is compiled "
                             "(the output's shape depends on it)")
        cond = cond.const
    return np.nonzero(np.asarray(cond).reshape(-1))[0].astype(np.int64)


def _compress_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    x, idx = ins[0], _compress_indices(node, ins[1])
    if node.attr("axis") is None:
        return [TensorInfo(x.dtype, (len(idx),))]
    axis = norm_axis(int(node.attr("axis")), len(x.shape))
    return [TensorInfo(x.dtype, tuple(x.shape[:axis]) + (len(idx),) + tuple(x.shape[axis + 1:]))]


def _compress(b: Builder, node: Node) -> list[str]:
    x = node.inputs[0]
    idx = _compress_indices(node, b.info(node.inputs[1]))
    if node.attr("axis") is None:
        x, axis = b.reshape(x, (int(np.prod(b.shape(x))),)), 0
    else:
        axis = norm_axis(int(node.attr("axis")), len(b.shape(x)))
        idx = idx[idx < b.shape(x)[axis]]  # a longer condition selects nothing past the end
    return [b.op("Gather", [x, _i64(b, idx)], axis=axis)]


defcomposite("Compress", infer=_compress_infer, expand=_compress, nondiff=[1])


def _nonzero_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    x = ins[0]
    if x.const is None:
        raise ShapeError(f"{node.label}: the input must be known when the model is compiled "
                         "(the output's shape depends on its values)")
    out = np.array(np.nonzero(np.asarray(x.const)), np.int64)
    return [TensorInfo(np.dtype(np.int64), out.shape, out)]


defop("NonZero", infer=_nonzero_infer, nondiff=[0],
      forward=lambda node, ins: np.array(np.nonzero(ins[0]), np.int64))


# -- CumProd ---------------------------------------------------------------------------------
def _cum_axis(node: Node, ins: list, rank: int) -> int:
    return norm_axis(ints_of(ins[1], "axis", node)[0], rank)


def _cumprod_forward(node: Node, ins: list) -> np.ndarray:
    x = ins[0]
    axis = _cum_axis(node, ins, x.ndim)
    exclusive, reverse = int(node.attr("exclusive", 0)), int(node.attr("reverse", 0))
    if reverse:
        x = np.flip(x, axis)
    if exclusive:
        ones = np.ones_like(np.take(x, [0], axis=axis))
        x = np.concatenate([ones, np.take(x, np.arange(x.shape[axis] - 1), axis=axis)], axis=axis)
    y = np.cumprod(x, axis=axis, dtype=x.dtype)
    return np.flip(y, axis) if reverse else y


def _cumprod_grad(g: GradContext):
    """dx_k = sum over the outputs y_i that include x_k of dy_i * y_i / x_k: a CumSum of dy*y run
    the other way. Exact for nonzero inputs (as PyTorch's fast path); a zero input gets inf/nan."""
    x, axis = g.x
    summed = g.op("CumSum", [g.op("Mul", [g.dy, g.y[0]]), axis], exclusive=int(g.node.attr("exclusive", 0)),
                  reverse=1 - int(g.node.attr("reverse", 0)))
    return [g.op("Div", [summed, x]), None]


defop("CumProd", infer=same_as_first, forward=_cumprod_forward, grad=_cumprod_grad, nondiff=[1])


# -- Hardmax: one-hot of the first maximum along an axis (opset 13); zero gradient -----------
def _hardmax_forward(node: Node, ins: list) -> np.ndarray:
    x = ins[0]
    axis = norm_axis(int(node.attr("axis", -1)), x.ndim)
    arg = np.expand_dims(np.argmax(x, axis=axis), axis)
    out = np.zeros_like(x)
    np.put_along_axis(out, arg, 1, axis=axis)
    return out


defop("Hardmax", infer=same_as_first, forward=_hardmax_forward, nondiff=[0])


# -- EyeLike ---------------------------------------------------------------------------------
def _eyelike_dtype(node: Node, x) -> np.dtype:
    return onnx_dtype(node.attr("dtype"), node) if node.attr("dtype") is not None else np.dtype(x.dtype)


defop("EyeLike", nondiff=[0],
      infer=lambda node, ins: [TensorInfo(_eyelike_dtype(node, ins[0]), tuple(ins[0].shape))],
      forward=lambda node, ins: np.eye(*ins[0].shape, k=int(node.attr("k", 0)), dtype=_eyelike_dtype(node, ins[0])))


# -- window functions: generalized cosine windows a0 - a1 cos(2 pi n / N) + a2 cos(4 pi n / N) --
WINDOWS = {"HannWindow": (0.5, 0.5, 0.0), "HammingWindow": (25 / 46, 21 / 46, 0.0),
           "BlackmanWindow": (0.42, 0.5, 0.08)}


def _window_dtype(node: Node) -> np.dtype:
    return onnx_dtype(node.attr("output_datatype", 1), node)


def _window_size(node: Node, value) -> int:
    return ints_of(value, "size", node)[0]


def _window_forward(coeffs):
    def forward(node: Node, ins: list) -> np.ndarray:
        size = _window_size(node, ins[0])
        denom = size if int(node.attr("periodic", 1)) else size - 1
        n = np.arange(size, dtype=np.float64)
        a0, a1, a2 = coeffs
        w = a0 - a1 * np.cos(2 * np.pi * n / denom) + a2 * np.cos(4 * np.pi * n / denom)
        return w.astype(_window_dtype(node))
    return forward


for _name, _coeffs in WINDOWS.items():
    defop(_name, nondiff=[0], forward=_window_forward(_coeffs),
          infer=lambda node, ins: [TensorInfo(_window_dtype(node), (_window_size(node, ins[0]),))])


# -- Det -------------------------------------------------------------------------------------
def _cofactors(x: np.ndarray) -> np.ndarray:
    """d det(x) / dx: the cofactor matrix, from the minors (defined for singular x too)."""
    n = x.shape[-1]
    if n == 1:
        return np.ones_like(x)
    out = np.empty_like(x)
    keep = [np.array([k for k in range(n) if k != i]) for i in range(n)]
    for i in range(n):
        for j in range(n):
            minor = x[..., keep[i][:, None], keep[j][None, :]]
            out[..., i, j] = (-1) ** (i + j) * np.linalg.det(minor)
    return out


def _det_grad_forward(node: Node, ins: list) -> np.ndarray:
    dy, x = ins[0], ins[1].astype(np.float64)
    return (np.asarray(dy, np.float64)[..., None, None] * _cofactors(x)).astype(ins[1].dtype)


defop("Det", infer=lambda node, ins: [TensorInfo(ins[0].dtype, tuple(ins[0].shape[:-2]))],
      forward=lambda node, ins: np.asarray(np.linalg.det(ins[0])).astype(ins[0].dtype),
      grad=lambda g: [g.op("DetGrad", [g.dy, g.x[0]])])
defop("DetGrad", internal=True, forward=_det_grad_forward,
      infer=lambda node, ins: [TensorInfo(ins[1].dtype, tuple(ins[1].shape))])


# -- ReverseSequence: its own inverse, so also its own gradient -------------------------------
def _reverse_sequence_forward(node: Node, ins: list) -> np.ndarray:
    x, lengths = ins[0], np.asarray(ins[1]).reshape(-1)
    batch_axis, time_axis = int(node.attr("batch_axis", 1)), int(node.attr("time_axis", 0))
    out = x.copy()
    for b, n in enumerate(lengths):
        src = [slice(None)] * x.ndim
        src[batch_axis], src[time_axis] = b, slice(0, int(n))
        dst = list(src)
        dst[time_axis] = slice(int(n) - 1, None, -1) if n > 0 else slice(0, 0)
        out[tuple(src)] = x[tuple(dst)]
    return out


defop("ReverseSequence", infer=same_as_first, forward=_reverse_sequence_forward, nondiff=[1],
      grad=lambda g: [g.op("ReverseSequence", [g.dy, g.x[1]], **g.node.attrs), None])

