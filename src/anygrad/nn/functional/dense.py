"""The dense layers' functions: linear (Gemm, or MatMul + Add) and embedding (a Gather from the
table, with PyTorch's padding_idx).
"""
from __future__ import annotations

import numpy as np

from ...errors import AnygradError, ConfigError
from ..tracing import Operand, Tensor, as_tensor
from ._util import _t
from .shape import unsqueeze


def linear(x, weight, bias=None) -> Tensor:
    """y = x W^T + b; Gemm for 2-D input (as the exporter), MatMul + Add otherwise."""
    x, w = _t(x), _t(weight)
    if len(x.shape) == 2:
        ins = [x, w] + ([_t(bias)] if bias is not None else [])
        return x.tracer.op("Gemm", ins, alpha=1.0, beta=1.0, transB=1)
    y = x @ w.tracer.op("Transpose", [w], perm=[1, 0])
    return y + bias if bias is not None else y


def _embedding_options(who: str, max_norm: float | None, scale_grad_by_freq: bool) -> None:
    """Refuse the Embedding options the graph cannot express."""
    if max_norm is not None or scale_grad_by_freq:
        option = "max_norm" if max_norm is not None else "scale_grad_by_freq"
        raise ConfigError(f"{who}: {option} is not supported (it rewrites the weights or gradients "
                          "outside the graph); leave it at its default")


def _padding_row(who: str, padding_idx: int, rows: int) -> int:
    """padding_idx as a row of a table of `rows` (a negative one counts from the end, as in PyTorch)."""
    if not -rows <= padding_idx < rows:
        raise ConfigError(f"{who}: padding_idx {padding_idx} is outside the {rows} embeddings")
    return padding_idx % rows


def embedding(indices, weight, padding_idx: int | None = None, max_norm: float | None = None,
              norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """Gather(weight, indices). With padding_idx, that row gets no gradient (as in PyTorch):
    the lookup is Where(indices == padding_idx, 0, row), which reads the padding row as the
    zeros PyTorch initialises it to; a Parameter whose padding row is not zero is refused, as
    the graph could not give its values. `sparse` only changes how PyTorch stores gradients."""
    _embedding_options("embedding", max_norm, scale_grad_by_freq)
    w = _t(weight)
    idx = _t(indices) if isinstance(indices, Operand) else as_tensor(np.asarray(indices, np.int64), w)
    out = w.tracer.op("Gather", [w, idx], axis=0)
    if padding_idx is None:
        return out
    padding_idx = _padding_row("embedding", padding_idx, int(w.shape[0]))
    data = getattr(weight, "data", None)  # a Parameter's values (a traced Tensor has none)
    if isinstance(data, np.ndarray) and np.any(data[padding_idx] != 0):
        raise AnygradError(
            f"embedding: row {padding_idx} (padding_idx) of the weight is not zero; anygrad keeps the "
            "padding row at zero, as PyTorch initialises it. Zero it before tracing "
            "(module.weight.data[padding_idx] = 0) or drop padding_idx"
        )
    is_pad = unsqueeze(w.tracer.op("Equal", [idx, as_tensor(np.array(padding_idx, idx.dtype), idx)]), -1)
    return w.tracer.op("Where", [is_pad, as_tensor(0.0, w), out])
