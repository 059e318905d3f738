"""Shape inference of one node: its op's shape rule over its inputs' infos, and folding where every
input is a known constant (the op's reference kernel computes the value). The Builder calls it for
every node it appends; passes.infer_shapes for every node of a graph."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from .graph import Graph, Node, info_of
from .registry import get_op

# Folding a huge constant wastes memory for nothing; shape arithmetic is tiny.
_FOLD_LIMIT = 1 << 20


def infer_node(graph: Graph, node: Node) -> None:
    """Infer one node's outputs (and fold them when all inputs are known constants)."""
    op = get_op(node.op)
    if op is None:
        raise UnsupportedOpError(f"{node.label}: op type {node.op} is not supported")
    ins = [graph.info.get(i) if i else None for i in node.inputs]
    for i, (name, inf) in enumerate(zip(node.inputs, ins)):
        if name and inf is None:
            raise ShapeError(f"{node.label}: input {i} '{name}' has no known shape")
    try:
        outs = op.infer(node, ins)  # type: ignore[arg-type]
    except UnsupportedOpError:
        raise
    except ShapeError as e:  # shared shape helpers do not know the node: name it here
        if node.label in str(e):
            raise
        raise ShapeError(f"{node.label}: {e}") from e
    except Exception as e:  # a shape rule tripping over bad attributes or shapes
        shapes = [tuple(i.shape) if i else None for i in ins]
        raise ShapeError(f"{node.label}: cannot infer output shape from input shapes {shapes}: {e}") from e
    if (op.foldable and all(i is None or i.const is not None for i in ins)
            and any(i is not None for i in ins) and all(o.const is None for o in outs)
            and sum(o.size for o in outs if o.is_static) <= _FOLD_LIMIT):
        values = op.run(node, [i.const if i is not None else None for i in ins])
        outs = [info_of(np.asarray(v)) for v in values]
    for name, inf in zip(node.outputs, outs):
        if name:
            graph.info[name] = inf
