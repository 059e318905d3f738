"""The user's own data as batches: arrays, memory-mapped files, indexable datasets, iterables.

`batch_source(data, ...)` takes what `fit` is given and returns a BatchSource the trainer draws
from. What it recognises, in this order:
- a BatchSource (a DataLoader, anygrad.data.TokenWindows, ...): as it is;
- a `.npy` path: the array mapped from the file (np.load(mmap_mode='r')), inputs only;
- a tuple `(inputs, targets)` of arrays, torch tensors, `.npy` paths or memmaps (or dicts/tuples
  of them): in-memory or mapped arrays, batched and shuffled by anygrad;
- a numpy array (np.memmap included) or a torch tensor: inputs only (a loss in the graph);
- a list of batches, a zero-argument callable returning an iterator of batches (a generator
  function), or any other re-iterable without `__getitem__` (a torch DataLoader): batches as
  they come, in their own order;
- anything else with `__len__` and `__getitem__` (a torch Dataset, a Hugging Face Dataset, your
  own class): samples, batched and shuffled by anygrad.
torch and datasets are never imported: their objects are recognised by what they do.

Indexable data keeps anygrad's determinism: batch k of epoch e depends on (seed, e, k) alone, so a
run resumes mid-epoch on the same batches. An iterable's batches are whatever it yields, so a run
over one resumes at an epoch boundary (see anygrad.train).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from ..batch import DEFAULT_TARGET_KEYS, Layout, batch_size_of, collate, is_torch_tensor, split, to_tree
from ..errors import ConfigError, DataError
from ..torchfile.npzfile import map_npy
from .loader import BatchSource, DataLoader, Samples, Transform


def load_npy(path: str | PathLike) -> np.ndarray:
    """A .npy file mapped into memory (read lazily, batch by batch)."""
    p = Path(path).expanduser()
    if p.suffix.lower() != ".npy":
        raise DataError(f"{p}: a file given as data must be a .npy array (np.save); for other files use a "
                        "dataset (anygrad.data.get_dataset, --dataset npz/tokens/...)")
    if not p.exists():
        raise DataError(f"{p}: no such file")
    return map_npy(p, DataError)


def _arrays(tree: Any, where: str) -> Any:
    """Arrays, memmaps, .npy paths and tensors (in dicts/tuples) as numpy arrays, files mapped."""
    if isinstance(tree, (str, PathLike)):
        return load_npy(tree)
    if isinstance(tree, np.ndarray):
        if tree.ndim == 0:
            raise DataError(f"{where}: a single number, not an array of samples")
        return tree
    if isinstance(tree, Mapping):
        return {str(k): _arrays(v, f"{where} '{k}'") for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_arrays(v, f"{where}[{i}]") for i, v in enumerate(tree))
    out = to_tree(tree, where)  # tensors, lists of numbers
    if isinstance(out, np.ndarray) and out.ndim == 0:
        raise DataError(f"{where}: a single number, not an array of samples")
    return out


def _is_arrays(value: Any) -> bool:
    if isinstance(value, (np.ndarray, str, PathLike)) or is_torch_tensor(value):
        return True
    if isinstance(value, Mapping):
        return bool(value) and all(_is_arrays(v) for v in value.values())
    if isinstance(value, tuple):
        return bool(value) and all(_is_arrays(v) for v in value)
    return False


def _name(data: Any) -> str:
    t = type(data)
    return f"{t.__module__.split('.')[0]}.{t.__qualname__}" if t.__module__ != "builtins" else t.__name__


class DatasetSamples(Samples):
    """An indexable dataset: `dataset[i]` is one sample (a tuple, a dict or an array), collated
    into batches of the same structure. A `__getitems__` method (torch and Hugging Face datasets
    have one) fetches a batch's samples in one call. Wrap a list of samples in it to have anygrad
    batch them (a plain list is read as a list of batches). `layout` None: the run's."""

    def __init__(self, dataset: Any, layout: Layout | None = None):
        self.dataset, self.layout = dataset, layout
        try:
            self.n = len(dataset)
        except TypeError as e:
            raise DataError(f"{_name(dataset)}: an indexable dataset needs a length ({e})") from None
        self.what = f"the dataset ({_name(dataset)}, {self.n:,} samples)"

    def __len__(self) -> int:
        return self.n

    def take(self, indices: np.ndarray) -> tuple[Any, Any]:
        idx = [int(i) for i in indices]
        getitems = getattr(self.dataset, "__getitems__", None)
        try:
            items = list(getitems(idx)) if getitems is not None else [self.dataset[i] for i in idx]
        except DataError:
            raise
        except Exception as e:  # the user's __getitem__ failed: say which batch, keep the cause
            raise DataError(f"{self.what}: reading items {idx[0]}..{idx[-1]} failed: {type(e).__name__}: "
                            f"{e}") from e
        if len(items) != len(idx):
            raise DataError(f"{self.what}: __getitems__ returned {len(items)} samples for {len(idx)} indices")
        return collate(items, idx, self.layout or Layout())


class IterableBatches(BatchSource):
    """Batches from a re-iterable (a list, a torch DataLoader) or a zero-argument callable that
    returns a fresh iterator each epoch (a generator function), in the order they come: anygrad's
    shuffle and seed do not reach them (a torch DataLoader shuffles with its own generator). One
    without a length (a generator function) is run once more, at the start, to count its batches,
    which progress, schedules and checkpoints need."""

    positionable = False

    def __init__(self, data: Any, layout: Layout, prefetch: bool = False, what: str | None = None,
                 once: bool = False):
        # once: read a single time (evaluate, predict), so a one-shot iterator is fine
        self.data, self.layout, self.prefetch, self.once = data, layout, prefetch, once
        self.factory = callable(data) and not hasattr(data, "__iter__")
        self.what = what or (f"the generator function {getattr(data, '__name__', _name(data))}()" if self.factory
                             else f"the iterable of batches ({_name(data)})")
        self._len: int | None = None
        if not self.factory:
            try:
                self._len = len(data)
            except TypeError:  # an iterable of unknown length
                self._len = None
        self.epoch = 0

    def __len__(self) -> int:
        if self._len is None:  # count once: a generator function, or a DataLoader over an IterableDataset
            self._len = sum(1 for _ in self._raw(0))
        return self._len

    def _raw(self, epoch: int) -> Iterator[Any]:
        source = self.data() if self.factory else self.data
        try:
            it = iter(source)
        except TypeError:
            raise DataError(f"{self.what} returned {type(source).__name__}, which is not iterable; it must "
                            "return an iterator of batches (write it as a generator: yield x, y)") from None
        if it is source and not self.factory and not self.once:
            raise DataError(f"{self.what} is a one-shot iterator (a generator object), which the second epoch "
                            "would find empty; pass the generator function itself (fit(make_batches), not "
                            "fit(make_batches())), or a list")
        return it

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[Any, Any]]:
        for i, batch in enumerate(self._raw(epoch)):
            where = f"batch {i} of {self.what}"
            x, y = split(batch, where, self.layout)
            batch_size_of(x, y, where)
            yield x, y


def _iterable(data: Any) -> bool:
    if isinstance(data, (list, tuple)) and not _is_arrays(data):
        return True
    if hasattr(data, "__iter__") and not hasattr(data, "__getitem__"):
        return True
    if callable(data) and not hasattr(data, "__getitem__") and not isinstance(data, type):
        try:
            params = inspect.signature(data).parameters.values()
        except (TypeError, ValueError):
            return True
        return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
    return False


def batch_source(data: Any, *, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 transform: Transform | None = None, prefetch: bool = False, layout: Layout | None = None,
                 role: str = "training data") -> BatchSource:
    """A BatchSource over `data` (see the module's docstring for what is recognised)."""
    layout = layout or Layout()
    if isinstance(data, BatchSource):
        if prefetch:
            data.prefetch = True
        return data
    if isinstance(data, Samples):
        if isinstance(data, DatasetSamples) and data.layout is None:
            data.layout = layout
        return DataLoader(data, None, batch_size, shuffle, seed, drop_last, transform, prefetch)
    if isinstance(data, (str, PathLike)):
        data = load_npy(data)
    if isinstance(data, tuple) and _is_arrays(data):
        if len(data) == 2:
            x, y = _arrays(data[0], f"{role} inputs"), _arrays(data[1], f"{role} targets")
        elif len(data) == 1:
            x, y = _arrays(data[0], f"{role} inputs"), None
        else:
            raise DataError(f"{role}: a tuple of {len(data)} arrays; give (inputs, targets), with several inputs "
                            "as a tuple or a dict inside: ((ids, mask), labels)")
        if y is None and layout.needs_targets:
            raise DataError(f"{role}: inputs without targets, which the loss needs; give (inputs, targets)")
        return DataLoader(x, y, batch_size, shuffle, seed, drop_last, transform, prefetch)
    if isinstance(data, np.ndarray) or is_torch_tensor(data):
        if layout.needs_targets:
            raise DataError(f"{role}: one array, but the loss needs targets too; give (inputs, targets)")
        return DataLoader(_arrays(data, f"{role}"), None, batch_size, shuffle, seed, drop_last, transform, prefetch)
    if isinstance(data, Mapping):
        raise DataError(f"{role}: a dict; give (inputs, targets) with the dict inside, as ({{'ids': ids, 'mask': "
                        "mask}, labels), or a dataset/iterable of dict samples")
    if _is_iterable_dataset(data):
        raise DataError(f"{role}: a torch IterableDataset yields single samples; wrap it in "
                        "torch.utils.data.DataLoader(dataset, batch_size=...) to give batches")
    if _iterable(data):
        if transform is not None:
            raise ConfigError(f"{role}: per-batch transforms apply to arrays and indexable datasets; transform "
                              "the batches in your iterable instead")
        return IterableBatches(data, layout, prefetch)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return DataLoader(DatasetSamples(data, layout), None, batch_size, shuffle, seed, drop_last, transform,
                          prefetch)
    raise DataError(f"{role}: cannot read {_name(data)} as data; give (inputs, targets) arrays, .npy files, an "
                    "indexable dataset (__len__ and __getitem__: a torch or Hugging Face Dataset), a list of "
                    "batches, a generator function, or a torch DataLoader")


def one_pass(data: Any, *, batch_size: int, loss_in_graph: bool, with_targets: bool,
             role: str) -> Iterator[tuple[Any, Any]]:
    """The batches of `data` once, in order and unshuffled: any form `batch_source` reads, and a
    one-shot iterator too, laid out as fit lays them out (layout_for); `with_targets` False
    (predict): targets are not required. An anygrad BatchSource gives its current epoch's batches
    and keeps its epoch (evaluating on the training loader must not change the next epoch's
    shuffle). What `Model.evaluate` and `Model.predict` read (the facade operation 'one_pass')."""
    layout = layout_for(loss_in_graph)
    if not with_targets:
        layout = replace(layout, needs_targets=False)
    if isinstance(data, BatchSource):
        return data.batches(data.epoch)
    if not isinstance(data, (list, tuple)) and hasattr(data, "__next__") and iter(data) is data:
        return IterableBatches(data, layout, once=True).batches(0)
    source = batch_source(data, batch_size=batch_size, shuffle=False, layout=layout, role=role)
    return source.batches(source.epoch)


def _is_iterable_dataset(data: Any) -> bool:
    return any(c.__name__ == "IterableDataset" and c.__module__.startswith("torch") for c in type(data).__mro__)


def layout_for(loss_in_graph: bool, target_keys: Any = None) -> Layout:
    """The Layout of a run: `target_keys` None means the defaults (none when the graph computes
    the loss, whose labels are ordinary inputs)."""
    if target_keys is None:
        keys = () if loss_in_graph else DEFAULT_TARGET_KEYS
    elif isinstance(target_keys, str):
        keys = (target_keys,)
    else:
        keys = tuple(target_keys)
    return Layout(keys, needs_targets=not loss_in_graph)


FactoryOrIterable = Callable[[], Iterator[Any]]
