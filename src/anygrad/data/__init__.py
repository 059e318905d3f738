"""Datasets and batching: IDX files, MNIST (read, cached, downloaded), a seeded DataLoader.

More datasets (fashion-mnist, cifar-10, .npz, image folders) through `get_dataset`, batch
transforms declared in a `DataConfig`."""
from .datasets import DATASETS, DataConfig, Dataset, dataset_names, get_dataset, split
from .idx import parse_idx, read_idx, write_idx
from .loader import DataLoader, permutation
from .mnist import MIRRORS, MNIST_FILES, MnistData, default_cache_dir, load_mnist, normalize
from .transforms import BatchTransform, augment, normalize_images

__all__ = [
           "DATASETS",
           "MIRRORS",
           "MNIST_FILES",
           "BatchTransform",
           "DataConfig",
           "DataLoader",
           "Dataset",
           "MnistData",
           "augment",
           "dataset_names",
           "default_cache_dir",
           "get_dataset",
           "load_mnist",
           "normalize",
           "normalize_images",
           "parse_idx",
           "permutation",
           "read_idx",
           "split",
           "write_idx",
]
