"""Checkpoints: all device state as .npz plus a JSON record of where the run stands.

A checkpoint is `ckpt-<global step>.npz` (every persistent tensor the step programs touch:
parameters, BatchNorm buffers, optimizer slots, accumulation sums, lr, step and RNG counters,
metric sums) and `ckpt-<global step>.json` (epoch and step within it, scheduler and
early-stopping state, history, the model fingerprint, the config, and the .npz's sha256). Both
are written atomically (fsutil.atomic_write), the JSON last: it is the commit marker, and a
checkpoint without its JSON was interrupted while being written and does not exist.

The best checkpoint is rewritten in place, so its arrays go to a new name each time
(`best-<step>-<sha>.npz`) and `best.json`, which names them, is committed with one rename: a
kill at any moment leaves the old best or the new one, never a pair that does not match.
`clean` removes what a killed run left (temp files, arrays no JSON names). No pickle anywhere.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AnygradError
from ..fsutil import atomic_write, remove_stray_temps
from ..torchfile.npzfile import read_npz_bytes
from ..torchfile.safe_io import read_regular

FORMAT = "anygrad-checkpoint/1"
PREFIX = "ckpt-"
BEST = "best"
MAX_RECORD_BYTES = 64 << 20  # a checkpoint's JSON record (history, config): far above any real one


class CheckpointError(AnygradError):
    """A checkpoint is missing, corrupt, or belongs to another model or configuration."""


@dataclass
class Checkpoint:
    state: dict[str, np.ndarray]
    meta: dict[str, Any]
    path: Path  # the .json


def _npz_bytes(state: dict[str, np.ndarray]) -> bytes:
    import io
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in state.items()})
    return buf.getvalue()


def write(directory: Path, stem: str, state: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    """Write the arrays, then <stem>.json (the commit marker); returns the .json path. Step
    checkpoints keep their arrays in <stem>.npz (a new name each step); the best one, rewritten in
    place, in a new best-<step>-<sha>.npz each time, the old one removed after the commit."""
    directory.mkdir(parents=True, exist_ok=True)
    data = _npz_bytes(state)
    sha = hashlib.sha256(data).hexdigest()
    arrays = f"{stem}-{int(meta.get('global_step', 0)):08d}-{sha[:8]}.npz" if stem == BEST else f"{stem}.npz"
    atomic_write(directory / arrays, data)
    record = {"format": FORMAT, **meta, "arrays": arrays, "sha256": sha}
    atomic_write(directory / f"{stem}.json", json.dumps(record, indent=1, default=_jsonable) + "\n")
    if stem == BEST:
        _remove_unreferenced_best(directory, keep=arrays)
    return directory / f"{stem}.json"


def _remove_unreferenced_best(directory: Path, keep: str) -> None:
    for p in directory.glob(f"{BEST}*.npz"):
        if p.name != keep:
            p.unlink(missing_ok=True)


def clean(directory: Path) -> list[Path]:
    """Remove what a killed run left in a checkpoint folder: temp files, arrays no committed JSON
    names (a step checkpoint killed before its JSON, an old or uncommitted best). Call it only
    while holding the run's lock. Returns the removed files."""
    if not directory.is_dir():
        return []
    removed = remove_stray_temps(directory)
    named = set()
    for j in directory.glob("*.json"):
        try:
            arrays = json.loads(j.read_text()).get("arrays")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(arrays, str):
            named.add(arrays)
    for p in directory.glob("*.npz"):
        if p.name not in named and (p.name.startswith(PREFIX) or p.name.startswith(BEST)):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


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
        p.unlink(missing_ok=True)  # the JSON first: arrays without it are no checkpoint (clean removes them)
        p.with_suffix(".npz").unlink(missing_ok=True)


def read(path: Path) -> Checkpoint:
    """Load and verify one checkpoint (.json path); CheckpointError says what is wrong."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    try:  # a regular file only: a FIFO or device in a run folder must not block or fill memory
        meta = json.loads(bytes(read_regular(path, CheckpointError, limit=MAX_RECORD_BYTES)).decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt checkpoint record ({e}); delete it to resume from an older "
                              "checkpoint") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an anygrad checkpoint (format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                              f"expected {FORMAT!r})")
    config = meta.get("config", {})
    if not isinstance(config, dict) or not all(isinstance(config.get(k, ""), (str, type(None)))
                                               for k in ("model", "dataset", "data_dir")):
        raise CheckpointError(f"{path}: corrupt checkpoint record (its 'config' entry is not a record of the run's "
                              "settings); delete it to resume from an older checkpoint")
    name = meta.get("arrays")
    if not isinstance(name, str) or not name.endswith(".npz") or Path(name).name != name:
        raise CheckpointError(f"{path}: corrupt checkpoint record (its 'arrays' entry {name!r} is not an .npz "
                              "file beside it); delete it to resume from an older checkpoint")
    arrays = path.with_name(name)
    data = bytes(read_regular(arrays, CheckpointError))
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"{arrays}: corrupt checkpoint (its sha256 does not match {path.name}); "
                              "delete both files to resume from an older checkpoint")
    state = read_npz_bytes(data, str(arrays), CheckpointError)
    return Checkpoint(state, meta, path)


def latest(directory: Path) -> Path | None:
    found = numbered(directory)
    return found[-1] if found else None


# -- what a resume may trust -----------------------------------------------------------------------
_HISTORY_KEYS = ("epoch",)  # the metric names belong to the trainer (EpochMetrics checks them on load)


def _int(meta: dict[str, Any], key: str, low: int, high: int | None, where: str) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise CheckpointError(f"{where}: corrupt checkpoint record: '{key}' is {v!r}, expected an integer {span}; "
                              "delete it to resume from an older checkpoint")
    return v


def _number_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def validate(c: Checkpoint, steps_per_epoch: int, required: dict[str, np.ndarray], *,
             allow_nonfinite: bool = False) -> None:
    """Check every field a resume reads before any is used: the counters in range and consistent
    with each other, the records of the right kinds, every state entry of `required` (the model's
    own state names with shapes and dtypes, and the learning rate) present and alike, and all
    floating-point arrays finite (unless the run was told to go on through NaNs)."""
    m, where = c.meta, str(c.path)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: corrupt checkpoint record: {what}; delete it to resume from an older "
                               "checkpoint")
    epoch = _int(m, "epoch", 1, 10**9, where)
    step = _int(m, "step", 0, steps_per_epoch, where)
    _int(m, "global_step", (epoch - 1) * steps_per_epoch + step, (epoch - 1) * steps_per_epoch + step, where)
    _int(m, "micro_step", 0, None, where)
    for key in ("epoch_done", "stopped_early"):
        if not isinstance(m.get(key, False), bool):
            raise bad(f"'{key}' is {m.get(key)!r}, expected true or false")
    if m.get("epoch_done") and step != steps_per_epoch:
        raise bad(f"the epoch is marked done at step {step} of {steps_per_epoch}")
    if not _number_or_none(m.get("lr")):
        raise bad(f"'lr' is {m.get('lr')!r}, expected a finite number")
    history = m.get("history")
    if not isinstance(history, list) or not all(isinstance(r, dict) and all(k in r for k in _HISTORY_KEYS)
                                                and all(_number_or_none(v) for v in r.values()) for r in history):
        raise bad("'history' is not a list of metric rows")
    if len(history) != epoch - (0 if m.get("epoch_done") else 1) or \
            [r["epoch"] for r in history] != list(range(1, len(history) + 1)):
        raise bad(f"'history' holds {len(history)} epochs at epoch {epoch}")
    sums = m.get("sums")
    # this version's sums: count and {metric: [numerator, denominator, exp]}; older ones: numbers
    metrics = sums.get("metrics", {}) if isinstance(sums, dict) else None
    if not isinstance(sums, dict) or not all(isinstance(v, bool) or _number_or_none(v)
                                             for k, v in sums.items() if k != "metrics") or \
            not isinstance(metrics, dict) or not all(
                isinstance(k, str) and isinstance(v, list) and len(v) == 3 and _number_or_none(v[0])
                and v[0] is not None and _number_or_none(v[1]) and v[1] is not None and isinstance(v[2], bool)
                for k, v in metrics.items()):
        raise bad("'sums' is not a record of finite numbers")
    mon = m.get("monitor")
    if not isinstance(mon, dict) or not _number_or_none(mon.get("best")) or \
            (mon.get("best_epoch") is not None and not (isinstance(mon.get("best_epoch"), int)
                                                        and 1 <= mon["best_epoch"] <= epoch)) or \
            isinstance(mon.get("wait"), bool) or not isinstance(mon.get("wait"), int) or mon["wait"] < 0:
        raise bad(f"'monitor' is {mon!r}, expected best, best_epoch (1..{epoch}) and wait (>= 0)")
    if m.get("scheduler") is not None and not isinstance(m["scheduler"], dict):
        raise bad("'scheduler' is not a record")
    arrays = c.path.with_name(str(m.get("arrays")))
    for name, want in required.items():
        have = c.state.get(name)
        if have is None:
            raise CheckpointError(f"{arrays}: the checkpoint lacks the entry '{name}'; delete it to resume from an "
                                  "older checkpoint")
        if have.shape != want.shape or have.dtype != want.dtype:
            raise CheckpointError(f"{arrays}: entry '{name}' is {have.dtype}{list(have.shape)}, the model's is "
                                  f"{want.dtype}{list(want.shape)}")
    if not allow_nonfinite:
        for name, value in c.state.items():
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise CheckpointError(f"{arrays}: entry '{name}' holds NaN or infinite values (the run diverged "
                                      "before this checkpoint); resume from an older checkpoint (delete this "
                                      "one), or start again with a smaller learning rate")
