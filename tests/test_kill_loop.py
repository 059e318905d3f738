"""The kill loop (issue 12): a run SIGKILLed again and again, at random moments and in the middle of
writing a checkpoint (between a file's temp write and its rename, between the best checkpoint's
arrays and its record), resumed each time, ends with the very bytes of a run never killed; after
every kill each committed checkpoint, the best one included, reads back whole."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_resume import _mlp

from anygrad.data import write_idx
from anygrad.data.mnist import MNIST_FILES
from anygrad.train import checkpoint as ckpt

# Runs the CLI, SIGKILLing itself at the KILL_AT_WRITE-th checkpoint file write, after the temp
# file is written and before its rename (KILL_AT_WRITE=0: never).
KILLABLE = """
import os, signal, sys
from pathlib import Path
from anygrad import fsutil
from anygrad.train import checkpoint as ck
at, count, real = int(os.environ.get("KILL_AT_WRITE", "0")), [0], ck.atomic_write
def write(path, content, **kw):
    count[0] += 1
    if count[0] == at:
        fsutil.temp_name(Path(path)).write_bytes(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, content, **kw)
ck.atomic_write = write
from anygrad.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("killloop")
    rng = np.random.default_rng(1)
    for split, n in (("train", 120), ("test", 24)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = (rng.integers(0, 20, (n, 28, 28)) + y[:, None, None] * 23).astype(np.uint8)
        write_idx(folder / f"{MNIST_FILES['x_' + split].name}.gz", x)
        write_idx(folder / f"{MNIST_FILES['y_' + split].name}.gz", y)
    return _mlp(folder / "mlp.onnx", hidden=8), folder


def _args(model: Path, data: Path, run: Path) -> list[str]:
    return ["train", str(model), "--data-dir", str(data), "--device", "cpu", "--epochs", "4", "--batch-size", "8",
            "--optimizer", "adam", "--lr", "0.003", "--checkpoint-every", "4", "--keep-checkpoints", "2",
            "--seed", "7", "--artifacts", str(run), "--quiet"]


def _spawn(args: list[str], kill_at_write: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", KILLABLE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "KILL_AT_WRITE": str(kill_at_write), "PYTHONUNBUFFERED": "1"})


def _state(path: Path) -> dict[str, bytes]:
    c = ckpt.read(path)
    return {k: v.tobytes() for k, v in c.state.items() if not k.startswith("anygrad.metric")}


def _weights(run: Path) -> dict[str, bytes]:
    with np.load(run / "weights.npz", allow_pickle=False) as z:
        return {k: z[k].tobytes() for k in z.files}


def _all_committed_checkpoints_read(run: Path) -> None:
    folder = run / "checkpoints"
    for path in [*ckpt.numbered(folder), *([folder / "best.json"] if (folder / "best.json").exists() else [])]:
        ckpt.read(path)  # raises CheckpointError when a pair does not match


def test_kill_loop_resumes_to_identical_weights(tmp_path, setup):
    model, data = setup
    ref = tmp_path / "ref"
    r = subprocess.run([sys.executable, "-c", KILLABLE, *_args(model, data, ref)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr

    run = tmp_path / "run"
    rng = np.random.default_rng(12)
    # mid-write kills: the first step checkpoint's arrays, a best's arrays before its record, a
    # best's record, a later step checkpoint's record; then kills at random moments
    plan = [("write", 1), ("write", 5), ("write", 8), ("write", 11), ("time", None), ("time", None)]
    kills = 0
    for how, n in plan:
        resume = ckpt.latest(run / "checkpoints") is not None
        args = ["train", "--resume", str(run), "--quiet"] if resume else [*_args(model, data, run), "--overwrite"]
        proc = _spawn(args, kill_at_write=n if how == "write" else 0)
        if how == "time":
            time.sleep(float(rng.uniform(3.0, 8.0)))  # the interpreter's start takes a few seconds
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        out = proc.communicate(timeout=600)[0]
        assert "Traceback" not in out, out
        if proc.returncode == -signal.SIGKILL:
            kills += 1
        else:
            assert proc.returncode == 0, out
        _all_committed_checkpoints_read(run)
        if proc.returncode == 0:
            break
    assert kills >= 4
    final = subprocess.run([sys.executable, "-c", KILLABLE, "train", "--resume", str(run), "--quiet"],
                           capture_output=True, text=True, timeout=600, check=False)
    assert final.returncode == 0, final.stdout + final.stderr
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]  # cleaned on start

    assert _weights(run) == _weights(ref)  # the exported (best) weights, byte for byte
    assert _state(ckpt.latest(run / "checkpoints")) == _state(ckpt.latest(ref / "checkpoints"))
    assert _state(run / "checkpoints" / "best.json") == _state(ref / "checkpoints" / "best.json")
