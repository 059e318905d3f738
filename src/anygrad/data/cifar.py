"""CIFAR-10 from the official python tarball, read WITHOUT Python's unpickler.

The batches are pickles (protocol 2, written by python 2) of a dict holding a numpy array. They
are decoded with anygrad's restricted pickle machine (`anygrad.torchfile.pickle_reader`), which
resolves only the three numpy globals an ndarray needs, mapped to inert stand-ins here: nothing
the file names is imported or called.
"""
from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from ..torchfile.pickle_reader import Buildable, SafeGlobal, Unpickler
from ..torchfile.tensors import FormatError
from .idx import USERS_FILE
from .remote import RemoteFile, RemoteSet

CIFAR10 = RemoteSet(
    "cifar-10",
    {"archive": RemoteFile("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a",
                           alternatives=("cifar-10-batches-py",))},
    ("https://www.cs.toronto.edu/~kriz/",),
    "CIFAR-10",
)
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
ALLOWED_DTYPES = {"u1": np.uint8, "i1": np.int8, "i2": np.int16, "i4": np.int32, "i8": np.int64,
                  "f4": np.float32, "f8": np.float64}


class _Dtype(Buildable):
    def __init__(self, code: Any, *_: Any):
        code = code.decode("latin-1") if isinstance(code, bytes) else code
        if code not in ALLOWED_DTYPES:
            raise FormatError(f"unsupported array dtype {code!r} in a CIFAR batch")
        self.dtype = np.dtype(ALLOWED_DTYPES[code])

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) > 1 and state[1] == ">":
            self.dtype = self.dtype.newbyteorder(">")


class _Array(Buildable):
    """numpy's pickled ndarray: _reconstruct(ndarray, (0,), b'b') then BUILD (version, shape, dtype,
    fortran, raw bytes)."""

    def __init__(self, *_: Any):
        self.array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], _Dtype)):
            raise FormatError("unexpected ndarray state in a CIFAR batch")
        _, shape, dtype, fortran, raw = state
        if isinstance(raw, str):
            raw = raw.encode("latin-1")  # python-2 str, decoded as latin-1 to keep every byte
        if not isinstance(raw, (bytes, bytearray)) or not all(isinstance(d, int) for d in shape):
            raise FormatError("unexpected ndarray data in a CIFAR batch")
        count = int(np.prod(shape, dtype=np.int64))
        if len(raw) != count * dtype.dtype.itemsize:
            raise FormatError(f"ndarray of shape {shape} holds {len(raw)} bytes; the batch is truncated")
        self.array = np.frombuffer(raw, dtype.dtype).reshape(shape, order="F" if fortran else "C").copy()


ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): SafeGlobal("numpy.core.multiarray._reconstruct",
                                                          lambda cls, *a: _Array()),
    ("numpy._core.multiarray", "_reconstruct"): SafeGlobal("numpy._core.multiarray._reconstruct",
                                                           lambda cls, *a: _Array()),
    ("numpy", "ndarray"): "ndarray",
    ("numpy", "dtype"): SafeGlobal("numpy.dtype", _Dtype),
    # python 3 writes bytes at protocol 2 as _codecs.encode(text, "latin1")
    ("_codecs", "encode"): SafeGlobal("_codecs.encode", lambda text, enc="utf-8": _latin1(text, enc)),
}


def _latin1(text: Any, encoding: Any) -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise FormatError(f"unexpected _codecs.encode({type(text).__name__}, {encoding!r}) in a CIFAR batch")
    return text.encode("latin-1")


def _plain(value: Any) -> Any:
    if isinstance(value, _Array):
        return value.array
    if isinstance(value, dict):
        return {(k.decode("latin-1") if isinstance(k, bytes) else k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def read_batch(data: bytes, source: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch pickle -> uint8 images (N, 3, 32, 32) and int64 labels."""
    try:
        batch = _plain(Unpickler(data, ALLOWED, _no_persistent, encoding="latin-1").load())
    except FormatError as e:
        why = str(e).split(":")[0] if "refused global" in str(e) else str(e)
        raise DataError(f"{source}: not a CIFAR-10 batch ({why}; only numpy arrays, lists and dicts are read)") \
            from None
    if not isinstance(batch, dict) or "data" not in batch or "labels" not in batch:
        raise DataError(f"{source}: not a CIFAR-10 batch (no data/labels entries)")
    x, y = batch["data"], np.asarray(batch["labels"], np.int64)
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32 \
            or len(y) != len(x):
        raise DataError(f"{source}: expected uint8 data of shape (N, 3072) and N labels, found "
                        f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')} and {len(y)} labels")
    if len(y) and (y.min() < 0 or y.max() > 9):
        raise DataError(f"{source}: labels must be 0-9, found {int(y.min())}..{int(y.max())}")
    return x.reshape(-1, 3, 32, 32), y


def _no_persistent(pid: Any) -> Any:
    raise FormatError("persistent ids are not allowed in a CIFAR batch")


def _members(path: Path, remedy: str) -> dict[str, bytes]:
    """Batch name -> bytes, from the tarball or an extracted cifar-10-batches-py folder."""
    wanted = (*TRAIN_BATCHES, TEST_BATCH)
    if path.is_dir():
        missing = [n for n in wanted if not (path / n).is_file()]
        if missing:
            raise DataError(f"{path} lacks the CIFAR-10 batches {', '.join(missing)}")
        return {n: (path / n).read_bytes() for n in wanted}
    out: dict[str, bytes] = {}
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar.getmembers():  # read in memory: nothing is extracted to disk
                name = member.name.rsplit("/", 1)[-1]
                if member.isfile() and name in wanted:
                    out[name] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{path} is truncated or corrupt: not a readable CIFAR-10 tarball ({e}); {remedy}") \
            from None
    missing = [n for n in wanted if n not in out]
    if missing:
        raise DataError(f"{path} lacks the CIFAR-10 batches {', '.join(missing)}")
    return out


def read_cifar10(path: str | Path, remedy: str = USERS_FILE) -> tuple[tuple[np.ndarray, np.ndarray],
                                                                     tuple[np.ndarray, np.ndarray]]:
    """(train, test) as uint8 NCHW images and int64 labels, from the tarball or its extracted folder.
    `remedy`: what a damaged tarball's message says to do (anygrad.data.idx.CACHED_FILE for the cache's)."""
    path = Path(path)
    batches = _members(path, remedy)
    train = [read_batch(batches[n], f"{path}:{n}") for n in TRAIN_BATCHES]
    test = read_batch(batches[TEST_BATCH], f"{path}:{TEST_BATCH}")
    return (np.concatenate([b[0] for b in train]), np.concatenate([b[1] for b in train])), test


def write_cifar_batch(x: np.ndarray, y: np.ndarray) -> bytes:
    """A batch pickled the way the official files are (for tests): python's pickle of a numpy array."""
    import pickle
    buf = io.BytesIO()
    pickle.dump({b"batch_label": b"test", b"labels": [int(v) for v in y],
                 b"data": np.ascontiguousarray(x.reshape(len(x), -1), np.uint8),
                 b"filenames": [b"f%d.png" % i for i in range(len(y))]}, buf, protocol=2)
    return buf.getvalue()
