"""Optimizers with PyTorch's exact update rules and defaults."""
from .base import LR_STATE, STEP_STATE, Optimizer

__all__ = ["LR_STATE", "STEP_STATE", "Optimizer"]
