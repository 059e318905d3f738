"""Elementwise ops: numpy broadcasting binaries and unary activations.

Each unary op is one table row: numpy kernel and gradient rule. Backward helpers that several
rules need (ReluGrad, SigmoidGrad, ...) are internal elementwise ops, so the wgpu backend can fuse
them like any other elementwise op.
"""
from __future__ import annotations

import numpy as np

from ..ir.builder import GradContext
from ..ir.registry import defop
from ._util import broadcast_infer, same_as_first


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
    defop(_name, infer=same_as_first, forward=_unary(_fn), grad=(lambda gr: lambda g: [gr(g)])(_g))

# Backward helpers: (dy, saved) -> dx.
BACKWARD = {
    "ReluGrad": lambda n, dy, y: dy * (y > 0),
    "LeakyReluGrad": lambda n, dy, x: np.where(x >= 0, dy, dy * np.float32(n.attr("alpha", 0.01))),
    "SigmoidGrad": lambda n, dy, y: dy * y * (1 - y),
    "TanhGrad": lambda n, dy, y: dy * (1 - y * y),
}
for _name, _fn in BACKWARD.items():
    defop(_name, infer=same_as_first, internal=True,
          forward=(lambda f: lambda node, ins: f(node, ins[0], ins[1]).astype(ins[0].dtype))(_fn))
