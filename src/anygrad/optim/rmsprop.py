"""RMSprop, optionally centered and with momentum (torch.optim.RMSprop)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import ElementwiseOptimizer, defupdate, lerp


def _slots(attrs: dict) -> list[str]:
    return (["square_avg"] + (["momentum_buffer"] if attrs["momentum"] > 0 else [])
            + (["grad_avg"] if attrs["centered"] else []))


def _rmsprop(h: dict, p, g, s: dict, lr: float, step: float):
    alpha = h["alpha"]
    g = -g if h["maximize"] else g
    if h["weight_decay"]:
        g = g + h["weight_decay"] * p
    square_avg = s["square_avg"] * alpha + (1 - alpha) * g * g
    out = {"square_avg": square_avg}
    if h["centered"]:
        grad_avg = out["grad_avg"] = lerp(s["grad_avg"], g, 1 - alpha)
        avg = np.sqrt(square_avg - grad_avg * grad_avg)
    else:
        avg = np.sqrt(square_avg)
    avg = avg + h["eps"]
    if h["momentum"] > 0:
        buf = out["momentum_buffer"] = s["momentum_buffer"] * h["momentum"] + g / avg
        return p - lr * buf, out
    return p - lr * g / avg, out


defupdate("RMSpropUpdate", _slots, _rmsprop)


@dataclass
class RMSprop(ElementwiseOptimizer):
    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    maximize: bool = False

    name = "rmsprop"
    op = "RMSpropUpdate"
    slots_of = staticmethod(_slots)

    def __post_init__(self) -> None:
        self._check(lr=(0.0, None), alpha=(0.0, None), eps=(0.0, None), weight_decay=(0.0, None),
                    momentum=(0.0, None))
