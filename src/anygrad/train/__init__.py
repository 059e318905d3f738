"""Training loops over compiled models: the Learner (validation, metrics, early stopping,
schedules, checkpoints, resume) and the Reporter interface its displays implement."""
from .checkpoint import CheckpointError
from .monitor import Monitor
from .report import EpochInfo, Reporter, RunInfo, StepInfo
from .trainer import EpochMetrics, FitResult, Learner, LineReporter, TrainConfig, fit, save_weights

__all__ = ["CheckpointError", "EpochInfo", "EpochMetrics", "FitResult", "Learner", "LineReporter", "Monitor",
           "Reporter", "RunInfo", "StepInfo", "TrainConfig", "fit", "save_weights"]
