"""`anygrad train` (and `train --resume`): the settings checked before any slow work, then one
run of train.run, its epoch lines and progress on the console, and its exit code (diverged,
interrupted). How the settings are merged is config.py's."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, ModelError
from .common import EXIT_DIVERGED, EXIT_INTERRUPTED, _not_a_folder, _short
from .config import _given_settings, _read_config, _train_settings


class Console:
    """Epoch lines on stdout; progress on stderr, redrawn in place on a terminal."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.pending = False

    def line(self, text: str) -> None:
        self._clear()
        print(text, flush=True)

    def progress(self, text: str) -> None:
        if self.quiet:
            return
        if self.tty:
            print(f"\r{text}\x1b[K", end="", file=sys.stderr, flush=True)
            self.pending = True
        else:
            print(text, file=sys.stderr, flush=True)

    def _clear(self) -> None:
        if self.pending:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
            self.pending = False


def _reporter(quiet: bool, every: int, console: Console) -> Any:
    """The UX reporter (live dashboard on a terminal, plain lines otherwise) when present."""
    try:
        from ..train.dashboard import make_reporter
    except ImportError:
        from ..train import LineReporter
        return LineReporter(console.line, console.progress)
    return make_reporter(quiet=quiet, every=every)


# Paths a run records: stored absolute (a later `predict` or `eval` may run from another folder),
# and as typed under config.json's resolved.paths_as_typed, for messages.
_PATH_SETTINGS = ("model", "weights", "data_dir", "artifacts_dir")


def cmd_train(args: argparse.Namespace) -> int:
    """Parse the settings into a RunConfig and run it (train.run.run: the folder, the process group
    of a torchrun job, rank 0's output and an elastic restart's resume are the run's own)."""
    from ..losses import get_loss
    from ..optim import get_optimizer
    from ..train import TrainConfig
    from ..train.run import RunConfig, run

    s = _train_settings(args)
    given = set(_given_settings(args)) | (set(_read_config(Path(args.resume) / "config.json")) if args.resume else
                                          set(_read_config(Path(args.config))) if args.config else set())
    _not_a_folder(Path(s["model"]), "an ONNX model file")
    _check_dataset(s["dataset"])
    if s["loss"] != "auto":
        get_loss(s["loss"])  # fail on a bad name before any slow work
    _check_finite(s)
    get_optimizer(s["optimizer"], lr=s["lr"])
    typed = {k: str(s[k]) for k in _PATH_SETTINGS if s.get(k)}
    config = TrainConfig.from_dict({**s, **{k: _absolute(v) for k, v in typed.items()}})
    config.check()
    if config.scheduler:  # bad names and types fail now; values against the run when the Learner builds it
        from ..optim.schedulers import check_options
        check_options(config.scheduler, config.scheduler_options)
    if config.weights:  # its content is checked when the model loads it (torchfile names the file's kind)
        weights = _not_a_folder(Path(config.weights), "a weights file")
        if not weights.exists():
            raise ConfigError(f"--weights {typed['weights']}: no such file")
    if not Path(config.model).exists():
        raise ModelError(f"{_short(typed['model'])}: no such model file")
    console = Console(quiet=args.quiet)
    result = run(RunConfig(config, resume=bool(args.resume), overwrite=bool(args.overwrite),
                           reporter=_reporter(args.quiet, config.log_every, console), log=console.line,
                           typed_paths={k: v for k, v in typed.items() if _absolute(v) != v},
                           defaulted=tuple(k for k in ("batch_size",) if k not in given)))
    if result.diverged:
        print(f"anygrad: error: {result.diverged} (--on-nan stop); {_after_divergence(result.artifacts_dir)}",
              file=sys.stderr)
        return EXIT_DIVERGED
    return EXIT_INTERRUPTED if result.interrupted else 0


def _after_divergence(folder: Path | None) -> str:
    """How to go on after a diverged run: what its folder holds (a checkpoint or none) decides."""
    from ..train import checkpoint as ckpt
    last = ckpt.latest(folder / "checkpoints") if folder is not None else None
    again = "start again with a smaller --lr (or --clip-grad-norm)" + (
        f" and --overwrite to reuse {folder} (or another --artifacts)" if folder is not None else "")
    if last is None:
        return f"no checkpoint was written before it; {again}, or use --on-nan skip"
    return (f"the newest checkpoint {last} holds the last finite state; {again}, or go on from that checkpoint "
            f"with --resume {folder} --on-nan skip")


def _check_dataset(name: str) -> None:
    from ..data import dataset_names
    from ..data.datasets import canonical_name
    if canonical_name(name) not in dataset_names() and name != "tokens":
        raise ConfigError(f"unknown dataset '{name}'; choose one of {', '.join(dataset_names() + ['tokens'])}")


# Number settings that must be finite: 'nan' and 'inf' parse as floats, but are not numbers to train with.
_FINITE_SETTINGS = ("lr", "clip_grad_norm", "min_delta", "valid_fraction")


def _check_finite(settings: dict[str, Any]) -> None:
    for name in _FINITE_SETTINGS:
        value = settings.get(name)
        if isinstance(value, float) and not np.isfinite(value):
            raise ConfigError(f"--{name.replace('_', '-')} {value}: not a number; give a finite value")


def _absolute(path: str) -> str:
    """`path` made absolute without resolving links (what the user named stays recognisable)."""
    return os.path.abspath(os.path.expanduser(path))
