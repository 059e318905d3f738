"""Uint8 batches normalised on the device: the graph pass `anygrad.ir.input_norm`, applied to a Model.

Use it with DataLoader batches left as uint8 (a BatchTransform with to_float=False, or no
transform). Anything with a `.graph` and a `.backend` (an anygrad.Model) will do: the data layer
feeds models without depending on the Model class.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..ir.input_norm import (
    Prologue,
    find_input_normalisation,
    input_statistics,
    without_input_normalisation,
)
from ..ir.input_norm import add_input_normalisation as _add_to_graph
from ..ir.input_norm import can_normalise_in_graph as _graph_can_normalise

__all__ = ["Prologue", "add_input_normalisation", "can_normalise_in_graph", "find_input_normalisation",
           "input_statistics", "without_input_normalisation"]


def can_normalise_in_graph(model: Any, mean: Sequence[float]) -> bool:
    """Whether the model's input takes a per-channel prologue: a float input of rank >= 2 whose axis 1
    has one entry per mean (or a single mean, which broadcasts over any input)."""
    return _graph_can_normalise(model.graph, mean)


def add_input_normalisation(model: Any, mean: Sequence[float], std: Sequence[float]) -> Any:
    """Make `model` (an anygrad.Model) take uint8 images and normalise them per channel in the graph
    (in place), and return it.

    Call before `compile`. The float input keeps its name inside the graph; the new uint8 input
    is called '<input>_uint8'. One mean/std per channel (axis 1), or a single one for any input
    (an MLP over flattened MNIST pixels).
    """
    if model.backend is not None:
        raise ConfigError("add_input_normalisation changes the graph: call it before model.compile()")
    _add_to_graph(model.graph, mean, std)
    return model
