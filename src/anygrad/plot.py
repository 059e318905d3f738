"""Metric curves of a run (DIR/metrics.jsonl) as PNG files, one per metric: loss.png, accuracy.png,
and the task's own (perplexity.png, mae.png, mse.png, pixel_accuracy.png, label_accuracy.png,
box_mae.png, ...: every train_<name>/valid_<name> pair the run wrote); the training curve also
at every progress read (DIR/metrics_steps.csv) when the run wrote one, so short runs draw more
than a point per epoch.

matplotlib is an optional extra (`pip install 'anygrad-train[plot]'`), imported only here and only when
plotting, with the non-interactive Agg backend (no display needed).

Plots drawn into the run folder itself are recorded there (PLOTS_RECORD: each file's name and
sha256), so that `anygrad train --overwrite` removes exactly the plots of the run it replaces
(`plotted_files`), whatever their metric, and never a file of the same name that plot did not
write (or that was changed since).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, DataError
from .fsutil import atomic_write

PLOTS_RECORD = ".anygrad-plots.json"  # in a run folder: the plots plot_run wrote there ({name: sha256})

# (metric, file stem, y label, train key, valid key, as percent): the classifier's; other
# metrics get one of their own from the names in metrics.jsonl (see curve_specs)
CURVES = (
    ("loss", "loss", "loss", "train_loss", "valid_loss", False),
    ("accuracy", "accuracy", "accuracy (%)", "train_accuracy", "valid_accuracy", True),
)


@dataclass
class Curve:
    name: str
    epochs: list[int]
    train: list[float | None]
    valid: list[float | None]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl (one JSON object per epoch); a folder means its metrics.jsonl."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file; plot needs a run folder with metrics.jsonl "
                        "(anygrad train --artifacts DIR writes one)") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{n}: not a JSON line ({e})") from None
        if isinstance(row, dict) and "epoch" in row:
            rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no epochs yet")
    return rows


def read_steps(run: Path) -> list[dict[str, float]]:
    """metrics_steps.csv rows as numbers (epoch, step, steps, loss, accuracy and the task's metric
    columns); [] when absent or odd."""
    import csv
    path = (run if run.is_dir() else run.parent) / "metrics_steps.csv"
    try:
        rows = list(csv.DictReader(path.read_text().splitlines()))
    except (OSError, UnicodeDecodeError, csv.Error):
        return []
    out = []
    skip = ("global_step", "lr", "samples_per_s")
    for r in rows:
        try:
            out.append({k: float(v) if v not in (None, "") else None for k, v in r.items()
                        if isinstance(k, str) and k not in skip and not isinstance(v, list)})
            if any(out[-1].get(k) is None for k in ("epoch", "step", "steps")):
                out.pop()
        except (ValueError, TypeError):
            continue
    return [r for r in out if r["epoch"] and r["step"] and r["steps"]]


def _is_ratio(name: str) -> bool:
    return name.endswith("accuracy") or name.rsplit("_", 1)[-1].startswith("top")


def curve_specs(rows: list[dict[str, Any]]) -> list[tuple[str, str, str, str, str, bool]]:
    """CURVES, then one per other metric the rows hold (train_<name>/valid_<name>), in their order."""
    specs = list(CURVES)
    seen = {c[0] for c in CURVES} | {"top5"}  # top-5 sits beside accuracy in the files only
    for row in rows:
        for key in row:
            if not key.startswith(("train_", "valid_")):
                continue
            name = key.split("_", 1)[1]
            if name in seen:
                continue
            seen.add(name)
            ratio = _is_ratio(name)
            stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
            specs.append((name, stem, f"{name.replace('_', ' ')}" + (" (%)" if ratio else ""),
                          f"train_{name}", f"valid_{name}", ratio))
    return specs


def curves(rows: list[dict[str, Any]]) -> list[Curve]:
    """The curves that have at least one value (a regression run has no accuracy)."""
    out = []
    for name, _, _, train_key, valid_key, _ in curve_specs(rows):
        train = [r.get(train_key) for r in rows]
        valid = [r.get(valid_key) for r in rows]
        if any(v is not None for v in train + valid):
            out.append(Curve(name, [int(r["epoch"]) for r in rows], train, valid))
    return out


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'anygrad-train[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_run(run: str | Path, out_dir: str | Path | None = None, title: str | None = None) -> list[Path]:
    """Write loss.png, accuracy.png when the run has accuracy, and a <metric>.png per other metric
    (perplexity.png, mae.png, ...) into out_dir (default: the run folder)."""
    run = Path(run).expanduser()
    rows = read_metrics(run)
    plt = _pyplot()
    out = Path(out_dir).expanduser() if out_dir is not None else (run if run.is_dir() else run.parent)
    out.mkdir(parents=True, exist_ok=True)
    title = title or (run.name if run.is_dir() else run.parent.name)
    written = []
    steps = read_steps(run)
    specs = curve_specs(rows)
    for curve in curves(rows):
        _, stem, ylabel, _, _, percent = next(c for c in specs if c[0] == curve.name)
        scale = 100.0 if percent else 1.0
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        points = [(r["epoch"] - 1 + r["step"] / r["steps"], r[curve.name] * scale) for r in steps
                  if r.get(curve.name) is not None]
        if points:  # within each epoch, the running mean up to each progress read
            ax.plot(*zip(*points), "-", label="train (within epoch)", linewidth=0.9, alpha=0.5)
        for label, values, style in (("train", curve.train, "o-"), ("valid", curve.valid, "s--")):
            points = [(e, v * scale) for e, v in zip(curve.epochs, values) if v is not None]
            if points:
                ax.plot(*zip(*points), style, label=label, linewidth=1.8, markersize=4)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {curve.name}")
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()
        fig.tight_layout()
        path = out / f"{stem}.png"
        png = io.BytesIO()
        fig.savefig(png, format="png")
        plt.close(fig)
        atomic_write(path, png.getvalue(), fsync=False)
        written.append(path)
    if out.resolve() == (run if run.is_dir() else run.parent).resolve():
        _record_plots(out, written)
    return written


def _digest(path: Path) -> str | None:
    """sha256 of a regular file's bytes (not through a link), or None."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _read_record(folder: Path) -> dict[str, str]:
    try:
        record = json.loads((folder / PLOTS_RECORD).read_bytes()[:1 << 20])
    except (OSError, ValueError, RecursionError):
        return {}
    plots = record.get("plots") if isinstance(record, dict) else None
    if not isinstance(plots, dict):
        return {}
    return {k: v for k, v in plots.items() if isinstance(k, str) and isinstance(v, str)
            and k == Path(k).name and k.endswith(".png")}


def _record_plots(folder: Path, paths: list[Path]) -> None:
    """Add `paths` (just written into the run folder) to its PLOTS_RECORD; earlier entries whose
    file is unchanged stay."""
    plots = {name: digest for name, digest in _read_record(folder).items() if _digest(folder / name) == digest}
    plots.update({p.name: d for p in paths if (d := _digest(p)) is not None})
    try:
        atomic_write(folder / PLOTS_RECORD, json.dumps({"plots": plots}, indent=1, sort_keys=True) + "\n",
                     fsync=False)
    except OSError:  # the plots are written; only --overwrite's cleanup would miss them
        pass


def plotted_files(folder: str | os.PathLike) -> list[Path]:
    """The plots plot_run wrote into run folder `folder` that are still as it wrote them (a file
    of such a name that it did not write, or that was changed since, is not among them)."""
    folder = Path(folder)
    return [folder / name for name, digest in sorted(_read_record(folder).items())
            if _digest(folder / name) == digest]
