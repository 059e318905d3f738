"""Column sums in two kernels (colsum.py): LayerNormGrad's dscale and dbias from one slicing pass
and one finishing pass, and the columns layout of the reductions (a bias gradient summing rows)
as lane-combined slices and one serial pass over them. Against the numpy backend, on one slice
and on several (small thresholds, so small shapes take the multi-slice path), vec4 and scalar entries; the
kernel names say which path ran, and a second run gives the same bits."""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import assert_close, make_graph, op_graph, run_both, wgpu_backend

from anygrad.backends.wgpu.kernels import colsum, kernels_reduce
from anygrad.backends.wgpu.kernels.kernel import Kernel
from anygrad.ir import Node

pytestmark = pytest.mark.wgpu

RNG = np.random.default_rng(31)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def backend():
    return wgpu_backend()


@pytest.fixture(params=[False, True], ids=["one-slice", "sliced"])
def sliced(request, monkeypatch):
    """Several slices on test-sized shapes: lanes of one row each, chunks of a few rows."""
    if request.param:
        monkeypatch.setattr(colsum, "LANE_ROWS", 1)
        monkeypatch.setattr(kernels_reduce, "MIN_CHUNK", 4)
    return request.param


def check(backend, op, inputs, attrs, *, rtol, atol, **kw) -> list[Kernel]:
    """op and its input gradients on numpy and wgpu; a second run gives the same bits. Returns
    the plan's kernels."""
    graph, feeds = op_graph(op, inputs, attrs, **kw)
    want, got, exe = run_both(graph, feeds, backend=backend)
    assert_close(want, got, rtol, atol, what=op)
    again = exe.run(feeds)
    for k, v in got.items():
        np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(v), err_msg=f"{op} {k}: second run differs")
    return [st.kernel for st in exe.plan.steps]


def names(kernels: list[Kernel]) -> list[str]:
    return [k.name for k in kernels]


# -- the geometry ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,entries,width,want", [
    # (tile, lanes, tiles, slices)
    (16384, 256, 4, (16, 16, 4, 64)),     # GPT LayerNorm / bias gradient: 256 workgroups, 64 slices
    (16384, 1024, 4, (16, 16, 16, 16)),   # MLP bias gradient
    (16384, 10, 1, (16, 16, 1, 256)),     # few entries: at most MAX_SLICES slices
    (100, 7, 1, (8, 32, 1, 1)),           # few rows: one slice, stored directly
    (300, 130, 1, (64, 4, 3, 19)),        # a partial last tile
])
def test_geometry(rows, entries, width, want):
    geo = colsum.geometry(rows, entries, width)
    assert (geo.tile, geo.lanes, geo.tiles, geo.slices) == want
    assert geo.tile * geo.lanes == colsum.WG and (geo.slices - 1) * geo.per < rows <= geo.slices * geo.per


# -- LayerNorm's parameter gradients --------------------------------------------------------------------------
LN_SHAPES = [(3, 37, 24), (2, 5, 12), (40, 10), (30, 130), (20, 72)]


@pytest.mark.parametrize("shape", LN_SHAPES, ids=[str(s) for s in LN_SHAPES])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_layer_norm_params(backend, sliced, shape, bias):
    """dx, dscale, dbias (when there is a bias) against numpy: one kernel for every
    parameter gradient, plus one adding the slices; vec4 loads when d % 4 == 0."""
    d = shape[-1]
    x = randn(*shape) * 0.5 + 3
    inputs = [x, randn(d)] + ([randn(d)] if bias else [])
    kernels = check(backend, "LayerNormalization", inputs, {"axis": -1}, rtol=1e-3, atol=1e-4)
    got = [n for n in names(kernels) if n.startswith("LayerNormGrad:") and not n.startswith("LayerNormGrad:row")]
    rows = x.size // d
    geo = colsum.geometry(rows, d, 4 if d % 4 == 0 else 1)
    assert got == ["LayerNormGrad:params:cols"] + (["LayerNormGrad:params:slices"] if geo.slices > 1 else [])
    assert geo.slices > 1 or not sliced or rows <= geo.lanes  # (2, 5, 12): 10 rows, 64 lanes
    first = next(k for k in kernels if k.name == "LayerNormGrad:params:cols")
    assert ("array<vec4<f32>>" in first.wgsl) == (d % 4 == 0)
    assert first.wgsl.count("var<workgroup>") == 2  # dbias too: the gradient node always has it


@pytest.mark.parametrize("outs", [("dx", "ds", ""), ("dx", "", "db"), ("", "ds", "db"), ("", "", "db")])
def test_layer_norm_grad_some_outputs(backend, sliced, outs):
    """LayerNormGrad with only some outputs named: the same kernels, as many sums as gradients;
    dbias alone reads dy only."""
    x, dy, scale = randn(2, 33, 16) + 1, randn(2, 33, 16), randn(16)
    info = {"dy": (np.float32, dy.shape), "x": (np.float32, x.shape), "sc": (np.float32, (16,))}
    info.update({o: (np.float32, x.shape if o == "dx" else (16,)) for o in outs if o})
    node = Node("LayerNormGrad", ["dy", "x", "sc"], list(outs), {"axis": -1, "epsilon": 1e-5}, name="g")
    graph = make_graph([node], ["dy", "x", "sc"], [o for o in outs if o], info)
    feeds = {"dy": dy, "x": x, "sc": scale}
    want, got, exe = run_both(graph, feeds, backend=backend)
    assert_close(want, got, 1e-3, 1e-4, what=str(outs))
    again = exe.run(feeds)
    for k, v in got.items():
        np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(v))
    first = next(st.kernel for st in exe.plan.steps if st.kernel.name == "LayerNormGrad:params:cols")
    assert first.wgsl.count("var<workgroup>") == len([o for o in outs[1:] if o])
    assert len(first.reads) == (1 if outs[1] == "" else 3)


def test_layer_norm_over_two_axes(backend, sliced):
    """axis 1 of (5, 6, 8): rows of 48 entries, a scale per entry."""
    check(backend, "LayerNormalization", [randn(5, 6, 8) + 2, randn(6, 8), randn(6, 8)], {"axis": 1},
          rtol=1e-3, atol=1e-4)


# -- reductions: the columns layout ---------------------------------------------------------------------------
REDUCE_CASES = [
    ("ReduceSum", (4, 50, 16), (0, 1)),    # bias gradient of (B, T, d): vec4
    ("ReduceSum", (3, 70, 10), (0, 1)),    # d not a multiple of 4: scalar
    ("ReduceSum", (600, 12), (0,)),        # bias gradient of (N, d)
    ("ReduceSum", (600, 7), (0,)),
    ("ReduceSum", (2, 90, 3, 8), (1,)),    # reduced axis in the middle: kept axes strided, innermost contiguous
    ("ReduceSum", (90, 8, 3), (0,)),       # kept (8, 3) merged: 24 contiguous outputs
    ("ReduceMean", (300, 8), (0,)),
    ("ReduceMax", (300, 8), (0,)),
    ("ReduceMin", (300, 5), (0,)),
    ("ReduceL2", (200, 6, 4), (0,)),
    ("ReduceProd", (200, 8), (0,)),
    ("ReduceLogSumExp", (300, 8), (0,)),   # aux input (the max): scalar loads
]


def _reduce_input(op, shape):
    x = randn(*shape)
    return (1.0 + 0.01 * x).astype(np.float32) if op == "ReduceProd" else x


@pytest.mark.parametrize("op,shape,axes", REDUCE_CASES, ids=[f"{o}{s}@{a}" for o, s, a in REDUCE_CASES])
def test_reduce_columns(backend, sliced, op, shape, axes):
    x = _reduce_input(op, shape)
    kernels = check(backend, op, [x, np.array(axes, np.int64)], {"keepdims": 0}, grad=False, feed=[0],
                    rtol=3e-4, atol=1e-4)
    own = [n for n in names(kernels) if ":max:" not in n]
    assert own in ([f"{op}:cols"], [f"{op}:cols", f"{op}:partials:serial"])
    if sliced:
        assert own == [f"{op}:cols", f"{op}:partials:serial"]
    first = next(k for k in kernels if k.name == f"{op}:cols")
    kept, _ = kernels_reduce.split_dims(shape, axes)  # merged: (90, 8, 3) keeps 24 contiguous outputs
    vec = op != "ReduceLogSumExp" and kept[-1][1] == 1 and kept[-1][0] % 4 == 0
    assert ("array<vec4<" in first.wgsl) == vec


@pytest.mark.parametrize("op,shape,axes", [
    ("ReduceSum", (5, 3000), (1,)),       # rows
    ("ReduceSum", (2, 20011), (1,)),      # rows split over workgroups, then their partials
    ("ReduceSum", (40, 6, 50), (0, 2)),   # rows over two merged-apart axes
    ("ReduceSum", (6, 5), (1,)),          # short rows
    ("ReduceSum", (20, 7), (0,)),         # a short column reduction: one serial pass
    ("ReduceMax", (1000,), (0,)),
])
def test_other_reductions_take_no_column_kernels(backend, op, shape, axes):
    """Row layouts and short reductions: against numpy, and no columns kernels."""
    x = randn(*shape)
    inputs = [x, np.array(axes, np.int64)]
    on = check(backend, op, inputs, {"keepdims": 0}, grad=False, feed=[0], rtol=3e-4, atol=1e-4)
    assert not any(":cols" in k.name for k in on)


def test_two_kernels_at_the_real_thresholds(backend):
    """A column sum at the real thresholds: the slicing kernel, then one serial pass."""
    x = randn(3000, 12)
    on = names(check(backend, "ReduceSum", [x, np.array([0], np.int64)], {"keepdims": 0}, grad=False, feed=[0],
                     rtol=3e-4, atol=1e-4))
    assert on == ["ReduceSum:cols", "ReduceSum:partials:serial"]


def test_bias_gradient_float64(backend):
    """A bias gradient far from zero (mean 10 per entry) over many rows, against float64 sums."""
    x = (randn(4096, 16) + 10).astype(np.float32)
    graph, feeds = op_graph("ReduceSum", [x, np.array([0], np.int64)], {"keepdims": 0}, grad=False, feed=[0])
    got = backend.compile(graph).run(feeds)["out0"]
    want = x.astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(got, want, rtol=2e-6)


@pytest.mark.parametrize("shape", [(600, 16), (600, 7)])
def test_float16_columns(backend, sliced, shape):
    """float16 values: vec4<f16> loads (halfstore.py) the sums in f32."""
    x = randn(*shape).astype(np.float16)
    kernels = check(backend, "ReduceSum", [x, np.array([0], np.int64)], {"keepdims": 0}, grad=False, feed=[0],
                    rtol=1e-2, atol=1e-2)
    first = next(k for k in kernels if k.name == "ReduceSum:cols")
    assert ("vec4<f16>" in first.wgsl) == (shape[-1] % 4 == 0)


def test_layer_norm_float16(backend, sliced):
    d = 16
    x = (randn(40, d) + 2).astype(np.float16)
    check(backend, "LayerNormalization", [x, randn(d).astype(np.float16), randn(d).astype(np.float16)], {"axis": -1},
          rtol=2e-2, atol=2e-2)


def test_real_thresholds_gpt_width(backend):
    """d = 256 at the real thresholds: 4 tiles x 64 slices of vec4 lanes, then one pass over the
    64 slices, for a bias gradient and LayerNorm's parameter gradients alike."""
    x = randn(4096, 256)
    kernels = check(backend, "ReduceSum", [x, np.array([0], np.int64)], {"keepdims": 0}, grad=False, feed=[0],
                    rtol=1e-4, atol=1e-5)
    assert [(k.name, k.workgroups) for k in kernels] == [("ReduceSum:cols", (256, 1, 1)),
                                                          ("ReduceSum:partials:serial", (1, 1, 1))]
    kernels = check(backend, "LayerNormalization", [randn(2, 2048, 256) + 1, randn(256), randn(256)], {"axis": -1},
                    rtol=1e-3, atol=1e-4)
    params = [(k.name, k.workgroups) for k in kernels if ":params:" in k.name]
    assert params == [("LayerNormGrad:params:cols", (256, 1, 1)), ("LayerNormGrad:params:slices", (2, 1, 1))]
