"""Loss functions as Graph builders: (builder, model output, target) -> scalar loss value.

All use mean reduction, as PyTorch's defaults do; cross_entropy and nll also take
reduction="sum" and PyTorch's ignore_index (default -100: those targets add nothing to the loss,
its gradient or the metrics).

Class-index targets of any rank. The class axis is PyTorch's axis 1 -- logits (N, C, d1, ...) with
targets (N, d1, ...), as F.cross_entropy takes them (per-pixel segmentation) -- or the last axis,
as Hugging Face language models return logits (B, T, V) for labels (B, T). Which one is read from
the shapes: the layout whose shape the targets have. When both fit (T == V), axis 1 is taken, as
PyTorch does, unless `class_axis=-1` says otherwise. The last-axis layout is computed as (B*T, V) rows, with no transpose.
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
    needs_target: bool = True     # False: the loss is the model's own output (loss="output")

    @property
    def ignore_index(self) -> int | None:
        """Targets equal to this are skipped (class-index losses), else None."""
        value = self.options.get("ignore_index")
        return None if value is None else int(value)

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
    if not isinstance(name, str):
        raise ConfigError(f"a loss is a name ({', '.join(sorted(LOSSES))}) or a Loss, got {type(name).__name__}")
    if name.startswith("output:"):  # loss="output:NAME": the model's own loss, output NAME
        if options:
            raise ConfigError(f"loss '{name}' takes no options, got {sorted(options)}")
        return output(name.split(":", 1)[1])
    if name not in LOSSES:
        raise ConfigError(f"unknown loss '{name}'; choose one of {', '.join(sorted(LOSSES))} "
                          "(or output:NAME for a model's own loss output)")
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


CLASS_AXES = (1, -1)


def class_layout(name: str, out_shape: tuple, target_shape: tuple, class_axis: int | None = None) -> int:
    """Where the classes are in a class-score output for these targets: 1 (PyTorch's (N, C, d...)
    with targets (N, d...)) or -1 (the last axis: (B, T, V) with targets (B, T)). A target of the
    same size but another layout ((N, 1) for (N, C)) is reshaped. Errors name both shapes."""
    out_shape, target_shape = tuple(out_shape), tuple(target_shape)
    if len(out_shape) < 2:
        raise ShapeError(f"loss '{name}' needs a model output of shape (N, C, ...) with class scores, "
                         f"got {out_shape}; use mse or bce_with_logits for other outputs")
    first = (out_shape[0],) + out_shape[2:]
    last = out_shape[:-1] if len(out_shape) >= 3 else None
    candidates = {1: first, -1: last} if class_axis is None else {class_axis: first if class_axis == 1 else last}
    if class_axis == -1 and last is None:
        raise ShapeError(f"loss '{name}': class_axis=-1 needs logits with a position axis, (B, T, V); "
                         f"got {out_shape}")
    for exact in (True, False):
        fits = [a for a, want in candidates.items() if want is not None and
                (tuple(target_shape) == want if exact else int(np.prod(target_shape)) == int(np.prod(want)))]
        if len(fits) == 1:
            return fits[0]
        if len(fits) > 1:  # T == V: PyTorch's rule, as F.cross_entropy reads it; class_axis=-1 says otherwise
            return 1
    wants = " or ".join(str(w) for w in candidates.values() if w is not None)
    if tuple(target_shape) == out_shape:  # one-hot or probabilities, as Keras' categorical_crossentropy takes
        raise ShapeError(f"loss '{name}' takes class-index targets of shape {wants}, got targets of the "
                         f"output's own shape {target_shape} (one-hot or probabilities, which it does not "
                         "take); give the class indices: y.argmax(axis=1)")
    raise ShapeError(f"loss '{name}': targets of shape {target_shape} do not fit the model output {out_shape}; "
                     f"class-index targets have shape {wants} (check the dataset's labels against the "
                     "model's output)")


def _class_index_loss(name: str, log_input: int, label_smoothing: float, weight: np.ndarray | None,
                      ignore_index: int | None = -100, reduction: str = "mean", class_axis: int | None = None):
    def build(b: Builder, output: str, target: str) -> str:
        out_shape = tuple(b.shape(output))
        axis = class_layout(name, out_shape, b.shape(target), class_axis)
        scores = output
        if axis == 1:
            target = _matching_target(b, name, target, (out_shape[0],) + out_shape[2:])
        else:  # (B, T, V) -> rows (B*T, V): a free reshape, and the fast row layout for the kernels
            rows = int(np.prod(out_shape[:-1]))
            scores = b.reshape(output, (rows, out_shape[-1]))
            target = b.reshape(target, (rows,))
        classes = b.shape(scores)[1]
        inputs = [scores, target]
        if weight is not None:
            if weight.shape != (classes,):
                raise ShapeError(f"loss '{name}': {weight.size} class weights for a model with "
                                 f"{classes} classes")
            inputs.append(b.const(weight, np.float32, "class_weight"))
        attrs = {"label_smoothing": float(label_smoothing)} if label_smoothing else {}
        if ignore_index is not None:
            attrs["ignore_index"] = int(ignore_index)
        return b.op("CrossEntropy", inputs, log_input=log_input, reduction=reduction, **attrs)
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
TRAINING_REDUCTIONS = ("mean", "sum")


def _class_options(name: str, weight, ignore_index, reduction: str, class_axis) -> tuple[np.ndarray | None, dict]:
    w = _class_weight(name, weight)
    if reduction not in TRAINING_REDUCTIONS:
        raise ConfigError(f"{name}: reduction must be 'mean' or 'sum' (training needs one number per batch), "
                          f"got {reduction!r}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or int(ignore_index) != ignore_index):
        raise ConfigError(f"{name}: ignore_index must be an integer class index (PyTorch's default is -100) "
                          f"or None, got {ignore_index!r}")
    if class_axis not in (None,) + CLASS_AXES:
        raise ConfigError(f"{name}: class_axis must be 1 (PyTorch's (N, C, ...)), -1 (the last axis, as "
                          f"Hugging Face's (B, T, V) logits) or None (from the shapes), got {class_axis!r}")
    options: dict = {"ignore_index": None if ignore_index is None else int(ignore_index), "reduction": reduction}
    if class_axis is not None:
        options["class_axis"] = int(class_axis)
    if w is not None:
        options["weight"] = [float(v) for v in w]
    return w, options


def cross_entropy(label_smoothing: float = 0.0, weight=None, ignore_index: int | None = -100,
                  reduction: str = "mean", class_axis: int | None = None) -> Loss:
    """PyTorch's CrossEntropyLoss on logits and class-index targets of any rank (see the module
    docstring for the class axis); targets equal to `ignore_index` are skipped."""
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ConfigError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    w, options = _class_options("cross_entropy", weight, ignore_index, reduction, class_axis)
    options = {"label_smoothing": float(label_smoothing), **options}
    return Loss("cross_entropy", _class_index_loss("cross_entropy", 0, float(label_smoothing), w,
                                                   options["ignore_index"], reduction, class_axis),
                np.int64, True, options)


def nll(weight=None, ignore_index: int | None = -100, reduction: str = "mean", class_axis: int | None = None) -> Loss:
    """PyTorch's NLLLoss: the model outputs log-probabilities (log_softmax)."""
    w, options = _class_options("nll", weight, ignore_index, reduction, class_axis)
    return Loss("nll", _class_index_loss("nll", 1, 0.0, w, options["ignore_index"], reduction, class_axis),
                np.int64, True, options)


def mse() -> Loss:
    return Loss("mse", _elementwise_loss("mse", _squared_error))


def l1() -> Loss:
    return Loss("l1", _elementwise_loss("l1", lambda b, x, y: b.op("AbsoluteError", [x, y])))


def bce_with_logits() -> Loss:
    """PyTorch's BCEWithLogitsLoss: logits and float targets in [0, 1] of the same shape."""
    return Loss("bce_with_logits", _elementwise_loss(
        "bce_with_logits", lambda b, x, y: b.op("BinaryCrossEntropyWithLogits", [x, y])))


def output(output: str | None = None) -> Loss:
    """The model's own output is the loss (a scalar): what a PyTorch module whose forward returns
    its loss trains with. No targets; labels, if any, are model inputs. `output` names which
    output it is (the name "output:NAME" says the same); left out, the model's only scalar float
    output, wherever it stands (Model.compile chooses)."""
    if output is not None and (not isinstance(output, str) or not output):
        raise ConfigError(f"loss 'output': the output to minimise is named by a non-empty string, "
                          f"got {output!r}")

    def build(b: Builder, out: str, target: str) -> str:
        raise ConfigError("loss 'output' takes no targets: the program uses the model's output as it is")
    return Loss("output", build, np.float32, False, {} if output is None else {"output": output},
                needs_target=False)


LOSSES.update({"cross_entropy": cross_entropy, "nll": nll, "mse": mse, "l1": l1,
               "bce_with_logits": bce_with_logits, "output": output})
