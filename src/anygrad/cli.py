"""The `anygrad` command: info, train, devices.

Every error a user can cause is an AnygradError; main() prints its message on one
`anygrad: error:` line (no traceback) and exits 2. `anygrad info` exits 1 when the model uses ops
anygrad cannot run yet.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import AnygradError, ConfigError

EXIT_ERROR = 2
EXIT_UNSUPPORTED = 1

# Settings the founding example was trained with; the defaults when no MODEL is given.
FOUNDING_DEFAULTS = {"optimizer": "adagrad", "lr": 1.0, "batch_size": 1000, "epochs": 8, "loss": "nll"}
# Defaults for a user's own model: a safe optimizer; the loss follows the model's output.
MODEL_DEFAULTS = {"optimizer": "adam", "lr": 1e-3, "batch_size": 64, "epochs": 1, "loss": "auto"}


class Console:
    """Epoch lines on stdout; progress on stderr, redrawn in place on a terminal."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.pending = False

    def line(self, text: str) -> None:
        self._clear()
        print(text, flush=True)

    def progress(self, text: str) -> None:
        if self.quiet:
            return
        if self.tty:
            print(f"\r{text}\x1b[K", end="", file=sys.stderr, flush=True)
            self.pending = True
        else:
            print(text, file=sys.stderr, flush=True)

    def _clear(self) -> None:
        if self.pending:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
            self.pending = False


# -- info ----------------------------------------------------------------------------------------
def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def cmd_info(args: argparse.Namespace) -> int:
    from .frontends.onnx_import import summarize
    s = summarize(args.model)
    out = [f"model: {s.path}" + (f"  (producer {s.producer}, opset {s.opset})" if s.producer else
                                 f"  (opset {s.opset})")]
    for title, values in (("inputs", s.inputs), ("outputs", s.outputs)):
        out.append(f"{title}:")
        out += [f"  {v.name}  {v.dtype}  {_shape(v.shape)}" for v in values]
    out.append(f"parameters: {s.num_parameters:,}" + (f"  (+ {s.num_buffers:,} in buffers)" if s.num_buffers else ""))
    out.append(f"ops ({sum(s.op_histogram.values())} nodes):")
    width = max((len(op) for op in s.op_histogram), default=0)
    out += [f"  {op:<{width}}  {n}" for op, n in sorted(s.op_histogram.items(), key=lambda kv: (-kv[1], kv[0]))]
    if not s.opset_supported:
        out.append(f"unsupported opset: {s.opset}")
    if s.unsupported:
        out.append("unsupported ops: " + ", ".join(f"{op} ({len(nodes)} node{'s' * (len(nodes) != 1)})"
                                                    for op, nodes in sorted(s.unsupported.items())))
        out.append("anygrad cannot train this model until these ops are supported")
    else:
        out.append("unsupported ops: none")
    print("\n".join(out))
    return 0 if s.supported else EXIT_UNSUPPORTED


# -- train ---------------------------------------------------------------------------------------
@dataclass
class Dataset:
    train: tuple[np.ndarray, np.ndarray]
    valid: tuple[np.ndarray, np.ndarray]
    source: str


def _mnist(data_dir: str | None, log: Callable[[str], None]) -> Dataset:
    from .data import load_mnist
    d = load_mnist(data_dir=data_dir, log=log)
    return Dataset(d.train(), d.test(), d.source)


DATASETS: dict[str, Callable[[str | None, Callable[[str], None]], Dataset]] = {"mnist": _mnist}


def _fit_input(x: np.ndarray, shape: tuple, input_name: str) -> np.ndarray:
    """Dataset samples reshaped to the model's input, when only the layout differs ((1,28,28) vs (784,))."""
    want = tuple(shape[1:])
    if all(isinstance(d, int) for d in want) and tuple(x.shape[1:]) != want:
        if int(np.prod(want)) != int(np.prod(x.shape[1:])):
            raise ConfigError(f"the model's input '{input_name}' takes samples of shape {want}, but the dataset "
                              f"holds {tuple(x.shape[1:])}; choose a model made for this dataset")
        return x.reshape((len(x),) + want)
    return x


def _auto_loss(model: Any) -> str:
    """nll when the model already ends in LogSoftmax (as the founding example does), else cross_entropy."""
    producer = model.graph.producers().get(model.graph.outputs[0])
    return "nll" if producer is not None and producer.op == "LogSoftmax" else "cross_entropy"


def _default_artifacts(model_name: str) -> Path:
    base = Path("runs") / f"{model_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def cmd_train(args: argparse.Namespace) -> int:
    from . import load_onnx
    from .devices import get_backend
    from .losses import get_loss
    from .optim import get_optimizer
    from .train import TrainConfig, fit

    if args.model is None:
        from .examples import FOUNDING_MODEL
        model_path, defaults = Path(FOUNDING_MODEL), FOUNDING_DEFAULTS
    else:
        model_path, defaults = Path(args.model), MODEL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dataset not in DATASETS:
        raise ConfigError(f"unknown dataset '{args.dataset}'; choose one of {', '.join(DATASETS)}")
    if args.loss != "auto":
        get_loss(args.loss)  # fail on a bad name before any slow work
    optimizer = get_optimizer(args.optimizer, lr=args.lr)
    backend = get_backend(args.device)

    console = Console(quiet=args.quiet)
    model = load_onnx(str(model_path), init=args.init)
    loss = _auto_loss(model) if args.loss == "auto" else args.loss
    data = DATASETS[args.dataset](args.data_dir, console.line)
    model.compile(loss=loss, optimizer=optimizer, device=backend, seed=args.seed)
    train = (_fit_input(data.train[0], model.input_shape, model.input_name), data.train[1])
    valid = (_fit_input(data.valid[0], model.input_shape, model.input_name), data.valid[1])

    artifacts = Path(args.artifacts) if args.artifacts else _default_artifacts(model_path.stem)
    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, drop_last=args.drop_last,
                         log_every=args.log_every, artifacts_dir=str(artifacts), model=str(model_path),
                         dataset=args.dataset, data_dir=data.source, loss=loss, optimizer=args.optimizer,
                         lr=args.lr, device=args.device, init=args.init)
    config.check()
    console.line(f"training {model_path.name} ({model.num_parameters():,} parameters) on "
                 f"{backend.description}: {args.optimizer} lr {args.lr:g}, loss {loss}, batch {args.batch_size}, "
                 f"{args.epochs} epoch{'s' * (args.epochs != 1)}, seed {args.seed}")
    console.line(f"data: {len(train[1]):,} train / {len(valid[1]):,} valid samples from {data.source}")
    result = fit(model, train, valid, config, log=console.line, progress=console.progress)
    console.line(f"artifacts: {result.artifacts_dir}")
    return 0


# -- devices -------------------------------------------------------------------------------------
def cmd_devices(args: argparse.Namespace) -> int:
    from . import devices
    print("cpu (numpy)")
    list_adapters = getattr(devices, "list_adapters", None)
    if list_adapters is not None:
        for adapter in list_adapters():
            print(adapter)
    return 0


# -- the command table ---------------------------------------------------------------------------
def _add_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX file to describe")


def _add_train(p: argparse.ArgumentParser) -> None:
    founding = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in FOUNDING_DEFAULTS.items())
    own = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in MODEL_DEFAULTS.items())
    p.description = (f"Train an ONNX model. Without MODEL: the bundled founding example (MNIST convnet) with "
                     f"its founding settings ({founding}). With MODEL: {own} unless given.")
    p.add_argument("model", metavar="MODEL.onnx", nargs="?", help="ONNX file (default: the founding example)")
    p.add_argument("--dataset", default="mnist", help="dataset name (default: mnist)")
    p.add_argument("--data-dir", metavar="DIR", help="folder holding the dataset files (default: cache, "
                   "downloading when missing)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--optimizer", metavar="NAME", help="sgd, adam, adamw, adagrad, adadelta, rmsprop")
    p.add_argument("--lr", type=float, help="learning rate")
    p.add_argument("--loss", metavar="NAME", help="nll, cross_entropy, mse, l1, bce_with_logits")
    p.add_argument("--device", default="auto", help="auto, cpu, wgpu, wgpu:N, wgpu:vulkan|metal|dx12|gl "
                   "(default: auto, the best available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--artifacts", metavar="DIR", help="output folder (default: runs/<model>-<timestamp>)")
    p.add_argument("--init", choices=("onnx", "fresh"), default="onnx",
                   help="start from the file's weights (onnx) or PyTorch's default initialisation (fresh)")
    p.add_argument("--drop-last", action="store_true", help="skip the last partial batch of each epoch")
    p.add_argument("--log-every", type=int, default=0, metavar="STEPS",
                   help="progress every STEPS steps (default: about ten times per epoch)")
    p.add_argument("--quiet", action="store_true", help="no progress lines, only one line per epoch")


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
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = argparse.ArgumentParser(prog="anygrad", description="Train PyTorch-written models (exported to "
                                     "ONNX) on any GPU through WebGPU, or on the CPU.")
    parser.add_argument("--version", action="version", version=f"anygrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except AnygradError as e:
        print(f"anygrad: error: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("anygrad: error: interrupted", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
