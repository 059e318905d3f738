"""DataParallel: the step split into a gradient phase and an update phase, with the gradients
summed across replicas in between.

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
"""
from __future__ import annotations

import contextlib
import hashlib
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import numpy as np

from .. import _parallel, timeline
from .. import settings as env_settings  # (`settings` is a local name below)
from ..backends.base import Backend, Exchange, Executable
from ..batch import Batch, batch_size, take
from ..data.loader import DataLoader
from ..errors import ConfigError, DeviceError
from ..ir.passes import RNG_STATE
from ..model import Model
from ..program import ACCUM_PREFIX
from .launch import BUCKET_BYTES, ProcessGroup, fixed_bucket_bytes
from .sampler import ShardedLoader

# What each phase of Model.next_phase becomes: gradients only, the update runs after the sum.
GRADIENT_PHASE = {"step": "first", "first": "first", "accumulate": "accumulate", "apply": "accumulate"}
UPDATES = ("step", "apply")
# float32 elements a thread sums at a time (1 MB: an 8 MB bucket spreads over 8 threads, and a
# chunk's sum stays in the thread's cache on its way to every device's upload memory); smaller
# buckets are cut into pieces of at least MIN_SUM_CHUNK, one a thread (a 2 MB bucket over 8
# threads, not 2: the last buckets' sums are on the step's critical path)
SUM_CHUNK = 1 << 18
MIN_SUM_CHUNK = 1 << 15
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
# a device's big inputs staged through mapped memory (WgpuExecutable.stage_inputs) unless
# ANYGRAD_WGPU_STAGED_UPLOAD=0 (write_buffer, for A/B runs)
TIMELINE_ENV = "ANYGRAD_DP_TIMELINE"
# gradients summed and all-reduced straight from the devices' mapped readback memory; 0: each
# bucket copied into a host buffer first (the A/B: one more pass over every gradient byte)
SUM_VIEWS_ENV = "ANYGRAD_DP_SUM_MAPPED"
READER_JOIN_S = 60.0  # a failed step waits this long at most for its bucket reader to stop


class _Done:
    """A finished result where a Future is expected (the devices run one after the other)."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


class _Meeting:
    """Where the replica threads of this process meet at each AllReduceSum: each leaves its value,
    one (the barrier's first) sums them in device order and (across ranks) all-reduces the sum."""

    def __init__(self, k: int):
        self.k = k
        self.barrier = threading.Barrier(k)
        self.parts: list[Any] = [None] * k
        self.total: Any = None

    def ready(self) -> None:
        if self.barrier.broken:  # a device failed in an earlier step
            self.barrier.reset()

    def sum(self, i: int, value: np.ndarray, across: Callable[[np.ndarray], np.ndarray] | None) -> np.ndarray:
        self.parts[i] = value
        if self.barrier.wait() == 0:
            total = self.parts[0].copy()
            for part in self.parts[1:]:
                total += part
            self.total = across(total) if across is not None else total
        self.barrier.wait()  # every part is in the sum; the next meeting's parts may come
        return self.total.copy()


class _Choice:
    """A setting of the exchange whose best value depends on the model, the batch and the machine,
    chosen by timing whole steps: each candidate in turn over `trials` updates, then the one with
    the lowest (lower) median is kept, the first on a tie. Ranks keep rank 0's choice: choosing is
    a collective, which every rank reaches at the same update. `value` is None until chosen."""

    def __init__(self, candidates: tuple, trials: int, value: Any = None):
        self.candidates, self.trials = tuple(candidates), trials
        self.value = self.candidates[0] if value is None and len(self.candidates) == 1 else value
        self.times: list[tuple[Any, float]] = []

    def now(self, may_time: bool, group: ProcessGroup | None) -> tuple[Any, bool]:
        """(the value for this update, whether this update times it). Without `may_time` (the
        first update, which compiles; another setting timed in it) the chosen value or the
        first candidate, untimed."""
        if self.value is None and may_time:
            if len(self.times) < self.trials * len(self.candidates):
                return self.candidates[len(self.times) % len(self.candidates)], True
            self._choose(group)
        return (self.candidates[0] if self.value is None else self.value), False

    def _choose(self, group: ProcessGroup | None) -> None:
        def median(c: Any) -> float:
            times = sorted(t for v, t in self.times if v == c)
            return times[(len(times) - 1) // 2]
        best = min(self.candidates, key=lambda c: (median(c), c != self.candidates[0]))
        if group is not None and group.size > 1:
            best = type(best)(group.gather_strings(str(best))[0])
        self.value = best


class DataParallel:
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
    def hold_parts(self) -> int | None:
        """How many parts of a wgpu step are held back (None: still being timed)."""
        return self._hold.value

    @hold_parts.setter
    def hold_parts(self, value: int | None) -> None:
        self._hold.value = value

    @property
    def bucket_bytes(self) -> int:
        """The gradient bucket size in use (chosen over the first updates unless ANYGRAD_BUCKET_MB)."""
        return self._bucket_bytes

    def set_sync_batchnorm(self, on: bool) -> None:
        """BatchNorm statistics over every replica (every device, every rank) as SyncBatchNorm, or per
        replica (DDP's default). The training programs are rebuilt."""
        lacking = [r.backend.description for r in self.replicas if on and not r.backend.supports("AllReduceSum")]
        if lacking:
            raise ConfigError(f"--sync-batchnorm needs a sum across devices inside the step, which {lacking[0]} "
                              "cannot run yet (its step is one submission to the GPU); train with --device cpu "
                              "or torch, or leave BatchNorm statistics per replica (without --sync-batchnorm)")
        for r in self.replicas:
            if r.sync_batchnorm != bool(on):
                r.sync_batchnorm = bool(on)
                r.clear_programs()
        self._meet = _Meeting(len(self.replicas)) if on else None

    def _reduce_stat(self, i: int, x: np.ndarray, mode: str) -> np.ndarray:
        """AllReduceSum on replica i (ops.collective's modes): the replicas of this process meet on
        threads (summed in device order, in double), the ranks through gloo."""
        sizes = self._sizes
        if mode == "count":
            return x * (float(sum(sizes)) * self.world_size / sizes[i])
        value = x.astype(np.float64) * (sizes[i] if mode == "weighted" else 1.0)
        meet = self._meet
        ranks = self.group is not None and self.group.size > 1
        t = time.perf_counter()
        if meet is None or meet.k == 1:
            total = self.group.all_reduce_f64(value).reshape(x.shape) if ranks else value
        else:
            total = meet.sum(i, value, (lambda v: self.group.all_reduce_f64(v).reshape(v.shape)) if ranks else None)
        self._mark(f"sync_bn{i}", t)  # the wait for the other replicas' statistics
        return total / sizes[i] if mode == "weighted" else total

    # -- replicas -------------------------------------------------------------------------------
    def _resync(self, failed: list[int]) -> None:
        """The update failed on devices `failed` and ran on the others: every replica takes the state
        of one that completed it (so the step counts as applied, as on that device), or device 0's
        when none did, so that they stay equal; left alone, they would train on apart until the
        next parameter check. Metric sums stay each replica's own. Best effort: a lost device
        cannot take it, and the step's own error is raised either way."""
        done = [i for i in range(len(self.replicas)) if i not in failed]
        source = self.replicas[done[0] if done else 0]
        own = self.model.metric_buffers()
        try:
            state = {n: v for n, v in source.full_state().items() if n not in own}
        except Exception:  # noqa: BLE001 - the source device failed too: nothing to copy from
            return
        for r in self.replicas:
            if r is source:
                continue
            with contextlib.suppress(Exception):  # a lost device: its next step fails on its own
                for name, value in state.items():
                    r.backend.set_state(name, value)

    def state_loaded(self, model: Model) -> None:
        """The model's state was overwritten (load_full_state): replicas take it."""
        for r in self.replicas[1:]:
            r.take_state(model)
        self._lr = model.group_lrs

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

    # -- the exchange -----------------------------------------------------------------------------
    def _pool_submit(self, fn, *args) -> Any:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            # A cpu device's ops stay on its own thread (no nested use of the shared numpy pool,
            # whose BLAS thread count one caller at a time may set): k cpu devices use k cores.
            self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="anygrad-replica",
                                            initializer=_parallel.mark_worker)
        return self._pool.submit(fn, *args)

    def _prepare_exchange(self) -> None:
        """Buckets of about bucket_bytes, each a run of consecutive parameters (a range of the flat
        vector, which is in parameter order), listed from the last parameters to the first (the
        order the backward finishes them, as DDP's), the host buffers they land in (kept from step
        to step), and a queue per device that says which buckets it has read back."""
        if self._buckets is None:
            params = list(self.model.graph.params)
            sizes = [int(self.model.graph.initializers[p].size) for p in params]
            starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
            limit = max(1, self._bucket_bytes // 4)
            buckets: list[tuple[tuple[str, ...], int, int]] = []
            run: list[int] = []
            for j in reversed(range(len(params))):
                if run and starts[run[0] + 1] - starts[j + 1] + sizes[j] > limit:
                    buckets.append((tuple(ACCUM_PREFIX + params[i] for i in reversed(run)), starts[run[-1]],
                                    starts[run[0] + 1]))
                    run = []
                run.append(j)
            if run:
                buckets.append((tuple(ACCUM_PREFIX + params[i] for i in reversed(run)), starts[run[-1]],
                                starts[run[0] + 1]))
            self._buckets = buckets
            self._ordered = False
            # device 0 reads into the sum itself; the others into a buffer of their own
            self._host = [np.empty(starts[-1], np.float32) for _ in self.replicas]
        # new queues each update: a reader left from a failed step announces into its own, not this one's
        self._ready = [queue.SimpleQueue() for _ in self.replicas]
        for held in self._views:  # a failed step's buckets, never summed: their memory goes back
            for k in list(held):
                with contextlib.suppress(Exception):
                    held.pop(k)[1]()
        self._views = [{} for _ in self.replicas]
        # summed (all-reduced) straight from where each device read its bucket, no copy into host buffers first
        exchanged = len(self.replicas) > 1 or (self.group is not None and self.group.size > 1)
        self._sum_views = exchanged and env_settings.get(SUM_VIEWS_ENV)
        self._arrived = [set() for _ in self.replicas]
        self._first_read = set()

    def _order_buckets(self, exe: Any) -> None:
        """Once: take the buckets in the order device 0's program finishes them (where it says), so
        that the host never waits for a late bucket while an early one is ready. Every rank must
        reduce them in the same order, so ranks keep the default order unless all agree."""
        self._ordered = True
        ready = self._ready_steps(exe)
        last = float("inf")
        order = sorted(range(len(self._buckets)), key=lambda k: (last if ready[k] is None else ready[k], k)) \
            if ready else list(range(len(self._buckets)))
        if self.group is not None and self.group.size > 1 and \
                len(set(self.group.gather_strings(",".join(map(str, order))))) > 1:
            return  # every rank calls the gather (a collective), whatever its device
        self._buckets = [self._buckets[k] for k in order]

    def _ready_steps(self, exe: Executable) -> dict[int, int | None]:
        """Per bucket, the kernel of `exe` after which its gradients are final (Executable.ready_step;
        None: at the end); {} where no bucket is final before the end (a step run whole)."""
        held = self._ready_at.get(id(exe))
        if held is None or held[0] is not exe or held[1] is not self._buckets:
            ready = {k: exe.ready_step(names) for k, (names, _, _) in enumerate(self._buckets)}
            held = (exe, self._buckets, ready if any(v is not None for v in ready.values()) else {})
            self._ready_at[id(exe)] = held
        return held[2]

    def _timing_choice(self, choice: _Choice) -> Any:
        """`choice`'s value for this update, timed if it is still being chosen, nothing else is
        timed in this update, this is not the first update (it compiles) and the devices do not
        run one after the other (balance()). With other ranks, balanced updates are timed too:
        every rank must try the same value at the same update (its buckets are all-reduced with
        theirs), and another rank may have no devices to balance."""
        balancing = self._timing and (self.group is None or self.group.size == 1)
        value, timed = choice.now(self.updates >= 1 and self._timed is None and not balancing, self.group)
        if timed:
            self._timed = (choice, value)
        return value

    def _cut_buckets(self) -> None:
        """This update's bucket size; a new size re-cuts the buckets, and the devices' staging
        buffers of the old ones are dropped."""
        size = self._timing_choice(self._bucket)
        if size != self._bucket_bytes:
            self._bucket_bytes, self._buckets = size, None
            for r in self.replicas:
                r.backend.drop_transfer_buffers()

    def _hold_for_this_update(self, exe: Any) -> int | None:
        """hold_parts for this update's gradient phases (timed over the first updates unless
        fixed); None where the executable holds nothing back (a device whose mappings resolve
        mid-step)."""
        if not exe.holds_parts:
            return None
        return self._timing_choice(self._hold)

    def _gradient_job(self, i: int, r: Model, exe: Executable, feeds: dict, size: int, fetch: bool,
                      update: bool, hold: int | None = None) -> Any:
        """One device: its gradient phase, then (at an update) its gradient read back bucket by
        bucket, each announced on its queue as soon as it is on the host (an error too). On wgpu a
        bucket's copy is encoded right after the kernel that finishes it (the run's Exchange.ready);
        once the step is encoded (Exchange.encoded) a reader thread takes those buckets while the
        executable submits the rest part by part (`hold` parts held: wgpu/runtime/encode.py),
        so each bucket is read, summed and all-reduced during the rest of the backward pass. With
        SyncBatchNorm the run's AllReduceSums meet the other replicas through Exchange.reduce."""
        announce = self._ready[i]  # this update's queue (_prepare_exchange makes new ones)
        views = self._views[i] if update else {}  # and the buckets it holds mapped, for the sums to read
        try:
            began = time.perf_counter()
            if self._timing:
                r.backend.get_state(RNG_STATE)  # the device is idle when the clock starts
            # the device waits for its shard: uploaded over the host's threads
            exchange = Exchange(stage_inputs=env_settings.get("ANYGRAD_WGPU_STAGED_UPLOAD"))
            if self._meet is not None:
                exchange.reduce = lambda x, mode: self._reduce_stat(i, x, mode)
            host = self._host[i] if update else None
            ready = self._ready_steps(exe) if update else {}
            # summed from where the device put a bucket (its view, released by the sum), or copied into host
            export = r.backend.export_view_async if self._sum_views else r.backend.export_states_async
            waits: dict[int, Callable[[], Any]] = {}
            reader: list[threading.Thread] = []
            if ready:
                at: dict[int, list[int]] = {}
                for k, step in ready.items():
                    if step is not None:
                        at.setdefault(step, []).append(k)

                def tap(enc: Any, ks: list[int]) -> None:
                    for k in ks:
                        names, a, b = self._buckets[k]
                        waits[k] = export(names, host[a:b], encoder=enc)
                exchange.ready = {step: (lambda enc, ks=ks: tap(enc, ks)) for step, ks in at.items()}

                def encoded() -> None:  # the tapped buckets are read while the rest of the step runs
                    tapped = sorted(waits, key=lambda k: (ready[k], k))
                    # named per device: the timeline keeps a track per thread name
                    reader.append(threading.Thread(target=self._read_buckets, args=(i, waits, tapped, announce, views),
                                                   name=f"anygrad-readback{i}", daemon=True))
                    reader[0].start()
                exchange.encoded, exchange.hold_parts = encoded, hold or 0
            out = exe.run(feeds, fetch=[exe.graph.outputs[0]] if fetch else [], exchange=exchange)
            self._spent(f"run{i}", began)
            self.timings[f"upload{i}"] = self.timings.get(f"upload{i}", 0.0) + exe.upload_s
            if self.timeline is not None and exe.upload_at >= began:  # a part of run<i>
                self.timeline.record(f"upload{i}", exe.upload_at, exe.upload_at + exe.upload_s)
            if self._timing:
                self._times[i][0] += time.perf_counter() - began
                self._times[i][1] += size
            if update:
                late = [k for k in range(len(self._buckets)) if k not in waits]  # read after the step
                for k in late:
                    names, a, b = self._buckets[k]
                    waits[k] = export(names, host[a:b])
                self._read_buckets(i, waits, late, announce, views)
                if reader:
                    reader[0].join()
            return out
        except BaseException as e:
            if self._meet is not None:
                self._meet.barrier.abort()  # the other devices stop waiting for this one
            if update:
                announce.put(e)
            if reader:  # no reader of this step may still hold mapped memory when the next one starts
                reader[0].join(READER_JOIN_S)
            raise

    def _read_buckets(self, i: int, waits: dict[int, Callable[[], Any]], order: list[int],
                      announce: queue.SimpleQueue, views: dict[int, tuple[np.ndarray, Callable[[], None]]]) -> None:
        """Device i's buckets `order` onto the host, one after the other, each announced on its
        queue as it lands (an error too, then stop). Where gradients are summed from the devices'
        readback memory (_sum_views), a wait gives the bucket where the device put it (on wgpu its
        mapped staging memory), kept in `views` until the sum has read it (_release); else it has
        copied the bucket into the device's host buffer. The wait for its first bucket counts as
        compute_wait<i>, the others as readback<i>."""
        for k in order:
            t = time.perf_counter()
            try:
                got = waits[k]()
                if self._sum_views:
                    views[k] = got
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                announce.put(e)
                return
            first = i not in self._first_read
            self._first_read.add(i)
            self._spent(f"compute_wait{i}" if first else f"readback{i}", t)
            announce.put(k)

    def _await(self, i: int, k: int, futures: list[Any]) -> None:
        """Until device i has bucket k on the host (devices may finish buckets in their own order)."""
        t = time.perf_counter()
        waited = k not in self._arrived[i]
        while k not in self._arrived[i]:
            got = self._ready[i].get()
            if isinstance(got, BaseException):
                futures[i].result()  # raises the device's error
                raise got
            self._arrived[i].add(got)
        if waited:
            self._mark(f"await{i}", t, {"bucket": k})

    def _here(self, k: int) -> bool:
        """Whether every device has bucket k on the host already (without waiting; a device's
        error is left in its queue's place for _await to raise)."""
        if k >= len(self._buckets):
            return False
        for i, arrived in enumerate(self._arrived):
            while k not in arrived:
                try:
                    got = self._ready[i].get_nowait()
                except queue.Empty:
                    return False
                if isinstance(got, BaseException):
                    self._ready[i].put(got)
                    return False
                arrived.add(got)
        return True

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
        """Every array of `into` = the weighted sum of `parts` (equal weights: their sum, in order,
        times the weight; else each part times its own, summed in order), in chunks over the host's
        threads (memory-bound: one thread does not saturate it). Each chunk is summed once in a
        cache-sized scratch of its thread, then copied out, so `into` may hold parts[0]. One part
        into one array (a rank's one device) is one pass, part times weight straight into it: the
        write-back of a rank's all-reduced bucket into its device's upload memory, at the end of
        the step. `threads`: at most that many (default every worker of the host)."""
        scratch, n = self._scratch, parts[0].size
        one_pass = len(parts) == 1 and len(into) == 1

        def work(spans: list[tuple[int, int]]) -> list[None]:
            if getattr(scratch, "buf", None) is None:
                scratch.buf, scratch.tmp = np.empty(SUM_CHUNK, np.float32), np.empty(SUM_CHUNK, np.float32)
            for lo, hi in spans:
                if one_pass:
                    if weights[0] != 1.0:
                        np.multiply(parts[0][lo:hi], np.float32(weights[0]), out=into[0][lo:hi])
                    elif into[0] is not parts[0]:
                        np.copyto(into[0][lo:hi], parts[0][lo:hi])
                    continue
                out = scratch.buf[:hi - lo]
                if equal:
                    np.copyto(out, parts[0][lo:hi]) if len(parts) == 1 else \
                        np.add(parts[0][lo:hi], parts[1][lo:hi], out=out)
                    for part in parts[2:]:
                        np.add(out, part[lo:hi], out=out)
                    if weights[0] != 1.0:
                        np.multiply(out, np.float32(weights[0]), out=out)
                else:
                    np.multiply(parts[0][lo:hi], np.float32(weights[0]), out=out)
                    for part, w in zip(parts[1:], weights[1:]):
                        tmp = scratch.tmp[:hi - lo]
                        np.multiply(part[lo:hi], np.float32(w), out=tmp)
                        np.add(out, tmp, out=out)
                for dst in into:
                    np.copyto(dst[lo:hi], out)
            return [None] * len(spans)

        threads = threads or _parallel.workers()
        chunk = min(SUM_CHUNK, max(MIN_SUM_CHUNK, -(-n // threads)))
        spans = [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
        _parallel.map_shares(work, spans, min(len(spans), threads), blas=False)

    def _update_job(self, r: Model, i: int) -> None:
        t = time.perf_counter()
        r.update_program().run({}, fetch=[])
        self._mark(f"update{i}", t)

    def _spent(self, what: str, since: float, args: dict | None = None) -> None:
        """Phase `what`, begun at `since` on this thread, into the totals (breakdown) and the timeline."""
        now = time.perf_counter()
        self.timings[what] = self.timings.get(what, 0.0) + now - since
        if self.timeline is not None:
            self.timeline.record(what, since, now, args)

    def _mark(self, what: str, since: float, args: dict | None = None) -> None:
        """A span for the timeline only (a wait or a part of a phase that breakdown does not total)."""
        if self.timeline is not None:
            self.timeline.record(what, since, time.perf_counter(), args)

    def write_timeline(self) -> Path | None:
        """Save the timeline now (it is also written after its last kept step and at exit); None
        without ANYGRAD_DP_TIMELINE. A failed write is reported, not raised: training goes on."""
        if self.timeline is None:
            return None
        try:
            return self.timeline.write()
        except OSError as e:
            print(f"anygrad: timeline not written to {self.timeline.path}: {e}", file=sys.stderr)
            return None

    def breakdown(self, reset: bool = True) -> dict[str, float]:
        """Host milliseconds per step in each part of the data-parallel step, since the last reset:
        submit (the main thread handing each device its shard), run<i> (device i's thread
        uploading its shard (upload<i> of it, on a GPU), encoding and submitting its gradient phase: on a GPU the host's part,
        on a CPU device the whole computation; with --sync-batchnorm also the waits for the other
        replicas), compute_wait<i> (device i finishing the step up to its first bucket and that
        bucket's readback), readback<i> (waiting for its other buckets), sum (with ranks: host sum
        of this process's devices' parts), all_reduce_wait (gloo beyond what overlapped),
        write_back (the reduced gradient into the devices' upload memory; without ranks, summed
        on the way), update (the update programs), hash, and step (the whole). The device
        threads' parts overlap the main thread's."""
        steps = max(1, self.steps)
        out = {k: 1000.0 * v / steps for k, v in self.timings.items()}
        if reset:
            self.timings, self.steps = {}, 0
        return out

    # -- equality of the replicas ---------------------------------------------------------------------
    def parameter_hash(self, r: Model) -> str:
        state = r.backend.get_states(list(r.graph.params))
        h = hashlib.sha256()
        for name in r.graph.params:
            h.update(np.ascontiguousarray(state[name]).tobytes())
        return h.hexdigest()[:16]

    def check_replicas(self) -> None:
        """Raise DeviceError unless every replica (every device, every rank) holds the same parameters."""
        hashes = [self.parameter_hash(r) for r in self.replicas]
        where = [f"device {i} ({r.backend.description})" for i, r in enumerate(self.replicas)]
        if self.group is not None and self.group.size > 1:
            gathered = self.group.gather_strings(";".join(hashes))
            hashes = [h for text in gathered for h in text.split(";")]
            where = [f"rank {k} {w}" for k in range(self.group.size) for w in where]
        if len(set(hashes)) > 1:
            odd = [w for w, h in zip(where, hashes) if h != hashes[0]]
            raise DeviceError(f"data-parallel replicas diverged after {self.updates} updates: the parameters of "
                              f"{', '.join(odd)} differ from {where[0]}'s. A device computes differently (driver "
                              "bug, non-deterministic kernel) or ranks run different settings; train on one device "
                              "to find which")

    # -- metrics (Model.read_metrics / reset_metrics) ----------------------------------------------
    def metric_sums(self, model: Model, names: list[str]) -> dict[str, float]:
        """The metric buffers `names` summed over every replica (every device, every rank)."""
        sums = np.zeros(len(names), np.float64)
        for r in self.replicas:
            sums += [float(r.backend.get_state(n)) if r.backend.has_state(n) else 0.0 for n in names]
        if self.group is not None and self.group.size > 1:
            sums = self.group.all_reduce_f64(sums)
        return dict(zip(names, sums.tolist()))

    def reset_metrics(self, model: Model, names: list[str]) -> None:
        """Zero the metric sums `names` on every replica (the model's own: every one)."""
        for name in names:
            model.backend.set_state(name, np.zeros((), np.float32))
        for r in self.replicas[1:]:
            for name in names:
                if r.backend.has_state(name):
                    r.backend.set_state(name, np.zeros((), np.float32))
