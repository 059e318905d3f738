"""Helpers every family of anygrad.nn.functional shares: an argument as a traced Tensor, int
arguments checked per spatial dim, a dim checked against a rank, constant axes and ONNX Slice.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import AnygradError, ConfigError
from ..tracing import Operand, Tensor


def _t(x: Any) -> Tensor:
    if not isinstance(x, Operand):
        raise AnygradError(f"expected a tensor, got {type(x).__name__}")
    return x._t()


def _ints(v: int | Sequence[int], n: int, what: str) -> list[int]:
    if isinstance(v, (int, np.integer)):
        return [int(v)] * n
    v = [int(i) for i in v]
    if len(v) != n:
        raise ConfigError(f"{what} must be an int or {n} ints, got {v}")
    return v


def _axis(dim: int, rank: int) -> int:
    if not -rank <= dim < rank:
        raise AnygradError(f"dim {dim} is out of range for a tensor of rank {rank}")
    return dim % rank


def _axes_const(x: Tensor, axes: Sequence[int]) -> Tensor:
    return x.tracer.const(np.array(list(axes), np.int64), np.int64)


def _slice(x: Tensor, starts: list[int], ends: list[int], axes: list[int], steps: list[int] | None = None) -> Tensor:
    """ONNX Slice over `axes` (steps only when given: the input is optional)."""
    consts = [starts, ends, axes] + ([steps] if steps is not None else [])
    return x.tracer.op("Slice", [x] + [x.tracer.const(np.array(c, np.int64), np.int64) for c in consts])
