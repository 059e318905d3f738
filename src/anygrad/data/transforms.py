"""Per-batch transforms: normalisation and augmentation, declared as data and seeded by position.

A random choice for a sample depends only on (seed, epoch, sample index), never on a generator's
state, so epoch e of a run is the same on every machine, with or without prefetching, and after
a resume. Augmentation works on the stored images (uint8 or float, NCHW) before normalisation, as
torchvision does (padding is black: 0 in pixel units).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..rng import key, mix32

AUGMENT_SALT = 0x4155  # independent of the shuffle and of dropout drawn with the same seed


def normalize_images(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """NCHW images -> float32 (x - mean) / std per channel; uint8 pixels are scaled to [0, 1] first."""
    out = np.asarray(x, np.float32)
    if x.dtype == np.uint8:
        out = out / np.float32(255.0)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    m = np.asarray(mean, np.float32).reshape(shape)
    s = np.asarray(std, np.float32).reshape(shape)
    return ((out - m) / s).astype(np.float32, copy=False)


def _draws(seed: int, epoch: int, indices: np.ndarray, count: int) -> np.ndarray:
    """`count` 32-bit random words per sample index: (len(indices), count)."""
    idx = np.asarray(indices, np.uint32)[:, None] * np.uint32(count) + np.arange(count, dtype=np.uint32)
    with np.errstate(over="ignore"):
        return mix32(idx ^ key(seed, epoch, AUGMENT_SALT))


def augment(x: np.ndarray, indices: np.ndarray, epoch: int, seed: int, crop_padding: int = 0,
            hflip: bool = False) -> np.ndarray:
    """Random crop after zero padding and/or random horizontal flip of NCHW images, one gather."""
    if not crop_padding and not hflip:
        return x
    n, _, h, w = x.shape
    words = _draws(seed, epoch, indices, 3)
    p = crop_padding
    dy = (words[:, 0] % np.uint32(2 * p + 1)).astype(np.int64) if p else np.zeros(n, np.int64)
    dx = (words[:, 1] % np.uint32(2 * p + 1)).astype(np.int64) if p else np.zeros(n, np.int64)
    flip = (words[:, 2] >> np.uint32(31)).astype(bool) if hflip else np.zeros(n, bool)
    padded = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p))) if p else x
    cols = np.where(flip[:, None], np.arange(w)[::-1], np.arange(w)) + dx[:, None]
    rows = np.arange(h)[None, :] + dy[:, None]
    return padded[np.arange(n)[:, None, None, None], np.arange(x.shape[1])[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]


@dataclass
class BatchTransform:
    """What the DataLoader applies to each batch of stored images: augmentation (training only)
    then normalisation. Called as transform(x, indices, epoch)."""

    mean: tuple[float, ...] | None = None  # None: no normalisation (uint8 pixels only scaled to [0, 1])
    std: tuple[float, ...] | None = None
    crop_padding: int = 0
    hflip: bool = False
    seed: int = 0
    to_float: bool = True  # False: without normalisation, keep the stored dtype (uint8 for the device)

    def __post_init__(self) -> None:
        if self.crop_padding < 0:
            raise ConfigError(f"crop padding must be 0 or positive, got {self.crop_padding}")
        if (self.mean is None) != (self.std is None):
            raise ConfigError("give both mean and std for normalisation, or neither")
        if self.std is not None and any(s <= 0 for s in self.std):
            raise ConfigError(f"std must be positive per channel, got {list(self.std)}")

    def __call__(self, x: np.ndarray, indices: np.ndarray, epoch: int) -> np.ndarray:
        if x.ndim == 4:
            x = augment(x, indices, epoch, self.seed, self.crop_padding, self.hflip)
        if self.mean is not None:
            return normalize_images(x, self.mean, self.std)
        if not self.to_float:
            return x
        return np.asarray(x, np.float32) / np.float32(255.0) if x.dtype == np.uint8 else x
