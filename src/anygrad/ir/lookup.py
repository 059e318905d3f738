"""What the pattern passes (ir/gelu.py, attention.py, rmsnorm.py, rotary.py) ask of a graph as they match: who
makes and who reads each value, which values must stay (outputs, state updates), and constants;
and how matched chains are put back as one node each (fuse_chains, replace_chains)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .graph import Graph, Node
from .infer import infer_node


class Lookup:
    def __init__(self, graph: Graph):
        self.g = graph
        self.producer = graph.producers()
        self.users = graph.consumers()
        self.pinned = set(graph.outputs) | set(graph.state_updates)

    def const(self, name: str) -> np.ndarray | None:
        info = self.g.info.get(name)
        return None if info is None or info.const is None else np.asarray(info.const)

    def scalar(self, name: str) -> float | None:
        """A one-element float constant's value."""
        c = self.const(name)
        return float(c.reshape(())) if c is not None and c.size == 1 and c.dtype.kind == "f" else None


def replace_chains(graph: Graph, replaced: dict[int, Node], gone: set[int]) -> int:
    """Put each fused node in the place of its chain's last node (`replaced`: id of that node ->
    the fused node), drop the chains' other nodes (`gone`: ids) and whatever is now unread;
    returns how many chains were replaced."""
    if not replaced:
        return 0
    graph.nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) in replaced or id(n) not in gone]
    for node in replaced.values():
        infer_node(graph, node)
    graph.dce()
    return len(replaced)


Match = tuple[Sequence[Node], str, Callable[[], Node]]  # a chain's nodes, its output, its fused node's maker


def fuse_chains(look: Lookup, anchor: str, match: Callable[[Node], Match | None]) -> int:
    """The pattern passes' loop: for each `anchor` node not yet in a chain, match(node) gives the
    chain's nodes, its output and what makes the node that replaces it (or None: no match); a
    chain that shares a node with one already taken is left as it is (and its node never made).
    Then replace_chains."""
    replaced: dict[int, Node] = {}  # id of the chain's last node -> the fused node
    gone: set[int] = set()
    for node in look.g.nodes:
        if node.op != anchor or id(node) in gone:
            continue
        found = match(node)
        if found is None or any(id(n) in gone for n in found[0]):
            continue
        nodes, out, make = found
        gone.update(id(n) for n in nodes)
        replaced[id(look.producer[out])] = make()
    return replace_chains(look.g, replaced, gone)
