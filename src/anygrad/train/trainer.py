"""The training loop: epochs of `Model.train_step` over a DataLoader, validation, artifacts.

Steps never read back from the device; the metric sums the step program accumulates there are
read every `log_every` steps (progress) and at the end of the epoch. Artifacts are written to a
temporary name and renamed, so a crash or Ctrl-C never leaves a half-written file.
"""
from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..data.loader import DataLoader
from ..errors import ConfigError
from ..model import Model

Arrays = tuple[np.ndarray, np.ndarray]
Log = Callable[[str], None]


@dataclass
class TrainConfig:
    """Every setting of a run; saved as config.json. Fields beyond the loop's own are recorded
    as given (the CLI fills in model, dataset, optimizer, ...)."""

    epochs: int = 1
    batch_size: int = 64
    seed: int = 0
    drop_last: bool = False
    shuffle: bool = True
    valid_batch_size: int | None = None  # default: batch_size
    log_every: int = 0  # steps between progress reads; 0: about ten per epoch
    artifacts_dir: str | None = None
    model: str = ""
    dataset: str = ""
    data_dir: str | None = None
    loss: str = ""
    optimizer: str = ""
    lr: float | None = None
    device: str = ""
    init: str = ""

    def check(self) -> None:
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.valid_batch_size is not None and self.valid_batch_size < 1:
            raise ConfigError(f"valid-batch-size must be at least 1, got {self.valid_batch_size}")
        if self.log_every < 0:
            raise ConfigError(f"log-every must be 0 (auto) or positive, got {self.log_every}")


@dataclass
class EpochMetrics:
    epoch: int
    train_loss: float | None
    train_accuracy: float | None
    valid_loss: float | None
    valid_accuracy: float | None
    seconds: float


@dataclass
class FitResult:
    history: list[EpochMetrics]
    artifacts_dir: Path | None

    @property
    def last(self) -> EpochMetrics | None:
        return self.history[-1] if self.history else None


class _Sums:
    """Host-side totals of the device's metric reads (each read resets the device sums)."""

    def __init__(self) -> None:
        self.count = self.loss = self.correct = 0.0
        self.has_accuracy = False

    def add(self, read: dict[str, float]) -> None:
        n = read.get("count", 0.0)
        if not n:
            return
        self.count += n
        self.loss += read["loss"] * n
        if "accuracy" in read:
            self.has_accuracy = True
            self.correct += read["accuracy"] * n

    @property
    def mean_loss(self) -> float | None:
        return self.loss / self.count if self.count else None

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.count if self.count and self.has_accuracy else None


# -- artifacts ------------------------------------------------------------------------------------
def _atomic_write(path: Path, write: Callable[[Any], None], mode: str = "w") -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj: Any) -> None:
    _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, default=str) + "\n"))


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf (a diverged run) as null: JSON has no NaN, and jq and friends reject it."""
    return {k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in row.items()}


def write_metrics(path: Path, history: list[EpochMetrics]) -> None:
    _atomic_write(path, lambda f: f.writelines(json.dumps(_finite(asdict(m))) + "\n" for m in history))


def save_weights(model: Model, directory: Path) -> list[Path]:
    """weights.npz (graph names -> arrays) and, when the ONNX exporter is present, model.onnx."""
    written = [directory / "weights.npz"]
    state = model.state_dict()
    _atomic_write(written[0], lambda f: np.savez(f, **state), "wb")
    export = _onnx_exporter()
    if export is not None:
        written.append(export(model, directory / "model.onnx"))  # atomic itself (external data too)
    return written


def _onnx_exporter() -> Callable | None:
    try:
        return importlib.import_module("anygrad.frontends.onnx_export").save_onnx
    except (ImportError, AttributeError):
        return None


def config_record(model: Model, config: TrainConfig) -> dict[str, Any]:
    """config.json: the run's settings plus what the model and device resolved them to."""
    record = asdict(config)
    record["resolved"] = {
        "model_source": model.source,
        "parameters": model.num_parameters(),
        "input": {"name": model.input_name, "shape": list(model.input_shape)},
        "device": model.backend.description if model.backend else None,
        "loss": {"name": model.loss.name, **model.loss.options} if model.loss else None,
        "optimizer": model.optimizer.config() if model.optimizer else None,
    }
    return record


# -- the loop -------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _validate(model: Model, data: Arrays, batch_size: int) -> _Sums:
    """Loss and accuracy over `data` in inference mode (eval programs, one per batch shape)."""
    model.reset_metrics()
    sums = _Sums()
    for x, y in DataLoader(*data, batch_size=batch_size, shuffle=False):
        model.eval_step(x, y)
    sums.add(model.read_metrics(reset=True))
    return sums


def fit(model: Model, train_data: Arrays, valid_data: Arrays | None = None, config: TrainConfig | None = None,
        *, log: Log | None = print, progress: Log | None = None, **settings: Any) -> FitResult:
    """Train a compiled model for `config.epochs` epochs (TrainConfig fields may be passed as keywords).

    `log` gets one line per epoch, `progress` one every `log_every` steps (both may be None).
    With `artifacts_dir`, metrics.jsonl and weights are rewritten after every epoch.
    """
    unknown = set(settings) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown training setting(s) {sorted(unknown)}")
    config = replace(config or TrainConfig(), **settings)
    config.check()
    model._require_compiled()

    loader = DataLoader(*train_data, batch_size=config.batch_size, shuffle=config.shuffle, seed=config.seed,
                        drop_last=config.drop_last)
    if len(loader) == 0:
        raise ConfigError(f"no full batch of {config.batch_size} in {len(train_data[0])} training samples; "
                          "use a smaller batch size or keep the last partial batch (no drop_last)")
    steps = len(loader)
    log_every = config.log_every or max(1, steps // 10)
    out_dir = Path(config.artifacts_dir) if config.artifacts_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "config.json", config_record(model, config))

    history: list[EpochMetrics] = []
    warned = False
    for epoch in range(1, config.epochs + 1):
        start = time.perf_counter()
        model.reset_metrics()
        sums = _Sums()
        for step, (x, y) in enumerate(loader, 1):
            model.train_step(x, y)
            if step % log_every == 0 and step < steps:
                sums.add(model.read_metrics(reset=True))
                if progress:
                    rate = sums.count / (time.perf_counter() - start)
                    progress(f"epoch {epoch}/{config.epochs} step {step}/{steps}  loss {_fmt(sums.mean_loss)}"
                             f"  acc {_fmt(sums.accuracy)}  {rate:.0f} samples/s")
        sums.add(model.read_metrics(reset=True))
        valid = _validate(model, valid_data, config.valid_batch_size or config.batch_size) \
            if valid_data is not None else _Sums()
        metrics = EpochMetrics(epoch, sums.mean_loss, sums.accuracy, valid.mean_loss, valid.accuracy,
                               round(time.perf_counter() - start, 3))
        history.append(metrics)
        if log:
            log(f"epoch {epoch}/{config.epochs}  train loss {_fmt(metrics.train_loss)} "
                f"acc {_fmt(metrics.train_accuracy)}  valid loss {_fmt(metrics.valid_loss)} "
                f"acc {_fmt(metrics.valid_accuracy)}  {metrics.seconds:.1f}s")
            if not warned and any(v is not None and not np.isfinite(v) for v in (metrics.train_loss,
                                                                                 metrics.valid_loss)):
                warned = True
                log("warning: the loss is not finite; the run diverged (try a smaller learning rate)")
        if out_dir is not None:
            write_metrics(out_dir / "metrics.jsonl", history)
            save_weights(model, out_dir)
    return FitResult(history, out_dir)
