"""The numpy backend: the reference every other backend is tested against, and a real CPU device.

A compiled graph is a flat list of (kernel, node, input names, output names) plus the step at
which each temporary dies, so running it is one loop with no per-op decisions.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..errors import ShapeError
from ..ir.graph import Graph
from ..ir.registry import get_op
from .base import Backend, Executable


class NumpyExecutable(Executable):
    def __init__(self, backend: "NumpyBackend", graph: Graph):
        self.backend = backend
        self.graph = graph
        state = set(graph.state_names)
        self.consts = {k: v for k, v in graph.initializers.items() if k not in state}
        self.plan = [(get_op(n.op), n, n.inputs, n.outputs) for n in graph.nodes]
        keep = set(graph.outputs) | set(graph.state_updates)
        last_use: dict[str, int] = {}
        for step, n in enumerate(graph.nodes):
            for i in n.inputs:
                last_use[i] = step
        # free[step] = temporaries no later node reads (never state, constants or outputs)
        self.free: list[list[str]] = [[] for _ in graph.nodes]
        produced = {o for n in graph.nodes for o in n.outputs}
        for name, step in last_use.items():
            if name in produced and name not in keep:
                self.free[step].append(name)
        self.input_info = {name: graph.info[name] for name in graph.inputs}

    def _check_feed(self, name: str, value: np.ndarray) -> np.ndarray:
        inf = self.input_info[name]
        value = np.asarray(value)
        if tuple(value.shape) != tuple(inf.shape):
            raise ShapeError(f"input '{name}' has shape {tuple(value.shape)}; this executable was "
                             f"compiled for {tuple(inf.shape)}")
        return value.astype(inf.dtype, copy=False)

    def run(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray | None] = {"": None}
        env.update(self.consts)
        env.update(self.backend.state)
        for name in self.graph.inputs:
            env[name] = self._check_feed(name, feeds[name])
        for step, (op, node, ins, outs) in enumerate(self.plan):
            values = op.run(node, [env[i] for i in ins])
            for o, v in zip(outs, values):
                if o:
                    env[o] = v
            for dead in self.free[step]:
                del env[dead]
        for produced, target in self.graph.state_updates.items():
            self.backend.state[target] = env[produced]
        return {f: np.asarray(env[f]) for f in (fetch if fetch is not None else self.graph.outputs)}


class NumpyBackend(Backend):
    name = "cpu"

    def __init__(self) -> None:
        self.state: dict[str, np.ndarray] = {}

    @property
    def description(self) -> str:
        return "cpu (numpy)"

    def compile(self, graph: Graph) -> NumpyExecutable:
        for name in graph.state_names:
            if name not in self.state and name in graph.initializers:
                self.state[name] = np.array(graph.initializers[name])
        return NumpyExecutable(self, graph)

    def get_state(self, name: str) -> np.ndarray:
        return np.array(self.state[name])

    def set_state(self, name: str, value: np.ndarray) -> None:
        self.state[name] = np.array(value)

    def has_state(self, name: str) -> bool:
        return name in self.state
