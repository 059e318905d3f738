"""CPU fast paths of the numpy backend: kernels that compute exactly what an op's registry kernel
computes (anygrad.ops keeps the plain reference), only faster on this machine's numpy."""
from __future__ import annotations

import numpy as np

_ZEROS_ROW = 1 << 12
_zeros: dict[np.dtype, np.ndarray] = {}


def maximum0(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """np.maximum(x, 0, out=out), the same values, faster: numpy 2.4's loop for an array and a
    scalar is not vectorised, its loop for two contiguous arrays is (11.6M float32: 6.5 ms
    against 1.5 ms on one core of the 2-vCPU AMD EPYC), so contiguous floats meet rows of zeros."""
    if (x.dtype.kind != "f" or x.size < _ZEROS_ROW or not x.flags.c_contiguous
            or (out is not None and (out.dtype != x.dtype or not out.flags.c_contiguous))):
        return np.maximum(x, 0, out=out)
    if out is None:
        out = np.empty_like(x)
    zeros = _zeros.get(x.dtype)
    if zeros is None:
        zeros = _zeros[x.dtype] = np.zeros(_ZEROS_ROW, x.dtype)
    src, dst = x.reshape(-1), out.reshape(-1)
    bulk = src.size - src.size % _ZEROS_ROW
    np.maximum(src[:bulk].reshape(-1, _ZEROS_ROW), zeros, out=dst[:bulk].reshape(-1, _ZEROS_ROW))
    np.maximum(src[bulk:], zeros[:src.size - bulk], out=dst[bulk:])
    return out
