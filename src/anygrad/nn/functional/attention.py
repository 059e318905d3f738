"""scaled_dot_product_attention, composed from MatMul, Softmax and a mask as the exporter writes
it.
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import AnygradError, ConfigError
from ..tracing import Operand, SymInt, Tensor, as_tensor
from ._util import _t
from .activation import softmax
from .normalization import dropout
from .shape import transpose


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """softmax(q k^T * scale + mask) v, composed as the exporter writes it: q and k^T are each
    scaled by sqrt(scale), a boolean mask becomes 0 / -inf added to the scores, is_causal a
    constant lower-triangular one. dropout_p applies a Dropout node (active in training steps
    only, as with `dropout_p=p if self.training else 0` in PyTorch)."""
    q, k, v = _t(query), _t(key), _t(value)
    if enable_gqa:
        raise ConfigError("scaled_dot_product_attention: enable_gqa is not supported; repeat the key/value "
                          "heads to the query's count instead")
    if is_causal and attn_mask is not None:
        raise ConfigError("scaled_dot_product_attention: pass attn_mask or is_causal, not both (as in PyTorch)")
    e = q.shape[-1]
    if isinstance(e, SymInt):
        raise AnygradError("scaled_dot_product_attention: the embedding dim (last dim) must be static")
    c = math.sqrt(1.0 / math.sqrt(int(e)) if scale is None else float(scale))
    scores = (q * c) @ (transpose(k, -2, -1) * c)
    if is_causal:
        rows, cols = q.shape[-2], k.shape[-2]
        if isinstance(rows, SymInt) or isinstance(cols, SymInt):
            raise AnygradError("scaled_dot_product_attention: is_causal needs static sequence lengths; give "
                               "them as numbers in input_shape")
        keep = np.tril(np.ones((int(rows), int(cols)), bool))
        scores = scores + np.where(keep, 0.0, -np.inf).astype(scores.dtype)
    elif attn_mask is not None:
        mask = attn_mask._t() if isinstance(attn_mask, Operand) else as_tensor(np.asarray(attn_mask), q)
        if mask.dtype == np.bool_:  # True: take part in the attention
            mask = q.tracer.op("Where", [mask, as_tensor(0.0, q), as_tensor(-np.inf, q)])
        scores = scores + mask
    weights = softmax(scores, -1)
    if dropout_p:
        weights = dropout(weights, dropout_p)
    return weights @ v
