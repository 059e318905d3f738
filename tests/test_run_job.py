"""The run in one place (issue 45, item 5): what `anygrad train` does around the Learner (the run
folder made and removed again, the process group of a torchrun job, rank 0's output, an elastic
restart resumed) is train.run.run's, so a Python caller of run(RunConfig) gets all of it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from mnist_util import write_tiny_mnist
from test_cli import _mlp

from anygrad.train import TrainConfig
from anygrad.train import checkpoint as ckpt
from anygrad.train.job import elastic_resume
from anygrad.train.run import RunConfig, run

SRC = str(Path(__file__).resolve().parents[1] / "src")
JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_tiny_mnist(tmp_path_factory.mktemp("mini-mnist"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return _mlp(tmp_path_factory.mktemp("model") / "mlp.onnx")


def _config(model: Path, data: Path, folder: Path | None, epochs: int = 1) -> TrainConfig:
    return TrainConfig(model=str(model), dataset="mnist", data_dir=str(data), device="cpu", epochs=epochs,
                       batch_size=8, optimizer="sgd", lr=0.05, seed=1, artifacts_dir=str(folder) if folder else None)


def test_a_run_that_never_started_leaves_no_folder(tmp_path, data):
    folder = tmp_path / "new" / "deeper"
    with pytest.raises(Exception, match="mlp.onnx"):
        run(RunConfig(_config(tmp_path / "mlp.onnx", data, folder), log=None))  # no such model file
    assert not (tmp_path / "new").exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(Exception, match="is a file, not a folder"):
        run(RunConfig(_config(tmp_path / "mlp.onnx", data, tmp_path / "afile" / "run"), log=None))


def test_the_default_folder_is_made_absolute_and_noted_as_made(tmp_path, model, data, monkeypatch):
    import json
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    result = run(RunConfig(_config(model, data, None), log=lines.append))
    assert result.artifacts_dir.is_absolute() and result.artifacts_dir.parent == tmp_path / "runs"
    assert lines[-1] == f"artifacts: {result.artifacts_dir}"
    record = json.loads((result.artifacts_dir / "config.json").read_text())
    assert record["artifacts_dir"] == str(result.artifacts_dir)
    assert record["resolved"]["paths_as_typed"]["artifacts_dir"] == str(result.artifacts_dir.relative_to(tmp_path))


def test_elastic_resume_follows_the_folders_checkpoints(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)
    assert elastic_resume(folder, False, False) == (False, False)  # a first start: as asked
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert elastic_resume(folder, False, False) == (False, True)  # died before its first checkpoint
    ckpt.write(folder / "checkpoints", "ckpt-00000003", {"w": np.zeros(2, np.float32)}, {"global_step": 3})
    assert elastic_resume(folder, False, False) == (True, False)
    assert elastic_resume(None, False, False) == (False, False)  # a default folder is new on every start


# Two ranks of a torchrun-like job, each calling train.run.run itself (no CLI).
RANK = textwrap.dedent("""
    import sys
    from anygrad.train import TrainConfig
    from anygrad.train.run import RunConfig, run
    model, data, folder, epochs = sys.argv[1:5]
    config = TrainConfig(model=model, dataset="mnist", data_dir=data, device="cpu", epochs=int(epochs), batch_size=8,
                         optimizer="sgd", lr=0.05, seed=1, artifacts_dir=folder)
    result = run(RunConfig(config))
    import torch.distributed as dist
    print("group closed:", not dist.is_initialized(), file=sys.stderr)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(script: Path, args: list[str], restart: int = 0) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
        env.update(PYTHONPATH=SRC + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_RESTART_COUNT=str(restart))
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_python_ranks_join_the_job_speak_once_and_resume_after_a_restart(tmp_path, model, data):
    pytest.importorskip("torch.distributed")
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    folder = tmp_path / "run"
    first = _ranks(script, [str(model), str(data), str(folder), "1"])
    for r in first:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "group closed: True" in r.stderr
    assert "artifacts:" in first[0].stdout and "training mlp.onnx" in first[0].stdout
    assert first[1].stdout == "", first[1].stdout  # rank 1 says nothing
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 1
    # torchrun restarted the job (the same settings, now 2 epochs): it resumes, not "holds another run"
    again = _ranks(script, [str(model), str(data), str(folder), "2"], restart=1)
    for r in again:
        assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in again[0].stdout and again[1].stdout == ""
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 2
    # one process over the same two epochs: the same weights (the ranks split each global batch)
    one = run(RunConfig(_config(model, data, tmp_path / "one", epochs=2), log=None))
    with np.load(folder / "weights.npz") as got, np.load(one.artifacts_dir / "weights.npz") as ref:
        for name in ref.files:
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
