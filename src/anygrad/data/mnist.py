"""MNIST: the four IDX files, read from a folder or from a cache that is filled by downloading.

Files are found as `<name>.gz` or `<name>`; finding and downloading is `remote.locate`'s (the
same for every dataset on the web). This module knows what the files are: their names and md5s,
and what a valid split holds (uint8 28x28 images, one digit label each), which Fashion-MNIST
shares.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from .idx import CACHED_FILE, USERS_FILE, read_idx
from .remote import RemoteFile, RemoteSet, cache_root, locate


@dataclass(frozen=True)
class MnistFile:
    name: str  # standard file name without .gz
    md5: str  # of the official .gz


MNIST_FILES: dict[str, MnistFile] = {
    "x_train": MnistFile("train-images-idx3-ubyte", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    "y_train": MnistFile("train-labels-idx1-ubyte", "d53e105ee54ea40749a09fcbcd1e9432"),
    "x_test": MnistFile("t10k-images-idx3-ubyte", "9fb629c4189551a2d022fa330f9573f3"),
    "y_test": MnistFile("t10k-labels-idx1-ubyte", "ec29112dd5afa0611ce80d1b7f02629c"),
}
MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
MEAN, STD = 0.1307, 0.3081  # the founding example's normalisation (PyTorch's MNIST example)


def idx_set(key: str, files: dict[str, MnistFile], mirrors: Sequence[str], title: str = "") -> RemoteSet:
    """The RemoteSet of four MNIST-style IDX files: `<name>.gz` on the mirrors, either form in a folder."""
    return RemoteSet(key, {role: RemoteFile(f"{f.name}.gz", f.md5, (f.name,)) for role, f in files.items()},
                     tuple(mirrors), title)


def _mnist() -> RemoteSet:
    return idx_set("mnist", MNIST_FILES, MIRRORS, "MNIST")  # built at call time: tests swap MNIST_FILES


@dataclass
class MnistData:
    x_train: np.ndarray  # uint8 (N, 28, 28)
    y_train: np.ndarray  # int64 (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    source: str = ""  # the folder the files came from

    def train(self) -> tuple[np.ndarray, np.ndarray]:
        """Normalised training images (N, 1, 28, 28) float32 and int64 labels."""
        return normalize(self.x_train), self.y_train

    def test(self) -> tuple[np.ndarray, np.ndarray]:
        return normalize(self.x_test), self.y_test


def normalize(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 28, 28) -> float32 (N, 1, 28, 28), (x / 255 - mean) / std."""
    x = np.asarray(images, np.float32) / np.float32(255.0)
    x = (x - np.float32(MEAN)) / np.float32(STD)
    return x.reshape(x.shape[0], 1, *x.shape[1:]).astype(np.float32, copy=False)


def default_cache_dir() -> Path:
    return cache_root() / "mnist"


def default_mirrors() -> list[str]:
    """ANYGRAD_MNIST_MIRRORS (whitespace or comma separated base URLs), else MIRRORS."""
    return _mnist().default_mirrors()


# -- loading -------------------------------------------------------------------------------
def read_split(paths: dict[str, Path], remedy: str, classes: int = 10) -> dict[str, np.ndarray]:
    """The four arrays of an MNIST-style set, checked: uint8 (N, 28, 28) images, N labels in
    0..classes-1 (int64). `remedy`: what to do about a damaged file (idx.USERS_FILE or CACHED_FILE)."""
    arrays = {role: read_idx(path, remedy) for role, path in paths.items()}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        xp, yp = paths[f"x_{split}"], paths[f"y_{split}"]
        if x.ndim != 3 or x.shape[1:] != (28, 28) or x.dtype != np.uint8:
            raise DataError(f"{xp}: expected uint8 images of shape (N, 28, 28), found {x.dtype} {x.shape}")
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f"{yp} holds {y.shape} labels but {xp} holds {len(x)} images")
        if len(y) and (y.min() < 0 or y.max() >= classes):
            raise DataError(f"{yp}: labels must be 0-{classes - 1}, found {int(y.min())}..{int(y.max())}")
        arrays[f"y_{split}"] = y.astype(np.int64)
    return arrays


def load_mnist(data_dir: str | Path | None = None, cache_dir: str | Path | None = None, download: bool = True,
               mirrors: Sequence[str] | None = None, log: Callable[[str], None] | None = None) -> MnistData:
    """Load MNIST as uint8 images and int64 labels.

    With `data_dir`, read the four standard files from it (never downloads). Otherwise use the
    cache (`cache_dir`, default `$ANYGRAD_CACHE/mnist` or `~/.cache/anygrad/mnist`), downloading
    what is missing from `mirrors` when `download` is true.
    """
    paths, folder = locate(_mnist(), data_dir, cache_dir, download, mirrors, log)
    return MnistData(**read_split(paths, USERS_FILE if data_dir is not None else CACHED_FILE), source=str(folder))
