"""The names of the old single trainer module, re-exported from their homes (kept so that
`from anygrad.train.trainer import ...` goes on working):

- config.py: TrainConfig and its checks and config.json form
- metrics.py: EpochMetrics, the monitorable metric names, the host-side metric sums
- artifacts.py: metrics files, config.json record, weights exports
- line_reporter.py: LineReporter
- interrupt.py: Ctrl-C handling of the loop
- learner.py: Learner, fit, FitResult, the loop

Names are bound here, not looked up through this module: to monkeypatch one the loop calls (e.g.
_validate), patch it in anygrad.train.learner.
"""
from __future__ import annotations

from .artifacts import (
           _on_device_stats,
           _onnx_exporter,
           _save_safetensors,
           config_record,
           save_weights,
           write_json,
           write_metrics,
)
from .config import BOOKKEEPING_KEYS, NORMALIZE_MODES, RESUMABLE_CHANGES, TrainConfig
from .interrupt import _graceful_interrupt, _StopFlag
from .learner import (
           Arrays,
           Data,
           FitResult,
           Learner,
           Transform,
           _inputs,
           _layout,
           _Run,
           _validate,
           _with_last,
           fit,
)
from .line_reporter import LineReporter, Log, _fmt
from .metrics import (
           FIELD_METRICS,
           FIXED_MONITORS,
           METRIC_FAMILIES,
           EpochMetrics,
           _finite,
           _Sums,
           metric_family,
           monitorable_names,
)

__all__ = [
           "BOOKKEEPING_KEYS",
           "FIELD_METRICS",
           "FIXED_MONITORS",
           "METRIC_FAMILIES",
           "NORMALIZE_MODES",
           "RESUMABLE_CHANGES",
           "Arrays",
           "Data",
           "EpochMetrics",
           "FitResult",
           "Learner",
           "LineReporter",
           "Log",
           "TrainConfig",
           "Transform",
           "_Run",
           "_StopFlag",
           "_Sums",
           "_finite",
           "_fmt",
           "_graceful_interrupt",
           "_inputs",
           "_layout",
           "_on_device_stats",
           "_onnx_exporter",
           "_save_safetensors",
           "_validate",
           "_with_last",
           "config_record",
           "fit",
           "metric_family",
           "monitorable_names",
           "save_weights",
           "write_json",
           "write_metrics",
]
