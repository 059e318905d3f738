"""The training loop: epochs of `Model.train_step` over a DataLoader, validation, artifacts.

Steps never read back from the device; the metric sums the step program accumulates there are
read every `log_every` steps (progress) and at the end of the epoch. Artifacts are written to a
temporary name and renamed, so a crash or Ctrl-C never leaves a half-written file. Checkpoints
hold all device state, so `resume` continues a run bit for bit (on the CPU).
"""
from __future__ import annotations

import csv
import difflib
import importlib
import io
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..coerce import coerce_fields, json_text
from ..data.datasets import DataConfig
from ..data.loader import BatchSource, DataLoader
from ..data.sources import batch_source, layout_for
from ..data.structure import unwrap_single
from ..data.tokens import TokenWindows
from ..errors import AnygradError, ConfigError, ShapeError
from ..fsutil import atomic_write
from ..ir.input_norm import input_statistics
from ..model import Model
from ..optim.schedulers import RunFacts, get_scheduler
from . import checkpoint as ckpt
from .export_model import plain_model
from .guard import ON_NAN, Diverged, Guard, nonfinite_entries
from .monitor import Monitor
from .report import EpochInfo, Reporter, RunInfo, StepInfo, ValidInfo
from .steplog import StepLog

Arrays = tuple[np.ndarray, np.ndarray]
# What fit trains on: (inputs, targets) arrays or .npy files, an indexable dataset, an iterable of
# batches, a generator function, a BatchSource (see anygrad.data.sources).
Data = Any
Transform = Callable[[np.ndarray, np.ndarray, int], np.ndarray]  # (x batch, sample indices, epoch) -> x
Log = Callable[[str], None]

# Settings that may differ between a run and its resumption (everything else must match).
RESUMABLE_CHANGES = ("epochs", "log_every", "device", "artifacts_dir", "data_dir", "keep_checkpoints",
                     "checkpoint_every", "patience", "min_delta", "prefetch", "on_nan", "export")
# Keys of config.json that are not settings: what the run resolved them to (written by the run).
BOOKKEEPING_KEYS = ("resolved",)
# How batches are normalised: in the graph on the device (uint8 uploads), on the host, or not at all.
NORMALIZE_MODES = ("device", "host", "none")


@dataclass
class TrainConfig:
    """Every setting of a run; saved as config.json, from which `anygrad train --config` reruns it.
    Fields beyond the loop's own are recorded as given (the CLI fills in model, dataset, ...)."""

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
    limits: str | None = None            # a wgpu limits profile to train within (backends/wgpu/limits.py)
    memory_budget: str | None = None     # device bytes a step may hold, e.g. '1.5GB' (default: the profile's)
    init: str = ""
    weights: str | None = None           # state_dict file loaded right after the model (fine-tuning)
    freeze: list[str] = field(default_factory=list)  # parameter patterns not to train (Model.freeze)
    padding_idx: list[str] = field(default_factory=list)  # 'TABLE:ROW' (Model.set_padding_idx)
    # -- data (anygrad.data.DataConfig): split, normalisation, augmentation, prefetching
    valid_fraction: float | None = None  # None: the set's own validation split (else 0.1 of train)
    normalize: str = "device"            # device, host, none (see NORMALIZE_MODES)
    mean: list[float] | None = None      # per channel, [0, 1] pixel units; None: the dataset's own
    std: list[float] | None = None
    crop_padding: int = 0                # random crop after this much zero padding (training only)
    hflip: bool = False                  # random horizontal flip (training only)
    prefetch: bool = False               # prepare the next batch in a background thread
    x_key: str = "x"                     # .npz array names
    y_key: str = "y"
    block_size: int | None = None        # tokens per window of the tokens dataset (anygrad.data.tokens)
    target_keys: list[str] | None = None  # keys of dict samples that are targets (None: labels, label, y, ...)
    # -- the step program
    clip_grad_norm: float | None = None  # max global 2-norm of the gradients
    accumulate: int = 1                  # batches per optimizer update
    # -- learning-rate schedule (anygrad.optim.get_scheduler name and options)
    scheduler: str | None = None
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    # -- the monitored metric: best checkpoint, early stopping, reduce-on-plateau
    monitor: str = "valid_loss"
    mode: str = "auto"                   # min, max, auto (max for accuracies and top5, min otherwise)
    patience: int | None = None          # early stopping after this many epochs without improvement
    min_delta: float = 0.0
    # -- checkpoints
    keep_checkpoints: int = 2
    checkpoint_every: int = 0            # also every N steps within an epoch (0: at epoch ends only)
    # -- safety (train/guard.py, train/run.py)
    on_nan: str = "stop"                 # a non-finite loss or state: stop, skip (go back), warn
    export: str = "best"                 # weights.* and model.onnx at the end: the best epoch's, or the last's

    def check(self, own_loss: bool | None = None) -> None:
        """Raise a ConfigError for a bad setting. `own_loss`: whether the model computes its own
        loss (loss='output'), whose scalar outputs may be monitored by name (default: the loss
        setting says)."""
        for name in ("epochs", "batch_size", "accumulate"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.valid_batch_size is not None and self.valid_batch_size < 1:
            raise ConfigError(f"valid-batch-size must be at least 1, got {self.valid_batch_size}")
        for name in ("log_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be 0 or positive, got {getattr(self, name)}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.lr is not None and not (np.isfinite(self.lr) and self.lr >= 0):
            raise ConfigError(f"lr must be a finite number >= 0, got {self.lr}")
        if self.on_nan not in ON_NAN:
            raise ConfigError(f"on-nan must be one of {', '.join(ON_NAN)}, got {self.on_nan!r}")
        if self.export not in ("best", "last"):
            raise ConfigError(f"export must be best or last, got {self.export!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"clip-grad-norm must be positive, got {self.clip_grad_norm}")
        self.check_monitor_name(own_loss)
        Monitor(self.monitor, self.mode, self.patience, self.min_delta)  # raises on bad values
        if self.normalize not in NORMALIZE_MODES:
            raise ConfigError(f"normalize must be one of {', '.join(NORMALIZE_MODES)}, got {self.normalize!r}")
        self.data_config().check()

    def check_monitor_name(self, own_loss: bool | None = None) -> None:
        """--monitor names a metrics.jsonl column: a fixed one, or train_/valid_ and a metric of a
        known family (perplexity, box_mae, ...); with loss='output' (`own_loss`, default: the
        loss setting) any train_/valid_ name, the model's outputs being known only once it runs.
        Whether this run's model reports it is checked when training starts (Learner)."""
        m = self.monitor
        if m in FIXED_MONITORS:
            return
        base = m.split("_", 1)[1] if m.startswith(("train_", "valid_")) else ""
        own = self.loss == "output" if own_loss is None else own_loss
        if base and (metric_family(base) is not None or (own and base.replace("_", "").replace(".", "").isalnum())):
            return
        names = monitorable_names()
        close = difflib.get_close_matches(m, names, 3)
        raise ConfigError(f"monitor: unknown metric '{m}'" + (f" (did you mean {' or '.join(close)}?)" if close else "")
                          + f"; choose one of {', '.join(names)}, or train_/valid_ with an output's prefix "
                          "(valid_box_mae)" + ("" if own else "; with --loss output, any of the model's scalar "
                                              "outputs (valid_<output>)"))

    def data_config(self) -> DataConfig:
        """The data settings as an anygrad.data.DataConfig (dataset, folder, split, transforms)."""
        return DataConfig(dataset=self.dataset or "mnist", data_dir=self.data_dir, valid_fraction=self.valid_fraction,
                          normalize=self.normalize != "none", mean=self.mean, std=self.std,
                          crop_padding=self.crop_padding, hflip=self.hflip, prefetch=self.prefetch,
                          x_key=self.x_key, y_key=self.y_key)

    def __post_init__(self) -> None:
        # Every way in (a config file, fit(**settings), the constructor) gets the annotated types,
        # so a wrong value fails here, naming the setting, not as a TypeError inside the loop.
        coerce_fields(self, lambda name, what, value: ConfigError(
            f"setting '{name}' must be {what}, got {json_text(value)}"))

    @classmethod
    def from_dict(cls, record: dict[str, Any], source: str = "config") -> TrainConfig:
        """The settings in a config.json record. Its bookkeeping keys ("resolved", and notes under
        keys starting with "_") are skipped; any other unknown key is an error."""
        names = [f.name for f in fields(cls)]
        unknown = [k for k in record if k not in names and k not in BOOKKEEPING_KEYS and not k.startswith("_")]
        if unknown:
            hints = [f"'{k}' (did you mean '{m[0]}'?)" if (m := difflib.get_close_matches(k, names, 1)) else f"'{k}'"
                     for k in unknown]
            raise ConfigError(f"{source}: unknown setting{'s' * (len(unknown) > 1)} {', '.join(hints)}; remove "
                              f"{'them' if len(unknown) > 1 else 'it'} (the settings are the fields of "
                              "anygrad.train.TrainConfig; notes go under keys starting with '_')")
        try:
            return cls(**{k: v for k, v in record.items() if k in names})
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


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


@dataclass
class FitResult:
    history: list[EpochMetrics]
    artifacts_dir: Path | None
    stopped_early: bool = False
    interrupted: bool = False
    best_epoch: int | None = None
    diverged: str | None = None          # what was not finite, when --on-nan stop ended the run
    exported_epoch: int | None = None    # whose weights weights.* hold (train/run.py exports the best)

    @property
    def last(self) -> EpochMetrics | None:
        return self.history[-1] if self.history else None


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
            n, parts = read
        else:
            n = read.get("count", 0.0)
            parts = {}
            for k, v in read.items():
                if k == "count" or v is None:
                    continue
                exp = metric_family(k) == "perplexity"  # summed as NLL, as the device does
                parts[k] = (float(np.log(v)) * n if exp else v * n, n, exp)
        if not n:
            return
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


# -- artifacts ------------------------------------------------------------------------------------
def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf (a diverged run) as null: JSON has no NaN, and jq and friends reject it."""
    return {k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in row.items()}


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


# -- reporting ------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


class LineReporter:
    """A Reporter over two callables: `log` gets one line per epoch and messages, `progress` one
    line every `log_every` steps (either may be None)."""

    def __init__(self, log: Log | None = print, progress: Log | None = None):
        self.log, self.progress, self.epochs = log, progress, 0

    def run_begin(self, info: RunInfo) -> None:
        self.epochs = info.epochs

    def step(self, info: StepInfo) -> None:
        if self.progress:
            self.progress(f"epoch {info.epoch}/{self.epochs} step {info.step}/{info.steps}  loss {_fmt(info.loss)}"
                          f"  acc {_fmt(info.accuracy)}  lr {info.lr:.3g}  {info.samples_per_s:.0f} samples/s")

    def epoch_end(self, info: EpochInfo) -> None:
        if self.log:
            m = info.metrics
            top = f" top5 {_fmt(m.get('valid_top5'))}" if m.get("valid_top5") is not None else ""
            top += "".join(f"  {k.replace('_', ' ', 1)} {_fmt(v)}" for k, v in m.items()
                           if k.startswith(("train_", "valid_")) and k not in FIXED_MONITORS and v is not None)
            self.log(f"epoch {info.epoch}/{self.epochs}  train loss {_fmt(m.get('train_loss'))} "
                     f"acc {_fmt(m.get('train_accuracy'))}  valid loss {_fmt(m.get('valid_loss'))} "
                     f"acc {_fmt(m.get('valid_accuracy'))}{top}  {info.seconds:.1f}s" + ("  *" if info.best else ""))

    def message(self, text: str) -> None:
        if self.log:
            self.log(text)

    def run_end(self, stopped_early: bool = False, interrupted: bool = False) -> None:
        pass


# -- Ctrl-C: finish the step, checkpoint, stop --------------------------------------------------
class _StopFlag:
    def __init__(self) -> None:
        self.requested = False


@contextmanager
def _graceful_interrupt(acknowledge: Callable[[], None] | None = None) -> Iterator[_StopFlag]:
    """The first SIGINT asks the loop to stop after the current step (a step interrupted halfway
    would leave the device state half updated), said at once by `acknowledge`; a second one
    interrupts at once."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True
        if acknowledge is not None:
            acknowledge()

    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


# -- the loop -------------------------------------------------------------------------------------
def _validate(model: Model, data: Data, batch_size: int, transform: Transform | None = None,
              on_batch: Callable[[int, int], None] | None = None) -> _Sums:
    """Loss and accuracy over `data` (any source fit takes, or a BatchSource) in inference mode
    (eval programs, one per batch shape); `on_batch(done, total)` after each batch (the validation
    progress bar)."""
    model.reset_metrics()
    sums = _Sums()
    source = data if isinstance(data, BatchSource) else batch_source(
        data, batch_size=batch_size, shuffle=False, transform=transform, layout=_layout(model, None),
        role="validation data")
    for i, (x, y) in enumerate(source.epoch_batches(0), 1):
        model.eval_step(_inputs(model, x), y)
        if on_batch is not None:
            on_batch(i, len(source))
    sums.add(model.read_metric_sums(reset=True))
    return sums


def _layout(model: Model, target_keys: Any) -> Any:
    """How dict samples split for this model: a loss computed in the graph takes no targets."""
    return layout_for(getattr(model.loss, "name", None) == "output", target_keys)


def _inputs(model: Model, x: Any, dropped: set[str] | None = None) -> Any:
    """A batch's inputs as the model takes them: the structure as given ({name: array} or a
    tuple in graph order), a one-input model's single array unwrapped. Dict keys that name no
    graph input are left out when others do (as Hugging Face's Trainer drops unused columns,
    such as 'idx' or 'text'); `dropped` collects them."""
    names = model.graph.inputs
    if isinstance(x, dict):
        known = [k for k in x if k in names]
        if known and len(known) < len(x):
            if dropped is not None:
                dropped.update(k for k in x if k not in names)
            x = {k: x[k] for k in known}
    return unwrap_single(x, len(names))


def _with_last(batches: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """(batch, is_last) pairs, one batch ahead: the last batch of an epoch flushes an accumulation
    group, also when an iterable's epoch is not as long as its first one."""
    it = iter(batches)
    try:
        ahead = next(it)
    except StopIteration:
        return
    for item in it:
        yield ahead, False
        ahead = item
    yield ahead, True


@dataclass
class _Run:
    """Where the run stands: everything besides device state that a checkpoint records."""

    epoch: int = 1                 # the epoch in progress (1-based)
    step: int = 0                  # steps done within it
    global_step: int = 0
    epoch_done: bool = False       # the checkpoint was written after the epoch's validation
    history: list[EpochMetrics] = field(default_factory=list)
    sums: _Sums = field(default_factory=_Sums)
    stopped_early: bool = False
    lr: float | None = None        # the rate of the epoch's latest optimizer step (metrics.jsonl's lr)


class Learner:
    """One training run of a compiled model: the loop, its schedule, monitor and checkpoints."""

    def __init__(self, model: Model, train_data: Data, valid_data: Data | None, config: TrainConfig,
                 reporter: Reporter, transforms: tuple[Transform | None, Transform | None] = (None, None),
                 resolved: dict[str, Any] | None = None):
        """`transforms`: per-batch input transforms (training, validation), e.g. a DataConfig's.
        `resolved`: what the caller resolved settings to, for config.json's "resolved" record."""
        self.model, self.train_data, self.valid_data, self.config, self.reporter = \
            model, train_data, valid_data, config, reporter
        self.resolved = dict(resolved or {})
        self.valid_transform = transforms[1]
        model._require_compiled()
        if config.clip_grad_norm is not None or config.accumulate != 1:  # else keep what compile() set
            model.configure_step(clip_norm=config.clip_grad_norm, accumulate=config.accumulate)
        # Data parallelism (anygrad.distributed): this rank's share of each global batch; rank 0 writes.
        parallel = model.parallel
        self.writer = parallel is None or parallel.is_writer
        self.world_size = 1 if parallel is None else parallel.world_size
        layout = _layout(model, config.target_keys)
        if parallel is not None:
            if not (isinstance(train_data, tuple) and len(train_data) == 2):
                raise ConfigError("data-parallel training shards (inputs, targets) arrays; pass fit the arrays "
                                  "(or .npy memmaps) rather than a dataset object or an iterable of batches")
            self.loader = parallel.loader(*train_data, batch_size=config.batch_size, shuffle=config.shuffle,
                                          seed=config.seed, drop_last=config.drop_last, transform=transforms[0],
                                          prefetch=config.prefetch)
        else:
            self.loader = batch_source(train_data, batch_size=config.batch_size, shuffle=config.shuffle,
                                       seed=config.seed, drop_last=config.drop_last, transform=transforms[0],
                                       prefetch=config.prefetch, layout=layout)
        if isinstance(self.loader, TokenWindows):
            self.loader.bind(config.batch_size, config.seed)
        if valid_data is not None and not isinstance(valid_data, BatchSource):
            valid_data = batch_source(valid_data, batch_size=config.valid_batch_size or config.batch_size,
                                      shuffle=False, transform=transforms[1], layout=layout, role="validation data")
            self.valid_data = valid_data
        n = self.loader.n_samples
        if len(self.loader) == 0:
            raise ConfigError(f"no full batch of {config.batch_size} in {n if n is not None else 'the'} training "
                              "samples; use a smaller batch size or keep the last partial batch (no drop_last)"
                              if n is not None else f"{self.loader.what} yielded no batches")
        if n is not None and self.loader.sample_shape is not None and isinstance(self.loader, DataLoader):
            self._check_last_batch(n % config.batch_size if not config.drop_last else 0)
        self.steps = len(self.loader)
        self.log_every = config.log_every or max(1, self.steps // 10)
        self.out_dir = Path(config.artifacts_dir) if config.artifacts_dir else None
        self.ckpt_dir = self.out_dir / "checkpoints" if self.out_dir else None
        self.monitor = Monitor(config.monitor, config.mode, config.patience, config.min_delta)
        self.notes: list[str] = []  # said when the run begins
        self.scheduler = None
        if config.scheduler:
            self.scheduler = get_scheduler(config.scheduler, base_lr=model.lr, run=self.run_facts(),
                                           **config.scheduler_options)
            model.lr = self.scheduler.lr
        self._check_monitor()
        self._monitor_checked = False
        self._length_noted = False
        self._dropped: set[str] = set()
        if not self.loader.positionable and self.out_dir is not None:
            self.notes.append(f"note: {self.loader.what} is an iterable, which cannot be positioned mid-epoch: "
                              "checkpoints are written at epoch ends only, and a resumed run restarts an "
                              "interrupted epoch from its beginning with the weights it began with")
        self.run = _Run()
        self.guard = Guard(config.on_nan, model.state_dict, model.full_state, model.load_full_state)
        self.steplog = StepLog(self.out_dir) if self.out_dir is not None and self.writer else None
        self._valid_steps = len(self.valid_data) if self.valid_data is not None else 0

    def _check_last_batch(self, size: int) -> None:
        """Shape-check the training graph at the last partial batch now, not an epoch from now
        (BatchNorm cannot train on a batch of one sample, as in PyTorch)."""
        if size == 0:
            return
        n, shape = self.loader.n_samples, tuple(self.loader.sample_shape)
        try:
            self.model.check_training_shape((size,) + shape)
        except ShapeError as e:
            raise ConfigError(f"the last batch of each epoch holds {size} sample{'s' * (size != 1)} ({n} "
                              f"samples, batch size {self.config.batch_size}), which the model cannot train on: "
                              f"{e}") from None

    def _unmonitorable(self) -> str | None:
        """Why this run will have no value for the monitored metric, or None."""
        metric, model = self.config.monitor, self.model
        if metric.startswith("valid_") and (self.valid_data is None or len(self.valid_data) == 0):
            return "the run has no validation data (none given, or --valid-fraction 0)"
        base = metric.split("_", 1)[1] if metric.startswith(("train_", "valid_")) else metric
        if base in FIXED_MONITORS or base == "loss" or len(model.heads) != 1 or not model.loss.needs_target:
            return None  # per-output names: checked against the model's names at the first step
        family, loss = metric_family(base), model.loss
        if family == "label_accuracy" and loss.name != "bce_with_logits":
            return f"label_accuracy is counted for multi-label bce_with_logits, not for the loss {loss.name}"
        if family in ("mse", "mae") and loss.name not in ("mse", "l1"):
            return f"{family} is counted for the regression losses mse and l1, not for the loss {loss.name}"
        if family in ("accuracy", "top5", "pixel_accuracy", "perplexity") and not loss.classification:
            return f"the loss {loss.name} is not a classification loss, so no accuracy is counted"
        if family == "top5" and model.top_k is None:
            return "top-5 accuracy is counted for classifiers of more than 5 classes only"
        return None

    def _check_monitor_reported(self) -> None:
        """Once the first step program is built (the model's metric names known): a monitored
        metric the model does not report is an error when early stopping or the schedule needs
        it, else a note."""
        if self._monitor_checked:
            return
        self._monitor_checked = True
        metric, names = self.config.monitor, self.model.metric_names
        base = metric.split("_", 1)[1] if metric.startswith(("train_", "valid_")) else metric
        if metric in ("seconds", "lr", "samples_per_s") or base in names or not names:
            return
        choices = ", ".join(f"{p}_{n}" for n in names for p in ("train", "valid"))
        why = f"the model reports {', '.join(names)} (monitor one of {choices})"
        if self._metric_needed:
            raise ConfigError(f"--monitor {metric}: this model reports no metric '{base}'; {why}")
        self.reporter.message(f"note: no best checkpoint: '{metric}' has no value in this run: {why}")

    @property
    def _metric_needed(self) -> bool:
        """Whether early stopping or the schedule reads the monitored metric (so the run must have it)."""
        return self.config.patience is not None or (self.scheduler is not None and self.scheduler.needs_metric)

    def _check_monitor(self) -> None:
        """Before the first step: a monitored metric the run will never have is an error when early
        stopping or the plateau schedule depends on it, else a note (no best checkpoint)."""
        why = self._unmonitorable()
        if why is None:
            return
        if self._metric_needed:
            users = (["--patience"] if self.config.patience is not None else []) + \
                ([f"--scheduler {self.scheduler.name}"] if self.scheduler is not None and self.scheduler.needs_metric
                 else [])
            raise ConfigError(f"{' and '.join(users)} watch --monitor {self.config.monitor}, which this run cannot "
                              f"measure: {why}; choose another --monitor (e.g. train_loss)")
        if self.out_dir is not None:
            self.notes.append(f"note: no best checkpoint: {why}, so '{self.config.monitor}' has no value "
                              "(--monitor chooses another metric)")

    def run_facts(self) -> RunFacts:
        """What a scheduler may take from this run: its length in optimizer updates (an update
        every `accumulate` batches, and one for the last partial group of an epoch) and the
        direction of the monitored metric."""
        return RunFacts(self.config.epochs, -(-self.steps // self.config.accumulate), self.monitor.mode)

    # -- checkpoints --------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        r = self.run
        return {"fingerprint": self.model.fingerprint(), "epoch": r.epoch, "step": r.step,
                "global_step": r.global_step, "epoch_done": r.epoch_done, "stopped_early": r.stopped_early,
                "lr": r.lr, "micro_step": self.model.micro_step,
                "steps_per_epoch": self.steps, "history": [_finite(m.row()) for m in r.history],
                "sums": r.sums.state_dict(), "monitor": self.monitor.state_dict(), "world_size": self.world_size,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "config": asdict(self.config)}

    def save_checkpoint(self, best: bool = False) -> Path | None:
        if self.ckpt_dir is None or not self.writer:
            return None
        state, meta = self.model.full_state(), self._meta()
        bad = nonfinite_entries({k: v for k, v in state.items() if not k.startswith("anygrad.metric")})
        if bad and self.config.on_nan != "warn":  # never a non-finite checkpoint: the last one stays the newest
            raise Diverged(f"{', '.join(bad[:3])} hold NaN or infinite values")
        path = ckpt.write(self.ckpt_dir, f"{ckpt.PREFIX}{self.run.global_step:08d}", state, meta)
        ckpt.prune(self.ckpt_dir, self.config.keep_checkpoints)
        if best:
            ckpt.write(self.ckpt_dir, ckpt.BEST, state, meta)
        return path

    def resume(self, path: Path | None = None) -> Path:
        """Continue from checkpoint `path` (default: the newest in the artifacts folder)."""
        if path is None:
            if self.ckpt_dir is None:
                raise ConfigError("resuming needs the run's artifacts folder")
            path = ckpt.latest(self.ckpt_dir)
            if path is None:
                raise ckpt.CheckpointError(f"no checkpoint in {self.ckpt_dir} to resume from; the run stopped "
                                           "before its first checkpoint, so start it again")
        c = ckpt.read(Path(path))
        m = c.meta
        if m.get("fingerprint") != self.model.fingerprint():
            raise ckpt.CheckpointError(f"{path}: this checkpoint belongs to another model (fingerprint "
                                       f"{m.get('fingerprint')}, this model's is {self.model.fingerprint()}); "
                                       "resume with the model file the run was started with")
        saved = m.get("config", {})
        now = asdict(self.config)
        diff = [k for k in now if k not in RESUMABLE_CHANGES and k in saved and saved[k] != now[k]]
        if diff:
            raise ckpt.CheckpointError(f"{path}: the checkpoint was made with different settings: " + ", ".join(
                f"{k} {saved[k]!r} (now {now[k]!r})" for k in diff) + "; resume with the run's own config.json")
        if not self.loader.positionable and not m.get("epoch_done") and int(m.get("step", 0) or 0) > 0:
            raise ckpt.CheckpointError(f"{path} was written mid-epoch (epoch {m.get('epoch')}, step {m.get('step')}),"
                                       f" but {self.loader.what} is an iterable, which cannot be positioned there; "
                                       "resume from a checkpoint written at an epoch end")
        # Another number of ranks pads the epoch's tail differently (DistributedSampler), which may
        # change its step count; a global step still covers the same samples of the epoch's order.
        if m.get("steps_per_epoch") != self.steps and m.get("world_size", 1) == self.world_size:
            raise ckpt.CheckpointError(f"{path}: the run had {m.get('steps_per_epoch')} steps per epoch, this "
                                       f"one {self.steps}: the training data differ")
        ckpt.validate(c, self.steps, {**self.model.state_dict(), "anygrad.lr": np.zeros((), np.float32)},
                      allow_nonfinite=self.config.on_nan == "warn")
        try:
            self.model.load_full_state(c.state)
            r = self.run
            r.epoch, r.step, r.global_step = int(m["epoch"]), int(m["step"]), int(m["global_step"])
            r.epoch_done = bool(m["epoch_done"])
            r.lr = None if m.get("lr") is None else float(m["lr"])
            r.history = [EpochMetrics.from_row(row) for row in m["history"]]
            r.sums.load_state_dict(m["sums"])
            self.model.micro_step = int(m["micro_step"])
            self.monitor.load_state_dict(m["monitor"])
            if self.scheduler is not None:
                if m.get("scheduler") is None:
                    raise KeyError("scheduler")
                self.scheduler.load_state_dict(m["scheduler"])
        except (KeyError, TypeError, ValueError) as e:
            raise ckpt.CheckpointError(f"{path}: corrupt checkpoint record ({e!r})") from None
        if r.epoch_done:
            r.epoch, r.step, r.epoch_done = r.epoch + 1, 0, False
            r.sums = _Sums()
        # A run that stopped early stays stopped: its monitor's wait already reached the patience.
        # Under a larger --patience (now RESUMABLE) it has not, and the run goes on; --epochs alone
        # does not restart it (the stop is about the metric, not the length). Older checkpoints
        # without the flag: the monitor's state says it.
        r.stopped_early = bool(m.get("stopped_early", True)) and self.monitor.should_stop
        return Path(path)

    # -- the loop -----------------------------------------------------------------------------------
    def fit(self) -> FitResult:
        cfg, r, model = self.config, self.run, self.model
        if self.out_dir is not None and self.writer:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_json(self.out_dir / "config.json", config_record(
                model, cfg, self.resolved, scheduler=self.scheduler.config() if self.scheduler else None))
        if self.steplog is not None:  # per-step rows past the checkpoint resumed from are another history
            self.steplog.truncate(r.global_step)
        self.reporter.run_begin(RunInfo(model=model.source, device=model.backend.description,
                                        epochs=cfg.epochs, steps_per_epoch=self.steps, batch_size=cfg.batch_size,
                                        start_epoch=r.epoch, artifacts_dir=str(self.out_dir) if self.out_dir else None,
                                        valid_steps=self._valid_steps))
        for note in self.notes:
            self.reporter.message(note)
        if r.stopped_early:  # resumed after an early stop (see resume): nothing to train
            self.reporter.message(f"the run already stopped early at epoch {r.epoch - 1}: {cfg.monitor} has not "
                                  f"improved for {self.monitor.wait} epochs (best {self.monitor.best:.6g} at epoch "
                                  f"{self.monitor.best_epoch}); to train on, resume with a larger --patience")
        elif r.epoch > cfg.epochs:
            self.reporter.message(f"the run already finished its {cfg.epochs} epochs; to train on, resume with a "
                                  "larger --epochs")
        warned = interrupted = False
        already_stopped = r.stopped_early
        diverged = None
        with _graceful_interrupt(lambda: self.reporter.message(
                "stopping after this step, then writing a checkpoint (Ctrl-C again stops at once)")) as stop:
            try:
                while r.epoch <= cfg.epochs and not r.stopped_early:
                    if self._train_epoch(stop):
                        interrupted = True
                        break
                    self._end_epoch(warned)
                    warned = warned or self._diverged()
                    r.epoch, r.step, r.sums = r.epoch + 1, 0, _Sums()
            except Diverged as e:
                diverged = f"the run diverged at epoch {r.epoch} step {r.step}: {e}"
        closing = []  # said below the final view: what stopped the run and how to go on
        if diverged:
            last = ckpt.latest(self.ckpt_dir) if self.ckpt_dir is not None else None
            closing.append(f"{diverged}; stopped (--on-nan stop)" + (
                f"; the newest checkpoint {last} holds the last finite state" if last else ""))
        elif interrupted and not self.loader.positionable:
            closing.append(f"interrupted at epoch {r.epoch} step {r.step}/{self.steps}; {self.loader.what} "
                           "cannot resume mid-epoch, so no checkpoint of this step" + (
                               f"; anygrad train --resume {self.out_dir} restarts epoch {r.epoch} from the "
                               f"checkpoint of epoch {r.epoch - 1}" if self.out_dir and r.epoch > 1 else ""))
        elif interrupted:
            try:
                where = self.save_checkpoint()
            except Diverged as e:  # stopped between two checks, after the state went non-finite
                where, diverged = None, f"the run diverged before epoch {r.epoch} step {r.step}: {e}"
                closing.append(f"{diverged}; no checkpoint written (--on-nan stop)")
            closing.append(f"interrupted at epoch {r.epoch} step {r.step}/{self.steps}" + (
                f"; checkpoint {where}; continue with: anygrad train --resume {self.out_dir}" if where else ""))
        elif r.stopped_early and not already_stopped:
            self.reporter.message(f"early stop: {cfg.monitor} has not improved for {self.monitor.wait} epochs "
                                  f"(best {self.monitor.best:.6g} at epoch {self.monitor.best_epoch})")
        self.reporter.run_end(stopped_early=r.stopped_early, interrupted=interrupted)
        for text in closing:
            self.reporter.message(text)
        return FitResult(r.history, self.out_dir, r.stopped_early, interrupted, self.monitor.best_epoch, diverged,
                         r.history[-1].epoch if r.history else None)

    def _inputs(self, x: Any) -> Any:
        dropped: set[str] = set()
        x = _inputs(self.model, x, dropped)
        if dropped - self._dropped:
            self._dropped |= dropped
            self.reporter.message(f"note: the data's {', '.join(sorted(dropped))} name no input of the model "
                                  f"(inputs: {', '.join(self.model.graph.inputs)}); left out")
        return x

    def _train_epoch(self, stop: _StopFlag) -> bool:
        """Train the rest of epoch r.epoch; True when interrupted."""
        cfg, r, model = self.config, self.run, self.model
        start, done_before = time.perf_counter(), r.sums.count
        if r.step == 0:
            model.reset_metrics()
        self.guard.remember(r.global_step, model.micro_step)
        # A positionable source starts mid-epoch (after a resume) at batch r.step, the batches being
        # a function of (seed, epoch, position); an iterable starts epochs at their beginning only.
        batches = self.loader.epoch_batches(r.epoch - 1, r.step)
        for step, ((x, y), last) in enumerate(_with_last(batches), r.step + 1):
            r.lr = model.lr  # what this step's update (or its accumulation group's) uses
            model.train_step(self._inputs(x), y, flush=last)
            self._check_monitor_reported()
            r.step, r.global_step = step, r.global_step + 1
            if self.scheduler is not None and self.scheduler.interval == "step" and model.micro_step == 0:
                model.lr = self.scheduler.step()
            if last and step != self.steps and not self._length_noted:
                self._length_noted = True
                self.reporter.message(f"note: epoch {r.epoch} of {self.loader.what} had {step} batches, the first "
                                      f"{self.steps}; progress and schedules count {self.steps} per epoch")
            if step % self.log_every == 0 and step < self.steps:
                r.sums.add(self._read())
                rate = (r.sums.count - done_before) / max(time.perf_counter() - start, 1e-9)
                info = StepInfo(r.epoch, step, self.steps, r.global_step, r.sums.mean_loss, r.sums.accuracy,
                                model.lr, rate, r.sums.means())
                self.reporter.step(info)
                if self.steplog is not None:
                    self.steplog.add(info)
            if stop.requested if model.parallel is None else model.parallel.agree(stop.requested):
                return True  # (every rank stops after the same step: a Ctrl-C reaches them at different ones)
            if cfg.checkpoint_every and r.global_step % cfg.checkpoint_every == 0 and step < self.steps \
                    and self.loader.positionable:
                if step % self.log_every and cfg.on_nan == "skip":  # go back before checkpointing a NaN
                    r.sums.add(self._read())
                self.save_checkpoint()
        r.sums.add(self._read())
        self._epoch_seconds = time.perf_counter() - start
        self._epoch_samples = r.sums.count - done_before
        return False

    def _end_epoch(self, warned: bool) -> None:
        cfg, r, model = self.config, self.run, self.model
        # The rate of the epoch's last optimizer step, whether the schedule moves per epoch or per
        # step (model.lr may already hold the next one); as the float32 device value without its
        # binary tail (0.001, not 0.0010000000475).
        lr = float(f"{r.lr if r.lr is not None else model.lr:.8g}")
        shown = getattr(self.reporter, "validation", None)
        on_batch = None if shown is None else lambda i, n: shown(ValidInfo(r.epoch, i, n))
        valid = _validate(model, self.valid_data, cfg.valid_batch_size or cfg.batch_size, self.valid_transform,
                          on_batch=on_batch) if self.valid_data is not None else _Sums()
        seconds = self._epoch_seconds
        train_extra, valid_extra = r.sums.extra(""), valid.extra("")
        extra: dict[str, float | None] = {}
        for name in list(train_extra) + [k for k in valid_extra if k not in train_extra]:
            extra[f"train_{name}"] = train_extra.get(name)
            extra[f"valid_{name}"] = valid_extra.get(name)
        metrics = EpochMetrics(r.epoch, r.sums.mean_loss, r.sums.accuracy, valid.mean_loss, valid.accuracy,
                               round(seconds, 3), r.sums.top_accuracy, valid.top_accuracy, lr,
                               round(self._epoch_samples / max(seconds, 1e-9), 1), extra)
        r.history.append(metrics)
        row = metrics.row()
        best = self.monitor.update(r.epoch, row) if self._monitorable(row) else False
        if self.scheduler is not None and self.scheduler.interval == "epoch":
            model.lr = self.scheduler.step(self.monitor.value(row) if self.scheduler.needs_metric else None)
        r.stopped_early = self.monitor.should_stop
        self.reporter.epoch_end(EpochInfo(r.epoch, _finite(row), seconds, best))
        if not warned and self._diverged():
            self.reporter.message("warning: the loss is not finite; the run diverged (try a smaller learning rate)")
        if self.out_dir is not None:
            if self.writer:
                write_metrics(self.out_dir / "metrics.jsonl", r.history)
                save_weights(model, self.out_dir)
            r.step, r.epoch_done = self.steps, True
            self.save_checkpoint(best=best)
            r.epoch_done = False

    def _read(self) -> tuple[float, dict[str, tuple[float, float, bool]]]:
        """The device's metric sums since the last read (reset), after the divergence check."""
        return self._checked(self.model.read_metric_sums(reset=True))

    def _checked(self, read: tuple[float, dict[str, tuple[float, float, bool]]]
                 ) -> tuple[float, dict[str, tuple[float, float, bool]]]:
        """A metric read, after the divergence check (--on-nan): passed on when all is finite or
        the mode is warn; stop raises Diverged; skip restores the last finite state and drops it."""
        n, parts = read
        loss = parts.get("loss")
        problem = self.guard.problem(loss[0] / loss[1] if n and loss else None)
        if problem is None:
            self.guard.remember(self.run.global_step, self.model.micro_step)
            return read
        if self.config.on_nan == "stop":
            raise Diverged(problem)
        if self.config.on_nan == "skip":
            skipped, self.model.micro_step = self.guard.restore(self.run.global_step)
            self.reporter.message(f"warning: {problem} at epoch {self.run.epoch} step {self.run.step}; skipped "
                                  f"{skipped} (--on-nan skip)")
            return 0.0, {}
        if not self.guard.warned:
            self.guard.warned = True
            self.reporter.message(f"warning: {problem} at epoch {self.run.epoch} step {self.run.step}; training "
                                  "goes on (--on-nan warn)")
        return read

    def _monitorable(self, row: dict[str, Any]) -> bool:
        """Whether the monitored metric has a value (always, when _check_monitor found it needed)."""
        return row.get(self.config.monitor) is not None

    def _diverged(self) -> bool:
        m = self.run.history[-1] if self.run.history else None
        return m is not None and any(v is not None and not np.isfinite(v) for v in (m.train_loss, m.valid_loss))


def fit(model: Model, train_data: Data, valid_data: Data | None = None, config: TrainConfig | None = None,
        *, reporter: Reporter | None = None, log: Log | None = print, progress: Log | None = None,
        resume: bool | str | Path = False, transforms: tuple[Transform | None, Transform | None] = (None, None),
        resolved: dict[str, Any] | None = None, **settings: Any) -> FitResult:
    """Train a compiled model for `config.epochs` epochs (TrainConfig fields may be passed as keywords).

    `train_data` and `valid_data`: (inputs, targets) arrays, memmaps or .npy paths; an indexable
    dataset (a torch or Hugging Face Dataset, anything with __len__ and __getitem__), batched and
    shuffled by anygrad from (seed, epoch); a list of batches, a generator function or a torch
    DataLoader, whose batches come as they are; or anygrad.data.TokenWindows. Samples and batches
    are arrays, (inputs, targets) tuples or dicts, whose `target_keys` (default labels, label, y,
    target, targets; none for loss='output') are the targets. See anygrad.data.sources.

    Progress goes to `reporter` (default: a LineReporter over `log` and `progress`). With
    `artifacts_dir`, metrics, weights and a checkpoint are written after every epoch; `resume`
    (True: the newest checkpoint there, or a checkpoint's .json path) continues a run.
    `resolved` goes into config.json's "resolved" record (e.g. {"normalisation": {"mean": ...,
    "std": ..., "on": "host"}, "classes": [...]}, which predict and eval read).
    """
    unknown = set(settings) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown training setting(s) {sorted(unknown)}")
    config = replace(config or TrainConfig(), **settings)
    config.check(own_loss=getattr(model.loss, "name", None) == "output")
    learner = Learner(model, train_data, valid_data, config, reporter or LineReporter(log, progress), transforms,
                      resolved)
    if resume:
        learner.resume(None if resume is True else Path(resume))
    return learner.fit()
