"""Reporters for the training loop: a live dashboard on a terminal, plain lines elsewhere, or quiet.

`make_reporter()` picks one. All three implement `anygrad.train.report.Reporter`; none of them
touches the model or the device, they only format the dataclasses the loop hands them.

Plain lines are meant for logs and scripts: one `key=value` record per line, fields in a fixed
order, `-` for a value that is not known (no validation set, a regression loss without accuracy).
The task's main metrics follow the fixed fields, named as in metrics.jsonl (`train_perplexity=...
valid_perplexity=...`, `valid_mae=...`, `valid_pixel_accuracy=...`; see task_metrics); the live
view shows them compactly (ppl, mae, pixel acc) and leaves out accuracy columns a run never has.
"""
from __future__ import annotations

import atexit
import math
import os
import sys
import time
from collections.abc import Callable
from typing import IO

from .report import EpochInfo, Reporter, RunInfo, StepInfo, ValidInfo

SPARK = "▁▂▃▄▅▆▇█"
CURVE_POINTS = 48  # logged loss values the live sparkline shows
EPOCH_ROWS = 12  # finished epochs the live table keeps (older ones scroll out, the best stays marked)
LINES_PER_EPOCH = 10  # plain mode with every=0: about this many step lines per epoch
SMOOTHING = 0.3  # weight of the newest window loss in the live curve

# The metrics.jsonl keys shown per epoch: (key, plain-mode name, table heading, is a ratio)
EPOCH_FIELDS = (
    ("train_loss", "train_loss", "train loss", False),
    ("train_accuracy", "train_acc", "train acc", True),
    ("valid_loss", "valid_loss", "valid loss", False),
    ("valid_accuracy", "valid_acc", "valid acc", True),
)


# The task's own metrics (metrics.jsonl's train_<name>/valid_<name> beyond the classifier's
# columns): how the dashboard names them, and which are ratios (shown as percent).
SHORT_NAMES = {"perplexity": "ppl", "pixel_accuracy": "pixel acc", "label_accuracy": "label acc"}
FIXED_KEYS = ("loss", "accuracy", "top5")
TASK_COLUMNS = 3  # task metrics the table and the live line show at most (the files hold them all)


def task_metrics(keys) -> list[str]:
    """The task's main metrics among metrics.jsonl keys (or the model's metric names), in order,
    without the train_/valid_ prefix: perplexity for a language model, mae for regression (mse is
    in the files), pixel_accuracy for segmentation, label_accuracy for multi-label, each head's
    for several outputs (not the per-head losses), a loss='output' model's other outputs."""
    names: list[str] = []
    for key in keys:
        name = key.split("_", 1)[1] if key.startswith(("train_", "valid_")) else key
        if key in ("epoch", "seconds", "lr", "samples_per_s", "count") or name in FIXED_KEYS or name in names:
            continue
        names.append(name)
    shown = [n for n in names if not n.endswith("_loss") and not n.endswith("_top5")
             and not (n.endswith("mse") and n[:-3] + "mae" in names)]
    return shown[:TASK_COLUMNS]


def _is_ratio(name: str) -> bool:
    return name.endswith("accuracy") or name.rsplit("_", 1)[-1].startswith("top")


def _short(name: str) -> str:
    for full, short in SHORT_NAMES.items():
        if name == full or name.endswith("_" + full):
            return name[:len(name) - len(full)].replace("_", " ") + short
    return name.replace("_", " ")


def _value(name: str, value: float | None) -> str:
    return _pct(value) if _is_ratio(name) else _num(value)


def _num(value: float | None, spec: str = ".4f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def sparkline(values: list[float], width: int = CURVE_POINTS) -> str:
    """The last `width` values as block characters, scaled between their min and max."""
    vals = [v for v in values[-width:] if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in vals)


def _smooth(values: list[float], alpha: float = SMOOTHING) -> list[float]:
    """Exponential moving average: the trend, not the noise of small logging windows."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class _Summary:
    """What every reporter remembers to print the closing summary line."""

    def __init__(self) -> None:
        self.run: RunInfo | None = None
        self.earlier: list[EpochInfo] = []  # a resumed run's epochs from before (the table shows them)
        self.epochs: list[EpochInfo] = []   # this invocation's (the summary line counts them)
        self.start = time.perf_counter()
        self.best_epoch: int | None = None

    def begin(self, info: RunInfo) -> None:
        self.run, self.earlier, self.epochs, self.start = info, list(info.history), [], time.perf_counter()
        self.best_epoch = next((e.epoch for e in reversed(self.earlier) if e.best), None)

    @property
    def all_epochs(self) -> list[EpochInfo]:
        return self.earlier + self.epochs

    def add(self, info: EpochInfo) -> None:
        self.epochs.append(info)
        if info.best:
            self.best_epoch = info.epoch

    def line(self, stopped_early: bool, interrupted: bool) -> str:
        how = "interrupted" if interrupted else "stopped early" if stopped_early else "done"
        parts = [(f"{how}: {len(self.epochs)} epoch{'s' * (len(self.epochs) != 1)} in "
                 f"{_duration(time.perf_counter() - self.start)}")]
        if self.epochs:
            last = self.epochs[-1].metrics
            parts += [f"{plain}={_num(last.get(key))}" for key, plain, _, _ in EPOCH_FIELDS
                      if last.get(key) is not None]
            parts += [f"{p}_{n}={_num(last.get(f'{p}_{n}'))}" for n in task_metrics(last) for p in ("train", "valid")
                      if last.get(f"{p}_{n}") is not None]
            if self.best_epoch is not None:
                parts.append(f"best_epoch={self.best_epoch}")
        if self.run and self.run.artifacts_dir:
            parts.append(f"artifacts={self.run.artifacts_dir}")
        return " ".join(parts)


# -- quiet and plain ------------------------------------------------------------------------------
class QuietReporter:
    """Messages and the final summary only."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream
        self.summary = _Summary()

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def run_begin(self, info: RunInfo) -> None:
        self.summary.begin(info)

    def step(self, info: StepInfo) -> None:
        pass

    def epoch_end(self, info: EpochInfo) -> None:
        self.summary.add(info)

    def message(self, text: str) -> None:
        self._print(text)

    def run_end(self, stopped_early: bool = False, interrupted: bool = False) -> None:
        self._print(self.summary.line(stopped_early, interrupted))


class PlainReporter(QuietReporter):
    """One line per `every` steps and one per epoch, `key=value` in a fixed order (for logs and CI).

        run model=mnist.onnx device=cpu epochs=2 steps_per_epoch=94 batch_size=64 start_epoch=1
        step epoch=1/2 step=10/94 loss=1.2345 acc=0.6123 lr=0.001 samples_per_s=5321
        epoch 1/2 train_loss=0.4521 train_acc=0.8712 valid_loss=0.2210 valid_acc=0.9351 time=3.2s best=yes
        done: 2 epochs in 0:07 train_loss=... best_epoch=2 artifacts=runs/x
    """

    def __init__(self, every: int = 0, stream: IO[str] | None = None):
        super().__init__(stream)
        self.every = every
        self._last: tuple[int, int] = (0, 0)  # (epoch, step bucket) of the last printed line

    def run_begin(self, info: RunInfo) -> None:
        super().run_begin(info)
        self._last = (0, 0)
        self._print(f"run model={info.model} device={info.device} epochs={info.epochs} "
                    f"steps_per_epoch={info.steps_per_epoch} batch_size={info.batch_size} "
                    f"start_epoch={info.start_epoch}")

    def step(self, info: StepInfo) -> None:
        every = self.every or max(1, info.steps // LINES_PER_EPOCH)
        bucket = (info.epoch, info.step // every)
        if bucket[1] == 0 or bucket <= self._last or info.loss is None:  # on crossing a multiple of `every`
            return
        self._last = bucket
        epochs = self.summary.run.epochs if self.summary.run else "?"
        extra = "".join(f" {n}={_num(info.metrics.get(n))}" for n in task_metrics(info.metrics))
        self._print(f"step epoch={info.epoch}/{epochs} step={info.step}/{info.steps} loss={_num(info.loss)} "
                    f"acc={_num(info.accuracy)}{extra} lr={info.lr:.6g} samples_per_s={info.samples_per_s:.0f}")

    def epoch_end(self, info: EpochInfo) -> None:
        super().epoch_end(info)
        epochs = self.summary.run.epochs if self.summary.run else "?"
        fields = " ".join(f"{plain}={_num(info.metrics.get(key))}" for key, plain, _, _ in EPOCH_FIELDS)
        fields += "".join(f" {p}_{n}={_num(info.metrics.get(f'{p}_{n}'))}" for n in task_metrics(info.metrics)
                          for p in ("train", "valid"))
        self._print(f"epoch {info.epoch}/{epochs} {fields} time={info.seconds:.1f}s "
                    f"best={'yes' if info.best else 'no'}")


# -- the live dashboard ---------------------------------------------------------------------------
def _hide_control_echo() -> Callable[[], None] | None:
    """Stop the terminal from echoing control keys (Ctrl-C as "^C") while the live view is drawn;
    returns what puts the setting back (None where there is no such terminal setting).

    The view ends in a line as wide as the terminal, which leaves the cursor waiting to wrap: an
    echoed "^C" wraps it onto a new line that rich does not know of, so rich's next redraw (the
    "interrupted ... continue with" message printed above the view) starts one line too low and
    leaves the old top border behind. Without the echo its line count stays right. Only ECHOCTL
    changes (SIGINT still arrives); if the process dies before restoring it, ^C just is not
    shown in that terminal until `stty echoctl`."""
    try:
        import termios
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except (ImportError, OSError):  # Windows, or no controlling terminal
        return None
    try:
        before = termios.tcgetattr(fd)
        if not before[3] & termios.ECHOCTL:
            os.close(fd)
            return None
        quiet = list(before)
        quiet[3] &= ~termios.ECHOCTL
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except (termios.error, OSError):
        os.close(fd)
        return None

    def restore() -> None:
        try:
            termios.tcsetattr(fd, termios.TCSANOW, before)
        except (termios.error, OSError):
            pass
        finally:
            os.close(fd)
    return restore


def _count_column():
    """The bars' done/total: a task's own `count` field where it has one (the run's bar: training
    steps), else its completed/total."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Count(ProgressColumn):
        def render(self, task) -> Text:
            text = task.fields.get("count") or f"{int(task.completed)}/{int(task.total or 0)}"
            return Text(text, style="progress.download")
    return Count()


class LiveReporter:
    """A rich `Live` view: epoch and run progress with ETA, current metrics, a loss sparkline, the
    finished epochs. Messages print above it; the final view stays on screen after the run."""

    def __init__(self, console=None):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console or Console()
        self.progress = Progress(TextColumn("{task.description:<12}"), BarColumn(bar_width=None),
                                 _count_column(), TextColumn("elapsed"), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), console=self.console, expand=True)
        self.summary = _Summary()
        self.live = None
        self.current: StepInfo | None = None
        self.losses: list[float] = []
        self._epoch_task = self._run_task = None
        self._epoch_seen = 0
        self._prev: StepInfo | None = None
        self._restore_echo: Callable[[], None] | None = None

    # -- rendering ------------------------------------------------------------------------------
    def _header(self):
        from rich.text import Text
        run = self.summary.run
        t = Text()
        t.append(" anygrad ", style="bold white on blue")
        t.append(f"  {run.model}", style="bold")
        t.append("  on ")
        t.append(run.device, style="bold cyan")
        t.append(f"   batch {run.batch_size}")
        if run.start_epoch > 1:
            t.append(f"   resumed at epoch {run.start_epoch}", style="yellow")
        return t

    def _metrics(self):
        from rich.text import Text
        s = self.current
        t = Text()
        if s is None:
            run = self.summary.run
            on_gpu = run is not None and not run.device.lower().startswith("cpu")
            t.append("waiting for the first step" + (" (compiling the device's shaders: seconds to a minute the "
                                                     "first time)" if on_gpu else "") + " ...", style="dim")
            return t
        t.append("loss ", style="dim")
        t.append(_num(s.loss), style="bold")
        if s.accuracy is not None:
            t.append("   acc ", style="dim")
            t.append(_pct(s.accuracy), style="bold")
        for name in task_metrics(s.metrics):
            if s.metrics.get(name) is not None:
                t.append(f"   {_short(name)} ", style="dim")
                t.append(_value(name, s.metrics[name]), style="bold")
        t.append("   lr ", style="dim")
        t.append(f"{s.lr:.3g}")
        t.append("   ", style="dim")
        t.append(f"{s.samples_per_s:,.0f}")
        t.append(" samples/s", style="dim")
        return t

    def _curve(self):
        from rich.text import Text
        t = Text()
        vals = _smooth([v for v in self.losses if math.isfinite(v)])[-CURVE_POINTS:]
        t.append("loss curve ", style="dim")
        if vals:
            t.append(sparkline(vals), style="green")
            t.append(f"  {_num(vals[0], '.3f')} → {_num(vals[-1], '.3f')}", style="dim")
        return t

    def _table(self):
        from rich.table import Table
        table = Table(expand=False, header_style="bold", box=None, padding=(0, 1))
        table.add_column("epoch", justify="right")
        epochs = self.summary.all_epochs[-EPOCH_ROWS:]
        # the accuracy columns when some epoch has one (a regression run has none); then the task's
        columns = [(key, heading, ratio) for key, _, heading, ratio in EPOCH_FIELDS
                   if not ratio or any(e.metrics.get(key) is not None for e in epochs)]
        names: list[str] = []
        for e in epochs:
            names += [n for n in task_metrics(e.metrics) if n not in names]
        for name in names[:TASK_COLUMNS]:
            for p in ("train", "valid"):
                columns.append((f"{p}_{name}", f"{p} {_short(name)}", _is_ratio(name)))
        for _, heading, _ in columns:
            table.add_column(heading, justify="right")
        table.add_column("time", justify="right")
        table.add_column("", justify="left")
        for e in epochs:
            cells = [_pct(e.metrics.get(k)) if ratio else _num(e.metrics.get(k)) for k, _, ratio in columns]
            best = e.epoch == self.summary.best_epoch  # one marker: the best so far
            table.add_row(str(e.epoch), *cells, _duration(e.seconds), "★ best" if best else "",
                          style="bold green" if best else None)
        return table

    def render(self):
        from rich.console import Group
        from rich.panel import Panel
        if self.summary.run is None:
            return Group()
        parts = [self._header(), self.progress, self._metrics(), self._curve()]
        if self.summary.all_epochs:
            parts.append(self._table())
        return Panel(Group(*parts), border_style="blue", padding=(0, 1))

    # -- Reporter hooks -------------------------------------------------------------------------
    def run_begin(self, info: RunInfo) -> None:
        from rich.live import Live
        self.summary.begin(info)
        for earlier in info.earlier_steps:  # a resumed run's curve goes on from where it was
            if earlier.loss is not None:
                self.losses.append(self._window_loss(earlier))
        # The run's bar moves through validation batches too, so that its ETA counts them, but it
        # says training steps (epochs x steps): validation batches are the epoch bar's to show.
        self._epoch_task = self.progress.add_task(f"epoch {info.start_epoch}/{info.epochs}",
                                                  total=info.steps_per_epoch)
        self._run_task = self.progress.add_task("run", total=info.epochs * self._epoch_units(info),
                                                completed=(info.start_epoch - 1) * self._epoch_units(info))
        self._count_steps((info.start_epoch - 1) * info.steps_per_epoch)
        self._epoch_seen = info.start_epoch
        self.live = Live(get_renderable=self.render, console=self.console, refresh_per_second=8,
                         transient=False, redirect_stdout=True, redirect_stderr=True)
        self._restore_echo = _hide_control_echo() if self.console.is_terminal else None
        self.live.start()
        atexit.register(self._stop)  # an exception that skips run_end must not leave the cursor hidden

    @staticmethod
    def _epoch_units(run: RunInfo) -> int:
        return run.steps_per_epoch + run.valid_steps

    def _count_steps(self, done: int) -> None:
        run = self.summary.run
        total = run.epochs * run.steps_per_epoch if run else 0
        self.progress.update(self._run_task, count=f"{done}/{total}")

    def _stop(self) -> None:
        if self.live:
            self.live.stop()
            self.live = None
        if self._restore_echo is not None:
            self._restore_echo()
            self._restore_echo = None

    def step(self, info: StepInfo) -> None:
        run = self.summary.run
        if info.epoch != self._epoch_seen:
            self._epoch_seen = info.epoch
            self.progress.reset(self._epoch_task, total=info.steps,
                                description=f"epoch {info.epoch}/{run.epochs if run else '?'}")
        self.progress.update(self._epoch_task, completed=info.step, total=info.steps)
        before = info.epoch - 1
        self.progress.update(self._run_task, completed=before * (self._epoch_units(run) if run else info.steps)
                             + info.step)
        self._count_steps(before * (run.steps_per_epoch if run else info.steps) + info.step)
        if info.loss is not None:
            self.losses.append(self._window_loss(info))
            self.current = info
        elif self.current is not None:
            self.current.samples_per_s, self.current.lr = info.samples_per_s, info.lr

    def _window_loss(self, info: StepInfo) -> float:
        """The mean loss of the steps since the previous report: the loop reports a running mean
        over the epoch, which would make the curve jump at every epoch start."""
        prev, self._prev = self._prev, info
        if prev is None or prev.epoch != info.epoch or prev.step >= info.step or prev.loss is None:
            return info.loss
        return (info.loss * info.step - prev.loss * prev.step) / (info.step - prev.step)

    def validation(self, info: ValidInfo) -> None:
        """The epoch's bar becomes the validation bar while the validation set runs."""
        run = self.summary.run
        if run is None:
            return
        self.progress.update(self._epoch_task, completed=info.step, total=info.steps,
                             description=f"valid {info.epoch}/{run.epochs}")
        self.progress.update(self._run_task, completed=(info.epoch - 1) * self._epoch_units(run)
                             + run.steps_per_epoch + info.step)

    def epoch_end(self, info: EpochInfo) -> None:
        self.summary.add(info)
        run = self.summary.run
        if run is not None:
            self.progress.update(self._run_task, completed=info.epoch * self._epoch_units(run))
            self._count_steps(info.epoch * run.steps_per_epoch)
            self.progress.update(self._epoch_task, completed=run.steps_per_epoch, total=run.steps_per_epoch,
                                 description=f"epoch {info.epoch}/{run.epochs}")
        if self.live:
            self.live.refresh()

    def message(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)  # above the live view while it runs

    def run_end(self, stopped_early: bool = False, interrupted: bool = False) -> None:
        if self.live:
            self.live.refresh()
        self._stop()
        atexit.unregister(self._stop)
        self.console.print(self.summary.line(stopped_early, interrupted), markup=False, highlight=False)


def make_reporter(quiet: bool = False, tty: bool | None = None, every: int = 0,
                  stream: IO[str] | None = None) -> Reporter:
    """The reporter for this output: quiet -> summary only; a terminal -> live dashboard; else plain lines.

    `every`: plain mode prints a step line every `every` steps (0: about ten per epoch).
    `tty`: force the choice (default: whether stdout is a terminal).
    """
    if quiet:
        return QuietReporter(stream)
    if tty is None:
        tty = (stream or sys.stdout).isatty()
    if tty:
        from rich.console import Console
        return LiveReporter(Console(file=stream, force_terminal=True) if stream is not None else None)
    return PlainReporter(every, stream)
