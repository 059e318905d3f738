"""Each rank's share of every global batch, with torch.utils.data.DistributedSampler's semantics.

The epoch's order is anygrad's seeded permutation of (seed, epoch) (what set_epoch selects), padded
by repeating its head until it divides among the ranks (or cut, with drop_last); rank r takes
positions r, r + W, r + 2W, ... and batches them by batch_size / W. Global batch k is then the k-th
block of batch_size positions of that order: the same samples one process would train on at
batch_size, so the trajectory does not depend on the number of ranks.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..data.loader import DataLoader, permutation
from ..errors import ConfigError


def shard_indices(n: int, rank: int, world: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                  drop_last: bool = False) -> np.ndarray:
    """The sample indices rank `rank` of `world` visits in `epoch`, as DistributedSampler's."""
    order = permutation(n, seed, epoch) if shuffle else np.arange(n)
    if drop_last:
        total = (n // world) * world
        order = order[:total]
    else:
        total = -(-n // world) * world
        if total > n:  # DistributedSampler repeats the head (as often as needed) to fill the tail
            order = np.concatenate([order] + [order] * ((total - n) // max(n, 1)) + [order[:(total - n) % max(n, 1)]])
            order = order[:total]
    return order[rank:total:world]


class ShardedLoader(DataLoader):
    """A DataLoader over this rank's share: batch_size is the global batch, each rank gets
    batch_size / world of it. `epoch` is DistributedSampler.set_epoch (the trainer sets it)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, rank: int, world: int, **options):
        if batch_size % world:
            raise ConfigError(f"--batch-size {batch_size} is the global batch and must divide among the {world} "
                              f"ranks; use a multiple of {world}")
        super().__init__(x, y, batch_size // world, **options)
        self.rank, self.world, self.global_batch = rank, world, batch_size

    def _indices(self, epoch: int) -> np.ndarray:
        return shard_indices(len(self.samples), self.rank, self.world, shuffle=self.shuffle, seed=self.seed,
                             epoch=epoch, drop_last=self.drop_last)

    def __len__(self) -> int:
        n = len(self.samples)
        n = n // self.world if self.drop_last else -(-n // self.world)
        b = self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[Any, Any]]:
        order = self._indices(epoch)
        for i in range(start, len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            x, y = self.samples.take(idx)
            yield (self.transform(x, idx, epoch) if self.transform else x), y
