"""The Model's heads: compile's `loss=` (with loss_weights, loss options and loss_output) read into
one Head per output that trains, and a batch's targets read for those heads.

Separate from the Model class because it is argument interpretation with its own error messages:
it reads the graph's outputs and the loss registry, and holds no state of its own.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..batch import Batch, check_batch_sizes, structure, to_numpy
from ..errors import ConfigError, DataError
from ..ir.graph import Graph
from ..losses import LOSSES, Loss, get_loss
from ..program import TARGET, TARGET_PREFIX, Head


def _is_float_scalar(info: Any) -> bool:
    """Whether a graph value's declared info is one float number (shape () or all ones)."""
    shape = getattr(info, "shape", None)
    if shape is None or not all(isinstance(d, (int, np.integer)) and d == 1 for d in shape):
        return False
    return np.issubdtype(np.dtype(info.dtype), np.floating)


def build_heads(graph: Graph, loss: Any, weights: Mapping[str, float] | None, options: dict[str, Any],
                loss_output: str | None = None) -> list[Head]:
    """compile's loss/loss_weights/options as Heads (see Model.compile)."""
    outputs = list(graph.outputs)
    if loss_output is not None and not (isinstance(loss, str) and loss.split(":")[0] == "output"):
        raise ConfigError(f"loss_output={loss_output!r} chooses the output of loss='output' (a model "
                          f"that returns its own loss), not of loss={loss!r}")
    if isinstance(loss, Mapping):
        if not loss:
            raise ConfigError(f"loss: an empty dict; name a loss per output, e.g. {{'{outputs[0]}': 'cross_entropy'}}")
        unknown = [k for k in loss if k not in outputs]
        if unknown:
            raise ConfigError(f"loss: the model has no output named {unknown[0]!r}; its outputs are {outputs}")
        if any(v == "output" for v in loss.values()):
            raise ConfigError("loss='output' trains the whole model on its own loss: pass it alone, not per output")
        used = set()
        chosen = {}
        for out in outputs:  # graph order: the first head's metrics keep the plain names
            if out in loss:
                chosen[out] = one_loss(loss[out], options, used)
        left = set(options) - used
        if left:
            raise ConfigError(f"loss options {sorted(left)} are taken by none of the losses {dict(loss)}")
    else:
        one = one_loss(loss, options, None)
        chosen = {own_loss_output(graph, one, loss_output) if not one.needs_target else outputs[0]: one}
    weights = dict(weights or {})
    unknown = [k for k in weights if k not in chosen]
    if unknown:
        raise ConfigError(f"loss_weights: {unknown[0]!r} is not an output with a loss (those are {list(chosen)})")
    heads = []
    for i, (out, lo) in enumerate(chosen.items()):
        w = weights.get(out, 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float, np.number)) or not np.isfinite(w):
            raise ConfigError(f"loss_weights['{out}'] must be a finite number, got {w!r}")
        heads.append(Head(out, lo, float(w), TARGET if i == 0 else TARGET_PREFIX + out))
    if not heads[0].loss.needs_target and weights:
        raise ConfigError("loss_weights do not apply to loss='output' (the model computes its own loss)")
    return heads


def own_loss_output(graph: Graph, loss: Loss, requested: str | None) -> str:
    """Which output loss='output' minimises: the one named (loss='output:NAME' or
    loss_output=NAME); else the first output when it is a float scalar (a forward returning
    the loss first, as loss='output' always took); else the model's only scalar float
    output, wherever it stands (a forward returning (logits, loss)); several such scalars
    must be chosen between."""
    outputs, named = list(graph.outputs), loss.options.get("output")
    if requested is not None and named is not None and requested != named:
        raise ConfigError(f"loss='output:{named}' and loss_output={requested!r} name different outputs; "
                          "give one")
    requested = requested if requested is not None else named
    if requested is not None:
        if not isinstance(requested, str) or requested not in outputs:
            raise ConfigError(f"loss_output: the model has no output named {requested!r}; its outputs "
                              f"are {outputs}")
        return requested
    scalars = [o for o in outputs if _is_float_scalar(graph.info.get(o))]
    if scalars and scalars[0] == outputs[0]:  # the loss first: the convention loss='output' always took
        return outputs[0]
    if len(scalars) > 1:
        first = scalars[0]
        raise ConfigError(f"loss='output': the model has several scalar float outputs "
                          f"({', '.join(scalars)}); choose the loss with loss='output:{first}' or "
                          f"loss_output='{first}' (CLI: --loss output:{first}); the others are reported "
                          "as metrics")
    return scalars[0] if scalars else outputs[0]  # none: the step's check names the first output's shape


def one_loss(loss: Any, options: dict[str, Any], used: set | None) -> Loss:
    """A Loss from a name (with the options it takes) or a Loss. `used`: collect the option
    names taken, for a dict of losses (each takes the options it knows); None: all must fit."""
    if isinstance(loss, Loss):
        if options and used is None:
            raise ConfigError(f"loss options {sorted(options)} go with a loss name, not a Loss object")
        return loss
    if used is None or not isinstance(loss, str) or loss not in LOSSES:
        return get_loss(loss, **options)
    import inspect
    takes = set(inspect.signature(LOSSES[loss]).parameters)
    mine = {k: v for k, v in options.items() if k in takes}
    used.update(mine)
    return get_loss(loss, **mine)


def parse_targets(heads: list[Head], input_names: list[str], y: Any) -> Batch:
    """A batch's targets as {target input: array} for the heads with a target (Model.parse_targets)."""
    taking = [h for h in heads if h.loss.needs_target]
    if not heads:
        raise ConfigError("call model.compile(loss=..., optimizer=..., device=...) first")
    if not taking:
        if y is not None:
            raise ConfigError("loss='output' takes no targets: the model computes its own loss; pass labels "
                              f"as model inputs (its inputs are {input_names})")
        return {}
    if y is None:
        names = [h.output for h in taking]
        raise ConfigError(f"loss '{taking[0].loss.name}' needs targets: train_on_batch(inputs, targets)"
                          + (f" with targets by output name {names}" if len(names) > 1 else "")
                          + "; a model that computes its own loss compiles with loss='output'")
    raw = structure(y, [h.output for h in taking], "target")
    out = {}
    for h in taking:
        what = f"targets of output '{h.output}'" if len(taking) > 1 else "targets"
        value = to_numpy(raw[h.output], what)
        try:
            out[h.target] = h.loss.targets(value)
        except DataError as e:
            if len(taking) == 1:
                raise
            raise DataError(f"{what}: {e}") from None
    if len(taking) > 1:
        # Targets are not checked against the inputs: a model may return flattened (batch *
        # tokens, vocab) logits, as nanoGPT does, for (batch * tokens,) targets, and a file's
        # declared output shapes may call that axis 'batch' too; the loss's shape rule checks
        # each target against its output when the step is built.
        check_batch_sizes({f"target of '{h.output}'": out[h.target] for h in taking}, "target")
    return out


def by_output(heads: list[Head], targets: Batch) -> dict[str, np.ndarray]:
    """Targets by target input -> by output name (what parse_targets takes)."""
    return {h.output: targets[h.target] for h in heads if h.target in targets}
