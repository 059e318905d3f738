"""Training loops over compiled models: the Learner (validation, metrics, early stopping,
schedules, checkpoints, resume), the Reporter interface its displays implement, and `run`: a whole
run from its settings as `anygrad train` does it (folder lock and protection, best export, NaN
handling; anygrad.train.run.run)."""
from .. import facade
from .checkpoint import CheckpointError
from .monitor import Monitor
from .report import EpochInfo, Reporter, RunInfo, StepInfo
from .artifacts import save_weights
from .config import TrainConfig
from .learner import FitResult, Learner, fit
from .line_reporter import LineReporter
from .metrics import EpochMetrics
from .run import RunConfig  # and run(): `from anygrad.train.run import run` (the module keeps the name)

# Model.fit calls fit through anygrad.facade (the Model does not import the layer above it)
facade.register("fit", fit)

__all__ = ["CheckpointError", "EpochInfo", "EpochMetrics", "FitResult", "Learner", "LineReporter", "Monitor",
           "Reporter", "RunConfig", "RunInfo", "StepInfo", "TrainConfig", "fit", "save_weights"]
