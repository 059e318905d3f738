"""Batches over in-memory arrays, reshuffled each epoch from (seed, epoch) alone.

The permutation comes from anygrad's counter-based generator, so epoch e of a run with seed s is
the same on every machine and after a resume, without carrying RNG state around.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import DataError
from ..rng import key, mix32

SHUFFLE_SALT = 0x5348  # keeps shuffles independent of dropout masks drawn with the same seed


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(n) determined by (seed, epoch)."""
    bits = mix32(np.arange(n, dtype=np.uint32) ^ key(seed, epoch, SHUFFLE_SALT))
    return np.argsort(bits, kind="stable")


class DataLoader:
    """Iterate (x, y) batches. Each `iter()` is one epoch; `epoch` counts them (settable, to resume).

    The last batch is smaller when batch_size does not divide the data, unless drop_last.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        if len(x) != len(y):
            raise DataError(f"{len(x)} inputs but {len(y)} targets")
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {batch_size}")
        self.x, self.y = x, y
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.epoch = 0

    def __len__(self) -> int:
        n, b = len(self.x), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        order = permutation(len(self.x), self.seed, self.epoch) if self.shuffle else None
        self.epoch += 1
        for i in range(len(self)):
            if order is None:
                sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
                yield self.x[sl], self.y[sl]
            else:
                idx = order[i * self.batch_size:(i + 1) * self.batch_size]
                yield self.x[idx], self.y[idx]
