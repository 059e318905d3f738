"""Optimizers with PyTorch's exact update rules and defaults; each update is one registry op."""
from __future__ import annotations

from ..errors import ConfigError
from .adadelta import Adadelta
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .base import STEP_STATE, ElementwiseOptimizer, Optimizer
from .from_torch import from_torch
from .groups import LR_STATE, ParamGroup, no_decay
from .rmsprop import RMSprop
from .schedulers import SCHEDULERS, GroupSchedule, Scheduler, get_scheduler
from .sgd import SGD

AdaGrad = Adagrad  # the spelling of the founding example's write-up; torch.optim's is Adagrad

OPTIMIZERS: dict[str, type[Optimizer]] = {
    "sgd": SGD, "adam": Adam, "adamw": AdamW, "adagrad": Adagrad, "adadelta": Adadelta, "rmsprop": RMSprop,
}


def get_optimizer(name: str, **kwargs) -> Optimizer:
    """An optimizer by CLI name ("sgd", "adam", ...) with torch.optim's keyword arguments."""
    key = name.strip().lower()
    if key not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer '{name}'; choose one of {', '.join(OPTIMIZERS)}")
    try:
        return OPTIMIZERS[key](**kwargs)
    except TypeError as e:  # an option this optimizer does not take
        raise ConfigError(f"optimizer '{key}' does not accept options {sorted(kwargs)}: {e}") from e


__all__ = [
    "LR_STATE",
    "OPTIMIZERS",
    "SCHEDULERS",
    "SGD",
    "STEP_STATE",
    "AdaGrad",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "ElementwiseOptimizer",
    "GroupSchedule",
    "Optimizer",
    "ParamGroup",
    "RMSprop",
    "Scheduler",
    "from_torch",
    "get_optimizer",
    "get_scheduler",
    "no_decay",
]
