"""The PyTorch backend (device torch:cpu here) against the numpy backend, its oracle.

The same compiled step graph runs on both; trajectories agree to float32 noise, dropout masks
bit for bit (the RNG in torch ops), checkpoints move between the backends. ONNX's node
conformance suite runs on torch:cpu against its own expected-failures list, for the cases that
reach a torch kernel (the others run the numpy reference kernels, which the numpy half of
test_onnx_conformance.py already checks).
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import anygrad
from anygrad import devices, rng
from anygrad.backends.numpy import NumpyBackend
from anygrad.backends.torch import LOWERINGS, TorchBackend
from anygrad.backends.torch import rng as torch_rng
from anygrad.errors import AnygradError, ConfigError, DataError, DeviceError
from anygrad.examples import FOUNDING_MODEL

TESTS = Path(__file__).resolve().parent
XFAIL_TORCH_FILE = TESTS / "onnx_expected_failures_torch.txt"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Small tensors on a shared 2-core machine: torch's thread pool only waits on itself."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the RNG ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, step, salt", [(0, 0, 0), (3, 17, 2), (0xFFFFFFFF, 0xFFFFFFFE, 7), (12345, 1, 0)])
def test_rng_draws_are_the_numpy_draws_bit_for_bit(seed, step, salt):
    state = torch.tensor([seed, step], dtype=torch.int64)
    ours = torch_rng.uniform(state, salt, 10_000, "cpu").numpy()
    np.testing.assert_array_equal(ours, rng.uniform(seed, step, salt, 10_000))


# -- the founding CNN: trajectories --------------------------------------------------------------
def _train(device, optimizer, steps: int = 4, batch: int = 8, seed: int = 3):
    model = anygrad.load_onnx(FOUNDING_MODEL)
    model.compile(loss="nll", optimizer=optimizer, device=device, seed=seed)
    data = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        x = data.standard_normal((batch, 1, 28, 28)).astype(np.float32)
        y = data.integers(0, 10, batch)
        losses.append(model.train_on_batch(x, y))
    return model, losses


def _close(actual: np.ndarray, desired: np.ndarray, name: str, atol: float = 2e-5) -> None:
    """Float32 noise: relative, and absolute against the tensor's own scale (an element of a sum
    of large terms that cancel carries their rounding, not its own)."""
    scale = float(np.abs(desired).max()) if desired.size else 0.0
    np.testing.assert_allclose(actual, desired, rtol=1e-4, atol=atol + 1e-5 * scale, err_msg=name)


def _train_program(model):
    return next(exe for key, exe in model._programs.items() if key[0] == "train")


@pytest.mark.parametrize("optimizer, atol", [
    (lambda: anygrad.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4), 2e-5),
    (lambda: anygrad.optim.Adagrad(lr=0.05), 5e-4),
    (lambda: anygrad.optim.RMSprop(lr=1e-3, momentum=0.5, centered=True), 5e-4),
], ids=["sgd", "adagrad", "rmsprop"])
def test_founding_cnn_trains_like_numpy(optimizer, atol):
    """Dropout (p=0.3) on, BatchNorm in training mode: the same losses, weights, running
    statistics and metrics as the numpy backend, up to float32 noise. Adaptive optimizers divide
    by the gradient's own scale: a weight whose gradient is ~0 moves by ~lr on noise alone. Their
    tolerance is 1% of the rate, and only weights are compared: the biases right before a
    BatchNorm (exact gradient 0: the normalisation removes them) drift, and with them the
    BatchNorm's running mean and the eval-mode predictions; the losses are immune to them."""
    ref, ref_losses = _train("cpu", optimizer())
    ours, losses = _train(TorchBackend("torch:cpu"), optimizer())
    adaptive = atol > 2e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    a, b = ref.full_state(), ours.full_state()
    assert a.keys() == b.keys()
    for name in a:
        if adaptive and (not name.endswith(".weight") or name.startswith("optim.")):
            continue
        _close(b[name], a[name], name, atol)
    assert ours.read_metrics() == pytest.approx(ref.read_metrics(), rel=1e-5)
    # only the RNG counter's uint32 increment runs on a reference kernel
    assert _train_program(ours).fallback_ops == ["Add"]
    if adaptive:
        return
    x = np.random.default_rng(1).standard_normal((5, 1, 28, 28)).astype(np.float32)
    np.testing.assert_allclose(ours.predict(x), ref.predict(x), rtol=1e-4, atol=1e-5)
    y = np.arange(5)
    assert ours.evaluate(x, y) == pytest.approx(ref.evaluate(x, y), rel=1e-5)


def test_adam_losses_match_numpy():
    """Adam divides by sqrt of the squared gradient, so a bias whose exact gradient is 0 (a conv
    before BatchNorm) moves by lr on noise alone: compare losses, not those weights."""
    make = lambda: anygrad.optim.AdamW(lr=1e-3, weight_decay=0.01, amsgrad=True)
    _, ref = _train("cpu", make())
    _, ours = _train(TorchBackend("torch:cpu"), make())
    np.testing.assert_allclose(ours, ref, rtol=1e-5)


def test_checkpoints_move_between_devices(tmp_path):
    """Train on torch:cpu, resume from its full state on the numpy backend, predict on wgpu:
    the same numbers as training on numpy throughout."""
    sgd = lambda: anygrad.optim.SGD(lr=0.05, momentum=0.9)
    ref, _ = _train("cpu", sgd(), steps=4)
    first, _ = _train(TorchBackend("torch:cpu"), sgd(), steps=2)
    state = first.full_state()
    np.savez(tmp_path / "ckpt.npz", **state)
    with np.load(tmp_path / "ckpt.npz") as z:
        state = {k: z[k] for k in z.files}
    resumed = anygrad.load_onnx(FOUNDING_MODEL)
    resumed.compile(loss="nll", optimizer=sgd(), device="cpu", seed=3)
    resumed.load_full_state(state)
    data = np.random.default_rng(0)
    batches = [(data.standard_normal((8, 1, 28, 28)).astype(np.float32), data.integers(0, 10, 8)) for _ in range(4)]
    for x, y in batches[2:]:
        resumed.train_on_batch(x, y)
    a, b = ref.full_state(), resumed.full_state()
    for name in a:
        # two steps on torch's conv kernels, two on numpy's, against four on numpy: momentum
        # carries the first steps' float32 summation-order noise (3.8e-5 on an element of 7e-4
        # on a 2-core machine, 2026-12-02), so the absolute floor is wider than _close's
        _close(b[name], a[name], name, atol=1e-4)
    # and back onto torch: the numpy-trained state loads and predicts there as on numpy
    back = anygrad.load_onnx(FOUNDING_MODEL)
    back.compile(loss="nll", optimizer=sgd(), device="torch:cpu", seed=3)
    back.load_full_state(resumed.full_state())
    x = batches[0][0]
    np.testing.assert_allclose(back.predict(x), resumed.predict(x), rtol=1e-4, atol=1e-5)
    from wgpu_util import has_adapter, no_adapter
    if not has_adapter():
        no_adapter()
    on_wgpu = anygrad.load_onnx(FOUNDING_MODEL)
    on_wgpu.compile(loss="nll", optimizer=sgd(), device="wgpu", seed=3)
    on_wgpu.load_full_state(first.full_state())
    on_cpu = anygrad.load_onnx(FOUNDING_MODEL)
    on_cpu.compile(loss="nll", optimizer=sgd(), device="cpu", seed=3)
    on_cpu.load_full_state(first.full_state())
    np.testing.assert_allclose(on_wgpu.predict(x[:2]), on_cpu.predict(x[:2]), rtol=1e-4, atol=1e-4)


def test_compile_is_for_torch_devices_only(tmp_path, capsys):
    """torch_compile / --compile on a backend without torch.compile: a ConfigError naming the
    devices to choose, from Python and from the CLI (one error line, exit code 2)."""
    from anygrad import cli
    model = anygrad.load_onnx(FOUNDING_MODEL)
    with pytest.raises(ConfigError, match="only the torch backend has.*device is cpu.*--device torch"):
        model.compile(loss="nll", device="cpu", torch_compile=True)
    with pytest.raises(ConfigError, match="torch.compile has no backend 'nope'"):
        model.compile(loss="nll", device="torch:cpu", torch_compile="nope")
    assert cli.main(["train", "--device", "cpu", "--compile", "--epochs", "1", "--artifacts",
                     str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error: --compile") and "torch:cpu" in err and "Traceback" not in err


@pytest.mark.slow  # inductor compiles C++: ~45 s on a 2-core machine
def test_torch_compile_runs_the_same_step():
    """The step's torch segments through torch.compile (inductor, C++ on the CPU): same losses.
    Through Model.compile(torch_compile=True), as `anygrad train --compile` asks for it."""
    pytest.importorskip("torch._inductor")
    import shutil
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile on the CPU needs a C compiler")  # the eager path is tested above
    nn = anygrad.nn
    module = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Dropout(0.25), nn.Linear(5, 3))
    model_a, model_b = module.to_model((None, 6)), module.to_model((None, 6))
    shape = (4, 6)
    model_a.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.1), device=TorchBackend("torch:cpu"))
    model_b.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.1), device="torch:cpu",
                    torch_compile=True)
    assert model_b.backend.compile_backend == "inductor" and "torch.compile" in model_b.backend.description
    data = np.random.default_rng(0)
    for _ in range(2):
        x, y = data.standard_normal(shape).astype(np.float32), data.integers(0, 3, shape[0])
        assert model_b.train_on_batch(x, y) == pytest.approx(model_a.train_on_batch(x, y), rel=1e-5)
    exe = _train_program(model_b)
    assert exe.torch_compile
    # the compiled parts hand back only what is read after them: intermediates stay inside
    made = [o for n in exe.graph.nodes for o in n.outputs if o]
    assert exe.slot[made[0]] not in exe.compiled_keep and len(exe.compiled_keep) < len(made) // 2
    with pytest.raises(DeviceError, match="torch.compile"):
        exe.run({**{n: np.zeros(exe.graph.info[n].shape, exe.graph.info[n].dtype) for n in exe.graph.inputs}},
                fetch=[made[0]])


# -- devices and support ---------------------------------------------------------------------------
def test_device_names():
    backend = devices.get_backend("torch:cpu")
    assert isinstance(backend, TorchBackend) and backend.device.type == "cpu"
    assert "torch" in backend.description
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="CUDA"):
            devices.get_backend("torch:cuda")
        assert devices.get_backend("torch").device.type in ("cpu", "mps")
    with pytest.raises(ConfigError, match="torch:cuda"):
        devices.get_backend("torch:tpu")
    with pytest.raises(ConfigError, match="torch:mps"):
        devices.get_backend("tpu")


def test_auto_prefers_wgpu_then_torch_gpu_then_cpu_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(devices, "best_adapter", lambda include_software=True: None)
    monkeypatch.setattr(devices, "_torch_gpu", lambda: None)
    assert isinstance(devices.get_backend("auto"), NumpyBackend)
    assert "CPU (numpy)" in capsys.readouterr().err
    # a torch GPU (stood in for by torch's CPU device, the one this machine has) comes before the CPU
    monkeypatch.setattr(devices, "_torch_gpu", lambda: "cpu")
    backend = devices.get_backend("auto")
    assert isinstance(backend, TorchBackend)
    assert "using PyTorch's torch" in capsys.readouterr().err


def _batches(steps: int, batch: int = 8, seed: int = 0):
    data = np.random.default_rng(seed)
    return [(data.standard_normal((batch, 1, 28, 28)).astype(np.float32), data.integers(0, 10, batch))
            for _ in range(steps)]


def test_auto_with_two_gpus_times_the_step_on_each_and_trains_on_the_faster(monkeypatch, capsys):
    """With a wgpu GPU and a torch GPU (stood in for by the numpy backend and torch's CPU device),
    `auto` times the model's own step on each before its first step, says so, and trains on the
    faster from the state as it was: the same bits as training on that backend alone, also after
    a checkpoint was loaded (its optimizer slots kept); the slower one holds no state after."""
    made: list = []
    monkeypatch.setattr(devices, "auto_backends", lambda limits=None, memory_budget=None, precision=None: made.append(
        [NumpyBackend(), TorchBackend("torch:cpu")]) or made[-1])
    make = lambda: anygrad.optim.SGD(lr=0.05, momentum=0.9)
    start = anygrad.load_onnx(FOUNDING_MODEL).compile(loss="nll", optimizer=make(), device="cpu", seed=3)
    for x, y in _batches(2, seed=1):
        start.train_step(x, y)
    checkpoint = start.full_state()
    for resume in (False, True):
        model = anygrad.load_onnx(FOUNDING_MODEL).compile(loss="nll", optimizer=make(), device="auto", seed=3)
        if resume:
            model.load_full_state(checkpoint)
        losses = [model.train_on_batch(x, y) for x, y in _batches(3)]
        err = capsys.readouterr().err
        assert "device auto:" in err and f"training on {model.backend.description}" in err
        assert set(model.backend_trial) == {NumpyBackend().description, TorchBackend("torch:cpu").description}
        assert model.backend.description == min(model.backend_trial, key=model.backend_trial.get)
        loser = next(b for b in made[-1] if b is not model.backend)
        assert not loser.state and model.backend.state
        alone = NumpyBackend() if isinstance(model.backend, NumpyBackend) else TorchBackend("torch:cpu")
        ref = anygrad.load_onnx(FOUNDING_MODEL).compile(loss="nll", optimizer=make(), device=alone, seed=3)
        if resume:
            ref.load_full_state(checkpoint)
        assert losses == [ref.train_on_batch(x, y) for x, y in _batches(3)]
        a, b = ref.full_state(), model.full_state()
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(b[name], a[name], err_msg=name)
        assert model.read_metrics() == ref.read_metrics()


def test_auto_leaves_out_a_candidate_that_cannot_train_the_model(monkeypatch, capsys):
    """A candidate whose compile fails (here: one that raises as a wgpu adapter out of memory
    would) is left out and named; the other trains as it would alone. None left: the error."""
    class Broken(NumpyBackend):
        @property
        def description(self) -> str:
            return "broken GPU"

        def compile(self, graph):
            raise DeviceError("out of device memory")
    monkeypatch.setattr(devices, "auto_backends",
                        lambda limits=None, memory_budget=None, precision=None: [Broken(), TorchBackend("torch:cpu")])
    make = lambda: anygrad.optim.SGD(lr=0.05, momentum=0.9)
    model = anygrad.load_onnx(FOUNDING_MODEL).compile(loss="nll", optimizer=make(), device="auto", seed=3)
    losses = [model.train_on_batch(x, y) for x, y in _batches(2)]
    err = capsys.readouterr().err
    assert "broken GPU left out (DeviceError: out of device memory)" in err and isinstance(model.backend, TorchBackend)
    ref = anygrad.load_onnx(FOUNDING_MODEL).compile(loss="nll", optimizer=make(), device="torch:cpu", seed=3)
    assert losses == [ref.train_on_batch(x, y) for x, y in _batches(2)]
    monkeypatch.setattr(devices, "auto_backends", lambda limits=None, memory_budget=None, precision=None: [Broken(), Broken()])
    model = anygrad.load_onnx(FOUNDING_MODEL).compile(loss="nll", optimizer=make(), device="auto")
    with pytest.raises(DeviceError, match="out of device memory"):
        model.train_on_batch(*_batches(1)[0])


def test_supports_is_asked_per_backend():
    torch_backend, numpy_backend = TorchBackend("torch:cpu"), NumpyBackend()
    for backend in (torch_backend, numpy_backend):
        assert backend.supports("Conv") and backend.supports("CountTopK")
        assert not backend.supports("Frobnicate")
    assert torch_backend.lowered("Conv") and not torch_backend.lowered("DFT")
    model = anygrad.load_onnx(FOUNDING_MODEL).compile(loss="nll", device=torch_backend)
    assert model._supports("CountTopK") and not model._supports("Frobnicate")


def test_an_op_without_a_torch_kernel_runs_its_reference_kernel():
    """ReverseSequence has no lowering: the numpy kernel runs on host copies, same values."""
    from anygrad.ir.builder import Builder
    from anygrad.ir.graph import Graph, TensorInfo
    from anygrad.ir.passes import specialize
    assert "ReverseSequence" not in LOWERINGS
    g = Graph()
    g.inputs = ["x"]
    g.info["x"] = TensorInfo(np.dtype(np.float32), (3, 4))
    b = Builder(g, prefix="t")
    lengths = b.const(np.array([3, 1, 2, 3], np.int64), np.int64, "lengths")
    y = b.op("Relu", [b.op("ReverseSequence", ["x", lengths])])
    g.outputs = [y]
    g = specialize(g, {"x": (3, 4)})
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    exe = TorchBackend("torch:cpu").compile(g)
    assert exe.fallback_ops == ["ReverseSequence"]
    np.testing.assert_allclose(exe.run({"x": x})[y], NumpyBackend().compile(g).run({"x": x})[y], rtol=1e-6)


def test_bad_targets_are_a_data_error():
    model = anygrad.load_onnx(FOUNDING_MODEL).compile(loss="nll", device="torch:cpu")
    with pytest.raises(AnygradError, match="outside"):
        model.train_on_batch(np.zeros((2, 1, 28, 28), np.float32), np.array([1, 10]))


def test_flattened_token_targets_are_checked_on_the_host(monkeypatch):
    """A language model's (N, T) targets reach its loss flattened (a Reshape of the fed batch):
    they are range-checked on the host copy, so the kernel reads nothing back from the device
    (a sync per step, and a graph break under torch.compile); a bad token is still a DataError."""
    from torch import nn

    from anygrad.backends.torch import kernels_loss

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

        def forward(self, tokens):
            return self.head(self.embed(tokens)).view(-1, 16)
    torch.manual_seed(0)
    module = Tokens()
    x = np.random.default_rng(0).integers(0, 16, (2, 4))
    y = np.random.default_rng(1).integers(0, 16, (2, 4))
    monkeypatch.setattr(kernels_loss, "_check_targets", lambda *a: pytest.fail("targets read back on the device"))
    losses = []
    for device in ("cpu", "torch:cpu"):
        model = anygrad.from_torch(module, torch.from_numpy(x), check=False)
        model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.1), device=device)
        losses.append([model.train_on_batch(x, y) for _ in range(3)])
    assert any(n.op == "Reshape" for n in _train_program(model).graph.nodes)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    with pytest.raises(DataError, match="outside"):
        model.train_on_batch(x, np.where(y == y[0, 0], 16, y))


# -- the CLI -------------------------------------------------------------------------------------------
def test_cli_founding_run_on_torch_cpu(tmp_path, monkeypatch, capsys):
    """`anygrad train` with the founding model and its defaults (Adagrad, lr 1.0, uint8 batches
    normalised on the device) on torch:cpu, 3 steps, eager and with --compile: the metrics of the
    same run on numpy. (--compile's inductor needs a C++ build of each segment, ~45 s here: this
    run swaps in torch.compile's "eager" backend, which traces the same functions with dynamo
    and runs them as traced; test_torch_compile_runs_the_same_step runs inductor itself.)"""
    from anygrad import cli
    from anygrad.data import write_idx
    from anygrad.data.mnist import MNIST_FILES
    data = tmp_path / "data"
    data.mkdir()
    r = np.random.default_rng(0)
    for split, n in (("train", 48), ("test", 16)):
        y = r.integers(0, 10, n).astype(np.uint8)
        x = (r.integers(0, 20, (n, 28, 28)) + y[:, None, None] * 23).astype(np.uint8)
        write_idx(data / f"{MNIST_FILES['x_' + split].name}.gz", x)
        write_idx(data / f"{MNIST_FILES['y_' + split].name}.gz", y)
    set_compile = TorchBackend.set_torch_compile
    asked = []

    def eager_compile(self, torch_compile):
        asked.append(torch_compile)
        set_compile(self, "eager" if torch_compile is True else torch_compile)
    monkeypatch.setattr(TorchBackend, "set_torch_compile", eager_compile)
    rows = {}
    for device in ("cpu", "torch:cpu", "torch:cpu --compile"):
        run = tmp_path / device.replace(":", "-").replace(" --", "-")
        assert cli.main(["train", "--data-dir", str(data), "--device", *device.split(), "--epochs", "1",
                         "--batch-size", "16", "--artifacts", str(run), "--quiet"]) == 0
        rows[device] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((run / "config.json").read_text())["torch_compile"] is device.endswith("--compile")
    assert asked[-1] is True  # --compile reached the backend
    assert len(rows["cpu"]) == len(rows["torch:cpu"]) == len(rows["torch:cpu --compile"]) == 1
    for a, b, c in zip(rows["cpu"], rows["torch:cpu"], rows["torch:cpu --compile"]):
        for key in ("train_loss", "train_accuracy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
            assert c[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
        # Adagrad at lr 1 moves the biases before each BatchNorm (exact gradient 0) by ~lr on
        # rounding noise; the eval-mode loss reads them through the running means
        assert b["valid_loss"] == pytest.approx(a["valid_loss"], rel=2e-2)


# -- ONNX node conformance on torch:cpu -------------------------------------------------------------
def _conformance_suite() -> dict[str, type]:
    from onnx.backend.test import BackendTest
    from onnx.backend.test.loader import load_model_tests
    from test_onnx_conformance import expected_failures

    from anygrad.frontends.onnx_backend import AnygradBackend

    class TorchOnnxBackend(AnygradBackend):
        """anygrad's ONNX backend on device TORCH (torch:cpu)."""

        @classmethod
        def supports_device(cls, device: str) -> bool:
            return device.upper() == "TORCH"

        @classmethod
        def _backend(cls, device: str):
            return TorchBackend("torch:cpu")

    class TorchNodeConformance(BackendTest):
        def _add_model_test(self, model_test, kind: str) -> None:
            if kind == "Node":
                super()._add_model_test(model_test, kind)

        def _add_test(self, category, test_name, test_func, report_item, devices=None, **kwargs) -> None:
            super()._add_test(category, test_name, test_func, report_item, devices=("TORCH",), **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
        bt = TorchNodeConformance(TorchOnnxBackend, __name__)
    # Cases with an op that has a torch lowering; the rest would only run the numpy kernels again.
    lowered = sorted(c.name for c in cases if any(n.op_type in LOWERINGS for n in c.model.graph.node))
    bt.include("^(" + "|".join(re.escape(n) for n in lowered) + ")_torch$")
    for name in expected_failures(XFAIL_TORCH_FILE):
        bt.xfail(f"^{re.escape(name)}_torch$")
    out = {}
    for key, cls in bt.test_cases.items():
        cls.__name__ = cls.__qualname__ = key + "Torch"
        out[key + "Torch"] = cls
    return out


globals().update(_conformance_suite())


def test_torch_expected_failures_name_real_cases():
    from onnx.backend.test.loader import load_model_tests
    from test_onnx_conformance import expected_failures
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = {c.name for c in load_model_tests(kind="node")}
    stale = sorted(set(expected_failures(XFAIL_TORCH_FILE)) - names)
    assert not stale, f"{XFAIL_TORCH_FILE.name} lists cases onnx does not have: {stale[:10]}"


# -- the step's plan: grouped optimizer updates, CUDA graphs ---------------------------------------
def _states_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("optimizer", [
    lambda: anygrad.optim.SGD(lr=0.05, momentum=0.9),
    lambda: anygrad.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    lambda: anygrad.optim.SGD(lr=0.05, momentum=0.5, dampening=0.1, maximize=True),
    lambda: anygrad.optim.AdamW(lr=1e-3, weight_decay=0.01, amsgrad=True),
    lambda: anygrad.optim.Adam(lr=1e-3, betas=(0.4, 0.99), weight_decay=1e-3),
    lambda: anygrad.optim.Adagrad(lr=0.05, lr_decay=0.01, weight_decay=1e-3),
], ids=["sgd-momentum", "sgd-nesterov", "sgd-maximize", "adamw-amsgrad", "adam-wd", "adagrad"])
def test_grouped_updates_are_the_per_parameter_updates_bit_for_bit(optimizer, monkeypatch):
    """All parameters' updates as one torch._foreach_* kernel: the same bits as one kernel per
    parameter (the grouped lowerings switched off)."""
    from anygrad.backends.torch import runtime
    grouped, _ = _train(TorchBackend("torch:cpu"), optimizer(), steps=3)
    exe = _train_program(grouped)
    assert sum(1 for a in exe.actions if len(a[1]) > 20) == 1  # one action takes every parameter
    monkeypatch.setattr(runtime, "GROUP_LOWERINGS", {})
    single, _ = _train(TorchBackend("torch:cpu"), optimizer(), steps=3)
    assert len(_train_program(single).actions) > len(exe.actions)
    _states_equal(grouped.full_state(), single.full_state())


class _ReplayGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay() runs the recorded body again on
    the same buffers (a real capture records its kernels instead)."""

    def __init__(self, body):
        self.body = body
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.body()


def test_graph_replay_keeps_state_metrics_and_rebinding_right(monkeypatch):
    """The CUDA-graph path's bookkeeping on the CPU (static state buffers updated in place,
    uploads copied in, host fallbacks first, a state rebound by set_state or another program
    copied back into its buffer): the same bits as the plain eager step."""
    from anygrad.backends.torch import runtime
    monkeypatch.setattr(runtime.TorchExecutable, "_graphs_on", staticmethod(lambda device: True))
    monkeypatch.setattr(runtime.TorchExecutable, "_record", lambda self, body: _ReplayGraph(body))
    runs = []
    for cuda_graph in (False, True):
        model = anygrad.load_onnx(FOUNDING_MODEL)
        model.compile(loss="nll", optimizer=anygrad.optim.SGD(lr=0.05, momentum=0.9), device=TorchBackend(
            "torch:cpu", cuda_graph=cuda_graph), seed=3)
        data = np.random.default_rng(0)
        losses, metrics = [], []
        for k in range(7):
            x = data.standard_normal((8, 1, 28, 28)).astype(np.float32)
            y = data.integers(0, 10, 8)
            if k == 4:
                model.lr = 0.01                       # set_state: a new tensor in the store
                metrics.append(model.read_metrics(reset=True))
                model.evaluate(x, y)                  # another program rebinds metric state
            losses.append(model.train_on_batch(x, y) if k % 2 else (model.train_step(x, y) or 0.0))
        metrics.append(model.read_metrics())
        runs.append((losses, metrics, model.full_state(), model.predict(x)))
        exe = _train_program(model)
        assert exe.cuda_graph == cuda_graph
        if cuda_graph:
            assert exe._graph["graph"].replays == 5  # captured on the third step
    (l0, m0, s0, p0), (l1, m1, s1, p1) = runs
    assert l0 == l1 and m0 == m1
    _states_equal(s0, s1)
    np.testing.assert_array_equal(p0, p1)


def test_batch_norm_grad_reuses_the_forward_statistics(monkeypatch):
    """BatchNormGrad takes the batch mean and variance its forward computed from the same tensor
    (one var_mean per BatchNorm per step, not two); the trajectory tests check the values."""
    model = anygrad.load_onnx(FOUNDING_MODEL).compile(loss="nll", optimizer=anygrad.optim.SGD(lr=0.1),
                                                      device=TorchBackend("torch:cpu"))
    x, y = np.zeros((4, 1, 28, 28), np.float32), np.arange(4)
    model.train_step(x, y)
    calls = []
    var_mean = torch.var_mean
    monkeypatch.setattr(torch, "var_mean", lambda *a, **k: calls.append(1) or var_mean(*a, **k))
    model.train_step(x, y)
    assert len(calls) == 2  # the founding CNN's two BatchNorms


def test_fused_batch_norm_trains_like_numpy_and_reuses_its_statistics(monkeypatch):
    """aten's fused batch norm (the GPU default; forced here on the CPU): the founding CNN's
    losses, weights, running statistics and metrics follow the numpy backend within float32
    noise of a few steps (the fused kernels compute per channel in float32, not double); the
    backward takes what the forward saved (PyTorch's implementation index, the mean and inverse
    deviation), computing no statistics."""
    monkeypatch.setenv("ANYGRAD_TORCH_FUSED_NORMS", "1")
    make = lambda: anygrad.optim.SGD(lr=0.05, momentum=0.9)
    ref, ref_losses = _train("cpu", make())
    calls = []
    backward = torch.ops.aten._batch_norm_impl_index_backward
    monkeypatch.setattr(torch.ops.aten, "_batch_norm_impl_index_backward",
                        lambda *a: calls.append(a[6] is not None) or backward(*a))
    monkeypatch.setattr(torch, "var_mean", lambda *a, **k: pytest.fail("statistics computed twice"))
    ours, losses = _train(TorchBackend("torch:cpu"), make())
    assert calls and all(calls)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    a, b = ref.full_state(), ours.full_state()
    for name in a:
        _close(b[name], a[name], name, atol=2e-4)
    assert ours.read_metrics() == pytest.approx(ref.read_metrics(), rel=1e-4)


# -- single ops and their gradients against the numpy backend ---------------------------------------
def _op_and_grads(op: str, inputs: list, attrs: dict | None = None, *, diff: tuple[int, ...] = (0,),
                  n_outputs: int = 1) -> tuple:
    """One op node, plus the backward pass of sum(out0 * R) with respect to the inputs in `diff`
    (graph inputs); the other inputs are graph inputs too (fed) unless None (absent)."""
    from anygrad.autodiff import gradients
    from anygrad.ir.builder import Builder
    from anygrad.ir.graph import Graph, Node, TensorInfo
    from anygrad.ir.passes import specialize
    g = Graph(name=op)
    names = []
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        names.append(f"in{i}")
        if isinstance(a, _Const):  # an initializer: known when the graph is compiled
            g.initializers[f"in{i}"] = a.value
        else:
            g.inputs.append(f"in{i}")
        g.info[f"in{i}"] = TensorInfo(np.asarray(a).dtype, np.shape(a))
    outs = [f"out{k}" for k in range(n_outputs)]
    g.nodes = [Node(op, names, outs, dict(attrs or {}), name="op")]
    g.outputs = list(outs)
    s = specialize(g, {})
    if diff:
        b = Builder(s, prefix="check")
        r = np.random.default_rng(7).standard_normal(b.shape("out0")).astype(b.dtype("out0"))
        loss = b.op("ReduceSum", [b.op("Mul", ["out0", b.const(r)])], keepdims=0)
        grads = gradients(s, loss, [f"in{i}" for i in diff])
        s.outputs = outs + [grads[f"in{i}"] for i in diff]
    feeds = {f"in{i}": np.asarray(a) for i, a in enumerate(inputs) if a is not None and not isinstance(a, _Const)}
    return s, feeds


class _Const:
    """An input of `_op_and_grads` given as a constant (pads, slice bounds), not fed."""

    def __init__(self, value):
        self.value = np.asarray(value)
        self.dtype, self.shape = self.value.dtype, self.value.shape

    def __array__(self, dtype=None, copy=None):
        return self.value


def _agrees_with_numpy(op: str, inputs: list, attrs: dict | None = None, *, diff: tuple[int, ...] = (0,),
                       n_outputs: int = 1, lowered: tuple[str, ...] = (), rtol: float = 1e-5,
                       atol: float = 1e-6) -> dict:
    """The graph of `_op_and_grads` on torch:cpu and on numpy: every node on a torch kernel (no
    fallback), the ops in `lowered` among them, and the same outputs (dtypes included)."""
    graph, feeds = _op_and_grads(op, inputs, attrs, diff=diff, n_outputs=n_outputs)
    exe = TorchBackend("torch:cpu").compile(graph)
    assert exe.fallback_ops == [], f"{op}: {exe.fallback_ops} ran on the numpy reference kernel"
    ops = {n.op for n in graph.nodes}
    assert set(lowered) <= ops, f"{op}: the graph has no {set(lowered) - ops}"
    ours, ref = exe.run(feeds), NumpyBackend().compile(graph).run(feeds)
    for name in graph.outputs:
        assert ours[name].dtype == ref[name].dtype, name
        np.testing.assert_allclose(ours[name], ref[name], rtol=rtol, atol=atol, err_msg=f"{op}: {name}")
    return ours


FLOATS = pytest.mark.parametrize("dtype", [np.float32, np.float64])


@FLOATS
@pytest.mark.parametrize("axis, epsilon, bias", [(-1, 1e-5, True), (1, 1e-3, False), (0, 1e-5, True),
                                                 (-2, 0.1, True)])
def test_layer_norm_runs_on_torch(dtype, axis, epsilon, bias):
    """Forward (y, mean, 1/std), dx, d scale and d bias: axis from the first to the last, one
    leading axis or none (axis 0: d scale and d bias are not summed at all), with and without bias."""
    r = np.random.default_rng(0)
    x = (3 * r.standard_normal((2, 3, 4)) + 1).astype(dtype)
    norm = x.shape[axis % 3:]
    scale = r.standard_normal(norm).astype(dtype)
    inputs = [x, scale, r.standard_normal(norm).astype(dtype) if bias else None]
    _agrees_with_numpy("LayerNormalization", inputs, {"axis": axis, "epsilon": epsilon},
                       diff=(0, 1, 2) if bias else (0, 1), n_outputs=3, lowered=("LayerNormGrad",))


@FLOATS
@pytest.mark.parametrize("axis, epsilon", [(-1, 1e-5), (1, 1e-3), (0, 1e-5)])
def test_rms_norm_runs_on_torch(dtype, axis, epsilon):
    """RMSNormalization's y, dx and d scale, with one leading axis or none (axis 0: d scale is not
    summed at all)."""
    r = np.random.default_rng(3)
    x = (3 * r.standard_normal((2, 3, 4)) + 1).astype(dtype)
    scale = r.standard_normal(x.shape[axis % 3:]).astype(dtype)
    _agrees_with_numpy("RMSNormalization", [x, scale], {"axis": axis, "epsilon": epsilon}, diff=(0, 1),
                       lowered=("RMSNormGrad",))


@pytest.mark.parametrize("axis, sign", [(-1, 1), (1, -1)])
def test_rotate_half_runs_on_torch(axis, sign):
    x = np.random.default_rng(4).standard_normal((2, 4, 6)).astype(np.float32)
    _agrees_with_numpy("RotateHalf", [x], {"axis": axis, "sign": sign}, diff=(0,))


def test_layer_norm_stash_type_double_keeps_float64_statistics():
    r = np.random.default_rng(1)
    x, scale = r.standard_normal((3, 5)).astype(np.float32), r.standard_normal(5).astype(np.float32)
    ours = _agrees_with_numpy("LayerNormalization", [x, scale], {"stash_type": 11}, diff=(), n_outputs=3)
    assert ours["out1"].dtype == np.float64


@FLOATS
def test_bce_with_logits_runs_on_torch(dtype):
    """Large logits of both signs (no overflow) and a target broadcast along the batch."""
    r = np.random.default_rng(2)
    x = (r.standard_normal((4, 3)) * np.array([1.0, 30.0, -60.0])).astype(dtype)
    y = r.uniform(0, 1, (1, 3)).astype(dtype)
    _agrees_with_numpy("BinaryCrossEntropyWithLogits", [x, y], diff=(0, 1),
                       lowered=("BinaryCrossEntropyWithLogitsGrad",))


@FLOATS
@pytest.mark.parametrize("op, attrs", [("HardSigmoid", {}), ("HardSigmoid", {"alpha": 1 / 6, "beta": 0.5}),
                                       ("HardSigmoid", {"alpha": 0.5, "beta": 0.25}), ("HardSwish", {})])
def test_hard_activations_run_on_torch(dtype, op, attrs):
    """Including the kinks themselves (x = ±3 for HardSwish, the ends of HardSigmoid's ramp)."""
    alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
    edges = [-3.0, 3.0] if op == "HardSwish" else [-beta / alpha, (1 - beta) / alpha]
    x = np.concatenate([np.linspace(-7, 7, 29), edges]).astype(dtype).reshape(1, -1)
    _agrees_with_numpy(op, [x], attrs, lowered=(f"{op}Grad",))


@FLOATS
@pytest.mark.parametrize("bounds", ["inputs", "min-input", "max-input", "attrs", "min-attr"])
def test_clip_grad_runs_on_torch(dtype, bounds):
    """Bounds as inputs (opset 11+, either one absent) or attributes (opset 6); x on the bounds
    themselves passes dy (inclusive, as PyTorch's clamp)."""
    x = np.array([[-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0]], dtype)
    lo, hi = np.array(-1.0, dtype), np.array(1.0, dtype)
    inputs, attrs = {"inputs": ([x, lo, hi], {}), "min-input": ([x, lo, None], {}), "max-input": ([x, None, hi], {}),
                     "attrs": ([x], {"min": -1.0, "max": 1.0}), "min-attr": ([x], {"min": -0.5})}[bounds]
    ours = _agrees_with_numpy("Clip", inputs, attrs, lowered=("ClipGrad",))
    (grad,) = (v for k, v in ours.items() if k != "out0")
    r = np.random.default_rng(7).standard_normal(x.shape)  # _op_and_grads's R (a float32 constant)
    given = inputs + [None, None]
    lo_ = attrs.get("min", -np.inf if given[1] is None else -1.0)
    hi_ = attrs.get("max", np.inf if given[2] is None else 1.0)
    np.testing.assert_allclose(grad, np.where((x >= lo_) & (x <= hi_), r, 0), rtol=1e-6)


@FLOATS
@pytest.mark.parametrize("axis, indices", [
    (0, np.array([[1, 4, 1], [0, 1, -1]])),    # repeated rows and a negative index (-1: the last)
    (1, np.array([2, -3, 2, 2])),              # a middle axis, repeated
    (2, np.array(1)),                          # a scalar index: the axis disappears
    (0, np.array([[3, 3], [3, 3]], np.int32)),  # int32 indices, all the same row
])
def test_gather_grad_runs_on_torch(dtype, axis, indices):
    r = np.random.default_rng(3)
    data = r.standard_normal((5, 4, 3)).astype(dtype)
    _agrees_with_numpy("Gather", [data, indices], {"axis": axis}, lowered=("GatherGrad",))


def test_embedding_grad_with_padding_idx_runs_on_torch():
    """nn.Embedding(padding_idx): the padding row gets no gradient (the graph masks dy first);
    GatherGrad on torch sums the repeated rows as numpy does, and PyTorch's own embedding agrees."""
    r = np.random.default_rng(4)
    table = r.standard_normal((6, 3)).astype(np.float32)
    ids = np.array([[1, 2, 1, 5], [1, 1, 0, 2]])
    ours = _agrees_with_numpy("Gather", [table, ids], {"axis": 0, "padding_idx": 1}, lowered=("GatherGrad",))
    weight = torch.tensor(table, requires_grad=True)
    out = torch.nn.functional.embedding(torch.tensor(ids), weight, padding_idx=1)
    rr = np.random.default_rng(7).standard_normal(out.shape).astype(np.float32)
    (out * torch.tensor(rr)).sum().backward()
    grad = next(v for k, v in ours.items() if k != "out0")
    np.testing.assert_allclose(grad, weight.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert not grad[1].any()


def test_gather_grad_is_deterministic_on_torch():
    """Many contributions to few rows, in float32: the same bits on every run."""
    r = np.random.default_rng(5)
    table = r.standard_normal((3, 8)).astype(np.float32)
    ids = r.integers(0, 3, (64, 16))
    graph, feeds = _op_and_grads("Gather", [table, ids], {"axis": 0})
    exe = TorchBackend("torch:cpu").compile(graph)
    first = exe.run(feeds)
    for _ in range(3):
        again = exe.run(feeds)
        for name in first:
            np.testing.assert_array_equal(again[name], first[name])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_is_nan_and_is_inf_run_on_torch(dtype):
    x = np.array([1.0, np.nan, np.inf, -np.inf, 0.0]) if dtype != np.int64 else np.arange(5)
    x = x.astype(dtype)
    for op, attrs in (("IsNaN", {}), ("IsInf", {}), ("IsInf", {"detect_negative": 0}),
                      ("IsInf", {"detect_positive": 0})):
        graph, feeds = _op_and_grads(op, [x], attrs, diff=())
        exe = TorchBackend("torch:cpu").compile(graph)
        # integers are never NaN nor infinite: those nodes may stay on the reference kernel
        assert exe.fallback_ops == ([] if dtype != np.int64 else [op])
        np.testing.assert_array_equal(exe.run(feeds)["out0"], NumpyBackend().compile(graph).run(feeds)["out0"])


# -- whole models: nothing but the RNG counter on the host ---------------------------------------------
def _host_nodes(exe) -> list[str]:
    """The nodes of a compiled step that run on a numpy reference kernel, except the RNG
    counter's uint32 increment (torch holds no uint32: that state stays a host array)."""
    from anygrad.backends.torch.sites import lower, node_site
    graph = exe.graph
    host = [n for n in graph.nodes if lower(node_site(graph, n)) is None]
    return [f"{n.op} {n.label}" for n in host
            if not (n.op == "Add" and graph.info[n.outputs[0]].dtype == np.uint32)]


def _three_steps(make, device, batches, loss: str):
    model = make().compile(loss=loss, optimizer=anygrad.optim.SGD(lr=0.05, momentum=0.9), device=device, seed=1)
    losses = [model.train_on_batch(x, y) for x, y in batches]
    return model, losses


def test_gpt_decoder_trains_on_torch_kernels_only():
    """benchmarks/models.py's GPT-style decoder (2 layers, batch 2): embeddings (GatherGrad),
    LayerNorm and its gradient, attention, GELU-tanh, cross-entropy all on torch kernels; the
    losses of three SGD steps are numpy's."""
    import sys
    sys.path.insert(0, str(TESTS.parent / "benchmarks"))
    from models import _gpt_module
    torch.manual_seed(0)
    module = _gpt_module(64, 8, 32, 4, 2).train()
    r = np.random.default_rng(0)
    batches = [(r.integers(0, 64, (2, 8)), r.integers(0, 64, (16,))) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make = lambda: anygrad.from_torch(module, torch.from_numpy(batches[0][0]), dynamo=False)
        ref_model, ref = _three_steps(make, "cpu", batches, "cross_entropy")
        model, ours = _three_steps(make, TorchBackend("torch:cpu"), batches, "cross_entropy")
    exe = _train_program(model)
    assert {"LayerNormGrad", "GatherGrad"} <= {n.op for n in exe.graph.nodes}
    assert _host_nodes(exe) == []
    np.testing.assert_allclose(ours, ref, rtol=2e-5)
    for name, value in ref_model.full_state().items():
        _close(model.full_state()[name], value, name)


def test_founding_cnn_trains_on_torch_kernels_only():
    r = np.random.default_rng(0)
    batches = [(r.standard_normal((4, 1, 28, 28)).astype(np.float32), r.integers(0, 10, 4)) for _ in range(3)]
    make = lambda: anygrad.load_onnx(FOUNDING_MODEL)
    _, ref = _three_steps(make, "cpu", batches, "nll")
    model, ours = _three_steps(make, TorchBackend("torch:cpu"), batches, "nll")
    assert _host_nodes(_train_program(model)) == []
    np.testing.assert_allclose(ours, ref, rtol=2e-5)


@pytest.mark.parametrize("shared", [False, True], ids=["fused", "matmul-read-twice"])
def test_linear_bias_runs_in_the_matmul(shared):
    """MatMul + Add(1-D bias) on a (batch, tokens, d) input is one addmm step, with the numpy
    backend's outputs and gradients; a matmul output that something else reads stays apart."""
    from anygrad.backends.torch.runtime import TorchExecutable
    from anygrad.ir.graph import Graph, Node, TensorInfo
    rng = np.random.default_rng(6)
    g = Graph(name="linear")
    g.inputs = ["x"]
    g.info["x"] = TensorInfo(np.dtype(np.float32), (2, 3, 4))
    g.initializers = {"w": rng.standard_normal((4, 5)).astype(np.float32),
                      "b": rng.standard_normal(5).astype(np.float32)}
    g.nodes = [Node("MatMul", ["x", "w"], ["mm"], name="mm"), Node("Add", ["mm", "b"], ["y"], name="add")]
    g.outputs = ["y"] + (["mm"] if shared else [])
    from anygrad.ir.passes import specialize
    s = specialize(g, {})
    exe = TorchBackend("torch:cpu").compile(s)
    assert isinstance(exe, TorchExecutable)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    got = exe.run({"x": x}, fetch=["y"])["y"]
    np.testing.assert_allclose(got, x @ g.initializers["w"] + g.initializers["b"], rtol=1e-5, atol=1e-6)
    assert ("MatMul+Add" in exe.step_ops) != shared and ("MatMul" in exe.step_ops) == shared


@FLOATS
@pytest.mark.parametrize("op, axis", [("Softmax", -1), ("Softmax", 1), ("LogSoftmax", -1)])
def test_softmax_gradients_run_on_torch(dtype, op, axis):
    """SoftmaxGrad (aten's one-kernel backward) and LogSoftmaxGrad against the numpy reference."""
    x = np.random.default_rng(4).standard_normal((3, 4, 6)).astype(dtype) * 3
    _agrees_with_numpy(op, [x], {"axis": axis}, lowered=(op + "Grad",))


@FLOATS
def test_tanhshrink_runs_on_torch(dtype):
    """The op added in three source files (ops/elementwise.py, the wgpu and the torch kernels)."""
    x = np.linspace(-6, 6, 25).astype(dtype).reshape(5, 5)
    _agrees_with_numpy("Tanhshrink", [x], lowered=("TanhshrinkGrad",))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted, ignore, log_input", [(False, None, 0), (True, None, 0), (False, 2, 0),
                                                          (True, 0, 1), (False, None, 1)])
@pytest.mark.parametrize("spatial", [False, True])
def test_class_losses_and_gradients_run_on_torch(reduction, weighted, ignore, log_input, spatial):
    """Cross-entropy and NLL on aten's NLL kernels: loss and gradient (through log-softmax's
    backward) with class weights, an ignored class, per-position targets (N, C, d)."""
    r = np.random.default_rng(3)
    shape = (4, 5, 3) if spatial else (6, 5)
    x = (2 * r.standard_normal(shape)).astype(np.float32)
    if log_input:
        x = (x - np.log(np.exp(x).sum(axis=1, keepdims=True))).astype(np.float32)
    target = r.integers(0, 5, (shape[0],) + shape[2:]).astype(np.int64)
    target.flat[0] = 2  # one ignored position at least, when ignoring class 2
    weight = r.uniform(0.5, 2, 5).astype(np.float32) if weighted else None
    attrs = {"reduction": reduction, "log_input": log_input} | ({"ignore_index": ignore} if ignore is not None else {})
    _agrees_with_numpy("CrossEntropy", [x, target, weight], attrs, lowered=("CrossEntropyGrad",))
    attrs.pop("log_input")
    _agrees_with_numpy("CrossEntropyMetrics", [x, target, weight], attrs | {"k": 3}, n_outputs=4,
                       lowered=("CrossEntropyGrad",))


def test_class_loss_with_every_target_ignored_runs_on_torch():
    """The mean over no sample is nan (0/0), its gradient zero, as in PyTorch and the reference."""
    x = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    ours = _agrees_with_numpy("CrossEntropy", [x, np.full(3, 1), None], {"ignore_index": 1})
    loss, grad = ours.pop("out0"), list(ours.values())
    assert np.isnan(loss) and len(grad) == 1 and grad[0].shape == x.shape and not grad[0].any()


@FLOATS
@pytest.mark.parametrize("mode, pads", [("constant", [1, 0, 2, 1, 0, 3]), ("constant", [0, -1, 1, 0, 1, -2]),
                                        ("reflect", [0, 2, 1, 0, 1, 2]), ("edge", [1, 0, 3, 0, 2, 1]),
                                        ("wrap", [0, 1, 2, 0, 3, 1])])
def test_pad_and_its_gradient_run_on_torch(dtype, mode, pads):
    """Pad (negative amounts crop) and PadGrad on torch kernels, every mode."""
    x = np.random.default_rng(5).standard_normal((2, 3, 4)).astype(dtype)
    _agrees_with_numpy("Pad", [x, _Const(np.array(pads, np.int64)), _Const(np.array(1.5, dtype))], {"mode": mode},
                       lowered=("PadGrad",))


@FLOATS
@pytest.mark.parametrize("starts, ends, axes, steps", [([1, 0], [3, 5], [0, 2], [1, 2]),
                                                       ([-1, 4], [-4, 0], [1, 2], [-1, -2]),
                                                       ([0], [2], [1], [1])])
def test_slice_gradient_runs_on_torch(dtype, starts, ends, axes, steps):
    """SliceGrad: steps of 1, 2 and negative ones."""
    x = np.random.default_rng(6).standard_normal((4, 5, 6)).astype(dtype)
    _agrees_with_numpy("Slice", [x] + [_Const(np.array(v, np.int64)) for v in (starts, ends, axes, steps)],
                       lowered=("SliceGrad",))


@FLOATS
@pytest.mark.parametrize("shape, attrs", [
    ((2, 3, 6, 7), {"kernel_shape": [2, 3], "strides": [2, 1]}),
    ((2, 3, 6, 7), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ((2, 3, 6, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 3, 9), {"kernel_shape": [3], "strides": [2]}),
    ((1, 2, 4, 5, 6), {"kernel_shape": [2, 2, 3], "strides": [2, 1, 2]})])
def test_average_pool_gradient_runs_on_torch(dtype, shape, attrs):
    x = np.random.default_rng(7).standard_normal(shape).astype(dtype)
    _agrees_with_numpy("AveragePool", [x], attrs, lowered=("AveragePoolGrad",))


@FLOATS
@pytest.mark.parametrize("op, shape, groups, per_group", [("InstanceNormalization", (2, 3, 4, 5), None, False),
                                                          ("InstanceNormalization", (3, 4, 6), None, False),
                                                          ("GroupNormalization", (2, 6, 3, 2), 3, False),
                                                          ("GroupNormalization", (2, 6, 5), 2, True)])
def test_group_and_instance_norm_run_on_torch(dtype, op, shape, groups, per_group, monkeypatch):
    """Forward and GroupNormGrad (dx, d scale, d bias) on aten's fused group-norm kernels, per-
    channel and per-group (opset 18-20) parameters; with the forward's statistics (memo) and
    without (as torch.compile's executables, which share none): the same bits."""
    from anygrad.backends.torch import runtime
    r = np.random.default_rng(8)
    x = (2 * r.standard_normal(shape) + 0.5).astype(dtype)
    n = groups if per_group else shape[1]
    params = [r.standard_normal(n).astype(dtype) for _ in range(2)]
    attrs = {"epsilon": 1e-3} | ({"num_groups": groups} if groups else {})
    ours = _agrees_with_numpy(op, [x, *params], attrs, diff=(0, 1, 2), lowered=("GroupNormGrad",))
    graph, feeds = _op_and_grads(op, [x, *params], attrs, diff=(0, 1, 2))
    site = runtime.node_site
    monkeypatch.setattr(runtime, "node_site", lambda graph, node, memo=None, producers=None: site(graph, node, None, producers))
    for name, value in TorchBackend("torch:cpu").compile(graph).run(feeds).items():
        np.testing.assert_array_equal(value, ours[name], err_msg=name)


def test_an_f16_linear_rounds_once_as_autocast_does():
    """Under precision='f16' a Gemm with a bias is addmm, as F.linear under autocast: a @ b + c
    rounded to float16 once (apart, the product and the sum each rounded, 652.572 against 652.634)."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(8, 8) * 30, torch.randn(8, 3) * 30
    with torch.autocast("cpu", dtype=torch.float16):
        want = F.mse_loss(net(x).float(), y).item()
    m = anygrad.from_torch(net, torch.zeros(4, 8))
    m.compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.0), device="torch:cpu", precision="f16")
    assert m.train_on_batch(x.numpy(), y.numpy()) == pytest.approx(want, rel=1e-7)
