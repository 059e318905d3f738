"""What a person sees while a run works (issue 12, items 14-15): a validation bar with the run's ETA
counting it, the shader-compilation hint, Ctrl-C acknowledged at once and the resume hint last,
and metrics_steps.csv for the curves of short runs."""
from __future__ import annotations

import csv
import io
import os
import signal

import numpy as np
from rich.console import Console
from test_resume import _mlp

import anygrad
from anygrad.optim import get_optimizer
from anygrad.train import LineReporter, TrainConfig, fit
from anygrad.train.dashboard import LiveReporter
from anygrad.train.report import EpochInfo, RunInfo, StepInfo, ValidInfo


def _text(reporter: LiveReporter) -> str:
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(reporter.render())
    return out.getvalue()


def test_validation_has_a_bar_and_counts_in_the_eta():
    r = LiveReporter(Console(file=io.StringIO(), width=120))
    r.run_begin(RunInfo("m.onnx", "wgpu: llvmpipe (Vulkan, CPU)", 2, 6, 32, valid_steps=4))
    try:
        assert "compiling the device's shaders" in _text(r)
        run_task = r.progress.tasks[1]
        assert run_task.total == 2 * (6 + 4)
        r.step(StepInfo(1, 6, 6, 6, 1.0, 0.5, 0.01, 100.0))
        r.validation(ValidInfo(1, 3, 4))
        text = _text(r)
        assert "valid 1/2" in text and "3/4" in text
        assert run_task.completed == 6 + 3
        r.epoch_end(EpochInfo(1, {"train_loss": 1.0}, 1.0))
        assert run_task.completed == 10 and "epoch 1/2" in _text(r)
    finally:
        r.run_end()
    cpu = LiveReporter(Console(file=io.StringIO(), width=120))
    cpu.run_begin(RunInfo("m.onnx", "cpu (numpy)", 1, 6, 32))
    assert "shaders" not in _text(cpu)
    cpu.run_end()


def _model(tmp_path):
    path = _mlp(tmp_path / "mlp.onnx", hidden=8)
    return anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer("adam", lr=0.01), "cpu", seed=5)


def _data():
    rng = np.random.default_rng(2)
    return rng.standard_normal((40, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 40).astype(np.int64)


def test_ctrl_c_is_acknowledged_at_once_and_the_resume_hint_comes_last(tmp_path):
    events: list[str] = []

    class Recorder(LineReporter):
        def step(self, info):
            events.append(f"step {info.step}")
            if info.step == 2:
                os.kill(os.getpid(), signal.SIGINT)
                events.append("after kill")

        def run_end(self, stopped_early=False, interrupted=False):
            events.append("run_end")

    x, y = _data()
    fit(_model(tmp_path), (x, y), (x, y), TrainConfig(epochs=1, batch_size=8, log_every=1,
                                                       artifacts_dir=str(tmp_path / "run")),
        reporter=Recorder(events.append))
    ack = next(i for i, e in enumerate(events) if e.startswith("stopping after this step"))
    assert ack < events.index("after kill")  # said in the signal handler, before the step ends
    assert events.index("run_end") < len(events) - 1 and "continue with" in events[-1]


def test_steps_are_written_to_metrics_steps_csv_and_resume_drops_later_rows(tmp_path):
    x, y = _data()
    config = TrainConfig(epochs=2, batch_size=8, log_every=2, artifacts_dir=str(tmp_path / "run"))
    fit(_model(tmp_path), (x, y), (x, y), config, log=None)
    path = tmp_path / "run" / "metrics_steps.csv"
    rows = list(csv.DictReader(path.open()))
    assert [(int(r["epoch"]), int(r["step"])) for r in rows] == [(1, 2), (1, 4), (2, 2), (2, 4)]
    assert all(float(r["loss"]) > 0 for r in rows)
    with path.open("a") as f:  # a row from beyond the checkpoint, as a killed run would leave
        f.write("3,2,12,1.0,0.5,0.01,10\n")
    fit(_model(tmp_path), (x, y), (x, y), config, log=None, resume=True)  # finished: nothing to train
    assert len(list(csv.DictReader(path.open()))) == 4


def test_plot_draws_the_step_curve(tmp_path):
    import pytest
    pytest.importorskip("matplotlib")
    from anygrad.plot import plot_run, read_steps
    x, y = _data()
    run = tmp_path / "run"
    fit(_model(tmp_path), (x, y), (x, y), TrainConfig(epochs=2, batch_size=8, log_every=1, artifacts_dir=str(run)),
        log=None)
    steps = read_steps(run)
    assert len(steps) == 8 and steps[0]["steps"] == 5  # 4 reads per epoch (the last step is the epoch's own read)
    written = plot_run(run, tmp_path / "plots")
    assert [p.name for p in written] == ["loss.png", "accuracy.png"] and all(p.stat().st_size > 0 for p in written)
