"""Datasets and batching: IDX files, MNIST (read, cached, downloaded), a seeded DataLoader."""
from .idx import parse_idx, read_idx, write_idx
from .loader import DataLoader, permutation
from .mnist import MIRRORS, MNIST_FILES, MnistData, default_cache_dir, load_mnist, normalize

__all__ = [
           "MIRRORS",
           "MNIST_FILES",
           "DataLoader",
           "MnistData",
           "default_cache_dir",
           "load_mnist",
           "normalize",
           "parse_idx",
           "permutation",
           "read_idx",
           "write_idx",
]
