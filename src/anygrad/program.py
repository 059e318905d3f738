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
from .ir.graph import Graph, Shape, TensorInfo, info_of
from .ir.passes import RNG_STATE, infer_shapes, set_training_mode, specialize
from .losses import Loss
from .optim.base import LR_STATE, STEP_STATE, Optimizer

TARGET = "anygrad.target"
LOSS_SUM = "anygrad.metric.loss_sum"
CORRECT_SUM = "anygrad.metric.correct"
SAMPLE_COUNT = "anygrad.metric.count"
METRIC_STATE = (LOSS_SUM, CORRECT_SUM, SAMPLE_COUNT)


@dataclass
class StepOutputs:
    loss: str
    correct: str | None


def _add_buffer(g: Graph, name: str, value: np.ndarray) -> None:
    g.initializers[name] = value
    g.info[name] = TensorInfo(value.dtype, tuple(value.shape))
    if name not in g.buffers:
        g.buffers.append(name)


def _loss_and_metrics(g: Graph, b: Builder, output: str, loss: Loss, target_shape: Shape) -> StepOutputs:
    g.inputs.append(TARGET)
    g.info[TARGET] = TensorInfo(np.dtype(loss.target_dtype), tuple(target_shape))
    loss_value = loss.build(b, output, TARGET)
    correct = b.op("CountCorrect", [output, TARGET]) if loss.classification else None
    # Device-side running sums, read back only when the trainer asks.
    for name in METRIC_STATE:
        _add_buffer(g, name, np.zeros((), np.float32))
    n = float(b.shape(output)[0]) if b.shape(output) else 1.0
    batch_loss = b.op("Mul", [loss_value, b.const(n)])
    g.state_updates[b.op("Add", [LOSS_SUM, batch_loss])] = LOSS_SUM
    g.state_updates[b.op("Add", [SAMPLE_COUNT, b.const(n)])] = SAMPLE_COUNT
    if correct is not None:
        g.state_updates[b.op("Add", [CORRECT_SUM, correct])] = CORRECT_SUM
    return StepOutputs(loss_value, correct)


def build_train_step(model: Graph, input_shapes: dict[str, Shape], target_shape: Shape,
                     loss: Loss, optimizer: Optimizer) -> Graph:
    """The training step for one batch shape: forward, loss, backward, update."""
    g = set_training_mode(model, True)
    _add_buffer(g, RNG_STATE, np.zeros(2, np.uint32))
    g = specialize(g, input_shapes)
    b = Builder(g, prefix="step")
    out = _loss_and_metrics(g, b, g.outputs[0], loss, target_shape)

    grads = gradients(g, out.loss, g.params)
    _add_buffer(g, LR_STATE, np.array(optimizer.lr, np.float32))
    _add_buffer(g, STEP_STATE, np.zeros((), np.float32))
    b = Builder(g, prefix="optim")
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
    g.state_updates[b.op("Add", [RNG_STATE, b.const(np.array([0, 1], np.uint32), np.uint32)])] = RNG_STATE
    g.outputs = [out.loss] + ([out.correct] if out.correct else [])
    g.dce()
    return g


def build_inference(model: Graph, input_shapes: dict[str, Shape]) -> Graph:
    """The model in inference mode (running statistics, no dropout) for one input shape."""
    return specialize(set_training_mode(model, False), input_shapes)


def build_eval_step(model: Graph, input_shapes: dict[str, Shape], target_shape: Shape, loss: Loss) -> Graph:
    """Inference plus loss and metric accumulation (validation)."""
    g = build_inference(model, input_shapes)
    b = Builder(g, prefix="eval")
    out = _loss_and_metrics(g, b, g.outputs[0], loss, target_shape)
    g.outputs = [out.loss] + ([out.correct] if out.correct else [])
    g.dce()
    return g


__all__ = ["build_train_step", "build_inference", "build_eval_step", "TARGET", "METRIC_STATE",
           "LOSS_SUM", "CORRECT_SUM", "SAMPLE_COUNT", "info_of", "infer_shapes"]
