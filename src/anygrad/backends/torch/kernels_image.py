"""Spatial lowerings (formulas: anygrad/ops/image.py, ops/detection.py): GridSample and
GridSampleGrad, Col2Im and Col2ImGrad, DeformConv, RoiAlign.

GridSample follows the reference's interpolation plan step for step in float64: per spatial dim
the source coordinate (align_corners or not), the padding mode (zeros, border, reflection), the
taps of the mode (nearest rounds half to even as np.rint; linear; cubic with Keys' a = -0.75,
through the reference's own `cubic_weights`, which is plain arithmetic), each tap's weight and validity,
then every combination of taps gathered and summed in the reference's order, rounded to the
output dtype once. The gradient scatters into the image with `add_rows` (never float atomics).

Col2Im adds each kernel offset's blocks into the padded image in the reference's order; its
gradient (im2col) gathers them back. DeformConv samples every tap at once (one gather per bilinear
corner) in float64. RoiAlign runs when sampling_ratio is fixed (> 0): every ROI then has the same
sampling grid; with 0 each ROI's grid depends on its values and the reference's loop runs.
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ...errors import ShapeError
from ...ops.image import MODES, col2im_blocks, cubic_weights
from .lowering import Site, TorchKernel, add_rows, device_constants, is_float, lowering


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
            offsets = cubic_weights(frac)
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


# -- RoiAlign (a fixed sampling_ratio: every ROI has the same sampling grid) ------------------------
def _roi_axis(start: Any, bin_size: Any, bins: int, grid: int, size: int, device: Any):
    """ops.detection._roi_axis for every ROI at once: (R, bins, grid) low/high indices, weights, validity."""
    import torch
    f64 = torch.float64
    i = torch.arange(bins, dtype=f64, device=device)[None, :, None]
    j = torch.arange(grid, dtype=f64, device=device)[None, None, :]
    bs = bin_size[:, None, None]
    pos = start[:, None, None] + i * bs + (j + 0.5) * bs / grid
    valid = (pos >= -1.0) & (pos <= size)
    pos = torch.clamp_min(pos, 0)
    low = pos.to(torch.int64)
    edge = low >= size - 1
    low = torch.where(edge, size - 1, low)
    high = torch.where(edge, size - 1, low + 1)
    pos = torch.where(edge, low.to(f64), pos)
    frac = pos - low
    return low, high, 1 - frac, frac, valid


@lowering("RoiAlign")
def _roi_align(site: Site) -> TorchKernel | None:
    mode = site.attr("mode", "avg")
    ratio = int(site.attr("sampling_ratio", 0))
    x_shape = site.shape(0)
    if mode not in ("avg", "max") or ratio <= 0 or len(x_shape) != 4 or not is_float(site.dtype(0)) \
            or not is_float(site.dtype(1)):
        return None  # sampling_ratio 0: each ROI's grid depends on its size (the reference loops)
    import torch
    oh, ow = int(site.attr("output_height", 1)), int(site.attr("output_width", 1))
    scale = float(site.attr("spatial_scale", 1.0))
    half_pixel = site.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    c, height, width = x_shape[1:]

    def roi_align(ins):
        x, rois, batch = ins[0], ins[1].to(torch.float64), ins[2].reshape(-1).to(torch.int64)
        r = rois.shape[0]
        box = rois * scale - (0.5 if half_pixel else 0.0)
        x0, y0, x1, y1 = box.unbind(1)
        rw, rh = x1 - x0, y1 - y0
        if not half_pixel:
            rw, rh = torch.clamp_min(rw, 1.0), torch.clamp_min(rh, 1.0)
        ylo, yhi, wyl, wyh, vy = _roi_axis(y0, rh / oh, oh, ratio, height, x.device)
        xlo, xhi, wxl, wxh, vx = _roi_axis(x0, rw / ow, ow, ratio, width, x.device)
        img = x.to(torch.float64)[batch].reshape(r, c, height * width)
        valid = (vy[:, :, :, None, None] & vx[:, None, None, :, :]).unsqueeze(1)  # (R, 1, oh, gh, ow, gw)
        terms = []
        for ys, wy in ((ylo, wyl), (yhi, wyh)):
            for xs, wx in ((xlo, wxl), (xhi, wxh)):
                flat = ys[:, :, :, None, None] * width + xs[:, None, None, :, :]  # (R, oh, gh, ow, gw)
                vals = torch.gather(img, 2, flat.reshape(r, 1, -1).expand(r, c, -1)).reshape((r, c) + flat.shape[1:])
                t = vals * (wy[:, :, :, None, None] * wx[:, None, None, :, :]).unsqueeze(1)
                terms.append(torch.where(valid, t, torch.zeros_like(t)))
        if mode == "avg":
            total = ((terms[0] + terms[1]) + terms[2]) + terms[3]
            out = total.sum(dim=(3, 5)) / max(ratio * ratio, 1)
        else:
            top = torch.maximum(torch.maximum(torch.maximum(terms[0], terms[1]), terms[2]), terms[3])
            out = top.amax(dim=(3, 5))
        return [out.to(x.dtype)]
    return roi_align


# -- DeformConv (2-D) --------------------------------------------------------------------------------
@lowering("DeformConv")
def _deform_conv(site: Site) -> TorchKernel | None:
    """Every kernel tap's bilinear sample (corners outside read 0) at once, as one gather per corner
    in the reference's corner order, scaled by the mask, then one grouped matmul in float64."""
    x_shape, w_shape = site.shape(0), site.shape(1)
    if len(x_shape) != 4 or len(w_shape) != 4 or not all(is_float(site.dtype(i)) for i in range(3)):
        return None
    if site.has(4) and not is_float(site.dtype(4)):
        return None
    import torch
    n, c, height, width = x_shape
    oc, _, kh, kw = w_shape
    group, og = int(site.attr("group", 1)), int(site.attr("offset_group", 1))
    sh, sw = site.attr("strides") or [1, 1]
    dh, dw = site.attr("dilations") or [1, 1]
    pads = site.attr("pads") or [0, 0, 0, 0]
    oh, ow = site.shape(2)[2:]
    has_b, has_m = site.has(3), site.has(4)
    cg = c // og
    base_h = np.array([[(r * sh - pads[0]) + i * dh for r in range(oh)] for i in range(kh)])  # (kh, oh)
    base_w = np.array([[(q * sw - pads[1]) + j * dw for q in range(ow)] for j in range(kw)])  # (kw, ow)
    bases = device_constants(site, [base_h.reshape(kh, 1, oh, 1), base_w.reshape(1, kw, 1, ow)], floats=True)

    def deform_conv(ins):
        f64 = torch.float64
        x, w, offset = ins[0], ins[1], ins[2]
        dev = x.device
        off = offset.to(f64).reshape(n, og, kh, kw, 2, oh, ow)
        bh, bw = bases(dev, f64)
        h = bh + off[:, :, :, :, 0]  # (N, og, kh, kw, oh, ow)
        ww = bw + off[:, :, :, :, 1]
        img = x.to(f64).reshape(n, og, cg, height * width)
        h0, w0 = torch.floor(h), torch.floor(ww)
        sampled = None
        for ah, aw in ((0, 0), (0, 1), (1, 0), (1, 1)):
            hi, wi = h0 + ah, w0 + aw
            weight = (1 - torch.abs(h - hi)) * (1 - torch.abs(ww - wi))
            valid = (hi >= 0) & (hi <= height - 1) & (wi >= 0) & (wi <= width - 1)
            hc = torch.clamp(hi, 0, height - 1).to(torch.int64)
            wc = torch.clamp(wi, 0, width - 1).to(torch.int64)
            flat = (hc * width + wc).reshape(n, og, 1, -1).expand(n, og, cg, -1)
            vals = torch.gather(img, 3, flat)  # (N, og, cg, kh*kw*oh*ow)
            term = vals * (weight * valid).reshape(n, og, 1, -1)
            sampled = term if sampled is None else sampled + term
        if has_m:
            sampled = sampled * ins[4].to(f64).reshape(n, og, 1, -1)
        cols = sampled.reshape(n, group, (c // group) * kh * kw, oh * ow)
        weights = w.to(f64).reshape(group, oc // group, -1)
        y = torch.matmul(weights, cols).reshape(n, oc, oh, ow)
        if has_b:
            y = y + ins[3].to(f64).reshape(1, -1, 1, 1)
        return [y.to(x.dtype)]
    return deform_conv
