"""From a specialized Graph to a fixed plan: the kernel list and where every value lives.

No GPU objects here, only decisions, so the plan can be tested and printed on any machine:

- Reshape-like nodes produce no kernel: their output is an alias of their input's storage.
- Every value resolves to a storage root: a state tensor (the backend's persistent buffer), a
  graph input (written each run), a constant (written once), or a temporary slot.
- Temporaries share buffers by liveness over the kernel sequence: each is placed at an offset
  into a few shared buffers, into the tightest gap free over its lifetime (TFLite's greedy
  offset planner, tried in a few orders: largest first, longest-lived first...), so a step of
  mixed 2/4/8 MiB activations needs about the peak of its live bytes (planner.liveness_bound),
  not one buffer per value nor a slot per size.
- A state update (new value V replaces state S) is planned into S's own buffer when S is not
  read after V is first written (or only by V's elementwise producer at the same element);
  otherwise V is copied onto S after the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .... import settings
from ....errors import DeviceError
from ....ir.graph import Graph, Node
from ....ir.recompute import ELEMENTWISE, recompute
from ..device.adapters import _bytes
from ..fusion.passes import PACKED
from ..kernels.halfstore import is_half, stored_half
from ..kernels.kernel import LOWERINGS, AdapterCaps, Kernel, ops_where
from ..kernels.wgsl import shape_of
from .bindpack import pack_reads
from .bindsplit import split_rows
from .gridfold import fold_kernel
from .limits import shared_buffer_bytes

# Ops whose output is the input's bytes under another shape: no kernel, no copy.
ALIAS_OPS = ops_where("alias")
ELEM_BYTES = 4  # f32, i32, u32
# Temporaries sharing a buffer start at multiples of this: WebGPU's largest allowed
# minStorageBufferOffsetAlignment (256 on every adapter's limits), so any adapter binds them.
SLOT_ALIGN = 256
# The placements make_plan tries for temporaries (tests pin one): a buffer per slot, grown to its
# largest tenant ("slots"), and offsets into shared buffers ("offsets"); the smallest is kept.
PLACEMENTS = ("slots", "offsets")
HALF_BYTES = 2  # f16 (mixed precision: halfstore.py)
HALF = np.dtype(np.float16)



def _label(node: Node) -> str:
    """How a message names node: as the model's node it was made from, for the nodes the
    lowering passes split off one (fusion.split_batchnorm sets `_origin`)."""
    return node.attrs.get("_origin") or node.label

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
    slot_of: dict[Root, int]                      # temp root -> slot (buffer) index
    slot_bytes: list[int]
    root_of: dict[str, Root]                      # every graph value the plan knows -> its storage
    state_copies: list[tuple[Root, str]]          # after the step: copy root onto state
    inplace: dict[str, str] = field(default_factory=dict)  # value -> state it is computed into
    graph: Graph | None = None
    arenas: list = field(default_factory=list)    # fusion.ArenaSpec: state packed back to back
    slot_offset: dict[Root, int] = field(default_factory=dict)  # temp root -> byte offset in its slot
    live: dict[Root, tuple[int, int]] = field(default_factory=dict)  # temp root -> (first, last) step


def value_bytes(graph: Graph, name: str) -> int:
    """Device bytes of a value: 4 per element, 2 for float16 (rounded up to whole 4-byte words,
    as bindings and copies need)."""
    n = math.prod(shape_of(graph, name))
    if np.dtype(graph.info[name].dtype) == HALF:
        return max(ELEM_BYTES, -(-n * HALF_BYTES // ELEM_BYTES) * ELEM_BYTES)
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
    arena_total = {spec.value: spec.total for n in graph.nodes if n.op == "wgpu.FusedUpdate"
                   for spec in n.attrs["arenas"]}

    def elements(v: str) -> int | None:
        if v in graph.info:
            return math.prod(shape_of(graph, v))
        if v in scratch_bytes:
            return scratch_bytes[v] // ELEM_BYTES
        return arena_total.get(v)
    for k, node in enumerate(graph.nodes):
        if node.op in ALIAS_OPS:
            alias[node.outputs[0]] = node.inputs[0]
            continue
        try:
            node_kernels = None
            if any(v and v in graph.info and value_bytes(graph, v) > caps.max_storage_binding_size
                   for v in list(node.inputs) + list(node.outputs)):
                node_kernels = split_rows(node, graph, caps, LOWERINGS[node.op])  # bindsplit.py
            if node_kernels is None:
                node_kernels = LOWERINGS[node.op](node, graph, caps)
            if any(is_half(graph, v) for v in list(node.inputs) + list(node.outputs) if v):
                node_kernels = stored_half(node_kernels, graph, elements)
        except (ValueError, NotImplementedError) as e:  # attributes or inputs a kernel cannot take
            raise DeviceError(f"{_label(node)}: the wgpu backend cannot run this node ({e}); "
                              "use device='cpu' for this model") from e
        # Scratch names are local to one node's kernels (any of them may declare it).
        ren: dict[str, str] = {}
        for kern in node_kernels:
            for sc in kern.scratch:
                ren[sc.name] = f"{sc.name}@{k}"
                scratch_bytes[ren[sc.name]] = max(scratch_bytes.get(ren[sc.name], 0),
                                                  max(ELEM_BYTES, int(sc.elements) * ELEM_BYTES))
        for j, kern in enumerate(node_kernels):
            kern = _rename(kern, ren) if ren else kern
            # Past max-storage-buffers-per-shader-stage: small reads packed into one buffer (bindpack.py).
            for part in pack_reads(kern, caps.max_storage_buffers_per_stage, elements,
                                   caps.max_storage_binding_size, f"{k}.{j}"):
                for sc in part.scratch:
                    if sc.name.startswith("@pack:"):
                        scratch_bytes[sc.name] = max(ELEM_BYTES, int(sc.elements) * ELEM_BYTES)
                kernels.append((k, fold_kernel(part, caps.max_workgroups_per_dim)))
    return kernels, alias, scratch_bytes


def _rename(kern: Kernel, ren: dict[str, str]) -> Kernel:
    return replace(kern, reads=tuple(ren.get(v, v) for v in kern.reads),
                   writes=tuple(ren.get(v, v) for v in kern.writes),
                   inplace=tuple(ren.get(v, v) for v in kern.inplace))


def make_plan(graph: Graph, caps: AdapterCaps, state_names: set[str], read_apart: bool = True) -> Plan:
    """The step's kernels and where each value lives. `read_apart`: a temporary that a kernel
    reads while writing another is kept out of that one's shared buffer (_read_while_written:
    faster reads, more bytes); without it the placement is the tightest (fit_plan, over budget)."""
    kernels, alias, scratch_bytes = lower_all(graph, caps)

    def resolve(v: str) -> str:
        while v in alias:
            v = alias[v]
        return v

    inputs = set(graph.inputs)
    # Fused optimizer updates: arenas of state, and gradients computed into their arena slices.
    arenas, gslice = [], {}
    labels: dict[Root, str] = {}  # arena storage named by the parameters in it, for limit errors
    for node in graph.nodes:
        if node.op == "wgpu.FusedUpdate":
            arenas += node.attrs["arenas"]
            for spec in node.attrs["arenas"]:
                labels[Root("arena", spec.value)] = _members(spec.members, "parameter/state tensor")
            labels[Root("garena", node.attrs["garena"])] = _members(node.attrs["arenas"][0].members,
                                                                   "the gradient arena of parameter")
            for g, off in zip(node.attrs["grads"], node.attrs["offsets"]):
                gslice[g] = Root("gslice", node.attrs["garena"], off * ELEM_BYTES)
                labels[gslice[g]] = f"gradient '{g}'"
            if node.attrs.get("half"):  # float16 weights: slices of the arena's float16 copy
                labels[Root("garena", node.attrs["half"])] = _members(node.attrs["arenas"][0].members,
                                                                     "the float16 arena of parameter")
                for v, off in node.attrs["half_slices"].items():
                    gslice[v] = Root("gslice", node.attrs["half"], off * HALF_BYTES)
                    labels[gslice[v]] = f"float16 weight '{v}'"

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

    _check_limits(graph, caps, kernels, root_of, nbytes, labels)

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

    # Placements by liveness; the smallest total is kept (a tighter reuse at no cost per step).
    # Offsets into shared buffers usually win; a slot per tenant (offset 0) stays as a fallback.
    live = {r: (s, last[r]) for r, s in first.items() if r.kind == "temp" and r.name not in inplace}
    cap = shared_buffer_bytes(caps.max_storage_binding_size)
    apart = _read_while_written(steps, live) if read_apart else {}
    slot_of, slot_bytes, slot_offset = min(
        [(*_assign_slots(steps, first, last, nbytes, set(inplace), grow), {})
         for grow in (True, False) if "slots" in PLACEMENTS]
        + [_place_offsets(live, nbytes, cap, SLOT_ALIGN, apart, order) for order in _ORDERS if "offsets" in PLACEMENTS],
        key=lambda t: (sum(t[1]), len(t[1])))
    nbytes = {r: b for r, b in nbytes.items() if not (r.kind == "temp" and r.name in inplace)}
    plan = Plan(steps, nbytes, slot_of, slot_bytes, root_of, copies, inplace, graph, arenas,
                {r: o for r, o in slot_offset.items() if o}, live)
    if caps.memory_budget is not None:
        _check_budget(plan, caps)
    return plan


# -- memory ------------------------------------------------------------------------------------------
def recompute_elementwise() -> bool:
    """Per-element forward values recomputed in the backward when that plans smaller (default);
    ANYGRAD_RECOMPUTE_ELEMENTWISE=0 keeps them stored instead (one elementwise kernel fewer per
    recomputed segment, more memory)."""
    return settings.get("ANYGRAD_RECOMPUTE_ELEMENTWISE")


def fit_plan(graph: Graph, caps: AdapterCaps, state_names: set[str], prepare_fn) -> tuple[Graph, Plan, list[str]]:
    """(prepared graph, plan, recomputed values) for `graph` within caps.memory_budget: the plan
    as it is when it fits; else the tightest placement of it (make_plan's read_apart off); else
    the plan of the graph with cheap forward values recomputed in the backward (ir/recompute.py);
    else the budget error, naming the largest batch that fits. prepare_fn(graph) -> the graph to plan."""
    free = replace(caps, memory_budget=None)
    prepared = prepare_fn(graph)
    plan = make_plan(prepared, free, state_names)
    # per-element values (casts too: under mixed precision, float32 copies of float16 values)
    # recomputed in the backward whenever that plans smaller (recompute.ELEMENTWISE)
    lighter, values = recompute(graph, ELEMENTWISE) if recompute_elementwise() else (graph, [])
    if values:
        prepared2 = prepare_fn(lighter)
        plan2 = make_plan(prepared2, free, state_names)
        if memory_report(plan2).total < memory_report(plan).total:
            graph, prepared, plan = lighter, prepared2, plan2
    if caps.memory_budget is None or memory_report(plan).total <= caps.memory_budget:
        return prepared, plan, []
    # Over the budget: first the tightest placement, where a kernel may read a buffer it writes
    # (slower reads; ResNet-18 b512 f16: 223 -> 205 MiB of temporaries, the liveness bound 193)
    tight = make_plan(prepared, free, state_names, read_apart=False)
    if memory_report(tight).total < memory_report(plan).total:
        plan = tight
    if memory_report(plan).total <= caps.memory_budget:
        return prepared, plan, []
    lighter, values = recompute(graph)
    used: list[str] = []
    if values:
        prepared2 = prepare_fn(lighter)
        plan2 = make_plan(prepared2, free, state_names, read_apart=False)
        if memory_report(plan2).total < memory_report(plan).total:
            prepared, plan, used = prepared2, plan2, values
    _check_budget(plan, caps, recomputed=len(used))
    return prepared, plan, used


OPTIMIZER_PREFIXES = ("optim.", "accum.")  # program.py's names of optimizer slots and accumulators


@dataclass(frozen=True)
class MemoryReport:
    """Device bytes one compiled step holds, by what they are for."""

    parameters: int       # trainable tensors (params, frozen ones included)
    optimizer_state: int  # optimizer slots, gradient-accumulation buffers
    buffers: int          # other state: BatchNorm statistics, counters, metric sums
    activations: int      # temporaries after liveness reuse: activations, gradients, workspace
    inputs: int           # the batch
    constants: int
    recomputed: int = 0   # forward values recomputed in the backward to fit a memory budget

    @property
    def total(self) -> int:
        return (self.parameters + self.optimizer_state + self.buffers + self.activations + self.inputs
                + self.constants)

    @property
    def per_batch(self) -> int:
        """The part that grows with the batch (temporaries and inputs)."""
        return self.activations + self.inputs

    def lines(self) -> list[str]:
        parts = [("parameters", self.parameters), ("optimizer state", self.optimizer_state),
                 ("buffers", self.buffers), ("activations and gradients", self.activations),
                 ("inputs", self.inputs), ("constants", self.constants)]
        extra = [f"recomputed in the backward to fit the memory budget: {self.recomputed} activations"] \
            if self.recomputed else []
        return [f"{name}: {_size(n)}" for name, n in parts] + extra + [f"peak: {_size(self.total)}"]


def memory_report(plan: Plan) -> MemoryReport:
    graph = plan.graph
    params = set(graph.params) if graph is not None else set()

    def kind(state: str) -> str:
        if state in params:
            return "parameters"
        return "optimizer_state" if state.startswith(OPTIMIZER_PREFIXES) else "buffers"

    members = {spec.value: spec.members for spec in plan.arenas}
    packed = {m for ms in members.values() for m in ms}  # lives in its arena, counted there
    sums = dict.fromkeys(("parameters", "optimizer_state", "buffers", "activations", "inputs", "constants"), 0)
    for r, n in plan.nbytes.items():
        if r.kind == "state" and r.name not in packed:
            sums[kind(r.name)] += n
        elif r.kind == "arena":  # packed state: counted by what its first member is
            sums[kind(members.get(r.name, ("",))[0])] += n
        elif r.kind == "garena":
            sums["activations"] += n  # the gradients of a fused update (and its weights' float16 copy)
        elif r.kind == "input":
            sums["inputs"] += n
        elif r.kind == "const":
            sums["constants"] += n
    sums["activations"] += sum(plan.slot_bytes)
    return MemoryReport(**sums)


def _check_budget(plan: Plan, caps: AdapterCaps, recomputed: int = 0) -> None:
    """The memory budget: refuse a step that would not fit, naming the batch that does."""
    report = memory_report(plan)
    budget = caps.memory_budget
    if report.total <= budget:
        return
    batch = _batch_size(plan.graph) if plan.graph is not None else None
    fixed = report.total - report.per_batch
    source = (f"the '{caps.limits_profile}' limits profile allows" if caps.limits_profile and not caps.memory_budget_set
              else "the memory budget is")
    after = f" even with {recomputed} activations recomputed in the backward" if recomputed else ""
    what = (f"the training step needs {_size(report.total)} on the device ({', '.join(report.lines()[:-1])}){after}, "
            f"but {source} {_size(budget)}.")
    if fixed >= budget:
        raise DeviceError(f"{what} Its parameters and state alone need {_size(fixed)}, so no batch size fits: "
                          "freeze some parameters, use a smaller model, or an optimizer with less state (sgd).")
    # Temporaries grow about linearly with the batch, not exactly (slots are reused by liveness):
    # a 10% margin keeps the batch named here inside the budget.
    fit = int(0.9 * batch * (budget - fixed) / report.per_batch) if batch and report.per_batch else 0
    hint = (f"The largest batch that fits is about {fit}." if fit else "Even a batch of 1 does not fit.")
    raise DeviceError(f"{what} {hint}")


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


def _assign_slots(steps: list[Step], first, last, nbytes, inplaced: set[str],
                  grow: bool = True) -> tuple[dict[Root, int], list[int]]:
    """Greedy by first use: a freed slot that fits, else (grow) the largest free one, grown, else a
    new one. Growing saves buffers when sizes rise through a step; not growing saves bytes when a
    large slot would stay large for many small tenants."""
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
            elif free and grow:
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


# Which temporary is placed first. No one order wins everywhere (measured on the GPT, ViT and
# ResNet-18 steps of benchmarks/models.py): largest first is TFLite's; longest-lived first packs
# the values that outlive the forward pass at the bottom, and usually lands within 1-5% of the
# liveness bound. Each costs well under a second even for a step with thousands of temporaries.
# (TFLite's greedy by breadth, the values of the fullest step first, was tried: 15-64% over the
# bound on these steps, never the best, so it is not among them.)
_ORDERS = {
    "size": lambda live, nbytes: lambda r: (-nbytes[r], live[r][0], r.name),
    "area": lambda live, nbytes: lambda r: (-nbytes[r] * (live[r][1] - live[r][0] + 1), live[r][0], r.name),
    "first": lambda live, nbytes: lambda r: (live[r][0], -nbytes[r], r.name),
    "long": lambda live, nbytes: lambda r: (live[r][0] - live[r][1], -nbytes[r], r.name),
}


def _read_while_written(steps: list[Step], live: dict[Root, tuple[int, int]]) -> dict[Root, set[Root]]:
    """For each temporary, the temporaries a kernel reads while writing it, or writes while
    reading it. In one buffer, the read binding must be declared writable (one usage scope may not
    mix read-only and writable views: runtime/encode.py: writable_reads), which takes the read off the GPU's
    read-only path: at 2 GiB shared buffers 75 of the d-256 GPT's 92 GEMMs read a buffer they
    write, and the same kernels ran 15-40% slower than with each tensor in a buffer of its own."""
    apart: dict[Root, set[Root]] = {}
    for st in steps:
        for w in st.writes:
            for r in st.reads:
                if r != w and r in live and w in live:
                    apart.setdefault(w, set()).add(r)
                    apart.setdefault(r, set()).add(w)
    return apart


_SEGMENT = 1 << 42   # above any byte offset: lifts each buffer's ends above every earlier buffer's


def _place_offsets(live: dict[Root, tuple[int, int]], nbytes: dict[Root, int], cap: int, align: int,
                   apart: dict[Root, set[Root]], order: str = "size") -> tuple[dict[Root, int], list[int], dict[Root, int]]:
    """Greedy offsets (TFLite's offset planner, with several buffers): temporaries in `order`
    (_ORDERS), each into the tightest gap, in any buffer, that no temporary live at the same time occupies,
    else at the end of the buffer that grows least within `cap` bytes, else into a new buffer.
    A value larger than `cap` (bound through windows, bindsplit.py) opens a buffer of its own
    size. Two temporaries share bytes only when their [first, last] step ranges are disjoint,
    exactly the condition under which the slot assignment lets them share a slot.
    A temporary never joins a buffer holding one of its `apart` partners (_read_while_written).
    Ties go to the least waste, then the lower buffer, then the lower offset.
    Returns (buffer of each, buffer sizes, byte offset of each in its buffer).

    Every buffer is searched at once (numpy over the temporaries placed so far, sorted by buffer
    and offset): ResNet-50's step spreads 746 temporaries over 22 buffers, and a loop over the
    buffers took 0.14-0.23 s an order, 1.4 s of its 4.3 s of planning."""
    n = len(live)
    # Placed temporaries, in placement order
    p_off, p_end, p_first, p_last, p_buf = (np.zeros(n, dtype=np.int64) for _ in range(5))
    sizes: list[int] = []
    limits: list[int] = []
    slot_of: dict[Root, int] = {}
    offset_of: dict[Root, int] = {}
    for m, r in enumerate(sorted(live, key=_ORDERS[order](live, nbytes))):
        need = -(-nbytes[r] // align) * align
        f, la = live[r]
        best = None  # (bytes wasted or grown, grows, buffer, offset)
        if sizes:
            ok = np.ones(len(sizes), dtype=bool)
            for p in apart.get(r, ()):
                if p in slot_of:
                    ok[slot_of[p]] = False
            busy = np.flatnonzero((p_first[:m] <= la) & (f <= p_last[:m]))  # live at the same time as r
            busy = busy[ok[p_buf[busy]]]
            at = np.lexsort((p_off[busy], p_buf[busy]))
            b, o, e = p_buf[busy][at], p_off[busy][at], p_end[busy][at]
            # the bytes taken below each, within its buffer: one running max over all buffers
            lifted = np.maximum.accumulate(e + b * _SEGMENT)
            starts = np.ones(len(b), dtype=bool)
            starts[1:] = b[1:] != b[:-1]
            before = np.where(starts, 0, np.concatenate(([0], lifted[:-1])) - b * _SEGMENT)
            gaps = o - before
            fits = np.flatnonzero(gaps >= need)
            if len(fits):
                g = fits[np.lexsort((before[fits], b[fits], gaps[fits]))[0]]
                best = (int(gaps[g]) - need, 0, int(b[g]), int(before[g]))
            top = np.zeros(len(sizes), dtype=np.int64)   # each buffer's end above the busy ones
            np.maximum.at(top, b, e)
            spare = np.asarray(sizes, dtype=np.int64) - top - need   # < 0: the buffer grows by -spare
            ks = np.flatnonzero(ok & (top + need <= np.asarray(limits, dtype=np.int64)))
            if len(ks):
                grows = spare[ks] < 0
                cost = np.abs(spare[ks])
                i = np.lexsort((top[ks], ks, grows, cost))[0]
                cand = (int(cost[i]), int(grows[i]), int(ks[i]), int(top[ks[i]]))
                best = cand if best is None or cand < best else best
        if best is None:
            sizes.append(0)
            limits.append(max(cap, need))
            best = (0, 1, len(sizes) - 1, 0)
        _, _, k, off = best
        p_off[m], p_end[m], p_first[m], p_last[m], p_buf[m] = off, off + need, f, la, k
        sizes[k] = max(sizes[k], off + need)
        slot_of[r] = k
        offset_of[r] = off
    return slot_of, sizes, offset_of


def liveness_bound(plan: Plan, align: int = SLOT_ALIGN) -> int:
    """The least bytes any placement of the plan's temporaries needs: the peak over the kernel
    sequence of the (aligned) bytes of the temporaries live at once."""
    delta: dict[int, int] = {}
    for r, (f, la) in plan.live.items():
        n = -(-plan.nbytes[r] // align) * align
        delta[f] = delta.get(f, 0) + n
        delta[la + 1] = delta.get(la + 1, 0) - n
    peak = cur = 0
    for s in sorted(delta):
        cur += delta[s]
        peak = max(peak, cur)
    return peak


# Storage that never scales with the batch: parameters, optimizer state, constants, gradients
# computed into a parameter arena. A smaller batch cannot make these fit.
_FIXED_ROOTS = frozenset({"state", "const", "arena", "garena", "gslice"})


def _members(names: tuple[str, ...], what: str) -> str:
    listed = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{what}{'s' if len(names) > 1 else ''} {listed}"


def _batch_size(graph: Graph) -> int | None:
    """The batch: the leading dim of the first graph input that has one (a packed byte input is
    measured by the value it stands for, whose shape keeps the batch dim)."""
    for name in graph.inputs:
        shape = shape_of(graph, name.removeprefix(PACKED))
        if shape:
            return int(shape[0])
    return None


def _batch_leading(graph: Graph, name: str, batch: int | None) -> bool:
    info = graph.info.get(name.removeprefix(PACKED))
    return batch is not None and info is not None and len(info.shape) > 0 and int(info.shape[0]) == batch


def _size(n: int) -> str:
    """What a value needs, in MiB (KiB below 1 MiB) to a tenth, rounded up, so a need over the limit
    (written exactly, by adapters' _bytes) never prints as equal to it."""
    for unit, name in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            tenths = -(-n * 10 // unit)
            return f"{tenths // 10}{f'.{tenths % 10}' if tenths % 10 else ''} {name}"
    return f"{n} bytes"


def _root_label(graph: Graph, r: Root, labels: dict[Root, str]) -> str:
    """What a storage root is, in the user's words (parameter names, not arena ids)."""
    if r in labels:
        return labels[r]
    if r.kind == "state":
        return f"parameter/state tensor '{r.name}' (shape {tuple(shape_of(graph, r.name))})"
    if r.kind == "const":
        return f"constant '{r.name}' (shape {tuple(shape_of(graph, r.name))})"
    base, _, k = r.name.rpartition("@")
    if r.name not in graph.info and base and k.isdigit():  # lower_all's per-node scratch name
        return f"a scratch buffer of {_label(graph.nodes[int(k)])}"
    shape = shape_of(graph, r.name.removeprefix(PACKED)) if r.name.removeprefix(PACKED) in graph.info else None
    return f"value '{r.name}'" + (f" (shape {tuple(shape)})" if shape is not None else "")


def _check_limits(graph: Graph, caps: AdapterCaps, kernels, root_of, nbytes,
                  labels: dict[Root, str] | None = None) -> None:
    """Raise a DeviceError naming the value or kernel past an adapter limit, and what to change:
    a batch size only when the thing over the limit grows with the batch."""
    labels = labels or {}
    limit = caps.max_storage_binding_size
    batch = _batch_size(graph)
    # Values bound only through windows (bindsplit.py) never bind more than one window at a time.
    whole: dict[Root, int] = {}  # root -> the first node whose kernel binds all of it
    for k, kern in kernels:
        for v, w in zip(kern.reads + kern.writes, kern.windows or (None,) * len(kern.reads + kern.writes)):
            if w is None or w[1] > limit:
                whole.setdefault(root_of[v], k)

    def by(r: Root) -> str:  # the op that needs the value in one binding
        k = whole.get(r)
        if k is None:
            return ""
        op = graph.nodes[k].op.replace("wgpu.Fused", "fused elementwise")
        return f" (bound whole by the {op} kernel of {_label(graph.nodes[k])}, which is not split by rows)"

    over = sorted(((b, r) for r, b in nbytes.items() if b > limit and r in whole), key=lambda t: (-t[0], t[1].name))
    have = (f"but this adapter's max-storage-buffer-binding-size is {_bytes(limit)}")
    fixed = [(b, r) for b, r in over if r.kind in _FIXED_ROOTS]
    if fixed:
        b, r = fixed[0]
        raise DeviceError(
            f"{_root_label(graph, r, labels)}{by(r)} needs {_size(b)} {have}, and its size does not "
            "depend on the batch, so no batch size fits. Use an adapter with a larger limit (`anygrad "
            "devices` lists each adapter's limits), device='cpu', or a model with a smaller layer.")
    scaled = [(b, r) for b, r in over if _batch_leading(graph, r.name, batch)]
    if scaled and batch:
        per_sample = max(-(-b // batch) for b, _ in scaled)
        fit = limit // per_sample
        b, r = scaled[0]
        hint = (f"The largest batch that fits is about {fit}: use a batch size of at most {fit}, or another "
                "device." if fit else f"Even a batch of 1 needs {_size(per_sample)}: use another "
                "device or device='cpu'.")
        raise DeviceError(f"{_root_label(graph, r, labels)}{by(r)} needs {_size(b)} at batch {batch} "
                          f"{have}. {hint}")
    if over:
        b, r = over[0]
        raise DeviceError(
            f"{_root_label(graph, r, labels)}{by(r)} needs {_size(b)} {have}. Its leading dimension is "
            f"not the batch{f' ({batch})' if batch else ''}, so a smaller batch may not shrink it: try "
            "one, or an adapter with a larger limit (`anygrad devices`), or device='cpu'.")
    max_wg = caps.max_workgroups_per_dim
    for k, kern in kernels:
        n = len(kern.reads) + len(kern.writes)
        if n > caps.max_storage_buffers_per_stage:
            # bindpack.py packed what it could: only reads of 4-byte elements that fit one binding pack
            raise DeviceError(f"kernel {kern.name} of {_label(graph.nodes[k])} binds {n} storage buffers "
                              f"({len(kern.writes)} written); this adapter's max-storage-buffers-per-shader-stage "
                              f"is {caps.max_storage_buffers_per_stage}, and its reads cannot be packed into fewer. "
                              "Use another device (`anygrad devices` lists each adapter's limits) or device='cpu'.")
        if max(kern.workgroups) <= max_wg:
            continue
        # lower_all folded every grid that a 3-D dispatch can hold (gridfold.py): this one holds more.
        total, room = int(np.prod(kern.workgroups)), max_wg ** 3
        node = graph.nodes[k]
        outs = [o for o in node.outputs if o and o in graph.info]
        grows = any(_batch_leading(graph, o, batch) and root_of.get(o, Root("temp", o)).kind not in _FIXED_ROOTS
                    for o in outs)
        what = (f"kernel {kern.name} of {_label(node)} needs {total} workgroups {kern.workgroups}; this adapter's "
                f"max-compute-workgroups-per-dimension is {max_wg}, so a dispatch holds at most {room}.")
        if grows and batch:
            fit = batch * room // total  # the grid grows in proportion to the batch
            hint = (f"The largest batch that fits is about {fit}: use a batch size of at most {fit}, or another "
                    "device." if fit else "Even a batch of 1 is too large: use another device or device='cpu'.")
            raise DeviceError(f"{what} Its grid grows with the batch ({batch} now). {hint}")
        shapes = ", ".join(f"'{o}' {tuple(shape_of(graph, o))}" for o in outs) or "its output"
        raise DeviceError(f"{what} Its grid follows {shapes}, which does not depend on the batch, so a smaller "
                          "batch does not help: use another device or device='cpu'.")


def describe(plan: Plan) -> str:
    """Human-readable plan: kernels in order with their bindings, then buffers."""
    head = (f"{len(plan.steps)} kernels, {len(plan.slot_bytes)} temporary slots "
            f"({sum(plan.slot_bytes) >> 10} KiB), {len(plan.inplace)} in-place state updates")
    lines = [head]
    for s, st in enumerate(plan.steps):
        lines.append(f"  {s:3d} {st.kernel.name} {st.kernel.workgroups}")
    return "\n".join(lines)

