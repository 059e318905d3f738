"""Graph pass: normalisation inside the graph, so uint8 images go to the device and are normalised there.

A uint8 batch is a quarter of the float32 bytes to prepare and upload; the prologue
`Cast -> Sub -> Div` computes (x - 255 mean) / (255 std) = (x / 255 - mean) / std per channel
before the model's first op. Use it with DataLoader batches left as uint8 (a BatchTransform with
to_float=False, or no transform). The prologue belongs to the run, not to the model: exports
(model.onnx) go through `plain_model`, which takes it out again, so the file keeps the float input
the user's PyTorch model has.

This module works on Graphs only; `anygrad.data.graph_input` applies it to a Model.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .graph import Graph, Node, TensorInfo, info_of

PREFIX = "input_norm"
ONNX_FLOAT = 1  # TensorProto.FLOAT, the Cast's `to` (the dtype table lives in ops/, a layer above)


@dataclass(frozen=True)
class Prologue:
    """Where add_input_normalisation put its nodes: uint8 input -> ... -> the model's float input."""

    uint8_input: str
    float_input: str
    nodes: tuple[str, ...]       # node names
    constants: tuple[str, ...]   # initializer names (255 mean, 255 std)


def _stat_shape(shape: tuple, n: int) -> tuple[int, ...]:
    """How a mean/std of n values broadcasts against an input of `shape`: one per channel (axis 1)."""
    return (1,) if n == 1 else (1, n) + (1,) * (len(shape) - 2)


def can_normalise_in_graph(graph: Graph, mean: Sequence[float]) -> bool:
    """Whether the graph's first input takes a per-channel prologue: a float input of rank >= 2 whose
    axis 1 has one entry per mean (or a single mean, which broadcasts over any input)."""
    info = graph.info[graph.inputs[0]]
    shape = tuple(info.shape)
    if np.dtype(info.dtype) != np.float32 or len(shape) < 1:
        return False
    n = len(np.asarray(mean).ravel())
    return n == 1 or (len(shape) >= 2 and shape[1] == n)


def add_input_normalisation(graph: Graph, mean: Sequence[float], std: Sequence[float]) -> Graph:
    """Make `graph` take uint8 images and normalise them per channel (in place).

    The float input keeps its name inside the graph; the new uint8 input is called
    '<input>_uint8'. One mean/std per channel (axis 1), or a single one for any input (an MLP over
    flattened MNIST pixels).
    """
    g = graph
    old = g.inputs[0]
    info = g.info[old]
    shape = tuple(info.shape)
    mean, std = np.asarray(mean, np.float64).ravel(), np.asarray(std, np.float64).ravel()
    if len(std) != len(mean) or not can_normalise_in_graph(g, mean):
        raise ConfigError(f"input normalisation needs one mean/std per channel (axis 1 of an NCHW image input) "
                          f"or a single mean/std; the model's input '{old}' is {np.dtype(info.dtype)} {shape}, "
                          f"got {len(mean)} means and {len(std)} stds")
    if np.any(std <= 0):
        raise ConfigError(f"std must be positive, got {std.tolist()}")
    new = g.fresh(f"{old}_uint8")
    g.info[new] = TensorInfo(np.dtype(np.uint8), shape)
    g.inputs[0] = new
    # Plain nodes, not a Builder: the batch dimension is still symbolic here; `specialize`
    # infers these shapes with the rest of the graph.
    mean_c, std_c = g.fresh(f"{PREFIX}.mean"), g.fresh(f"{PREFIX}.std")
    for name, value in ((mean_c, 255.0 * mean), (std_c, 255.0 * std)):
        g.initializers[name] = value.reshape(_stat_shape(shape, len(mean))).astype(np.float32)
        g.info[name] = info_of(g.initializers[name])
    cast, centred = g.fresh(f"{PREFIX}.cast"), g.fresh(f"{PREFIX}.centred")
    prologue = [Node("Cast", [new], [cast], {"to": ONNX_FLOAT}, g.fresh(f"{PREFIX}.Cast")),
                Node("Sub", [cast, mean_c], [centred], {}, g.fresh(f"{PREFIX}.Sub")),
                Node("Div", [centred, std_c], [old], {}, g.fresh(f"{PREFIX}.Div"))]
    g.nodes = prologue + g.nodes
    return g


def find_input_normalisation(graph: Graph) -> Prologue | None:
    """The prologue add_input_normalisation put in front of `graph`, if any."""
    nodes = [n for n in graph.nodes[:3] if n.name.startswith(f"{PREFIX}.")]
    if [n.op for n in nodes] != ["Cast", "Sub", "Div"] or not graph.inputs or nodes[0].inputs[0] != graph.inputs[0]:
        return None
    return Prologue(graph.inputs[0], nodes[2].outputs[0], tuple(n.name for n in nodes),
                    (nodes[1].inputs[1], nodes[2].inputs[1]))


def input_statistics(graph: Graph) -> tuple[list[float], list[float]] | None:
    """(mean, std) in [0, 1] pixel units of the graph's prologue, or None without one."""
    p = find_input_normalisation(graph)
    if p is None:
        return None
    mean, std = (np.asarray(graph.initializers[c], np.float64).ravel() / 255.0 for c in p.constants)
    return [float(f"{v:.7g}") for v in mean], [float(f"{v:.7g}") for v in std]


def without_input_normalisation(graph: Graph) -> Graph:
    """A copy of `graph` with the prologue taken out: the model's own float input again."""
    p = find_input_normalisation(graph)
    if p is None:
        return graph
    g = graph.copy()
    g.nodes = [n for n in g.nodes if n.name not in p.nodes]
    g.inputs[0] = p.float_input
    for name in p.constants + (p.uint8_input,):
        g.initializers.pop(name, None)
        g.info.pop(name, None)
    return g

