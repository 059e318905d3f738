"""Shape and indexing functions (reshape/view, flatten, transpose, permute, unsqueeze, squeeze,
cat, basic indexing): the torch.* functions behind a traced Tensor's shape methods, and what the
other families reshape with.
"""
from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import AnygradError
from ..tracing import Tensor
from ._util import _axes_const, _axis, _slice, _t


def reshape(x, *shape) -> Tensor:
    x = _t(x)
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    spec = x.tracer.reshape_spec(x, shape)
    return x.tracer.op("Reshape", [x, x.tracer.const(np.array(spec, np.int64), np.int64)])


view = reshape


def flatten(x, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    x = _t(x)
    rank = len(x.shape)
    s, e = _axis(start_dim, rank) if rank else 0, _axis(end_dim, rank) if rank else 0
    if s == 1 and e == rank - 1:
        return x._unary("Flatten", axis=1)  # what the exporter emits for torch.flatten(x, 1)
    shape = x.shape
    merged = 1
    for d in shape[s : e + 1]:
        merged = d * merged
    return reshape(x, *(tuple(shape[:s]) + (merged,) + tuple(shape[e + 1 :])))


def transpose(x, dim0: int, dim1: int) -> Tensor:
    x = _t(x)
    perm = list(range(len(x.shape)))
    a, b = _axis(dim0, len(perm)), _axis(dim1, len(perm))
    perm[a], perm[b] = perm[b], perm[a]
    return x._unary("Transpose", perm=perm)


def permute(x, *dims) -> Tensor:
    x = _t(x)
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return x._unary("Transpose", perm=[_axis(d, len(x.shape)) for d in dims])


def unsqueeze(x, dim: int) -> Tensor:
    x = _t(x)
    return x.tracer.op("Unsqueeze", [x, _axes_const(x, [_axis(dim, len(x.shape) + 1)])])


def squeeze(x, dim: int | None = None) -> Tensor:
    x = _t(x)
    if dim is None:
        return x.tracer.op("Squeeze", [x])
    axis = _axis(dim, len(x.shape))
    if x.shape[axis] != 1:  # PyTorch leaves a dim that is not 1 alone
        return x
    return x.tracer.op("Squeeze", [x, _axes_const(x, [axis])])


def cat(tensors: Sequence[Any], dim: int = 0) -> Tensor:
    ts = [_t(t) for t in tensors]
    return ts[0].tracer.op("Concat", ts, axis=_axis(dim, len(ts[0].shape)))


def getitem(x: Tensor, index: Any) -> Tensor:
    """Basic indexing: ints, slices (step > 0), None and Ellipsis, as Slice/Squeeze/Unsqueeze."""
    index = index if isinstance(index, tuple) else (index,)
    if builtins.sum(i is Ellipsis for i in index) > 1:
        raise AnygradError("an index can have only one Ellipsis")
    rank = len(x.shape)
    used = builtins.sum(1 for i in index if i is not None and i is not Ellipsis)
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (rank - used) + index[k + 1 :]
    starts, ends, axes, steps, squeeze_axes, unsqueeze_at = [], [], [], [], [], []
    axis = 0
    for pos, i in enumerate(index):
        if i is None:
            unsqueeze_at.append(pos)
            continue
        if isinstance(i, (int, np.integer)):
            starts.append(int(i))
            ends.append(int(i) + 1 if int(i) != -1 else np.iinfo(np.int64).max)
            steps.append(1)
            axes.append(axis)
            squeeze_axes.append(axis)
        elif isinstance(i, slice):
            if i != slice(None):
                step = 1 if i.step is None else int(i.step)
                if step <= 0:
                    raise AnygradError("slices with a step <= 0 are not supported while tracing")
                starts.append(0 if i.start is None else int(i.start))
                ends.append(np.iinfo(np.int64).max if i.stop is None else int(i.stop))
                steps.append(step)
                axes.append(axis)
        else:
            raise AnygradError(
                f"indexing a traced tensor with {type(i).__name__} is not supported "
                "(ints, slices, None and ... are)"
            )
        axis += 1
    if axis > rank:
        raise AnygradError(f"too many indices for a tensor of rank {rank}")
    y = x
    if axes:
        y = _slice(x, starts, ends, axes, steps)
    if squeeze_axes:
        y = y.tracer.op("Squeeze", [y, _axes_const(y, squeeze_axes)])
    if unsqueeze_at:
        # positions of None in the result: count the kept dims before each
        out_pos, kept = [], 0
        for pos, i in enumerate(index):
            if i is None:
                out_pos.append(kept + len(out_pos))
            elif not isinstance(i, (int, np.integer)):
                kept += 1
        y = y.tracer.op("Unsqueeze", [y, _axes_const(y, out_pos)])
    return y
