"""The globals a PyTorch checkpoint may name, each mapped to anygrad's own harmless replacement.

Nothing here imports torch: `torch._utils._rebuild_tensor_v2` becomes a function that records a
`TensorRef`, `torch.FloatStorage` a marker holding a dtype name, `collections.OrderedDict` a plain
OrderedDict. A name missing from `ALLOWED` is refused by the unpickler.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from .pickle_reader import Buildable, SafeGlobal
from .tensors import (
    RAW_DTYPES,
    STORAGE_CLASSES,
    TORCH_DTYPES,
    UNSUPPORTED_DTYPES,
    UNTYPED_STORAGE,
    Deferred,
    FormatError,
    Storage,
    TensorRef,
    check_view,
    short_repr,
)


@dataclass(frozen=True)
class StorageType:
    """torch.FloatStorage, torch.UntypedStorage, ...: only its element dtype matters."""
    dtype: str


@dataclass(frozen=True)
class DType:
    """torch.float32, torch.int64, ...: a dtype name."""
    name: str


@dataclass(frozen=True)
class TensorType:
    """torch.Tensor / torch.nn.Parameter as the `new_type` of _rebuild_from_type_v2."""
    name: str


class StateDict(OrderedDict, Buildable):
    """collections.OrderedDict; a torch state_dict pickles its `_metadata` (module versions) as state."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise FormatError(f"OrderedDict state must be a dict, got {type(state).__name__}")
        if "_metadata" in state:
            self._metadata = state["_metadata"]


# ---- tensors -------------------------------------------------------------------------------------
def _tensor(storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None = None) -> TensorRef:
    if not isinstance(storage, Storage):
        raise FormatError(f"a tensor must be rebuilt from a storage, got {short_repr(storage)}")
    offset, size, stride = check_view(offset, size, stride)
    return TensorRef(storage, offset, size, stride, dtype or storage.dtype)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> TensorRef:
    return _tensor(storage, offset, size, stride)


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None) -> TensorRef:
    return _tensor(storage, offset, size, stride)


def _rebuild_tensor_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, dtype: Any, metadata: Any = None) -> TensorRef:
    if not isinstance(dtype, DType):
        raise FormatError(f"_rebuild_tensor_v3 needs a torch dtype, got {short_repr(dtype)}")
    return _tensor(storage, offset, size, stride, dtype.name)


def _tensor_arg(data: Any) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise FormatError(f"a Parameter must wrap a tensor, got {short_repr(data)}")
    return data


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> TensorRef:
    return _tensor_arg(data)


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, backward_hooks: Any, state: Any) -> TensorRef:
    return _tensor_arg(data)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
    # Tensors with Python attributes pickle as this; the attributes (state) are dropped.
    if not any(func is g for g in _TENSOR_REBUILDS.values()) or not isinstance(new_type, TensorType) or not isinstance(args, tuple):
        raise FormatError(f"_rebuild_from_type_v2 with {short_repr(func)} / {short_repr(new_type)} is not allowed")
    return _tensor_arg(func(*args))


# ---- plain values --------------------------------------------------------------------------------
def _ordered_dict(items: Any = ()) -> StateDict:
    if not isinstance(items, (list, tuple)):
        raise FormatError("OrderedDict items must be a list of pairs")
    return StateDict(items)


def _size(dims: Any = ()) -> tuple[int, ...]:
    if not isinstance(dims, (list, tuple)) or not all(type(d) is int for d in dims):
        raise FormatError(f"torch.Size needs ints, got {short_repr(dims)}")
    return tuple(dims)


def _device(kind: Any, index: Any = None) -> str:
    if not isinstance(kind, str) or not (index is None or type(index) is int):
        raise FormatError(f"torch.device({short_repr(kind)}, {short_repr(index)}) is malformed")
    return kind if index is None else f"{kind}:{index}"


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # protocol-2 pickles store bytes objects as _codecs.encode(latin-1 text, 'latin1')
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise FormatError("_codecs.encode is only allowed for latin1 byte strings")
    return text.encode("latin1")


def _collection(kind: type):
    def build(items: Any = ()) -> Any:
        if not isinstance(items, (list, tuple, set, frozenset)):
            raise FormatError(f"{kind.__name__} needs a list of items, got {short_repr(items)}")
        return kind(items)
    return build


def _slice(*args: Any) -> slice:
    if len(args) > 3 or not all(a is None or type(a) is int for a in args):
        raise FormatError(f"slice{short_repr(args)} is malformed")
    return slice(*args)


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(type(v) in (int, float) for v in (real, imag)):
        raise FormatError(f"complex({short_repr(real)}, {short_repr(imag)}) is malformed")
    return complex(real, imag)


def _bytearray(data: Any = b"", encoding: Any = None) -> bytearray:
    if isinstance(data, str):
        data = _codecs_encode(data, encoding)
    if not isinstance(data, bytes):
        raise FormatError("bytearray needs bytes")
    return bytearray(data)


# ---- numpy scalars and arrays (training scripts store metrics and arguments as numpy values) -----
_NUMPY_KINDS = "biufc"


def _numpy_dtype_of(spec: Any) -> np.dtype:
    if not isinstance(spec, str):
        raise FormatError(f"numpy dtype {short_repr(spec)} is not allowed")
    dt = np.dtype(spec)
    if dt.kind not in _NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise FormatError(f"numpy dtype {spec!r} is not a plain numeric type")
    return dt


class NumpyDType(Buildable):
    """numpy.dtype(spec, align, copy) followed by BUILD (version, byteorder, ...)."""

    def __init__(self, spec: Any, align: Any = False, copy: Any = True):
        self.dtype = _numpy_dtype_of(spec)

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) < 2 or state[1] not in ("<", ">", "|", "="):
            raise FormatError(f"numpy dtype state {short_repr(state)} is malformed")
        if self.dtype.itemsize > 1:
            self.dtype = self.dtype.newbyteorder(state[1])


class NumpyArray(Buildable, Deferred):
    """numpy.core.multiarray._reconstruct(ndarray, (0,), b'b') followed by BUILD (ver, shape, dtype, fortran, raw)."""

    def __init__(self, cls: Any, shape: Any, typecode: Any):
        if cls is not _NDARRAY:
            raise FormatError(f"numpy _reconstruct of {short_repr(cls)} is not allowed")
        self.array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise FormatError("numpy array state is malformed")
        _, shape, dtype, fortran, raw = state
        if not isinstance(dtype, NumpyDType) or not isinstance(raw, (bytes, bytearray)):
            raise FormatError("numpy array state needs a numeric dtype and raw bytes")
        self.array = _array_of_bytes(raw, dtype.dtype, shape, "F" if fortran else "C")

    def value(self, byteorder: str, budget: Any = None) -> np.ndarray:
        if self.array is None:
            raise FormatError("numpy array without data")
        return self.array


def _numpy_scalar(dtype: Any, raw: Any = None) -> Any:
    if not isinstance(dtype, NumpyDType) or not isinstance(raw, bytes) or len(raw) != dtype.dtype.itemsize:
        raise FormatError("numpy scalar needs a numeric dtype and its bytes")
    return np.frombuffer(raw, dtype=dtype.dtype)[0]


def _numpy_frombuffer(buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    """numpy._core.numeric._frombuffer(buffer, dtype, shape, order): how pickle protocol 5 stores
    an array (its bytes in-band). Only builds a numeric array of exactly the bytes given."""
    if not isinstance(buf, (bytes, bytearray)) or not isinstance(dtype, NumpyDType) or order not in ("C", "F"):
        raise FormatError("numpy _frombuffer needs raw bytes, a numeric dtype and order 'C' or 'F'")
    return _array_of_bytes(buf, dtype.dtype, shape, order)


def _array_of_bytes(raw: bytes | bytearray, dtype: np.dtype, shape: Any, order: str) -> np.ndarray:
    """A C-ordered native-endian copy of an array stored as exactly these bytes."""
    shape = _size(shape)
    count = int(np.prod(shape, dtype=object))
    if count * dtype.itemsize != len(raw):
        raise FormatError(f"numpy array of shape {shape} does not match its {len(raw)} bytes")
    flat = np.frombuffer(raw, dtype=dtype, count=count)
    return np.array(flat.reshape(shape, order=order), dtype=dtype.newbyteorder("="), order="C")


_NDARRAY = TensorType("numpy.ndarray")

# ---- the table -----------------------------------------------------------------------------------
_TENSOR_REBUILDS = {
    name: SafeGlobal(f"torch._utils.{name}", fn) for name, fn in [
        ("_rebuild_tensor", _rebuild_tensor), ("_rebuild_tensor_v2", _rebuild_tensor_v2),
        ("_rebuild_tensor_v3", _rebuild_tensor_v3), ("_rebuild_parameter", _rebuild_parameter),
        ("_rebuild_parameter_with_state", _rebuild_parameter_with_state)]
}


def _pair_keys(items: Any = ()) -> list[Any]:
    """The keys OrderedDict(items) will hash (what is not a pair is refused by OrderedDict itself)."""
    if not isinstance(items, (list, tuple)):
        return []
    return [p[0] for p in items if isinstance(p, (list, tuple)) and len(p) == 2]


def _members(items: Any = ()) -> Any:
    return items if isinstance(items, (list, tuple, set, frozenset)) else ()

ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch._utils", name): g for name, g in _TENSOR_REBUILDS.items()},
    ("torch._tensor", "_rebuild_from_type_v2"): SafeGlobal("torch._tensor._rebuild_from_type_v2",
                                                           _rebuild_from_type_v2),
    **{("torch", cls): StorageType(dtype) for cls, dtype in STORAGE_CLASSES.items()},
    **{(mod, "UntypedStorage"): StorageType(UNTYPED_STORAGE) for mod in ("torch", "torch.storage")},
    ("torch.storage", "_UntypedStorage"): StorageType(UNTYPED_STORAGE),
    **{("torch", name): DType(canonical) for name, canonical in TORCH_DTYPES.items()},
    **{("torch", name): DType(name) for name in UNSUPPORTED_DTYPES},
    ("torch", "Tensor"): TensorType("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): TensorType("torch.nn.Parameter"),
    ("torch", "Size"): SafeGlobal("torch.Size", _size),
    ("torch", "device"): SafeGlobal("torch.device", _device),
    ("collections", "OrderedDict"): SafeGlobal("collections.OrderedDict", _ordered_dict, _pair_keys),
    ("_codecs", "encode"): SafeGlobal("_codecs.encode", _codecs_encode),
    **{(mod, name): SafeGlobal(f"builtins.{name}", fn)
       for mod in ("builtins", "__builtin__")
       for name, fn in [("slice", _slice), ("complex", _complex), ("bytearray", _bytearray)]},
    **{(mod, name): SafeGlobal(f"builtins.{name}", _collection(kind), _members)
       for mod in ("builtins", "__builtin__") for name, kind in [("set", set), ("frozenset", frozenset)]},
    **{(mod, name): g for mod in ("numpy.core.multiarray", "numpy._core.multiarray")
       for name, g in [("scalar", SafeGlobal("numpy.core.multiarray.scalar", _numpy_scalar)),
                       ("_reconstruct", SafeGlobal("numpy.core.multiarray._reconstruct", NumpyArray))]},
    **{(mod, "_frombuffer"): SafeGlobal("numpy._core.numeric._frombuffer", _numpy_frombuffer)
       for mod in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "dtype"): SafeGlobal("numpy.dtype", NumpyDType),
    ("numpy", "ndarray"): _NDARRAY,
}
assert all(d in RAW_DTYPES for d in STORAGE_CLASSES.values())
