"""Resize / Upsample and ResizeGrad (formulas: anygrad/ops/index.py).

Resize is separable: on each resized axis it applies a small (out x in) interpolation matrix,
the one the numpy reference builds (`interp_matrices`), so nearest (every rounding), linear and
cubic modes, every coordinate mode, antialias and exclude_outside come out as the reference
computes them. The matrices depend only on static shapes and attributes: they are built once,
when the graph is compiled (scales, sizes and roi must be compile-time constants), as their
nonzero taps per output row (as the wgpu kernel's sparse tables), and applied axis by axis in the
input's dtype, first axis first, as the reference does: a gather of each row's taps and their
weighted sum, so the work is taps x outputs, not inputs x outputs. Outputs that
tf_crop_and_resize maps outside the input take the extrapolation value afterwards.

ResizeGrad is the same kernel over the transposed matrices.

Integer and bool inputs run only in nearest mode, as a gather of each output row's one source
index (the reference's float64 product, rounded back, picks the same element).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...ops.resize import Interp, interp_matrices
from .lowering import Site, device_constants, is_float, lowering


def _taps(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Matrix m (out x in) as its nonzero taps per row: (columns, weights), each (out, T) for
    the most taps any row has (zero weights pad the shorter rows), so that a kernel reads T
    inputs per output (2 for linear, 4 for cubic) and not every input of the axis."""
    nnz = np.count_nonzero(m, axis=1)
    t = max(1, int(nnz.max()) if nnz.size else 1)
    cols = np.zeros((m.shape[0], t), np.int64)
    weights = np.zeros((m.shape[0], t), np.float64)
    for r, row in enumerate(m):
        nz = np.nonzero(row)[0]
        cols[r, :len(nz)], weights[r, :len(nz)] = nz, row[nz]
    return cols, weights


def _filled(outside: list | None, d: int) -> np.ndarray | bool:
    return False if outside is None or d >= len(outside) else np.asarray(outside[d], bool)


def _separable(site: Site, in_shape: tuple, mats: list, outside: list | None, fill: float):
    """The kernel y = x through mats[d] (out_d x in_d; None: axis unchanged) on each axis d in
    turn, then the `outside` rows of each axis set to `fill`; None when it cannot match the
    reference for this dtype. Each axis gathers its taps and sums them weighted; where every
    row is one weight of 1 (nearest), the gather alone."""
    import torch
    dtype = site.dtype(0)
    axes = [d for d, m in enumerate(mats) if m is not None]
    taps = [_taps(mats[d]) for d in axes]
    # a gather alone: one tap of weight 1 per row, or none on a row filled afterwards (an empty
    # row elsewhere, an input no output reads in the gradient, must give 0: weighted path)
    pure = [w.shape[1] == 1 and bool(np.all((w[:, 0] == 1) | ((w[:, 0] == 0) & _filled(outside, d))))
            for d, (_, w) in zip(axes, taps)]
    if not is_float(dtype) and (dtype.kind not in "iub" or not all(pure)):
        return None  # interpolating integers: the reference rounds a float64 sum, declined
    fills = [(d, np.nonzero(rows)[0]) for d, rows in enumerate(outside or []) if np.any(rows)]
    fill_tensors = device_constants(site, [idx for _, idx in fills]) if fills else None
    fill_axes = [d for d, _ in fills]
    get_cols = device_constants(site, [c.reshape(-1) for c, _ in taps])
    # weights as (1, out, T, 1): the axis viewed as the middle of (before, axis, after)
    get_weights = device_constants(site, [w for _, w in taps], floats=True) if is_float(dtype) else None
    plan, shape = [], list(in_shape)
    for d, (cols, _) in zip(axes, taps):
        n_out, t = cols.shape
        before, after = int(np.prod(shape[:d], dtype=np.int64)), int(np.prod(shape[d + 1:], dtype=np.int64))
        shape[d] = n_out
        plan.append((d, (before, n_out, t, after), tuple(shape)))
    if is_float(dtype):
        value = float(fill)
    else:  # the reference assigns the float fill into the integer array: numpy's cast
        cast = np.zeros(1, dtype)
        cast[0] = fill
        value = cast[0].item()

    def resize(ins):
        x = ins[0]
        cols = get_cols(x.device)
        weights = get_weights(x.device, x.dtype) if get_weights is not None else None
        for k, (d, split, out) in enumerate(plan):
            x = torch.index_select(x, d, cols[k])
            if not pure[k]:
                w = weights[k].reshape(1, split[1], split[2], 1)
                x = (x.reshape(split) * w).sum(dim=2).reshape(out)
        if fill_tensors is not None:
            for d, idx in zip(fill_axes, fill_tensors(x.device)):
                x = x.index_fill(d, idx, value)
        return [x]
    return resize


@lowering("Resize", "Upsample")
def _resize(site: Site):
    """Scales, sizes and roi must be known when the graph is compiled (constants)."""
    scales, roi = site.attr("scales"), site.attr("roi")
    if scales is None or roi is None:
        return None  # scales, sizes or roi known only at run time: the reference kernel reads them
    shape = site.shape(0)
    it = Interp.resolved(site.node)
    mats, outside = interp_matrices(it, shape, site.out_shape(), list(scales), list(roi))
    return _separable(site, shape, mats, outside, it.extrapolation)


@lowering("ResizeGrad")
def _resize_grad(site: Site) -> Any:
    """dy through each axis's matrix transposed (rows outside the input are zero: no gradient)."""
    if not is_float(site.dtype(0)):
        return None
    shape = tuple(int(d) for d in site.attr("shape"))
    out = site.shape(0)
    mats, _ = interp_matrices(Interp.resolved(site.node), shape, out, list(site.attr("scales")), list(site.attr("roi")))
    mats_t = [None if m is None else np.ascontiguousarray(m.T) for m in mats]
    return _separable(site, out, mats_t, None, 0.0)
