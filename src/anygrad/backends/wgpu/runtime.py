"""The wgpu backend: device, state buffers, pipelines, and the executor for compiled graphs.

Running a compiled step is: write the inputs, encode the prebuilt dispatch list into one compute
pass, copy state updates that could not be planned in place, copy fetched values into one staging
buffer, submit one new command buffer, and map the staging buffer only when something was fetched.
"""
from __future__ import annotations

import contextlib
import ctypes
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ... import _parallel, settings
from ...errors import DeviceError, ShapeError
from ...ir.graph import Graph, Node
from ...ir.passes import resolve_attributes
from ..base import NO_EXCHANGE, Backend, Exchange, Executable, _nothing
from . import autotune, halfstore, implementation, pipeline_cache
from .adapters import AdapterInfo, enabled_facts, say_matrix_fallback, select_adapter
from .fusion import packed_name, prepare
from .kernel import REGISTRY, AdapterCaps, ops_where
from .kernels_collective import HOST_PREFIX
from .limits import LimitsProfile, get_profile, parse_size
from .planner import MemoryReport, Root, fit_plan, memory_report, recompute_elementwise, value_bytes
from .poller import poll_freely
from .profiling import StepProfile, live_profiler, profile_dispatches, wall_ms
from .shader_module import create_shader_module, shader_rejected
from .wgsl import np_device_dtype, workgroup_bytes

UPLOAD_FLUSH = 64 << 20   # bytes of queued writes that may sit in wgpu staging memory (upload)
# In a data-parallel step an input at least this big is copied by the host's threads into a mapped
# buffer and from there into its input buffer by the step's first command: queue.write_buffer
# took 68-93 ms for a 308 MB ImageNet batch of 512 on an H200 host, this 11-15 ms.
STAGED_INPUT_BYTES = 16 << 20


EARLY_CHUNK = 16  # kernels in a tapped step's first submission, doubling up to its first tap


def _wgpu():
    """WebGPU's flag and enum constants (the same values in wgpu-native and Dawn: implementation.py)."""
    return implementation.flags()


@dataclass
class _Context:
    """One device per adapter per process, shared by every WgpuBackend on it (pipelines too)."""

    info: AdapterInfo
    device: Any
    caps: AdapterCaps
    pipelines: dict
    layouts: dict
    pending: dict = field(default_factory=dict)  # pipeline key -> Future of a build in the background
    f16_problem: str | None = None  # the f16 self-test's finding: None not run yet, "" passed
    f16_math_problem: str | None = None  # the same for f16 products (selftest.f16_math_problem)
    # the driver's f32 -> f16 conversion against IEEE's (selftest.f16_rounding_problem): None not
    # probed yet, "" it matches (kernels use it), else why kernels get halfstore.exact_conversions
    f16_rounding: str | None = None
    polls_freely: bool = False  # its poll thread does not block (poller.py): maps resolve mid-step


_CONTEXTS: dict[tuple[int, str], _Context] = {}


def _context(info: AdapterInfo, adapter: Any, profile: LimitsProfile | None = None, replica: int = 0) -> _Context:
    key = (info.index, profile.name if profile else "") + ((replica,) if replica else ())
    if key in _CONTEXTS:
        return _CONTEXTS[key]
    feats = [f for f in implementation.of(adapter).features if f in adapter.features]
    limits = profile.required_limits(dict(adapter.limits)) if profile else None
    try:
        device = adapter.request_device_sync(required_features=feats, required_limits=limits)
    except Exception as e:  # driver refuses: report, do not crash
        raise DeviceError(f"could not open adapter {info.summary}: {e}. Try another device "
                          "(`anygrad devices`) or device='cpu'.") from e
    lim = device.limits
    caps = AdapterCaps(
        max_storage_buffers_per_stage=int(lim["max-storage-buffers-per-shader-stage"]),
        max_storage_binding_size=int(lim["max-storage-buffer-binding-size"]),
        max_workgroup_storage=int(lim["max-compute-workgroup-storage-size"]),
        max_invocations_per_workgroup=int(lim["max-compute-invocations-per-workgroup"]),
        max_workgroups_per_dim=int(lim["max-compute-workgroups-per-dimension"]),
        has_subgroups="subgroup" in device.features, has_f16="shader-f16" in device.features,
        is_cpu=info.is_software, memory_budget=profile.memory_budget if profile else None,
        limits_profile=profile.name if profile else "",
        adapter_facts=enabled_facts(info.facts, device.features))
    ctx = _Context(info, device, caps, {}, {}, polls_freely=poll_freely(device))
    _CONTEXTS[key] = ctx
    return ctx


def _gpu_error(e: Exception, what: str) -> Exception:
    """Device-side failures a user can cause or meet become DeviceErrors; bugs stay bugs."""
    wgpu = _wgpu()
    text = str(e)
    if isinstance(e, getattr(wgpu, "GPUOutOfMemoryError", ())) or "out of memory" in text.lower():
        return DeviceError(f"out of device memory while {what}. Use a smaller batch or a smaller model.")
    if "lost" in text.lower():
        return DeviceError(f"the GPU device was lost while {what} ({text.splitlines()[0]}). "
                           "Restart the program; if it repeats, update the driver or use device='cpu'.")
    return e


@dataclass
class _StateBuf:
    buffer: Any
    dtype: np.dtype      # host dtype, restored by get_state
    shape: tuple
    nbytes: int
    offset: int = 0      # bytes; nonzero inside an arena
    arena: str = ""      # the arena holding it, if any
    pending: np.ndarray | None = None  # device bytes not yet uploaded (buffer is None until placed)


def to_device(value: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """Host array -> contiguous device representation (f32 / i32 / u32)."""
    value = np.asarray(value)
    dev = np_device_dtype(dtype if dtype is not None else value.dtype)
    data = np.ascontiguousarray(value.astype(dev, copy=False))
    if data.itemsize == 2 and data.size % 2:  # f16: whole 4-byte words, as buffer writes need
        data = np.concatenate([data.reshape(-1), np.zeros(1, data.dtype)])
    return data


def _owned(data: np.ndarray, value: np.ndarray) -> np.ndarray:
    """`data`, copied if it shares memory with the caller's array (held until it is uploaded)."""
    return data.copy() if np.may_share_memory(data, value) else data


def _cancel(hooks: Sequence[Callable[[], None]]) -> None:
    """Map requests whose copies were never submitted: their readers stop waiting (and raise)."""
    for hook in hooks:
        getattr(hook, "cancel", lambda: None)()


def _copy_mapped(buf: Any, mapping: Any, out: np.ndarray) -> None:
    """Wait for `mapping` (buf.map_async(READ); an event wait: the GIL is free), copy the first
    out.nbytes bytes of the mapped buffer into `out` over the threads, unmap."""
    implementation.wait_mapped(buf, mapping)
    try:
        _parallel.copy(out, np.frombuffer(buf.read_mapped(0, out.nbytes, copy=False), out.dtype))
    finally:
        buf.unmap()


def _unmapped(buf: Any, mapping: Any = None) -> Any:
    """A kept staging buffer, back to unmapped before new copies go into it. A step that failed
    mid-way may have left its map asked for and never read (pending or mapped, `mapping` its
    promise), and wgpu-native aborts the process on a submit that copies into a mapped buffer
    (docs/wgpu-facts.md); wgpu-py cannot unmap a pending map, so that one is waited for first."""
    state = getattr(buf, "map_state", "unmapped")
    if state == "pending" and mapping is not None:
        with contextlib.suppress(Exception):  # an aborted map leaves the buffer unmapped, as wanted
            mapping.sync_wait()
        state = buf.map_state
    if state == "mapped":
        buf.unmap()
    return buf


def _mapped_view(buf: Any, nbytes: int) -> np.ndarray | None:
    """The first nbytes of a mapped buffer as a writable uint8 array (wgpu-py's write_mapped copies
    on one thread, and its read_mapped views are read-only), or None where this wgpu-py has no
    such internals. Valid until the buffer is unmapped; writes into a read mapping are dropped
    then (WebGPU's semantics), so it may serve as scratch."""
    _api = implementation.of(buf).native_api  # wgpu-native's C API takes wgpu-native buffers only
    if _api is None:
        return None
    try:
        ptr = _api.libf.wgpuBufferGetMappedRange(buf._internal, 0, nbytes)
        address = int(_api.ffi.cast("intptr_t", ptr))
    except (ImportError, AttributeError):
        return None
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def to_device_packed(value: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """A 1-byte array as stored, for a packed input (fusion.pack_byte_inputs): its whole 4-byte
    words as a view of its bytes (no copy, no per-element work), and the last partial word
    zero-padded, if any. Bytes in memory order are what WGSL reads as little-endian u32 words,
    so the host's byte order does not matter."""
    raw = np.ascontiguousarray(value, dtype=dtype).reshape(-1).view(np.uint8)
    whole = raw.size & ~3
    if whole == raw.size:
        return raw, None
    tail = np.zeros(4, np.uint8)
    tail[:raw.size - whole] = raw[whole:]
    return raw[:whole], tail


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
            from .selftest import f16_problem
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
        from .kernels_gemm import F16_MATH_ENV
        if self.caps.is_cpu or settings.get(F16_MATH_ENV) is False:
            return
        if self.ctx.f16_math_problem is None:
            from .selftest import f16_math_problem
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
            from .selftest import f16_rounding_problem
            self.ctx.f16_rounding = "(being probed)"  # the probe's own shader has no conversion functions
            self.ctx.f16_rounding = f16_rounding_problem(self)
            if self.ctx.f16_rounding:  # once per device: the kernels stay correct, a little slower
                print(f"anygrad: {self.adapter.summary}: {self.ctx.f16_rounding}; f16 kernels round "
                      "exactly in integer arithmetic instead", file=sys.stderr)
        return halfstore.exact_conversions(wgsl) if self.ctx.f16_rounding else wgsl

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
        threaded = implementation.of(self.device).threaded_device  # Dawn: one thread per device
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
        from ... import __version__
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


def from_device(raw: bytes, dtype: np.dtype, shape: tuple) -> np.ndarray:
    dev = np_device_dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    arr = np.frombuffer(raw, dtype=dev, count=n)
    if np.dtype(dtype) == np.bool_:
        return (arr != 0).reshape(shape)
    return arr.astype(dtype).reshape(shape)


_READ_DECL = r"(@binding\({k}\)\s*var<storage,\s*)read>"


def writable_reads(wgsl: str, bindings: Sequence[int]) -> str:
    """Re-declare read-only bindings read_write: the same buffer is also written by this dispatch
    (in-place state update), and one usage scope may not mix read-only and writable views."""
    for k in bindings:
        wgsl, n = re.subn(_READ_DECL.format(k=k), r"\1read_write>", wgsl)
        if n != 1:
            raise RuntimeError(f"cannot find the declaration of binding {k} to make it writable")
    return wgsl


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


class WgpuExecutable(Executable):
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
        # Where the GPU waits for the inputs (Exchange.stage_inputs: a data-parallel step starts once
        # the last update is submitted), a big input goes through a mapped buffer of its own, filled
        # over the host's threads (_write_inputs). Alone, queue.write_buffer's one-core copy overlaps
        # the previous step, and mapping would wait for that step (docs/wgpu-facts.md).
        self._upload_bufs: dict[str, Any] = {}
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

    @property
    def holds_parts(self) -> bool:
        """Whether Exchange.hold_parts matters: only where the device's poll thread blocks (poller.py)."""
        return not self.backend.ctx.polls_freely

    # -- binding ----------------------------------------------------------------------------------
    def _buffer(self, r: Root) -> Any:
        if r.kind == "state":
            if r.name not in self.backend.state:
                raise DeviceError(f"state tensor '{r.name}' is not on the device; set it with set_state first")
            return self.backend.placed_state(r.name).buffer
        if r.kind == "arena":
            return self.backend.arenas[r.name][0]
        if r.kind in ("garena", "gslice"):
            return self.garenas[r.name]
        if r.kind == "input":
            return self.inputs[r.name]
        if r.kind == "const":
            return self.consts[r.name]
        return self.slots[self.plan.slot_of[r]]

    def _placeholder(self, k: int) -> Any:
        """A small storage buffer for binding k where a merged shader no longer reads it
        (_pipeline_spec): one per binding index, as writable bindings of a dispatch may not alias."""
        bufs = self.__dict__.setdefault("_placeholder_bufs", {})
        if k not in bufs:
            bufs[k] = self.backend.create_buffer(16, self.backend.storage_usage, f"unused binding {k}")
        return bufs[k]

    def _nbytes(self, r: Root) -> int:
        if r.kind == "state":
            return self.backend.state[r.name].nbytes
        return self.plan.nbytes[r]

    def _offset(self, r: Root) -> int:
        if r.kind == "state":
            return self.backend.state[r.name].offset
        return self.plan.slot_offset.get(r, 0) if r.kind == "temp" else r.offset

    def _storage(self, r: Root) -> tuple:
        """Which buffer a root lives in: one dispatch may not view a buffer both read-only and
        writable, so a read of a buffer the kernel also writes is bound read_write."""
        if r.kind in ("gslice", "garena"):
            return ("garena", r.name)
        if r.kind == "temp":
            return ("slot", self.plan.slot_of[r])
        return (r.kind, r.name)

    def _read_only(self, st) -> tuple[bool, ...]:
        written = {self._storage(r) for r in st.writes}
        return tuple(self._storage(r) not in written for r in st.reads) + (False,) * len(st.writes)

    def _pipeline_spec(self, st) -> tuple[str, str, tuple[bool, ...], str]:
        ro = self._read_only(st)
        shared = [k for k, r in enumerate(st.reads) if not ro[k]]
        wgsl = writable_reads(st.kernel.wgsl, shared) if shared else st.kernel.wgsl
        same = self._same_bytes(st, ro) if shared else {}
        if same:  # Dawn: no two writable bindings of one dispatch may alias (merged into one)
            wgsl, self._merged[id(st)] = implementation.merge_bindings(wgsl, same)
        return wgsl, st.kernel.entry, ro, st.kernel.name

    def _same_bytes(self, st, ro: tuple[bool, ...]) -> dict[int, int]:
        """Read binding k -> write binding j viewing the very same bytes (an in-place update),
        where the implementation enforces WebGPU's no-aliasing rule for writable bindings (Dawn)."""
        if implementation.of(self.backend.device).key == implementation.NATIVE:
            return {}
        roots = st.reads + st.writes
        windows = st.kernel.windows or (None,) * len(roots)

        def key(r: Root, win: Any) -> tuple:
            if r.kind == "state":
                return ("state", r.name, win)
            if r.kind == "temp":
                return ("slot", self.plan.slot_of[r], self.plan.slot_offset.get(r, 0), self.plan.nbytes.get(r), win)
            return (r.kind, r.name, r.offset, win)
        n_reads = len(st.reads)
        written = {key(roots[j], windows[j]): j for j in range(n_reads, len(roots))}
        return {k: written[key(roots[k], windows[k])] for k in range(n_reads)
                if not ro[k] and key(roots[k], windows[k]) in written}

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

    def _build(self) -> None:
        for spec in self.plan.arenas:
            self.backend.pack_arena(spec)
        dev = self.backend.device
        out = []
        for st, pipe in zip(self.plan.steps, self._pipes):
            bgl, _ = self.backend.layout(self._read_only(st))
            entries = []
            windows = st.kernel.windows or (None,) * (len(st.reads) + len(st.writes))
            merged = self._merged.get(id(st), {})
            for k, (r, win) in enumerate(zip(st.reads + st.writes, windows)):
                if k in merged:  # its shader reads through binding merged[k] (_pipeline_spec)
                    entries.append({"binding": k, "resource": {"buffer": self._placeholder(k), "offset": 0,
                                                               "size": 16}})
                    continue
                # a window: rows of a value larger than one binding (planner's binding split)
                off, size = (0, -(-self._nbytes(r) // 4) * 4) if win is None else win
                entries.append({"binding": k, "resource": {"buffer": self._buffer(r), "offset": self._offset(r) + off,
                                                           "size": size}})
            out.append((pipe, dev.create_bind_group(layout=bgl, entries=entries), st.kernel.workgroups))
        self._dispatches = out
        self._generation = self.backend.generation

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
        """`value` as `dtype` in input `name`'s upload buffer (mapped again: its last copy ran at
        the start of the last step), written over the host's threads; returns the buffer."""
        staging = self._upload_bufs.get(name)
        if staging is not None:
            implementation.map_now(staging, _wgpu().MapMode.WRITE)
        else:
            U = _wgpu().BufferUsage
            staging = self.backend.device.create_buffer(size=nbytes, usage=U.COPY_SRC | U.MAP_WRITE,
                                                        mapped_at_creation=True, label=f"upload {name}"[:60])
            self._upload_bufs[name] = staging
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
        uploads = self._write_inputs(feeds, ex.stage_inputs)
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

    def _encode_dispatches(self, enc: Any, ex: Exchange) -> tuple[Any, list[tuple[Any, list]]]:
        """The step's kernels in one compute pass, or with taps (the exchange's `ready`) one pass
        per stretch between them:
        at each tap the pass ends, the tap encodes its copies, and that part is finished.
        Where the device polls without blocking (poller.py) each part is submitted as it is
        encoded and its mappings asked for at once: each resolves when its part has run.
        Elsewhere parts are submitted as they are encoded until one asks for a mapping; the later
        ones are held and returned, to be submitted once the whole step is encoded, each right
        after the one before it has run: while a mapping is pending, wgpu-py polls until the
        newest submission is done and a submit waits for that poll (docs/wgpu-facts.md), so a
        mapping asked for after later parts were submitted would resolve only at the end.
        A host step (with the exchange's reducer) ends the pass, submits and runs on the host.
        Returns the encoder the rest of the step is encoded into, and the held parts."""
        at, n = 0, len(self._dispatches)
        taps = ex.ready
        hosted = {k - 1 for k in self._host_steps} if self._host_steps and ex.reduce is not None else set()
        held: list[tuple[Any, list]] = []
        asked = False
        free = not self.holds_parts
        cap = ex.hold_parts
        deferred: list[Callable[[], None]] = []  # cap 0: every map asked after the last part
        # Until the first tap nothing waits on a mapping: the first kernels go in doubling chunks,
        # so the GPU starts while the rest is encoded.
        first = min((k for k in taps if k < n), default=-1) if free or cap else -1
        early = {c - 1 for c in (EARLY_CHUNK << j for j in range(32)) if 0 < c <= first}
        try:
            for cut in sorted({k for k in taps if k < n} | hosted | {n - 1} | early):
                if cut >= at:
                    cpass = enc.begin_compute_pass()
                    for pipe, bg, wg in self._dispatches[at:cut + 1]:
                        cpass.set_pipeline(pipe)
                        cpass.set_bind_group(0, bg)
                        cpass.dispatch_workgroups(*wg)
                    cpass.end()
                    at = cut + 1
                if cut in taps:
                    taps[cut](enc)
                if cut in hosted:  # the next kernel is a host step: it runs on the host, between submissions
                    for part, hooks in held:
                        self._submit_part(part, hooks)
                    for hook in deferred:
                        hook()
                    held, asked, deferred = [], False, []
                    enc = self._host_step(enc, cut + 1, ex.reduce)
                    at = cut + 2
                elif (cut in early and not asked) or (free and cut in taps and cut < n - 1):
                    self._submit_part(enc.finish(), self.backend.take_hooks())
                    enc = self.backend.device.create_command_encoder()
                elif cut in taps and cut < n - 1 and not cap:
                    deferred += self.backend.take_hooks()
                    self.backend.submit(enc.finish())
                    enc = self.backend.device.create_command_encoder()
                elif cut in taps and cut < n - 1:
                    if asked and len(held) >= cap:
                        continue  # later taps' copies go with the next part held, or the last
                    hooks = self.backend.take_hooks()
                    if asked:
                        held.append((enc.finish(), hooks))
                    else:
                        self._submit_part(enc.finish(), hooks)
                        asked = bool(hooks)
                    enc = self.backend.device.create_command_encoder()
        except BaseException:  # the map requests not yet submitted: their readers raise, not wait
            _cancel([h for _, hooks in held for h in hooks] + deferred + self.backend.take_hooks())
            raise
        self._deferred = deferred
        return enc, held

    def _submit_part(self, part: Any, hooks: list[Callable[[], None]]) -> None:
        """A part of the step and the map requests of the copies in it; if the submit fails, those
        requests are cancelled, so that their readers raise instead of waiting for ever."""
        try:
            self.backend.submit(part, hooks)
        except BaseException:
            _cancel(hooks)
            raise

    def _host_step(self, enc: Any, k: int, reduce: Callable[[np.ndarray, str], np.ndarray]) -> Any:
        """Kernel k is a host step: submit the step so far with a copy of its input, wait, let the
        reducer sum it with the other replicas', write the result where the kernel writes, and
        return a fresh encoder for the rest. One GPU round trip per sum (SyncBatchNorm's cost)."""
        wgpu = _wgpu()
        st = self.plan.steps[k]
        src, dst = st.reads[0], st.writes[0]
        nbytes = value_bytes(self.prepared, st.kernel.reads[0])
        if k not in self._host_staging:
            U = wgpu.BufferUsage
            self._host_staging[k] = self.backend.create_buffer(nbytes, U.MAP_READ | U.COPY_DST, "host step")
        staging = self._host_staging[k]
        enc.copy_buffer_to_buffer(self._buffer(src), self._offset(src), staging, 0, nbytes)
        self.backend.submit(enc.finish(), self.backend.take_hooks())
        implementation.map_now(staging, wgpu.MapMode.READ)
        try:
            x = np.frombuffer(staging.read_mapped(0, nbytes, copy=True), np.float32)
        finally:
            staging.unmap()
        mode = st.kernel.name.rsplit(":", 1)[-1]
        y = np.ascontiguousarray(np.asarray(reduce(x, mode), np.float32).reshape(x.shape))
        self.backend.device.queue.write_buffer(self._buffer(dst), self._offset(dst), y)
        return self.backend.device.create_command_encoder()

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
        from .planner import describe
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


def warn_cpu_fallback(reason: str) -> None:
    print(f"anygrad: {reason}; using the CPU (numpy) backend", file=sys.stderr)
