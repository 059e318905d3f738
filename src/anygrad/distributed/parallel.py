"""DataParallel: the step split into a gradient phase and an update phase, with the gradients
summed across replicas in between.

The gradient phase is the step program's "first"/"accumulate" phase (program.PHASES): it leaves
the micro-batch's gradient in the accum.<param> buffers instead of updating. The sum runs on the
host: replicas of this process (several devices) are summed weighted by their share of the batch,
then, in a torch.distributed job, all-reduced through gloo and divided by the number of ranks,
whose shares are equal by construction (ShardedLoader). Every replica then runs the same update
program (program.build_update_step) on the same summed gradient, so parameters stay equal; a hash
of them is compared every `check_every` updates, and a mismatch is an error.
"""
from __future__ import annotations

import copy
import hashlib
import time
from typing import Any

import numpy as np

from ..backends.base import Backend
from ..batch import Batch, batch_size, take
from ..data.loader import DataLoader
from ..errors import ConfigError, DeviceError
from ..ir.passes import RNG_STATE
from ..model import Model
from ..optim.base import LR_STATE
from ..program import ACCUM_PREFIX, build_update_step
from .launch import ProcessGroup
from .sampler import ShardedLoader

# What each phase of Model._next_phase becomes: gradients only, the update runs after the sum.
GRADIENT_PHASE = {"step": "first", "first": "first", "accumulate": "accumulate", "apply": "accumulate"}
UPDATES = ("step", "apply")


def device_list(device: Any) -> list[Any] | None:
    """The devices of a multi-device spec ('wgpu:0,wgpu:1' or a list), or None for one device."""
    if isinstance(device, (list, tuple)):
        return list(device) if len(device) > 1 else None
    if isinstance(device, str) and "," in device:
        items = [d.strip() for d in device.split(",") if d.strip()]
        return items if len(items) > 1 else None
    return None


def open_backends(devices: list[Any], limits: str | None = None, memory_budget: Any = None) -> list[Backend]:
    """Backends for a device list; a wgpu adapter named again opens another device of it (its own
    queue and memory), which is how two devices of one adapter share a batch."""
    from ..devices import get_backend
    out: list[Backend] = []
    seen: dict[str, int] = {}
    for d in devices:
        if isinstance(d, Backend):
            out.append(d)
            continue
        spec = str(d).strip().lower()
        again = seen.get(spec, 0)
        seen[spec] = again + 1
        if again and spec.startswith("wgpu"):
            from ..backends.wgpu import WgpuBackend
            out.append(WgpuBackend(spec, limits=limits, replica=again, memory_budget=memory_budget))
        else:
            out.append(get_backend(spec, limits=limits, memory_budget=memory_budget))
    return out


class DataParallel:
    """Attached to a compiled Model as `model.parallel`: Model.train_step and the metric reads
    come here. `backends`: the devices besides the model's own (this process); `group`: the
    torch.distributed job, or None."""

    def __init__(self, model: Model, backends: list[Backend] | None = None, group: ProcessGroup | None = None,
                 check_every: int = 100):
        model._require_compiled()
        self.model, self.group, self.check_every = model, group, int(check_every)
        self.replicas: list[Model] = [model] + [self._replica(b) for b in backends or []]
        self.updates = 0
        self._lr = model.optimizer.lr
        self._group_counts: list[int] = []  # samples per replica since the last update
        self._flat: tuple[np.ndarray, np.ndarray] | None = None  # the gradient vector and a device's part
        self._settings = (tuple(model.graph.params), model.clip_norm, model.accumulate)
        self.speeds: list[float] | None = None  # samples/s per device, once balance() measured them
        self._timing, self._timed_steps, self._times = False, 0, []
        # Unlike devices (an iGPU beside a dGPU) share by speed, measured after the first update.
        self._balance_later = len({r.backend.description for r in self.replicas}) > 1

    # -- replicas -------------------------------------------------------------------------------
    def _replica(self, backend: Backend) -> Model:
        """A Model sharing the graph, loss and optimizer settings, with its own device and programs."""
        r = copy.copy(self.model)
        r.backend, r._programs, r.parallel, r.micro_step = backend, {}, None, 0
        self._copy_state(r)
        return r

    def _copy_state(self, r: Model) -> None:
        state = self.model.full_state()
        for name in self.model.graph.state_names:
            state.setdefault(name, self.model.graph.initializers[name])
        for name, value in state.items():
            r.backend.set_state(name, value)
        r.optimizer.lr = self.model.optimizer.lr

    def state_loaded(self) -> None:
        """The model's state was overwritten (load_full_state): replicas take it."""
        for r in self.replicas[1:]:
            self._copy_state(r)
        self._lr = self.model.optimizer.lr

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

    def train_step(self, inputs: Batch, targets: Batch, flush: bool = False,
                   fetch_loss: bool = False) -> float | None:
        """Model.train_step (and train_on_batch with fetch_loss: the global batch's mean loss) on
        this process's batch (parsed: {input name: array}, {target name: array}): its devices'
        gradient phases, then, at an update, the exchange."""
        model = self.model
        phase = model._next_phase(flush)
        if model.optimizer.lr != self._lr:  # a scheduler moved it: the model's device has it already
            for r in self.replicas[1:]:
                r.backend.set_state(LR_STATE, np.array(model.optimizer.lr, np.float32))
            self._lr = model.optimizer.lr
        settings = (tuple(model.graph.params), model.clip_norm, model.accumulate)
        if settings != self._settings:  # freeze() or configure_step(): the replicas' programs are stale
            for r in self.replicas[1:]:
                r._programs.clear()
                r.clip_norm, r.accumulate = model.clip_norm, model.accumulate
            self._settings = settings
        sizes = self.shares(batch_size(inputs))
        losses, start = [], 0
        for i, (r, size) in enumerate(zip(self.replicas, sizes)):
            part = slice(start, start + size)
            feeds = {**take(inputs, part), **take(targets, part)}
            start += size
            exe = r._program("train", take(inputs, part), take(targets, part), GRADIENT_PHASE[phase])
            fetch = [exe.graph.outputs[0]] if fetch_loss else []
            if self._timing:  # balance(): this device alone, to its end (compiled before the clock starts)
                r.backend.get_state(RNG_STATE)  # the device is idle when the clock starts
                began = time.perf_counter()
                losses.append(exe.run(feeds, fetch=[exe.graph.outputs[0]]))
                self._times[i][0] += time.perf_counter() - began
                self._times[i][1] += size
            else:
                losses.append(exe.run(feeds, fetch=fetch))
        grouped = phase not in ("first", "step") and self._group_counts
        self._group_counts = [c + s for c, s in zip(self._group_counts, sizes)] if grouped else sizes
        if phase in UPDATES:
            self._reduce_and_update()
            if self._balance_later:
                self._balance_later = False
                self.balance()
            elif self._timing:
                self._timed_steps -= 1
                if self._timed_steps <= 0:
                    self.speeds = [n / max(t, 1e-9) for t, n in self._times]
                    self._timing = False
        if not fetch_loss:
            return None
        local = sum(float(out[next(iter(out))]) * s for out, s in zip(losses, sizes)) / sum(sizes)
        if self.group is not None:
            local = float(self.group.all_reduce_f64(np.array([local]))[0]) / self.group.size
        return local

    def _reduce_and_update(self) -> None:
        """Sum the replicas' accum buffers (one flat float32 vector each: one readback per device,
        all-reduced in place in buckets), write the sum back, run the update everywhere."""
        names = [ACCUM_PREFIX + p for p in self.model.graph.params]
        size = sum(int(self.model.graph.initializers[p].size) for p in self.model.graph.params)
        if self._flat is None or self._flat[0].size != size:
            self._flat = (np.empty(size, np.float32), np.empty(size, np.float32))
        flat, part = self._flat
        counts = self._group_counts
        total = float(sum(counts))
        several = len(self.replicas) > 1
        for i, (r, n) in enumerate(zip(self.replicas, counts)):
            r.backend.export_states(names, flat if i == 0 else part)
            if several:  # weight by each device's share of the batch (exact with uneven shares)
                if i == 0:
                    flat *= np.float32(n / total)
                else:
                    flat += part * np.float32(n / total)
        if self.group is not None and self.group.size > 1:
            self.group.all_reduce_flat(flat, 1.0 / self.group.size)
        if several or self.group is not None:
            for r in self.replicas:
                r.backend.import_states(names, flat)
        for r in self.replicas:
            self._update_program(r).run({}, fetch=[])
        self.updates += 1
        if self.check_every and self.updates % self.check_every == 0:
            self.check_replicas()

    def _update_program(self, r: Model):
        g = r.graph
        key = ("update", tuple(g.params), r.clip_norm, id(r.optimizer))
        if key not in r._programs:
            r._programs[key] = r.backend.compile(build_update_step(g, r.optimizer, clip_norm=r.clip_norm))
        return r._programs[key]

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
    def metric_sums(self, names: list[str]) -> dict[str, float]:
        """The metric buffers `names` summed over every replica (every device, every rank)."""
        sums = np.zeros(len(names), np.float64)
        for r in self.replicas:
            sums += [float(r.backend.get_state(n)) if r.backend.has_state(n) else 0.0 for n in names]
        if self.group is not None and self.group.size > 1:
            sums = self.group.all_reduce_f64(sums)
        return dict(zip(names, sums.tolist()))

    def reset_metrics(self) -> None:
        names = self.model._metric_buffers()
        for r in self.replicas[1:]:
            for name in names:
                if r.backend.has_state(name):
                    r.backend.set_state(name, np.zeros((), np.float32))
