"""Shape-rule helpers the op families share."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.graph import Node, Shape, TensorInfo


def broadcast_shape(*shapes: Shape) -> Shape:
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError as e:
        raise ShapeError(f"shapes {list(shapes)} do not broadcast") from e


def same_as_first(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    return [TensorInfo(ins[0].dtype, ins[0].shape)]


def broadcast_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    return [TensorInfo(ins[0].dtype, broadcast_shape(*[i.shape for i in ins if i is not None]))]


def const_ints(info: TensorInfo | None, what: str, node: Node) -> list[int] | None:
    """Integer values of an input that must be known at compile time (axes, shapes, pads)."""
    if info is None:
        return None
    if info.const is None:
        raise ShapeError(f"{node.label}: input '{what}' must be a constant (known when the model is compiled)")
    return [int(v) for v in np.asarray(info.const).reshape(-1)]


def axes_of(node: Node, ins: list, slot: int = 1) -> list[int] | None:
    """Axes from the attribute (older opsets) or from a constant input (newer opsets)."""
    if node.attr("axes") is not None:
        return list(node.attr("axes"))
    if len(ins) > slot and ins[slot] is not None:
        value = ins[slot]
        if isinstance(value, TensorInfo):
            return const_ints(value, "axes", node)
        return [int(v) for v in np.asarray(value).reshape(-1)]
    return None


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis
