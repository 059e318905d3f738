"""LineReporter: the Reporter of plain lines (logs, CI, a pipe; the rich one is dashboard.py)."""
from __future__ import annotations

import warnings
from collections.abc import Callable

from .metrics import FIXED_MONITORS
from .report import EpochInfo, RunInfo, StepInfo

Log = Callable[[str], None]
WARNING = "warning: "   # how a Reporter message that warns begins


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


class LineReporter:
    """A Reporter over two callables: `log` gets one line per epoch and messages, `progress` one
    line every `log_every` steps (either may be None). Without a `log`, messages that warn
    ("warning: ...") go to Python's `warnings` instead (`fit(log=None)` silences the lines, not
    the news that the weights stopped changing; filter them as any warning), unless `warn` is
    False (data-parallel ranks other than the one that speaks)."""

    def __init__(self, log: Log | None = print, progress: Log | None = None, warn: bool = True):
        self.log, self.progress, self.epochs, self.warn = log, progress, 0, warn

    def run_begin(self, info: RunInfo) -> None:
        self.epochs = info.epochs

    def step(self, info: StepInfo) -> None:
        if self.progress:
            self.progress(f"epoch {info.epoch}/{self.epochs} step {info.step}/{info.steps}  loss {_fmt(info.loss)}"
                          f"  acc {_fmt(info.accuracy)}  lr {info.lr:.3g}  {info.samples_per_s:.0f} samples/s")

    def epoch_end(self, info: EpochInfo) -> None:
        if self.log:
            m = info.metrics
            top = f" top5 {_fmt(m.get('valid_top5'))}" if m.get("valid_top5") is not None else ""
            top += "".join(f"  {k.replace('_', ' ', 1)} {_fmt(v)}" for k, v in m.items()
                           if k.startswith(("train_", "valid_")) and k not in FIXED_MONITORS and v is not None)
            self.log(f"epoch {info.epoch}/{self.epochs}  train loss {_fmt(m.get('train_loss'))} "
                     f"acc {_fmt(m.get('train_accuracy'))}  valid loss {_fmt(m.get('valid_loss'))} "
                     f"acc {_fmt(m.get('valid_accuracy'))}{top}  {info.seconds:.1f}s" + ("  *" if info.best else ""))

    def message(self, text: str) -> None:
        if self.log:
            self.log(text)
        elif self.warn and text.startswith(WARNING):
            warnings.warn(text[len(WARNING):], RuntimeWarning, stacklevel=2)

    def run_end(self, stopped_early: bool = False, interrupted: bool = False) -> None:
        pass

