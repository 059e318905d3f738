"""What a run writes besides checkpoints: metrics.jsonl/.csv, config.json and the weights
exports (weights.npz, weights.safetensors, model.onnx). Every file is written to a temporary name
and renamed, so a crash or Ctrl-C never leaves a half-written one."""
from __future__ import annotations

import csv
import importlib
import io
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AnygradError
from ..fsutil import atomic_write
from ..ir.input_norm import input_statistics
from ..model import Model
from .config import TrainConfig
from .export_model import plain_model
from .metrics import EpochMetrics, _finite


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")

def write_metrics(path: Path, history: list[EpochMetrics]) -> None:
    """metrics.jsonl and, next to it, metrics.csv (same rows; empty cells for null). The
    classifier's columns come first, in their historical order, then the task's own
    (train_perplexity, valid_mae, ...) in the order the model reports them."""
    rows = [_finite(m.row()) for m in history]
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))
    columns: dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path.with_suffix(".csv"), buf.getvalue())


def save_weights(model: Model, directory: Path) -> list[Path]:
    """weights.npz (graph names -> arrays), weights.safetensors (PyTorch state_dict names when
    the model knows them) and, when the ONNX exporter is present, model.onnx."""
    written = [directory / "weights.npz"]
    state = model.state_dict()
    atomic_write(written[0], lambda f: np.savez(f, **state))
    written.append(_save_safetensors(model, state, directory / "weights.safetensors"))
    export = _onnx_exporter()
    if export is not None:  # the user's float input, without a uint8 normalisation prologue
        written.append(export(plain_model(model), directory / "model.onnx"))  # atomic itself (external data too)
    return written


def _save_safetensors(model: Model, state: dict[str, np.ndarray], path: Path) -> Path:
    own = getattr(model, "save_safetensors", None)
    if own is not None:  # PyTorch state_dict names (frontends/torch_weights.py)
        try:
            own(path)
            return path
        except AnygradError:  # names it cannot map: the graph's own below
            pass
    # graph names, which are the state_dict names for models exported by torch.onnx
    from ..torchfile import save_safetensors
    save_safetensors({k: np.ascontiguousarray(v) for k, v in state.items()}, path)
    return path


def _onnx_exporter() -> Callable | None:
    try:
        return importlib.import_module("anygrad.frontends.onnx_export").save_onnx
    except (ImportError, AttributeError):
        return None


def config_record(model: Model, config: TrainConfig, extra: dict[str, Any] | None = None, *,
                  scheduler: dict[str, Any] | None) -> dict[str, Any]:
    """config.json: the run's settings plus what the model and device resolved them to, the
    schedule (`scheduler`: its config(), None without one), and `extra`: what the caller resolved
    (the CLI: the data's normalisation and class names)."""
    record = asdict(config)
    record["resolved"] = {
        "model_source": model.source,
        "fingerprint": model.fingerprint(),
        "parameters": model.num_parameters(),
        "input": {"name": model.input_name, "shape": list(model.input_shape),
                  "dtype": str(model.graph.info[model.input_name].dtype)},
        "normalised_on_device": _on_device_stats(model),
        "device": model.backend.description if model.backend else None,
        "loss": {"name": model.loss.name, **model.loss.options} if model.loss else None,
        "optimizer": model.optimizer.config() if model.optimizer else None,
        "scheduler": scheduler,
        **(extra or {}),
    }
    return record


def _on_device_stats(model: Model) -> dict[str, list[float]] | None:
    stats = input_statistics(model.graph)
    return None if stats is None else {"mean": stats[0], "std": stats[1]}

