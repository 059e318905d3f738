"""Nothing the user owns is overwritten (issue 44, item 6): a run's exports and run files never
replace a file the run did not write, and every run that was allowed to start can be resumed.
Hostile layouts, for `anygrad train` and for Model.fit: the artifacts folder is the model's own
folder, or a folder of the user's other files."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from mnist_util import write_tiny_mnist
from test_cli import _mlp

import anygrad
from anygrad import cli
from anygrad.optim import get_optimizer
from anygrad.train.runfolder import RunFolderError


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_tiny_mnist(tmp_path_factory.mktemp("mini-mnist"))


def _train(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", str(model), "--data-dir", str(data), "--device", "cpu", "--batch-size", "8", "--optimizer",
            "sgd", "--lr", "0.05", "--artifacts", str(run), "--quiet", *extra]


def _error(capsys, args: list[str]) -> str:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error:") and "Traceback" not in err and err.count("\n") == 1, err
    return err


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256 of its bytes)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _users_folder(folder: Path) -> Path:
    """A folder of a user's own files, several of them named as a run's files are."""
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "weights.safetensors").write_bytes(b"my own weights")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))  # Hugging Face's
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "best.pt").write_bytes(b"a PyTorch checkpoint")
    return folder


# -- artifacts = the model's own folder ------------------------------------------------------------------------
def test_cli_refuses_to_write_over_the_model_it_trains(tmp_path, data, capsys):
    proj = tmp_path / "proj"
    proj.mkdir()
    model = _mlp(proj / "model.onnx")
    before = _snapshot(proj)
    for extra in ((), ("--overwrite",)):
        err = _error(capsys, _train(model, data, proj, "--epochs", "1", *extra))
        assert f"{model}" in err and "model.onnx" in err and f"--artifacts {proj / 'run'}" in err
        assert _snapshot(proj) == before and sorted(p.name for p in proj.iterdir()) == ["model.onnx"]


def test_cli_refuses_a_run_whose_weights_file_it_would_replace(tmp_path, data, capsys):
    proj = tmp_path / "proj"
    proj.mkdir()
    model = _mlp(proj / "net.onnx")
    weights = proj / "weights.npz"
    np.savez(weights, **{k: v for k, v in anygrad.load_onnx(str(model)).state_dict().items()})
    before = _snapshot(proj)
    err = _error(capsys, _train(model, data, proj, "--epochs", "1", "--weights", str(weights)))
    assert str(weights) in err and "trains from" in err
    assert _snapshot(proj) == before


def test_cli_run_beside_the_model_trains_resumes_and_leaves_the_model_alone(tmp_path, data, capsys):
    """A model under another name than the run's files: allowed, and resumable (the model file the
    checkpoints were made from is still there)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    model = _mlp(proj / "net.onnx")
    original = model.read_bytes()
    assert cli.main(_train(model, data, proj, "--epochs", "1")) == 0
    assert (proj / "model.onnx").is_file() and model.read_bytes() == original
    assert cli.main(["train", "--resume", str(proj), "--epochs", "2", "--quiet"]) == 0
    assert len((proj / "metrics.jsonl").read_text().splitlines()) == 2 and model.read_bytes() == original
    # training again from the run's own export into the run's folder would replace that export
    err = _error(capsys, _train(proj / "model.onnx", data, proj, "--epochs", "1", "--overwrite"))
    assert "trains from" in err and len((proj / "metrics.jsonl").read_text().splitlines()) == 2


# -- artifacts = a folder of the user's other files -------------------------------------------------------------
def test_cli_refuses_a_folder_holding_the_users_files_of_run_names(tmp_path, data, capsys):
    folder = _users_folder(tmp_path / "mine")
    model = _mlp(tmp_path / "mlp.onnx")
    before = _snapshot(folder)
    for extra in ((), ("--overwrite",)):  # --overwrite replaces a run, never files no run wrote
        err = _error(capsys, _train(model, data, folder, "--epochs", "1", *extra))
        assert "not an anygrad run's" in err and "weights.safetensors" in err and "config.json" in err
        assert "checkpoints/best.pt" in err and "notes.txt" not in err
        assert _snapshot(folder) == before and not (folder / ".anygrad.lock").exists()


def test_cli_run_in_a_folder_of_other_files_keeps_them_and_resumes(tmp_path, data):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "checkpoints").mkdir()
    model = _mlp(tmp_path / "mlp.onnx")
    assert cli.main(_train(model, data, folder, "--epochs", "1")) == 0
    assert (folder / "notes.txt").read_text() == "my notes\n" and (folder / "weights.npz").is_file()
    assert cli.main(["train", "--resume", str(folder), "--epochs", "2", "--quiet"]) == 0
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 2
    assert cli.main(_train(model, data, folder, "--epochs", "1", "--overwrite")) == 0  # a run's files only
    assert (folder / "notes.txt").read_text() == "my notes\n"
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 1


# -- Model.fit ----------------------------------------------------------------------------------------------------
def _fit_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((16, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int64)


def _model(path: Path):
    return anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer("sgd", lr=0.05), "cpu")


def test_fit_keeps_one_run_per_folder_unless_overwrite(tmp_path):
    model_path, run = _mlp(tmp_path / "mlp.onnx"), tmp_path / "runs" / "misc"
    settings = {"epochs": 2, "batch_size": 8, "artifacts_dir": str(run), "log": None}
    _model(model_path).fit(_fit_data(), _fit_data(), **settings)
    before = _snapshot(run)
    with pytest.raises(RunFolderError, match=r"holds another run .*resume=True.*overwrite=True"):
        _model(model_path).fit(_fit_data(), _fit_data(), **settings)
    assert _snapshot(run) == before  # config.json, metrics.jsonl and the checkpoints as they were
    _model(model_path).fit(_fit_data(), _fit_data(), **{**settings, "epochs": 3}, resume=True)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    _model(model_path).fit(_fit_data(), _fit_data(), **{**settings, "epochs": 1}, overwrite=True)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert [p.name for p in (run / "checkpoints").glob("ckpt-*.json")] == ["ckpt-00000002.json"]


def test_fit_never_writes_over_the_model_file_or_the_users_files(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    model_path = _mlp(proj / "model.onnx")
    before = _snapshot(proj)
    with pytest.raises(RunFolderError, match=r"artifacts_dir .*model\.onnx.*trains from"):
        _model(model_path).fit(_fit_data(), epochs=1, batch_size=8, artifacts_dir=str(proj), log=None,
                               overwrite=True)
    assert _snapshot(proj) == before
    folder = _users_folder(tmp_path / "mine")
    before = _snapshot(folder)
    with pytest.raises(RunFolderError, match="not an anygrad run's"):
        _model(model_path).fit(_fit_data(), epochs=1, batch_size=8, artifacts_dir=str(folder), log=None,
                               overwrite=True)
    assert _snapshot(folder) == before


# -- QA pass 2: --resume of a folder that is not a run; --overwrite and the run's plots -------------------------
def test_resume_of_a_folder_whose_config_is_not_a_runs_says_so(tmp_path, capsys):
    folder = _users_folder(tmp_path / "bert")
    before = _snapshot(folder)
    err = _error(capsys, ["train", "--resume", str(folder)])
    assert f"{folder} is not an anygrad run folder" in err and "model_type" not in err
    assert _snapshot(folder) == before


def test_overwrite_removes_the_plots_plot_wrote_and_no_file_of_the_users(tmp_path):
    pytest.importorskip("matplotlib")
    from anygrad.plot import PLOTS_RECORD, plot_run
    from anygrad.train.runfolder import RunFolder
    run = tmp_path / "lm"
    run.mkdir()
    rows = [{"epoch": e, "train_loss": 2.0 / e, "valid_loss": 2.2 / e, "train_perplexity": 7.0 / e,
             "valid_perplexity": 9.0 / e} for e in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sorted(p.name for p in plot_run(run)) == ["loss.png", "perplexity.png"]
    (run / "accuracy.png").write_bytes(b"my own picture")  # not plot's: the run had no accuracy
    (run / "notes.txt").write_text("mine\n")
    with RunFolder(run, overwrite=True, log=lambda _: None):
        pass
    assert sorted(p.name for p in run.iterdir()) == ["accuracy.png", "notes.txt"]
    # a plot the user replaced after plot drew it is theirs now; and a loss.png in a run never plotted stays
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_run(run)
    (run / "perplexity.png").write_bytes(b"edited")
    with RunFolder(run, overwrite=True, log=lambda _: None):
        pass
    assert sorted(p.name for p in run.iterdir()) == ["accuracy.png", "notes.txt", "perplexity.png"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "loss.png").write_bytes(b"my loss curve")
    with RunFolder(run, overwrite=True, log=lambda _: None):
        pass
    assert (run / "loss.png").read_bytes() == b"my loss curve" and not (run / PLOTS_RECORD).exists()
