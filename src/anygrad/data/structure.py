"""What a sample or a batch looks like: (inputs, targets), each an array, a dict or a tuple of arrays.

Users bring data in the shapes PyTorch and Hugging Face code produce: `(x, y)` tuples, the lists
torch's default collate makes of them, dicts of named columns ({"input_ids", "attention_mask",
"labels"}), torch tensors, lists of numbers. This module turns one such sample or batch into a
pair (inputs, targets) of numpy trees with the structure kept as the user gave it, so a model
with several inputs gets a dict by input name or a tuple in graph order, and collates samples
into batches of the same structure. Every way a sample can be malformed is a DataError naming
the sample (or batch) and what to do; nothing else escapes.

The rules:
- a dict (any Mapping with string keys): the keys in `target_keys` are the targets (one key: that
  array; several: a dict of them), the others the inputs (a dict by input name);
- a tuple, or a list whose elements are not plain numbers (what torch's default collate makes of
  tuples): `(inputs, targets)`, or `(inputs,)` without targets; any other length is refused;
- anything else (an array, a tensor, a list of numbers, a number): the inputs alone.
Inside the inputs and targets, dicts and tuples nest; leaves become numpy arrays (torch tensors
without a copy when they are on the CPU).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DataError

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


def is_tensor(value: Any) -> bool:
    """A torch tensor, recognised without importing torch."""
    return type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach") and hasattr(value, "numpy")


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
    elif is_tensor(value):
        t = value.detach()
        if getattr(t, "device", None) is not None and str(t.device) != "cpu":
            t = t.cpu()
        try:
            array = t.numpy()
        except (TypeError, RuntimeError) as e:  # bfloat16 and other dtypes numpy lacks
            raise DataError(f"{where}: a torch tensor of dtype {t.dtype} has no numpy form ({e}); convert it "
                            "(e.g. .float()) in the dataset") from None
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
