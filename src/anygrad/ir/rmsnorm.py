"""RMSNorm fusion: the exporters' written-out RMS normalisation becomes one RMSNormalization node.

Llama, Mistral, Qwen and T5 write their norm by hand (HF's `LlamaRMSNorm`), and `nn.RMSNorm` /
`F.rms_norm` reach ONNX written out too before opset 23, as

    weight * (x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), axes) + eps)))

(x * x for the square, Div(x, Sqrt(...)) for the last step, the weight's Mul on either side, or no
weight at all). Autodiff then writes about fifteen nodes for its gradient. As one node the forward
is one read of each row and the backward one RMSNormGrad (ops/norm.py), on every backend.

A chain is left as it is (correct, just slower) when the reduced axes are not a suffix of x's,
an intermediate value has another reader or is a graph output, or eps is not one constant. Runs
on specialised graphs (constants known), before autodiff. ANYGRAD_FUSE_RMSNORM=0 turns it off.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import settings
from .graph import Graph, Node, info_of
from .lookup import Lookup, Match, fuse_chains


def enabled() -> bool:
    return settings.get("ANYGRAD_FUSE_RMSNORM")


@dataclass
class _Chain:
    x: str
    out: str            # the chain's last value: the normalised x, or it times the weight
    axis: int
    eps: float
    weight: str | None
    nodes: list[Node]


class _Graph(Lookup):
    def only(self, name: str, *ops: str) -> Node | None:
        """The producer of `name` (one of `ops`) when the chain is its value's only reader."""
        node = self.producer.get(name)
        if node is None or node.op not in ops or name in self.pinned or len(self.users.get(name, [])) != 1:
            return None
        return node

    def reader(self, name: str, op: str) -> tuple[Node, int] | None:
        """The one reader of `name`, an `op` node, and the slot it reads it in."""
        readers = self.users.get(name, [])
        if name in self.pinned or len(readers) != 1 or readers[0][0].op != op:
            return None
        return readers[0]


def _squared(m: _Graph, name: str) -> tuple[str, Node] | None:
    """(x, node) for Pow(x, 2) or Mul(x, x)."""
    node = m.only(name, "Pow", "Mul")
    if node is None:
        return None
    a, b = node.inputs
    if node.op == "Pow":
        return (a, node) if m.scalar(b) == 2.0 else None
    return (a, node) if a == b else None


def _suffix_axis(m: _Graph, mean: Node, rank: int) -> int | None:
    """The first reduced axis of ReduceMean `mean` when it reduces a suffix of the dims, keeping them."""
    if int(mean.attr("keepdims", 1)) != 1:
        return None
    axes = mean.attr("axes")
    if axes is None and len(mean.inputs) > 1 and mean.inputs[1]:
        c = m.const(mean.inputs[1])
        axes = None if c is None else c.reshape(-1).tolist()
    if not axes:
        return None
    axes = sorted(int(a) % rank for a in axes)
    return axes[0] if axes == list(range(axes[0], rank)) else None


def _match(m: _Graph, mean: Node) -> _Chain | None:
    """The chain around ReduceMean `mean`, else None."""
    sq = _squared(m, mean.inputs[0])
    if sq is None:
        return None
    x, sq_node = sq
    rank = len(m.g.info[x].shape)
    axis = _suffix_axis(m, mean, rank)
    if axis is None or m.g.info[x].dtype.kind != "f":
        return None
    add, slot = m.reader(mean.outputs[0], "Add") or (None, 0)
    eps = m.scalar(add.inputs[1 - slot]) if add is not None else None
    root = m.reader(add.outputs[0], "Sqrt") if add is not None else None
    if eps is None or root is None:
        return None
    sqrt = root[0]
    nodes = [sq_node, mean, add, sqrt]
    recip = m.reader(sqrt.outputs[0], "Reciprocal")
    if recip is not None:   # x * (1 / sqrt(...)), in either order
        mul, slot = m.reader(recip[0].outputs[0], "Mul") or (None, 0)
        if mul is None or mul.inputs[1 - slot] != x:
            return None
        nodes += [recip[0], mul]
        out = mul.outputs[0]
    else:                   # x / sqrt(...)
        div, slot = m.reader(sqrt.outputs[0], "Div") or (None, 0)
        if div is None or slot != 1 or div.inputs[0] != x:
            return None
        nodes.append(div)
        out = div.outputs[0]
    if tuple(m.g.info[out].shape) != tuple(m.g.info[x].shape):
        return None
    weight = None
    scaled = m.reader(out, "Mul")
    if scaled is not None:  # the weight's Mul: a tensor over the normalised dims (or fewer), not x's batch
        w = scaled[0].inputs[1 - scaled[1]]
        norm = tuple(m.g.info[x].shape[axis:])
        wshape = tuple(m.g.info[w].shape) if w in m.g.info else None
        if (wshape is not None and len(wshape) <= len(norm) and wshape == norm[len(norm) - len(wshape):]
                and m.g.info[w].dtype == m.g.info[x].dtype):
            weight = w
            nodes.append(scaled[0])
            out = scaled[0].outputs[0]
    return _Chain(x, out, axis, eps, weight, nodes)


def fuse_rms_norm(graph: Graph) -> int:
    """Rewrite every written-out RMS normalisation in place; returns how many were fused."""
    if not enabled() or not any(n.op == "ReduceMean" for n in graph.nodes):
        return 0
    m = _Graph(graph)

    def match(mean: Node) -> Match | None:
        chain = _match(m, mean)
        return None if chain is None else (chain.nodes, chain.out, lambda: _fused(graph, chain))
    return fuse_chains(m, "ReduceMean", match)


def _fused(graph: Graph, chain: _Chain) -> Node:
    """The RMSNormalization that replaces `chain` (without a weight: a scale of ones, made here)."""
    scale = chain.weight
    if scale is None:
        norm = graph.info[chain.x].shape[chain.axis:]
        scale = graph.fresh("rmsnorm.ones")
        graph.initializers[scale] = np.ones(norm, graph.info[chain.x].dtype)
        graph.info[scale] = info_of(graph.initializers[scale])
    return Node("RMSNormalization", [chain.x, scale], [chain.out], {"axis": chain.axis, "epsilon": chain.eps},
                name=graph.fresh("rmsnorm"))
