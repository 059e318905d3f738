"""The structure of a batch as a user passes it: inputs by name, in graph order, or one array.

    parse_inputs({"ids": ids, "mask": mask}, model.graph)  # by input name
    parse_inputs((ids, mask), model.graph)                 # in the graph's input order
    parse_inputs(x, model.graph)                           # one-input models

Values are numpy arrays, torch tensors (CPU tensors are read without a copy, others are moved
to the CPU first; torch is never imported here: a tensor is recognised by its type's module) or
nested lists of numbers. Every mistake is an AnygradError that names the input and says how to
pass it: an unknown or missing name, a wrong rank or fixed dimension, a dtype the input cannot
take (floats for token ids), or batch sizes that disagree between inputs. Each input keeps the
dtype the graph declares (int64 ids stay integers, a float mask stays float); the backends cast
to that dtype.

Targets take the same structures, keyed by the names of the outputs that have a loss.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import DataError, ShapeError
from .ir.graph import Graph

Batch = dict[str, np.ndarray]


def is_torch_tensor(value: Any) -> bool:
    """A torch.Tensor, recognised without importing torch."""
    t = type(value)
    return t.__module__.split(".")[0] == "torch" and hasattr(value, "detach") and hasattr(value, "numpy")


def is_array_like(value: Any) -> bool:
    """One tensor's worth of data: a numpy array or scalar, a torch tensor, or a number."""
    return isinstance(value, (np.ndarray, np.generic, int, float, bool)) or is_torch_tensor(value)


def to_numpy(value: Any, what: str) -> np.ndarray:
    """`value` as a numpy array: CPU torch tensors without a copy (.numpy()), others after .cpu();
    numpy arrays as they are; nested lists of numbers via np.asarray. `what` names it in errors."""
    if isinstance(value, np.ndarray):
        return value
    if is_torch_tensor(value):
        t = value.detach()
        if getattr(getattr(t, "device", None), "type", "cpu") != "cpu":
            t = t.cpu()
        if str(getattr(t, "dtype", "")) == "torch.bfloat16":  # numpy has no bfloat16
            t = t.float()
        try:
            return t.numpy()
        except (TypeError, RuntimeError) as e:
            raise DataError(f"{what}: cannot read the torch tensor ({e}); pass a numpy array") from None
    if isinstance(value, (Mapping, str, bytes)) or value is None:
        raise DataError(f"{what}: expected an array or tensor, got {_kind(value)}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise DataError(f"{what}: cannot read {_kind(value)} as an array ({str(e).splitlines()[0]})") from None
    if arr.dtype.kind not in "biuf":
        raise DataError(f"{what}: expected numbers (an array or tensor), got {_kind(value)} of dtype {arr.dtype}")
    return arr


def _kind(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape}"
    if is_torch_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a dict with keys {list(value)[:6]}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def _how(names: Sequence[str], what: str) -> str:
    """How to pass several named values, for error messages."""
    if len(names) == 1:
        return f"pass one array (or {{'{names[0]}': array}})"
    listed = ", ".join(f"'{n}': ..." for n in names)
    return f"pass a dict {{{listed}}} or a tuple of {len(names)} arrays in that order"


def structure(value: Any, names: Sequence[str], what: str) -> dict[str, Any]:
    """Split a batch given by name (dict), in order (tuple or list of arrays) or as one array (when
    there is one name) into {name: value}; `what` is 'input' or 'target'. Names only, no checks of
    the values themselves (see to_numpy)."""
    names = list(names)
    plural = f"{what}s"
    if isinstance(value, Mapping):
        bad_keys = [k for k in value if not isinstance(k, str)]
        if bad_keys:
            raise DataError(f"{plural} by name: keys must be strings, got {bad_keys[0]!r}; the model's "
                            f"{plural} are {names}")
        unknown = [k for k in value if k not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise DataError(f"the model has no {what} named '{unknown[0]}'{hint}; its {plural} are {names}")
        missing = [n for n in names if n not in value]
        if missing:
            raise DataError(f"{what} '{missing[0]}' is missing" + (f" (and {missing[1:]})" if missing[1:] else "")
                            + f": the model's {plural} are {names}; {_how(names, what)}")
        return {n: value[n] for n in names}
    if isinstance(value, (tuple, list)) and not (len(names) == 1 and not _holds_arrays(value)):
        if len(value) != len(names):
            raise DataError(f"got {len(value)} {plural} in a {type(value).__name__}, but the model has "
                            f"{len(names)}: {names}; {_how(names, what)}")
        return dict(zip(names, value))
    if len(names) != 1:
        raise DataError(f"got {_kind(value)} for a model with {len(names)} {plural} {names}; {_how(names, what)}")
    return {names[0]: value}


def _holds_arrays(value: Sequence) -> bool:
    """A tuple/list whose items are arrays or tensors (a structure), not numbers (data)."""
    return len(value) > 0 and all(isinstance(v, np.ndarray) or is_torch_tensor(v) or isinstance(v, Mapping)
                                  for v in value)


def _dtype_fits(declared: np.dtype, got: np.dtype) -> bool:
    """Whether values of dtype `got` may be cast to the declared input dtype without losing meaning:
    integer inputs (token ids, masks) take integers and booleans, never floats; bool inputs take
    bool or integers; float inputs take any number."""
    if declared.kind in "iu":
        return got.kind in "biu"
    if declared.kind == "b":
        return got.kind in "biu"
    return got.kind in "biuf"


def check_value(name: str, value: np.ndarray, declared_dtype: Any, declared_shape: Any, what: str) -> None:
    """A DataError/ShapeError naming `name` when `value` cannot feed a tensor of this dtype and shape."""
    dtype = np.dtype(declared_dtype)
    if not _dtype_fits(dtype, value.dtype):
        raise DataError(f"{what} '{name}' takes {dtype} values, got {value.dtype}"
                        + ("; token ids and masks must be integers (cast with .long() or astype(np.int64))"
                           if dtype.kind in "iub" else ""))
    if declared_shape is None:
        return
    declared = tuple(declared_shape)
    if value.ndim != len(declared) or any(isinstance(d, (int, np.integer)) and d != s
                                          for d, s in zip(declared, value.shape)):
        raise ShapeError(f"{what} '{name}' takes shape {_shape_text(declared)}, got {tuple(value.shape)}")


def _shape_text(shape: tuple) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def check_batch_sizes(values: Mapping[str, np.ndarray], what: str) -> int:
    """The common batch size (axis 0) of `values`; a DataError naming two that disagree."""
    sizes = {n: (int(v.shape[0]) if v.ndim else None) for n, v in values.items()}
    ranked = [(n, s) for n, s in sizes.items() if s is not None]
    if not ranked:
        raise ShapeError(f"{what}s {list(values)} are scalars; a batch needs a leading batch axis")
    first, size = ranked[0]
    for n, s in ranked[1:]:
        if s != size:
            raise DataError(f"batch sizes disagree: {what} '{first}' has {size} samples, '{n}' has {s}; "
                            "every input (and target) of a batch needs the same first dimension")
    return size


def parse_inputs(value: Any, graph: Graph) -> Batch:
    """The model inputs of one batch as {graph input name: numpy array}, checked against the graph's
    declared dtypes and shapes (symbolic dims may take any size; the batch dim must agree)."""
    names = list(graph.inputs)
    if not names:
        raise ShapeError("the model has no inputs")
    raw = structure(value, names, "input")
    batch = {n: to_numpy(v, f"input '{n}'") for n, v in raw.items()}
    for n, v in batch.items():
        info = graph.info.get(n)
        if info is not None:
            check_value(n, v, info.dtype, info.shape, "input")
    _check_symbols(graph, batch)
    check_batch_sizes(batch, "input")
    return batch


def _check_symbols(graph: Graph, batch: Batch) -> None:
    """A symbolic dim the graph's inputs share (ids and mask both ('batch', 'seq')) takes one size."""
    seen: dict[str, tuple[str, int]] = {}
    for n, v in batch.items():
        shape = getattr(graph.info.get(n), "shape", None) or ()
        for d, s in zip(shape, v.shape):
            if isinstance(d, str) and d:
                if d in seen and seen[d][1] != s:
                    other, size = seen[d]
                    raise DataError(f"inputs '{other}' and '{n}' disagree on the dimension '{d}': {size} vs {s}"
                                    + ("; every input of a batch needs the same first dimension"
                                       if d == "batch" else ""))
                seen.setdefault(d, (n, int(s)))


def batch_size(inputs: Mapping[str, np.ndarray]) -> int:
    """The number of samples in parsed inputs."""
    return int(next(iter(inputs.values())).shape[0])


def take(value: Any, index: Any) -> Any:
    """`value[index]` for each array of a batch structure (dict, tuple/list of arrays, one array):
    how a loader slices a batch out of in-memory data of any structure."""
    if isinstance(value, Mapping):
        return {k: take(v, index) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and _holds_arrays(value):
        return type(value)(take(v, index) for v in value)
    return value[index]


def length(value: Any, what: str = "data") -> int:
    """The number of samples in a batch structure (all of its arrays must agree)."""
    if isinstance(value, Mapping):
        parts = {str(k): v for k, v in value.items()}
    elif isinstance(value, (tuple, list)) and _holds_arrays(value):
        parts = {f"{what}[{i}]": v for i, v in enumerate(value)}
    else:
        return len(value)
    sizes = {k: length(v, k) for k, v in parts.items()}
    if not sizes:
        raise DataError(f"{what}: an empty structure holds no samples")
    if len(set(sizes.values())) > 1:
        raise DataError(f"{what}: batch sizes disagree: {sizes}; every array needs the same first dimension")
    return next(iter(sizes.values()))


__all__ = ["Batch", "batch_size", "check_batch_sizes", "check_value", "is_torch_tensor", "length", "parse_inputs",
           "structure", "take", "to_numpy"]
