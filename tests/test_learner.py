"""The Learner: clipping, accumulation, early stopping, schedulers, top-5, checkpoints, config reruns.

References: PyTorch (clip_grad_norm_, SGD, lr_scheduler) in float64/float32, numpy.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import anygrad
from anygrad import cli
from anygrad.data import write_idx
from anygrad.data.mnist import MNIST_FILES
from anygrad.ir.passes import RNG_STATE
from anygrad.optim import get_optimizer
from anygrad.train import LineReporter, TrainConfig, fit
from anygrad.train import learner as learner_mod

torch = pytest.importorskip("torch")


def _onnx(path: Path, sizes: list[int], seed: int = 0, input_shape=None) -> Path:
    """Gemm(+Relu) layers over (N, sizes[0]), built with onnx.helper."""
    rng = np.random.default_rng(seed)
    inits, nodes, x = [], [], "x"
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        inits += [numpy_helper.from_array((rng.standard_normal((n_out, n_in)) * 0.5).astype(np.float32), f"l{i}.weight"),
                  numpy_helper.from_array((rng.standard_normal(n_out) * 0.1).astype(np.float32), f"l{i}.bias")]
        nodes.append(helper.make_node("Gemm", [x, f"l{i}.weight", f"l{i}.bias"], [f"h{i}"], transB=1))
        x = f"h{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            x = f"r{i}"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, input_shape or ["N", sizes[0]])]
    if input_shape is not None:  # (N, 1, 28, 28) images: flatten first
        inits.append(numpy_helper.from_array(np.array([-1, sizes[0]], np.int64), "shape"))
        nodes.insert(0, helper.make_node("Reshape", ["x", "shape"], ["flat"]))
        nodes[1].input[0] = "flat"
    graph = helper.make_graph(nodes, "mlp", inputs, [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", sizes[-1]])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _torch_mlp(path: Path) -> torch.nn.Sequential:
    weights = {t.name: torch.tensor(numpy_helper.to_array(t)) for t in onnx.load(str(path)).graph.initializer}
    n = len(weights) // 2
    layers = []
    for i in range(n):
        w = weights[f"l{i}.weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(weights[f"l{i}.bias"])
        layers += [lin] + ([torch.nn.ReLU()] if i < n - 1 else [])
    return torch.nn.Sequential(*layers)


def _params(model) -> dict[str, np.ndarray]:
    return model.state_dict()


# -- gradient clipping inside the step ------------------------------------------------------------------
@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipped, and a bound that never bites
def test_clipping_matches_torch(tmp_path, max_norm):
    path = _onnx(tmp_path / "m.onnx", [4, 5, 3])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.standard_normal((6, 3)).astype(np.float32)
    model = anygrad.load_onnx(str(path)).compile("mse", get_optimizer("sgd", lr=0.1, momentum=0.9), "cpu",
                                                 clip_norm=max_norm)
    ref = _torch_mlp(path)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(4):
        model.train_step(x, y)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.tensor(x)), torch.tensor(y)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
    got = _params(model)
    for i, layer in enumerate(m for m in ref if isinstance(m, torch.nn.Linear)):
        np.testing.assert_allclose(got[f"l{i}.weight"], layer.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[f"l{i}.bias"], layer.bias.detach().numpy(), rtol=1e-5, atol=1e-6)


# -- gradient accumulation ------------------------------------------------------------------------------
@pytest.mark.parametrize("n, optimizer", [(2, "sgd"), (3, "adam"), (4, "sgd")])
def test_accumulation_equals_one_big_batch(tmp_path, n, optimizer):
    path = _onnx(tmp_path / "m.onnx", [6, 8, 5])
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4 * n, 6)).astype(np.float32)  # two updates of 4n samples
    y = rng.integers(0, 5, (2, 4 * n)).astype(np.int64)
    big = anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer(optimizer, lr=0.05), "cpu")
    acc = anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer(optimizer, lr=0.05), "cpu",
                                               accumulate=n)
    for u in range(2):
        big.train_step(x[u], y[u])
        for i in range(n):
            before = acc.state_dict()
            acc.train_step(x[u, 4 * i:4 * (i + 1)], y[u, 4 * i:4 * (i + 1)])
            if i < n - 1:  # no update until the n-th micro-batch
                assert all(np.array_equal(before[k], v) for k, v in acc.state_dict().items())
    for k, v in big.state_dict().items():
        np.testing.assert_allclose(acc.state_dict()[k], v, rtol=1e-6, atol=1e-6)
    assert float(acc.backend.get_state("anygrad.step")) == 2.0


def test_accumulation_flushes_at_epoch_end(tmp_path):
    """10 batches, N = 4: updates after batches 4, 8 and 10 (the last, partial group)."""
    path = _onnx(tmp_path / "m.onnx", [6, 5])
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((40, 6)).astype(np.float32), rng.integers(0, 5, 40).astype(np.int64)
    model = anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer("sgd", lr=0.1), "cpu")
    fit(model, (x, y), None, epochs=1, batch_size=4, accumulate=4, shuffle=False, log=None)
    assert float(model.backend.get_state("anygrad.step")) == 3.0 and model.micro_step == 0
    # PyTorch users' loop: loss / N per micro-batch, step every N-th and after the last batch
    ref = _torch_mlp(path)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(10):
        loss = torch.nn.functional.cross_entropy(ref(torch.tensor(x[4 * i:4 * i + 4])), torch.tensor(y[4 * i:4 * i + 4]))
        (loss / 4).backward()
        if (i + 1) % 4 == 0 or i == 9:
            opt.step()
            opt.zero_grad()
    np.testing.assert_allclose(model.state_dict()["l0.weight"], ref[0].weight.detach().numpy(), rtol=1e-5, atol=1e-6)


# -- early stopping, schedulers: a scripted validation metric ------------------------------------------------
def _scripted(monkeypatch, values: list[float], key: str = "loss"):
    """Replace validation by a scripted valid_<key> ("loss" or "accuracy") per epoch; the other
    stays flat (loss 1.0, accuracy 0.5)."""
    scripted = iter(values)

    def fake(model, data, batch_size, transform=None, **_):
        s = learner_mod._Sums()
        s.add({"count": 1.0, "loss": 1.0, "accuracy": 0.5, key: next(scripted)})
        return s
    monkeypatch.setattr(learner_mod, "_validate", fake)


def _small(tmp_path, lr=0.1, optimizer="sgd"):
    path = _onnx(tmp_path / "m.onnx", [6, 5])
    rng = np.random.default_rng(4)
    data = rng.standard_normal((16, 6)).astype(np.float32), rng.integers(0, 5, 16).astype(np.int64)
    return anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer(optimizer, lr=lr), "cpu"), data


@pytest.mark.parametrize("losses, patience, min_delta, stop_epoch", [
    ([1.0, 0.9, 0.95, 0.91, 0.92, 0.5, 0.4], 3, 0.0, 5),   # best at 2, then 3 epochs without improvement
    ([1.0, 0.9, 0.95, 0.85, 0.92, 0.93, 0.4], 2, 0.0, 6),
    ([1.0, 0.95, 0.92, 0.91, 0.5, 0.4, 0.3], 2, 0.1, 3),   # improvements below min_delta do not count
    ([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4], 1, 0.0, None),    # always improving: all 7 epochs
])
def test_early_stopping(tmp_path, monkeypatch, losses, patience, min_delta, stop_epoch):
    model, data = _small(tmp_path)
    _scripted(monkeypatch, losses)
    result = fit(model, data, data, epochs=7, batch_size=8, patience=patience, min_delta=min_delta, log=None)
    assert len(result.history) == (stop_epoch or 7)
    assert result.stopped_early == (stop_epoch is not None)


def test_early_stopping_on_a_max_metric(tmp_path, monkeypatch):
    model, data = _small(tmp_path)
    _scripted(monkeypatch, [1.0] * 6)
    accs = iter([0.1, 0.5, 0.4, 0.45, 0.6, 0.7])
    real = learner_mod._validate

    def fake(model, d, b, transform=None, **_):
        s = real(model, d, b, transform)
        s.parts["accuracy"][0] = next(accs) * s.parts["accuracy"][1]  # correct = accuracy x counted
        return s
    monkeypatch.setattr(learner_mod, "_validate", fake)
    result = fit(model, data, data, epochs=6, batch_size=8, monitor="valid_accuracy", patience=2,  # mode auto: max
                 log=None)
    assert len(result.history) == 4 and result.best_epoch == 2


def _torch_lrs(name: str, epochs: int, metrics=None, **options) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = getattr(torch.optim.lr_scheduler, name)(opt, **options)
    lrs = []
    for e in range(epochs):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step(*([metrics[e]] if metrics else []))
    return lrs


@pytest.mark.parametrize("ours, theirs, options", [
    ("step", "StepLR", {"step_size": 2, "gamma": 0.5}),
    ("cosine", "CosineAnnealingLR", {"T_max": 4, "eta_min": 0.01}),
    ("exponential", "ExponentialLR", {"gamma": 0.7}),
])
def test_epoch_schedulers_set_lr_like_torch(tmp_path, ours, theirs, options):
    model, data = _small(tmp_path)
    result = fit(model, data, data, epochs=6, batch_size=8, scheduler=ours, scheduler_options=options, log=None)
    np.testing.assert_allclose([m.lr for m in result.history], _torch_lrs(theirs, 6, **options), rtol=1e-6)


def test_plateau_is_fed_the_monitored_metric(tmp_path, monkeypatch):
    losses = [1.0, 0.9, 0.95, 0.96, 0.97, 0.8, 0.85, 0.86]
    model, data = _small(tmp_path)
    _scripted(monkeypatch, losses)
    result = fit(model, data, data, epochs=8, batch_size=8, scheduler="plateau",
                 scheduler_options={"patience": 1, "factor": 0.5}, log=None)
    want = _torch_lrs("ReduceLROnPlateau", 8, metrics=losses, patience=1, factor=0.5)
    np.testing.assert_allclose([m.lr for m in result.history], want, rtol=1e-6)


def test_plateau_follows_the_direction_of_the_monitored_metric(tmp_path, monkeypatch):
    """A rising accuracy is an improvement: plateau (mode from --monitor) keeps the rate, as
    torch's ReduceLROnPlateau(mode="max") does; a falling one reduces it."""
    rising = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    model, data = _small(tmp_path)
    _scripted(monkeypatch, rising, "accuracy")
    result = fit(model, data, data, epochs=6, batch_size=8, monitor="valid_accuracy", scheduler="plateau",
                 scheduler_options={"patience": 0, "factor": 0.5}, log=None)
    assert [m.lr for m in result.history] == [0.1] * 6
    assert model.lr == pytest.approx(0.1)
    falling = [0.6, 0.5, 0.4, 0.3, 0.3, 0.2]
    model, data = _small(tmp_path)
    _scripted(monkeypatch, falling, "accuracy")
    result = fit(model, data, data, epochs=6, batch_size=8, monitor="valid_accuracy", scheduler="plateau",
                 scheduler_options={"patience": 0, "factor": 0.5}, log=None)
    want = _torch_lrs("ReduceLROnPlateau", 6, metrics=falling, mode="max", patience=0, factor=0.5)
    np.testing.assert_allclose([m.lr for m in result.history], want, rtol=1e-6)
    assert want[-1] < 0.1
    # an explicit mode wins: "min" on a rising accuracy treats every epoch as worse
    model, data = _small(tmp_path)
    _scripted(monkeypatch, rising, "accuracy")
    result = fit(model, data, data, epochs=6, batch_size=8, monitor="valid_accuracy", scheduler="plateau",
                 scheduler_options={"patience": 0, "factor": 0.5, "mode": "min"}, log=None)
    want = _torch_lrs("ReduceLROnPlateau", 6, metrics=rising, mode="min", patience=0, factor=0.5)
    np.testing.assert_allclose([m.lr for m in result.history], want, rtol=1e-6)


def test_step_interval_scheduler(tmp_path):
    model, data = _small(tmp_path)  # 2 steps per epoch
    result = fit(model, data, None, epochs=3, batch_size=8, scheduler="cosine",
                 scheduler_options={"T_max": 10, "interval": "step"}, log=None)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    used = []
    for _ in range(6):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert model.lr == pytest.approx(opt.param_groups[0]["lr"], rel=1e-6)
    # the lr column holds the rate of each epoch's last step, as for epoch schedules
    assert [m.lr for m in result.history] == pytest.approx(used[1::2], rel=1e-6)


# -- top-5 accuracy ------------------------------------------------------------------------------------------
def _top5_reference(scores: np.ndarray, target: np.ndarray) -> float:
    top = torch.topk(torch.tensor(scores), 5, dim=1).indices.numpy()
    return float(np.mean([t in row for t, row in zip(target, top)]))


def test_count_top_k_matches_topk():
    from anygrad.ir.graph import Node
    from anygrad.ir.registry import get_op
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((64, 12)).astype(np.float32)
    target = rng.integers(0, 12, 64)
    for k in (1, 3, 5):
        got = get_op("CountTopK").run(Node("CountTopK", ["o", "t"], ["c"], {"k": k}), [scores, target])[0]
        ref = torch.topk(torch.tensor(scores), k, dim=1).indices.numpy()
        assert float(got) == sum(t in row for t, row in zip(target, ref))


def test_top5_metric_in_fit(tmp_path):
    path = _onnx(tmp_path / "m.onnx", [6, 10])
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((30, 6)).astype(np.float32), rng.integers(0, 10, 30).astype(np.int64)
    model = anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer("sgd", lr=0.1), "cpu")
    result = model.fit((x, y), (x, y), epochs=1, batch_size=8, valid_batch_size=7, log=None)
    assert result.last.valid_top5 == pytest.approx(_top5_reference(model.predict(x), y), abs=1e-6)
    assert result.last.train_top5 is not None
    small = anygrad.load_onnx(str(_onnx(tmp_path / "s.onnx", [6, 5]))).compile("cross_entropy", device="cpu")
    assert small.top_k is None  # 5 classes or fewer: no top-5


# -- artifacts -------------------------------------------------------------------------------------------------
def test_checkpoints_keep_last_n_and_best(tmp_path, monkeypatch):
    model, data = _small(tmp_path)
    _scripted(monkeypatch, [1.0, 0.5, 0.7, 0.8, 0.9])
    run = tmp_path / "run"
    fit(model, data, data, epochs=5, batch_size=8, keep_checkpoints=2, artifacts_dir=str(run), log=None)
    ckpts = run / "checkpoints"
    best = json.loads((ckpts / "best.json").read_text())
    assert best["arrays"].startswith("best-00000004-")  # the best's arrays get a new name each time it moves
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(["best.json", best["arrays"], "ckpt-00000008.json",
                                                              "ckpt-00000008.npz", "ckpt-00000010.json",
                                                              "ckpt-00000010.npz"])
    assert best["epoch"] == 2 and best["monitor"]["best"] == 0.5
    last = json.loads((ckpts / "ckpt-00000010.json").read_text())
    assert last["epoch"] == 5 and last["epoch_done"] and last["fingerprint"] == model.fingerprint()
    arrays = np.load(ckpts / "ckpt-00000010.npz", allow_pickle=False)
    for name, value in model.full_state().items():  # every device tensor, optimizer state included
        np.testing.assert_array_equal(arrays[name], value)
    assert {"anygrad.lr", "anygrad.step", RNG_STATE, "l0.weight"} <= set(arrays.files)
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("epoch,train_loss") and len(rows) == 6
    assert (run / "weights.safetensors").is_file()


def test_full_state_holds_optimizer_slots(tmp_path):
    model, (x, y) = _small(tmp_path, optimizer="adam")
    model.train_step(x[:8], y[:8])
    state = model.full_state()
    assert {"optim.exp_avg.l0.weight", "optim.exp_avg_sq.l0.weight", "anygrad.lr", "anygrad.step"} <= set(state)
    other, _ = _small(tmp_path, optimizer="adam")
    other.load_full_state(state)
    model.train_step(x[8:], y[8:])
    other.train_step(x[8:], y[8:])
    for k, v in model.full_state().items():
        np.testing.assert_array_equal(other.full_state()[k], v)


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-mnist")
    rng = np.random.default_rng(0)
    for split, n in (("train", 48), ("test", 20)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = (rng.integers(0, 20, (n, 28, 28)) + y[:, None, None] * 23).astype(np.uint8)
        write_idx(folder / f"{MNIST_FILES['x_' + split].name}.gz", x)
        write_idx(folder / f"{MNIST_FILES['y_' + split].name}.gz", y)
    return folder


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("seconds", "samples_per_s")} for r in rows]


def test_config_json_reproduces_the_run(tmp_path, tiny_mnist):
    model = _onnx(tmp_path / "m.onnx", [784, 16, 10], input_shape=["N", 1, 28, 28])
    first = tmp_path / "first"
    assert cli.main(["train", str(model), "--data-dir", str(tiny_mnist), "--device", "cpu", "--epochs", "3",
                     "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.05", "--clip-grad-norm", "1.0",
                     "--accumulate", "2", "--scheduler", "step", "--scheduler-opt", "step_size=1",
                     "--scheduler-opt", "gamma=0.5", "--seed", "7", "--artifacts", str(first), "--quiet"]) == 0
    config = json.loads((first / "config.json").read_text())
    assert (config["clip_grad_norm"], config["accumulate"], config["scheduler"], config["seed"]) == \
        (1.0, 2, "step", 7)
    for name in ("again", "again2"):
        assert cli.main(["train", "--config", str(first / "config.json"), "--artifacts", str(tmp_path / name),
                         "--quiet"]) == 0
        assert _rows(tmp_path / name) == _rows(first)
    lrs = [r["lr"] for r in _rows(first)]
    assert lrs == pytest.approx([0.05, 0.025, 0.0125])
    # a flag overrides the file
    assert cli.main(["train", "--config", str(first / "config.json"), "--epochs", "1", "--artifacts",
                     str(tmp_path / "short"), "--quiet"]) == 0
    assert _rows(tmp_path / "short") == _rows(first)[:1]


def test_line_reporter_gets_every_hook(tmp_path):
    events = []

    class Recorder(LineReporter):
        def run_begin(self, info):
            events.append(("begin", info.epochs, info.steps_per_epoch))

        def step(self, info):
            events.append(("step", info.epoch, info.step))

        def epoch_end(self, info):
            events.append(("epoch", info.epoch, sorted(info.metrics)))

        def run_end(self, stopped_early=False, interrupted=False):
            events.append(("end", stopped_early, interrupted))

    model, data = _small(tmp_path)
    fit(model, data, data, TrainConfig(epochs=2, batch_size=4, log_every=2), reporter=Recorder())
    assert events[0] == ("begin", 2, 4) and events[-1] == ("end", False, False)
    assert [e[1:] for e in events if e[0] == "step"] == [(1, 2), (2, 2)]
    assert [e[1] for e in events if e[0] == "epoch"] == [1, 2]


# -- data settings on the command line: normalisation, augmentation, metrics files, early stopping -----------
def _train(tmp_path, tiny_mnist, run: str, *extra: str) -> Path:
    model = tmp_path / "m.onnx"
    if not model.exists():
        _onnx(model, [784, 16, 10], input_shape=["N", 1, 28, 28])
    out = tmp_path / run
    assert cli.main(["train", str(model), "--data-dir", str(tiny_mnist), "--device", "cpu", "--batch-size", "8",
                     "--optimizer", "sgd", "--lr", "0.05", "--artifacts", str(out), "--quiet", *extra]) == 0
    return out


def test_augmentation_and_normalisation_are_saved_and_reproduced(tmp_path, tiny_mnist):
    import onnxruntime as ort

    from anygrad.data import normalize_images
    dev = _train(tmp_path, tiny_mnist, "device", "--epochs", "2", "--augment", "crop:2,hflip", "--prefetch",
                 "--mean", "0.2", "--std", "0.3")
    config = json.loads((dev / "config.json").read_text())
    assert (config["crop_padding"], config["hflip"], config["normalize"], config["mean"], config["std"],
            config["prefetch"]) == (2, True, "device", [0.2], [0.3], True)
    assert config["resolved"]["input"]["dtype"] == "uint8"  # batches travel as uint8
    assert config["resolved"]["normalised_on_device"] == {"mean": [0.2], "std": [0.3]}
    again = tmp_path / "again"
    assert cli.main(["train", "--config", str(dev / "config.json"), "--artifacts", str(again), "--quiet"]) == 0
    assert _rows(again) == _rows(dev)  # the same crops and flips
    plain = _train(tmp_path, tiny_mnist, "plain", "--epochs", "2", "--mean", "0.2", "--std", "0.3")
    assert _rows(plain) != _rows(dev)  # augmentation changed the batches
    host = _train(tmp_path, tiny_mnist, "host", "--epochs", "2", "--augment", "crop:2,hflip", "--mean", "0.2",
                  "--std", "0.3", "--normalize", "host")
    assert json.loads((host / "config.json").read_text())["resolved"]["normalised_on_device"] is None
    for a, b in zip(_rows(host), _rows(dev)):  # normalised on the host or the device: the same run
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["valid_loss"] == pytest.approx(b["valid_loss"], rel=1e-4)
    # model.onnx keeps the user's float input: the device prologue is not part of the model
    x = np.random.default_rng(1).integers(0, 256, (3, 1, 28, 28), dtype=np.uint8)
    sessions = [ort.InferenceSession(str(r / "model.onnx"), providers=["CPUExecutionProvider"]) for r in (dev, host)]
    assert [s.get_inputs()[0].type for s in sessions] == ["tensor(float)"] * 2
    outs = [s.run(None, {s.get_inputs()[0].name: normalize_images(x, (0.2,), (0.3,))})[0] for s in sessions]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("spec", ["crop", "crop:x", "flip", "hflip:2"])
def test_bad_augment_spec_is_a_clear_error(tmp_path, tiny_mnist, capsys, spec):
    assert cli.main(["train", "--data-dir", str(tiny_mnist), "--augment", spec, "--artifacts",
                     str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error: --augment takes") and repr(spec.split(",")[0]) in err


def test_metrics_files_and_early_stopping_from_the_command_line(tmp_path, tiny_mnist, capsys):
    """metrics.jsonl/.csv rows hold lr, samples/s, epoch time and top-5 (10 classes); --patience
    stops a run whose monitored metric no longer improves (lr 0: it never does)."""
    run = _train(tmp_path, tiny_mnist, "run", "--epochs", "5", "--lr", "0", "--patience", "1", "--monitor",
                 "valid_loss")
    assert "early stop: valid_loss has not improved for 1 epochs" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["lr"] == 0 and r["seconds"] > 0 and r["samples_per_s"] > 0
        assert 0 <= r["train_top5"] <= 1 and 0 <= r["valid_top5"] <= 1 and r["valid_top5"] >= r["valid_accuracy"]
    import csv
    with open(run / "metrics.csv") as f:
        table = list(csv.DictReader(f))
    assert {"lr", "samples_per_s", "seconds", "train_top5", "valid_top5"} <= set(table[0])
    assert [float(t["valid_loss"]) for t in table] == pytest.approx([r["valid_loss"] for r in rows])


def test_npz_colour_images_normalised_per_channel_on_the_device(tmp_path):
    """--dataset npz with its own key names, a held-out split, crop+flip: three channel statistics
    go into the graph prologue and config.json."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (24, 3, 6, 6), dtype=np.uint8)
    x[:, 1] //= 2  # channels with different statistics
    data = tmp_path / "d.npz"
    np.savez(data, images=x, labels=rng.integers(0, 10, 24))
    model = _onnx(tmp_path / "m.onnx", [108, 10], input_shape=["N", 3, 6, 6])
    run = tmp_path / "run"
    assert cli.main(["train", str(model), "--dataset", "npz", "--data-dir", str(data), "--npz-keys", "images,labels",
                     "--valid-fraction", "0.25", "--augment", "crop:1,hflip", "--device", "cpu", "--batch-size", "6",
                     "--optimizer", "sgd", "--lr", "0.01", "--artifacts", str(run), "--quiet"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert (config["x_key"], config["y_key"], config["valid_fraction"]) == ("images", "labels", 0.25)
    stats = config["resolved"]["normalised_on_device"]
    from anygrad.data import get_dataset
    d = get_dataset("npz", data, x_key="images", y_key="labels", valid_fraction=0.25)
    assert stats["mean"] == pytest.approx(d.mean, abs=1e-6) and stats["std"] == pytest.approx(d.std, abs=1e-6)
    assert len(stats["mean"]) == 3 and stats["mean"][1] < stats["mean"][0]
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["valid_loss"] is not None


def test_npz_greyscale_images_without_a_channel_axis_train(tmp_path):
    """(N, H, W) uint8 images, as keras.datasets.mnist saves them: one channel axis added, the
    statistics are the images' own (in [0, 1] units), train and valid alike."""
    rng = np.random.default_rng(3)
    x, xv = rng.integers(0, 256, (24, 6, 6), dtype=np.uint8), rng.integers(0, 256, (6, 6, 6), dtype=np.uint8)
    data = tmp_path / "g.npz"
    np.savez(data, x=x, y=rng.integers(0, 10, 24), x_valid=xv, y_valid=rng.integers(0, 10, 6))
    from anygrad.data import get_dataset
    d = get_dataset("npz", data)
    assert d.train[0].shape == (24, 1, 6, 6) and d.valid[0].shape == (6, 1, 6, 6)
    assert d.mean == pytest.approx((x.mean() / 255,)) and d.std == pytest.approx((x.std() / 255,))
    model = _onnx(tmp_path / "m.onnx", [36, 10], input_shape=["N", 1, 6, 6])
    run = tmp_path / "run"
    assert cli.main(["train", str(model), "--dataset", "npz", "--data-dir", str(data), "--device", "cpu",
                     "--batch-size", "6", "--epochs", "1", "--artifacts", str(run), "--quiet"]) == 0
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["valid_loss"] is not None


def test_npz_channels_last_images_are_transposed_and_bad_sample_shapes_are_named(tmp_path, capsys):
    """(N, H, W, C) uint8 images (keras' cifar10, PIL) become (N, C, H, W) with per-channel
    statistics; float (N, H, W) data the model cannot take is a sample-shape error, not the last
    batch's; an x_valid without y_valid is an error, not a silent 10% hold-out."""
    from anygrad.data import get_dataset
    from anygrad.errors import ConfigError, DataError
    rng = np.random.default_rng(4)
    x = rng.integers(0, 256, (36, 6, 6, 3), dtype=np.uint8)
    x[..., 1] //= 2
    data = tmp_path / "hwc.npz"
    np.savez(data, x=x, y=rng.integers(0, 10, 36))
    d = get_dataset("npz", data, valid_fraction=0.0)
    np.testing.assert_array_equal(d.train[0], x.transpose(0, 3, 1, 2))
    assert d.mean == pytest.approx(tuple(x.reshape(-1, 3).mean(0) / 255)) and d.mean[1] < d.mean[0]
    model = _onnx(tmp_path / "m.onnx", [108, 10], input_shape=["N", 3, 6, 6])
    assert cli.main(["train", str(model), "--dataset", "npz", "--data-dir", str(data), "--device", "cpu",
                     "--batch-size", "8", "--epochs", "1", "--artifacts", str(tmp_path / "run"), "--quiet"]) == 0
    grey = anygrad.load_onnx(str(_onnx(tmp_path / "g.onnx", [36, 10], input_shape=["N", 1, 6, 6])))
    grey.compile("cross_entropy", get_optimizer("sgd", lr=0.1), "cpu")
    with pytest.raises(ConfigError, match=r"the training data's samples have shape \(6, 6\), which") as e:
        grey.fit((rng.standard_normal((36, 6, 6)).astype(np.float32), rng.integers(0, 10, 36)), batch_size=8, log=None)
    assert "last batch" not in str(e.value)
    half = tmp_path / "half.npz"
    np.savez(half, x=x, y=rng.integers(0, 10, 36), x_valid=x[:4])
    with pytest.raises(DataError, match="has the validation array 'x_valid' but no 'y_valid'"):
        get_dataset("npz", half)


# -- settings that depend on the run are checked before the first step -------------------------------------
def test_onecycle_spans_the_run_in_optimizer_updates(tmp_path, monkeypatch):
    """Without total_steps, onecycle takes epochs and steps_per_epoch from the run, counting optimizer
    updates (5 batches, accumulate 2: updates after batches 2, 4 and 5): torch's OneCycleLR with
    total_steps = 2 epochs x 3 updates gives the rate of every update, to the last one."""
    path = _onnx(tmp_path / "m.onnx", [6, 5])
    rng = np.random.default_rng(7)
    data = rng.standard_normal((40, 6)).astype(np.float32), rng.integers(0, 5, 40).astype(np.int64)
    model = anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer("sgd", lr=0.1), "cpu")
    used, real_step = [], model.train_step

    def recording(x, y, flush=False):
        if flush or model.micro_step + 1 == model.accumulate:  # this call applies an update
            used.append(model.lr)
        return real_step(x, y, flush=flush)
    monkeypatch.setattr(model, "train_step", recording)
    result = fit(model, data, None, epochs=2, batch_size=8, accumulate=2, scheduler="onecycle", log=None)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=6)
    want = []
    for _ in range(6):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(used, want, rtol=1e-6)
    # metrics.jsonl's lr: the rate of each epoch's last optimizer step
    assert [m.lr for m in result.history] == pytest.approx([want[2], want[5]], rel=1e-6)


def test_run_dependent_settings_fail_before_training(tmp_path, tiny_mnist, capsys):
    """Each is an error before the first step (no metrics written), not after an epoch."""
    for extra, words in (
            (["--scheduler", "onecycle", "--scheduler-opt", "total_steps=5"],
             ["the run takes 12 optimizer updates (2 epochs x 6 updates)", "total_steps=5"]),
            (["--monitor", "valid_accuracy", "--valid-fraction", "0", "--patience", "2"],
             ["--patience watch --monitor valid_accuracy, which this run cannot measure", "no validation data"]),
            (["--valid-fraction", "0", "--scheduler", "plateau"],
             ["--scheduler plateau watch --monitor valid_loss", "no validation data"]),
            (["--monitor", "train_top5", "--patience", "1", "--loss", "mse"], ["no accuracy"])):
        model = tmp_path / "m.onnx"
        if not model.exists():
            _onnx(model, [784, 16, 10], input_shape=["N", 1, 28, 28])
        run = tmp_path / "run"
        code = cli.main(["train", str(model), "--data-dir", str(tiny_mnist), "--device", "cpu", "--epochs", "2",
                         "--batch-size", "8", "--artifacts", str(run), "--quiet", *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("anygrad: error:"), (extra, err)
        assert all(w in err for w in words), (extra, err)
        assert not (run / "metrics.jsonl").exists()


def test_unknown_monitor_fails_before_anything_loads(tmp_path, capsys):
    assert cli.main(["train", str(tmp_path / "absent.onnx"), "--monitor", "valid_acc", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown metric 'valid_acc'" in err and "valid_accuracy" in err and "absent.onnx" not in err


def test_default_monitor_without_validation_is_a_note(tmp_path, tiny_mnist, capsys):
    run = _train(tmp_path, tiny_mnist, "run", "--epochs", "1", "--valid-fraction", "0")
    assert "note: no best checkpoint: the run has no validation data" in capsys.readouterr().out
    assert not (run / "checkpoints" / "best.json").exists()


def test_a_last_batch_batchnorm_cannot_train_on_fails_before_training(tmp_path):
    """BatchNorm1d cannot train on one sample (PyTorch raises too); with 5 samples at batch 4 the
    run must refuse at once, not after an epoch, and train fine with drop_last."""
    from anygrad.examples import FOUNDING_MODEL
    model = anygrad.load_onnx(str(FOUNDING_MODEL)).compile(loss="nll", optimizer=get_optimizer("sgd", lr=0.01),
                                                           device="cpu")
    x = np.random.default_rng(0).standard_normal((5, 1, 28, 28)).astype(np.float32)
    y = np.arange(5) % 10
    before = model.state_dict()
    with pytest.raises(anygrad.AnygradError, match=r"last batch of each epoch holds 1 sample .*drop-last"):
        fit(model, (x, y), None, TrainConfig(epochs=1, batch_size=4), log=None)
    assert all(np.array_equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing trained
    fit(model, (x, y), None, TrainConfig(epochs=1, batch_size=4, drop_last=True), log=None)
