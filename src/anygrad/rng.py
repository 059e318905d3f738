"""The counter-based random number generator every backend shares.

A random draw is a pure function of (seed, step, salt, element index): no hidden state, so the
numpy and wgpu backends produce identical dropout masks and a run is reproducible from its seed,
also after a resume. Only 32-bit integer multiply, xor and shift are used, which WGSL has.
The mixer is Chris Wellons' "lowbias32" integer hash.
"""
from __future__ import annotations

import numpy as np

_M1 = np.uint32(0x7FEB352D)
_M2 = np.uint32(0x846CA68B)
GOLDEN = 0x9E3779B9


def mix32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * _M1
        x = x ^ (x >> np.uint32(15))
        x = x * _M2
        x = x ^ (x >> np.uint32(16))
    return x


def key(seed: int, step: int, salt: int) -> np.uint32:
    """Fold (seed, step, salt) into one 32-bit key; the element index is mixed in per element."""
    with np.errstate(over="ignore"):
        k = mix32(np.uint32(seed & 0xFFFFFFFF) ^ np.uint32(GOLDEN))
        k = mix32(k ^ np.uint32(step & 0xFFFFFFFF))
        k = mix32(k ^ np.uint32(salt & 0xFFFFFFFF))
    return np.uint32(k)


def uniform(seed: int, step: int, salt: int, n: int) -> np.ndarray:
    """n float32 draws in [0, 1): 24 random bits each, exactly representable."""
    idx = np.arange(n, dtype=np.uint32)
    bits = mix32(idx ^ key(seed, step, salt))
    return (bits >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / (1 << 24))
