"""Loss functions as Graph builders: (builder, model output, target) -> scalar loss value.

All use mean reduction, as PyTorch's defaults do.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError, DataError, ShapeError
from .ir.builder import Builder


@dataclass(frozen=True)
class Loss:
    name: str
    build: Callable[[Builder, str, str], str]
    target_dtype: type = np.float32
    classification: bool = False  # targets are class indices; accuracy is meaningful
    options: dict = field(default_factory=dict)

    def targets(self, y) -> np.ndarray:
        """A batch of targets as the step program takes them. Class indices must be whole
        numbers: float labels holding whole numbers (1.0) are accepted, others are an error
        rather than truncated on the way to int64."""
        y = np.asarray(y)
        if not self.classification or y.dtype.kind in "iu":
            return y
        if y.dtype.kind == "f":
            bad = y[~np.isfinite(y) | (y != np.round(y))] if y.size else y[:0]
            if not bad.size:
                return y.astype(np.int64)
            raise DataError(f"loss '{self.name}' takes class indices, but the targets hold non-integer values "
                            f"such as {', '.join(f'{v:g}' for v in bad.reshape(-1)[:3])}; give integer class "
                            "labels (class probabilities are not supported), or use mse/bce_with_logits for "
                            "continuous targets")
        raise DataError(f"loss '{self.name}' takes integer class indices, got targets of dtype {y.dtype}")


LOSSES: dict[str, Callable[..., Loss]] = {}


def get_loss(name: str, **options) -> Loss:
    if name not in LOSSES:
        raise ConfigError(f"unknown loss '{name}'; choose one of {', '.join(sorted(LOSSES))}")
    try:
        return LOSSES[name](**options)
    except TypeError as e:  # an option this loss does not take
        raise ConfigError(f"loss '{name}' does not accept options {sorted(options)}: {e}") from e


# -- helpers --------------------------------------------------------------------------------------
def _mean(b: Builder, v: str) -> str:
    total = b.op("ReduceSum", [v], keepdims=0)
    return b.op("Div", [total, b.const(float(max(1, int(np.prod(b.shape(v))))), b.dtype(v))])


def _matching_target(b: Builder, name: str, target: str, shape: tuple) -> str:
    """The target reshaped to `shape` when only its layout differs ((N,) vs (N, 1)), else an error."""
    tshape = b.shape(target)
    if tuple(tshape) == tuple(shape):
        return target
    if int(np.prod(tshape)) == int(np.prod(shape)):
        return b.reshape(target, shape)
    raise ShapeError(f"loss '{name}': targets of shape {tuple(tshape)} do not fit the expected shape "
                     f"{tuple(shape)}; check the dataset's labels against the model's output")


def _class_weight(name: str, weight) -> np.ndarray | None:
    if weight is None:
        return None
    w = np.asarray(weight, np.float32).reshape(-1)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ConfigError(f"{name}: class weights must be finite and >= 0, got {list(map(float, w))}")
    return w


def _class_index_loss(name: str, log_input: int, label_smoothing: float, weight: np.ndarray | None):
    def build(b: Builder, output: str, target: str) -> str:
        out_shape = b.shape(output)
        if len(out_shape) < 2:
            raise ShapeError(f"loss '{name}' needs a model output of shape (N, C, ...) with class scores, "
                             f"got {tuple(out_shape)}; use mse or bce_with_logits for other outputs")
        target = _matching_target(b, name, target, (out_shape[0],) + tuple(out_shape[2:]))
        inputs = [output, target]
        if weight is not None:
            if weight.shape != (out_shape[1],):
                raise ShapeError(f"loss '{name}': {weight.size} class weights for a model with "
                                 f"{out_shape[1]} classes")
            inputs.append(b.const(weight, np.float32, "class_weight"))
        attrs = {"label_smoothing": float(label_smoothing)} if label_smoothing else {}
        return b.op("CrossEntropy", inputs, log_input=log_input, reduction="mean", ignore_index=-100, **attrs)
    return build


def _elementwise_loss(name: str, per_element: Callable[[Builder, str, str], str]):
    def build(b: Builder, output: str, target: str) -> str:
        target = _matching_target(b, name, target, b.shape(output))
        return _mean(b, per_element(b, output, target))
    return build


def _squared_error(b: Builder, x: str, y: str) -> str:
    d = b.op("Sub", [x, y])
    return b.op("Mul", [d, d])


# -- the losses -------------------------------------------------------------------------------------
def cross_entropy(label_smoothing: float = 0.0, weight=None) -> Loss:
    """PyTorch's CrossEntropyLoss on logits and class-index targets (ignore_index -100)."""
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ConfigError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    w = _class_weight("cross_entropy", weight)
    options = {"label_smoothing": float(label_smoothing)}
    if w is not None:
        options["weight"] = [float(v) for v in w]
    return Loss("cross_entropy", _class_index_loss("cross_entropy", 0, float(label_smoothing), w),
                np.int64, True, options)


def nll(weight=None) -> Loss:
    """PyTorch's NLLLoss: the model outputs log-probabilities (log_softmax)."""
    w = _class_weight("nll", weight)
    return Loss("nll", _class_index_loss("nll", 1, 0.0, w), np.int64, True,
                {} if w is None else {"weight": [float(v) for v in w]})


def mse() -> Loss:
    return Loss("mse", _elementwise_loss("mse", _squared_error))


def l1() -> Loss:
    return Loss("l1", _elementwise_loss("l1", lambda b, x, y: b.op("AbsoluteError", [x, y])))


def bce_with_logits() -> Loss:
    """PyTorch's BCEWithLogitsLoss: logits and float targets in [0, 1] of the same shape."""
    return Loss("bce_with_logits", _elementwise_loss(
        "bce_with_logits", lambda b, x, y: b.op("BinaryCrossEntropyWithLogits", [x, y])))


LOSSES.update({"cross_entropy": cross_entropy, "nll": nll, "mse": mse, "l1": l1,
               "bce_with_logits": bce_with_logits})
