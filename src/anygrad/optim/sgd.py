"""SGD with momentum, dampening, Nesterov, weight decay (torch.optim.SGD)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import ElementwiseOptimizer, defupdate


def _slots(attrs: dict) -> list[str]:
    return ["momentum_buffer"] if attrs["momentum"] else []


def _sgd(h: dict, p, g, s: dict, lr: float, step: float):
    g = -g if h["maximize"] else g
    if h["weight_decay"]:
        g = g + h["weight_decay"] * p
    out = {}
    if h["momentum"]:
        # PyTorch starts the buffer as the raw gradient (no dampening on the first step).
        buf = g.copy() if step == 1 else s["momentum_buffer"] * h["momentum"] + (1 - h["dampening"]) * g
        out["momentum_buffer"] = buf
        g = g + h["momentum"] * buf if h["nesterov"] else buf
    return p - lr * g, out


defupdate("SGDUpdate", _slots, _sgd)


@dataclass
class SGD(ElementwiseOptimizer):
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    name = "sgd"
    op = "SGDUpdate"
    slots_of = staticmethod(_slots)

    def __post_init__(self) -> None:
        self._check(lr=(0.0, None), momentum=(0.0, None), weight_decay=(0.0, None))
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            from ..errors import ConfigError
            raise ConfigError("sgd: nesterov needs momentum > 0 and dampening = 0")
