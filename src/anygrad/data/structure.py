"""What a sample or a batch looks like: defined in anygrad.batch, the one module of the batch
structure (the model's inputs by name, and samples as datasets and loaders yield them); these names
stay importable from here."""
from ..batch import (
    DEFAULT_TARGET_KEYS,
    MAX_DEPTH,
    Layout,
    Tree,
    batch_size_of,
    collate,
    describe,
    leaves,
    signature,
    split,
    stack,
    to_tree,
    unwrap_single,
)
from ..batch import is_torch_tensor as is_tensor

__all__ = ["DEFAULT_TARGET_KEYS", "MAX_DEPTH", "Layout", "Tree", "batch_size_of", "collate", "describe", "is_tensor",
           "leaves", "signature", "split", "stack", "to_tree", "unwrap_single"]
