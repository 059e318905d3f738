"""Many short rows, several to a workgroup (rowsplit.py's grouped rows): Softmax / LogSoftmax and
their gradients, LayerNorm and its gradient, GroupNorm, against the numpy backend. Row lengths around
every edge of the walk (a lane's whole steps of LANE_LOADS loads, the guarded last step, rows
shorter than one step), row counts that leave spare rows in the last workgroup, the axis last
or in the middle; the kernel names say which path ran, and a second run gives the same bits."""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import assert_close, op_graph, run_both, wgpu_backend

from anygrad.backends.wgpu.kernels import rowsplit
from anygrad.backends.wgpu.kernels.rowsplit import Rows, Stats

pytestmark = pytest.mark.wgpu

RNG = np.random.default_rng(23)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def backend():
    return wgpu_backend()


@pytest.fixture(params=["grouped", "narrow"])
def path(request, monkeypatch):
    """Several rows a workgroup, with lanes sized by the rules ('grouped') or as for many rows
    ('narrow': a lane takes several whole steps, as on a GPU-sized batch; the test shapes are few
    rows, which widen the lanes)."""
    if request.param == "narrow":
        monkeypatch.setattr(rowsplit, "TARGET_INVOCATIONS", 0)
    return request.param


def kind(path: str, rows: int, length: int) -> str:
    """The kernel-name suffix of a whole-row kernel on `path` (the environment the fixture set)."""
    way = rowsplit.row_path(length)
    if way != "lanes":
        return "row"
    lanes = rowsplit.row_lanes(rows, length)
    return f"rows{rowsplit.GROUP_WG // lanes}x{lanes}"


def check(backend, op, inputs, attrs, kernels, *, rtol, atol, **kw):
    """op and its input gradients on numpy and wgpu; each of `kernels` is a kernel's exact name;
    a second run gives the same bits."""
    graph, feeds = op_graph(op, inputs, attrs, **kw)
    want, got, exe = run_both(graph, feeds, backend=backend)
    assert_close(want, got, rtol, atol, what=op)
    names = [st.kernel.name for st in exe.plan.steps]
    for name in kernels:
        assert name in names, f"{op}: no {name} kernel in {names}"
    again = exe.run(feeds)
    for k, v in got.items():
        np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(v), err_msg=f"{op} {k}: second run differs")
    return exe


# -- the geometry ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,length,lanes", [
    (65536, 128, 32),   # attention probabilities: 8 rows a workgroup, one step of 4 loads a lane
    (16384, 256, 32),   # LayerNorm rows: two steps a lane
    (2048, 768, 32),    # GPT-2 small's LayerNorm: enough rows for the GPU, six steps
    (65536, 65, 32),    # just past the serial rows: one guarded step
    (100000, 4096, 128),  # long rows: at most LANE_STEPS steps a lane
    (256, 4096, 256),   # few long rows: a workgroup a row
    (6, 300, 128),      # few rows: wider rows, but no lane left without a whole step
])
def test_row_lanes(rows, length, lanes):
    got = rowsplit.row_lanes(rows, length)
    assert got == lanes and rowsplit.GROUP_WG % got == 0


def test_row_path():
    """An invocation a row up to SERIAL_MAX elements, else several rows a workgroup."""
    want = {40: "row", 64: "row", 65: "lanes", 5000: "lanes"}
    assert {n: rowsplit.row_path(n) for n in want} == want


def test_lane_loop_guards_only_a_partial_step():
    """A row a whole number of steps long runs no guarded step; one that is not ends with one,
    and a row shorter than one step has no unguarded loop at all."""
    whole = rowsplit.lane_loop(256, 32, "s += X[k];")
    assert "k0 += 128u" in whole and "if (k <" not in whole
    part = rowsplit.lane_loop(100, 32, "s += X[k];")
    assert "k0 += 128u" in part and part.count("if (k < 100u)") == rowsplit.LANE_LOADS
    short = rowsplit.lane_loop(65, 32, "s += X[k];")
    assert "for (" not in short


def test_grouped_kernel_combines_within_each_row():
    """A segmented tree in workgroup memory, never a subgroup op (a subgroup may hold several
    rows); spare rows of the last workgroup skip the reads but reach the barriers."""
    k = rowsplit.lane_kernel("Softmax", Rows(37, 100), Stats(softmax=True), [("x0", "f32", "x")],
                             "exp(x0[e] - r_m) / r_s", "y")
    assert k.name == "Softmax:rows8x32"
    assert "lid.x % 32u < wr_t" in k.wgsl and "subgroup" not in k.wgsl
    assert "if (row < 37u)" in k.wgsl
    even = rowsplit.lane_kernel("Softmax", Rows(40, 100), Stats(softmax=True), [("x0", "f32", "x")],
                                "exp(x0[e] - r_m) / r_s", "y")
    assert "if (row <" not in even.wgsl


# -- Softmax / LogSoftmax and their gradients -------------------------------------------------------------
SOFTMAX_CASES = [((37, 3), -1), ((21, 64), -1), ((30, 20, 3), 1), ((37, 65), -1), ((45, 100), -1), ((300, 128), -1),
                 ((9, 256), -1), ((5, 1000), -1), ((3, 100, 5), 1), ((2, 128, 3), 1)]


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,axis", SOFTMAX_CASES, ids=[f"{s}@{a}" for s, a in SOFTMAX_CASES])
def test_softmax_rows(backend, path, op, shape, axis):
    """Forward (online max and sum of exp) and gradient (one sum) kernels, with large logits so
    that the max grows along a lane's walk and across the lanes of a row."""
    x = randn(*shape) * 4
    x.reshape(-1)[::7] += 30
    length = shape[axis]
    k = kind(path, x.size // length, length)
    exe = check(backend, op, [x], {"axis": axis}, (f"{op}:{k}", f"{op}Grad:{k}"), rtol=2e-4, atol=2e-5)
    assert len([st for st in exe.plan.steps if st.kernel.name.startswith(op)]) == 2  # one kernel each way


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_masked_rows_grouped(backend, op):
    """Masked attention rows on the grouped path: half masked with the lowest f32, one fully
    masked (uniform), -inf before the first finite element; a row's lanes see masked elements
    only, or finite ones only, so the combine must not mix the identity in."""
    x = randn(11, 128)
    lowest = np.finfo(np.float32).min
    x[:, 64:] = lowest
    x[2, :] = lowest
    x[5, :40] = -np.inf
    graph, feeds = op_graph(op, [x], {"axis": -1}, grad=False, feed=[0])
    want, got, exe = run_both(graph, feeds, backend=backend)
    assert [st.kernel.name for st in exe.plan.steps] == [f"{op}:rows8x32"]
    np.testing.assert_allclose(got["out0"], want["out0"], rtol=2e-4, atol=2e-5)


# -- LayerNorm and its gradient, GroupNorm ------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(40, 48), (37, 100), (9, 256), (3, 1000), (2, 3, 128)])
def test_layer_norm_rows(backend, path, shape):
    """Rows far from zero (mean 50): the sums shifted by the row's first element keep the
    variance; mean and 1/std outputs written once a row; the gradient's four sums share a combine."""
    d = shape[-1]
    x = randn(*shape) * 0.5 + 50
    rows = x.size // d
    k = kind(path, rows, d)
    check(backend, "LayerNormalization", [x, randn(d), randn(d)], {"axis": -1}, n_outputs=3,
          kernels=(f"LayerNorm:{k}", f"LayerNormGrad:{k}"), rtol=1e-3, atol=1e-4)


def test_layer_norm_over_two_axes(backend, path):
    """axis 1 of (5, 4, 30): rows of 120 elements, a scale per element of the row."""
    x = randn(5, 4, 30) + 3
    k = kind(path, 5, 120)
    check(backend, "LayerNormalization", [x, randn(4, 30), randn(4, 30)], {"axis": 1},
          kernels=(f"LayerNorm:{k}", f"LayerNormGrad:{k}"), rtol=1e-3, atol=1e-4)


def test_group_norm_rows(backend, path):
    """Rows (sample, group) of channels-in-the-group x spatial: 3 x 2 rows of 2 x 45."""
    x = randn(3, 4, 45) + 3
    k = kind(path, 6, 90)
    check(backend, "GroupNormalization", [x, randn(4), randn(4)], {"num_groups": 2},
          kernels=(f"GroupNormalization:{k}", f"GroupNormGrad:{k}"), rtol=5e-4, atol=5e-5)
