"""Elementwise kernels four elements per invocation (vec4 loads and stores), against numpy.

A fused chain takes the vec4 path when the output's last axis is a multiple of 4; each input is
then loaded as a vec4 (it keeps the last axis), as one scalar for all four lanes (broadcast along
it), or indexed per lane (an input the op indexes itself). Everything else stays one element per
invocation.
"""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import assert_close, check_wgpu, make_graph, run_both, wgpu_backend

from anygrad.ir import Node
from anygrad.ir.passes import RNG_STATE

pytestmark = pytest.mark.wgpu
F32 = np.float32
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def wb():
    return wgpu_backend()


def _chain(shape: tuple[int, ...], bias_shape: tuple[int, ...], col_shape: tuple[int, ...]):
    """y = where(x > 0, gelu(x * 2 + bias), x - col) and z = sigmoid(y) * mask: a vec4 input, a
    bias along the last axis, a column broadcast along it, a literal, a bool, two outputs."""
    nodes = [Node("Mul", ["x", "two"], ["a"]), Node("Add", ["a", "bias"], ["b"]), Node("Gelu", ["b"], ["c"]),
             Node("Sub", ["x", "col"], ["d"]), Node("Greater", ["x", "zero"], ["p"]),
             Node("Where", ["p", "c", "d"], ["y"]), Node("Sigmoid", ["y"], ["s"]),
             Node("Cast", ["m"], ["mf"], {"to": 1}), Node("Mul", ["s", "mf"], ["z"])]
    inits = {"two": np.array(2.0, F32), "zero": np.array(0.0, F32),
             "bias": RNG.standard_normal(bias_shape).astype(F32), "col": RNG.standard_normal(col_shape).astype(F32)}
    g = make_graph(nodes, ["x", "m"], ["y", "z"], {"x": (F32, shape), "m": (np.bool_, shape)}, inits)
    feeds = {"x": RNG.standard_normal(shape).astype(F32), "m": RNG.random(shape) > 0.3}
    return g, feeds


def _ew_sources(exe) -> list[str]:
    return [st.kernel.wgsl for st in exe.plan.steps if st.kernel.name.startswith("ew:")]


@pytest.mark.parametrize("shape, bias, col, vec", [
    ((6, 8), (8,), (6, 1), True),
    ((2, 3, 12), (12,), (2, 3, 1), True),
    ((5, 4), (1, 4), (), True),
    ((3, 10), (10,), (3, 1), False),     # last axis not a multiple of 4
    ((8, 4), (4,), (8, 4), True),
])
def test_fused_chain_matches_numpy(wb, shape, bias, col, vec):
    g, feeds = _chain(shape, bias, col)
    want, got, exe = run_both(g, feeds, backend=wb)
    assert_close(want, got, rtol=2e-5, atol=2e-6)
    srcs = _ew_sources(exe)
    assert srcs and all(("vec4<f32>" in s) == vec for s in srcs), srcs


def test_a_middle_axis_broadcast_reads_whole_vectors(wb):
    """An input (2, 1, 8) against output (2, 3, 8): each vec4 of the output maps to one vec4 of
    the input at a broadcast vec4 index."""
    g = make_graph([Node("Mul", ["x", "w"], ["y"])], ["x"], ["y"], {"x": (F32, (2, 3, 8))},
                   {"w": RNG.standard_normal((2, 1, 8)).astype(F32)})
    want, got, exe = run_both(g, {"x": RNG.standard_normal((2, 3, 8)).astype(F32)}, backend=wb)
    assert_close(want, got)
    assert "array<vec4<f32>>" in _ew_sources(exe)[0]


def test_dropout_masks_are_the_same_per_element(wb):
    """Dropout draws its mask from the element's flat index: four lanes per invocation must give
    numpy's mask bit for bit."""
    inputs = [RNG.standard_normal((4, 16)).astype(F32), np.array(0.4, F32), np.array(True),
              np.array([11, 5], np.uint32)]
    exe = check_wgpu("Dropout", inputs, {"salt": 3}, const=[1, 2], n_outputs=2, state={3: RNG_STATE},
                     grad=False, rtol=0, atol=0)
    assert any("vec4" in s for s in _ew_sources(exe))


def test_float16_values_round_the_same(wb):
    """A float16 chain loads and stores vec4<f16> and computes in f32 in between: numpy in float32
    rounding only the stored value gives the same bits."""
    shape = (4, 8)
    nodes = [Node("Mul", ["x", "x"], ["a"]), Node("Add", ["a", "b"], ["y"])]
    b = RNG.standard_normal(8).astype(np.float16)
    g = make_graph(nodes, ["x"], ["y"], {"x": (np.float16, shape)}, {"b": b})
    x = RNG.standard_normal(shape).astype(np.float16)
    exe = wb.compile(g)
    got = exe.run({"x": x})["y"]
    assert got.dtype == np.float16 and "vec4<f16>" in _ew_sources(exe)[0]
    xf = x.astype(F32)
    np.testing.assert_array_equal(got, (xf * xf + b.astype(F32)).astype(np.float16))


# -- copies (kernels_shape.affine_copy) -------------------------------------------------------------
def _i64(*v):
    return np.array(v, np.int64)


def _copy_sources(exe, name: str) -> list[str]:
    return [st.kernel.wgsl for st in exe.plan.steps if st.kernel.name == name]


@pytest.mark.parametrize("op, inputs, attrs, vec", [
    ("Slice", [RNG.standard_normal((3, 5, 24)).astype(F32), _i64(8), _i64(16), _i64(2)], None, True),  # q of qkv
    ("Slice", [RNG.standard_normal((3, 5, 24)).astype(F32), _i64(2), _i64(10), _i64(2)], None, False),  # 2 not 4-aligned
    ("Slice", [RNG.standard_normal((6, 8)).astype(F32), _i64(1, 0), _i64(5, 8), _i64(0, 1), _i64(1, 1)], None, True),
    ("Transpose", [RNG.standard_normal((2, 3, 4, 8)).astype(F32)], {"perm": [0, 2, 1, 3]}, True),  # head split
    ("Transpose", [RNG.standard_normal((2, 4, 8)).astype(F32)], {"perm": [0, 2, 1]}, False),
    ("Concat", [RNG.standard_normal((2, 3, 4)).astype(F32), RNG.standard_normal((2, 3, 8)).astype(F32)],
     {"axis": -1}, True),
    ("Concat", [RNG.standard_normal((2, 4)).astype(F32), RNG.standard_normal((3, 4)).astype(F32)], {"axis": 0}, True),
    ("Concat", [RNG.standard_normal((2, 3)).astype(F32), RNG.standard_normal((2, 5)).astype(F32)], {"axis": 1}, False),
])
def test_copies_match_numpy(wb, op, inputs, attrs, vec):
    """Forward copies and their gradients (SliceGrad's zero fill and scatter, the Concat and
    Transpose gradients) against numpy; the forward kernel says which path it took."""
    exe = check_wgpu(op, inputs, attrs, const=[1, 2, 3, 4] if op == "Slice" else [])
    srcs = _copy_sources(exe, op)
    assert srcs and all(("vec4<f32>" in s) == vec for s in srcs), srcs


def test_split_into_aligned_parts(wb):
    exe = check_wgpu("Split", [RNG.standard_normal((3, 16)).astype(F32), _i64(4, 12)], {"axis": 1}, const=[1],
                     n_outputs=2)
    assert all("vec4<f32>" in s for s in _copy_sources(exe, "Split"))


# -- a training BatchNormalization split into statistics and a fusable apply -----------------------
@pytest.mark.parametrize("shape", [(4, 3, 8), (3, 2, 5, 5), (6, 4)])
def test_batchnorm_apply_fuses_with_what_reads_it(wb, shape):
    """Forward (y and the running statistics, updated in place) and the input gradients against
    numpy: the normalisation runs inside the elementwise kernel after it, no apply kernel of its
    own; with ANYGRAD_WGPU_BN_SPLIT=0 the node stays whole, with the same values."""
    c = shape[1]
    ins = [RNG.standard_normal(shape).astype(F32) * 2 + 3, RNG.standard_normal(c).astype(F32),
           RNG.standard_normal(c).astype(F32), RNG.standard_normal(c).astype(F32),
           np.abs(RNG.standard_normal(c)).astype(F32) + 0.5]
    exe = check_wgpu("BatchNormalization", ins, {"training_mode": 1}, n_outputs=3, state={3: "rm", 4: "rv"},
                     rtol=2e-5, atol=2e-5)
    names = [st.kernel.name for st in exe.plan.steps]
    assert any(n.startswith("ew:wgpu.BatchNormApply+") for n in names), names
    assert not any(n.startswith("BatchNorm:apply") for n in names), names


def test_batchnorm_relu_block_keeps_no_bn_output(wb, monkeypatch):
    """BN -> ReLU as in a ResNet: one kernel normalises and rectifies, and the BN output is not
    stored (nothing else reads it: ReLU's gradient reads the ReLU output)."""
    shape = (4, 3, 4, 4)
    nodes = [Node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], {"training_mode": 1}),
             Node("Relu", ["y"], ["z"])]
    inits = {"s": RNG.standard_normal(3).astype(F32), "b": RNG.standard_normal(3).astype(F32),
             "m": np.zeros(3, F32), "v": np.ones(3, F32)}
    g = make_graph(nodes, ["x"], ["z"], {"x": (F32, shape)}, inits)
    feeds = {"x": RNG.standard_normal(shape).astype(F32)}
    want, got, exe = run_both(g, feeds, backend=wb)
    assert_close(want, got, rtol=2e-5, atol=2e-5)
    fused = [st for st in exe.plan.steps if st.kernel.name.startswith("ew:wgpu.BatchNormApply+Relu")]
    assert len(fused) == 1 and fused[0].kernel.writes == ("z",)
    monkeypatch.setenv("ANYGRAD_WGPU_BN_SPLIT", "0")
    _, whole, exe = run_both(g, feeds, backend=wb)
    np.testing.assert_array_equal(whole["z"], got["z"])
    assert any(st.kernel.name == "BatchNorm:apply" for st in exe.plan.steps)
