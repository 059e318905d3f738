"""ONNX's preview training ops (domain ai.onnx.preview.training): Adagrad, Adam, Momentum.

Each updates n tensors at once: inputs (R, T, X_1..n, G_1..n, state_1..n...), outputs (X_new_1..n,
state_new_1..n...). anygrad's own optimizers are Graph ops too (optim/); these follow ONNX's
formulas instead, so files that carry their update rule run as written. No gradients.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop

DOMAIN = "ai.onnx.preview.training"


def _adagrad(node: Node, r, t, x, g, h):
    decay, eps, norm = (float(node.attr(k, d)) for k, d in
                        (("decay_factor", 0.0), ("epsilon", 1e-6), ("norm_coefficient", 0.0)))
    rate = r / (1 + t * decay)
    g = norm * x + g
    h = h + g * g
    return x - rate * g / (np.sqrt(h) + eps), h


def _adam(node: Node, r, t, x, g, v, h):
    alpha, beta, eps, norm, post = (float(node.attr(k, d)) for k, d in (
        ("alpha", 0.9), ("beta", 0.999), ("epsilon", 1e-6), ("norm_coefficient", 0.0), ("norm_coefficient_post", 0.0)))
    g = norm * x + g
    v = alpha * v + (1 - alpha) * g
    h = beta * h + (1 - beta) * g * g
    rate = r * np.sqrt(1 - beta ** t) / (1 - alpha ** t) if t > 0 else r
    return (1 - post) * (x - rate * v / (np.sqrt(h) + eps)), v, h


def _momentum(node: Node, r, t, x, g, v):
    alpha, beta, norm = (float(node.attr(k)) for k in ("alpha", "beta", "norm_coefficient"))
    g = norm * x + g
    v = alpha * v + (beta if t > 0 else 1.0) * g
    step = g + alpha * v if node.attr("mode", "standard") == "nesterov" else v
    return x - r * step, v


# op: (update rule, tensors per group: X, G and the states)
RULES = {"Adagrad": (_adagrad, 3), "Adam": (_adam, 4), "Momentum": (_momentum, 3)}


def _forward(rule, per):
    def forward(node: Node, ins: list) -> list[np.ndarray]:
        r, t = float(np.asarray(ins[0]).reshape(-1)[0]), int(np.asarray(ins[1]).reshape(-1)[0])
        tensors = ins[2:]
        n = len(tensors) // per
        groups = [rule(node, r, t, *[tensors[k * n + i] for k in range(per)]) for i in range(n)]
        # outputs: new X for every group, then each state in turn (G has no output)
        by_kind = [[grp[k].astype(tensors[(0 if k == 0 else k + 1) * n + i].dtype) for i, grp in enumerate(groups)]
                   for k in range(per - 1)]
        return [o for kind in by_kind for o in kind]
    return forward


def _infer(per):
    def infer(node: Node, ins: list) -> list[TensorInfo]:
        tensors = ins[2:]
        n = len(tensors) // per
        kinds = [0] + list(range(2, per))  # X, then the states
        return [TensorInfo(tensors[k * n + i].dtype, tuple(tensors[k * n + i].shape)) for k in kinds for i in range(n)]
    return infer


for _name, (_rule, _per) in RULES.items():
    defop(f"{DOMAIN}.{_name}", infer=_infer(_per), forward=_forward(_rule, _per), foldable=False)
