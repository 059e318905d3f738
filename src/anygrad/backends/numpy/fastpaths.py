"""CPU fast paths of the numpy backend: kernels that compute exactly what an op's registry kernel
computes (anygrad.ops keeps the plain reference), only faster on this machine's numpy."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import _parallel
from ...ir.graph import Node
from ...ops.nn import batch_norm_outputs

# epilogue(batch slice, block): applied in place to each block of output 0 once it is final
# (lowering.BLOCKED).
Epilogue = Callable[[slice, np.ndarray], None]

_ZEROS_ROW = 1 << 12
_zeros: dict[np.dtype, np.ndarray] = {}


def maximum0(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """np.maximum(x, 0, out=out), the same values, faster: numpy 2.4's loop for an array and a
    scalar is not vectorised, its loop for two contiguous arrays is (11.6M float32: 6.5 ms
    against 1.5 ms on one core of the 2-vCPU AMD EPYC), so contiguous floats meet rows of zeros."""
    if (x.dtype.kind != "f" or x.size < _ZEROS_ROW or not x.flags.c_contiguous
            or (out is not None and (out.dtype != x.dtype or not out.flags.c_contiguous))):
        return np.maximum(x, 0, out=out)
    if out is None:
        out = np.empty_like(x)
    zeros = _zeros.get(x.dtype)
    if zeros is None:
        zeros = _zeros[x.dtype] = np.zeros(_ZEROS_ROW, x.dtype)
    src, dst = x.reshape(-1), out.reshape(-1)
    bulk = src.size - src.size % _ZEROS_ROW
    np.maximum(src[:bulk].reshape(-1, _ZEROS_ROW), zeros, out=dst[:bulk].reshape(-1, _ZEROS_ROW))
    np.maximum(src[bulk:], zeros[:src.size - bulk], out=dst[bulk:])
    return out


# -- BatchNormalization and its gradient: blocked over the batch, on every core ----------------------
def _channel(v: np.ndarray, rank: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast against (N, C, ...)."""
    return v.reshape((1, -1) + (1,) * (rank - 2))


def _row_sums(a: np.ndarray) -> np.ndarray:
    """(N, C) float sums of each (sample, channel) row (pairwise, in the input's precision)."""
    return a.reshape(a.shape[0], a.shape[1], -1).sum(axis=2)


def _row_dots(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, C) sums of a * b per row without materialising the product (einsum per row)."""
    rows = a.shape[:2] + (-1,)
    return np.einsum("ncp,ncp->nc", a.reshape(rows), b.reshape(rows))


# Elements of a BatchNorm block: the several passes an op makes over a block (x, dY, a
# temporary, dX: 4 MiB) then hit the cache instead of memory, and a block is big enough that
# numpy's per-call cost (and the GIL each call takes) stays small. Measured on the 2-vCPU AMD
# EPYC (1 MiB L2 per core, 32 MiB L3), BatchNormGrad on (1000, 24, 22, 22): 2^18 best, 2^15
# 2x slower than unblocked. Per-row results do not depend on the blocks.
_BLOCK = 1 << 18


def _over_blocks(x: np.ndarray, fn: Callable[[slice], object]) -> list:
    """fn(batch slice) for blocks of about _BLOCK elements of x, spread over the workers when x
    is big; the results in batch order."""
    n = x.shape[0]
    step = max(1, min(n, _BLOCK // max(1, x.size // max(1, n))))
    threads = _parallel.workers() if x.size >= _parallel.SPLIT_MIN else 1
    return _parallel.map_shares(lambda blocks: [fn(s) for s in blocks],
                                [slice(i, i + step) for i in range(0, n, step)], threads, blas=False)


def _over_rows(x: np.ndarray, fn) -> np.ndarray:
    """Per-channel double sums of fn(batch slice) -> (rows, C'), computed block by block on every
    core; the rows are joined in batch order before the one double sum, so the result depends
    neither on the blocks nor on the core count."""
    return np.concatenate(_over_blocks(x, fn)).sum(axis=0, dtype=np.float64)


def _per_channel(v: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Per-channel statistics are kept in double; the big tensors stay in the input's precision."""
    return _channel(np.asarray(v).astype(like.dtype), like.ndim)


def _sample_map(v: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Per-channel values spread over one sample, (C * positions,): an op between a (block, C *
    positions) view and this map is numpy's loop over contiguous rows, 2x faster than
    broadcasting (1, C, 1, ...) over rows of `positions` elements (MNIST's BatchNorm2d, 484)."""
    return np.repeat(np.asarray(v).astype(like.dtype), like[:1, :1].size)


def _samples(a: np.ndarray, s: slice) -> np.ndarray:
    """A batch block of a (contiguous) as (block, C * positions)."""
    b = a[s]
    return b.reshape(len(b), -1)


def _batch_stats(x: np.ndarray, dy: np.ndarray | None = None) -> tuple:
    """(mean, biased variance, mean as a `_sample_map`) over every axis but the channel axis, two passes
    over x (the variance of x - mean, never E[x^2] - mean^2). With dy, also (sum of dy, sum of
    dy * (x - mean)) per channel, from the same two passes."""
    n, c = x.size // x.shape[1], x.shape[1]
    if dy is None:
        mean = _over_rows(x, lambda s: _row_sums(x[s])) / n
    else:
        sums = _over_rows(x, lambda s: np.concatenate([_row_sums(x[s]), _row_sums(dy[s])], axis=1))
        mean, dbias = sums[:c] / n, sums[c:]
    mean_m = _sample_map(mean, x)

    def centered(s: slice) -> np.ndarray:
        d = (_samples(x, s) - mean_m).reshape(x[s].shape)  # a block: stays in cache
        return _row_dots(d, d) if dy is None else np.concatenate([_row_dots(d, d), _row_dots(dy[s], d)], axis=1)

    second = _over_rows(x, centered)
    if dy is None:
        return mean, second / n, mean_m
    return mean, second[:c] / n, mean_m, dbias, second[c:]


def batch_norm(node: Node, ins: list, epilogue: Epilogue | None = None) -> list:
    x, scale, bias, mean, var = ins[:5]
    eps = float(node.attr("epsilon", 1e-5))
    training = bool(node.attr("training_mode", 0))
    if training:
        batch_mean, batch_var, mean_m = _batch_stats(x)
        a_m, bias_m = _sample_map(scale * (1.0 / np.sqrt(batch_var + eps)), x), _sample_map(bias, x)
        y = np.empty(x.shape, x.dtype)  # C order: its blocks are reshaped in place

        def normalize(s: slice) -> list:
            block = _samples(y, s)
            np.subtract(_samples(x, s), mean_m, out=block)  # then in place while it is in cache
            block *= a_m
            block += bias_m
            if epilogue is not None:
                epilogue(s, y[s])
            return []

        _over_blocks(x, normalize)
    else:
        a = scale * (1.0 / np.sqrt(var.astype(np.float64) + eps))
        y = (x * _per_channel(a, x) + _per_channel(bias - mean * a, x)).astype(x.dtype, copy=False)
        if epilogue is not None:
            epilogue(slice(0, x.shape[0]), y)
    return batch_norm_outputs(node, y, mean, var, (batch_mean, batch_var) if training else None, x.size // x.shape[1])


def batch_norm_grad(node: Node, ins: list, epilogue: Epilogue | None = None) -> list:
    """BatchNormGrad: (dX, dscale, dbias); batch statistics recomputed (training) or given (training=0)."""
    dy, x, scale = ins[:3]
    eps = float(node.attr("epsilon", 1e-5))
    training = bool(node.attr("training", 1))
    if training:
        _, var, mean_m, dbias, dot = _batch_stats(x, dy)
    else:
        var, mean_c = ins[4].astype(np.float64), _per_channel(ins[3], x)
        sums = _over_rows(x, lambda s: np.concatenate([_row_sums(dy[s]), _row_dots(dy[s], x[s] - mean_c)], axis=1))
        dbias, dot = sums[:x.shape[1]], sums[x.shape[1]:]
    inv = 1.0 / np.sqrt(var + eps)
    k = scale * inv
    dscale = dot * inv
    dparams = [dscale.astype(scale.dtype), dbias.astype(scale.dtype)]
    if not training:
        dx = (dy * _per_channel(k, x)).astype(x.dtype)
        if epilogue is not None:
            epilogue(slice(0, x.shape[0]), dx)
        return [dx] + dparams
    # The batch statistics depend on x too (mean and variance terms of the chain rule):
    # dx = k * (dy - dbias / n - xhat * dscale / n), with xhat = (x - mean) * inv.
    n = x.size // x.shape[1]
    alpha, beta, k_m = (_sample_map(-k * inv * dscale / n, x), _sample_map(-k * dbias / n, x),
                        _sample_map(k, x))
    dx = np.empty(x.shape, x.dtype)  # C order: its blocks are reshaped in place

    def grad(s: slice) -> list:
        d = _samples(x, s) - mean_m  # a block: stays in cache
        d *= alpha
        d += beta
        block = _samples(dx, s)
        np.multiply(_samples(dy, s), k_m, out=block)
        block += d
        if epilogue is not None:
            epilogue(s, dx[s])
        return []

    _over_blocks(x, grad)
    return [dx] + dparams
