"""The name table: SCHEDULERS (CLI/config name -> class), the other spellings accepted for each,
check_options (an option set checked against a class before anything is built) and
get_scheduler. Separate because it is the one module that knows every schedule.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from ...coerce import convert
from ...errors import ConfigError
from .base import _BASE, RunFacts, Scheduler, _option_error
from .composite import ChainedScheduler, SequentialLR
from .epoch import CosineAnnealingWarmRestarts, CosineLR, ExponentialLR, LinearLR, MultiStepLR, StepLR
from .lambdas import LambdaLR, MultiplicativeLR
from .onecycle import OneCycleLR
from .plateau import ReduceLROnPlateau

SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (StepLR, MultiStepLR, ExponentialLR, CosineLR, LinearLR, OneCycleLR,
                              ReduceLROnPlateau, CosineAnnealingWarmRestarts, LambdaLR, MultiplicativeLR,
                              SequentialLR, ChainedScheduler)
}

# Other spellings people use (compared after dropping '-', '_' and spaces, lower-cased).
_ALIASES: dict[str, str] = {
    "steplr": "step", "multisteplr": "multistep", "exp": "exponential", "exponentiallr": "exponential",
    "cosineannealing": "cosine", "cosineannealinglr": "cosine", "linearlr": "linear", "warmup": "linear",
    "linearwarmup": "linear", "onecyclelr": "onecycle", "reduceonplateau": "plateau",
    "reducelronplateau": "plateau", "cosineannealingwarmrestarts": "cosine_restarts",
    "cosinerestarts": "cosine_restarts", "sgdr": "cosine_restarts", "lambdalr": "lambda",
    "multiplicativelr": "multiplicative", "sequentiallr": "sequential", "chainedscheduler": "chained",
}


def _canonical(name: str) -> str:
    key = "".join(c for c in str(name).lower() if c not in "-_ ")
    return _ALIASES.get(key, key)


def check_options(name: str, options: dict[str, Any]) -> type[Scheduler]:
    """The scheduler class for `name`, after checking that it takes each of `options` and that
    each value has the option's type (ranges and run-dependent checks come when it is built)."""
    key = _canonical(name)
    if key not in SCHEDULERS:
        raise ConfigError(f"unknown learning-rate scheduler '{name}'; choose one of {', '.join(SCHEDULERS)}")
    cls = SCHEDULERS[key]
    types = {f.name: str(f.type) for f in fields(cls) if f.name != "base_lr"}
    unknown = sorted(set(options) - set(types))
    if unknown:
        raise ConfigError(f"scheduler '{key}' does not take option(s) {', '.join(unknown)}; "
                          f"its options are {', '.join(sorted(types))}")
    for option, value in options.items():
        convert(option, types[option], value, _option_error(key), _BASE)
    return cls


def get_scheduler(name: str, base_lr: float, *, run: RunFacts | None = None, **options: Any) -> Scheduler:
    """A scheduler by CLI/config name ("step", "multistep", "exponential", "cosine", "linear",
    "onecycle", "plateau") with torch.optim.lr_scheduler's option names. With `run` (what the
    training loop knows), options left unset are taken from the run (plateau's mode from the
    monitored metric, onecycle's length) and a schedule too short for the run is an error now."""
    cls = check_options(name, options)
    if run is not None:
        options = {**cls.run_defaults(run, options), **options}
    scheduler = cls(base_lr, **options)
    if run is not None:
        scheduler.check_run(run)
    return scheduler
