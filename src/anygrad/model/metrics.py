"""A Model's metrics: the sums its step programs add to on the device (loss, accuracy, ...), read
back as raw sums or as means, and reset.

Separate from the Model class because it is the one readback path of training and evaluation:
which buffers hold sums, and how a metric's numerator and denominator make its value.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..program import METRIC_PREFIX, METRIC_STATE, SAMPLE_COUNT

if TYPE_CHECKING:
    from .core import Model


def metric_buffers(model: Model) -> set[str]:
    """The names of the metric sums the step programs add to on the device (read_metric_sums)."""
    names = set(METRIC_STATE)
    for spec in model._metric_specs.values():
        names.update((spec.num, spec.den))
    for exe in model._programs.values():
        names.update(n for n in exe.graph.state_names if n.startswith(METRIC_PREFIX))
    return names


def reset_metrics(model: Model) -> None:
    """Zero every metric sum, on every device the model trains on."""
    model.require_compiled()
    model.strategy.reset_metrics(model, sorted(metric_buffers(model)))


def read_metric_sums(model: Model, reset: bool = False) -> tuple[float, dict[str, tuple[float, float, bool]]]:
    """Model.read_metric_sums: (samples, {metric: (numerator, denominator, exp)})."""
    backend = model.require_compiled()
    names = sorted(n for n in metric_buffers(model) if backend.has_state(n))
    sums = model.strategy.metric_sums(model, names)  # one read of every sum, over every device trained on
    n = sums.get(SAMPLE_COUNT, 0.0)
    parts: dict[str, tuple[float, float, bool]] = {}
    # each metric by its own denominator: where every f16 step overflowed, no sample counts, but
    # the skipped updates (over updates attempted) still do
    for key, spec in model._metric_specs.items():
        den = sums.get(spec.den)
        if spec.num in sums and den:
            parts[key] = (sums[spec.num], den, spec.exp)
    if reset:
        reset_metrics(model)
    return n, parts


def read_metrics(model: Model, reset: bool = False) -> dict[str, float]:
    """Model.read_metrics: the sums since the last reset as means, with 'count'."""
    count, parts = read_metric_sums(model, reset)
    out = {"count": count}
    for key, (num, den, exp) in parts.items():
        mean = num / den
        out[key] = float(np.exp(min(mean, 700.0))) if exp else mean
    return out
