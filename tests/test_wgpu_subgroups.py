"""Workgroup reductions with subgroup ops (wgreduce.py) and with the workgroup-memory tree they
fall back to, against the numpy backend: every reduction kind, softmax rows, BatchNorm
statistics and gradient sums, LayerNorm / GroupNorm rows and parameter sums, loss sums and
CountCorrect, on odd sizes. `has_subgroups` is forced off (and on, where the adapter has the
feature) per test; the shader text confirms which path ran."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from wgpu_util import assert_close, op_graph, run_both, wgpu_backend

pytestmark = pytest.mark.wgpu

RNG = np.random.default_rng(7)


def randn(*shape, lo=None):
    x = RNG.standard_normal(shape).astype(np.float32)
    return np.abs(x) + lo if lo is not None else x


@pytest.fixture(scope="module")
def backends():
    """{True: a backend using subgroup ops, False: one forced to the tree}; pipelines are keyed by
    shader text, so both share the device and its pipeline cache."""
    out = {}
    for sg in (True, False):
        b = wgpu_backend()
        if sg and not b.caps.has_subgroups:
            continue
        b.caps = dataclasses.replace(b.caps, has_subgroups=sg)
        out[sg] = b
    return out


@pytest.fixture(params=[True, False], ids=["subgroups", "tree"])
def backend(request, backends):
    if request.param not in backends:
        pytest.skip("this adapter has no 'subgroup' feature")
    return backends[request.param]


def check(backend, op, inputs, attrs=None, *, combined=(), rtol=1e-4, atol=1e-5, **kw):
    """Run one op (and its gradients unless grad=False) on numpy and on `backend`; each prefix in
    `combined` must name a kernel, and those kernels use subgroup ops exactly when the backend does."""
    graph, feeds = op_graph(op, inputs, attrs, **kw)
    state = {name: np.asarray(graph.initializers[name]) for name in graph.buffers}
    want, got, exe = run_both(graph, feeds, backend=backend, state=state)
    assert_close(want, got, rtol, atol, what=op)
    kernels = [st.kernel for st in exe.plan.steps]
    for prefix in combined:
        assert any(k.name.startswith(prefix) for k in kernels), f"{op}: no {prefix} in {[k.name for k in kernels]}"
    hits = [k for k in kernels if k.name.startswith(tuple(combined))]
    sg = backend.caps.has_subgroups
    for k in hits:
        assert ("subgroupAdd" in k.wgsl or "subgroupMax" in k.wgsl or "subgroupMin" in k.wgsl
                or "subgroupMul" in k.wgsl) == sg, f"{k.name}: subgroup ops {'missing' if sg else 'used'}"
        assert ("wr_t > 0u" in k.wgsl) != sg, f"{k.name}: tree {'used' if sg else 'missing'}"
    return exe


# -- ReduceX ------------------------------------------------------------------------------------------------
KINDS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare", "ReduceL1",
         "ReduceL2", "ReduceLogSum", "ReduceLogSumExp"]


def _reduce_input(op, shape):
    x = randn(*shape)
    if op == "ReduceProd":
        return (1 + 1e-3 * x).astype(np.float32)  # products of thousands of factors stay finite
    if op == "ReduceLogSum":
        return np.abs(x) + 0.1
    return x


@pytest.mark.parametrize("op", KINDS)
@pytest.mark.parametrize("n", [1, 31, 33, 1000, 4097])
def test_reduce_kinds(backend, op, n):
    """3 outputs of n elements each (n <= 32 is the serial path; the rest one workgroup per output,
    33 leaving most of a 64-wide workgroup without elements)."""
    x = _reduce_input(op, (3, n))
    check(backend, op, [x, np.array([1], np.int64)], {"keepdims": 0}, grad=False, feed=[0],
          combined=(f"{op}:wg",) if n > 32 else (), rtol=2e-4)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceProd", "ReduceLogSumExp"])
def test_reduce_split_and_strided(backend, op):
    """Long reductions split over workgroups (the few partials are then summed serially), and reduced axes around a kept one
    (strided reads; a reduced axis in the middle, kept axes innermost, is a column reduction
    without a workgroup combine, tested in test_wgpu_parallel.py)."""
    check(backend, op, [_reduce_input(op, (2, 20011)), np.array([1], np.int64)], {"keepdims": 1}, grad=False,
          feed=[0], combined=(f"{op}:split",) + ((f"{op}:max:split",) if "Exp" in op else ()),
          rtol=2e-4)
    check(backend, op, [_reduce_input(op, (40, 33, 5)), np.array([0, 2], np.int64)], {"keepdims": 0}, grad=False,
          feed=[0], combined=(f"{op}:wg",), rtol=2e-4)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_reduce_integers(backend, op, dtype):
    """i32 through the subgroup ops; exact results."""
    x = RNG.integers(-1000, 1000, size=(5, 777)).astype(dtype)
    if op == "ReduceProd":
        x = np.where(RNG.random((5, 777)) < 0.99, 1, np.where(RNG.random((5, 777)) < 0.5, -1, 2)).astype(dtype)
    check(backend, op, [x, np.array([1], np.int64)], {"keepdims": 0}, grad=False, feed=[0],
          combined=(f"{op}:wg",))


def test_reduce_max_all_negative_and_infinite(backend):
    """The combine's identity must not leak: all-negative rows, -inf and +inf entries (exact)."""
    x = -np.abs(randn(3, 1000)) - 5
    x[1, 17] = -np.inf
    x[2, 999] = np.inf
    for op in ("ReduceMax", "ReduceMin"):
        graph, feeds = op_graph(op, [x, np.array([1], np.int64)], {"keepdims": 0}, grad=False, feed=[0])
        want, got, exe = run_both(graph, feeds, backend=backend)
        np.testing.assert_array_equal(got["out0"], want["out0"])
        assert [st.kernel.name for st in exe.plan.steps] == [f"{op}:wg"]


# -- softmax rows -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_long_rows(backend, op):
    """Forward (online max and sum) and the gradient kernels (one sum): two rows of 4097 are split
    in two chunks each (rowsplit.py) to give the GPU more workgroups, combined with subgroup ops.
    Rows taken whole, several a workgroup, combine without them (test_wgpu_rows.py)."""
    check(backend, op, [randn(2, 4097) * 3], {"axis": -1}, combined=(f"{op}:partial", f"{op}Grad:partial"),
          rtol=2e-4, atol=2e-5)


# -- BatchNorm ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,kernels", [((4, 3, 9, 9), ("stats",)),            # 64-wide workgroups
                                           ((4, 3, 16, 20), ("stats",)),          # 256-wide
                                           ((20, 2, 31, 31), ("partial", "combine"))])  # split channels
def test_batchnorm_stats_and_grad(backend, shape, kernels):
    c = shape[1]
    x = randn(*shape) * 2 + 1
    check(backend, "BatchNormalization", [x, randn(c), randn(c), randn(c), randn(c, lo=0.5)],
          {"training_mode": 1, "momentum": 0.8}, const=[3, 4], n_outputs=3, rtol=3e-4, atol=3e-5,
          combined=tuple(f"{op}:{k}" for op in ("BatchNorm", "BatchNormGrad") for k in kernels))


# -- LayerNorm / GroupNorm ----------------------------------------------------------------------------------
def test_group_norm_param_sums(backend):
    """GroupNorm's dscale / dbias: a workgroup an entry, combined with subgroup ops. Its rows
    combine without them, several a workgroup (test_wgpu_rows.py)."""
    check(backend, "GroupNormalization", [randn(2, 4, 700), randn(4), randn(4)], {"num_groups": 2},
          rtol=5e-4, atol=5e-5, combined=("GroupNormGrad:dy_xhat:wg", "GroupNormGrad:dy:wg"))


# -- losses and metrics -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 33, 1000])
def test_loss_sums(backend, n):
    """The mean-reduced loss sums terms and weights per workgroup of rows, then in one
    workgroup; its gradient sums the weights again; CountCorrect sums its hits the same way."""
    x = randn(n, 5)
    t = RNG.integers(0, 5, size=n).astype(np.int64)
    t[::4] = -100
    check(backend, "CrossEntropy", [x, t, randn(5, lo=0.1)],
          {"log_input": 0, "reduction": "mean", "ignore_index": -100}, const=[2], rtol=2e-4,
          combined=("CrossEntropy:rows", "CrossEntropy:sum", "CrossEntropyGrad:rows", "CrossEntropyGrad:sum"))
    hits = np.argmax(x, axis=1)
    hits[::3] = (hits[::3] + 1) % 5
    check(backend, "CountCorrect", [x, hits.astype(np.int64)], feed=[0, 1], grad=False,
          combined=("CountCorrect:rows", "CountCorrect:sum"))


def test_env_switch_turns_subgroups_off(backends, monkeypatch):
    """ANYGRAD_WGPU_SUBGROUPS=0 keeps an adapter with the feature on the tree."""
    if True not in backends:
        pytest.skip("this adapter has no 'subgroup' feature")
    from anygrad.backends.wgpu.kernels.wgreduce import use_subgroups
    caps = backends[True].caps
    assert use_subgroups(caps)
    monkeypatch.setenv("ANYGRAD_WGPU_SUBGROUPS", "0")
    assert not use_subgroups(caps)
    graph, feeds = op_graph("ReduceSum", [randn(2, 500), np.array([1], np.int64)], {"keepdims": 0}, grad=False,
                            feed=[0])
    _, _, exe = run_both(graph, feeds, backend=backends[True])
    assert all("subgroupAdd" not in st.kernel.wgsl for st in exe.plan.steps)
