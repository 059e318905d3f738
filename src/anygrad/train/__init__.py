"""Training loops over compiled models (the full Learner with dashboard and checkpoints grows here)."""
from .trainer import EpochMetrics, FitResult, TrainConfig, fit, save_weights

__all__ = ["EpochMetrics", "FitResult", "TrainConfig", "fit", "save_weights"]
