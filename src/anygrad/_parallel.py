"""CPU parallelism for the numpy kernels: one worker pool, one BLAS policy, one split helper.

numpy runs a ufunc or a copy on one core, and OpenBLAS threads a GEMM only inside that one call.
The numpy backend instead spreads independent pieces of an op (batch chunks of a convolution,
batch slices of BatchNorm, row or column blocks of a matmul, flat slices of an elementwise op)
over a pool of worker threads (numpy and BLAS release the GIL), each calling a single-threaded
BLAS. `ANYGRAD_NUMPY_THREADS` sets the number of workers (default: the CPUs this process may use,
at most 8).

OpenBLAS's own threads busy-wait for a while after every multithreaded call, so on a small
machine they take cores away from the workers of the next ops: measured on 2 vCPUs (MNIST CNN,
batch 1000), a step ran ~20% faster with OpenBLAS at one thread. The numpy backend therefore
makes BLAS single-threaded for a whole step (`serial_blas`), and the matmuls it runs split
themselves over the workers (`matmul`); ANYGRAD_NUMPY_THREADS=1 thus means one thread in all. Without a way to set the BLAS thread count (a BLAS other
than OpenBLAS), work that calls BLAS runs on the calling thread only.

Determinism: splitting never changes what is summed, nor in which order: pieces are disjoint
blocks of the output (each output element is computed by exactly one piece, with the full
reduction), and where an op reduces over pieces (the convolution weight gradient) the pieces and
their order are fixed independently of the number of workers.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from . import settings

T = TypeVar("T")
R = TypeVar("R")

_POOL: ThreadPoolExecutor | None = None
_BLAS: tuple | None = None
# .worker: this thread runs ops without the pool (a pool worker, or a data-parallel device's
# thread); .pooled: it is one of the pool's (or running a share), so it never waits on the pool
_local = threading.local()


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has none of the parent's worker threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def workers() -> int:
    """How many threads share an op: ANYGRAD_NUMPY_THREADS, else the CPUs this process may use."""
    fixed = settings.get("ANYGRAD_NUMPY_THREADS")
    if fixed is not None:
        return fixed
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, 8))


def blas_threads() -> tuple | None:
    """(get, set) of the OpenBLAS thread count numpy uses, found once; () when there is none."""
    global _BLAS
    if _BLAS is None:
        _BLAS = ()
        try:
            with open("/proc/self/maps") as maps:
                paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower()})
        except OSError:
            paths = []
        for path in paths:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"),
                                   ("openblas", "")):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    _BLAS = (get, put)
                    return _BLAS
    return _BLAS


def blas_workers() -> int:
    """Workers for work that calls BLAS: 1 unless this BLAS can be made single-threaded."""
    return workers() if blas_threads() else 1


@contextlib.contextmanager
def serial_blas():
    """OpenBLAS at one thread inside, the previous count restored after (a no-op without it)."""
    controls = blas_threads()
    if not controls:
        yield
        return
    get, put = controls
    before = get()
    if before != 1:
        put(1)
    try:
        yield
    finally:
        if before != 1:
            put(before)


def mark_worker() -> None:
    """This thread runs ops without the pool (a thread of its own per data-parallel device)."""
    _local.worker = True


def _pool(n: int) -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL._max_workers < n:

        def mark() -> None:
            _local.worker = _local.pooled = True

        _POOL = ThreadPoolExecutor(n, thread_name_prefix="anygrad-cpu", initializer=mark)
    return _POOL


def shares(items: Sequence[T], n: int) -> list[list[T]]:
    """items dealt round-robin into at most n non-empty shares (one per worker)."""
    n = max(1, min(n, len(items)))
    return [list(items[i::n]) for i in range(n)]


def map_shares(work: Callable[[list[T]], list[R]], items: Sequence[T], n: int | None = None,
               blas: bool = True) -> list[R]:
    """work(share) on each of up to n threads (default: every worker), one round-robin share of
    items each; returns the results in the order of items. work returns one result per item of
    its share, so it can set up per-thread scratch buffers once. The calling thread takes the
    first share itself. blas: work calls BLAS (threads then need a BLAS that can be made
    single-threaded; the thread count is restored afterwards)."""
    n = (blas_workers() if blas else workers()) if n is None else n
    if getattr(_local, "worker", False):
        n = 1  # already on a worker: never wait on the pool from inside it
    return _run_shares(work, items, n, blas)


def _run_shares(work: Callable[[list[T]], list[R]], items: Sequence[T], n: int, blas: bool) -> list[R]:
    parts = shares(items, n)
    if len(parts) <= 1:
        return list(work(list(items))) if items else []
    # numpy's error state is per thread: the workers take the caller's (the numpy runtime quiets
    # f16 overflow, an expected event under loss scaling, for the whole step)
    err = np.geterr()

    def in_callers_errstate(part: list[T]) -> list[R]:
        with np.errstate(**err):
            return work(part)
    with serial_blas() if blas else contextlib.nullcontext():
        futures = [_pool(len(parts) - 1).submit(in_callers_errstate, part) for part in parts[1:]]
        was = getattr(_local, "worker", False), getattr(_local, "pooled", False)
        _local.worker = _local.pooled = True  # the calling thread is a worker too until its share is done
        try:
            first = work(parts[0])
        finally:
            _local.worker, _local.pooled = was
        results = [first] + [f.result() for f in futures]
    out: list = [None] * len(items)
    for i, part_results in enumerate(results):
        out[i::len(parts)] = part_results
    return out


COPY_CHUNK = 4 << 20  # bytes per thread's piece of a parallel copy


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """np.copyto for large 1-D arrays, in pieces over the threads: one core copies ~9 GB/s, short
    of what memory and PCIe give (a 45 MB gradient read back from a mapped wgpu buffer: 5.1 ms on
    one thread, 1.7 ms on 8, on the H100 host)."""
    if dst.nbytes < 2 * COPY_CHUNK or getattr(_local, "pooled", False):
        np.copyto(dst, src)
        return
    step = max(1, COPY_CHUNK // dst.itemsize)
    pieces = [slice(lo, lo + step) for lo in range(0, dst.size, step)]

    def work(share: list[slice]) -> list[None]:
        for sl in share:
            np.copyto(dst[sl], src[sl])
        return [None] * len(share)
    # also from a data-parallel device's thread (mark_worker), unlike ops: a copy never waits on
    # the pool from inside its share, and these are the host's bytes on their way to a GPU
    _run_shares(work, pieces, min(len(pieces), workers()), blas=False)


def ranges(n: int, parts: int, align: int = 1) -> list[slice]:
    """[0, n) cut into at most `parts` contiguous slices of near-equal size (multiples of align)."""
    step = -(-n // max(1, parts))
    step = -(-step // align) * align
    return [slice(lo, min(n, lo + step)) for lo in range(0, n, max(1, step))]


# numpy runs a ufunc on one core; big elementwise work (the numpy backend's in-place kernels,
# BatchNorm's batch blocks) is split over the workers (ufuncs release the GIL). Below this many
# elements it runs on one thread: threads cost more than they save.
SPLIT_MIN = 1 << 20

# A matmul below this many flops runs as one call: a pool round trip costs ~20-50 us.
_MATMUL_SPLIT_MIN = 1 << 23


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.matmul(a, b) with the output cut into row blocks (or column blocks, when it is wider
    than tall) computed on every worker. The split depends only on the shapes and the worker
    count, so a run repeats bit for bit at a given ANYGRAD_NUMPY_THREADS; against one BLAS call
    an element may differ in its last bits, since BLAS sums a block's edge rows with other kernels
    (OpenBLAS 0.3.31: rows 96-99 of a 100-row block)."""
    # The cheap checks first: most matmuls of a step are small, and blas_workers() asks the OS.
    if (a.ndim < 2 or b.ndim < 2 or a.dtype != b.dtype or a.dtype.char not in "fd"
            or 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * max(math.prod(a.shape[:-2]), math.prod(b.shape[:-2]))
            < _MATMUL_SPLIT_MIN or (n := blas_workers()) <= 1):
        return np.matmul(a, b)
    out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), a.dtype)
    rows = a.shape[-2] >= b.shape[-1]
    blocks = ranges(a.shape[-2] if rows else b.shape[-1], n, 1 if rows else 16)

    def work(share: list[slice]) -> list[None]:
        for s in share:
            if rows:
                np.matmul(a[..., s, :], b, out=out[..., s, :])
            else:
                np.matmul(a, b[..., s], out=out[..., s])
        return [None] * len(share)

    map_shares(work, blocks, n)
    return out
