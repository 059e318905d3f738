"""The numpy backend's convolutions: im2col + one BLAS matmul per batch chunk (all groups in one
stacked matmul), the chunks spread over the cores. They compute what the registry kernels of
Conv, ConvGradInput and ConvGradWeight compute (anygrad.ops.nn keeps those plain, tap by tap),
only faster on a CPU; Conv and ConvGradInput also take the backend's epilogue (lowering.BLOCKED).

The chunk keeps the column matrix cache-sized instead of materialising it for the whole batch.
Stride-1 convolutions build "flat" columns (`_Im2col`): every tap is a shift of the flattened
padded input, so im2col and col2im move long contiguous runs. Chunks are spread over the cores
by `anygrad._parallel`, each with a single-threaded BLAS; `ANYGRAD_NUMPY_THREADS` sets the
number of workers (default: the CPUs this process may use).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from ... import _parallel
from ...ir.graph import Node
from ...ops.nn import Window

# epilogue(batch slice, block): applied in place to each block of output 0 once it is final
Epilogue = Callable[[slice, np.ndarray], None]


# -- batch chunks and batch slices on every core ------------------------------------------------
# numpy runs im2col copies and transposes on one core, and OpenBLAS gains little from threading
# GEMMs this skinny. Each worker (anygrad._parallel) instead takes its own share of the batch
# chunks end to end (im2col, GEMM with a single-threaded BLAS, scatter) with its own scratch.

# Elements (floats) a batch chunk of a convolution touches (`_Im2col.footprint`: its input,
# columns and GEMM output): big enough for efficient GEMMs and few numpy calls, small enough to
# stay in cache (MNIST conv3's columns at batch 1000 would otherwise be 300 MB). Measured on
# the 2-vCPU AMD EPYC (1 MiB L2 per core, 32 MiB L3), MNIST CNN at batch 1000, one step:
# 2^18 ~15% slower, 2^19 and 2^20 alike, 2^21 ~5% slower.
_COLS_BUDGET = 1 << 19

# Elements a convolution touches over the whole batch (`_Im2col.footprint`) below which it runs
# on one thread: the workers would mostly wait on each other. Measured on the MNIST CNN at batch
# 64, 2 vCPUs: 0 (always threaded) 1,650 samples/s, 5M 1,820 (conv3 threaded, conv1-2 not),
# never threaded 1,370.
_PARALLEL_MIN = 5 << 20


# Positions (the GEMM's reduction length) per batch chunk of a weight gradient at most. A conv
# with few channels has a small footprint per sample, so the budget alone would give it long
# chunks, and its GEMM, with few output rows and columns, then streams its operands from L3
# instead of L2 (MNIST conv1's weight gradient, 9 x 8 outputs: 16 GFLOP/s at 58K positions,
# 74 at 7K, one core of the 2-vCPU AMD EPYC; the whole step 4% faster than without the cap).
_COLS_MAX = 1 << 13


def _chunk(n: int, per_item: int, q: int = 0) -> int:
    """Samples per batch chunk (q: reduction positions per sample): set by the cache budget alone,
    never by the core count, so sums over chunks (the weight gradient) are the same on any machine."""
    return max(1, min(n, _COLS_BUDGET // max(1, per_item), _COLS_MAX // q if q else n))


def _conv_threads(n: int, per_item: int) -> int:
    return _parallel.blas_workers() if n * per_item >= _PARALLEL_MIN else 1


def _balanced(n: int, step: int, threads: int) -> int:
    """The largest chunk size <= step that cuts n into a multiple of `threads` chunks, so that
    every worker gets as many (only where the chunking does not decide a summation order)."""
    chunks = max(1, -(-n // step))
    chunks = -(-chunks // threads) * threads
    return max(1, -(-n // chunks))


class _Scratch:
    """One buffer every batch chunk of a worker reuses: a fresh multi-MB array per chunk costs
    page faults. Zeroed when asked, once: positions no chunk writes (padding, the extra columns
    of flat columns) then stay 0, since they sit at the same places whatever the chunk's size."""

    def __init__(self, size: int, dtype: np.dtype, zero: bool = False):
        self.data = np.zeros(size, dtype) if zero else np.empty(size, dtype)

    def view(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.data[:math.prod(shape)].reshape(shape)


class _Im2col:
    """A convolution's column matrix, one batch chunk at a time: (group, C/group * taps, chunk * q),
    rows (channel, kernel tap), q columns (output positions) per sample.

    Stride 1 (any dilation, any pads) uses flat columns: the positions are every element of the
    first out[0] full rows of the padded grid (q = out[0] * prod(padded[1:])), the valid outputs
    plus those past out[1:]. Tap t of position p then reads the padded input at p + offsets[t],
    so each (channel, tap) row of a sample is ONE contiguous run of its padded input: im2col
    copies long runs instead of numpy looping over rows of out[-1] elements (measured 3x faster
    for MNIST's 3x3 convs on 24x24, for 9% more GEMM columns). `valid` drops the extra positions
    from outputs; where they enter a sum, their dY is 0. Other strides gather the prod(out)
    valid positions through a sliding-window view. whole_grid takes positions on all the padded
    rows instead (q = prod(padded): one per padded input element, for conv_grad_input)."""

    def __init__(self, x_shape, win: Window, group: int, flat: bool | None = None, whole_grid: bool = False):
        self.win, self.group, self.c = win, group, x_shape[1]
        self.flat = all(s == 1 for s in win.strides) if flat is None else flat
        self.grid = math.prod(win.padded)
        pitch = [math.prod(win.padded[i + 1:]) for i in range(win.nd)]
        self.tap_steps = tuple(d * p for d, p in zip(win.dilations, pitch))  # flat step per kernel index
        self.offsets = [sum(i * s for i, s in zip(idx, self.tap_steps))
                        for idx in itertools.product(*(range(k) for k in win.kernel))]
        if self.flat:
            first = win.padded[0] if whole_grid else win.out[0]  # whole_grid: positions on every row
            self.q, self.rows = first * pitch[0], (first,) + win.padded[1:]
            self.valid = (Ellipsis,) + tuple(slice(0, o) for o in win.out)
            self.tail = self.offsets[-1] + self.q - self.grid  # the last tap's reach past a grid
        else:
            self.q, self.rows, self.valid, self.tail = math.prod(win.out), win.out, (Ellipsis,), 0
        self.per_item = self.c * len(self.offsets) * self.q

    def footprint(self, m: int) -> int:
        """Elements a chunk touches per sample: padded input (or dX accumulator), columns, and
        the M rows of GEMM output (or dY) at the q positions."""
        return self.c * self.grid + self.per_item + m * self.q

    def scratch(self, step: int, dtype) -> tuple[_Scratch, _Scratch]:
        """A worker's buffers: its padded chunk (zeroed: the padding is never written) and columns."""
        return (_Scratch(step * self.c * self.grid + self.tail, dtype, zero=True),
                _Scratch(step * self.per_item, dtype))

    def columns(self, x: np.ndarray, b0: int, step: int, bufs: tuple[_Scratch, _Scratch]) -> np.ndarray:
        xbuf, cols_buf = bufs
        xc = x[b0:b0 + step]
        n, c = xc.shape[:2]
        xp = xbuf.view((n, c) + self.win.padded)
        xp[self.win.interior] = xc
        if self.flat:  # (C, *kernel, chunk, q); the tail keeps the last sample's reads in xbuf
            it = xbuf.data.itemsize
            view = as_strided(xbuf.data, (c,) + self.win.kernel + (n, self.q),
                              (self.grid * it,) + tuple(s * it for s in self.tap_steps) + (c * self.grid * it, it))
        else:  # (B, C, *out, *kernel) -> (C, *kernel, B, *out)
            nd, win = self.win.nd, self.win
            view = sliding_window_view(xp, win.extent, axis=tuple(range(2, 2 + nd)))
            view = view[(slice(None), slice(None))
                        + tuple(slice(None, (o - 1) * s + 1, s) for o, s in zip(win.out, win.strides))
                        + tuple(slice(None, None, d) for d in win.dilations)]
            view = view.transpose((1,) + tuple(range(2 + nd, 2 + 2 * nd)) + (0,) + tuple(range(2, 2 + nd)))
        cols = cols_buf.view(view.shape)
        np.copyto(cols, view)
        return cols.reshape(self.group, -1, n * self.q)

    def outputs(self, a: np.ndarray, n: int) -> np.ndarray:
        """The valid outputs of (..., n * q) as a view (..., n, *out)."""
        return a.reshape(a.shape[:-1] + (n,) + self.rows)[self.valid]


def conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, win: Window, group: int,
         epilogue: Epilogue | None = None) -> np.ndarray:
    """Y = W * X (+ b); epilogue(batch slice, Y block) on each chunk once written (the numpy backend's BLOCKED)."""
    n, m = x.shape[0], w.shape[0]
    im2col = _Im2col(x.shape, win, group)
    w3 = w.reshape(group, m // group, -1)
    y = np.empty((n, m) + win.out, x.dtype)  # owns its memory: the executor may reuse it in place
    # The bias as one sample's output (M, *out): adding it to the (chunk, M * P) block is numpy's
    # loop over two contiguous rows, not a broadcast over rows of out[-1] elements (2x faster).
    bias = None if b is None else np.ascontiguousarray(
        np.broadcast_to(b.astype(x.dtype, copy=False).reshape((m,) + (1,) * win.nd), (m,) + win.out)).reshape(-1)
    threads = _conv_threads(n, im2col.footprint(m))
    step = _balanced(n, _chunk(n, im2col.footprint(m)), threads)

    def work(starts: list[int]) -> list[None]:
        bufs, out_buf = im2col.scratch(step, x.dtype), _Scratch(m * step * im2col.q, x.dtype)
        for b0 in starts:
            cols = im2col.columns(x, b0, step, bufs)
            bsz = cols.shape[2] // im2col.q
            chunk = out_buf.view((group, m // group, cols.shape[2]))
            np.matmul(w3, cols, out=chunk)
            y[b0:b0 + bsz] = im2col.outputs(chunk.reshape(m, -1), bsz).swapaxes(0, 1)
            if bias is not None:  # while the block is in cache
                block = y[b0:b0 + bsz].reshape(bsz, -1)
                np.add(block, bias, out=block)
            if epilogue is not None:
                epilogue(slice(b0, b0 + bsz), y[b0:b0 + bsz])
        return [None] * len(starts)

    _parallel.map_shares(work, range(0, n, step), threads)
    return y


def conv_grad_input(dy: np.ndarray, w: np.ndarray, win: Window, group: int, x_shape,
                    epilogue: Epilogue | None = None) -> np.ndarray:
    """dX: each output's gradient spread over its window (GEMM, then col2im tap by tap);
    epilogue(batch slice, dX block) on each block once final (numpy BLOCKED)."""
    if all(s == 1 for s in win.strides) and np.isfinite(w).all():
        return _conv_grad_input_flat(dy, w, win, group, x_shape, epilogue)
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
    dx = win.crop(dxp)
    if epilogue is not None:
        epilogue(slice(0, n), dx)
    return dx


def _conv_grad_input_flat(dy: np.ndarray, w: np.ndarray, win: Window, group: int, x_shape,
                          epilogue: Epilogue | None) -> np.ndarray:
    """conv_grad_input for stride 1, where every tap is a flat shift of the padded grid.

    dY is laid out channel-major on the whole padded grid (0 where no output is), so col2im is
    one long contiguous add per tap (the padded input at p + offsets[t] gets position p's tap t)
    instead of numpy looping over short rows (2x faster here). Not on the rows-only positions of
    `_Im2col`: their per-sample adds would be 3-D, which numpy runs 3x slower than these 2-D
    ones (measured on MNIST's conv3). The extra positions add exact zeros (W finite: the caller
    checks, since 0 * inf would not be 0)."""
    n, c = x_shape[:2]
    m = w.shape[0]
    im2col = _Im2col(x_shape, win, group, whole_grid=True)
    grid, taps = im2col.grid, len(im2col.offsets)
    wt = np.ascontiguousarray(w.reshape(group, m // group, (c // group) * taps).transpose(0, 2, 1))
    dx = np.empty(x_shape, dy.dtype)
    threads = _conv_threads(n, im2col.footprint(m))
    step = _balanced(n, _chunk(n, im2col.footprint(m)), threads)

    def work(starts: list[int]) -> list[None]:
        dy_buf = _Scratch(m * step * grid, dy.dtype, zero=True)  # 0 where no output is
        cols_buf, acc_buf = _Scratch(step * im2col.per_item, dy.dtype), _Scratch(c * (step * grid + im2col.tail),
                                                                                  dy.dtype)
        for b0 in starts:
            dyc = dy[b0:b0 + step]
            size = dyc.shape[0] * grid
            dyq = dy_buf.view((group, m // group, size))
            im2col.outputs(dyq.reshape(m, -1), dyc.shape[0])[...] = dyc.swapaxes(0, 1)
            dcols = cols_buf.view((group, (c // group) * taps, size))
            np.matmul(wt, dyq, out=dcols)
            dcols = dcols.reshape(c, taps, size)
            acc = acc_buf.view((c, size + im2col.tail))
            acc[:, :size] = dcols[:, 0]  # tap 0 is at offset 0
            acc[:, size:] = 0
            for t, off in enumerate(im2col.offsets[1:], start=1):
                acc[:, off:off + size] += dcols[:, t]
            padded = acc[:, :size].reshape((c, dyc.shape[0]) + win.padded)
            dx[b0:b0 + dyc.shape[0]] = padded[win.interior].swapaxes(0, 1)
            if epilogue is not None:
                epilogue(slice(b0, b0 + dyc.shape[0]), dx[b0:b0 + dyc.shape[0]])
        return [None] * len(starts)

    _parallel.map_shares(work, range(0, n, step), threads)
    return dx


def conv_grad_weight(dy: np.ndarray, x: np.ndarray, win: Window, group: int, w_shape,
                     flat: bool | None = None) -> np.ndarray:
    """dW = dY (as M x positions) @ columns^T, accumulated over batch chunks in batch order."""
    n, m = x.shape[0], w_shape[0]
    im2col = _Im2col(x.shape, win, group, flat)
    step = _chunk(n, im2col.footprint(m), im2col.q)  # never the core count: it fixes the summation order

    def work(starts: list[int]) -> list[np.ndarray]:
        bufs = im2col.scratch(step, x.dtype)
        dy_buf = _Scratch(m * step * im2col.q, dy.dtype, zero=True)  # 0 at the extra positions
        partials = []
        for b0 in starts:
            cols = im2col.columns(x, b0, step, bufs)
            bsz = cols.shape[2] // im2col.q
            dyq = dy_buf.view((group, m // group, bsz * im2col.q))
            im2col.outputs(dyq.reshape(m, -1), bsz)[...] = dy[b0:b0 + bsz].swapaxes(0, 1)
            # dW^T = columns @ dY^T: OpenBLAS runs this orientation 1.3-1.7x faster than
            # dY @ columns^T on these shapes (measured on MNIST's conv2 and conv3, one core).
            partials.append(np.matmul(cols, dyq.transpose(0, 2, 1)))
        return partials

    dwt = np.zeros((group, (x.shape[1] // group) * math.prod(win.kernel), m // group), dy.dtype)
    # Chunk by chunk in batch order, whichever core computed it, each chunk's GEMM on a
    # single-threaded BLAS even on one worker: the same bits on any core count.
    with _parallel.serial_blas():
        partials = _parallel.map_shares(work, range(0, n, step), _conv_threads(n, im2col.footprint(m)))
    for partial in partials:
        dwt += partial
    if im2col.flat and not np.isfinite(dwt).all():
        # A non-finite X or dY: the extra positions may have added 0 * inf = nan where the
        # exact sum has none. Recompute on the valid positions alone.
        return conv_grad_weight(dy, x, win, group, w_shape, flat=False)
    return dwt.transpose(0, 2, 1).reshape(w_shape).astype(dy.dtype, copy=False)


# -- the nodes (attributes resolved: ir/passes.resolve_attributes) ------------------------------
def conv_node(node: Node, ins: list, epilogue: Epilogue | None = None) -> np.ndarray:
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    return conv(x, w.astype(x.dtype, copy=False), b, Window.of(node, x.shape[2:]), int(node.attr("group", 1)),
                epilogue)


def conv_grad_input_node(node: Node, ins: list, epilogue: Epilogue | None = None) -> np.ndarray:
    dy, w = ins
    shape = tuple(int(d) for d in node.attr("input_shape"))
    return conv_grad_input(dy, w.astype(dy.dtype, copy=False), Window.of(node, shape[2:]),
                           int(node.attr("group", 1)), shape, epilogue)


def conv_grad_weight_node(node: Node, ins: list) -> np.ndarray:
    dy, x = ins
    shape = tuple(int(d) for d in node.attr("weight_shape"))
    return conv_grad_weight(dy, x, Window.of(node, x.shape[2:]), int(node.attr("group", 1)), shape)
