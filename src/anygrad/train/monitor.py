"""Watching one metric across epochs: the best value so far, and early stopping."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError

MODES = ("min", "max")


# Metrics that should go up, by the end of their name (train_/valid_ and an output's prefix
# before it): accuracy, pixel_accuracy, label_accuracy, top5. Everything else goes down: loss,
# perplexity, mse, mae, and a loss='output' model's other outputs (losses, as a rule).
_HIGHER_IS_BETTER = re.compile(r"(^|_)(accuracy|top\d+)$")


def resolve_mode(metric: str, mode: str) -> str:
    """"auto": accuracies should go up (max), everything else down (min)."""
    if mode != "auto":
        return mode
    return "max" if _HIGHER_IS_BETTER.search(metric) else "min"


@dataclass
class Monitor:
    """Tracks `metric` (a metrics.jsonl key) in `mode`. An epoch improves when it beats the best
    by more than min_delta (Keras's EarlyStopping rule); after `patience` epochs without an
    improvement `should_stop` turns true (patience None: never)."""

    metric: str = "valid_loss"
    mode: str = "min"
    patience: int | None = None
    min_delta: float = 0.0
    best: float | None = None
    best_epoch: int | None = None
    wait: int = 0

    def __post_init__(self) -> None:
        self.mode = resolve_mode(self.metric, self.mode)
        if self.mode not in MODES:
            raise ConfigError(f"mode must be 'min', 'max' or 'auto', got {self.mode!r}")
        if self.patience is not None and self.patience < 0:
            raise ConfigError(f"patience must be 0 or more epochs, got {self.patience}")
        if not self.min_delta >= 0:
            raise ConfigError(f"min-delta must be >= 0, got {self.min_delta}")

    def value(self, row: dict[str, Any]) -> float:
        if self.metric not in row:
            raise ConfigError(f"cannot monitor '{self.metric}': the metrics are {', '.join(row)}")
        v = row[self.metric]
        if v is None:
            raise ConfigError(f"cannot monitor '{self.metric}': it has no value in this run (no validation "
                              f"data, or a metric of another task); choose another --monitor")
        return float(v)

    def update(self, epoch: int, row: dict[str, Any]) -> bool:
        """Record one epoch; True when it is the best so far."""
        v = self.value(row)
        sign = 1.0 if self.mode == "min" else -1.0
        improved = math.isfinite(v) and (self.best is None or sign * (self.best - v) > self.min_delta)
        if improved:
            self.best, self.best_epoch, self.wait = v, epoch, 0
        else:
            self.wait += 1
        return improved

    @property
    def should_stop(self) -> bool:
        # Lightning's rule: `patience` epochs in a row without an improvement (0: the first one).
        return self.patience is not None and self.wait > 0 and self.wait >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch, self.wait = state["best"], state["best_epoch"], int(state["wait"])

    def config(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("best", "best_epoch", "wait")}
