"""Tasks beyond classification through the trainer: every metric the model reports (perplexity,
mse/mae, pixel_accuracy, ...) reaches metrics.jsonl/csv, metrics_steps.csv, the dashboard, plots and
--monitor, each weighted by its own denominator (tokens, pixels, elements), checked against numpy
float64 on the model's own predictions; a run with these metrics resumes bit for bit."""
from __future__ import annotations

import contextlib
import copy
import csv
import io
import itertools
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as tnn

import anygrad
from anygrad.errors import ConfigError
from anygrad.optim import SGD
from anygrad.train import checkpoint as ckpt
from anygrad.train import fit
from anygrad.train import learner as learner_mod
from anygrad.train.dashboard import LiveReporter, PlainReporter, task_metrics
from anygrad.train.monitor import Monitor, resolve_mode
from anygrad.train.report import EpochInfo, RunInfo, StepInfo

VOCAB, T = 11, 6


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


class TinyLM(tnn.Module):
    def __init__(self):
        super().__init__()
        self.emb = tnn.Embedding(VOCAB, 8)
        self.out = tnn.Linear(8, VOCAB)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


class PixelNet(tnn.Module):
    def __init__(self):
        super().__init__()
        self.conv = tnn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


@pytest.fixture(scope="module")
def lm_parts():
    torch.manual_seed(0)
    net = TinyLM()
    model = quiet(anygrad.from_torch, net, torch.zeros((2, T), dtype=torch.int64), dynamo=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (10, T)).astype(np.int64)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    labels[0, :4] = -100  # batches with different numbers of counted tokens: sample weighting would differ
    labels[5, :] = -100
    labels[6, 1:] = -100
    return model, ids, labels


def lm_model(lm_parts, lr=0.0):
    return copy.deepcopy(lm_parts[0]).compile(loss="cross_entropy", ignore_index=-100, optimizer=SGD(lr=lr))


def token_nll(model, ids, labels) -> np.ndarray:
    logits = model.predict(ids).astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    keep = labels != -100
    return -np.take_along_axis(logp, np.where(keep, labels, 0)[..., None], -1)[..., 0][keep]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- what fit writes ------------------------------------------------------------------------------
def test_language_model_fit_writes_token_level_perplexity(lm_parts, tmp_path):
    _, ids, labels = lm_parts
    model = lm_model(lm_parts)  # lr 0: every batch sees the same weights, so numpy can recompute the epoch
    run = tmp_path / "lm"
    result = fit(model, (ids, labels), (ids, labels), epochs=1, batch_size=4, shuffle=False, log=None,
                 artifacts_dir=str(run), log_every=1)
    nll = token_nll(model, ids, labels)
    want = float(np.exp(nll.mean()))  # over the counted tokens, not a mean of per-batch perplexities
    per_batch = [np.exp(token_nll(model, ids[i:i + 4], labels[i:i + 4]).mean()) for i in (0, 4, 8)]
    assert abs(np.average(per_batch, weights=[4, 4, 2]) - want) > 1e-3  # sample weighting would be wrong
    (row,) = rows(run)
    assert row["train_perplexity"] == pytest.approx(want, rel=1e-5)
    assert row["valid_perplexity"] == pytest.approx(want, rel=1e-5)
    assert result.last.valid_perplexity == row["valid_perplexity"]
    keep = labels != -100
    acc = (model.predict(ids).argmax(-1) == labels)[keep].mean()
    assert row["train_accuracy"] == pytest.approx(acc) and row["valid_accuracy"] == pytest.approx(acc)
    # metrics.csv: the historical columns first, then the task's
    with open(run / "metrics.csv") as f:
        header = next(csv.reader(f))
    assert header[:10] == ["epoch", "train_loss", "train_accuracy", "valid_loss", "valid_accuracy", "seconds",
                           "train_top5", "valid_top5", "lr", "samples_per_s"]
    assert header[10:] == ["train_perplexity", "valid_perplexity"]
    # metrics_steps.csv: the running perplexity at each read; the last one is the epoch's
    with open(run / "metrics_steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert "perplexity" in steps[0] and float(steps[-1]["perplexity"]) > 0


def test_regression_fit_writes_mse_and_mae(tmp_path):
    from anygrad import nn
    rng = np.random.default_rng(1)
    x, t = rng.standard_normal((10, 4)).astype(np.float32), rng.standard_normal((10, 3)).astype(np.float32)
    model = nn.Linear(4, 3).to_model(("batch", 4)).compile(loss="mse", optimizer=SGD(lr=0.0))
    run = tmp_path / "reg"
    fit(model, (x, t), (x, t), epochs=1, batch_size=4, shuffle=False, log=None, artifacts_dir=str(run))
    d = model.predict(x).astype(np.float64) - t
    (row,) = rows(run)
    for split in ("train", "valid"):
        assert row[f"{split}_mse"] == pytest.approx((d ** 2).mean(), rel=1e-5)
        assert row[f"{split}_mae"] == pytest.approx(np.abs(d).mean(), rel=1e-5)
        assert row[f"{split}_accuracy"] is None


@pytest.fixture(scope="module")
def seg_parts():
    torch.manual_seed(2)
    model = quiet(anygrad.from_torch, PixelNet(), torch.zeros((2, 2, 5, 5)), dynamo=False)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 2, 5, 5)).astype(np.float32)
    y = rng.integers(0, 3, (6, 5, 5)).astype(np.int64)
    y[0, :3] = -100  # unlabelled pixels
    y[4] = -100
    return model, x, y


def test_segmentation_fit_writes_pixel_accuracy(seg_parts, tmp_path):
    net, x, y = seg_parts
    model = copy.deepcopy(net).compile(loss="cross_entropy", ignore_index=-100, optimizer=SGD(lr=0.0))
    run = tmp_path / "seg"
    fit(model, (x, y), (x, y), epochs=1, batch_size=4, shuffle=False, log=None, artifacts_dir=str(run))
    keep = y != -100
    want = (model.predict(x).argmax(1) == y)[keep].mean()
    (row,) = rows(run)
    assert row["train_pixel_accuracy"] == pytest.approx(want) and row["valid_pixel_accuracy"] == pytest.approx(want)
    assert "train_accuracy" in row and row["train_accuracy"] is None


# -- --monitor -------------------------------------------------------------------------------------
def test_monitor_direction_by_metric():
    for name in ("valid_perplexity", "train_loss", "valid_mse", "valid_mae", "valid_box_mae", "valid_kl",
                 "valid_stop_loss", "train_topology"):
        assert resolve_mode(name, "auto") == "min", name
    for name in ("valid_accuracy", "valid_pixel_accuracy", "valid_label_accuracy", "valid_logits_accuracy",
                 "train_top5"):
        assert resolve_mode(name, "auto") == "max", name


def test_early_stopping_on_valid_perplexity_min(lm_parts):
    _, ids, labels = lm_parts
    model = lm_model(lm_parts, lr=0.5)
    result = fit(model, (ids, labels), (ids, labels), epochs=4, batch_size=10, monitor="valid_perplexity",
                 patience=1, log=None)
    ppl = [m.valid_perplexity for m in result.history]
    assert all(b < a for a, b in itertools.pairwise(ppl)), ppl  # learning: each epoch lower
    assert result.best_epoch == 4 and not result.stopped_early  # min: the lowest is the best
    model = lm_model(lm_parts, lr=0.0)  # never improves: stops after `patience` epochs
    result = fit(model, (ids, labels), (ids, labels), epochs=5, batch_size=10, monitor="valid_perplexity",
                 patience=2, log=None)
    assert result.stopped_early and len(result.history) == 3 and result.best_epoch == 1


def test_early_stopping_on_valid_pixel_accuracy_max(seg_parts, monkeypatch):
    net, x, y = seg_parts
    scripted = iter([0.2, 0.5, 0.4, 0.45, 0.6])
    real = learner_mod._validate

    def fake(*args, **kwargs):
        s = real(*args, **kwargs)
        part = s.parts["pixel_accuracy"]
        part[0] = next(scripted) * part[1]
        return s
    monkeypatch.setattr(learner_mod, "_validate", fake)
    model = copy.deepcopy(net).compile(loss="cross_entropy", ignore_index=-100, optimizer=SGD(lr=0.1))
    result = fit(model, (x, y), (x, y), epochs=5, batch_size=6, monitor="valid_pixel_accuracy", patience=2,
                 log=None)
    assert [m.valid_pixel_accuracy for m in result.history] == pytest.approx([0.2, 0.5, 0.4, 0.45])
    assert result.best_epoch == 2 and result.stopped_early  # max: 0.5 was the best, then two epochs below


def test_monitoring_a_metric_the_task_lacks(seg_parts):
    from anygrad import nn
    x, t = np.zeros((4, 2), np.float32), np.zeros((4, 1), np.float32)
    reg = nn.Linear(2, 1).to_model(("batch", 2)).compile(loss="mse")
    with pytest.raises(ConfigError, match="valid_perplexity.*not a classification loss"):
        fit(reg, (x, t), (x, t), monitor="valid_perplexity", patience=1, log=None)
    net, sx, sy = seg_parts
    seg = copy.deepcopy(net).compile(loss="cross_entropy", ignore_index=-100)
    # perplexity is counted for token-level targets only: known once the step program is built
    with pytest.raises(ConfigError, match="reports no metric 'perplexity'.*valid_pixel_accuracy"):
        fit(seg, (sx, sy), (sx, sy), monitor="valid_perplexity", patience=1, log=None)
    with pytest.raises(ConfigError, match="unknown metric 'valid_perplexty'.*did you mean valid_perplexity"):
        fit(reg, (x, t), monitor="valid_perplexty", log=None)


# -- the dashboard, plain lines, plots --------------------------------------------------------------
def _lm_events(reporter) -> None:
    reporter.run_begin(RunInfo("lm.onnx", "cpu (numpy)", 2, 4, 8, artifacts_dir="runs/lm"))
    g = 0
    for e in (1, 2):
        for s in range(1, 5):
            g += 1
            reporter.step(StepInfo(e, s, 4, g, 2.0 / g, 0.3, 0.01, 100.0,
                                   {"loss": 2.0 / g, "accuracy": 0.3, "perplexity": float(np.exp(2.0 / g))}))
        reporter.epoch_end(EpochInfo(e, {"train_loss": 1.0 / e, "train_accuracy": 0.3, "valid_loss": 1.1 / e,
                                         "valid_accuracy": 0.31, "train_perplexity": 12.5 / e,
                                         "valid_perplexity": 13.25 / e}, 1.0, best=True))
    reporter.run_end()


def test_task_metric_selection():
    assert task_metrics(["train_loss", "train_accuracy", "train_perplexity", "valid_perplexity"]) == ["perplexity"]
    assert task_metrics(["train_mse", "valid_mse", "train_mae", "valid_mae"]) == ["mae"]
    assert task_metrics(["train_logits_loss", "train_logits_accuracy", "train_box_loss", "train_box_mse",
                         "train_box_mae"]) == ["logits_accuracy", "box_mae"]


def test_plain_lines_show_the_task_metrics():
    out = io.StringIO()
    _lm_events(PlainReporter(every=1, stream=out))
    lines = out.getvalue().splitlines()
    assert any(line.startswith("step epoch=1/2 step=4/4 ") and " perplexity=" in line for line in lines)
    epoch = next(line for line in lines if line.startswith("epoch 2/2 "))
    assert "train_perplexity=6.2500 valid_perplexity=6.6250" in epoch and "valid_acc=0.3100" in epoch
    assert "train_perplexity=6.2500" in lines[-1] and lines[-1].startswith("done: 2 epochs")


def test_live_dashboard_shows_perplexity_and_pixel_accuracy():
    from rich.console import Console
    out = io.StringIO()
    r = LiveReporter(Console(file=out, force_terminal=True, width=140, color_system=None))
    _lm_events(r)
    text = out.getvalue()
    assert "train ppl" in text and "valid ppl" in text and "13.2500" in text and "ppl " in text
    out = io.StringIO()
    r = LiveReporter(Console(file=out, force_terminal=True, width=140, color_system=None))
    r.run_begin(RunInfo("unet.onnx", "cpu (numpy)", 1, 2, 8))
    r.step(StepInfo(1, 2, 2, 2, 0.7, None, 0.01, 50.0, {"loss": 0.7, "pixel_accuracy": 0.875}))
    r.epoch_end(EpochInfo(1, {"train_loss": 0.7, "train_accuracy": None, "valid_loss": 0.8, "valid_accuracy": None,
                              "train_pixel_accuracy": 0.875, "valid_pixel_accuracy": 0.75}, 1.0, best=True))
    r.run_end()
    text = out.getvalue()
    assert "pixel acc 87.50%" in text and "valid pixel acc" in text and "75.00%" in text
    assert "train acc" not in text  # no accuracy column for a run without one


def test_plot_draws_every_metric(lm_parts, tmp_path):
    pytest.importorskip("matplotlib")
    from anygrad.plot import plot_run
    _, ids, labels = lm_parts
    run = tmp_path / "lm"
    fit(lm_model(lm_parts, lr=0.5), (ids, labels), (ids, labels), epochs=2, batch_size=4, log=None,
        artifacts_dir=str(run))
    written = sorted(p.name for p in plot_run(run, tmp_path / "plots"))
    assert written == ["accuracy.png", "loss.png", "perplexity.png"]
    # an old run's metrics.jsonl (the classifier's columns only) still plots
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train_loss": 1.0, "train_accuracy": 0.5,
                                                   "valid_loss": 1.1, "valid_accuracy": 0.4, "seconds": 1.0}) + "\n")
    assert sorted(p.name for p in plot_run(old)) == ["accuracy.png", "loss.png"]


# -- resume ------------------------------------------------------------------------------------------
def test_resume_mid_epoch_with_task_metrics_is_bit_identical(lm_parts, tmp_path):
    _, ids, labels = lm_parts
    settings = {"epochs": 3, "batch_size": 3, "seed": 5, "log": None, "checkpoint_every": 1, "keep_checkpoints": 100,
                "monitor": "valid_perplexity", "log_every": 2}
    full = tmp_path / "full"
    fit(lm_model(lm_parts, lr=0.5), (ids, labels), (ids, labels), artifacts_dir=str(full), **settings)
    # a copy of the run as it stood mid-epoch 2 (step 2 of 4: the epoch's sums are half done)
    part = tmp_path / "part"
    shutil.copytree(full, part)
    chosen = part / "checkpoints" / f"{ckpt.PREFIX}{4 + 2:08d}.json"
    meta = json.loads(chosen.read_text())
    assert meta["epoch"] == 2 and meta["step"] == 2 and "perplexity" in meta["sums"]["metrics"]
    fit(lm_model(lm_parts, lr=0.5), (ids, labels), (ids, labels), artifacts_dir=str(part), resume=str(chosen),
        **settings)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("seconds", "samples_per_s")} for r in rs]
    assert strip(rows(part)) == strip(rows(full))
    assert "train_perplexity" in rows(full)[0]
    a, b = np.load(full / "weights.npz"), np.load(part / "weights.npz")
    assert all(np.array_equal(a[k], b[k]) for k in a.files)


def test_old_sums_and_history_rows_still_load():
    s = learner_mod._Sums()
    s.load_state_dict({"count": 8.0, "loss": 12.0, "correct": 6.0, "top": 7.0, "has_accuracy": True,
                       "has_top": True})
    assert (s.mean_loss, s.accuracy, s.top_accuracy) == (1.5, 0.75, 0.875)
    m = learner_mod.EpochMetrics.from_row({"epoch": 1, "train_loss": 1.0, "train_accuracy": 0.5, "valid_loss": None,
                                          "valid_accuracy": None, "seconds": 2.0})
    assert m.train_top5 is None and m.extra == {}
    m = learner_mod.EpochMetrics.from_row({"epoch": 1, "train_loss": 1.0, "seconds": 2.0, "valid_mae": 0.25})
    assert m.valid_mae == 0.25 and m.row()["valid_mae"] == 0.25
    with pytest.raises(AttributeError):
        _ = m.valid_nothing
    assert Monitor("valid_mae").mode == "min"


# -- the command line: a regression run, its metrics, eval and --monitor ------------------------------
def test_cli_regression_run_monitors_mae_and_eval_prints_it(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from anygrad import cli
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, :3] * 2).astype(np.float32))
    inits = [numpy_helper.from_array((rng.standard_normal((3, 4)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(3, np.float32), "b")]
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["out"], transB=1)], "lin",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "m.onnx"))
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["train", str(tmp_path / "m.onnx"), "--dataset", "npz", "--data-dir", str(tmp_path / "d.npz"),
                         "--loss", "mse", "--epochs", "2", "--batch-size", "8", "--device", "cpu", "--artifacts",
                         str(run), "--normalize", "none", "--monitor", "valid_mae", "--patience", "3"]) == 0
    out = capsys.readouterr().out
    assert "valid_mae=" in out and "the best by valid_mae" in out
    last = rows(run)[-1]
    assert json.loads((run / "export.json").read_text())["value"] == pytest.approx(last["valid_mae"])
    assert cli.main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if s.startswith("loss "))
    assert line == f"loss {last['valid_loss']:.4f}  mse {last['valid_mse']:.4f}  mae {last['valid_mae']:.4f}  (4 samples)"


# -- loss='output': the model's other scalar outputs, by name ----------------------------------------
class OwnLoss(tnn.Module):
    def __init__(self):
        super().__init__()
        self.lin = tnn.Linear(3, 2)

    def forward(self, x, t):
        d = self.lin(x) - t
        mae = d.abs().mean()
        return (d * d).mean() + 0.1 * mae, mae


def test_own_loss_outputs_are_metrics_and_monitorable():
    torch.manual_seed(5)
    net = quiet(anygrad.from_torch, OwnLoss(), (torch.zeros(4, 3), torch.zeros(4, 2)), dynamo=False)
    other = net.graph.outputs[1]
    rng = np.random.default_rng(5)
    xs, ts = rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32)
    data = [{"x": xs[i:i + 4], "t": ts[i:i + 4]} for i in (0, 4)]
    model = copy.deepcopy(net).compile(loss="output", optimizer=SGD(lr=0.0))
    result = fit(model, data, data, epochs=2, log=None, monitor=f"valid_{other}", patience=1)
    row = result.history[0].row()
    state = model.state_dict()
    w, b = (state[next(k for k in state if k.endswith(end))] for end in ("weight", "bias"))
    want = np.mean([np.abs(xs[i:i + 4] @ w.T + b - ts[i:i + 4]).mean() for i in (0, 4)])  # lr 0: fixed weights
    assert row[f"train_{other}"] == pytest.approx(want, rel=1e-5) and row[f"valid_{other}"] == pytest.approx(want, rel=1e-5)
    assert result.stopped_early and result.best_epoch == 1  # lr 0: never improves (min)
    model = copy.deepcopy(net).compile(loss="output")
    with pytest.raises(ConfigError, match=f"reports no metric 'kl'.*valid_{other}"):
        fit(model, data, data, epochs=1, log=None, monitor="valid_kl", patience=1)
