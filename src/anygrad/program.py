"""Whole-program graphs a backend compiles once per input shape: the training step and inference.

The training step is one pure Graph: forward (in training mode), loss, backward, optimizer
update, metric accumulation. Everything that changes from step to step (parameters, BatchNorm
statistics, optimizer state, learning rate, step counter, RNG counter, metric sums) is a buffer
with a state update, so a backend runs a step with nothing but the batch as input.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .autodiff import gradients
from .ir.builder import Builder
from .ir.graph import Graph, Node, Shape, TensorInfo, info_of
from .ir.passes import RNG_STATE, infer_node, infer_shapes, set_training_mode, specialize
from .losses import Loss, _matching_target
from .optim.base import LR_STATE, STEP_STATE, Optimizer

TARGET = "anygrad.target"
LOSS_SUM = "anygrad.metric.loss_sum"
CORRECT_SUM = "anygrad.metric.correct"
SAMPLE_COUNT = "anygrad.metric.count"
TOPK_SUM = "anygrad.metric.topk"
METRIC_STATE = (LOSS_SUM, CORRECT_SUM, SAMPLE_COUNT, TOPK_SUM)
TOP_K = 5  # top-5 accuracy, reported when the output has more than 5 classes
ACCUM_PREFIX = "accum."  # gradient-accumulation buffers: accum.<param>

# Training-step phases. Gradient accumulation over N micro-batches runs "first" (accum = g/N),
# "accumulate" (accum += g/N) and "apply" (update with accum + g/N), so the device never branches
# on data; "step" is the plain step (N = 1).
PHASES = ("step", "first", "accumulate", "apply")


def top_k_for(output: TensorInfo, classification: bool) -> int | None:
    """k for the top-k metric of this output, or None when there are k classes or fewer."""
    shape = tuple(output.shape)
    if classification and len(shape) >= 2 and isinstance(shape[1], int) and shape[1] > TOP_K:
        return TOP_K
    return None


@dataclass
class StepOutputs:
    loss: str
    correct: str | None


def _add_buffer(g: Graph, name: str, value: np.ndarray) -> None:
    g.initializers[name] = value
    g.info[name] = TensorInfo(value.dtype, tuple(value.shape))
    if name not in g.buffers:
        g.buffers.append(name)


def _loss_and_metrics(g: Graph, b: Builder, output: str, loss: Loss, target_shape: Shape,
                      top_k: int | None = None) -> StepOutputs:
    g.inputs.append(TARGET)
    g.info[TARGET] = TensorInfo(np.dtype(loss.target_dtype), tuple(target_shape))
    loss_value = loss.build(b, output, TARGET)
    target = TARGET
    if loss.classification:  # the layout the loss accepted: (N, T) targets for (N*T, C) logits
        out_shape = b.shape(output)
        target = _matching_target(b, loss.name, TARGET, (out_shape[0],) + tuple(out_shape[2:]))
    correct = top = None
    if loss.classification:
        correct, top = _with_loss(g, b, loss_value, output, top_k) or _count_correct(b, output, target, top_k)
    # Device-side running sums, read back only when the trainer asks.
    for name in METRIC_STATE:
        _add_buffer(g, name, np.zeros((), np.float32))
    if top is not None:
        g.state_updates[b.op("Add", [TOPK_SUM, top])] = TOPK_SUM
    n = float(b.shape(output)[0]) if b.shape(output) else 1.0
    batch_loss = b.op("Mul", [loss_value, b.const(n)])
    g.state_updates[b.op("Add", [LOSS_SUM, batch_loss])] = LOSS_SUM
    g.state_updates[b.op("Add", [SAMPLE_COUNT, b.const(n)])] = SAMPLE_COUNT
    if correct is not None:
        g.state_updates[b.op("Add", [CORRECT_SUM, correct])] = CORRECT_SUM
    return StepOutputs(loss_value, correct)


def _count_correct(b: Builder, output: str, target: str, top_k: int | None) -> tuple[str, str | None]:
    """(correct, top-k count or None) from one CountCorrect node: one read of the scores."""
    if top_k is None:
        return b.op("CountCorrect", [output, target]), None
    correct, top = b.ops("CountCorrect", [output, target], 2, k=int(top_k))
    return correct, top


def _with_loss(g: Graph, b: Builder, loss_value: str, output: str, top_k: int | None) -> tuple | None:
    """When the loss is one CrossEntropy node over the model output, make it CrossEntropyMetrics:
    the counts come from the loss's own read of the scores, and its gradient reuses the softmax
    statistics. Returns (correct, top-k count or None), or None to count separately."""
    node = next((n for n in g.nodes if loss_value in n.outputs), None)
    if node is None or node.op != "CrossEntropy" or node.inputs[0] != output or len(node.outputs) != 1:
        return None
    extra = [g.fresh(f"{b.prefix}.{what}") for what in ("row_lse", "correct", "topk")[:3 if top_k else 2]]
    fused = Node("CrossEntropyMetrics", list(node.inputs), [loss_value] + extra,
                 {**node.attrs, **({"k": int(top_k)} if top_k else {})}, node.name)
    g.nodes[g.nodes.index(node)] = fused
    infer_node(g, fused)
    return extra[1], extra[2] if top_k else None


def clip_grad_norm(b: Builder, grads: dict[str, str], max_norm: float) -> dict[str, str]:
    """torch.nn.utils.clip_grad_norm_ as graph nodes: scale every gradient by
    min(1, max_norm / (total_norm + 1e-6)), total_norm the 2-norm over all gradients together."""
    names = list(grads)
    squares = [b.op("ReduceSumSquare", [grads[p]], keepdims=0) for p in names]
    total = squares[0]
    for sq in squares[1:]:
        total = b.op("Add", [total, sq])
    norm = b.op("Sqrt", [total])
    coef = b.op("Div", [b.const(float(max_norm)), b.op("Add", [norm, b.const(1e-6)])])
    coef = b.op("Min", [coef, b.const(1.0)])
    return {p: b.op("Mul", [grads[p], coef]) for p in names}


def training_forward(model: Graph, input_shapes: dict[str, Shape]) -> Graph:
    """The model in training mode (batch statistics, dropout drawing from the RNG state),
    specialized to these input shapes: the forward half of every training step."""
    g = set_training_mode(model, True)
    _add_buffer(g, RNG_STATE, np.zeros(2, np.uint32))
    return specialize(g, input_shapes)


def build_train_step(model: Graph, input_shapes: dict[str, Shape], target_shape: Shape,
                     loss: Loss, optimizer: Optimizer, *, clip_norm: float | None = None,
                     accumulate: int = 1, phase: str = "step", top_k: int | None = None) -> Graph:
    """The training step for one batch shape: forward, loss, backward, (clip,) update.

    With `accumulate` = N > 1 the loss is scaled by 1/N and `phase` says what this micro-batch
    does with its gradients (see PHASES); only "apply" (and "step") clips and updates.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    g = training_forward(model, input_shapes)
    b = Builder(g, prefix="step")
    out = _loss_and_metrics(g, b, g.outputs[0], loss, target_shape, top_k)

    # Like PyTorch users do: backward of loss / N for each of the N micro-batches.
    objective = out.loss if accumulate == 1 else b.op("Mul", [out.loss, b.const(1.0 / accumulate)])
    grads = gradients(g, objective, g.params)
    b = Builder(g, prefix="optim")
    if phase != "step":
        grads = _accumulate(g, b, grads, phase)
    if phase in ("step", "apply"):
        if clip_norm is not None:
            grads = clip_grad_norm(b, grads, clip_norm)
        _update(g, b, grads, optimizer)
    g.state_updates[b.op("Add", [RNG_STATE, b.const(np.array([0, 1], np.uint32), np.uint32)])] = RNG_STATE
    g.outputs = [out.loss] + ([out.correct] if out.correct else [])
    g.dce()
    return g


def _accumulate(g: Graph, b: Builder, grads: dict[str, str], phase: str) -> dict[str, str]:
    """Gradient sums in accum.<param> buffers; returns the total for the "apply" phase."""
    total = {}
    for p, grad in grads.items():
        name = ACCUM_PREFIX + p
        _add_buffer(g, name, np.zeros_like(g.initializers[p]))
        total[p] = grad if phase == "first" else b.op("Add", [name, grad])
        if phase != "apply":
            g.state_updates[total[p]] = name
    return total


def _update(g: Graph, b: Builder, grads: dict[str, str], optimizer: Optimizer) -> None:
    _add_buffer(g, LR_STATE, np.array(optimizer.lr, np.float32))
    _add_buffer(g, STEP_STATE, np.zeros((), np.float32))
    step = b.op("Add", [STEP_STATE, b.const(1.0)])
    g.state_updates[step] = STEP_STATE
    for p in g.params:
        slots = {}
        for slot, init in optimizer.init_state(g.initializers[p]).items():
            name = f"optim.{slot}.{p}"
            _add_buffer(g, name, init)
            slots[slot] = name
        new_p, new_slots = optimizer.update(b, p, grads[p], slots, LR_STATE, step)
        g.state_updates[new_p] = p
        for slot, value in new_slots.items():
            g.state_updates[value] = slots[slot]


def build_update_step(model: Graph, optimizer: Optimizer, *, clip_norm: float | None = None) -> Graph:
    """The update alone: (clip,) optimizer step from the gradients in the accum.<param> buffers,
    which the "first"/"accumulate" phases filled. Data parallelism runs it after summing those
    buffers across replicas, so the gradient phase and the update are two programs."""
    g = Graph(name=f"{model.name}.update")
    for p in model.params:
        g.initializers[p] = model.initializers[p]
        g.info[p] = TensorInfo(model.initializers[p].dtype, tuple(model.initializers[p].shape))
        g.params.append(p)
    grads = {}
    for p in model.params:
        grads[p] = ACCUM_PREFIX + p
        _add_buffer(g, grads[p], np.zeros_like(model.initializers[p]))
    b = Builder(g, prefix="optim")
    if clip_norm is not None:
        grads = clip_grad_norm(b, grads, clip_norm)
    _update(g, b, grads, optimizer)
    return g


def build_inference(model: Graph, input_shapes: dict[str, Shape]) -> Graph:
    """The model in inference mode (running statistics, no dropout) for one input shape."""
    return specialize(set_training_mode(model, False), input_shapes)


def build_eval_step(model: Graph, input_shapes: dict[str, Shape], target_shape: Shape, loss: Loss,
                    top_k: int | None = None) -> Graph:
    """Inference plus loss and metric accumulation (validation)."""
    g = build_inference(model, input_shapes)
    b = Builder(g, prefix="eval")
    out = _loss_and_metrics(g, b, g.outputs[0], loss, target_shape, top_k)
    g.outputs = [out.loss] + ([out.correct] if out.correct else [])
    g.dce()
    return g


__all__ = [
    "ACCUM_PREFIX",
    "CORRECT_SUM",
    "LOSS_SUM",
    "METRIC_STATE",
    "PHASES",
    "SAMPLE_COUNT",
    "TARGET",
    "TOPK_SUM",
    "build_eval_step",
    "build_inference",
    "build_train_step",
    "build_update_step",
    "clip_grad_norm",
    "infer_shapes",
    "info_of",
    "top_k_for",
]
