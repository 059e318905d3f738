"""Non-linear activations (relu, gelu, softplus, prelu, ...) and softmax/log_softmax, each as the
exporter writes it.
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import ConfigError
from ..tracing import Tensor, as_tensor
from ._util import _axis, _t
from .shape import reshape


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
