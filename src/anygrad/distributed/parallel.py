"""DataParallel: the data-parallel training strategy, the step it drives through the Model's
public methods, and at an update the exchange of the gradients between the two phases of it.

The gradient phase is the step program's "first"/"accumulate" phase (program.PHASES): it leaves
the micro-batch's gradient in the accum.<param> buffers instead of updating. Each device runs it
on a thread of its own (wgpu-py waits on events and numpy releases the GIL, so devices overlap).
The gradient travels in buckets (a size timed over the first updates, last parameters first): on wgpu a bucket's
copy is encoded right after the kernel that finishes it and that part of the step is submitted,
so the host reads it back while the backward pass goes on; the main thread sums each bucket over
the devices of this process (weighted by their share of the batch, into preallocated buffers),
starts its gloo all-reduce across ranks (whose shares are equal by construction, ShardedLoader;
several buckets in flight on several gloo groups), and writes each reduced bucket back to every
device. Every replica then runs the same update program (program.build_update_step) on the same
summed gradient, so parameters stay equal; a hash of them is compared every `check_every`
updates, and a mismatch is an error. breakdown() says where a step's host time went; with
ANYGRAD_DP_TIMELINE=<path>, a timeline of when each phase ran on which thread is written there
(anygrad.timeline: a Chrome trace, the first ANYGRAD_DP_TIMELINE_STEPS steps, default 50).

BatchNorm keeps per-replica statistics (DDP's default) unless set_sync_batchnorm(True): then the
training program's BatchNorms become sums over every replica (ops.collective.AllReduceSum, which
meets the device threads here and the ranks through gloo), forward and backward, as SyncBatchNorm.

DataParallel's state is all set up here (__init__); its other halves are classes of their own
modules, each one job: readback.py (the device threads: gradient phases, buckets read back),
buckets.py (the buckets' layout, order, host buffers and queues), host_sum.py (the weighted sum
over the host's threads), tuning.py (bucket size and hold_parts, timed), sync_batchnorm.py,
replicas.py (state handed to, compared over and summed over the replicas) and step_times.py
(breakdown() and the timeline). This module keeps the strategy's own methods (train_step,
loader, shares, ...) and the reduction at an update: each bucket summed, all-reduced, written
back into every device's upload memory, then the update programs.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

import numpy as np

from .. import settings as env_settings  # (`settings` is a local name below)
from .. import timeline
from ..backends.base import Backend
from ..batch import Batch, batch_size, take
from ..data.loader import DataLoader
from ..errors import ConfigError
from ..model import Model
from .buckets import BucketLayout
from .host_sum import combine
from .launch import BUCKET_BYTES, ProcessGroup, fixed_bucket_bytes
from .readback import GradientReadback
from .replicas import ReplicaState
from .sampler import ShardedLoader
from .step_times import TIMELINE_ENV, StepTimes
from .sync_batchnorm import SyncBatchNorm, _Meeting
from .tuning import ExchangeTuning, _Choice

# What each phase of Model.next_phase becomes: gradients only, the update runs after the sum.
GRADIENT_PHASE = {"step": "first", "first": "first", "accumulate": "accumulate", "apply": "accumulate"}
UPDATES = ("step", "apply")
# threads that write into devices' mapped upload memory (write-combined on NVIDIA), by what they
# write (2 H200s, session 40, benchmarks/probe_writeback.py): a rank's bucket, scaled, into its one
# device's memory goes fastest on one thread (2 MB: 0.17 ms; 8 threads 0.52 ms); several devices'
# parts summed into each one's memory on four (8 MB: 1.26 ms; one thread 2.2 ms, 8 threads 1.27 ms).
# Host memory is summed over every thread.
MAPPED_COPY_WRITERS = 1
MAPPED_SUM_WRITERS = 4
GRAD_COMPRESSIONS = ("none", "bf16")  # what gloo moves between ranks (DataParallel grad_compression)


def data_parallel(model: Any) -> DataParallel | None:
    """The DataParallel strategy training `model`, or None (one device, SingleDevice)."""
    return model.strategy if isinstance(model.strategy, DataParallel) else None


HOLD_TRIALS = 3  # updates timed with each setting of hold_parts before one is kept
HOLD_CANDIDATES = (2, 0)
# Bucket sizes timed over the first updates, as multiples of BUCKET_BYTES, the fastest kept: the
# best size depends on the model, the batch and the machine (2 H200s: the GPT ran fastest at 8 MB
# with batch 128 a GPU, at 2 MB with batch 512; ResNet-18 in one process at 16 MB). With
# ANYGRAD_BUCKET_MB set, that size only.
BUCKET_SCALES = (1.0, 2.0, 0.5, 0.25)
BUCKET_TRIALS = 2


class _Done:
    """A finished result where a Future is expected (the devices run one after the other)."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


class DataParallel(GradientReadback, BucketLayout, ExchangeTuning, SyncBatchNorm, ReplicaState, StepTimes):
    """A training strategy (anygrad.strategy): the batch shared by the model's device and
    `backends` (the devices besides the model's own, this process) and by the ranks of `group`
    (a torch.distributed job, or None). compile(device="wgpu:0,wgpu:1") makes one; for a job,
    `model.strategy = DataParallel(model, model.devices[1:], group)`. Model.train_step and the
    metric reads come here, through the Model's public methods; the Model never knows."""

    def __init__(self, model: Model, backends: list[Backend] | None = None, group: ProcessGroup | None = None,
                 check_every: int = 100, sync_batchnorm: bool | None = None, grad_compression: str = "none"):
        model.require_compiled()
        if grad_compression not in GRAD_COMPRESSIONS:
            raise ConfigError(f"grad_compression {grad_compression!r}: choose one of {', '.join(GRAD_COMPRESSIONS)}")
        # what gloo moves between ranks: float32, or bfloat16 (half the bytes, as DDP's bf16_compress_hook)
        self.grad_compression = grad_compression
        self.model, self.group, self.check_every = model, group, int(check_every)
        self.replicas: list[Model] = [model] + [model.replica(b) for b in backends or []]
        self.updates = 0
        self._lr = model.group_lrs
        self._group_counts: list[int] = []  # samples per replica since the last update
        self._settings = (tuple(model.graph.params), model.clip_norm, model.accumulate)
        self.speeds: list[float] | None = None  # samples/s per device, once balance() measured them
        self._timing, self._timed_steps, self._times = False, 0, []
        self._pool: Any = None  # a thread per device, made at the first step
        self._buckets: list[tuple[tuple[str, ...], int, int]] | None = None
        self._host: list[np.ndarray] = []
        self._arrived: list[set[int]] = []
        self._views: list[dict[int, tuple[np.ndarray, Callable[[], None]]]] = []  # per device, this update's buckets held
        self._sum_views = False
        self._ordered = False  # buckets sorted by when the program finishes them (_order_buckets)
        self._ready_at: dict[int, tuple] = {}  # id(executable) -> (it, buckets, _ready_steps's answer)
        self._ready = [queue.SimpleQueue() for _ in self.replicas]
        self._first_read: set[int] = set()  # devices whose first bucket of this update arrived
        self._scratch = threading.local()  # _write_back's per-thread sum buffers
        self.timings: dict[str, float] = {}
        self.steps = 0
        # when each phase ran on which thread (ANYGRAD_DP_TIMELINE=path; ranks write path.rank<N>.json)
        self.timeline = timeline.from_env(TIMELINE_ENV, group.rank if group is not None else None,
                                          f"rank {group.rank}" if group is not None else "anygrad")
        self._sizes: list[int] = []  # this micro-batch's shares (AllReduceSum's weights)
        self._meet: _Meeting | None = None
        self.set_sync_batchnorm(model.sync_batchnorm if sync_batchnorm is None else sync_batchnorm)
        # Unlike devices (an iGPU beside a dGPU) share by speed, measured after the first update.
        self._balance_later = len({r.backend.description for r in self.replicas}) > 1
        # How many parts of a wgpu step are held so that buckets map mid-step (WgpuExecutable.hold_parts):
        # ANYGRAD_WGPU_HOLD_PARTS if set, else the faster of the default and 0, timed over
        # HOLD_TRIALS updates each after the first (it depends on the model and the GPU).
        self._hold = _Choice(HOLD_CANDIDATES, HOLD_TRIALS, env_settings.get("ANYGRAD_WGPU_HOLD_PARTS"))
        # The bucket size: timed first, then hold_parts (one setting timed at a time).
        fixed_bucket = fixed_bucket_bytes()  # (ANYGRAD_BUCKET_MB: that size only)
        sizes = (fixed_bucket,) if fixed_bucket is not None else \
            tuple(max(4, int(BUCKET_BYTES * f)) for f in BUCKET_SCALES)
        self._bucket = _Choice(sizes, BUCKET_TRIALS)
        self._bucket_bytes = self._bucket.candidates[0]
        self._timed: tuple[_Choice, Any] | None = None  # the setting this update times, and its value

    @property
    def world_size(self) -> int:
        return self.group.size if self.group else 1

    @property
    def is_writer(self) -> bool:
        """Whether this process writes artifacts (rank 0, or not distributed)."""
        return self.group is None or self.group.is_writer

    @property
    def description(self) -> str:
        devices = ", ".join(r.backend.description for r in self.replicas)
        return devices + (f"; rank {self.group.rank} of {self.group.size}" if self.group else "")

    def loader(self, x: np.ndarray, y: np.ndarray, batch_size: int, **options: Any) -> DataLoader:
        """The training batches this process sees: its rank's share of every global batch."""
        if self.group is None:
            return DataLoader(x, y, batch_size, **options)
        return ShardedLoader(x, y, batch_size, self.group.rank, self.group.size, **options)

    def agree(self, flag: bool) -> bool:
        """Whether any rank raised `flag` (all ranks call this at the same step)."""
        if self.group is None or self.group.size == 1:
            return flag
        return bool(self.group.all_reduce_f64(np.array([float(flag)]))[0] > 0)

    # -- the step -------------------------------------------------------------------------------
    def shares(self, n: int) -> list[int]:
        """How many of n samples each replica of this process takes: proportional to the devices'
        measured speeds after balance(), else an even split (the first get the remainder)."""
        k = len(self.replicas)
        if n < k:
            raise ConfigError(f"a batch of {n} samples cannot be shared by {k} devices; use a batch of at least {k}")
        if self.speeds is None:
            return [n // k + (i < n % k) for i in range(k)]
        ideal = np.asarray(self.speeds, np.float64) / float(sum(self.speeds)) * (n - k)
        out = [1 + int(v) for v in ideal]  # at least one sample each, then the largest remainders
        for i in np.argsort(-(ideal - np.floor(ideal)), kind="stable")[:n - sum(out)]:
            out[i] += 1
        return out

    def balance(self, steps: int = 2) -> None:
        """Share batches by speed (an iGPU beside a dGPU): the next `steps` updates (call it after a
        first step, which compiles) run the devices one after the other, timed, and later batches are split in proportion to the samples per
        second each reached. The gradient weighting stays exact (each device by its share)."""
        self._timing, self._timed_steps, self._times = True, int(steps), [[0.0, 0.0] for _ in self.replicas]

    def train_step(self, model: Model, inputs: Batch, targets: Batch, flush: bool = False,
                   fetch_loss: bool = False) -> float | None:
        """Model.train_step (and train_on_batch with fetch_loss: the global batch's mean loss) on
        this process's batch (parsed: {input name: array}, {target name: array}): its devices'
        gradient phases, each on a thread of its own, then, at an update, the exchange."""
        phase = model.next_phase(flush)
        if model.group_lrs != self._lr:  # a scheduler moved them: the model's device has them already
            for r in self.replicas[1:]:
                for name, value in model.lr_states().items():
                    r.backend.set_state(name, value)
            self._lr = model.group_lrs
        settings = (tuple(model.graph.params), model.clip_norm, model.accumulate)
        if settings != self._settings:  # freeze() or configure_step(): the replicas' programs are stale
            for r in self.replicas[1:]:
                r.clear_programs()
                r.clip_norm, r.accumulate = model.clip_norm, model.accumulate
                r.param_groups = model.param_groups
            self._settings = settings
            self._buckets = None
        began = time.perf_counter()
        sizes = self.shares(batch_size(inputs))
        update = phase in UPDATES
        grouped = phase not in ("first", "step") and self._group_counts
        self._group_counts = [c + s for c, s in zip(self._group_counts, sizes)] if grouped else sizes
        self._timed = None
        jobs, start = [], 0
        for i, (r, size) in enumerate(zip(self.replicas, sizes)):
            part = slice(start, start + size)
            start += size
            exe = r.train_program(take(inputs, part), take(targets, part), GRADIENT_PHASE[phase])
            feeds = {**take(inputs, part), **take(targets, part)}
            jobs.append((i, r, exe, feeds, size, fetch_loss or self._timing, update))
        self._sizes = sizes
        if update:
            self._cut_buckets()
            self._prepare_exchange()
            if not self._ordered:  # before the devices start: their threads index the buckets
                self._order_buckets(jobs[0][2])
        hold = self._hold_for_this_update(jobs[0][2]) if update else None
        if self._meet is not None:
            self._meet.ready()
        jobs = [job + (hold,) for job in jobs]
        if self._timing and self._meet is None:  # balance(): each device alone, timed (compiled before the clock starts)
            futures = [_Done(self._gradient_job(*job)) for job in jobs]
        else:
            futures = [self._pool_submit(self._gradient_job, *job) for job in jobs]
        self._spent("submit", began)
        try:
            if update:
                self._reduce_and_update(futures)
            t = time.perf_counter()
            losses = [f.result() for f in futures]
            self._mark("join", t)
        except BaseException:
            # The step ends once every device's part of it has: the pool's threads are shared, so a
            # device still finishing this step would otherwise run its executable beside its next one.
            wait([f for f in futures if isinstance(f, Future)])
            raise
        self.steps += 1
        if update:
            if self._balance_later:
                self._balance_later = False
                self.balance()
            elif self._timing:
                self._timed_steps -= 1
                if self._timed_steps <= 0:
                    self.speeds = [n / max(t, 1e-9) for t, n in self._times]
                    self._timing = False
        self._spent("step", began, {"update": update, "hold_parts": hold})
        if self.timeline is not None and self.timeline.end_step():
            self.write_timeline()
        if self._timed is not None:
            choice, value = self._timed
            choice.times.append((value, time.perf_counter() - began))
        if not fetch_loss:
            return None
        local = sum(float(out[next(iter(out))]) * s for out, s in zip(losses, sizes)) / sum(sizes)
        if self.group is not None:
            local = float(self.group.all_reduce_f64(np.array([local]))[0]) / self.group.size
        return local

    # -- the exchange at an update ---------------------------------------------------------------
    def _reduce_and_update(self, futures: list[Any]) -> None:
        """As each bucket arrives from every device: without other ranks, the devices' parts
        summed (weighted by their shares of the batch: exact with uneven shares) straight into
        every device's upload memory, one pass over the host's threads (_write_back); with
        ranks, summed into device 0's buffer (a rank's one device: left where it was read back)
        and all-reduced there through gloo (started at once, several buckets in flight), then
        written back as each finishes. The parts are read where each device put them (_views),
        released once read. Then the update runs everywhere (the devices in parallel)."""
        counts = self._group_counts
        flat = self._host[0]
        several = len(self.replicas) > 1
        ranks = self.group is not None and self.group.size > 1
        total = float(sum(counts))
        equal = len(set(counts)) == 1
        local = ([1.0 / len(counts)] * len(counts)) if equal else [n / total for n in counts]
        works: dict[int, tuple[Any, np.ndarray]] = {}  # bucket -> (its gloo work, the array it sums in place)
        compressed = ranks and self.grad_compression == "bf16"
        pending: list[int] = []  # all-reducing, not yet written back (in bucket order)
        mapped: dict[int, list] = {}  # bucket -> its upload memory, until written back (_map_uploads)

        def finish(k: int) -> None:  # bucket k's gloo sum is done: scaled, back to every device
            t = time.perf_counter()
            work, summed = works.pop(k)
            try:
                work.wait()
                self._spent("all_reduce_wait", t)
                scale = 1.0 if compressed else 1.0 / self.group.size  # (bfloat16: scaled before it was sent)
                self._write_back(mapped, k, [summed], [scale], True, summed)
            finally:
                self._release(k)

        try:
            for k, (_, a, b) in enumerate(self._buckets):
                for i in range(len(self.replicas)):
                    self._await(i, k, futures)
                if not (several or self.group is not None):
                    continue
                if k == 0 and (several or ranks):
                    mapped.update(self._map_uploads())
                parts = [self._views[i][k][0] if self._sum_views else h[a:b] for i, h in enumerate(self._host)]
                if not ranks:
                    try:
                        self._write_back(mapped, k, parts, local, equal, flat[a:b])
                    finally:
                        self._release(k)
                    continue
                t = time.perf_counter()
                summed = flat[a:b]
                if not several and parts[0].flags.writeable:
                    # all-reduced where the device put it (on wgpu its mapped readback memory: what
                    # the host writes there is dropped when it is released, after the write-back)
                    summed = parts[0]
                else:
                    try:  # this process's devices first (or its one, read-only), into device 0's buffer
                        self._combine(parts, local, equal, [summed])
                    finally:
                        self._release(k)
                self._spent("sum", t)
                t = time.perf_counter()
                works[k] = (self.group.all_reduce_start_bf16(summed, 1.0 / self.group.size) if compressed
                            else self.group.all_reduce_start(summed), summed)
                self._mark("all_reduce_start", t, {"bucket": k})
                pending.append(k)
                # write back what gloo has finished while later buckets are still on their way (a
                # thread of its own for this was slower on 2 H200s: GPT 1.15x -> 0.97x on 2 ranks),
                # but start the next bucket's all-reduce first if it is here: at the end of the step
                # a write-back (0.3-0.6 ms) held up the last bucket's gloo sum (session 40's timeline)
                while pending and works[pending[0]][0].is_completed() and not self._here(k + 1):
                    finish(pending.pop(0))
            for k in pending:
                finish(k)
        except BaseException:
            for work, _ in works.values():  # gloo must be done with the memory before it is released
                with contextlib.suppress(Exception):
                    work.wait()
            self._unmap(mapped)
            raise
        t = time.perf_counter()
        if several:
            updates = [self._pool_submit(self._update_job, r, i) for i, r in enumerate(self.replicas)]
            wait(updates)  # all of them, even past a failure: the pool's threads serve the next step
            failed = [i for i, f in enumerate(updates) if f.exception() is not None]
            if failed:
                self._resync(failed)
                updates[failed[0]].result()  # raises that device's error
        else:
            self._update_job(self.replicas[0], 0)
        self._spent("update", t)
        self.updates += 1
        if self.check_every and self.updates % self.check_every == 0:
            t = time.perf_counter()
            self.check_replicas()
            self._spent("hash", t)

    def _release(self, k: int) -> None:
        """Bucket k's mapped readback memory goes back to its devices (its sum has read it)."""
        for held in self._views:
            got = held.pop(k, None)
            if got is not None:
                got[1]()

    def _write_back(self, mapped: dict[int, list], k: int, parts: list[np.ndarray], weights: list[float],
                    equal: bool, spare: np.ndarray) -> None:
        """Every replica's gradients of bucket k = the weighted sum of `parts` (equal weights: their
        sum times the weight; else each part times its own, summed in order: _combine). Where
        _map_uploads mapped every device's upload memory for the bucket (`mapped[k]`, taken out),
        the sum goes straight into each and is committed; after an error what is not committed
        yet is given back unwritten. Else it goes into `spare` (a host buffer; it may be
        parts[0]), then import_states. The same values reach every device either way, so the
        replicas stay equal."""
        t = time.perf_counter()
        names, views = self._buckets[k][0], mapped.pop(k, None)
        if views is None:
            self._combine(parts, weights, equal, [spare])
            for r in self.replicas:
                r.backend.import_states(names, spare)
            self._spent("write_back", t)
            return
        try:
            writers = MAPPED_COPY_WRITERS if len(parts) == 1 and len(views) == 1 else MAPPED_SUM_WRITERS
            self._combine(parts, weights, equal, [v for v, _ in views], writers)
            self._mark("write_back_sum", t)
            committed = time.perf_counter()
            for _, commit in views:
                commit()
            self._mark("write_back_commit", committed)
        except BaseException:
            self._unmap({k: views})  # (a committed one is unmapped already: its cancel does nothing)
            raise
        self._spent("write_back", t)

    def _map_uploads(self) -> dict[int, list[tuple[np.ndarray, Callable[[], None]]]]:
        """Every bucket's upload memory on every device (Backend.import_view), mapped now, once
        the first bucket is on the host: the write-backs at the end of the step, after gloo's
        last sums, then need not wait for a map (0.1-0.3 ms a bucket on 2 H200s, session 38's
        timelines), and the maps stay out of the step's start, where they held up the devices'
        input uploads (GPT on 2 H200s: 0.4 -> 0.9 ms; session 40) and so the GPUs' start. Later
        buckets arrive a few ms apart, time enough to catch up. A bucket some device has no
        such memory for is left out (_write_back then goes through import_states). Each one
        mapped is committed by _write_back, or unmapped unwritten by _unmap after an error."""
        t = time.perf_counter()
        out: dict[int, list[tuple[np.ndarray, Callable[[], None]]]] = {}
        try:
            for k, (names, _, _) in enumerate(self._buckets):
                views = []
                for r in self.replicas:
                    got = r.backend.import_view(names)
                    if got is None:
                        break
                    views.append(got)
                if len(views) == len(self.replicas):
                    out[k] = views
                else:
                    self._unmap({k: views})
        except BaseException:
            self._unmap(out)
            raise
        self._mark("write_back_map", t)
        return out

    @staticmethod
    def _unmap(mapped: dict[int, list[tuple[np.ndarray, Callable[[], None]]]]) -> None:
        """Upload memory mapped and never written, given back without being copied anywhere (the
        commit's `cancel`, Backend.import_view)."""
        for views in mapped.values():
            for _, commit in views:
                with contextlib.suppress(Exception):
                    getattr(commit, "cancel", commit)()
        mapped.clear()

    def _combine(self, parts: list[np.ndarray], weights: list[float], equal: bool,
                 into: list[np.ndarray], threads: int | None = None) -> None:
        """Every array of `into` = the weighted sum of `parts` (host_sum.combine, with this
        strategy's per-thread scratch buffers); `threads`: at most that many."""
        combine(parts, weights, equal, into, self._scratch, threads)

    def _update_job(self, r: Model, i: int) -> None:
        t = time.perf_counter()
        r.update_program().run({}, fetch=[])
        self._mark(f"update{i}", t)
