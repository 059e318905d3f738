"""The settings of `anygrad train`: the defaults (the founding example's, or a user model's), a
run's config.json (--config FILE, --resume DIR) and the flags given on the command line, merged
in that order. Apart from the train command because `info` plans with the same defaults, and the
option help quotes them."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# Settings the founding example was trained with; the defaults when no MODEL is given.
FOUNDING_DEFAULTS = {"optimizer": "adagrad", "lr": 1.0, "batch_size": 1000, "epochs": 8, "loss": "nll"}

# Defaults for a user's own model: a safe optimizer; the loss follows the model's output.
MODEL_DEFAULTS = {"optimizer": "adam", "lr": 1e-3, "batch_size": 64, "epochs": 1, "loss": "auto"}

# Flags of `anygrad train` -> TrainConfig fields (the rest have the same name). Defaults live in
# TRAIN_DEFAULTS, not in argparse, so a flag given on the command line can be told from a default
# and overrides a --config file or is checked against a --resume run.
_FLAG_FIELDS = {"artifacts": "artifacts_dir"}
TRAIN_DEFAULTS = {"dataset": "mnist", "device": "auto", "seed": 0, "init": "onnx", "drop_last": False,
                  "log_every": 0}


def _given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig settings the command line states explicitly."""
    from ..train import TrainConfig
    names = set(TrainConfig.__dataclass_fields__)
    out = {}
    for key, value in vars(args).items():
        field_name = _FLAG_FIELDS.get(key, key)
        if value is not None and field_name in names:
            out[field_name] = value
    if args.scheduler_opt:
        out["scheduler_options"] = _scheduler_options(args.scheduler_opt)
    if args.augment is not None:
        out.update(_parse_augment(args.augment))
    if args.npz_keys is not None:
        keys = [k.strip() for k in args.npz_keys.split(",")]
        if len(keys) != 2 or not all(keys):
            raise ConfigError(f"--npz-keys takes the input and target array names, e.g. images,labels; got "
                              f"{args.npz_keys!r}")
        out["x_key"], out["y_key"] = keys
    return out


def _scheduler_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--scheduler-opt takes KEY=VALUE (e.g. T_max=10), got {pair!r}")
        options[key.strip()] = value.strip()
    return options


def _read_config(path: Path) -> dict[str, Any]:
    import json

    from ..torchfile.safe_io import read_regular
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    try:  # a regular file only: --config on a FIFO must not block
        record = json.loads(bytes(read_regular(path, ConfigError, limit=16 << 20)).decode())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: cannot read the config ({e})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path}: a config file holds one JSON object of settings")
    return record


def _file_settings(path: Path) -> dict[str, Any]:
    """The settings a config.json states (checked and converted to their types); the ones it
    leaves out get the same defaults as on the command line."""
    from ..train import TrainConfig
    record = _read_config(path)
    config = TrainConfig.from_dict(record, str(path))
    try:  # values out of range too, while the file is still the one to name
        config.check()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return {k: getattr(config, k) for k in record if k in TrainConfig.__dataclass_fields__}


def _run_config(run: Path) -> Path:
    """`run`'s config.json, once it reads as the one an anygrad run wrote (not, say, a Hugging Face
    model's config.json, whose settings would be named as unknown ones)."""
    from ..train.runfolder import is_run_config
    path = run / "config.json"
    _read_config(path)  # unreadable or not one JSON object: said so first
    if not is_run_config(path):
        raise ConfigError(f"{run} is not an anygrad run folder (its config.json is not an anygrad run's); --resume "
                          "takes the --artifacts folder of an earlier `anygrad train`")
    return path


def _train_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Settings from --resume DIR's config.json or --config FILE, then the command line's flags,
    then the defaults (the founding ones when no model is named) for whatever is still unset."""
    given = _given_settings(args)
    settings: dict[str, Any] = {}
    if args.resume:
        run = Path(args.resume)
        if not run.is_dir():
            raise ConfigError(f"--resume {run}: " + ("no such folder" if not os.path.lexists(run) else
                              "a file, not a folder") + "; --resume takes the --artifacts folder of an earlier "
                              "`anygrad train`")
        if not (run / "config.json").is_file():
            raise ConfigError(f"{run}: not a training run folder (no config.json); --resume takes the "
                              "--artifacts folder of an earlier `anygrad train`")
        settings = _file_settings(_run_config(run))
        settings["artifacts_dir"] = str(run)
        given.pop("artifacts_dir", None)
    elif args.config:
        settings = _file_settings(Path(args.config))
        settings["artifacts_dir"] = None  # a rerun writes a new folder unless --artifacts says otherwise
    settings.update(given)
    if not settings.get("model"):
        from ..examples import FOUNDING_MODEL
        settings["model"] = str(Path(FOUNDING_MODEL))
    for key, value in {**TRAIN_DEFAULTS, **model_defaults(settings["model"])}.items():
        if settings.get(key) in (None, ""):
            settings[key] = value
    return settings


def model_defaults(model: str | os.PathLike) -> dict[str, Any]:
    """The settings `train` gives `model` unless told otherwise: the founding example's own
    (FOUNDING_DEFAULTS) for that file, MODEL_DEFAULTS for any other. `info` plans with the same."""
    from ..examples import FOUNDING_MODEL
    try:
        founding = Path(model).resolve() == Path(FOUNDING_MODEL).resolve()
    except (OSError, RuntimeError, ValueError):
        founding = False
    return FOUNDING_DEFAULTS if founding else MODEL_DEFAULTS


def _parse_augment(spec: str) -> dict[str, Any]:
    """--augment crop:4,hflip -> {crop_padding: 4, hflip: True}; 'none' turns both off."""
    out: dict[str, Any] = {"crop_padding": 0, "hflip": False}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition(":")
        if name == "none" and not value:
            continue
        if name == "hflip" and not value:
            out["hflip"] = True
        elif name == "crop" and value.isdigit():
            out["crop_padding"] = int(value)
        else:
            raise ConfigError(f"--augment takes a comma-separated list of crop:PADDING (random crop after zero "
                              f"padding) and hflip (random horizontal flip), or none; got {item!r}")
    return out
