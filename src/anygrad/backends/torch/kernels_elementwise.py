"""Elementwise lowerings: broadcasting binaries, unary activations and their backward helpers,
comparisons, Where, Cast, Clip and the variadic Sum/Mean/Max/Min. Each mirrors the numpy
kernel of anygrad/ops/elementwise.py; the runtime casts every result to the output's dtype
(numpy's `.astype(x.dtype)`)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .lowering import Site, is_float, lowering


def _numeric(site: Site) -> bool:
    return all(info is None or np.dtype(info.dtype).kind in "iuf" for info in site.ins)


def _floats(site: Site) -> bool:
    return all(info is None or is_float(info.dtype) for info in site.ins)


# -- binary, broadcasting ---------------------------------------------------------------------
@lowering("Add", "Sub", "Mul")
def _arith(site: Site):
    if not _numeric(site):
        return None
    import torch
    fn = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul}[site.node.op]
    return lambda ins: [fn(ins[0], ins[1])]


@lowering("Div")
def _div(site: Site):
    if not _numeric(site):
        return None
    if is_float(site.dtype(0)):
        return lambda ins: [ins[0] / ins[1]]
    # ONNX integer Div truncates; numpy's reference divides in double first (and so do we)
    return lambda ins: [(ins[0].double() / ins[1].double()).trunc()]


@lowering("Pow")
def _pow(site: Site):
    if not is_float(site.dtype(0)) or not _numeric(site):
        return None
    import torch
    return lambda ins: [torch.pow(ins[0], ins[1])]


# -- unary ---------------------------------------------------------------------------------------
def _unary_table() -> dict[str, tuple[bool, Any]]:
    """op -> (floats only, fn(site, x))."""
    import torch
    return {
        "Neg": (False, lambda s, x: -x),
        "Identity": (False, lambda s, x: x),
        "Abs": (False, lambda s, x: torch.abs(x)),
        "Sign": (False, lambda s, x: torch.sign(x)),
        "Relu": (False, lambda s, x: torch.relu(x)),
        "Exp": (True, lambda s, x: torch.exp(x)),
        "Log": (True, lambda s, x: torch.log(x)),
        "Sqrt": (True, lambda s, x: torch.sqrt(x)),
        "Sigmoid": (True, lambda s, x: torch.sigmoid(x)),
        "Tanh": (True, lambda s, x: torch.tanh(x)),
        "Reciprocal": (True, lambda s, x: torch.reciprocal(x)),
        "Erf": (True, lambda s, x: torch.erf(x)),
        "Floor": (True, lambda s, x: torch.floor(x)),
        "Ceil": (True, lambda s, x: torch.ceil(x)),
        "Round": (True, lambda s, x: torch.round(x)),  # half to even, as numpy and ONNX
        "LeakyRelu": (True, lambda s, x: torch.where(
            x >= 0, x, x * float(np.float32(s.attr("alpha", 0.01))))),
    }


UNARY = ("Neg", "Identity", "Abs", "Sign", "Relu", "Exp", "Log", "Sqrt", "Sigmoid", "Tanh", "Reciprocal",
         "Erf", "Floor", "Ceil", "Round", "LeakyRelu")


@lowering(*UNARY)
def _unary(site: Site):
    floats_only, fn = _unary_table()[site.node.op]
    if not _numeric(site) or (floats_only and not _floats(site)):
        return None
    if site.node.op in ("Abs", "Neg") and site.dtype(0).kind == "u":
        return None  # numpy's unsigned wrap-around, which torch does not share
    return lambda ins: [fn(site, ins[0])]


@lowering("Not")
def _not(site: Site):
    import torch
    return lambda ins: [torch.logical_not(ins[0])]


# Backward helpers: (dy, saved) -> dx.
@lowering("ReluGrad", "LeakyReluGrad", "SigmoidGrad", "TanhGrad", "ErfGrad")
def _backward(site: Site):
    if not _floats(site):
        return None
    import torch
    op = site.node.op
    if op == "ReluGrad":  # PyTorch's own relu backward: one kernel, where dy * (y > 0) takes two
        return lambda ins: [torch.ops.aten.threshold_backward(ins[0], ins[1], 0)]
    if op == "LeakyReluGrad":
        alpha = float(np.float32(site.attr("alpha", 0.01)))
        return lambda ins: [torch.where(ins[1] >= 0, ins[0], ins[0] * alpha)]
    if op == "SigmoidGrad":
        return lambda ins: [ins[0] * ins[1] * (1 - ins[1])]
    if op == "TanhGrad":
        return lambda ins: [ins[0] * (1 - ins[1] * ins[1])]
    c = 2.0 / math.sqrt(math.pi)
    return lambda ins: [ins[0] * c * torch.exp(-ins[1] * ins[1])]


# -- comparisons and logic -------------------------------------------------------------------------
@lowering("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor")
def _compare(site: Site):
    import torch
    fn = {"Equal": torch.eq, "Less": torch.lt, "LessOrEqual": torch.le, "Greater": torch.gt,
          "GreaterOrEqual": torch.ge, "And": torch.logical_and, "Or": torch.logical_or,
          "Xor": torch.logical_xor}[site.node.op]
    return lambda ins: [fn(ins[0], ins[1])]


@lowering("Where")
def _where(site: Site):
    import torch
    return lambda ins: [torch.where(ins[0].bool(), ins[1], ins[2])]


@lowering("Cast", "CastLike")
def _cast(site: Site):
    src, dst = site.dtype(0), np.dtype(site.outs[0].dtype)
    if src.kind == "f" and dst.kind in "iub":
        return None  # float -> integer of out-of-range values: leave numpy's rules to numpy
    return lambda ins: [ins[0]]  # the runtime casts to the output dtype


@lowering("Clip")
def _clip(site: Site):
    if not _numeric(site):
        return None
    import torch
    lo_slot, hi_slot = site.has(1), site.has(2)
    lo_attr, hi_attr = site.attr("min"), site.attr("max")

    def clip(ins):
        x = ins[0]
        lo = ins[1] if lo_slot else lo_attr
        hi = ins[2] if hi_slot else hi_attr
        if lo is not None:
            x = torch.maximum(x, lo if torch.is_tensor(lo) else torch.tensor(lo, dtype=x.dtype, device=x.device))
        if hi is not None:
            x = torch.minimum(x, hi if torch.is_tensor(hi) else torch.tensor(hi, dtype=x.dtype, device=x.device))
        return [x]
    return clip


@lowering("Sum", "Mean", "Max", "Min")
def _variadic(site: Site):
    if not _numeric(site) or (site.node.op == "Mean" and not _floats(site)):
        return None
    import torch
    op = site.node.op
    fn = {"Sum": torch.add, "Mean": torch.add, "Max": torch.maximum, "Min": torch.minimum}[op]

    def run(ins):
        xs = [x for x in ins if x is not None]
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        return [out / len(xs) if op == "Mean" else out]
    return run


# -- hard activations (MobileNetV3) and their backward helpers -------------------------------------
def _hard_sigmoid_args(site: Site) -> tuple[float, float]:
    # ONNX's defaults; PyTorch's hardsigmoid exports alpha 1/6
    return float(site.attr("alpha", 0.2)), float(site.attr("beta", 0.5))


@lowering("HardSigmoid", "HardSwish")
def _hard(site: Site):
    if not _floats(site):
        return None
    import torch
    if site.node.op == "HardSwish":
        return lambda ins: [ins[0] * torch.clamp(ins[0] / 6 + 0.5, 0, 1)]
    alpha, beta = _hard_sigmoid_args(site)
    return lambda ins: [torch.clamp(ins[0] * alpha + beta, 0, 1)]


@lowering("HardSigmoidGrad", "HardSwishGrad")
def _hard_grad(site: Site):
    """(dy, x) -> dx. The boundaries as the reference kernel draws them: HardSigmoid passes dy
    strictly inside (0, 1); HardSwish's slope is 0 below -3, x/3 + 1/2 up to 3 inclusive, then 1."""
    if not _floats(site):
        return None
    import torch
    if site.node.op == "HardSwishGrad":
        def hard_swish_grad(ins):
            dy, x = ins
            slope = torch.where(x < -3, torch.zeros_like(x), torch.where(x <= 3, x / 3 + 0.5, torch.ones_like(x)))
            return [dy * slope]
        return hard_swish_grad
    alpha, beta = _hard_sigmoid_args(site)
    return lambda ins: [ins[0] * alpha * (torch.abs(ins[1] * alpha + beta - 0.5) < 0.5)]


@lowering("ClipGrad")
def _clip_grad(site: Site):
    """(dy, x, min?, max?) -> dy where min <= x <= max (inclusive, PyTorch's clamp), else 0; the
    bounds are inputs (opset 11+) or the attributes min/max (opset 6), as Clip's."""
    if not _numeric(site):
        return None
    lo_slot, hi_slot = site.has(2), site.has(3)
    lo_attr, hi_attr = site.attr("min"), site.attr("max")

    def clip_grad(ins):
        dy, x = ins[0], ins[1]
        lo = ins[2] if lo_slot else lo_attr
        hi = ins[3] if hi_slot else hi_attr
        keep = None
        if lo is not None:
            keep = x >= lo
        if hi is not None:
            keep = x <= hi if keep is None else keep & (x <= hi)
        return [dy if keep is None else dy * keep]
    return clip_grad


@lowering("IsNaN", "IsInf")
def _is_special(site: Site):
    if not _floats(site):
        return None  # integers are never NaN or infinite: numpy's answer on the host is as cheap
    import torch
    if site.node.op == "IsNaN":
        return lambda ins: [torch.isnan(ins[0])]
    positive, negative = bool(site.attr("detect_positive", 1)), bool(site.attr("detect_negative", 1))

    def is_inf(ins):
        x = ins[0]
        if positive and negative:
            return [torch.isinf(x)]
        if positive:
            return [torch.isposinf(x)]
        return [torch.isneginf(x) if negative else torch.zeros_like(x, dtype=torch.bool)]
    return is_inf


@lowering("Tanhshrink", "TanhshrinkGrad")
def _tanhshrink(site: Site):
    """x - tanh(x); its backward (dy, x) -> dy * tanh(x)^2."""
    if not _floats(site):
        return None
    import torch
    if site.node.op == "Tanhshrink":
        return lambda ins: [ins[0] - torch.tanh(ins[0])]
    return lambda ins: [ins[0] * torch.square(torch.tanh(ins[1]))]


@lowering("Gelu", "GeluGrad")
def _gelu(site: Site):
    """Both GELU variants (erf, tanh) as aten's single kernels; the backward is (dy, x) -> dx."""
    if not _floats(site):
        return None
    import torch
    approximate = "tanh" if site.attr("approximate", "none") == "tanh" else "none"
    if site.node.op == "Gelu":
        return lambda ins: [torch.nn.functional.gelu(ins[0], approximate=approximate)]
    return lambda ins: [torch.ops.aten.gelu_backward(ins[0], ins[1], approximate=approximate)]


# -- activations, trigonometric and hyperbolic functions (floats only) -------------------------------
def _alpha(site: Site, default: float) -> float:
    return float(site.attr("alpha", default))


_SELU_ALPHA, _SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875  # ONNX's, not torch's


def _float_unary_table() -> dict[str, Any]:
    """op -> fn(site) -> kernel body fn(x): forwards mirroring ops/elementwise.py ACTIVATIONS and
    ops/math_extra.py TRIG."""
    import torch
    import torch.nn.functional as F

    def softplus(s):
        # logaddexp(0, x) as numpy: F.softplus returns x itself past its threshold (off by exp(-x))
        return lambda x: torch.logaddexp(x, x.new_zeros(()))

    def elu(s):
        alpha = _alpha(s, 1.0)
        return lambda x: F.elu(x, alpha)

    def selu(s):
        alpha, gamma = _alpha(s, _SELU_ALPHA), float(s.attr("gamma", _SELU_GAMMA))
        return lambda x: F.elu(x, alpha) * gamma

    def celu(s):  # max(x, 0) + min(0, alpha * expm1(x / alpha)) is torch's celu for any nonzero alpha
        alpha = _alpha(s, 1.0)
        return lambda x: F.celu(x, alpha)

    return {
        "Elu": elu, "Selu": selu, "Celu": celu,
        "Softplus": softplus,
        "Softsign": lambda s: F.softsign,
        "Mish": lambda s: F.mish,
        "Sin": lambda s: torch.sin, "Cos": lambda s: torch.cos, "Tan": lambda s: torch.tan,
        "Asin": lambda s: torch.asin, "Acos": lambda s: torch.acos, "Atan": lambda s: torch.atan,
        "Sinh": lambda s: torch.sinh, "Cosh": lambda s: torch.cosh, "Asinh": lambda s: torch.asinh,
        "Acosh": lambda s: torch.acosh, "Atanh": lambda s: torch.atanh,
    }


FLOAT_UNARY = ("Elu", "Selu", "Celu", "Softplus", "Softsign", "Mish", "Sin", "Cos", "Tan", "Asin", "Acos",
               "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh")


@lowering(*FLOAT_UNARY)
def _float_unary(site: Site):
    # numpy runs these on integers in float64 and truncates back: left to numpy
    if not _floats(site) or (site.node.op == "Celu" and _alpha(site, 1.0) == 0):
        return None
    fn = _float_unary_table()[site.node.op](site)
    return lambda ins: [fn(ins[0])]


def _activation_grad_table() -> dict[str, Any]:
    """op -> fn(site) -> kernel body fn(dy, x), as the reference's (dy, x) -> dx."""
    import torch

    def elu(s):
        alpha = _alpha(s, 1.0)
        return lambda dy, x: torch.where(x > 0, dy, dy * alpha * torch.exp(torch.clamp(x, max=0)))

    def selu(s):
        alpha, gamma = _alpha(s, _SELU_ALPHA), float(s.attr("gamma", _SELU_GAMMA))
        return lambda dy, x: dy * gamma * torch.where(x > 0, 1.0, alpha * torch.exp(torch.clamp(x, max=0)))

    def celu(s):
        alpha = _alpha(s, 1.0)
        return lambda dy, x: torch.where(x > 0, dy, dy * torch.exp(torch.clamp(x, max=0) / alpha))

    return {
        "EluGrad": elu, "SeluGrad": selu, "CeluGrad": celu,
        "SoftplusGrad": lambda s: (lambda dy, x: dy * torch.sigmoid(x)),
        "SoftsignGrad": lambda s: (lambda dy, x: dy / torch.square(1 + torch.abs(x))),
        "MishGrad": lambda s: torch.ops.aten.mish_backward,
        "SinGrad": lambda s: (lambda dy, x: dy * torch.cos(x)),
        "CosGrad": lambda s: (lambda dy, x: -dy * torch.sin(x)),
    }


ACTIVATION_GRADS = ("EluGrad", "SeluGrad", "CeluGrad", "SoftplusGrad", "SoftsignGrad", "MishGrad", "SinGrad",
                    "CosGrad")


@lowering(*ACTIVATION_GRADS)
def _activation_grad(site: Site):
    if not _floats(site) or (site.node.op == "CeluGrad" and _alpha(site, 1.0) == 0):
        return None
    fn = _activation_grad_table()[site.node.op](site)
    return lambda ins: [fn(ins[0], ins[1])]


@lowering("PRelu")
def _prelu(site: Site):
    if not _numeric(site):
        return None
    import torch
    return lambda ins: [torch.where(ins[0] > 0, ins[0], ins[0] * ins[1])]


# -- Mod and bitwise ops -------------------------------------------------------------------------------
@lowering("Mod")
def _mod(site: Site):
    """fmod=1: C's fmod (sign of a), torch.fmod; fmod=0: the floored modulo (sign of b),
    torch.remainder. numpy gives 0 for an integer modulo by zero where torch raises: a zero
    divisor becomes 1 and its result 0, without reading b on the host."""
    if not _numeric(site):
        return None
    import torch
    fn = torch.fmod if site.attr("fmod", 0) else torch.remainder
    if _floats(site):
        return lambda ins: [fn(ins[0], ins[1])]

    def int_mod(ins):
        a, b = ins
        zero = b == 0
        return [torch.where(zero, torch.zeros_like(a), fn(a, torch.where(zero, torch.ones_like(b), b)))]
    return int_mod


def _integers(site: Site) -> bool:
    return all(info is None or np.dtype(info.dtype).kind in "iub" for info in site.ins)


@lowering("BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot")
def _bitwise(site: Site):
    if not _integers(site):
        return None
    import torch
    fn = {"BitwiseAnd": torch.bitwise_and, "BitwiseOr": torch.bitwise_or, "BitwiseXor": torch.bitwise_xor,
          "BitwiseNot": torch.bitwise_not}[site.node.op]
    if site.node.op == "BitwiseNot":
        return lambda ins: [fn(ins[0])]
    return lambda ins: [fn(ins[0], ins[1])]


@lowering("BitShift")
def _bit_shift(site: Site):
    """ONNX shifts unsigned integers; torch holds uint8 among those (wider ones arrive widened to
    int64, where a left shift would not wrap as numpy's does)."""
    if site.dtype(0) != np.uint8 or site.dtype(1).kind not in "iu" or site.attr("direction") not in ("LEFT", "RIGHT"):
        return None
    import torch
    fn = torch.bitwise_left_shift if site.attr("direction") == "LEFT" else torch.bitwise_right_shift
    return lambda ins: [fn(ins[0], ins[1].to(ins[0].dtype))]
