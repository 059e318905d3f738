"""GEMM/conv tilings timed on the real adapter when a step is compiled, the winners kept on disk.

`choose_tiling`'s rules were measured on one GPU (an H200) and cannot be right for every shape
on every adapter: an Intel iGPU, an M1 and an H100 want different tiles, and so do a ResNet's 1x1
stage-4 convs and GPT-2's vocabulary projection. So, as burn's autotune does, each GEMM-shaped
node of a compiled step (MatMul, Gemm, Conv and the conv gradients, fused epilogues included)
whose work is worth it is lowered with each candidate tiling pinned (the `_gemm_*` attributes that
tests and benchmarks already pin with), every distinct candidate is timed on the device with
buffers of the node's shapes, and the fastest is pinned on the node before planning.

Winners are stored per adapter, driver, device limits and anygrad source in
`$ANYGRAD_CACHE/wgpu-autotune/` (JSON: shape key -> pin), so a shape is timed once per machine
and later compiles only look the choice up. Timing is capped per compile (BUDGET_S, or
`ANYGRAD_AUTOTUNE_SECONDS`): a model with
many shapes (ResNet-18 at 224 px took 240 s uncapped on an H200) keeps the rules for the shapes
left over, and later compiles tune them. `ANYGRAD_AUTOTUNE=0` turns tuning off (the rule-based
tilings: a plan that does not depend on timing noise); `=1` turns it on also for software
adapters (lavapipe), where it is off by default because it only costs compile time there.

The K split is tuned too: the rules split K to fill the GPU (gemm_splitk.choose_splits), and
how many splits pay depends on the shape and the adapter (session 34, H100: GPT-2 small's attention
weight gradient ran at 0.63x cuBLAS with the rule's 4 splits and 0.70x with 8, while twice the
splits for every shape cost whole steps 1-10%). So the leading tiling of a shape's first timing
round, where it splits, is also timed at other split counts (SPLIT_FACTORS), in the confirming round,
and the fastest count is kept with it (`ANYGRAD_AUTOTUNE_SPLITS=0`: the rule's count). The
other confirmed leaders are timed unsplit there too (split_pins).

Results are the same numbers up to float32 summation order: a different tiling or split-K changes
the order of the K sum, so a tuned plan and an untuned one differ in the last bits, while two runs
of one plan give the same bits.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .... import settings as env_settings  # (`settings` below: what a tuned plan depends on)
from ....fsutil import atomic_write
from ....ir.graph import Graph, Node
from ..kernels.gemm_splitk import split_count
from ..kernels.halfstore import stored_half
from ..kernels.kernel import LOWERINGS, AdapterCaps, Kernel
from ..kernels.wgsl import workgroup_bytes
from ..planning.gridfold import fold_kernel
from .profiling import clock, encode_spin, spin, wall_ms

ENV = "ANYGRAD_AUTOTUNE"
SPLITS_ENV = "ANYGRAD_AUTOTUNE_SPLITS"
MAX_SPLITS = 4096  # gemm_splitk.choose_splits' own cap
# The K split counts the leading tiling is also timed at, as multiples of the rule's count s. Which
# count is fastest follows how the workgroups fill the GPU's waves, which WebGPU does not tell
# (H100, GPT-2 small's MLP output forward, 2048x3072x768 on 128x256 tiles, for which the rule
# splits 11 ways: 0.295 ms at 5 splits, 0.284 at 8, 0.328 at 12; on 128x128 tiles 0.337 at the
# rule's 6, 0.268 at 8; session 39): 3s/4 and 4s/3 besides s/2 and 2s sample the waves more finely
SPLIT_FACTORS = (0.5, 0.75, 4 / 3, 2.0)
TUNABLE_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvGradInput", "ConvGradWeight"})
PIN_ATTRS = ("_gemm_variant", "_gemm_block", "_gemm_kt", "_gemm_prefetch", "_gemm_unroll", "_gemm_tn", "_gemm_splits",
             "_gemm_threads", "_gemm_half")
# Candidate pins: the rules' own choice first (ties keep it), then each variant the GEMM
# generator has. A lowering that cannot take a candidate (a K tile over workgroup storage, dot
# on a shape it does not fit) raises, and the candidate is skipped.
CANDIDATES: tuple[dict[str, Any], ...] = (
    {},
    {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 8},
    {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 16},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 8},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16},
    # register prefetch of the next K tile, both ways (the rules prefetch plain GEMMs only)
    {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 16, "_gemm_prefetch": 1},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 0},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1, "_gemm_unroll": 2},
    # 8 x 16 outputs an invocation (128 x 256 tiles, as cuBLAS's SIMT kernels hold 128 accumulators):
    # H200, GPT-2 small's fc2 forward 0.38 -> 0.30 ms and LM-head input gradient 5.1 -> 4.9 ms, its
    # LM-head forward 4.8 -> 10.0 ms
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1, "_gemm_tn": 16},
    # two workgroup tiles, one barrier a K tile (Tiling.double; prefetch 2)
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 8, "_gemm_prefetch": 2},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 2},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 2, "_gemm_tn": 16},
    # f16 products (kernels_gemm.half_math), for float16 operands on a device that passed their
    # self-test; elsewhere these lower to an earlier candidate's kernels and are dropped as duplicates
    {"_gemm_half": 1},
    {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 16, "_gemm_prefetch": 1, "_gemm_half": 1},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1, "_gemm_half": 1},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 2, "_gemm_half": 1},
    {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1, "_gemm_tn": 16, "_gemm_half": 1},
    {"_gemm_variant": "register", "_gemm_block": 4},
    {"_gemm_variant": "register", "_gemm_block": 8},
    {"_gemm_variant": "dot"},
    # matrix units (kernels_mma.py; operands of a type the adapter's subgroup-matrix configs take,
    # elsewhere they raise and are skipped): 4 x 4 fragments a subgroup on 4 or 8 subgroups (H200,
    # 4096^3 f16: 119 and 178 TFLOP/s), 2 x 2 for shapes that fill the GPU only with small tiles
    {"_gemm_variant": "mma"},
    {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 128},
    {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 256},
    {"_gemm_variant": "mma", "_gemm_block": 2, "_gemm_threads": 128},
    {"_gemm_variant": "mma", "_gemm_block": 2, "_gemm_threads": 256},
    # ... with one 32-deep workgroup tile instead of the rules' two 16-deep ones (matrix_units.
    # RULE_DOUBLE_SUBGROUPS), and without the register prefetch of the next K tile (a gather's
    # registers may cost more occupancy than the overlap gains)
    {"_gemm_variant": "mma", "_gemm_prefetch": 1},
    {"_gemm_variant": "mma", "_gemm_prefetch": 0},
    {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 128, "_gemm_prefetch": 0},
)
MIN_FLOPS = 1 << 26     # smaller GEMMs take microseconds: launch overhead, not tiling, decides
REPEATS, ROUNDS = 8, 2  # at most this many runs per timing, best of rounds
CONFIRM = 3             # the fastest candidates of the first pass, timed once more (_Rounds)
TARGET_MS = 4.0         # runs per timing: enough to last about this long (one run of a slow conv is enough)
BUDGET_S = 20.0         # timing per compile; shapes left over keep the rules now and are tuned by later compiles
BUDGET_ENV = "ANYGRAD_AUTOTUNE_SECONDS"  # another budget (benchmarks: tune a whole model in one compile)
_MAX_FILE = 1 << 20     # a cache file larger than this is not ours: ignored

# "left": shapes a timed tuning left on the rules because the budget ran out (runtime/executable.py does not
# keep such a plan in the plan cache, so that a later compile tunes them and plans again)
stats = {"timed": 0, "cached": 0, "candidates": 0, "seconds": 0.0, "left": 0}


@dataclass(frozen=True)
class Pick:
    """What timing chose for one shape: the rules' kernels against the winner's, in ms a run
    (benchmarks print these beside a profile; the rules are rewritten from them)."""

    op: str
    shapes: tuple[tuple[int, ...], ...]   # the node's input shapes
    rule: tuple[str, ...]                 # kernel names of the rules' lowering
    rule_ms: float
    best: tuple[str, ...]                 # ... of the fastest candidate (the rules' own where they won)
    best_ms: float


picks: list[Pick] = []   # the shapes timed in this process, in order (the last MAX_PICKS)
MAX_PICKS = 4096         # a process compiling many graphs (a sweep) keeps a bounded report


def enabled(caps: AdapterCaps) -> bool:
    """Tuning for this adapter: ANYGRAD_AUTOTUNE=0/1, else on for real GPUs only."""
    forced = env_settings.get(ENV)
    return not caps.is_cpu if forced is None else forced


def tunes_splits() -> bool:
    """Whether a shape's leading tiling is also timed at other K splits (ANYGRAD_AUTOTUNE_SPLITS=0: no)."""
    return env_settings.get(SPLITS_ENV)


def settings(caps: AdapterCaps) -> tuple[bool, bool]:
    """What a tuned plan depends on besides its graph and adapter (for plan caches)."""
    return enabled(caps), tunes_splits()


def split_pins(pin: dict[str, Any], kernels: list[Kernel], leading: bool = True) -> list[dict[str, Any]]:
    """`pin` at the other K split counts tried: unsplit, and for the `leading` tiling also
    SPLIT_FACTORS times the count its lowering has; none where it does not split.

    Unsplit because the rules split to fill the GPU with workgroups, and on matrix units a
    tile's K loop can win anyway (H200, GPT-2 small's 768x3072x2048 weight gradient on 128x256
    tiles: at most 0.12 ms unsplit against 0.35 at the 4 splits tuning kept, which never timed 1)."""
    s = split_count(kernels)
    if s <= 1:
        return []
    scaled = {min(max(1, int(s * f)), MAX_SPLITS) for f in SPLIT_FACTORS} if leading else set()
    return [pin | {"_gemm_splits": v} for v in sorted(({1} | scaled) - {s})]


def _known(pin: Any) -> bool:
    """A pin the tuner can have stored: a candidate, optionally with a split count."""
    if not isinstance(pin, dict):
        return False
    splits = pin.get("_gemm_splits")
    base = {k: v for k, v in pin.items() if k != "_gemm_splits"}
    return base in CANDIDATES and (splits is None or (type(splits) is int and 1 <= splits <= MAX_SPLITS))


def cache_file(context: tuple) -> Path:
    root = env_settings.get("ANYGRAD_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "anygrad"
    from ..device.pipeline_cache import _source_hash
    digest = hashlib.sha256(repr((context, tunes_splits(), _source_hash())).encode()).hexdigest()[:32]
    return base / "wgpu-autotune" / f"{digest}.json"


def _load(path: Path) -> dict[str, dict[str, Any]]:
    """The stored winners; anything unreadable or not a known candidate is ignored (a cache can
    never make a compile fail or pick a tiling that is not one of ours)."""
    try:
        if path.stat().st_size > _MAX_FILE:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and _known(v)}


def shape_key(node: Node, graph: Graph) -> str:
    """What a tiling's speed depends on: the op, its attributes and its values' shapes and dtypes."""
    def desc(v: str) -> Any:
        info = graph.info.get(v) if v else None
        return None if info is None else (tuple(int(d) for d in info.shape), str(info.dtype))
    attrs = sorted((k, repr(v)) for k, v in node.attrs.items() if k not in PIN_ATTRS)
    text = repr((node.op, attrs, [desc(v) for v in node.inputs], [desc(v) for v in node.outputs]))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _pinned(node: Node, pin: dict[str, Any]) -> Node:
    attrs = {k: v for k, v in node.attrs.items() if k not in PIN_ATTRS} | pin
    return replace(node, attrs=attrs)


def tune(graph: Graph, caps: AdapterCaps, context: tuple, timer: Callable[[list[Kernel], Graph], float] | None
         ) -> Graph:
    """`graph` with a tiling pinned on every GEMM-shaped node worth tuning: the stored winner, or
    (with a `timer`) the fastest candidate, timed now and stored. Nodes already pinned (tests,
    benchmarks) keep their pin. Without a timer only stored winners are applied."""
    t0 = time.perf_counter()
    budget = _budget()
    path = cache_file(context)
    known = _load(path)
    nodes = list(graph.nodes)
    shapes: dict[str, list[int]] = {}  # shape key -> the nodes of that shape
    for k, node in enumerate(nodes):
        if node.op in TUNABLE_OPS and not any(a in node.attrs for a in PIN_ATTRS) and not _too_big(node, graph, caps):
            shapes.setdefault(shape_key(node, graph), []).append(k)
    # the work of one node a shape (it lowers the node: a transformer repeats each shape per layer)
    work = {key: _flops(nodes[ks[0]], graph, caps) for key, ks in shapes.items()}
    # most work first (a shape's FLOPs times its nodes): a budget that runs out mid-model leaves the
    # rules on the shapes that cost the step least (ResNet-50 f16 on Dawn: 71 shapes, 86 s to tune
    # them all, against 20 s a compile); ties keep the graph's order
    todo = {key: ks for key, ks in sorted(shapes.items(), key=lambda kv: -work[kv[0]] * len(kv[1]))
            if work[key] >= MIN_FLOPS}
    chosen = {key: known[key] for key in todo if key in known}
    stats["cached"] += len(chosen)
    if timer is not None:
        candidates = {key: _candidates(nodes[ks[0]], graph, caps) for key, ks in todo.items() if key not in chosen}
        prebuild = getattr(timer, "prebuild", None)
        if prebuild is not None:  # every candidate's pipelines, built in the background in the order timed
            prebuild([kern for cands in candidates.values() for _, kernels in cands for kern in kernels])
        rounds: dict[str, _Rounds] = {}
        for key, cands in candidates.items():  # every shape's first round, then every confirming round
            if time.perf_counter() - t0 > budget:
                break
            node = nodes[todo[key][0]]
            splits = (lambda pin, kernels, leading=True, node=node:
                      _candidates(node, graph, caps, split_pins(pin, kernels, leading))) if tunes_splits() else None
            rounds[key] = _Rounds(cands, graph, timer, splits, deadline=t0 + budget)
            stats["timed"] += 1
        new = {key: r.confirm() for key, r in rounds.items()}
        for key, r in rounds.items():
            if r.candidates:
                node = nodes[todo[key][0]]
                ins = tuple(tuple(graph.info[v].shape) if v in graph.info else () for v in node.inputs)
                picks.append(Pick(node.op, ins, r.names(0), r.times[0], r.names(r.best), r.times[r.best]))
        del picks[:-MAX_PICKS]
        chosen |= new
        if new:
            _store(path, known | new)
        stats["left"] += sum(1 for key in todo if key not in chosen)
    stats["seconds"] += time.perf_counter() - t0
    for key, ks in todo.items():
        if chosen.get(key):
            for k in ks:
                nodes[k] = _pinned(nodes[k], chosen[key])
    if not any(a is not b for a, b in zip(nodes, graph.nodes)):
        return graph
    out = graph.copy()
    out.nodes = nodes
    return out


def _budget() -> float:
    """Seconds of timing per compile: BUDGET_S, or ANYGRAD_AUTOTUNE_SECONDS when it is a number."""
    value = env_settings.get(BUDGET_ENV)
    return BUDGET_S if value is None else value


def _flops(node: Node, graph: Graph, caps: AdapterCaps) -> int:
    """The node's GEMM work as its rule-based lowering counts it (0: not a GEMM there)."""
    try:
        return sum(k.flops for k in LOWERINGS[node.op](node, graph, caps))
    except (ValueError, NotImplementedError, KeyError):
        return 0


def _too_big(node: Node, graph: Graph, caps: AdapterCaps) -> bool:
    """Values past one binding go through the planner's binding split: not timed alone here."""
    from ..planning.planner import value_bytes
    return any(v and v in graph.info and value_bytes(graph, v) > caps.max_storage_binding_size
               for v in list(node.inputs) + list(node.outputs))


def _candidates(node: Node, graph: Graph, caps: AdapterCaps, pins=CANDIDATES) -> list[tuple[dict[str, Any], list[Kernel]]]:
    """(pin, kernels) for each of `pins` the lowering takes, duplicates (the same shaders and
    grids as an earlier candidate) left out."""
    out, seen = [], set()
    for pin in pins:
        try:
            kernels = [fold_kernel(kern, caps.max_workgroups_per_dim)
                       for kern in stored_half(LOWERINGS[node.op](_pinned(node, pin), graph, caps), graph)]
        except (ValueError, NotImplementedError, KeyError, AssertionError):
            continue
        if any(workgroup_bytes(kern.wgsl) > caps.max_workgroup_storage for kern in kernels):
            continue   # a pipeline over the limit would fail only when dispatched
        text = tuple((kern.wgsl, kern.workgroups) for kern in kernels)
        if text not in seen:
            seen.add(text)
            out.append((pin, kernels))
    return out


class _Rounds:
    """One shape's timing: a first round of every candidate, then (confirm) the CONFIRM fastest
    and the first (the rules' own tiling) timed again, each keeping its better time. A slow spell
    of the device during one timing (seen on an H100: the same GEMM 4x slower for a whole
    benchmark case) then cannot make a candidate win, and the winner is stored for good.

    `variants(pin, kernels, leading)`: more candidates made from the first round's leader (its
    other K splits) and from the other leaders (leading=False: unsplit), timed in the confirming round beside the others, so they cost no round of their
    own. Their pipelines start building (the timer's `prebuild`) as soon as the first round has
    picked the leader, and tune() runs every shape's first round before any confirming round, so
    they build while other shapes are timed: built when first timed, one by one, they took about
    6 of GPT-2 small's 14.2 s cold compile (8.2 s now; H100, session 39). A timer with an `all` method times a
    list of candidates together (device_timer: one submission a round)."""

    def __init__(self, candidates: list[tuple[dict[str, Any], list[Kernel]]], graph: Graph, timer,
                 variants: Callable[[dict[str, Any], list[Kernel]], list] | None = None,
                 deadline: float | None = None):
        self.graph, self.timer, self.deadline = graph, timer, deadline
        self.candidates = list(candidates)
        self.best = 0   # (confirm) the winner's index
        if not candidates:
            return
        self.times = list(self.time_all([kernels for _, kernels in candidates]))
        leaders = [i for i in sorted(range(len(candidates)), key=self.times.__getitem__)[:CONFIRM]
                   if math.isfinite(self.times[i])]
        more = [] if variants is None or not leaders else list(variants(*candidates[leaders[0]]))
        for i in leaders[1:] if variants is not None else ():
            more += variants(*candidates[i], leading=False)
        self.candidates += more
        self.times += [float("inf")] * len(more)
        stats["candidates"] += len(self.candidates)
        self.again = sorted(set(leaders) | {0} | set(range(len(self.candidates) - len(more), len(self.candidates))))
        prebuild = getattr(timer, "prebuild", None)
        if prebuild is not None and more:
            prebuild([kern for _, kernels in more for kern in kernels])

    def time_all(self, lists: list[list[Kernel]]) -> list[float]:
        """Each list's time; inf for those left untimed because the deadline passed before their
        pipelines were built (never the first: the rules' own tiling is always timed). A pipeline
        costs 0.3-0.5 s on Dawn (one thread, H200), so a round checked only before it started
        overran a 20 s budget by 30-40 s."""
        together = getattr(self.timer, "all", None)
        if together is not None:
            return together(lists, self.graph, deadline=self.deadline)
        out = []
        for i, kernels in enumerate(lists):
            if i and self.deadline is not None and time.perf_counter() > self.deadline:
                return out + [math.inf] * (len(lists) - i)
            out.append(self.timer(kernels, self.graph))
        return out

    def confirm(self) -> dict[str, Any]:
        """The fastest candidate's pin, after the confirming round."""
        if not self.candidates:
            return {}
        times = self.times
        for i, t in zip(self.again, self.time_all([self.candidates[i][1] for i in self.again])):
            times[i] = min(times[i], t)
        best = 0
        for i in range(1, len(self.candidates)):
            if times[i] < times[best] * 0.97:  # a win within timing noise keeps the earlier (rule-based) choice
                best = i
        self.best = best
        return self.candidates[best][0]

    def names(self, i: int) -> tuple[str, ...]:
        return tuple(k.name for k in self.candidates[i][1])


def _store(path: Path, table: dict[str, dict[str, Any]]) -> None:
    """Never raises: a cache that cannot be written only costs the next compile its tuning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(table, sort_keys=True).encode(), fsync=False)
    except Exception:  # noqa: BLE001, S110
        pass


def device_timer(backend: Any) -> Callable[[list[Kernel], Graph], float]:
    """Milliseconds one run of a node's kernels takes on `backend`'s device: buffers of the
    node's shapes (contents irrelevant to the time: zeros), as many runs as last about TARGET_MS
    (at most REPEATS), best of ROUNDS after a warm-up.

    `timer.all(lists, graph)` times several candidates of one node together: one set of buffers
    for all of them (their values are the node's; scratch is the largest any asks for), and,
    where the device has timestamp queries, every candidate's runs in one submission a round, each
    in a pass of its own between two timestamps. So a node costs a few waits for the GPU instead
    of several per candidate (GPT-2 small: 263 candidates over 21 shapes took 8.8 s of a cold
    18 s compile on an H100 when each was timed alone)."""
    from ..planning.planner import value_bytes
    from .profiling import FEATURE, TimestampProfiler

    def buffers(lists: list[list[Kernel]], graph: Graph) -> dict[str, Any]:
        sizes: dict[str, int] = {}
        for kern in (k for kernels in lists for k in kernels):
            for sc in kern.scratch:
                sizes[sc.name] = max(sizes.get(sc.name, 0), 4 * max(1, int(sc.elements)))
            for v in kern.reads + kern.writes:
                if v not in sizes:
                    sizes[v] = value_bytes(graph, v) if v in graph.info else 16
        return {v: backend.create_buffer(n, backend.storage_usage, f"tune:{v}") for v, n in sizes.items()}

    def dispatches(kernels: list[Kernel], bufs: dict[str, Any]) -> list[tuple]:
        out = []
        for kern in kernels:
            ro = (True,) * len(kern.reads) + (False,) * len(kern.writes)
            bgl, _ = backend.layout(ro)
            pipe = backend.pipeline(kern.wgsl, kern.entry, ro, kern.name)
            entries = [{"binding": j, "resource": {"buffer": bufs[v], "offset": 0, "size": bufs[v].size}}
                       for j, v in enumerate(kern.reads + kern.writes)]
            out.append((pipe, backend.device.create_bind_group(layout=bgl, entries=entries), kern.workgroups))
        return out

    def walled(lists: list[list[tuple]], probe: Any) -> list[float]:
        def one(ds: list[tuple]) -> float:
            wall_ms(backend.device, ds, probe, 1)  # warm-up: lazy driver work, first touch of the buffers
            once = wall_ms(backend.device, ds, probe, 1)
            if clock.cold():
                spin(backend.device, ds, once, probe)  # the GPU's clock up (profiling.SPIN_MS)
            reps = max(1, min(REPEATS, int(TARGET_MS / max(once, 1e-3))))
            best = min([once] + [wall_ms(backend.device, ds, probe, reps) for _ in range(ROUNDS)])
            clock.mark()
            return best
        return [one(ds) for ds in lists]

    def stamped(lists: list[list[tuple]]) -> list[float]:
        prof = TimestampProfiler(backend.device, [str(i) for i in range(len(lists))])

        def round_ms(reps: list[int], spun: float = 0.0) -> np.ndarray:
            enc = backend.device.create_command_encoder()
            if spun:  # the GPU's clock up first (profiling.SPIN_MS), untimed, in the same submission
                encode_spin(enc, lists[0], spun)
            prof.encode_runs(enc, [ds * r for ds, r in zip(lists, reps)])
            backend.device.queue.submit([enc.finish()])
            return prof.collect_ns() / 1e6 / np.asarray(reps)

        cold = clock.cold()
        warm = round_ms([1] * len(lists))   # lazy driver work, first touch; then a first estimate
        reps = [max(1, min(REPEATS, int(TARGET_MS / max(float(t), 1e-3)))) for t in warm]
        rounds = [round_ms(reps, spun=float(warm[0]) if r == 0 and cold else 0.0) for r in range(ROUNDS)]
        clock.mark()
        return [float(t) for t in np.min(rounds, axis=0)]

    def built(kernels: list[Kernel]) -> bool:
        return all(backend.has_pipeline(k.wgsl, k.entry, (True,) * len(k.reads) + (False,) * len(k.writes))
                   for k in kernels)

    def time_all(lists: list[list[Kernel]], graph: Graph, deadline: float | None = None) -> list[float]:
        """Each list's milliseconds; past `deadline`, lists whose pipelines are not built yet are
        left out (inf), except the first."""
        bufs = buffers(lists, graph)
        try:
            timed, ds = [], []
            for i, kernels in enumerate(lists):  # building is what takes the time: checked between builds
                if i and deadline is not None and time.perf_counter() > deadline and not built(kernels):
                    continue
                timed.append(i)
                ds.append(dispatches(kernels, bufs))
            ms = stamped(ds) if FEATURE in backend.device.features else walled(ds, next(iter(bufs.values())))
            out = [math.inf] * len(lists)
            for i, t in zip(timed, ms):
                out[i] = t
            return out
        finally:
            for b in bufs.values():
                b.destroy()

    def timer(kernels: list[Kernel], graph: Graph) -> float:
        return time_all([kernels], graph)[0]

    def prebuild(kernels: list[Kernel]) -> None:
        backend.pipelines([(k.wgsl, k.entry, (True,) * len(k.reads) + (False,) * len(k.writes), k.name)
                           for k in kernels], wait=False)

    timer.all = time_all
    timer.prebuild = prebuild
    return timer


__all__ = ["CANDIDATES", "ENV", "SPLITS_ENV", "TUNABLE_OPS", "device_timer", "enabled", "settings", "shape_key",
           "split_pins", "tune", "tunes_splits"]
