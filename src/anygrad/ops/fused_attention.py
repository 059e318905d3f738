"""FusedAttention and FusedAttentionGrad: scaled dot-product attention as one op, forward and backward.

anygrad's own ops (internal: never exported), made by the IR pass `ir/attention.py` from the
MatMul -> scale -> mask -> Softmax -> MatMul chains the exporters emit. One node lets a backend run
attention without materialising the (..., T, S) scores, probabilities and their gradients
(flash attention: the wgpu backend tiles keys and queries through workgroup memory).

    FusedAttention(q, k, v, [bias]) -> (out, lse)
        q (*L, T, D), k (*L, S, D), v (*L, S, Dv), bias broadcastable to (*L, T, S) (additive:
        0 / -inf / any float; a constant or a value no parameter reaches).
        attrs: scale (float), causal (0/1), causal_offset (int): with causal, key j is seen by
        query i only when j <= i + causal_offset (0: PyTorch's is_causal, top-left aligned).
        out = softmax(q k^T * scale + bias [+ causal]) v, shape (*L, T, Dv);
        lse (*L, T), float32: the log of each row's softmax denominator, kept for the backward.
    FusedAttentionGrad(dout, q, k, v, out, lse, [bias]) -> (dq, dk, dv), same attrs.

A row whose every key is masked (-inf) gives a zero output and zero gradients, as PyTorch's
scaled_dot_product_attention (since 2.5) and ONNX's Attention do; its lse is +inf, so that
exp(s - lse) is 0 for all of its keys in the backward.
"""
from __future__ import annotations

import numpy as np

from ..errors import AnygradError, ShapeError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop


def _dt(x: np.ndarray) -> np.dtype:
    return np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)


def logits(node: Node, q: np.ndarray, k: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """q k^T * scale + bias, with -inf where the causal rule hides a key: (*L, T, S)."""
    dt = _dt(q)
    s = np.matmul(q.astype(dt), np.swapaxes(k.astype(dt), -1, -2)) * dt.type(float(node.attr("scale")))
    if bias is not None:
        s = s + bias.astype(dt)
    if int(node.attr("causal", 0)):
        t, n = s.shape[-2:]
        hidden = np.arange(n)[None, :] > np.arange(t)[:, None] + int(node.attr("causal_offset", 0))
        s = np.where(hidden, -np.inf, s)
    return s


def _forward(node: Node, ins: list) -> tuple[np.ndarray, np.ndarray]:
    q, k, v = ins[:3]
    bias = ins[3] if len(ins) > 3 else None
    dt = _dt(q)
    s = logits(node, q, k, bias)
    m = s.max(axis=-1, keepdims=True)
    dead = np.isneginf(m)  # no attendable key: zero output, lse = +inf
    m = np.where(dead, 0.0, m)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    out = np.matmul(p, v.astype(dt)) / np.where(dead, 1.0, denom)
    with np.errstate(divide="ignore"):
        lse = np.where(dead, np.inf, m + np.log(denom))[..., 0]
    return out.astype(q.dtype), lse.astype(np.float32)


def _grad_forward(node: Node, ins: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dout, q, k, v, out, lse = ins[:6]
    bias = ins[6] if len(ins) > 6 else None
    dt = _dt(q)
    scale = dt.type(float(node.attr("scale")))
    p = np.exp(logits(node, q, k, bias) - lse.astype(dt)[..., None])  # 0 for masked keys and dead rows
    dout, v = dout.astype(dt), v.astype(dt)
    dv = np.matmul(np.swapaxes(p, -1, -2), dout)
    dp = np.matmul(dout, np.swapaxes(v, -1, -2))
    delta = np.sum(dout * out.astype(dt), axis=-1, keepdims=True)  # rowsum(dP * P) = rowsum(dO * O)
    ds = p * (dp - delta)
    dq = np.matmul(ds, k.astype(dt)) * scale
    dk = np.matmul(np.swapaxes(ds, -1, -2), q.astype(dt)) * scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _check(node: Node, q, k, v, bias) -> None:
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if len(qs) < 2 or len(ks) != len(qs) or len(vs) != len(qs) or qs[:-2] != ks[:-2] or ks[:-2] != vs[:-2] \
            or qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        raise ShapeError(f"{node.label}: q {qs}, k {ks}, v {vs} must be (*L, T, D), (*L, S, D), (*L, S, Dv)")
    if bias is not None:
        want = qs[:-1] + (ks[-2],)
        bs = tuple(bias.shape)
        if len(bs) > len(want) or any(b not in (1, w) for b, w in zip(bs[::-1], want[::-1])):
            raise ShapeError(f"{node.label}: mask {bs} does not broadcast to the scores' shape {want}")


def _infer(node: Node, ins: list) -> list[TensorInfo]:
    q, k, v = ins[:3]
    _check(node, q, k, v, ins[3] if len(ins) > 3 else None)
    return [TensorInfo(q.dtype, tuple(q.shape[:-1]) + (v.shape[-1],)),
            TensorInfo(np.dtype(np.float32), tuple(q.shape[:-1]))]


def _grad_infer(node: Node, ins: list) -> list[TensorInfo]:
    return [TensorInfo(i.dtype, tuple(i.shape)) for i in ins[1:4]]


def _grad(g: GradContext) -> list[str | None]:
    if g.dys[1] is not None:
        raise AnygradError(f"{g.node.label}: FusedAttention's lse output has no gradient")
    q, k, v = g.x[:3]
    bias = g.node.input(3)
    attrs = {key: g.node.attrs[key] for key in ("scale", "causal", "causal_offset") if key in g.node.attrs}
    lse = g.y[1]
    dq, dk, dv = g.ops("FusedAttentionGrad", [g.dy, q, k, v, g.y[0], lse] + ([bias] if bias else []), 3, **attrs)
    return [dq if g.need(0) else None, dk if g.need(1) else None, dv if g.need(2) else None]


# The bias (slot 3) is a mask: the pass fuses only masks no parameter reaches, so it has no gradient.
defop("FusedAttention", infer=_infer, forward=_forward, grad=_grad, nondiff=[3], internal=True, foldable=False)
defop("FusedAttentionGrad", infer=_grad_infer, forward=_grad_forward, internal=True, foldable=False)
