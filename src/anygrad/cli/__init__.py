"""The `anygrad` command: info, train, predict, eval, plot, codegen, devices.

Every error a user can cause is an AnygradError; main() prints its message on one
`anygrad: error:` line (no traceback) and exits 2, as argparse's own errors do. `anygrad info` exits 1 when the model uses ops
anygrad cannot run yet.

The package, by job: entry.py (main: errors to one line and an exit code), parser.py (the
command table and the parser), options.py (every command's arguments and help), config.py
(train's settings: defaults, config.json, flags), one module per command group: training.py
(train, --resume), info.py, predict.py (predict, eval), tools.py (devices, plot, codegen);
common.py (exit codes, path messages). This module only names what users and tests import.
"""
from ..errors import AnygradError
from .common import EXIT_BROKEN_PIPE, EXIT_DIVERGED, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_UNSUPPORTED
from .config import FOUNDING_DEFAULTS, MODEL_DEFAULTS, TRAIN_DEFAULTS, model_defaults
from .options import INFERENCE_DEVICE
from .training import Console, cmd_train
from .info import cmd_info
from .predict import cmd_eval, cmd_predict
from .tools import cmd_codegen, cmd_devices, cmd_plot
from .parser import COMMANDS, Command, build_parser
from .entry import main

__all__ = ["COMMANDS", "EXIT_BROKEN_PIPE", "EXIT_DIVERGED", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_UNSUPPORTED",
           "FOUNDING_DEFAULTS", "INFERENCE_DEVICE", "MODEL_DEFAULTS", "TRAIN_DEFAULTS", "AnygradError", "Command",
           "Console", "build_parser", "cmd_codegen", "cmd_devices", "cmd_eval", "cmd_info", "cmd_plot", "cmd_predict",
           "cmd_train", "main", "model_defaults"]
