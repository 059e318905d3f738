"""AdaGrad (torch.optim.Adagrad)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import ElementwiseOptimizer, defupdate


def _slots(attrs: dict) -> list[str]:
    return ["sum"]


def _adagrad(h: dict, p, g, s: dict, lr: float, step: float):
    g = -g if h["maximize"] else g
    if h["weight_decay"]:
        g = g + h["weight_decay"] * p
    clr = lr / (1 + (step - 1) * h["lr_decay"])
    total = s["sum"] + g * g
    return p - clr * g / (np.sqrt(total) + h["eps"]), {"sum": total}


defupdate("AdagradUpdate", _slots, _adagrad)


@dataclass
class Adagrad(ElementwiseOptimizer):
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False

    name = "adagrad"
    op = "AdagradUpdate"
    slots_of = staticmethod(_slots)

    def __post_init__(self) -> None:
        self._check(lr=(0.0, None), lr_decay=(0.0, None), weight_decay=(0.0, None),
                    initial_accumulator_value=(0.0, None), eps=(0.0, None))

    def initial_value(self, slot: str) -> float:
        return self.initial_accumulator_value
