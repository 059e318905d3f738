"""Compile-time questions about one node: the Site its lowering sees (static infos of its
inputs and outputs, which class-index targets the host checks) and whether it gets a torch kernel
at all (`lower`); and the host-side check of those fed targets, run per step before the upload.

Separate from the executable: this is what decides lowered vs fallback node by node; the
executable only arranges the kernels it gets back into a plan.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...ir.graph import Graph, Node
from ...ops.loss import bad_target
from .convert import TORCH_DTYPES, WIDENED
from .lowering import LOWERINGS, Site

# Ops that take class-index targets (slot): a target fed as a graph input is range-checked on the
# host before it is uploaded, so the kernel need not read a verdict back from the device (a sync
# per step on a GPU); a bad index would otherwise be a device-side assert there.
TARGET_SLOTS = {"CrossEntropy": 1, "NegativeLogLikelihoodLoss": 1, "SoftmaxCrossEntropyLoss": 1,
                "CrossEntropyMetrics": 1}


# Ops that pass every element of their first input through unchanged (only the shape moves), so
# a range check on a fed tensor holds for what they make of it: a flattened (N*T,) target
# checked as the (N, T) batch the user fed.
SAME_VALUES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


def fed_source(graph: Graph, value: str, producers: dict[str, Node] | None = None) -> str | None:
    """The graph input `value` holds the elements of, through SAME_VALUES ops, or None."""
    producers = producers if producers is not None else graph.producers()
    while value not in graph.inputs:
        node = producers.get(value)
        if node is None or node.op not in SAME_VALUES:
            return None
        value = node.inputs[0]
    return value


def node_site(graph: Graph, node: Node, memo: dict | None = None,
              producers: dict[str, Node] | None = None) -> Site:
    slot = TARGET_SLOTS.get(node.op)
    fed = slot is not None and fed_source(graph, node.input(slot), producers) is not None
    return Site(node, [graph.info.get(i) if i else None for i in node.inputs],
                [graph.info.get(o) if o else None for o in node.outputs],
                frozenset({slot}) if fed else frozenset(), memo)


def lower(site: Site) -> Callable | None:
    """The torch kernel for a node, or None: no lowering, a dtype torch cannot hold, an empty tensor,
    or the lowering declines this node's configuration."""
    fn = LOWERINGS.get(site.node.op)
    if fn is None:
        return None
    for k, info in enumerate(site.ins + site.outs):
        if info is None:
            continue
        dtype = np.dtype(info.dtype)
        # unsigned inputs up to 32 bits reach a kernel as int64 (exact); no output may be one
        held = dtype in TORCH_DTYPES or (k < len(site.ins) and dtype in WIDENED)
        if not held or not all(isinstance(d, int) for d in info.shape):
            return None
        # an empty tensor, but for an empty constant operand (a shape [] or no axes), which the
        # lowerings read at compile time (Site.const)
        if 0 in tuple(info.shape) and not (0 < k < len(site.ins) and info.const is not None):
            return None
    return fn(site)


def _check_targets(target: np.ndarray, classes: int, ignore: int | None, op: str) -> None:
    """ops.loss's check of class-index targets, on the host copy the caller fed."""
    bad = ((target < 0) | (target >= classes)) & (target != ignore if ignore is not None else True)
    if bad.any():
        raise bad_target(op, int(target[bad].flat[0]), classes)
