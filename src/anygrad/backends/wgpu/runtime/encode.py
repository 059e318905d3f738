"""Encoding a compiled step: binding each kernel's values to buffers (bind groups, Dawn's merged
bindings), the prebuilt dispatch list, and encoding it into compute passes (with an exchange's
taps, held parts and host steps). StepEncoder is WgpuExecutable's encoding half; it reads the
executable's plan, backend and buffers (set up in executable.py); it submits the parts it
encodes, the executable writes inputs and reads results.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ....errors import DeviceError
from ...base import Exchange
from ..device import implementation
from ..planning.planner import Root, value_bytes
from .buffers import _cancel, _wgpu

EARLY_CHUNK = 16  # kernels in a tapped step's first submission, doubling up to its first tap


_READ_DECL = r"(@binding\({k}\)\s*var<storage,\s*)read>"


def writable_reads(wgsl: str, bindings: Sequence[int]) -> str:
    """Re-declare read-only bindings read_write: the same buffer is also written by this dispatch
    (in-place state update), and one usage scope may not mix read-only and writable views."""
    for k in bindings:
        wgsl, n = re.subn(_READ_DECL.format(k=k), r"\1read_write>", wgsl)
        if n != 1:
            raise RuntimeError(f"cannot find the declaration of binding {k} to make it writable")
    return wgsl


class StepEncoder:
    """Bind groups, the dispatch list and its encoding, for WgpuExecutable (which owns the state)."""

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
