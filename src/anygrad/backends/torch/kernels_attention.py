"""FusedAttention and FusedAttentionGrad (anygrad/ops/fused_attention.py) in torch's own ops.

The forward keeps the row log-sum-exp for the backward, which recomputes the probabilities from
it (the formulas of the reference kernels, in torch: it runs on every torch device, CPU included).
Rows whose every key is masked give zeros and lse = +inf, as the reference does.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .lowering import Site, is_float, lowering


def _attention(site: Site, q_slot: int, mask_slot: int,
               kernel: Callable[[list, Any, float], list]) -> Callable[[list], list] | None:
    """The run function of a FusedAttention(Grad) site: kernel(ins, scores, scale), the scores being
    q k^T times the scale, plus the mask (input mask_slot, where given), -inf past the causal
    frontier; q is input q_slot, k the next. None where q is not floating point (the site falls back)."""
    if not is_float(site.dtype(q_slot)):
        return None
    scale, causal, offset = float(site.attr("scale")), bool(int(site.attr("causal", 0))), int(site.attr("causal_offset", 0))
    has_mask = site.has(mask_slot)

    def run(ins: list) -> list:
        import torch
        s = torch.matmul(ins[q_slot], ins[q_slot + 1].transpose(-1, -2)) * scale
        if has_mask:
            s = s + ins[mask_slot].to(s.dtype)
        if causal:
            t, n = s.shape[-2], s.shape[-1]
            hidden = torch.ones(t, n, dtype=torch.bool, device=s.device).triu(diagonal=offset + 1)
            s = s.masked_fill(hidden, float("-inf"))
        return kernel(ins, s, scale)
    return run


def _forward(ins: list, s: Any, scale: float) -> list:
    """(output, row log-sum-exp) of q, k, v from the scores s (already scaled: scale unused)."""
    import torch
    m = s.amax(dim=-1, keepdim=True)
    dead = torch.isneginf(m)
    m = torch.where(dead, torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, ins[2]) / torch.where(dead, torch.ones_like(denom), denom)
    lse = torch.where(dead, torch.full_like(m, float("inf")), m + torch.log(denom))
    return [out, lse.squeeze(-1).to(torch.float32)]


def _backward(ins: list, s: Any, scale: float) -> list:
    """(dq, dk, dv) from dO, q, k, v, the output, its lse and the recomputed scores s."""
    import torch
    dout, q, k, v, out, lse = ins[:6]
    p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = p * (dp - (dout * out).sum(dim=-1, keepdim=True))
    return [torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv]


@lowering("FusedAttention")
def _fused_attention(site: Site):
    return _attention(site, q_slot=0, mask_slot=3, kernel=_forward)


@lowering("FusedAttentionGrad")
def _fused_attention_grad(site: Site):
    return _attention(site, q_slot=1, mask_slot=6, kernel=_backward)
