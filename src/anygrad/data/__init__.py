"""Datasets and batching: IDX files, MNIST (read, cached, downloaded), a seeded DataLoader.

More datasets (fashion-mnist, cifar-10, .npz, image folders) through `get_dataset`, batch
transforms declared in a `DataConfig`; the user's own data (indexable datasets, iterables of
batches, memory-mapped files) through `batch_source`; token files through `TokenWindows`."""
from .datasets import DATASETS, DataConfig, Dataset, dataset_names, get_dataset, split
from .idx import parse_idx, read_idx, write_idx
from .loader import ArraySamples, BatchSource, DataLoader, Samples, permutation
from .mnist import MIRRORS, MNIST_FILES, MnistData, default_cache_dir, load_mnist, normalize
from .sources import DatasetSamples, IterableBatches, batch_source, load_npy, one_pass
from ..batch import DEFAULT_TARGET_KEYS, Layout
from .tokens import TokenBlocks, TokenWindows, read_tokens, token_split
from .transforms import BatchTransform, augment, normalize_images
from .. import facade

# Model.evaluate and Model.predict read data sources through anygrad.facade (the Model sits below data)
facade.register("one_pass", one_pass)

__all__ = [
           "DATASETS",
           "DEFAULT_TARGET_KEYS",
           "MIRRORS",
           "MNIST_FILES",
           "ArraySamples",
           "BatchSource",
           "BatchTransform",
           "DataConfig",
           "DataLoader",
           "Dataset",
           "DatasetSamples",
           "IterableBatches",
           "Layout",
           "MnistData",
           "Samples",
           "TokenBlocks",
           "TokenWindows",
           "augment",
           "batch_source",
           "dataset_names",
           "default_cache_dir",
           "get_dataset",
           "load_mnist",
           "load_npy",
           "normalize",
           "normalize_images",
           "one_pass",
           "parse_idx",
           "permutation",
           "read_idx",
           "read_tokens",
           "split",
           "token_split",
           "write_idx",
]
