"""BatchNorm's vec4 kernels (kernels_nn.py): when a channel's S spatial elements split into whole
vec4s, the apply / eval / dx kernels and the per-channel sums read 4 consecutive elements per
load. Checked against float64 numpy for training (y, running mean / var), its gradient (dx,
dscale, dbias) and eval mode, on vec4 (S % 4 == 0) and scalar shapes, 1-D and 2-D, with the
statistics in one workgroup per channel and split over several; the shader text shows which path
ran, and two runs give the same bits."""
from __future__ import annotations

import math

import numpy as np
import pytest
from wgpu_util import op_graph, wgpu_backend

from anygrad.backends.wgpu.kernels import kernels_nn

pytestmark = pytest.mark.wgpu

RNG = np.random.default_rng(11)
EPS, MOMENTUM = 1e-5, 0.8
VEC = "array<vec4<f32>>"


def randn(*shape, lo=None):
    x = RNG.standard_normal(shape).astype(np.float32)
    return np.abs(x) + lo if lo is not None else x


@pytest.fixture(scope="module")
def backend():
    return wgpu_backend()


@pytest.fixture(autouse=True)
def _whole_batchnorm(monkeypatch):
    """These tests read the whole node's apply kernel: the split into statistics and a fusable
    elementwise apply (fusion.split_batchnorm) is tested in test_wgpu_ew_vec.py."""
    monkeypatch.setenv("ANYGRAD_WGPU_BN_SPLIT", "0")


@pytest.fixture(params=[False, True], ids=["one-group", "split"])
def split(request, monkeypatch):
    """Split: per-channel sums over several workgroups (partial + combine) on small shapes; the
    uneven last part of (5, 3, 8)'s 10 vec4 steps per channel (3 parts of 4) included."""
    if request.param:
        monkeypatch.setattr(kernels_nn, "PER_GROUP", 16)
        monkeypatch.setattr(kernels_nn, "MIN_PER_GROUP", 12)
    return request.param


def _reference(x, scale, bias, rm, rv, dy, training):
    """(y, running mean, running var, dx, dscale, dbias) in float64."""
    axes = (0,) + tuple(range(2, x.ndim))
    per = (1, -1) + (1,) * (x.ndim - 2)
    xd, dyd = x.astype(np.float64), dy.astype(np.float64)
    n = x.size // x.shape[1]
    if training:
        mean = xd.mean(axis=axes)
        var = np.square(xd - mean.reshape(per)).mean(axis=axes)
    else:
        mean, var = rm.astype(np.float64), rv.astype(np.float64)
    inv = 1.0 / np.sqrt(var + EPS)
    xhat = (xd - mean.reshape(per)) * inv.reshape(per)
    y = xhat * scale.reshape(per) + bias.reshape(per)
    dbias, dscale = dyd.sum(axis=axes), (dyd * xhat).sum(axis=axes)
    k = (scale * inv).reshape(per)
    dx = k * (dyd - (dbias / n).reshape(per) - xhat * (dscale / n).reshape(per)) if training else k * dyd
    run_mean = rm * MOMENTUM + mean * (1 - MOMENTUM)
    run_var = rv * MOMENTUM + var * (n / (n - 1)) * (1 - MOMENTUM)
    return y, run_mean, run_var, dx, dscale, dbias


def _run(backend, shape, training):
    """Compile and run BatchNormalization and its gradient twice; (reference, results, exe)."""
    c = shape[1]
    x = randn(*shape) * 2 + 3  # off-centre: the shift k keeps the variance's precision
    ins = [x, randn(c), randn(c), randn(c), randn(c, lo=0.5)]
    n_out = 3 if training else 1
    graph, feeds = op_graph("BatchNormalization", ins, {"training_mode": int(training), "momentum": MOMENTUM,
                                                        "epsilon": EPS}, const=[3, 4], n_outputs=n_out)
    dy = np.random.default_rng(0).standard_normal(shape).astype(np.float32)  # op_graph's seed-0 weights
    ref = _reference(*ins, dy, training)
    want = dict(zip(graph.outputs, ref[:n_out] + ref[3:]))
    exe = backend.compile(graph)
    first = exe.run(feeds)
    second = exe.run(feeds)
    for k in first:  # a fixed summation order: the same bits every run
        np.testing.assert_array_equal(first[k], second[k], err_msg=f"{k} differs between runs")
    return want, first, exe


def _assert_close(want, got, rtol=2e-5, atol=2e-5):
    for k, w in want.items():
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(got[k], w, rtol=rtol, atol=atol * scale, err_msg=k)


def _kernels(exe, prefix):
    return [st.kernel for st in exe.plan.steps if st.kernel.name.startswith(prefix)]


def _assert_path(exe, prefixes, vec):
    for prefix in prefixes:
        found = _kernels(exe, prefix)
        assert found, f"no {prefix} kernel in {[st.kernel.name for st in exe.plan.steps]}"
        for k in found:
            assert (VEC in k.wgsl) == vec, f"{k.name}: vec4 path {'missing' if vec else 'taken'}"


SHAPES = [(5, 3, 8),       # 1-D, S % 4 == 0
          (4, 2, 160),     # 1-D, a thread sums several vec4s across samples
          (5, 3, 7),       # 1-D, scalar
          (3, 2, 4, 6),    # 2-D, S = 24
          (3, 2, 5, 3)]    # 2-D, S = 15: scalar


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_training_forward_and_gradient(backend, shape, split):
    want, got, exe = _run(backend, shape, training=True)
    _assert_close(want, got)
    vec = math.prod(shape[2:]) % 4 == 0
    stats = ("partial", "combine") if split else ("stats",)
    names = [f"{op}:{k}" for op in ("BatchNorm", "BatchNormGrad") for k in stats]
    _assert_path(exe, ["BatchNorm:apply", "BatchNormGrad:dx"] + [n for n in names if not n.endswith("combine")], vec)
    for name in names:
        assert _kernels(exe, name), f"no {name} kernel"
    assert not _kernels(exe, "BatchNorm:stats" if split else "BatchNorm:partial")


@pytest.mark.parametrize("shape", [(5, 3, 8), (3, 2, 4, 6), (3, 2, 5, 3)], ids=lambda s: "x".join(map(str, s)))
def test_eval_forward_and_gradient(backend, shape, split):
    """Eval mode: the apply kernel from running statistics; its gradient sums dy, dy * (x - mean)."""
    want, got, exe = _run(backend, shape, training=False)
    _assert_close(want, got)
    vec = math.prod(shape[2:]) % 4 == 0
    _assert_path(exe, ["BatchNorm:eval", "BatchNormGrad:dx", "BatchNormGrad:partial" if split else "BatchNormGrad:stats"],
                 vec)


def test_2d_input_keeps_the_scalar_kernels(backend):
    """(N, C): S = 1, no vec4 run per channel."""
    want, got, exe = _run(backend, (8, 6), training=True)
    _assert_close(want, got)
    _assert_path(exe, ["BatchNorm:apply", "BatchNorm:stats", "BatchNormGrad:dx"], vec=False)


def test_running_statistics_updated_in_place_on_the_vec_path(backend):
    """As in a training step: the running mean / var are state, read and written in one buffer
    by the combine of vec4 sums."""
    shape, c = (6, 4, 12), 4
    x, rm, rv = randn(*shape) + 1, randn(c), randn(c, lo=0.5)
    graph, feeds = op_graph("BatchNormalization", [x, randn(c), randn(c), rm, rv], {"training_mode": 1,
                            "momentum": MOMENTUM}, n_outputs=3, state={3: "rm", 4: "rv"}, grad=False)
    for name, value in (("rm", rm), ("rv", rv)):
        backend.set_state(name, value)
    got = backend.compile(graph).run(feeds)
    want = _reference(x, np.zeros(c), np.zeros(c), rm, rv, np.zeros(shape), True)
    np.testing.assert_allclose(got[graph.outputs[1]], want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[graph.outputs[2]], want[2], rtol=1e-5, atol=1e-6)


def test_float16_values_read_and_write_vec4_f16(backend):
    """A float16 x and y: halfstore.py rewrites the vec4 bindings to vec4<f16>, sums stay f32."""
    if not backend.caps.has_f16:
        pytest.skip("no shader-f16 on this adapter")
    shape, c = (4, 3, 8), 3
    x = (randn(*shape) * 2 + 3).astype(np.float16)
    ins = [x, randn(c), randn(c), randn(c), randn(c, lo=0.5)]
    graph, feeds = op_graph("BatchNormalization", ins, {"training_mode": 1, "momentum": MOMENTUM},
                            const=[1, 2, 3, 4], n_outputs=3, grad=False)
    exe = backend.compile(graph)
    got = exe.run(feeds)
    want = _reference(x.astype(np.float32), *ins[1:], np.zeros(shape), True)
    np.testing.assert_allclose(got[graph.outputs[0]].astype(np.float64), want[0], rtol=4e-3, atol=4e-3)
    np.testing.assert_allclose(got[graph.outputs[1]], want[1], rtol=1e-4, atol=1e-5)
    apply = _kernels(exe, "BatchNorm:apply")
    assert apply and "array<vec4<f16>>" in apply[0].wgsl
    assert not _kernels(exe, "BatchNorm:apply:to_f")  # rewritten in place, no f32 copy
