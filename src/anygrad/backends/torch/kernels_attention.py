"""FusedAttention and FusedAttentionGrad (anygrad/ops/fused_attention.py) in torch's own ops.

The forward keeps the row log-sum-exp for the backward, which recomputes the probabilities from
it (the formulas of the reference kernels, in torch: it runs on every torch device, CPU included).
Rows whose every key is masked give zeros and lse = +inf, as the reference does.
"""
from __future__ import annotations

from typing import Any

from .lowering import Site, is_float, lowering


def _logits(q: Any, k: Any, bias: Any, scale: float, causal: bool, offset: int) -> Any:
    import torch
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(s.dtype)
    if causal:
        t, n = s.shape[-2], s.shape[-1]
        hidden = torch.ones(t, n, dtype=torch.bool, device=s.device).triu(diagonal=offset + 1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _attrs(site: Site) -> tuple[float, bool, int]:
    return float(site.attr("scale")), bool(int(site.attr("causal", 0))), int(site.attr("causal_offset", 0))


@lowering("FusedAttention")
def _fused_attention(site: Site):
    if not is_float(site.dtype(0)):
        return None
    scale, causal, offset = _attrs(site)
    has_bias = site.has(3)

    def run(ins):
        import torch
        q, k, v = ins[:3]
        s = _logits(q, k, ins[3] if has_bias else None, scale, causal, offset)
        m = s.amax(dim=-1, keepdim=True)
        dead = torch.isneginf(m)
        m = torch.where(dead, torch.zeros_like(m), m)
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        out = torch.matmul(p, v) / torch.where(dead, torch.ones_like(denom), denom)
        lse = torch.where(dead, torch.full_like(m, float("inf")), m + torch.log(denom))
        return [out, lse.squeeze(-1).to(torch.float32)]
    return run


@lowering("FusedAttentionGrad")
def _fused_attention_grad(site: Site):
    if not is_float(site.dtype(1)):
        return None
    scale, causal, offset = _attrs(site)
    has_bias = site.has(6)

    def run(ins):
        import torch
        dout, q, k, v, out, lse = ins[:6]
        s = _logits(q, k, ins[6] if has_bias else None, scale, causal, offset)
        p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, v.transpose(-1, -2))
        ds = p * (dp - (dout * out).sum(dim=-1, keepdim=True))
        return [torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv]
    return run
