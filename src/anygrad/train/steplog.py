"""metrics_steps.csv: the running metrics at every progress read, for curves of short runs.

metrics.jsonl has one row per epoch, too few to plot a run of two epochs. This file gets a row
each time the loop reads the device's metric sums (every `log_every` steps): the running means of
the epoch so far (loss, accuracy, then the task's own metrics: perplexity, mae, pixel_accuracy, ...,
as columns named as the model names them), the rate and the throughput. Rows are appended
(one write each, flushed); a run resumed from a checkpoint first drops the rows past that
checkpoint's step, so the file tells one history, as metrics.jsonl does.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

from ..fsutil import atomic_write
from .report import StepInfo

NAME = "metrics_steps.csv"
FIELDS = ("epoch", "step", "steps", "global_step", "loss", "accuracy", "lr", "samples_per_s")


class StepLog:
    def __init__(self, folder: Path):
        self.path = folder / NAME
        self.fields: list[str] | None = None  # the file's header (FIELDS, then the task's metrics)

    def _header(self) -> list[str] | None:
        try:
            with open(self.path, newline="") as f:
                first = next(csv.reader(f), None)
        except (OSError, UnicodeDecodeError, csv.Error):
            return None
        return first if first and all(k in first for k in FIELDS) else None

    def truncate(self, global_step: int) -> None:
        """Keep the rows up to `global_step` (all of them when resuming at the end of the file)."""
        if not self.path.is_file():
            return
        try:
            rows = list(csv.DictReader(io.StringIO(self.path.read_text())))
        except (OSError, UnicodeDecodeError, csv.Error):
            rows = []
        kept = [r for r in rows if str(r.get("global_step", "")).isdigit() and int(r["global_step"]) <= global_step]
        self.fields = self._header() or list(FIELDS)
        atomic_write(self.path, _csv(kept, header=True, fields=self.fields))

    def steps(self) -> list[StepInfo]:
        """The rows as StepInfo (what a resumed run's dashboard redraws its curve from); rows that
        do not parse are left out."""
        try:
            rows = list(csv.DictReader(io.StringIO(self.path.read_text()))) if self.path.is_file() else []
        except (OSError, UnicodeDecodeError, csv.Error):
            return []
        out = []
        for r in rows:
            try:
                out.append(StepInfo(int(r["epoch"]), int(r["step"]), int(r["steps"]), int(r["global_step"]),
                                    _float(r["loss"]), _float(r["accuracy"]), float(r["lr"]),
                                    float(r["samples_per_s"])))
            except (KeyError, TypeError, ValueError):
                continue
        return out

    def add(self, info: StepInfo) -> None:
        row = {"epoch": info.epoch, "step": info.step, "steps": info.steps, "global_step": info.global_step,
               "loss": info.loss,
               "accuracy": info.accuracy, "lr": f"{info.lr:.8g}", "samples_per_s": round(info.samples_per_s, 1)}
        row.update({k: v for k, v in info.metrics.items() if k not in row})
        new = not self.path.is_file()
        if new or self.fields is None:
            self.fields = list(FIELDS) + [k for k in info.metrics if k not in FIELDS] if new else \
                (self._header() or list(FIELDS))
        with open(self.path, "a") as f:
            f.write(_csv([row], header=new, fields=self.fields))


def _csv(rows: list[dict], header: bool, fields: list[str] | tuple[str, ...] = FIELDS) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n", extrasaction="ignore")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _float(text: str | None) -> float | None:
    return None if text in (None, "") else float(text)
