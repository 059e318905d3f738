"""Linear quantization ops over the integer types anygrad holds (int8/uint8/int16/uint16, int32
accumulators): QuantizeLinear, DequantizeLinear (per tensor, per axis, blocked),
DynamicQuantizeLinear, MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv.

These are inference ops: rounding has a zero gradient almost everywhere, and their integer inputs
take none, so every slot is nondiff. (Quantization-aware training exports fake-quant pairs whose
straight-through gradient is a training recipe, not the op's derivative.)
"""
from __future__ import annotations

import numpy as np

from ..errors import UnsupportedOpError
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop, get_op
from ._util import norm_axis, onnx_dtype, slot

RANGES = {np.dtype(t): (np.iinfo(t).min, np.iinfo(t).max) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32)}


def _spread(value: np.ndarray, shape: tuple, axis: int, block: int) -> np.ndarray:
    """A scale / zero point broadcastable to x: a scalar, one per index along `axis`, or one per
    block of `block` indices along it (ONNX's three quantization granularities)."""
    value = np.asarray(value)
    if value.ndim == 0 or value.size == 1 and not block:
        return value.reshape(())
    axis = norm_axis(axis, len(shape))
    if not block:
        dims = [1] * len(shape)
        dims[axis] = value.size
        return value.reshape(dims)
    return np.repeat(value, block, axis=axis).take(range(shape[axis]), axis=axis)


def _quantized_dtype(node: Node, zero_point) -> np.dtype:
    if zero_point is not None:
        return np.dtype(zero_point.dtype)
    code = node.attr("output_dtype", 0)
    return onnx_dtype(code, node) if code else np.dtype(np.uint8)


def _check_quantized(node: Node, dtype: np.dtype) -> np.dtype:
    if dtype not in RANGES:
        raise UnsupportedOpError(f"{node.label}: quantized type {dtype} is not supported "
                                 "(anygrad quantizes to int8, uint8, int16, uint16)")
    return dtype


def quantize_precision(node: Node) -> np.dtype | None:
    """The float type QuantizeLinear divides in (its `precision` attribute, opset 23), or None:
    the inputs' own."""
    precision = node.attr("precision", 0)
    return onnx_dtype(precision, node) if precision else None


def _quantize_forward(node: Node, ins: list) -> np.ndarray:
    x, scale, zp = ins[0], ins[1], slot(ins, 2)
    dtype = _check_quantized(node, _quantized_dtype(node, zp))
    axis, block = int(node.attr("axis", 1)), int(node.attr("block_size", 0))
    work = quantize_precision(node)
    scale = _spread(scale, x.shape, axis, block)
    q = x.astype(work) / scale.astype(work) if work else x / scale
    q = np.rint(q).astype(np.int64)
    if zp is not None:
        q = q + _spread(zp, x.shape, axis, block).astype(np.int64)
    return np.clip(q, *RANGES[dtype]).astype(dtype)


defop("QuantizeLinear", nondiff=[0, 1, 2], forward=_quantize_forward,
      infer=lambda node, ins: [TensorInfo(_check_quantized(node, _quantized_dtype(node, slot(ins, 2))),
                                          tuple(ins[0].shape))])


def _dequantized_dtype(node: Node, scale) -> np.dtype:
    code = node.attr("output_dtype", 0)
    return onnx_dtype(code, node) if code else np.dtype(scale.dtype)


def _dequantize_forward(node: Node, ins: list) -> np.ndarray:
    x, scale, zp = ins[0], ins[1], slot(ins, 2)
    axis, block = int(node.attr("axis", 1)), int(node.attr("block_size", 0))
    dx = x.astype(np.float32)
    if zp is not None:
        dx = dx - _spread(zp, x.shape, axis, block).astype(np.float32)
    return (dx * _spread(scale, x.shape, axis, block)).astype(_dequantized_dtype(node, scale))


defop("DequantizeLinear", nondiff=[0, 2], forward=_dequantize_forward,
      infer=lambda node, ins: [TensorInfo(_dequantized_dtype(node, ins[1]), tuple(ins[0].shape))])


def _dynamic_quantize_forward(node: Node, ins: list) -> list[np.ndarray]:
    x = ins[0]
    hi, lo = np.float32(max(0.0, float(np.max(x)))), np.float32(min(0.0, float(np.min(x))))
    scale = np.float32(1.0 if hi == lo else hi - lo) / np.float32(255)
    zp = np.rint(np.clip(np.float32(0) - lo / scale, 0, 255))
    y = np.clip(np.rint(x / scale) + zp, 0, 255)
    return [y.astype(np.uint8), np.array(scale, x.dtype), np.array(zp, np.uint8)]


defop("DynamicQuantizeLinear", nondiff=[0], forward=_dynamic_quantize_forward,
      infer=lambda node, ins: [TensorInfo(np.dtype(np.uint8), tuple(ins[0].shape)),
                               TensorInfo(ins[0].dtype, ()), TensorInfo(np.dtype(np.uint8), ())])


# -- integer matmul / conv ---------------------------------------------------------------------
def _centered(x: np.ndarray, zp, per_row_axis: int | None = None) -> np.ndarray:
    """x - zero point, in int64. A 1-D zero point of a weight is per output channel (axis 0 for
    Conv weights) or per column (MatMul's B)."""
    out = x.astype(np.int64)
    if zp is None:
        return out
    zp = np.asarray(zp).astype(np.int64)
    if zp.ndim == 1 and zp.size > 1 and per_row_axis is not None:
        shape = [1] * x.ndim
        shape[per_row_axis] = zp.size
        zp = zp.reshape(shape)
    return out - zp


def _matmul_shape(a, b) -> tuple:
    return np.matmul(np.zeros(a.shape, np.int8), np.zeros(b.shape, np.int8)).shape


def _matmul_integer(node: Node, ins: list) -> np.ndarray:
    a, b, azp, bzp = ins[0], ins[1], slot(ins, 2), slot(ins, 3)
    if azp is not None and np.asarray(azp).ndim == 1 and np.asarray(azp).size > 1:  # per row of A
        a64 = a.astype(np.int64) - np.asarray(azp).astype(np.int64).reshape(-1, 1)
    else:  # (centring first as per column broadcast a per-row zero point over a non-square A)
        a64 = _centered(a, azp)
    return np.matmul(a64, _centered(b, bzp)).astype(np.int32)


defop("MatMulInteger", nondiff=[0, 1, 2, 3], forward=_matmul_integer,
      infer=lambda node, ins: [TensorInfo(np.dtype(np.int32), _matmul_shape(ins[0], ins[1]))])


def _requantize(acc: np.ndarray, scale: np.ndarray, zp, like: np.dtype) -> np.ndarray:
    r = acc * scale
    dtype = np.dtype(zp.dtype) if zp is not None else like
    if zp is not None:
        r = r + zp
    return np.clip(np.rint(r), *RANGES[dtype]).astype(dtype)


def _qlinear_matmul(node: Node, ins: list) -> np.ndarray:
    a, a_scale, azp, b, b_scale, bzp, y_scale, yzp = ins[:8]
    acc = np.matmul(_centered(a, azp), _centered(b, bzp)).astype(np.float64)
    scale = np.asarray(a_scale, np.float64) * np.asarray(b_scale, np.float64) / np.asarray(y_scale, np.float64)
    return _requantize(acc, scale, yzp, np.dtype(a.dtype))


defop("QLinearMatMul", nondiff=list(range(8)), forward=_qlinear_matmul,
      infer=lambda node, ins: [TensorInfo(ins[7].dtype if ins[7] is not None else ins[0].dtype,
                                          _matmul_shape(ins[0], ins[3]))])


def _conv_node(node: Node, n_inputs: int) -> Node:
    keep = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
    return Node("Conv", ["x", "w", "b"][:n_inputs], ["y"], {k: v for k, v in node.attrs.items() if k in keep},
                node.name)


def _int_conv(node: Node, x: np.ndarray, w: np.ndarray, bias=None) -> np.ndarray:
    """Exact integer convolution through anygrad's float64 Conv kernel (sums stay below 2**53)."""
    ins = [x.astype(np.float64), w.astype(np.float64)] + ([np.asarray(bias, np.float64)] if bias is not None else [])
    return np.rint(get_op("Conv").run(_conv_node(node, len(ins)), ins)[0]).astype(np.int64)


def _conv_shape(node: Node, x: TensorInfo, w: TensorInfo) -> tuple:
    info = get_op("Conv").infer(_conv_node(node, 2), [TensorInfo(np.dtype(np.float32), x.shape),
                                                      TensorInfo(np.dtype(np.float32), w.shape)])
    return tuple(info[0].shape)


def _conv_integer(node: Node, ins: list) -> np.ndarray:
    x, w, xzp, wzp = ins[0], ins[1], slot(ins, 2), slot(ins, 3)
    return _int_conv(node, _centered(x, xzp), _centered(w, wzp, 0)).astype(np.int32)


defop("ConvInteger", nondiff=[0, 1, 2, 3], forward=_conv_integer,
      infer=lambda node, ins: [TensorInfo(np.dtype(np.int32), _conv_shape(node, ins[0], ins[1]))])


def _qlinear_conv(node: Node, ins: list) -> np.ndarray:
    x, x_scale, xzp, w, w_scale, wzp, y_scale, yzp = ins[:8]
    acc = _int_conv(node, _centered(x, xzp), _centered(w, wzp, 0), slot(ins, 8)).astype(np.float64)
    w_scale = np.asarray(w_scale, np.float64)
    if w_scale.size > 1:
        w_scale = w_scale.reshape((1, -1) + (1,) * (x.ndim - 2))
    scale = np.asarray(x_scale, np.float64) * w_scale / np.asarray(y_scale, np.float64)
    return _requantize(acc, scale, yzp, np.dtype(x.dtype))


defop("QLinearConv", nondiff=list(range(9)), forward=_qlinear_conv,
      infer=lambda node, ins: [TensorInfo(ins[7].dtype if ins[7] is not None else ins[0].dtype,
                                          _conv_shape(node, ins[0], ins[3]))])
