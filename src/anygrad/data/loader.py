"""Batches over arrays and indexable datasets, reshuffled each epoch from (seed, epoch) alone.

The permutation comes from anygrad's counter-based generator, so epoch e of a run with seed s is
the same on every machine and after a resume, without carrying RNG state around.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..errors import DataError
from ..rng import key, mix32

SHUFFLE_SALT = 0x5348  # keeps shuffles independent of dropout masks drawn with the same seed


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(n) determined by (seed, epoch)."""
    bits = mix32(np.arange(n, dtype=np.uint32) ^ key(seed, epoch, SHUFFLE_SALT))
    return np.argsort(bits, kind="stable")


# transform(x_batch, sample indices, epoch) -> x_batch: augmentation and normalisation per batch
Transform = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


class BatchSource:
    """What the trainer draws batches from: `len()` batches per epoch, the batches of an epoch
    from a given step on (`epoch_batches`), prepared in a background thread with `prefetch`.

    `positionable` sources (arrays, indexable datasets, token windows) make every batch a function
    of (seed, epoch, position), so a run resumes mid-epoch on the very same batches; others (an
    iterable of batches) can only start an epoch from its beginning.
    """

    PREFETCH_DEPTH = 2
    positionable = True
    prefetch = False
    epoch = 0  # the epoch `iter()` gives next (settable, to resume)
    what = "the data"  # how messages name the source

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def n_samples(self) -> int | None:
        """Samples per epoch, where known."""
        return None

    @property
    def sample_shape(self) -> tuple | None:
        """The shape of one sample of a single-array input, where known (for early shape checks)."""
        return None

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[Any, Any]]:
        """The (inputs, targets) batches of `epoch` (0-based), from batch `start` on."""
        raise NotImplementedError

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[tuple[Any, Any]]:
        if start and not self.positionable:
            raise DataError(f"{self.what} cannot start an epoch at batch {start}; only at its beginning")
        batches = self.batches(epoch, start)
        return _prefetched(batches, self.PREFETCH_DEPTH) if self.prefetch else batches

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        epoch = self.epoch
        self.epoch += 1
        return self.epoch_batches(epoch)


class Samples:
    """An indexable set of samples: `len()` and `take(indices) -> (inputs, targets)` batches."""

    what = "the data"

    def __len__(self) -> int:
        raise NotImplementedError

    def take(self, indices: np.ndarray) -> tuple[Any, Any]:
        raise NotImplementedError

    def take_range(self, start: int, stop: int) -> tuple[Any, Any]:
        return self.take(np.arange(start, stop))

    @property
    def sample_shape(self) -> tuple | None:
        return None


def _index(tree: Any, idx: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _index(v, idx) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_index(v, idx) for v in tree)
    if isinstance(tree, np.memmap):
        # Read from the file now (in the prefetch thread, when there is one), in file order.
        if isinstance(idx, slice):
            return np.array(tree[idx])
        order = np.argsort(idx, kind="stable")
        out = np.empty((len(idx),) + tree.shape[1:], tree.dtype)
        out[order] = tree[idx[order]]
        return out
    return tree[idx]


def _lengths(tree: Any) -> list[int]:
    if isinstance(tree, dict):
        return [n for v in tree.values() for n in _lengths(v)]
    if isinstance(tree, tuple):
        return [n for v in tree for n in _lengths(v)]
    return [len(tree)]


class ArraySamples(Samples):
    """Arrays in memory or mapped from files (np.memmap, np.load(mmap_mode='r')): inputs and
    targets are arrays, or dicts/tuples of them, all with the samples along their first axis.
    A mapped file is read batch by batch, so data larger than RAM trains."""

    what = "the arrays"

    def __init__(self, x: Any, y: Any = None):
        lengths = _lengths(x) + ([] if y is None else _lengths(y))
        if len(set(lengths)) > 1:
            if y is not None and len(set(_lengths(x))) == 1 and len(set(_lengths(y))) == 1:
                raise DataError(f"{_lengths(x)[0]} inputs but {_lengths(y)[0]} targets")
            raise DataError(f"the arrays disagree on the number of samples ({', '.join(map(str, lengths))}); "
                            "every input and target array needs one row per sample")
        self.x, self.y = x, y
        self.n = lengths[0]

    def __len__(self) -> int:
        return self.n

    def take(self, indices: np.ndarray) -> tuple[Any, Any]:
        return _index(self.x, indices), None if self.y is None else _index(self.y, indices)

    def take_range(self, start: int, stop: int) -> tuple[Any, Any]:
        sl = slice(start, stop)
        return _index(self.x, sl), None if self.y is None else _index(self.y, sl)

    @property
    def sample_shape(self) -> tuple | None:
        return tuple(self.x.shape[1:]) if isinstance(self.x, np.ndarray) else None


class DataLoader(BatchSource):
    """Iterate (x, y) batches. Each `iter()` is one epoch; `epoch` counts them (settable, to resume).

    `x` and `y` are arrays (or dicts/tuples of arrays, or memory-mapped files); or `x` is any
    `Samples` (an indexable dataset) and `y` is None. The last batch is smaller when batch_size
    does not divide the data, unless drop_last. `transform` is applied to each batch's inputs
    (see anygrad.data.transforms); with `prefetch`, a background thread prepares the next batches
    while the device works on this one (same order, same values: a batch depends only on (seed,
    epoch, position)).
    """

    def __init__(self, x: Any, y: Any, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, transform: Transform | None = None, prefetch: bool = False):
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {batch_size}")
        self.samples = x if isinstance(x, Samples) else ArraySamples(x, y)
        self.what = self.samples.what
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.epoch = 0
        self.transform, self.prefetch = transform, prefetch

    @property
    def x(self) -> Any:  # the arrays, for callers that read them (array data only)
        return getattr(self.samples, "x", None)

    @property
    def y(self) -> Any:
        return getattr(self.samples, "y", None)

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    @property
    def sample_shape(self) -> tuple | None:
        return self.samples.sample_shape

    def __len__(self) -> int:
        n, b = len(self.samples), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[Any, Any]]:
        n, b = len(self.samples), self.batch_size
        order = permutation(n, self.seed, epoch) if self.shuffle else None
        for i in range(start, len(self)):
            if order is None:
                lo, hi = i * b, min((i + 1) * b, n)
                x, y = self.samples.take_range(lo, hi)
                idx = np.arange(lo, hi) if self.transform else None
            else:
                idx = order[i * b:(i + 1) * b]
                x, y = self.samples.take(idx)
            yield (self.transform(x, idx, epoch) if self.transform else x), y


_DONE = object()


def _prefetched(batches: Iterator, depth: int) -> Iterator:
    """Run `batches` in a daemon thread, `depth` ahead; errors re-raise in the consumer; stopping
    early (break, exception) stops the thread."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in batches:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((_DONE, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((_DONE, e))

    thread = threading.Thread(target=produce, name="anygrad-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if item is _DONE:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
