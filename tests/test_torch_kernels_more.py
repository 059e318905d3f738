"""More torch lowerings against the numpy backend (device torch:cpu): activations, trigonometric
functions, Mod and bitwise ops, gathers and scatters, TopK, OneHot, CumSum, Einsum, the
remaining reductions, CumProd, Det, GridSample, Col2Im, RoiAlign, DeformConv and the quantization
ops (ties at .5, saturation, per-axis and blocked scales, integer matmul / conv). Each case asserts the op ran on a torch kernel (no reference fallback),
with its gradient ops where it has them."""
from __future__ import annotations

import numpy as np
import pytest
from test_torch_backend import _agrees_with_numpy, _Const, one_torch_thread  # noqa: F401  (the fixture)

from anygrad.backends.torch import TorchBackend

FLOATS = pytest.mark.parametrize("dtype", [np.float32, np.float64])
R = np.random.default_rng(0)


def _x(shape, dtype=np.float32, scale: float = 2.0):
    return (R.standard_normal(shape) * scale).astype(dtype)


# -- activations and their gradient ops ---------------------------------------------------------------
@FLOATS
@pytest.mark.parametrize("op, attrs", [
    ("Elu", {}), ("Elu", {"alpha": 0.5}), ("Selu", {}), ("Selu", {"alpha": 1.2, "gamma": 0.9}),
    ("Celu", {}), ("Celu", {"alpha": 2.0}), ("Softplus", {}), ("Softsign", {}), ("Mish", {}),
    ("Sin", {}), ("Cos", {})])
def test_activations_and_gradients(dtype, op, attrs):
    x = _x((4, 7), dtype, 3.0)
    x[0, :3] = [0.0, 30.0, -30.0]
    _agrees_with_numpy(op, [x], attrs, lowered=(op, f"{op}Grad"))


@FLOATS
@pytest.mark.parametrize("op, low, high", [
    ("Tan", -1.2, 1.2), ("Asin", -0.95, 0.95), ("Acos", -0.95, 0.95), ("Atan", -5, 5), ("Sinh", -3, 3),
    ("Cosh", -3, 3), ("Asinh", -5, 5), ("Acosh", 1.1, 5), ("Atanh", -0.9, 0.9)])
def test_trigonometric_and_gradients(dtype, op, low, high):
    x = R.uniform(low, high, (3, 5)).astype(dtype)
    _agrees_with_numpy(op, [x], lowered=(op,))


def test_trigonometric_out_of_domain_is_nan_as_numpy():
    x = np.array([-2.0, 0.5, 2.0], np.float32)
    for op in ("Asin", "Acos", "Acosh", "Atanh"):
        _agrees_with_numpy(op, [x], diff=(), lowered=(op,))


@pytest.mark.parametrize("dtype, slope_shape", [(np.float32, (5,)), (np.float64, (3, 1)), (np.int32, (5,))])
def test_prelu(dtype, slope_shape):
    x = _x((3, 5), dtype, 3.0) if dtype != np.int32 else R.integers(-9, 9, (3, 5)).astype(dtype)
    slope = _x(slope_shape, dtype, 1.0) if dtype != np.int32 else R.integers(-3, 3, slope_shape).astype(dtype)
    diff = (0, 1) if dtype != np.int32 else ()
    _agrees_with_numpy("PRelu", [x, slope], diff=diff, lowered=("PRelu",))


# -- Mod and bitwise -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.uint8, np.int8])
def test_mod(dtype, fmod):
    if np.dtype(dtype).kind == "f":
        a, b = _x((4, 6), dtype, 5.0), _x((6,), dtype, 2.0)
        diff = (0, 1)
    else:
        lo = 0 if np.dtype(dtype).kind == "u" else -20
        a, b = R.integers(lo, 20, (4, 6)).astype(dtype), R.integers(lo // 4, 6, (6,)).astype(dtype)
        b[0] = 0  # numpy's 0, where torch alone would raise
        diff = ()
    _agrees_with_numpy("Mod", [a, b], {"fmod": fmod}, diff=diff, lowered=("Mod",))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.int8, np.bool_])
@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot"])
def test_bitwise(dtype, op):
    if dtype == np.bool_:
        a, b = R.integers(0, 2, (3, 4)).astype(bool), R.integers(0, 2, (4,)).astype(bool)
    else:
        info = np.iinfo(dtype)
        a = R.integers(info.min, info.max, (3, 4), endpoint=True).astype(dtype)
        b = R.integers(info.min, info.max, (4,), endpoint=True).astype(dtype)
    _agrees_with_numpy(op, [a] if op == "BitwiseNot" else [a, b], diff=(), lowered=(op,))


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bit_shift(direction):
    x = R.integers(0, 256, (4, 5)).astype(np.uint8)
    n = R.integers(0, 10, (5,)).astype(np.uint8)  # 8 and 9 shift everything out
    _agrees_with_numpy("BitShift", [x, n], {"direction": direction}, diff=(), lowered=("BitShift",))


# -- gathers and scatters ----------------------------------------------------------------------------
@FLOATS
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements_and_gradient(dtype, axis):
    data = _x((4, 5, 3), dtype)
    shape = list(data.shape)
    dim = shape[axis]
    shape[axis] = 6  # more entries than the axis: repeated indices add up in the gradient
    idx = R.integers(-dim, dim, shape).astype(np.int64)
    _agrees_with_numpy("GatherElements", [data, idx], {"axis": axis}, lowered=("GatherElements", "GatherElementsGrad"))
    _agrees_with_numpy("GatherElements", [data, _Const(idx.astype(np.int32))], {"axis": axis},
                       lowered=("GatherElements", "GatherElementsGrad"))


def test_gather_elements_out_of_range_raises_on_torch_too():
    data, idx = _x((3, 4)), np.array([[0, 4, 1, 0]], np.int64)
    from test_torch_backend import _op_and_grads
    graph, feeds = _op_and_grads("GatherElements", [data, idx], {"axis": 1}, diff=())
    exe = TorchBackend("torch:cpu").compile(graph)
    assert exe.fallback_ops == []
    with pytest.raises((RuntimeError, IndexError)):  # torch's own bounds check
        exe.run(feeds)
    # a constant out-of-range index: the reference kernel runs (and raises its own error)
    graph, _ = _op_and_grads("GatherElements", [data, _Const(idx)], {"axis": 1}, diff=())
    assert "GatherElements" in TorchBackend("torch:cpu").compile(graph).fallback_ops


@FLOATS
@pytest.mark.parametrize("data_shape, idx_shape, batch_dims", [
    ((4, 5, 3), (6, 2), 0), ((4, 5, 3), (2, 3, 1), 0), ((4, 5, 3), (7, 3), 0),
    ((2, 5, 3), (2, 4, 1), 1), ((2, 3, 5, 4), (2, 3, 2, 2), 2)])
def test_gather_nd_and_gradient(dtype, data_shape, idx_shape, batch_dims):
    data = _x(data_shape, dtype)
    k = idx_shape[-1]
    dims = np.array(data_shape[batch_dims:batch_dims + k], np.int64)
    idx = (R.integers(0, 1 << 30, idx_shape) % np.maximum(dims, 1)).astype(np.int64)
    idx[..., :] -= dims * R.integers(0, 2, idx_shape)  # some from the end
    _agrees_with_numpy("GatherND", [data, idx], {"batch_dims": batch_dims}, lowered=("GatherND", "GatherNDGrad"))


def test_gather_nd_out_of_range_raises_on_torch_too():
    from test_torch_backend import _op_and_grads
    graph, feeds = _op_and_grads("GatherND", [_x((3, 4)), np.array([[1, 4]], np.int64)], diff=())
    exe = TorchBackend("torch:cpu").compile(graph)
    assert exe.fallback_ops == []
    with pytest.raises((RuntimeError, IndexError)):  # torch's own bounds check
        exe.run(feeds)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, -1])
def test_scatter_elements(dtype, reduction, axis):
    data = _x((4, 5), dtype) if dtype != np.int32 else R.integers(-9, 9, (4, 5)).astype(dtype)
    shape = [4, 5]
    shape[axis] = 7
    dim = data.shape[axis]
    idx = R.integers(-dim, dim, shape).astype(np.int64)  # repeated positions: last wins for "none"
    upd = _x(shape, dtype) if dtype != np.int32 else R.integers(-9, 9, shape).astype(dtype)
    diff = (0, 2) if reduction in ("none", "add") and dtype != np.int32 else ()
    _agrees_with_numpy("ScatterElements", [data, idx, upd], {"axis": axis, "reduction": reduction}, diff=diff,
                       lowered=("ScatterElements",) + (("GatherElements",) if diff else ()))


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("data_shape, idx_shape", [((6, 3, 2), (5, 1)), ((6, 3, 2), (4, 2, 2)), ((6, 3), (3, 2))])
def test_scatter_nd(dtype, reduction, data_shape, idx_shape):
    k = idx_shape[-1]
    dims = np.array(data_shape[:k])
    idx = (R.integers(0, 1 << 30, idx_shape) % dims).astype(np.int64) - dims * R.integers(0, 2, idx_shape)
    upd_shape = idx_shape[:-1] + data_shape[k:]
    if dtype == np.int64:
        data, upd = R.integers(-9, 9, data_shape).astype(dtype), R.integers(-9, 9, upd_shape).astype(dtype)
    else:
        data, upd = _x(data_shape, dtype), _x(upd_shape, dtype)
    diff = (0, 2) if reduction in ("none", "add") and dtype != np.int64 else ()
    _agrees_with_numpy("ScatterND", [data, idx, upd], {"reduction": reduction}, diff=diff,
                       lowered=("ScatterND",) + (("GatherND",) if diff else ()))


# -- TopK, Hardmax, OneHot -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8])
@pytest.mark.parametrize("largest, sorted_, axis, k", [(1, 1, -1, 3), (0, 1, 0, 2), (1, 0, 1, 5), (0, 0, -1, 1)])
def test_topk_ties_and_gradient(dtype, largest, sorted_, axis, k):
    x = R.integers(0, 4, (5, 6)).astype(dtype)  # many ties: the lower index first
    attrs = {"largest": largest, "sorted": sorted_, "axis": axis}
    diff = (0,) if np.dtype(dtype).kind == "f" else ()
    _agrees_with_numpy("TopK", [x, _Const(np.array([k], np.int64))], attrs, diff=diff, n_outputs=2,
                       lowered=("TopK",) + (("GatherElementsGrad",) if diff else ()))


def test_topk_nan_and_k_attribute():
    x = np.array([[1.0, np.nan, 3.0, np.nan, -1.0]], np.float32)
    for largest in (0, 1):
        _agrees_with_numpy("TopK", [x], {"k": 4, "largest": largest}, diff=(), n_outputs=2, lowered=("TopK",))


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_hardmax(dtype, axis):
    x = R.integers(0, 3, (4, 5, 3)).astype(dtype)  # ties: the first maximum
    _agrees_with_numpy("Hardmax", [x], {"axis": axis}, diff=(), lowered=("Hardmax",))


@pytest.mark.parametrize("idx_dtype", [np.int64, np.int32, np.uint8])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_onehot_and_gradient(idx_dtype, axis):
    lo = 0 if idx_dtype == np.uint8 else -7
    idx = R.integers(lo, 8, (3, 4)).astype(idx_dtype)  # some out of range: all "off"
    values = np.array([-0.5, 2.0], np.float32)
    _agrees_with_numpy("OneHot", [idx, _Const(np.array(5, np.int64)), values], {"axis": axis}, diff=(2,),
                       lowered=("OneHot",))


# -- CumSum, Tile, Trilu, DepthToSpace, SpaceToDepth, EyeLike -----------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_and_gradient(dtype, axis, exclusive, reverse):
    x = _x((4, 5), dtype) if dtype != np.int32 else R.integers(-9, 9, (4, 5)).astype(dtype)
    diff = (0,) if dtype != np.int32 else ()
    _agrees_with_numpy("CumSum", [x, _Const(np.array(axis, np.int32))], {"exclusive": exclusive, "reverse": reverse},
                       diff=diff, lowered=("CumSum",))


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
@pytest.mark.parametrize("reps", [(2, 1, 3), (1, 1, 1), (3, 2, 1)])
def test_tile_and_gradient(dtype, reps):
    x = _x((2, 3, 2)).astype(dtype)
    diff = (0,) if dtype == np.float32 else ()
    _agrees_with_numpy("Tile", [x, _Const(np.array(reps, np.int64))], diff=diff, lowered=("Tile",))


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 2, -1, -7])
def test_trilu_and_gradient(dtype, upper, k):
    x = _x((2, 4, 5)).astype(dtype)
    diff = (0,) if dtype == np.float32 else ()
    inputs = [x] if k is None else [x, _Const(np.array(k, np.int64))]
    _agrees_with_numpy("Trilu", inputs, {"upper": upper}, diff=diff, lowered=("Trilu",))


@FLOATS
@pytest.mark.parametrize("op, shape, attrs", [
    ("DepthToSpace", (2, 8, 3, 2), {"blocksize": 2}), ("DepthToSpace", (2, 8, 3, 2), {"blocksize": 2, "mode": "CRD"}),
    ("SpaceToDepth", (2, 3, 4, 6), {"blocksize": 2}), ("SpaceToDepth", (1, 2, 6, 3), {"blocksize": 3})])
def test_depth_space(dtype, op, shape, attrs):
    _agrees_with_numpy(op, [_x(shape, dtype)], attrs, lowered=(op,))


@pytest.mark.parametrize("k", [0, 1, -2, 7])
@pytest.mark.parametrize("dtype_attr", [None, 1, 7, 9])  # same as input, float, int64, bool
def test_eyelike(k, dtype_attr):
    attrs = {"k": k} if dtype_attr is None else {"k": k, "dtype": dtype_attr}
    _agrees_with_numpy("EyeLike", [_x((4, 6))], attrs, diff=(), lowered=("EyeLike",))


# -- Einsum, AbsoluteError -----------------------------------------------------------------------------
@FLOATS
@pytest.mark.parametrize("equation, shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("ii->i", [(4, 4)]),
    ("...ij,...jk", [(2, 3, 4), (2, 4, 2)]), ("ij,ij,j->i", [(3, 4), (3, 4), (4,)]), ("ij->", [(3, 4)]),
    ("i,j", [(3,), (4,)])])
def test_einsum_and_gradient(dtype, equation, shapes):
    inputs = [_x(s, dtype) for s in shapes]
    _agrees_with_numpy("Einsum", inputs, {"equation": equation}, diff=tuple(range(len(inputs))), lowered=("Einsum",),
                       rtol=1e-4, atol=1e-5)


@FLOATS
def test_absolute_error_and_gradient(dtype):
    x, y = _x((4, 5), dtype), _x((5,), dtype)
    x[0] = y  # sign(0) = 0
    _agrees_with_numpy("AbsoluteError", [x, y], diff=(0, 1), lowered=("AbsoluteError", "AbsoluteErrorGrad"))


# -- reductions --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("op", ["ReduceL1", "ReduceLogSum", "ReduceLogSumExp", "ReduceProd"])
@pytest.mark.parametrize("axes, keepdims, noop", [([1], 1, 0), ([0, 2], 0, 0), ([-1], 0, 0), (None, 1, 0),
                                                  (None, 0, 0), ([], 1, 1)])
def test_reductions(dtype, op, axes, keepdims, noop):
    if dtype == np.int32 and op in ("ReduceLogSum", "ReduceLogSumExp"):
        pytest.skip("floats only")
    x = R.uniform(0.5, 1.5, (3, 4, 2)).astype(dtype) if dtype != np.int32 else R.integers(-3, 4, (3, 4, 2)).astype(dtype)
    if op == "ReduceLogSumExp" and dtype != np.int32:
        x = _x((3, 4, 2), dtype, 5.0)
    inputs = [x] if axes is None else [x, _Const(np.array(axes, np.int64))]
    diff = (0,) if dtype != np.int32 else ()  # ReduceProd's gradient runs CumProd (exclusive, both ways)
    _agrees_with_numpy(op, inputs, {"keepdims": keepdims, "noop_with_empty_axes": noop}, diff=diff, lowered=(op,))


# -- quantization -----------------------------------------------------------------------------------
def _ties(shape, scale, dtype=np.float32):
    """Values at exact .5 ties of x / scale (both signs), large ones that saturate, and noise."""
    x = (R.integers(-300, 300, shape) + 0.5) * scale
    x.flat[::3] = R.standard_normal(x.size)[::3] * 40 * scale
    x.flat[1] = 1000 * scale
    x.flat[2] = -1000 * scale
    return x.astype(dtype)


@pytest.mark.parametrize("zp_dtype", [np.uint8, np.int8, np.int16, None])
@pytest.mark.parametrize("dtype, scale_dtype", [(np.float32, np.float32), (np.float64, np.float32),
                                                (np.float32, np.float64), (np.float16, np.float16)])
def test_quantize_linear_per_tensor(dtype, scale_dtype, zp_dtype):
    x = _ties((3, 5, 4), 0.25, dtype)
    scale = np.array(0.25 if dtype != np.float16 else 0.5, scale_dtype)
    inputs = [x, scale]
    if zp_dtype is not None:
        zp = 128 if zp_dtype == np.uint8 else (-3 if zp_dtype == np.int8 else -700)
        inputs.append(np.array(zp, zp_dtype))
    _agrees_with_numpy("QuantizeLinear", inputs, diff=(), lowered=("QuantizeLinear",))


@pytest.mark.parametrize("axis, block", [(1, 0), (-1, 0), (0, 0), (1, 2), (2, 3)])
def test_quantize_dequantize_per_axis_and_blocked(axis, block):
    x = _ties((4, 6, 5), 0.1)
    shape = list(x.shape)
    if block:
        shape[axis] = -(-shape[axis] // block)
        scale = R.uniform(0.05, 0.3, shape).astype(np.float32)
        zp = R.integers(-20, 20, shape).astype(np.int8)
    else:
        scale = R.uniform(0.05, 0.3, x.shape[axis]).astype(np.float32)
        zp = R.integers(-20, 20, x.shape[axis]).astype(np.int8)
    attrs = {"axis": axis, "block_size": block}
    _agrees_with_numpy("QuantizeLinear", [x, scale, zp], attrs, diff=(), lowered=("QuantizeLinear",))
    q = R.integers(-128, 128, x.shape).astype(np.int8)
    _agrees_with_numpy("DequantizeLinear", [q, scale, zp], attrs, diff=(), lowered=("DequantizeLinear",))


def test_quantize_linear_output_dtype_and_precision():
    x = _ties((4, 7), 0.5)
    _agrees_with_numpy("QuantizeLinear", [x, np.array(0.5, np.float32)], {"output_dtype": 3}, diff=(),
                       lowered=("QuantizeLinear",))  # int8, no zero point
    _agrees_with_numpy("QuantizeLinear", [x, np.array(0.5, np.float32)], diff=(), lowered=("QuantizeLinear",))
    _agrees_with_numpy("QuantizeLinear", [x, np.array(0.3, np.float32), np.array(5, np.uint8)], {"precision": 11},
                       diff=(), lowered=("QuantizeLinear",))


@pytest.mark.parametrize("x_dtype, scale_dtype, zp", [(np.uint8, np.float32, 128), (np.int8, np.float32, -5),
                                                      (np.int8, np.float64, 3), (np.int16, np.float16, -300),
                                                      (np.int32, np.float32, None), (np.uint8, np.float16, None)])
def test_dequantize_linear(x_dtype, scale_dtype, zp):
    info = np.iinfo(x_dtype)
    x = R.integers(max(info.min, -5000), min(info.max, 5000), (3, 4, 5), endpoint=True).astype(x_dtype)
    inputs = [x, np.array(0.037, scale_dtype)] + ([np.array(zp, x_dtype)] if zp is not None else [])
    _agrees_with_numpy("DequantizeLinear", inputs, diff=(), lowered=("DequantizeLinear",))
    _agrees_with_numpy("DequantizeLinear", inputs, {"output_dtype": 11}, diff=(), lowered=("DequantizeLinear",))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", ["mixed", "positive", "negative", "zeros", "ties"])
def test_dynamic_quantize_linear(dtype, case):
    x = {"mixed": _x((3, 8), np.float64, 3.0), "positive": np.abs(_x((3, 8), np.float64)) + 0.1,
         "negative": -np.abs(_x((3, 8), np.float64)) - 0.1, "zeros": np.zeros((3, 8)),
         "ties": (np.arange(24).reshape(3, 8) - 8) * 0.5}[case].astype(dtype)
    _agrees_with_numpy("DynamicQuantizeLinear", [x], diff=(), n_outputs=3, lowered=("DynamicQuantizeLinear",))


def _q(shape, dtype):
    info = np.iinfo(dtype)
    return R.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


@pytest.mark.parametrize("a_dtype, b_dtype", [(np.uint8, np.uint8), (np.int8, np.int8), (np.uint8, np.int8),
                                              (np.int8, np.uint8)])
@pytest.mark.parametrize("zps", ["none", "scalar", "per_row_col"])
def test_matmul_integer(a_dtype, b_dtype, zps):
    a, b = _q((2, 3, 6), a_dtype), _q((6, 5), b_dtype)
    inputs = [a, b]
    if zps == "scalar":
        inputs += [_q((), a_dtype), _q((), b_dtype)]
    elif zps == "per_row_col":
        a = _q((4, 6), a_dtype)  # a zero point per row of a non-square A
        inputs = [a, b, _q((4,), a_dtype), _q((5,), b_dtype)]
    _agrees_with_numpy("MatMulInteger", inputs, diff=(), lowered=("MatMulInteger",))
    if zps == "none":
        _agrees_with_numpy("MatMulInteger", [a, b, None, _q((5,), b_dtype)], diff=(), lowered=("MatMulInteger",))


@pytest.mark.parametrize("dtype, y_dtype", [(np.uint8, np.uint8), (np.int8, np.int8), (np.uint8, np.int8)])
@pytest.mark.parametrize("per_col", [False, True])
def test_qlinear_matmul(dtype, y_dtype, per_col):
    a, b = _q((4, 7), dtype), _q((7, 3), dtype)
    b_scale = R.uniform(0.001, 0.02, 3 if per_col else ()).astype(np.float32)
    b_zp = _q((3,) if per_col else (), dtype)
    inputs = [a, np.array(0.05, np.float32), _q((), dtype), b, b_scale, b_zp, np.array(0.3, np.float32),
              _q((), y_dtype)]
    _agrees_with_numpy("QLinearMatMul", inputs, diff=(), lowered=("QLinearMatMul",))
    # y = 0.5-ties: scales 1 and integer accumulators over 2
    a2, b2 = R.integers(-9, 9, (3, 2)).astype(np.int8), R.integers(-9, 9, (2, 4)).astype(np.int8)
    ties = [a2, np.array(1.0, np.float32), np.array(0, np.int8), b2, np.array(0.5, np.float32), np.array(0, np.int8),
            np.array(1.0, np.float32), np.array(0, np.int8)]
    _agrees_with_numpy("QLinearMatMul", ties, diff=(), lowered=("QLinearMatMul",))


@pytest.mark.parametrize("x_dtype, w_dtype", [(np.uint8, np.uint8), (np.int8, np.int8), (np.uint8, np.int8)])
@pytest.mark.parametrize("attrs", [{}, {"pads": [1, 1, 1, 1], "strides": [2, 1]}, {"pads": [0, 1, 2, 0]},
                                   {"group": 2, "dilations": [2, 1]}, {"auto_pad": "SAME_UPPER"}])
def test_conv_integer_and_qlinear_conv(x_dtype, w_dtype, attrs):
    x, w = _q((2, 4, 6, 5), x_dtype), _q((6, 4 // attrs.get("group", 1), 3, 2), w_dtype)
    _agrees_with_numpy("ConvInteger", [x, w], attrs, diff=(), lowered=("ConvInteger",))
    _agrees_with_numpy("ConvInteger", [x, w, _q((), x_dtype), _q((6,), w_dtype)], attrs, diff=(),
                       lowered=("ConvInteger",))
    for per_channel in (False, True):
        ws = R.uniform(0.001, 0.01, 6 if per_channel else ()).astype(np.float32)
        inputs = [x, np.array(0.04, np.float32), _q((), x_dtype), w, ws, _q((6,) if per_channel else (), w_dtype),
                  np.array(0.5, np.float32), _q((), x_dtype), R.integers(-5000, 5000, 6).astype(np.int32)]
        _agrees_with_numpy("QLinearConv", inputs, attrs, diff=(), lowered=("QLinearConv",))
        _agrees_with_numpy("QLinearConv", inputs[:8], attrs, diff=(), lowered=("QLinearConv",))


def test_conv_integer_1d():
    x, w = _q((1, 2, 9), np.uint8), _q((3, 2, 4), np.uint8)
    _agrees_with_numpy("ConvInteger", [x, w, np.array(7, np.uint8)], {"strides": [2]}, diff=(), lowered=("ConvInteger",))


# -- CumProd, Det --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.int8, np.uint8])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod_and_gradient(dtype, axis, exclusive, reverse):
    if np.dtype(dtype).kind == "f":
        x = R.uniform(0.5, 1.5, (3, 4, 5)).astype(dtype) * np.where(R.random((3, 4, 5)) < 0.3, -1, 1).astype(dtype)
        diff = (0,)
    else:  # integers wrap in their own dtype (numpy's cumprod with dtype=x.dtype)
        lo = 0 if np.dtype(dtype).kind == "u" else -9
        x = R.integers(lo, 9, (3, 4, 5)).astype(dtype)
        diff = ()
    _agrees_with_numpy("CumProd", [x, _Const(np.array(axis, np.int64))], {"exclusive": exclusive, "reverse": reverse},
                       diff=diff, lowered=("CumProd",))


def test_cumprod_int32_overflow_wraps_as_numpy():
    x = np.full((2, 40), 7, np.int32)
    _agrees_with_numpy("CumProd", [x, _Const(np.array(1, np.int32))], diff=(), lowered=("CumProd",))


@FLOATS
@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (2, 1, 1), (5, 2, 2)])
def test_det_and_gradient(dtype, shape):
    x = _x(shape, dtype, 1.0)
    if shape[-1] > 1:
        x[0, ..., 0] = x[0, ..., 1] if len(shape) == 2 else x[0, :, 1]  # a singular matrix: cofactors, not inverse
    _agrees_with_numpy("Det", [x], lowered=("Det", "DetGrad"), rtol=1e-4, atol=1e-5)


# -- GridSample, Col2Im --------------------------------------------------------------------------------
def _grid(shape, dtype):
    g = R.uniform(-1.3, 1.3, shape).astype(dtype)
    g.reshape(-1, shape[-1])[:6] = np.array([[-1, -1, -1], [1, 1, 1], [0, 0, 0], [-1.25, 0.5, 3.1],
                                             [2.7, -3.3, 1.0], [0.2, -0.6, -1.0]])[:, :shape[-1]]
    return g


@FLOATS
@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic", "linear", "cubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_2d_and_gradient(dtype, mode, padding, align):
    x, grid = _x((2, 3, 5, 4), dtype), _grid((2, 6, 7, 2), dtype)
    diff = (0,) if mode in ("bicubic", "cubic") else (0, 1)  # no grid gradient in cubic mode
    _agrees_with_numpy("GridSample", [x, grid], {"mode": mode, "padding_mode": padding, "align_corners": align},
                       diff=diff, lowered=("GridSample", "GridSampleGrad"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_grid_sample_1d_3d_and_nearest_ties(mode, padding):
    x, grid = _x((1, 2, 4, 3, 5), np.float64), _grid((1, 3, 2, 4, 3), np.float64)
    diff = (0,) if mode == "cubic" else (0, 1)
    _agrees_with_numpy("GridSample", [x, grid], {"mode": mode, "padding_mode": padding},
                       diff=diff, lowered=("GridSample", "GridSampleGrad"))
    # pixel coordinates at exact .5 ties (size 4, align_corners=1: x = 1.5 * (g + 1))
    ties = np.array([-1, -2 / 3, 0, 2 / 3, 1, -1 / 3, 1 / 3], np.float64).reshape(1, 7, 1)
    _agrees_with_numpy("GridSample", [_x((1, 2, 4), np.float64), ties],
                       {"mode": mode, "padding_mode": padding, "align_corners": 1}, diff=(0,), lowered=("GridSample",))
    x1 = _x((2, 3, 6), np.float32)
    _agrees_with_numpy("GridSample", [x1, _grid((2, 9, 1), np.float32)], {"mode": mode, "padding_mode": padding},
                       diff=(0,), lowered=("GridSample", "GridSampleGrad"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("image, block, attrs", [
    ((5, 5), (2, 2), {}), ((6, 7), (3, 2), {"strides": [2, 1], "pads": [1, 0, 1, 2]}),
    ((6, 6), (2, 3), {"dilations": [2, 1], "strides": [1, 2]}), ((9,), (3,), {"pads": [1, 2], "strides": [2]}),
    ((4, 3, 4), (2, 2, 2), {"pads": [0, 1, 0, 1, 0, 1]})])
def test_col2im_and_gradient(dtype, image, block, attrs):
    nd = len(image)
    dil, st = attrs.get("dilations", [1] * nd), attrs.get("strides", [1] * nd)
    pads = attrs.get("pads", [0] * 2 * nd)
    counts = [(image[i] + pads[i] + pads[nd + i] - dil[i] * (block[i] - 1) - 1) // st[i] + 1 for i in range(nd)]
    shape = (2, 3 * int(np.prod(block)), int(np.prod(counts)))
    x = _x(shape, dtype) if dtype != np.int32 else R.integers(-50, 50, shape).astype(dtype)
    _agrees_with_numpy("Col2Im", [x, _Const(np.array(image, np.int64)), _Const(np.array(block, np.int64))], attrs,
                       diff=(0,) if dtype != np.int32 else (), lowered=("Col2Im",) + (("Col2ImGrad",) if dtype != np.int32 else ()))


# -- RoiAlign --------------------------------------------------------------------------------------------
@FLOATS
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("ratio, scale", [(2, 1.0), (1, 0.5), (3, 0.25)])
def test_roi_align(dtype, mode, ctm, ratio, scale):
    x = _x((2, 3, 10, 8), dtype)
    rois = np.array([[0, 0, 7, 9], [1.5, 2.2, 6.1, 8.7], [-3, -2, 4, 3], [5, 6, 30, 40], [2, 2, 2.4, 2.2]],
                    dtype) / scale
    batch = np.array([0, 1, 1, 0, 1], np.int64)
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm, "sampling_ratio": ratio, "spatial_scale": scale,
             "output_height": 3, "output_width": 4}
    _agrees_with_numpy("RoiAlign", [x, rois, batch], attrs, diff=(), lowered=("RoiAlign",))


def test_roi_align_adaptive_sampling_falls_back():
    from test_torch_backend import _op_and_grads
    x, rois, batch = _x((1, 2, 6, 6)), np.array([[0, 0, 5, 5]], np.float32), np.array([0], np.int64)
    graph, _ = _op_and_grads("RoiAlign", [x, rois, batch], {"sampling_ratio": 0}, diff=())
    assert TorchBackend("torch:cpu").compile(graph).fallback_ops == ["RoiAlign"]


# -- DeformConv ----------------------------------------------------------------------------------------
@FLOATS
@pytest.mark.parametrize("attrs, group, og, bias, mask", [
    ({}, 1, 1, False, False), ({"pads": [1, 1, 1, 1]}, 1, 2, True, True),
    ({"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 1, 0]}, 2, 1, True, False),
    ({"pads": [2, 1, 0, 1]}, 2, 2, False, True)])
def test_deform_conv(dtype, attrs, group, og, bias, mask):
    n, c, h, w, oc, kh, kw = 2, 4, 7, 6, 6, 3, 2
    st, dil = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1])
    pads = attrs.get("pads", [0, 0, 0, 0])
    oh = (h + pads[0] + pads[2] - dil[0] * (kh - 1) - 1) // st[0] + 1
    ow = (w + pads[1] + pads[3] - dil[1] * (kw - 1) - 1) // st[1] + 1
    x, wt = _x((n, c, h, w), dtype), _x((oc, c // group, kh, kw), dtype)
    offset = _x((n, og * kh * kw * 2, oh, ow), dtype, 1.5)
    offset.flat[:4] = [0.0, 2.0, -7.0, 9.0]  # integer offsets and far outside the image
    inputs = [x, wt, offset, _x((oc,), dtype) if bias else None, R.uniform(0, 1, (n, og * kh * kw, oh, ow)).astype(dtype)
              if mask else None]
    if inputs[-1] is None:
        inputs = inputs[:-1]
        if inputs[-1] is None:
            inputs = inputs[:-1]
    _agrees_with_numpy("DeformConv", inputs, {**attrs, "group": group, "offset_group": og}, diff=(),
                       lowered=("DeformConv",), rtol=1e-5, atol=1e-5)
