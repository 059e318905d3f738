"""Neural-network ops: Conv, pooling, BatchNormalization, Dropout, Softmax / LogSoftmax.

Every sliding-window op (Conv and the pools) shares one geometry (`Window`): ONNX attributes plus
the input's spatial shape resolve to explicit begin/end pads and the output shape, for any number
of spatial dims. Gradient helpers are internal ops with explicit pads (auto_pad already resolved),
so a backend implements exactly: ConvGradInput, ConvGradWeight, MaxPoolGrad, AveragePoolGrad,
BatchNormGrad, DropoutGrad, SoftmaxGrad, LogSoftmaxGrad.

The numpy Conv is im2col + one BLAS matmul per batch chunk (all groups in one stacked matmul);
the chunk keeps the column matrix cache-sized instead of materialising it for the whole batch.
Chunks (and BatchNorm's batch slices) are spread over the cores, each with a single-threaded
BLAS; `ANYGRAD_NUMPY_THREADS` sets the number of workers (default: the CPUs this process may use).
"""
from __future__ import annotations

import ctypes
import itertools
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .. import rng
from ..errors import AnygradError, ShapeError, UnsupportedOpError
from ..ir.builder import GradContext
from ..ir.graph import Graph, Node, TensorInfo, info_of
from ..ir.passes import RNG_STATE
from ..ir.registry import defop
from ._util import norm_axis, same_as_first

# Column-matrix elements per batch chunk (floats): big enough for efficient GEMMs, small enough
# to stay cache-friendly (MNIST conv3 at batch 1000 would otherwise be 280 MB); measured best.
_COLS_BUDGET = 1 << 21


# -- window geometry -------------------------------------------------------------------------
def _str_attr(node: Node, key: str, default: str) -> str:
    value = node.attr(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Window:
    """Where each output of a sliding-window op reads its input, per spatial dim."""

    spatial: tuple[int, ...]    # input spatial shape
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]      # explicit pads (auto_pad resolved)
    end: tuple[int, ...]
    out: tuple[int, ...]

    @property
    def nd(self) -> int:
        return len(self.kernel)

    @property
    def extent(self) -> tuple[int, ...]:
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations))

    @property
    def pads(self) -> list[int]:
        return list(self.begin) + list(self.end)

    @property
    def padded(self) -> tuple[int, ...]:
        """Padded spatial shape, including the overhang of ceil_mode's last window."""
        return tuple(max(i + b + e, (o - 1) * s + x) for i, b, e, o, s, x in
                     zip(self.spatial, self.begin, self.end, self.out, self.strides, self.extent))

    def taps(self):
        """(kernel offset, slice of the padded input that offset reads for every output)."""
        for idx in itertools.product(*(range(k) for k in self.kernel)):
            yield idx, (slice(None), slice(None)) + tuple(
                slice(i * d, i * d + (o - 1) * s + 1, s)
                for i, d, o, s in zip(idx, self.dilations, self.out, self.strides))

    def pad(self, x: np.ndarray, value: float = 0.0) -> np.ndarray:
        widths = [(0, 0), (0, 0)] + [(b, p - i - b) for i, b, p in zip(self.spatial, self.begin, self.padded)]
        if not any(w for pair in widths for w in pair):
            return x
        return np.pad(x, widths, constant_values=value)

    def crop(self, xp: np.ndarray) -> np.ndarray:
        inside = tuple(slice(b, b + i) for b, i in zip(self.begin, self.spatial))
        return xp[(slice(None), slice(None)) + inside]

    def attrs(self) -> dict:
        """Explicit attributes for the internal gradient ops (no auto_pad left to resolve)."""
        return {"kernel_shape": list(self.kernel), "strides": list(self.strides),
                "dilations": list(self.dilations), "pads": self.pads}


def window(node: Node, spatial, kernel, ceil_mode: bool = False) -> Window:
    """Resolve a node's strides/dilations/pads/auto_pad against an input spatial shape."""
    nd = len(kernel)
    spatial, kernel = tuple(int(d) for d in spatial), tuple(int(k) for k in kernel)
    strides = tuple(int(s) for s in (node.attr("strides") or [1] * nd))
    dilations = tuple(int(d) for d in (node.attr("dilations") or [1] * nd))
    if len(strides) != nd or len(dilations) != nd:
        raise ShapeError(f"{node.label}: strides {list(strides)} / dilations {list(dilations)} do not "
                         f"match the {nd} spatial dims")
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    auto_pad = _str_attr(node, "auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = tuple(-(-i // s) for i, s in zip(spatial, strides))
        total = [max(0, (o - 1) * s + x - i) for o, s, x, i in zip(out, strides, extent, spatial)]
        # SAME_UPPER puts the odd pad at the end, SAME_LOWER at the beginning.
        begin = tuple(t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total)
        end = tuple(t - b for t, b in zip(total, begin))
        return Window(spatial, kernel, strides, dilations, begin, end, out)
    if auto_pad == "VALID":
        pads = [0] * (2 * nd)
    elif auto_pad == "NOTSET":
        pads = [int(p) for p in (node.attr("pads") or [0] * (2 * nd))]
    else:
        raise ShapeError(f"{node.label}: unknown auto_pad '{auto_pad}'")
    if len(pads) != 2 * nd:
        raise ShapeError(f"{node.label}: pads {pads} must have 2 x {nd} entries")
    begin, end = tuple(pads[:nd]), tuple(pads[nd:])
    out = []
    for i, b, e, x, s in zip(spatial, begin, end, extent, strides):
        span = i + b + e - x
        o = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (o - 1) * s >= i + b:
            o -= 1  # the last window would start in the end padding (PyTorch and ONNX drop it)
        out.append(o)
    if any(o < 1 for o in out):
        raise ShapeError(f"{node.label}: kernel {list(kernel)} (dilations {list(dilations)}) does not fit "
                         f"input {list(spatial)} with pads {pads}")
    return Window(spatial, kernel, strides, dilations, begin, end, tuple(out))


def _chunk(n: int, per_item: int) -> int:
    return max(1, min(n, _COLS_BUDGET // max(1, per_item)))


# -- batch chunks on every core ----------------------------------------------------------------
# numpy runs im2col copies and transposes on one core, and OpenBLAS gains little from threading
# GEMMs this skinny. Each core instead takes its own batch chunks end to end (im2col, GEMM with a
# single-threaded BLAS, scatter), which measured ~1.4x faster on 2 cores. Without a way to set
# the BLAS thread count (a BLAS other than OpenBLAS), chunks run one after another.
_BLAS_THREADS: tuple | None = None
_POOL: ThreadPoolExecutor | None = None


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has none of the parent's worker threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _blas_threads() -> tuple | None:
    """(get, set) of the OpenBLAS thread count numpy uses, found once; () when there is none."""
    global _BLAS_THREADS
    if _BLAS_THREADS is None:
        _BLAS_THREADS = ()
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
                    _BLAS_THREADS = (get, put)
                    return _BLAS_THREADS
    return _BLAS_THREADS


def _cores() -> int:
    if os.environ.get("ANYGRAD_NUMPY_THREADS"):
        return max(1, int(os.environ["ANYGRAD_NUMPY_THREADS"]))
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, 8))


@contextmanager
def _single_threaded_blas():
    get, put = _blas_threads()
    before = get()
    put(1)
    try:
        yield
    finally:
        put(before)


def _over_chunks(n: int, step: int, workers: int, work: Callable[[list[int]], object]) -> list:
    """work(chunk starts) on `workers` threads, each with its own share of the batch chunks."""
    global _POOL
    starts = list(range(0, n, step))
    workers = min(workers, len(starts))
    if workers <= 1:
        return [work(starts)]
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix="anygrad-conv")
    with _single_threaded_blas():
        return list(_POOL.map(work, [starts[i::workers] for i in range(workers)]))


_SPLIT_MIN = 1 << 20  # elements below which threads cost more than they save


def _over_batch(x: np.ndarray, fn: Callable[[slice], object]) -> list:
    """fn(batch slice) for one contiguous slice of x's batch per core; one slice when x is small."""
    n = x.shape[0]
    cores = min(_cores(), n) if _blas_threads() and x.size >= _SPLIT_MIN else 1
    bounds = [n * i // cores for i in range(cores + 1)]
    parts = [slice(lo, hi) for lo, hi in itertools.pairwise(bounds)]
    if cores <= 1:
        return [fn(p) for p in parts]
    per_worker = _over_chunks(cores, 1, cores, lambda starts: [fn(parts[i]) for i in starts])
    return [result for results in per_worker for result in results]


# Column-matrix elements of a whole batch below which one thread is faster: on small batches
# the workers wait on each other and on OpenBLAS's spinning threads. Measured on the MNIST CNN,
# 2 cores: batch 64 (conv3: 4.5M) is faster on one thread, batch 1000 (conv1: 6.1M) on two.
_PARALLEL_MIN = 5 << 20


def _chunk_plan(n: int, per_item: int) -> tuple[int, int]:
    """(chunk size, workers): the workers share the cache budget, and every one gets a chunk."""
    cores = _cores() if _blas_threads() and n * per_item >= _PARALLEL_MIN else 1
    return max(1, min(-(-n // cores), _COLS_BUDGET // cores // max(1, per_item))), cores


# -- Conv ------------------------------------------------------------------------------------
def _conv_window(node: Node, x_shape, w_shape) -> Window:
    kernel = tuple(w_shape[2:])
    if node.attr("kernel_shape") is not None and tuple(node.attr("kernel_shape")) != kernel:
        raise ShapeError(f"{node.label}: kernel_shape {list(node.attr('kernel_shape'))} differs from the "
                         f"weight's {list(kernel)}")
    return window(node, x_shape[2:], kernel)


def _conv_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    x, w = ins[0], ins[1]
    if x.rank < 3 or w.rank != x.rank:
        raise ShapeError(f"{node.label}: Conv needs X (N, C, ...) and W (M, C/group, ...) of equal rank, "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    group = int(node.attr("group", 1))
    if x.shape[1] != w.shape[1] * group or w.shape[0] % group:
        raise ShapeError(f"{node.label}: X has {x.shape[1]} channels but W {tuple(w.shape)} with "
                         f"group={group} "
                         f"expects {w.shape[1] * group}")
    if len(ins) > 2 and ins[2] is not None and tuple(ins[2].shape) != (w.shape[0],):
        raise ShapeError(f"{node.label}: bias shape {tuple(ins[2].shape)} is not ({w.shape[0]},)")
    win = _conv_window(node, x.shape, w.shape)
    return [TensorInfo(x.dtype, (x.shape[0], w.shape[0]) + win.out)]


class _Scratch:
    """One buffer every batch chunk reuses: a fresh multi-MB array per chunk costs page faults."""

    def __init__(self, size: int, dtype: np.dtype):
        self.data = np.empty(size, dtype)

    def view(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.data[:math.prod(shape)].reshape(shape)


def _columns(xp: np.ndarray, win: Window, group: int, scratch: _Scratch) -> np.ndarray:
    """im2col of a padded batch chunk: (group, C/group * prod(kernel), B * prod(out))."""
    nd = win.nd
    view = sliding_window_view(xp, win.extent, axis=tuple(range(2, 2 + nd)))
    view = view[(slice(None), slice(None))
                + tuple(slice(None, (o - 1) * s + 1, s) for o, s in zip(win.out, win.strides))
                + tuple(slice(None, None, d) for d in win.dilations)]
    # (B, C, *out, *kernel) -> (C, *kernel, B, *out): rows are (channel, tap), columns pixels.
    perm = (1,) + tuple(range(2 + nd, 2 + 2 * nd)) + (0,) + tuple(range(2, 2 + nd))
    b, c = xp.shape[:2]
    cols = scratch.view((c,) + win.kernel + (b,) + win.out)
    np.copyto(cols, view.transpose(perm))
    return cols.reshape(group, (c // group) * math.prod(win.kernel), b * math.prod(win.out))


def conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, win: Window, group: int) -> np.ndarray:
    n, c = x.shape[:2]
    m = w.shape[0]
    p = math.prod(win.out)
    w3 = w.reshape(group, m // group, -1)
    xp = win.pad(x)
    y = np.empty((n, m) + win.out, x.dtype)  # owns its memory: the executor may reuse it in place
    y3 = y.reshape(n, m, p)
    bias = None if b is None else b.reshape(1, m, 1).astype(x.dtype, copy=False)
    step, workers = _chunk_plan(n, c * math.prod(win.kernel) * p)

    def work(starts: list[int]) -> None:
        cols_buf = _Scratch(c * math.prod(win.kernel) * step * p, x.dtype)
        out_buf = _Scratch(m * step * p, x.dtype)
        for b0 in starts:
            cols = _columns(xp[b0:b0 + step], win, group, cols_buf)
            chunk = out_buf.view((group, m // group, cols.shape[2]))
            np.matmul(w3, cols, out=chunk)
            chunk = chunk.reshape(m, -1, p).transpose(1, 0, 2)
            if bias is None:
                y3[b0:b0 + step] = chunk
            else:  # transpose and bias in one pass while the chunk is in cache
                np.add(chunk, bias, out=y3[b0:b0 + step])

    _over_chunks(n, step, workers, work)
    return y


def _conv_forward(node, ins):
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    return conv(x, w.astype(x.dtype, copy=False), b, _conv_window(node, x.shape, w.shape),
                int(node.attr("group", 1)))


def conv_grad_input(dy: np.ndarray, w: np.ndarray, win: Window, group: int, x_shape) -> np.ndarray:
    """dX: each output's gradient spread over its window (GEMM, then col2im tap by tap)."""
    if all(s == 1 for s in win.strides):
        return _conv_grad_input_flat(dy, w, win, group, x_shape)
    n, c = x_shape[:2]
    m = w.shape[0]
    p = math.prod(win.out)
    kg = (c // group) * math.prod(win.kernel)
    wt = np.ascontiguousarray(w.reshape(group, m // group, kg).transpose(0, 2, 1))  # (G, Kg, Mg)
    dy4 = dy.reshape(n, group, m // group, p)
    dxp = np.zeros((n, c) + win.padded, dy.dtype)
    step = _chunk(n, c * math.prod(win.kernel) * p)
    cols_buf = _Scratch(step * group * kg * p, dy.dtype)
    for b0 in range(0, n, step):
        dyc = dy4[b0:b0 + step]
        dcols = cols_buf.view((dyc.shape[0], group, kg, p))
        np.matmul(wt, dyc, out=dcols)  # per sample
        dcols = dcols.reshape((-1, c) + win.kernel + win.out)
        target = dxp[b0:b0 + step]
        for idx, sl in win.taps():
            # Within one tap the outputs read distinct inputs, so a strided += is exact.
            target[sl] += dcols[(slice(None), slice(None)) + idx]
    return win.crop(dxp)


def _conv_grad_input_flat(dy: np.ndarray, w: np.ndarray, win: Window, group: int, x_shape) -> np.ndarray:
    """conv_grad_input for stride 1, where every tap is a flat shift of the padded grid.

    dY is laid out channel-major on the padded grid (zeros where no output is), so col2im is one
    long contiguous add per tap instead of numpy iterating over short rows (2x faster here)."""
    n, c = x_shape[:2]
    m = w.shape[0]
    taps = math.prod(win.kernel)
    grid = math.prod(win.padded)
    pitch = [math.prod(win.padded[i + 1:]) for i in range(win.nd)]
    offsets = [sum(i * d * p for i, d, p in zip(idx, win.dilations, pitch))
               for idx in itertools.product(*(range(k) for k in win.kernel))]
    wt = np.ascontiguousarray(w.reshape(group, m // group, (c // group) * taps).transpose(0, 2, 1))
    outputs = (slice(None), slice(None)) + tuple(slice(0, o) for o in win.out)
    inside = (slice(None), slice(None)) + tuple(slice(b, b + i) for b, i in zip(win.begin, win.spatial))
    dx = np.empty(x_shape, dy.dtype)
    step, workers = _chunk_plan(n, c * taps * grid)

    def work(starts: list[int]) -> None:
        dy_buf, cols_buf = _Scratch(m * step * grid, dy.dtype), _Scratch(c * taps * step * grid, dy.dtype)
        acc_buf = _Scratch(c * (step * grid + offsets[-1]), dy.dtype)
        for b0 in starts:
            dyc = dy[b0:b0 + step]
            bsz = dyc.shape[0]
            size = bsz * grid
            dyf = dy_buf.view((m, bsz) + win.padded)
            dyf.fill(0)
            dyf[outputs] = dyc.swapaxes(0, 1)
            dcols = cols_buf.view((group, (c // group) * taps, size))
            np.matmul(wt, dyf.reshape(group, m // group, size), out=dcols)
            dcols = dcols.reshape(c, taps, size)
            acc = acc_buf.view((c, size + offsets[-1]))
            acc.fill(0)
            for t, off in enumerate(offsets):
                acc[:, off:off + size] += dcols[:, t]
            dx[b0:b0 + bsz] = acc[:, :size].reshape((c, bsz) + win.padded)[inside].swapaxes(0, 1)

    _over_chunks(n, step, workers, work)
    return dx


def conv_grad_weight(dy: np.ndarray, x: np.ndarray, win: Window, group: int, w_shape) -> np.ndarray:
    """dW = dY (as M x pixels) @ columns^T, accumulated over batch chunks."""
    n, c = x.shape[:2]
    m = w_shape[0]
    p = math.prod(win.out)
    xp = win.pad(x)
    _, workers = _chunk_plan(n, c * math.prod(win.kernel) * p)
    step = _chunk(n, c * math.prod(win.kernel) * p)  # the chunking fixes the summation order

    def work(starts: list[int]) -> list[tuple[int, np.ndarray]]:
        cols_buf = _Scratch(c * math.prod(win.kernel) * step * p, x.dtype)
        dy_buf = _Scratch(m * step * p, dy.dtype)
        partials = []
        for b0 in starts:
            cols = _columns(xp[b0:b0 + step], win, group, cols_buf)
            dyc = dy[b0:b0 + step].reshape(-1, group, m // group, p)
            dyt = dy_buf.view((group, m // group, dyc.shape[0], p))
            np.copyto(dyt, dyc.transpose(1, 2, 0, 3))
            partials.append((b0, np.matmul(dyt.reshape(group, m // group, -1), cols.transpose(0, 2, 1))))
        return partials

    dw = np.zeros((group, m // group, (c // group) * math.prod(win.kernel)), dy.dtype)
    # Chunk by chunk in batch order, whichever core computed it: the same bits on any core count.
    for _, partial in sorted((pair for part in _over_chunks(n, step, workers, work) for pair in part),
                             key=lambda pair: pair[0]):
        dw += partial
    return dw.reshape(w_shape).astype(dy.dtype, copy=False)


def _explicit(node: Node, win: Window, **extra) -> dict:
    return {**win.attrs(), "group": int(node.attr("group", 1)), **extra}


def _conv_grad(g: GradContext):
    x, w = g.x[0], g.x[1]
    xs, ws = g.shape(x), g.shape(w)
    attrs = _explicit(g.node, _conv_window(g.node, xs, ws))
    dx = g.op("ConvGradInput", [g.dy, w], **attrs, input_shape=list(xs)) if g.need(0) else None
    dw = g.op("ConvGradWeight", [g.dy, x], **attrs, weight_shape=list(ws)) if g.need(1) else None
    db = None
    if g.need(2) and g.node.input(2):
        axes = [0] + list(range(2, len(xs)))
        db = g.op("ReduceSum", [g.dy, g.const(np.array(axes, np.int64), np.int64, "axes")], keepdims=0)
    return [dx, dw, db]


defop("Conv", infer=_conv_infer, forward=_conv_forward, grad=_conv_grad)


def _grad_input_infer(node, ins):
    return [TensorInfo(ins[0].dtype, tuple(int(d) for d in node.attr("input_shape")))]


def _conv_grad_input_forward(node, ins):
    dy, w = ins
    shape = tuple(node.attr("input_shape"))
    return conv_grad_input(dy, w.astype(dy.dtype, copy=False), window(node, shape[2:], w.shape[2:]),
                           int(node.attr("group", 1)), shape)


def _conv_grad_weight_forward(node, ins):
    dy, x = ins
    shape = tuple(node.attr("weight_shape"))
    return conv_grad_weight(dy, x, window(node, x.shape[2:], shape[2:]), int(node.attr("group", 1)), shape)


def _conv_grad_input_grad(g: GradContext):
    """ConvGradInput is linear in dY and in W: a Conv of the incoming gradient for dY, the weight
    gradient with input and output swapped for W (ConvTranspose and double backward use this)."""
    attrs = {k: v for k in ("kernel_shape", "strides", "dilations", "pads", "group")
             if (v := g.node.attr(k)) is not None}
    dy, w = g.x[0], g.x[1]
    ddy = g.op("Conv", [g.dy, w], **attrs) if g.need(0) else None
    dw = g.op("ConvGradWeight", [dy, g.dy], **attrs, weight_shape=list(g.shape(w))) if g.need(1) else None
    return [ddy, dw]


defop("ConvGradInput", infer=_grad_input_infer, forward=_conv_grad_input_forward, grad=_conv_grad_input_grad,
      internal=True)
defop("ConvGradWeight", internal=True, forward=_conv_grad_weight_forward,
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, tuple(int(d) for d in node.attr("weight_shape")))])


# -- pooling -----------------------------------------------------------------------------------
def _pool_window(node: Node, x_shape) -> Window:
    kernel = node.attr("kernel_shape")
    if kernel is None:
        raise ShapeError(f"{node.label}: {node.op} needs the kernel_shape attribute")
    return window(node, x_shape[2:], kernel, bool(node.attr("ceil_mode", 0)))


def _pool_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    if len(node.outputs) > 1 and node.outputs[1]:
        raise UnsupportedOpError(f"{node.label}: the Indices output of MaxPool is not supported; export "
                                 "the model without return_indices")
    x = ins[0]
    win = _pool_window(node, x.shape)
    return [TensorInfo(x.dtype, tuple(x.shape[:2]) + win.out)]


def _max_pool_forward(node, ins):
    x = ins[0]
    win = _pool_window(node, x.shape)
    lowest = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min  # padding never wins
    xp = win.pad(x, lowest)
    y = None
    for _, sl in win.taps():
        y = xp[sl].copy() if y is None else np.maximum(y, xp[sl], out=y)
    return y


def _max_pool_grad_forward(node, ins):
    """Each output's gradient goes to the first maximum of its window (row-major), as PyTorch."""
    dy, x = ins
    win = _pool_window(node, x.shape)
    xp = win.pad(x, -np.inf)
    taps = list(win.taps())
    best = xp[taps[0][1]].copy()
    arg = np.zeros(best.shape, np.int32)
    for t, (_, sl) in enumerate(taps[1:], start=1):
        better = xp[sl] > best  # strict: ties keep the earlier tap
        np.copyto(best, xp[sl], where=better)
        arg[better] = t
    dxp = np.zeros(xp.shape, dy.dtype)
    for t, (_, sl) in enumerate(taps):
        dxp[sl] += np.where(arg == t, dy, 0)
    return win.crop(dxp)


def _pool_attrs(node: Node, win: Window) -> dict:
    return {**win.attrs(), "ceil_mode": int(node.attr("ceil_mode", 0)),
            "count_include_pad": int(node.attr("count_include_pad", 0))}


def _max_pool_grad(g: GradContext):
    win = _pool_window(g.node, g.shape(g.x[0]))
    return [g.op("MaxPoolGrad", [g.dy, g.x[0]], **_pool_attrs(g.node, win))]


defop("MaxPool", infer=_pool_infer, forward=_max_pool_forward, grad=_max_pool_grad)
defop("MaxPoolGrad", infer=lambda node, ins: [TensorInfo(ins[0].dtype, ins[1].shape)],
      forward=_max_pool_grad_forward, internal=True)


def _window_counts(node: Node, win: Window) -> np.ndarray:
    """How many elements each average divides by, shape (*out).

    count_include_pad counts the explicit padding but never ceil_mode's overhang (PyTorch)."""
    inside = np.zeros(win.padded, np.float32)
    if node.attr("count_include_pad", 0):
        inside[tuple(slice(0, i + b + e) for i, b, e in zip(win.spatial, win.begin, win.end))] = 1
    else:
        inside[tuple(slice(b, b + i) for i, b in zip(win.spatial, win.begin))] = 1
    inside = inside[None, None]
    counts = sum(inside[sl] for _, sl in win.taps())
    return np.maximum(counts[0, 0], 1)


def _avg_pool_forward(node, ins):
    x = ins[0]
    win = _pool_window(node, x.shape)
    xp = win.pad(x)
    total = np.zeros(x.shape[:2] + win.out, x.dtype)
    for _, sl in win.taps():
        total += xp[sl]
    return (total / _window_counts(node, win)).astype(x.dtype)


def _avg_pool_grad_forward(node, ins):
    dy = ins[0]
    shape = tuple(node.attr("input_shape"))
    win = _pool_window(node, shape)
    share = (dy / _window_counts(node, win)).astype(dy.dtype)
    dxp = np.zeros(shape[:2] + win.padded, dy.dtype)
    for _, sl in win.taps():
        dxp[sl] += share
    return win.crop(dxp)


def _avg_pool_grad(g: GradContext):
    xs = g.shape(g.x[0])
    win = _pool_window(g.node, xs)
    return [g.op("AveragePoolGrad", [g.dy], **_pool_attrs(g.node, win), input_shape=list(xs))]


defop("AveragePool", infer=_pool_infer, forward=_avg_pool_forward, grad=_avg_pool_grad)
defop("AveragePoolGrad", infer=_grad_input_infer, forward=_avg_pool_grad_forward, internal=True)


def _global_avg_infer(node, ins):
    x = ins[0]
    return [TensorInfo(x.dtype, tuple(x.shape[:2]) + (1,) * (x.rank - 2))]


def _global_avg_grad(g: GradContext):
    xs = g.shape(g.x[0])
    scaled = g.op("Mul", [g.dy, g.const(1.0 / math.prod(xs[2:]), g.dtype(g.dy))])
    return [g.op("Expand", [scaled, g.const(np.array(xs, np.int64), np.int64, "shape")])]


def _global_avg_forward(node, ins):
    x = ins[0]
    return x.mean(axis=tuple(range(2, x.ndim)), keepdims=True).astype(x.dtype)


defop("GlobalAveragePool", infer=_global_avg_infer, forward=_global_avg_forward, grad=_global_avg_grad)


# -- BatchNormalization --------------------------------------------------------------------------
def _channel(v: np.ndarray, rank: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast against (N, C, ...)."""
    return v.reshape((1, -1) + (1,) * (rank - 2))


def _bn_axes(rank: int) -> tuple[int, ...]:
    return (0,) + tuple(range(2, rank))


def _bn_infer(node, ins):
    x = ins[0]
    if x.rank < 2:
        raise ShapeError(f"{node.label}: BatchNormalization needs (N, C, ...) input, got {tuple(x.shape)}")
    for slot in range(1, 5):
        if ins[slot] is not None and tuple(ins[slot].shape) != (x.shape[1],):
            raise ShapeError(f"{node.label}: input {slot} has shape {tuple(ins[slot].shape)}, expected "
                             f"({x.shape[1]},)")
    per_channel = [d for i, d in enumerate(x.shape) if i != 1]
    if node.attr("training_mode", 0) and all(isinstance(d, int) for d in per_channel) \
            and int(np.prod(per_channel)) == 1:  # batch statistics of one value: x - mean = 0, no variance
        raise ShapeError(f"{node.label}: training needs more than 1 value per channel, got input shape "
                         f"{tuple(x.shape)} (PyTorch: 'Expected more than 1 value per channel when training'). "
                         "Train with batches of 2 or more; if the last batch of an epoch holds one sample, "
                         "drop it (--drop-last, or fit(..., drop_last=True))")
    outs = [TensorInfo(x.dtype, x.shape)]
    for slot in (3, 4)[:len(node.outputs) - 1]:
        outs.append(TensorInfo(ins[slot].dtype, ins[slot].shape))
    return outs


def _row_sums(a: np.ndarray) -> np.ndarray:
    """(N, C) float sums of each (sample, channel) row (pairwise, in the input's precision)."""
    return a.reshape(a.shape[0], a.shape[1], -1).sum(axis=2)


def _row_dots(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, C) sums of a * b per row without materialising the product (einsum per row)."""
    rows = a.shape[:2] + (-1,)
    return np.einsum("ncp,ncp->nc", a.reshape(rows), b.reshape(rows))


def _channel_sum(a: np.ndarray) -> np.ndarray:
    """Per-channel sums of (N, C, ...) in double: pairwise float sums along rows, then double."""
    return _row_sums(a).sum(axis=0, dtype=np.float64)


def _channel_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-channel sum of a * b without materialising the product (einsum per row, then double)."""
    return _row_dots(a, b).sum(axis=0, dtype=np.float64)


def _over_rows(x: np.ndarray, fn) -> np.ndarray:
    """Per-channel double sums of fn(batch slice) -> (rows, C) computed on every core; the rows
    are joined before the one double sum, so the result does not depend on the core count."""
    return np.concatenate(_over_batch(x, fn)).sum(axis=0, dtype=np.float64)


def _per_channel(v: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Per-channel statistics are kept in double; the big tensors stay in the input's precision."""
    return _channel(np.asarray(v).astype(like.dtype), like.ndim)


def _batch_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, biased variance, x - mean) over every axis but the channel axis; batch slices on
    every core."""
    n = x.size // x.shape[1]
    mean = _over_rows(x, lambda s: _row_sums(x[s])) / n
    mean_c = _per_channel(mean, x)
    centered = np.empty_like(x)

    def center(s: slice) -> np.ndarray:
        np.subtract(x[s], mean_c, out=centered[s])
        return _row_dots(centered[s], centered[s])

    return mean, _over_rows(x, center) / n, centered


def _bn_forward(node, ins):
    x, scale, bias, mean, var = ins[:5]
    eps = float(node.attr("epsilon", 1e-5))
    training = bool(node.attr("training_mode", 0))
    if training:
        batch_mean, batch_var, y = _batch_stats(x)
        a_c, bias_c = _per_channel(scale * (1.0 / np.sqrt(batch_var + eps)), x), _per_channel(bias, x)

        def normalize(s: slice) -> list:
            y[s] *= a_c  # in place on the centered copy: two passes in all
            y[s] += bias_c
            return []

        _over_batch(y, normalize)
    else:
        a = scale * (1.0 / np.sqrt(var.astype(np.float64) + eps))
        y = x * _per_channel(a, x) + _per_channel(bias - mean * a, x)
    y = y.astype(x.dtype, copy=False)
    if len(node.outputs) == 1:
        return [y]
    if not training:
        return [y, mean.copy(), var.copy()][:len(node.outputs)]
    momentum = float(node.attr("momentum", 0.9))
    n = x.size // x.shape[1]
    # PyTorch semantics, not ONNX's: the running variance tracks the UNBIASED batch variance
    # (n / (n - 1)), as torch.nn.BatchNorm does, while normalisation uses the biased one.
    unbiased = batch_var * (n / max(n - 1, 1))
    running_mean = mean * momentum + batch_mean * (1 - momentum)
    running_var = var * momentum + unbiased * (1 - momentum)
    return [y, running_mean.astype(mean.dtype), running_var.astype(var.dtype)][:len(node.outputs)]


def _bn_grad_forward(node, ins):
    """(dX, dscale, dbias); batch statistics recomputed (training) or given (training=0)."""
    dy, x, scale = ins[:3]
    eps = float(node.attr("epsilon", 1e-5))
    training = bool(node.attr("training", 1))
    if training:
        _, var, centered = _batch_stats(x)
    else:
        var = ins[4].astype(np.float64)
        centered = x - _per_channel(ins[3], x)
    inv = 1.0 / np.sqrt(var + eps)
    k = scale * inv
    dbias = _over_rows(x, lambda s: _row_sums(dy[s]))
    dscale = _over_rows(x, lambda s: _row_dots(dy[s], centered[s])) * inv
    dparams = [dscale.astype(scale.dtype), dbias.astype(scale.dtype)]
    if not training:
        return [(dy * _per_channel(k, x)).astype(x.dtype)] + dparams
    # The batch statistics depend on x too (mean and variance terms of the chain rule):
    # dx = k * (dy - dbias / n - xhat * dscale / n), with xhat = centered * inv.
    n = x.size // x.shape[1]
    alpha, beta, k_c = (_per_channel(-k * inv * dscale / n, x), _per_channel(-k * dbias / n, x),
                        _per_channel(k, x))
    dx = np.empty_like(x)

    def grad(s: slice) -> list:
        centered[s] *= alpha
        centered[s] += beta
        np.multiply(dy[s], k_c, out=dx[s])
        dx[s] += centered[s]
        return []

    _over_batch(x, grad)
    return [dx] + dparams


def _bn_grad(g: GradContext):
    x, scale = g.x[0], g.x[1]
    eps = float(g.node.attr("epsilon", 1e-5))
    if g.node.attr("training_mode", 0):
        outs = g.ops("BatchNormGrad", [g.dy, x, scale], 3, epsilon=eps)
    else:
        outs = g.ops("BatchNormGrad", [g.dy, x, scale, g.x[3], g.x[4]], 3, epsilon=eps, training=0)
    return outs + [None, None]


def _bn_set_mode(graph: Graph, node: Node, training: bool) -> None:
    if not training:
        node.attrs["training_mode"] = 0
        for out in node.outputs[1:]:
            graph.state_updates.pop(out, None)
        del node.outputs[1:]
        return
    node.attrs["training_mode"] = 1
    while len(node.outputs) < 3:
        node.outputs.append("")
    base = node.name or node.outputs[0]
    for slot, hint in ((1, "running_mean"), (2, "running_var")):
        if not node.outputs[slot]:
            node.outputs[slot] = graph.fresh(f"{base}.{hint}")
        state = node.inputs[slot + 2]
        graph.state_updates[node.outputs[slot]] = state
        if state in graph.params:
            graph.params.remove(state)
        if state not in graph.buffers:
            graph.buffers.append(state)


def _bn_grad_infer(node, ins):
    return [TensorInfo(ins[1].dtype, ins[1].shape), TensorInfo(ins[2].dtype, ins[2].shape),
            TensorInfo(ins[2].dtype, ins[2].shape)]


defop("BatchNormalization", infer=_bn_infer, forward=_bn_forward, grad=_bn_grad, nondiff=[3, 4],
      set_mode=_bn_set_mode)
defop("BatchNormGrad", infer=_bn_grad_infer, forward=_bn_grad_forward, internal=True)


# -- Dropout -------------------------------------------------------------------------------------
def _const_input(value, node: Node, slot: int, default):
    """The value of a constant optional input (TensorInfo at infer time, array at run time)."""
    if value is None:
        return default
    if isinstance(value, TensorInfo):
        if value.const is None:
            raise ShapeError(f"{node.label}: input {slot} must be a constant (known when the model "
                             "is compiled)")
        value = value.const
    return np.asarray(value).reshape(()).item()


def dropout_ratio(node: Node, value) -> float:
    """The drop probability: input 1 (opset 12+), else the `ratio` attribute of opsets 7-11, else
    0.5. `value` is input 1's TensorInfo (compile time) or array (run time), None when absent."""
    return float(_const_input(value, node, 1, node.attr("ratio", 0.5)))


def _dropout_infer(node, ins):
    ratio = dropout_ratio(node, ins[1] if len(ins) > 1 else None)
    if not 0 <= ratio < 1:
        raise ShapeError(f"{node.label}: dropout ratio {ratio} must be in [0, 1)")
    x = ins[0]
    return [TensorInfo(x.dtype, x.shape), TensorInfo(np.dtype(bool), x.shape)][:max(1, len(node.outputs))]


def dropout_scale(ratio: float) -> np.float32:
    """Kept elements are multiplied by this: float32(1 / (1 - ratio)), computed in double."""
    return np.float32(1.0 / (1.0 - ratio))


def _dropout_forward(node, ins):
    x = ins[0]
    ratio = dropout_ratio(node, ins[1] if len(ins) > 1 else None)
    training = bool(_const_input(ins[2] if len(ins) > 2 else None, node, 2, False))
    if not training or ratio == 0:
        return [x.copy(), np.ones(x.shape, bool)]
    state = ins[3] if len(ins) > 3 else None
    if state is None:
        raise AnygradError(f"{node.label}: Dropout in training mode needs the RNG state input "
                           f"'{RNG_STATE}'; prepare the graph with set_training_mode")
    seed, counter = (int(v) for v in np.asarray(state).reshape(-1)[:2])
    u = rng.uniform(seed, counter, int(node.attr("salt", 0)), x.size).reshape(x.shape)
    mask = u >= np.float32(ratio)
    return [(x * (mask * dropout_scale(ratio))).astype(x.dtype), mask]


def _dropout_grad(g: GradContext):
    ratio = dropout_ratio(g.node, g.info(g.x[1]) if g.node.input(1) else None)
    training = bool(_const_input(g.info(g.x[2]) if g.node.input(2) else None, g.node, 2, False))
    if not training or ratio == 0:
        return [g.dy]
    if len(g.y) < 2 or not g.y[1]:
        raise AnygradError(f"{g.node.label}: training-mode Dropout needs its mask output for the gradient; "
                           "prepare the graph with set_training_mode")
    return [g.op("DropoutGrad", [g.dy, g.y[1]], ratio=ratio)]


def _dropout_set_mode(graph: Graph, node: Node, training: bool) -> None:
    inputs = node.inputs[:2]
    if not training:
        while inputs and not inputs[-1]:
            inputs.pop()
        node.inputs = inputs
        return
    inputs += [""] * (2 - len(inputs))
    flag = np.array(True)
    name = graph.fresh(f"{node.name or node.outputs[0]}.training_mode")
    graph.initializers[name] = flag
    graph.info[name] = info_of(flag)
    node.inputs = inputs + [name, RNG_STATE]
    # A stable per-node salt: this node's position among the graph's Dropout nodes.
    dropouts = [n for n in graph.nodes if n.op == "Dropout"]
    node.attrs["salt"] = next(i for i, n in enumerate(dropouts) if n is node)
    if len(node.outputs) < 2 or not node.outputs[1]:
        node.outputs[1:] = [graph.fresh(f"{node.name or node.outputs[0]}.mask")]


defop("Dropout", infer=_dropout_infer, forward=_dropout_forward, grad=_dropout_grad,
      nondiff=[1, 2, 3], foldable=False, set_mode=_dropout_set_mode)
def _dropout_grad_forward(node, ins):
    dy, mask = ins
    return (dy * (mask * dropout_scale(float(node.attr("ratio", 0.5))))).astype(dy.dtype)


defop("DropoutGrad", infer=same_as_first, forward=_dropout_grad_forward, internal=True)


# -- Softmax / LogSoftmax ------------------------------------------------------------------------
def _axis(node: Node, x: np.ndarray) -> int:
    return norm_axis(int(node.attr("axis", -1)), x.ndim)


def _softmax(node, ins):
    x = ins[0]
    e = np.exp(x - x.max(axis=_axis(node, x), keepdims=True))
    return (e / e.sum(axis=_axis(node, x), keepdims=True)).astype(x.dtype)


def _log_softmax(node, ins):
    x = ins[0]
    shifted = x - x.max(axis=_axis(node, x), keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=_axis(node, x), keepdims=True))).astype(x.dtype)


def _softmax_grad_forward(node, ins):
    dy, y = ins
    return (y * (dy - (dy * y).sum(axis=_axis(node, y), keepdims=True))).astype(dy.dtype)


def _log_softmax_grad_forward(node, ins):
    dy, y = ins
    return (dy - np.exp(y) * dy.sum(axis=_axis(node, y), keepdims=True)).astype(dy.dtype)


def _grad_via(op: str):
    return lambda g: [g.op(op, [g.dy, g.y[0]], axis=int(g.node.attr("axis", -1)))]


defop("Softmax", infer=same_as_first, forward=_softmax, grad=_grad_via("SoftmaxGrad"))
defop("LogSoftmax", infer=same_as_first, forward=_log_softmax, grad=_grad_via("LogSoftmaxGrad"))
defop("SoftmaxGrad", infer=same_as_first, forward=_softmax_grad_forward, internal=True)
defop("LogSoftmaxGrad", infer=same_as_first, forward=_log_softmax_grad_forward, internal=True)
