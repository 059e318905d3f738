"""TrainConfig: every setting of a run, its checks, and its config.json form (from_dict)."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ..coerce import coerce_fields, json_text
from ..data.datasets import DataConfig
from ..errors import ConfigError
from .guard import ON_NAN
from .metrics import FIXED_MONITORS, metric_family, monitorable_names
from .monitor import Monitor

# Settings that may differ between a run and its resumption (everything else must match).
RESUMABLE_CHANGES = ("epochs", "log_every", "device", "artifacts_dir", "data_dir", "keep_checkpoints",
                     "checkpoint_every", "patience", "min_delta", "prefetch", "on_nan", "export",
                     "torch_compile")
# Which TrainConfig fields Model.fit / anygrad.train.fit take as keywords, and where the others
# belong (one table; fit's keyword check reads it). The loop's own settings:
FIT_SETTINGS = ("epochs", "batch_size", "seed", "drop_last", "shuffle", "valid_batch_size", "log_every",
                "artifacts_dir", "prefetch", "target_keys", "clip_grad_norm", "accumulate", "scheduler",
                "scheduler_options", "monitor", "mode", "patience", "min_delta", "keep_checkpoints",
                "checkpoint_every", "on_nan", "param_groups", "no_decay")
# The model's: set by compile() (or Model methods) before fit; field -> where it goes.
COMPILE_SETTINGS = {
    "optimizer": "compile(optimizer=anygrad.optim.SGD(lr=...))",
    "lr": "compile(optimizer=anygrad.optim.SGD(lr={value!r})) — or set model.lr",
    "loss": "compile(loss=...)",
    "precision": "compile(precision={value!r})",
    "device": "compile(device={value!r})",
    "limits": "compile(limits={value!r})",
    "memory_budget": "compile(memory_budget={value!r})",
    "sync_batchnorm": "compile(sync_batchnorm=...)",
    "grad_compression": "compile(grad_compression={value!r})",
    "torch_compile": "compile(torch_compile=...)",
    "init": "the model's construction (anygrad train --init)",
    "weights": "model.load_state_dict({value!r})",
    "weights_partial": "model.load_state_dict(..., strict=False)",
    "weights_key": "model.load_state_dict(..., key={value!r})",
    "freeze": "model.freeze(...)",
    "padding_idx": "model.set_padding_idx(...)",
}
# The CLI's (train/run.py builds the model and the data from them); in Python, pass fit the data,
# validation data and transforms.
CLI_SETTINGS = ("model", "dataset", "data_dir", "valid_fraction", "normalize", "mean", "std", "crop_padding",
                "hflip", "x_key", "y_key", "block_size", "export")
# Keys of config.json that are not settings: what the run resolved them to (written by the run).
BOOKKEEPING_KEYS = ("resolved",)
# How batches are normalised: in the graph on the device (uint8 uploads), on the host, or not at all.
NORMALIZE_MODES = ("device", "host", "none")


def check_fit_keywords(settings: dict[str, Any]) -> None:
    """Raise a ConfigError for a keyword fit does not take: a compile()-time or CLI-only setting
    (see FIT_SETTINGS, COMPILE_SETTINGS, CLI_SETTINGS), or no setting at all."""
    for name, value in settings.items():
        if name in FIT_SETTINGS:
            continue
        if name in COMPILE_SETTINGS:
            raise ConfigError(f"fit() does not take {name}=: it is the model's, set before training: "
                              + COMPILE_SETTINGS[name].format(value=value))
        if name in CLI_SETTINGS:
            raise ConfigError(f"fit() does not take {name}=: data and run settings (dataset, valid_fraction, "
                              "normalize, mean, std, hflip, crop_padding, export, ...) are the CLI's (anygrad train); "
                              "in Python pass fit the training and validation data and transforms=")
        close = difflib.get_close_matches(name, FIT_SETTINGS, 1)
        raise ConfigError(f"fit() does not take {name}=" + (f" (did you mean {close[0]}=?)" if close else "")
                          + f"; its settings are {', '.join(FIT_SETTINGS)}")


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
    # parameter groups (anygrad.optim.groups): {"params": [globs], setting: value} or --param-group's
    # 'PATTERN:KEY=VALUE,...'; then one group without weight decay for the no_decay globs
    param_groups: list[Any] = field(default_factory=list)
    no_decay: list[str] = field(default_factory=list)
    device: str = ""
    limits: str | None = None            # a wgpu limits profile to train within (wgpu/planning/limits.py)
    memory_budget: str | None = None     # device bytes a step may hold, e.g. '1.5GB' (default: the profile's)
    sync_batchnorm: bool = False         # BatchNorm statistics over every device and rank (SyncBatchNorm)
    grad_compression: str = "none"       # none, or bf16: gradients sent between ranks as bfloat16
    torch_compile: bool = False          # the step through torch.compile (torch devices only; --compile)
    precision: str = "f32"               # f32, or f16: mixed precision with loss scaling (ir/autocast.py)
    init: str = ""
    weights: str | None = None           # state_dict file loaded right after the model (fine-tuning)
    weights_partial: bool = False        # load the weights' matching entries only (load_state_dict(strict=False))
    weights_key: str | None = None       # the checkpoint entry holding the state_dict (default: searched for)
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
        if self.precision not in ("f32", "f16"):
            raise ConfigError(f"precision must be f32 or f16, got {self.precision!r}")
        if self.export not in ("best", "last"):
            raise ConfigError(f"export must be best or last, got {self.export!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"clip-grad-norm must be positive, got {self.clip_grad_norm}")
        if (self.weights_partial or self.weights_key) and not self.weights:
            raise ConfigError(f"{'weights-partial' if self.weights_partial else 'weights-key'} says how to load "
                              "--weights FILE; give --weights too")
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
        own = str(self.loss).split(":")[0] == "output" if own_loss is None else own_loss
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
        from ..optim.groups import parse_group_spec
        # one form (the dict) whichever way a group came, so a resume compares like with like
        self.param_groups = [parse_group_spec(g, "param-group") for g in self.param_groups]
        if any(not p for p in self.no_decay):
            raise ConfigError("no-decay: patterns are non-empty globs such as '*.bias'")

    def optimizer_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param_groups these settings ask for (--param-group, then --no-decay)."""
        from ..optim.groups import config_groups
        return config_groups(self.param_groups, self.no_decay)

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

