"""wgpu lowerings added for ONNX coverage against the numpy backend: forward outputs and the
gradients of sum(out * R), on small shapes with odd sizes. Modules: kernels_norm (LayerNorm,
GroupNorm/InstanceNorm and their grads), kernels_index (gathers/scatters, TopK, CountTopK,
OneHot, CumSum/CumProd, Trilu, DepthToSpace, Mod/IsNaN/IsInf), kernels_resize, kernels_einsum,
kernels_pool_nd / kernels_conv_nd (3-D), kernels_image (GridSample, Col2Im, RoiAlign),
kernels_math (trig, Hardmax, EyeLike, ReverseSequence, Det, bitwise), kernels_preview_training,
kernels_quant. Ops registered by modules still in progress are skipped when absent."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wgpu_util import check_wgpu, wgpu_backend

pytestmark = pytest.mark.wgpu

RNG = np.random.default_rng(7)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module", autouse=True)
def _backend():
    wgpu_backend()  # skips the module when there is no adapter


# -- normalisations ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axis,scale_shape", [
    ((3, 5), -1, (5,)),            # short rows: one invocation per row
    ((2, 3, 7), 1, (3, 7)),
    ((2, 3, 7), -1, (1,)),         # broadcast scale
    ((3, 130), -1, (130,)),        # long rows: a workgroup per row
    ((2, 2, 300), 1, (2, 300)),
])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(shape, axis, scale_shape, bias):
    x = randn(*shape) * 2 + 0.5
    ins = [x, randn(*scale_shape)] + ([randn(*scale_shape)] if bias else [])
    check_wgpu("LayerNormalization", ins, {"axis": axis, "epsilon": 1e-5}, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("shape,axis,scale_shape", [
    ((3, 5), -1, (5,)),            # short rows: one invocation per row
    ((2, 3, 7), 1, (3, 7)),
    ((2, 3, 7), -1, (1,)),         # broadcast scale
    ((3, 130), -1, (130,)),        # long rows: a workgroup per row
    ((9000, 16), -1, (16,)),       # many rows: several a workgroup, dscale over sliced columns
])
def test_rms_norm(shape, axis, scale_shape):
    """RMSNormalization and RMSNormGrad (LayerNorm's kernels with a mean of zero) against numpy."""
    x = randn(*shape) * 2 + 0.5
    check_wgpu("RMSNormalization", [x, randn(*scale_shape)], {"axis": axis, "epsilon": 1e-5}, rtol=5e-4, atol=5e-5)


@pytest.mark.parametrize("shape,axis,sign", [((2, 3, 4, 16), -1, 1), ((2, 3, 4, 6), -1, -1), ((2, 6, 5), 1, 1)])
def test_rotate_half(shape, axis, sign):
    """RotateHalf: vec4 halves (head dim 16), scalar halves of 3, a middle axis."""
    check_wgpu("RotateHalf", [randn(*shape)], {"axis": axis, "sign": sign})


def test_layer_norm_stat_outputs():
    x = randn(4, 6)
    check_wgpu("LayerNormalization", [x, randn(6), randn(6)], {"axis": -1}, n_outputs=3, rtol=2e-4, atol=2e-5)


@settings(max_examples=6, deadline=None)
@given(st.integers(1, 3), st.sampled_from([(4, 2), (6, 3), (6, 6), (5, 1)]), st.integers(1, 9),
       st.booleans())
def test_group_norm(n, cg, spatial, per_group):
    c, groups = cg
    x = randn(n, c, spatial) * 1.5 + 0.3
    entries = groups if per_group else c
    check_wgpu("GroupNormalization", [x, randn(entries), randn(entries)],
               {"num_groups": groups, "epsilon": 1e-5}, rtol=3e-4, atol=3e-5)


@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 4, 3, 3), (2, 2, 150)])
def test_instance_norm(shape):
    c = shape[1]
    check_wgpu("InstanceNormalization", [randn(*shape), randn(c), randn(c)], {"epsilon": 1e-5},
               rtol=3e-4, atol=3e-5)


# -- gathers and scatters ------------------------------------------------------------------------
def _idx(shape, n, neg=True):
    i = RNG.integers(0, n, size=shape)
    if neg:
        i = np.where(RNG.random(shape) < 0.3, i - n, i)
    return i.astype(np.int64)


@pytest.mark.parametrize("dshape,ishape,axis", [((4, 5), (3, 5), 0), ((3, 6), (3, 4), 1), ((2, 3, 5), (2, 2, 7), 2),
                                                ((5,), (9,), 0)])
def test_gather_elements(dshape, ishape, axis):
    check_wgpu("GatherElements", [randn(*dshape), _idx(ishape, dshape[axis])], {"axis": axis})


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements(reduction):
    data = randn(4, 5)
    idx = np.array([[1, 0, 3, -1, 2], [1, 2, 0, 3, 3]], np.int64)  # repeats along the axis
    grad = reduction in ("none", "add")
    check_wgpu("ScatterElements", [data, idx, randn(2, 5)], {"axis": 0, "reduction": reduction}, grad=grad)
    check_wgpu("ScatterElements", [randn(3, 7), _idx((3, 4), 7, neg=False), randn(3, 4)],
               {"axis": 1, "reduction": reduction}, grad=grad)


@pytest.mark.parametrize("dshape,ishape,b", [((4, 5), (3, 1), 0), ((4, 5, 3), (2, 2), 0), ((3, 4, 5), (3, 2, 1), 1),
                                             ((2, 3, 4), (2, 3), 0)])
def test_gather_nd(dshape, ishape, b):
    k = ishape[-1]
    idx = np.stack([RNG.integers(0, dshape[b + t], size=ishape[:-1]) for t in range(k)], -1).astype(np.int64)
    check_wgpu("GatherND", [randn(*dshape), idx], {"batch_dims": b})


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_nd(reduction):
    idx = np.array([[1], [3], [1], [-1]], np.int64)
    grad = reduction in ("none", "add", "mul")
    check_wgpu("ScatterND", [randn(5, 3), idx, randn(4, 3)], {"reduction": reduction}, grad=grad)
    idx2 = np.array([[0, 1], [2, 2], [0, 1]], np.int64)
    check_wgpu("ScatterND", [randn(3, 4, 2), idx2, randn(3, 2)], {"reduction": reduction}, grad=grad)


# -- TopK, CountTopK, OneHot, CumSum, Trilu -----------------------------------------------------------
@pytest.mark.parametrize("shape,axis,k", [((3, 7), -1, 3), ((4, 5, 2), 1, 5), ((9,), 0, 1)])
@pytest.mark.parametrize("largest", [1, 0])
def test_topk(shape, axis, k, largest):
    x = np.round(randn(*shape) * 2) / 2  # ties: the lower index comes first
    check_wgpu("TopK", [x, np.array([k], np.int64)], {"axis": axis, "largest": largest}, n_outputs=2)


def test_topk_int():
    x = RNG.integers(-5, 5, size=(3, 8)).astype(np.int32)
    check_wgpu("TopK", [x, np.array([4], np.int64)], {"axis": 1}, n_outputs=2, feed=[0], grad=False)


@pytest.mark.parametrize("shape,k", [((7, 10), 5), ((3, 4, 5), 2), ((300, 3), 1)])
def test_count_top_k(shape, k):
    out = np.round(randn(*shape))  # ties with the target count as hits when few enough are higher
    target = RNG.integers(-1, shape[1] + 1, size=(shape[0],) + shape[2:]).astype(np.int64)
    check_wgpu("CountTopK", [out, target], {"k": k}, feed=[0, 1], grad=False)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot(axis):
    idx = np.array([[0, 3, -1], [2, 5, -5]], np.int64)
    check_wgpu("OneHot", [idx, np.array([4], np.int64), np.array([-1.5, 2.0], np.float32)], {"axis": axis},
               feed=[0])
    check_wgpu("OneHot", [idx.astype(np.float32) + 0.3, np.array(5, np.int64), np.array([0, 1], np.int64)],
               {"axis": axis}, feed=[0], grad=False)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("shape,axis", [((3, 5), 1), ((4, 3, 2), 0), ((7,), -1)])
def test_cumsum(shape, axis, exclusive, reverse):
    check_wgpu("CumSum", [randn(*shape), np.array(axis, np.int64)], {"exclusive": exclusive, "reverse": reverse})


def test_cumsum_int():
    check_wgpu("CumSum", [np.arange(10, dtype=np.int32).reshape(2, 5), np.array(1, np.int32)], feed=[0], grad=False)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 2, -1, -7])
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 6, 3)])
def test_trilu(shape, k, upper):
    ins = [randn(*shape)] + ([] if k is None else [np.array(k, np.int64)])
    check_wgpu("Trilu", ins, {"upper": upper})


# -- rearrangements and elementwise predicates ----------------------------------------------------
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_space(mode):
    check_wgpu("DepthToSpace", [randn(2, 8, 3, 2)], {"blocksize": 2, "mode": mode})
    check_wgpu("SpaceToDepth", [randn(2, 3, 4, 6)], {"blocksize": 2})


def test_mod_isnan_isinf():
    a = np.array([5.5, -5.5, 3.0, -7.0, 0.5, 9.0], np.float32)
    b = np.array([2.0, 2.0, -2.0, -3.0, 4.0, 3.0], np.float32)
    for fmod in (0, 1):
        check_wgpu("Mod", [a, b], {"fmod": fmod}, feed=[0, 1], grad=False)
    ia, ib = np.array([5, -5, 7, -7, 0, 9], np.int32), np.array([3, 3, -2, -2, 4, 3], np.int32)
    for fmod in (0, 1):
        check_wgpu("Mod", [ia, ib], {"fmod": fmod}, feed=[0, 1], grad=False)
    check_wgpu("Mod", [randn(3, 4) * 5, np.abs(randn(4)) + 1], {"fmod": 0}, rtol=1e-4, atol=1e-5)
    x = np.array([1.0, np.nan, np.inf, -np.inf, 0.0, -2.0], np.float32)
    check_wgpu("IsNaN", [x], feed=[0], grad=False)
    for pos, neg in [(1, 1), (1, 0), (0, 1)]:
        check_wgpu("IsInf", [x], {"detect_positive": pos, "detect_negative": neg}, feed=[0], grad=False)


# -- Resize ------------------------------------------------------------------------------------------
RESIZE_CASES = [
    ({"mode": "nearest"}, [1, 1, 2, 3]),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 0.6, 1.7]),
    ({"mode": "linear"}, [1, 1, 2, 2]),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1, 1, 1.5, 0.5]),
    ({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, [1, 1, 0.5, 2.5]),
    ({"mode": "cubic"}, [1, 1, 2, 1]),
    ({"mode": "linear", "antialias": 1}, [1, 1, 0.5, 0.75]),
]


@pytest.mark.parametrize("attrs,scales", RESIZE_CASES)
def test_resize(attrs, scales):
    x = randn(2, 3, 5, 4)
    check_wgpu("Resize", [x, None, np.array(scales, np.float32)], attrs, const=[2], rtol=2e-4, atol=2e-5)


def test_resize_sizes_and_upsample():
    x = randn(1, 2, 3, 5)
    check_wgpu("Resize", [x, None, None, np.array([1, 2, 7, 4], np.int64)], {"mode": "linear"}, rtol=2e-4, atol=2e-5)
    check_wgpu("Upsample", [x, np.array([1, 1, 2, 2], np.float32)], {"mode": "nearest"}, const=[1])


# -- Einsum ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eq,shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("bij,bjk->bik", [(2, 3, 4), (1, 4, 2)]),       # batch broadcast
    ("ii->i", [(4, 4)]),                             # diagonal
    ("ij->", [(3, 5)]),
    ("i,i", [(6,), (6,)]),
    ("...ij,...jk", [(2, 3, 4), (2, 4, 3)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
])
def test_einsum(eq, shapes):
    check_wgpu("Einsum", [randn(*s) for s in shapes], {"equation": eq}, rtol=2e-4, atol=2e-5)


# -- 3-D pools -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2, 2]},
    {"kernel_shape": [3, 2, 3], "strides": [2, 1, 2], "pads": [1, 0, 1, 1, 0, 1]},
    {"kernel_shape": [2, 3, 2], "strides": [2, 2, 1], "ceil_mode": 1},
    {"kernel_shape": [2, 2, 2], "dilations": [2, 1, 1]},
    {"kernel_shape": [3, 3, 3], "pads": [1, 1, 1, 1, 1, 1], "count_include_pad": 1},
])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool_3d(op, attrs):
    if op == "MaxPool" and "count_include_pad" in attrs:
        attrs = {k: v for k, v in attrs.items() if k != "count_include_pad"}
    if op == "AveragePool" and "dilations" in attrs:
        pytest.skip("AveragePool has dilations only from opset 19")
    check_wgpu(op, [randn(2, 3, 5, 4, 6)], attrs)


# -- trigonometric, Hardmax, CumProd, EyeLike, ReverseSequence ---------------------------------------
@pytest.mark.parametrize("op", ["Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh"])
def test_trig(op):
    from anygrad.ir.registry import get_op
    if get_op(op) is None:
        pytest.skip(f"{op} is not registered")
    x = RNG.uniform(-0.9, 0.9, size=(3, 7)).astype(np.float32)
    if op == "Acosh":
        x = np.abs(x) * 3 + 1.1
    check_wgpu(op, [x], rtol=3e-4, atol=3e-6)


def test_hardmax_eyelike_reverse_sequence():
    from anygrad.ir.registry import get_op
    if get_op("Hardmax") is None:
        pytest.skip("math_extra ops are not registered")
    x = np.round(randn(3, 4, 5))  # ties: the first maximum wins
    for axis in (-1, 1, 0):
        check_wgpu("Hardmax", [x], {"axis": axis}, feed=[0], grad=False)
    for k in (0, 2, -1):
        check_wgpu("EyeLike", [randn(4, 6)], {"k": k}, feed=[0], grad=False)
    check_wgpu("ReverseSequence", [randn(5, 3, 2), np.array([5, 1, 3], np.int64)], {"batch_axis": 1, "time_axis": 0})
    check_wgpu("ReverseSequence", [randn(3, 4), np.array([2, 4, 0], np.int64)], {"batch_axis": 0, "time_axis": 1})


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod(exclusive, reverse):
    from anygrad.ir.registry import get_op
    if get_op("CumProd") is None:
        pytest.skip("CumProd is not registered")
    x = (RNG.uniform(0.5, 1.5, size=(3, 5)) * RNG.choice([-1, 1], size=(3, 5))).astype(np.float32)
    check_wgpu("CumProd", [x, np.array(1, np.int64)], {"exclusive": exclusive, "reverse": reverse}, rtol=2e-4)


# -- Col2Im -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attrs,image,block", [
    ({}, [4, 5], [2, 2]),
    ({"strides": [2, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2]}, [5, 6], [3, 2]),
    ({"strides": [2]}, [7], [3]),
])
def test_col2im(attrs, image, block):
    from anygrad.ir.registry import get_op
    if get_op("Col2Im") is None:
        pytest.skip("Col2Im is not registered")
    nd = len(image)
    st, dl = attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd)
    pads = attrs.get("pads", [0] * (2 * nd))
    counts = [(image[i] + pads[i] + pads[nd + i] - dl[i] * (block[i] - 1) - 1) // st[i] + 1 for i in range(nd)]
    x = randn(2, 3 * int(np.prod(block)), int(np.prod(counts)))
    check_wgpu("Col2Im", [x, np.array(image, np.int64), np.array(block, np.int64)], attrs)


# -- GridSample -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample(mode, padding, align):
    from anygrad.ir.registry import get_op
    if get_op("GridSample") is None:
        pytest.skip("GridSample is not registered")
    x = randn(2, 3, 4, 5)
    grid = RNG.uniform(-1.3, 1.3, size=(2, 3, 2, 2)).astype(np.float32)  # some points outside
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    check_wgpu("GridSample", [x, grid], attrs, const=[1] if mode != "linear" else (), rtol=3e-4, atol=3e-5)


def test_grid_sample_3d():
    from anygrad.ir.registry import get_op
    if get_op("GridSample") is None:
        pytest.skip("GridSample is not registered")
    grid = RNG.uniform(-1.1, 1.1, size=(1, 2, 3, 2, 3)).astype(np.float32)
    check_wgpu("GridSample", [randn(1, 2, 3, 4, 3), grid], {"mode": "linear"}, rtol=3e-4, atol=3e-5)


# -- bitwise --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int8, np.uint16])
def test_bitwise(dtype):
    from anygrad.ir.registry import get_op
    if get_op("BitShift") is None:
        pytest.skip("bitwise ops are not registered")
    info = np.iinfo(dtype)
    a = RNG.integers(info.min, info.max, size=(3, 4), endpoint=True).astype(dtype)
    b = RNG.integers(info.min, info.max, size=(4,), endpoint=True).astype(dtype)
    for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
        check_wgpu(op, [a, b], feed=[0, 1], grad=False)
    check_wgpu("BitwiseNot", [a], feed=[0], grad=False)
    if info.min == 0:
        shift = RNG.integers(0, 8 * np.dtype(dtype).itemsize, size=(4,)).astype(dtype)
        for d in ("LEFT", "RIGHT"):
            check_wgpu("BitShift", [a, shift], {"direction": d}, feed=[0, 1], grad=False)


def test_det():
    from anygrad.ir.registry import get_op
    if get_op("Det") is None:
        pytest.skip("Det is not registered")
    check_wgpu("Det", [randn(3, 4, 4)], rtol=2e-4, atol=2e-5)  # DetGrad too, where registered
    check_wgpu("Det", [randn(5, 5)], rtol=2e-4, atol=2e-5)
    check_wgpu("Det", [randn(2, 1, 1)], rtol=2e-4, atol=2e-5)
    check_wgpu("Det", [np.array([[1, 2], [2, 4]], np.float32)], feed=[0], grad=False)


def test_constant_of_shape_too_large_to_fold():
    from wgpu_util import assert_close, run_both

    from anygrad.ir import Graph, Node, TensorInfo, specialize
    g = Graph(name="cos", inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype(np.float32), (3,))
    g.initializers["s"] = np.array([1100, 1000], np.int64)  # past the constant-folding limit
    g.nodes = [Node("ConstantOfShape", ["s"], ["c"], {"value": np.array([2.5], np.float32)}),
               Node("ReduceMean", ["c"], ["r"], {"keepdims": 0}), Node("Add", ["x", "r"], ["y"])]
    s = specialize(g, {})
    assert s.nodes[0].op == "ConstantOfShape"
    want, got, _ = run_both(s, {"x": randn(3)})
    assert_close(want, got)


# -- ONNX preview training ops ---------------------------------------------------------------------------
@pytest.mark.parametrize("op,attrs,states", [
    ("Adagrad", {"decay_factor": 0.1, "epsilon": 1e-6, "norm_coefficient": 0.01}, 1),
    ("Momentum", {"alpha": 0.9, "beta": 0.5, "norm_coefficient": 0.01, "mode": "standard"}, 1),
    ("Momentum", {"alpha": 0.9, "beta": 0.5, "norm_coefficient": 0.0, "mode": "nesterov"}, 1),
    ("Adam", {"alpha": 0.9, "beta": 0.99, "epsilon": 1e-6, "norm_coefficient": 0.01, "norm_coefficient_post": 0.1}, 2),
])
@pytest.mark.parametrize("step", [0, 3])
def test_preview_training(op, attrs, states, step):
    from anygrad.ir.registry import get_op
    name = f"ai.onnx.preview.training.{op}"
    if get_op(name) is None:
        pytest.skip(f"{name} is not registered")
    shapes = [(3, 4), (5,)]
    xs, gs = [randn(*s) for s in shapes], [randn(*s) for s in shapes]
    st_ = [[np.abs(randn(*s)) for s in shapes] for _ in range(states)]
    ins = [np.array(0.1, np.float32), np.array(step, np.int64)] + xs + gs + [a for kind in st_ for a in kind]
    check_wgpu(name, ins, attrs, n_outputs=len(shapes) * (1 + states), feed=list(range(len(ins))), grad=False)


@pytest.mark.parametrize("attrs", [{"output_height": 3, "output_width": 2, "sampling_ratio": 2},
                                   {"output_height": 2, "output_width": 3, "spatial_scale": 0.5, "mode": "max"},
                                   {"output_height": 2, "output_width": 2,
                                    "coordinate_transformation_mode": "output_half_pixel"}])
def test_roi_align(attrs):
    from anygrad.ir.registry import get_op
    if get_op("RoiAlign") is None:
        pytest.skip("RoiAlign is not registered")
    # no sample point exactly on the image border: whether 6.0 counts as inside then hangs on the
    # last ulp of a division, which WGSL lets GPUs round differently (NVIDIA does)
    rois = np.array([[0.5, 1.0, 4.0, 5.5], [2.0, 0.0, 6.5, 3.0], [-1.0, -1.0, 8.0, 8.8]], np.float32)
    check_wgpu("RoiAlign", [randn(2, 3, 6, 7), rois, np.array([1, 0, 1], np.int64)], attrs,
               feed=[0, 1, 2], grad=False, rtol=2e-4, atol=2e-5)


# -- 3-D convolutions --------------------------------------------------------------------------------------
@pytest.mark.parametrize("attrs,cin,cout", [
    ({"kernel_shape": [2, 3, 2]}, 3, 4),
    ({"kernel_shape": [3, 3, 3], "strides": [2, 1, 2], "pads": [1, 1, 0, 1, 0, 1], "dilations": [1, 2, 1]}, 2, 3),
    ({"kernel_shape": [1, 2, 2], "group": 2}, 4, 6),
])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_3d(attrs, cin, cout, bias):
    g = attrs.get("group", 1)
    ins = [randn(2, cin, 4, 5, 6), randn(cout, cin // g, *attrs["kernel_shape"])] + ([randn(cout)] if bias else [])
    check_wgpu("Conv", ins, attrs, rtol=2e-4, atol=2e-5)


def test_conv_transpose_3d():
    from anygrad.ir.registry import get_op
    if get_op("ConvTranspose") is None:
        pytest.skip("ConvTranspose is not registered")
    check_wgpu("ConvTranspose", [randn(1, 2, 3, 4, 3), randn(2, 3, 2, 2, 3)], {"strides": [2, 1, 2]},
               rtol=2e-4, atol=2e-5)


# -- larger shapes: the other kernel variants (many rows, long rows, folded grids) ---------------------
@pytest.mark.parametrize("shape", [(9000, 16), (3, 2500)])
def test_layer_norm_large(shape):
    check_wgpu("LayerNormalization", [randn(*shape), randn(shape[-1]), randn(shape[-1])], {"axis": -1},
               rtol=5e-4, atol=5e-5)


def test_group_norm_large_and_gather_elements_large():
    check_wgpu("GroupNormalization", [randn(2, 4, 700), randn(4), randn(4)], {"num_groups": 2}, rtol=5e-4, atol=5e-5)
    data = randn(300, 300)  # 90000 outputs, each scanning 300 indices
    check_wgpu("GatherElements", [data, _idx((300, 300), 300)], {"axis": 1})


# -- quantization (inference ops) ------------------------------------------------------------------------
def test_quantize_dequantize():
    from anygrad.ir.registry import get_op
    if get_op("QuantizeLinear") is None:
        pytest.skip("quantization ops are not registered")
    x = randn(2, 3, 4) * 3
    check_wgpu("QuantizeLinear", [x, np.array(0.05, np.float32), np.array(10, np.uint8)], feed=[0], grad=False)
    check_wgpu("QuantizeLinear", [x, np.array([0.1, 0.2, 0.05], np.float32), np.array([0, -3, 5], np.int8)],
               {"axis": 1}, feed=[0], grad=False)
    check_wgpu("QuantizeLinear", [x, np.abs(randn(2, 3, 2)) + 0.05], {"axis": 2, "block_size": 2}, feed=[0],
               grad=False)
    q = RNG.integers(-128, 127, size=(2, 3, 4)).astype(np.int8)
    check_wgpu("DequantizeLinear", [q, np.array([0.1, 0.2, 0.05], np.float32), np.array([1, -2, 0], np.int8)],
               {"axis": 1}, feed=[0], grad=False)
    check_wgpu("DynamicQuantizeLinear", [x], n_outputs=3, feed=[0], grad=False)


def test_integer_matmul_conv():
    from anygrad.ir.registry import get_op
    if get_op("MatMulInteger") is None:
        pytest.skip("quantization ops are not registered")
    a = RNG.integers(0, 255, size=(2, 3, 5)).astype(np.uint8)
    b = RNG.integers(-128, 127, size=(5, 4)).astype(np.int8)
    check_wgpu("MatMulInteger", [a, b, np.array(7, np.uint8), np.array([1, 0, -2, 3], np.int8)], feed=[0, 1],
               grad=False)
    ins = [a, np.array(0.02, np.float32), np.array(3, np.uint8), b, np.array(0.01, np.float32), np.array(0, np.int8),
           np.array(0.05, np.float32), np.array(128, np.uint8)]
    # requantisation rounds a float32 product: numpy and the GPU may order the scale multiplies
    # differently, so an exact .5 tie can round one step apart (seen once in CI: 68 vs 69)
    check_wgpu("QLinearMatMul", ins, feed=[0, 3], grad=False, atol=1)
    x = RNG.integers(0, 255, size=(1, 2, 5, 5)).astype(np.uint8)
    w = RNG.integers(-128, 127, size=(3, 2, 3, 3)).astype(np.int8)
    check_wgpu("ConvInteger", [x, w, np.array(5, np.uint8)], {"pads": [1, 1, 1, 1]}, feed=[0, 1], grad=False)
    ins = [x, np.array(0.02, np.float32), np.array(3, np.uint8), w, np.array([0.01, 0.02, 0.03], np.float32),
           np.array([0, 0, 0], np.int8), np.array(0.5, np.float32), np.array(10, np.uint8),
           np.array([5, -5, 100], np.int32)]
    check_wgpu("QLinearConv", ins, {"strides": [2, 2]}, feed=[0, 3], grad=False, atol=1)


def test_binarizer():
    from anygrad.ir.registry import get_op
    if get_op("ai.onnx.ml.Binarizer") is None:
        pytest.skip("Binarizer is not registered")
    check_wgpu("ai.onnx.ml.Binarizer", [randn(3, 5)], {"threshold": 0.2}, feed=[0], grad=False)


@pytest.mark.parametrize("attrs,og,use_mask", [({}, 1, False), ({"strides": [2, 1], "pads": [1, 0, 1, 1]}, 2, True),
                                               ({"group": 2, "dilations": [1, 2]}, 1, True)])
def test_deform_conv(attrs, og, use_mask):
    from anygrad.ir.graph import Node
    from anygrad.ir.registry import get_op
    from anygrad.ops.nn import window
    if get_op("DeformConv") is None:
        pytest.skip("DeformConv is not registered")
    groups = attrs.get("group", 1)
    x, w = randn(2, 4, 5, 6), randn(3 if groups == 1 else 4, 4 // groups, 2, 2)
    attrs = {**attrs, "offset_group": og}
    oh, ow = window(Node("Conv", ["x", "w"], ["y"], attrs), x.shape[2:], w.shape[2:]).out
    offset = randn(2, og * 2 * 2 * 2, oh, ow) * 1.5  # samples land between pixels and outside
    ins = [x, w, offset, randn(w.shape[0])] + ([np.abs(randn(2, og * 4, oh, ow))] if use_mask else [])
    check_wgpu("DeformConv", ins, attrs, feed=list(range(len(ins))), grad=False, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
def test_tfidf(mode):
    from anygrad.ir.registry import get_op
    if get_op("TfIdfVectorizer") is None:
        pytest.skip("TfIdfVectorizer is not registered")
    x = np.array([[1, 1, 3, 3, 3, 7, 2], [8, 6, 7, 5, 6, 8, 6]], np.int32)
    attrs = {"mode": mode, "min_gram_length": 1, "max_gram_length": 2, "max_skip_count": 2,
             "ngram_counts": [0, 4], "ngram_indexes": [0, 1, 2, 3, 4, 5, 6],
             "pool_int64s": [2, 3, 5, 4, 5, 6, 7, 8, 6, 7], "weights": [1.0, 0.5, 2.0, 1.5, 1.0, 3.0, 0.25]}
    check_wgpu("TfIdfVectorizer", [x], attrs, feed=[0], grad=False)


@pytest.mark.parametrize("agg", [0, 1, 2, 3])
def test_tree_ensemble_and_optional(agg):
    from anygrad.ir.registry import get_op
    if get_op("ai.onnx.ml.TreeEnsemble") is None:
        pytest.skip("TreeEnsemble is not registered")
    # tree 0: x0 <= 0.5 ? leaf 0 : (x1 in {1, 3} ? leaf 1 : leaf 2); tree 1: x1 > 2 ? leaf 3 : leaf 4
    attrs = {"nodes_splits": np.array([0.5, np.nan, 2.0], np.float32), "nodes_featureids": [0, 1, 1],
             "nodes_modes": np.array([0, 6, 3], np.uint8), "nodes_truenodeids": [0, 1, 3],
             "nodes_falsenodeids": [1, 2, 4], "nodes_trueleafs": [1, 1, 1], "nodes_falseleafs": [0, 1, 1],
             "leaf_targetids": [0, 1, 0, 1, 0], "leaf_weights": np.array([1.0, 2.0, 3.0, 5.0, -1.0], np.float32),
             "tree_roots": [0, 2], "membership_values": np.array([1.0, 3.0, np.nan], np.float32),
             "n_targets": 2, "aggregate_function": agg}
    x = np.array([[0.0, 1.0], [1.0, 3.0], [1.0, 4.0], [2.0, np.nan], [0.2, 2.5]], np.float32)
    check_wgpu("ai.onnx.ml.TreeEnsemble", [x], attrs, feed=[0], grad=False)
    if get_op("OptionalGetElement") is not None:
        check_wgpu("OptionalGetElement", [randn(3, 2)])
