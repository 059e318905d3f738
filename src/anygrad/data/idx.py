"""IDX files (the MNIST container format): a 4-byte magic, big-endian uint32 dims, raw data.

Gzip-compressed files are recognised by their content, not their name. The dims in the header are
the truth: a file with fewer or more bytes than they promise is reported as corrupt.
"""
from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from ..errors import DataError

# The third magic byte names the element type; multi-byte types are big-endian.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
GZIP_MAGIC = b"\x1f\x8b"

# What a message about a damaged file tells the user to do. A file in the user's own folder
# (data_dir) is theirs: replace it, never "delete it". Only a file anygrad downloaded into its cache
# may be deleted, to be downloaded again.
USERS_FILE = "replace it with a complete copy"
CACHED_FILE = "delete it and anygrad downloads it again on the next run"


def _read_bytes(path: Path, remedy: str = USERS_FILE) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    if raw[:2] != GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path} is truncated or corrupt: not a valid gzip file ({e}); {remedy}") from None


def parse_idx(data: bytes, source: str = "<bytes>", remedy: str = USERS_FILE) -> np.ndarray:
    """Decode IDX bytes; `source` names the file in error messages, `remedy` says what to do
    about a damaged one."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{source} is not an IDX file (bad magic {data[:4].hex() or 'empty'})")
    code, ndim = data[2], data[3]
    if code not in IDX_DTYPES:
        raise DataError(f"{source}: unknown IDX element type 0x{code:02x}")
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise DataError(f"{source}: IDX header truncated or has no dimensions")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    got = len(data) - header
    if got != expected:
        raise DataError(f"{source}: header says {'x'.join(map(str, dims))} ({expected} data bytes) "
                        f"but the file holds {got}; the file is truncated or corrupt: {remedy}")
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return array.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: str | Path, remedy: str = USERS_FILE) -> np.ndarray:
    """Read an IDX file (raw or gzip) into a native-endian numpy array. `remedy`: what a message
    about a damaged file says to do (CACHED_FILE for a file in anygrad's download cache)."""
    path = Path(path)
    return parse_idx(_read_bytes(path, remedy), str(path), remedy)


def write_idx(path: str | Path, array: np.ndarray, compress: bool | None = None) -> Path:
    """Write an IDX file (gzip when `compress`, default: when the name ends in .gz). For tests and tools."""
    path = Path(path)
    array = np.asarray(array)
    codes = {dt.newbyteorder("="): c for c, dt in IDX_DTYPES.items()}
    native = array.dtype.newbyteorder("=")
    if native not in codes:
        raise DataError(f"cannot store dtype {array.dtype} in an IDX file")
    code = codes[native]
    body = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    body += array.astype(IDX_DTYPES[code], copy=False).tobytes()
    if compress if compress is not None else path.suffix == ".gz":
        body = gzip.compress(body, mtime=0)
    path.write_bytes(body)
    return path
