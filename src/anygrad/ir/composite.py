"""Composite ops: registered with an expansion into other ops (ConvTranspose, LRN, the RNNs,
attention, ...), whose reference kernel is that expansion run over the concrete inputs. Apart
from the registry so that it may build graphs: the registry is below the Builder, which infers
each node's shape through it."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .builder import Builder
from .graph import Graph, Node, info_of
from .registry import ExpandFn, ForwardFn, InferFn, OpDef, defop, get_op


def defcomposite(name: str, *, infer: InferFn, expand: ExpandFn, nondiff: Sequence[int] = (), **kw) -> OpDef:
    """Register an op that `expand` writes in other ops; its reference kernel runs that expansion
    (expand_composites replaces it by the expansion before a backend sees it)."""
    return defop(name, infer=infer, forward=forward_by_expansion(expand), expand=expand, nondiff=nondiff, **kw)


def forward_by_expansion(expand: ExpandFn) -> ForwardFn:
    """A reference kernel for a composite op: build its expansion over the concrete inputs and run it."""

    def forward(node: Node, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        g = Graph()
        names = []
        for i, x in enumerate(inputs):
            if x is None:
                names.append("")
                continue
            names.append(f"in{i}")
            g.initializers[f"in{i}"] = np.asarray(x)
            g.info[f"in{i}"] = info_of(np.asarray(x))
        outs = expand(Builder(g, prefix="x"), Node(node.op, names, list(node.outputs), node.attrs, node.name))
        values = dict(g.initializers)
        for n in g.nodes:  # folding stops at large tensors: run what it left
            results = get_op(n.op).run(n, [values[i] if i else None for i in n.inputs])
            values.update((o, r) for o, r in zip(n.outputs, results) if o)
        return [values[o] if o in values else g.info[o].const if o else np.zeros(0, np.float32)
                for o in outs]

    return forward
