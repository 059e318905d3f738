"""What the codegen rules ask of the graph (inferred shapes for two stand-in batch sizes, constants,
uses, PyTorch names), and dims that stay symbolic in the code (`x.shape[0] * 2`)."""
from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...ir.graph import Graph, Node, TensorInfo, info_of
from ...ir.infer import infer_node
from ...model import Model

_PER_BATCH_LIMIT = 1024  # elements of a batch-dependent value kept for folding what follows (shapes)


def _infer(g: Graph, alt: bool) -> dict[str, TensorInfo]:
    """Every value's shape with each symbolic input dim set to a stand-in size of its own, a
    second set when `alt` (values whose shape cannot be known here, like a shape fed as an input,
    stay unknown: their nodes are written generic)."""
    inferred = g.copy()
    symbols: dict[str, int] = {}
    for name in inferred.inputs:
        inf = inferred.info[name]
        for d in inf.shape:
            if not isinstance(d, int):
                symbols.setdefault(d, 11 + 2 * len(symbols) if alt else 2 + len(symbols))
        inferred.info[name] = TensorInfo(
            inf.dtype, tuple(d if isinstance(d, int) else symbols[d] for d in inf.shape)
        )
    state = set(g.state_names)
    for name, array in inferred.initializers.items():  # as infer_shapes: state is never a constant
        inferred.info[name] = TensorInfo(array.dtype, tuple(array.shape)) if name in state else info_of(array)
    for node in inferred.nodes:  # imported graphs are in order
        with contextlib.suppress(Exception):
            infer_node(inferred, node)
    return inferred.info


class _Graph:
    """The graph plus what the rules ask about it: shapes, state, uses, PyTorch names."""

    def __init__(self, model: Model):
        self.g = g = model.graph
        # Shapes for two stand-in sizes of the symbolic dims (as the nn tracer does): a dim that
        # differs between the two depends on the batch.
        self.info, self.info_alt = _infer(g, False), _infer(g, True)
        self.params, self.buffers = set(g.params), set(g.buffers)
        self.uses = g.consumers()
        self.producers = g.producers()
        self.folded: dict[str, np.ndarray] = {}  # outputs of nodes whose inputs are all constants
        # values computed from shapes that depend on the batch size: one per stand-in size
        self.per_batch: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.live = self._live()
        self.order = {name: i for i, name in enumerate(g.initializers)}
        origin = getattr(model, "origin", None)
        self.torch_names = {k: v.key for k, v in (origin.torch_names if origin else {}).items()}

    def _live(self) -> set[int]:
        """ids of the nodes an output depends on (dead ones are not written); a folded value is
        a constant, so what only it reads is dead too."""
        producers = self.g.producers()
        live: set[int] = set()
        todo = [o for o in self.g.outputs if o not in self.folded]
        while todo:
            n = producers.get(todo.pop())
            if n is not None and id(n) not in live:
                live.add(id(n))
                todo += [v for v in n.inputs if v and v not in self.folded]
        return live

    def dim(self, v: str, k: int) -> tuple[int, int] | None:
        """Dim k of v for both stand-in batch sizes (equal: a static dim)."""
        a, b = self.info.get(v), self.info_alt.get(v)
        if a is None or b is None or a.shape is None or b.shape is None or k >= len(a.shape):
            return None
        return int(a.shape[k]), int(b.shape[k])

    def small(self, v: str) -> bool:
        """Whether v's inferred shape is static and at most _PER_BATCH_LIMIT elements."""
        inf = self.info.get(v)
        return inf is not None and inf.shape is not None and inf.is_static and inf.size <= _PER_BATCH_LIMIT

    def rank(self, v: str) -> int | None:
        inf = self.info.get(v)
        return len(inf.shape) if inf is not None and inf.shape is not None else None

    def dtype(self, v: str) -> np.dtype | None:
        inf = self.info.get(v)
        return inf.dtype if inf is not None else None

    def param(self, v: str, ndim: int | None = None) -> np.ndarray | None:
        a = self.g.initializers.get(v) if v in self.params else None
        return a if a is not None and (ndim is None or a.ndim == ndim) else None

    def const(self, v: str) -> np.ndarray | None:
        """The value of a constant: an initializer that is not state, or a folded node output."""
        if not v or v in self.params or v in self.buffers:
            return None
        return self.folded.get(v, self.g.initializers.get(v))

    def buffer(self, v: str) -> np.ndarray | None:
        return self.g.initializers.get(v) if v in self.buffers else None

    def unused(self, v: str) -> bool:
        return not v or (v not in self.uses and v not in self.g.outputs)

    def only_use(self, v: str) -> Node | None:
        users = self.uses.get(v, [])
        return users[0][0] if len(users) == 1 and v not in self.g.outputs else None

    def module_of(self, weight: str, suffix: str = "weight") -> str:
        key = self.torch_names.get(weight, weight)
        return key[: -len(suffix) - 1] if key.endswith("." + suffix) else ""




# Integer arithmetic on a dim that stays symbolic in the generated code (dims are positive, so
# ONNX's truncating Div is Python's floor division).
_DIM_OPS: dict[str, tuple[Callable[[int, int], int], str]] = {
    "Mul": (operator.mul, "*"), "Add": (operator.add, "+"), "Sub": (operator.sub, "-"), "Div": (operator.floordiv, "//"),
}


@dataclass(frozen=True)
class _Dim:
    """tensor.shape[k], then arithmetic with constants: `x.shape[0] * 2` (the dynamo exporter
    computes nn.MultiheadAttention's batch * heads this way)."""

    tensor: str
    k: int
    ops: tuple[tuple[str, int], ...] = ()

    def values(self, G: _Graph) -> tuple[int, int] | None:
        """The dim for both stand-in batch sizes."""
        pair = G.dim(self.tensor, self.k)
        for op, c in self.ops if pair is not None else ():
            pair = (_DIM_OPS[op][0](pair[0], c), _DIM_OPS[op][0](pair[1], c))
        return pair

    def text(self, tensor: str) -> str:
        out = f"{tensor}.shape[{self.k}]"
        for i, (op, c) in enumerate(self.ops):
            out = f"{f'({out})' if i else out} {_DIM_OPS[op][1]} {c}"
        return out


def _dim_arithmetic(G: _Graph, n: Node, chain: list[Node]) -> list[Any] | None:
    """[dim op c] for a one-element shape and an int constant (c on either side of * and +)."""
    if len(n.inputs) != 2:
        return None
    sides = [G.const(v) for v in n.inputs]
    k = 0 if sides[1] is not None else 1  # the dim's side
    c = sides[1 - k]
    if c is None or c.size != 1 or c.dtype.kind not in "iu" or sides[k] is not None:
        return None
    if k == 1 and n.op not in ("Mul", "Add"):
        return None
    dims = _shape_dims(G, n.inputs[k], chain)
    c = int(c.reshape(-1)[0])
    if dims is None or len(dims) != 1 or not isinstance(dims[0], _Dim) or (n.op == "Div" and c <= 0):
        return None
    d = dims[0]
    return [_Dim(d.tensor, d.k, d.ops + ((n.op, c),))]


def _shape_dims(G: _Graph, v: str, chain: list[Node]) -> list[Any] | None:
    """A shape computed from tensor shapes (Shape/Gather/Unsqueeze/Concat, arithmetic), as
    Python dims: ints, or a _Dim for tensor.shape[k]. `chain` collects the nodes it reads."""
    c = G.const(v)
    if c is not None:
        return [int(d) for d in c.reshape(-1)] if c.dtype.kind in "iu" and c.ndim <= 1 else None
    n = G.producers.get(v)
    if n is None:
        return None
    if n.op == "Shape":
        rank = G.rank(n.input(0))
        if rank is None:
            return None
        start, end = (
            max(0, min(rank, k + rank if k < 0 else k)) for k in (n.attr("start", 0), n.attr("end", rank))
        )
        out = [_Dim(n.input(0), k) for k in range(start, end)]
    elif n.op == "Gather" and int(n.attr("axis", 0)) == 0:
        src, idx = _shape_dims(G, n.input(0), chain), G.const(n.input(1))
        if src is None or idx is None or not all(-len(src) <= int(i) < len(src) for i in idx.reshape(-1)):
            return None
        out = [src[int(i)] for i in idx.reshape(-1)]
    elif n.op in ("Unsqueeze", "Squeeze", "Cast", "Identity", "Reshape"):
        out = _shape_dims(G, n.input(0), chain)  # scalar or 1-D: the same list of dims here
        if out is None or (n.op != "Cast" and n.op != "Identity" and len(out) != 1):
            return None
    elif n.op == "Slice":  # Shape(x)[1:3] with constant bounds
        src, bounds = _shape_dims(G, n.input(0), chain), [G.const(v) for v in n.inputs[1:]]
        if src is None or len(bounds) < 2 or any(b is None or b.size != 1 for b in bounds):
            return None
        start, end, *rest = (int(b.reshape(-1)[0]) for b in bounds)
        if rest[:1] not in ([], [0], [-1]) or rest[1:] not in ([], [1]):  # axis 0, step 1
            return None
        out = src[slice(start, end)]
    elif n.op in _DIM_OPS:
        out = _dim_arithmetic(G, n, chain)
        if out is None:
            return None
    elif n.op == "Concat" and int(n.attr("axis", 0)) == 0:
        parts = [_shape_dims(G, i, chain) for i in n.inputs]
        if any(p is None for p in parts):
            return None
        out = [d for p in parts for d in p]
    else:
        return None
    chain.append(n)
    return out


def _dynamic_reshape(G: _Graph, n: Node) -> tuple[list[Any], list[Node]] | None:
    """Reshape(x, Concat(Shape(x)[0], -1)): `x.view(x.size(0), -1)` as exported. Only targets the
    tracer writes back as they were: x's own dims in place, and at most one dim it has to infer
    (a -1, or another tensor's dim that may depend on the batch), no literal 0."""
    chain: list[Node] = []
    if G.const(n.input(1)) is not None:
        return None
    dims = _shape_dims(G, n.input(1), chain)
    if dims is None:
        return None
    x, unknown = n.input(0), 0
    for i, d in enumerate(dims):
        if d == 0 and not n.attr("allowzero", 0):
            dims[i] = _Dim(x, i)  # ONNX's 0: this dim of the input
        elif d == 0:
            return None
        elif d == -1 or (isinstance(d, _Dim) and not _in_place(G, d, x, i)):
            unknown += 1
    return (dims, chain) if unknown <= 1 else None  # more than one unknown: ambiguous


def _private_chain_nodes(G: _Graph, reshapes: dict[int, tuple[list[Any], list[Node]]]) -> set[int]:
    """The shape-chain nodes that only recognised reshapes (and other such chain nodes) read:
    they need not be written. Exporters share one chain between several views (the dynamo
    exporter's batch size for every head split); a chain node something else reads is written."""
    skip = {id(m) for _, chain in reshapes.values() for m in chain}
    nodes = {id(m): m for _, chain in reshapes.values() for m in chain}
    while True:
        readers = set(reshapes) | skip
        needed = {
            k for k in skip
            if any(o in G.g.outputs or any(id(u) not in readers and id(u) in G.live for u, _ in G.uses.get(o, []))
                   for o in nodes[k].outputs if o)
        }
        if not needed:
            return skip
        skip -= needed


def _in_place(G: _Graph, d: _Dim, x: str, i: int) -> bool:
    """Whether the tracer writes `d` at position i of x's reshape as a number or as 0 (a static
    dim, or the same batch-dependent dim as x's own dim i), not as -1."""
    pair, own = d.values(G), G.dim(x, i)
    return pair is not None and (pair[0] == pair[1] or pair == own)
