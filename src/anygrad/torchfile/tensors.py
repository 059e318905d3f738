"""Storages and tensor views of a PyTorch checkpoint, as plain numpy.

A torch tensor is (storage, storage_offset, size, stride) over a flat typed buffer. While a pickle is
read, tensors are only recorded (`TensorRef`); the legacy format stores the raw bytes *after* the
pickle, so arrays are built once every storage has its bytes (`materialize`).
"""
from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

import numpy as np

_repr = reprlib.Repr()  # bounded repr of untrusted values for error messages
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxtuple = 2, 40, 40, 4, 6
short_repr = _repr.repr


class FormatError(Exception):
    """The checkpoint is malformed or asks for something refused; the caller adds the file name."""


# dtype name -> numpy dtype of the raw elements in the file (bfloat16 is read as its uint16 bits).
RAW_DTYPES: dict[str, str] = {
    "float64": "f8", "float32": "f4", "float16": "f2", "bfloat16": "u2",
    "int64": "i8", "int32": "i4", "int16": "i2", "int8": "i1",
    "uint64": "u8", "uint32": "u4", "uint16": "u2", "uint8": "u1",
    "bool": "b1", "complex64": "c8", "complex128": "c16", "float8_e5m2": "u1", "float8_e4m3fn": "u1",
}

# legacy typed-storage class (torch.FloatStorage, ...) -> dtype name
STORAGE_CLASSES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
}
UNTYPED_STORAGE = "uint8"  # torch.UntypedStorage counts bytes

# torch.<name> dtype globals (canonical names and aliases) -> dtype name
TORCH_DTYPES: dict[str, str] = {name: name for name in RAW_DTYPES} | {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
    "short": "int16", "cfloat": "complex64", "cdouble": "complex128",
}
# torch dtypes a file may name but anygrad cannot turn into numpy (refused when a tensor uses them)
UNSUPPORTED_DTYPES = ("complex32", "chalf", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                      "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits8",
                      "bits16", "bits1x8", "bits2x4", "bits4x2")

# A view may repeat storage elements (stride 0); refuse copies that blow up far beyond the file.
MAX_EXPANDED_BYTES = 1 << 28
# All the bytes copied out of storages (strided or overlapping views, widened bfloat16 and float8,
# byte-swapped tensors) may take this many times the storages' own bytes, plus a floor: float8
# widened to float32 takes 4x; twelve stride-0 views of one element, or hundreds of overlapping
# strided views of one storage, would take gigabytes from a file of kilobytes.
MAX_COPY_FACTOR, MAX_COPY_FLOOR = 4, 64 << 20


class CopyBudget:
    """What `materialize` may still allocate for the tensors of one file."""

    def __init__(self, storage_bytes: int):
        self.limit = MAX_COPY_FACTOR * storage_bytes + MAX_COPY_FLOOR
        self.left = self.limit

    def spend(self, nbytes: int, what: str) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise FormatError(
                f"the tensors would take more than {self.limit >> 20} MiB once copied out of the file's storages "
                f"({MAX_COPY_FACTOR}x their size plus {MAX_COPY_FLOOR >> 20} MiB), {what} among them: overlapping or "
                "repeating (stride 0) views blow a small file up; is it corrupt or hostile?")


@dataclass(eq=False)
class Storage:
    """A flat buffer of `numel` elements of `dtype`; `data` is filled once its bytes are read.

    `base`/`offset` express the legacy format's storage views (a slice of another storage)."""
    dtype: str
    numel: int
    key: str
    data: bytes | memoryview | None = None
    base: Storage | None = None
    offset: int = 0  # in elements of dtype, into base

    def raw(self) -> memoryview:
        if self.base is not None:
            size = np.dtype(RAW_DTYPES[self.dtype]).itemsize
            whole = self.base.raw()
            start, stop = self.offset * size, (self.offset + self.numel) * size
            if stop > len(whole):
                raise FormatError(f"storage view {self.key} runs past storage {self.base.key}")
            return whole[start:stop]
        if self.data is None:
            raise FormatError(f"storage {self.key} has no data in the file")
        return memoryview(self.data)


class Deferred:
    """A value recorded while unpickling and produced once all storages are read."""

    def value(self, byteorder: str, budget: CopyBudget | None = None) -> Any:
        raise NotImplementedError


@dataclass(eq=False)
class TensorRef(Deferred):
    """A tensor recorded by a _rebuild_* call; `materialize` turns it into an array."""
    storage: Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    def value(self, byteorder: str, budget: CopyBudget | None = None) -> np.ndarray:
        return materialize(self, byteorder, budget)

    def view(self) -> tuple:
        """What makes two tensors one and the same (tied weights saved under two names): the same
        elements of the same root storage, in the same layout and dtype."""
        storage, offset = self.storage, self.offset
        while storage.base is not None:  # a legacy storage view: count from its root
            storage, offset = storage.base, offset + storage.offset
        return storage, offset, self.size, self.stride, self.dtype


def check_view(offset: object, size: object, stride: object) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Validate the integers of a tensor view (they come from an untrusted pickle)."""
    def ints(v: object, what: str) -> tuple[int, ...]:
        if not isinstance(v, (tuple, list)) or not all(type(i) is int for i in v):
            raise FormatError(f"tensor {what} must be a tuple of ints, got {short_repr(v)}")
        if any(i < 0 for i in v):
            raise FormatError(f"tensor {what} has a negative entry: {tuple(v)}")
        return tuple(v)
    if type(offset) is not int or offset < 0:
        raise FormatError(f"tensor storage offset must be a non-negative int, got {short_repr(offset)}")
    size_t, stride_t = ints(size, "size"), ints(stride, "stride")
    if len(size_t) != len(stride_t):
        raise FormatError(f"tensor size {size_t} and stride {stride_t} differ in length")
    return offset, size_t, stride_t


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: widen the uint16 bit patterns by shifting."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float8_e5m2_to_float32(bits: np.ndarray) -> np.ndarray:
    """float8_e5m2 is the top byte of a float16."""
    return (bits.astype(np.uint16) << 8).view(np.float16).astype(np.float32)


def _e4m3fn_table() -> np.ndarray:
    code = np.arange(256)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    mag = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    return np.where((code & 0x7F) == 0x7F, np.nan, sign * mag).astype(np.float32)  # no inf; S.1111.111 = NaN


def float8_e4m3fn_to_float32(bits: np.ndarray) -> np.ndarray:
    return _e4m3fn_table()[bits]


# dtypes numpy lacks, widened to float32 after reading their bit patterns
WIDEN = {"bfloat16": bfloat16_to_float32, "float8_e5m2": float8_e5m2_to_float32,
         "float8_e4m3fn": float8_e4m3fn_to_float32}


def _c_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, st in zip(reversed(size), reversed(stride)):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


def materialize(ref: TensorRef, byteorder: str, budget: CopyBudget | None = None) -> np.ndarray:
    """The (offset, size, stride) view of its storage as an array: a view sharing the storage's
    buffer when the tensor is contiguous in it (as torch's views share storage), else a contiguous
    copy (strided, repeating or byte-swapped views, widened dtypes), paid from `budget`."""
    if ref.dtype not in RAW_DTYPES:
        raise FormatError(f"tensors of dtype {ref.dtype} are not supported")
    raw_dtype = np.dtype(RAW_DTYPES[ref.dtype]).newbyteorder(byteorder)
    buf = ref.storage.raw()
    n_avail = len(buf) // raw_dtype.itemsize
    flat = np.frombuffer(buf, dtype=raw_dtype, count=n_avail)
    numel = int(np.prod(ref.size, dtype=object)) if ref.size else 1
    widen = WIDEN.get(ref.dtype)
    if numel == 0:
        out = np.zeros(ref.size, dtype=raw_dtype.newbyteorder("="))
        return out if widen is None else widen(out)
    last = ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))
    if last >= n_avail:
        raise FormatError(
            f"tensor view (offset {ref.offset}, size {ref.size}, stride {ref.stride}) reads element "
            f"{last} of storage {ref.storage.key}, which holds {n_avail} elements of {ref.dtype}")
    if widen is None and raw_dtype.isnative and _c_contiguous(ref.size, ref.stride):
        return flat[ref.offset:ref.offset + numel].reshape(ref.size)
    if numel > n_avail and numel * raw_dtype.itemsize > MAX_EXPANDED_BYTES:
        raise FormatError(f"tensor of size {ref.size} expands storage {ref.storage.key} beyond 256 MiB")
    if budget is not None:
        budget.spend(numel * (4 if widen is not None else raw_dtype.itemsize),
                     f"a tensor of size {ref.size} over storage {ref.storage.key}")
    view = np.lib.stride_tricks.as_strided(
        flat[ref.offset:], shape=ref.size, strides=[s * raw_dtype.itemsize for s in ref.stride],
        writeable=False)
    out = np.array(view, dtype=raw_dtype.newbyteorder("="), order="C")
    return out if widen is None else widen(out)


def resolve(obj: Any, byteorder: str, storage_bytes: int = 0) -> Any:
    """Replace every Deferred in the unpickled tree by its value (copies bounded by `CopyBudget`
    of the file's `storage_bytes`).

    Objects are visited once (by identity), so a tensor or container referenced twice stays one object
    and shared sub-trees do not blow up; containers are updated in place, tuples rebuilt. Tensors that
    are the same view of the same storage (a tied weight under two names) become one array, as they
    are one tensor in PyTorch; other views of a storage share its buffer where they can."""
    budget = CopyBudget(storage_bytes)
    done: dict[int, tuple[Any, Any]] = {}  # id -> (original, result); keeps originals alive
    views: dict[tuple, np.ndarray] = {}

    def walk(x: Any) -> Any:
        hit = done.get(id(x))
        if hit is not None:
            return hit[1]
        if isinstance(x, TensorRef):
            key = x.view()
            if key not in views:
                views[key] = x.value(byteorder, budget)
            out = views[key]
        elif isinstance(x, Deferred):
            out = x.value(byteorder, budget)
        elif isinstance(x, dict):
            done[id(x)] = (x, x)
            for k in list(x):
                x[k] = walk(x[k])
            out = x
        elif isinstance(x, list):
            done[id(x)] = (x, x)
            x[:] = [walk(v) for v in x]
            out = x
        elif type(x) is tuple:
            out = tuple(walk(v) for v in x)
        else:
            out = x
        done[id(x)] = (x, out)
        return out

    return walk(obj)
