"""Activation recomputation (gradient checkpointing) as a graph rewrite, for any backend.

A training step's peak memory is mostly forward values the backward reads: each stays live from
the forward node that makes it to the backward node that last reads it. For values made by a
cheap node (an activation, a per-element product, a cast) from inputs that stay live until the
backward anyway, keeping them is waste: this pass gives the backward its own copy of the node,
placed just before the backward's first read, so the forward value dies after its forward uses.
SiLU (x * sigmoid(x)) or the tanh GELU keep only x; every intermediate is computed again.

Copies of chained cheap nodes read each other's copies (a segment is recomputed as a whole),
placed before the first backward read of any value of the segment. A node qualifies only when
each input is a source (graph input, state, constant), a value also recomputed, or a value some
backward node at or after the copy reads anyway, so no value lives longer than before. The
recomputed values are the same bits: the same op on the same inputs.
"""
from __future__ import annotations

from .graph import Graph, Node

# Deterministic, single-output, per-element ops (no RNG, no state update): cheap to compute again.
CHEAP = frozenset({
    "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus",
    "Softsign", "Gelu", "Mish", "Erf", "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Pow",
    "Add", "Sub", "Mul", "Div", "Max", "Min", "Cast", "Clip", "Where", "PRelu",
})
BACKWARD_PREFIX = "grad."  # autodiff.gradients names every node it adds so


def backward_start(graph: Graph) -> int | None:
    """Position of the first backward node, or None for a graph without a backward."""
    for k, n in enumerate(graph.nodes):
        if n.name.startswith(BACKWARD_PREFIX):
            return k
    return None


def recompute(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of graph whose backward recomputes cheap forward values; and those values."""
    start = backward_start(graph)
    if start is None:
        return graph, []
    g = graph.copy()
    nodes = g.nodes
    uses: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for v in n.inputs:
            if v:
                uses.setdefault(v, []).append(k)
    keep = set(g.outputs) | set(g.state_updates) | set(g.state_updates.values())
    sources = set(g.inputs) | set(g.initializers) | set(g.state_names)

    cand: dict[str, int] = {}  # value -> producer position, for forward values the backward reads
    for k, n in enumerate(nodes[:start]):
        if n.op in CHEAP and len([o for o in n.outputs if o]) == 1 and n.outputs[0] not in keep:
            v = n.outputs[0]
            if any(p >= start for p in uses.get(v, [])):
                cand[v] = k
    while True:
        # where each copy goes: before the first backward read of the value or of a copy reading it
        at = {v: min(p for p in uses[v] if p >= start) for v in cand}
        for v in sorted(cand, key=lambda v: -cand[v]):
            for u in nodes[cand[v]].inputs:
                if u in cand:
                    at[u] = min(at[u], at[v])
        bad = {v for v, k in cand.items()
               if not all(not u or u in sources or u in cand or any(p >= at[v] for p in uses.get(u, []))
                          for u in nodes[k].inputs)}
        if not bad:
            break
        for v in bad:
            del cand[v]
    if not cand:
        return graph, []

    copy_of = {v: g.fresh(f"{v}.recomputed") for v in cand}
    inserts: dict[int, list[Node]] = {}
    for v in sorted(cand, key=lambda v: cand[v]):  # forward order: a copy's inputs' copies first
        n = nodes[cand[v]]
        ins = [copy_of.get(u, u) for u in n.inputs]
        inserts.setdefault(at[v], []).append(Node(n.op, ins, [copy_of[v]], dict(n.attrs),
                                                   name=g.fresh(f"{BACKWARD_PREFIX}recompute.{n.name or n.op}")))
        g.info[copy_of[v]] = g.info[v]
    out: list[Node] = []
    for k, n in enumerate(nodes):
        out += inserts.get(k, [])
        if k >= start:
            n.inputs = [copy_of.get(v, v) for v in n.inputs]
        out.append(n)
    g.nodes = out
    return g, sorted(cand, key=lambda v: cand[v])


__all__ = ["CHEAP", "backward_start", "recompute"]
