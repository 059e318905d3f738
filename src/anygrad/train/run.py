"""One training run from its settings: `run(RunConfig) -> FitResult`.

What `anygrad train` does besides parsing and printing lives here, so that Python users get the
same run: the model loaded (its weights, frozen parameters, padding rows), the data read and
normalised (on the device or the host), the step compiled, the Learner's fit, and around it:

- the run folder made at once (a bad one fails before the slow work, and is removed again when
  the run fails before it starts) and claimed (train/runfolder.py): refused when it holds another
  run unless `overwrite` (or `resume`), or files of the user's that the run would replace, locked
  while the run lives, cleared of what a killed run left;
- one rank of a torchrun job (train/job.py): the process group joined, the folder and the output
  rank 0's, a rank torchrun restarted resumed from the last checkpoint;
- a full disk or read-only folder mid-run: a RunFolderError that names the folder, says the last
  checkpoint is intact and how to resume, instead of an OSError traceback;
- the best epoch's weights exported at the end when a metric is monitored (`export="last"` keeps
  the last epoch's), and which epoch that is said and written to export.json.
"""
from __future__ import annotations

import errno
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..fsutil import atomic_write
from . import checkpoint as ckpt
from . import job
from .artifacts import save_weights
from .config import TrainConfig
from .learner import FitResult, fit
from .line_reporter import LineReporter
from .report import Reporter
from .runfolder import RunFolder, RunFolderError, make_folder, remove_empty

Log = Callable[[str], None]
# errno values that mean "the folder cannot take more files": said as such, with the way out
_WRITE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EIO, errno.EFBIG}


@dataclass
class RunConfig:
    """A run: its settings (saved as config.json) and how this invocation treats its folder."""

    config: TrainConfig
    resume: bool = False        # continue the run in config.artifacts_dir from its newest checkpoint
    overwrite: bool = False     # replace another run found in config.artifacts_dir
    reporter: Reporter | None = None  # default: a LineReporter over `log`
    log: Log | None = print     # lines about the model, the data and the folder
    typed_paths: dict[str, str] | None = None  # settings' paths as the user typed them (config.json notes them)
    defaulted: tuple[str, ...] = ()  # settings nobody gave (defaults): softer checks, e.g. batch_size vs data
    # One rank of a torch.distributed job (anygrad.distributed.ProcessGroup): it trains its share of
    # each global batch on the device of its local rank; only rank 0 claims and writes the folder.
    # None: the job torchrun's variables describe, when they are set (train/job.py).
    group: Any = None


def default_artifacts(model_name: str) -> Path:
    """runs/<model>-<timestamp>, with -2, -3, ... when that exists already."""
    base = Path("runs") / f"{model_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def run(rc: RunConfig) -> FitResult:
    """Train as `anygrad train` does. Bad settings, a folder holding another run or in use, and
    divergence under on_nan='stop' (FitResult.diverged) are reported; see the module's doc.
    Started by torchrun (its variables set), the process trains as one rank of the job
    (train/job.py): its process group opened, rank 0 alone writing the folder and speaking, and a
    restarted rank resuming the run."""
    config = rc.config
    config.check()
    if not config.model:
        raise ConfigError("RunConfig.config.model: name the ONNX model file to train")
    from ..devices import check_device_settings  # on every device, not only where they are used (wgpu)
    check_device_settings(config.limits, config.memory_budget, flags=True)
    with job.joined(rc.group) as group, job.rank_output(group) as speaks:
        resume, overwrite = job.elastic_resume(config.artifacts_dir, rc.resume, rc.overwrite) \
            if group is not None else (rc.resume, rc.overwrite)
        typed = dict(rc.typed_paths or {})
        if not config.artifacts_dir:  # absolute (predict and eval may run elsewhere), noted as made
            default = default_artifacts(Path(config.model).stem)
            config = replace(config, artifacts_dir=str(default.absolute()))
            typed["artifacts_dir"] = str(default)
        if group is not None:  # rank 0's folder (the default one has a timestamp)
            config = replace(config, artifacts_dir=group.gather_strings(config.artifacts_dir)[0])
        log = (rc.log if speaks else None) or (lambda text: None)
        reporter = (rc.reporter or LineReporter(log)) if speaks else LineReporter(None, warn=False)
        writer = group is None or group.is_writer
        created = make_folder(Path(config.artifacts_dir)) if writer else []
        try:
            result = _run(replace(rc, config=config, resume=resume, overwrite=overwrite, reporter=reporter, log=log,
                                  typed_paths=typed, group=group), writer)
        except BaseException:  # a run that never started leaves nothing behind (a started one keeps its files)
            remove_empty(created)
            raise
        log(f"artifacts: {result.artifacts_dir}")
    return result


def _run(rc: RunConfig, writer: bool) -> FitResult:
    """The run in its folder, claimed (by the writer), with the model and data prepared."""
    config, log, folder = rc.config, rc.log or (lambda text: None), Path(rc.config.artifacts_dir)
    claim = RunFolder(folder, resume=rc.resume, overwrite=rc.overwrite, log=log,
                      inputs=(config.model, config.weights, config.data_dir)) if writer else nullcontext()
    with claim:
        model, train, valid, transforms, resolved, config = _prepare(config, log, "batch_size" in rc.defaulted,
                                                                     rc.group)
        if rc.typed_paths:
            resolved["paths_as_typed"] = dict(rc.typed_paths)
        if rc.resume:
            log(f"resuming from {folder / 'checkpoints'}")
        reporter = rc.reporter or LineReporter(log)
        try:
            result = fit(model, train, valid, config, reporter=reporter, resume=rc.resume,
                         transforms=transforms, resolved=resolved, claim=False)  # claimed above
            if writer:  # an interrupted run too: its weights.* are said for what they are
                _export(model, config, result, reporter)
        except OSError as e:
            if e.errno not in _WRITE_ERRNOS and not _inside(e.filename, folder):
                raise
            raise RunFolderError(_write_failure(folder, e)) from None
    return result


def _inside(filename: Any, folder: Path) -> bool:
    try:
        return filename is not None and Path(filename).resolve().is_relative_to(folder.resolve())
    except (OSError, ValueError, TypeError):
        return False


def _write_failure(folder: Path, e: OSError) -> str:
    """The one-line story of a write that failed mid-run: where, why, what is safe, what to do."""
    what = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    last = ckpt.latest(folder / "checkpoints")
    if last is None:
        kept = "no checkpoint was written yet, so start the run again once the folder takes files"
    else:
        try:
            c = ckpt.read(last)
            kept = (f"the last checkpoint {last} (epoch {c.meta.get('epoch')} step {c.meta.get('step')}) is intact; "
                    f"free space (or make the folder writable), then continue with: anygrad train --resume {folder}")
        except ckpt.CheckpointError as err:
            kept = f"the last checkpoint cannot be read ({err}); resume from an older one"
    return f"cannot write to the run folder {folder} ({what}); {kept}"


def _export(model: Any, config: TrainConfig, result: FitResult, reporter: Reporter) -> None:
    """weights.*, model.onnx and export.json at the end: the best epoch's (Keras'
    restore_best_weights) unless export='last' or nothing was monitored. An interrupted run gets
    the same, over the epochs it finished (none finished: export.json says no weights were
    exported)."""
    out = result.artifacts_dir
    if out is None:
        return
    if not result.history:
        if result.interrupted:
            atomic_write(out / "export.json", json_text({"epoch": None, "chosen": None, "monitor": config.monitor,
                                                         "value": None, "last_epoch": None, "interrupted": True}))
        return
    last = result.history[-1].epoch
    best_file = out / "checkpoints" / f"{ckpt.BEST}.json"
    chosen, epoch = "last", last
    if config.export == "best" and result.best_epoch is not None and best_file.is_file():
        chosen, epoch = "best", result.best_epoch
        if result.best_epoch != last or result.diverged:
            c = ckpt.read(best_file)
            model.load_full_state(c.state)  # the Python caller's model holds the best weights too
            save_weights(model, out)
    elif result.diverged:
        chosen = "last finite"
    value = result.history[epoch - 1].row().get(config.monitor) if chosen == "best" else None
    record = {"epoch": epoch, "chosen": chosen, "monitor": config.monitor, "value": value, "last_epoch": last,
              "interrupted": bool(result.interrupted)}
    atomic_write(out / "export.json", json_text(record))
    result.exported_epoch = epoch
    if chosen == "best":
        how = f"the best by {config.monitor} ({value:.6g})" if isinstance(value, float) else "the best"
        also = "" if epoch == last else f"; the last epoch's ({last}) stay in {out / 'checkpoints'} " \
            "(--export last exports them instead)"
        reporter.message(f"exported the weights of epoch {epoch}, {how}{also}")
    else:
        reporter.message(f"exported the weights of epoch {epoch}, the {chosen}")


def json_text(obj: Any) -> str:
    import json
    return json.dumps(obj, indent=2) + "\n"


# -- model and data ---------------------------------------------------------------------------------
def _prepare(config: TrainConfig, log: Log, default_batch: bool = False,
             group: Any = None) -> tuple[Any, Any, Any, tuple, dict[str, Any], TrainConfig]:
    """The compiled model, the data and its transforms, what was resolved (for config.json), and the
    config with the data folder and loss as resolved."""
    from ..frontends import load_onnx
    from ..optim import get_optimizer
    model_path = Path(config.model)
    optimizer = get_optimizer(config.optimizer or "adam", lr=config.lr, param_groups=config.optimizer_groups())
    # 'auto' (one process, no torch.compile) is resolved by compile: with a wgpu GPU and torch's
    # CUDA/MPS both there, it times the model's step on each (devices.auto_backends)
    auto = (config.device or "auto").strip().lower() == "auto" and group is None and not config.torch_compile
    backend = "auto" if auto else _open_devices(config.device or "auto", config.limits, group, config.memory_budget)
    if config.torch_compile:  # before the data loads: a device without torch.compile is an error at once
        from ..devices import use_torch_compile
        for each in backend if isinstance(backend, list) else [backend]:
            use_torch_compile(each)
    model = load_onnx(str(model_path), init=config.init or "onnx")
    loaded = None
    if config.weights:  # fine-tuning: every tensor comes from the state_dict (or, partial, those that match)
        loaded = model.load_state_dict(config.weights, strict=not config.weights_partial, key=config.weights_key)
    if config.freeze:  # after the weights, so patterns may use the state_dict's PyTorch names
        model.freeze(*config.freeze)
    for spec in config.padding_idx:
        model.set_padding_idx(*padding_spec(spec))
    loss = auto_loss(model) if config.loss in ("auto", "") else config.loss
    train, valid, transforms, source, resolved = train_data(config, model, log)
    if isinstance(train, tuple) and config.batch_size > len(train[1]) and not default_batch:
        raise ConfigError(f"batch-size {config.batch_size} is larger than the {len(train[1]):,} training samples; "
                          f"choose at most {len(train[1])}")
    model.compile(loss=loss, optimizer=optimizer, device=backend, seed=config.seed, limits=config.limits,
                  memory_budget=config.memory_budget, torch_compile=config.torch_compile, precision=config.precision)
    if group is not None:  # one rank of a torch.distributed job (with this process's devices, if several)
        from ..distributed import DataParallel
        model.strategy = DataParallel(model, model.devices[1:], group, sync_batchnorm=config.sync_batchnorm,
                                      grad_compression=config.grad_compression)
    elif config.grad_compression != "none":
        raise ConfigError(f"--grad-compression {config.grad_compression} compresses the gradients torchrun's ranks "
                          "send each other: launch with torchrun (the devices of one process sum in host memory)")
    elif config.sync_batchnorm:
        from ..distributed import data_parallel
        if data_parallel(model) is None:
            raise ConfigError("--sync-batchnorm syncs BatchNorm across data-parallel devices or ranks: give several "
                              "devices (--device cpu,cpu or wgpu:0,wgpu:1) or launch with torchrun")
        data_parallel(model).set_sync_batchnorm(True)
    # the folder the data came from, absolute: predict and eval may run from elsewhere
    config = replace(config, data_dir=str(Path(source).absolute()) if source and Path(source).exists() else source,
                     loss=loss)
    extras = ["mixed precision f16 (loss scaling)" if config.precision == "f16" else "",
              f"clip {config.clip_grad_norm:g}" if config.clip_grad_norm else "",
              f"accumulate {config.accumulate}" if config.accumulate > 1 else "",
              f"scheduler {config.scheduler}" if config.scheduler else "",
              f"from weights {Path(config.weights).name}" if config.weights else "",
              f"{model.num_frozen_parameters():,} frozen" if config.freeze else ""]
    devices = [model.backend, *(model.auto_candidates or [])]
    if not any(str(d.name).startswith("wgpu") for d in devices):
        from ..backends.wgpu.planning.limits import get_profile
        for flag, given in (("--limits", config.limits is not None and get_profile(config.limits) is not None),
                            ("--memory-budget", config.memory_budget is not None)):
            if given:
                log(f"note: {flag} applies to wgpu devices only; {model.backend.description} does not use it")
    if config.weights_partial and loaded is not None and (loaded.missing or loaded.unexpected
                                                          or loaded.mismatched):
        log(f"note: --weights-partial loaded {len(loaded.loaded)} entries of {Path(config.weights).name}; "
            f"{len(loaded.missing)} missing (the model's own values kept), {len(loaded.unexpected)} "
            f"unexpected and {len(loaded.mismatched)} mis-shaped (not loaded)")
    from ..distributed import data_parallel
    parallel = data_parallel(model)
    where = parallel.description if parallel is not None else model.backend.description
    if model.auto_candidates:
        where = (" or ".join(b.description for b in model.auto_candidates)
                 + ", whichever runs its first steps faster")
    log(f"training {model_path.name} ({model.num_parameters():,} parameters) on "
        f"{where}: {config.optimizer} lr {optimizer.lr:g}, loss {loss}, batch {config.batch_size}, "
        f"{config.epochs} epoch{'s' * (config.epochs != 1)}, seed {config.seed}" + "".join(f", {e}" for e in extras if e))
    if isinstance(train, tuple):
        log(f"data: {len(train[1]):,} train / {len(valid[1]) if valid else 0:,} valid samples from {source}")
    if str(model.backend.name).startswith("wgpu"):
        log("the first steps compile the device's shaders (seconds to a minute); progress follows")
    return model, train, valid, transforms, resolved, config


def _open_devices(device: str, limits: str | None, group: Any = None, memory_budget: Any = None) -> Any:
    """The backend of `device`, or a list of them for 'wgpu:0,wgpu:1' (data parallel in-process);
    a rank of a job takes the device of its local rank."""
    from ..devices import get_backend
    from ..distributed import device_list, open_backends, rank_device
    if group is not None:
        device = rank_device(device, group.world.local_rank)
    several = device_list(device)
    return open_backends(several, limits, memory_budget) if several else \
        get_backend(device, limits=limits, memory_budget=memory_budget)


def padding_spec(spec: str) -> tuple[str, int]:
    """'TABLE:ROW' of --padding-idx -> (table, row)."""
    table, _, row = str(spec).rpartition(":")
    try:
        return table, int(row)
    except ValueError:
        raise ConfigError(f"--padding-idx takes TABLE:ROW, such as 'embed_tokens.weight:1', not {spec!r}") from None


def fit_input(x: np.ndarray, shape: tuple, input_name: str) -> np.ndarray:
    """Dataset samples reshaped to the model's input, when only the layout differs ((1,28,28) vs (784,))."""
    want = tuple(shape[1:])
    if all(isinstance(d, int) for d in want) and tuple(x.shape[1:]) != want:
        if int(np.prod(want)) != int(np.prod(x.shape[1:])):
            raise ConfigError(f"the model's input '{input_name}' takes samples of shape {want}, but the dataset "
                              f"holds {tuple(x.shape[1:])}; choose a model made for this dataset")
        return x.reshape((len(x),) + want)
    return x


def auto_loss(model: Any) -> str:
    """nll when the model already ends in LogSoftmax (as the founding example does), else cross_entropy."""
    producer = model.graph.producers().get(model.graph.outputs[0])
    return "nll" if producer is not None and producer.op == "LogSoftmax" else "cross_entropy"


def train_data(config: TrainConfig, model: Any, log: Log) -> tuple[Any, Any, tuple, str, dict[str, Any]]:
    """(train, valid, per-batch transforms, source, resolved) through anygrad.data: stored images,
    augmented batch by batch, and normalised on the device (uint8 batches, a prologue in the model's
    graph; before compile) or on the host (float32 batches), as config.normalize says. `resolved`
    records the normalisation and class names for config.json, where predict and eval find them."""
    from ..data.graph_input import add_input_normalisation, can_normalise_in_graph
    if config.dataset == "tokens":  # a language model on a token file: random windows (anygrad.data.tokens)
        from ..data.tokens import token_run_data
        train, valid, source, resolved = token_run_data(config.data_dir, config.block_size, config.valid_fraction)
        log(f"data: {train.tokens.dtype} tokens, {len(train.tokens):,} train / "
            f"{len(valid.tokens) if valid is not None else 0:,} valid, windows of {config.block_size} + 1")
        return train, valid, (None, None), source, resolved
    dcfg = config.data_config()
    d = dcfg.load(seed=config.seed, log=log)
    mean, std = dcfg.stats(d)
    on_device = config.normalize == "device" and mean is not None and d.train[0].dtype == np.uint8 \
        and can_normalise_in_graph(model, mean)
    if on_device:
        add_input_normalisation(model, mean, std)
    shape, name = model.input_shape, model.input_name

    def fitted(transform: Callable) -> Callable:
        return lambda x, idx, epoch: fit_input(transform(x, idx, epoch), shape, name)
    train_tf, valid_tf = (fitted(dcfg.transform(d, config.seed, train=t, on_device=on_device)) for t in (True, False))
    train_tf(d.train[0][:1], np.arange(1), 0)  # a dataset that does not fit the model fails now, clearly
    stats = "" if mean is None else f" (mean {_floats_text(mean)} std {_floats_text(std)})"
    how = "not normalised" if mean is None else "uint8, normalised on the device" if on_device else \
        "normalised on the host"
    log(f"batches: {how}{stats}; augment {augment_text(config.crop_padding, config.hflip)}; valid: {d.valid_from}")
    normalisation = None if mean is None else {"mean": [float(v) for v in mean], "std": [float(v) for v in std],
                                               "on": "device" if on_device else "host"}
    resolved = {"normalisation": normalisation, "classes": list(d.classes)}
    return d.train, d.valid, (train_tf, valid_tf), d.source, resolved


def _floats_text(values: Any) -> str:
    return ",".join(f"{v:.4g}" for v in values)


def augment_text(crop_padding: int, hflip: bool) -> str:
    parts = ([f"crop:{crop_padding}"] if crop_padding else []) + (["hflip"] if hflip else [])
    return ",".join(parts) or "none"
