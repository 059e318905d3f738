"""anygrad plot / predict / eval and anygrad.inference, checked against onnxruntime."""
from __future__ import annotations

import builtins
import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from anygrad import cli
from anygrad.data import write_idx
from anygrad.data.mnist import MNIST_FILES, normalize
from anygrad.errors import AnygradError, ConfigError, ModelError
from anygrad.inference import evaluate, load_model, output_kind, probabilities, resolve_model

N_TEST = 40


def _mlp(path: Path, last: str | None = "LogSoftmax", seed: int = 0) -> Path:
    """An ONNX MLP over (N, 1, 28, 28) built with onnx.helper; `last`: LogSoftmax, Softmax or None."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.array([-1, 784], np.int64), "shape"),
             numpy_helper.from_array((rng.standard_normal((16, 784)) * 0.1).astype(np.float32), "fc1.weight"),
             numpy_helper.from_array(np.zeros(16, np.float32), "fc1.bias"),
             numpy_helper.from_array((rng.standard_normal((10, 16)) * 0.5).astype(np.float32), "fc2.weight"),
             numpy_helper.from_array(np.zeros(10, np.float32), "fc2.bias")]
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["flat"]),
             helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["logits" if last else "y"], transB=1)]
    if last:
        nodes.append(helper.make_node(last, ["logits"], ["y"], axis=1))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 28, 28])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def _ort(path: Path, x: np.ndarray, weights: dict[str, np.ndarray] | None = None) -> np.ndarray:
    model = onnx.load(path)
    if weights:
        for init in model.graph.initializer:
            if init.name in weights:
                init.CopyFrom(numpy_helper.from_array(weights[init.name], init.name))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.astype(np.float32)})[0]


@pytest.fixture
def mnist_dir(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A tiny MNIST-format folder: 20 train and N_TEST test images."""
    rng = np.random.default_rng(11)
    folder = tmp_path / "mnist"
    folder.mkdir()
    x_test = rng.integers(0, 256, (N_TEST, 28, 28), dtype=np.uint8)
    y_test = rng.integers(0, 10, N_TEST).astype(np.uint8)
    arrays = {"x_train": rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
              "y_train": rng.integers(0, 10, 20).astype(np.uint8), "x_test": x_test, "y_test": y_test}
    for role, f in MNIST_FILES.items():
        write_idx(folder / f"{f.name}.gz", arrays[role])
    return folder, x_test, y_test.astype(np.int64)


# -- plot -----------------------------------------------------------------------------------------
def _metrics(run: Path, accuracy: bool = True) -> None:
    rows = [{"epoch": e, "train_loss": 1.0 / e, "valid_loss": 1.2 / e, "seconds": 1.0,
             **({"train_accuracy": 0.5 + e / 20, "valid_accuracy": 0.45 + e / 20} if accuracy else {})}
            for e in range(1, 6)]
    rows[2]["valid_loss"] = None  # a diverged validation is written as null
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_writes_loss_and_accuracy_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg
    run = tmp_path / "run"
    _metrics(run)
    assert cli.main(["plot", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run / 'loss.png'}" in out and f"wrote {run / 'accuracy.png'}" in out
    for name in ("loss.png", "accuracy.png"):
        data = (run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(run / name)
        assert img.shape[0] >= 300 and img.shape[1] >= 500 and img[..., :3].std() > 0.05  # not blank
    other = tmp_path / "elsewhere"
    assert cli.main(["plot", str(run / "metrics.jsonl"), "-o", str(other)]) == 0
    assert sorted(p.name for p in other.iterdir()) == ["accuracy.png", "loss.png"]
    regression = tmp_path / "reg"
    _metrics(regression, accuracy=False)
    assert cli.main(["plot", str(regression)]) == 0
    assert not (regression / "accuracy.png").exists() and (regression / "loss.png").exists()


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    _metrics(tmp_path / "run")
    from anygrad.plot import plot_run
    with pytest.raises(ConfigError, match=r"pip install 'anygrad-train\[plot\]'"):
        plot_run(tmp_path / "run")
    assert cli.main(["plot", str(tmp_path / "run")]) == cli.EXIT_ERROR
    assert "pip install 'anygrad-train[plot]'" in capsys.readouterr().err


def test_plot_of_a_folder_without_metrics(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path)]) == cli.EXIT_ERROR
    assert "metrics.jsonl" in capsys.readouterr().err


# -- what the output means ----------------------------------------------------------------------
@pytest.mark.parametrize("last, kind", [("LogSoftmax", "log-probabilities"), ("Softmax", "probabilities"),
                                        (None, "logits")])
def test_output_kind_and_probabilities_match_onnxruntime(tmp_path, last, kind):
    path = _mlp(tmp_path / "m.onnx", last)
    model, _ = load_model(path)
    assert output_kind(model) == kind
    x = np.random.default_rng(0).standard_normal((6, 1, 28, 28)).astype(np.float32)
    out = _ort(path, x)
    logits = _ort(_mlp(tmp_path / "l.onnx", None), x)
    ref = np.exp(logits - logits.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    np.testing.assert_allclose(probabilities(out, kind), ref, rtol=1e-5, atol=1e-6)


def test_log_probabilities_without_a_logsoftmax_node_are_recognised():
    logits = np.random.default_rng(1).standard_normal((4, 10))
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    np.testing.assert_allclose(probabilities(logp, "logits"), np.exp(logp), rtol=1e-9)


# -- predict ---------------------------------------------------------------------------------------
def _parse_predict(out: str) -> tuple[int, float, int | None]:
    m = re.search(r"^predicted: (\d+)(?: \([^)]*\))?\s+probability ([\d.]+)$", out, re.MULTILINE)
    t = re.search(r"^true label: (\d+)", out, re.MULTILINE)
    return int(m[1]), float(m[2]), int(t[1]) if t else None


def test_predict_a_dataset_sample(tmp_path, mnist_dir, capsys):
    folder, x_test, y_test = mnist_dir
    path = _mlp(tmp_path / "m.onnx")
    assert cli.main(["predict", str(path), "--data-dir", str(folder), "--index", "12"]) == 0
    out = capsys.readouterr().out
    label, prob, true = _parse_predict(out)
    ref = np.exp(_ort(path, normalize(x_test[12:13]))[0])
    assert label == int(ref.argmax()) and prob == pytest.approx(float(ref.max()), abs=1e-4)
    assert true == int(y_test[12]) and ("correct" in out) == (label == true)
    assert "outputs log-probabilities" in out and "top: " in out
    assert cli.main(["predict", str(path), "--data-dir", str(folder), "--index", str(N_TEST)]) == cli.EXIT_ERROR
    assert "--index 40 is outside the 40 samples" in capsys.readouterr().err


def test_predict_an_image_inverts_a_white_background(tmp_path, mnist_dir, capsys):
    Image = pytest.importorskip("PIL.Image")
    _folder, x_test, _ = mnist_dir
    path = _mlp(tmp_path / "m.onnx")
    sample = x_test[5].copy()
    sample[:2], sample[-2:], sample[:, :2], sample[:, -2:] = 0, 0, 0, 0  # MNIST-like: a dark border
    Image.fromarray(255 - sample).convert("RGB").save(tmp_path / "white.png")  # a user's drawing: dark on white
    Image.fromarray(sample).save(tmp_path / "dark.png")
    ref = np.exp(_ort(path, normalize(sample[None]))[0])
    for name, inverted in (("white.png", True), ("dark.png", False)):
        assert cli.main(["predict", str(path), "--image", str(tmp_path / name)]) == 0
        out = capsys.readouterr().out
        label, prob, true = _parse_predict(out)
        assert label == int(ref.argmax()) and prob == pytest.approx(float(ref.max()), abs=1e-4) and true is None
        assert ("inverted (white background" in out) == inverted and "resized to 28x28, greyscale" in out


def test_predict_image_without_pillow(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_pil(name, *args, **kwargs):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError("No module named 'PIL'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pil)
    (tmp_path / "a.png").write_bytes(b"")
    assert cli.main(["predict", str(_mlp(tmp_path / "m.onnx")), "--image", str(tmp_path / "a.png")]) == cli.EXIT_ERROR
    assert "pip install 'anygrad-train[image]'" in capsys.readouterr().err


# -- eval -------------------------------------------------------------------------------------------
def test_eval_prints_loss_accuracy_and_confusion_matrix(tmp_path, mnist_dir, capsys):
    folder, x_test, y_test = mnist_dir
    path = _mlp(tmp_path / "m.onnx", last=None)
    assert cli.main(["eval", str(path), "--data-dir", str(folder), "--device", "cpu", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    logits = _ort(path, normalize(x_test)).astype(np.float64)
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    loss, acc = -logp[np.arange(N_TEST), y_test].mean(), (logits.argmax(1) == y_test).mean()
    m = re.search(r"^loss ([\d.]+)\s+accuracy ([\d.]+)%\s+\(40 samples\)", out, re.MULTILINE)
    assert float(m[1]) == pytest.approx(loss, abs=1e-4) and float(m[2]) == pytest.approx(100 * acc, abs=0.01)
    assert "confusion matrix" in out and "recall" in out
    ref = np.zeros((10, 10), int)
    np.add.at(ref, (y_test, logits.argmax(1)), 1)
    rows = [line for line in out.splitlines() if re.match(r"^│\s+\d\s+│", line)]
    got = np.array([[int(c) for c in line.split("│")[2:12]] for line in rows])
    np.testing.assert_array_equal(got, ref)


# -- finding the model --------------------------------------------------------------------------
def test_resolve_run_folder_checkpoint_and_weights(tmp_path, mnist_dir):
    folder, x_test, y_test = mnist_dir
    path = _mlp(tmp_path / "m.onnx")
    trained = {"fc2.weight": np.random.default_rng(5).standard_normal((10, 16)).astype(np.float32),
               "fc2.bias": np.arange(10, dtype=np.float32) / 10}
    x = normalize(x_test[:8])
    ref = np.exp(_ort(path, x, trained))

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": str(path), "dataset": "mnist", "data_dir": str(folder)}))
    from anygrad.train import checkpoint
    base, _ = load_model(path)
    state = {**base.state_dict(), **trained, "opt.slot": np.zeros(3, np.float32)}
    checkpoint.write(run / "checkpoints", "best", state, {"epoch": 4, "config": {"model": str(path)}})
    model, source = load_model(run)
    assert source.description.endswith("best.json (epoch 4)") and source.run_config["dataset"] == "mnist"
    model.compile(loss="nll", device="cpu")
    np.testing.assert_allclose(np.exp(model.predict(x)), ref, rtol=1e-4, atol=1e-6)

    result = evaluate(model, x, y_test[:8])
    assert result.confusion.sum() == 8 and result.accuracy == pytest.approx(np.mean(ref.argmax(1) == y_test[:8]))

    np.savez(run / "weights.npz", **state)
    (run / "checkpoints" / "best.json").unlink()
    weights_model, _src = load_model(run / "weights.npz")
    weights_model.compile(loss="nll", device="cpu")
    np.testing.assert_allclose(np.exp(weights_model.predict(x)), ref, rtol=1e-4, atol=1e-6)
    assert resolve_model(run).description.endswith("weights.npz")  # no model.onnx, no checkpoint left

    onnx_model = tmp_path / "run" / "model.onnx"
    onnx_model.write_bytes(path.read_bytes())
    assert resolve_model(run).onnx == onnx_model  # a run's model.onnx comes first

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no model.onnx, no checkpoints/ and no weights.npz"):
        resolve_model(empty)
    with pytest.raises(AnygradError, match="no such model"):
        resolve_model(tmp_path / "missing")
    bad = {**state, "fc2.weight": np.zeros((3, 3), np.float32)}
    np.savez(tmp_path / "run" / "bad.npz", **bad)
    with pytest.raises(ModelError, match="'fc2.weight' has shape"):
        load_model(tmp_path / "run" / "bad.npz")


def test_predict_uses_the_runs_dataset_folder(tmp_path, mnist_dir, capsys):
    folder, _x_test, y_test = mnist_dir
    run = tmp_path / "run"
    run.mkdir()
    _mlp(run / "model.onnx")
    (run / "config.json").write_text(json.dumps({"model": "m.onnx", "dataset": "mnist", "data_dir": str(folder)}))
    assert cli.main(["predict", str(run), "--index", "3"]) == 0
    assert _parse_predict(capsys.readouterr().out)[2] == int(y_test[3])


def test_predict_and_eval_normalise_like_the_run(tmp_path, mnist_dir, capsys):
    """A run trained with its own --mean/--std (normalised on the device, uint8 batches): its
    model.onnx takes float input, and predict/eval normalise with the run's statistics."""
    from anygrad.data import normalize_images
    folder, x_test, y_test = mnist_dir
    run = tmp_path / "run"
    assert cli.main(["train", str(_mlp(tmp_path / "m.onnx")), "--data-dir", str(folder), "--device", "cpu",
                     "--epochs", "1", "--batch-size", "10", "--optimizer", "sgd", "--lr", "0.01", "--mean", "0.4",
                     "--std", "0.2", "--artifacts", str(run), "--quiet"]) == 0
    assert "batches: uint8, normalised on the device (mean 0.4 std 0.2)" in capsys.readouterr().out
    assert cli.main(["predict", str(run), "--index", "5"]) == 0
    label, prob, true = _parse_predict(capsys.readouterr().out)
    ref = np.exp(_ort(run / "model.onnx", normalize_images(x_test[5:6, None], (0.4,), (0.2,)))[0])
    assert label == int(ref.argmax()) and prob == pytest.approx(float(ref.max()), abs=1e-4) and true == y_test[5]
    assert cli.main(["eval", str(run), "--device", "cpu"]) == 0
    loss = float(re.search(r"loss (\S+)", capsys.readouterr().out).group(1))
    logp = _ort(run / "model.onnx", normalize_images(x_test[:, None], (0.4,), (0.2,)))
    assert loss == pytest.approx(float(-logp[np.arange(N_TEST), y_test].mean()), abs=1e-3)


# -- predict --image normalises like the run, whatever the run's dataset and settings ------------------
def _digit_image(path: Path, seed: int = 3) -> np.ndarray:
    """A dark-background 28x28 greyscale PNG (no inversion); returns its pixels."""
    Image = pytest.importorskip("PIL.Image")
    img = np.random.default_rng(seed).integers(0, 256, (28, 28), dtype=np.uint8)
    img[:3], img[-3:], img[:, :3], img[:, -3:] = 0, 0, 0, 0
    Image.fromarray(img).save(path)
    return img


def _image_folder(root: Path) -> np.ndarray:
    """Two classes of 28x28 greyscale PNGs; returns all images (N, 1, 28, 28) in reading order."""
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(4)
    images = []
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(6):
            img = rng.integers(0, 120 + 100 * (c == "dog"), (28, 28), dtype=np.uint8)
            Image.fromarray(img).save(root / c / f"{i}.png")
            images.append(img)
    return np.stack(images)[:, None]


def _npz_set(path: Path) -> np.ndarray:
    rng = np.random.default_rng(6)
    x = rng.integers(0, 180, (20, 1, 28, 28), dtype=np.uint8)
    np.savez(path, images=x, labels=rng.integers(0, 10, 20))
    return x


@pytest.mark.parametrize("case", ["none", "device-mean", "host-mean", "imagefolder", "npz", "imagefolder-old-run"])
def test_predict_image_normalises_like_the_run(tmp_path, mnist_dir, capsys, case):
    """The image goes into model.onnx exactly as the run's batches went into training: pixels / 255
    (--normalize none), the run's --mean/--std (on the device or the host), or the statistics
    of an imagefolder/npz dataset (recorded in config.json; for runs that did not record them,
    computed from the run's data folder)."""
    def stats(images):  # the reference: per-channel mean/std of the pixels in [0, 1], in float64
        f = images.astype(np.float64) / 255
        return f.mean(axis=(0, 2, 3)), f.std(axis=(0, 2, 3))
    folder, _x, _y = mnist_dir
    data = ["--data-dir", str(folder)]
    if case == "none":
        flags, expect = [*data, "--normalize", "none"], None
    elif case == "device-mean":
        flags, expect = [*data, "--mean", "0.3", "--std", "0.6"], ((0.3,), (0.6,))
    elif case == "host-mean":
        flags, expect = [*data, "--mean", "0.3", "--std", "0.6", "--normalize", "host"], ((0.3,), (0.6,))
    elif case.startswith("imagefolder"):
        images = _image_folder(tmp_path / "folder")
        flags, expect = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "folder")], stats(images)
    else:
        images = _npz_set(tmp_path / "d.npz")
        flags = ["--dataset", "npz", "--data-dir", str(tmp_path / "d.npz"), "--npz-keys", "images,labels"]
        expect = stats(images)
    run = tmp_path / "run"
    assert cli.main(["train", str(_mlp(tmp_path / "m.onnx")), "--device", "cpu", "--epochs", "1", "--batch-size",
                     "10", "--optimizer", "sgd", "--lr", "0.01", "--artifacts", str(run), "--quiet", *flags]) == 0
    config = json.loads((run / "config.json").read_text())
    if case == "imagefolder-old-run":  # an older host-normalised run: no statistics nor classes recorded
        del config["resolved"]["normalisation"], config["resolved"]["classes"]
        config["resolved"]["normalised_on_device"] = None
        (run / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    img = _digit_image(tmp_path / "digit.png")
    assert cli.main(["predict", str(run), "--image", str(tmp_path / "digit.png")]) == 0
    out = capsys.readouterr().out
    x = img[None, None].astype(np.float64) / 255
    if expect is not None:
        mean, std = (np.asarray(v, np.float64).reshape(1, -1, 1, 1) for v in expect)
        x = (x - mean) / std
    x = x.astype(np.float32)
    ref = np.exp(_ort(run / "model.onnx", x)[0])
    label, prob, _ = _parse_predict(out)
    assert prob == pytest.approx(float(ref.max()), abs=1e-4) and label == int(ref.argmax())
    assert ("not normalised" in out) == (expect is None)
    if case.startswith("imagefolder"):
        assert re.search(r"^predicted: \d \((cat|dog)\)", out, re.MULTILINE)  # the run's class names
    if case == "npz":  # eval reads the run's .npz keys and its held-out part, normalised like the run
        assert cli.main(["eval", str(run), "--device", "cpu"]) == 0
        out = capsys.readouterr().out
        assert "2 samples" in out and "like the run" in out
