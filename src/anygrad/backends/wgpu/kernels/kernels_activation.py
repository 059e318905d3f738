"""Activations PyTorch exports as single ONNX ops, and their backward ops (dy, x) -> dx, as
elementwise table rows (see anygrad/ops/elementwise.py ACTIVATIONS for the formulas)."""
from __future__ import annotations

import math

from ....ir.graph import Node
from .kernels_elementwise import _ERF, Emit, ew
from .wgsl import literal

_SELU_ALPHA, _SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875
_K = math.sqrt(2.0 / math.pi)


def F(v: float) -> str:
    return literal(v, "f32")


def _a(n: Node, key: str, default: float) -> str:
    return F(float(n.attr(key, default)))


def _softplus(x: str) -> str:
    return f"(max({x}, 0.0) + log(1.0 + exp(-abs({x}))))"


def _sigmoid(c: Emit, x: str) -> str:
    e = c.let(f"exp(-abs({x}))", "f32").expr
    return c.let(f"select({e} / (1.0 + {e}), 1.0 / (1.0 + {e}), {x} >= 0.0)", "f32").expr


def _tanh(c: Emit, x: str) -> str:
    t = c.let(f"exp(-2.0 * abs({x}))", "f32").expr
    return c.let(f"sign({x}) * (1.0 - {t}) / (1.0 + {t})", "f32").expr


def _expm1_neg(c: Emit, x: str) -> str:
    """expm1(min(x, 0)) with relative accuracy near 0 (a short series there)."""
    m = c.let(f"min({x}, 0.0)", "f32").expr
    return c.let(f"select(exp({m}) - 1.0, {m} * (1.0 + {m} * (0.5 + {m} * (1.0 / 6.0 + {m} / 24.0))), "
                 f"{m} > -0.01)", "f32").expr


def _gelu_parts(c: Emit, n: Node, x: str) -> tuple[str, str]:
    """(Phi-like factor, its derivative times x) for both GELU variants."""
    if n.attr("approximate", "none") in ("tanh", b"tanh"):
        t = _tanh(c, f"{F(_K)} * ({x} + {F(0.044715)} * {x} * {x} * {x})")
        d = f"0.5 * {x} * (1.0 - {t} * {t}) * {F(_K)} * (1.0 + {F(3 * 0.044715)} * {x} * {x})"
        return f"0.5 * (1.0 + {t})", d
    c.helper("erf_f", _ERF)
    return (f"0.5 * (1.0 + erf_f({x} * {F(1 / math.sqrt(2.0))}))",
            f"{x} * exp(-0.5 * {x} * {x}) * {F(1 / math.sqrt(2 * math.pi))}")


@ew("Gelu")
def _gelu(c, n, a, ot):
    x = a[0].expr
    phi, _ = _gelu_parts(c, n, x)
    return [c.let(f"{x} * {phi}", "f32")]


@ew("GeluGrad")
def _gelu_grad(c, n, a, ot):
    x = a[1].expr
    phi, d = _gelu_parts(c, n, x)
    return [c.let(f"{a[0].expr} * ({phi} + {d})", "f32")]


@ew("Elu")
def _elu(c, n, a, ot):
    x = a[0].expr
    return [c.let(f"select({_a(n, 'alpha', 1.0)} * {_expm1_neg(c, x)}, {x}, {x} > 0.0)", "f32")]


@ew("EluGrad")
def _elu_grad(c, n, a, ot):
    dy, x = a[0].expr, a[1].expr
    return [c.let(f"select({dy} * {_a(n, 'alpha', 1.0)} * exp(min({x}, 0.0)), {dy}, {x} > 0.0)", "f32")]


@ew("Selu")
def _selu(c, n, a, ot):
    x = a[0].expr
    e = _expm1_neg(c, x)
    return [c.let(f"{_a(n, 'gamma', _SELU_GAMMA)} * select({_a(n, 'alpha', _SELU_ALPHA)} * {e}, {x}, {x} > 0.0)",
                  "f32")]


@ew("SeluGrad")
def _selu_grad(c, n, a, ot):
    dy, x = a[0].expr, a[1].expr
    return [c.let(f"{dy} * {_a(n, 'gamma', _SELU_GAMMA)} * select({_a(n, 'alpha', _SELU_ALPHA)} * "
                  f"exp(min({x}, 0.0)), 1.0, {x} > 0.0)", "f32")]


@ew("Celu")
def _celu(c, n, a, ot):
    x = a[0].expr
    alpha = float(n.attr("alpha", 1.0))
    e = _expm1_neg(c, f"({x} / {F(alpha)})")
    return [c.let(f"max({x}, 0.0) + min(0.0, {F(alpha)} * {e})", "f32")]


@ew("CeluGrad")
def _celu_grad(c, n, a, ot):
    dy, x = a[0].expr, a[1].expr
    return [c.let(f"select({dy} * exp(min({x}, 0.0) / {_a(n, 'alpha', 1.0)}), {dy}, {x} > 0.0)", "f32")]


@ew("SoftplusGrad")
def _sp_grad(c, n, a, ot):
    return [c.let(f"{a[0].expr} * {_sigmoid(c, a[1].expr)}", "f32")]


@ew("Softsign")
def _softsign(c, n, a, ot):
    x = a[0].expr
    return [c.let(f"{x} / (1.0 + abs({x}))", "f32")]


@ew("SoftsignGrad")
def _softsign_grad(c, n, a, ot):
    x = a[1].expr
    return [c.let(f"{a[0].expr} / ((1.0 + abs({x})) * (1.0 + abs({x})))", "f32")]


@ew("HardSigmoid")
def _hsig(c, n, a, ot):
    return [c.let(f"clamp({_a(n, 'alpha', 0.2)} * {a[0].expr} + {_a(n, 'beta', 0.5)}, 0.0, 1.0)", "f32")]


@ew("HardSigmoidGrad")
def _hsig_grad(c, n, a, ot):
    alpha = _a(n, "alpha", 0.2)
    inner = f"{alpha} * {a[1].expr} + {_a(n, 'beta', 0.5)}"
    return [c.let(f"select(0.0, {a[0].expr} * {alpha}, abs({inner} - 0.5) < 0.5)", "f32")]


@ew("HardSwish")
def _hswish(c, n, a, ot):
    x = a[0].expr
    return [c.let(f"{x} * clamp({x} / 6.0 + 0.5, 0.0, 1.0)", "f32")]


@ew("HardSwishGrad")
def _hswish_grad(c, n, a, ot):
    dy, x = a[0].expr, a[1].expr
    return [c.let(f"{dy} * select(select(1.0, {x} / 3.0 + 0.5, {x} <= 3.0), 0.0, {x} < -3.0)", "f32")]


def _tanh_softplus(c: Emit, x: str) -> str:
    """tanh(softplus(x)) keeping its relative precision for very negative x, where softplus is
    tiny: log1p and tanh by short series there (1 + e and exp(-2t) round away the answer)."""
    e = c.let(f"exp(-abs({x}))", "f32").expr
    l1p = c.let(f"select(log(1.0 + {e}), {e} * (1.0 - {e} * (0.5 - {e} / 3.0)), {e} < 1e-3)", "f32").expr
    sp = c.let(f"max({x}, 0.0) + {l1p}", "f32").expr
    t = _tanh(c, sp)
    return c.let(f"select({t}, {sp} * (1.0 - {sp} * {sp} / 3.0), {sp} < 5e-3)", "f32").expr


@ew("Mish")
def _mish(c, n, a, ot):
    x = a[0].expr
    return [c.let(f"{x} * {_tanh_softplus(c, x)}", "f32")]


@ew("MishGrad")
def _mish_grad(c, n, a, ot):
    x = a[1].expr
    t = _tanh_softplus(c, x)
    return [c.let(f"{a[0].expr} * ({t} + {x} * {_sigmoid(c, x)} * (1.0 - {t} * {t}))", "f32")]


@ew("Tanhshrink")
def _tanhshrink(c, n, a, ot):
    x = a[0].expr
    return [c.let(f"{x} - {_tanh(c, x)}", "f32")]


@ew("TanhshrinkGrad")
def _tanhshrink_grad(c, n, a, ot):
    t = _tanh(c, a[1].expr)
    return [c.let(f"{a[0].expr} * {t} * {t}", "f32")]


@ew("SinGrad")
def _sin_grad(c, n, a, ot):
    return [c.let(f"{a[0].expr} * cos({a[1].expr})", "f32")]


@ew("CosGrad")
def _cos_grad(c, n, a, ot):
    return [c.let(f"-{a[0].expr} * sin({a[1].expr})", "f32")]


@ew("PRelu")
def _prelu(c, n, a, ot):
    x = a[0].expr
    return [c.let(f"select({x} * {a[1].expr}, {x}, {x} > 0.0)", "f32")]

