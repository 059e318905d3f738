"""Elementwise ops: numpy broadcasting binaries and unary activations.

Each unary op is one table row: numpy kernel and gradient rule. Backward helpers that several
rules need (ReluGrad, SigmoidGrad, ...) are internal elementwise ops, so the wgpu backend can fuse
them like any other elementwise op.
"""
from __future__ import annotations

import functools

import numpy as np

from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import (
    ONNX_CODES,
    broadcast_infer,
    broadcast_shape,
    is_float,
    onnx_dtype,
    same_as_first,
    slot,
)


# -- binary, broadcasting ------------------------------------------------------------------
def _grad_add(g: GradContext):
    a, b = g.x
    return [g.unbroadcast(g.dy, g.shape(a)) if g.need(0) else None,
            g.unbroadcast(g.dy, g.shape(b)) if g.need(1) else None]


def _grad_sub(g: GradContext):
    a, b = g.x
    return [g.unbroadcast(g.dy, g.shape(a)) if g.need(0) else None,
            g.unbroadcast(g.op("Neg", [g.dy]), g.shape(b)) if g.need(1) else None]


def _grad_mul(g: GradContext):
    a, b = g.x
    return [g.unbroadcast(g.op("Mul", [g.dy, b]), g.shape(a)) if g.need(0) else None,
            g.unbroadcast(g.op("Mul", [g.dy, a]), g.shape(b)) if g.need(1) else None]


def _grad_div(g: GradContext):
    a, b = g.x
    da = db = None
    if g.need(0):
        da = g.unbroadcast(g.op("Div", [g.dy, b]), g.shape(a))
    if g.need(1):  # d(a/b)/db = -y/b
        db = g.unbroadcast(g.op("Neg", [g.op("Div", [g.op("Mul", [g.dy, g.y[0]]), b])]), g.shape(b))
    return [da, db]


def _grad_pow(g: GradContext):
    a, b = g.x
    da = db = None
    if g.need(0):  # b * a^(b-1)
        bm1 = g.op("Sub", [b, g.const(1.0, g.dtype(b))])
        da = g.unbroadcast(g.op("Mul", [g.dy, g.op("Mul", [b, g.op("Pow", [a, bm1])])]), g.shape(a))
    if g.need(1):  # y * log(a)
        db = g.unbroadcast(g.op("Mul", [g.dy, g.op("Mul", [g.y[0], g.op("Log", [a])])]), g.shape(b))
    return [da, db]


def _pow(node, ins):
    a, b = ins
    return np.power(a, b).astype(a.dtype)


def _binary(fn):
    return lambda node, ins: fn(ins[0], ins[1]).astype(ins[0].dtype, copy=False)


for _name, _fn, _grad in [("Add", np.add, _grad_add), ("Sub", np.subtract, _grad_sub),
                          ("Mul", np.multiply, _grad_mul)]:
    defop(_name, infer=broadcast_infer, forward=_binary(_fn), grad=_grad)


def _div(node, ins):
    a, b = ins
    if np.issubdtype(a.dtype, np.integer):
        return (np.trunc(a / b)).astype(a.dtype)  # ONNX integer Div truncates
    return (a / b).astype(a.dtype)


defop("Div", infer=broadcast_infer, forward=_div, grad=_grad_div)
defop("Pow", infer=broadcast_infer, forward=_pow, grad=_grad_pow)


# -- unary -----------------------------------------------------------------------------------
def _unary(fn):
    return lambda node, ins: np.asarray(fn(node, ins[0])).astype(ins[0].dtype)


def _one_grad(rule):
    """A rule that returns dx, as a gradient rule (one entry per input)."""
    return lambda g: [rule(g)]


def _backward_kernel(fn):
    """fn(node, dy, saved) -> dx, as a forward kernel over inputs (dy, saved)."""
    return lambda node, ins: fn(node, ins[0], ins[1]).astype(ins[0].dtype)


def _sigmoid(x):
    # Stable in both tails; exp of a negative argument never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


UNARY = {
    # name: (numpy kernel(node, x), gradient rule(ctx) -> dx)
    "Neg": (lambda n, x: -x, lambda g: g.op("Neg", [g.dy])),
    "Identity": (lambda n, x: x.copy(), lambda g: g.dy),
    "Exp": (lambda n, x: np.exp(x), lambda g: g.op("Mul", [g.dy, g.y[0]])),
    "Log": (lambda n, x: np.log(x), lambda g: g.op("Div", [g.dy, g.x[0]])),
    "Sqrt": (lambda n, x: np.sqrt(x),
             lambda g: g.op("Div", [g.dy, g.op("Mul", [g.y[0], g.const(2.0, g.dtype(g.y[0]))])])),
    "Relu": (lambda n, x: np.maximum(x, 0), lambda g: g.op("ReluGrad", [g.dy, g.y[0]])),
    "LeakyRelu": (lambda n, x: np.where(x >= 0, x, x * np.float32(n.attr("alpha", 0.01))),
                  lambda g: g.op("LeakyReluGrad", [g.dy, g.x[0]], alpha=g.node.attr("alpha", 0.01))),
    "Sigmoid": (lambda n, x: _sigmoid(x), lambda g: g.op("SigmoidGrad", [g.dy, g.y[0]])),
    "Tanh": (lambda n, x: np.tanh(x), lambda g: g.op("TanhGrad", [g.dy, g.y[0]])),
}

for _name, (_fn, _g) in UNARY.items():
    defop(_name, infer=same_as_first, forward=_unary(_fn), grad=_one_grad(_g))

# Backward helpers: (dy, saved) -> dx.
BACKWARD = {
    "ReluGrad": lambda n, dy, y: dy * (y > 0),
    "LeakyReluGrad": lambda n, dy, x: np.where(x >= 0, dy, dy * np.float32(n.attr("alpha", 0.01))),
    "SigmoidGrad": lambda n, dy, y: dy * y * (1 - y),
    "TanhGrad": lambda n, dy, y: dy * (1 - y * y),
}
for _name, _fn in BACKWARD.items():
    defop(_name, infer=same_as_first, internal=True,
          forward=_backward_kernel(_fn))


# -- more unary ------------------------------------------------------------------------------
_ERFC_COEFFS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
                0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def erf(x: np.ndarray) -> np.ndarray:
    """erf without scipy: the Maclaurin series near 0 (double precision for |x| < 0.5), elsewhere
    Numerical Recipes' erfc (relative error < 1.2e-7: below float32 resolution)."""
    x64 = np.asarray(x, np.float64)
    out = np.empty_like(x64)
    small = np.abs(x64) < 0.5
    xs = x64[small]
    z2, term, series = xs * xs, xs.copy(), xs.copy()
    for n in range(1, 14):  # term_n = (-1)^n x^(2n+1) / n!
        term = term * -z2 / n
        series += term / (2 * n + 1)
    out[small] = series * (2.0 / np.sqrt(np.pi))
    xl = x64[~small]
    a = np.abs(xl)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = np.full_like(t, _ERFC_COEFFS[-1])
    for c in reversed(_ERFC_COEFFS[:-1]):
        poly = poly * t + c
    out[~small] = np.sign(xl) * (1.0 - t * np.exp(-a * a + poly))
    return out


UNARY_MORE = {
    "Abs": (lambda n, x: np.abs(x), lambda g: g.op("Mul", [g.dy, g.op("Sign", [g.x[0]])])),
    "Reciprocal": (lambda n, x: 1 / x,
                   lambda g: g.op("Neg", [g.op("Mul", [g.dy, g.op("Mul", [g.y[0], g.y[0]])])])),
    "Erf": (lambda n, x: erf(x), lambda g: g.op("ErfGrad", [g.dy, g.x[0]])),
}
for _name, (_fn, _g) in UNARY_MORE.items():
    defop(_name, infer=same_as_first, forward=_unary(_fn), grad=_one_grad(_g))

# Piecewise constant: the gradient is zero almost everywhere, so the input slot is nondiff.
STEP_FUNCTIONS = {
    "Sign": np.sign, "Floor": np.floor, "Ceil": np.ceil,
    "Round": np.round,  # numpy rounds half to even, as ONNX Round does
    "Not": np.logical_not,
}
for _name, _fn in STEP_FUNCTIONS.items():
    defop(_name, infer=same_as_first, nondiff=[0], forward=_unary(lambda n, x, f=_fn: f(x)))

BACKWARD_MORE = {
    "ErfGrad": lambda n, dy, x: dy * (2.0 / np.sqrt(np.pi)) * np.exp(-x * x),
}
for _name, _fn in BACKWARD_MORE.items():
    defop(_name, infer=same_as_first, internal=True,
          forward=_backward_kernel(_fn))


# -- comparisons and logic (bool outputs, no gradient) ---------------------------------------
COMPARE = {
    "Equal": np.equal, "Less": np.less, "LessOrEqual": np.less_equal, "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal, "And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor,
}


def _bool_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    return [TensorInfo(np.dtype(np.bool_), broadcast_infer(node, ins)[0].shape)]


for _name, _fn in COMPARE.items():
    defop(_name, infer=_bool_infer, nondiff=[0, 1],
          forward=lambda node, ins, f=_fn: np.asarray(f(ins[0], ins[1])))


def _where_infer(node, ins):
    return [TensorInfo(ins[1].dtype, broadcast_shape(*[i.shape for i in ins]))]


def _where_grad(g: GradContext):
    c, x, y = g.x
    zero = g.const(0.0, g.dtype(g.dy), "zero")
    return [None,
            g.unbroadcast(g.op("Where", [c, g.dy, zero]), g.shape(x)) if g.need(1) else None,
            g.unbroadcast(g.op("Where", [c, zero, g.dy]), g.shape(y)) if g.need(2) else None]


defop("Where", infer=_where_infer, grad=_where_grad, nondiff=[0],
      forward=lambda node, ins: np.where(ins[0], ins[1], ins[2]).astype(ins[1].dtype, copy=False))


# -- Cast ------------------------------------------------------------------------------------
def _cast_grad(g: GradContext):
    src, dst = g.dtype(g.x[0]), g.dtype(g.y[0])
    if not (is_float(src) and is_float(dst)):
        return [None] * len(g.x)  # through integers and bools nothing flows back
    return [g.op("Cast", [g.dy], to=ONNX_CODES[src])] + [None] * (len(g.x) - 1)


defop("Cast", grad=_cast_grad,
      infer=lambda node, ins: [TensorInfo(onnx_dtype(node.attr("to"), node), tuple(ins[0].shape))],
      forward=lambda node, ins: ins[0].astype(onnx_dtype(node.attr("to"), node)))
defop("CastLike", grad=_cast_grad, nondiff=[1],
      infer=lambda node, ins: [TensorInfo(ins[1].dtype, tuple(ins[0].shape))],
      forward=lambda node, ins: ins[0].astype(ins[1].dtype))


# -- Clip ------------------------------------------------------------------------------------
def _clip_bounds(node: Node, ins: list, first: int = 1) -> tuple:
    """(min, max): inputs (opset 11+) or attributes (opset 6); None where absent."""
    lo, hi = slot(ins, first), slot(ins, first + 1)
    return (lo if lo is not None else node.attr("min"), hi if hi is not None else node.attr("max"))


def _clip_forward(node, ins):
    x = ins[0]
    lo, hi = _clip_bounds(node, ins)
    if lo is not None:
        x = np.maximum(x, lo)
    if hi is not None:
        x = np.minimum(x, hi)
    return np.asarray(x).astype(ins[0].dtype, copy=False)


def _clip_grad_forward(node, ins):
    dy, x = ins[0], ins[1]
    lo, hi = _clip_bounds(node, ins, first=2)
    keep = np.ones(x.shape, bool)
    if lo is not None:
        keep &= x >= lo
    if hi is not None:
        keep &= x <= hi
    return (dy * keep).astype(dy.dtype)


def _clip_grad(g: GradContext):
    """PyTorch's clamp backward (its conventions up to 2.13): x gets dy where min <= x <= max; a
    tensor bound gets the dy of the elements it clipped, min only while min < max (when min >= max
    every clipped element is max)."""
    bounds = {k: g.node.attr(k) for k in ("min", "max") if g.node.attr(k) is not None}
    x, lo, hi = g.x[0], g.node.input(1), g.node.input(2)
    dx = g.op("ClipGrad", [g.dy, x, lo, hi], **bounds) if g.need(0) else None
    dlo = dhi = None
    if g.need(1) or g.need(2):
        zero = g.const(0.0, g.dtype(g.dy), "zero")
    if g.need(1):  # x < min, while min < max
        mask = g.op("Less", [x, lo])
        if hi:
            mask = g.op("And", [mask, g.op("Less", [lo, hi])])
        dlo = g.unbroadcast(g.op("Where", [mask, g.dy, zero]), g.shape(lo))
    if g.need(2):  # x > max, or x < min while max <= min (every clipped element is max then)
        mask = g.op("Greater", [x, hi])
        if lo:
            mask = g.op("Or", [mask, g.op("And", [g.op("Not", [g.op("Greater", [hi, lo])]), g.op("Less", [x, lo])])])
        dhi = g.unbroadcast(g.op("Where", [mask, g.dy, zero]), g.shape(hi))
    return [dx, dlo, dhi]


defop("Clip", infer=same_as_first, forward=_clip_forward, grad=_clip_grad)
# dy where min <= x <= max (inclusive, as PyTorch's clamp), 0 elsewhere. Inputs: dy, x, min?, max?.
defop("ClipGrad", infer=same_as_first, forward=_clip_grad_forward, internal=True)


# -- variadic, broadcasting: Sum Mean Max Min ------------------------------------------------
def _variadic_forward(fn, mean: bool = False):
    def forward(node, ins):
        ins = [i for i in ins if i is not None]
        out = functools.reduce(fn, ins)
        if mean:
            out = out / len(ins)
        return np.asarray(out).astype(ins[0].dtype, copy=False)
    return forward


def _sum_grad(scale: bool):
    def rule(g: GradContext):
        dy = g.dy
        if scale and len(g.x) > 1:
            dy = g.op("Mul", [dy, g.const(1.0 / len(g.x), g.dtype(dy))])
        return [g.unbroadcast(dy, g.shape(x)) if g.need(i) else None for i, x in enumerate(g.x)]
    return rule


def _select_grad(g: GradContext):
    """Max/Min: the gradient goes to the inputs equal to the result, split evenly between ties
    (as PyTorch's maximum/minimum do)."""
    if len(g.x) == 1:
        return [g.dy]
    dtype = g.dtype(g.dy)
    masks = [g.op("Cast", [g.op("Equal", [x, g.y[0]])], to=ONNX_CODES[dtype]) for x in g.x]
    share = g.op("Div", [g.dy, g.add_all(masks)])
    return [g.unbroadcast(g.op("Mul", [share, m]), g.shape(x)) if g.need(i) else None
            for i, (x, m) in enumerate(zip(g.x, masks))]


for _name, _fwd, _g in [("Sum", _variadic_forward(np.add), _sum_grad(False)),
                        ("Mean", _variadic_forward(np.add, mean=True), _sum_grad(True)),
                        ("Max", _variadic_forward(np.maximum), _select_grad),
                        ("Min", _variadic_forward(np.minimum), _select_grad)]:
    defop(_name, infer=broadcast_infer, forward=_fwd, grad=_g)


# -- activations PyTorch exports as single ONNX ops --------------------------------------------
# Each: numpy kernel(node, x) and the internal backward op's kernel(node, dy, x) -> dx. The
# backward ops take x (not y) so every rule has the same shape and fuses like any elementwise op.
_SELU_ALPHA, _SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875
_SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)


def _f(node: Node, key: str, default: float) -> float:
    return float(node.attr(key, default))


def _gelu(node, x):
    if node.attr("approximate", "none") == "tanh":
        return 0.5 * x * (1 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + erf(x / np.sqrt(2.0)))


def _gelu_grad(node, dy, x):
    x = x.astype(np.float64)
    if node.attr("approximate", "none") == "tanh":
        t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))
        return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x))
    return dy * (0.5 * (1 + erf(x / np.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi))


def _softplus(x):
    return np.logaddexp(0, x)


def _hard_sigmoid_args(node):
    return _f(node, "alpha", 0.2), _f(node, "beta", 0.5)


ACTIVATIONS = {
    # name: (forward(node, x), backward(node, dy, x))
    "Gelu": (_gelu, _gelu_grad),
    "Elu": (lambda n, x: np.where(x > 0, x, _f(n, "alpha", 1.0) * np.expm1(np.minimum(x, 0))),
            lambda n, dy, x: np.where(x > 0, dy, dy * _f(n, "alpha", 1.0) * np.exp(np.minimum(x, 0)))),
    "Selu": (lambda n, x: _f(n, "gamma", _SELU_GAMMA) * np.where(
                 x > 0, x, _f(n, "alpha", _SELU_ALPHA) * np.expm1(np.minimum(x, 0))),
             lambda n, dy, x: dy * _f(n, "gamma", _SELU_GAMMA) * np.where(
                 x > 0, 1, _f(n, "alpha", _SELU_ALPHA) * np.exp(np.minimum(x, 0)))),
    "Celu": (lambda n, x: np.maximum(x, 0) + np.minimum(0, _f(n, "alpha", 1.0) * np.expm1(
                 np.minimum(x, 0) / _f(n, "alpha", 1.0))),
             lambda n, dy, x: np.where(x > 0, dy, dy * np.exp(np.minimum(x, 0) / _f(n, "alpha", 1.0)))),
    "Softplus": (lambda n, x: _softplus(x), lambda n, dy, x: dy * _sigmoid(x)),
    "Softsign": (lambda n, x: x / (1 + np.abs(x)), lambda n, dy, x: dy / np.square(1 + np.abs(x))),
    "HardSigmoid": (lambda n, x: np.clip(_hard_sigmoid_args(n)[0] * x + _hard_sigmoid_args(n)[1], 0, 1),
                    lambda n, dy, x: dy * _hard_sigmoid_args(n)[0] * (
                        np.abs(_hard_sigmoid_args(n)[0] * x + _hard_sigmoid_args(n)[1] - 0.5) < 0.5)),
    # HardSwish = x * HardSigmoid(x) with alpha 1/6, beta 0.5 (PyTorch's hardswish)
    "HardSwish": (lambda n, x: x * np.clip(x / 6 + 0.5, 0, 1),
                  lambda n, dy, x: dy * np.where(x < -3, 0, np.where(x <= 3, x / 3 + 0.5, 1))),
    "Mish": (lambda n, x: x * np.tanh(_softplus(x)),
             lambda n, dy, x: dy * (np.tanh(_softplus(x)) + x * _sigmoid(x) * (1 - np.tanh(_softplus(x)) ** 2))),
    # PyTorch's nn.Tanhshrink, as one op (its exporters write Sub(x, Tanh(x)))
    "Tanhshrink": (lambda n, x: x - np.tanh(x), lambda n, dy, x: dy * np.square(np.tanh(x))),
    "Sin": (lambda n, x: np.sin(x), lambda n, dy, x: dy * np.cos(x)),
    "Cos": (lambda n, x: np.cos(x), lambda n, dy, x: -dy * np.sin(x)),
}


def _activation_grad(grad_op: str):
    return lambda g: [g.op(grad_op, [g.dy, g.x[0]], **g.node.attrs)]


# Activations ONNX does not have: anygrad's own ops (internal: no ONNX file may hold them, none is written)
NOT_ONNX = frozenset({"Tanhshrink"})

for _name, (_fwd, _bwd) in ACTIVATIONS.items():
    defop(_name, infer=same_as_first, forward=_unary(_fwd), grad=_activation_grad(f"{_name}Grad"),
          internal=_name in NOT_ONNX)
    defop(f"{_name}Grad", infer=same_as_first, internal=True, forward=_backward_kernel(_bwd))


def _prelu_infer(node, ins):
    # the slope broadcasts to x (unidirectionally): the output has x's shape
    if broadcast_shape(ins[0].shape, ins[1].shape) != tuple(ins[0].shape):
        raise ValueError(f"slope shape {tuple(ins[1].shape)} does not broadcast to {tuple(ins[0].shape)}")
    return [TensorInfo(ins[0].dtype, tuple(ins[0].shape))]


def _prelu_grad(g: GradContext):
    x, slope = g.x
    positive = g.op("Greater", [x, g.const(0.0, g.dtype(x), "zero")])
    zero = g.const(0.0, g.dtype(x), "zero")
    dx = g.op("Where", [positive, g.dy, g.op("Mul", [g.dy, slope])]) if g.need(0) else None
    dslope = (g.unbroadcast(g.op("Where", [positive, zero, g.op("Mul", [g.dy, x])]), g.shape(slope))
              if g.need(1) else None)
    return [dx, dslope]


defop("PRelu", infer=_prelu_infer, grad=_prelu_grad,
      forward=lambda node, ins: np.where(ins[0] > 0, ins[0], ins[0] * ins[1]).astype(ins[0].dtype))
