"""How the training loop tells the outside world what happens: one Reporter interface.

The loop calls these hooks; a Reporter decides how to show them (a live rich dashboard on a
terminal, plain lines in logs and CI, nothing with --quiet). Hooks get plain dataclasses, so a
Reporter never touches the model or the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class RunInfo:
    model: str
    device: str
    epochs: int
    steps_per_epoch: int
    batch_size: int
    start_epoch: int = 1            # > 1 when resumed
    artifacts_dir: str | None = None
    valid_steps: int = 0            # validation batches after each epoch (0: no validation)
    # A resumed run: the epochs done before (best=True on the best one) and the progress reads of
    # the epoch it resumes into and those before (metrics_steps.csv), so views keep the whole run.
    history: list[EpochInfo] = field(default_factory=list)
    earlier_steps: list[StepInfo] = field(default_factory=list)


@dataclass
class ValidInfo:
    epoch: int
    step: int                       # validation batches done (1-based)
    steps: int


@dataclass
class StepInfo:
    epoch: int
    step: int                       # 1-based within the epoch
    steps: int                      # steps in this epoch
    global_step: int
    loss: float | None              # running mean over the epoch so far (device-side sums)
    accuracy: float | None
    lr: float
    samples_per_s: float
    # every metric's running mean by the model's name (loss, accuracy, perplexity, mae, ...)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EpochInfo:
    epoch: int
    metrics: dict[str, float | None] = field(default_factory=dict)  # the metrics.jsonl row
    seconds: float = 0.0
    best: bool = False              # this epoch is the best so far by the monitored metric


class Reporter(Protocol):
    """The hooks every reporter has. A reporter may also have `validation(info: ValidInfo)`,
    called after each validation batch (the loop checks for it, so older reporters still work)."""

    def run_begin(self, info: RunInfo) -> None: ...
    def step(self, info: StepInfo) -> None: ...
    def epoch_end(self, info: EpochInfo) -> None: ...
    def message(self, text: str) -> None: ...
    def run_end(self, stopped_early: bool = False, interrupted: bool = False) -> None: ...
