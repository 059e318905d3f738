"""Runs users can trust (issue 12, items 7-13): one run per folder, atomic best checkpoints, a full
disk said in one line, the best epoch exported, divergence stopped, tampered checkpoints refused,
absolute paths recorded."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mnist_util import write_tiny_mnist
from test_cli import _mlp

from anygrad import cli, fsutil
from anygrad.train import checkpoint as ckpt


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """40 train / 16 test images (class = brightness band)."""
    return write_tiny_mnist(tmp_path_factory.mktemp("mini-mnist"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return _mlp(tmp_path_factory.mktemp("model") / "mlp.onnx")


def _train(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", str(model), "--data-dir", str(data), "--device", "cpu", "--batch-size", "8", "--optimizer",
            "sgd", "--lr", "0.05", "--artifacts", str(run), "--quiet", *extra]


def _error(capsys, args: list[str], code: int = 2) -> str:
    assert cli.main(args) == code
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error:") and "Traceback" not in err and err.count("\n") == 1, err
    return err


# -- fsutil.atomic_write ------------------------------------------------------------------------------------
def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    fsutil.atomic_write(path, "old")
    assert path.read_text() == "old" and (path.stat().st_mode & 0o777) == 0o666 & ~_umask()

    def full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError):
        fsutil.atomic_write(path, full)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_artifacts_share_one_file_mode(tmp_path, model, data):
    run = tmp_path / "run"
    assert cli.main(_train(model, data, run, "--epochs", "1")) == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in run.iterdir() if p.is_file()}
    assert modes["weights.safetensors"] == modes["weights.npz"] == modes["config.json"] == 0o666 & ~_umask()


# -- item 7: one run per folder -----------------------------------------------------------------------------
def test_a_folder_holding_another_run_is_refused_unless_overwrite(tmp_path, model, data, capsys):
    run = tmp_path / "run"
    assert cli.main(_train(model, data, run, "--epochs", "2")) == 0
    before = (run / "metrics.jsonl").read_text()
    err = _error(capsys, _train(model, data, run, "--epochs", "1"))
    assert "holds another run" in err and "--overwrite" in err and f"--resume {run}" in err
    assert (run / "metrics.jsonl").read_text() == before  # untouched
    assert cli.main(_train(model, data, run, "--epochs", "1", "--overwrite")) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert [p.name for p in (run / "checkpoints").glob("ckpt-*.json")] == ["ckpt-00000005.json"]  # old ones gone
    assert not (run / ".anygrad.lock").exists()  # released


def test_a_live_run_locks_its_folder_and_a_dead_ones_lock_is_taken_over(tmp_path, model, data, capsys):
    from anygrad.train.runfolder import RunFolder, RunFolderError
    run = tmp_path / "run"
    with RunFolder(run, log=lambda m: None):  # as a live run in another process would hold it (flock)
        err = _error(capsys, _train(model, data, run, "--epochs", "1"))
        assert "in use by another anygrad run" in err and f"pid {os.getpid()}" in err
    # a lock file left by a killed process (its pid gone, its flock released by the kernel)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=False)
    (run / ".anygrad.lock").write_text(json.dumps({"pid": int(dead.stdout), "host": "x"}))
    notes: list[str] = []
    with RunFolder(run, log=notes.append):
        assert json.loads((run / ".anygrad.lock").read_text())["pid"] == os.getpid()
    assert any("no longer alive" in n and dead.stdout.strip() in n for n in notes)
    assert issubclass(RunFolderError, cli.AnygradError)


def test_python_run_gets_the_same_protection(tmp_path, model, data):
    from anygrad.train import TrainConfig
    from anygrad.train.run import RunConfig, run
    from anygrad.train.runfolder import RunFolderError
    config = TrainConfig(model=str(model), dataset="mnist", data_dir=str(data), device="cpu", epochs=1,
                         batch_size=8, optimizer="sgd", lr=0.05, artifacts_dir=str(tmp_path / "run"))
    result = run(RunConfig(config, log=None))
    assert result.exported_epoch == 1 and (tmp_path / "run" / "export.json").is_file()
    with pytest.raises(RunFolderError, match="holds another run"):
        run(RunConfig(config, log=None))


# -- item 8: the best checkpoint is committed by one rename -------------------------------------------------
def test_best_checkpoint_survives_a_kill_between_its_files(tmp_path, monkeypatch):
    state = {"w": np.arange(3, dtype=np.float32)}
    folder = tmp_path / "checkpoints"
    ckpt.write(folder, ckpt.BEST, state, {"global_step": 4})
    real = ckpt.atomic_write

    def killed_at_commit(path, content, **kw):
        if Path(path).suffix == ".json":
            raise KeyboardInterrupt  # the arrays are written, the record is not: as a kill there
        return real(path, content, **kw)
    monkeypatch.setattr(ckpt, "atomic_write", killed_at_commit)
    with pytest.raises(KeyboardInterrupt):
        ckpt.write(folder, ckpt.BEST, {"w": np.zeros(3, np.float32)}, {"global_step": 8})
    monkeypatch.undo()
    np.testing.assert_array_equal(ckpt.read(folder / "best.json").state["w"], state["w"])  # the old best, whole
    (folder / ".best.json.123.tmp").write_text("{")  # what a kill inside atomic_write leaves
    removed = ckpt.clean(folder)
    assert min(p.name for p in removed) == ".best.json.123.tmp" and len(removed) == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted(["best.json", json.loads(
        (folder / "best.json").read_text())["arrays"]])


# -- item 9: a full disk mid-run ------------------------------------------------------------------------------
def test_full_disk_mid_run_is_one_line_and_resumable(tmp_path, model, data, capsys, monkeypatch):
    run = tmp_path / "run"
    real, calls = ckpt.atomic_write, []

    def disk_fills(path, content, **kw):
        calls.append(path)
        if len(calls) > 4:  # the second epoch's checkpoint
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, content, **kw)
    monkeypatch.setattr(ckpt, "atomic_write", disk_fills)
    err = _error(capsys, _train(model, data, run, "--epochs", "3"))
    assert f"cannot write to the run folder {run}" in err and "No space left on device" in err
    assert "ckpt-00000005.json (epoch 1 step 5) is intact" in err and f"anygrad train --resume {run}" in err
    monkeypatch.undo()
    assert cli.main(["train", "--resume", str(run), "--quiet"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


# -- item 10: the best epoch is exported ----------------------------------------------------------------------
@pytest.mark.parametrize("export", ["best", "last"])
def test_the_best_epoch_is_exported(tmp_path, model, data, monkeypatch, capsys, export):
    from test_learner import _scripted
    _scripted(monkeypatch, [1.0, 0.5, 0.7])
    run = tmp_path / "run"
    assert cli.main(_train(model, data, run, "--epochs", "3", "--export", export)) == 0
    out = capsys.readouterr().out
    with np.load(run / "weights.npz") as w:
        weights = {k: w[k] for k in w.files}
    epoch = 2 if export == "best" else 3
    source = run / "checkpoints" / ("best.json" if export == "best" else "ckpt-00000015.json")
    saved = ckpt.read(source)
    assert saved.meta["epoch"] == epoch
    for name, value in weights.items():
        np.testing.assert_array_equal(value, saved.state[name])
    assert json.loads((run / "export.json").read_text())["epoch"] == epoch
    assert f"exported the weights of epoch {epoch}" in out


# -- item 11: divergence ------------------------------------------------------------------------------------------
def test_divergence_stops_keeping_the_last_finite_checkpoint(tmp_path, model, data, capsys):
    run = tmp_path / "run"
    args = _train(model, data, run, "--epochs", "3", "--log-every", "1")
    args[args.index("--lr") + 1] = "1e30"
    assert cli.main(args) == cli.EXIT_DIVERGED
    captured = capsys.readouterr()
    assert "diverged at epoch 1" in captured.err and "Traceback" not in captured.err
    for path in (run / "checkpoints").glob("*.json"):  # none, or only finite ones
        assert not [k for k, v in ckpt.read(path).state.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]


def test_divergence_skip_and_warn(tmp_path, model, data, capsys):
    for mode, code, words in (("skip", 0, "skipped"), ("warn", 0, "training goes on")):
        run = tmp_path / mode
        args = _train(model, data, run, "--epochs", "1", "--log-every", "1", "--on-nan", mode)
        args[args.index("--lr") + 1] = "1e30"
        assert cli.main(args) == code
        assert words in capsys.readouterr().out
        with np.load(run / "weights.npz") as w:
            finite = all(np.isfinite(w[k]).all() for k in w.files)
        assert finite == (mode == "skip")  # skip went back to the last finite state each time


@pytest.mark.parametrize("lr", ["inf", "nan", "-1"])
def test_lr_must_be_finite(tmp_path, model, data, capsys, lr):
    args = _train(model, data, tmp_path / "run", "--epochs", "1")
    args[args.index("--lr") + 1] = lr
    assert "lr" in _error(capsys, args)


# -- item 12: every checkpoint field is checked on resume ---------------------------------------------------------
@pytest.fixture
def finished(tmp_path, model, data) -> Path:
    run = tmp_path / "run"
    assert cli.main(_train(model, data, run, "--epochs", "1")) == 0
    return run


def _tamper(run: Path, meta: dict | None = None, drop: str | None = None, nan: str | None = None) -> None:
    path = ckpt.latest(run / "checkpoints")
    c = ckpt.read(path)
    state = dict(c.state)
    if drop:
        del state[drop]
    if nan:
        state[nan] = np.full_like(state[nan], np.nan)
    record = {k: v for k, v in c.meta.items() if k not in ("format", "arrays", "sha256")}
    ckpt.write(path.parent, path.stem, state, {**record, **(meta or {})})


@pytest.mark.parametrize("change, words", [
    ({"meta": {"step": -5}}, "'step' is -5"),
    ({"meta": {"step": 10**9}}, "'step' is 1000000000"),
    ({"meta": {"epoch": "x"}}, "'epoch' is 'x'"),
    ({"meta": {"global_step": 3}}, "'global_step' is 3"),
    ({"meta": {"history": [{"epoch": 1, "train_loss": "low"}]}}, "'history'"),
    ({"meta": {"history": []}}, "'history' holds 0 epochs"),
    ({"meta": {"monitor": {"best": None, "best_epoch": 99, "wait": 0}}}, "'monitor'"),
    ({"meta": {"lr": "fast"}}, "'lr'"),
    ({"drop": "anygrad.lr"}, "lacks the entry 'anygrad.lr'"),
    ({"drop": "fc1.weight"}, "lacks the entry 'fc1.weight'"),
    ({"nan": "fc2.bias"}, "'fc2.bias' holds NaN"),
])
def test_tampered_checkpoints_are_refused(finished, capsys, change, words):
    _tamper(finished, **change)
    err = _error(capsys, ["train", "--resume", str(finished), "--epochs", "2"])
    assert words in err, err


# -- item 13: paths ---------------------------------------------------------------------------------------------
def test_relative_paths_are_stored_absolute_and_as_typed(tmp_path, model, data, monkeypatch, capsys):
    monkeypatch.chdir(data.parent)
    assert cli.main(_train(model, Path(data.name), Path("rel-run"), "--epochs", "1")) == 0
    config = json.loads((data.parent / "rel-run" / "config.json").read_text())
    assert config["data_dir"] == str(data) and config["artifacts_dir"] == str(data.parent / "rel-run")
    assert config["resolved"]["paths_as_typed"] == {"data_dir": data.name, "artifacts_dir": "rel-run"}
    monkeypatch.chdir(tmp_path)  # predict from elsewhere finds the data through the absolute path
    assert cli.main(["predict", str(data.parent / "rel-run"), "--device", "cpu"]) == 0
    config["data_dir"] = "gone"
    (data.parent / "rel-run" / "config.json").write_text(json.dumps(config))
    err = _error(capsys, ["predict", str(data.parent / "rel-run"), "--device", "cpu"])
    assert "gone" in err and "config.json" in err


# -- item 16: no RuntimeWarning from ReduceLogSumExp over an all -inf row ------------------------------------------
def test_logsumexp_of_minus_inf_rows_warns_nothing():
    import warnings

    from anygrad.ops.reduce import _logsumexp
    x = np.array([[-np.inf, -np.inf], [0.0, 1.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _logsumexp(x, (1,), False)
    assert out[0] == -np.inf and np.isclose(out[1], np.log(1 + np.e))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _logsumexp(np.zeros((2, 0), np.float32), (1,), False).tolist() == [-np.inf, -np.inf]


def test_guard_sees_a_statistic_overflow_while_the_loss_is_finite():
    """--lr 1e6 with BatchNorm: the running variance overflows before the loss does."""
    from anygrad.train.guard import Guard
    state = {"bn.running_var": np.array([1.0, np.inf], np.float32), "step": np.array([3], np.int64)}
    guard = Guard("stop", lambda: state, lambda: state, lambda s: None)
    assert guard.problem(0.5) == "bn.running_var holds NaN or infinite values"
    state["bn.running_var"][1] = 2.0
    assert guard.problem(0.5) is None and guard.problem(float("nan")) == "the loss is nan"
