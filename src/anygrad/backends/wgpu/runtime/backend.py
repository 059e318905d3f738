"""The wgpu backend, the device side (tinygrad's device + allocator): the adapter's device
(context.py), state buffers (buffers.py) and pipelines. A compiled graph is a WgpuExecutable
(executable.py: running a step), whose dispatch list is built and encoded by encode.py.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from .... import _parallel, settings
from ....errors import DeviceError
from ....ir.graph import Graph, Node
from ....ir.passes import resolve_attributes
from ...base import Backend, _nothing
from ..device import implementation, pipeline_cache
from ..device.adapters import say_matrix_fallback, select_adapter
from ..device.shader_module import create_shader_module, shader_rejected
from ..fusion.passes import prepare
from ..kernels import halfstore
from ..kernels.kernel import REGISTRY, ops_where
from ..kernels.wgsl import workgroup_bytes
from ..planning.limits import get_profile, parse_size
from ..planning.planner import MemoryReport, fit_plan, memory_report, recompute_elementwise
from ..tuning import autotune
from .buffers import (
    _copy_mapped,
    _gpu_error,
    _mapped_view,
    _owned,
    _StateBuf,
    _unmapped,
    _wgpu,
    from_device,
    to_device,
)
from .context import _CONTEXTS, _context
from .executable import WgpuExecutable

UPLOAD_FLUSH = 64 << 20   # bytes of queued writes that may sit in wgpu staging memory (upload)



class WgpuBackend(Backend):
    """One wgpu adapter. State tensors live in device buffers, shared by all executables."""

    name = "wgpu"

    def __init__(self, device: str = "wgpu", limits: str | None = None, replica: int = 0,
                 memory_budget: int | str | None = None):
        """`limits`: a limits profile (limits.PROFILES) the device is created with, so that it
        enforces a weaker adapter's limits; None: ANYGRAD_WGPU_LIMITS, else the adapter's own.
        `replica` k > 0 opens the adapter's k-th extra device (data parallelism on one adapter).
        `memory_budget`: bytes (or '1.5GB') a compiled step may hold; None: the profile's."""
        info, adapter = select_adapter(device)
        self.adapter = info
        self.ctx = _context(info, adapter, get_profile(limits), replica)
        self.device = self.ctx.device
        self.caps = self.ctx.caps
        if memory_budget is not None:
            self.caps = replace(self.caps, memory_budget=parse_size(memory_budget, "memory_budget"),
                                memory_budget_set=True)
        self.state: dict[str, _StateBuf] = {}
        self.arenas: dict[str, Any] = {}  # arena value -> (buffer, ArenaSpec)
        self.generation = 0   # bumped when a state buffer is replaced (bind groups must follow)
        self._export_bufs: dict[tuple, list] = {}  # export_states_async's [buffer, size, last map], per list of names
        self._import_bufs: dict[tuple, Any] = {}  # import_states' mapped upload buffers, per list of names
        self._unflushed = 0   # bytes written by write_buffer since the last submit (staging held)
        self._flush_probe: Any = None
        self._hooks: list[Callable[[], None]] = []  # map requests of copies in the encoder being built

    def take_hooks(self) -> list[Callable[[], None]]:
        """What must run right after the encoder now being finished is submitted (submit())."""
        hooks, self._hooks = self._hooks, []
        return hooks

    def submit(self, command_buffer: Any, hooks: Sequence[Callable[[], None]] = ()) -> None:
        """queue.submit, then `hooks`: mappings of buffers the submitted work copies into, asked for
        at once. Where the device's poll thread blocks (wgpu-py's own: poller.py), it waits for
        the newest submission whenever a mapping is pending, so a map asked for only after later
        parts were submitted resolves at their end."""
        self.device.queue.submit([command_buffer])
        self._unflushed = 0  # the writes before it are in this submission: their staging goes with it
        for hook in hooks:
            hook()

    def check_precision(self, precision: str) -> str:
        """float16 needs the adapter's `shader-f16` feature (f16 storage and arithmetic in WGSL),
        and f16 kernels that pass the self-test (selftest.py, once per device); an adapter that
        fails it trains in f32, which this says in one line."""
        if precision != "f16":
            return precision
        if not self.caps.has_f16:
            raise DeviceError(f"precision='f16' needs the WebGPU feature 'shader-f16', which adapter "
                              f"{self.adapter.summary} does not have; train with --precision f32 "
                              "(precision='f32'), or pick another adapter (`anygrad devices`)")
        say_matrix_fallback(self.adapter, self.caps.adapter_facts, precision)  # Dawn without f16 matrices: once
        if self.ctx.f16_problem is None:
            from ..tuning.selftest import f16_problem
            self.ctx.f16_problem = f16_problem(self) or ""
        if self.ctx.f16_problem:
            print(f"anygrad: f16 self-test failed on {self.adapter.summary}: {self.ctx.f16_problem}; "
                  "training in f32", file=sys.stderr)
            return "f32"
        self._check_f16_math()
        return precision

    def _check_f16_math(self) -> None:
        """Allow f16 products (caps.f16_math: kernels_gemm.half_math) once their self-test passed on
        this device; an adapter that fails it keeps f32 products, which this says in one line.
        Not on software adapters (no f16 ALUs to gain from) nor with ANYGRAD_F16_MATH=0."""
        from ..kernels.gemm_wgsl import F16_MATH_ENV
        if self.caps.is_cpu or settings.get(F16_MATH_ENV) is False:
            return
        if self.ctx.f16_math_problem is None:
            from ..tuning.selftest import f16_math_problem
            plain = self.caps
            self.caps = replace(plain, f16_math=True)
            try:
                self.ctx.f16_math_problem = f16_math_problem(self) or ""
            finally:
                self.caps = plain
            if self.ctx.f16_math_problem:
                print(f"anygrad: f16-product self-test failed on {self.adapter.summary}: "
                      f"{self.ctx.f16_math_problem}; f16 training keeps f32 products", file=sys.stderr)
        if not self.ctx.f16_math_problem:
            self.caps = replace(self.caps, f16_math=True)

    @property
    def description(self) -> str:
        limits = f", limits {self.caps.limits_profile}" if self.caps.limits_profile else ""
        impl = ", Dawn" if self.adapter.implementation == "dawn" else ""
        return f"wgpu: {self.adapter.name} ({self.adapter.backend}, {self.adapter.type}{impl}{limits})"

    # -- buffers ------------------------------------------------------------------------------
    def create_buffer(self, nbytes: int, usage: int, label: str = "") -> Any:
        try:
            return self.device.create_buffer(size=max(16, -(-int(nbytes) // 16) * 16),
                                             usage=usage, label=label[:60])
        except Exception as e:
            raise _gpu_error(e, f"allocating {nbytes >> 20} MiB for '{label}'") from e

    @property
    def storage_usage(self) -> int:
        U = _wgpu().BufferUsage
        return U.STORAGE | U.COPY_SRC | U.COPY_DST

    # -- state ----------------------------------------------------------------------------------
    def upload(self, buffer: Any, offset: int, data: np.ndarray) -> None:
        """queue.write_buffer, without letting staging memory pile up: wgpu copies each write into
        a staging buffer of its own that lives until the next submit has run, so loading a model's
        parameters and optimizer state (1.3 GB for GPT-2 small with momentum) would first hold all
        of it twice on the device. Past UPLOAD_FLUSH bytes the writes are submitted and waited for."""
        self.device.queue.write_buffer(buffer, offset, data)
        self._unflushed += data.nbytes
        if self._unflushed >= UPLOAD_FLUSH:
            # a 4-byte readback submits the queued writes and waits for them (wgpu-py 0.32's
            # on_submitted_work_done_sync does not run against this wgpu-native)
            if self._flush_probe is None:
                self._flush_probe = self.create_buffer(16, self.storage_usage, "upload flush")
            self.device.queue.read_buffer(self._flush_probe, 0, 4)
            self._unflushed = 0

    def set_state(self, name: str, value: np.ndarray) -> None:
        """A new state tensor is only recorded here: its device buffer is made when something first
        needs it (placed_state), or never, when an executable packs it into an arena (pack_arena
        writes it there directly). Loading GPT-2 small made ~300 buffers that the arenas then
        replaced; freed, they left the allocator's 256 MB blocks pinned by the small buffers
        created beside them (~1 GB held for nothing)."""
        value = np.asarray(value)
        data = to_device(value)
        nbytes = max(4, data.nbytes)
        cur = self.state.get(name)
        if cur is None or cur.nbytes != nbytes:
            # A new size leaves any arena: the executables using it re-pack on their next run.
            # New buffers start zeroed (WebGPU's guarantee): zero optimizer state needs no upload.
            self.state[name] = _StateBuf(None, value.dtype, tuple(value.shape), nbytes,
                                         pending=_owned(data, value) if data.any() else None)
            self.generation += 1
            return
        cur.dtype, cur.shape = value.dtype, tuple(value.shape)
        if cur.buffer is None:
            cur.pending = _owned(data, value)
        elif data.nbytes:
            self.upload(cur.buffer, cur.offset, data)

    def placed_state(self, name: str) -> _StateBuf:
        """The state tensor with its device buffer made (and its pending value uploaded)."""
        st = self.state[name]
        if st.buffer is None:
            st.buffer = self.create_buffer(st.nbytes, self.storage_usage, f"state {name}")
            if st.pending is not None:
                self.upload(st.buffer, 0, st.pending)
            st.pending = None
        return st

    def get_state(self, name: str) -> np.ndarray:
        st = self.state[name]
        if st.buffer is None:
            raw = st.pending.tobytes()[:st.nbytes] if st.pending is not None else bytes(st.nbytes)
            return from_device(raw, st.dtype, st.shape)
        raw = self.read(st.buffer, st.nbytes, st.offset)
        return from_device(raw, st.dtype, st.shape)

    def get_state_shape(self, name: str) -> tuple:
        return self.state[name].shape

    def export_states(self, names: Sequence[str], out: np.ndarray) -> None:
        """float32 states back to back into `out` with one copy pass on the device, one map and one
        host copy, through a mapped staging buffer kept between calls (gradient exchange)."""
        self.export_states_async(names, out)()

    def export_view_async(self, names: Sequence[str], out: np.ndarray,
                          encoder: Any = None) -> Callable[[], tuple[np.ndarray, Callable[[], None]]]:
        """Backend.export_view_async through a mapped staging buffer of these names' own (kept
        between calls): this call queues the copies into it and asks to map it; the returned
        function waits for that map and gives the mapped memory itself as the vector (no host
        copy), valid until its release unmaps it. Buckets exported one after the other each get
        their own submission, so the first is read while the next copies. With `encoder` the
        copies go into it instead (a tap of WgpuExecutable.taps: mid-step), and the map is asked
        for when that encoder is submitted (take_hooks / submit, maybe on another thread: the
        returned function waits for it), or else when it is called."""
        spans = self._float32_spans(names)
        if spans is None:
            return super().export_view_async(names, out)
        total = sum(nbytes for _, _, nbytes, _ in spans)
        if total == 0:
            return lambda: (out[:0], _nothing)
        wgpu = _wgpu()
        key = tuple(names)
        held = self._export_bufs.get(key)
        if held is None or held[1] < total:
            held = [self.create_buffer(total, wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
                                       "state export"), total, None]
            self._export_bufs[key] = held
        buf = _unmapped(held[0], held[2])
        enc = encoder if encoder is not None else self.device.create_command_encoder()
        for src, at, nbytes, off in spans:
            enc.copy_buffer_to_buffer(src, at, buf, off, nbytes)
        promise: list[Any] = []
        asked = threading.Event()

        def request() -> None:
            try:
                promise.append(buf.map_async(wgpu.MapMode.READ))
                held[2] = promise[0]
            finally:
                asked.set()
        request.cancel = asked.set  # its part was never submitted: finish() raises
        if encoder is None:
            try:
                self.device.queue.submit([enc.finish()])
                request()
            except Exception as e:
                raise _gpu_error(e, "reading gradients back") from e
        else:
            self._hooks.append(request)

        def finish() -> tuple[np.ndarray, Callable[[], None]]:
            try:
                asked.wait()
                if not promise:
                    raise DeviceError("the gradient copy's submission failed")
                implementation.wait_mapped(buf, promise[0])  # an event wait: the GIL is free
                raw = _mapped_view(buf, total)  # writable: the all-reduce may sum in it in place
                view = (raw if raw is not None else np.frombuffer(buf.read_mapped(0, total, copy=False), np.uint8)
                        ).view(np.float32)
            except Exception as e:
                _unmapped(buf)
                raise _gpu_error(e, "reading gradients back") from e
            return view, lambda: _unmapped(buf)
        return finish

    def import_states(self, names: Sequence[str], flat: np.ndarray) -> None:
        """Each state's slice of the float32 vector `flat`, written in place (no new buffers):
        through import_view where there is one (filled over the host's threads), else
        write_buffer per span."""
        got = self.import_view(names)
        if got is not None:
            view, commit = got
            try:
                _parallel.copy(view, flat[:view.size])
            finally:
                commit()
            return
        spans = self._float32_spans(names)
        if spans is None:
            return super().import_states(names, flat)
        for buf, at, nbytes, off in spans:
            self.upload(buf, at, flat[off // 4:(off + nbytes) // 4])

    def drop_transfer_buffers(self) -> None:
        # between steps: no copy into or out of them is pending, and none is mapped for a reader
        for held in self._export_bufs.values():
            held[0].destroy()
        for staging in self._import_bufs.values():
            staging.destroy()
        self._export_bufs.clear()
        self._import_bufs.clear()

    def import_view(self, names: Sequence[str]) -> tuple[np.ndarray, Callable[[], None]] | None:
        """The float32 states `names` back to back as a mapped upload buffer of their own (kept
        between calls), and the commit that unmaps it and copies each span into its state (one
        submission): a gradient bucket written back mid-step, by the host straight into memory
        the GPU copies from. None where the device's poll blocks (poller.py: the map would wait
        for the whole step), the states are not all float32, or this wgpu-py cannot expose a
        mapped range as memory."""
        spans = self._float32_spans(names)
        if spans is None or not self.ctx.polls_freely:
            return None
        total = sum(nbytes for _, _, nbytes, _ in spans)
        if total == 0:
            return np.empty(0, np.float32), lambda: None
        wgpu = _wgpu()
        key = tuple(names)
        staging = self._import_bufs.get(key)
        if staging is not None and staging.size < total:
            staging.destroy()
            staging = None
        try:
            if staging is not None and staging.map_state != "mapped":  # (mapped: a failed step's, never committed)
                implementation.map_now(staging, wgpu.MapMode.WRITE)  # its last copy ran in an earlier step
            else:
                U = wgpu.BufferUsage
                staging = self.device.create_buffer(size=total, usage=U.COPY_SRC | U.MAP_WRITE,
                                                    mapped_at_creation=True, label="state import")
                self._import_bufs[key] = staging
            view = _mapped_view(staging, total)
        except Exception as e:
            raise _gpu_error(e, "writing gradients back") from e
        if view is None:
            staging.unmap()
            return None

        def commit() -> None:
            try:
                staging.unmap()
                enc = self.device.create_command_encoder()
                for buf, at, nbytes, off in spans:
                    enc.copy_buffer_to_buffer(staging, off, buf, at, nbytes)
                self.submit(enc.finish())
            except Exception as e:
                raise _gpu_error(e, "writing gradients back") from e
        commit.cancel = staging.unmap
        return view.view(np.float32), commit

    def _float32_spans(self, names: Sequence[str]) -> list[tuple[Any, int, int, int]] | None:
        """(buffer, byte offset, bytes, byte offset in the flat vector) of the float32 states
        `names` laid back to back, neighbours in one buffer merged into one span (an arena's
        members: one copy or upload instead of one per tensor); None if any is not float32."""
        spans: list[list] = []
        total = 0
        for n in names:
            st = self.placed_state(n)
            if np.dtype(st.dtype) != np.float32 or st.nbytes % 4:
                return None
            if spans and spans[-1][0] is st.buffer and spans[-1][1] + spans[-1][2] == st.offset:
                spans[-1][2] += st.nbytes
            elif st.nbytes:
                spans.append([st.buffer, st.offset, st.nbytes, total])
            total += st.nbytes
        return [tuple(sp) for sp in spans]

    def pack_arena(self, spec) -> None:
        """Place the arena's state tensors back to back in one buffer (copying their values), unless
        they already are. Executables binding the old buffers rebind (generation)."""
        held = self.arenas.get(spec.value)
        if held is not None and held[1] == spec and all(
                self.state[m].arena == spec.value and self.state[m].offset == off * 4
                for m, off in zip(spec.members, spec.offsets)):
            return
        buf = self.create_buffer(spec.total * 4, self.storage_usage, f"arena {spec.value}")
        enc = self.device.create_command_encoder()
        for m, off in zip(spec.members, spec.offsets):
            st = self.state[m]
            if st.buffer is not None and st.nbytes:
                enc.copy_buffer_to_buffer(st.buffer, st.offset, buf, off * 4, -(-st.nbytes // 4) * 4)
        self.device.queue.submit([enc.finish()])
        for m, off in zip(spec.members, spec.offsets):  # never placed: written straight into the arena
            st = self.state[m]
            if st.buffer is None and st.pending is not None:
                self.upload(buf, off * 4, st.pending)
        old = {id(self.state[m].buffer): self.state[m].buffer for m in spec.members
               if self.state[m].buffer is not None}
        for m, off in zip(spec.members, spec.offsets):
            st = self.state[m]
            st.buffer, st.offset, st.arena, st.pending = buf, off * 4, spec.value, None
        self.arenas[spec.value] = (buf, spec)
        self.generation += 1
        # Buffers no state or arena holds any more are freed now, not whenever Python drops them
        # (bind groups of executables built earlier keep them alive otherwise; those rebuild on
        # the generation change). wgpu frees them once the copy above has run.
        held = {id(st.buffer) for st in self.state.values()} | {id(b) for b, _ in self.arenas.values()}
        for key, b in old.items():
            if key not in held:
                b.destroy()

    def has_state(self, name: str) -> bool:
        return name in self.state

    def read(self, buffer: Any, nbytes: int, offset: int = 0) -> np.ndarray:
        """`nbytes` bytes of `buffer` from `offset`, as uint8. Through a mapped staging buffer and a
        parallel copy: wgpu-py's queue.read_buffer moved 45 MB in 62 ms on the H100 (this: ~3 ms),
        which made saving GPT-2 small's state take seconds."""
        if nbytes == 0:
            return np.empty(0, np.uint8)
        size = -(-nbytes // 4) * 4
        wgpu = _wgpu()
        staging = self.create_buffer(size, wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST, "readback")
        try:
            enc = self.device.create_command_encoder()
            enc.copy_buffer_to_buffer(buffer, offset, staging, 0, size)
            self.device.queue.submit([enc.finish()])
            out = np.empty(size, np.uint8)
            _copy_mapped(staging, staging.map_async(wgpu.MapMode.READ), out)
        except Exception as e:
            raise _gpu_error(e, "reading a result back") from e
        finally:
            staging.destroy()
        return out[:nbytes]

    # -- pipelines --------------------------------------------------------------------------------
    def layout(self, n_read_only: tuple[bool, ...]) -> tuple[Any, Any]:
        """Bind group + pipeline layout for bindings (True = read-only storage)."""
        key = n_read_only
        if key not in self.ctx.layouts:
            wgpu = _wgpu()
            bt = wgpu.BufferBindingType
            entries = [{"binding": k, "visibility": wgpu.ShaderStage.COMPUTE,
                        "buffer": {"type": bt.read_only_storage if ro else bt.storage}}
                       for k, ro in enumerate(key)]
            bgl = self.device.create_bind_group_layout(entries=entries)
            self.ctx.layouts[key] = (bgl, self.device.create_pipeline_layout(bind_group_layouts=[bgl]))
        return self.ctx.layouts[key]

    def device_wgsl(self, wgsl: str) -> str:
        """The shader as this device runs it: its f32 -> f16 conversions exact (halfstore.py) where
        the driver's own differ from IEEE rounding (probed once per device, on first use)."""
        if not halfstore.plain_conversions(wgsl):
            return wgsl
        if self.ctx.f16_rounding is None:
            from ..tuning.selftest import f16_register_problem, f16_rounding_problem
            # the probes' own shaders have no conversion functions (those would be swapped meanwhile)
            self.ctx.f16_rounding = self.ctx.f16_register = "(being probed)"
            self.ctx.f16_rounding, self.ctx.f16_register = f16_rounding_problem(self), f16_register_problem(self)
            for problem in (self.ctx.f16_rounding, self.ctx.f16_register):
                if problem:  # once per device: the kernels stay correct, a little slower
                    print(f"anygrad: {self.adapter.summary}: {problem}; those f16 conversions round "
                          "exactly in integer arithmetic instead", file=sys.stderr)
        return halfstore.exact_conversions(wgsl, stores=bool(self.ctx.f16_rounding),
                                           registers=bool(self.ctx.f16_register))

    def pipeline(self, wgsl: str, entry: str, read_only: tuple[bool, ...], name: str) -> Any:
        wgsl = self.device_wgsl(wgsl)
        key = (wgsl, entry, read_only)
        if key not in self.ctx.pipelines:
            pending, pipe = self.ctx.pending.pop(key, None), None
            if pending is not None:
                try:
                    pipe = pending.result()
                except Exception:  # noqa: BLE001, S110  (built again below: its error is raised on this thread)
                    pass
            self.ctx.pipelines[key] = pipe if pipe is not None else self._create_pipeline(key, name)
        return self.ctx.pipelines[key]

    def has_pipeline(self, wgsl: str, entry: str, read_only: tuple[bool, ...]) -> bool:
        """Whether pipeline() would return at once: built, or built in the background already."""
        key = (self.device_wgsl(wgsl), entry, read_only)
        pending = self.ctx.pending.get(key)
        return key in self.ctx.pipelines or (pending is not None and pending.done())

    def supports(self, op: str | Node) -> bool:
        """An op in this backend's lowering registry (an alias such as Reshape runs no kernel)."""
        return (op.op if isinstance(op, Node) else op) in REGISTRY

    def pipelines(self, specs: Sequence[tuple[str, str, tuple[bool, ...], str]], wait: bool = True) -> list[Any]:
        """pipeline() for each (wgsl, entry, read_only, name), the missing ones created in parallel
        (pipeline_cache.build_parallel: the driver compiles several shaders at once). With
        wait=False the builds start in the background and nothing is returned; pipeline() waits
        for each one when it is asked for."""
        specs = [(self.device_wgsl(w), e, ro, n) for w, e, ro, n in specs]
        names = {(w, e, ro): n for w, e, ro, n in specs}
        missing = [k for k in names if k not in self.ctx.pipelines and k not in self.ctx.pending]
        for k in missing:  # layouts first, on this thread: a pipeline and its bind groups share one
            self.layout(k[2])
        threaded = implementation.of(self.device).threaded(self.device)
        if not wait:
            if not threaded:
                return []  # built on this thread when pipeline() asks for each
            self.ctx.pending.update(pipeline_cache.build_background(lambda k: self._create_pipeline(k, names[k]),
                                                                    missing))
            return []
        for k, pipe in pipeline_cache.build_parallel(lambda k: self._create_pipeline(k, names[k]), missing,
                                                     threaded=threaded).items():
            self.ctx.pipelines[k] = pipe
        return [self.pipeline(*spec) for spec in specs]

    def _create_pipeline(self, key: tuple[str, str, tuple[bool, ...]], name: str) -> Any:
        wgsl, entry, read_only = key
        need = workgroup_bytes(wgsl)
        if need > self.caps.max_workgroup_storage:  # created without an error, it would fail unseen when run
            raise RuntimeError(f"wgpu kernel {name} needs {need} bytes of workgroup memory; adapter "
                               f"{self.adapter.summary} has {self.caps.max_workgroup_storage} (an anygrad bug: "
                               "please report it)")
        _, pl = self.layout(read_only)
        try:
            module = create_shader_module(self.device, wgsl, name[:60])
            return self.device.create_compute_pipeline(
                layout=pl, compute={"module": module, "entry_point": entry}, label=name[:60])
        except Exception as e:
            text = str(e)
            if "COMPUTE_SHADER" in text or "lost" in text.lower():
                _CONTEXTS.pop(self.adapter.index, None)
                raise DeviceError(f"adapter {self.adapter.summary} cannot run compute shaders "
                                  f"({text.strip().splitlines()[-1]}); use another device (`anygrad "
                                  "devices`), e.g. its Vulkan/Metal/DX12 adapter, or device='cpu'") from e
            raise shader_rejected(name, e, wgsl, implementation.of(self.device)) from e

    def plan_context(self, fuse: bool) -> tuple:
        """What a compiled plan depends on besides the graph: the adapter, its driver, the device's
        limits and features as the lowering sees them, anygrad's version, fusion, the state present."""
        from ....version import __version__
        a = self.adapter
        return (__version__, a.name, a.vendor, a.driver, a.backend, a.type, repr(self.caps), fuse,
                tuple(sorted(self.state)), autotune.settings(self.caps), recompute_elementwise())

    def prepared(self, graph: Graph, fuse: bool, measure: bool = True) -> Graph:
        """The graph as it is lowered: fused (fusion.prepare), then GEMM tilings pinned by the
        autotuner when it is on (timed now when `measure`, else only winners already stored)."""
        g = prepare(graph, self.caps, ops_where("epilogue"), fuse=fuse)
        if not autotune.enabled(self.caps):
            return g
        a = self.adapter
        context = (a.name, a.vendor, a.driver, a.backend, a.type, repr(self.caps))
        return autotune.tune(g, self.caps, context, autotune.device_timer(self) if measure else None)

    # -- compile ----------------------------------------------------------------------------------
    def memory_report(self, graph: Graph, fuse: bool = True) -> MemoryReport:
        """The device memory compiling `graph` would hold, planned as compile plans it, without
        building a pipeline or allocating a buffer (`anygrad info --batch-size`)."""
        _, plan, recomputed = fit_plan(graph, self.caps, set(graph.state_names) | set(self.state),
                                       lambda g: self.prepared(g, fuse, measure=False))
        return replace(memory_report(plan), recomputed=len(recomputed))

    def compile(self, graph: Graph, fuse: bool = True) -> WgpuExecutable:
        resolve_attributes(graph)  # before the plan cache's key: the graph as it is lowered
        for name in graph.state_names:
            if name not in self.state and name in graph.initializers:
                self.set_state(name, graph.initializers[name])
        return WgpuExecutable(self, graph, fuse=fuse)



def warn_cpu_fallback(reason: str) -> None:
    print(f"anygrad: {reason}; using the CPU (numpy) backend", file=sys.stderr)
