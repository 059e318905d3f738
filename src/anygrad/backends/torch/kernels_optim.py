"""Optimizer updates (anygrad/optim): SGD, Adam/AdamW, Adagrad, RMSprop and Adadelta as torch
tensor arithmetic, in the order of operations of the numpy kernels (which follow torch.optim's).
The learning rate and the step are 0-d state tensors: their arithmetic is done in double, as
the numpy kernels do with Python floats, so no value is read back to the host during a step.

SGD, Adam/AdamW and Adagrad also have grouped lowerings: every parameter's update of one step in
one kernel of torch._foreach_* ops (as torch.optim's foreach implementation), the same operations
in the same order as the per-parameter kernels, so the same bits (tests/test_torch_backend.py)."""
from __future__ import annotations

import numpy as np

from .lowering import Site, group_lowering, is_float, lowering


def _lerp(a, b, w: float):
    """optim.base.lerp: torch.lerp's formula, branch chosen by the weight."""
    w32 = float(np.float32(w))
    return a + w32 * (b - a) if abs(w) < 0.5 else b - (b - a) * (1.0 - w32)


@lowering("SGDUpdate")
def _sgd(site: Site):
    if not is_float(site.dtype(0)):
        return None
    import torch
    h = site.node.attrs

    def run(ins):
        p, g, lr, step = ins[0], ins[1], ins[-2].double(), ins[-1].double()
        g = -g if h["maximize"] else g
        if h["weight_decay"]:
            g = g + h["weight_decay"] * p
        outs = []
        if h["momentum"]:
            buf = torch.where(step == 1, g, ins[2] * h["momentum"] + (1 - h["dampening"]) * g)
            outs.append(buf)
            g = g + h["momentum"] * buf if h["nesterov"] else buf
        return [p - (lr * g).to(p.dtype)] + outs
    return run


@lowering("AdamUpdate")
def _adam(site: Site):
    if not is_float(site.dtype(0)):
        return None
    import torch
    h = site.node.attrs
    beta1, beta2 = (float(b) for b in h["betas"])

    def run(ins):
        p, g, lr, step = ins[0], ins[1], ins[-2].double(), ins[-1].double()
        g = -g if h["maximize"] else g
        if h["weight_decay"]:
            if h["decoupled"]:  # AdamW
                p = p * (1 - lr * h["weight_decay"]).to(p.dtype)
            else:
                g = g + h["weight_decay"] * p
        exp_avg = _lerp(ins[2], g, 1 - beta1)
        exp_avg_sq = ins[3] * beta2 + (1 - beta2) * g * g
        outs = [exp_avg, exp_avg_sq]
        step_size = (lr / (1 - beta1 ** step)).to(p.dtype)
        bias_correction2_sqrt = ((1 - beta2 ** step) ** 0.5).to(p.dtype)
        second = exp_avg_sq
        if h["amsgrad"]:
            second = torch.maximum(ins[4], exp_avg_sq)
            outs.append(second)
        denom = torch.sqrt(second) / bias_correction2_sqrt + h["eps"]
        return [p - step_size * exp_avg / denom] + outs
    return run


def _decayed(h: dict, p, g):
    g = -g if h["maximize"] else g
    return g + h["weight_decay"] * p if h["weight_decay"] else g


@lowering("AdagradUpdate")
def _adagrad(site: Site):
    if not is_float(site.dtype(0)):
        return None
    import torch
    h = site.node.attrs

    def run(ins):
        p, lr, step = ins[0], ins[-2].double(), ins[-1].double()
        g = _decayed(h, p, ins[1])
        clr = (lr / (1 + (step - 1) * h["lr_decay"])).to(p.dtype)
        total = ins[2] + g * g
        return [p - clr * g / (torch.sqrt(total) + h["eps"]), total]
    return run


@lowering("RMSpropUpdate")
def _rmsprop(site: Site):
    if not is_float(site.dtype(0)):
        return None
    import torch
    h = site.node.attrs
    alpha = h["alpha"]

    def run(ins):
        p, lr = ins[0], ins[-2].double().to(ins[0].dtype)
        g = _decayed(h, p, ins[1])
        slots = iter(ins[2:-2])
        square_avg = next(slots) * alpha + (1 - alpha) * g * g
        outs = [square_avg]
        buf_in = next(slots) if h["momentum"] > 0 else None
        if h["centered"]:
            grad_avg = _lerp(next(slots), g, 1 - alpha)
            avg = torch.sqrt(square_avg - grad_avg * grad_avg)
        else:
            grad_avg, avg = None, torch.sqrt(square_avg)
        avg = avg + h["eps"]
        if h["momentum"] > 0:
            buf = buf_in * h["momentum"] + g / avg
            outs.append(buf)
            update = p - lr * buf
        else:
            update = p - lr * g / avg
        if grad_avg is not None:
            outs.append(grad_avg)
        return [update] + outs
    return run


@lowering("AdadeltaUpdate")
def _adadelta(site: Site):
    if not is_float(site.dtype(0)):
        return None
    import torch
    h = site.node.attrs
    rho, eps = h["rho"], h["eps"]

    def run(ins):
        p, lr = ins[0], ins[-2].double().to(ins[0].dtype)
        g = _decayed(h, p, ins[1])
        square_avg = ins[2] * rho + (1 - rho) * g * g
        std = torch.sqrt(square_avg + eps)
        delta = torch.sqrt(ins[3] + eps) / std * g
        acc_delta = ins[3] * rho + (1 - rho) * delta * delta
        return [p - lr * delta, square_avg, acc_delta]
    return run


# -- grouped (foreach) updates: inputs (p, g, *slots, lr, step) per node ---------------------------
def _floats(sites: list[Site]) -> bool:
    return all(is_float(s.dtype(0)) for s in sites) and len({s.dtype(0) for s in sites}) == 1


def _columns(groups: list[list]) -> tuple[list, list, list[list]]:
    """(params, grads, [slot k of every node, for each optimizer slot k])."""
    n_slots = len(groups[0]) - 4
    return [g[0] for g in groups], [g[1] for g in groups], [[g[2 + k] for g in groups] for k in range(n_slots)]


def _decayed_all(torch, h: dict, ps: list, gs: list) -> list:
    """_decayed over lists: -g when maximizing, then g + weight_decay * p."""
    gs = torch._foreach_neg(gs) if h["maximize"] else gs
    return torch._foreach_add(gs, torch._foreach_mul(ps, h["weight_decay"])) if h["weight_decay"] else gs


@group_lowering("AdagradUpdate", shared=(-2, -1))
def _adagrad_group(sites: list[Site]):
    if not _floats(sites):
        return None
    import torch
    h = sites[0].node.attrs

    def run(groups):
        ps, gs, (sums,) = _columns(groups)
        lr, step = groups[0][-2].double(), groups[0][-1].double()
        gs = _decayed_all(torch, h, ps, gs)
        clr = (lr / (1 + (step - 1) * h["lr_decay"])).to(ps[0].dtype)
        totals = torch._foreach_add(sums, torch._foreach_mul(gs, gs))
        denom = torch._foreach_sqrt(totals)
        torch._foreach_add_(denom, h["eps"])
        delta = torch._foreach_mul(gs, clr)
        torch._foreach_div_(delta, denom)
        return [list(pt) for pt in zip(torch._foreach_sub(ps, delta), totals)]
    return run


@group_lowering("SGDUpdate", shared=(-2, -1))
def _sgd_group(sites: list[Site]):
    if not _floats(sites):
        return None
    import torch
    h = sites[0].node.attrs
    wide = (torch.float32, torch.float64)

    def run(groups):
        ps, gs, slots = _columns(groups)
        lr, step = groups[0][-2].double(), groups[0][-1].double()
        gs = _decayed_all(torch, h, ps, gs)
        outs: list[list] = [[] for _ in groups]
        if h["momentum"] and not h["dampening"] and ps[0].dtype in wide:
            # buf = g on the first step, else buf * momentum + g: two foreach ops with a 0-d
            # factor (0 on the first step, when buf holds zeros: 0 * buf + g is g) instead of a
            # torch.where per parameter. The factor is the float32 (float64) momentum that
            # multiplying by the Python float gives: the same bits as the per-node kernel.
            keep = (step != 1).to(ps[0].dtype) * h["momentum"]
            bufs = torch._foreach_add(torch._foreach_mul(slots[0], keep), gs)
        elif h["momentum"]:
            first = step == 1
            blend = torch._foreach_add(torch._foreach_mul(slots[0], h["momentum"]),
                                       torch._foreach_mul(gs, 1 - h["dampening"]))
            bufs = [torch.where(first, g, b) for g, b in zip(gs, blend)]
        if h["momentum"]:
            for o, b in zip(outs, bufs):
                o.append(b)
            gs = torch._foreach_add(gs, torch._foreach_mul(bufs, h["momentum"])) if h["nesterov"] else bufs
        deltas = torch._foreach_mul(gs, lr)
        if deltas[0].dtype != ps[0].dtype:
            deltas = [d.to(ps[0].dtype) for d in deltas]
        return [[p] + o for p, o in zip(torch._foreach_sub(ps, deltas), outs)]
    return run


@group_lowering("AdamUpdate", shared=(-2, -1))
def _adam_group(sites: list[Site]):
    if not _floats(sites):
        return None
    import torch
    h = sites[0].node.attrs
    beta1, beta2 = (float(b) for b in h["betas"])
    w = 1 - beta1
    w32 = float(np.float32(w))

    def run(groups):
        ps, gs, slots = _columns(groups)
        lr, step = groups[0][-2].double(), groups[0][-1].double()
        dt = ps[0].dtype
        gs = torch._foreach_neg(gs) if h["maximize"] else gs
        if h["weight_decay"]:
            if h["decoupled"]:  # AdamW
                ps = torch._foreach_mul(ps, (1 - lr * h["weight_decay"]).to(dt))
            else:
                gs = torch._foreach_add(gs, torch._foreach_mul(ps, h["weight_decay"]))
        # _lerp(m, g, w): m + w32 * (g - m) below a weight of 0.5, else g - (g - m) * (1 - w32)
        diff = torch._foreach_sub(gs, slots[0])
        if abs(w) < 0.5:
            exp_avg = torch._foreach_add(slots[0], torch._foreach_mul(diff, w32))
        else:
            exp_avg = torch._foreach_sub(gs, torch._foreach_mul(diff, 1.0 - w32))
        scaled = torch._foreach_mul(gs, 1 - beta2)
        torch._foreach_mul_(scaled, gs)
        exp_avg_sq = torch._foreach_add(torch._foreach_mul(slots[1], beta2), scaled)
        step_size = (lr / (1 - beta1 ** step)).to(dt)
        bias_correction2_sqrt = ((1 - beta2 ** step) ** 0.5).to(dt)
        second = torch._foreach_maximum(slots[2], exp_avg_sq) if h["amsgrad"] else exp_avg_sq
        denom = torch._foreach_sqrt(second)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, h["eps"])
        delta = torch._foreach_mul(exp_avg, step_size)
        torch._foreach_div_(delta, denom)
        news = torch._foreach_sub(ps, delta)
        if h["amsgrad"]:
            return [[p, m, v, s] for p, m, v, s in zip(news, exp_avg, exp_avg_sq, second)]
        return [[p, m, v] for p, m, v in zip(news, exp_avg, exp_avg_sq)]
    return run


@lowering("FoundInf")
def _found_inf(site: Site):
    """Some element of some input is inf or NaN: an elementwise test per tensor (torch.isfinite),
    as torch.amp.GradScaler's, never a sum (which finite values can overflow)."""
    import torch

    def run(ins):
        return [torch.logical_not(torch.stack([torch.isfinite(x).all() for x in ins]).all())]
    return run
