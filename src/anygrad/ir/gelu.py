"""GELU fusion: the exporters' written-out tanh GELU becomes one Gelu(approximate="tanh") node.

ONNX before opset 20 has no Gelu, so `nn.GELU(approximate="tanh")`, HF's `gelu_new` and every
GPT-2-style MLP reach the graph as

    0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))

in eight elementwise nodes (x^3 as Pow(x, 3) or x * x * x, the product of 0.5, x and the bracket
in any order). Autodiff then writes about a dozen more for the gradient. As one node the forward
is one kernel and the backward one GeluGrad: on the torch backend that is 2 launches instead of
~20 per MLP, on wgpu a GEMM epilogue, and on every backend only x is kept for the backward.

A chain is left as it is (correct, just slower) when a constant differs, or an intermediate value
has another reader or is a graph output. Runs on specialised graphs (constants known), before
autodiff. ANYGRAD_FUSE_GELU=0 turns it off.
"""
from __future__ import annotations

import math

from .. import settings
from .graph import Graph, Node
from .lookup import Lookup, Match, fuse_chains

_K = math.sqrt(2.0 / math.pi)


def enabled() -> bool:
    return settings.get("ANYGRAD_FUSE_GELU")


class _Match:
    """The nodes of one candidate chain; it fails (ValueError) at the first thing that differs."""

    def __init__(self, look: Lookup):
        self.g, self.producer, self.users = look.g, look.producer, look.users
        self.pinned = look.pinned
        self.scalar = look.scalar
        self.nodes: list[Node] = []

    def take(self, name: str, *ops: str) -> Node:
        """The producer of `name` (one of `ops`), which the chain is the only reader of."""
        node = self.producer.get(name)
        if node is None or node.op not in ops or name in self.pinned or len(self.users.get(name, [])) != 1:
            raise ValueError(name)
        self.nodes.append(node)
        return node

    def split(self, node: Node, value: float) -> str:
        """The operand of a binary node whose other operand is the scalar `value`."""
        a, b = node.inputs
        for c, other in ((b, a), (a, b)):
            s = self.scalar(c)
            if s is not None and math.isclose(s, value, rel_tol=1e-5):
                return other
        raise ValueError(node.name)

    def cube_of(self, name: str) -> str:
        """x for Pow(x, 3), x * (x * x) or (x * x) * x."""
        node = self.take(name, "Pow", "Mul")
        if node.op == "Pow":
            x, e = node.inputs
            if self.scalar(e) != 3.0:
                raise ValueError(name)
            return x
        a, b = node.inputs
        for sq, x in ((a, b), (b, a)):
            sq_node = self.producer.get(sq)
            if sq_node is not None and sq_node.op == "Mul" and list(sq_node.inputs) == [x, x]:
                self.take(sq, "Mul")
                return x
        raise ValueError(name)


def _match(look: Lookup, tanh: Node) -> tuple[str, str, list[Node]] | None:
    """(x, the chain's output, its nodes) for the GELU around this Tanh, else None."""
    m, graph, users = _Match(look), look.g, look.users
    try:
        inner = m.split(m.take(tanh.inputs[0], "Mul"), _K)
        add = m.take(inner, "Add")
        x = None
        for cubed_scaled, cand in ((add.inputs[1], add.inputs[0]), (add.inputs[0], add.inputs[1])):
            try:
                trial = _Match(look)
                if trial.cube_of(trial.split(trial.take(cubed_scaled, "Mul"), 0.044715)) == cand:
                    m.nodes += trial.nodes
                    x = cand
                    break
            except ValueError:
                continue
        if x is None:
            return None
        m.nodes.append(tanh)
        # (1 + tanh) times 0.5 and x, in any order and grouping
        readers = users.get(tanh.outputs[0], [])
        if tanh.outputs[0] in m.pinned or len(readers) != 1 or readers[0][0].op != "Add":
            return None
        bracket = readers[0][0]
        if m.split(bracket, 1.0) != tanh.outputs[0]:
            return None
        m.nodes.append(bracket)
        cur, need = bracket.outputs[0], {"x": 1, "half": 1}
        for _ in range(3):
            readers = users.get(cur, [])
            if cur in m.pinned or len(readers) != 1 or readers[0][0].op != "Mul":
                return None
            mul, slot = readers[0]
            m.nodes.append(mul)
            for leaf in _factors(m, mul.inputs[1 - slot]):
                key = "x" if leaf == x else "half" if m.scalar(leaf) == 0.5 else None
                if key is None or need[key] == 0:
                    return None
                need[key] -= 1
            cur = mul.outputs[0]
            if not any(need.values()):
                if tuple(graph.info[cur].shape) != tuple(graph.info[x].shape):
                    return None
                return x, cur, m.nodes
        return None
    except ValueError:
        return None


def _factors(m: _Match, name: str) -> list[str]:
    """The leaves of a product: `name` itself, or, for a Mul only this chain reads, its operands'."""
    node = m.producer.get(name)
    if node is not None and node.op == "Mul" and name not in m.pinned and len(m.users.get(name, [])) == 1 \
            and m.scalar(name) is None:
        m.nodes.append(node)
        return _factors(m, node.inputs[0]) + _factors(m, node.inputs[1])
    return [name]


def fuse_gelu(graph: Graph) -> int:
    """Rewrite every written-out tanh GELU in place; returns how many were fused."""
    if not enabled() or not any(n.op == "Tanh" for n in graph.nodes):
        return 0
    look = Lookup(graph)

    def match(tanh: Node) -> Match | None:
        found = _match(look, tanh)
        if found is None:
            return None
        x, out, nodes = found
        return nodes, out, lambda: Node("Gelu", [x], [out], {"approximate": "tanh"}, name=graph.fresh("gelu"))
    return fuse_chains(look, "Tanh", match)
