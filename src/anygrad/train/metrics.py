"""What a run measures: an epoch's metrics.jsonl row (EpochMetrics), the metric names a run may
monitor, and the host-side sums of the device's metric reads (_Sums)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


@dataclass
class EpochMetrics:
    """One metrics.jsonl row. The classifier's metrics are fields (the historical columns, in
    their order); every other metric the model reports (perplexity, pixel_accuracy, mse, mae,
    label_accuracy, per-output names, a loss='output' model's other outputs) is in `extra` as
    train_<name> / valid_<name>, read as attributes too (m.valid_perplexity)."""

    epoch: int
    train_loss: float | None
    train_accuracy: float | None
    valid_loss: float | None
    valid_accuracy: float | None
    seconds: float
    train_top5: float | None = None
    valid_top5: float | None = None
    lr: float | None = None
    samples_per_s: float | None = None
    extra: dict[str, float | None] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        extra = self.__dict__.get("extra")
        if extra is not None and name in extra:
            return extra[name]
        raise AttributeError(f"{type(self).__name__} has no metric {name!r}")

    def row(self) -> dict[str, Any]:
        """The flat metrics.jsonl record: the fixed columns, then the extra metrics."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> EpochMetrics:
        """A metrics.jsonl / checkpoint history row, of this version or an older one."""
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in row.items() if k in names}
        for k in ("train_loss", "train_accuracy", "valid_loss", "valid_accuracy"):
            known.setdefault(k, None)
        known.setdefault("seconds", 0.0)
        extra = {k: v for k, v in row.items() if k not in names and k != "extra"}
        return cls(**known, extra=extra)


# metrics.jsonl columns of the classifier's metrics (EpochMetrics fields) by the model's metric name
FIELD_METRICS = ("loss", "accuracy", "top5")
# The metric families a model reports (Model.metric_names), possibly prefixed '<output>_' with
# several heads; a loss='output' model's other scalar outputs come under their own names.
METRIC_FAMILIES = ("loss", "accuracy", "top5", "perplexity", "pixel_accuracy", "mse", "mae", "label_accuracy")
FIXED_MONITORS = ("train_loss", "train_accuracy", "valid_loss", "valid_accuracy", "seconds", "train_top5",
                  "valid_top5", "lr", "samples_per_s")


def metric_family(name: str) -> str | None:
    """The family of a metric name without its train_/valid_ prefix ('box_mae' -> 'mae'), or None."""
    for family in sorted(METRIC_FAMILIES, key=len, reverse=True):
        if name == family or name.endswith("_" + family):
            return family
    return None


def monitorable_names() -> list[str]:
    """The --monitor names every run may have, for messages."""
    return list(FIXED_MONITORS) + [f"{p}_{f}" for f in METRIC_FAMILIES if f not in FIELD_METRICS
                                   for p in ("train", "valid")]


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf (a diverged run) as null: JSON has no NaN, and jq and friends reject it."""
    return {k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in row.items()}



class _Sums:
    """Host-side totals of the device's metric reads (each read resets the device sums).

    Each metric is kept as its numerator and denominator sums (Model.read_metric_sums), so an
    epoch's value weighs every read by the metric's own denominator: tokens that are not ignored
    for a language model's accuracy and perplexity, labelled pixels for segmentation, elements
    for mse and mae, samples for the loss. Perplexity is exp of the summed NLL over the summed
    tokens, not a mean of per-read perplexities. A read of plain means (a dict, as
    Model.read_metrics gives) is weighted by its sample count."""

    def __init__(self) -> None:
        self.count = 0.0
        self.parts: dict[str, list] = {}  # metric -> [numerator, denominator, exp]

    def add(self, read: dict[str, float] | tuple[float, dict[str, tuple[float, float, bool]]]) -> None:
        if isinstance(read, tuple):
            n, parts = read   # each part by its own denominator: skipped updates count without samples
        else:
            n = read.get("count", 0.0)
            parts = {}
            for k, v in read.items():
                if k == "count" or v is None or not n:
                    continue
                exp = metric_family(k) == "perplexity"  # summed as NLL, as the device does
                parts[k] = (float(np.log(v)) * n if exp else v * n, n, exp)
        self.count += n
        for key, (num, den, exp) in parts.items():
            have = self.parts.get(key)
            if have is None:
                self.parts[key] = [float(num), float(den), bool(exp)]
            else:
                have[0] += num
                have[1] += den

    def means(self) -> dict[str, float]:
        """Every metric's value over the reads so far (model names: loss, accuracy, perplexity, ...)."""
        out = {}
        for key, (num, den, exp) in self.parts.items():
            if den:
                mean = num / den
                out[key] = float(np.exp(min(mean, 700.0))) if exp else mean
        return out

    def value(self, key: str) -> float | None:
        part = self.parts.get(key)
        if not self.count or part is None or not part[1]:
            return None
        mean = part[0] / part[1]
        return float(np.exp(min(mean, 700.0))) if part[2] else mean

    @property
    def mean_loss(self) -> float | None:
        return self.value("loss")

    @property
    def accuracy(self) -> float | None:
        return self.value("accuracy")

    @property
    def top_accuracy(self) -> float | None:
        return self.value("top5")

    def extra(self, prefix: str) -> dict[str, float | None]:
        """The metrics beyond loss, accuracy and top5 as {prefix + name: value}."""
        return {prefix + k: v for k, v in self.means().items() if k not in FIELD_METRICS}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "metrics": {k: list(v) for k, v in self.parts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = float(state["count"])
        if "metrics" in state:
            self.parts = {str(k): [float(v[0]), float(v[1]), bool(v[2])] for k, v in state["metrics"].items()}
            return
        # a checkpoint of an older version: sample-weighted loss, accuracy and top-k sums
        n, self.parts = self.count, {}
        if n:
            self.parts["loss"] = [float(state["loss"]), n, False]
            if state.get("has_accuracy"):
                self.parts["accuracy"] = [float(state["correct"]), n, False]
            if state.get("has_top"):
                self.parts["top5"] = [float(state["top"]), n, False]

