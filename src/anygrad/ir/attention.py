"""Attention fusion: the exporters' scaled dot-product attention chains become one FusedAttention node.

Both ONNX exporters (TorchScript and dynamo), `F.scaled_dot_product_attention`,
`nn.MultiheadAttention`, HF attention blocks and ONNX's own Attention op (after its expansion)
all reach the graph as

    MatMul(q', k') -> [Mul/Div by a constant]* -> [Add mask | Where(mask, fill, .)]* -> Softmax(last axis)
        -> [Where(IsNaN(p), 0, p) | Dropout(ratio 0) | Identity]* -> MatMul(., v)

where q' is q scaled by a constant (or not) and k' is k transposed on its last two axes: a
Transpose (perm swapping them, possibly folding in the head split), dynamo's
Reshape -> Transpose(0, 2, 1) -> Reshape, or anything else (then a Transpose is added), with
constant scales on either side. Each such chain becomes FusedAttention(q, k, v, [bias]) with the
product of the scales, a constant causal mask recognised as `causal` (so kernels skip hidden key
blocks), and no (..., T, S) tensor left in the graph; autodiff then emits FusedAttentionGrad.

A chain is left as it is (correct, just slower) when an intermediate value (scores, probabilities)
has another reader or is a graph output, a mask is reached by a parameter (it would need a
gradient), a dropout on the probabilities is active, the dtype is not float32, or a head
dimension passes MAX_HEAD_DIM. Runs on specialised graphs (static shapes, constants folded),
before autodiff.

Off by default (ANYGRAD_FUSE_ATTENTION=1 turns it on): on an H200 the fused kernels ran 11-17x
slower than the unfused chain at the benchmark models' shapes (benchmarks/attention.py,
2026-11-26: 32x4x128x64 causal 2.17 vs 0.19 ms), because each invocation walks one query row
over every key alone, where the unfused chain runs as tiled GEMMs. The pass and the kernels are
correct and tested; making them fast (GEMM-tiled score blocks) is what is left.
"""
from __future__ import annotations

import numpy as np

from .. import settings
from .graph import Graph, Node, info_of
from .infer import infer_node
from .lookup import Lookup

MAX_HEAD_DIM = 128  # the wgpu kernels keep a query/key row per invocation: head dims up to this
_VERY_NEGATIVE = -1e30  # a mask fill at or below this hides a key (finfo.min, -1e38, -inf)


def enabled() -> bool:
    return settings.get("ANYGRAD_FUSE_ATTENTION")


class _Ctx(Lookup):
    def __init__(self, graph: Graph):
        super().__init__(graph)
        self.trainable = _reached_by(graph, set(graph.params))
        self.new_nodes: list[Node] = []

    def only_reader(self, name: str, node: Node) -> bool:
        """`node` is the one reader of `name`, which is no graph output: it may disappear."""
        readers = self.users.get(name, [])
        return name not in self.pinned and len(readers) >= 1 and all(n is node for n, _ in readers)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.g.info[name].shape)

    def add(self, op: str, inputs: list[str], hint: str, **attrs) -> str:
        out = self.g.fresh(hint)
        node = Node(op, inputs, [out], attrs, name=self.g.fresh(hint))
        infer_node(self.g, node)
        if self.g.info[out].const is not None:  # folded: a constant, no node
            self.g.initializers[out] = self.g.info[out].const
        else:
            self.new_nodes.append(node)
        return out

    def const_value(self, value: np.ndarray, hint: str) -> str:
        name = self.g.fresh(hint)
        self.g.initializers[name] = value
        self.g.info[name] = info_of(value)
        return name


def _reached_by(graph: Graph, sources: set[str]) -> set[str]:
    live = set(sources)
    for n in graph.nodes:
        if any(i in live for i in n.inputs if i):
            live.update(o for o in n.outputs if o)
    return live


def _scaled(ctx: _Ctx, name: str, scale: float, stop_at: Node | None = None) -> tuple[str, float]:
    """Strip Mul/Div by constants and Identities (each read only by the chain) from `name`."""
    while True:
        node = ctx.producer.get(name)
        if node is None or (stop_at is not None and not ctx.only_reader(name, stop_at)):
            return name, scale
        if node.op == "Identity" or (node.op == "Concat" and len(node.inputs) == 1):
            nxt = node.inputs[0]
        elif node.op in ("Mul", "Div") and len(node.inputs) == 2:
            a, b = node.inputs
            if ctx.scalar(b) is not None and ctx.shape(a) == ctx.shape(name):
                c, nxt = ctx.scalar(b), a
            elif node.op == "Mul" and ctx.scalar(a) is not None and ctx.shape(b) == ctx.shape(name):
                c, nxt = ctx.scalar(a), b
            else:
                return name, scale
            if c == 0.0 or not np.isfinite(c):
                return name, scale
            scale *= c if node.op == "Mul" else 1.0 / c
        else:
            return name, scale
        stop_at = node
        name = nxt


def _swap_last(rank: int) -> list[int]:
    return list(range(rank - 2)) + [rank - 1, rank - 2]


def _untransposed(ctx: _Ctx, kt: str) -> str:
    """k (..., S, D) from k^T (..., D, S): undo the exporter's transpose, or add one."""
    shape = ctx.shape(kt)
    node = ctx.producer.get(kt)
    if node is not None and node.op == "Transpose":
        src = node.inputs[0]
        rank = len(shape)
        perm = [int(p) for p in node.attr("perm", list(range(rank))[::-1])]
        perm = perm[:-2] + [perm[-1], perm[-2]]
        return src if perm == list(range(rank)) else ctx.add("Transpose", [src], "attn.k", perm=perm)
    if node is not None and node.op == "Reshape":  # dynamo: Reshape(Transpose(Reshape(k, (N, S, D)), (0, 2, 1)))
        mid = ctx.producer.get(node.inputs[0])
        if mid is not None and mid.op == "Transpose" and [int(p) for p in mid.attr("perm", [])] == [0, 2, 1]:
            inner = ctx.producer.get(mid.inputs[0])
            if inner is not None and inner.op == "Reshape":
                k = inner.inputs[0]
                ks = ctx.shape(k)
                if len(ks) == len(shape) and ks[:-2] == shape[:-2] and ks[-2:] == (shape[-1], shape[-2]):
                    return k
    return ctx.add("Transpose", [kt], "attn.k", perm=_swap_last(len(shape)))


def _where_bias(ctx: _Ctx, node: Node, x: str) -> str | None:
    """Where(cond, fill, x) or Where(cond, x, fill) with a hiding fill: as an additive bias."""
    cond, a, b = node.inputs
    if cond in ctx.trainable:
        return None
    fill = a if b == x else b
    f = ctx.scalar(fill)
    if f is None or f > _VERY_NEGATIVE or a == b:
        return None
    dtype = ctx.g.info[x].dtype
    zero = ctx.const_value(np.zeros((), dtype), "attn.zero")
    fill_c = ctx.const_value(np.asarray(f, dtype), "attn.fill")
    return ctx.add("Where", [cond, fill_c, zero] if b == x else [cond, zero, fill_c], "attn.bias")


def _causal(bias: np.ndarray, t: int, s: int) -> int | None:
    """The causal offset when a constant bias is exactly a causal mask (0 where j <= i + offset,
    hiding values elsewhere), else None."""
    if bias.ndim < 2:
        return None
    rows = bias.reshape((-1,) + bias.shape[-2:])
    if not np.all(rows == rows[:1]):  # (B, 1, T, S) masks repeat one (T, S) mask per sample
        return None
    b = np.broadcast_to(rows[0], (t, s))
    for offset in sorted({0, s - t}):
        if offset < 0:
            continue
        seen = np.arange(s)[None, :] <= np.arange(t)[:, None] + offset
        if np.all(b[seen] == 0) and np.all(b[~seen] <= _VERY_NEGATIVE):
            return offset
    return None


def _match(ctx: _Ctx, final: Node) -> Node | None:
    """The FusedAttention node for the chain ending at `final` (a MatMul), or None."""
    p, v = final.inputs
    # probabilities: through NaN guards, inert dropouts and identities back to the Softmax
    name, reader = p, final
    while True:
        node = ctx.producer.get(name)
        if node is None:
            return None
        guarded = (node.op == "Softmax" and reader.op == "Where" and reader.inputs[2] == name
                   and name not in ctx.pinned and _is_nan_guard(ctx, reader))
        if not guarded and not ctx.only_reader(name, reader):
            return None
        if node.op == "Softmax":
            break
        if node.op == "Identity" or (node.op == "Dropout" and _inert_dropout(ctx, node)):
            nxt = node.inputs[0]
        elif node.op == "Where" and _is_nan_guard(ctx, node):
            nxt = node.inputs[2]
        else:
            return None
        name, reader = nxt, node
    softmax = ctx.producer[name]
    scores_in = softmax.inputs[0]
    rank = len(ctx.shape(scores_in))
    if rank < 2 or int(softmax.attr("axis", -1)) not in (-1, rank - 1):
        return None
    if not ctx.only_reader(scores_in, softmax):
        return None
    # masks, from the Softmax back towards the scores MatMul
    biases: list[str] = []
    name, reader = scores_in, softmax
    while True:
        node = ctx.producer.get(name)
        if node is None or not ctx.only_reader(name, reader):
            return None
        if node.op == "Add" and len(node.inputs) == 2:
            operands = _scores_first(ctx, node, name)
            if operands is None:
                return None
            x, m = operands
            biases.append(m)
        elif node.op == "Where" and len(node.inputs) == 3:
            _, a, b = node.inputs
            if ctx.scalar(a) is not None and ctx.shape(b) == ctx.shape(name):
                x = b
            elif ctx.scalar(b) is not None and ctx.shape(a) == ctx.shape(name):
                x = a
            else:
                return None
            bias = _where_bias(ctx, node, x)
            if bias is None:
                return None
            biases.append(bias)
        elif node.op in ("Identity",):
            x = node.inputs[0]
        else:
            break
        name, reader = x, node
    # scale, then the scores MatMul
    scores, scale = _scaled(ctx, name, 1.0, stop_at=reader)
    mm = ctx.producer.get(scores)
    if mm is None or mm.op != "MatMul" or not ctx.only_reader(scores, _reader(ctx, scores)):
        return None
    q, scale = _scaled(ctx, mm.inputs[0], scale)
    kt, scale = _scaled(ctx, mm.inputs[1], scale)
    qs, kts, vs = ctx.shape(q), ctx.shape(kt), ctx.shape(v)
    if len(qs) < 2 or len(kts) != len(qs) or len(vs) != len(qs) or qs[:-2] != kts[:-2] or vs[:-2] != qs[:-2] \
            or qs[-1] != kts[-2] or kts[-1] != vs[-2]:
        return None  # broadcast batch dims, or ranks that differ: leave it
    if max(qs[-1], vs[-1]) > MAX_HEAD_DIM or any(ctx.g.info[x].dtype != np.float32 for x in (q, kt, v)):
        return None
    k, kt_scale = _scaled(ctx, _untransposed(ctx, kt), 1.0)
    scale *= kt_scale
    attrs: dict = {"scale": float(scale), "causal": 0, "causal_offset": 0}
    bias = ctx.add("Add", biases, "attn.bias") if len(biases) == 2 else biases[0] if biases else ""
    for extra in biases[2:]:
        bias = ctx.add("Add", [bias, extra], "attn.bias")
    if bias and ctx.g.info[bias].dtype != np.float32:
        return None
    t, s = qs[-2], kts[-1]
    if bias and ctx.const(bias) is not None and (offset := _causal(ctx.const(bias), t, s)) is not None:
        attrs.update(causal=1, causal_offset=offset)
        bias = ""
    lse = ctx.g.fresh(f"{final.name or 'attn'}.lse")
    return Node("FusedAttention", [q, k, v] + ([bias] if bias else []), [final.outputs[0], lse], attrs,
                name=ctx.g.fresh(f"{final.name or 'attn'}.fused"))


def _scores_first(ctx: _Ctx, node: Node, name: str) -> tuple[str, str] | None:
    """(scores, mask) of an Add: the mask is the operand no parameter reaches (a constant when
    both are free of parameters, else the first operand is taken as the scores; the sum is the
    same either way, and the mask gets no gradient)."""
    a, b = node.inputs
    full = ctx.shape(name)
    options = [(x, m) for x, m in ((a, b), (b, a)) if ctx.shape(x) == full and m not in ctx.trainable]
    options.sort(key=lambda xm: ctx.const(xm[0]) is not None)  # a constant is never the scores
    if not options or ctx.g.info[options[0][1]].dtype.kind != "f":
        return None
    return options[0]


def _reader(ctx: _Ctx, name: str) -> Node | None:
    readers = ctx.users.get(name, [])
    return readers[0][0] if len(readers) == 1 else None


def _is_nan_guard(ctx: _Ctx, node: Node) -> bool:
    """Where(IsNaN(p), 0, p): PyTorch's safe softmax (rows with no key give zeros)."""
    cond, zero, p = node.inputs
    test = ctx.producer.get(cond)
    return (test is not None and test.op == "IsNaN" and test.inputs[0] == p and ctx.scalar(zero) == 0.0
            and all(n in (node, test) for n, _ in ctx.users.get(p, [])) and ctx.only_reader(cond, node))


def _nan_guarded(ctx: _Ctx, name: str) -> bool:
    readers = [n for n, _ in ctx.users.get(name, [])]
    return name not in ctx.pinned and len(readers) == 2 and any(
        n.op == "Where" and _is_nan_guard(ctx, n) for n in readers)


def _inert_dropout(ctx: _Ctx, node: Node) -> bool:
    ratio = ctx.scalar(node.input(1)) if node.input(1) else None
    training = ctx.const(node.input(2)) if node.input(2) else None
    masks_used = len(node.outputs) > 1 and node.outputs[1] and ctx.users.get(node.outputs[1])
    return not masks_used and (ratio == 0.0 or (training is not None and not bool(training.reshape(-1)[0])))


def fuse_attention(graph: Graph) -> int:
    """Rewrite every recognised attention chain in place; returns how many were fused."""
    if not enabled() or not any(n.op == "Softmax" for n in graph.nodes):
        return 0
    ctx = _Ctx(graph)
    fused = 0
    out: list[Node] = []
    for node in graph.nodes:
        if node.op == "MatMul" and len(node.inputs) == 2:
            ctx.new_nodes = []
            try:
                new = _match(ctx, node)
            except (KeyError, ValueError):
                new = None
            if new is not None:
                out += ctx.new_nodes
                infer_node(graph, new)
                out.append(new)
                fused += 1
                continue
            out += ctx.new_nodes  # helper constants/nodes of a failed match are dead: DCE drops them
        out.append(node)
    if fused:
        graph.nodes = out
        graph.dce()
    return fused
