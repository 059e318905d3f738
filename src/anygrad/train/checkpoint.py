"""Checkpoints: all device state as .npz plus a JSON record of where the run stands.

A checkpoint is `ckpt-<global step>.npz` (every persistent tensor the step programs touch:
parameters, BatchNorm buffers, optimizer slots, accumulation sums, lr, step and RNG counters,
metric sums) and `ckpt-<global step>.json` (epoch and step within it, scheduler and
early-stopping state, history, the model fingerprint, the config, and the .npz's sha256). Both
are written to a temporary name and renamed, the JSON last: a checkpoint without its JSON was
interrupted while being written and does not exist. No pickle anywhere.
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AnygradError

FORMAT = "anygrad-checkpoint/1"
PREFIX = "ckpt-"
BEST = "best"


class CheckpointError(AnygradError):
    """A checkpoint is missing, corrupt, or belongs to another model or configuration."""


@dataclass
class Checkpoint:
    state: dict[str, np.ndarray]
    meta: dict[str, Any]
    path: Path  # the .json


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _npz_bytes(state: dict[str, np.ndarray]) -> bytes:
    import io
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in state.items()})
    return buf.getvalue()


def write(directory: Path, stem: str, state: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    """Write <stem>.npz then <stem>.json (the commit marker); returns the .json path."""
    directory.mkdir(parents=True, exist_ok=True)
    data = _npz_bytes(state)
    _atomic(directory / f"{stem}.npz", data)
    record = {"format": FORMAT, **meta, "arrays": f"{stem}.npz", "sha256": hashlib.sha256(data).hexdigest()}
    _atomic(directory / f"{stem}.json", (json.dumps(record, indent=1, default=_jsonable) + "\n").encode())
    return directory / f"{stem}.json"


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"{type(v).__name__} is not JSON serialisable")


def numbered(directory: Path) -> list[Path]:
    """Complete step checkpoints (their .json), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.glob(f"{PREFIX}*.json"):
        try:
            found.append((int(p.stem[len(PREFIX):]), p))
        except ValueError:
            continue
    return [p for _, p in sorted(found)]


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints (the best one is a separate copy)."""
    for p in numbered(directory)[:-keep] if keep > 0 else []:
        p.unlink(missing_ok=True)
        p.with_suffix(".npz").unlink(missing_ok=True)


def read(path: Path) -> Checkpoint:
    """Load and verify one checkpoint (.json path); CheckpointError says what is wrong."""
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt checkpoint record ({e}); delete it to resume from an older "
                              "checkpoint") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an anygrad checkpoint (format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                              f"expected {FORMAT!r})")
    arrays = path.with_name(str(meta.get("arrays", "")))
    try:
        data = arrays.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{arrays}: cannot read the checkpoint's arrays ({e})") from None
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"{arrays}: corrupt checkpoint (its sha256 does not match {path.name}); "
                              "delete both files to resume from an older checkpoint")
    try:
        import io
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            state = {k: npz[k] for k in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{arrays}: corrupt checkpoint arrays ({e})") from None
    return Checkpoint(state, meta, path)


def latest(directory: Path) -> Path | None:
    found = numbered(directory)
    return found[-1] if found else None
