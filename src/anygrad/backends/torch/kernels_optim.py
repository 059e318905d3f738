"""Optimizer updates (anygrad/optim): SGD, Adam/AdamW, Adagrad, RMSprop and Adadelta as torch
tensor arithmetic, in the order of operations of the numpy kernels (which follow torch.optim's).
The learning rate and the step are 0-d state tensors: their arithmetic is done in double, as
the numpy kernels do with Python floats, so no value is read back to the host during a step."""
from __future__ import annotations

import numpy as np

from .lowering import Site, is_float, lowering


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
