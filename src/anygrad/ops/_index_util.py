"""Attribute helpers the index-family op modules share (index.py, gather_scatter.py, resize.py):
a checked axis, a string attribute, and the shape rule of internal gradient ops that rebuild an
input of the shape in their `shape` attribute.
"""
from __future__ import annotations

from ..errors import ShapeError
from ..ir.graph import Node, TensorInfo
from ._util import norm_axis


def _axis(node: Node, rank: int, default: int = 0) -> int:
    axis = norm_axis(int(node.attr("axis", default)), rank)
    if not 0 <= axis < rank:
        raise ShapeError(f"{node.label}: axis {node.attr('axis', default)} is out of range for rank {rank}")
    return axis


def _str(node: Node, key: str, default: str) -> str:
    value = node.attr(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _shape_attr_infer(node, ins):
    """Backward helpers that rebuild an input of the shape in attribute `shape`."""
    return [TensorInfo(ins[0].dtype, tuple(node.attr("shape")))]
