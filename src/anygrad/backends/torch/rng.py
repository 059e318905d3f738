"""anygrad's counter-based RNG (anygrad/rng.py) with torch tensor operations, on the device.

Same function of (seed, step, salt, element index), so dropout masks are identical to those of
the numpy and wgpu backends. torch has no full uint32 arithmetic, so 32-bit words are held in
int64. A product (x * m) mod 2^32 is formed as x * m' with m' = m or m - 2^32, whichever lies in
(-2^31, 2^31): m' = m (mod 2^32), and |x * m'| < 2^63 for x < 2^32, so the product is exact in
int64 and its low 32 bits (two's complement: `& 0xFFFFFFFF`) are those of x * m. Two ops per
multiply: every op is a kernel launch on a GPU, and the key alone chains three hashes.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ... import rng as host_rng
from ...rng import GOLDEN

_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # rng.mix32's multipliers (tests compare the draws)


def _signed32(m: int) -> int:
    """The representative of m mod 2^32 in (-2^31, 2^31]."""
    return m - (1 << 32) if m >= 1 << 31 else m


def _mul32(x: Any, m: int) -> Any:
    """(x * m) mod 2^32 for int64 x in [0, 2^32): exact, see the module's docstring."""
    return (x * _signed32(m)) & _MASK


def mix32(x: Any) -> Any:
    """The lowbias32 hash of rng.mix32, over an int64 tensor of 32-bit words."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def key(state: Any, salt: int) -> Any:
    """rng.key(seed, step, salt) from the RNG state tensor [seed, step] (int64), as a 0-d tensor."""
    k = mix32((state[0] & _MASK) ^ GOLDEN)
    k = mix32(k ^ (state[1] & _MASK))
    return mix32(k ^ (salt & _MASK))


def host_key(state: Any, salt: int) -> np.ndarray:
    """rng.key for the RNG state [seed, step] held on the host (a uint32 array): a 0-d int64
    array, for a kernel to upload instead of chaining three hashes on the device, ~30 launches."""
    seed, step = (int(v) for v in np.asarray(state).reshape(-1)[:2])
    return np.array(int(host_rng.key(seed, step, salt)), np.int64)


def uniform_bits(state: Any, salt: int, n: int, device: Any) -> Any:
    """The 32-bit words (int64) behind rng.uniform's n draws: draw k is (bits[k] >> 8) * 2^-24.
    `state`: the RNG state [seed, step] as a tensor, or its key (a 0-d tensor, host_key's)."""
    import torch
    idx = torch.arange(n, dtype=torch.int64, device=device)
    k = state if state.dim() == 0 else key(state.reshape(-1).to(torch.int64), salt)
    return mix32(idx ^ k)


def uniform(state: Any, salt: int, n: int, device: Any) -> Any:
    """rng.uniform's n float32 draws in [0, 1) for the step the state names."""
    import torch
    return (uniform_bits(state, salt, n, device) >> 8).to(torch.float32) * (1.0 / (1 << 24))


def at_least(threshold: float) -> int:
    """The least word w such that draw(w) = (w >> 8) * 2^-24 >= threshold (a float32 value): a
    draw is compared as an integer, exactly (both sides are exact multiples of 2^-24, 2^-149)."""
    v = math.ceil(float(threshold) * (1 << 24))  # draws are v * 2^-24 for integers v < 2^24
    return max(v, 0) << 8
