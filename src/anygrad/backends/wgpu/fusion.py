"""Graph rewrites before lowering: elementwise fusion and GEMM/Conv epilogues.

Fusion groups elementwise nodes of one output shape into a `wgpu.Fused` node evaluated per
element in registers. A group is emitted at the position of its last member, so a node may join
a group only when no node outside the group, placed before it, reads a value the group produces
(otherwise that reader would run before the group's kernel), which also rules out cycles.
"""
from __future__ import annotations

from ...ir.graph import Graph, Node
from .kernel import AdapterCaps
from .kernels_elementwise import bound_count, is_elementwise, make_fused
from .wgsl import shape_of

MAX_GROUP = 48          # members per kernel: keeps shaders small and compile times short
EPILOGUE_OPS = ("Gemm", "Conv")


def fuse_epilogues(graph: Graph, protected: set[str], supports_epilogue: set[str]) -> None:
    """(Gemm|Conv) -> Relu where the pre-activation has no other use: the GEMM applies the Relu."""
    users = graph.consumers()
    producers = graph.producers()
    drop = set()
    for n in graph.nodes:
        if n.op != "Relu" or len(n.inputs) != 1:
            continue
        p = producers.get(n.inputs[0])
        if (p is None or p.op not in supports_epilogue or p.attr("_epilogue") is not None
                or len(users.get(n.inputs[0], [])) != 1 or n.inputs[0] in protected):
            continue
        p.attrs["_epilogue"] = "relu"
        p.outputs[0] = n.outputs[0]
        drop.add(id(n))
    graph.nodes = [n for n in graph.nodes if id(n) not in drop]


def fuse_elementwise(graph: Graph, caps: AdapterCaps, protected: set[str]) -> None:
    """Replace groups of elementwise nodes by wgpu.Fused nodes (in place on graph.nodes).

    protected: values that must be stored even when only group members read them (graph
    outputs, state updates)."""
    state = set(graph.state_names)
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    users = graph.consumers()
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

    emitted = set()
    new_nodes: list[Node] = []
    last = {id(g[-1]): g for g in groups}
    for n in graph.nodes:
        if id(n) not in group_of:
            new_nodes.append(n)
        elif id(n) in last:
            g = last[id(n)]
            new_nodes.append(make_fused(graph, g, stored(g), state))
            emitted.add(id(g[0]))
    graph.nodes = new_nodes


def prepare(graph: Graph, caps: AdapterCaps, supports_epilogue: set[str], fuse: bool = True) -> Graph:
    """A copy of graph rewritten for lowering."""
    g = graph.copy()
    protected = set(g.outputs) | set(g.state_updates)
    if fuse:
        fuse_epilogues(g, protected, supports_epilogue)
        fuse_elementwise(g, caps, protected)
    return g
