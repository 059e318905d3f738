"""What the pattern passes (ir/gelu.py, attention.py, rmsnorm.py, rotary.py) ask of a graph as they match: who
makes and who reads each value, which values must stay (outputs, state updates), and constants;
and how a matched chain is put back as one node (replace_chains)."""
from __future__ import annotations

import numpy as np

from .graph import Graph, Node
from .passes import infer_node


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
