"""Reading a node's attributes and constant inputs in the wgpu lowerings (what ONNX leaves
relative, such as negative axes, made absolute); ops/ internals are not the backend's to import."""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node, TensorInfo


def norm_axis(axis: int, rank: int) -> int:
    """An ONNX axis (negative: counted from the end) as an index into a shape of `rank` dims."""
    return axis + rank if axis < 0 else axis


def ints_of(info: TensorInfo | None, what: str, node: Node) -> list[int] | None:
    """The integer values of a constant input (None for an absent one); an input only known when
    the step runs is a ShapeError naming the node and the input."""
    if info is None:
        return None
    if info.const is None:
        raise ShapeError(f"{node.label}: input '{what}' must be a constant (known when the model is compiled)")
    return [int(v) for v in np.asarray(info.const).reshape(-1)]
