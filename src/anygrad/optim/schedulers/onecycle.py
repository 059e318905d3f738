"""OneCycleLR: torch's one-cycle batch schedule, computed in closed form per step (no recursion),
whose length may be taken from the training run (run_defaults/check_run). Separate because it is
the one schedule sized by the run and stepped per optimizer update by default.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...coerce import to_lower_str
from .base import RunFacts, Scheduler

_ANNEAL: dict[str, Callable[[float, float, float], float]] = {
    # OneCycleLR._annealing_cos / _annealing_linear, operation for operation.
    "cos": lambda start, end, pct: end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1),
    "linear": lambda start, end, pct: (end - start) * pct + start,
}


@dataclass
class OneCycleLR(Scheduler):
    """torch.optim.lr_scheduler.OneCycleLR (learning rate only; momentum is not cycled).

    Warms up from max_lr/div_factor to max_lr over pct_start of total_steps, then anneals to
    max_lr/div_factor/final_div_factor (three_phase: back down to the initial rate first).
    max_lr defaults to base_lr; total_steps may be given as epochs * steps_per_epoch. In a training
    run (get_scheduler(..., run=...)) options left unset span the run: total_steps = its epochs x
    its optimizer updates per epoch. Note the first rate is max_lr/div_factor, so set
    `model.lr = sched.lr` before training.
    """

    max_lr: float | None = None
    total_steps: int | None = None
    epochs: int | None = None
    steps_per_epoch: int | None = None
    pct_start: float = 0.3
    anneal_strategy: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False
    interval: str = field(default="step", kw_only=True)

    name = "onecycle"

    @classmethod
    def run_defaults(cls, run: RunFacts, options: dict[str, Any]) -> dict[str, Any]:
        # Without a length of its own, the cycle spans the run: its epochs, each of its optimizer
        # updates a step (interval "step"), or each epoch one (interval "epoch").
        if options.get("total_steps") is not None:
            return {}
        per_step = to_lower_str(options.get("interval", "step")) == "step"
        return {"epochs": run.epochs, "steps_per_epoch": run.updates_per_epoch if per_step else 1}

    def check_run(self, run: RunFacts) -> None:
        needed = run.epochs * (run.updates_per_epoch if self.interval == "step" else 1)
        what = "optimizer updates" if self.interval == "step" else "epochs"
        self._require(self.total_steps >= needed,
                      f"the run takes {needed} {what} ({run.epochs} epochs"
                      + (f" x {run.updates_per_epoch} updates" if self.interval == "step" else "")
                      + f") but the cycle has only total_steps={self.total_steps}; raise total_steps (or epochs, "
                      "steps_per_epoch), or leave all three unset and the cycle spans the run")

    def _validate(self) -> None:
        if self.max_lr is None:
            self.max_lr = self.base_lr
        self._require(self.max_lr > 0 and math.isfinite(self.max_lr), f"max_lr must be > 0, got {self.max_lr}")
        if self.total_steps is None:
            self._require(self.epochs is not None and self.steps_per_epoch is not None,
                          "give total_steps, or epochs and steps_per_epoch")
            self._require(self.epochs >= 1 and self.steps_per_epoch >= 1,
                          f"epochs and steps_per_epoch must be >= 1, got {self.epochs} and {self.steps_per_epoch}")
            self.total_steps = self.epochs * self.steps_per_epoch
        self._require(self.total_steps >= 1, f"total_steps must be >= 1, got {self.total_steps}")
        self._require(0 <= self.pct_start <= 1, f"pct_start must be in [0, 1], got {self.pct_start}")
        self._require(self.anneal_strategy in _ANNEAL,
                      f"anneal_strategy must be one of {', '.join(_ANNEAL)}, got {self.anneal_strategy!r}")
        self._require(self.div_factor > 0 and self.final_div_factor > 0,
                      f"div_factor and final_div_factor must be > 0, got {self.div_factor} and "
                      f"{self.final_div_factor}")
        initial = self.max_lr / self.div_factor
        rates = {"initial_lr": initial, "max_lr": self.max_lr, "min_lr": initial / self.final_div_factor}
        n = self.total_steps
        if self.three_phase:
            table = [(float(self.pct_start * n) - 1, "initial_lr", "max_lr"),
                     (float(2 * self.pct_start * n) - 2, "max_lr", "initial_lr"),
                     (n - 1, "initial_lr", "min_lr")]
        else:
            table = [(float(self.pct_start * n) - 1, "initial_lr", "max_lr"),
                     (n - 1, "max_lr", "min_lr")]
        self._phases = [(end, rates[a], rates[b]) for end, a, b in table]
        # torch divides by the phase length: a zero-length phase it reaches is a ZeroDivisionError there.
        self._require(self._phases[0][0] != 0 and self._phases[-1][0] != self._phases[-2][0],
                      f"pct_start={self.pct_start} with total_steps={n} leaves a phase of zero length; "
                      f"change pct_start or total_steps")

    def _rate(self, t: int) -> float:
        """OneCycleLR.get_lr at last_epoch = t."""
        start_step = 0.0
        for i, (end_step, start_lr, end_lr) in enumerate(self._phases):
            if t <= end_step or i == len(self._phases) - 1:
                pct = (t - start_step) / (end_step - start_step)
                return _ANNEAL[self.anneal_strategy](start_lr, end_lr, pct)
            start_step = end_step
        raise AssertionError("unreachable")

    def _check_step(self, step: int) -> int:
        step = super()._check_step(step)
        self._require(step <= self.total_steps,
                      f"stepped {step} times but total_steps is {self.total_steps}; raise total_steps "
                      f"(or epochs) to cover the whole run")
        return step

    def _next(self, lr: float, t: int) -> float:
        return self._rate(self._check_step(t))

    def lr_at(self, step: int) -> float:
        return self._rate(self._check_step(step))
