"""Small things a new user ran into (issue 44, item 7): each one as the user met it."""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mnist_util import write_tiny_mnist
from test_cli import _mlp

from anygrad import cli
from anygrad.cli.config import _train_settings
from anygrad.data.mnist import MNIST_FILES, load_mnist
from anygrad.errors import DataError
from anygrad.examples import FOUNDING_MODEL

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_tiny_mnist(tmp_path_factory.mktemp("mini-mnist"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return _mlp(tmp_path_factory.mktemp("model") / "mlp.onnx")


def _train(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", str(model), "--data-dir", str(data), "--device", "cpu", "--batch-size", "8", "--optimizer",
            "sgd", "--lr", "0.05", "--artifacts", str(run), "--quiet", *extra]


def _error(capsys, args: list[str]) -> str:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error:") and "Traceback" not in err and err.count("\n") == 1, err
    return err


# -- --memory-budget ---------------------------------------------------------------------------------------------
def test_memory_budget_is_checked_on_every_device_and_noted_once_off_wgpu(tmp_path, model, data, capsys):
    err = _error(capsys, _train(model, data, tmp_path / "bad", "--epochs", "1", "--memory-budget", "lots"))
    assert "--memory-budget 'lots' is not a size" in err
    assert not (tmp_path / "bad").exists()  # refused before the run folder stays behind
    assert cli.main(_train(model, data, tmp_path / "run", "--epochs", "1", "--memory-budget", "1GB")) == 0
    out = capsys.readouterr().out
    assert out.count("--memory-budget applies to wgpu devices only") == 1, out
    assert cli.main(_train(model, data, tmp_path / "plain", "--epochs", "1")) == 0
    assert "memory-budget" not in capsys.readouterr().out


# -- a closed stdout -----------------------------------------------------------------------------------------------
def test_a_closed_stdout_ends_quietly():
    """`anygrad info MODEL | head -1`: the reader is gone before the command writes."""
    proc = subprocess.Popen([sys.executable, "-m", "anygrad", "info", str(FOUNDING_MODEL)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(SRC)})
    proc.stdout.close()  # as `head -1` exits: every write of the command meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE and err == "", err


def test_a_closed_stdout_in_process(monkeypatch, capsys):
    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(sys, "stdout", Closed())
    assert cli.main(["info", str(FOUNDING_MODEL)]) == cli.EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""


# -- info plans with the optimizer train would use ---------------------------------------------------------------
def test_info_and_train_share_the_models_default_optimizer(model):
    parser = cli.build_parser()
    founding = _train_settings(parser.parse_args(["train", str(FOUNDING_MODEL)]))
    assert founding["optimizer"] == cli.FOUNDING_DEFAULTS["optimizer"] == "adagrad"
    assert _train_settings(parser.parse_args(["train"]))["optimizer"] == "adagrad"
    own = _train_settings(parser.parse_args(["train", str(model)]))
    assert own["optimizer"] == cli.MODEL_DEFAULTS["optimizer"] == "adam"
    assert cli.model_defaults(FOUNDING_MODEL) is cli.FOUNDING_DEFAULTS
    assert cli.model_defaults(model) is cli.MODEL_DEFAULTS


@pytest.mark.wgpu
def test_info_labels_its_memory_plan_with_the_default_optimizer(model, capsys):
    from wgpu_util import has_adapter, no_adapter
    if not has_adapter():
        no_adapter()
    assert cli.main(["info", str(FOUNDING_MODEL), "--batch-size", "8"]) == 0
    assert "training step at batch 8 on" in (out := capsys.readouterr().out) and "(adagrad, nll)" in out, out
    assert cli.main(["info", str(model), "--batch-size", "8"]) == 0
    assert "(adam, cross_entropy)" in (out := capsys.readouterr().out), out
    assert cli.main(["info", str(model), "--batch-size", "8", "--optimizer", "sgd"]) == 0
    assert "(sgd, cross_entropy)" in capsys.readouterr().out


# -- --resume, codegen -o, --lr ------------------------------------------------------------------------------------
def test_resume_of_a_missing_folder_says_so(tmp_path, capsys):
    err = _error(capsys, ["train", "--resume", str(tmp_path / "nope")])
    assert f"--resume {tmp_path / 'nope'}: no such folder" in err
    (tmp_path / "file").write_text("x")
    assert "a file, not a folder" in _error(capsys, ["train", "--resume", str(tmp_path / "file")])
    (tmp_path / "empty").mkdir()
    assert "not a training run folder" in _error(capsys, ["train", "--resume", str(tmp_path / "empty")])


def test_codegen_creates_the_folder_of_its_output(tmp_path, model, capsys):
    out = tmp_path / "new" / "sub" / "net.py"
    assert cli.main(["codegen", str(model), "-o", str(out)]) == 0
    assert out.is_file() and out.with_suffix(".safetensors").is_file()
    (tmp_path / "afile").write_text("x")
    err = _error(capsys, ["codegen", str(model), "-o", str(tmp_path / "afile" / "net.py")])
    assert "is a file, not a folder" in err


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_lr_that_is_not_a_number_is_said_so(tmp_path, model, data, capsys, value):
    args = _train(model, data, tmp_path / "run", "--epochs", "1")
    args[args.index("--lr") + 1] = value
    err = _error(capsys, args)
    assert "--lr" in err and "not a number" in err and ">= 0" not in err


# -- an interrupted run says what it exported ---------------------------------------------------------------------
def test_an_interrupted_run_writes_export_json(tmp_path, model, data):
    from anygrad.train import LineReporter, TrainConfig
    from anygrad.train import checkpoint as ckpt
    from anygrad.train.run import RunConfig, run

    class CtrlC(LineReporter):
        def step(self, info):
            if info.epoch == 2 and info.step == 3:
                os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C would

    folder = tmp_path / "run"
    config = TrainConfig(model=str(model), dataset="mnist", data_dir=str(data), device="cpu", epochs=3,
                         batch_size=8, optimizer="sgd", lr=0.05, log_every=1, artifacts_dir=str(folder),
                         export="last")
    result = run(RunConfig(config, reporter=CtrlC(None), log=None))
    assert result.interrupted and len(result.history) == 1
    record = json.loads((folder / "export.json").read_text())
    assert record["epoch"] == 1 and record["interrupted"] is True and record["last_epoch"] == 1
    import numpy as np
    epoch_end = ckpt.read(folder / "checkpoints" / "ckpt-00000005.json")  # 40 samples / 8: epoch 1's end
    with np.load(folder / "weights.npz") as w:
        for name in w.files:
            np.testing.assert_array_equal(w[name], epoch_end.state[name])


# -- a damaged file of the user's own is the user's to replace --------------------------------------------------
def test_a_truncated_gz_in_the_users_data_dir_is_named_not_deleted(tmp_path, model, capsys):
    (tmp_path / "mine").mkdir()
    data = write_tiny_mnist(tmp_path / "mine")
    damaged = data / f"{MNIST_FILES['x_train'].name}.gz"
    damaged.write_bytes(damaged.read_bytes()[:60])
    err = _error(capsys, _train(model, data, tmp_path / "run", "--epochs", "1"))
    assert str(damaged) in err and "truncated or corrupt" in err and "delete" not in err
    assert "replace it" in err
    with pytest.raises(DataError, match="delete it and anygrad downloads it again"):  # the cache's own copy
        load_mnist(cache_dir=data, download=False)


def test_a_gz_whose_content_is_cut_short_is_named_too(tmp_path):
    (tmp_path / "mine").mkdir()
    data = write_tiny_mnist(tmp_path / "mine")
    labels = data / f"{MNIST_FILES['y_test'].name}.gz"
    labels.write_bytes(gzip.compress(gzip.decompress(labels.read_bytes())[:-3]))  # whole gzip, short IDX
    with pytest.raises(DataError, match="truncated or corrupt: replace it") as e:
        load_mnist(data_dir=data)
    assert str(labels) in str(e.value) and "delete" not in str(e.value)


# -- --limits: checked and noted as --memory-budget is ------------------------------------------------------------
def test_limits_are_checked_on_every_device_and_noted_once_off_wgpu(tmp_path, model, data, capsys):
    err = _error(capsys, _train(model, data, tmp_path / "bad", "--epochs", "1", "--limits", "potato"))
    assert "unknown limits profile 'potato'" in err
    assert not (tmp_path / "bad").exists()  # refused before config.json records it
    assert cli.main(_train(model, data, tmp_path / "run", "--epochs", "1", "--limits", "uhd630")) == 0
    out = capsys.readouterr().out
    assert out.count("note: --limits applies to wgpu devices only") == 1, out
    assert cli.main(_train(model, data, tmp_path / "own", "--epochs", "1", "--limits", "adapter")) == 0
    assert "--limits" not in capsys.readouterr().out  # no profile: nothing to note


def test_a_bad_limits_variable_is_refused_before_overwrite_replaces_a_run(tmp_path, model, data, capsys, monkeypatch):
    """ANYGRAD_WGPU_LIMITS is checked with --limits, before the run folder is claimed: the earlier
    run that --overwrite would replace is still there; `anygrad devices` names it too."""
    run = tmp_path / "run"
    assert cli.main(_train(model, data, run, "--epochs", "1")) == 0
    before = sorted(p.name for p in run.rglob("*"))
    monkeypatch.setenv("ANYGRAD_WGPU_LIMITS", "bogus")
    err = _error(capsys, _train(model, data, run, "--epochs", "1", "--overwrite"))
    assert err.startswith("anygrad: error: ANYGRAD_WGPU_LIMITS=bogus: unknown limits profile 'bogus'")
    assert sorted(p.name for p in run.rglob("*")) == before
    assert "ANYGRAD_WGPU_LIMITS=bogus" in _error(capsys, ["devices"])


def test_limits_and_memory_budget_are_checked_in_python_on_every_device(model):
    from anygrad import load_onnx
    from anygrad.backends.base import Backend
    from anygrad.devices import get_backend
    from anygrad.errors import ConfigError
    m = load_onnx(str(model))
    for kwargs, said in (({"limits": "potato"}, "unknown limits profile 'potato'"),
                         ({"memory_budget": "lots"}, "memory_budget 'lots' is not a size"),
                         ({"limits": 5}, "limits names a limits profile")):
        with pytest.raises(ConfigError, match=said):
            m.compile(loss="cross_entropy", device="cpu", **kwargs)
        with pytest.raises(ConfigError, match=said):  # a backend given, not a name: checked all the same
            m.compile(loss="cross_entropy", device=get_backend("cpu"), **kwargs)
        with pytest.raises(ConfigError, match=said):
            get_backend("cpu", **kwargs)
    assert isinstance(get_backend("cpu", limits="uhd630", memory_budget="1GB"), Backend)  # valid: no error


# -- --weights-partial, --weights-key: load_state_dict's strict=False and key= --------------------------------
def test_weights_partial_and_key_from_the_command_line(tmp_path, model, data, capsys):
    import onnx
    import torch
    from onnx import numpy_helper
    from safetensors.numpy import save_file
    w = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer if t.name != "shape"}
    save_file({k: v for k, v in w.items() if k.startswith("fc1.")}, str(tmp_path / "half.safetensors"))
    half = ["--weights", str(tmp_path / "half.safetensors")]
    err = _error(capsys, _train(model, data, tmp_path / "strict", "--epochs", "1", *half))
    assert "missing (2)" in err and "strict=False (--weights-partial)" in err
    assert cli.main(_train(model, data, tmp_path / "partial", "--epochs", "1", *half, "--weights-partial")) == 0
    out = capsys.readouterr().out
    assert "--weights-partial loaded 2 entries of half.safetensors; 2 missing" in out, out
    record = json.loads((tmp_path / "partial" / "config.json").read_text())
    assert record["weights_partial"] is True and record["weights_key"] is None
    # a checkpoint dict with two state_dicts: --weights-key picks one
    torch.save({"model": {k: torch.tensor(v) for k, v in w.items()},
                "ema": {k: torch.zeros(v.shape) for k, v in w.items()}}, tmp_path / "ckpt.pt")
    assert cli.main(_train(model, data, tmp_path / "ema", "--epochs", "1", "--weights", str(tmp_path / "ckpt.pt"),
                           "--weights-key", "ema")) == 0
    assert json.loads((tmp_path / "ema" / "config.json").read_text())["weights_key"] == "ema"
    err = _error(capsys, _train(model, data, tmp_path / "nokey", "--epochs", "1", "--weights",
                                str(tmp_path / "ckpt.pt"), "--weights-key", "nope"))
    assert "entry 'nope'" in err
    err = _error(capsys, _train(model, data, tmp_path / "flat", "--epochs", "1", *half, "--weights-key", "model"))
    assert "(--weights-key)" in err and "leave the key out" in err
    err = _error(capsys, _train(model, data, tmp_path / "alone", "--epochs", "1", "--weights-partial"))
    assert "give --weights too" in err


def test_info_says_describes_for_one_option(capsys):
    err = _error(capsys, ["info", str(FOUNDING_MODEL), "--optimizer", "sgd"])
    assert "--optimizer describes the training step" in err, err
    err = _error(capsys, ["info", str(FOUNDING_MODEL), "--optimizer", "sgd", "--loss", "nll"])
    assert "--loss, --optimizer describe the training step" in err, err


# -- QA pass 2: codegen's targets, a run that diverged before its first checkpoint, option suggestions ------------
def test_codegen_refuses_existing_files_unless_overwrite(tmp_path, model, capsys):
    out, weights = tmp_path / "mine.py", tmp_path / "mine.safetensors"
    assert cli.main(["codegen", str(model), "-o", str(out)]) == 0
    capsys.readouterr()
    out.write_text("# my own code\n")
    weights.write_bytes(b"my own weights")
    err = _error(capsys, ["codegen", str(model), "-o", str(out)])
    assert f"{out} exists" in err and "--overwrite" in err
    out.unlink()  # the module is free, its weights file beside it is not: refused too, nothing written
    err = _error(capsys, ["codegen", str(model), "-o", str(out)])
    assert f"{weights} exists" in err and "--weights-out" in err and not out.exists()
    assert weights.read_bytes() == b"my own weights"
    other = tmp_path / "w.safetensors"
    other.write_bytes(b"mine too")
    err = _error(capsys, ["codegen", str(model), "-o", str(tmp_path / "new.py"), "--weights-out", str(other)])
    assert f"{other} exists" in err and "choose another --weights-out" in err and not (tmp_path / "new.py").exists()
    assert cli.main(["codegen", str(model), "-o", str(tmp_path / "new.py"), "--weights-out", str(other),
                     "--no-weights"]) == 0  # writes no weights: nothing to refuse
    assert other.read_bytes() == b"mine too"
    assert cli.main(["codegen", str(model), "-o", str(out), "--overwrite"]) == 0
    assert "class Model" in out.read_text() and weights.read_bytes() != b"my own weights"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_run_that_diverged_before_its_first_checkpoint_says_how_to_start_again(tmp_path, model, data, capsys):
    run = tmp_path / "rn0"
    args = _train(model, data, run, "--epochs", "1")
    args[args.index("--lr") + 1] = "1e12"
    assert cli.main(args) == cli.EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "no checkpoint was written" in err and "--overwrite" in err and "newest checkpoint" not in err, err
    again = _error(capsys, _train(model, data, run, "--epochs", "1"))
    assert "--overwrite" in again and "--resume" not in again and "cannot be resumed" in again
    resumed = _error(capsys, ["train", "--resume", str(run), "--quiet"])
    assert "no checkpoint" in resumed and "--overwrite" in resumed
    assert cli.main(_train(model, data, run, "--epochs", "1", "--overwrite")) == 0


def _usage_error(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("anygrad: error:") and err.count("\n") == 1, err
    return err


def test_a_mistyped_option_is_suggested_only_when_close(capsys):
    assert "did you mean" not in _usage_error(capsys, ["train", "--bogus"])  # was: --loss
    assert "(did you mean --batch-size?)" in _usage_error(capsys, ["train", "--batch-sise", "8"])
    assert "(did you mean --overwrite?)" in _usage_error(capsys, ["codegen", "m.onnx", "--overwirte"])
