"""Graph rewrites before lowering (on a copy): fewer, bigger kernels.

- Elementwise fusion groups elementwise nodes of one output shape into a `wgpu.Fused` node
  evaluated per element in registers. A group is emitted at the position of its last member, so
  a node may join a group only when no node outside the group, placed before it, reads a value
  the group produces (that reader would otherwise run before the group's kernel); this also rules
  out cycles. Independent groups of one shape then merge the same way (horizontal fusion).
- GEMM/Conv -> Relu: the Relu runs in the GEMM's epilogue (attr `_epilogue`).
- Optimizer updates of one kind become one `wgpu.FusedUpdate` over arenas (see group_updates).
- Dropout outside training becomes an Identity, which the planner aliases.
- Graph inputs of 1-byte elements (uint8 images) are uploaded four per u32 word and unpacked by an
  elementwise node, which fuses into whatever elementwise chain reads them (see pack_byte_inputs).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ...ir.graph import Graph, Node, TensorInfo
from .kernel import AdapterCaps
from .kernels_elementwise import UNPACK_BYTES, bound_count, is_elementwise, make_fused
from .kernels_optim import COPY, FUSED_UPDATE, UPDATE_OPS
from .wgsl import shape_of

MAX_GROUP = 48          # members per kernel: keeps shaders small and compile times short


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


# -- optimizer updates over arenas -------------------------------------------------------------------
ARENA_ALIGN = 64          # elements (256 bytes): every adapter's storage-offset alignment
ALIAS_LIKE = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


@dataclass(frozen=True)
class ArenaSpec:
    """State tensors that must lie back to back in one buffer, at these element offsets."""

    value: str                       # the graph value standing for the whole arena
    members: tuple[str, ...]         # state names
    offsets: tuple[int, ...]         # element offsets
    total: int                       # elements


def _aligned(n: int) -> int:
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


def group_updates(graph: Graph, caps: AdapterCaps) -> None:
    """Merge the optimizer update nodes of one kind (same op, hyperparameters, lr and step) into
    one `wgpu.FusedUpdate` over arenas: parameters, each slot, and the gradients lie back to back,
    so the whole optimizer step is one dispatch updating every parameter in its own buffer."""
    users = graph.consumers()
    producers = graph.producers()
    state = set(graph.state_names)
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        if n.op not in UPDATE_OPS:
            continue
        targets = [graph.state_updates.get(o) for o in n.outputs]
        state_in = [n.inputs[0]] + n.inputs[2:2 + len(n.outputs) - 1]
        if (targets != state_in or any(t not in state for t in state_in) or any(users.get(o) for o in n.outputs)
                or any(graph.info[v].dtype != np.float32 for v in state_in)):
            continue
        key = (n.op, repr(sorted(n.attrs.items())), n.inputs[-2], n.inputs[-1])
        groups.setdefault(key, []).append(n)
    for members in groups.values():
        # Even one parameter gains: each arena is bound once (read_write), within 8 bindings.
        last = max(order[id(m)] for m in members)
        touched = {v for m in members for v in [m.inputs[0]] + m.inputs[2:2 + len(m.outputs) - 1]}
        grown = True
        while grown:  # values aliasing the state (Reshape of a weight) read its buffer too
            more = {n.outputs[0] for n in graph.nodes if n.op in ALIAS_LIKE and n.inputs[0] in touched}
            grown = not more <= touched
            touched |= more
        # Everything reading those tensors must run before the fused update (placed at the last member).
        # ... and nothing may need their old values after it (outputs, other state updates).
        if (any(order[id(u)] > last for v in touched for u, _ in users.get(v, []))
                or touched & (set(graph.outputs) | set(graph.state_updates))):
            continue
        # Bindings: gradients, lr, step, and each arena once (read_write).
        if 3 + len(members[0].outputs) > caps.max_storage_buffers_per_stage:
            continue
        # Each arena must fit one storage binding: split into chunks that do.
        budget = caps.max_storage_binding_size // 4
        chunk: list[Node] = []
        size = 0
        for m in members + [None]:
            n = _aligned(int(np.prod(shape_of(graph, m.inputs[0]), dtype=np.int64))) if m is not None else 0
            if m is None or (chunk and size + n > budget):
                if chunk:
                    _fuse_group(graph, chunk, producers, state)
                chunk, size = [], 0
            if m is not None:
                chunk.append(m)
                size += n


def _fuse_group(graph: Graph, members: list[Node], producers: dict[str, Node], state: set[str]) -> None:
    first = members[0]
    n_slots = len(first.outputs) - 1
    params = [m.inputs[0] for m in members]
    gid = hashlib.sha1(("|".join([first.op] + params)).encode()).hexdigest()[:10]
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += _aligned(int(np.prod(shape_of(graph, p), dtype=np.int64)))
    arenas = []
    for j in range(n_slots + 1):
        names = tuple(m.inputs[0] if j == 0 else m.inputs[1 + j] for m in members)
        arenas.append(ArenaSpec(f"@arena:{gid}:{j}", names, tuple(offsets), total))
    garena = f"@garena:{gid}"
    for v in [a.value for a in arenas] + [garena]:
        graph.info[v] = TensorInfo(np.dtype(np.float32), (total,))
    # Each gradient is computed straight into its slice of the gradient arena when its storage is
    # a fresh temporary of its own; otherwise it is copied there.
    claims, copies, claimed_roots = [], [], set()
    for m in members:
        g = m.inputs[1]
        root = g
        while root in producers and producers[root].op in ALIAS_LIKE:
            root = producers[root].inputs[0]
        fresh = (root in producers and root not in state and root not in graph.inputs
                 and root not in graph.initializers and root not in claimed_roots and root not in graph.outputs)
        if not fresh:
            root = graph.fresh(f"{g}.arena")
            graph.info[root] = TensorInfo(np.dtype(np.float32), graph.info[g].shape)
            copies.append(Node(COPY, [g], [root], name=graph.fresh("copy")))
        claimed_roots.add(root)
        claims.append(root)
    lr, step = first.inputs[-2], first.inputs[-1]
    ins = [arenas[0].value, garena] + [a.value for a in arenas[1:]] + [lr, step]
    outs = [a.value for a in arenas]
    fused = Node(FUSED_UPDATE, ins, outs, {"op": first.op, "attrs": dict(first.attrs), "arenas": arenas,
                                           "grads": claims, "offsets": offsets, "garena": garena},
                 name=f"{first.op}x{len(members)}")
    for m in members:
        for o in m.outputs:
            graph.state_updates.pop(o, None)
    last = max(graph.nodes.index(m) for m in members)
    drop = {id(m) for m in members}
    nodes = []
    for k, n in enumerate(graph.nodes):
        if id(n) not in drop:
            nodes.append(n)
        if k == last:
            nodes.extend(copies + [fused])
    graph.nodes = nodes


def _merge_siblings(graph: Graph, groups: list[list[Node]], users, order, stored, limit: int,
                    state: set[str]) -> list[list[Node]]:
    """Horizontal fusion: independent groups of one shape become one kernel (emitted at the later
    one's place) when nothing between them reads what the earlier one stores."""
    groups = sorted(groups, key=lambda g: order[id(g[-1])])
    merged: list[list[Node]] = []
    for g in groups:
        target = None
        for a in reversed(merged):
            if (shape_of(graph, a[-1].outputs[0]) != shape_of(graph, g[-1].outputs[0])
                    or len(a) + len(g) > MAX_GROUP):
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


def inference_dropout_to_identity(graph: Graph) -> None:
    """Dropout outside training (no training flag, or a constant false one) is the identity: make it
    an Identity, which the planner turns into an alias (no kernel), when its mask is unused."""
    users = graph.consumers()
    for n in graph.nodes:
        if n.op != "Dropout" or any(users.get(o) or o in graph.outputs for o in n.outputs[1:] if o):
            continue
        flag = n.input(2)
        if flag and (flag not in graph.initializers or bool(np.asarray(graph.initializers[flag]).reshape(()))):
            continue
        n.op, n.inputs, n.outputs, n.attrs = "Identity", [n.inputs[0]], [n.outputs[0]], {}


# -- 1-byte graph inputs ----------------------------------------------------------------------------
PACKED = "@u8x4:"   # prefix of the packed input standing in for a 1-byte graph input
BYTE_DTYPES = frozenset({np.dtype(np.uint8), np.dtype(np.int8), np.dtype(np.bool_)})


def packed_name(name: str) -> str:
    return PACKED + name


def pack_byte_inputs(graph: Graph) -> None:
    """Upload uint8/int8/bool graph inputs as they are stored, four elements per u32 word.

    The input becomes '@u8x4:<name>' (the array's bytes seen as u32 words, padded to a whole word,
    so a batch uploads x.nbytes rounded up to 4), and a wgpu.UnpackBytes node in front of the graph
    recomputes <name> as one u32/i32 per element, the kernel contract every consumer expects. The
    unpack is elementwise, so it fuses into the elementwise chain reading the input (the Cast ->
    Sub -> Div of an in-graph normalisation reads the words directly); any other consumer reads it
    from a temporary it writes. The runtime writes the feed of <name> into '@u8x4:<name>'."""
    unpack = []
    for k, name in enumerate(graph.inputs):
        info = graph.info[name]
        if np.dtype(info.dtype) not in BYTE_DTYPES or info.size == 0:
            continue
        packed = packed_name(name)
        graph.info[packed] = TensorInfo(np.dtype(np.uint32), (-(-info.size // 4),))
        graph.inputs[k] = packed
        unpack.append(Node(UNPACK_BYTES, [packed], [name], name=f"unpack {name}"))
    graph.nodes = unpack + graph.nodes


def prepare(graph: Graph, caps: AdapterCaps, supports_epilogue: set[str], fuse: bool = True) -> Graph:
    """A copy of graph rewritten for lowering."""
    g = graph.copy()
    protected = set(g.outputs) | set(g.state_updates)
    inference_dropout_to_identity(g)
    pack_byte_inputs(g)  # not an optimisation: the runtime uploads those inputs packed either way
    if fuse:
        group_updates(g, caps)
        # Gradients computed into their arena slice are read only through FusedUpdate's attrs.
        claimed = {v for n in g.nodes if n.op == FUSED_UPDATE for v in n.attrs["grads"]}
        protected = set(g.outputs) | set(g.state_updates) | claimed
        fuse_epilogues(g, protected, supports_epilogue)
        fuse_elementwise(g, caps, protected)
    return g
