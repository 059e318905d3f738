"""Adadelta (torch.optim.Adadelta): lr multiplies the adaptive step (default 1.0)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import ElementwiseOptimizer, defupdate


def _slots(attrs: dict) -> list[str]:
    return ["square_avg", "acc_delta"]


def _adadelta(h: dict, p, g, s: dict, lr: float, step: float):
    rho, eps = h["rho"], h["eps"]
    g = -g if h["maximize"] else g
    if h["weight_decay"]:
        g = g + h["weight_decay"] * p
    square_avg = s["square_avg"] * rho + (1 - rho) * g * g
    std = np.sqrt(square_avg + eps)
    delta = np.sqrt(s["acc_delta"] + eps) / std * g
    acc_delta = s["acc_delta"] * rho + (1 - rho) * delta * delta
    return p - lr * delta, {"square_avg": square_avg, "acc_delta": acc_delta}


defupdate("AdadeltaUpdate", _slots, _adadelta)


@dataclass
class Adadelta(ElementwiseOptimizer):
    lr: float = 1.0
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0
    maximize: bool = False

    name = "adadelta"
    op = "AdadeltaUpdate"
    slots_of = staticmethod(_slots)

    def __post_init__(self) -> None:
        self._check(lr=(0.0, None), rho=(0.0, 1.0 + 1e-12), eps=(0.0, None), weight_decay=(0.0, None))
