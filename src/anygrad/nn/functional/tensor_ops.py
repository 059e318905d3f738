"""Reductions (sum, mean, amax), arithmetic (matmul, add, exp, log, sqrt), constants and
onnx_op, the escape hatch to any registered op: the torch.* functions that are not
torch.nn.functional, which traced Tensor methods and the losses and normalisations build on.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import AnygradError
from ...ir.registry import get_op
from ..tracing import Operand, Tensor, as_tensor
from ._util import _axes_const, _axis, _t


def _reduce_axes(x: Tensor, dim) -> list[int]:
    rank = len(x.shape)
    if dim is None:
        return list(range(rank))
    dims = [dim] if isinstance(dim, (int, np.integer)) else list(dim)
    return sorted(_axis(int(d), rank) for d in dims)


def sum(x, dim=None, keepdim: bool = False) -> Tensor:
    x = _t(x)
    return x.tracer.op("ReduceSum", [x, _axes_const(x, _reduce_axes(x, dim))], keepdims=int(keepdim))


def mean(x, dim=None, keepdim: bool = False) -> Tensor:
    x = _t(x)  # opset 17: ReduceMean takes its axes as an attribute
    return x._unary("ReduceMean", axes=_reduce_axes(x, dim), keepdims=int(keepdim))


def amax(x, dim=None, keepdim: bool = False) -> Tensor:
    x = _t(x)
    return x._unary("ReduceMax", axes=_reduce_axes(x, dim), keepdims=int(keepdim))


def matmul(a, b) -> Tensor:
    return _t(a) @ b


def add(a, b) -> Tensor:
    return a + b if isinstance(a, Operand) else _t(b).__radd__(a)


def exp(x) -> Tensor:
    return _t(x)._unary("Exp")


def log(x) -> Tensor:
    return _t(x)._unary("Log")


def sqrt(x) -> Tensor:
    return _t(x)._unary("Sqrt")


def constant(value: Any, like) -> Tensor:
    """A constant tensor in the traced graph (dtype of `like` for Python numbers)."""
    return as_tensor(value, _t(like))


def onnx_op(op: str, *inputs: Any, n_out: int = 1, **attrs: Any) -> Tensor | list[Tensor]:
    """Any registered op by its ONNX name and attributes: the escape hatch for ops that have no
    PyTorch-style function here (`anygrad codegen` emits it for those). Inputs are tensors,
    numpy arrays (constants, dtype kept) or None (an absent optional input); n_out > 1 returns
    a list."""
    if get_op(op) is None:
        raise AnygradError(f"onnx_op: '{op}' is not an op anygrad knows")
    like = next((i._t() for i in inputs if isinstance(i, Operand)), None)
    tensors = [None if i is None else as_tensor(i, like) for i in inputs]
    tracer = like.tracer if like is not None else next(t.tracer for t in tensors if t is not None)
    outs = tracer.ops(op, tensors, n_out, **attrs)
    return outs[0] if n_out == 1 else outs
