"""The units a step is compiled into before it becomes a plan: `_Step` (a lowered node, a group
of nodes run by one grouped kernel, or a numpy fallback), and the rewrite of that list that fuses
MatMul + bias Add into one torch.addmm step.

Separate because it is the executable's intermediate form: built from the graph node by node,
rewritten (bias fusion, grouping), then flattened into actions (actions.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...ir.graph import Graph, Node
from .device import _torch


@dataclass
class _Step:
    """One unit of the step: a lowered node, a group of nodes (one grouped kernel), or a fallback."""

    nodes: list[Node]
    kernel: Callable  # torch kernel, grouped kernel, or the op's numpy reference kernel (fallback)
    lowered: bool
    grouped: bool = False
    torch_dtypes: list[Any] = field(default_factory=list)  # of the outputs, for lowered steps
    host_dtypes: list[np.dtype | None] = field(default_factory=list)  # of the inputs, for fallbacks

    @property
    def inputs(self) -> list[str]:
        return [i for n in self.nodes for i in n.inputs]

    @property
    def outputs(self) -> list[str]:
        return [o for n in self.nodes for o in n.outputs]


def _fuse_bias(graph: Graph, steps: list[_Step]) -> list[_Step]:
    """MatMul(a, W) followed by Add(., bias) with a 1-D bias over W's columns (every Linear, as
    ONNX writes it) becomes one torch.addmm step, at the Add's place, where the matmul's output has
    no other reader: the bias is added in the GEMM's epilogue instead of by a pass of its own over
    the output (24 launches per step of the GPT benchmark). Both kernels must be lowered."""
    readers: dict[str, int] = {}
    for st in steps:
        for i in st.inputs:
            if i:
                readers[i] = readers.get(i, 0) + 1
    pinned = set(graph.outputs) | set(graph.state_updates)
    at = {o: k for k, st in enumerate(steps) for o in st.outputs if o}
    fused: dict[int, _Step] = {}
    dropped: set[int] = set()
    for k, st in enumerate(steps):
        node = st.nodes[0]
        if not st.lowered or st.grouped or node.op != "Add" or len(node.inputs) != 2:
            continue
        for mm_out, bias in (node.inputs, node.inputs[::-1]):
            j = at.get(mm_out)
            if j is None or j in dropped or readers.get(mm_out) != 1 or mm_out in pinned:
                continue
            mm = steps[j]
            a, w = (mm.nodes[0].inputs + ["", ""])[:2]
            if not mm.lowered or mm.grouped or mm.nodes[0].op != "MatMul" or not (a and w and bias):
                continue
            ia, iw, ib, io = (graph.info.get(n) for n in (a, w, bias, node.outputs[0]))
            if None in (ia, iw, ib, io) or len(iw.shape) != 2 or len(ia.shape) < 2 or \
                    tuple(ib.shape) != (iw.shape[1],) or tuple(io.shape) != tuple(ia.shape[:-1]) + (iw.shape[1],) or \
                    len({np.dtype(x.dtype) for x in (ia, iw, ib)}) != 1 or np.dtype(ia.dtype).kind != "f":
                continue
            fused[k] = _Step([Node("MatMul+Add", [a, w, bias], list(node.outputs), name=node.name)], _addmm, True,
                             torch_dtypes=st.torch_dtypes)
            dropped.add(j)
            break
    return [fused.get(k, st) for k, st in enumerate(steps) if k not in dropped]


def _addmm(ins: list) -> list:
    a, w, bias = ins
    rows = _torch().addmm(bias, a.reshape(-1, a.shape[-1]), w)
    return [rows.reshape(*a.shape[:-1], w.shape[1])]
