"""Reverse-mode autodiff over the Graph: gradients are more Graph nodes, built by each op's rule."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import AnygradError
from .ir.builder import Builder, GradContext
from .ir.graph import Graph
from .ir.registry import get_op
from .ops.shape import merge_slice_grads


def requires_grad(graph: Graph, wrt: Sequence[str]) -> set[str]:
    """Every value that depends on one of `wrt` through a differentiable input slot."""
    live = set(wrt)
    for node in graph.nodes:
        op = get_op(node.op)
        if any(v in live and i not in op.nondiff for i, v in enumerate(node.inputs)):
            live.update(o for o in node.outputs if o)
    return live


def gradients(graph: Graph, loss: str, wrt: Sequence[str], seed: str | None = None) -> dict[str, str]:
    """Append the backward pass of `loss` to `graph`; return {name in wrt: its gradient value}.

    `seed` is the gradient of the loss (ones when omitted). Values in `wrt` the loss does not
    depend on get a zero gradient, as PyTorch would leave `.grad` at zero after zero_grad.
    """
    b = Builder(graph, prefix="grad")
    needed = requires_grad(graph, wrt)
    if seed is None:
        seed = b.const(np.ones(b.shape(loss), b.dtype(loss)), b.dtype(loss), "seed")
    contributions: dict[str, list[str]] = {loss: [seed]}
    forward_nodes = list(graph.nodes)

    def total(name: str) -> str | None:
        terms = contributions.get(name)
        if not terms:
            return None
        if len(terms) > 1:  # slices that tile the value: one Concat instead of zero-fill and add
            contributions[name] = [b.add_all(merge_slice_grads(graph, b, terms))]
        return contributions[name][0]

    for node in reversed(forward_nodes):
        dys = [total(o) if o else None for o in node.outputs]
        if all(d is None for d in dys):
            continue
        op = get_op(node.op)
        needs = [bool(v) and v in needed and i not in op.nondiff for i, v in enumerate(node.inputs)]
        if not any(needs):
            continue
        if op.grad is None:
            raise AnygradError(f"{node.label}: op {node.op} has no gradient rule, so the model "
                               "cannot be trained through it")
        dxs = op.grad(GradContext(graph, node, dys, needs))
        for v, dx, need in zip(node.inputs, dxs, needs):
            if need and dx is not None:
                contributions.setdefault(v, []).append(dx)

    out = {}
    for w in wrt:
        g = total(w)
        out[w] = g if g is not None else b.const(np.zeros(b.shape(w), b.dtype(w)), b.dtype(w), "zero_grad")
    return out
