"""float16 values on the numpy backend (mixed precision, ir/autocast.py).

A node that reads float16 runs its registry kernel on float32 copies of those inputs and rounds
its float outputs to the dtype the graph gives them: float32 arithmetic and accumulation, float16
storage, which is what a GPU kernel over float16 buffers does (and what torch's float16 kernels
do). numpy's own float16 loops would be slow and, for matmul, accumulate in float16.
"""
from __future__ import annotations

import numpy as np

from ...ir.graph import Graph, Node
from ...ir.registry import OpDef

HALF = np.dtype(np.float16)


def reads_half(graph: Graph, node: Node) -> bool:
    """Whether the node reads or writes a float16 value and so runs through run_in_float32."""
    return any(v and v in graph.info and np.dtype(graph.info[v].dtype) == HALF
               for v in list(node.inputs) + list(node.outputs))


def run_in_float32(op: OpDef, node: Node, ins: list[np.ndarray | None], out_dtypes: list[np.dtype | None],
                   kernel=None) -> list[np.ndarray]:
    """op's outputs (`kernel`'s, when the backend has a faster one) computed from float32 copies
    of the float16 inputs, rounded to out_dtypes. Values past float16's range become inf, as on a
    GPU (loss scaling counts on it): no warning."""
    wide = [a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == HALF else a for a in ins]
    with np.errstate(over="ignore"):
        outs = kernel(node, wide) if kernel is not None else op.run(node, wide)
        return [o.astype(d) if d is not None and o.dtype != d else o for o, d in zip(outs, out_dtypes)]


__all__ = ["reads_half", "run_in_float32"]
