"""GPU time per kernel of a compiled wgpu step, from timestamp queries (opt-in).

Two ways in, both needing the adapter's `timestamp-query` feature (the backend requests it
whenever the adapter has it):

- `WgpuExecutable.step_profile(feeds, repeat)`: runs the step `repeat` times and returns a
  `StepProfile` (per kernel, per op kind, and the whole step timed as the executor runs it).
- `ANYGRAD_WGPU_PROFILE=1` in the environment: every executable records its kernels on every run
  (each run then waits for the GPU, so throughput drops) and a table per executable is printed to
  stderr when the process exits.

Each dispatch is encoded in a compute pass of its own with beginning/end timestamp writes (the
portable WebGPU way; writes inside a pass are a native extension). Passes are a few microseconds
apart on the GPU, so the kernel times add up to slightly more than the one-pass step; both are
reported. Timestamps are taken as nanoseconds: wgpu-py exposes no timestamp period, and it is 1 on
the Vulkan drivers measured (NVIDIA, lavapipe); `StepProfile.wall_ms` lets a reader check that.
"""
from __future__ import annotations

import atexit
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .... import settings

ENV = "ANYGRAD_WGPU_PROFILE"
FEATURE = "timestamp-query"
_MAX_QUERIES = 4096  # wgpu's limit on one query set


def enabled() -> bool:
    return settings.get(ENV)


def op_kind(kernel_name: str) -> str:
    """The op family of a kernel name: 'Conv[register 8x128]' -> 'Conv', 'ew:ReluGrad' ->
    'elementwise', 'ew:AdagradUpdatex14' -> 'optimizer update', 'BatchNorm:stats' -> 'BatchNorm'."""
    if kernel_name.startswith("ew:"):
        return "optimizer update" if "Update" in kernel_name else "elementwise"
    kind = re.split(r"[\[:]", kernel_name, maxsplit=1)[0]
    return f"{kind} splitK reduce" if "splitK reduce" in kernel_name else kind


@dataclass
class StepProfile:
    """GPU nanoseconds of one step's kernels, averaged over `runs` runs."""

    kernels: list[tuple[str, float]]      # (kernel name, mean ns), in dispatch order
    runs: int
    step_ns: float | None = None          # the whole step in one pass, as the executor encodes it
    wall_ms: float | None = None          # host wall time of one one-pass step, submit to readback
    meta: dict = field(default_factory=dict)
    flops: list[int] = field(default_factory=list)  # per kernel where known (GEMMs), else 0

    def tflops(self, i: int) -> float | None:
        """Kernel i's rate in TFLOP/s, where its FLOPs are known."""
        fl = self.flops[i] if i < len(self.flops) else 0
        ns = self.kernels[i][1]
        return fl / ns / 1e3 if fl and ns > 0 else None

    @property
    def kernel_ns(self) -> float:
        return float(sum(ns for _, ns in self.kernels))

    def by_kind(self) -> list[tuple[str, int, float]]:
        """(op kind, kernels, ns) sorted by time, largest first."""
        acc: dict[str, list] = {}
        for name, ns in self.kernels:
            a = acc.setdefault(op_kind(name), [0, 0.0])
            a[0] += 1
            a[1] += ns
        return sorted(((k, n, ns) for k, (n, ns) in acc.items()), key=lambda t: -t[2])

    def by_gemm(self) -> list[tuple[str, int, int, float]]:
        """(kernel name, FLOPs of one, kernels, ns) per GEMM of one tiling and size (kernels whose
        FLOPs are known), largest total first: a transformer's 12 layers make one row each."""
        acc: dict[tuple[str, int], list] = {}
        for (name, ns), fl in zip(self.kernels, self.flops):
            if fl:
                a = acc.setdefault((name, fl), [0, 0.0])
                a[0] += 1
                a[1] += ns
        return sorted(((name, fl, n, ns) for (name, fl), (n, ns) in acc.items()), key=lambda t: -t[3])

    def top(self, n: int = 10) -> list[tuple[int, str, float]]:
        """The n slowest kernels: (dispatch index, name, ns)."""
        return sorted(((i, name, ns) for i, (name, ns) in enumerate(self.kernels)), key=lambda t: -t[2])[:n]

    def as_dict(self) -> dict:
        return {"runs": self.runs, "step_ns": self.step_ns, "wall_ms": self.wall_ms,
                "kernel_ns": self.kernel_ns, "kernels": [list(k) for k in self.kernels], "flops": list(self.flops),
                "by_kind": [list(k) for k in self.by_kind()], **self.meta}

    def format(self, title: str = "step", top: int = 10) -> str:
        total = self.kernel_ns or 1.0
        lines = [f"GPU profile of {title}: {len(self.kernels)} kernels, sum {self.kernel_ns / 1e3:.1f} us"
                 + (f", one-pass step {self.step_ns / 1e3:.1f} us" if self.step_ns else "")
                 + (f", wall {self.wall_ms * 1e3:.0f} us" if self.wall_ms else "")
                 + f" (mean of {self.runs} runs)",
                 f"  {'op kind':28s} {'kernels':>7s} {'us':>9s} {'share':>6s}"]
        for kind, n, ns in self.by_kind():
            lines.append(f"  {kind:28s} {n:7d} {ns / 1e3:9.1f} {100 * ns / total:5.1f}%")
        gemms = self.by_gemm()
        if gemms:
            lines.append(f"  GEMMs by tiling and size: {'GFLOP':>8s} {'kernels':>7s} {'us each':>9s} {'TFLOP/s':>8s}")
            for name, fl, n, ns in gemms[:top]:
                lines.append(f"  {name:40s} {fl / 1e9:8.3f} {n:7d} {ns / n / 1e3:9.1f} {fl * n / ns / 1e3:8.1f}")
        lines.append("  slowest kernels:")
        for i, name, ns in self.top(top):
            rate = self.tflops(i)
            lines.append(f"  #{i:<3d} {name:40s} {ns / 1e3:9.1f} us {100 * ns / total:5.1f}%"
                         + (f" {rate:6.1f} TFLOP/s" if rate else ""))
        return "\n".join(lines)


class TimestampProfiler:
    """Encodes a dispatch list one pass per dispatch with timestamp writes, and accumulates the
    resolved times. One profiler per executable; `encode` then `collect` once per submit."""

    def __init__(self, device: Any, names: Sequence[str]):
        from ..device.implementation import flags
        wgpu = flags()
        if FEATURE not in device.features:
            raise RuntimeError(f"the device has no '{FEATURE}' feature")
        self.device, self.names = device, list(names)
        self.flops: list[int] = []   # per kernel, where known: the profile prints rates
        self.count = 2 * len(self.names) + 2    # two per kernel, two for a whole one-pass step
        self.sets = [device.create_query_set(type=wgpu.QueryType.timestamp, count=min(_MAX_QUERIES, self.count - s))
                     for s in range(0, self.count, _MAX_QUERIES)]
        U = wgpu.BufferUsage
        # kernel pairs from byte 0, the whole-step pair at the next 256-byte boundary (resolve
        # offsets must be aligned to 256)
        self.whole_at = -(-8 * (self.count - 2) // 256) * 256
        self.nbytes = self.whole_at + 16
        self.resolved = device.create_buffer(size=self.nbytes, usage=U.QUERY_RESOLVE | U.COPY_SRC)
        self.readback = device.create_buffer(size=self.nbytes, usage=U.MAP_READ | U.COPY_DST)
        self.sum_ns = np.zeros(len(self.names))
        self.step_sum_ns = 0.0
        self.runs = self.step_runs = 0
        self._whole = False

    def _writes(self, q: int) -> dict:
        return {"query_set": self.sets[q // _MAX_QUERIES], "beginning_of_pass_write_index": q % _MAX_QUERIES,
                "end_of_pass_write_index": q % _MAX_QUERIES + 1}

    def encode(self, enc: Any, dispatches: Sequence[tuple], whole: bool = False) -> None:
        """Per-kernel passes; with `whole`, then the same dispatches once more in one pass."""
        for k, dispatch in enumerate(dispatches):
            encode_pass(enc, [dispatch], timestamp_writes=self._writes(2 * k))
        self._whole = whole
        if whole:
            encode_pass(enc, dispatches, timestamp_writes=self._writes(self.count - 2))
        # Resolve only queries written in this command buffer: Vulkan waits for the availability
        # of every resolved query, so an unwritten one would hang the queue (seen on NVIDIA).
        self._resolve(enc, 0, self.count - 2, 0)
        if whole:
            self._resolve(enc, self.count - 2, self.count, self.whole_at)
        enc.copy_buffer_to_buffer(self.resolved, 0, self.readback, 0, self.nbytes)

    def encode_runs(self, enc: Any, runs: Sequence[Sequence[tuple]]) -> None:
        """Each dispatch list of `runs` in a pass of its own between two timestamps, one list per
        name (the autotuner's candidates); `collect_ns` reads their times."""
        for k, dispatches in enumerate(runs):
            encode_pass(enc, dispatches, timestamp_writes=self._writes(2 * k))
        self._whole = False
        self._resolve(enc, 0, 2 * len(runs), 0)
        enc.copy_buffer_to_buffer(self.resolved, 0, self.readback, 0, self.nbytes)

    def _resolve(self, enc: Any, first: int, end: int, offset: int) -> None:
        """Queries [first, end) into the resolve buffer from byte `offset` (split at set ends,
        which fall on 32 KiB: aligned)."""
        while first < end:
            s, q = divmod(first, _MAX_QUERIES)
            n = min(end - first, _MAX_QUERIES - q)
            enc.resolve_query_set(self.sets[s], q, n, self.resolved, offset)
            first, offset = first + n, offset + 8 * n

    def _read(self) -> np.ndarray:
        """Wait for the submitted work; the resolved timestamps."""
        from ..device.implementation import flags, map_now
        map_now(self.readback, flags().MapMode.READ)
        try:
            return np.frombuffer(bytes(self.readback.read_mapped()), np.uint64).astype(np.int64)
        finally:
            self.readback.unmap()

    def _pairs_ns(self, t: np.ndarray) -> np.ndarray:
        """End minus beginning of each name's pair of timestamps."""
        k = len(self.names)
        return np.maximum(t[1:2 * k:2] - t[0:2 * k:2], 0).astype(np.float64)

    def collect_ns(self) -> np.ndarray:
        """Wait for the submitted work; nanoseconds of each name's pass (encode_runs)."""
        return self._pairs_ns(self._read())

    def collect(self) -> None:
        """Wait for the submitted work and add its times."""
        t = self._read()
        self.sum_ns += self._pairs_ns(t)
        self.runs += 1
        if self._whole:
            w = self.whole_at // 8
            self.step_sum_ns += max(int(t[w + 1] - t[w]), 0)
            self.step_runs += 1

    def result(self, **meta: Any) -> StepProfile:
        runs = max(self.runs, 1)
        return StepProfile([(n, float(s) / runs) for n, s in zip(self.names, self.sum_ns)], self.runs,
                           self.step_sum_ns / self.step_runs if self.step_runs else None, meta=meta,
                           flops=list(self.flops))


# An idle NVIDIA GPU lowers its SM clock and needs a fifth of a second of load to raise it again.
# On an H200: 1,980 MHz after 1 s idle, 510 after 2 s, 345 after 3 s; 50 ms of work at 345 MHz left
# it there, about 190 ms raised it (benchmarks/probes/dawn_order_effect.py, 2026-12-04). The same
# GEMM read 0.094 ms at full clock and 0.458 ms at idle clock, and the autotuner, timing candidates
# between pipeline builds, picked GPT-2 small's weight-gradient tilings at idle clock (0.33 ms in
# the step, where the rules' kernel takes 0.09). So a timing after a pause is preceded by SPIN_MS of
# untimed GPU work.
SPIN_MS = 250.0
IDLE_S = 0.5            # a timing this soon after the last keeps the clock the last one left
SPIN_DISPATCHES = 8192  # at most this many: encoding a spin of tiny kernels must not cost more than it saves


class GpuClock:
    """When this process last had the GPU busy: whether a timing must spin the clock up first."""

    def __init__(self) -> None:
        self.busy_at = -float("inf")

    def cold(self) -> bool:
        return time.perf_counter() - self.busy_at > IDLE_S

    def mark(self) -> None:
        self.busy_at = time.perf_counter()


clock = GpuClock()


def encode_pass(enc: Any, dispatches: Sequence[tuple], runs: int = 1, **pass_args: Any) -> None:
    """One compute pass of `runs` runs of the dispatch list ((pipeline, bind group, grid) each)."""
    cpass = enc.begin_compute_pass(**pass_args)
    for _ in range(runs):
        for pipe, bg, wg in dispatches:
            cpass.set_pipeline(pipe)
            cpass.set_bind_group(0, bg)
            cpass.dispatch_workgroups(*wg)
    cpass.end()


def encode_spin(enc: Any, dispatches: Sequence[tuple], run_ms: float) -> None:
    """Untimed runs of the dispatch list, about SPIN_MS of GPU work in one pass (`run_ms`: one run
    as read, perhaps at an idle clock, so the spin lasts at least that long while the clock rises)."""
    if dispatches:
        encode_pass(enc, dispatches, max(1, min(SPIN_DISPATCHES // len(dispatches),
                                                int(np.ceil(SPIN_MS / max(run_ms, 1e-4))))))


def spin(device: Any, dispatches: Sequence[tuple], run_ms: float, probe: Any) -> None:
    """`encode_spin` submitted on its own, waited for through a readback of `probe`."""
    enc = device.create_command_encoder()
    encode_spin(enc, dispatches, run_ms)
    device.queue.submit([enc.finish()])
    device.queue.read_buffer(probe, 0, 4)
    clock.mark()


def wall_ms(device: Any, dispatches: Sequence[tuple], probe: Any, reps: int = 1) -> float:
    """Host milliseconds from submitting `reps` runs of the dispatch list (one pass) to a readback
    of `probe` (which waits for them), per run."""
    enc = device.create_command_encoder()
    encode_pass(enc, dispatches, reps)
    t0 = time.perf_counter()
    device.queue.submit([enc.finish()])
    device.queue.read_buffer(probe, 0, 4)  # waits for the submitted work
    return (time.perf_counter() - t0) * 1e3 / reps


def profile_dispatches(device: Any, names: Sequence[str], dispatches: Sequence[tuple], repeat: int,
                       probe: Any) -> StepProfile:
    """Time each dispatch (own pass) and the whole list (one pass), `repeat` times, each run one
    submit; plus the host wall time of the one-pass list alone, submit to a readback of `probe`."""
    prof = TimestampProfiler(device, names)
    spin(device, dispatches, wall_ms(device, dispatches, probe), probe)
    for _ in range(repeat):
        enc = device.create_command_encoder()
        prof.encode(enc, dispatches, whole=True)
        device.queue.submit([enc.finish()])
        prof.collect()
    walls = [wall_ms(device, dispatches, probe) / 1e3 for _ in range(repeat)]
    out = prof.result()
    out.wall_ms = 1e3 * float(np.median(walls))
    return out


# -- ANYGRAD_WGPU_PROFILE=1: profile every run, print at exit ------------------------------------
_LIVE: list[tuple[str, TimestampProfiler]] = []


def live_profiler(device: Any, names: Sequence[str], title: str,
                  flops: Sequence[int] = ()) -> TimestampProfiler | None:
    """A profiler for an executable when the environment asks for one and the device can."""
    if not enabled():
        return None
    if FEATURE not in device.features:
        print(f"anygrad: {ENV} is set but this adapter has no '{FEATURE}': no GPU profile", file=sys.stderr)
        return None
    prof = TimestampProfiler(device, names)
    if not _LIVE:
        atexit.register(_print_live)
    prof.flops = list(flops)
    _LIVE.append((title, prof))
    return prof


def _print_live() -> None:
    for title, prof in _LIVE:
        if prof.runs:
            print(prof.result().format(title), file=sys.stderr)
