"""ReduceLROnPlateau: the metric-driven schedule, stepped with the monitored validation metric
(best value, bad-epoch and cooldown counters in its state). Separate because it is the only
schedule whose rates depend on what it is fed rather than on the step count alone.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...coerce import to_float, to_int
from ...errors import ConfigError
from .base import RunFacts, Scheduler

_IS_BETTER: dict[tuple[str, str], Callable[[float, float, float], bool]] = {
    # ReduceLROnPlateau._is_better, by (mode, threshold_mode).
    ("min", "rel"): lambda a, best, th: a < best * (1.0 - th),
    ("min", "abs"): lambda a, best, th: a < best - th,
    ("max", "rel"): lambda a, best, th: a > best * (th + 1.0),
    ("max", "abs"): lambda a, best, th: a > best + th,
}


@dataclass
class ReduceLROnPlateau(Scheduler):
    """torch.optim.lr_scheduler.ReduceLROnPlateau: multiply by factor when the metric passed to
    step() has not improved (mode "min": decreased, "max": increased) for more than patience
    epochs; then wait cooldown epochs; never below min_lr, and skip reductions smaller than eps.
    """

    mode: str = "min"
    factor: float = 0.1
    patience: int = 10
    threshold: float = 1e-4
    threshold_mode: str = "rel"
    cooldown: int = 0
    min_lr: float = 0.0
    eps: float = 1e-8

    name = "plateau"
    needs_metric = True

    @classmethod
    def run_defaults(cls, run: RunFacts, options: dict[str, Any]) -> dict[str, Any]:
        # The metric it is fed is the run's monitored one: an accuracy must rise, a loss fall.
        return {"mode": run.mode}

    def _validate(self) -> None:
        self._require(self.mode in ("min", "max"), f"mode must be 'min' or 'max', got {self.mode!r}")
        self._require(self.threshold_mode in ("rel", "abs"),
                      f"threshold_mode must be 'rel' or 'abs', got {self.threshold_mode!r}")
        self._require(0 < self.factor < 1, f"factor must be in (0, 1), got {self.factor}")
        self._require(self.patience >= 0, f"patience must be >= 0, got {self.patience}")
        self._require(self.cooldown >= 0, f"cooldown must be >= 0, got {self.cooldown}")
        self._require(self.threshold >= 0, f"threshold must be >= 0, got {self.threshold}")
        self._require(self.min_lr >= 0, f"min_lr must be >= 0, got {self.min_lr}")
        self._require(self.eps >= 0, f"eps must be >= 0, got {self.eps}")

    @property
    def _worse(self) -> float:
        return math.inf if self.mode == "min" else -math.inf

    def reset(self) -> None:
        self.steps = 0
        self.lr = self.base_lr
        self.best = self._worse
        self.num_bad_epochs = 0
        self.cooldown_counter = 0

    def step(self, metric: float | None = None) -> float:
        if metric is None:
            raise ConfigError("scheduler 'plateau' needs the monitored metric: call step(metric), "
                              "e.g. step(validation_loss)")
        try:
            current = float(metric)
        except (TypeError, ValueError):
            raise ConfigError(f"scheduler 'plateau': metric must be a number, got {metric!r}") from None
        self.steps += 1
        if _IS_BETTER[self.mode, self.threshold_mode](current, self.best, self.threshold):
            self.best = current
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0  # bad epochs during the cooldown do not count
        if self.num_bad_epochs > self.patience:
            new_lr = max(self.lr * self.factor, self.min_lr)
            if self.lr - new_lr > self.eps:
                self.lr = new_lr
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        return self.lr

    def lr_at(self, step: int) -> float:
        raise ConfigError("scheduler 'plateau' depends on the metrics it is fed, so it has no "
                          "rate for an arbitrary step; read .lr after step(metric)")

    def _extra_state(self) -> dict[str, Any]:
        # None stands for "no best yet" (±inf), which strict JSON cannot hold.
        best = None if math.isinf(self.best) else self.best
        return {"best": best, "num_bad_epochs": self.num_bad_epochs, "cooldown_counter": self.cooldown_counter}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        best = state["best"]
        self.best = self._worse if best is None else to_float(best)
        self.num_bad_epochs = to_int(state["num_bad_epochs"])
        self.cooldown_counter = to_int(state["cooldown_counter"])
