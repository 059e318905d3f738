"""Values larger than one storage binding, split along their leading dimension (issue 13).

WebGPU binds at most `max-storage-buffer-binding-size` bytes of a buffer to one shader variable
(128 MiB by default), while one buffer may be larger (`max-buffer-size`). A kernel whose values
are larger than a binding is dispatched several times instead, each time over a block of leading
rows: the node is lowered again for the block's shapes, and each dispatch binds a window (byte
offset and size) of every value whose leading dimension is the one split. Values broadcast along
that dimension (a bias) are bound whole.

Which ops allow it: those whose output rows depend only on the same rows of their inputs. Here,
fused elementwise chains (every member is per element). Every other op keeps the planner's error,
which names the op and the largest batch that fits.
"""
from __future__ import annotations

from dataclasses import replace

from ...ir.graph import Graph, Node, TensorInfo
from .kernel import AdapterCaps, Kernel
from .kernels_elementwise import FUSED
from .wgsl import shape_of

ALIGN = 256  # bytes: every adapter's min-storage-buffer-offset-alignment is at most this
SPLITTABLE = frozenset({FUSED})


def _rows_value(graph: Graph, v: str, lead: int, rank: int) -> bool:
    """Whether v is indexed by the split rows: same rank as the output and the same leading dim."""
    shape = shape_of(graph, v)
    return len(shape) == rank and rank > 0 and shape[0] == lead and lead > 1


def split_rows(node: Node, graph: Graph, caps: AdapterCaps, lower) -> list[Kernel] | None:
    """The node's kernels, one per block of leading rows, each binding windows of the row values;
    None when the node is not one that may split, or no block of rows fits a binding."""
    if node.op not in SPLITTABLE or not node.outputs:
        return None
    out_shape = shape_of(graph, node.outputs[0])
    if not out_shape:
        return None
    lead, rank = out_shape[0], len(out_shape)
    values = [v for v in list(node.inputs) + list(node.outputs) if v]
    rowed = [v for v in values if _rows_value(graph, v, lead, rank)]
    limit = caps.max_storage_binding_size
    whole = [v for v in values if v not in rowed]
    if any(4 * max(1, _elems(graph, v)) > limit for v in whole):
        return None  # a value not split by rows is itself too large
    row_bytes = max(4 * _elems(graph, v) // lead for v in rowed) if rowed else 0
    if not rowed or row_bytes * lead <= limit:
        return None
    rows = limit // row_bytes
    # Every block starts at an aligned byte offset of every row value.
    step = 1
    while any((step * 4 * _elems(graph, v) // lead) % ALIGN for v in rowed):
        step *= 2
        if step > lead:
            return None
    rows -= rows % step
    if rows <= 0:
        return None
    kernels: list[Kernel] = []
    for r0 in range(0, lead, rows):
        n = min(rows, lead - r0)
        sub = _with_rows(graph, rowed, n)
        for kern in lower(node, sub, caps):
            if kern.scratch:
                return None  # a lowering with its own scratch is not windowed here
            order = list(kern.reads) + list(kern.writes)
            win = []
            for v in order:
                if v in rowed:
                    per_row = 4 * _elems(graph, v) // lead
                    win.append((r0 * per_row, n * per_row))
                else:
                    win.append(None)
            kernels.append(replace(kern, name=f"{kern.name}:rows{r0}", windows=tuple(win)))
    return kernels


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


__all__ = ["split_rows", "SPLITTABLE"]
