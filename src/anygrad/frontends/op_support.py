"""How far anygrad supports each op of an imported graph: training, inference only, or not at all.

An op is supported for training when its registry entry can pass a gradient back (a grad rule,
or a composite `expand` into ops that have one), or when no gradient ever has to cross it: every
input a parameter's gradient could reach sits in a `nondiff` slot (indices, shapes, comparisons)
or, in this graph, carries nothing that depends on a parameter. An op with a forward kernel but
no grad rule on a parameter's gradient path runs for inference only. An op without a registry
entry is not supported at all.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph
from ..ir.registry import get_op

TRAINING, INFERENCE, UNSUPPORTED = "training", "inference only", "not supported"
LEVELS = (TRAINING, INFERENCE, UNSUPPORTED)


@dataclass(frozen=True)
class OpSupport:
    op: str
    level: str                     # one of LEVELS
    nodes: tuple[str, ...]         # every node of this op in the graph
    blocking: tuple[str, ...] = ()  # inference only: the nodes a parameter's gradient would have to cross


def op_support(g: Graph) -> dict[str, OpSupport]:
    """Op type -> its support level in `g` (whose params are classified; nodes in topological order)."""
    live = set(g.params)  # values a parameter's gradient flows back through
    nodes: dict[str, list[str]] = {}
    blocking: dict[str, list[str]] = {}
    for n in g.nodes:
        name = n.name or n.outputs[0]
        nodes.setdefault(n.op, []).append(name)
        op = get_op(n.op)
        reached = any(v and v in live for i, v in enumerate(n.inputs) if op is None or i not in op.nondiff)
        if not reached:
            continue
        if op is not None and op.grad is None and op.expand is None:
            blocking.setdefault(n.op, []).append(name)
        live.update(v for v in n.outputs if v)  # downstream nodes are on the gradient path too
    out = {}
    for op_type, names in nodes.items():
        level = UNSUPPORTED if get_op(op_type) is None else INFERENCE if op_type in blocking else TRAINING
        out[op_type] = OpSupport(op_type, level, tuple(names), tuple(blocking.get(op_type, ())))
    return out


def by_level(support: dict[str, OpSupport], level: str) -> dict[str, OpSupport]:
    return {op: s for op, s in sorted(support.items()) if s.level == level}
