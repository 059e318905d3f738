"""The command table (COMMANDS: each command's help, arguments and function) and the parser
built from it, whose errors take the CLI's one-line form with exit code 2 and a "did you mean"
for a mistyped command, choice or option."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .common import EXIT_ERROR, _elide_words, _one_line
from .info import cmd_info
from .options import _add_codegen, _add_eval, _add_info, _add_plot, _add_predict, _add_settings, _add_train
from .predict import cmd_eval, cmd_predict
from .tools import cmd_codegen, cmd_devices, cmd_plot, cmd_settings
from .training import cmd_train


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "info": Command("describe an ONNX model: inputs, outputs, ops, parameters, unsupported ops", _add_info,
                    cmd_info),
    "train": Command("train a model (default: the founding MNIST example)", _add_train, cmd_train),
    "devices": Command("list the devices anygrad can train on", lambda p: None, cmd_devices),
    "plot": Command("draw a run's loss and accuracy curves as PNG (needs anygrad-train[plot])", _add_plot, cmd_plot),
    "predict": Command("classify one dataset sample or your own image with a trained model", _add_predict,
                       cmd_predict),
    "eval": Command("loss, accuracy and confusion matrix (perplexity for a token run) of a trained model on a dataset", _add_eval, cmd_eval),
    "settings": Command("every ANYGRAD_* environment setting with its current value", _add_settings, cmd_settings),
    "codegen": Command("write an ONNX model as PyTorch-style Python (anygrad.nn) plus its weights",
                       _add_codegen, cmd_codegen),
}


class _Parser(argparse.ArgumentParser):
    """argparse with errors in the CLI's one-line form: `anygrad: error: ...; see 'anygrad train
    --help'` and exit code 2, without the usage block (subcommand parsers are this class too)."""

    def error(self, message: str) -> NoReturn:
        import re
        typo = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if typo:  # a mistyped command or choice: the nearest one
            import difflib
            match = difflib.get_close_matches(typo[1], re.findall(r"'([^']*)'", typo[2]), 1, 0.6)
            message += f" (did you mean {match[0]}?)" if match else ""
        self.exit(EXIT_ERROR, f"anygrad: error: {_elide_words(_one_line(message))}; see '{self.prog} --help'\n")

    def _suggest(self, word: str) -> str:
        """" (did you mean --batch-size?)" for a mistyped option or command, else ""."""
        import difflib
        name, _, _ = word.partition("=")
        choices = [o for a in self._actions for o in a.option_strings] if name.startswith("-") else \
            [c for a in self._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
        # compared without the leading dashes, which every option shares ('--bogus' is not near '--loss')
        stems = {c.lstrip("-"): c for c in choices}
        match = difflib.get_close_matches(name.lstrip("-"), list(stems), 1, 0.6)
        return f" (did you mean {stems[match[0]]}?)" if match else ""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        # argparse reports unknown flags from the top-level parser; the subcommand's help is the useful one
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            sub = commands[0].choices.get(getattr(parsed, commands[0].dest, None)) if commands else None
            parser = sub or self
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser._suggest(extras[0])}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    from ..version import __version__
    parser = _Parser(prog="anygrad", description="Train PyTorch-written models (exported to "
                                     "ONNX) on any GPU through WebGPU, or on the CPU.")
    parser.add_argument("--version", action="version", version=f"anygrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser
