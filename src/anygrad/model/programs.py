"""The compiled programs a Model caches: its training, evaluation and prediction steps per batch
shape (and accumulation phase), and the optimizer update alone, built from the Model's graph and
settings (program.py) and compiled on its backend.

Separate from the Model class because it owns the cache key, which settings a program bakes in,
and which micro-batch phase runs next; the Model only asks for the program a batch needs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..backends.base import Executable
from ..batch import Batch
from ..program import (
    MetricSpec,
    build_eval_step,
    build_inference,
    build_train_step,
    build_update_step,
    top_k_for,
)

if TYPE_CHECKING:
    from .core import Model


def top_k(model: Model) -> int | None:
    """Model.top_k: k of the top-k accuracy the programs count, or None."""
    if model.loss is None or not model.loss.classification or not model._supports("CountTopK"):
        return None
    info = model.graph.info.get(model.heads[0].output if model.heads else model.graph.outputs[0])
    if info is None or info.shape is None or len(info.shape) != 2:  # per-sample classes only
        return None
    return top_k_for(info, True)


def program(model: Model, kind: str, inputs: Batch, targets: Batch | None = None, phase: str = "step") -> Executable:
    """The compiled `kind` ("train", "eval", "predict") program for these inputs' and targets'
    shapes and `phase`, built and cached on first use; its metrics join the Model's."""
    shapes = {n: tuple(v.shape) for n, v in inputs.items()}
    target_shapes = {n: tuple(v.shape) for n, v in (targets or {}).items()}
    # (kind, first input's shape, first target's shape, phase, every shape): the first four as
    # they were when models had one input and one target
    first_target = next(iter(target_shapes.values()), None)
    key = (kind, next(iter(shapes.values())), first_target, phase,
           tuple(shapes.items()) + tuple(target_shapes.items()))
    if key not in model._programs:
        backend = model.require_compiled()
        report: dict[str, MetricSpec] = {}
        if kind == "train":
            graph = build_train_step(model.graph, shapes, target_shapes, model.heads, model.optimizer,
                                     clip_norm=model.clip_norm, accumulate=model.accumulate, phase=phase,
                                     top_k=model.top_k, report=report, sync_batchnorm=model.sync_batchnorm,
                                     precision=model.precision, groups=model.param_groups)
        # Evaluation and prediction run in float32 even for f16 training: no backward to fit, and
        # BatchNorm's running statistics lag the weights early in training, so inference-mode
        # activations can pass float16's 65504 where the training step's do not.
        elif kind == "eval":
            graph = build_eval_step(model.graph, shapes, target_shapes, model.heads, top_k=model.top_k,
                                    report=report)
        else:
            graph = build_inference(model.graph, shapes)
        model._programs[key] = backend.compile(graph)
        model._metric_specs.update(report)
    return model._programs[key]


def update_program(model: Model) -> Executable:
    """Model.update_program: the optimizer update alone, built and cached on first use."""
    g = model.graph
    key = ("update", tuple(g.params), model.clip_norm, id(model.optimizer), model.precision)
    if key not in model._programs:
        report: dict[str, MetricSpec] = {}  # f16: the skipped updates (counted by every replica alike)
        model._programs[key] = model.require_compiled().compile(
            build_update_step(g, model.optimizer, clip_norm=model.clip_norm, precision=model.precision,
                              report=report, groups=model.param_groups))
        model._metric_specs.update(report)
    return model._programs[key]


def next_phase(model: Model, flush: bool) -> str:
    """Model.next_phase: which step program this micro-batch runs; advances micro_step."""
    if model.accumulate == 1:
        return "step"
    phase = "first" if model.micro_step == 0 else "accumulate"
    model.micro_step += 1
    if flush or model.micro_step == model.accumulate:
        phase = "step" if model.micro_step == 1 else "apply"
        model.micro_step = 0
    return phase
