"""Loss functions as Graph builders: (builder, model output, target) -> scalar loss value.

All use mean reduction, as PyTorch's defaults do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import ConfigError
from .ir.builder import Builder


@dataclass(frozen=True)
class Loss:
    name: str
    build: Callable[[Builder, str, str], str]
    target_dtype: type = np.float32
    classification: bool = False  # targets are class indices; accuracy is meaningful
    options: dict = field(default_factory=dict)


LOSSES: dict[str, Callable[..., Loss]] = {}


def get_loss(name: str, **options) -> Loss:
    if name not in LOSSES:
        raise ConfigError(f"unknown loss '{name}'; choose one of {', '.join(sorted(LOSSES))}")
    return LOSSES[name](**options)
