"""Whole-program graphs a backend compiles once per input shape: the training step and inference.

The training step is one pure Graph: forward (in training mode), loss, backward, optimizer
update, metric accumulation. Everything that changes from step to step (parameters, BatchNorm
statistics, optimizer state, learning rate, step counter, RNG counter, metric sums) is a buffer
with a state update, so a backend runs a step with nothing but the batch as input.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import settings
from .autodiff import gradients
from .errors import ConfigError
from .ir.attention import fuse_attention
from .ir.autocast import LAYOUT_OPS, PRECISIONS, autocast
from .ir.builder import Builder
from .ir.gelu import fuse_gelu
from .ir.graph import Graph, Node, Shape, TensorInfo, info_of
from .ir.infer import infer_node
from .ir.passes import RNG_STATE, infer_shapes, resolve_attributes, set_training_mode, specialize
from .ir.registry import get_op
from .ir.rmsnorm import fuse_rms_norm
from .ir.rotary import fuse_rotate_half
from .losses import Loss, _matching_target, class_layout
from .ops._util import ONNX_CODES
from .optim import grad_scaler
from .optim.base import STEP_STATE, Optimizer
from .optim.groups import ResolvedGroup, resolve_groups

TARGET = "anygrad.target"                # the target input of the first (or only) output with a loss
TARGET_PREFIX = "anygrad.target."         # ... of the others: anygrad.target.<output>
METRIC_PREFIX = "anygrad.metric."         # every device-side metric sum
LOSS_SUM = "anygrad.metric.loss_sum"
CORRECT_SUM = "anygrad.metric.correct"
SAMPLE_COUNT = "anygrad.metric.count"
TOPK_SUM = "anygrad.metric.topk"
UPDATE_COUNT = "anygrad.metric.updates"  # optimizer updates attempted (f16: the skipped ones' denominator)
SKIPPED_UPDATES = "skipped_updates"  # the metric of f16 updates skipped for non-finite gradients
TRAIN_ONLY_METRICS = frozenset({SKIPPED_UPDATES})  # metrics evaluation never has (no valid_ column)
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


@dataclass(frozen=True)
class Head:
    """One model output trained by a loss: the graph input its targets arrive in, and its weight
    in the objective (the sum of weight * loss over heads)."""

    output: str
    loss: Loss
    weight: float = 1.0
    target: str = TARGET


@dataclass(frozen=True)
class MetricSpec:
    """A reported metric: the device sum `num` divided by the device sum `den` (exp of that
    for perplexity). Model.read_metrics turns these into numbers."""

    num: str
    den: str
    exp: bool = False


@dataclass
class StepOutputs:
    loss: str
    correct: str | None


def _add_buffer(g: Graph, name: str, value: np.ndarray) -> None:
    g.initializers[name] = value
    g.info[name] = TensorInfo(value.dtype, tuple(value.shape))
    if name not in g.buffers:
        g.buffers.append(name)


def _sum_into(g: Graph, b: Builder, buffer: str, value: str) -> None:
    """buffer += value, a float32 scalar running sum read back only when the trainer asks."""
    _add_buffer(g, buffer, np.zeros((), np.float32))
    g.state_updates[b.op("Add", [buffer, value])] = buffer


def _head_buffer(index: int, head: Head, kind: str) -> str:
    """The first head keeps the historical names (anygrad.metric.correct, ...)."""
    legacy = {"loss": LOSS_SUM, "correct": CORRECT_SUM, "topk": TOPK_SUM}
    if index == 0 and kind in legacy and kind != "loss":
        return legacy[kind]
    return f"{METRIC_PREFIX}{kind}" if index == 0 else f"{METRIC_PREFIX}{head.output}.{kind}"


def _batch_size(g: Graph) -> float:
    """Samples in the batch: axis 0 of the first input (every input shares it)."""
    shape = g.info[g.inputs[0]].shape if g.inputs else ()
    return float(shape[0]) if shape else 1.0


def _loss_and_metrics(g: Graph, b: Builder, heads: list[Head], target_shapes: dict[str, Shape],
                      top_k: int | None = None, report: dict[str, MetricSpec] | None = None) -> StepOutputs:
    """The objective (sum of weighted head losses, or the model's own scalar output) and the
    device-side metric sums; `report` receives {metric name: MetricSpec} for Model.read_metrics."""
    specs: dict[str, MetricSpec] = {} if report is None else report
    for name in METRIC_STATE:
        _add_buffer(g, name, np.zeros((), np.float32))
    n = b.const(_batch_size(g))
    _sum_into(g, b, SAMPLE_COUNT, n)
    specs["loss"] = MetricSpec(LOSS_SUM, SAMPLE_COUNT)
    if not heads[0].loss.needs_target:
        objective = own_loss(g, b, heads[0].output)
        for other in g.outputs:  # the others, reported like metrics when they are numbers
            if other != heads[0].output and int(np.prod(b.shape(other))) == 1:
                value = other if b.shape(other) == () else b.reshape(other, ())
                buffer = f"{METRIC_PREFIX}output.{other}"
                _sum_into(g, b, buffer, b.op("Mul", [value, n]))
                specs[other if other not in specs else f"output_{other}"] = MetricSpec(buffer, SAMPLE_COUNT)
        _sum_into(g, b, LOSS_SUM, b.op("Mul", [objective, n]))
        return StepOutputs(objective, None)
    total = first_correct = None
    for i, head in enumerate(heads):
        g.inputs.append(head.target)
        g.info[head.target] = TensorInfo(np.dtype(head.loss.target_dtype), tuple(target_shapes[head.target]))
        value = head.loss.build(b, head.output, head.target)
        weighted = value if head.weight == 1.0 else b.op("Mul", [value, b.const(float(head.weight))])
        total = weighted if total is None else b.op("Add", [total, weighted])
        prefix = f"{head.output}_" if len(heads) > 1 else ""
        if len(heads) > 1:
            buffer = _head_buffer(i, head, "head_loss")
            _sum_into(g, b, buffer, b.op("Mul", [value, n]))
            specs[f"{prefix}loss"] = MetricSpec(buffer, SAMPLE_COUNT)
        correct = _head_metrics(g, b, i, head, value, prefix, specs, top_k if i == 0 else None)
        if i == 0:
            first_correct = correct
    _sum_into(g, b, LOSS_SUM, b.op("Mul", [total, n]))
    loss_reads_half(g)
    return StepOutputs(total, first_correct)


F16_LOSS_ENV = "ANYGRAD_F16_LOSS_READS_HALF"


def loss_reads_half(g: Graph) -> None:
    """Let the ops that compute in float32 whatever their input (OpDef.reads_half: the fused
    cross-entropy) read the float16 value behind a float32 Cast -- autocast's float32 copy of a
    float16 model output -- through any layout ops in between (an LM's (B*T, V) reshape).

    f16 -> f32 is exact, so the loss and metrics are the same numbers; the gradient w.r.t. the
    logits comes back float16, rounded once from float32 as the Cast's gradient rounded it. The
    float32 logits and their float32 gradient, the step's two largest values for a big
    vocabulary, then never exist. Only the loss's edge moves: a Cast another node (or a graph
    output) still reads stays; one nothing reads goes with dce. ANYGRAD_F16_LOSS_READS_HALF=0
    keeps the Cast (for A/B)."""
    if not settings.get(F16_LOSS_ENV):
        return
    producer = {o: n for n in g.nodes for o in n.outputs if o}
    for node in list(g.nodes):
        op = get_op(node.op)
        for k in sorted(op.reads_half) if op is not None else ():
            if k >= len(node.inputs) or not node.inputs[k]:
                continue
            chain, value = [], node.inputs[k]
            while value in producer and producer[value].op in LAYOUT_OPS:
                chain.append(producer[value])
                value = producer[value].inputs[0]
            cast = producer.get(value)
            if (cast is None or cast.op != "Cast" or np.dtype(g.info[value].dtype) != np.float32
                    or np.dtype(g.info[cast.inputs[0]].dtype) != np.float16):
                continue
            at, value = g.nodes.index(node), cast.inputs[0]
            for layout in reversed(chain):  # the same views of the float16 value
                view = Node(layout.op, [value] + list(layout.inputs[1:]), [g.fresh(f"{layout.outputs[0]}.float16")],
                            dict(layout.attrs), g.fresh(layout.name or layout.op))
                g.nodes.insert(at, view)
                at += 1
                infer_node(g, view)
                value = view.outputs[0]
            node.inputs[k] = value
            infer_node(g, node)


F16_SOFTMAX_GRAD_ENV = "ANYGRAD_F16_SOFTMAX_GRAD_READS_HALF"


def softmax_grad_reads_half(g: Graph) -> None:
    """Under autocast a softmax computes in float32 and its output is cast to float16 for the
    product that reads it (attention's probabilities @ V). Its gradient then reads that float16
    copy instead of the float32 output, which so lives only until the cast: a float32 tensor of
    the attention's size per layer no longer waits in memory for the backward pass (the GPT at
    batch 128: 4 x 32 MiB). The gradient's arithmetic stays float32; only the probabilities it
    reads are rounded to float16, as the backward of P @ V reads them anyway.
    ANYGRAD_F16_SOFTMAX_GRAD_READS_HALF=0 keeps the float32 read (for A/B)."""
    if not settings.get(F16_SOFTMAX_GRAD_ENV):
        return
    half_of: dict[str, str] = {}
    for n in g.nodes:
        if (n.op == "Cast" and np.dtype(g.info[n.outputs[0]].dtype) == np.float16
                and np.dtype(g.info[n.inputs[0]].dtype) == np.float32):
            half_of.setdefault(n.inputs[0], n.outputs[0])
    for n in g.nodes:
        if n.op == "SoftmaxGrad" and n.inputs[1] in half_of:
            n.inputs[1] = half_of[n.inputs[1]]


def own_loss(g: Graph, b: Builder, output: str) -> str:
    """loss="output": the model's output as the scalar to minimise; a ConfigError when it is not one."""
    shape = tuple(b.shape(output))
    if int(np.prod(shape)) != 1 or not np.issubdtype(b.dtype(output), np.floating):
        which = "first output" if g.outputs and output == g.outputs[0] else "output"
        raise ConfigError(f"loss='output' minimises the model's {which} '{output}', but it has shape {shape} "
                          f"and dtype {b.dtype(output)}, not a float scalar; make forward return the loss "
                          "(e.g. F.cross_entropy(logits, labels)), name the loss output with "
                          "loss='output:NAME', or compile with a loss such as 'cross_entropy' and pass "
                          "targets")
    return output if shape == () else b.reshape(output, ())


def _producer(g: Graph, value: str) -> Node | None:
    return next((n for n in reversed(g.nodes) if value in n.outputs), None)


def _head_metrics(g: Graph, b: Builder, index: int, head: Head, value: str, prefix: str,
                  specs: dict[str, MetricSpec], top_k: int | None) -> str | None:
    """The metrics the loss and the output's shape call for (see metric_names); returns the
    first head's correct count (the step program's second output) for classifiers."""
    loss, out_shape = head.loss, tuple(b.shape(head.output))
    buf = lambda kind: _head_buffer(index, head, kind)
    node = _producer(g, value)
    if loss.classification:
        positions = len(out_shape) - 2
        k = top_k if positions == 0 else None
        if node is not None and node.op == "CrossEntropy":
            target = node.inputs[1]
            correct, top = _fuse_counts(g, b, node, k)
        else:  # a loss built otherwise: count with a CountCorrect node of its own
            scores, target = _class_rows(b, loss, head.output, head.target)
            counted = target
            if loss.ignore_index is not None and loss.ignore_index >= 0:  # -1 never matches a class
                same = b.op("Equal", [target, b.const(np.array(loss.ignore_index, b.dtype(target)), b.dtype(target))])
                counted = b.op("Where", [same, b.const(np.array(-1, b.dtype(target)), b.dtype(target)), target])
            correct, top = _count_correct(b, scores, counted, k)
        rows = float(int(np.prod(b.shape(target))))
        if loss.ignore_index is None:
            valid = b.const(rows)
        else:
            ignored = b.op("Equal", [target, b.const(np.array(loss.ignore_index, b.dtype(target)), b.dtype(target))])
            ignored = b.op("ReduceSum", [b.op("Cast", [ignored], to=ONNX_CODES[np.dtype(np.float32)])], keepdims=0)
            valid = b.op("Sub", [b.const(rows), ignored])
        _sum_into(g, b, buf("valid"), valid)
        _sum_into(g, b, buf("correct"), correct)
        specs[prefix + ("pixel_accuracy" if positions >= 2 else "accuracy")] = MetricSpec(buf("correct"), buf("valid"))
        if top is not None:
            _sum_into(g, b, buf("topk"), top)
            specs[f"{prefix}top{k}"] = MetricSpec(buf("topk"), buf("valid"))
        plain = not loss.options.get("weight") and not loss.options.get("label_smoothing")
        if positions == 1 and plain and node.attr("log_input", 0) in (0, 1):
            nll = value if node.attr("reduction", "mean") == "sum" else b.op("Mul", [value, valid])
            _sum_into(g, b, buf("nll_sum"), nll)
            specs[prefix + "perplexity"] = MetricSpec(buf("nll_sum"), buf("valid"), exp=True)
        return correct
    if loss.name in ("mse", "l1", "bce_with_logits") and head.target in g.inputs:
        target = _matching_target(b, loss.name, head.target, out_shape)
        elements = b.const(float(int(np.prod(out_shape))))
        _sum_into(g, b, buf("elements"), elements)
        if loss.name == "bce_with_logits":  # a label is right when sigmoid(x) > 0.5 agrees with target > 0.5
            f32 = ONNX_CODES[np.dtype(np.float32)]
            pred = b.op("Cast", [b.op("Greater", [head.output, b.const(0.0)])], to=f32)
            truth = b.op("Cast", [b.op("Greater", [target, b.const(0.5)])], to=f32)
            wrong = b.op("ReduceSum", [b.op("Abs", [b.op("Sub", [pred, truth])])], keepdims=0)
            _sum_into(g, b, buf("label_correct"), b.op("Sub", [elements, wrong]))
            specs[prefix + "label_accuracy"] = MetricSpec(buf("label_correct"), buf("elements"))
        else:
            d = b.op("Sub", [head.output, target])
            _sum_into(g, b, buf("sq_sum"), b.op("ReduceSum", [b.op("Mul", [d, d])], keepdims=0))
            _sum_into(g, b, buf("abs_sum"), b.op("ReduceSum", [b.op("Abs", [d])], keepdims=0))
            specs[prefix + "mse"] = MetricSpec(buf("sq_sum"), buf("elements"))
            specs[prefix + "mae"] = MetricSpec(buf("abs_sum"), buf("elements"))
    return None


def _class_rows(b: Builder, loss: Loss, output: str, target: str) -> tuple[str, str]:
    """(scores with the classes on axis 1, targets of their shape) in the layout the loss reads."""
    out_shape = tuple(b.shape(output))
    if class_layout(loss.name, out_shape, b.shape(target), loss.options.get("class_axis")) == 1:
        return output, _matching_target(b, loss.name, target, (out_shape[0],) + out_shape[2:])
    rows = int(np.prod(out_shape[:-1]))
    return b.reshape(output, (rows, out_shape[-1])), b.reshape(target, (rows,))


def _count_correct(b: Builder, output: str, target: str, top_k: int | None) -> tuple[str, str | None]:
    """(correct, top-k count or None) from one CountCorrect node: one read of the scores."""
    if top_k is None:
        return b.op("CountCorrect", [output, target]), None
    correct, top = b.ops("CountCorrect", [output, target], 2, k=int(top_k))
    return correct, top


def _fuse_counts(g: Graph, b: Builder, node: Node, top_k: int | None) -> tuple[str, str | None]:
    """Make the loss's CrossEntropy node CrossEntropyMetrics: the accuracy counts (which skip
    ignored targets) come from the loss's own read of the scores, and its gradient reuses the
    softmax statistics. Returns (correct, top-k count or None)."""
    extra = [g.fresh(f"{b.prefix}.{what}") for what in ("row_lse", "correct", "topk")[:3 if top_k else 2]]
    fused = Node("CrossEntropyMetrics", list(node.inputs), [node.outputs[0]] + extra,
                 {**node.attrs, **({"k": int(top_k)} if top_k else {})}, node.name)
    g.nodes[g.nodes.index(node)] = fused
    infer_node(g, fused)
    return extra[1], extra[2] if top_k else None


def as_heads(graph: Graph, loss: Loss | list[Head], target_shape: Shape | dict[str, Shape] | None
             ) -> tuple[list[Head], dict[str, Shape]]:
    """(heads, target shapes by target input) from either form build_*_step takes: one Loss for
    the first output with one target shape, or heads with shapes by target input name."""
    if isinstance(loss, Loss):
        heads = [Head(graph.outputs[0], loss)]
        shapes = {} if not loss.needs_target else (
            dict(target_shape) if isinstance(target_shape, dict) else {TARGET: tuple(target_shape or ())})
        return heads, shapes
    return list(loss), dict(target_shape or {})


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


def check_precision(precision: str) -> str:
    """precision as given when it is one anygrad knows (PRECISIONS), else a ConfigError."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def _at_precision(g: Graph, precision: str) -> Graph:
    """The specialised forward graph with torch.autocast's casts for "f16" (ir/autocast.py)."""
    return autocast(g) if check_precision(precision) == "f16" else g


def training_forward(model: Graph, input_shapes: dict[str, Shape], precision: str = "f32") -> Graph:
    """The model in training mode (batch statistics, dropout drawing from the RNG state),
    specialized to these input shapes: the forward half of every training step."""
    g = set_training_mode(model, True)
    _add_buffer(g, RNG_STATE, np.zeros(2, np.uint32))
    g = specialize(g, input_shapes)
    fuse_gelu(g)  # before autodiff: the backward is one GeluGrad
    fuse_rms_norm(g)  # likewise one RMSNormGrad
    fuse_rotate_half(g)  # and one RotateHalf
    fuse_attention(g)  # before autodiff (the backward is FusedAttentionGrad) and before autocast's Casts
    return _at_precision(g, precision)


def build_train_step(model: Graph, input_shapes: dict[str, Shape], target_shape: Shape | dict[str, Shape] | None,
                     loss: Loss | list[Head], optimizer: Optimizer, *, clip_norm: float | None = None,
                     accumulate: int = 1, phase: str = "step", top_k: int | None = None,
                     report: dict[str, MetricSpec] | None = None, sync_batchnorm: bool = False,
                     precision: str = "f32", loss_scaling: bool | None = None,
                     groups: list[ResolvedGroup] | None = None) -> Graph:
    """The training step for one batch shape: forward, loss, backward, (clip,) update.

    `loss` is one Loss for the first output (target_shape its target's shape) or a list of Heads
    (target_shape {target input: shape}); `report` receives the metrics the step accumulates.
    With `accumulate` = N > 1 the loss is scaled by 1/N and `phase` says what this micro-batch
    does with its gradients (see PHASES); only "apply" (and "step") clips and updates.
    `sync_batchnorm`: BatchNorm statistics summed over the data-parallel replicas (ops.collective).
    `precision` "f16": float16 activations and matmul/conv operands (ir/autocast.py) and dynamic
    loss scaling (optim/grad_scaler.py; `loss_scaling` False turns it off, for tests); master
    weights, gradients and optimizer state stay float32.
    `groups`: the optimizer's parameter groups as the Model resolved them (optim/groups.py;
    default: resolved here over graph names).
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    g = training_forward(model, input_shapes, precision)
    if sync_batchnorm:
        from .ops.collective import sync_batch_norms
        sync_batch_norms(g)
    scaling = precision == "f16" if loss_scaling is None else loss_scaling
    b = Builder(g, prefix="step")
    heads, target_shapes = as_heads(model, loss, target_shape)
    out = _loss_and_metrics(g, b, heads, target_shapes, top_k, report)

    # Like PyTorch users do: backward of loss / N for each of the N micro-batches.
    objective = out.loss if accumulate == 1 else b.op("Mul", [out.loss, b.const(1.0 / accumulate)])
    if scaling:
        objective = grad_scaler.scaled(g, b, objective)
    grads = gradients(g, objective, g.params)
    if precision == "f16":
        softmax_grad_reads_half(g)
    b = Builder(g, prefix="optim")
    if scaling:  # accumulate true gradients: an inf stays inf in the sum, and the apply phase sees it
        grads = grad_scaler.unscale(b, grads)
    if phase != "step":
        grads = _accumulate(g, b, grads, phase)
    if phase in ("step", "apply"):
        _apply_update(g, b, grads, optimizer, clip_norm, scaling, report, loss=out.loss, groups=groups)
    elif scaling:  # a gradient phase (accumulation, data parallelism): its metrics as the step's
        _gate_metrics_on_loss(g, b, out.loss)
    g.state_updates[b.op("Add", [RNG_STATE, b.const(np.array([0, 1], np.uint32), np.uint32)])] = RNG_STATE
    g.outputs = [out.loss] + ([out.correct] if out.correct else [])
    g.dce()
    return resolve_attributes(g)  # the loss, gradient and update nodes too: what backends lower


def _accumulate(g: Graph, b: Builder, grads: dict[str, str], phase: str) -> dict[str, str]:
    """Gradient sums in accum.<param> buffers; returns the total for the "apply" phase."""
    total = {}
    for p, grad in grads.items():
        name = ACCUM_PREFIX + p
        _add_buffer(g, name, np.zeros_like(g.initializers[p]))
        total[p] = grad if phase == "first" else b.op("Add", [name, grad])
        if phase != "apply":
            g.state_updates[total[p]] = name
    if phase != "first":  # each sum as soon as its gradient is made: the gradient dies there
        g.hoist(total.values())
    return total


def _apply_update(g: Graph, b: Builder, grads: dict[str, str], optimizer: Optimizer, clip_norm: float | None,
                  scaling: bool, report: dict[str, MetricSpec] | None, loss: str | None = None,
                  groups: list[ResolvedGroup] | None = None) -> None:
    """(Clip,) optimizer update from `grads`. With loss scaling, a gradient that is not finite skips
    the update (every state it changes keeps its value, BatchNorm's running statistics included), the
    scale backs off or grows, and skipped updates are counted; the step's metrics count unless the
    forward itself overflowed float16 (`loss` not finite: no NaN loss for --on-nan to see)."""
    found = grad_scaler.found_inf(b, list(grads.values())) if scaling else None
    if clip_norm is not None:
        grads = clip_grad_norm(b, grads, clip_norm)
    _update(g, b, grads, optimizer, groups)
    if found is None:
        return
    metric = {k: v for k, v in g.state_updates.items() if v.startswith(METRIC_PREFIX)}
    grad_scaler.gate(g, b, found, {k: v for k, v in g.state_updates.items() if v != RNG_STATE and k not in metric})
    if loss is not None:
        _gate_metrics_on_loss(g, b, loss)
    grad_scaler.update_scale(g, b, found)
    _sum_into(g, b, UPDATE_COUNT, b.const(1.0))
    if report is not None:
        report[SKIPPED_UPDATES] = MetricSpec(grad_scaler.SKIPPED_SUM, UPDATE_COUNT)


def _gate_metrics_on_loss(g: Graph, b: Builder, loss: str) -> None:
    """The metric sums keep their values where the forward overflowed float16 (the loss is not
    finite): no NaN loss for --on-nan to see; the skipped update is counted instead."""
    metric = {k: v for k, v in g.state_updates.items() if v.startswith(METRIC_PREFIX)}
    grad_scaler.gate(g, b, grad_scaler.found_inf(b, [loss]), metric)


def _update(g: Graph, b: Builder, grads: dict[str, str], optimizer: Optimizer,
            groups: list[ResolvedGroup] | None = None) -> None:
    """Each parameter's update with its group's settings, reading its group's rate buffer."""
    if groups is None:
        groups = resolve_groups(optimizer, g.params, {p: tuple(g.initializers[p].shape) for p in g.params})
    group_of = {p: group for group in groups for p in group.params}
    for group in groups:
        _add_buffer(g, group.lr_state, np.array(group.optimizer.lr, np.float32))
    _add_buffer(g, STEP_STATE, np.zeros((), np.float32))
    step = b.op("Add", [STEP_STATE, b.const(1.0)])
    g.state_updates[step] = STEP_STATE
    for p in g.params:
        if p not in group_of:
            raise ValueError(f"parameter {p!r} is in none of the optimizer's resolved groups")
        group = group_of[p]
        slots = {}
        for slot, init in group.optimizer.init_state(g.initializers[p]).items():
            name = f"optim.{slot}.{p}"
            _add_buffer(g, name, init)
            slots[slot] = name
        new_p, new_slots = group.optimizer.update(b, p, grads[p], slots, group.lr_state, step)
        g.state_updates[new_p] = p
        for slot, value in new_slots.items():
            g.state_updates[value] = slots[slot]


def build_update_step(model: Graph, optimizer: Optimizer, *, clip_norm: float | None = None, precision: str = "f32",
                      report: dict[str, MetricSpec] | None = None,
                      groups: list[ResolvedGroup] | None = None) -> Graph:
    """The update alone: (clip,) optimizer step from the gradients in the accum.<param> buffers,
    which the "first"/"accumulate" phases filled. Data parallelism runs it after summing those
    buffers across replicas, so the gradient phase and the update are two programs. With
    `precision` "f16" it is the "apply" phase's loss-scaled update: the summed gradients (unscaled
    by each gradient phase) are checked, the update skipped where one is not finite, and the
    scale the gradient phases read (a state of the same device) updated."""
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
    scaling = check_precision(precision) == "f16"
    if scaling:
        grad_scaler.add_state(g)
    _apply_update(g, b, grads, optimizer, clip_norm, scaling, report, groups=groups)
    return resolve_attributes(g)


def build_inference(model: Graph, input_shapes: dict[str, Shape], precision: str = "f32") -> Graph:
    """The model in inference mode (running statistics, no dropout) for one input shape."""
    g = specialize(set_training_mode(model, False), input_shapes)
    fuse_gelu(g)
    fuse_rms_norm(g)
    fuse_rotate_half(g)
    fuse_attention(g)
    return _at_precision(g, precision)


def build_eval_step(model: Graph, input_shapes: dict[str, Shape], target_shape: Shape | dict[str, Shape] | None,
                    loss: Loss | list[Head], top_k: int | None = None,
                    report: dict[str, MetricSpec] | None = None, precision: str = "f32") -> Graph:
    """Inference plus loss and metric accumulation (validation)."""
    g = build_inference(model, input_shapes, precision)
    b = Builder(g, prefix="eval")
    heads, target_shapes = as_heads(model, loss, target_shape)
    out = _loss_and_metrics(g, b, heads, target_shapes, top_k, report)
    g.outputs = [out.loss] + ([out.correct] if out.correct else [])
    g.dce()
    return resolve_attributes(g)  # the loss, gradient and update nodes too: what backends lower


__all__ = [
    "ACCUM_PREFIX",
    "CORRECT_SUM",
    "F16_LOSS_ENV",
    "F16_SOFTMAX_GRAD_ENV",
    "LOSS_SUM",
    "METRIC_PREFIX",
    "METRIC_STATE",
    "PHASES",
    "SAMPLE_COUNT",
    "TARGET",
    "TARGET_PREFIX",
    "TOPK_SUM",
    "Head",
    "MetricSpec",
    "as_heads",
    "build_eval_step",
    "build_inference",
    "build_train_step",
    "build_update_step",
    "clip_grad_norm",
    "infer_shapes",
    "info_of",
    "loss_reads_half",
    "own_loss",
    "softmax_grad_reads_half",
    "top_k_for",
]
