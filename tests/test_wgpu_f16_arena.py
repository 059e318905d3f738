"""The float16 step's per-tensor work done once per arena on wgpu (ANYGRAD_WGPU_F16_ARENA, default on).

The loss scaler's test (FoundInf) reads the whole gradient arena in one reduction (wgpu.NonFinite,
fusion.arena_finite_check) instead of one per gradient, and the weights' float16 copies
are one cast of the whole parameter arena (wgpu.ArenaCast, fusion.arena_weight_casts) instead of
one Cast per weight (and per recomputed copy). Only the finiteness of the check matters and the
cast rounds each weight as before, so the switch changes no bit of a step: losses, parameters,
optimizer state, loss scale and the skipped-step count are compared exactly, on finite steps and
on steps that overflow float16 or carry a NaN.
"""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import wgpu_backend

import anygrad
from anygrad import nn
from anygrad.backends.wgpu.fusion.arenas import F16_ARENA_ENV
from anygrad.optim import grad_scaler

pytestmark = pytest.mark.wgpu


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (None, 8)


def _cnn():
    return (nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(4 * 3 * 3, 3)), (None, 1, 6, 6))


def _data(kind: str):
    rng = np.random.default_rng(0)
    if kind == "mlp":
        return rng.standard_normal((16, 8)).astype(np.float32), rng.integers(0, 4, 16)
    return rng.standard_normal((8, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, 8)


def _train_exe(model):
    return next(e for k, e in model._programs.items() if k[0] == "train")


def _run(monkeypatch, switch: str, kind: str, batches, optimizer):
    """Compile a fresh model under the switch; its losses, full state and kernel names."""
    monkeypatch.setenv(F16_ARENA_ENV, switch)
    net, shape = _mlp() if kind == "mlp" else _cnn()
    net.load_state_dict({k: v for k, v in _weights(kind).items()})
    m = net.to_model(input_shape=shape).compile("cross_entropy", optimizer(), device=wgpu_backend(), precision="f16")
    losses = [m.train_on_batch(x, y) for x, y in batches]
    names = [st.kernel.name for st in _train_exe(m).plan.steps]
    return losses, m.full_state(), m.read_metrics(), names, len(m.graph.params), _train_exe(m).plan.graph


def _weights(kind: str) -> dict[str, np.ndarray]:
    net, _ = _mlp() if kind == "mlp" else _cnn()
    rng = np.random.default_rng(1)
    return {k: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) if v.dtype == np.float32 else v
            for k, v in net.state_dict().items()}


def _param_casts(graph) -> list:
    """The Cast nodes reading a parameter, fused ones included."""
    nodes = [m for n in graph.nodes for m in (n.attrs["members"] if n.op == "wgpu.Fused" else [n])]
    return [n for n in nodes if n.op == "Cast" and n.inputs[0] in graph.params]


def _same(a, b):
    la, sa, ma = a[:3]
    lb, sb, mb = b[:3]
    assert [np.float32(v).tobytes() for v in la] == [np.float32(v).tobytes() for v in lb], (la, lb)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    assert ma == mb


def _sgd():
    return anygrad.optim.SGD(lr=0.1, momentum=0.9)


def _adam():
    return anygrad.optim.Adam(lr=1e-2)


@pytest.mark.parametrize("kind,optimizer", [("mlp", _sgd), ("cnn", _adam)])
def test_switch_changes_no_bit_of_finite_steps_and_drops_the_per_gradient_reductions(monkeypatch, kind, optimizer):
    x, y = _data(kind)
    batches = [(x, y), (x[::-1].copy(), y[::-1].copy()), (x, y)]
    on = _run(monkeypatch, "1", kind, batches, optimizer)
    off = _run(monkeypatch, "0", kind, batches, optimizer)
    _same(on, off)
    assert on[2]["skipped_updates"] == 0.0
    n_params = on[4]
    # the finite check: FoundInf reads the arena's one NonFinite scalar (one arena here) instead of
    # each gradient; the loss's FoundInf (the metrics' gate) is the same either way
    tested = [sorted(len(n.inputs) for n in run[5].nodes if n.op == "FoundInf") for run in (on, off)]
    assert tested == [[1, 1], [1, n_params]], tested
    assert len([n for n in on[5].nodes if n.op == "wgpu.NonFinite"]) == 1
    reductions = [len([k for k in names if k.startswith(("FoundInf", "NonFinite"))]) for names in (on[3], off[3])]
    assert reductions[0] < reductions[1] and reductions[1] >= n_params, reductions
    # the weights' float16 copies: one cast of the parameter arena instead of one (or more) per weight
    assert on[3].count("ew:ArenaCast") == 1 and "ew:ArenaCast" not in off[3]
    casts = [len([n for n in names if n.startswith("ew:") and "Cast" in n]) for names in (on[3], off[3])]
    assert casts[0] < casts[1], casts
    assert not _param_casts(on[5]) and len(_param_casts(off[5])) >= n_params - 2  # (BN's weights stay f32)


@pytest.mark.parametrize("bad", ["overflow", "nan"])
def test_skipped_steps_are_the_same_with_and_without_the_switch(monkeypatch, bad):
    """Inputs of 1e4 overflow float16 in the backward at the initial scale 2**16 (skipped steps
    while the scale backs off); a NaN input makes every gradient NaN (skipped, loss not counted)."""
    x, y = _data("mlp")
    big = x * (1e4 if bad == "overflow" else 1.0)
    if bad == "nan":
        big[3, 2] = np.nan
    batches = [(big, y), (x, y), (big, y), (x, y), (x, y)]
    on = _run(monkeypatch, "1", "mlp", batches, _adam)
    off = _run(monkeypatch, "0", "mlp", batches, _adam)
    _same(on, off)
    skipped = on[1][grad_scaler.SKIPPED_SUM]
    assert skipped >= 2.0, skipped  # both bad batches skipped (the overflow case may back off longer)
    assert on[1][grad_scaler.LOSS_SCALE] < grad_scaler.INIT_SCALE
    assert [n for n in on[3] if n.startswith("NonFinite")]


def test_a_skipped_first_step_leaves_every_parameter_unchanged(monkeypatch):
    x, y = _data("mlp")
    x = x.copy()
    x[0, 0] = np.inf
    w0 = _weights("mlp")
    _, state, *_ = _run(monkeypatch, "1", "mlp", [(x, y)], _sgd)
    for k, v in w0.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)
    assert state[grad_scaler.SKIPPED_SUM] == 1.0
    assert state[grad_scaler.LOSS_SCALE] == grad_scaler.INIT_SCALE / 2


def test_non_finite_kernel_counts_inf_and_nan_and_never_overflows():
    """The arena check's kernels: +inf when any element is inf or NaN, else 0, also where a sum of
    the (finite) values would overflow float32; short (one workgroup) and split (two passes) arenas."""
    from test_wgpu_gemm import CPU, GPU, run_kernels

    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    from anygrad.backends.wgpu.kernels.kernels_reduce import NON_FINITE
    from anygrad.ir import Graph, Node, TensorInfo

    for caps in (CPU, GPU):
        for n in (100, 70000):
            g = Graph()
            g.info["x"] = TensorInfo(np.dtype(np.float32), (n,))
            g.info["y"] = TensorInfo(np.dtype(np.float32), ())
            kernels = LOWERINGS[NON_FINITE](Node(NON_FINITE, ["x"], ["y"], name="n"), g, caps)
            assert len(kernels) == (1 if n == 100 else 2), [k.name for k in kernels]
            rng = np.random.default_rng(n)
            base = rng.standard_normal(n).astype(np.float32)
            huge = base.copy()
            huge[:4] = 3e38  # sums to inf: the count does not
            cases = {"finite": (base, 0.0), "huge": (huge, 0.0)}
            for label, v in (("inf", np.inf), ("-inf", -np.inf), ("nan", np.nan)):
                for at in (0, n // 2, n - 1):
                    a = base.copy()
                    a[at] = v
                    cases[f"{label}@{at}"] = (a, np.inf)
            for label, (a, want) in cases.items():
                got = run_kernels(kernels, {"x": a}, {"y": 1})["y"][0]
                assert got == want, (caps, n, label, got)


@pytest.mark.slow
def test_a_tiny_gpt_is_the_same_bits_with_and_without_the_switch(monkeypatch):
    """benchmarks/models.py's GPT decoder (weights also read through a tied/transposed embedding,
    recomputed casts in the backward): identical losses and state, fewer kernels."""
    import sys
    from pathlib import Path

    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from models import _gpt_module
    torch.manual_seed(0)
    module = _gpt_module(64, 8, 32, 2, 1).train()
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (16,))
    # Recomputing GELU in the backward is chosen when it plans smaller, which the switch can tip;
    # the copy is not the fused forward's bits (ew:Add+Gelu skips the f16 rounding of the add).
    monkeypatch.setenv("ANYGRAD_RECOMPUTE_ELEMENTWISE", "0")
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(F16_ARENA_ENV, switch)
        m = anygrad.from_torch(module, torch.from_numpy(x), check=False)
        m.compile("cross_entropy", anygrad.optim.AdamW(lr=1e-3), device=wgpu_backend(), precision="f16")
        losses = [m.train_on_batch(x, y) for _ in range(3)]
        runs[switch] = (losses, m.full_state(), m.read_metrics(), [st.kernel.name for st in _train_exe(m).plan.steps])
    _same(runs["1"], runs["0"])
    on, off = runs["1"][3], runs["0"][3]
    assert "ew:ArenaCast" in on and [n for n in on if n.startswith("NonFinite")]
    assert len(on) < len(off), (len(on), len(off))


def test_parameters_split_over_several_arenas_are_checked_and_cast_arena_by_arena(monkeypatch):
    """A 32 KiB storage binding splits the parameter arena in two (group_updates): one check and
    one cast per arena, the checks added; finite and overflowing steps the same bits as without."""
    import dataclasses

    from anygrad.backends.wgpu import WgpuBackend
    from anygrad.backends.wgpu.planning import limits as L
    name = "test-32k-f16-arena"
    monkeypatch.setitem(L.PROFILES, name, dataclasses.replace(L.PROFILES["webgpu-default"], name=name,
                                                              max_storage_buffer_binding_size=32 << 10))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 8)).astype(np.float32), rng.integers(0, 4, 8)
    batches = [(x * 1e4, y), (x, y), (x, y)]
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(F16_ARENA_ENV, switch)
        net = nn.Sequential(nn.Linear(8, 768), nn.ReLU(), nn.Linear(768, 4))
        net.load_state_dict({k: (0.1 * np.random.default_rng(2).standard_normal(v.shape)).astype(np.float32)
                             for k, v in net.state_dict().items()})
        m = net.to_model(input_shape=(None, 8)).compile("cross_entropy", _sgd(), device=WgpuBackend("wgpu", limits=name),
                                                       precision="f16")
        losses = [m.train_on_batch(bx, by) for bx, by in batches]
        runs[switch] = (losses, m.full_state(), m.read_metrics(), [st.kernel.name for st in _train_exe(m).plan.steps],
                        _train_exe(m).plan.graph)
    _same(runs["1"], runs["0"])
    graph = runs["1"][4]
    assert len([n for n in graph.nodes if n.op == "wgpu.FusedUpdate"]) == 2
    arenas = {n.inputs[0] for n in graph.nodes if n.op == "wgpu.NonFinite" and n.inputs[0].startswith("@garena")}
    assert len(arenas) == 2  # (and one more for the loss)
    assert runs["1"][3].count("ew:ArenaCast") == 2 and not _param_casts(graph)
    assert runs["1"][1][grad_scaler.SKIPPED_SUM] >= 1.0
