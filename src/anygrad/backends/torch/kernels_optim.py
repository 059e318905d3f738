"""Optimizer updates (anygrad/optim): SGD and Adam/AdamW as torch tensor arithmetic, in the
order of operations of the numpy kernels (which follow torch.optim's). The learning rate and
the step are 0-d state tensors: their arithmetic is done in double, as the numpy kernels do
with Python floats, so no value is read back to the host during a step. Other optimizers
run on their numpy kernels."""
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
