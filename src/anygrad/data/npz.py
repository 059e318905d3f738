"""A dataset in one .npz file: arrays under configurable keys, read without pickle, with bounds
(torchfile's npz reader: a deflate bomb or a corrupt archive is a DataError naming the file)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..torchfile.npzfile import read_npz_arrays


def read_npz(path: str | Path, x_key: str = "x", y_key: str = "y", x_valid_key: str = "x_valid",
             y_valid_key: str = "y_valid") -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """(train, valid or None). Validation arrays are used when both of their keys are present;
    one of them alone is a DataError."""
    path = Path(path).expanduser()
    if not os.path.lexists(path):  # (False, not an exception, for a name too long or with a NUL)
        raise DataError(f"{path}: no such .npz file")
    if os.path.isdir(path):
        raise DataError(f"{path} is a directory; the npz dataset is one .npz file (--data-dir FILE.npz)")
    arrays = read_npz_arrays(path, DataError)
    missing = [k for k in (x_key, y_key) if k not in arrays]
    if missing:
        raise DataError(f"{path} has no array {' or '.join(repr(k) for k in missing)} (it holds "
                        f"{', '.join(sorted(arrays)) or 'nothing'}); choose the keys with x_key=/y_key= "
                        f"(--npz-keys X,Y)")

    def pair(xk: str, yk: str) -> tuple[np.ndarray, np.ndarray]:
        x, y = arrays[xk], arrays[yk]
        if len(x) != len(y):
            raise DataError(f"{path}: '{xk}' holds {len(x)} samples but '{yk}' holds {len(y)}")
        return x, (y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y)

    half = [k for k in (x_valid_key, y_valid_key) if k in arrays]
    if len(half) == 1:  # half a validation split is a mistake, not a reason to hold out 10% instead
        other = y_valid_key if half[0] == x_valid_key else x_valid_key
        raise DataError(f"{path} has the validation array '{half[0]}' but no '{other}': add it, or remove "
                        f"'{half[0]}' for a held-out part of the training data")
    valid = pair(x_valid_key, y_valid_key) if half else None
    return pair(x_key, y_key), valid
