"""The training reporters as a person sees them: the live dashboard in a real terminal (tmux), plain
lines in a log, and the quiet summary."""
from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anygrad.train.dashboard import LiveReporter, PlainReporter, QuietReporter, make_reporter, sparkline
from anygrad.train.report import EpochInfo, RunInfo, StepInfo

DEVICE = "wgpu: llvmpipe (Vulkan, CPU)"

# Drives a reporter with scripted events the way the training loop does; argv: delay per step.
DRIVER = f'''
import math, sys, time
from anygrad.train.dashboard import make_reporter
from anygrad.train.report import EpochInfo, RunInfo, StepInfo
delay = float(sys.argv[1])
r = make_reporter()
E, S = 3, 20
r.run_begin(RunInfo("mnist.onnx", "{DEVICE}", E, S, 64, artifacts_dir="runs/demo"))
g = 0
for e in range(1, E + 1):
    for s in range(1, S + 1):
        g += 1
        loss = 2.3 * math.exp(-g / 15) + 0.1
        r.step(StepInfo(e, s, S, g, loss, 1 - loss / 2.5, 1e-3, 5120.0))
        time.sleep(delay)
    if e == 2:
        r.message("interrupted: checkpoint written, resume with anygrad train --resume runs/demo")
    r.epoch_end(EpochInfo(e, {{"train_loss": loss, "train_accuracy": 1 - loss / 2.5,
                              "valid_loss": loss * 0.9, "valid_accuracy": 1 - loss / 2.6}}, 1.5, best=e != 3))
r.run_end()
print("DRIVER-DONE", flush=True)
'''


def _events(reporter, epochs: int = 2, steps: int = 20, every_step: bool = True) -> None:
    reporter.run_begin(RunInfo("m.onnx", "cpu (numpy)", epochs, steps, 32, artifacts_dir="runs/x"))
    g = 0
    for e in range(1, epochs + 1):
        for s in range(1, steps + 1):
            g += 1
            if every_step or s % 7 == 0:
                reporter.step(StepInfo(e, s, steps, g, 1.0 / g, 0.5 + e / 10, 0.01, 1000.0))
        reporter.epoch_end(EpochInfo(e, {"train_loss": 1.0 / e, "train_accuracy": 0.5 + e / 10,
                                         "valid_loss": None, "valid_accuracy": None}, 2.0, best=e == 1))
    reporter.run_end()


# -- plain lines ----------------------------------------------------------------------------------
STEP_RE = re.compile(r"^step epoch=(\d+)/(\d+) step=(\d+)/(\d+) loss=([\d.]+) acc=([\d.]+) lr=([\d.e-]+) "
                     r"samples_per_s=(\d+)$")
EPOCH_RE = re.compile(r"^epoch (\d+)/(\d+) train_loss=(\S+) train_acc=(\S+) valid_loss=(\S+) valid_acc=(\S+) "
                      r"time=([\d.]+)s best=(yes|no)$")


def test_plain_lines_are_parseable_and_throttled():
    out = io.StringIO()
    _events(PlainReporter(every=5, stream=out))
    lines = out.getvalue().splitlines()
    assert lines[0] == "run model=m.onnx device=cpu (numpy) epochs=2 steps_per_epoch=20 batch_size=32 start_epoch=1"
    steps = [STEP_RE.match(line) for line in lines if line.startswith("step ")]
    assert all(steps) and [int(m[3]) for m in steps] == [5, 10, 15, 20] * 2
    assert [int(m[1]) for m in steps] == [1] * 4 + [2] * 4
    assert float(steps[0][5]) == pytest.approx(1 / 5, abs=1e-4)
    epochs = [EPOCH_RE.match(line) for line in lines if line.startswith("epoch ")]
    assert all(epochs) and len(epochs) == 2
    assert epochs[0][3] == "1.0000" and epochs[0][5] == "-" and epochs[0][8] == "yes" and epochs[1][8] == "no"
    assert lines[-1].startswith("done: 2 epochs in ") and "best_epoch=1" in lines[-1]
    assert lines[-1].endswith("artifacts=runs/x")


def test_plain_lines_when_the_loop_reports_sparsely():
    """The loop may call step() only every few steps: a line still comes out per crossed multiple."""
    out = io.StringIO()
    _events(PlainReporter(every=5, stream=out), epochs=1, every_step=False)
    assert [line.split()[2] for line in out.getvalue().splitlines() if line.startswith("step ")] == \
        ["step=7/20", "step=14/20"]


def test_plain_default_is_about_ten_lines_per_epoch():
    out = io.StringIO()
    _events(make_reporter(tty=False, stream=out), epochs=1, steps=100)
    assert sum(line.startswith("step ") for line in out.getvalue().splitlines()) == 10


def test_quiet_prints_messages_and_the_summary_only():
    out = io.StringIO()
    r = make_reporter(quiet=True, stream=out)
    assert isinstance(r, QuietReporter) and not isinstance(r, PlainReporter)
    r.run_begin(RunInfo("m", "cpu", 1, 3, 8))
    r.step(StepInfo(1, 1, 3, 1, 0.5, None, 0.1, 10.0))
    r.message("hello")
    r.epoch_end(EpochInfo(1, {"train_loss": float("nan")}, 1.0))
    r.run_end(interrupted=True)
    lines = out.getvalue().splitlines()
    assert lines[0] == "hello" and len(lines) == 2
    assert lines[1].startswith("interrupted: 1 epoch in") and "train_loss=nan" in lines[1]


def test_sparkline_scales_between_min_and_max():
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"  # the middle value lands in the upper half of 8 levels
    assert sparkline([1.0, 1.0]) == "▁▁" and sparkline([]) == ""
    assert sparkline([math.nan, 1.0, 2.0]) == "▁█"


def test_live_reporter_renders_to_a_forced_terminal():
    """The rich view without a terminal (a recording console): bars, metrics, table, best marker."""
    from rich.console import Console
    out = io.StringIO()
    r = LiveReporter(Console(file=out, force_terminal=True, width=100, color_system=None))
    assert isinstance(make_reporter(tty=True, stream=io.StringIO()), LiveReporter)
    _events(r)
    text = out.getvalue()
    assert "m.onnx" in text and "cpu (numpy)" in text and "epoch 2/2" in text and "40/40" in text
    assert "★ best" in text and "done: 2 epochs" in text


def _live(width: int = 110):
    from rich.console import Console
    out = io.StringIO()
    return LiveReporter(Console(file=out, force_terminal=True, width=width, color_system=None)), out


def test_the_run_bar_counts_training_steps_not_validation_batches():
    """8 epochs of 6 steps with 10 validation batches each: `run 48/48`, never out of 128."""
    from anygrad.train.report import ValidInfo
    r, out = _live()
    r.run_begin(RunInfo("m.onnx", "cpu (numpy)", 8, 6, 32, valid_steps=10))
    g = 0
    for e in range(1, 9):
        for s in range(1, 7):
            g += 1
            r.step(StepInfo(e, s, 6, g, 1.0 / g, 0.5, 0.01, 1000.0))
        for v in range(1, 11):
            r.validation(ValidInfo(e, v, 10))
        task = r.progress.tasks[1]  # its ETA counts the validation batches; what it says does not
        assert (task.completed, task.total, task.fields["count"]) == (16 * e, 128, f"{6 * e}/48")
        r.epoch_end(EpochInfo(e, {"train_loss": 1.0 / e}, 1.0))
    r.run_end()
    text = out.getvalue()
    assert "48/48" in text and "/128" not in text


def test_a_resumed_dashboard_keeps_the_earlier_epochs_and_curve():
    history = [EpochInfo(e, {"train_loss": 2.0 / e, "train_accuracy": 0.1 * e, "valid_loss": 1.5 / e,
                             "valid_accuracy": 0.1 * e}, 3.0, best=e == 2) for e in (1, 2)]
    earlier = [StepInfo(e, s, 4, 4 * (e - 1) + s, 2.0 / (4 * (e - 1) + s), None, 0.01, 100.0)
               for e in (1, 2) for s in (2, 4)]
    r, out = _live()
    r.run_begin(RunInfo("m.onnx", "cpu (numpy)", 3, 4, 32, start_epoch=3, history=history,
                        earlier_steps=earlier))
    assert len(r.losses) == 4  # the curve goes on from the earlier progress reads
    r.step(StepInfo(3, 4, 4, 12, 0.1, 0.9, 0.01, 100.0))
    r.epoch_end(EpochInfo(3, {"train_loss": 0.9, "train_accuracy": 0.2, "valid_loss": 0.9,
                              "valid_accuracy": 0.2}, 3.0, best=False))
    r.run_end()
    rows = [line for line in out.getvalue().splitlines() if re.match(r"^\W*[123]\s+\d\.\d{4}", line)]
    final = rows[-3:]
    assert [int(re.match(r"^\W*(\d)", line)[1]) for line in final] == [1, 2, 3], rows
    assert f"{1.5 / 2:.4f}" in final[1] and "★ best" in final[1] and "★" not in final[2]
    assert "done: 1 epoch in" in out.getvalue()  # the summary counts this invocation's epochs


def test_a_resumed_run_hands_the_dashboard_its_history(tmp_path):
    """Through the Learner: the resumed run's RunInfo holds the epochs and progress reads before."""
    import numpy as np
    from test_cli import _mlp

    import anygrad
    from anygrad.optim import get_optimizer
    from anygrad.train import LineReporter, fit

    class Recording(LineReporter):
        def run_begin(self, info):
            self.info = info

    path = _mlp(tmp_path / "mlp.onnx")
    rng = np.random.default_rng(0)
    data = rng.standard_normal((16, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int64)

    def model():
        return anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer("sgd", lr=0.05), "cpu")
    settings = {"batch_size": 8, "log_every": 1, "artifacts_dir": str(tmp_path / "run")}
    first = Recording(None)
    fit(model(), data, data, epochs=2, reporter=first, **settings)
    assert first.info.history == [] and first.info.earlier_steps == []
    again = Recording(None)
    result = fit(model(), data, data, epochs=3, reporter=again, resume=True, **settings)
    info = again.info
    assert info.start_epoch == 3 and [e.epoch for e in info.history] == [1, 2]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e.metrics["train_loss"] for e in info.history] == [row["train_loss"] for row in rows[:2]]
    assert [e.best for e in info.history].count(True) == 1
    import csv
    with open(tmp_path / "run" / "metrics_steps.csv", newline="") as f:
        logged = [(int(r["epoch"]), int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)
                  if int(r["epoch"]) <= 2]  # what was there when the resumed run began
    assert {e for e, _, _ in logged} == {1, 2}  # the progress reads of both earlier epochs
    assert [(s.epoch, s.step, s.loss) for s in info.earlier_steps] == logged
    assert len(result.history) == 3


# -- the live view in a real terminal -------------------------------------------------------------
def _capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux): "
                    "the live dashboard is checked in a real terminal through tmux")
def test_live_dashboard_in_a_terminal(tmp_path: Path):
    script = tmp_path / "drive.py"
    script.write_text(DRIVER)
    session = f"anygrad-dash-{tmp_path.name}"[:60]
    cmd = f"env -u COLUMNS -u LINES {sys.executable} {script} 0.08; sleep 60"  # the pane decides the size
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "30", cmd], check=True)
    try:
        # mid-run: the view is live
        deadline, mid = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            mid = _capture(session)
            if "epoch 2/3" in mid and "valid acc" in mid:
                break
            time.sleep(0.2)
        assert "epoch 2/3" in mid, mid
        assert "━" in mid and re.search(r"\b\d+/20\b", mid) and re.search(r"\b\d+/60\b", mid), mid
        assert "eta" in mid and DEVICE in mid and "mnist.onnx" in mid, mid
        assert re.search(r"loss \d\.\d{4}", mid) and "samples/s" in mid and "lr 0.001" in mid, mid
        assert re.search(r"loss curve [▁▂▃▄▅▆▇█]{5,}", mid), mid
        assert re.search(r"^\W*1\s+0\.\d{4}\s+\d+\.\d\d%", mid, re.MULTILINE), mid  # the finished epoch's row

        deadline, end = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            end = _capture(session)
            if "DRIVER-DONE" in end:
                break
            time.sleep(0.2)
        assert "DRIVER-DONE" in end, end
        lines = end.splitlines()
        msg = next(i for i, line in enumerate(lines) if line.startswith("interrupted: checkpoint written"))
        panel = next(i for i, line in enumerate(lines) if line.startswith("╭"))
        assert msg < panel, end  # the message printed above the live view, not inside or below it
        assert "60/60" in end and "20/20" in end and "★ best" in end, end
        best = next(line for line in lines if "★ best" in line)
        assert re.match(r"^\W*2\s", best), best  # epoch 3 was not better: the marker stays on epoch 2
        assert any(line.startswith("done: 3 epochs") for line in lines), end
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


# A real (tiny) training run through the Learner's loop, shown by the live dashboard.
REAL_RUN = '''
import sys
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
import anygrad
from anygrad.data import DataConfig
from anygrad.optim import get_optimizer
from anygrad.train import fit
from anygrad.train.dashboard import make_reporter
rng = np.random.default_rng(0)
inits = [numpy_helper.from_array(np.array([-1, 784], np.int64), "shape"),
         numpy_helper.from_array((rng.standard_normal((16, 784)) * 0.05).astype(np.float32), "w1"),
         numpy_helper.from_array(np.zeros(16, np.float32), "b1"),
         numpy_helper.from_array((rng.standard_normal((10, 16)) * 0.2).astype(np.float32), "w2"),
         numpy_helper.from_array(np.zeros(10, np.float32), "b2")]
nodes = [helper.make_node("Reshape", ["x", "shape"], ["f"]),
         helper.make_node("Gemm", ["f", "w1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1)]
g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 28, 28])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), "tiny.onnx")
cfg = DataConfig(data_dir=sys.argv[1])
data = cfg.load()
t = cfg.transform(data, train=False)
train = (t(data.train[0][:640], None, 0), data.train[1][:640])
valid = (t(data.valid[0][:320], None, 0), data.valid[1][:320])
model = anygrad.load_onnx("tiny.onnx").compile(loss="cross_entropy", optimizer=get_optimizer("adam", lr=3e-3),
                                               device="cpu")
fit(model, train, valid, reporter=make_reporter(), epochs=2, batch_size=32, log_every=2, artifacts_dir="run")
print("REAL-DONE", flush=True)
'''
SUBSET = Path(__file__).resolve().parents[1].parent / "shared/datasets/mnist-subset"
needs_subset = pytest.mark.skipif(not SUBSET.is_dir(), reason="shared MNIST subset not checked out next to the repo")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux): "
                    "the live dashboard is checked in a real terminal through tmux")
@needs_subset
def test_live_dashboard_of_a_real_training_run(tmp_path: Path):
    (tmp_path / "real.py").write_text(REAL_RUN)
    session = f"anygrad-real-{tmp_path.name}"[:60]
    cmd = f"cd {tmp_path} && env -u COLUMNS -u LINES {sys.executable} real.py {SUBSET}; sleep 60"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "110", "-y", "30", cmd], check=True)
    try:
        deadline, screen = time.monotonic() + 120, ""
        while time.monotonic() < deadline and "REAL-DONE" not in screen:
            time.sleep(0.5)
            screen = _capture(session)
        assert "REAL-DONE" in screen, screen
        assert "tiny.onnx" in screen and "cpu (numpy)" in screen and "epoch 2/2" in screen, screen
        # run and epoch bars complete; the run bar counts training steps only (2 epochs x 20), not the
        # validation batches (10 per epoch) the epoch's bar shows while they run
        assert "40/40" in screen and "20/20" in screen and "/60" not in screen, screen
        rows = [line for line in screen.splitlines() if re.match(r"^│\s+[12]\s+\d\.\d{4}", line)]
        assert len(rows) == 2, screen
        metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        for row, m in zip(rows, metrics):  # the table shows what metrics.jsonl holds
            assert f"{m['train_loss']:.4f}" in row and f"{100 * m['valid_accuracy']:.2f}%" in row, (row, m)
        assert re.search(r"loss curve [▁▂▃▄▅▆▇█]{3,}", screen), screen
        assert any(line.startswith("done: 2 epochs") for line in screen.splitlines()), screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux): "
                    "the live dashboard is checked in a real terminal through tmux")
@needs_subset
def test_ctrl_c_in_a_terminal_leaves_a_clean_screen(tmp_path: Path):
    """Ctrl-C typed into the terminal (tmux send-keys): the message prints below one intact view,
    with no stray top border left from a redraw that lost count of its lines (the echoed "^C"
    wrapped the full-width bottom line), and the terminal's echo setting is put back."""
    script = REAL_RUN.split("cfg = DataConfig")[0]  # writes tiny.onnx
    (tmp_path / "make.py").write_text(script)
    subprocess.run([sys.executable, "make.py"], cwd=tmp_path, check=True)
    session = f"anygrad-ctrlc-{tmp_path.name}"[:60]
    src = Path(__file__).resolve().parents[1] / "src"
    cmd = (f"cd {tmp_path} && env -u COLUMNS -u LINES PYTHONPATH={src} {sys.executable} -m anygrad.cli train "
           f"tiny.onnx --data-dir {SUBSET} --device cpu --epochs 50 --batch-size 8 --log-every 5 --artifacts run; "
           "echo EXIT=$?; stty -a | tr ' ;' '\\n\\n' | grep echoctl; sleep 60")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "40", cmd], check=True)
    try:
        deadline, screen = time.monotonic() + 120, ""
        while time.monotonic() < deadline and not re.search(r"│\s+1\s+\d\.\d{4}", screen):  # epoch 1 in the table
            time.sleep(0.3)
            screen = _capture(session)
        assert "╭" in screen, screen
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        while time.monotonic() < deadline and "EXIT=" not in screen:
            time.sleep(0.3)
            screen = _capture(session)
        assert "EXIT=130" in screen, screen
        lines = screen.splitlines()
        tops = [i for i, line in enumerate(lines) if line.startswith("╭")]
        msg = next(i for i, line in enumerate(lines) if line.startswith("interrupted at epoch"))
        assert len(tops) == 1 and msg > tops[0], screen
        hint = " ".join(lines[msg:msg + 5])  # the run folder is named as an absolute path, wrapped
        assert "continue with: anygrad train --resume" in hint and f"{tmp_path}/run" in hint.replace("\n", ""), screen
        assert "echoctl" in lines and "-echoctl" not in lines, screen  # the setting is back
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
