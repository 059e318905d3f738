"""Normalisation (batch_norm, layer_norm) and dropout: batch_norm and dropout emit the nodes of an
inference export, which the Model rewrites for training (set_training_mode).
"""
from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ...ir.registry import get_op
from ..tracing import Tensor
from ._util import _t
from .shape import reshape
from .tensor_ops import mean


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
