"""Class-index losses, their gradient and the training metrics (anygrad/ops/loss.py): the
plain and weighted cross-entropy and NLL; label smoothing runs on the reference kernel."""
from __future__ import annotations

from typing import Any

from ...errors import DataError
from .lowering import Site, is_float, lowering

REDUCTIONS = ("none", "sum", "mean")


def _targets(site: Site, x: Any, target: Any, weight: Any, check: bool = True) -> tuple[Any, Any]:
    """(safe class indices, per-sample weight w[t] * mask) as ops.loss._targets computes them;
    a target outside the classes raises the same DataError. The check reads back from the
    device, so it is skipped where the runtime checks a fed target on the host (TARGET_SLOTS),
    and the gradient, later in the same step, never repeats the forward's check."""
    import torch
    ignore = site.attr("ignore_index")
    mask = target != ignore if ignore is not None else torch.ones_like(target, dtype=torch.bool)
    safe = torch.where(mask, target, torch.zeros_like(target)).long()
    n_classes = x.shape[1]
    bad = (safe < 0) | (safe >= n_classes)
    if check and bool(bad.any()):
        raise DataError(f"{site.node.label}: target class index {int(target[bad].reshape(-1)[0])} is outside "
                        f"[0, {n_classes}); check the labels or the model's number of classes")
    w = weight[safe] if weight is not None else torch.ones(safe.shape, dtype=x.dtype, device=x.device)
    return safe, (w * mask).to(x.dtype)


def _plain(site: Site, weight_slot: int) -> bool:
    """Lowered: float scores, a known reduction, no label smoothing."""
    return (is_float(site.dtype(0 if site.node.op != "CrossEntropyGrad" else 1))
            and site.attr("reduction", "mean") in REDUCTIONS and not site.attr("label_smoothing", 0.0))


def _loss(site: Site, log_input: bool, x: Any, target: Any, weight: Any) -> tuple[Any, Any]:
    import torch
    logp = x if log_input else torch.log_softmax(x, dim=1)
    safe, wt = _targets(site, x, target, weight, check=1 not in site.host_checked)
    per_sample = -wt * logp.gather(1, safe.unsqueeze(1)).squeeze(1)
    reduction = site.attr("reduction", "mean")
    if reduction == "none":
        return per_sample, logp
    total = per_sample.sum()
    return (total if reduction == "sum" else total / wt.sum()), logp


@lowering("CrossEntropy", "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss")
def _class_loss(site: Site):
    if not _plain(site, 2):
        return None
    op = site.node.op
    log_input = op == "NegativeLogLikelihoodLoss" or (op == "CrossEntropy" and bool(site.attr("log_input", 0)))
    has_w = site.has(2)

    def run(ins):
        loss, logp = _loss(site, log_input, ins[0], ins[1], ins[2] if has_w else None)
        return [loss, logp]
    return run


def _count_correct(x: Any, target: Any) -> Any:
    import torch
    return (torch.argmax(x, dim=1) == target).sum().to(torch.float32)


def _count_top_k(x: Any, target: Any, k: int) -> Any:
    """ops.metrics.count_top_k: fewer than k classes score strictly higher than the target's."""
    import torch
    idx = target.long().unsqueeze(1)
    valid = (idx >= 0) & (idx < x.shape[1])
    picked = x.gather(1, torch.where(valid, idx, torch.zeros_like(idx)))
    higher = (x > picked).sum(dim=1)
    return ((higher < k) & valid.squeeze(1)).sum().to(torch.float32)


@lowering("CrossEntropyMetrics")
def _metrics(site: Site):
    if not _plain(site, 2):
        return None
    import torch
    log_input = bool(site.attr("log_input", 0))
    has_w = site.has(2)
    k = int(site.attr("k", 0) or 0)
    n_out = len(site.node.outputs)

    def run(ins):
        x, target = ins[0], ins[1]
        loss, _ = _loss(site, log_input, x, target, ins[2] if has_w else None)
        lse = torch.zeros_like(x[:, 0]) if log_input else torch.logsumexp(x, dim=1)
        outs = [loss, lse, _count_correct(x, target)]
        if n_out > 3:
            outs.append(_count_top_k(x, target, k))
        return outs
    return run


@lowering("CountCorrect")
def _count(site: Site):
    k = int(site.attr("k", 0) or 0)
    two = len(site.node.outputs) > 1
    return lambda ins: [_count_correct(ins[0], ins[1])] + ([_count_top_k(ins[0], ins[1], k)] if two else [])


@lowering("CountTopK")
def _count_top(site: Site):
    k = int(site.attr("k"))
    return lambda ins: [_count_top_k(ins[0], ins[1], k)]


@lowering("CrossEntropyGrad")
def _class_loss_grad(site: Site):
    if not _plain(site, 3):
        return None
    import torch
    log_input = bool(site.attr("log_input", 0))
    reduction = site.attr("reduction", "mean")
    has_w, has_lse = site.has(3), site.has(4)

    def run(ins):
        dy, x, target = ins[0], ins[1], ins[2]
        safe, wt = _targets(site, x, target, ins[3] if has_w else None, check=False)
        safe = safe.clamp(0, x.shape[1] - 1)  # never index out of range (the forward raised)
        if reduction == "mean":
            total = wt.sum()
            # every sample ignored: the loss is nan (0/0), the gradient zero, as in PyTorch
            scale = torch.where(total != 0, dy / torch.where(total != 0, total, torch.ones_like(total)),
                                torch.zeros_like(dy))
        else:
            scale = dy
        scale = torch.broadcast_to(scale, wt.shape).unsqueeze(1)
        wt_c = wt.unsqueeze(1)
        onehot = torch.zeros_like(x).scatter(1, safe.unsqueeze(1), 1.0)
        q = onehot * wt_c
        if log_input:
            return [-q * scale]
        p = torch.exp(x - ins[4].unsqueeze(1)) if has_lse else torch.softmax(x, dim=1)
        return [(p * wt_c - q) * scale]
    return run


# -- elementwise losses: BCE with logits ------------------------------------------------------------
@lowering("BinaryCrossEntropyWithLogits")
def _bce_with_logits(site: Site):
    """max(x, 0) - x*y + log1p(exp(-|x|)): no overflow for any x (the reference kernel's form);
    x and y broadcast."""
    if not all(is_float(site.dtype(k)) for k in (0, 1)):
        return None
    import torch

    def bce(ins):
        x, y = ins
        return [torch.clamp(x, min=0) - x * y + torch.log1p(torch.exp(-torch.abs(x)))]
    return bce


@lowering("BinaryCrossEntropyWithLogitsGrad")
def _bce_with_logits_grad(site: Site):
    """(dy, x, y) -> dy * (sigmoid(x) - y); torch's sigmoid is stable in both tails."""
    if not all(is_float(site.dtype(k)) for k in (0, 1, 2)):
        return None
    import torch
    return lambda ins: [ins[0] * (torch.sigmoid(ins[1]) - ins[2])]
