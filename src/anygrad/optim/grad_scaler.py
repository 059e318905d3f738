"""Dynamic loss scaling (torch.amp.GradScaler) as graph nodes with state, for float16 steps.

Small gradients underflow in float16, so the backward pass runs on loss * scale; the float32
gradients are divided by the scale before clipping and the optimizer update. When any gradient
is inf or NaN, the step is skipped (every state update keeps its old value, selected on the
device, so nothing is read back per step: parameters, optimizer state, and also BatchNorm's
running statistics, which torch's GradScaler leaves to the forward pass; the metric sums skip a
step only when its loss itself is not finite, a forward that overflowed float16, so --on-nan
sees no NaN loss) and the scale halves; after `GROWTH_INTERVAL` finite
steps in a row it doubles. The scale and the count of finite steps are state buffers, so they
live on the device and checkpoints carry them: a resumed run continues with the same scale.

The rule and its constants are GradScaler's defaults: init_scale 2**16, growth_factor 2,
backoff_factor 0.5, growth_interval 2000.
"""
from __future__ import annotations

import numpy as np

from ..ir.builder import Builder
from ..ir.graph import Graph, TensorInfo

LOSS_SCALE = "anygrad.loss_scale"          # float32 scalar: the current scale
GROWTH_TRACKER = "anygrad.loss_scale.good"  # float32 scalar: finite steps since the last change
SKIPPED_SUM = "anygrad.metric.skipped_steps"  # float32 running count of skipped updates
INIT_SCALE = 2.0 ** 16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000
_BOOL_TO_FLOAT = 1  # Cast to=FLOAT


def _buffer(g: Graph, name: str, value: float) -> None:
    array = np.array(value, np.float32)
    g.initializers[name] = array
    g.info[name] = TensorInfo(array.dtype, ())
    if name not in g.buffers:
        g.buffers.append(name)


def add_state(g: Graph) -> None:
    """The scale and its growth tracker as state buffers of `g` (a device keeps one of each, which
    every program on it that scales, unscales or updates reads)."""
    _buffer(g, LOSS_SCALE, INIT_SCALE)
    _buffer(g, GROWTH_TRACKER, 0.0)


def scaled(g: Graph, b: Builder, objective: str) -> str:
    """objective * scale: what the backward pass differentiates."""
    add_state(g)
    return b.op("Mul", [objective, LOSS_SCALE])


def unscale(b: Builder, grads: dict[str, str]) -> dict[str, str]:
    """The gradients of the true objective (float32 master gradients / scale), each computed as
    soon as its scaled gradient is: that frees a float16 weight gradient (widened here) where it
    is made, not after the whole backward pass."""
    inv = b.op("Div", [b.const(1.0), LOSS_SCALE])
    out = {p: b.op("Mul", [grad, inv]) for p, grad in grads.items()}
    b.graph.hoist([inv, *out.values()])
    return out


def found_inf(b: Builder, values: list[str]) -> str:
    """A bool scalar: some element of `values` (the gradients, or the loss) is inf or NaN (the
    FoundInf op, which each backend tests its own way: by the bits, which shader compilers cannot
    assume away, and on wgpu a whole gradient arena at once)."""
    return b.op("FoundInf", list(values))


def gate(g: Graph, b: Builder, found: str, updates: dict[str, str]) -> None:
    """Every state update in `updates` (new value -> state) keeps the old value when `found`."""
    for new, state in updates.items():
        del g.state_updates[new]
        g.state_updates[b.op("Where", [found, state, new])] = state


def update_scale(g: Graph, b: Builder, found: str) -> None:
    """GradScaler.update: backoff on inf, growth after GROWTH_INTERVAL finite steps; and the count
    of skipped steps among the metric sums."""
    zero, one = b.const(0.0), b.const(1.0)
    good = b.op("Where", [found, zero, b.op("Add", [GROWTH_TRACKER, one])])
    grow = b.op("GreaterOrEqual", [good, b.const(float(GROWTH_INTERVAL))])
    scale = b.op("Where", [found, b.op("Mul", [LOSS_SCALE, b.const(BACKOFF_FACTOR)]),
                           b.op("Where", [grow, b.op("Mul", [LOSS_SCALE, b.const(GROWTH_FACTOR)]), LOSS_SCALE])])
    g.state_updates[scale] = LOSS_SCALE
    g.state_updates[b.op("Where", [grow, zero, good])] = GROWTH_TRACKER
    _buffer(g, SKIPPED_SUM, 0.0)
    g.state_updates[b.op("Add", [SKIPPED_SUM, b.op("Cast", [found], to=_BOOL_TO_FLOAT)])] = SKIPPED_SUM


__all__ = ["BACKOFF_FACTOR", "GROWTH_FACTOR", "GROWTH_INTERVAL", "GROWTH_TRACKER", "INIT_SCALE", "LOSS_SCALE",
           "SKIPPED_SUM", "add_state", "found_inf", "gate", "scaled", "unscale", "update_scale"]
