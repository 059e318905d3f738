"""Every subcommand fed garbage ends in one `anygrad: error:` line and exit code 2, never a traceback
(issue 12, item 6); Ctrl-C at any moment is exit code 130; the small edges of items 15."""
from __future__ import annotations

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


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished one-epoch run on 40 synthetic images, and odd files beside it."""
    folder = write_tiny_mnist(tmp_path_factory.mktemp("garbage"))
    run = folder / "run"
    assert cli.main(["train", str(_mlp(folder / "m.onnx")), "--data-dir", str(folder), "--device", "cpu",
                     "--batch-size", "8", "--artifacts", str(run), "--quiet"]) == 0
    return run


def _odd_files(folder: Path) -> list[str]:
    nested = folder / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    deep = folder / "deep.json"
    deep.write_text('{"a":' * 50_000 + "1" + "}" * 50_000)
    odd = folder / "ckpt-00000001.json"
    odd.write_text(json.dumps({"format": "anygrad-checkpoint/1", "arrays": {"x": 1}, "config": [1], "3": None}))
    return [str(nested), str(deep), str(odd)]


GARBAGE = [["--nope"], ["x" * 100_000], ["\udcff"], ["-"], ["--batch-size", "abc"], ["--batch-size", "0"],
           ["--batch-size", "-3"], ["--device", "bogus"], ["--index", "-1"], ["--top", "-5"], ["--epochs", "1e9"],
           ["--lr", "inf"], ["--limits", "zzz"], ["-o", "/proc/nope/x"], ["--config", "x" * 100_000],
           ["--resume", "x" * 100_000], ["--artifacts", "x" * 100_000], ["--data-dir", "x" * 100_000]]


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_garbage_arguments_are_one_line_errors(command, run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # whatever a command writes by default lands here
    odd = _odd_files(tmp_path)
    cases = [g for g in GARBAGE] + [[f] for f in odd] + [["--config", f] for f in odd] + [["--weights", odd[2]]]
    if command != "devices":  # with a real first argument, so that the options themselves are judged
        first = str(run) if command in ("plot", "predict", "eval") else str(run / "model.onnx")
        cases += [[first, *g] for g in GARBAGE if g[0].startswith("-")]
    for args in cases:
        if command == "train" and not args[0].startswith("-") and args[0] == str(run / "model.onnx"):
            continue  # a model and some options: a real training run, not garbage
        try:
            code = cli.main([command, *args])
        except SystemExit as e:  # argparse
            code = e.code
        lines = [line for line in capsys.readouterr().err.splitlines() if "software adapter" not in line]
        err = "\n".join(lines)
        assert code == 2, (command, [a[:40] for a in args], err)
        assert len(lines) == 1 and err.startswith("anygrad: error:"), err
        assert len(err) < 1000  # a 100k-character argument is elided


def test_eval_batch_size_predict_index_and_top(run, capsys):
    for args, words in ((["eval", str(run), "--batch-size", "0"], "at least 1"),
                        (["predict", str(run), "--index", "-1"], "counts samples from 0"),
                        (["predict", str(run), "--top", "0"], "at least 1"),
                        # an image run: --dataset tokens is eval's, not a language model's refusal
                        (["predict", str(run), "--dataset", "tokens"], "--dataset tokens is for `anygrad eval")):
        assert cli.main(args) == 2
        assert words in capsys.readouterr().err


def test_plot_to_an_unwritable_path(run, capsys):
    pytest.importorskip("matplotlib")
    assert cli.main(["plot", str(run), "-o", str(run / "model.onnx")]) == 2  # a file where a folder must be
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error:") and "model.onnx" in err


def test_odd_checkpoint_records_for_predict(run, capsys):
    record = json.loads(max((run / "checkpoints").glob("ckpt-*.json")).read_text())
    for key in ("config", "arrays", "sha256", "epoch"):
        for bad in (None, "x", [1], {"a": 1}, -1, True):
            path = run / "checkpoints" / "ckpt-99999999.json"
            path.write_text(json.dumps({**record, key: bad}))
            code = cli.main(["predict", str(path)])
            err = capsys.readouterr().err
            assert code == 0 or (code == 2 and err.startswith("anygrad: error:")), (key, bad, err)
            path.unlink()


def test_batch_size_larger_than_the_data(run, capsys):
    config = json.loads((run / "config.json").read_text())
    assert cli.main(["train", config["model"], "--data-dir", config["data_dir"], "--device", "cpu", "--batch-size",
                     "41", "--artifacts", str(run.parent / "big"), "--quiet"]) == 2
    assert "larger than the 40 training samples" in capsys.readouterr().err


def test_did_you_mean_help_and_no_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--batchsize", "3"])
    assert e.value.code == 2 and "did you mean --batch-size?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["trian"])
    assert "did you mean train?" in capsys.readouterr().err
    assert cli.main([]) == 0 and "COMMAND" in capsys.readouterr().out
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for option in ("--epochs", "--batch-size", "--on-nan", "--overwrite", "--export"):
        line = help_text[help_text.index(option):].split("\n  -", 1)[0]
        assert len(line.split()) > 3, line  # has a help text
    predict, evaluate = (cli.build_parser().parse_args([c, "x"]) for c in ("predict", "eval"))
    assert predict.device == evaluate.device


def test_ctrl_c_early_is_exit_130_without_traceback(run, tmp_path):
    config = json.loads((run / "config.json").read_text())
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from anygrad.cli import main; sys.exit(main())",
                             "train", config["model"], "--data-dir", config["data_dir"], "--device", "cpu",
                             "--batch-size", "8", "--epochs", "50", "--artifacts", str(tmp_path / "r")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = proc.stdout.readline()  # main() is running: the data is being read
    proc.send_signal(signal.SIGINT)
    out = first + proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "interrupted" in out


def test_ctrl_c_while_anygrad_imports_is_exit_130_in_one_line():
    """The console command (anygrad_cli:main, as the `anygrad` script runs it): a Ctrl-C while
    `import anygrad` runs (seconds) is one line and exit 130, no traceback. -X importtime says
    when the package's import is under way (a line per finished module, on stderr)."""
    import anygrad
    src = str(Path(anygrad.__file__).resolve().parents[1])  # anygrad_cli.py sits next to the package
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([src] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-c",
                             "import sys; from anygrad_cli import main; sys.exit(main())", "--version"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "| " in line and line.rsplit("| ", 1)[1].strip().startswith("anygrad."):
            break  # a module of the package has been imported: the package's import (seconds) is under way
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 130, err[-2000:]
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert lines == ["anygrad: interrupted"] and out == "", (lines, out)


def test_the_console_command_leaves_sigint_to_python_users(monkeypatch):
    """Importing anygrad (or the console module) installs no SIGINT handler; the console command
    puts Python's back before anygrad.cli runs, and keeps an ignored SIGINT ignored (nohup, `&`)."""
    import anygrad  # noqa: F401
    import anygrad_cli
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    seen = []
    monkeypatch.setattr(cli, "main", lambda: seen.append(signal.getsignal(signal.SIGINT)) or 0)
    assert anygrad_cli.main() == 0
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert anygrad_cli.main() == 0
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [signal.default_int_handler, signal.SIG_IGN]
