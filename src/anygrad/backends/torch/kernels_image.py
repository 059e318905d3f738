"""Spatial lowerings (formulas: anygrad/ops/image.py): GridSample and GridSampleGrad, Col2Im and
Col2ImGrad.

GridSample follows the reference's interpolation plan step for step in float64: per spatial dim
the source coordinate (align_corners or not), the padding mode (zeros, border, reflection), the
taps of the mode (nearest rounds half to even as np.rint; linear; cubic with Keys' a = -0.75,
through the reference's own `_cubic`, which is plain arithmetic), each tap's weight and validity,
then every combination of taps gathered and summed in the reference's order, rounded to the
output dtype once. The gradient scatters into the image with `add_rows` (never float atomics).

Col2Im adds each kernel offset's blocks into the padded image in the reference's order; its
gradient (im2col) gathers them back.
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ...errors import ShapeError
from ...ops.image import MODES, _cubic, col2im_blocks
from .lowering import Site, TorchKernel, add_rows, is_float, lowering


def _reflect(x: Any, lo: float, hi: float) -> tuple[Any, Any]:
    """ops.image._reflect on tensors: x reflected into [lo, hi], and d result / d x (+-1)."""
    import torch
    span = hi - lo
    below, above = x < lo, x > hi
    dist = torch.where(below, lo - x, x - hi)
    n = torch.trunc(dist / span) if span > 0 else torch.zeros_like(dist)
    r = dist - n * span
    even = torch.remainder(n, 2) == 0
    out = torch.where(below, torch.where(even, lo + r, hi - r), torch.where(above, torch.where(even, hi - r, lo + r), x))
    sign = torch.where(even, -1.0, 1.0)
    sign = torch.where(below | above, sign, torch.ones_like(sign))
    return out, sign


def _grid_taps(grid: Any, dims: tuple, mode: str, padding: str, align: bool):
    """ops.image._grid_taps on tensors: per dim a list of (index, weight, dweight, valid or None),
    and d coordinate / d grid value."""
    import torch
    nd = len(dims)
    taps, dcoord = [], []
    for i, size in enumerate(dims):
        g = grid[..., nd - 1 - i].to(torch.float64)
        x = (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2
        dx = torch.full_like(x, (size - 1) / 2 if align else size / 2)
        if mode == "nearest":
            x, dx = torch.round(x), torch.zeros_like(x)
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        outside = (x < lo) | (x > hi)
        if padding == "border":
            dx = torch.where(outside, torch.zeros_like(dx), dx)
            x = torch.where(outside, torch.clamp(x, 0, size - 1), x)
        elif padding == "reflection":
            x, sign = _reflect(x, lo, hi)
            dx = dx * sign
        base = torch.floor(x)
        frac = x - base
        if mode == "nearest":
            offsets = [(0, torch.ones_like(x), torch.zeros_like(x))]
            base = x
        elif mode == "linear":
            offsets = [(0, 1 - frac, -torch.ones_like(x)), (1, frac, torch.ones_like(x))]
        else:
            offsets = _cubic(frac)
        dim_taps = []
        for off, w, dw in offsets:
            idx = base + off
            valid = None
            if padding == "zeros":
                valid = (idx >= 0) & (idx <= size - 1)
            elif padding == "border":
                idx = torch.clamp(idx, 0, size - 1)
            else:
                idx = torch.trunc(_reflect(idx, lo, hi)[0])
            dim_taps.append((torch.clamp(idx, 0, size - 1).to(torch.int64), w, dw, valid))
        taps.append(dim_taps)
        dcoord.append(dx)
    return taps, dcoord


def _grid_setup(site: Site, x_slot: int):
    mode = MODES.get(site.attr("mode", "linear"))
    padding = site.attr("padding_mode", "zeros")
    if mode is None or padding not in ("zeros", "border", "reflection"):
        return None
    x_shape = site.shape(x_slot)
    if not is_float(site.dtype(x_slot)) or not is_float(site.dtype(x_slot + 1)) or len(x_shape) < 3:
        return None
    return mode, padding, bool(site.attr("align_corners", 0)), tuple(x_shape[2:])


def _combos(taps):
    """Each combination of one tap per dim: (indices, weights, dweights, valid as float64 or None)."""
    for combo in itertools.product(*taps):
        valids = [t[3] for t in combo if t[3] is not None]
        valid = None
        if valids:
            valid = valids[0]
            for v in valids[1:]:
                valid = valid & v
        yield [t[0] for t in combo], [t[1] for t in combo], [t[2] for t in combo], valid


def _prod(ws: list) -> Any:
    out = ws[0]
    for w in ws[1:]:
        out = out * w
    return out


@lowering("GridSample")
def _grid_sample(site: Site) -> TorchKernel | None:
    setup = _grid_setup(site, 0)
    if setup is None:
        return None
    import torch
    mode, padding, align, dims = setup

    def grid_sample(ins):
        x, grid = ins
        xt = x.movedim(1, -1).to(torch.float64)  # (N, *dims, C)
        n_idx = torch.arange(x.shape[0], device=x.device).reshape((-1,) + (1,) * (grid.dim() - 2))
        taps, _ = _grid_taps(grid, dims, mode, padding, align)
        out = torch.zeros(tuple(grid.shape[:-1]) + (x.shape[1],), dtype=torch.float64, device=x.device)
        for index, weights, _, valid in _combos(taps):
            w = _prod(weights)
            if valid is not None:
                w = w * valid
            out = out + w[..., None] * xt[(n_idx, *index)]
        return [out.movedim(-1, 1).to(x.dtype)]
    return grid_sample


@lowering("GridSampleGrad")
def _grid_sample_grad(site: Site) -> TorchKernel | None:
    setup = _grid_setup(site, 1)
    if setup is None or not is_float(site.dtype(0)):
        return None
    import torch
    mode, padding, align, dims = setup
    nd = len(dims)
    strides = [int(np.prod(dims[k + 1:])) for k in range(nd)]
    total = int(np.prod(dims))

    def grid_sample_grad(ins):
        dy, x, grid = ins
        f64 = torch.float64
        xt = x.movedim(1, -1).to(f64)
        dyt = dy.movedim(1, -1).to(f64)  # (N, *out, C)
        n, c = x.shape[0], x.shape[1]
        n_idx = torch.arange(n, device=x.device).reshape((-1,) + (1,) * (grid.dim() - 2))
        acc = torch.zeros((n * total, c), dtype=f64, device=x.device)
        dgrid = [torch.zeros(tuple(grid.shape[:-1]), dtype=f64, device=x.device) for _ in range(nd)]
        taps, dcoord = _grid_taps(grid, dims, mode, padding, align)
        for index, weights, dweights, valid in _combos(taps):
            if valid is not None:
                weights = [w * valid for w in weights]
            flat = n_idx * total
            for k in range(nd):
                flat = flat + index[k] * strides[k]
            rows = (_prod(weights)[..., None] * dyt).reshape(-1, c)
            add_rows(acc, flat.expand(dyt.shape[:-1]).reshape(-1), rows)
            along = (dyt * xt[(n_idx, *index)]).sum(-1)
            for i in range(nd):
                term = along * _prod([w for j, w in enumerate(weights) if j != i]) if nd > 1 else along * 1.0
                term = term * dweights[i]
                if valid is not None:
                    term = term * valid
                dgrid[i] = dgrid[i] + term * dcoord[i]
        dx = acc.reshape((n, *dims, c)).movedim(-1, 1).to(x.dtype)
        return [dx, torch.stack(dgrid[::-1], dim=-1).to(grid.dtype)]
    return grid_sample_grad


# -- Col2Im and its gradient ---------------------------------------------------------------------
def _blocks(site: Site, x_slot: int):
    if any(site.const(s) is None for s in (x_slot + 1, x_slot + 2)):
        return None  # image and block shapes known only at run time: the reference reads them
    try:
        return col2im_blocks(site.node, [site.ins[x_slot], site.ins[x_slot + 1], site.ins[x_slot + 2]])
    except ShapeError:
        return None


@lowering("Col2Im")
def _col2im(site: Site) -> TorchKernel | None:
    bl = _blocks(site, 0)
    if bl is None or site.dtype(0).kind not in "iuf":
        return None
    import torch
    nd = len(bl.image)
    offsets = list(itertools.product(*[range(s) for s in bl.kernel]))
    padded_shape = tuple(bl.image[i] + bl.pads[i] + bl.pads[nd + i] for i in range(nd))
    full = (slice(None), slice(None))

    def col2im(ins):
        x = ins[0]
        n, c = x.shape[0], x.shape[1] // int(np.prod(bl.kernel))
        cols = x.reshape((n, c) + bl.kernel + bl.counts)
        padded = torch.zeros((n, c) + padded_shape, dtype=x.dtype, device=x.device)
        for k in offsets:
            padded[full + bl.slices(k)] += cols[full + k]
        return [padded[full + bl.crop()].contiguous()]
    return col2im


@lowering("Col2ImGrad")
def _col2im_grad(site: Site) -> TorchKernel | None:
    bl = _blocks(site, 1)
    if bl is None or site.dtype(0).kind not in "iuf":
        return None
    import torch
    import torch.nn.functional as F
    nd = len(bl.image)
    offsets = list(itertools.product(*[range(s) for s in bl.kernel]))
    pads: list[int] = []
    for i in reversed(range(nd)):
        pads += [bl.pads[i], bl.pads[nd + i]]
    x_shape = site.shape(1)
    full = (slice(None), slice(None))

    def im2col(ins):
        dy = ins[0]
        padded = F.pad(dy, pads) if any(pads) else dy
        cols = torch.stack([padded[full + bl.slices(k)] for k in offsets], dim=2)
        return [cols.reshape(x_shape)]
    return im2col
