"""Neural-network ops: Conv, pooling, BatchNormalization, Dropout, Softmax / LogSoftmax.

Every sliding-window op (Conv and the pools) shares one geometry (`Window`): ONNX attributes plus
the input's spatial shape resolve to explicit begin/end pads and the output shape, for any number
of spatial dims. Gradient helpers are internal ops with explicit pads (auto_pad already resolved),
so a backend implements exactly: ConvGradInput, ConvGradWeight, MaxPoolGrad, AveragePoolGrad,
BatchNormGrad, DropoutGrad, SoftmaxGrad, LogSoftmaxGrad.

The numpy Conv is im2col + one BLAS matmul per batch chunk (all groups in one stacked matmul);
the chunk keeps the column matrix cache-sized instead of materialising it for the whole batch.
Stride-1 convolutions build "flat" columns (`_Im2col`): every tap is a shift of the flattened
padded input, so im2col and col2im move long contiguous runs.
Chunks are spread over the cores by `anygrad._parallel`, each with a single-threaded BLAS;
`ANYGRAD_NUMPY_THREADS` sets the number of workers (default: the CPUs this process may use).
BatchNormalization's kernels here are the plain reference; the numpy backend runs blocked,
threaded ones of the same values (backends/numpy/fastpaths.py).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from .. import _parallel, rng
from ..errors import AnygradError, ShapeError, UnsupportedOpError
from ..ir.builder import GradContext
from ..ir.graph import Graph, Node, TensorInfo, info_of
from ..ir.passes import RNG_STATE
from ..ir.registry import defop
from ._util import norm_axis, same_as_first

# What the numpy backend passes the kernels that can write output 0 in batch blocks (its
# lowering registry, backends/numpy/lowering.py: BLOCKED): called on each block once final.
Epilogue = Callable[[slice, np.ndarray], None]


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

    @property
    def interior(self) -> tuple[slice, ...]:
        """Where the input lies in a padded (N, C, *padded) array."""
        return (slice(None), slice(None)) + tuple(slice(b, b + i) for b, i in zip(self.begin, self.spatial))

    def crop(self, xp: np.ndarray) -> np.ndarray:
        return xp[self.interior]

    @classmethod
    def of(cls, node: Node, spatial) -> Window:
        """The window of a node with resolved attributes (ops/resolve.py: explicit kernel_shape,
        strides, dilations, pads, ceil_mode; no auto_pad) over an input of `spatial` dims: arithmetic
        on those, what a backend needs to lay out a windowed op."""
        if node.attr("kernel_shape") is None or node.attr("pads") is None or node.attr("auto_pad") is not None:
            raise ShapeError(f"{node.label}: attributes are not resolved (anygrad.ir.passes.resolve_attributes)")
        return window(node, spatial, tuple(node.attr("kernel_shape")), bool(node.attr("ceil_mode", 0)))

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


def _conv_forward(node, ins, epilogue: Epilogue | None = None):
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    return conv(x, w.astype(x.dtype, copy=False), b, _conv_window(node, x.shape, w.shape),
                int(node.attr("group", 1)), epilogue)


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


def _conv_grad_input_forward(node, ins, epilogue: Epilogue | None = None):
    dy, w = ins
    shape = tuple(node.attr("input_shape"))
    return conv_grad_input(dy, w.astype(dy.dtype, copy=False), window(node, shape[2:], w.shape[2:]),
                           int(node.attr("group", 1)), shape, epilogue)


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


def _bn_forward(node, ins):
    """The reference: batch statistics in double over every axis but the channel axis (the
    variance of x - mean, biased); the numpy backend runs a blocked, threaded kernel of the same
    values (backends/numpy/fastpaths.py)."""
    x, scale, bias, mean, var = ins[:5]
    eps = float(node.attr("epsilon", 1e-5))
    training = bool(node.attr("training_mode", 0))
    if training:
        axes, xd = _bn_axes(x.ndim), x.astype(np.float64)
        batch_mean = xd.mean(axis=axes)
        batch_var = np.square(xd - _channel(batch_mean, x.ndim)).mean(axis=axes)
        a = scale * (1.0 / np.sqrt(batch_var + eps))
        y = ((xd - _channel(batch_mean, x.ndim)) * _channel(a, x.ndim) + _channel(bias, x.ndim)).astype(x.dtype)
    else:
        a = scale * (1.0 / np.sqrt(var.astype(np.float64) + eps))
        y = (x * _channel(a.astype(x.dtype), x.ndim)
             + _channel((bias - mean * a).astype(x.dtype), x.ndim)).astype(x.dtype, copy=False)
    return batch_norm_outputs(node, y, mean, var, (batch_mean, batch_var) if training else None, x.size // x.shape[1])


def batch_norm_outputs(node: Node, y: np.ndarray, mean: np.ndarray, var: np.ndarray,
                       batch: tuple[np.ndarray, np.ndarray] | None, n: int) -> list[np.ndarray]:
    """BatchNormalization's outputs from its normalised y: y alone, or with the running mean and
    variance, passed through at inference (batch None) or updated in training from the batch's
    (mean, biased variance) over n values per channel. Shared by the reference kernel and the numpy
    backend's blocked one (backends/numpy/fastpaths.py) so the two cannot drift apart."""
    if len(node.outputs) == 1:
        return [y]
    if batch is None:
        return [y, mean.copy(), var.copy()][:len(node.outputs)]
    return [y, *batch_norm_running_stats(node, mean, var, *batch, n)][:len(node.outputs)]


def batch_norm_running_stats(node: Node, mean: np.ndarray, var: np.ndarray, batch_mean: np.ndarray,
                             batch_var: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """BatchNorm's new running mean and variance after a batch of n values per channel.
    PyTorch semantics, not ONNX's: the running variance tracks the UNBIASED batch variance
    (n / (n - 1)), as torch.nn.BatchNorm does, while normalisation uses the biased one."""
    momentum = float(node.attr("momentum", 0.9))
    unbiased = batch_var * (n / max(n - 1, 1))
    running_mean = mean * momentum + batch_mean * (1 - momentum)
    running_var = var * momentum + unbiased * (1 - momentum)
    return running_mean.astype(mean.dtype), running_var.astype(var.dtype)


def _bn_grad_forward(node, ins):
    """(dX, dscale, dbias); batch statistics recomputed (training) or given (training=0).
    The reference in double; the numpy backend's blocked kernel: backends/numpy/fastpaths.py."""
    dy, x, scale = ins[:3]
    eps = float(node.attr("epsilon", 1e-5))
    training = bool(node.attr("training", 1))
    axes, xd, dyd = _bn_axes(x.ndim), x.astype(np.float64), dy.astype(np.float64)
    if training:
        mean = xd.mean(axis=axes)
        var = np.square(xd - _channel(mean, x.ndim)).mean(axis=axes)
    else:
        mean, var = ins[3].astype(np.float64), ins[4].astype(np.float64)
    inv = 1.0 / np.sqrt(var + eps)
    xhat = (xd - _channel(mean, x.ndim)) * _channel(inv, x.ndim)
    dbias, dscale = dyd.sum(axis=axes), (dyd * xhat).sum(axis=axes)
    k = scale * inv
    dparams = [dscale.astype(scale.dtype), dbias.astype(scale.dtype)]
    if not training:
        return [(dyd * _channel(k, x.ndim)).astype(x.dtype)] + dparams
    # The batch statistics depend on x too (mean and variance terms of the chain rule):
    # dx = k * (dy - dbias / n - xhat * dscale / n).
    n = x.size // x.shape[1]
    dx = _channel(k, x.ndim) * (dyd - _channel(dbias / n, x.ndim) - xhat * _channel(dscale / n, x.ndim))
    return [dx.astype(x.dtype)] + dparams


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
