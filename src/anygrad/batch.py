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

Samples and batches as datasets and loaders yield them (the second half of this module; the data
layer's loaders and the Learner use it): `(inputs, targets)`, each an array, a dict or a tuple of
arrays. Users bring data in the shapes PyTorch and Hugging Face code produce: `(x, y)` tuples, the
lists torch's default collate makes of them, dicts of named columns ({"input_ids",
"attention_mask", "labels"}), torch tensors, lists of numbers. `split` turns one such sample or
batch into a pair (inputs, targets) of numpy trees with the structure kept as the user gave it, and
`collate` batches samples of one structure. Every way a sample can be malformed is a DataError
naming the sample (or batch) and what to do; nothing else escapes. The rules:
- a dict (any Mapping with string keys): the keys in `target_keys` are the targets (one key: that
  array; several: a dict of them), the others the inputs (a dict by input name);
- a tuple, or a list whose elements are not plain numbers (what torch's default collate makes of
  tuples): `(inputs, targets)`, or `(inputs,)` without targets; any other length is refused;
- anything else (an array, a tensor, a list of numbers, a number): the inputs alone.
Inside the inputs and targets, dicts and tuples nest; leaves become numpy arrays (torch tensors
without a copy when they are on the CPU).
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DataError, ShapeError, first_line
from .ir.graph import Graph

Batch = dict[str, np.ndarray]


def is_torch_tensor(value: Any) -> bool:
    """A torch.Tensor, recognised without importing torch."""
    t = type(value)
    return t.__module__.split(".")[0] == "torch" and hasattr(value, "detach") and hasattr(value, "numpy")


def is_array_like(value: Any) -> bool:
    """One tensor's worth of data: a numpy array or scalar, a torch tensor, or a number."""
    return isinstance(value, (np.ndarray, np.generic, int, float, bool)) or is_torch_tensor(value)


def tensor_to_numpy(tensor: Any, what: str) -> np.ndarray:
    """A torch tensor as a numpy array: a CPU tensor without a copy (.numpy()), others after
    .cpu(); bfloat16, which numpy lacks, as float32. `what` names it in errors."""
    t = tensor.detach()
    if getattr(getattr(t, "device", None), "type", "cpu") != "cpu":
        t = t.cpu()
    if str(getattr(t, "dtype", "")) == "torch.bfloat16":  # numpy has no bfloat16
        t = t.float()
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as e:  # float8 and other dtypes numpy lacks
        raise DataError(f"{what}: a torch tensor of dtype {t.dtype} has no numpy form ({e}); convert it "
                        "(e.g. .float()) first, or pass a numpy array") from None


def to_numpy(value: Any, what: str) -> np.ndarray:
    """`value` as a numpy array: CPU torch tensors without a copy (.numpy()), others after .cpu();
    numpy arrays as they are; nested lists of numbers via np.asarray. `what` names it in errors."""
    if isinstance(value, np.ndarray):
        return value
    if is_torch_tensor(value):
        return tensor_to_numpy(value, what)
    if isinstance(value, (Mapping, str, bytes)) or value is None:
        raise DataError(f"{what}: expected an array or tensor, got {_kind(value)}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise DataError(f"{what}: cannot read {_kind(value)} as an array ({first_line(e)})") from None
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
        raise ShapeError(f"{what} '{name}' takes shape {_shape_text(declared)}, got {tuple(value.shape)}"
                         + _fixed_dims_hint(name, declared, value.shape, what))


def _fixed_dims_hint(name: str, declared: tuple, shape: tuple, what: str = "input") -> str:
    """Which fixed non-batch dim `shape` does not match, and what to do. Any model can fix one (a
    Linear's weight, an export's example input), so only say from_torch's way out as a condition."""
    if len(declared) != len(shape):
        return ""
    axes = [a for a, (d, s) in enumerate(zip(declared, shape)) if a and isinstance(d, (int, np.integer)) and d != s]
    if not axes:
        return ""
    a, size = axes[0], int(declared[axes[0]])
    return (f": the model's {what} takes size {size} on axis {a}, the data has {int(shape[a])}; "
            f"reshape, pad or crop the data to {size} (if the model came from from_torch, export with an "
            f"example of the size you use, or pass dynamic={{{name!r}: {{{a}: 'seq'}}}} to keep axis {a} symbolic)")


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


# -- samples and batches as datasets and loaders yield them --------------------------------------
# Keys of a dict sample that are targets unless `target_keys` says otherwise: Hugging Face's
# `labels` (what its models and Trainer take) and `label` (what its datasets name the column),
# and the names Keras-style and plain-numpy code use.
DEFAULT_TARGET_KEYS = ("labels", "label", "y", "target", "targets")
MAX_DEPTH = 8  # nesting deeper than this is not a batch structure anyone means
NUMERIC_KINDS = "biuf"

Tree = Any  # np.ndarray | dict[str, Tree] | tuple[Tree, ...]


@dataclass(frozen=True)
class Layout:
    """How samples split into inputs and targets: the dict keys that are targets, and whether
    the loss needs targets at all (a loss computed inside the model's graph does not)."""

    target_keys: tuple[str, ...] = DEFAULT_TARGET_KEYS
    needs_targets: bool = True


def _numbers_only(value: Any, depth: int = 0) -> bool:
    """A (nested) list of plain numbers: an array written as Python lists."""
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        return True
    if isinstance(value, list) and depth < MAX_DEPTH:
        return all(_numbers_only(v, depth + 1) for v in value)
    return False


def _is_sequence_structure(value: Any) -> bool:
    if isinstance(value, tuple):
        return True
    return isinstance(value, list) and not _numbers_only(value)


def _leaf(value: Any, where: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        array = value
    elif is_torch_tensor(value):
        array = tensor_to_numpy(value, where)
    elif isinstance(value, (bool, int, float, np.number, np.bool_, list)):
        try:
            array = np.asarray(value)
        except (ValueError, TypeError, OverflowError):
            array = None
        if array is None or array.dtype == object:
            raise DataError(f"{where}: a list that is not a rectangular array of numbers (sequences of "
                            "different lengths?); pad them to one length in the dataset or a collate function")
    else:
        raise DataError(f"{where}: holds {type(value).__name__}, not an array, a tensor or a number; samples "
                        "are arrays, dicts of arrays or (inputs, targets) tuples: drop or encode this field "
                        "(e.g. ds.remove_columns([...]) for a Hugging Face dataset)")
    if array.dtype.kind not in NUMERIC_KINDS:
        raise DataError(f"{where}: holds values of dtype {array.dtype}, not numbers; drop or encode this field")
    return array


def to_tree(value: Any, where: str, depth: int = 0) -> Tree:
    """`value` with its dicts and tuples kept and every leaf a numpy array."""
    if depth > MAX_DEPTH:
        raise DataError(f"{where}: nested more than {MAX_DEPTH} levels deep; give arrays, dicts of arrays or "
                        "(inputs, targets) tuples")
    if isinstance(value, Mapping):
        if not value:
            raise DataError(f"{where}: an empty dict; give at least one array")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise DataError(f"{where}: dict keys must be input or target names (strings), got {bad[0]!r}")
        return {k: to_tree(v, f"{where} key '{k}'", depth + 1) for k, v in value.items()}
    if _is_sequence_structure(value):
        if not value:
            raise DataError(f"{where}: an empty {type(value).__name__}; give at least one array")
        return tuple(to_tree(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    return _leaf(value, where)


def split(value: Any, where: str, layout: Layout) -> tuple[Tree, Tree | None]:
    """One sample or batch as (inputs, targets) trees (targets None when there are none)."""
    if isinstance(value, Mapping):
        keys = list(value)
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise DataError(f"{where}: dict keys must be input or target names (strings), got {bad[0]!r}")
        targets = [k for k in layout.target_keys if k in value]
        inputs = {k: v for k, v in value.items() if k not in targets}
        if not inputs:
            raise DataError(f"{where}: every key ({', '.join(keys)}) is a target; the inputs are missing "
                            f"(target keys: {', '.join(layout.target_keys) or 'none'}; pass target_keys=[...] "
                            "to choose others)")
        x = to_tree(inputs, where)
        if not targets:
            y = None
        elif len(targets) == 1:
            y = to_tree(value[targets[0]], f"{where} key '{targets[0]}'")
        else:
            y = to_tree({k: value[k] for k in targets}, where)
    elif _is_sequence_structure(value):
        if len(value) == 2:
            x, y = to_tree(value[0], f"{where} inputs ([0])"), to_tree(value[1], f"{where} targets ([1])")
        elif len(value) == 1:
            x, y = to_tree(value[0], f"{where} inputs ([0])"), None
        else:
            raise DataError(f"{where}: a {type(value).__name__} of {len(value)} elements; anygrad reads a tuple as "
                            "(inputs, targets) or (inputs,): nest several inputs, as ((ids, mask), labels), or "
                            "give dicts by input name ({'ids': ..., 'mask': ..., 'labels': ...})")
    else:
        x, y = to_tree(value, where), None
    if y is None and layout.needs_targets:
        raise DataError(f"{where}: has no targets, which the loss needs; give (inputs, targets) tuples or dicts "
                        f"with a target key ({', '.join(layout.target_keys) or 'none set'}; target_keys=[...] "
                        "names others), or compile(loss='output') for a model that computes its own loss")
    return x, y


def signature(tree: Tree) -> Any:
    """The structure of a sample: dict keys, tuple arity, and each leaf's shape and dtype kind."""
    if isinstance(tree, dict):
        return ("dict", tuple((k, signature(v)) for k, v in tree.items()))
    if isinstance(tree, tuple):
        return ("tuple", tuple(signature(v) for v in tree))
    if tree is None:
        return ("none",)
    return ("array", tuple(tree.shape), tree.dtype.kind)


def describe(sig: Any) -> str:
    kind = sig[0]
    if kind == "dict":
        return "{" + ", ".join(f"'{k}': {describe(v)}" for k, v in sig[1]) + "}"
    if kind == "tuple":
        return "(" + ", ".join(describe(v) for v in sig[1]) + ("," if len(sig[1]) == 1 else "") + ")"
    if kind == "none":
        return "no targets"
    kinds = {"b": "bool", "i": "int", "u": "uint", "f": "float"}
    return f"{kinds.get(sig[2], sig[2])} array{sig[1]}"


def leaves(tree: Tree) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [a for v in tree.values() for a in leaves(v)]
    if isinstance(tree, tuple):
        return [a for v in tree for a in leaves(v)]
    return [tree]


def stack(trees: Sequence[Tree]) -> Tree:
    """Samples of one signature stacked along a new batch axis, structure kept."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: stack([t[k] for t in trees]) for k in first}
    if isinstance(first, tuple):
        return tuple(stack([t[i] for t in trees]) for i in range(len(first)))
    return np.stack(trees)


def collate(samples: Sequence[Any], indices: Sequence[int], layout: Layout) -> tuple[Tree, Tree | None]:
    """Samples (dataset items `indices`) as one batch of (inputs, targets) with their structure.
    Every sample must have the structure of the first: the same keys, arity, shapes and kinds."""
    pairs = [split(s, f"dataset item {int(i)}", layout) for s, i in zip(samples, indices)]
    sig = signature(pairs[0])
    for (pair, i) in zip(pairs[1:], indices[1:]):
        other = signature(pair)
        if other != sig:
            raise DataError(f"dataset item {int(i)} is {describe(other)} but item {int(indices[0])} is "
                            f"{describe(sig)}; every item needs the same structure and shapes to batch (pad "
                            "sequences to one length, or give batches yourself through a DataLoader)")
    return stack([p[0] for p in pairs]), (None if pairs[0][1] is None else stack([p[1] for p in pairs]))


def batch_size_of(x: Tree, y: Tree | None, where: str) -> int:
    """The batch size of a batch whose arrays must all agree on it (their first axis)."""
    arrays = leaves(x) + ([] if y is None else leaves(y))
    sizes = set()
    for a in arrays:
        if a.ndim == 0:
            raise DataError(f"{where}: holds a single number where a batch needs an array with a batch axis; "
                            "give batches, or samples in an indexable dataset, which anygrad batches (a list of "
                            "samples: anygrad.data.DatasetSamples(samples))")
        sizes.add(a.shape[0])
    if len(sizes) != 1:
        raise DataError(f"{where}: its arrays disagree on the batch size ({', '.join(map(str, sorted(sizes)))}); "
                        "every input and target needs the same number of samples")
    return sizes.pop()


def unwrap_single(x: Tree, n_inputs: int) -> Tree:
    """A one-input model takes the array itself: {'pixels': a} or (a,) becomes a."""
    if n_inputs == 1 and isinstance(x, (dict, tuple)) and len(x) == 1:
        inner = next(iter(x.values())) if isinstance(x, dict) else x[0]
        return inner if isinstance(inner, np.ndarray) else x
    return x


__all__ = ["DEFAULT_TARGET_KEYS", "Batch", "Layout", "Tree", "batch_size", "batch_size_of", "check_batch_sizes",
           "check_value", "collate", "is_torch_tensor", "length", "parse_inputs", "split", "structure", "take",
           "tensor_to_numpy", "to_numpy", "to_tree", "unwrap_single"]
