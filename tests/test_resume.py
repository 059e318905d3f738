"""`anygrad train --resume`: a run killed (SIGKILL) or interrupted (Ctrl-C) and resumed ends with the
very same bytes as an uninterrupted run on the CPU; bad checkpoints are clear errors."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from anygrad import cli
from anygrad.data import write_idx
from anygrad.data.mnist import MNIST_FILES


def _mlp(path: Path, hidden: int = 32, seed: int = 0) -> Path:
    """784 -> hidden -> Dropout(0.2) -> 10 over (N, 1, 28, 28): dropout makes the RNG counter matter."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.array([-1, 784], np.int64), "shape"),
             numpy_helper.from_array((rng.standard_normal((hidden, 784)) * 0.05).astype(np.float32), "fc1.weight"),
             numpy_helper.from_array(np.zeros(hidden, np.float32), "fc1.bias"),
             numpy_helper.from_array(np.array(0.2, np.float32), "ratio"),
             numpy_helper.from_array((rng.standard_normal((10, hidden)) * 0.2).astype(np.float32), "fc2.weight"),
             numpy_helper.from_array(np.zeros(10, np.float32), "fc2.bias")]
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["flat"]),
             helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Dropout", ["r", "ratio"], ["d"]),
             helper.make_node("Gemm", ["d", "fc2.weight", "fc2.bias"], ["logits"], transB=1)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 28, 28])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Synthetic MNIST-format files, 3,000 train / 300 test (class = brightness band)."""
    folder = tmp_path_factory.mktemp("synthetic-mnist")
    rng = np.random.default_rng(0)
    for split, n in (("train", 3000), ("test", 300)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = (rng.integers(0, 20, (n, 28, 28)) + y[:, None, None] * 23).astype(np.uint8)
        write_idx(folder / f"{MNIST_FILES['x_' + split].name}.gz", x)
        write_idx(folder / f"{MNIST_FILES['y_' + split].name}.gz", y)
    return folder


def _args(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", str(model), "--data-dir", str(data), "--device", "cpu", "--epochs", "3", "--batch-size", "16",
            "--optimizer", "adam", "--lr", "0.002", "--accumulate", "2", "--clip-grad-norm", "5",
            "--scheduler", "cosine", "--scheduler-opt", "T_max=3", "--checkpoint-every", "7", "--seed", "3",
            "--artifacts", str(run), "--quiet", *extra]


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "anygrad.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for_checkpoint(proc: subprocess.Popen, run: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list((run / "checkpoints").glob("ckpt-*.json")):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)


def _weights(run: Path) -> dict[str, bytes]:
    with np.load(run / "weights.npz", allow_pickle=False) as z:
        return {k: z[k].tobytes() for k in z.files}


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("seconds", "samples_per_s")} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> tuple[Path, Path]:
    """The uninterrupted run."""
    tmp = tmp_path_factory.mktemp("reference")
    model = _mlp(tmp / "mlp.onnx")
    run = tmp / "run"
    r = subprocess.run([sys.executable, "-m", "anygrad.cli", *_args(model, data, run)], capture_output=True, check=False,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return model, run


def _final_checkpoint_state(run: Path) -> dict[str, bytes]:
    latest = max((run / "checkpoints").glob("ckpt-*.npz"))
    with np.load(latest, allow_pickle=False) as z:
        return {k: z[k].tobytes() for k in z.files if not k.startswith("anygrad.metric")}


def test_resume_after_sigkill_is_bit_identical(tmp_path, data, reference):
    model, ref = reference
    run = tmp_path / "run"
    proc = _spawn(_args(model, data, run))
    _wait_for_checkpoint(proc, run)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert len(_rows(run)) < 3 if (run / "metrics.jsonl").exists() else True  # killed before the end

    r = subprocess.run([sys.executable, "-m", "anygrad.cli", "train", "--resume", str(run), "--quiet"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _weights(run) == _weights(ref)  # byte for byte
    assert _final_checkpoint_state(run) == _final_checkpoint_state(ref)  # optimizer state, lr, step, RNG too
    assert _rows(run) == _rows(ref)


def test_ctrl_c_checkpoints_and_says_how_to_resume(tmp_path, data, reference):
    model, ref = reference
    run = tmp_path / "run"
    proc = _spawn(_args(model, data, run))
    _wait_for_checkpoint(proc, run)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert f"anygrad train --resume {run}" in out and "Traceback" not in out
    assert cli.main(["train", "--resume", str(run), "--quiet"]) == 0
    assert _weights(run) == _weights(ref)


# -- errors ----------------------------------------------------------------------------------------------
@pytest.fixture
def finished(tmp_path, data) -> tuple[Path, Path]:
    model = _mlp(tmp_path / "mlp.onnx")
    run = tmp_path / "run"
    assert cli.main(["train", str(model), "--data-dir", str(data), "--device", "cpu", "--epochs", "1",
                     "--batch-size", "500", "--artifacts", str(run), "--quiet"]) == 0
    return model, run


def _error(capsys, args: list[str]) -> str:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error:") and "Traceback" not in err
    return err


def test_resume_extends_a_finished_run(finished):
    _model, run = finished
    assert cli.main(["train", "--resume", str(run), "--epochs", "2", "--quiet"]) == 0
    assert [r["epoch"] for r in _rows(run)] == [1, 2]


def test_checkpoint_of_another_model(finished, capsys):
    model, run = finished
    _mlp(model, hidden=24)  # the file the run names now holds another network
    err = _error(capsys, ["train", "--resume", str(run), "--epochs", "2"])
    assert "another model" in err and "ckpt-" in err


def test_corrupt_checkpoint(finished, capsys):
    _, run = finished
    npz = max((run / "checkpoints").glob("ckpt-*.npz"))
    npz.write_bytes(npz.read_bytes()[:-100])
    assert "corrupt" in _error(capsys, ["train", "--resume", str(run), "--epochs", "2"])
    npz.with_suffix(".json").write_text("{not json")
    assert "corrupt" in _error(capsys, ["train", "--resume", str(run), "--epochs", "2"])


def test_settings_that_do_not_match(finished, capsys):
    _, run = finished
    err = _error(capsys, ["train", "--resume", str(run), "--epochs", "2", "--batch-size", "100"])
    assert "different settings" in err and "batch_size 500" in err


def test_nothing_to_resume(tmp_path, capsys):
    assert "not a training run folder" in _error(capsys, ["train", "--resume", str(tmp_path)])


def test_sigint_mid_epoch_checkpoints_that_step_and_resumes_it(tmp_path, data):
    """In process: SIGINT during step 3 of epoch 1 finishes that step, writes a checkpoint of
    exactly that point (no earlier one exists), says how to resume, and the resumed run ends
    where an uninterrupted one does."""
    import anygrad
    from anygrad.optim import get_optimizer
    from anygrad.train import LineReporter, TrainConfig, fit
    from anygrad.train import checkpoint as ckpt

    model_path = _mlp(tmp_path / "mlp.onnx", hidden=8)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 40).astype(np.int64)

    def model():
        return anygrad.load_onnx(str(model_path)).compile("cross_entropy", get_optimizer("adam", lr=0.01), "cpu",
                                                          seed=5)

    messages: list[str] = []

    class CtrlC(LineReporter):
        def step(self, info):
            if info.epoch == 1 and info.step == 3:
                os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C would

    config = TrainConfig(epochs=2, batch_size=8, log_every=1, seed=5, artifacts_dir=str(tmp_path / "run"))
    result = fit(model(), (x, y), (x, y), config, reporter=CtrlC(messages.append))
    assert result.interrupted and len(result.history) == 0
    assert f"continue with: anygrad train --resume {tmp_path / 'run'}" in messages[-1]
    meta = ckpt.read(ckpt.latest(tmp_path / "run" / "checkpoints")).meta
    assert (meta["epoch"], meta["step"], meta["global_step"]) == (1, 3, 3)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back

    resumed = model()
    fit(resumed, (x, y), (x, y), config, reporter=LineReporter(None), resume=True)
    straight = model()
    fit(straight, (x, y), (x, y), _with_dir(config, tmp_path / "straight"), reporter=LineReporter(None))
    for name, value in straight.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value)


def _with_dir(config, path: Path):
    import dataclasses
    return dataclasses.replace(config, artifacts_dir=str(path))


# -- an early-stopped run stays stopped on resume, unless a larger --patience lets it go on ------------------
def test_resuming_an_early_stopped_run(tmp_path, monkeypatch):
    from test_learner import _scripted

    import anygrad
    from anygrad.optim import get_optimizer
    from anygrad.train import TrainConfig, fit
    from anygrad.train import checkpoint as ckpt

    _scripted(monkeypatch, [1.0, 0.9, 0.95, 0.97, 0.8, 0.7, 0.6, 0.5])  # best at 2; 2 bad epochs stop patience 2
    model_path = _mlp(tmp_path / "mlp.onnx", hidden=8)
    rng = np.random.default_rng(2)
    data = rng.standard_normal((16, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int64)
    run = tmp_path / "run"

    def train(resume: bool, **settings) -> tuple:
        model = anygrad.load_onnx(str(model_path)).compile("cross_entropy", get_optimizer("sgd", lr=0.01), "cpu")
        messages: list[str] = []
        config = TrainConfig(**{"epochs": 6, "batch_size": 8, "patience": 2, "artifacts_dir": str(run), **settings})
        result = fit(model, data, data, config, log=messages.append, resume=resume)
        return result, messages

    result, messages = train(False)
    assert result.stopped_early and [m.epoch for m in result.history] == [1, 2, 3, 4]
    assert ckpt.read(ckpt.latest(run / "checkpoints")).meta["stopped_early"] is True
    weights = (run / "weights.npz").read_bytes()

    for settings in ({}, {"epochs": 10}):  # the same run, or only longer: still stopped, nothing trained
        result, messages = train(True, **settings)
        assert result.stopped_early and [m.epoch for m in result.history] == [1, 2, 3, 4]
        assert any("already stopped early at epoch 4" in m and "larger --patience" in m for m in messages)
        assert (run / "weights.npz").read_bytes() == weights and len((run / "metrics.jsonl").read_text().splitlines()) == 4

    result, messages = train(True, patience=3)  # one more bad epoch allowed: epoch 5 improves, and on
    assert not result.stopped_early and [m.epoch for m in result.history] == [1, 2, 3, 4, 5, 6]
    assert not any("already stopped" in m for m in messages)
