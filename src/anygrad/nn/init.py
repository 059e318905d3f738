"""PyTorch's default initialisation, drawn from a seeded numpy Generator.

Layers draw from the module-wide generator (`manual_seed` resets it) when they are built;
`Module.init_parameters(seed)` redraws a whole model from a fresh one. Values are drawn in
double and stored as float32. Functions follow torch.nn.init (`kaiming_uniform_`, ...), but
take the generator as an argument instead of a global torch RNG.
"""

from __future__ import annotations

import math

import numpy as np

_GENERATOR = np.random.default_rng(0)


def manual_seed(seed: int) -> np.random.Generator:
    """Reseed the generator new layers draw their initial values from."""
    global _GENERATOR
    _GENERATOR = np.random.default_rng(seed)
    return _GENERATOR


def generator() -> np.random.Generator:
    return _GENERATOR


def fan_in(shape: tuple[int, ...]) -> int:
    """PyTorch's fan_in: dim 1 times the receptive field (Linear [out, in], Conv [out, in/g, k...])."""
    return int(shape[1] * math.prod(shape[2:])) if len(shape) > 1 else int(shape[0])


def _set(param, values: np.ndarray) -> None:
    param.data = np.asarray(values).astype(param.data.dtype)


def uniform_(param, low: float, high: float, rng: np.random.Generator | None = None):
    _set(param, (rng or _GENERATOR).uniform(low, high, param.data.shape))
    return param


def normal_(param, mean: float = 0.0, std: float = 1.0, rng: np.random.Generator | None = None):
    _set(param, (rng or _GENERATOR).normal(mean, std, param.data.shape))
    return param


def zeros_(param, rng=None):
    _set(param, np.zeros(param.data.shape))
    return param


def ones_(param, rng=None):
    _set(param, np.ones(param.data.shape))
    return param


def kaiming_uniform_(param, a: float = math.sqrt(5), rng: np.random.Generator | None = None):
    """U(-b, b), b = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2)) (leaky_relu gain).

    With PyTorch's default a = sqrt(5) for Linear and Conv weights this is b = 1 / sqrt(fan_in)."""
    n = fan_in(param.data.shape)
    bound = math.sqrt(2.0 / (1.0 + a * a)) * math.sqrt(3.0 / n) if n else 0.0
    return uniform_(param, -bound, bound, rng)


def bias_uniform_(param, weight_fan_in: int, rng: np.random.Generator | None = None):
    """Linear/Conv bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with the weight's fan_in."""
    bound = 1.0 / math.sqrt(weight_fan_in) if weight_fan_in else 0.0
    return uniform_(param, -bound, bound, rng)
