"""The Model an export writes: the user's own float input, without the run's uint8 prologue."""
from __future__ import annotations

from ..ir.input_norm import find_input_normalisation, without_input_normalisation
from ..model import Model


def plain_model(model: Model) -> Model:
    """`model` as the user wrote it (float input), with its current weights: for exports.
    The model itself when it has no prologue (anygrad.ir.input_norm)."""
    if find_input_normalisation(model.graph) is None:
        return model
    graph = without_input_normalisation(model.graph)
    graph.initializers.update(model.state_dict())
    plain = Model(graph, model.source)
    plain.origin, plain.torch_binding = model.origin, model.torch_binding
    return plain
