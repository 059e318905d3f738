"""Kernels split for parallelism (issue 11): reductions of every shape, the embedding gradient by
a GPU counting sort, max-pool gradients from precomputed window maxima, and grids folded past
the adapter's workgroups-per-dimension limit. Each against the numpy backend on lavapipe, the
large-shape paths reached on small shapes by lowering the module thresholds, and each checked to
give the same bits on a second run."""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import assert_close, op_graph, run_both, wgpu_backend

from anygrad.backends.wgpu import kernels_reduce
from anygrad.backends.wgpu.kernel import AdapterCaps

pytestmark = pytest.mark.wgpu

RNG = np.random.default_rng(11)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def backend():
    return wgpu_backend()  # skips the module when there is no adapter


def check(backend, op, inputs, attrs=None, *, kernels=(), rtol=1e-4, atol=1e-5, grad=True, const=(), feed=()):
    """wgpu vs numpy (outputs and gradients), that the plan took the kernels named in `kernels`
    (substrings of kernel names), and that a second run gives the same bits."""
    graph, feeds = op_graph(op, inputs, attrs, grad=grad, const=const, feed=feed)
    want, got, exe = run_both(graph, feeds, backend=backend)
    assert_close(want, got, rtol, atol, what=op)
    names = [st.kernel.name for st in exe.plan.steps]
    for k in kernels:
        assert any(k in n for n in names), f"{op}: no kernel '{k}' in {names}"
    again = exe.run(feeds)
    for name, value in got.items():
        assert np.asarray(value).tobytes() == np.asarray(again[name]).tobytes(), f"{op} {name}: bits differ"
    return exe


# -- reductions ------------------------------------------------------------------------------------
@pytest.fixture
def small_reduce(monkeypatch):
    """Thresholds scaled down so small shapes take the split paths that large ones take."""
    monkeypatch.setattr(kernels_reduce, "TARGET_THREADS", 64)
    monkeypatch.setattr(kernels_reduce, "TARGET_GROUPS", 16)
    monkeypatch.setattr(kernels_reduce, "MIN_CHUNK", 4)
    monkeypatch.setattr(kernels_reduce, "PER_GROUP", 64)
    monkeypatch.setattr(kernels_reduce, "SHORT", 8)


REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL1", "ReduceL2",
              "ReduceLogSumExp", "ReduceLogSum", "ReduceProd"]


def _reduce_input(op, *shape):
    x = randn(*shape)
    if op in ("ReduceLogSum", "ReduceProd"):  # positive sums; products near 1
        return np.abs(x) + 0.5 if op == "ReduceLogSum" else (1.0 + 0.01 * x).astype(np.float32)
    return x


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("shape,axes,kernel", [
    ((300, 7), (0,), ":cols"),          # many-ish outputs, long column reduction (bias gradient shape)
    ((5, 3000), (1,), ":split"),        # few outputs, long rows
    ((40, 6, 50), (0, 2), ":split"),    # rows over two merged-apart axes, chunked
    ((2, 90, 3, 5), (1,), ":cols"),     # reduced axis in the middle: kept axes innermost
    ((1000,), (0,), ":split"),          # one output
    ((6, 5), (1,), ":serial"),          # short rows
])
def test_reduce_split_paths(backend, small_reduce, op, shape, axes, kernel):
    x = _reduce_input(op, *shape)
    check(backend, op, [x, np.array(axes, np.int64)], {"keepdims": 0}, kernels=[kernel], rtol=3e-4, atol=1e-4)


def test_reduce_integer_max_split(backend, small_reduce):
    x = RNG.integers(-1000, 1000, size=(300, 7)).astype(np.int64)
    check(backend, "ReduceMax", [x, np.array([0], np.int64)], {"keepdims": 1}, kernels=[":cols"], grad=False,
          feed=(0,))


def test_reduce_default_thresholds_bias_gradient_shape(backend):
    """A bias gradient (rows x features summed over rows) at the real thresholds: many invocations,
    never one invocation per output looping over every row."""
    exe = check(backend, "ReduceSum", [randn(2048, 40), np.array([0], np.int64)], {"keepdims": 0},
                kernels=[":cols"], rtol=3e-4, atol=1e-4)
    first = next(st.kernel for st in exe.plan.steps if st.kernel.name == "ReduceSum:cols")
    assert first.workgroups[0] * 256 >= 40 * 64  # 40 outputs x 64 chunks of 32 rows
