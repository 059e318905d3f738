"""The gradient buckets of a data-parallel update: each a run of consecutive parameters (a range
of the flat gradient vector), cut at the bucket size in use, taken in the order the program
finishes them, with the host buffers they land in and the queues on which each device announces
the buckets it has read back. BucketLayout is DataParallel's half that lays them out; the device
threads (readback.py) fill them and the main thread (parallel.py) sums them.
"""
from __future__ import annotations

import contextlib
import queue
from typing import Any

import numpy as np

from .. import settings as env_settings
from ..backends.base import Executable
from ..program import ACCUM_PREFIX

# gradients summed and all-reduced straight from the devices' mapped readback memory; 0: each
# bucket copied into a host buffer first (the A/B: one more pass over every gradient byte)
SUM_VIEWS_ENV = "ANYGRAD_DP_SUM_MAPPED"


class BucketLayout:
    """The buckets, their order, host buffers and queues, for DataParallel (which owns the state)."""

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
