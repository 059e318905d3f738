"""A dataset in one .npz file: arrays under configurable keys, read without pickle."""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from ..errors import DataError


def read_npz(path: str | Path, x_key: str = "x", y_key: str = "y", x_valid_key: str = "x_valid",
             y_valid_key: str = "y_valid") -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """(train, valid or None). Validation arrays are used when both of their keys are present."""
    path = Path(path).expanduser()
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except FileNotFoundError:
        raise DataError(f"{path}: no such .npz file") from None
    except IsADirectoryError:
        raise DataError(f"{path} is a directory; the npz dataset is one .npz file (--data-dir FILE.npz)") from None
    except EOFError:  # np.load of an empty file
        raise DataError(f"{path} is empty; the npz dataset is an .npz file written by numpy.savez") from None
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable .npz file of plain arrays ({e})") from None
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

    valid = pair(x_valid_key, y_valid_key) if x_valid_key in arrays and y_valid_key in arrays else None
    return pair(x_key, y_key), valid
