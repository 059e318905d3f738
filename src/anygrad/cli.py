"""The `anygrad` command: info, train, devices.

Every error a user can cause is an AnygradError; main() prints its message on one
`anygrad: error:` line (no traceback) and exits 2, as argparse's own errors do. `anygrad info` exits 1 when the model uses ops
anygrad cannot run yet.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .errors import AnygradError, ConfigError, ModelError

EXIT_ERROR = 2
EXIT_UNSUPPORTED = 1
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C after writing a checkpoint
EXIT_DIVERGED = 3       # --on-nan stop ended the run: a loss or weight was not finite
EXIT_BROKEN_PIPE = 141  # stdout closed by its reader (`| head -1`): 128 + SIGPIPE, as a Unix tool ends

# Settings the founding example was trained with; the defaults when no MODEL is given.
FOUNDING_DEFAULTS = {"optimizer": "adagrad", "lr": 1.0, "batch_size": 1000, "epochs": 8, "loss": "nll"}
# Defaults for a user's own model: a safe optimizer; the loss follows the model's output.
MODEL_DEFAULTS = {"optimizer": "adam", "lr": 1e-3, "batch_size": 64, "epochs": 1, "loss": "auto"}
# predict and eval: the CPU, for both (a trained model's forward pass is quick there, and no shader
# compilation comes first); --device auto picks a GPU.
INFERENCE_DEVICE = "cpu"


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
    unused = [f"--{k.replace('_', '-')}" for k in ("device", "limits", "loss", "optimizer", "memory_budget")
              if getattr(args, k) is not None]
    if args.no_decay or args.param_groups:  # --optimizer also names the optimizer whose groups are listed
        unused = [k for k in unused if k != "--optimizer"]
    if unused and args.batch_size is None:
        raise ConfigError(f"{', '.join(unused)} describe the training step whose memory `info` plans at "
                          "--batch-size N; give --batch-size too")
    s = summarize(str(_not_a_folder(Path(args.model), "an ONNX model file")), freeze=args.freeze or ())
    out = [f"model: {s.path}" + (f"  (producer {s.producer}, opset {s.opset})" if s.producer else
                                 f"  (opset {s.opset})")]
    for title, values in (("inputs", s.inputs), ("outputs", s.outputs)):
        out.append(f"{title}:")
        out += [f"  {v.name}  {v.dtype}  {_shape(v.shape)}" for v in values]
    out.append(f"parameters: {s.num_parameters:,} trainable" + (f", {s.num_frozen:,} frozen" if s.num_frozen else "")
               + (f"  (+ {s.num_buffers:,} in buffers)" if s.num_buffers else ""))
    out.append(f"ops ({sum(s.op_histogram.values())} nodes):")
    width = max((len(op) for op in s.op_histogram), default=0)
    out += [f"  {op:<{width}}  {n}" for op, n in sorted(s.op_histogram.items(), key=lambda kv: (-kv[1], kv[0]))]
    if not s.opset_supported:
        out.append(f"unsupported opset: {s.opset}")
    out += _support_lines(s)
    if s.unsupported:
        out.append("unsupported ops: " + _node_counts(s.unsupported))
        out.append("anygrad cannot run or train this model until these ops are supported")
    else:
        out.append("unsupported ops: none")
        if s.inference_only:
            out.append("anygrad can run this model (predict, eval) but cannot train it: a parameter's gradient "
                       "would have to pass through ops without a gradient rule")
    if args.no_decay or args.param_groups:
        out += _group_lines(args)
    if args.batch_size is not None and s.supported and not s.inference_only:
        out += _memory_lines(args)
    print("\n".join(out))
    return 0 if s.supported else EXIT_UNSUPPORTED


def _info_optimizer(args: argparse.Namespace, model: Any) -> tuple[Any, list[Any]]:
    """The optimizer `train` would give this model with these groups, and its groups over it."""
    from .optim import get_optimizer
    from .optim.groups import config_groups, resolve_groups
    from .train import TrainConfig
    settings = TrainConfig(param_groups=args.param_groups or [], no_decay=args.no_decay or [])
    optimizer = get_optimizer(args.optimizer or model_defaults(args.model)["optimizer"],
                              param_groups=config_groups(settings.param_groups, settings.no_decay))
    g = model.graph
    shapes = {p: tuple(g.initializers[p].shape) for p in g.params}
    return optimizer, resolve_groups(optimizer, g.params, shapes, model.parameter_aliases())


def _group_lines(args: argparse.Namespace) -> list[str]:
    """The parameter groups --no-decay and --param-group make: tensors, parameters, settings."""
    from . import load_onnx
    model = load_onnx(args.model, freeze=args.freeze or ())
    optimizer, groups = _info_optimizer(args, model)
    own = optimizer.settings()
    out = [f"parameter groups ({optimizer.name}; settings besides its own {_settings_text(own)}):"]
    for grp in groups:
        n = sum(int(model.graph.initializers[p].size) for p in grp.params)
        changed = {k: v for k, v in grp.settings().items() if own.get(k) != v}
        out.append(f"  {grp.label}: {len(grp.params)} tensors, {n:,} parameters"
                   + (f"; {_settings_text(changed)}" if changed else ""))
    return out


def _settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in settings.items())


def _memory_lines(args: argparse.Namespace) -> list[str]:
    """The training step's device memory at --batch-size, planned as `train` would compile it."""
    from . import load_onnx
    from .devices import get_backend
    from .losses import get_loss
    from .program import build_train_step
    from .train.run import auto_loss, check_memory_budget
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    check_memory_budget(args.memory_budget)
    backend = get_backend(args.device or "wgpu", limits=args.limits, memory_budget=args.memory_budget)
    if not hasattr(backend, "memory_report"):
        return [f"memory: the report needs a wgpu device; {backend.name} has no device memory to plan"]
    model = load_onnx(args.model, freeze=args.freeze or ())
    loss = get_loss(args.loss or auto_loss(model))
    out = model.graph.info[model.graph.outputs[0]].shape
    shape = (args.batch_size,) + tuple(model.input_shape[1:])
    target = ((args.batch_size,) + tuple(out[2:])) if loss.classification else (args.batch_size,) + tuple(out[1:])
    if any(not isinstance(d, int) for d in shape + target):
        return ["memory: the model's input or output has symbolic dims besides the batch; no report"]
    precision = backend.check_precision(args.precision)
    opt, groups = _info_optimizer(args, model)  # the one `train` would use, with its groups
    optimizer = opt.name
    step = build_train_step(model.graph, {model.input_name: shape}, target, loss, opt, precision=precision,
                            groups=groups)
    report = backend.memory_report(step)
    mixed = ", f16" if precision == "f16" else ""
    return [f"training step at batch {args.batch_size} on {backend.description} ({optimizer}, {loss.name}{mixed}):"] + [
        f"  {line}" for line in report.lines()]


def _node_counts(ops: dict[str, Any]) -> str:
    return ", ".join(f"{op} ({len(nodes)} node{'s' * (len(nodes) != 1)})" for op, nodes in sorted(ops.items()))


def _support_lines(s: Any) -> list[str]:
    """Ops by how far anygrad supports them: training, inference only, not at all."""
    from .frontends.op_support import INFERENCE, LEVELS, by_level
    out = ["support:"]
    for level in LEVELS:  # inference-only ops with the nodes a gradient would have to cross
        listing = _node_counts(s.inference_only) if level == INFERENCE else ", ".join(by_level(s.support, level))
        out.append(f"  {level + ':':<15} {listing or 'none'}")
    return out


# -- train ---------------------------------------------------------------------------------------
# Flags of `anygrad train` -> TrainConfig fields (the rest have the same name). Defaults live in
# TRAIN_DEFAULTS, not in argparse, so a flag given on the command line can be told from a default
# and overrides a --config file or is checked against a --resume run.
_FLAG_FIELDS = {"artifacts": "artifacts_dir"}
TRAIN_DEFAULTS = {"dataset": "mnist", "device": "auto", "seed": 0, "init": "onnx", "drop_last": False,
                  "log_every": 0}


def _given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig settings the command line states explicitly."""
    from .train import TrainConfig
    names = set(TrainConfig.__dataclass_fields__)
    out = {}
    for key, value in vars(args).items():
        field_name = _FLAG_FIELDS.get(key, key)
        if value is not None and field_name in names:
            out[field_name] = value
    if args.scheduler_opt:
        out["scheduler_options"] = _scheduler_options(args.scheduler_opt)
    if args.augment is not None:
        out.update(_parse_augment(args.augment))
    if args.npz_keys is not None:
        keys = [k.strip() for k in args.npz_keys.split(",")]
        if len(keys) != 2 or not all(keys):
            raise ConfigError(f"--npz-keys takes the input and target array names, e.g. images,labels; got "
                              f"{args.npz_keys!r}")
        out["x_key"], out["y_key"] = keys
    return out


def _scheduler_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--scheduler-opt takes KEY=VALUE (e.g. T_max=10), got {pair!r}")
        options[key.strip()] = value.strip()
    return options


def _read_config(path: Path) -> dict[str, Any]:
    import json

    from .torchfile.safe_io import read_regular
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    try:  # a regular file only: --config on a FIFO must not block
        record = json.loads(bytes(read_regular(path, ConfigError, limit=16 << 20)).decode())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: cannot read the config ({e})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path}: a config file holds one JSON object of settings")
    return record


def _file_settings(path: Path) -> dict[str, Any]:
    """The settings a config.json states (checked and converted to their types); the ones it
    leaves out get the same defaults as on the command line."""
    from .train import TrainConfig
    record = _read_config(path)
    config = TrainConfig.from_dict(record, str(path))
    try:  # values out of range too, while the file is still the one to name
        config.check()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return {k: getattr(config, k) for k in record if k in TrainConfig.__dataclass_fields__}


def _train_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Settings from --resume DIR's config.json or --config FILE, then the command line's flags,
    then the defaults (the founding ones when no model is named) for whatever is still unset."""
    given = _given_settings(args)
    settings: dict[str, Any] = {}
    if args.resume:
        run = Path(args.resume)
        if not run.is_dir():
            raise ConfigError(f"--resume {run}: " + ("no such folder" if not os.path.lexists(run) else
                              "a file, not a folder") + "; --resume takes the --artifacts folder of an earlier "
                              "`anygrad train`")
        if not (run / "config.json").is_file():
            raise ConfigError(f"{run}: not a training run folder (no config.json); --resume takes the "
                              "--artifacts folder of an earlier `anygrad train`")
        settings = _file_settings(run / "config.json")
        settings["artifacts_dir"] = str(run)
        given.pop("artifacts_dir", None)
    elif args.config:
        settings = _file_settings(Path(args.config))
        settings["artifacts_dir"] = None  # a rerun writes a new folder unless --artifacts says otherwise
    settings.update(given)
    if not settings.get("model"):
        from .examples import FOUNDING_MODEL
        settings["model"] = str(Path(FOUNDING_MODEL))
    for key, value in {**TRAIN_DEFAULTS, **model_defaults(settings["model"])}.items():
        if settings.get(key) in (None, ""):
            settings[key] = value
    return settings


def model_defaults(model: str | os.PathLike) -> dict[str, Any]:
    """The settings `train` gives `model` unless told otherwise: the founding example's own
    (FOUNDING_DEFAULTS) for that file, MODEL_DEFAULTS for any other. `info` plans with the same."""
    from .examples import FOUNDING_MODEL
    try:
        founding = Path(model).resolve() == Path(FOUNDING_MODEL).resolve()
    except (OSError, RuntimeError, ValueError):
        founding = False
    return FOUNDING_DEFAULTS if founding else MODEL_DEFAULTS


def _check_dataset(name: str) -> None:
    from .data import dataset_names
    from .data.datasets import canonical_name
    if canonical_name(name) not in dataset_names() and name != "tokens":
        raise ConfigError(f"unknown dataset '{name}'; choose one of {', '.join(dataset_names() + ['tokens'])}")


def _parse_augment(spec: str) -> dict[str, Any]:
    """--augment crop:4,hflip -> {crop_padding: 4, hflip: True}; 'none' turns both off."""
    out: dict[str, Any] = {"crop_padding": 0, "hflip": False}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition(":")
        if name == "none" and not value:
            continue
        if name == "hflip" and not value:
            out["hflip"] = True
        elif name == "crop" and value.isdigit():
            out["crop_padding"] = int(value)
        else:
            raise ConfigError(f"--augment takes a comma-separated list of crop:PADDING (random crop after zero "
                              f"padding) and hflip (random horizontal flip), or none; got {item!r}")
    return out


def _float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers (one per channel), got {text!r}") \
            from None


def _reporter(quiet: bool, every: int, console: Console) -> Any:
    """The UX reporter (live dashboard on a terminal, plain lines otherwise) when present."""
    try:
        from .train.dashboard import make_reporter
    except ImportError:
        from .train import LineReporter
        return LineReporter(console.line, console.progress)
    return make_reporter(quiet=quiet, every=every)


def _not_a_folder(path: Path, what: str) -> Path:
    """`path` for a file argument; a folder there is an error that says so (the loaders would
    report it as missing)."""
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not {what}; give the file itself")
    return path


# Paths a run records: stored absolute (a later `predict` or `eval` may run from another folder),
# and as typed under config.json's resolved.paths_as_typed, for messages.
_PATH_SETTINGS = ("model", "weights", "data_dir", "artifacts_dir")


def cmd_train(args: argparse.Namespace) -> int:
    """Parse the settings into a RunConfig and run it (train.run.run: the folder, the process group
    of a torchrun job, rank 0's output and an elastic restart's resume are the run's own)."""
    from .losses import get_loss
    from .optim import get_optimizer
    from .train import TrainConfig
    from .train.run import RunConfig, run

    s = _train_settings(args)
    given = set(_given_settings(args)) | (set(_read_config(Path(args.resume) / "config.json")) if args.resume else
                                          set(_read_config(Path(args.config))) if args.config else set())
    _not_a_folder(Path(s["model"]), "an ONNX model file")
    _check_dataset(s["dataset"])
    if s["loss"] != "auto":
        get_loss(s["loss"])  # fail on a bad name before any slow work
    _check_finite(s)
    get_optimizer(s["optimizer"], lr=s["lr"])
    typed = {k: str(s[k]) for k in _PATH_SETTINGS if s.get(k)}
    config = TrainConfig.from_dict({**s, **{k: _absolute(v) for k, v in typed.items()}})
    config.check()
    if config.scheduler:  # bad names and types fail now; values against the run when the Learner builds it
        from .optim.schedulers import check_options
        check_options(config.scheduler, config.scheduler_options)
    if config.weights:  # its content is checked when the model loads it (torchfile names the file's kind)
        weights = _not_a_folder(Path(config.weights), "a weights file")
        if not weights.exists():
            raise ConfigError(f"--weights {typed['weights']}: no such file")
    if not Path(config.model).exists():
        raise ModelError(f"{_short(typed['model'])}: no such model file")
    console = Console(quiet=args.quiet)
    result = run(RunConfig(config, resume=bool(args.resume), overwrite=bool(args.overwrite),
                           reporter=_reporter(args.quiet, config.log_every, console), log=console.line,
                           typed_paths={k: v for k, v in typed.items() if _absolute(v) != v},
                           defaulted=tuple(k for k in ("batch_size",) if k not in given)))
    if result.diverged:
        print(f"anygrad: error: {result.diverged} (--on-nan stop); the newest checkpoint holds the last finite "
              f"state; start again with a smaller --lr (or --clip-grad-norm), or use --on-nan skip", file=sys.stderr)
        return EXIT_DIVERGED
    return EXIT_INTERRUPTED if result.interrupted else 0


# Number settings that must be finite: 'nan' and 'inf' parse as floats, but are not numbers to train with.
_FINITE_SETTINGS = ("lr", "clip_grad_norm", "min_delta", "valid_fraction")


def _check_finite(settings: dict[str, Any]) -> None:
    for name in _FINITE_SETTINGS:
        value = settings.get(name)
        if isinstance(value, float) and not np.isfinite(value):
            raise ConfigError(f"--{name.replace('_', '-')} {value}: not a number; give a finite value")


def _absolute(path: str) -> str:
    """`path` made absolute without resolving links (what the user named stays recognisable)."""
    return os.path.abspath(os.path.expanduser(path))


# -- devices -------------------------------------------------------------------------------------
def cmd_devices(args: argparse.Namespace) -> int:
    from . import devices
    print("cpu (numpy)")
    list_adapters = getattr(devices, "list_adapters", None)
    if list_adapters is not None:
        for adapter in list_adapters():
            print(adapter)
    from .backends.wgpu.device.implementation import DAWN, DIST, available
    if not available(DAWN):
        print(f"(Dawn, the WebGPU implementation with subgroup matrices, is not installed: "
              f"pip install '{DIST}[dawn]')")
    return 0


# -- plot, predict, eval (anygrad.plot, anygrad.inference) ----------------------------------------
def cmd_plot(args: argparse.Namespace) -> int:
    from .plot import plot_run
    for path in plot_run(args.run_dir, args.output):
        print(f"wrote {path}")
    return 0


def _inference_model(args: argparse.Namespace) -> tuple[Any, Any, str, str | None]:
    """The model (compiled for inference), where it came from, the dataset and its folder."""
    from .inference import compile_for_inference, load_model, output_kind
    model, source = load_model(args.model)
    dataset = args.dataset or source.run_config.get("dataset") or "mnist"
    data_dir = args.data_dir
    if data_dir is None and dataset == source.run_config.get("dataset"):
        data_dir = source.run_config.get("data_dir")  # the folder the run was trained from
        if isinstance(data_dir, str) and data_dir and not os.path.exists(data_dir):
            resolved = source.run_config.get("resolved")
            typed = resolved.get("paths_as_typed") if isinstance(resolved, dict) else None
            typed = typed.get("data_dir") if isinstance(typed, dict) else None
            raise ConfigError(f"the data folder {data_dir!r} comes from the run's config.json ({source.description}"
                              + (f"; typed as {typed!r}" if typed else "") + ") and does not exist here; give "
                              "--data-dir DIR")
    compile_for_inference(model, args.device)
    print(f"model: {source.description} (outputs {output_kind(model)}) on {model.backend.description}")
    return model, source, dataset, data_dir


def _run_dataset(dataset: str, data_dir: str | None, run: dict[str, Any]) -> Any:
    """The dataset, read as the run read it when it trained on it: its .npz keys, and its
    held-out validation part (fraction and seed)."""
    from .data import get_dataset
    from .inference import run_for_dataset
    own = run_for_dataset(run, dataset)
    options = {k: own[k] for k in ("x_key", "y_key") if isinstance(own.get(k), str)}
    return get_dataset(dataset, data_dir, valid_fraction=own.get("valid_fraction"), seed=int(own.get("seed") or 0),
                       log=print, **options)


def _eval_split(args: argparse.Namespace, dataset: str, data_dir: str | None,
                run: dict[str, Any] | None = None) -> tuple[Any, Any, list[str]]:
    """(host transform, the split's arrays, class names); normalised as the run `run` (its config.json)
    was, when it trained on this dataset."""
    from .data import BatchTransform
    from .inference import input_normalisation
    data = _run_dataset(dataset, data_dir, run or {})
    norm = input_normalisation(run or {}, dataset, lambda: data)
    if args.split == "valid" and data.valid is None:
        raise ConfigError(f"{dataset} has no validation split here (the run held none out: valid-fraction 0); "
                          "use --split train")
    x, y = data.train if args.split == "train" else data.valid
    which = "train" if args.split == "train" else f"valid ({data.valid_from})"
    print(f"data: {dataset} {which}, {len(y):,} samples from {data.source}; {norm.how}")
    return BatchTransform(norm.mean, norm.std), (x, y), data.classes


def cmd_predict(args: argparse.Namespace) -> int:
    from .inference import fit_input, input_normalisation, predict_batch, prepare_image, run_class_names
    if args.index < 0:
        raise ConfigError(f"--index counts samples from 0, got {args.index}")
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}")
    model, source, dataset, data_dir = _inference_model(args)
    true_label = None
    if args.image:
        loaded: Any = None  # the dataset, read only when the run did not record what is needed

        def data() -> Any:
            nonlocal loaded
            if loaded is None:
                loaded = _run_dataset(dataset, data_dir, source.run_config)
            return loaded
        prepared = prepare_image(args.image, model, dataset, input_normalisation(source.run_config, dataset, data))
        print(f"image: {args.image}: " + "; ".join(prepared.notes))
        x, names = prepared.x, run_class_names(source.run_config, dataset) or (loaded.classes if loaded is not None else None)
    else:
        transform, (xs, ys), names = _eval_split(args, dataset, data_dir, source.run_config)
        if args.index >= len(xs):
            raise ConfigError(f"--index {args.index} is outside the {len(xs)} samples of the {args.split} split "
                              f"(0 to {len(xs) - 1})")
        i = args.index
        x = fit_input(transform(xs[i:i + 1], np.array([i]), 0), model)
        true_label = int(ys[i])
    probs = predict_batch(model, x)[0]
    label = int(probs.argmax())

    def name(c: int) -> str:
        return f"{c} ({names[c]})" if names and c < len(names) and names[c] != str(c) else str(c)

    print(f"predicted: {name(label)}  probability {probs[label]:.4f}")
    top = np.argsort(-probs)[:max(1, args.top)]
    print("top: " + "  ".join(f"{name(int(c))} {100 * probs[c]:.2f}%" for c in top))
    if true_label is not None:
        print(f"true label: {name(true_label)}  ({'correct' if true_label == label else 'wrong'})")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console as RichConsole
    from rich.table import Table

    from .inference import evaluate, fit_input
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    model, source, dataset, data_dir = _inference_model(args)
    transform, (x, y), names = _eval_split(args, dataset, data_dir, source.run_config)
    x = fit_input(transform(x, np.arange(len(x)), 0), model)
    task = _eval_task(source.run_config, y)
    if task is not None:  # not one class per sample: the model's own metrics under the run's loss
        model.compile(loss=task[0], device=model.backend, **task[1])
        print(_metrics_line(model.evaluate(x, y, args.batch_size)))
        return 0
    result = evaluate(model, x, y, args.batch_size)
    print(f"loss {result.loss:.4f}  accuracy {100 * result.accuracy:.2f}%  ({result.count:,} samples)")
    table = Table(title="confusion matrix (rows: true class, columns: predicted)", header_style="bold")
    table.add_column("true \\ pred", justify="right", style="bold")
    classes = range(len(result.confusion))
    for c in classes:
        table.add_column(str(c), justify="right")
    table.add_column("recall", justify="right")
    for t in classes:
        row = result.confusion[t]
        cells = [f"[green]{v}[/]" if p == t else (str(v) if v else "[dim]0[/]") for p, v in enumerate(row)]
        label = f"{t} {names[t]}" if names and t < len(names) and names[t] != str(t) else str(t)
        recall = f"{100 * row[t] / row.sum():.1f}%" if row.sum() else "-"
        table.add_row(label, *cells, recall)
    RichConsole(width=max(100, 12 + 7 * len(result.confusion))).print(table)
    return 0


def _eval_task(run: dict[str, Any], y: np.ndarray) -> tuple[str, dict[str, Any]] | None:
    """(loss, options) to evaluate a model that is not a per-sample classifier with: the run's own
    loss (config.json) when it is a regression or multi-label one, or class targets of more than
    one axis (tokens, pixels); None for a classifier (the confusion matrix)."""
    resolved = run.get("resolved") if isinstance(run.get("resolved"), dict) else {}
    record = resolved.get("loss") if isinstance(resolved.get("loss"), dict) else {}
    name = record.get("name") or run.get("loss") or ""
    options = {k: v for k, v in record.items() if k != "name"}
    y = np.asarray(y)
    if name in ("mse", "l1", "bce_with_logits"):
        return name, options
    if y.ndim > 1 and y.dtype.kind in "iu":
        return (name if name in ("cross_entropy", "nll") else "cross_entropy"), options
    return None


def _metrics_line(metrics: dict[str, float]) -> str:
    """Model.evaluate's metrics as one line: ratios as percent, the rest as numbers."""
    parts = []
    for name, value in metrics.items():
        if name == "count":
            continue
        ratio = name.endswith("accuracy") or name.rsplit("_", 1)[-1].startswith("top")
        parts.append(f"{name.replace('_', ' ')} " + (f"{100 * value:.2f}%" if ratio else f"{value:.4f}"))
    return "  ".join(parts) + f"  ({int(metrics.get('count', 0)):,} samples)"


def _add_inference_args(p: argparse.ArgumentParser, device: str) -> None:
    p.add_argument("model", metavar="MODEL", help="a run folder (its model.onnx or checkpoints), an .onnx file, "
                   "a checkpoint .json or weights.npz")
    p.add_argument("--dataset", help="mnist, fashion-mnist, cifar-10, npz, imagefolder (default: the run's, "
                   "else mnist)")
    p.add_argument("--data-dir", metavar="DIR", help="folder (or .npz file) holding the dataset")
    p.add_argument("--split", choices=("valid", "train"), default="valid",
                   help="valid: the test split (or held-out part) of the dataset (default)")
    p.add_argument("--device", default=device, help=f"cpu, wgpu, torch, auto, ... (default: {device})")


def _add_plot(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="DIR", help="a run folder with metrics.jsonl (or the metrics.jsonl itself)")
    p.add_argument("-o", "--output", metavar="OUT", help="folder for loss.png, accuracy.png and one png per other metric "
                   "(perplexity.png, mae.png, ...) (default: DIR)")


def _add_predict(p: argparse.ArgumentParser) -> None:
    _add_inference_args(p, INFERENCE_DEVICE)
    p.add_argument("--index", type=int, default=0, help="which sample of the split (default: 0)")
    p.add_argument("--image", metavar="FILE", help="classify your own image (PNG/JPEG; needs anygrad-train[image]): "
                   "resized to the model's input, greyscale for one channel, inverted when the background is "
                   "white, normalised as the run was trained (its config.json)")
    p.add_argument("--top", type=int, default=3, help="how many classes to list (default: 3)")


def _add_eval(p: argparse.ArgumentParser) -> None:
    _add_inference_args(p, INFERENCE_DEVICE)
    p.add_argument("--batch-size", type=int, default=500, metavar="N", help="samples per forward pass (default: 500)")


# -- codegen (anygrad.codegen) ------------------------------------------------------------------
def cmd_codegen(args: argparse.Namespace) -> int:
    from .codegen import write_code
    out = Path(args.output) if args.output else Path(f"{Path(args.model).stem}_model.py")
    for target in filter(None, (out, Path(args.weights_out) if args.weights_out else None)):
        _make_parent(target, "-o" if target is out else "--weights-out")
    written = write_code(str(_not_a_folder(Path(args.model), "an ONNX model file")), out, weights_out=args.weights_out, write_weights=not args.no_weights)
    print(f"wrote {written.code}" + (f" and {written.weights}" if written.weights else ""))
    return 0


def _make_parent(path: Path, option: str) -> None:
    """Create the folder a file option's path names (and its parents), as --artifacts and plot -o do."""
    folder = path.parent
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option} {path}: {existing} is a file, not a folder; choose another path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot create {folder} ({e.strerror or e}); choose a folder you can "
                          "write to") from None


def _add_codegen(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX file to write as Python")
    p.add_argument("-o", "--output", metavar="FILE.py", help="the module to write (default: <model>_model.py)")
    p.add_argument("--weights-out", metavar="W.safetensors", help="where to write the weights, under the "
                   "generated module's state_dict names (default: beside FILE.py, same name)")
    p.add_argument("--no-weights", action="store_true", help="write the code only")


# -- the command table ---------------------------------------------------------------------------
def _add_group_args(p: argparse.ArgumentParser) -> None:
    """--no-decay and --param-group (optim/groups.py), for train and info alike."""
    p.add_argument("--no-decay", action="append", metavar="PATTERN", help="no weight decay for the parameters "
                   "matching this glob over graph or PyTorch names (repeatable), e.g. '*.bias' '*norm*'")
    p.add_argument("--param-group", dest="param_groups", action="append", metavar="PATTERN:KEY=VALUE,...",
                   help="a parameter group with its own optimizer settings, as torch.optim's param_groups "
                   "(repeatable), e.g. 'head.*:lr=1e-3,weight_decay=0' (patterns joined by |, betas=0.9;0.95)")


def _add_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX file to describe")
    p.add_argument("--freeze", action="append", metavar="PATTERN", help="count the parameters matching this "
                   "glob as frozen, as `anygrad train --freeze` would (repeatable)")
    p.add_argument("--batch-size", type=int, metavar="N", help="also plan the training step at this batch and "
                   "print its device memory: parameters, optimizer state, activations, workspace")
    p.add_argument("--device", help="the wgpu device to plan for (default: wgpu)")
    p.add_argument("--limits", metavar="PROFILE", help="plan under a limits profile: webgpu-default, uhd630, m1-8gb")
    p.add_argument("--memory-budget", metavar="SIZE", help="plan within this much device memory, e.g. 1.5GB "
                   "(default: the limits profile's); recomputes activations to fit, else names the batch that fits")
    p.add_argument("--optimizer", help="the optimizer whose state to count (default: the one `train` gives this "
                   f"model: {MODEL_DEFAULTS['optimizer']}, {FOUNDING_DEFAULTS['optimizer']} for the founding example)")
    _add_group_args(p)
    p.add_argument("--precision", choices=("f32", "f16"), default="f32", help="plan the step at this precision "
                   "(f16: float16 activations, half their bytes)")
    p.add_argument("--loss", help="the loss (default: nll after LogSoftmax, else cross_entropy)")


def _add_train(p: argparse.ArgumentParser) -> None:
    founding = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in FOUNDING_DEFAULTS.items())
    own = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in MODEL_DEFAULTS.items())
    p.description = (f"Train an ONNX model. Without MODEL: the bundled founding example (MNIST convnet) with "
                     f"its founding settings ({founding}). With MODEL: {own} unless given. "
                     "Every run writes config.json: `anygrad train --config RUN/config.json` repeats it (flags "
                     "override), `anygrad train --resume RUN` continues it from its last checkpoint.")
    p.add_argument("model", metavar="MODEL.onnx", nargs="?", help="ONNX file (default: the founding example)")
    p.add_argument("--config", metavar="FILE", help="take every setting from a run's config.json (flags override)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR (its --artifacts folder) from its "
                   "newest checkpoint; --epochs may extend it")
    p.add_argument("--dataset", help="mnist, fashion-mnist, cifar-10, npz, imagefolder or tokens (default: mnist); "
                   "tokens: a language model on a flat token "
                   "file (--data-dir FILE.bin of uint16 ids as nanoGPT writes, or FILE.npy of any integer "
                   "dtype; --block-size T)")
    p.add_argument("--data-dir", metavar="DIR", help="folder holding the dataset files (default: cache, "
                   "downloading when missing)")
    p.add_argument("--valid-fraction", type=float, metavar="F", help="hold out this part of the training data "
                   "for validation (default: the set's own test split, else 0.1; 0: no validation)")
    p.add_argument("--augment", metavar="SPEC", help="training-batch augmentation: crop:PADDING (random crop "
                   "after zero padding), hflip (random horizontal flip), comma-separated, e.g. crop:4,hflip; "
                   "none (default)")
    p.add_argument("--normalize", choices=("device", "host", "none"), help="per-channel normalisation: on the "
                   "device, uint8 images uploaded as they are (default); on the host (float32 batches); none")
    p.add_argument("--mean", type=_float_list, metavar="M[,M...]", help="per-channel mean in [0, 1] pixel units "
                   "(default: the dataset's)")
    p.add_argument("--std", type=_float_list, metavar="S[,S...]", help="per-channel std (default: the dataset's)")
    p.add_argument("--block-size", type=int, metavar="T", help="tokens dataset: tokens per training window "
                   "(the model's sequence length); windows of T + 1 tokens give inputs w[:-1], targets w[1:]")
    p.add_argument("--npz-keys", metavar="X,Y", help="array names of inputs and targets in an .npz dataset "
                   "(default: x,y)")
    p.add_argument("--prefetch", action="store_true", default=None, help="prepare the next batch in a background "
                   "thread while the device works")
    p.add_argument("--epochs", type=int, metavar="N", help="epochs to train (default: 1; founding example 8)")
    p.add_argument("--batch-size", type=int, metavar="N", help="samples per step (default: 64; founding example "
                   "1000)")
    p.add_argument("--valid-batch-size", type=int, metavar="N", help="validation batch size (default: batch-size)")
    p.add_argument("--optimizer", metavar="NAME", help="sgd, adam, adamw, adagrad, adadelta, rmsprop")
    p.add_argument("--lr", type=float, help="learning rate")
    _add_group_args(p)
    p.add_argument("--loss", metavar="NAME", help="nll, cross_entropy, mse, l1, bce_with_logits; output: the "
                   "model's own scalar loss output (output:NAME picks one of several)")
    p.add_argument("--device", help="auto, cpu, wgpu, wgpu:N, wgpu:vulkan|metal|dx12|gl, wgpu:native or "
                   "wgpu:dawn (the WebGPU implementation; Dawn needs anygrad-train[dawn]), or with "
                   "anygrad-train[torch] torch, torch:cuda, torch:mps, torch:cpu (default: auto: a wgpu GPU, "
                   "Dawn's where it has matrix units for the precision, else torch's CUDA/MPS, else the CPU)")
    p.add_argument("--compile", dest="torch_compile", action="store_true", default=None,
                   help="torch devices: the training step goes through torch.compile (inductor; a C++ compiler "
                   "on the CPU), with CUDA graphs on CUDA; the first steps compile (seconds to minutes)")
    p.add_argument("--seed", type=int, help="seed of the shuffles and dropout (default: 0)")
    p.add_argument("--artifacts", metavar="DIR", help="output folder (default: runs/<model>-<timestamp>); one "
                   "that holds another run is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --artifacts (its "
                   "config, metrics, weights and checkpoints)")
    p.add_argument("--on-nan", choices=("stop", "skip", "warn"), help="when the loss, a weight or a statistic "
                   "turns NaN or infinite: stop (default; keeps the last finite checkpoint, exit code 3), skip "
                   "(go back to the last finite state and go on), warn (go on)")
    p.add_argument("--export", choices=("best", "last"), help="which weights weights.* and model.onnx hold at "
                   "the end: the best epoch's by --monitor (default), or the last epoch's")
    p.add_argument("--init", choices=("onnx", "fresh"),
                   help="start from the file's weights (onnx, default) or PyTorch's default initialisation (fresh)")
    p.add_argument("--weights", metavar="FILE", help="fine-tune: start from the weights in a PyTorch state_dict "
                   "(.pt/.pth from torch.save, read without torch) or .safetensors; names must match (strict)")
    p.add_argument("--freeze", action="append", metavar="PATTERN", help="do not train the parameters matching "
                   "this glob over graph or PyTorch names (repeatable), e.g. 'conv1.*' or a buffer such as 'pe'")
    p.add_argument("--limits", metavar="PROFILE", help="train within a weaker adapter's limits on this one: "
                   "webgpu-default, uhd630, m1-8gb (binding and buffer sizes, workgroup limits, a memory budget)")
    p.add_argument("--memory-budget", metavar="SIZE", help="fit the training step in this much device memory, "
                   "e.g. 1.5GB (default: the limits profile's): tighter reuse, then activations recomputed in the "
                   "backward, else an error naming the largest batch that fits")
    p.add_argument("--precision", choices=("f32", "f16"), help="f32 (default), or f16: mixed precision as "
                   "torch.autocast + GradScaler (float16 activations and matmul/conv operands, float32 weights, "
                   "optimizer state, softmax, norms and losses; dynamic loss scaling); wgpu needs shader-f16")
    p.add_argument("--padding-idx", action="append", metavar="TABLE:ROW", help="give lookups of this row of this "
                   "embedding table no gradient, as nn.Embedding(padding_idx=ROW) does (ONNX cannot say so; "
                   "repeatable), e.g. 'embed_tokens.weight:1'")
    p.add_argument("--sync-batchnorm", action="store_true", default=None, help="data parallel (several devices, or "
                   "torchrun ranks): BatchNorm statistics over the whole global batch, as torch's SyncBatchNorm "
                   "(default: per device, as DDP)")
    p.add_argument("--grad-compression", choices=("none", "bf16"), help="torchrun ranks: send the gradients as "
                   "bfloat16 (half the bytes over gloo, summed in bfloat16, as DDP's bf16_compress_hook; default "
                   "none: float32)")
    p.add_argument("--drop-last", action="store_true", default=None, help="skip the last partial batch of each epoch")
    p.add_argument("--clip-grad-norm", type=float, metavar="MAX", help="scale the gradients down to this global "
                   "2-norm (torch.nn.utils.clip_grad_norm_)")
    p.add_argument("--accumulate", type=int, metavar="N", help="one optimizer step every N batches (gradients "
                   "summed, loss divided by N)")
    p.add_argument("--scheduler", metavar="NAME", help="learning-rate schedule: step, multistep, exponential, "
                   "cosine, linear, onecycle, plateau")
    p.add_argument("--scheduler-opt", action="append", metavar="KEY=VALUE", help="a scheduler option with "
                   "torch's name (repeatable), e.g. T_max=10, step_size=2, gamma=0.5, interval=step")
    p.add_argument("--monitor", metavar="METRIC", help="metric for the best checkpoint, early stopping and "
                   "plateau: a metrics.jsonl column: valid_loss (default), valid_accuracy, valid_top5, valid_perplexity, "
                   "valid_mse, valid_mae, valid_pixel_accuracy, valid_label_accuracy, with several outputs "
                   "valid_<output>_<metric>, train_... alike")
    p.add_argument("--mode", choices=("min", "max", "auto"), help="whether the monitored metric should go down "
                   "(min) or up (max); default auto: max for accuracies and top5, min for the rest (losses, "
                   "perplexity, mse, mae)")
    p.add_argument("--patience", type=int, metavar="EPOCHS", help="early stopping: stop after this many epochs "
                   "without improvement of the monitored metric")
    p.add_argument("--min-delta", type=float, help="smallest change that counts as an improvement (default 0)")
    p.add_argument("--keep-checkpoints", type=int, metavar="N", help="keep the newest N checkpoints (default 2; "
                   "the best one is kept apart)")
    p.add_argument("--checkpoint-every", type=int, metavar="STEPS", help="also checkpoint every STEPS steps "
                   "within an epoch")
    p.add_argument("--log-every", type=int, metavar="STEPS",
                   help="progress every STEPS steps (default: about ten times per epoch)")
    p.add_argument("--quiet", action="store_true", help="no progress lines, only a summary")


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
    "eval": Command("loss, accuracy and confusion matrix of a trained model on a dataset", _add_eval, cmd_eval),
    "codegen": Command("write an ONNX model as PyTorch-style Python (anygrad.nn) plus its weights", _add_codegen,
                       cmd_codegen),
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
        match = difflib.get_close_matches(name, choices, 1, 0.6)
        return f" (did you mean {match[0]}?)" if match else ""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        # argparse reports unknown flags from the top-level parser; the subcommand's help is the useful one
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            sub = commands[0].choices.get(getattr(parsed, commands[0].dest, None)) if commands else None
            parser = sub or self
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser._suggest(extras[0])}")
        return parsed


def _one_line(text: str) -> str:
    """A message on one line: its lines joined ("; ", or a space after a colon)."""
    out = ""
    for line in filter(None, (line.strip() for line in str(text).splitlines())):
        out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = _Parser(prog="anygrad", description="Train PyTorch-written models (exported to "
                                     "ONNX) on any GPU through WebGPU, or on the CPU.")
    parser.add_argument("--version", action="version", version=f"anygrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        if not (sys.argv[1:] if argv is None else list(argv)):  # `anygrad` alone: what it can do
            parser.print_help()
            return 0
        args = parser.parse_args(argv)
        return args.run(args)
    except AnygradError as e:
        print(f"anygrad: error: {_elide_words(_one_line(e))}", file=sys.stderr)
    except KeyboardInterrupt:  # before training started (a run checkpoints and returns 130 itself)
        print("anygrad: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError as e:
        if e.filename is not None:  # a file the command writes, not its output: an error as any other
            print(f"anygrad: error: {_short(e.filename)}: {e.strerror or e}", file=sys.stderr)
            return EXIT_ERROR
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as e:  # a file the command had to write or read, failing outside its own checks
        where = f"{_short(e.filename)}: " if e.filename else ""
        print(f"anygrad: error: {where}{e.strerror or e}; check the path and its folder's permissions and free "
              "space", file=sys.stderr)
    except RecursionError:
        print("anygrad: error: an input is nested too deeply to read", file=sys.stderr)
    return EXIT_ERROR


def _drop_stdout() -> None:
    """Point stdout at the null device: its reader is gone (`anygrad info M | head -1`), and the
    interpreter's last flush at exit would report the broken pipe once more."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):  # no real file behind sys.stdout: nothing is flushed
        pass


def _elide_words(text: str) -> str:
    """A message with each very long word (a 100k-character path) shortened as _short does."""
    import re
    return re.sub(r"\S{201,}", lambda m: _short(m[0]), _short(text, 100_000))


def _short(path: Any, limit: int = 200) -> str:
    """A path for a message, its middle elided when very long (a 100k-character argument), and
    printable (an undecodable byte of a file name shown as \\udcff, not a UnicodeEncodeError)."""
    text = str(path).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]} ({len(text):,} characters)"


if __name__ == "__main__":
    sys.exit(main())
