"""README's and the docs' examples work as written: the Python quick start (data pointed at the
shared MNIST subset), the anygrad.nn example against PyTorch, and every command line and flag
example of README and the user pages parsed by the real CLI. tests/test_docs.py runs every other
Python block and builds the site."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SUBSET = REPO.parent / "shared/datasets/mnist-subset"
README = REPO / "README.md"
# the pages whose command lines and flags a user copies (not benchmarks, history or generated tables)
CLI_PAGES = [README, *(REPO / "docs" / f"{name}.md" for name in (
    "cli", "training", "optimizers", "runs", "dashboard", "your-model", "exporting", "from-torch", "pytorch",
    "devices", "small-gpus", "mixed-precision", "distributed", "troubleshooting"))]


def _python_blocks(page: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


def _block(containing: str, page: Path = README) -> str:
    (block,) = [b for b in _python_blocks(page) if containing in b]
    return block


@pytest.mark.slow
@pytest.mark.skipif(not SUBSET.is_dir(), reason="shared MNIST subset not checked out next to the repo")
def test_python_api_example(tmp_path, monkeypatch):
    import anygrad
    from anygrad.data import load_mnist
    from anygrad.examples import FOUNDING_MODEL

    monkeypatch.chdir(tmp_path)
    small = load_mnist(SUBSET)

    class Subset:  # the example's data, cut down so the test stays quick
        def train(self):
            x, y = small.train()
            return x[:600], y[:600]

        def test(self):
            x, y = small.test()
            return x[:300], y[:300]

    code = _block("data = load_mnist()").replace('"my_model.onnx"', repr(str(FOUNDING_MODEL)))
    code = code.replace("load_mnist()", "Subset()")
    scope = {"Subset": Subset}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 -- README's own example code
    assert (tmp_path / "runs/demo/metrics.jsonl").is_file() and (tmp_path / "trained.onnx").is_file()
    assert scope["result"].last.epoch == 2
    assert scope["log_probs"].shape == (8, 10)
    assert isinstance(scope["model"], anygrad.Model)


def test_nn_example_loads_a_torch_checkpoint(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    code = _block("class Net(nn.Module)", REPO / "docs/pytorch.md")

    class TorchNet(torch.nn.Module):  # the same network in PyTorch, saved with torch.save
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 8, 3)
            self.fc = torch.nn.Linear(8 * 26 * 26, 10)

        def forward(self, x):
            return torch.log_softmax(self.fc(torch.relu(self.conv(x)).flatten(1)), dim=1)

    reference = TorchNet()
    torch.save(reference.state_dict(), tmp_path / "net.pt")
    scope: dict = {}
    exec(compile(code, "docs/pytorch.md", "exec"), scope)  # noqa: S102 -- the docs' own example code
    x = np.random.default_rng(0).standard_normal((3, 1, 28, 28)).astype(np.float32)
    with torch.no_grad():
        expected = reference(torch.tensor(x)).numpy()
    np.testing.assert_allclose(scope["model"].predict(x), expected, rtol=1e-4, atol=1e-5)


# -- every command line and flag example in README and the user pages parses with the real CLI --------------
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.[a-z]+)?$")  # N, MAX, DIR, RUN, FILE.npz, MODEL.onnx


def _readme_examples() -> tuple[list[str], list[str]]:
    """(`anygrad ...` command lines from bash blocks and inline code, inline `--flag ...` spans)."""
    text = "\n".join(p.read_text() for p in CLI_PAGES if p.is_file())
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = part.split("#")[0].strip()
                if part.startswith("anygrad "):
                    commands.append(part)
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]
    # inline `anygrad plot` names a command (checked to exist below); longer spans are examples
    commands += [s for s in spans if s.startswith("anygrad ") and len(s.split()) > 2 and s.split()[2] != "--help"]
    names = [s.split()[1] for s in spans if s.startswith("anygrad ") and len(s.split()) == 2]
    assert set(names) <= set(_subparsers()), f"README names a command that does not exist: {names}"
    return commands, [s for s in spans if s.startswith("--")]


def _subparsers() -> dict:
    import argparse

    from anygrad import cli
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def _tokens(example: str, command: str) -> tuple[list[str], bool]:
    """The example as argv: optional groups [...] opened, the first of a|b|c alternatives taken,
    upper-case placeholders after a numeric option replaced by a number. Also whether it
    enumerated alternatives (then it is no single runnable setting)."""
    options = {s: a for a in _subparsers()[command]._actions for s in a.option_strings}
    tokens, enumerates = [], False
    for token in example.replace("[", " ").replace("]", " ").split():
        if "|" in token:
            token, enumerates = token.split("|")[0], True
        action = options.get(tokens[-1]) if tokens else None
        if action is not None and action.type is not None and PLACEHOLDER.match(token):
            token = "2" if action.type is int else "0.5"
        tokens.append(token)
    return tokens, enumerates


def _check_parses(argv: list[str], enumerates: bool) -> None:
    """argparse accepts argv, and a --scheduler with its --scheduler-opt options is valid."""
    from anygrad import cli
    from anygrad.cli.config import _scheduler_options
    from anygrad.optim.schedulers import RunFacts, get_scheduler
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"`anygrad {' '.join(argv)}` does not parse (exit {e.code})") from None
    if getattr(args, "scheduler", None) and not enumerates:
        options = _scheduler_options(args.scheduler_opt or [])
        get_scheduler(args.scheduler, 0.1, run=RunFacts(args.epochs or 8, 10), **options)


def test_readme_command_lines_parse(capsys):
    commands, _ = _readme_examples()
    assert len(commands) >= 15  # the command table, the quick run, the inline ones
    for line in commands:
        argv, enumerates = _tokens(line.split(" ", 1)[1], line.split()[1])
        _check_parses(argv, enumerates)


def test_readme_flag_examples_parse(capsys):
    """Inline examples such as `--scheduler cosine --scheduler-opt T_max=8` work on the subcommand
    that has these flags (a required MODEL/RUN argument filled in); a lone `--flag` exists."""
    _, spans = _readme_examples()
    assert any(s.startswith("--scheduler ") and "--scheduler-opt" in s for s in spans)
    subparsers = _subparsers()
    for span in spans:
        first = span.split()[0]
        owners = [name for name, p in subparsers.items() if any(first in a.option_strings for a in p._actions)]
        assert owners, f"README mentions {first}, which no anygrad command has"
        if len(span.split()) == 1 and first not in ("--drop-last", "--prefetch", "--no-weights", "--quiet"):
            continue  # a reference to an option, not an example
        command = "train" if "train" in owners else owners[0]
        positionals = [a for a in subparsers[command]._actions if not a.option_strings and a.nargs is None]
        argv, enumerates = _tokens(span, command)
        _check_parses([command, *["RUN"] * len(positionals), *argv], enumerates)
