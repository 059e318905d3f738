"""Adam and AdamW, with AMSGrad (torch.optim.Adam / AdamW)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import ElementwiseOptimizer, defupdate, lerp


def _slots(attrs: dict) -> list[str]:
    return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if attrs["amsgrad"] else [])


def _adam(h: dict, p, g, s: dict, lr: float, step: float):
    beta1, beta2 = h["betas"]
    g = -g if h["maximize"] else g
    if h["weight_decay"]:
        if h["decoupled"]:  # AdamW
            p = p * (1 - lr * h["weight_decay"])
        else:
            g = g + h["weight_decay"] * p
    exp_avg = lerp(s["exp_avg"], g, 1 - beta1)
    exp_avg_sq = s["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
    out = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    second = exp_avg_sq
    if h["amsgrad"]:
        second = out["max_exp_avg_sq"] = np.maximum(s["max_exp_avg_sq"], exp_avg_sq)
    denom = np.sqrt(second) / bias_correction2_sqrt + h["eps"]
    return p - step_size * exp_avg / denom, out  # addcdiv: (c * a) / b


defupdate("AdamUpdate", _slots, _adam)


@dataclass
class Adam(ElementwiseOptimizer):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False

    name = "adam"
    op = "AdamUpdate"
    slots_of = staticmethod(_slots)
    decoupled = False

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        self._check(lr=(0.0, None), eps=(0.0, None), weight_decay=(0.0, None))
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                from ..errors import ConfigError
                raise ConfigError(f"{self.name}: betas[{i}] must be in [0, 1), got {beta}")

    def attrs(self) -> dict:
        return {**super().attrs(), "betas": list(self.betas), "decoupled": int(self.decoupled)}


@dataclass
class AdamW(Adam):
    """Adam with decoupled weight decay: p *= 1 - lr * weight_decay before the Adam step."""

    weight_decay: float = 1e-2

    name = "adamw"
    decoupled = True
