"""rotate_half fusion: rotary embeddings' written-out half rotation becomes one RotateHalf node.

Llama, Mistral, Qwen, GPT-NeoX and Phi rotate queries and keys by `x * cos + rotate_half(x) * sin`,
with rotate_half(x) = cat(-x2, x1) of x's two halves along the head dimension. Exported, that is
Slice, Slice, Neg and Concat, and their gradients add Slices, Pads and Concats again: 16 kernels
per layer on wgpu. As one RotateHalf (ops/shape.py) it is one gather forward and one backward.

A Concat is left as it is when its parts are not exactly the two halves of one value, in the other
order, negated as above (or the mirror image, cat(x2, -x1): sign -1), or when a part has another
reader. Runs on specialised graphs (constants known), before autodiff. ANYGRAD_FUSE_ROTARY=0 turns
it off.
"""
from __future__ import annotations

from .. import settings
from .graph import Graph, Node
from .lookup import Lookup, replace_chains


def enabled() -> bool:
    return settings.get("ANYGRAD_FUSE_ROTARY")


def _half(m: Lookup, name: str) -> tuple[str, int, int] | None:
    """(x, axis, which half: 0 or 1) when `name` is a step-1 Slice of one half of x along one axis,
    read only by the pattern."""
    node = m.producer.get(name)
    if node is None or node.op != "Slice" or name in m.pinned or len(m.users.get(name, [])) != 1:
        return None
    x = node.inputs[0]
    consts = [m.const(v) if v else None for v in (list(node.inputs[1:5]) + [""] * 4)[:4]]
    starts, ends, axes, steps = consts
    if starts is None or ends is None or starts.size != 1 or ends.size != 1 or x not in m.g.info:
        return None
    shape = m.g.info[x].shape
    axis = int(axes.reshape(-1)[0]) if axes is not None and axes.size == 1 else 0 if axes is None else None
    if axis is None or (steps is not None and (steps.size != 1 or int(steps.reshape(-1)[0]) != 1)):
        return None
    axis %= len(shape)
    d = shape[axis]
    if not isinstance(d, int) or d % 2:
        return None
    lo, hi, _ = slice(int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])).indices(d)
    half = {(0, d // 2): 0, (d // 2, d): 1}.get((lo, hi))
    return None if half is None else (x, axis, half)


def _negated(m: Lookup, name: str) -> str | None:
    node = m.producer.get(name)
    if node is None or node.op != "Neg" or name in m.pinned or len(m.users.get(name, [])) != 1:
        return None
    return node.inputs[0]


def _match(m: Lookup, cat: Node) -> Node | None:
    """The RotateHalf standing for Concat `cat`, else None."""
    if len(cat.inputs) != 2:
        return None
    for neg_slot, sign in ((0, 1), (1, -1)):  # cat(-x2, x1): sign 1; cat(x2, -x1): sign -1
        inner = _negated(m, cat.inputs[neg_slot])
        parts = [inner if k == neg_slot else cat.inputs[k] for k in (0, 1)]
        halves = [_half(m, p) if p else None for p in parts]
        if None in halves:
            continue
        (x0, a0, h0), (x1, a1, h1) = halves
        rank = len(m.g.info[x0].shape)
        if x0 != x1 or a0 != a1 or (h0, h1) != (1, 0) or int(cat.attr("axis")) % rank != a0:
            continue
        return Node("RotateHalf", [x0], [cat.outputs[0]], {"axis": a0, "sign": sign}, name=cat.name or "rotate_half")
    return None


def fuse_rotate_half(graph: Graph) -> int:
    """Rewrite every written-out rotate_half in place; returns how many were fused."""
    if not enabled() or not any(n.op == "Concat" for n in graph.nodes):
        return 0
    m = Lookup(graph)
    replaced: dict[int, Node] = {}
    for node in graph.nodes:
        if node.op == "Concat":
            found = _match(m, node)
            if found is not None:
                replaced[id(node)] = found
    return replace_chains(graph, replaced, set())  # the Slices and the Neg go as unread
