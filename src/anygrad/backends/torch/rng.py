"""anygrad's counter-based RNG (anygrad/rng.py) with torch tensor operations, on the device.

Same function of (seed, step, salt, element index), so dropout masks are identical to those of
the numpy and wgpu backends. torch has no full uint32 arithmetic, so 32-bit words are held in
int64 and every product is formed from 16-bit halves: each partial product stays below 2^48,
exact in int64 (a full 32 x 32-bit product would overflow it).
"""
from __future__ import annotations

from typing import Any

from ...rng import GOLDEN

_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # rng.mix32's multipliers (tests compare the draws)


def _mul32(x: Any, m: int) -> Any:
    """(x * m) mod 2^32 for int64 x in [0, 2^32)."""
    lo, hi = m & 0xFFFF, m >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & _MASK


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


def uniform(state: Any, salt: int, n: int, device: Any) -> Any:
    """rng.uniform's n float32 draws in [0, 1) for the step the state names."""
    import torch
    idx = torch.arange(n, dtype=torch.int64, device=device)
    bits = mix32(idx ^ key(state.to(torch.int64), salt))
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))
