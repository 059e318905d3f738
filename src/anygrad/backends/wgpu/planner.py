"""From a specialized Graph to a fixed plan: the kernel list and where every value lives.

No GPU objects here, only decisions, so the plan can be tested and printed on any machine:

- Reshape-like nodes produce no kernel: their output is an alias of their input's storage.
- Every value resolves to a storage root: a state tensor (the backend's persistent buffer), a
  graph input (written each run), a constant (written once), or a temporary slot.
- Temporaries share slots by liveness over the kernel sequence (a slot grows to its largest
  tenant), so a training step needs a handful of buffers, not one per value.
- A state update (new value V replaces state S) is planned into S's own buffer when S is not
  read after V is first written (or only by V's elementwise producer at the same element);
  otherwise V is copied onto S after the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import DeviceError
from ...ir.graph import Graph
from .kernel import LOWERINGS, AdapterCaps, Kernel
from .wgsl import shape_of

# Ops whose output is the input's bytes under another shape: no kernel, no copy.
ALIAS_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
ELEM_BYTES = 4  # f32, i32, u32


@dataclass(frozen=True)
class Root:
    kind: str   # "state" | "input" | "const" | "temp" | "arena" | "garena" | "gslice"
    name: str   # state/input/const/arena name, or the temp's representative value
    offset: int = 0  # bytes into the storage (gslice: a gradient's place in its arena)


@dataclass
class Step:
    kernel: Kernel
    reads: tuple[Root, ...]
    writes: tuple[Root, ...]


@dataclass
class Plan:
    steps: list[Step]
    nbytes: dict[Root, int]                       # bytes each storage root needs
    slot_of: dict[Root, int]                      # temp root -> slot index
    slot_bytes: list[int]
    root_of: dict[str, Root]                      # every graph value the plan knows -> its storage
    state_copies: list[tuple[Root, str]]          # after the step: copy root onto state
    inplace: dict[str, str] = field(default_factory=dict)  # value -> state it is computed into
    graph: Graph | None = None
    arenas: list = field(default_factory=list)    # fusion.ArenaSpec: state packed back to back


def value_bytes(graph: Graph, name: str) -> int:
    n = int(np.prod(shape_of(graph, name), dtype=np.int64))
    return max(ELEM_BYTES, n * ELEM_BYTES)


def lower_all(graph: Graph, caps: AdapterCaps) -> tuple[list[tuple[int, Kernel]], dict[str, str], dict[str, int]]:
    """Kernels for every node (tagged with the node index), the alias map, and scratch sizes."""
    missing = sorted({n.op for n in graph.nodes if n.op not in ALIAS_OPS and n.op not in LOWERINGS})
    if missing:
        raise DeviceError(f"the wgpu backend has no kernel for op(s) {', '.join(missing)} "
                          f"(graph '{graph.name}'); use device='cpu' for this model, or open an issue naming the ops")
    alias: dict[str, str] = {}
    kernels: list[tuple[int, Kernel]] = []
    scratch_bytes: dict[str, int] = {}
    for k, node in enumerate(graph.nodes):
        if node.op in ALIAS_OPS:
            alias[node.outputs[0]] = node.inputs[0]
            continue
        try:
            node_kernels = LOWERINGS[node.op](node, graph, caps)
        except (ValueError, NotImplementedError) as e:  # attributes or inputs a kernel cannot take
            raise DeviceError(f"{node.label}: the wgpu backend cannot run this node ({e}); "
                              "use device='cpu' for this model") from e
        # Scratch names are local to one node's kernels (any of them may declare it).
        ren: dict[str, str] = {}
        for kern in node_kernels:
            for sc in kern.scratch:
                ren[sc.name] = f"{sc.name}@{k}"
                scratch_bytes[ren[sc.name]] = max(scratch_bytes.get(ren[sc.name], 0),
                                                  max(ELEM_BYTES, int(sc.elements) * ELEM_BYTES))
        for kern in node_kernels:
            kernels.append((k, _rename(kern, ren) if ren else kern))
    return kernels, alias, scratch_bytes


def _rename(kern: Kernel, ren: dict[str, str]) -> Kernel:
    return Kernel(kern.name, kern.wgsl, kern.workgroups, tuple(ren.get(v, v) for v in kern.reads),
                  tuple(ren.get(v, v) for v in kern.writes), kern.entry, kern.scratch,
                  tuple(ren.get(v, v) for v in kern.inplace))


def make_plan(graph: Graph, caps: AdapterCaps, state_names: set[str]) -> Plan:
    kernels, alias, scratch_bytes = lower_all(graph, caps)

    def resolve(v: str) -> str:
        while v in alias:
            v = alias[v]
        return v

    inputs = set(graph.inputs)
    # Fused optimizer updates: arenas of state, and gradients computed into their arena slices.
    arenas, gslice = [], {}
    for node in graph.nodes:
        if node.op == "wgpu.FusedUpdate":
            arenas += node.attrs["arenas"]
            for g, off in zip(node.attrs["grads"], node.attrs["offsets"]):
                gslice[g] = Root("gslice", node.attrs["garena"], off * ELEM_BYTES)

    def root(v: str) -> Root:
        r = resolve(v)
        if r.startswith("@arena:"):
            return Root("arena", r)
        if r.startswith("@garena:"):
            return Root("garena", r)
        if r in gslice:
            return gslice[r]
        if r in state_names:
            return Root("state", r)
        if r in inputs:
            return Root("input", r)
        if r in graph.initializers:
            return Root("const", r)
        return Root("temp", r)

    names = {v for _, kern in kernels for v in kern.reads + kern.writes}
    names |= set(graph.outputs) | set(graph.state_updates) | set(alias)
    root_of = {v: root(v) for v in names}
    nbytes: dict[Root, int] = {}
    for v, r in root_of.items():
        size = scratch_bytes.get(v) or value_bytes(graph, v if v in graph.info else r.name)
        nbytes[r] = max(nbytes.get(r, 0), size)

    _check_limits(graph, caps, kernels, root_of, nbytes)

    # Liveness of temporaries over the kernel sequence.
    first: dict[Root, int] = {}
    last: dict[Root, int] = {}
    first_write: dict[Root, int] = {}
    last_read: dict[Root, int] = {}
    for s, (_, kern) in enumerate(kernels):
        for v in kern.reads:
            r = root_of[v]
            first.setdefault(r, s)
            last[r] = s
            last_read[r] = s
        for v in kern.writes:
            r = root_of[v]
            first.setdefault(r, s)
            last[r] = s
            first_write.setdefault(r, s)
    end = len(kernels)
    for v in graph.outputs:
        if root_of[v].kind == "temp":
            first.setdefault(root_of[v], end)  # an output no kernel writes (zero elements) still needs a slot
            last[root_of[v]] = end
    copies: list[tuple[Root, str]] = []
    inplace: dict[str, str] = {}
    update_sources = {root_of[v] for v in graph.state_updates}
    output_roots = {root_of[v] for v in graph.outputs}  # fetched after the step: must keep old values
    for v, target in graph.state_updates.items():
        r = root_of[v]
        if r == Root("state", target):
            continue
        if (r.kind == "temp" and r not in inplace.values() and r.name not in inplace
                and Root("state", target) not in output_roots and Root("state", target) not in update_sources
                and _inplace_safe(kernels, root_of, r, Root("state", target), first_write, last_read)
                and nbytes[r] <= nbytes.get(Root("state", target), value_bytes(graph, target))):
            inplace[r.name] = target
            continue
        if r.kind == "temp":
            last[r] = end
        copies.append((r, target))

    # In-place temporaries become the state's buffer everywhere (copies from them too).
    for v, r in list(root_of.items()):
        if r.kind == "temp" and r.name in inplace:
            root_of[v] = Root("state", inplace[r.name])
    copies = [(Root("state", inplace[r.name]) if r.kind == "temp" and r.name in inplace else r, t)
              for r, t in copies]
    steps = [Step(kern, tuple(root_of[v] for v in kern.reads), tuple(root_of[v] for v in kern.writes))
             for _, kern in kernels]

    slot_of, slot_bytes = _assign_slots(steps, first, last, nbytes, set(inplace))
    nbytes = {r: b for r, b in nbytes.items() if not (r.kind == "temp" and r.name in inplace)}
    return Plan(steps, nbytes, slot_of, slot_bytes, root_of, copies, inplace, graph, arenas)


def _inplace_safe(kernels, root_of, temp: Root, state: Root, first_write, last_read) -> bool:
    fw = first_write.get(temp)
    if fw is None:
        return False
    lr = last_read.get(state, -1)
    if lr < fw:
        return True
    if lr > fw:
        return False
    kern = kernels[fw][1]
    reads_state = [v for v in kern.reads if root_of[v] == state]
    return all(v in kern.inplace for v in reads_state)


def _assign_slots(steps: list[Step], first, last, nbytes, inplaced: set[str]) -> tuple[dict[Root, int], list[int]]:
    """Greedy by first use: a freed slot that fits, else the largest free one (grown), else new."""
    born: dict[int, list[Root]] = {}
    dies: dict[int, list[Root]] = {}
    for r, s in first.items():
        if r.kind == "temp" and r.name not in inplaced:
            born.setdefault(s, []).append(r)
            dies.setdefault(last[r], []).append(r)
    slot_of: dict[Root, int] = {}
    sizes: list[int] = []
    free: list[int] = []
    for s in range(len(steps) + 1):
        for r in sorted(born.get(s, []), key=lambda r: -nbytes[r]):
            need = nbytes[r]
            fits = [k for k in free if sizes[k] >= need]
            if fits:
                k = min(fits, key=lambda k: sizes[k])
            elif free:
                k = max(free, key=lambda k: sizes[k])
                sizes[k] = need
            else:
                k = len(sizes)
                sizes.append(need)
            if k in free:
                free.remove(k)
            slot_of[r] = k
        for r in dies.get(s, []):
            free.append(slot_of[r])
    return slot_of, sizes


def _check_limits(graph: Graph, caps: AdapterCaps, kernels, root_of, nbytes) -> None:
    limit = caps.max_storage_binding_size
    worst = max(nbytes.items(), key=lambda kv: kv[1], default=None)
    if worst and worst[1] > limit:
        batch = None
        if graph.inputs and graph.info[graph.inputs[0]].shape:
            batch = int(graph.info[graph.inputs[0]].shape[0])
        hint = ""
        if batch:
            fit = max(0, batch * limit // worst[1])
            hint = f" The largest batch that fits is about {fit}." if fit else " Even a batch of 1 does not fit."
        raise DeviceError(f"value '{worst[0].name}' needs {worst[1] >> 20} MiB but this adapter's "
                          f"max-storage-buffer-binding-size is {limit >> 20} MiB.{hint} Use a smaller batch "
                          "or another device.")
    for _, kern in kernels:
        n = len(kern.reads) + len(kern.writes)
        if n > caps.max_storage_buffers_per_stage:
            raise DeviceError(f"kernel {kern.name} binds {n} storage buffers; this adapter allows "
                              f"{caps.max_storage_buffers_per_stage} per shader stage. Use another device.")
        if max(kern.workgroups) > caps.max_workgroups_per_dim:
            raise DeviceError(f"kernel {kern.name} dispatches {kern.workgroups} workgroups; this adapter "
                              f"allows {caps.max_workgroups_per_dim} per dimension. Use a smaller batch.")


def describe(plan: Plan) -> str:
    """Human-readable plan: kernels in order with their bindings, then buffers."""
    head = (f"{len(plan.steps)} kernels, {len(plan.slot_bytes)} temporary slots "
            f"({sum(plan.slot_bytes) >> 10} KiB), {len(plan.inplace)} in-place state updates")
    lines = [head]
    for s, st in enumerate(plan.steps):
        lines.append(f"  {s:3d} {st.kernel.name} {st.kernel.workgroups}")
    return "\n".join(lines)

