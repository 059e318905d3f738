"""The optimizer interface: an optimizer turns (param, grad, state) into Graph nodes.

State tensors (momentum buffers, accumulators) become graph buffers named
`optim.<slot>.<param>`, so they live on the device, are updated in place by the step, and are
saved in checkpoints like any other state. The learning rate and the step count are graph
buffers too (LR_STATE, STEP_STATE), so a scheduler changes the rate without recompiling.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import numpy as np

from ..ir.builder import Builder

LR_STATE = "anygrad.lr"
STEP_STATE = "anygrad.step"  # optimizer steps taken before this one, float32 scalar


@dataclass
class Optimizer(ABC):
    lr: float

    name = "optimizer"

    @abstractmethod
    def init_state(self, param: np.ndarray) -> dict[str, np.ndarray]:
        """Initial state for one parameter, keyed by slot name ({} when stateless)."""

    @abstractmethod
    def update(self, b: Builder, param: str, grad: str, state: dict[str, str], lr: str, step: str
               ) -> tuple[str, dict[str, str]]:
        """Emit the update; return (new param value, {slot: new state value}). `step` is the
        1-based index of this update (float32 scalar value), `lr` the current learning rate."""

    def config(self) -> dict:
        return {"name": self.name, **asdict(self)}
