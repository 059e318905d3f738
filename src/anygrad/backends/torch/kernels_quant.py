"""Quantization lowerings: QuantizeLinear, DequantizeLinear (per tensor, per axis, blocked),
DynamicQuantizeLinear, MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv.

Each computes what ops/quant.py computes, value for value: the same promoted dtypes (numpy's,
fixed when the graph is compiled, since torch promotes a 0-d tensor differently), rounding half
to even (torch.round, as np.rint) and then saturating, float16 divisions done in float32 and
rounded once (numpy's float16 ufuncs). Integer products run as float64 matmuls / convolutions,
exact while every sum stays below 2**53, which the lowering checks from the dtypes' ranges and
the reduction length (else the reference runs); integer results wrap to int32 as astype does.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import ShapeError
from ...ops.nn import Window
from ...ops.quant import RANGES, quantize_precision
from .convert import TORCH_DTYPES, torch_dtype
from .kernels_nn import _conv_fn, _pad, _symmetric
from .lowering import Site, TorchKernel, is_float, lowering, norm_axis

_EXACT = 2.0 ** 53


def _spreader(vshape: tuple, xshape: tuple, axis: int, block: int):
    """ops.quant._spread on tensors: a scale / zero point made broadcastable to x."""
    size = int(np.prod(vshape)) if vshape else 1
    if len(vshape) == 0 or size == 1 and not block:
        return lambda v: v.reshape(())
    axis = norm_axis(axis, len(xshape))
    if not block:
        dims = [1] * len(xshape)
        dims[axis] = size
        return lambda v: v.reshape(dims)
    if len(vshape) != len(xshape):
        return None
    import torch
    return lambda v: torch.repeat_interleave(v, block, dim=axis).narrow(axis, 0, xshape[axis])


def _held(dtype: np.dtype) -> Any:
    """torch's dtype for a value the kernel sees (uint16 and uint32 arrive as int64)."""
    import torch
    return torch_dtype(dtype) if dtype in TORCH_DTYPES else torch.int64


def _divide(a: Any, b: Any, work: np.dtype) -> Any:
    """a / b in numpy's `work` dtype: float16 divided in float32 and rounded once."""
    import torch
    if work == np.float16:
        return (a.to(torch.float32) / b.to(torch.float32)).to(torch.float16)
    dt = torch_dtype(work)
    return a.to(dt) / b.to(dt)


@lowering("QuantizeLinear")
def _quantize(site: Site) -> TorchKernel | None:
    out = np.dtype(site.outs[0].dtype)
    if out not in RANGES or out not in TORCH_DTYPES or not is_float(site.dtype(0)) or not is_float(site.dtype(1)):
        return None
    import torch
    xshape = site.shape(0)
    axis, block = int(site.attr("axis", 1)), int(site.attr("block_size", 0))
    work = quantize_precision(site.node)
    if work is None:
        work = np.result_type(site.dtype(0), site.dtype(1))
    if work.kind != "f" or work not in TORCH_DTYPES:
        return None
    spread_s = _spreader(site.shape(1), xshape, axis, block)
    has_zp = site.has(2)
    spread_z = _spreader(site.shape(2), xshape, axis, block) if has_zp else None
    if spread_s is None or has_zp and spread_z is None:
        return None
    lo, hi = (int(v) for v in RANGES[out])
    odt = torch_dtype(out)

    def quantize(ins):
        q = torch.round(_divide(ins[0], spread_s(ins[1]), work)).to(torch.int64)
        if has_zp:
            q = q + spread_z(ins[2]).to(torch.int64)
        return [q.clamp(lo, hi).to(odt)]
    return quantize


@lowering("DequantizeLinear")
def _dequantize(site: Site) -> TorchKernel | None:
    out = np.dtype(site.outs[0].dtype)
    if site.dtype(0).kind not in "iu" or not is_float(site.dtype(1)) or out not in TORCH_DTYPES:
        return None
    import torch
    xshape = site.shape(0)
    axis, block = int(site.attr("axis", 1)), int(site.attr("block_size", 0))
    spread_s = _spreader(site.shape(1), xshape, axis, block)
    has_zp = site.has(2)
    spread_z = _spreader(site.shape(2), xshape, axis, block) if has_zp else None
    if spread_s is None or has_zp and spread_z is None:
        return None
    work = np.result_type(np.float32, site.dtype(1))  # float32 at least: dx is float32
    wdt, odt = torch_dtype(work), torch_dtype(out)

    def dequantize(ins):
        dx = ins[0].to(torch.float32)
        if has_zp:
            dx = dx - spread_z(ins[2]).to(torch.float32)
        return [(dx.to(wdt) * spread_s(ins[1]).to(wdt)).to(odt)]
    return dequantize


@lowering("DynamicQuantizeLinear")
def _dynamic_quantize(site: Site) -> TorchKernel | None:
    if not is_float(site.dtype(0)) or site.dtype(0) not in TORCH_DTYPES:
        return None
    import torch
    xdt = torch_dtype(site.dtype(0))
    work = np.result_type(site.dtype(0), np.float32)
    f32 = torch.float32

    def dynamic_quantize(ins):
        x = ins[0]
        top, bottom = x.max().to(torch.float64), x.min().to(torch.float64)
        hi = torch.where(top > 0, top, torch.zeros_like(top)).to(f32)  # Python's max(0.0, m): 0 for NaN
        lo = torch.where(bottom < 0, bottom, torch.zeros_like(bottom)).to(f32)
        span = torch.where(hi == lo, torch.ones_like(hi), hi - lo)
        scale = span / torch.full_like(span, 255.0)
        zp = torch.round(torch.clamp(torch.zeros_like(lo) - lo / scale, 0.0, 255.0))
        y = torch.round(_divide(x, scale, work)) + zp.to(torch_dtype(work))
        return [y.clamp(0, 255).to(torch.uint8), scale.to(xdt), zp.to(torch.uint8)]
    return dynamic_quantize


# -- integer matmul / conv ---------------------------------------------------------------------
def _span(dtype: np.dtype) -> int:
    """The largest |x - zero point| of a quantized dtype."""
    lo, hi = RANGES.get(np.dtype(dtype), (None, None))
    return None if lo is None else int(hi) - int(lo)


def _exact(length: int, *dtypes: np.dtype) -> bool:
    spans = [_span(d) for d in dtypes]
    return None not in spans and all(np.dtype(d).kind in "iu" for d in dtypes) \
        and float(length) * math.prod(spans) < _EXACT


def _centered(x: Any, zp: Any, zshape: tuple | None, per_row: int | None = None, rank: int = 0) -> Any:
    """ops.quant._centered in float64 (exact for the integer dtypes held here)."""
    import torch
    out = x.to(torch.float64)
    if zp is None:
        return out
    z = zp.to(torch.float64)
    if per_row is not None and len(zshape) == 1 and zshape[0] > 1:
        shape = [1] * rank
        shape[per_row] = zshape[0]
        z = z.reshape(shape)
    return out - z


@lowering("MatMulInteger")
def _matmul_integer(site: Site) -> TorchKernel | None:
    a_shape = site.shape(0)
    if len(a_shape) < 1 or not _exact(a_shape[-1], site.dtype(0), site.dtype(1)):
        return None
    import torch
    has_a, has_b = site.has(2), site.has(3)
    azs = site.shape(2) if has_a else None
    bzs = site.shape(3) if has_b else None
    a_per_row = has_a and len(azs) == 1 and azs[0] > 1

    def matmul_integer(ins):
        a = ins[0].to(torch.float64)
        if a_per_row:
            a = a - ins[2].to(torch.float64).reshape(-1, 1)
        elif has_a:
            a = a - ins[2].to(torch.float64)
        b = _centered(ins[1], ins[3] if has_b else None, bzs)
        return [torch.matmul(a, b).to(torch.int64).to(torch.int32)]
    return matmul_integer


def _requantizer(site: Site, yzp_slot: int, like: np.dtype):
    """ops.quant._requantize: r = acc * scale (+ zero point), rounded half to even, saturated."""
    dtype = site.dtype(yzp_slot) if site.has(yzp_slot) else np.dtype(like)
    if dtype not in RANGES or dtype not in TORCH_DTYPES:
        return None
    import torch
    lo, hi = (int(v) for v in RANGES[dtype])
    odt = torch_dtype(dtype)

    def requantize(acc, scale, zp):
        r = acc * scale
        if zp is not None:
            r = r + zp.to(torch.float64)
        return torch.round(r).clamp(lo, hi).to(odt)
    return requantize


@lowering("QLinearMatMul")
def _qlinear_matmul(site: Site) -> TorchKernel | None:
    if not (site.has(0) and site.has(3)) or not all(site.has(i) for i in (1, 4, 6)):
        return None
    a_shape = site.shape(0)
    if len(a_shape) < 1 or not _exact(a_shape[-1], site.dtype(0), site.dtype(3)):
        return None
    if not all(is_float(site.dtype(i)) for i in (1, 4, 6)):
        return None
    requantize = _requantizer(site, 7, site.dtype(0))
    if requantize is None:
        return None
    import torch
    has = [site.has(i) for i in range(8)]
    f64 = torch.float64

    def qlinear_matmul(ins):
        a = _centered(ins[0], ins[2] if has[2] else None, None)
        b = _centered(ins[3], ins[5] if has[5] else None, None)
        acc = torch.matmul(a, b)
        scale = ins[1].to(f64) * ins[4].to(f64) / ins[6].to(f64)
        return [requantize(acc, scale, ins[7] if has[7] else None)]
    return qlinear_matmul


def _int_conv(site: Site, x_slot: int, w_slot: int):
    """conv(x, w, bias) in float64 with the node's window, exact for these integers; None when
    the node is not a 1-3 D conv of held integer dtypes with sums below 2**53."""
    x_shape, w_shape = site.shape(x_slot), site.shape(w_slot)
    nd = len(x_shape) - 2
    conv = _conv_fn(nd)
    if conv is None or len(w_shape) != nd + 2:
        return None
    length = int(np.prod(w_shape[1:]))
    if not _exact(length, site.dtype(x_slot), site.dtype(w_slot)):
        return None
    try:
        win = Window.of(site.node, x_shape[2:])
    except ShapeError:
        return None
    if tuple(win.kernel) != tuple(w_shape[2:]):
        return None
    group = int(site.attr("group", 1))
    sym = _symmetric(win)

    def run(x, w, b):
        if sym:
            return conv(x, w, b, win.strides, list(win.begin), win.dilations, group)
        return conv(_pad(x, win), w, b, win.strides, 0, win.dilations, group)
    return run


@lowering("ConvInteger")
def _conv_integer(site: Site) -> TorchKernel | None:
    run = _int_conv(site, 0, 1)
    if run is None:
        return None
    import torch
    has_x, has_w = site.has(2), site.has(3)
    wzs = site.shape(3) if has_w else None
    rank = len(site.shape(1))

    def conv_integer(ins):
        x = _centered(ins[0], ins[2] if has_x else None, None)
        w = _centered(ins[1], ins[3] if has_w else None, wzs, 0, rank)
        return [torch.round(run(x, w, None)).to(torch.int64).to(torch.int32)]
    return conv_integer


@lowering("QLinearConv")
def _qlinear_conv(site: Site) -> TorchKernel | None:
    if not all(site.has(i) for i in (0, 1, 3, 4, 6)) or not all(is_float(site.dtype(i)) for i in (1, 4, 6)):
        return None
    run = _int_conv(site, 0, 3)
    requantize = _requantizer(site, 7, site.dtype(0))
    if run is None or requantize is None:
        return None
    if site.has(8):
        if site.dtype(8).kind not in "iu":
            return None
        # the bias joins the float64 sums: still exact if it stays well inside 2**53
        length = int(np.prod(site.shape(3)[1:]))
        if float(length) * _span(site.dtype(0)) * _span(site.dtype(3)) + 2.0 ** 32 >= _EXACT:
            return None
    import torch
    has = [site.has(i) for i in range(9)]
    wzs = site.shape(5) if has[5] else None
    ws_shape = site.shape(4)
    rank = len(site.shape(0))
    ws_dims = (1, -1) + (1,) * (rank - 2) if int(np.prod(ws_shape)) > 1 else None
    f64 = torch.float64

    def qlinear_conv(ins):
        x = _centered(ins[0], ins[2] if has[2] else None, None)
        w = _centered(ins[3], ins[5] if has[5] else None, wzs, 0, rank)
        b = ins[8].to(f64) if has[8] else None
        acc = torch.round(run(x, w, b))
        w_scale = ins[4].to(f64)
        if ws_dims is not None:
            w_scale = w_scale.reshape(ws_dims)
        scale = ins[1].to(f64) * w_scale / ins[6].to(f64)
        return [requantize(acc, scale, ins[7] if has[7] else None)]
    return qlinear_conv
