"""The one IR: a Graph of Nodes over named Values, each with a dtype and a static shape.

Values are named by strings, as in ONNX, so importing and exporting is a renaming-free copy.
An empty string in `Node.inputs` marks an absent optional input. A shape dim is an int, or a
str for a symbolic dim (the batch) until `specialize` binds it.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import private_attrs

Dim = int | str
Shape = tuple[Dim, ...]


@dataclass
class TensorInfo:
    """What is known about a value at compile time: dtype, shape, and its value if constant.

    shape is None only for a graph input declared without any shape (not even its rank, unlike
    () for a scalar); `specialize` binds it to the shape it is fed."""

    dtype: np.dtype
    shape: Shape
    const: np.ndarray | None = None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)


def info_of(array: np.ndarray) -> TensorInfo:
    return TensorInfo(array.dtype, tuple(int(d) for d in array.shape), array)


@dataclass
class Node:
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def attr(self, key: str, default: Any = None) -> Any:
        if private_attrs.is_checking() and key[:1] == "_":  # (tests: a misspelt private key fails)
            private_attrs.check_key(key, self.label)
        return self.attrs.get(key, default)

    def input(self, i: int) -> str:
        """The i-th input name, or "" when absent (optional inputs may be omitted at the end)."""
        return self.inputs[i] if i < len(self.inputs) else ""

    @property
    def label(self) -> str:
        return f"{self.op} node '{self.name or self.outputs[0]}'"


@dataclass
class Graph:
    """A static dataflow graph.

    initializers hold every tensor the graph does not compute: weights, constants, BatchNorm
    running statistics, optimizer state. `params` names the trainable ones, `buffers` the other
    persistent ones (running statistics, optimizer state, counters); params + buffers are the
    state a backend keeps between runs, everything else is constant. `state_updates` maps a value
    computed by the graph to the initializer it replaces after each run (running stats, updated
    parameters, optimizer state), which is how a training step is a pure function of its state.
    """

    nodes: list[Node] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    info: dict[str, TensorInfo] = field(default_factory=dict)
    params: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    state_updates: dict[str, str] = field(default_factory=dict)
    name: str = "graph"
    _counter: Any = field(default_factory=itertools.count, repr=False)

    # -- naming ---------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        """A value or node name not used anywhere in the graph yet."""
        while True:
            name = f"{hint}__{next(self._counter)}"
            if name not in self.info and name not in self.initializers:
                return name

    # -- structure ------------------------------------------------------------------------
    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict[str, list[tuple[Node, int]]]:
        users: dict[str, list[tuple[Node, int]]] = {}
        for n in self.nodes:
            for i, v in enumerate(n.inputs):
                if v:
                    users.setdefault(v, []).append((n, i))
        return users

    def toposort(self) -> None:
        """Order nodes so every value is produced before it is used (stable for sorted input).

        Nodes come out in waves: those whose inputs are all available, in their original order, then
        those that the first wave made ready, and so on. Linear in the graph's size (Kahn's algorithm
        counting each node's missing inputs), so a large graph stored in reverse order costs no more
        than a sorted one."""
        produced = set(self.inputs) | set(self.initializers) | {""}
        missing_of: list[int] = []
        waiting: dict[str, list[int]] = {}  # value -> the nodes still waiting for it
        wave: list[int] = []
        for k, n in enumerate(self.nodes):
            needs = {i for i in n.inputs if i not in produced}
            missing_of.append(len(needs))
            for v in needs:
                waiting.setdefault(v, []).append(k)
            if not needs:
                wave.append(k)
        order: list[int] = []
        while wave:
            order.extend(wave)
            ready: list[int] = []
            for k in wave:
                for v in self.nodes[k].outputs:
                    if v in produced:
                        continue
                    produced.add(v)
                    for m in waiting.pop(v, ()):
                        missing_of[m] -= 1
                        if missing_of[m] == 0:
                            ready.append(m)
            wave = sorted(ready)
        if len(order) < len(self.nodes):
            placed = set(order)
            rest = [n for k, n in enumerate(self.nodes) if k not in placed]
            outputs_of_rest = {o for m in rest for o in m.outputs}
            missing = sorted({i for n in rest for i in n.inputs if i not in produced and i not in outputs_of_rest})
            from ..errors import ModelError
            if missing:
                raise ModelError(f"{rest[0].label} uses value(s) {missing} that nothing produces")
            raise ModelError(f"the graph has a cycle through {rest[0].label}")
        self.nodes = [self.nodes[k] for k in order]

    def hoist(self, values: Iterable[str]) -> None:
        """Move the nodes producing `values` as early as their inputs allow: each runs right after
        the last producer of what it reads (a node among them that reads another runs after it),
        the rest keep their order. For a node that is the last reader of a large value, e.g. a
        float16 gradient widened and unscaled into its float32 master gradient, this frees that
        value where it is made instead of at the end of the backward pass."""
        want = set(values)
        movable = {id(n) for n in self.nodes if any(o in want for o in n.outputs)}
        if not movable:
            return
        index = {id(n): k for k, n in enumerate(self.nodes)}
        produced = set(self.inputs) | set(self.initializers) | {""}
        missing: dict[int, int] = {}
        waiting: dict[str, list[Node]] = {}
        ready: list[Node] = []
        for n in self.nodes:
            if id(n) in movable:
                needs = {i for i in n.inputs if i not in produced}
                missing[id(n)] = len(needs)
                for v in needs:
                    waiting.setdefault(v, []).append(n)
                if not needs:
                    ready.append(n)
        order: list[Node] = []

        def emit(n: Node) -> None:
            order.append(n)
            woken = []
            for o in n.outputs:
                produced.add(o)
                for m in waiting.pop(o, ()):
                    missing[id(m)] -= 1
                    if missing[id(m)] == 0:
                        woken.append(m)
            for m in sorted(woken, key=lambda m: index[id(m)]):
                emit(m)
        for n in ready:
            emit(n)
        for n in self.nodes:
            if id(n) not in movable:
                emit(n)
        self.nodes = order

    def dce(self, keep: Iterable[str] = ()) -> None:
        """Drop nodes and initializers that no output or state update needs."""
        live = set(self.outputs) | set(self.state_updates) | set(keep)
        kept: list[Node] = []
        for n in reversed(self.nodes):
            if any(o in live for o in n.outputs):
                kept.append(n)
                live.update(i for i in n.inputs if i)
        self.nodes = kept[::-1]
        live |= set(self.state_updates.values())
        live |= {o for n in self.nodes for o in n.outputs}  # unused outputs of kept nodes (masks) keep their info
        keep_state = set(self.params) | set(self.buffers)
        self.initializers = {k: v for k, v in self.initializers.items() if k in live or k in keep_state}
        self.info = {k: v for k, v in self.info.items()
                     if k in live or k in self.inputs or k in self.initializers}

    def copy(self) -> Graph:
        """A structural copy: nodes and dicts are new, initializer arrays are shared."""
        return Graph(
            nodes=[Node(n.op, list(n.inputs), list(n.outputs), dict(n.attrs), n.name) for n in self.nodes],
            inputs=list(self.inputs), outputs=list(self.outputs),
            initializers=dict(self.initializers),
            info={k: TensorInfo(v.dtype, v.shape, v.const) for k, v in self.info.items()},
            params=list(self.params), buffers=list(self.buffers), state_updates=dict(self.state_updates), name=self.name,
        )

    @property
    def state_names(self) -> list[str]:
        return self.params + self.buffers

    def op_histogram(self) -> dict[str, int]:
        hist: dict[str, int] = {}
        for n in self.nodes:
            hist[n.op] = hist.get(n.op, 0) + 1
        return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))
