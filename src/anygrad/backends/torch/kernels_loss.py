"""Class-index losses, their gradient and the training metrics (anygrad/ops/loss.py): the
plain and weighted cross-entropy and NLL; label smoothing runs on the reference kernel.

Float16 scores are computed in float32 (the reference's rule): upcast on entry, each output
rounded once to the dtype the graph declares for it (the loss float32 for the internal ops, the
gradient float16)."""
from __future__ import annotations

from typing import Any

from ...ops.loss import bad_target
from .convert import torch_dtype
from .lowering import Site, is_float, lowering

REDUCTIONS = ("none", "sum", "mean")


def _check_targets(site: Site, x: Any, target: Any) -> None:
    """ops.loss._targets's check: a target outside the classes (and not ignored) raises its
    DataError. It reads back from the device (a sync), so it runs only where the runtime does
    not check a fed target on the host (TARGET_SLOTS); the gradient, later in the same step,
    never repeats the forward's check."""
    ignore = site.attr("ignore_index")
    n_classes = x.shape[1]
    bad = (target < 0) | (target >= n_classes)
    if ignore is not None:
        bad = bad & (target != ignore)
    if bool(bad.any()):
        raise bad_target(site.node.op, int(target[bad].reshape(-1)[0]), n_classes)


# torch's NLL kernels (aten.nll_loss_forward/backward) compute the reference's loss and gradient
# in one launch each: per sample -w[t] * logp[t], ignored samples 0, 'mean' divided by the sum of
# the weights taken (nan when every sample is ignored, a zero gradient then). Without an
# ignore_index no target equals theirs (-100): targets are checked to lie in [0, classes).
REDUCTION_ENUM = {"none": 0, "mean": 1, "sum": 2}
NO_IGNORE = -100


def _ignore(site: Site) -> int:
    ignore = site.attr("ignore_index")
    return NO_IGNORE if ignore is None else int(ignore)


def _rows(logp: Any, target: Any) -> tuple[Any, Any]:
    """(N, C, d1...) scores and (N, d1...) targets as (N*d1*..., C) and (N*d1*...,): the 2-D
    form aten's NLL kernels take."""
    if logp.dim() == 2:
        return logp, target
    return logp.movedim(1, -1).reshape(-1, logp.shape[1]), target.reshape(-1)


def _plain(site: Site, weight_slot: int) -> bool:
    """Lowered: float scores, a known reduction, no label smoothing, float weights."""
    x = 0 if site.node.op != "CrossEntropyGrad" else 1
    return (is_float(site.dtype(x)) and site.attr("reduction", "mean") in REDUCTIONS
            and not site.attr("label_smoothing", 0.0)
            and (not site.has(weight_slot) or is_float(site.dtype(weight_slot))))


def _wide(x: Any) -> Any:
    """Float16 scores (or weights) in float32, as every loss kernel computes them; others as they are."""
    import torch
    return x.float() if x is not None and x.dtype == torch.float16 else x


def _as_out(site: Site, slot: int, value: Any) -> Any:
    """`value` in the dtype the graph declares for output `slot`."""
    info = site.outs[slot] if slot < len(site.outs) else None
    return value if info is None else value.to(torch_dtype(info.dtype))


def _loss(site: Site, log_input: bool, x: Any, target: Any, weight: Any) -> tuple[Any, Any]:
    import torch
    x, weight = _wide(x), _wide(weight)
    weight = weight if weight is None else weight.to(x.dtype)
    logp = x if log_input else torch.log_softmax(x, dim=1)
    if 1 not in site.host_checked:
        _check_targets(site, x, target)
    reduction = site.attr("reduction", "mean")
    lp, t = _rows(logp, target.long())
    loss, _ = torch.ops.aten.nll_loss_forward(lp, t, weight, REDUCTION_ENUM[reduction], _ignore(site))
    if reduction == "none" and logp.dim() > 2:
        loss = loss.reshape(target.shape)
    return loss, logp


@lowering("CrossEntropy", "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss")
def _class_loss(site: Site):
    if not _plain(site, 2):
        return None
    op = site.node.op
    log_input = op == "NegativeLogLikelihoodLoss" or (op == "CrossEntropy" and bool(site.attr("log_input", 0)))
    has_w = site.has(2)

    def run(ins):
        loss, logp = _loss(site, log_input, ins[0], ins[1], ins[2] if has_w else None)
        return [_as_out(site, 0, loss), _as_out(site, 1, logp)]
    return run


def _count_correct(x: Any, target: Any) -> Any:
    import torch
    return (torch.argmax(x, dim=1) == target).sum(dtype=torch.float32)  # counts < 2^24: exact


def _count_top_k(x: Any, target: Any, k: int, in_range: bool = False) -> Any:
    """ops.metrics.count_top_k: fewer than k classes score strictly higher than the target's.
    `in_range`: every target is a class index (checked on the host), none to mask."""
    import torch
    idx = target.long().unsqueeze(1)
    if in_range:
        return ((x > x.gather(1, idx)).sum(dim=1) < k).sum(dtype=torch.float32)
    valid = (idx >= 0) & (idx < x.shape[1])
    picked = x.gather(1, torch.where(valid, idx, torch.zeros_like(idx)))
    higher = (x > picked).sum(dim=1)
    return ((higher < k) & valid.squeeze(1)).sum(dtype=torch.float32)


@lowering("CrossEntropyMetrics")
def _metrics(site: Site):
    if not _plain(site, 2):
        return None
    import torch
    log_input = bool(site.attr("log_input", 0))
    has_w = site.has(2)
    k = int(site.attr("k", 0) or 0)
    n_out = len(site.node.outputs)
    ignore = site.attr("ignore_index")
    in_range = 1 in site.host_checked and ignore is None
    lse_shape = site.shape(0)[:1] + site.shape(0)[2:]  # per sample (and position)

    def run(ins):
        x, target = _wide(ins[0]), ins[1]
        loss, _ = _loss(site, log_input, x, target, ins[2] if has_w else None)
        lse = x.new_zeros(lse_shape) if log_input else torch.logsumexp(x, dim=1)
        loss, lse = _as_out(site, 0, loss), _as_out(site, 1, lse)
        if ignore is not None:  # ignored positions count neither as right nor as wrong
            target = torch.where(target == ignore, -1, target)
        outs = [loss, lse, _count_correct(x, target)]
        if n_out > 3:
            outs.append(_count_top_k(x, target, k, in_range))
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
    """(dy, x, target, weight?, lse?) -> dx: the NLL gradient d logp (aten's), through
    log-softmax's backward unless the scores are log-probabilities already. log p is x - lse
    when the forward kept its log-sum-exp."""
    if not _plain(site, 3):
        return None
    import torch
    aten = torch.ops.aten
    log_input = bool(site.attr("log_input", 0))
    reduction = REDUCTION_ENUM[site.attr("reduction", "mean")]
    has_w, has_lse = site.has(3), site.has(4)
    ignore = _ignore(site)

    def run(ins):
        x, target = _wide(ins[1]), ins[2]
        dy = ins[0].to(x.dtype)
        w = _wide(ins[3]).to(x.dtype) if has_w else None
        if log_input:
            logp = x
        else:
            logp = x - _wide(ins[4]).unsqueeze(1) if has_lse else torch.log_softmax(x, dim=1)
        lp, t = _rows(logp, target.long())
        _, total = aten.nll_loss_forward(lp, t, w, reduction, ignore)  # the sum of the weights taken
        d = aten.nll_loss_backward(dy.reshape(-1) if reduction == 0 else dy, lp, t, w, reduction, ignore, total)
        if logp.dim() > 2:
            d = d.reshape(logp.movedim(1, -1).shape).movedim(-1, 1)
        if log_input:
            return [_as_out(site, 0, d)]
        return [_as_out(site, 0, aten._log_softmax_backward_data(d, logp, 1, logp.dtype))]
    return run


# -- elementwise losses: BCE with logits ------------------------------------------------------------
@lowering("BinaryCrossEntropyWithLogits")
def _bce_with_logits(site: Site):
    """max(x, 0) - x*y + log1p(exp(-|x|)), the first part per sign as the reference kernel writes
    it (no overflow for any x, no cancellation in either tail); x and y broadcast."""
    if not all(is_float(site.dtype(k)) for k in (0, 1)):
        return None
    import torch

    def bce(ins):
        x, y = ins
        return [torch.where(x < 0, -y * x, (1 - y) * x) + torch.log1p(torch.exp(-torch.abs(x)))]
    return bce


@lowering("BinaryCrossEntropyWithLogitsGrad")
def _bce_with_logits_grad(site: Site):
    """(dy, x, y) -> dy * (sigmoid(x) - y); torch's sigmoid is stable in both tails."""
    if not all(is_float(site.dtype(k)) for k in (0, 1, 2)):
        return None
    import torch
    return lambda ins: [ins[0] * (torch.sigmoid(ins[1]) - ins[2])]
