"""Spatial ops: GridSample, AffineGrid, Col2Im, CenterCropPad, MaxUnpool, DeformConv.

GridSample is one linear interpolation plan (per output point: which input pixels, with which
weights) shared by its forward kernel and its backward op, which gives the gradients of both the
image and the sampling grid (linear and nearest modes; cubic: the image only). The others are
expansions over primitive ops (MatMul, Slice/Pad, ScatterElements) or small linear kernels.
DeformConv has a numpy kernel only (no gradient rule yet).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..ir.builder import Builder, GradContext
from ..ir.composite import defcomposite
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import ints_of, norm_axis


def _i64(b: Builder, values) -> str:
    return b.const(np.asarray(values, np.int64), np.int64, "ints")


# -- GridSample ------------------------------------------------------------------------------
MODES = {"linear": "linear", "bilinear": "linear", "nearest": "nearest", "cubic": "cubic", "bicubic": "cubic"}
_CUBIC_A = -0.75


@dataclass
class Tap:
    """One input index per output point along one spatial dim, its weight and d weight / d coordinate."""

    index: np.ndarray  # int, clipped into range
    weight: np.ndarray
    dweight: np.ndarray
    valid: np.ndarray  # False where zeros padding reads outside the image


def _reflect(x: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Reflect x into [lo, hi] by the nearer border until inside; also d result / d x (+-1)."""
    span = hi - lo
    below, above = x < lo, x > hi
    dist = np.where(below, lo - x, x - hi)
    n = np.trunc(dist / span) if span > 0 else np.zeros_like(dist)
    r = dist - n * span
    even = n % 2 == 0
    out = np.where(below, np.where(even, lo + r, hi - r), np.where(above, np.where(even, hi - r, lo + r), x))
    # below & even: lo + (lo - x) -> -1; below & odd: hi - (lo - x) -> +1; above likewise.
    sign = np.where(below, np.where(even, -1.0, 1.0), np.where(above, np.where(even, -1.0, 1.0), 1.0))
    return out, sign


def cubic_weights(t: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Keys' cubic convolution weights (a = -0.75) of taps -1..2 at fraction t, and their derivatives."""
    a = _CUBIC_A

    def near(s):  # |s| <= 1
        return ((a + 2) * s - (a + 3)) * s * s + 1, (3 * (a + 2) * s - 2 * (a + 3)) * s

    def far(s):  # 1 < |s| < 2
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a, (3 * a * s - 10 * a) * s + 8 * a

    (w0, d0), (w1, d1), (w2, d2), (w3, d3) = far(t + 1), near(t), near(1 - t), far(2 - t)
    return [(-1, w0, d0), (0, w1, d1), (1, w2, -d2), (2, w3, -d3)]


def _grid_taps(node: Node, grid: np.ndarray, dims) -> tuple[list[list[Tap]], list[np.ndarray]]:
    """Per spatial dim: the taps, and d coordinate / d grid value."""
    mode = MODES.get(node.attr("mode", "linear"))
    padding = node.attr("padding_mode", "zeros")
    if mode is None or padding not in ("zeros", "border", "reflection"):
        raise UnsupportedOpError(f"{node.label}: mode '{node.attr('mode')}' / padding_mode '{padding}'")
    align = bool(node.attr("align_corners", 0))
    nd = len(dims)
    taps, dcoord = [], []
    for i, size in enumerate(dims):
        g = grid[..., nd - 1 - i].astype(np.float64)  # the grid's last axis lists (x, y, z): dims reversed
        x = (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2
        dx = np.full_like(x, (size - 1) / 2 if align else size / 2)
        if mode == "nearest":
            x, dx = np.rint(x), np.zeros_like(x)
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        outside = (x < lo) | (x > hi)
        if padding == "border":
            dx = np.where(outside, 0.0, dx)
            x = np.where(outside, np.clip(x, 0, size - 1), x)
        elif padding == "reflection":
            x, sign = _reflect(x, lo, hi)
            dx = dx * sign
        base = np.floor(x)
        frac = x - base
        if mode == "nearest":
            offsets = [(0, np.ones_like(x), np.zeros_like(x))]
            base = x
        elif mode == "linear":
            offsets = [(0, 1 - frac, -np.ones_like(x)), (1, frac, np.ones_like(x))]
        else:
            offsets = cubic_weights(frac)
        dim_taps = []
        for off, w, dw in offsets:
            idx = base + off
            valid = np.ones(idx.shape, bool)
            if padding == "zeros":
                valid = (idx >= 0) & (idx <= size - 1)
            elif padding == "border":
                idx = np.clip(idx, 0, size - 1)
            else:
                idx = np.trunc(_reflect(idx, lo, hi)[0])
            dim_taps.append(Tap(np.clip(idx, 0, size - 1).astype(np.int64), w, dw, valid))
        taps.append(dim_taps)
        dcoord.append(dx)
    return taps, dcoord


def _grid_combos(x: np.ndarray, grid: np.ndarray, node: Node):
    """Yield (index tuple into x moved to (N, *dims, C), weight per dim, dweight per dim, valid)."""
    dims = x.shape[2:]
    taps, dcoord = _grid_taps(node, grid, dims)
    n_idx = np.arange(x.shape[0]).reshape((-1,) + (1,) * (grid.ndim - 2))
    for combo in itertools.product(*taps):
        valid = np.logical_and.reduce([t.valid for t in combo])
        yield (n_idx,) + tuple(t.index for t in combo), combo, valid, dcoord


def _grid_sample_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    x, grid = ins
    return [TensorInfo(x.dtype, tuple(x.shape[:2]) + tuple(grid.shape[1:-1]))]


def _grid_sample_forward(node: Node, ins: list) -> np.ndarray:
    x, grid = ins
    xt = np.moveaxis(x, 1, -1).astype(np.float64)  # (N, *dims, C)
    out = np.zeros(grid.shape[:-1] + (x.shape[1],))
    for index, combo, valid, _ in _grid_combos(x, grid, node):
        w = np.prod([t.weight for t in combo], axis=0) * valid
        out += w[..., None] * xt[index]
    return np.moveaxis(out, -1, 1).astype(x.dtype)


def _grid_sample_grad_forward(node: Node, ins: list) -> list[np.ndarray]:
    dy, x, grid = ins
    xt = np.moveaxis(x, 1, -1).astype(np.float64)
    dyt = np.moveaxis(dy, 1, -1).astype(np.float64)  # (N, *out, C)
    dxt = np.zeros_like(xt)
    nd = x.ndim - 2
    dgrid = np.zeros(grid.shape, np.float64)
    for index, combo, valid, dcoord in _grid_combos(x, grid, node):
        weights = [t.weight * valid for t in combo]
        np.add.at(dxt, index, np.prod(weights, axis=0)[..., None] * dyt)
        along = (dyt * xt[index]).sum(-1)  # d out / d (product of weights), summed over channels
        for i in range(nd):
            others = np.prod([w for j, w in enumerate(weights) if j != i], axis=0) if nd > 1 else 1.0
            dgrid[..., nd - 1 - i] += along * others * combo[i].dweight * valid * dcoord[i]
    return [np.moveaxis(dxt, -1, 1).astype(x.dtype), dgrid.astype(grid.dtype)]


def _grid_sample_grad(g: GradContext):
    if MODES.get(g.node.attr("mode", "linear")) == "cubic" and g.need(1):
        raise UnsupportedOpError(f"{g.node.label}: no gradient for the grid in cubic mode")
    dx, dgrid = g.ops("GridSampleGrad", [g.dy, g.x[0], g.x[1]], 2, **g.node.attrs)
    return [dx if g.need(0) else None, dgrid if g.need(1) else None]


defop("GridSample", infer=_grid_sample_infer, forward=_grid_sample_forward, grad=_grid_sample_grad)
defop("GridSampleGrad", internal=True, forward=_grid_sample_grad_forward,
      infer=lambda node, ins: [TensorInfo(ins[1].dtype, tuple(ins[1].shape)),
                               TensorInfo(ins[2].dtype, tuple(ins[2].shape))])


# -- AffineGrid: theta @ (base grid of normalized coordinates) ---------------------------------
def _affine_size(node: Node, value) -> list[int]:
    return ints_of(value, "size", node)


def _affine_grid_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    size = _affine_size(node, ins[1])
    return [TensorInfo(ins[0].dtype, (size[0], *size[2:], len(size) - 2))]


def _affine_grid(b: Builder, node: Node) -> list[str]:
    theta = node.inputs[0]
    size = _affine_size(node, b.info(node.inputs[1]))
    spatial = size[2:]
    align = bool(node.attr("align_corners", 0))
    axes = [np.linspace(-1, 1, n) if align else (np.arange(n) * 2 + 1) / n - 1 for n in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")  # one array per spatial dim (D, H, W order)
    points = int(np.prod(spatial))
    base = np.stack([m.reshape(points) for m in reversed(mesh)] + [np.ones(points)])  # (x, y[, z], 1) rows
    grid = b.op("MatMul", [theta, b.const(base.astype(b.dtype(theta)), b.dtype(theta), "base_grid")])
    grid = b.op("Transpose", [grid], perm=[0, 2, 1])
    return [b.reshape(grid, (size[0], *spatial, len(spatial)))]


defcomposite("AffineGrid", infer=_affine_grid_infer, expand=_affine_grid, nondiff=[1])


# -- CenterCropPad: a Slice and a Pad per axis ---------------------------------------------------
def _crop_pad_plan(node: Node, shape, target_value) -> list[tuple[int, int, int]]:
    """Per axis: (crop start, crop end, pad before) for the centred target shape."""
    target = ints_of(target_value, "shape", node)
    rank = len(shape)
    axes = [norm_axis(a, rank) for a in (node.attr("axes") or range(rank))]
    plan = [(0, d, 0, d) for d in shape]
    for axis, want in zip(axes, target):
        have = shape[axis]
        if want < have:
            start = (have - want) // 2
            plan[axis] = (start, start + want, 0, want)
        elif want > have:
            plan[axis] = (0, have, (want - have) // 2, want)
    return plan


def _center_crop_pad_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    plan = _crop_pad_plan(node, ins[0].shape, ins[1])
    return [TensorInfo(ins[0].dtype, tuple(p[3] for p in plan))]


def _center_crop_pad(b: Builder, node: Node) -> list[str]:
    x = node.inputs[0]
    plan = _crop_pad_plan(node, b.shape(x), b.info(node.inputs[1]))
    starts, ends = [p[0] for p in plan], [p[1] for p in plan]
    if starts != [0] * len(plan) or ends != list(b.shape(x)):
        x = b.op("Slice", [x, _i64(b, starts), _i64(b, ends), _i64(b, list(range(len(plan))))])
    before = [p[2] for p in plan]
    after = [p[3] - p[2] - (p[1] - p[0]) for p in plan]
    if any(before) or any(after):
        x = b.op("Pad", [x, _i64(b, before + after)])
    return [x]


defcomposite("CenterCropPad", infer=_center_crop_pad_infer, expand=_center_crop_pad, nondiff=[1])


# -- MaxUnpool: scatter into zeros at the pooling indices ------------------------------------
def _unpool_shapes(node: Node, ins: list) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape the indices address, output shape)."""
    x_shape = tuple(ins[0].shape)
    kernel = list(node.attr("kernel_shape"))
    nd = len(kernel)
    strides = list(node.attr("strides") or [1] * nd)
    pads = list(node.attr("pads") or [0] * (2 * nd))
    inferred = x_shape[:2] + tuple((x_shape[2 + i] - 1) * strides[i] - (pads[i] + pads[nd + i]) + kernel[i]
                                   for i in range(nd))
    out = ins[2] if len(ins) > 2 and ins[2] is not None else None
    return inferred, tuple(ints_of(out, "output_shape", node)) if out is not None else inferred


def _max_unpool_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    return [TensorInfo(ins[0].dtype, _unpool_shapes(node, ins)[1])]


def _max_unpool(b: Builder, node: Node) -> list[str]:
    x, indices = node.inputs[:2]
    inferred, out = _unpool_shapes(node, [b.info(i) if i else None for i in node.inputs])
    total = int(np.prod(inferred))
    zeros = b.const(np.zeros(total, b.dtype(x)), b.dtype(x), "zeros")
    flat = b.op("ScatterElements", [zeros, b.reshape(indices, (int(np.prod(b.shape(indices))),)),
                                    b.reshape(x, (int(np.prod(b.shape(x))),))], axis=0)
    y = b.reshape(flat, inferred)
    if out != inferred:
        y = b.op("Pad", [y, _i64(b, [0] * len(out) + [o - i for o, i in zip(out, inferred)])])
    return [y]


defcomposite("MaxUnpool", infer=_max_unpool_infer, expand=_max_unpool, nondiff=[1, 2])


# -- Col2Im: sum sliding blocks back into an image (the adjoint of im2col) ----------------------
@dataclass
class Blocks:
    image: tuple[int, ...]
    kernel: tuple[int, ...]
    dilations: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[int, ...]  # begin..., end...
    counts: tuple[int, ...]  # blocks along each dim

    def slices(self, k: tuple[int, ...]) -> tuple[slice, ...]:
        """Where kernel offset k of every block lands in the padded image."""
        return tuple(slice(k[i] * self.dilations[i], k[i] * self.dilations[i] + self.strides[i] * (self.counts[i] - 1) + 1,
                           self.strides[i]) for i in range(len(k)))

    def crop(self) -> tuple[slice, ...]:
        nd = len(self.image)
        return tuple(slice(self.pads[i], self.pads[i] + self.image[i]) for i in range(nd))


def col2im_blocks(node: Node, ins: list) -> Blocks:
    """Col2Im's geometry (image, block, dilations, strides, pads, block counts), checked against
    the input's number of blocks."""
    image = tuple(ints_of(ins[1], "image_shape", node))
    kernel = tuple(ints_of(ins[2], "block_shape", node))
    nd = len(image)
    dil = tuple(node.attr("dilations") or [1] * nd)
    strides = tuple(node.attr("strides") or [1] * nd)
    pads = tuple(node.attr("pads") or [0] * (2 * nd))
    counts = tuple((image[i] + pads[i] + pads[nd + i] - dil[i] * (kernel[i] - 1) - 1) // strides[i] + 1
                   for i in range(nd))
    if int(np.prod(counts)) != ins[0].shape[2]:
        raise ShapeError(f"{node.label}: input has {ins[0].shape[2]} blocks, the attributes give {counts}")
    return Blocks(image, kernel, dil, strides, pads, counts)


def _col2im_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    bl = col2im_blocks(node, ins)
    n, ck = ins[0].shape[:2]
    return [TensorInfo(ins[0].dtype, (n, ck // int(np.prod(bl.kernel))) + bl.image)]


def _col2im_forward(node: Node, ins: list) -> np.ndarray:
    x = ins[0]
    bl = col2im_blocks(node, ins)
    n, c = x.shape[0], x.shape[1] // int(np.prod(bl.kernel))
    cols = x.reshape((n, c) + bl.kernel + bl.counts)
    nd = len(bl.image)
    padded = np.zeros((n, c) + tuple(bl.image[i] + bl.pads[i] + bl.pads[nd + i] for i in range(nd)), x.dtype)
    for k in itertools.product(*[range(s) for s in bl.kernel]):
        padded[(slice(None), slice(None)) + bl.slices(k)] += cols[(slice(None), slice(None)) + k]
    return padded[(slice(None), slice(None)) + bl.crop()]


def _im2col_forward(node: Node, ins: list) -> np.ndarray:
    """Col2ImGrad(dy, x, image_shape, block_shape): the blocks of dy, shaped like x."""
    dy, x = ins[0], ins[1]
    bl = col2im_blocks(node, [x, ins[2], ins[3]])
    n, c = dy.shape[:2]
    nd = len(bl.image)
    padded = np.pad(dy, [(0, 0), (0, 0)] + [(bl.pads[i], bl.pads[nd + i]) for i in range(nd)])
    cols = np.zeros((n, c) + bl.kernel + bl.counts, dy.dtype)
    for k in itertools.product(*[range(s) for s in bl.kernel]):
        cols[(slice(None), slice(None)) + k] = padded[(slice(None), slice(None)) + bl.slices(k)]
    return cols.reshape(x.shape)


defop("Col2Im", infer=_col2im_infer, forward=_col2im_forward, nondiff=[1, 2],
      grad=lambda g: [g.op("Col2ImGrad", [g.dy, g.x[0], g.x[1], g.x[2]], **g.node.attrs), None, None])
defop("Col2ImGrad", internal=True, nondiff=[1, 2, 3], forward=_im2col_forward,
      infer=lambda node, ins: [TensorInfo(ins[1].dtype, tuple(ins[1].shape))])


# -- DeformConv (2-D): a convolution whose taps sample the input at learned offsets --------------
def _deform_conv_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    x, w, offset = ins[:3]
    return [TensorInfo(x.dtype, (x.shape[0], w.shape[0]) + tuple(offset.shape[2:]))]


def _bilinear_zeros(img: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """img (N, G, C, H, W) sampled at pixel coordinates h, w of shape (N, G, ...); corners outside
    the image read 0. Returns (N, G, ..., C)."""
    height, width = img.shape[-2:]
    n_idx = np.arange(img.shape[0]).reshape((-1,) + (1,) * (h.ndim - 1))
    g_idx = np.arange(img.shape[1]).reshape((1, -1) + (1,) * (h.ndim - 2))
    h0, w0 = np.floor(h), np.floor(w)
    out = 0.0
    for dh, dw in ((0, 0), (0, 1), (1, 0), (1, 1)):
        hi, wi = h0 + dh, w0 + dw
        weight = (1 - np.abs(h - hi)) * (1 - np.abs(w - wi))
        valid = (hi >= 0) & (hi <= height - 1) & (wi >= 0) & (wi <= width - 1)
        hc, wc = np.clip(hi, 0, height - 1).astype(np.int64), np.clip(wi, 0, width - 1).astype(np.int64)
        vals = img[n_idx, g_idx, :, hc, wc]  # the advanced indices' dims first, then C
        out = out + vals * (weight * valid)[..., None]
    return out


def _deform_conv_forward(node: Node, ins: list) -> np.ndarray:
    x, w, offset = ins[0], ins[1], ins[2]
    bias, mask = (ins[i] if len(ins) > i else None for i in (3, 4))
    if x.ndim != 4:
        raise UnsupportedOpError(f"{node.label}: anygrad runs 2-D DeformConv only")
    n, c, _, _ = x.shape
    oc, _, kh, kw = w.shape
    group, og = int(node.attr("group", 1)), int(node.attr("offset_group", 1))
    sh, sw = node.attr("strides") or [1, 1]
    dh, dw = node.attr("dilations") or [1, 1]
    pads = node.attr("pads") or [0, 0, 0, 0]
    oh, ow = offset.shape[2:]
    off = offset.astype(np.float64).reshape(n, og, kh, kw, 2, oh, ow)
    m = np.ones((n, og, kh, kw, oh, ow)) if mask is None else mask.astype(np.float64).reshape(n, og, kh, kw, oh, ow)
    img = x.astype(np.float64).reshape(n, og, c // og, *x.shape[2:])
    base_h = (np.arange(oh) * sh - pads[0])[:, None]
    base_w = (np.arange(ow) * sw - pads[1])[None, :]
    cols = np.zeros((n, c, kh, kw, oh, ow))
    for i in range(kh):
        for j in range(kw):
            h = base_h + i * dh + off[:, :, i, j, 0]  # (N, og, oh, ow)
            ww = base_w + j * dw + off[:, :, i, j, 1]
            sampled = _bilinear_zeros(img, h, ww) * m[:, :, i, j, :, :, None]  # (N, og, oh, ow, C/og)
            cols[:, :, i, j] = np.moveaxis(sampled, -1, 2).reshape(n, c, oh, ow)
    cols = cols.reshape(n, group, (c // group) * kh * kw, oh * ow)
    weights = w.astype(np.float64).reshape(group, oc // group, -1)
    y = np.einsum("gok,ngkp->ngop", weights, cols).reshape(n, oc, oh, ow)
    if bias is not None:
        y = y + bias.reshape(1, -1, 1, 1)
    return y.astype(x.dtype)


defop("DeformConv", infer=_deform_conv_infer, forward=_deform_conv_forward)


# -- ImageDecoder: encoded bytes (known at compile time: the output's shape depends on them) ------
def _image_decoder_forward(node: Node, ins: list) -> np.ndarray:
    import io
    try:
        from PIL import Image
    except ImportError:
        raise UnsupportedOpError(f"{node.label}: decoding images needs Pillow: pip install 'anygrad-train[image]'") from None
    fmt = node.attr("pixel_format", "RGB")
    if fmt not in ("RGB", "BGR", "Grayscale"):
        raise UnsupportedOpError(f"{node.label}: pixel_format '{fmt}'; expected RGB, BGR or Grayscale")
    with Image.open(io.BytesIO(np.asarray(ins[0], np.uint8).tobytes())) as im:
        if fmt == "Grayscale":
            return np.asarray(im.convert("L"))[:, :, None]
        rgb = np.asarray(im.convert("RGB"))
    return np.ascontiguousarray(rgb[:, :, ::-1]) if fmt == "BGR" else rgb


def _image_decoder_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    if ins[0].const is None:
        raise ShapeError(f"{node.label}: the encoded image must be known when the model is compiled "
                         "(the output's shape depends on it)")
    out = _image_decoder_forward(node, [ins[0].const])
    return [TensorInfo(out.dtype, out.shape, out)]


defop("ImageDecoder", infer=_image_decoder_infer, forward=_image_decoder_forward, nondiff=[0])
