"""Internal metric ops the step programs accumulate on the device (no readback per step)."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop


def _count_top_k_infer(node: Node, ins):
    out, target = ins
    k = int(node.attr("k", 5))
    if out.rank < 2 or tuple(target.shape) != (out.shape[0],) + tuple(out.shape[2:]):
        raise ShapeError(f"{node.label}: top-{k} accuracy needs output (N, C, ...) and class-index targets "
                         f"(N, ...); got {tuple(out.shape)} and {tuple(target.shape)}")
    if k < 1:
        raise ShapeError(f"{node.label}: k must be at least 1, got {k}")
    return [TensorInfo(np.dtype(np.float32), ())]


def _count_top_k(node: Node, ins):
    out, target = ins
    return count_top_k(out, target, int(node.attr("k", 5)))


def count_top_k(out: np.ndarray, target: np.ndarray, k: int) -> np.ndarray:
    """Samples whose target class is among the k highest scores. A target tied with other
    classes counts as in the top k when fewer than k classes score strictly higher (so the
    result never depends on how a sort breaks ties, which differs between devices)."""
    idx = np.expand_dims(np.asarray(target, np.int64), 1)
    valid = (idx >= 0) & (idx < out.shape[1])
    picked = np.take_along_axis(out, np.where(valid, idx, 0), axis=1)
    higher = np.count_nonzero(out > picked, axis=1)
    hit = (higher < k) & valid[:, 0]
    return np.asarray(np.count_nonzero(hit), np.float32)


# CountTopK(output (N, C, ...), target (N, ...) int) -> float32 scalar count, attribute k.
defop("CountTopK", infer=_count_top_k_infer, forward=_count_top_k, internal=True, foldable=False, nondiff=[0, 1])
