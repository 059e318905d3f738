"""A tiny synthetic MNIST folder for CLI tests: the four standard IDX files, learnable classes."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from anygrad.data import write_idx
from anygrad.data.mnist import MNIST_FILES


def write_tiny_mnist(folder: Path, n_train: int = 40, n_test: int = 16, learnable: bool = True) -> Path:
    """n_train / n_test 28x28 images; with `learnable` the class is the brightness band (a model
    can fit it in a few steps), else the pixels are noise."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        if learnable:
            x = (rng.integers(0, 20, (n, 28, 28)) + y[:, None, None] * 23).astype(np.uint8)
        else:
            x = rng.integers(0, 255, (n, 28, 28)).astype(np.uint8)
        write_idx(folder / f"{MNIST_FILES['x_' + split].name}.gz", x)
        write_idx(folder / f"{MNIST_FILES['y_' + split].name}.gz", y)
    return folder
