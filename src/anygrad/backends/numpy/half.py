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
_EXACT = frozenset({"Cast", "CastLike"})  # a cast is its own rounding


def reads_half(graph: Graph, node: Node) -> bool:
    """Whether the node reads a float16 value and so runs through run_in_float32."""
    return node.op not in _EXACT and any(i and np.dtype(graph.info[i].dtype) == HALF for i in node.inputs)


def run_in_float32(op: OpDef, node: Node, ins: list[np.ndarray | None], out_dtypes: list[np.dtype | None]
                   ) -> list[np.ndarray]:
    """op's outputs computed from float32 copies of the float16 inputs, rounded to out_dtypes."""
    wide = [a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == HALF else a for a in ins]
    outs = op.run(node, wide)
    return [o.astype(d) if d is not None and o.dtype != d else o for o, d in zip(outs, out_dtypes)]


__all__ = ["reads_half", "run_in_float32"]
