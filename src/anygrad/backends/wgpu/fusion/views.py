"""Strided views: a tensor made from another by layout nodes alone (reshapes, transposes,
positive-step slices, gathers of one constant index) as (shape, strides, offset) over the other's
elements, so that a kernel reads or stores through the view instead of a copy kernel moving the
data. The GEMM layouts (gemm_layout.fold_views, fold_result_layouts) and the fused elementwise
kernels (elementwise.fold_elementwise_views) use them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ....ir.graph import Graph, Node
from ..kernels.kernel import AdapterCaps, ops_where
from ..kernels.kernels_elementwise import literal_value
from ..kernels.wgsl import shape_of
from ..kernels.wgsl import strides as _strides

ALIAS_LIKE = ops_where("alias")
VIEW_OPS = ALIAS_LIKE | {"Transpose", "Slice", "Gather"}   # what a strided view of a tensor can see through


def too_big_to_bind(graph: Graph, v: str, caps: AdapterCaps) -> bool:
    """Larger than one binding, counting 4 bytes an element (an upper bound of planner.value_bytes,
    which this module cannot import: the planner imports fusion): bindsplit's row blocks, which
    take no views."""
    return int(np.prod(shape_of(graph, v), dtype=np.int64)) * 4 > caps.max_storage_binding_size


def perm_of(graph: Graph, node: Node) -> list[int]:
    """A Transpose's perm (ONNX's default: the axes reversed)."""
    rank = len(shape_of(graph, node.inputs[0]))
    perm = node.attr("perm")
    return list(perm) if perm is not None else list(range(rank))[::-1]


Atom = tuple[int, int]   # (size, stride): an evenly spaced run of elements


@dataclass
class StridedView:
    """A tensor as a strided view of a base tensor's elements. Each axis is a run of atoms,
    outermost first (none for a size-1 axis), so that a reshape can merge axes that lie apart in
    memory and a later one split them again (attention's head split: (L, B*H, D) only
    exists as atoms, and (B, H, L, D) after the Transpose is one stride an axis again). Only the
    final view must give each axis one stride (`strided`)."""

    axes: list[list[Atom]]
    offset: int = 0

    @staticmethod
    def of(shape: tuple[int, ...], strides: tuple[int, ...] | None = None, offset: int = 0) -> StridedView:
        """A tensor of `shape` at `strides` (default: row-major) from element `offset`."""
        strides = _strides(shape) if strides is None else strides
        return StridedView([[(int(d), int(st))] if d != 1 else [] for d, st in zip(shape, strides)], int(offset))

    def reshape(self, shape: tuple[int, ...]) -> StridedView | None:
        """The same elements in row-major order cut into `shape`; None where an atom would have to
        be cut unevenly."""
        atoms: list[Atom] = []
        for size, st in (a for axis in self.axes for a in axis):   # evenly spaced runs first
            if atoms and atoms[-1][1] == size * st:
                atoms[-1] = (atoms[-1][0] * size, st)
            else:
                atoms.append((size, st))
        out = []
        for d in shape:
            axis, need = [], d
            while need > 1:
                if not atoms:
                    return None
                size, st = atoms[0]
                if size <= need:
                    if need % size:
                        return None
                    axis.append(atoms.pop(0))
                    need //= size
                else:
                    if size % need:
                        return None
                    axis.append((need, st * (size // need)))
                    atoms[0] = (size // need, st)
                    need = 1
            out.append(axis)
        return StridedView(out, self.offset) if not atoms else None

    def transpose(self, perm: list[int]) -> StridedView:
        return StridedView([self.axes[p] for p in perm], self.offset)

    def _one_stride(self, axis: int) -> Atom | None:
        atoms = self.axes[axis]
        if not atoms:
            return (1, 0)
        if any(atoms[i][1] != atoms[i + 1][0] * atoms[i + 1][1] for i in range(len(atoms) - 1)):
            return None
        return int(np.prod([a[0] for a in atoms])), atoms[-1][1]

    def sliced(self, axis: int, start: int, step: int, size: int) -> StridedView | None:
        one = self._one_stride(axis)
        if one is None:
            return None
        axes = list(self.axes)
        axes[axis] = [(size, one[1] * step)] if size != 1 else []
        return StridedView(axes, self.offset + start * one[1])

    def taken(self, axis: int, index: int, keep: bool) -> StridedView | None:
        """Element `index` of `axis` (a Gather of one constant index), the axis dropped or kept as 1."""
        one = self._one_stride(axis)
        if one is None:
            return None
        axes = list(self.axes)
        if keep:
            axes[axis] = []
        else:
            del axes[axis]
        return StridedView(axes, self.offset + index * one[1])

    def strided(self) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        """(shape, strides, offset), or None where an axis has no single stride."""
        ones = [self._one_stride(k) for k in range(len(self.axes))]
        if any(o is None for o in ones):
            return None
        return tuple(o[0] for o in ones), tuple(o[1] for o in ones), self.offset


def _view_step(graph: Graph, n: Node, view: StridedView) -> StridedView | None:
    """`view` (of n's input) carried through layout node n; None where no strides can."""
    out_shape = shape_of(graph, n.outputs[0])
    if n.op in ALIAS_LIKE:
        return view.reshape(out_shape)
    if n.op == "Transpose":
        return view.transpose(perm_of(graph, n))
    rank = len(shape_of(graph, n.inputs[0]))
    if n.op == "Slice":
        if not all(k in n.attrs for k in ("starts", "ends", "steps")) or len(n.attrs["starts"]) != rank:
            return None
        for axis, (start, step) in enumerate(zip(n.attrs["starts"], n.attrs["steps"])):
            if int(step) <= 0:
                return None
            view = view.sliced(axis, int(start), int(step), out_shape[axis])
            if view is None:
                return None
        return view
    if n.op == "Gather":   # one constant index: a slice of one element
        index = literal_value(graph, n.inputs[1], set(graph.state_names)) if len(n.inputs) == 2 else None
        if index is None or not np.issubdtype(index.dtype, np.integer):
            return None
        axis = int(n.attr("axis", 0)) % rank
        size = shape_of(graph, n.inputs[0])[axis]
        i = int(index.reshape(()))
        if not -size <= i < size:
            return None
        return view.taken(axis, i % size, keep=len(out_shape) == rank)
    return None


def operand_view(graph: Graph, v: str, producers: dict, readable: Callable[[Node], bool]
                 ) -> tuple[str, tuple, list[Node]] | None:
    """(base, (shape, strides, offset), nodes in between) when v is made from base by layout
    nodes alone (reshapes, transposes, positive-step slices, gathers of one constant index):
    v as a strided view of base's elements, from the farthest base whose nodes in between all
    pass `readable`; None where there is none but v itself."""
    chain = []
    while producers.get(v) is not None and producers[v].op in VIEW_OPS:
        chain.append(producers[v])
        v = producers[v].inputs[0]
    for far in range(len(chain), 0, -1):   # chain[far - 1] reads the base
        between = chain[:far]
        if not all(readable(n) for n in between):
            continue
        base = between[-1].inputs[0]
        view: StridedView | None = StridedView.of(shape_of(graph, base))
        for n in reversed(between):
            view = _view_step(graph, n, view)
            if view is None:
                break
        got = view.strided() if view is not None else None
        if got is not None:
            return base, got, between
    return None


def layout_chain(graph: Graph, v: str, users: dict, protected: set[str]) -> list[Node]:
    """The reshapes and transposes v reaches its one reader through, each read only by the next
    (none protected); the last one's output is what that reader reads."""
    chain: list[Node] = []
    while (v not in protected and len(users.get(v, [])) == 1
           and users[v][0][0].op in ALIAS_LIKE | {"Transpose"} and users[v][0][1] == 0):
        chain.append(users[v][0][0])
        v = chain[-1].outputs[0]
    return chain


def result_view(graph: Graph, chain: list[Node]) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """The chain's input as a strided view of its output (the chain's inverses from the output
    back): where to store a result so that the chain's output holds it, no kernel moving it."""
    view: StridedView | None = StridedView.of(shape_of(graph, chain[-1].outputs[0]))
    for c in reversed(chain):
        if c.op == "Transpose":
            view = view.transpose([int(i) for i in np.argsort(perm_of(graph, c))])
        else:
            view = view.reshape(shape_of(graph, c.inputs[0]))
        if view is None:
            return None
    return view.strided()


def stored_view(graph: Graph, v: str, users: dict, protected: set[str]) -> tuple[tuple, list[Node]] | None:
    """(v as a strided view of the value at the end of its layout chain, the chain) where that
    chain holds a Transpose, so that v's producer can store there and the chain go; None where
    there is nothing to gain or no strides can."""
    chain = layout_chain(graph, v, users, protected)
    if not any(c.op == "Transpose" for c in chain):
        return None
    got = result_view(graph, chain)
    return (got, chain) if got is not None else None


def drop_unread(graph: Graph, protected: set[str], ops: frozenset[str] | str) -> None:
    """Remove the nodes of `ops` (and reshapes) nothing reads any more, a fold having rewired
    their readers."""
    ops = frozenset({ops}) if isinstance(ops, str) else ops
    dead = True
    while dead:
        users = graph.consumers()
        dead = {id(n) for n in graph.nodes if (n.op in ops or n.op in ALIAS_LIKE)
                and n.outputs[0] not in protected and not users.get(n.outputs[0])}
        graph.nodes = [n for n in graph.nodes if id(n) not in dead]


def reshaped_strides(shape: tuple[int, ...], strides: tuple[int, ...],
                     new_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides under which `new_shape` walks the elements of a strided tensor (shape, strides) in
    the same row-major order, as a reshape would; None where no strides can (a reshape of a
    non-contiguous view that would need a copy)."""
    view = StridedView.of(shape, strides).reshape(new_shape)
    got = view.strided() if view is not None else None
    return got[1] if got is not None else None
