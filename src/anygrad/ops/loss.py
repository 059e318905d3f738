"""Loss and metric ops: ONNX NegativeLogLikelihoodLoss / SoftmaxCrossEntropyLoss, and internal ones.

All class-index losses share one kernel. For each sample i (class axis 1, spatial dims d.. allowed)
with target t_i not equal to ignore_index, the loss is -sum_c q_ic * logp_ic where

    q_ic = (1 - s) * w[t_i] * [c == t_i] + (s / C) * w[c]

(s = label smoothing, w = class weights, ones when absent), and `mean` divides the sum by
sum_i w[t_i] over the samples not ignored, which is what ONNX and PyTorch both do (PyTorch's
label smoothing divides by the same weight sum). `logp` is the input itself for NLL, log_softmax
of the input for softmax cross-entropy. The gradient is -q * scale (NLL) or
(softmax * sum_c q - q) * scale (softmax), with scale = dy / weight sum for `mean`.

CrossEntropyMetrics is CrossEntropy that also returns each sample's log-sum-exp and the
accuracy counts (CountCorrect's, skipping targets equal to ignore_index): the training step builds it when its loss
is a CrossEntropy over the model output, so a backend reads vocabulary-sized logits once for
the loss and the metrics, and the gradient (CrossEntropyGrad's optional input 4) needs no second
softmax pass.

Float16 scores: every kernel computes in float32 (f16 -> f32 is exact) and rounds its outputs
once. CrossEntropy and CrossEntropyMetrics declare `reads_half` on the scores: their loss and
log-sum-exp stay float32 whatever the scores' dtype, so mixed precision's training step feeds them
the float16 logits rather than a float32 copy, and CrossEntropyGrad returns the gradient in the
scores' dtype (the ONNX ops keep ONNX's rule: outputs of the input's type).

Elementwise losses (BCE with logits, absolute error) are elementwise internal ops; losses.py
takes their mean with ReduceSum, so a backend only needs one reduction kernel for them.
"""
from __future__ import annotations

import numpy as np

from ..errors import DataError, ShapeError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop, get_op
from ._util import broadcast_infer
from .metrics import count_top_k

REDUCTIONS = ("mean", "sum", "none")


# -- class-index losses -----------------------------------------------------------------------
def loss_reduction(node: Node) -> str:
    """A loss node's reduction (mean by default), checked."""
    r = node.attr("reduction", "mean")
    r = r.decode() if isinstance(r, bytes) else str(r)
    if r not in REDUCTIONS:
        raise ShapeError(f"{node.label}: reduction '{r}' is not one of {', '.join(REDUCTIONS)}")
    return r


def _computes_in(dtype) -> np.dtype:
    """The dtype a kernel computes in for scores of `dtype`: float16 ones in float32."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def _loss_dtype(node: Node, x_dtype) -> np.dtype:
    """Float32 for an op that reads float16 scores as float32 (reads_half), else the scores' dtype."""
    op = get_op(node.op)
    return _computes_in(x_dtype) if op is not None and 0 in op.reads_half else np.dtype(x_dtype)


def _class_loss_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    x, t = ins[0], ins[1]
    if x.rank < 2:
        raise ShapeError(f"{node.label}: input must be (N, C) or (N, C, d1, ...), got {tuple(x.shape)}")
    expected = (x.shape[0],) + tuple(x.shape[2:])
    if tuple(t.shape) != expected:
        raise ShapeError(f"{node.label}: target shape {tuple(t.shape)} does not match input "
                         f"{tuple(x.shape)}; expected {expected} (class indices)")
    if not np.issubdtype(t.dtype, np.integer):
        raise ShapeError(f"{node.label}: target must hold integer class indices, got {t.dtype}")
    if len(ins) > 2 and ins[2] is not None and tuple(ins[2].shape) != (x.shape[1],):
        raise ShapeError(f"{node.label}: weight must have shape ({x.shape[1]},), got {tuple(ins[2].shape)}")
    loss = TensorInfo(_loss_dtype(node, x.dtype), expected if loss_reduction(node) == "none" else ())
    return [loss, TensorInfo(x.dtype, x.shape)][:max(1, len(node.outputs))]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _class_axis(v: np.ndarray) -> np.ndarray:
    """(N, d..) -> (N, 1, d..), to broadcast per-sample values against the class axis."""
    return np.expand_dims(v, 1)


def bad_target(op: str, index: int, classes: int) -> DataError:
    """The one message for a class index out of range, every backend's: it names the loss by its
    op (the step graph's node names, such as 'step.CrossEntropy__4', mean nothing to a user)."""
    for part in ("Metrics", "Grad"):  # the fused and gradient forms of one loss
        op = op.removesuffix(part)
    return DataError(f"{op} loss: target class index {index} is outside [0, {classes}); check the labels or "
                     "the model's number of classes")


def _targets(node: Node, x: np.ndarray, target: np.ndarray, weight: np.ndarray | None):
    """(safe class indices, mask of samples not ignored, per-sample weight w[t] * mask)."""
    n_classes = x.shape[1]
    ignore = node.attr("ignore_index")
    mask = target != ignore if ignore is not None else np.ones(target.shape, bool)
    safe = np.where(mask, target, 0).astype(np.int64)
    bad = (safe < 0) | (safe >= n_classes)
    if bad.any():
        raise bad_target(node.op, int(target[bad].flat[0]), n_classes)
    w = weight if weight is not None else np.ones(n_classes, x.dtype)
    return safe, mask, (w[safe] * mask).astype(x.dtype)


def _class_weights(node: Node, x: np.ndarray, target, weight):
    """q of the module docstring, dense over the class axis."""
    safe, mask, wt = _targets(node, x, target, weight)
    n_classes = x.shape[1]
    s = float(node.attr("label_smoothing", 0.0))
    onehot = np.moveaxis(np.eye(n_classes, dtype=x.dtype)[safe], -1, 1)
    q = (1 - s) * onehot * _class_axis(wt)
    if s:
        w = weight if weight is not None else np.ones(n_classes, x.dtype)
        w = w.reshape((1, n_classes) + (1,) * (x.ndim - 2))
        q = q + (s / n_classes) * w * _class_axis(mask.astype(x.dtype))
    return q.astype(x.dtype), wt


def _logp(node: Node, x: np.ndarray) -> np.ndarray:
    return x if node.attr("log_input", 0) else _log_softmax(x)


def _reduce(node: Node, per_sample: np.ndarray, wt: np.ndarray) -> np.ndarray:
    reduction = loss_reduction(node)
    if reduction == "none":
        return per_sample
    total = per_sample.sum()
    if reduction == "sum":
        return total
    with np.errstate(invalid="ignore", divide="ignore"):  # every sample ignored: nan, as PyTorch
        return total / wt.sum()


def _class_loss_forward(node: Node, ins):
    x, target = ins[0].astype(_computes_in(ins[0].dtype), copy=False), ins[1]
    weight = ins[2] if len(ins) > 2 else None
    logp = _logp(node, x)
    if node.attr("label_smoothing", 0.0):
        q, wt = _class_weights(node, x, target, weight)
        per_sample = -(q * logp).sum(axis=1)
    else:  # gather: never multiplies 0 by a -inf log-probability
        safe, _, wt = _targets(node, x, target, weight)
        per_sample = -wt * np.take_along_axis(logp, _class_axis(safe), axis=1)[:, 0]
    loss = np.asarray(_reduce(node, per_sample, wt), _loss_dtype(node, ins[0].dtype))
    return [loss, logp.astype(ins[0].dtype)][:max(1, len(node.outputs))]


def _class_loss_grad_forward(node: Node, ins):
    wide = _computes_in(ins[1].dtype)
    dy, x, target = ins[0].astype(wide, copy=False), ins[1].astype(wide, copy=False), ins[2]
    weight = ins[3] if len(ins) > 3 else None
    lse = ins[4] if len(ins) > 4 else None  # the forward's per-sample log-sum-exp, when it kept one
    q, wt = _class_weights(node, x, target, weight)
    reduction = loss_reduction(node)
    if reduction == "mean":
        total = wt.sum()
        # Every sample ignored: the loss is nan (0/0), the gradient zero, as in PyTorch.
        scale = dy / total if total != 0 else np.zeros_like(dy)
    else:
        scale = dy
    scale = _class_axis(np.broadcast_to(scale, wt.shape))
    if node.attr("log_input", 0):
        dx = -q * scale
    else:
        p = np.exp(_log_softmax(x) if lse is None else x - _class_axis(lse))
        dx = (p * q.sum(axis=1, keepdims=True) - q) * scale
    return dx.astype(ins[1].dtype)  # rounded once, from the float32 computation


def _class_loss_grad(log_input: int):
    def rule(g: GradContext):
        if not g.need(0):
            return [None] * len(g.x)
        attrs = {k: v for k, v in g.node.attrs.items() if k in ("reduction", "ignore_index", "label_smoothing")}
        weight = [g.x[2]] if len(g.x) > 2 and g.x[2] else []
        if g.node.op == "CrossEntropyMetrics" and not log_input:  # reuse the forward's log-sum-exp
            weight = (weight or [""]) + [g.y[1]]
        terms = []
        if g.dys[0] is not None:
            terms.append(g.op("CrossEntropyGrad", [g.dys[0], g.x[0], g.x[1]] + weight,
                              log_input=log_input, **attrs))
        if g.node.op != "CrossEntropyMetrics" and len(g.dys) > 1 and g.dys[1] is not None:  # SCE's log_prob
            dlogp = g.dys[1]
            axis = g.const(np.array([1], np.int64), np.int64, "axes")
            total = g.op("ReduceSum", [dlogp, axis], keepdims=1)
            terms.append(g.op("Sub", [dlogp, g.op("Mul", [g.op("Exp", [g.y[1]]), total])]))
        return [g.add_all(terms) if terms else None] + [None] * (len(g.x) - 1)
    return rule


def _with_log_input(value: int):
    """The ONNX ops are the internal kernel with `log_input` fixed."""
    def forward(node: Node, ins):
        return _class_loss_forward(Node(node.op, node.inputs, node.outputs,
                                        {**node.attrs, "log_input": value}, node.name), ins)
    return forward


defop("NegativeLogLikelihoodLoss", infer=_class_loss_infer, forward=_with_log_input(1),
      grad=_class_loss_grad(1), nondiff=[1, 2])
defop("SoftmaxCrossEntropyLoss", infer=_class_loss_infer, forward=_with_log_input(0),
      grad=_class_loss_grad(0), nondiff=[1, 2])
# Internal: adds label_smoothing, and log_input selects NLL (1) or softmax cross-entropy (0).
defop("CrossEntropy", infer=_class_loss_infer, forward=_class_loss_forward, internal=True,
      grad=lambda g: _class_loss_grad(int(g.node.attr("log_input", 0)))(g), nondiff=[1, 2], reads_half=[0])
defop("CrossEntropyGrad", infer=lambda node, ins: [TensorInfo(ins[1].dtype, ins[1].shape)],
      forward=_class_loss_grad_forward, internal=True)


# CrossEntropyMetrics(x, target[, weight]) -> (loss, per-sample log-sum-exp, correct[, top-k count]):
# CrossEntropy (same attributes) with CountCorrect's counts (attribute k for the top-k one) from the
# same read of the scores; the gradient reuses the log-sum-exp instead of a second softmax.
def _metrics_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    loss = _class_loss_infer(Node(node.op, node.inputs, node.outputs[:1], node.attrs, node.name), ins)[0]
    counts = _count_correct_infer(Node(node.op, node.inputs[:2], node.outputs[2:], node.attrs, node.name), ins[:2])
    x = ins[0]
    return [loss, TensorInfo(_loss_dtype(node, x.dtype), (x.shape[0],) + tuple(x.shape[2:]))] + counts


def _metrics_forward(node: Node, ins):
    x = ins[0].astype(_computes_in(ins[0].dtype), copy=False)
    loss = _class_loss_forward(Node(node.op, node.inputs, node.outputs[:1], node.attrs, node.name), ins)[0]
    lse_dtype = _loss_dtype(node, ins[0].dtype)
    if node.attr("log_input", 0):
        lse = np.zeros((x.shape[0],) + x.shape[2:], lse_dtype)
    else:
        m = x.max(axis=1)
        lse = (m + np.log(np.exp(x - _class_axis(m)).sum(axis=1))).astype(lse_dtype)
    target = ins[1]
    ignore = node.attr("ignore_index")
    if ignore is not None:  # ignored positions count neither as right nor as wrong (-1 never matches)
        target = np.where(target == ignore, -1, target)
    counts = _count_correct(Node(node.op, node.inputs[:2], node.outputs[2:], node.attrs, node.name), [x, target])
    return [loss, lse] + counts


defop("CrossEntropyMetrics", infer=_metrics_infer, forward=_metrics_forward, internal=True, foldable=False,
      grad=lambda g: _class_loss_grad(int(g.node.attr("log_input", 0)))(g), nondiff=[1, 2], reads_half=[0])


# -- accuracy ---------------------------------------------------------------------------------
def _count_correct_infer(node: Node, ins):
    out, target = ins
    if out.rank < 2 or tuple(target.shape) != (out.shape[0],) + tuple(out.shape[2:]):
        raise ShapeError(f"{node.label}: accuracy needs output (N, C, ...) and class-index targets "
                         f"(N, ...); got {tuple(out.shape)} and {tuple(target.shape)}")
    if len(node.outputs) > 1 and int(node.attr("k", 0)) < 1:
        raise ShapeError(f"{node.label}: the top-k count (second output) needs an attribute k >= 1")
    return [TensorInfo(np.dtype(np.float32), ())] * max(1, len(node.outputs))


def _count_correct(node: Node, ins):
    """Samples whose highest score is the target's class; with a second output, also samples
    whose target is among the k highest scores (CountTopK's rule: ties never depend on a sort)."""
    out, target = ins
    correct = np.asarray(np.count_nonzero(np.argmax(out, axis=1) == target), np.float32)
    if len(node.outputs) < 2:
        return [correct]
    return [correct, count_top_k(out, target, int(node.attr("k")))]


# CountCorrect(output (N, C, ...), target (N, ...) int) -> correct [, top-k count (attribute k)]:
# both metrics from one read of the scores, which a vocabulary-sized output makes worth it.
defop("CountCorrect", infer=_count_correct_infer, forward=_count_correct, internal=True,
      foldable=False, nondiff=[0, 1])


# -- elementwise losses -----------------------------------------------------------------------
def _bce_with_logits(node: Node, ins):
    x, y = ins
    # max(x, 0) - x*y + log(1 + exp(-|x|)) (no overflow for any x), with max(x, 0) - x*y written
    # per sign, (1 - y) * x or -y * x: the subtraction of two near-equal products (x = 80, y near
    # 1) lost four digits in float32, and torch's (1 - y) * x - min(x, 0) still loses them at x < 0.
    return (np.where(x < 0, -y * x, (1 - y) * x) + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _bce_grad(g: GradContext):
    x, y = g.x
    dx = dt = None
    if g.need(0):
        dx = g.unbroadcast(g.op("BinaryCrossEntropyWithLogitsGrad", [g.dy, x, y]), g.shape(x))
    if g.need(1):  # d/dy = -x
        dt = g.unbroadcast(g.op("Neg", [g.op("Mul", [g.dy, x])]), g.shape(y))
    return [dx, dt]


def _abs_error_grad(g: GradContext):
    x, y = g.x
    d = g.op("AbsoluteErrorGrad", [g.dy, x, y]) if g.need(0) or g.need(1) else None
    return [g.unbroadcast(d, g.shape(x)) if g.need(0) else None,
            g.unbroadcast(g.op("Neg", [d]), g.shape(y)) if g.need(1) else None]


ELEMENTWISE = {
    # name: (forward(node, ins), gradient rule)
    "BinaryCrossEntropyWithLogits": (_bce_with_logits, _bce_grad),
    "AbsoluteError": (lambda n, ins: np.abs(ins[0] - ins[1]).astype(ins[0].dtype), _abs_error_grad),
}
BACKWARD = {
    # (dy, x, y) -> gradient w.r.t. x (same broadcast shape)
    "BinaryCrossEntropyWithLogitsGrad": lambda dy, x, y: dy * (_sigmoid(x) - y),
    "AbsoluteErrorGrad": lambda dy, x, y: dy * np.sign(x - y),  # sign(0) = 0, as PyTorch
}
for _name, (_fn, _grad) in ELEMENTWISE.items():
    defop(_name, infer=broadcast_infer, forward=_fn, grad=_grad, internal=True)


def _backward_kernel(fn):
    return lambda node, ins: fn(*ins).astype(ins[1].dtype)


for _name, _fn in BACKWARD.items():
    defop(_name, infer=broadcast_infer, forward=_backward_kernel(_fn), internal=True)
