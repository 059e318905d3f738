"""Values larger than one storage binding, split along their leading dimension (issue 13).

WebGPU binds at most `max-storage-buffer-binding-size` bytes of a buffer to one shader variable
(128 MiB by default), while one buffer may be larger (`max-buffer-size`). A kernel whose values
are larger than a binding is dispatched several times instead, each time over a block of leading
rows: the node is lowered again for the block's shapes, and each dispatch binds a window (byte
offset and size) of every value whose leading dimension is the one split. Values broadcast along
that dimension (a bias) are bound whole.

Which ops allow it: those whose output rows depend only on the same rows of some inputs (`_rowed`
says which): elementwise ops and fused chains, MatMul/Gemm over rows of A (or batches of both),
reductions and row-wise ops (Softmax, LayerNorm) over other axes, embedding lookups (Gather on
axis 0: rows of the indices), and Conv/pooling over the batch. Every other op keeps the planner's
error, which names the op and the largest batch that fits.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ....ir.graph import Graph, Node, TensorInfo
from ....ir.passes import resolved
from ..kernels.kernel import AdapterCaps, Kernel
from ..kernels.kernels_elementwise import EW, FUSED
from ..kernels.kernels_reduce import COMBINE
from ..kernels.wgsl import shape_of
from .bindpack import _DECL, _uses_only_indexed, index_rewrite

ALIGN = 256  # bytes: every adapter's min-storage-buffer-offset-alignment is at most this
_BATCH_OPS = frozenset({"Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "ConvGradInput"})
_ROWWISE = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization"})


def _rows_value(graph: Graph, v: str, lead: int, rank: int) -> bool:
    """Whether v is indexed by the split rows: same rank as the output and the same leading dim."""
    shape = shape_of(graph, v)
    return len(shape) == rank and rank > 0 and shape[0] == lead and lead > 1


def _rowed(node: Node, graph: Graph) -> list[str] | None:
    """The inputs and outputs of node indexed by its output's leading rows (the rest is bound
    whole), or None when the op's rows are not independent."""
    out_shape = shape_of(graph, node.outputs[0])
    if not out_shape or out_shape[0] <= 1:
        return None
    lead, rank = out_shape[0], len(out_shape)

    def auto(vs) -> list[str]:
        return [v for v in vs if v and _rows_value(graph, v, lead, rank)]

    outs = [o for o in node.outputs if o]
    if len(auto(outs)) != len(outs):
        return None
    ins = node.inputs
    op = node.op
    if op == FUSED and (node.attr("_views") or node.attr("_stores")):
        return None   # strided reads or stores: rows of the result are not rows of those values
    if op == FUSED or (op in EW and op != "Identity"):
        return auto(ins) + outs
    if op == "MatMul":
        if any(node.attr(a) is not None for a in ("_permA", "_permB", "_permY", "_viewA", "_viewB", "_intoY")):
            return None
        sa, sb = shape_of(graph, ins[0]), shape_of(graph, ins[1])
        if len(sa) != rank or sa[0] != lead or (len(sb) == rank > 2 and sb[0] not in (1, lead)):
            return None
        # rows of A (or batches of A and B) give the same rows of Y; a B without them is bound whole
        rows = [ins[0]] + ([ins[1]] if len(sb) == rank > 2 and sb[0] == lead else [])
        return rows + auto(ins[2:]) + outs
    if op == "Gemm":
        if node.attr("transA", 0) or node.attr("_viewA") is not None or node.attr("_viewB") is not None:
            return None   # a view's rows are not the bound value's (gemm_layout.fold_views)
        return [ins[0]] + auto(ins[2:]) + outs
    if op == "Gather":
        if int(node.attr("axis", 0)) != 0 or len(shape_of(graph, ins[1])) < 1 or shape_of(graph, ins[1])[0] != lead:
            return None
        return [ins[1]] + outs
    if op in COMBINE:
        shape = shape_of(graph, ins[0])
        axes = tuple(resolved(node, "axes"))
        if 0 in axes or not shape or shape[0] != lead:
            return None
        return [ins[0]] + outs
    if op in _ROWWISE:
        shape = shape_of(graph, ins[0])
        axis = int(node.attr("axis", -1))
        if axis % len(shape) == 0:
            return None
        return [ins[0]] + auto(ins[1:]) + outs
    if op in _BATCH_OPS:
        if op == "ConvGradInput":
            return None  # reads dY rows (input 0) against W; left whole: not needed yet
        return [ins[0]] + outs
    return None


def split_rows(node: Node, graph: Graph, caps: AdapterCaps, lower) -> list[Kernel] | None:
    """The node's kernels, one per block of leading rows, each binding windows of the row values;
    None when the node is not one that may split, or no block of rows fits a binding."""
    if not node.outputs or not node.outputs[0]:
        return None
    rowed = _rowed(node, graph)
    if rowed is None:
        return None
    lead = shape_of(graph, node.outputs[0])[0]
    values = [v for v in list(node.inputs) + list(node.outputs) if v]
    if any(v in graph.info and np.dtype(graph.info[v].dtype) == np.float16 for v in values):
        return None  # windows are planned in 4-byte elements; float16 values (2 bytes) are not split yet
    limit = caps.max_storage_binding_size
    whole = [v for v in values if v not in rowed]
    if any(4 * max(1, _elems(graph, v)) > limit for v in whole):
        return None  # a value not split by rows is itself too large
    row_bytes = max(4 * _elems(graph, v) // lead for v in rowed) if rowed else 0
    if not rowed or row_bytes * lead <= limit:
        return None
    # A window starts at an aligned offset at or before its rows (the shader skips the difference).
    rows = (limit - ALIGN) // row_bytes
    if rows >= 4:  # every window then starts 16 bytes aligned, as a vec4 binding needs
        rows -= rows % 4
    if rows <= 0:
        return None
    kernels: list[Kernel] = []
    for r0 in range(0, lead, rows):
        n = min(rows, lead - r0)
        sub = _with_rows(graph, rowed, n)
        # Scratch (a reduction's partials) is sized for one block, bound whole, reused by the next.
        for kern in lower(node, sub, caps):
            wgsl, win = kern.wgsl, []
            decls = {int(m.group(1)): (m.group(3), m.group(4)) for m in _DECL.finditer(wgsl)}
            for k, v in enumerate(list(kern.reads) + list(kern.writes)):
                if v not in rowed:
                    win.append(None)
                    continue
                per_row = 4 * _elems(graph, v) // lead
                off = r0 * per_row
                skip = off % ALIGN
                if skip:
                    var, elem = decls.get(k, ("", ""))
                    width = 4 * int(elem[3]) if elem.startswith("vec") else 4  # vec4<f32>: 16 bytes
                    if not var or skip % width or not _uses_only_indexed(wgsl, var):
                        return None
                    wgsl = _shift_index(wgsl, var, skip // width)
                win.append((off - skip, n * per_row + skip))
            kernels.append(replace(kern, name=f"{kern.name}:rows{r0}", wgsl=wgsl, windows=tuple(win)))
    return kernels


def _shift_index(wgsl: str, var: str, shift: int) -> str:
    """Every `var[expr]` -> `var[shift + (expr)]`: the binding starts `shift` elements early."""
    return index_rewrite(wgsl, var, lambda expr: f"{var}[{shift}u + ({expr})]")


def _elems(graph: Graph, v: str) -> int:
    n = 1
    for d in shape_of(graph, v):
        n *= int(d)
    return n


def _with_rows(graph: Graph, rowed: list[str], n: int) -> Graph:
    """A shallow view of graph whose row values have n leading rows (for lowering only)."""
    view = Graph.__new__(Graph)
    view.__dict__.update(graph.__dict__)
    view.info = dict(graph.info)
    for v in rowed:
        info = graph.info[v]
        view.info[v] = TensorInfo(info.dtype, (n,) + tuple(info.shape[1:]))
    return view


__all__ = ["split_rows"]
