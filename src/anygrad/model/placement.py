"""Which backends a Model trains on: a backend object bound to one live Model at a time, moving a
Model onto another backend with its state, and device='auto''s timed trial between candidates.

Separate from the Model class because it is device bookkeeping across models (the ownership mark
on a backend) and a measurement loop, apart from what a step computes.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from ..backends.base import Backend
from ..batch import Batch
from ..errors import ConfigError
from .metrics import read_metric_sums
from .programs import program

if TYPE_CHECKING:
    from .core import Model


def claim(backend: Backend, model: Any) -> None:
    """Bind `backend` to `model`, refusing a backend object another live Model trains on: a
    backend keeps state by name and initialises only what it lacks, so a second model with the
    same parameter names would start from the first one's optimizer state (momentum, step count)
    and overwrite its weights on the device, silently."""
    owner = getattr(backend, "_anygrad_owner", None)
    other = owner() if owner is not None else None
    if other is model:
        return
    if other is not None:
        raise ConfigError(f"device {backend.name!r}: this backend object already holds another Model's training "
                          "state; give each model its own (device='wgpu' opens one), or compile on it "
                          "once the other model is gone")
    if owner is not None:  # a model that is gone: its state must not seed this one's
        backend.release()
    backend._anygrad_owner = weakref.ref(model)


def choose_backend(model: Model, inputs: Batch, targets: Batch) -> None:
    """Model._choose_backend: time the candidates of device='auto' on this batch, keep the faster."""
    import sys
    candidates, model.auto_candidates = model.auto_candidates, []
    times: dict[int, float] = {}
    failed: dict[int, Exception] = {}
    before: dict[str, np.ndarray] | None = None
    for i, backend in enumerate(candidates):
        try:
            if backend is not model.backend:
                use_backend(model, backend, before if before is not None else model.full_state())
            program(model, "train", inputs, targets)  # its optimizer slots: loaded, or fresh
            before = before if before is not None else model.full_state()
            times[i] = time_step(model, inputs, targets)
        except Exception as e:  # noqa: BLE001  (any failure of one candidate: try the others)
            failed[i] = e
    if not times:
        raise failed[0]
    best = min(times, key=times.get)
    use_backend(model, candidates[best], before)
    for i, backend in enumerate(candidates):
        if i != best:
            backend.release()
    model.backend_trial = {candidates[i].description: ms for i, ms in times.items()}
    timed = ", ".join(f"{name} {ms:.2f} ms/step" for name, ms in model.backend_trial.items())
    skipped = "".join(f"; {candidates[i].description} left out ({type(e).__name__}: {e})"
                      for i, e in failed.items())
    print(f"anygrad: device auto: {timed}{skipped}; training on {model.backend.description}", file=sys.stderr)


def time_step(model: Model, inputs: Batch, targets: Batch, warmup: int = 3, seconds: float = 1.0,
              most: int = 10) -> float:
    """ms per training step on the current backend: after `warmup` steps (which compile it
    and capture torch's CUDA graph), up to `most` steps or `seconds`."""
    import time
    exe, feeds = program(model, "train", inputs, targets), {**inputs, **targets}
    for _ in range(warmup):
        exe.run(feeds, fetch=[])
    # reading the metric sums, which every step adds to on the device, waits for the queued
    # steps (the RNG counter would not: torch keeps it on the host)
    read_metric_sums(model)
    steps, t0 = 0, time.perf_counter()
    while steps < most and (steps == 0 or time.perf_counter() - t0 < seconds):
        exe.run(feeds, fetch=[])
        steps += 1
    read_metric_sums(model)
    return 1e3 * (time.perf_counter() - t0) / steps


def use_backend(model: Model, backend: Backend, state: dict[str, np.ndarray]) -> None:
    """Train on `backend` from `state` (a full_state()); programs compile anew."""
    claim(backend, model)
    model.backend, model.devices = backend, [backend]
    model._programs.clear()
    for name, value in state.items():
        backend.set_state(name, value)
