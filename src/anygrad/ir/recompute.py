"""Activation recomputation (gradient checkpointing) as a graph rewrite, for any backend.

A training step's peak memory is mostly forward values the backward reads: each stays live from
the forward node that makes it to the backward node that last reads it. For values made by a
cheap node (an activation, a per-element product, a cast) from inputs that stay live until the
backward anyway, keeping them is waste: this pass gives the backward its own copy of the node,
placed just before the backward's first read, so the forward value dies after its forward uses.
SiLU (x * sigmoid(x)) or the tanh GELU keep only x; every intermediate is computed again. In a
conv net, BatchNorm -> ReLU is recomputed from the BatchNorm input, which its gradient keeps.

Copies of chained cheap nodes read each other's copies (a segment is recomputed as a whole),
placed before the first backward read of any value of the segment. A node qualifies only when
each input is a source (graph input, state, constant), a value also recomputed, or a value some
backward node at or after the copy reads anyway, so no value lives longer than before. The
recomputed values are the same bits: the same op on the same inputs.
"""
from __future__ import annotations

from .graph import Graph, Node

# Deterministic ops (no RNG), per element or a normalisation: cheap to compute again.
CHEAP = frozenset({
    "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus",
    "Softsign", "Gelu", "Mish", "Erf", "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Pow",
    "Add", "Sub", "Mul", "Div", "Max", "Min", "Cast", "Clip", "Where", "PRelu",
    "BatchNormalization", "LayerNormalization", "RMSNormalization",
})
# Of these, the ops whose other outputs (running statistics, saved mean) the copy computes unused.
MULTI_OUTPUT = frozenset({"BatchNormalization", "LayerNormalization"})
BACKWARD_PREFIX = "grad."  # autodiff.gradients names every node it adds so


def backward_start(graph: Graph) -> int | None:
    """Position of the first backward node, or None for a graph without a backward."""
    for k, n in enumerate(graph.nodes):
        if n.name.startswith(BACKWARD_PREFIX):
            return k
    return None


# Per-element ops only, casts included: a copy costs one elementwise pass (a kernel of its own
# where it does not fuse with the backward's, measured -2.5% on the GPT benchmark), not a
# normalisation's. Under mixed precision this also recasts the float32 copy of a float16
# activation read by a float32 op, and the float16 copy of each weight, instead of keeping both
# copies live across the backward; a cast gives the same bits again.
ELEMENTWISE = CHEAP - MULTI_OUTPUT


def recompute(graph: Graph, ops: frozenset[str] = CHEAP) -> tuple[Graph, list[str]]:
    """A copy of graph whose backward recomputes cheap forward values (nodes of `ops`); and those
    values."""
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

    producer = {o: k for k, n in enumerate(nodes[:start]) for o in n.outputs if o}

    def cheap(k: int, v: str) -> bool:
        """Node k may be copied for its output v: a cheap op, and v its first output (BatchNorm's
        running statistics, its other outputs, are state updates the original still makes)."""
        n = nodes[k]
        return n.op in ops and n.outputs[0] == v and v not in keep and (
            len([o for o in n.outputs if o]) == 1 or n.op in MULTI_OUTPUT)

    def late(v: str) -> list[int]:
        return [p for p in uses.get(v, []) if p >= start]

    rejected: set[str] = set()
    cand: dict[str, int] = {}  # value -> producer position: forward values the backward reads ...
    for v, k in producer.items():
        if late(v) and cheap(k, v):
            cand[v] = k
    while True:
        # where each copy goes: before the first backward read of the value or of a copy reading it
        at: dict[str, int] = {}
        for v in sorted(cand, key=lambda v: -cand[v]):
            readers = [at[w] for w in cand if w in at and v in nodes[cand[w]].inputs]
            at[v] = min(late(v) + readers)

        def live(u: str, v: str, at: dict[str, int] = at) -> bool:
            """u is there at v's copy: a source, a copy itself, or read by the backward from then on."""
            return not u or u in sources or u in cand or any(p >= at[v] for p in uses.get(u, []))

        # ... and the cheap values they are computed from, when those are not kept anyway (segments)
        grow = {u for v, k in cand.items() for u in nodes[k].inputs
                if not live(u, v) and u in producer and u not in rejected and cheap(producer[u], u)}
        if grow:
            cand.update({u: producer[u] for u in grow})
            continue
        bad = {v for v, k in cand.items() if not all(live(u, v) for u in nodes[k].inputs)}
        if not bad:
            break
        for v in bad:
            del cand[v]
        rejected |= bad
        # a segment member no longer read by any copy, nor by the backward, goes too
        while True:
            idle = {v for v in cand if not late(v) and not any(v in nodes[cand[w]].inputs for w in cand)}
            if not idle:
                break
            for v in idle:
                del cand[v]
            rejected |= idle
    if not cand:
        return graph, []

    copy_of = {v: g.fresh(f"{v}.recomputed") for v in cand}
    inserts: dict[int, list[Node]] = {}
    for v in sorted(cand, key=lambda v: cand[v]):  # forward order: a copy's inputs' copies first
        n = nodes[cand[v]]
        ins = [copy_of.get(u, u) for u in n.inputs]
        outs = [copy_of[v]] + [g.fresh(f"{o}.unused") if o else "" for o in n.outputs[1:]]
        for o, new_o in zip(n.outputs, outs):
            if o:
                g.info[new_o] = g.info[o]
        inserts.setdefault(at[v], []).append(Node(n.op, ins, outs, dict(n.attrs),
                                                   name=g.fresh(f"{BACKWARD_PREFIX}recompute.{n.name or n.op}")))
    out: list[Node] = []
    for k, n in enumerate(nodes):
        out += inserts.get(k, [])
        if k >= start:
            n.inputs = [copy_of.get(v, v) for v in n.inputs]
        out.append(n)
    g.nodes = out
    return g, sorted(cand, key=lambda v: cand[v])


__all__ = ["CHEAP", "ELEMENTWISE", "backward_start", "recompute"]
