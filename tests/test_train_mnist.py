"""End to end: `anygrad train` on the founding example learns MNIST (6,000-image subset, one epoch)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anygrad.data import load_mnist

SUBSET = Path(__file__).resolve().parents[1].parent / "shared/datasets/mnist-subset"


@pytest.mark.slow
@pytest.mark.skipif(not SUBSET.is_dir(), reason="shared MNIST subset not checked out next to the repo")
def test_founding_example_learns_mnist(tmp_path):
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "anygrad.cli", "train", "--data-dir", str(SUBSET),
                        "--device", "cpu", "--epochs", "1", "--batch-size", "100", "--optimizer", "adagrad",
                        "--lr", "0.01", "--loss", "nll", "--seed", "0", "--artifacts", str(run)],
                       check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    print(r.stdout)

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["epoch"] == 1
    assert rows[0]["valid_accuracy"] >= 0.93, rows[0]
    assert rows[0]["train_loss"] < 1.0
    assert "valid" in r.stdout and f"{rows[0]['valid_accuracy']:.4f}" in r.stdout

    config = json.loads((run / "config.json").read_text())
    assert (config["optimizer"], config["lr"], config["batch_size"], config["loss"]) == ("adagrad", 0.01, 100, "nll")

    # The exported model.onnx is the trained network: onnxruntime scores the test split as anygrad did.
    ort = pytest.importorskip("onnxruntime")
    x, y = load_mnist(SUBSET).test()
    sess = ort.InferenceSession(str(run / "model.onnx"), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    pred = np.concatenate([sess.run(None, {name: x[i:i + 1000]})[0].argmax(1) for i in range(0, len(x), 1000)])
    assert abs(float((pred == y).mean()) - rows[0]["valid_accuracy"]) < 2e-3
