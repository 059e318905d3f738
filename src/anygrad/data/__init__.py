"""Datasets and batching: IDX files, MNIST (read, cached, downloaded), a seeded DataLoader."""
from .idx import parse_idx, read_idx, write_idx
from .loader import DataLoader, permutation
from .mnist import MNIST_FILES, MIRRORS, MnistData, default_cache_dir, load_mnist, normalize

__all__ = ["parse_idx", "read_idx", "write_idx", "DataLoader", "permutation", "MNIST_FILES", "MIRRORS",
           "MnistData", "default_cache_dir", "load_mnist", "normalize"]
