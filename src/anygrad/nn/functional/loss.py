"""Losses usable inside forward (cross_entropy, nll_loss, mse_loss, l1_loss,
binary_cross_entropy_with_logits); the training loss itself is compile(loss=...).
"""
from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ..tracing import Operand, Tensor, as_tensor
from ._util import _t
from .activation import log_softmax, softplus
from .tensor_ops import mean, sum

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
