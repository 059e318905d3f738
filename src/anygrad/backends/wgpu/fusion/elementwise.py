"""Elementwise fusion (fuse_elementwise): groups of elementwise nodes of one output shape become one
wgpu.Fused node evaluated per element in registers, emitted at its last member's place; then
independent groups of one shape merge (horizontal fusion, _merge_siblings).
"""
from __future__ import annotations

import numpy as np

from ....ir.graph import Graph, Node
from ..kernels.kernel import AdapterCaps
from ..kernels.kernels_elementwise import EW, FUSED, bound_count, is_elementwise, make_fused
from ..kernels.kernels_optim import FUSED_UPDATE
from ..kernels.wgsl import shape_of, size_of
from .views import ALIAS_LIKE, VIEW_OPS, drop_unread, operand_view, stored_view, too_big_to_bind

MAX_GROUP = 48          # members per kernel: keeps shaders small and compile times short
MERGE_FREES_BELOW = 1 << 20  # bytes: a group that frees more runs in its own place (_merge_siblings)


def fuse_elementwise(graph: Graph, caps: AdapterCaps, protected: set[str]) -> None:
    """Replace groups of elementwise nodes by wgpu.Fused nodes (in place on graph.nodes).

    protected: values that must be stored even when only group members read them (graph
    outputs, state updates)."""
    state = set(graph.state_names)
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    users = graph.consumers()
    # A gradient computed into its arena slice is read by its FusedUpdate through attrs, not
    # inputs: counted as a use here, so that no group holding its writer (joined or merged with a
    # later one) is emitted after the update, which would then read the slice before it is written.
    for n in graph.nodes:
        if n.op == FUSED_UPDATE:
            for v in n.attrs["grads"]:
                users.setdefault(v, []).append((n, -1))
    producers = graph.producers()
    group_of: dict[int, list[Node]] = {}   # id(node) -> its group's member list
    groups: list[list[Node]] = []
    limit = max(2, caps.max_storage_buffers_per_stage)

    def stored(members: list[Node]) -> list[str]:
        ids = {id(m) for m in members}
        out = []
        for m in members:
            for o in m.outputs:
                if o and (o in protected or any(id(u) not in ids for u, _ in users.get(o, []))):
                    out.append(o)
        return out or [members[-1].outputs[0]]

    def can_join(members: list[Node], node: Node) -> bool:
        if len(members) >= MAX_GROUP:
            return False
        if shape_of(graph, members[-1].outputs[0]) != shape_of(graph, node.outputs[0]):
            return False
        ids = {id(m) for m in members} | {id(node)}
        here = order[id(node)]
        for m in members:
            for o in m.outputs:
                for u, _ in users.get(o, []):
                    if id(u) not in ids and order[id(u)] < here:
                        return False
        trial = members + [node]
        return bound_count(graph, trial, stored(trial), state) <= limit

    for n in graph.nodes:
        if not is_elementwise(n, graph):
            continue
        joined = False
        for v in n.inputs:
            p = producers.get(v)
            if p is None or id(p) not in group_of:
                continue
            members = group_of[id(p)]
            if can_join(members, n):
                members.append(n)
                group_of[id(n)] = members
                joined = True
                break
        if not joined:
            members = [n]
            groups.append(members)
            group_of[id(n)] = members

    groups = _merge_siblings(graph, groups, users, order, stored, limit, state)
    group_of = {id(m): g for g in groups for m in g}
    new_nodes: list[Node] = []
    last = {id(g[-1]): g for g in groups}
    for n in graph.nodes:
        if id(n) not in group_of:
            new_nodes.append(n)
        elif id(n) in last:
            g = last[id(n)]
            new_nodes.append(make_fused(graph, g, stored(g), state))
    graph.nodes = new_nodes


def _merge_siblings(graph: Graph, groups: list[list[Node]], users, order, stored, limit: int,
                    state: set[str]) -> list[list[Node]]:
    """Horizontal fusion: independent groups of one shape become one kernel (emitted at the later
    one's place) when nothing between them reads what the earlier one stores, and the earlier one
    frees little: moved later, it would hold what it reads last (a float16 weight gradient it
    widens into its arena) alive across the kernels in between, at the backward pass's peak."""
    groups = sorted(groups, key=lambda g: order[id(g[-1])])
    fixed = set(graph.initializers) | set(graph.inputs)

    freed: dict[tuple[int, int], int] = {}   # (group, its size): a group changes only by growing

    def frees(a: list[Node]) -> int:
        """Bytes of the computed values nothing after group `a` reads."""
        key = (id(a), len(a))
        if key not in freed:
            ids, end = {id(m) for m in a}, order[id(a[-1])]
            last = {v for m in a for v in m.inputs if v and v not in fixed and v in graph.info
                    and all(id(u) in ids or order[id(u)] <= end for u, _ in users.get(v, []))}
            freed[key] = sum(size_of(graph, v) * np.dtype(graph.info[v].dtype).itemsize for v in last)
        return freed[key]
    merged: list[list[Node]] = []
    for g in groups:
        target = None
        for a in reversed(merged):
            if (shape_of(graph, a[-1].outputs[0]) != shape_of(graph, g[-1].outputs[0])
                    or len(a) + len(g) > MAX_GROUP or frees(a) >= MERGE_FREES_BELOW):
                continue
            ids = {id(m) for m in a + g}
            here = order[id(g[-1])]
            if any(id(u) not in ids and order[id(u)] <= here
                   for m in a for o in m.outputs if o for u, _ in users.get(o, [])):
                continue
            trial = sorted(a + g, key=lambda m: order[id(m)])
            if bound_count(graph, trial, stored(trial), state) <= limit:
                target = a
                break
        if target is None:
            merged.append(list(g))
        else:
            target.extend(g)
            target.sort(key=lambda m: order[id(m)])
    return merged


def fold_elementwise_views(graph: Graph, protected: set[str], caps: AdapterCaps) -> None:
    """Fused elementwise kernels read inputs and store results through strided views (attrs
    `_views` / `_stores`: position -> (the members' name, (shape, strides, offset))) where a
    Transpose (with reshapes, slices, one-index gathers) stands between them and the value read
    or the one reader: no copy kernel. It is the batch-first transposes of nn.MultiheadAttention
    as dynamo exports it (torchvision's ViT): LayerNorm's output transposed into a cast, the
    out-projection's transposed into the residual Add, and the backward's gradients transposed
    out of elementwise kernels. Only inputs of the kernel's full shape, and only values that fit
    one binding (bindsplit does not split views)."""
    producers = graph.producers()
    users = graph.consumers()

    def readable(x: Node) -> bool:  # read only by layout nodes and fused kernels: it can go
        return x.outputs[0] not in protected and all(
            u.op in VIEW_OPS or u.op == FUSED for u, _ in users.get(x.outputs[0], []))
    folded = False
    for n in graph.nodes:
        if n.op != FUSED:
            continue
        members = n.attrs["members"]
        out_shape = shape_of(graph, members[-1].outputs[0])
        raw = {m.inputs[k] for m in members for k in EW[m.op].raw if k < len(m.inputs)}
        views = dict(n.attr("_views") or {})
        for k, v in enumerate(n.inputs):
            if k in views or v in raw or v in n.outputs or shape_of(graph, v) != out_shape:
                continue
            found = operand_view(graph, v, producers, readable)
            if (found is None or not any(x.op not in ALIAS_LIKE for x in found[2])
                    or found[0] in n.outputs or too_big_to_bind(graph, found[0], caps)):
                continue
            views[k] = (v, found[1])
            n.inputs[k] = found[0]
        if views:
            n.attrs["_views"] = views
            folded = True
    if folded:
        drop_unread(graph, protected, VIEW_OPS)
    # Stores second, on the graph as the reads left it: a chain a store folds away is no
    # longer there to be read through (a read folded first would see its base renamed).
    users = graph.consumers()
    drop: set[int] = set()
    for n in graph.nodes:
        if n.op != FUSED:
            continue
        out_shape = shape_of(graph, n.attrs["members"][-1].outputs[0])
        stores = dict(n.attr("_stores") or {})
        for k, o in enumerate(n.outputs):
            if k in stores or o in n.inputs:
                continue
            found = stored_view(graph, o, users, protected) if not too_big_to_bind(graph, o, caps) else None
            if found is None or tuple(found[0][0]) != tuple(out_shape):
                continue
            got, chain = found
            stores[k] = (o, got)
            n.outputs[k] = chain[-1].outputs[0]
            drop |= {id(c) for c in chain}
        if stores:
            n.attrs["_stores"] = stores
    graph.nodes = [n for n in graph.nodes if id(n) not in drop]
