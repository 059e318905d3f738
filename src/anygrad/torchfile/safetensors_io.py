"""safetensors files through the `safetensors` package's numpy API (an optional dependency).

numpy has no bfloat16 or float8, so those entries (which the package cannot hand to numpy) are read
from the file's own layout -- an 8-byte header length, a JSON header, raw little-endian data -- and
widened to float32, like the .pt reader does.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AnygradError, ModelError
from ..fsutil import atomic_write
from .safe_io import check_regular
from .tensors import WIDEN

# safetensors dtype -> (raw numpy dtype of its bits, torch dtype name in WIDEN)
_WIDENED = {"BF16": ("<u2", "bfloat16"), "F8_E4M3": ("u1", "float8_e4m3fn"), "F8_E5M2": ("u1", "float8_e5m2")}


def _package() -> Any:
    try:
        import safetensors.numpy
    except ImportError:
        raise AnygradError("reading and writing .safetensors files needs the safetensors package: "
                           "pip install safetensors") from None
    return safetensors


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header and the file offset where the data starts."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > os.path.getsize(path):
            raise ValueError(f"header length {size} exceeds the file")
        return json.loads(f.read(size)), 8 + size


def _widened(path: Path, info: dict[str, Any], data_start: int) -> np.ndarray:
    raw_dtype, name = _WIDENED[info["dtype"]]
    start, stop = info["data_offsets"]
    shape = tuple(info["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if stop - start != count * np.dtype(raw_dtype).itemsize:
        raise ValueError(f"{info['dtype']} tensor of shape {shape} does not fill bytes {start}..{stop}")
    with open(path, "rb") as f:
        f.seek(data_start + start)
        bits = np.frombuffer(f.read(stop - start), dtype=raw_dtype, count=count)
    return WIDEN[name](bits.reshape(shape))


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read every tensor of a .safetensors file as numpy (BF16 and F8 widened to float32)."""
    st = _package()
    path = Path(path)
    check_regular(path)  # a FIFO or a device would block or never end
    try:
        header, data_start = _header(path)
        widen = {k for k, v in header.items() if k != "__metadata__" and v.get("dtype") in _WIDENED}
        out: dict[str, np.ndarray] = {}
        with st.safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                out[name] = _widened(path, header[name], data_start) if name in widen else f.get_tensor(name)
        return out
    except AnygradError:
        raise
    except Exception as e:
        raise ModelError(f"{path}: cannot read safetensors file ({type(e).__name__}: {e})") from e


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` to `path` atomically (a temp file in the same folder, then a rename)."""
    st = _package()
    path = Path(path)
    bad = [k for k, v in tensors.items() if not isinstance(k, str) or not isinstance(v, np.ndarray)]
    if bad:
        raise AnygradError(f"{path}: save_safetensors needs str names and numpy arrays; not so for {bad[:5]}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise AnygradError(f"{path}: safetensors metadata must map str to str")
    arrays = {k: np.ascontiguousarray(v).reshape(v.shape) for k, v in tensors.items()}  # keeps 0-d arrays 0-d
    try:  # to bytes, then atomic_write: safetensors' own save_file creates its files 0600
        data = st.numpy.save(arrays, metadata=dict(metadata) if metadata is not None else None)
        atomic_write(path, data)
    except Exception as e:
        raise AnygradError(f"{path}: cannot write safetensors file ({type(e).__name__}: {e})") from e
