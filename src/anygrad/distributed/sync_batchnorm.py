"""SyncBatchNorm for DataParallel: with set_sync_batchnorm(True) the training programs'
BatchNorms become sums over every replica (ops.collective.AllReduceSum), forward and backward.
The replica threads of this process meet at each sum (_Meeting), and the ranks through gloo.
Separate from the gradient exchange: these sums run inside the gradient phase, on the device
threads, not between it and the update.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ConfigError


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


class SyncBatchNorm:
    """BatchNorm statistics per replica or over every replica, for DataParallel (which owns the
    state: the replicas, this micro-batch's shares in _sizes, the meeting in _meet)."""

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
