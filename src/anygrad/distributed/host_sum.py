"""The host's weighted sum of the devices' gradient parts, the data-parallel exchange's one
numeric kernel: parts summed in order (or each weighted, then summed in order), in cache-sized
chunks over the host's threads, into one or several outputs (a host buffer, the devices' mapped
upload memory). Separate from the exchange that calls it (DataParallel._combine) because its
bits are what keeps the replicas equal and the sum exact: its tests hold it to numpy's one-pass
result.
"""
from __future__ import annotations

import threading

import numpy as np

from .. import _parallel

# float32 elements a thread sums at a time (1 MB: an 8 MB bucket spreads over 8 threads, and a
# chunk's sum stays in the thread's cache on its way to every device's upload memory); smaller
# buckets are cut into pieces of at least MIN_SUM_CHUNK, one a thread (a 2 MB bucket over 8
# threads, not 2: the last buckets' sums are on the step's critical path)
SUM_CHUNK = 1 << 18
MIN_SUM_CHUNK = 1 << 15


def combine(parts: list[np.ndarray], weights: list[float], equal: bool, into: list[np.ndarray],
            scratch: threading.local, threads: int | None = None) -> None:
    """Every array of `into` = the weighted sum of `parts` (equal weights: their sum, in order,
    times the weight; else each part times its own, summed in order), in chunks over the host's
    threads (memory-bound: one thread does not saturate it). Each chunk is summed once in a
    cache-sized scratch of its thread, then copied out, so `into` may hold parts[0]. One part
    into one array (a rank's one device) is one pass, part times weight straight into it: the
    write-back of a rank's all-reduced bucket into its device's upload memory, at the end of
    the step. `threads`: at most that many (default every worker of the host). `scratch`
    holds each thread's chunk buffers (DataParallel's, kept from step to step)."""
    n = parts[0].size
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
