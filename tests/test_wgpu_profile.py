"""GPU profiling of a compiled wgpu step (backends/wgpu/tuning/profiling.py) on lavapipe.

Checks that the timestamp profile covers every kernel of the plan, that its per-kind view adds up,
and that ANYGRAD_WGPU_PROFILE=1 records every run without changing results (reference: numpy).
"""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import wgpu_backend

from anygrad.backends import NumpyBackend
from anygrad.backends.wgpu.tuning import profiling
from anygrad.ir import Graph, Node, TensorInfo, specialize

pytestmark = pytest.mark.wgpu
F32 = np.dtype(np.float32)


@pytest.fixture(scope="module")
def wb():
    b = wgpu_backend()
    if profiling.FEATURE not in b.device.features:
        pytest.skip(f"adapter {b.adapter.name} has no '{profiling.FEATURE}'")
    return b


def _mlp_step() -> Graph:
    """h = relu(x @ W + b); y = sum(h); state c <- c + x (a state update next to the kernels)."""
    g = Graph(inputs=["x"], outputs=["y", "h"])
    g.nodes = [Node("Gemm", ["x", "W", "b"], ["g"]), Node("Relu", ["g"], ["h"]),
               Node("ReduceSum", ["h"], ["y"], {"keepdims": 0}), Node("Add", ["c", "x"], ["c2"])]
    g.info["x"] = TensorInfo(F32, (16, 24))
    rng = np.random.default_rng(0)
    g.initializers = {"W": rng.standard_normal((24, 8)).astype(np.float32),
                      "b": rng.standard_normal(8).astype(np.float32), "c": np.zeros((16, 24), np.float32)}
    g.buffers = ["c"]
    g.state_updates = {"c2": "c"}
    return specialize(g, {})


@pytest.mark.parametrize("name,kind", [("Conv[register 8x128]", "Conv"), ("ew:ReluGrad", "elementwise"),
                                       ("ew:AdagradUpdatex14", "optimizer update"),
                                       ("BatchNorm:stats", "BatchNorm"),
                                       ("ConvGradWeight[splitK reduce]", "ConvGradWeight splitK reduce"),
                                       ("CountCorrect", "CountCorrect")])
def test_op_kind(name, kind):
    assert profiling.op_kind(name) == kind


def test_step_profile_times_every_kernel(wb):
    exe = wb.compile(_mlp_step())
    x = np.ones((16, 24), np.float32)
    prof = exe.step_profile({"x": x}, repeat=2)
    assert [n for n, _ in prof.kernels] == [st.kernel.name for st in exe.plan.steps]
    assert prof.runs == 2 and all(ns >= 0 for _, ns in prof.kernels) and prof.kernel_ns > 0
    assert prof.step_ns is not None and prof.step_ns > 0 and prof.wall_ms > 0
    kinds = prof.by_kind()
    assert sum(n for _, n, _ in kinds) == len(prof.kernels)
    assert sum(ns for _, _, ns in kinds) == pytest.approx(prof.kernel_ns)
    text = prof.format("mlp")
    assert "GPU profile of mlp" in text and "Gemm" in text
    assert prof.as_dict()["kernel_ns"] == pytest.approx(prof.kernel_ns)
    # the Gemm's FLOPs (2 M N K) give its rate; other kernels have none
    gemm = next(i for i, (n, _) in enumerate(prof.kernels) if n.startswith("Gemm"))
    assert prof.flops[gemm] == 2 * 16 * 8 * 24
    assert prof.tflops(gemm) == pytest.approx(2 * 16 * 8 * 24 / prof.kernels[gemm][1] / 1e3)
    assert all(prof.tflops(i) is None for i in range(len(prof.kernels)) if i != gemm)


def test_env_profile_records_each_run_and_keeps_results(wb, monkeypatch, capsys):
    monkeypatch.setenv(profiling.ENV, "1")
    monkeypatch.setattr(profiling, "_LIVE", [])
    g = _mlp_step()
    exe = wb.compile(g)
    ref = NumpyBackend().compile(g)
    wb.set_state("c", np.zeros((16, 24), np.float32))
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.standard_normal((16, 24)).astype(np.float32)
        got, want = exe.run({"x": x}), ref.run({"x": x})
        np.testing.assert_allclose(got["h"], want["h"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-4)
    prof = exe._profiler
    assert prof is not None and prof.runs == 3
    assert prof.result().kernel_ns > 0
    profiling._print_live()
    err = capsys.readouterr().err
    assert "GPU profile of graph" in err and "TFLOP/s" in err   # the Gemm's rate


def test_no_profiler_without_env(wb, monkeypatch):
    monkeypatch.delenv(profiling.ENV, raising=False)
    assert wb.compile(_mlp_step())._profiler is None


def test_gemms_are_grouped_by_tiling_and_size():
    """Twelve layers' copies of a GEMM make one row: their count, time each and rate."""
    prof = profiling.StepProfile(kernels=[("MatMul[shared 128x128k16p]", 1000.0)] * 12
                                 + [("MatMul[shared 128x128k16p]", 4000.0), ("ew:Gelu", 500.0),
                                    ("Gemm[splitK reduce]", 30.0)],
                                 runs=1, flops=[2_000_000] * 12 + [2_000_000, 0, 0])
    # the last MatMul has the same tiling and FLOPs: one group of 13, 16,000 ns in all
    assert prof.by_gemm() == [("MatMul[shared 128x128k16p]", 2_000_000, 13, 16000.0)]
    text = prof.format("t")
    row = next(line for line in text.splitlines() if line.strip().startswith("MatMul[shared 128x128k16p]") and "13" in line)
    assert row.split()[-3:] == ["13", "1.2", "1.6"]  # 16 us / 13 kernels; 26 MFLOP in 16 us


class _Pass:
    """A compute pass that counts what is encoded into it."""

    def __init__(self, log: list):
        self.log = log
        self.dispatches = 0

    def set_pipeline(self, _):
        pass

    def set_bind_group(self, *_):
        pass

    def dispatch_workgroups(self, *_):
        self.dispatches += 1

    def end(self):
        self.log.append(self.dispatches)


class _Encoder:
    def __init__(self):
        self.passes: list[int] = []

    def begin_compute_pass(self, **_):
        return _Pass(self.passes)


def test_a_spin_lasts_about_spin_ms_and_stays_bounded():
    """encode_spin: untimed runs of a dispatch list adding up to SPIN_MS of GPU work at the time
    one run took; a list of tiny kernels stops at SPIN_DISPATCHES; nothing for an empty list."""
    two = [("pipe", "bg", (1, 1, 1))] * 2
    enc = _Encoder()
    profiling.encode_spin(enc, two, run_ms=1.0)
    assert enc.passes == [2 * int(np.ceil(profiling.SPIN_MS))]
    enc = _Encoder()
    profiling.encode_spin(enc, two, run_ms=1e-6)
    assert enc.passes == [profiling.SPIN_DISPATCHES // 2 * 2]
    enc = _Encoder()
    profiling.encode_spin(enc, two, run_ms=10 * profiling.SPIN_MS)
    assert enc.passes == [2]
    enc = _Encoder()
    profiling.encode_spin(enc, [], run_ms=1.0)
    assert enc.passes == []


def test_the_tuner_spins_the_clock_up_only_after_a_pause(wb, monkeypatch):
    """device_timer: a timing after IDLE_S without GPU work is preceded by a spin (an idle NVIDIA
    GPU's clock is low: profiling.py); one right after another is not."""
    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    from anygrad.backends.wgpu.tuning import autotune
    spins = []
    real = autotune.encode_spin
    monkeypatch.setattr(autotune, "encode_spin", lambda enc, ds, ms: spins.append(ms) or real(enc, ds, ms))
    g = Graph()
    g.info["a"] = TensorInfo(F32, (64, 64))
    g.info["b"] = TensorInfo(F32, (64, 64))
    g.info["y"] = TensorInfo(F32, (64, 64))
    node = Node("MatMul", ["a", "b"], ["y"], name="mm")
    g.nodes = [node]
    kernels = LOWERINGS["MatMul"](node, g, wb.caps)
    timer = autotune.device_timer(wb)
    profiling.clock.busy_at = -float("inf")
    first = timer.all([kernels], g)
    assert len(spins) == 1 and spins[0] > 0
    second = timer.all([kernels], g)
    assert len(spins) == 1, "a timing right after another must not spin"
    assert first[0] > 0 and second[0] > 0
    monkeypatch.setattr(profiling, "IDLE_S", 0.0)
    timer.all([kernels], g)
    assert len(spins) == 2
