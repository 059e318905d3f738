"""benchmarks/models.py end to end on the founding CNN (tiny timings): the script the model
tables in BENCHMARKS.md come from must run its whole anygrad path (compile, timed steps, the
compiled program's memory report, the GPU profile where the adapter times kernels), or a device
run is lost. Without CUDA there is no PyTorch case to set beside it. Its numbers are not checked
here: speed is the benchmark's business."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from wgpu_util import wgpu_backend

pytestmark = pytest.mark.wgpu
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "models.py"


def test_models_benchmark_runs_anygrad_and_pytorch_on_the_founding_cnn(tmp_path):
    wgpu_backend()  # skips without an adapter
    out = tmp_path / "models.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "cnn:64", "--device", "wgpu",
                           "--torch-cases", "none", "--seconds", "0.05", "--repeats", "1", "--profile",
                           "--timeout", "600", "--json", str(out)], check=False, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert not [c["error"] for c in result["cases"] if "error" in c], proc.stderr[-3000:]
    (anygrad,) = result["cases"]
    assert anygrad["framework"] == "anygrad" and anygrad["samples_per_s"] > 0
    assert anygrad["kernels"] > 0 and anygrad["planned_mib"] > 0 and anygrad["compile_times"]
    assert "| cnn | 64 |" in proc.stdout
