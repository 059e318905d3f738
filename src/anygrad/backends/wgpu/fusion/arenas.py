"""Optimizer updates over parameter arenas (fusion passes): updates of one kind become one
wgpu.FusedUpdate over an arena (group_updates, ArenaSpec); under float16 the loss scaler's test
reads each gradient arena in one reduction (arena_finite_check) and the weights' float16 copies
are one cast of the parameter arena (arena_weight_casts).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .... import settings
from ....ir.graph import Graph, Node, TensorInfo
from ..kernels.kernel import AdapterCaps, ops_where
from ..kernels.kernels_optim import ARENA_CAST, COPY, FUSED_UPDATE
from ..kernels.kernels_reduce import NON_FINITE
from ..kernels.wgsl import size_of
from .views import ALIAS_LIKE

# -- optimizer updates over arenas -------------------------------------------------------------------
ARENA_ALIGN = 64          # elements (256 bytes): every adapter's storage-offset alignment
HALF_ARENA_ALIGN = 128    # elements: 256 bytes also in the float16 copy of the arena (arena_weight_casts)


@dataclass(frozen=True)
class ArenaSpec:
    """State tensors that must lie back to back in one buffer, at these element offsets."""

    value: str                       # the graph value standing for the whole arena
    members: tuple[str, ...]         # state names
    offsets: tuple[int, ...]         # element offsets
    total: int                       # elements


def _aligned(n: int, align: int = ARENA_ALIGN) -> int:
    return -(-n // align) * align


def group_updates(graph: Graph, caps: AdapterCaps) -> None:
    """Merge the optimizer update nodes of one kind (same op, hyperparameters, lr and step) into
    one `wgpu.FusedUpdate` over arenas: parameters, each slot, and the gradients lie back to back,
    so the whole optimizer step is one dispatch updating every parameter in its own buffer."""
    users = graph.consumers()
    producers = graph.producers()
    state = set(graph.state_names)
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[Node]] = {}
    gates: dict[int, list[Node]] = {}  # update node -> its gating Where nodes (f16 loss scaling)
    update_ops = ops_where("update")
    for n in graph.nodes:
        if n.op not in update_ops:
            continue
        targets = [graph.state_updates.get(o) for o in n.outputs]
        state_in = [n.inputs[0]] + n.inputs[2:2 + len(n.outputs) - 1]
        found = None
        if targets != state_in:  # each output kept or not by Where(found, state, new) (grad_scaler.gate)?
            wheres = [_gate_of(users, o, s) for o, s in zip(n.outputs, state_in)]
            if any(w is None for w in wheres) or len({w.inputs[0] for w in wheres}) != 1:
                continue
            found = wheres[0].inputs[0]
            targets = [graph.state_updates.get(w.outputs[0]) for w in wheres]
            gates[id(n)] = wheres
        elif any(users.get(o) for o in n.outputs):
            continue
        if (targets != state_in or any(t not in state for t in state_in)
                or any(graph.info[v].dtype != np.float32 for v in state_in)):
            gates.pop(id(n), None)
            continue
        key = (n.op, repr(sorted(n.attrs.items())), n.inputs[-2], n.inputs[-1], found)
        groups.setdefault(key, []).append(n)
    half_cast = _half_cast_params(graph)
    for members in groups.values():
        gate_ids = {id(w) for m in members for w in gates.get(id(m), [])}
        # Parameters cast to float16 (f16 steps): slices of the float16 arena start on 256 bytes too.
        align = HALF_ARENA_ALIGN if any(m.inputs[0] in half_cast for m in members) else ARENA_ALIGN
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
        if (any(order[id(u)] > last and id(u) not in gate_ids for v in touched for u, _ in users.get(v, []))
                or touched & (set(graph.outputs) | set(graph.state_updates))):
            continue
        # Bindings: gradients, lr, step, (the skip flag,) and each arena once (read_write).
        if 3 + bool(gate_ids) + len(members[0].outputs) > caps.max_storage_buffers_per_stage:
            continue
        # Each arena must fit one storage binding: split into chunks that do.
        budget = caps.max_storage_binding_size // 4
        chunk: list[Node] = []
        size = 0
        for m in members + [None]:
            n = _aligned(size_of(graph, m.inputs[0]), align) if m is not None else 0
            if m is None or (chunk and size + n > budget):
                if chunk:
                    _fuse_group(graph, chunk, producers, state, [gates.get(id(c), []) for c in chunk], align)
                chunk, size = [], 0
            if m is not None:
                chunk.append(m)
                size += n


def _gate_of(users: dict, value: str, state_name: str) -> Node | None:
    """The Where(found, state, value) that is value's only use (a loss-scaled step's skip), or None."""
    use = users.get(value, [])
    if len(use) != 1:
        return None
    w, slot = use[0]
    return w if w.op == "Where" and slot == 2 and w.inputs[1] == state_name else None


def _fuse_group(graph: Graph, members: list[Node], producers: dict[str, Node], state: set[str],
                gates: list[list[Node]] | None = None, align: int = ARENA_ALIGN) -> None:
    first = members[0]
    wheres = [w for ws in (gates or []) for w in ws]
    n_slots = len(first.outputs) - 1
    params = [m.inputs[0] for m in members]
    gid = hashlib.sha1(("|".join([first.op] + params)).encode()).hexdigest()[:10]
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += _aligned(size_of(graph, p), align)
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
    attrs = {"op": first.op, "attrs": dict(first.attrs), "arenas": arenas, "grads": claims, "offsets": offsets,
             "garena": garena}
    if wheres:  # each arena keeps its old values where the flag says the step is skipped
        ins.append(wheres[0].inputs[0])
        attrs["gate"] = [graph.fresh(f"{v}.new") for v in outs]
        for v in attrs["gate"]:
            graph.info[v] = TensorInfo(np.dtype(np.float32), (total,))
    fused = Node(FUSED_UPDATE, ins, outs, attrs, name=f"{first.op}x{len(members)}")
    for m in members:
        for o in m.outputs:
            graph.state_updates.pop(o, None)
    for w in wheres:
        graph.state_updates.pop(w.outputs[0], None)
    ids = {id(m) for m in members}
    # by identity: list.index compares Nodes field by field (a dataclass), node after node
    last = max(k for k, n in enumerate(graph.nodes) if id(n) in ids)
    drop = ids | {id(w) for w in wheres}
    nodes = []
    for k, n in enumerate(graph.nodes):
        if id(n) not in drop:
            nodes.append(n)
        if k == last:
            nodes.extend(copies + [fused])
    graph.nodes = nodes


F16_ARENA_ENV = "ANYGRAD_WGPU_F16_ARENA"


def f16_arena_enabled() -> bool:
    """ANYGRAD_WGPU_F16_ARENA=0 keeps the float16 step's per-tensor work as the graph builds it
    (the per-gradient finite check), for A/B runs; default on."""
    return settings.get(F16_ARENA_ENV)


def _alias_root(v: str, producers: dict[str, Node]) -> str:
    while v in producers and producers[v].op in ALIAS_LIKE:
        v = producers[v].inputs[0]
    return v


def arena_finite_check(graph: Graph) -> None:
    """The loss scaler's test (grad_scaler.found_inf: FoundInf over the gradients) reads each
    gradient arena whole, in one reduction, instead of each gradient in it, for the
    wgpu.FusedUpdate nodes that the test gates.

    The reduction (wgpu.NonFinite, kernels_reduce.py) counts the elements of the whole garena
    buffer whose exponent bits are all ones (inf or NaN; the zero padding between slices counts
    nothing) and yields +inf when that count is positive, else 0: FoundInf reads that scalar in
    place of the arena's gradients (kernels_reduce.lower_found_inf), and it is non-finite exactly
    when one of them is. A count, not a sum of the values, so it decides exactly like torch's
    GradScaler (a sum of finite float32 gradients could overflow to inf and skip a good step); and
    not max(|x|), whose NaN handling WGSL leaves to the implementation.

    An arena is taken only when every gradient in it is one of FoundInf's inputs (so the test reads
    no gradient it did not read before). Its node is placed before the first reader of the test,
    after the copies into those arenas (moved there from in front of their updates); its inputs
    after the garena name the values written into it (each gradient computed into its slice, or the
    copy there), so that later passes (elementwise fusion, which emits a group at its last member)
    keep their writers before it. The lowering reads only the garena."""
    if not f16_arena_enabled():
        return
    producers = graph.producers()
    users = graph.consumers()
    updates = [n for n in graph.nodes if n.op == FUSED_UPDATE and n.attrs.get("gate")]
    for found in dict.fromkeys(n.inputs[-1] for n in updates):
        gated = [n for n in updates if n.inputs[-1] == found]
        _arena_finite_check(graph, found, gated, producers, users)
        producers = graph.producers()
        users = graph.consumers()


def _is_half_cast(graph: Graph, n: Node) -> bool:
    return (n.op == "Cast" and len(n.inputs) == 1 and len(n.outputs) == 1
            and np.dtype(graph.info[n.outputs[0]].dtype) == np.float16
            and np.dtype(graph.info[n.inputs[0]].dtype) == np.float32)


def _half_cast_params(graph: Graph) -> set[str]:
    """Trainable parameters some Cast reads straight into float16 (autocast, and recompute's copies)."""
    if not f16_arena_enabled():
        return set()
    params = set(graph.params)
    return {n.inputs[0] for n in graph.nodes if _is_half_cast(graph, n) and n.inputs[0] in params}


def arena_weight_casts(graph: Graph) -> None:
    """The float16 copies of the weights (autocast's Cast(param -> float16), and the copies
    ir/recompute.py places in the backward) as one cast of the whole parameter arena per step: a
    wgpu.ArenaCast writes `@garena:{gid}:f16` (a float16 buffer of the arena's size and layout,
    held like the gradient arena: its own buffer, zeroed at creation), and each cast's value becomes
    that weight's slice of it (planner Root "gslice"; group_updates aligned the arena to 128
    elements so that every slice starts on a 256-byte boundary). The cast is placed where the
    first of those Casts was: the parameters change only in the fused update, after every reader.
    Parameters in the arena that nothing casts (a BatchNorm's, kept float32) are cast too, unread:
    a few more elements, no more kernels. The float16 weights stay in memory through the step (2
    bytes a parameter), where recomputation let each die after its forward reads."""
    if not f16_arena_enabled():
        return
    for upd in [n for n in graph.nodes if n.op == FUSED_UPDATE]:
        spec = upd.attrs["arenas"][0]
        offset = dict(zip(spec.members, spec.offsets))
        casts = [n for n in graph.nodes if _is_half_cast(graph, n) and n.inputs[0] in offset
                 and offset[n.inputs[0]] % HALF_ARENA_ALIGN == 0 and n.outputs[0] not in graph.outputs
                 and n.outputs[0] not in graph.state_updates]
        if not casts:
            continue
        half = f"{upd.attrs['garena']}:f16"
        graph.info[half] = TensorInfo(np.dtype(np.float16), (spec.total,))
        upd.attrs["half"] = half
        upd.attrs["half_slices"] = {n.outputs[0]: offset[n.inputs[0]] for n in casts}
        cast = Node(ARENA_CAST, [spec.value], [half], name="ArenaCast")
        drop = {id(n) for n in casts}
        first = min(k for k, n in enumerate(graph.nodes) if id(n) in drop)
        nodes = []
        for k, n in enumerate(graph.nodes):
            if k == first:
                nodes.append(cast)
            if id(n) not in drop:
                nodes.append(n)
        graph.nodes = nodes


def _arena_finite_check(graph: Graph, found: str, gated: list[Node], producers: dict[str, Node],
                        users: dict) -> None:
    test = producers.get(found)
    if test is None or test.op != "FoundInf" or found in graph.outputs or found in graph.state_updates:
        return
    tested = {_alias_root(v, producers): v for v in test.inputs}  # gradient (alias root) -> FoundInf's input
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    first_use = min(order[id(u)] for u, _ in users[found])
    copies_of = {n.outputs[0]: n for n in graph.nodes if n.op == COPY}
    taken, moved, checks = set(), [], []
    for upd in gated:
        roots, srcs, cps = [], [], []
        for claim in upd.attrs["grads"]:
            cp = copies_of.get(claim)
            src = cp.inputs[0] if cp is not None else claim
            if src not in producers:  # a graph input or a state tensor: not a gradient of this step
                roots = None
                break
            roots.append(_alias_root(src, producers))
            srcs.append(src)
            if cp is not None:
                cps.append(cp)
        if (roots is None or any(r not in tested or tested[r] in taken for r in roots)
                or any(order[id(producers[v])] >= first_use for v in srcs)):
            continue
        taken |= {tested[r] for r in roots}
        moved += cps
        w = graph.fresh(f"{upd.attrs['garena']}.nonfinite")
        graph.info[w] = TensorInfo(np.dtype(np.float32), ())
        # the values written into the arena (a gradient, or its copy) after the garena: ordering edges
        checks.append(Node(NON_FINITE, [upd.attrs["garena"]] + list(upd.attrs["grads"]), [w],
                           name=graph.fresh("nonfinite")))
    if not checks:
        return
    test.inputs = [c.outputs[0] for c in checks] + [v for v in test.inputs if v not in taken]
    drop = {id(n) for n in moved + [test]}
    nodes = []
    for k, n in enumerate(graph.nodes):
        if k == first_use:
            nodes += moved + checks + [test]
        if id(n) not in drop:
            nodes.append(n)
    graph.nodes = nodes
