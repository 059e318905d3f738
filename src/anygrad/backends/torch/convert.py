"""numpy <-> torch: which dtypes torch holds, and moving values between host and device.

torch has no (or only partial) support for unsigned integers wider than 8 bits, so values of
those dtypes stay numpy arrays on the host; nodes that touch them run on the numpy reference
kernels. A lowered kernel that gets such a value anyway (the RNG state, uint32) sees it as
int64, which holds every uint32 exactly.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# numpy dtypes a torch tensor holds with the same values and arithmetic
TORCH_DTYPES = frozenset(np.dtype(d) for d in (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64,
                                               np.float16, np.float32, np.float64))
# dtypes torch lacks whose values int64 holds exactly: a kernel may read them as int64
WIDENED = frozenset(np.dtype(d) for d in (np.uint16, np.uint32))


_TORCH_DTYPES: dict[np.dtype, Any] = {}


def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of a numpy dtype in TORCH_DTYPES (the table is built on first use: torch
    is imported only when a torch device is used)."""
    if not _TORCH_DTYPES:
        import torch
        _TORCH_DTYPES.update({
            np.dtype(np.bool_): torch.bool, np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8,
            np.dtype(np.int16): torch.int16, np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
            np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
            np.dtype(np.float64): torch.float64})
    return _TORCH_DTYPES[np.dtype(dtype)]


def is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "device")


def to_torch(value: Any, device: Any) -> Any:
    """A host array (or a tensor already) as a tensor on `device`."""
    if value is None or is_tensor(value):
        return value
    import torch
    arr = np.asarray(value)
    if arr.dtype not in TORCH_DTYPES:
        if arr.dtype not in WIDENED:
            raise TypeError(f"torch holds no {arr.dtype} values")  # lower() keeps them on the host
        arr = arr.astype(np.int64)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        arr = np.array(arr)  # from_numpy shares memory: never share a read-only or strided array
    return torch.from_numpy(arr).to(device)


def to_numpy(value: Any, dtype: np.dtype | None = None) -> Any:
    """A tensor (or an array already) as a host numpy array, of `dtype` when given."""
    if value is None:
        return None
    if is_tensor(value):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    return arr if dtype is None or arr.dtype == dtype else arr.astype(dtype)
