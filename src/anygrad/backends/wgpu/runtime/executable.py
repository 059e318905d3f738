"""Running a compiled step (WgpuExecutable): compile its plan (or load it from the cache), build its
buffers and pipelines, write the inputs, encode (StepEncoder, encode.py), submit, and read the
fetched values back. Profiling a step's kernels lives here too.

Running a compiled step is: write the inputs, encode the prebuilt dispatch list into one compute
pass, copy state updates that could not be planned in place, copy fetched values into one staging
buffer, submit one new command buffer, and map the staging buffer only when something was fetched.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .... import _parallel, settings
from ....errors import DeviceError, ShapeError
from ....ir.graph import Graph
from ...base import NO_EXCHANGE, Exchange, Executable
from ..device import implementation, pipeline_cache
from ..fusion.passes import packed_name
from ..kernels.kernels_collective import HOST_PREFIX
from ..kernels.wgsl import np_device_dtype
from ..planning.planner import Root, fit_plan, value_bytes
from ..tuning import autotune
from ..tuning.profiling import StepProfile, live_profiler, profile_dispatches, spin, wall_ms
from .buffers import _cancel, _gpu_error, _mapped_view, _wgpu, from_device, to_device, to_device_packed
from .context import _CONTEXTS
from .encode import StepEncoder

if TYPE_CHECKING:
    from .backend import WgpuBackend

# In a data-parallel step an input at least this big is copied by the host's threads into a mapped
# buffer and from there into its input buffer by the step's first command: queue.write_buffer
# took 68-93 ms for a 308 MB ImageNet batch of 512 on an H200 host, this 11-15 ms.
STAGED_INPUT_BYTES = 16 << 20
# Upload buffers a big input cycles through: mapping one waits for the last step that copied from
# it, UPLOAD_RING steps back, which the GPU has finished while the host prepares this one. With
# one buffer the map waited for the previous step, and the GPU idled while the host filled it.
UPLOAD_RING = 2


@dataclass
class CompileTimes:
    """Where one executable's compile went, host seconds: planning (fusion, lowering, the memory
    plan) without the autotuner's part, the autotuner (timing its candidates while their pipelines
    build in the background), and the step's own pipelines (new ones built, the rest found built)."""
    plan_s: float = 0.0
    tune_s: float = 0.0
    tuned_shapes: int = 0
    tune_candidates: int = 0
    pipelines_s: float = 0.0
    pipelines_built: int = 0
    from_plan_cache: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


class WgpuExecutable(StepEncoder, Executable):
    def __init__(self, backend: WgpuBackend, graph: Graph, fuse: bool = True):
        self.backend = backend
        self.graph = graph
        # Within the memory budget: tighter reuse, else activations recomputed (planner.fit_plan);
        # from the disk cache when this graph was compiled before on this adapter and driver.
        self.compile_times = times = CompileTimes()
        t0, tuned = time.perf_counter(), dict(autotune.stats)
        self.prepared, self.plan, self.recomputed = self._compile_plan(graph, fuse)
        times.tune_s = autotune.stats["seconds"] - tuned["seconds"]
        times.plan_s = time.perf_counter() - t0 - times.tune_s
        times.tuned_shapes = autotune.stats["timed"] - tuned["timed"]
        times.tune_candidates = autotune.stats["candidates"] - tuned["candidates"]
        dev = backend.device
        usage = backend.storage_usage
        # Executable-owned storage: inputs, constants, temporary slots. A 1-byte input is written
        # packed into '@u8x4:<name>' (fusion.pack_byte_inputs); feed_to maps each input to its buffer.
        self.feed_to = {name: packed_name(name) if packed_name(name) in self.prepared.inputs else name
                        for name in graph.inputs}
        self.inputs = {to: backend.create_buffer(value_bytes(self.prepared, to), usage, f"input {name}")
                       for name, to in self.feed_to.items()}
        self.input_bytes: dict[str, int] = {}  # bytes the last run wrote per input (uploads)
        self.upload_s = 0.0  # host seconds the last run spent writing its inputs
        self.upload_at = 0.0  # when (perf_counter) that began: an exchanging caller's timeline
        # A big input goes up through mapped buffers of its own (UPLOAD_RING), filled over the
        # host's threads with the cast in the same pass (_write_inputs). queue.write_buffer copied
        # on one core into fresh staging memory: 24.6 ms a step for ResNet-50's 38.5 MB batch on
        # an H100's host, most of a 38.8 ms step (benchmarks/probes/step_gap.py, 2026-12-06).
        self._upload_bufs: dict[str, list[Any]] = {}
        # Arenas first: packing copies the state into them and frees the per-tensor buffers, and
        # done later (at the first run) that copy would briefly hold the parameters and optimizer
        # state twice beside every activation slot (1.3 GB more for GPT-2 small with momentum).
        for spec in self.plan.arenas:
            if all(m in backend.state for m in spec.members):
                backend.pack_arena(spec)
        self.consts: dict[str, Any] = {}
        for r, nbytes in self.plan.nbytes.items():
            if r.kind == "const":
                data = to_device(graph.initializers[r.name])
                buf = backend.create_buffer(nbytes, usage, f"const {r.name}")
                if data.nbytes:
                    backend.upload(buf, 0, data)
                self.consts[r.name] = buf
        self.slots = [backend.create_buffer(b, usage, f"slot {k}") for k, b in enumerate(self.plan.slot_bytes)]
        self.garenas = {r.name: backend.create_buffer(nbytes, usage, r.name)
                        for r, nbytes in self.plan.nbytes.items() if r.kind == "garena"}
        self.n_kernels = len(self.plan.steps)
        self._dispatches: list[tuple[Any, Any, tuple]] | None = None
        self._generation = -1
        self._staging: dict[tuple, tuple[Any, list]] = {}
        t0, known = time.perf_counter(), len(backend.ctx.pipelines)
        self._merged: dict[int, dict[int, int]] = {}  # id(step) -> bindings merged into others (Dawn)
        self._pipes = backend.pipelines([self._pipeline_spec(st) for st in self.plan.steps])  # compile every shader now
        times.pipelines_s, times.pipelines_built = time.perf_counter() - t0, len(backend.ctx.pipelines) - known
        self._overwritten = set(self.plan.inplace.values()) | {m for a in self.plan.arenas for m in a.members}
        # A state copied onto another state while itself replaced (a swap, a shift) is first held
        # in a buffer of its own, so every copy reads the value from before the step.
        targets = {t for _, t in self.plan.state_copies}
        self._holds = {r.name: backend.create_buffer(self._nbytes(r), usage, f"hold {r.name}")
                       for r, _ in self.plan.state_copies if r.kind == "state" and r.name in targets}
        # ANYGRAD_WGPU_PROFILE=1: GPU time per kernel on every run (profiling.py)
        self._profiler = live_profiler(dev, [st.kernel.name for st in self.plan.steps], f"graph '{graph.name}'",
                                       [st.kernel.flops for st in self.plan.steps])
        # A run's Exchange (backends.base) says after which kernels the caller encodes copies (its
        # `ready` taps), how many parts to hold, and how AllReduceSum sums: see _encode_dispatches.
        self._deferred: list[Callable[[], None]] = []
        # host steps (kernels_collective): AllReduceSum's sums over replicas (Exchange.reduce), on the host
        self._host_steps = {k for k, st in enumerate(self.plan.steps) if st.kernel.name.startswith(HOST_PREFIX)}
        self._host_staging: dict[int, Any] = {}

    def _compile_plan(self, graph: Graph, fuse: bool) -> tuple[Graph, Any, Any]:
        """The fused graph, its plan and what was recomputed to fit the budget: from the disk cache
        when this graph was compiled before on this adapter and driver (pipeline_cache; the caps in
        the key hold the memory budget), else built (planner.fit_plan) and stored. A plan built
        while the autotuner still had shapes to time (its budget per compile ran out) is not
        stored: kept, it would pin the rules on those shapes for every later compile, which would
        load it instead of tuning them."""
        backend = self.backend
        key = pipeline_cache.plan_key(graph, backend.plan_context(fuse)) if pipeline_cache.enabled() else ""
        cached = pipeline_cache.load(key, graph) if key else None
        if cached is not None and len(cached) == 3:
            self.compile_times.from_plan_cache = True
            return cached
        left = autotune.stats["left"]
        built = fit_plan(graph, backend.caps, set(graph.state_names) | set(backend.state),
                         lambda g: backend.prepared(g, fuse))
        if key and autotune.stats["left"] == left:
            pipeline_cache.save(key, graph, built)
        return built

    # -- run ----------------------------------------------------------------------------------------
    def _write_inputs(self, feeds: Mapping[str, np.ndarray], staged: bool = False) -> list[tuple[Any, Any, int]]:
        """Each input into its buffer. staged: a big one (STAGED_INPUT_BYTES) goes into a mapped
        buffer of its own (kept from step to step), filled over the host's threads, with the
        cast to the device type in the same pass; returns those (staging buffer, input buffer,
        bytes), for the step's encoder to copy first."""
        q = self.backend.device.queue
        copies = []
        for name in self.graph.inputs:
            if name not in feeds:
                raise ShapeError(f"input '{name}' was not given (inputs: {self.graph.inputs})")
            inf = self.graph.info[name]
            value = np.asarray(feeds[name])
            if tuple(value.shape) != tuple(inf.shape):
                raise ShapeError(f"input '{name}' has shape {tuple(value.shape)}; this executable was "
                                 f"compiled for {tuple(inf.shape)}")
            buf = self.inputs[self.feed_to[name]]
            if self.feed_to[name] != name:
                whole, tail = to_device_packed(value, inf.dtype)
                if whole.nbytes:
                    q.write_buffer(buf, 0, whole)
                if tail is not None:
                    q.write_buffer(buf, whole.nbytes, tail)
                self.input_bytes[name] = whole.nbytes + (0 if tail is None else tail.nbytes)
                continue
            dtype = np_device_dtype(inf.dtype)
            nbytes = value.size * dtype.itemsize
            if staged and nbytes >= STAGED_INPUT_BYTES and dtype.itemsize == 4 and \
                    np.can_cast(value.dtype, dtype, "same_kind"):
                copies.append((self._stage_input(name, value, dtype, nbytes), buf, nbytes))
                self.input_bytes[name] = nbytes
                continue
            data = to_device(value, inf.dtype)
            if data.nbytes:
                q.write_buffer(buf, 0, data)
            self.input_bytes[name] = data.nbytes
        return copies

    def _stage_input(self, name: str, value: np.ndarray, dtype: np.dtype, nbytes: int) -> Any:
        """`value` as `dtype` in the next of input `name`'s upload buffers (UPLOAD_RING; mapped
        again, its last copy ran UPLOAD_RING steps ago), written over the host's threads; returns
        the buffer."""
        ring = self._upload_bufs.setdefault(name, [])   # oldest first
        if len(ring) == UPLOAD_RING:
            staging = ring.pop(0)
            implementation.map_now(staging, _wgpu().MapMode.WRITE)
        else:
            U = _wgpu().BufferUsage
            staging = self.backend.device.create_buffer(size=nbytes, usage=U.COPY_SRC | U.MAP_WRITE,
                                                        mapped_at_creation=True, label=f"upload {name}"[:60])
        ring.append(staging)
        try:
            view = _mapped_view(staging, nbytes)
            if view is not None:
                _parallel.copy(view.view(dtype), value.reshape(-1))  # the cast in the same pass
            else:
                staging.write_mapped(to_device(value, dtype))
        finally:
            staging.unmap()
        return staging

    def _fetch_root(self, name: str) -> tuple[Root, int]:
        if self.feed_to.get(name, name) != name:  # a packed input: read its bytes as written
            r = Root("input", self.feed_to[name])
            return r, value_bytes(self.prepared, r.name)
        if name in self.plan.root_of:
            r = self.plan.root_of[name]
        elif name in self.backend.state:
            r = Root("state", name)
        elif name in self.graph.inputs:
            r = Root("input", name)
        elif name in self.consts:
            r = Root("const", name)
        else:
            raise KeyError(f"'{name}' is not a graph output, input or state of this executable")
        nbytes = value_bytes(self.graph, name) if name in self.graph.info else self._nbytes(r)
        return r, nbytes

    def _staging_for(self, fetch: tuple[str, ...]) -> tuple[Any, list]:
        if fetch not in self._staging:
            layout, offset = [], 0
            for name in fetch:
                r, nbytes = self._fetch_root(name)
                layout.append((name, r, offset, nbytes))
                offset += -(-nbytes // 16) * 16
            U = _wgpu().BufferUsage
            buf = self.backend.create_buffer(max(offset, 16), U.MAP_READ | U.COPY_DST, "staging")
            self._staging[fetch] = (buf, layout)
        return self._staging[fetch]

    def run(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None = None,
            exchange: Exchange | None = None) -> dict[str, np.ndarray]:
        wgpu = _wgpu()
        ex = exchange or NO_EXCHANGE
        fetch = tuple(self.graph.outputs if fetch is None else fetch)
        _cancel(self.backend.take_hooks() + self._deferred)  # left by a run that failed while encoding
        self._deferred = []
        t = time.perf_counter()
        uploads = self._write_inputs(feeds, settings.get("ANYGRAD_WGPU_STAGED_UPLOAD"))
        self.upload_at, self.upload_s = t, time.perf_counter() - t
        if self._dispatches is None or self._generation != self.backend.generation:
            self._build()
        try:
            enc = self.backend.device.create_command_encoder()
            for staging, buf, nbytes in uploads:
                enc.copy_buffer_to_buffer(staging, 0, buf, 0, nbytes)
            staging, layout = self._staging_for(fetch) if fetch else (None, [])
            # A fetched state that the step overwrites in place is read before the step, as the
            # numpy backend returns it; everything else after.
            early = [item for item in layout if item[1].kind == "state" and item[0] == item[1].name
                     and item[1].name in self._overwritten]
            for _, r, offset, nbytes in early:
                enc.copy_buffer_to_buffer(self._buffer(r), self._offset(r), staging, offset, -(-nbytes // 4) * 4)
            held: list[tuple[Any, list]] = []
            if self._dispatches and self._profiler is not None:
                self._profiler.encode(enc, self._dispatches)
                for step in sorted(ex.ready):  # profiled: the taps' copies after the whole pass
                    ex.ready[step](enc)
            elif self._dispatches:
                enc, held = self._encode_dispatches(enc, ex)
            # Fetched values are copied before state copies, so a fetched state reads as before the step.
            for item in layout:
                _, r, offset, nbytes = item
                if nbytes and item not in early:
                    enc.copy_buffer_to_buffer(self._buffer(r), self._offset(r), staging, offset,
                                              -(-nbytes // 4) * 4)
            for name, hold in self._holds.items():
                st = self.backend.placed_state(name)
                enc.copy_buffer_to_buffer(st.buffer, st.offset, hold, 0, -(-st.nbytes // 4) * 4)
            for r, target in self.plan.state_copies:
                st = self.backend.placed_state(target)
                nbytes = -(-min(self._nbytes(r), st.nbytes) // 4) * 4
                if not nbytes:
                    continue
                if r.kind == "state" and r.name in self._holds:
                    enc.copy_buffer_to_buffer(self._holds[r.name], 0, st.buffer, st.offset, nbytes)
                else:
                    enc.copy_buffer_to_buffer(self._buffer(r), self._offset(r), st.buffer, st.offset, nbytes)
            last = enc.finish()
            if ex.encoded is not None:
                ex.encoded()
            deferred, self._deferred = self._deferred, []
            try:
                for part, hooks in held:
                    self.backend.submit(part, hooks)
                    hooks.clear()
                self.backend.submit(last, deferred + self.backend.take_hooks())
            except BaseException:
                _cancel([h for _, hooks in held for h in hooks] + deferred + self.backend.take_hooks())
                raise
            if self._dispatches and self._profiler is not None:
                self._profiler.collect()
            if not fetch:
                return {}
            implementation.map_now(staging, wgpu.MapMode.READ)
            try:
                raw = bytes(staging.read_mapped())
            finally:
                staging.unmap()
        except (ShapeError, DeviceError):
            raise
        except Exception as e:
            err = _gpu_error(e, f"running graph '{self.graph.name}'")
            if isinstance(err, DeviceError) and "lost" in str(err):
                _CONTEXTS.pop(self.backend.adapter.index, None)  # the next backend opens a new device
            raise err from e
        out = {}
        for name, r, offset, nbytes in layout:
            if self.feed_to.get(name, name) != name:  # a packed input's own bytes
                inf = self.graph.info[name]
                out[name] = np.frombuffer(raw, np.uint8, inf.size, offset).view(inf.dtype).reshape(inf.shape)
                continue
            if name in self.graph.info:
                inf = self.graph.info[name]
                dtype, shape = inf.dtype, tuple(inf.shape)
            else:
                st = self.backend.state[name]
                dtype, shape = st.dtype, st.shape
            out[name] = from_device(raw[offset:offset + nbytes], dtype, shape)
        return out

    def ready_step(self, states: Sequence[str]) -> int | None:
        """Executable.ready_step: the last kernel writing these states (last_write)."""
        return self.last_write(states)

    def last_write(self, states: Sequence[str]) -> int | None:
        """The index of the last kernel writing any of these states in place, or None when one of
        them is written after the kernels (a state copy), sits in an arena, or is not written."""
        copied = {t for _, t in self.plan.state_copies} | {m for a in self.plan.arenas for m in a.members}
        if copied & set(states):
            return None
        last: dict[str, int] = {}
        for k, st in enumerate(self.plan.steps):
            for r in st.writes:
                if r.kind == "state":
                    last[r.name] = k
        found = [last.get(n) for n in states]
        return None if not found or None in found else max(found)

    def describe(self) -> str:
        from ..planning.planner import describe
        return describe(self.plan)

    def profile(self, feeds: Mapping[str, np.ndarray], repeat: int = 3) -> list[tuple[str, float]]:
        """Milliseconds per kernel (best of `repeat`), each dispatched and waited for alone. This
        runs the step's kernels `repeat` times, so state advances: profile a throwaway backend."""
        self._write_inputs(feeds)
        if self._dispatches is None or self._generation != self.backend.generation:
            self._build()
        dev = self.backend.device
        probe = self.backend.create_buffer(16, self.backend.storage_usage, "probe")
        best = [float("inf")] * len(self._dispatches)
        spin(dev, self._dispatches, wall_ms(dev, self._dispatches, probe), probe)  # the clock up first
        for _ in range(repeat):
            for k, dispatch in enumerate(self._dispatches):
                best[k] = min(best[k], wall_ms(dev, [dispatch], probe))
        return [(st.kernel.name, ms) for st, ms in zip(self.plan.steps, best)]

    def step_profile(self, feeds: Mapping[str, np.ndarray], repeat: int = 5) -> StepProfile:
        """GPU time per kernel from timestamp queries (each kernel in its own pass) and of the
        whole step in one pass, mean of `repeat` runs (profiling.py). The kernels run 3*repeat
        times, so state advances: profile a throwaway model or backend."""
        if "timestamp-query" not in self.backend.device.features:
            raise DeviceError(f"adapter {self.backend.adapter.summary} has no 'timestamp-query' "
                              "feature: no GPU profile (profile() times kernels by wall clock instead)")
        self._write_inputs(feeds)
        if self._dispatches is None or self._generation != self.backend.generation:
            self._build()
        probe = self.backend.create_buffer(16, self.backend.storage_usage, "probe")
        out = profile_dispatches(self.backend.device, [st.kernel.name for st in self.plan.steps],
                                 self._dispatches, repeat, probe)
        out.meta = {"adapter": self.backend.adapter.name, "graph": self.graph.name}
        out.flops = [st.kernel.flops for st in self.plan.steps]
        return out
