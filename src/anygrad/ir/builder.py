"""Appending nodes to a Graph with their shapes inferred on the spot.

Autodiff, losses and optimizers build Graph through a Builder, so every value they create has a
static shape immediately (gradient rules can ask `b.shape(x)`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .graph import Graph, Node, Shape, TensorInfo, info_of
from .infer import infer_node


class Builder:
    def __init__(self, graph: Graph, prefix: str = "b"):
        self.graph = graph
        self.prefix = prefix

    # -- queries ----------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        return self.graph.info[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.graph.info[name].shape)  # type: ignore[arg-type]

    def dtype(self, name: str) -> np.dtype:
        return self.graph.info[name].dtype

    # -- construction ---------------------------------------------------------------------
    def const(self, value: Any, dtype: Any = np.float32, hint: str = "const") -> str:
        """A constant tensor as an initializer (not a parameter)."""
        array = np.asarray(value, dtype=dtype)
        name = self.graph.fresh(f"{self.prefix}.{hint}")
        self.graph.initializers[name] = array
        self.graph.info[name] = info_of(array)
        return name

    def ops(self, op: str, inputs: Sequence[str], n_out: int, **attrs: Any) -> list[str]:
        outs = [self.graph.fresh(f"{self.prefix}.{op}") for _ in range(n_out)]
        node = Node(op, list(inputs), outs, attrs, name=self.graph.fresh(f"{self.prefix}.{op}"))
        self.graph.nodes.append(node)
        infer_node(self.graph, node)
        return outs

    def op(self, op: str, inputs: Sequence[str], **attrs: Any) -> str:
        return self.ops(op, inputs, 1, **attrs)[0]

    # -- helpers gradient rules share -----------------------------------------------------
    def add_all(self, terms: Sequence[str]) -> str:
        out = terms[0]
        for t in terms[1:]:
            out = self.op("Add", [out, t])
        return out

    def reshape(self, x: str, shape: Shape) -> str:
        if self.shape(x) == tuple(shape):
            return x
        return self.op("Reshape", [x, self.const(np.array(shape, np.int64), np.int64, "shape")])

    def unbroadcast(self, grad: str, shape: Shape) -> str:
        """Sum a broadcast gradient back down to `shape` (numpy broadcasting rules)."""
        gshape = self.shape(grad)
        shape = tuple(shape)
        if gshape == shape:
            return grad
        lead = len(gshape) - len(shape)
        axes = list(range(lead)) + [lead + i for i, d in enumerate(shape) if d == 1 and gshape[lead + i] != 1]
        if axes:
            grad = self.op("ReduceSum", [grad, self.const(np.array(axes, np.int64), np.int64, "axes")], keepdims=1)
        return self.reshape(grad, shape)


class GradContext(Builder):
    """What a gradient rule sees: the node, the gradients of its outputs, which inputs need one."""

    def __init__(self, graph: Graph, node: Node, dys: list[str | None], needs: list[bool]):
        super().__init__(graph, prefix=f"grad.{node.name or node.op}")
        self.node = node
        self.dys = dys
        self.needs = needs

    @property
    def x(self) -> list[str]:
        return self.node.inputs

    @property
    def y(self) -> list[str]:
        return self.node.outputs

    @property
    def dy(self) -> str:
        """Gradient of the first output; zeros when only other outputs carry a gradient."""
        if self.dys[0] is None:
            name = self.node.outputs[0]
            return self.const(np.zeros(self.shape(name), self.dtype(name)), self.dtype(name), "zeros")
        return self.dys[0]

    def need(self, i: int) -> bool:
        return i < len(self.needs) and self.needs[i]
