"""The `anygrad` command: info, train, devices, and one-line errors (never a traceback)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from anygrad import cli
from anygrad.data import write_idx
from anygrad.data.mnist import MNIST_FILES
from anygrad.examples import FOUNDING_MODEL

REPO = Path(__file__).resolve().parents[1]
SUBSET = REPO.parent / "shared/datasets/mnist-subset"


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real console entry point in a fresh process (what a user sees, tracebacks included)."""
    return subprocess.run([sys.executable, "-c", "import sys; from anygrad.cli import main; sys.exit(main())", *args],
                          check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def _mlp(path: Path, log_softmax: bool = False, extra_op: str | None = None, seed: int = 0) -> Path:
    """An ONNX MLP over (N, 1, 28, 28), built with onnx.helper (no PyTorch involved)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.array([-1, 784], np.int64), "shape"),
             numpy_helper.from_array((rng.standard_normal((32, 784)) * 0.05).astype(np.float32), "fc1.weight"),
             numpy_helper.from_array(np.zeros(32, np.float32), "fc1.bias"),
             numpy_helper.from_array((rng.standard_normal((10, 32)) * 0.2).astype(np.float32), "fc2.weight"),
             numpy_helper.from_array(np.zeros(10, np.float32), "fc2.bias")]
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["flat"]),
             helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["logits"], transB=1)]
    out = "logits"
    if log_softmax:
        nodes.append(helper.make_node("LogSoftmax", ["logits"], ["logp"], axis=1))
        out = "logp"
    if extra_op:
        nodes.append(helper.make_node(extra_op, [out], ["odd"]))
        nodes.append(helper.make_node(extra_op, ["odd"], ["odd2"]))
        out = "odd2"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 28, 28])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory) -> Path:
    """50 train / 20 test images in the four standard files (class = brightness band, learnable)."""
    folder = tmp_path_factory.mktemp("tiny-mnist")
    rng = np.random.default_rng(0)
    for split, n in (("train", 50), ("test", 20)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = (rng.integers(0, 20, (n, 28, 28)) + y[:, None, None] * 23).astype(np.uint8)
        write_idx(folder / f"{MNIST_FILES['x_' + split].name}.gz", x)
        write_idx(folder / f"{MNIST_FILES['y_' + split].name}.gz", y)
    return folder


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/"


def _torch_parameter_count() -> int:
    torch = pytest.importorskip("torch")  # noqa: F841
    sys.path.insert(0, str(REPO / "examples" / "mnist"))
    try:
        from model import Net
    finally:
        sys.path.pop(0)
    return sum(p.numel() for p in Net().parameters())


# -- info -------------------------------------------------------------------------------------------
def test_info_founding_model(capsys):
    code = cli.main(["info", str(FOUNDING_MODEL)])
    out = capsys.readouterr().out
    for op in ("Conv", "Gemm", "Relu", "BatchNormalization", "Dropout", "LogSoftmax"):
        assert op in out
    assert "input" in out and "log_probs" in out and "28, 28" in out
    assert f"parameters: {_torch_parameter_count():,}" in out
    assert "unsupported ops: none" in out
    assert code == 0


def test_info_counts_ops(tmp_path, capsys):
    assert cli.main(["info", str(_mlp(tmp_path / "mlp.onnx"))]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert ["Gemm", "2"] in lines and ["Relu", "1"] in lines and ["Reshape", "1"] in lines
    assert f"parameters: {784 * 32 + 32 + 32 * 10 + 10:,}" in out


def test_info_lists_unsupported_ops_and_fails(tmp_path, capsys):
    path = _mlp(tmp_path / "odd.onnx", extra_op="FrobnicateOp")
    assert cli.main(["info", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FrobnicateOp (2 nodes)" in out and "not supported" in out
    assert "Gemm" in out  # the rest of the summary is still shown


def test_truncated_onnx_is_one_line_error(tmp_path):
    path = tmp_path / "cut.onnx"
    path.write_bytes(FOUNDING_MODEL.read_bytes()[:3000])
    for args in (["info", str(path)], ["train", str(path), "--data-dir", str(tmp_path), "--device", "cpu"]):
        r = run_cli(*args)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr + r.stdout
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("anygrad: error:") and "cut.onnx" in lines[0]


def test_missing_model_file(tmp_path, capsys):
    assert cli.main(["info", str(tmp_path / "nothere.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error:") and "nothere.onnx" in err


# -- train: errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("option, value, words", [
    ("--optimizer", "adamx", ["unknown optimizer", "adamx", "adagrad"]),
    ("--loss", "hinge", ["unknown loss", "hinge", "nll"]),
    ("--device", "tpu", ["unknown device", "tpu"]),
    ("--dataset", "svhn", ["unknown dataset", "svhn", "mnist"]),  # (cifar is cifar-10 now)
    ("--epochs", "0", ["epochs", "at least 1"]),
    ("--batch-size", "0", ["batch", "at least 1"]),
])
def test_bad_option_values(tmp_path, tiny_mnist, capsys, option, value, words):
    code = cli.main(["train", str(_mlp(tmp_path / "m.onnx")), "--data-dir", str(tiny_mnist), "--device", "cpu",
                     "--artifacts", str(tmp_path / "run"), option, value])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("anygrad: error:")
    for w in words:
        assert w in err


def test_missing_data_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ANYGRAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ANYGRAD_MNIST_MIRRORS", _closed_port_url())
    code = cli.main(["train", str(_mlp(tmp_path / "m.onnx")), "--device", "cpu", "--artifacts", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("anygrad: error:")
    assert "could not download" in err and "--data-dir" in err and str(tmp_path / "cache" / "mnist") in err
    assert "train-images-idx3-ubyte.gz" in err
    assert not (tmp_path / "r").exists()  # nothing written for a run that never started


def test_data_dir_without_files(tmp_path, capsys):
    code = cli.main(["train", str(_mlp(tmp_path / "m.onnx")), "--data-dir", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "t10k-labels-idx1-ubyte" in err and str(tmp_path) in err


def test_keyboard_interrupt_is_caught(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setitem(cli.COMMANDS, "devices", cli.Command("x", lambda p: None, interrupted))
    assert cli.main(["devices"]) == 2
    assert capsys.readouterr().err.strip() == "anygrad: error: interrupted"


# -- train: runs ----------------------------------------------------------------------------------------
def test_train_writes_artifacts(tmp_path, tiny_mnist, capsys):
    model = _mlp(tmp_path / "mlp.onnx")
    run = tmp_path / "run"
    code = cli.main(["train", str(model), "--data-dir", str(tiny_mnist), "--device", "cpu", "--epochs", "2",
                     "--batch-size", "16", "--optimizer", "sgd", "--lr", "0.05", "--seed", "3",
                     "--artifacts", str(run)])
    out = capsys.readouterr().out
    assert code == 0
    assert "epoch 1/2" in out and "epoch 2/2" in out and str(run) in out
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json", "metrics.csv", "metrics.jsonl",
                                                     "model.onnx", "weights.npz", "weights.safetensors"]

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r) == {"epoch", "train_loss", "train_accuracy", "valid_loss", "valid_accuracy", "seconds",
                          "train_top5", "valid_top5", "lr", "samples_per_s"}
        assert 0 <= r["valid_accuracy"] <= 1 and np.isfinite(r["train_loss"])

    config = json.loads((run / "config.json").read_text())
    for key, value in {"epochs": 2, "batch_size": 16, "optimizer": "sgd", "lr": 0.05, "seed": 3, "device": "cpu",
                       "loss": "cross_entropy", "init": "onnx", "dataset": "mnist", "drop_last": False}.items():
        assert config[key] == value, key
    assert config["data_dir"] == str(tiny_mnist)

    weights = np.load(run / "weights.npz")
    assert set(weights.files) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer}
    assert not np.allclose(weights["fc1.weight"], original["fc1.weight"])  # it trained

    # model.onnx holds the trained weights: onnxruntime reproduces the same function
    ort = pytest.importorskip("onnxruntime")
    x = np.random.default_rng(0).standard_normal((5, 1, 28, 28)).astype(np.float32)
    sess = ort.InferenceSession(str(run / "model.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    h = np.maximum(x.reshape(5, 784) @ weights["fc1.weight"].T + weights["fc1.bias"], 0)
    np.testing.assert_allclose(got, h @ weights["fc2.weight"].T + weights["fc2.bias"], rtol=1e-4, atol=1e-4)


def test_train_is_reproducible_and_seeded(tmp_path, tiny_mnist, capsys):
    def train(seed: int, name: str) -> list[dict]:
        args = ["train", str(_mlp(tmp_path / "mlp.onnx")), "--data-dir", str(tiny_mnist), "--device", "cpu",
                "--epochs", "2", "--batch-size", "8", "--seed", str(seed), "--artifacts", str(tmp_path / name)]
        assert cli.main(args) == 0
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in ("seconds", "samples_per_s")} for r in rows]
    assert train(1, "a") == train(1, "b")
    assert train(1, "a") != train(2, "c")


def test_auto_loss_follows_log_softmax(tmp_path, tiny_mnist):
    run = tmp_path / "run"
    assert cli.main(["train", str(_mlp(tmp_path / "m.onnx", log_softmax=True)), "--data-dir", str(tiny_mnist),
                     "--device", "cpu", "--artifacts", str(run), "--quiet"]) == 0
    assert json.loads((run / "config.json").read_text())["loss"] == "nll"


def test_founding_defaults(tmp_path, tiny_mnist):
    run = tmp_path / "run"
    assert cli.main(["train", "--data-dir", str(tiny_mnist), "--device", "cpu", "--epochs", "1",
                     "--artifacts", str(run), "--quiet"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert {k: config[k] for k in ("optimizer", "lr", "batch_size", "loss")} == \
        {"optimizer": "adagrad", "lr": 1.0, "batch_size": 1000, "loss": "nll"}
    assert Path(config["model"]).name == "mnist.onnx"


def test_default_artifacts_folder(tmp_path, tiny_mnist, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", str(_mlp(tmp_path / "net.onnx")), "--data-dir", str(tiny_mnist), "--device", "cpu",
                     "--quiet"]) == 0
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("net-") and (runs[0] / "metrics.jsonl").is_file()


# -- devices ---------------------------------------------------------------------------------------------
def test_devices_lists_cpu(capsys):
    assert cli.main(["devices"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "cpu (numpy)"


def test_version_and_help():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("anygrad ")
    r = run_cli("train", "--help")
    assert r.returncode == 0 and "adagrad" in r.stdout and "--data-dir" in r.stdout


# -- README and CI agree ---------------------------------------------------------------------------------
def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [block.split("\n", 1)[1].strip() for block in setup.split("```bash")[1:]]


def test_readme_setup_commands_and_ci_agree():
    install, tests = (c.split("```")[0].strip() for c in _readme_commands())
    assert "\n" not in install and "\n" not in tests  # each one line
    assert "anygrad train" in install and "pytest" in tests
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == tests  # CI runs exactly README's test command
    # the CPU build of torch goes in before the test extras, or pip pulls the CUDA build
    assert tests.index("pip install torch==") < tests.index('pip install -e ".[test]"')


def _has_wgpu_adapter() -> bool:
    from wgpu_util import has_adapter
    return has_adapter()  # no adapter: skipped, or failed when ANYGRAD_REQUIRE_WGPU=1 (CI)


@pytest.mark.wgpu
def test_train_on_wgpu_matches_cpu(tmp_path, tiny_mnist):
    if not _has_wgpu_adapter():
        pytest.skip("no WebGPU adapter (install mesa-vulkan-drivers for lavapipe)")
    rows = {}
    for device in ("cpu", "wgpu"):
        run = tmp_path / device
        assert cli.main(["train", str(_mlp(tmp_path / "m.onnx")), "--data-dir", str(tiny_mnist), "--device", device,
                         "--epochs", "2", "--batch-size", "16", "--artifacts", str(run), "--quiet"]) == 0
        rows[device] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows["cpu"], rows["wgpu"]):
        for key in ("train_loss", "train_accuracy", "valid_loss", "valid_accuracy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
