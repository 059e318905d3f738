"""Batches over in-memory arrays, reshuffled each epoch from (seed, epoch) alone.

The permutation comes from anygrad's counter-based generator, so epoch e of a run with seed s is
the same on every machine and after a resume, without carrying RNG state around.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

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


class DataLoader:
    """Iterate (x, y) batches. Each `iter()` is one epoch; `epoch` counts them (settable, to resume).

    The last batch is smaller when batch_size does not divide the data, unless drop_last.
    `transform` is applied to each batch's inputs (see anygrad.data.transforms); with `prefetch`, a
    background thread prepares the next batches while the device works on this one (same order,
    same values: a batch depends only on (seed, epoch, position)).
    """

    PREFETCH_DEPTH = 2

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, transform: Transform | None = None, prefetch: bool = False):
        if len(x) != len(y):
            raise DataError(f"{len(x)} inputs but {len(y)} targets")
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {batch_size}")
        self.x, self.y = x, y
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.epoch = 0
        self.transform, self.prefetch = transform, prefetch

    def __len__(self) -> int:
        n, b = len(self.x), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        epoch = self.epoch
        self.epoch += 1
        batches = self._batches(epoch)
        return _prefetched(batches, self.PREFETCH_DEPTH) if self.prefetch else batches

    def _batches(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        order = permutation(len(self.x), self.seed, epoch) if self.shuffle else None
        for i in range(len(self)):
            if order is None:
                sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
                x, y = self.x[sl], self.y[sl]
                idx = np.arange(sl.start, sl.start + len(x)) if self.transform else None
            else:
                idx = order[i * self.batch_size:(i + 1) * self.batch_size]
                x, y = self.x[idx], self.y[idx]
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
