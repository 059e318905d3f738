"""The device threads of a data-parallel step: each replica's gradient phase on a thread of its
own (wgpu-py waits on events and numpy releases the GIL, so devices overlap) and, at an update,
its gradient's way onto the host bucket by bucket: on wgpu a bucket's copy is encoded right
after the kernel that finishes it and a reader thread takes it while the rest of the backward
pass runs. Each bucket is announced on its device's queue; the main thread waits there for it
(_await, _here) before it sums it (parallel.py). GradientReadback is DataParallel's half that
runs on those threads.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _parallel
from ..backends.base import Exchange, Executable
from ..ir.passes import RNG_STATE
from ..model import Model

READER_JOIN_S = 60.0  # a failed step waits this long at most for its bucket reader to stop


class GradientReadback:
    """The replicas' thread pool, their gradient phases and bucket readback, and the main thread's
    waits for the buckets, for DataParallel (which owns the state: buckets, queues, host buffers)."""

    def _pool_submit(self, fn, *args) -> Any:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            # A cpu device's ops stay on its own thread (no nested use of the shared numpy pool,
            # whose BLAS thread count one caller at a time may set): k cpu devices use k cores.
            self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="anygrad-replica",
                                            initializer=_parallel.mark_worker)
        return self._pool.submit(fn, *args)

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
            # the device waits for its shard, uploaded over the host's threads (big inputs staged
            # through mapped memory unless ANYGRAD_WGPU_STAGED_UPLOAD=0: WgpuExecutable._stage_input)
            exchange = Exchange()
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
