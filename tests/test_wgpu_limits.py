"""Limits profiles (a weaker adapter's limits, enforced by the device itself) and the planner's
memory report and budget, on lavapipe."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from wgpu_util import has_adapter, no_adapter

import anygrad
from anygrad.errors import ConfigError, DeviceError
from anygrad.losses import get_loss
from anygrad.optim import get_optimizer
from anygrad.program import build_train_step

pytestmark = pytest.mark.wgpu
MNIST = Path(anygrad.__file__).parent / "examples" / "mnist.onnx"


@pytest.fixture(autouse=True)
def _adapter():
    if not has_adapter():
        no_adapter()


def _backend(limits):
    from anygrad.devices import get_backend
    return get_backend("wgpu", limits=limits)


def test_a_profile_lowers_the_device_limits_and_never_raises_them():
    from anygrad.backends.wgpu.planning.limits import PROFILES
    plain, lowered = _backend("adapter"), _backend("webgpu-default")
    profile = PROFILES["webgpu-default"]
    for key, value in profile.device_limits().items():
        assert lowered.device.limits[key] == min(value, plain.device.limits[key]), key
    # the device enforces it: a workgroup of 512 invocations is refused under the profile's 256
    wgsl = "@compute @workgroup_size(512) fn main() {}"
    import wgpu
    with pytest.raises(wgpu.GPUError, match="(?i)workgroup"):
        lowered.device.create_compute_pipeline(
            layout="auto", compute={"module": lowered.device.create_shader_module(code=wgsl), "entry_point": "main"})
    assert "limits webgpu-default" in lowered.description


def test_unknown_profile_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match="unknown limits profile 'gtx9000'; choose one of webgpu-default"):
        _backend("gtx9000")
    monkeypatch.setenv("ANYGRAD_WGPU_LIMITS", "nope")
    with pytest.raises(ConfigError, match="^ANYGRAD_WGPU_LIMITS=nope: unknown limits profile 'nope'.*unset it"):
        _backend(None)
    from anygrad.backends.wgpu.planning.limits import get_profile
    monkeypatch.setenv("ANYGRAD_WGPU_LIMITS", "webgpu-default:bogus=1")
    with pytest.raises(ConfigError, match="^ANYGRAD_WGPU_LIMITS=webgpu-default:bogus=1: limits profile override"):
        get_profile(None)


def test_founding_model_trains_under_webgpu_default_like_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 32)
    losses = {}
    for device, limits in (("cpu", None), ("wgpu", "webgpu-default")):
        model = anygrad.load_onnx(MNIST)
        model.compile(loss="nll", optimizer=get_optimizer("adagrad", lr=0.1), device=device, limits=limits)
        losses[device] = [model.train_on_batch(x, y) for _ in range(3)]
    np.testing.assert_allclose(losses["wgpu"], losses["cpu"], rtol=1e-3, atol=1e-4)


def _step(batch: int, optimizer: str = "adam"):
    model = anygrad.load_onnx(MNIST)
    return model, build_train_step(model.graph, {model.input_name: (batch, 1, 28, 28)}, (batch,), get_loss("nll"),
                                   get_optimizer(optimizer))


def test_memory_report_counts_what_the_step_holds():
    backend = _backend(None)
    model, step = _step(64)
    report = backend.memory_report(step)
    param_bytes = 4 * sum(model.graph.initializers[p].size for p in model.graph.params)
    # packed into arenas, each tensor aligned: a little padding at most
    assert param_bytes <= report.parameters <= param_bytes * 1.01 + 4096
    assert 2 * param_bytes <= report.optimizer_state <= 2 * (param_bytes * 1.01 + 4096)  # Adam: two slots
    assert report.inputs == 64 * 28 * 28 * 4 + 64 * 4  # the images, and the targets as int32 on the device
    # the temporaries: what compiling the step allocates beyond state, inputs and constants
    allocated = []
    real = type(backend).create_buffer

    def counting(self, nbytes, usage, label=""):
        allocated.append((label, nbytes))
        return real(self, nbytes, usage, label)

    type(backend).create_buffer = counting
    try:
        exe = backend.compile(step)
    finally:
        type(backend).create_buffer = real
    temporaries = sum(n for label, n in allocated if label.startswith(("slot", "@garena")))
    assert temporaries == report.activations
    # activations grow with the batch, parameters do not
    bigger = backend.memory_report(_step(128)[1])
    assert bigger.parameters == report.parameters and bigger.activations > 1.8 * report.activations
    assert exe.n_kernels > 0


def test_memory_budget_refuses_a_step_and_names_a_batch_that_fits(monkeypatch):
    from anygrad.backends.wgpu.planning import limits
    tight = dataclasses.replace(limits.PROFILES["webgpu-default"], name="test-tight", memory_budget=40 << 20)
    monkeypatch.setitem(limits.PROFILES, "test-tight", tight)
    backend = _backend("test-tight")
    with pytest.raises(DeviceError, match=r"'test-tight' limits profile allows 40 MiB\. The largest batch that "
                                          r"fits is about (\d+)") as err:
        backend.memory_report(_step(512)[1])
    fit = int(err.value.args[0].rsplit("about ", 1)[1].rstrip("."))
    assert 0 < fit < 512
    assert backend.memory_report(_step(fit)[1]).total <= 40 << 20


def test_info_prints_the_memory_report():
    run = subprocess.run([sys.executable, "-m", "anygrad.cli", "info", str(MNIST), "--batch-size", "100",
                          "--optimizer", "sgd"], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert "training step at batch 100" in run.stdout and "peak:" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "anygrad.cli", "info", str(MNIST), "--batch-size", "10",
                          "--limits", "gtx9000"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "unknown limits profile" in bad.stderr and "Traceback" not in bad.stderr
