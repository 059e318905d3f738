"""What the pattern passes (ir/gelu.py, attention.py, rmsnorm.py, rotary.py) ask of a graph as they match: who
makes and who reads each value, which values must stay (outputs, state updates), and constants."""
from __future__ import annotations

import numpy as np

from .graph import Graph


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
