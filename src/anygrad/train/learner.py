"""The training loop: epochs of `Model.train_step` over a DataLoader, validation, checkpoints.

Steps never read back from the device; the metric sums the step program accumulates there are
read every `log_every` steps (progress) and at the end of the epoch. Artifacts are written to a
temporary name and renamed, so a crash or Ctrl-C never leaves a half-written file. Checkpoints
hold all device state, so `resume` continues a run bit for bit (on the CPU).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..batch import unwrap_single
from ..data.loader import BatchSource, DataLoader
from ..data.sources import batch_source, layout_for
from ..data.tokens import TokenWindows
from ..distributed import data_parallel
from ..errors import ConfigError, ShapeError
from ..model import Model
from ..optim.schedulers import RunFacts, get_scheduler
from ..program import ACCUM_PREFIX, SKIPPED_UPDATES, TRAIN_ONLY_METRICS
from . import checkpoint as ckpt
from .artifacts import config_record, save_weights, write_json, write_metrics
from .config import RESUMABLE_CHANGES, TrainConfig, check_fit_keywords
from .guard import Diverged, Guard, nonfinite_entries
from .interrupt import _graceful_interrupt, _StopFlag
from .line_reporter import LineReporter, Log
from .metrics import FIXED_MONITORS, EpochMetrics, _finite, _Sums, metric_family
from .monitor import Monitor
from .report import EpochInfo, Reporter, RunInfo, StepInfo, ValidInfo
from .runfolder import CLI, PYTHON, RunFolder, Wording
from .steplog import StepLog

Arrays = tuple[np.ndarray, np.ndarray]
# What fit trains on: (inputs, targets) arrays or .npy files, an indexable dataset, an iterable of
# batches, a generator function, a BatchSource (see anygrad.data.sources).
Data = Any
Transform = Callable[[np.ndarray, np.ndarray, int], np.ndarray]  # (x batch, sample indices, epoch) -> x


@dataclass
class FitResult:
    history: list[EpochMetrics]
    artifacts_dir: Path | None
    stopped_early: bool = False
    interrupted: bool = False
    best_epoch: int | None = None
    diverged: str | None = None          # what was not finite, when --on-nan stop ended the run
    exported_epoch: int | None = None    # whose weights weights.* hold (train/run.py exports the best)

    @property
    def last(self) -> EpochMetrics | None:
        return self.history[-1] if self.history else None


def _validate(model: Model, data: Data, batch_size: int, transform: Transform | None = None,
              on_batch: Callable[[int, int], None] | None = None) -> _Sums:
    """Loss and accuracy over `data` (any source fit takes, or a BatchSource) in inference mode
    (eval programs, one per batch shape); `on_batch(done, total)` after each batch (the validation
    progress bar)."""
    model.reset_metrics()
    sums = _Sums()
    source = data if isinstance(data, BatchSource) else batch_source(
        data, batch_size=batch_size, shuffle=False, transform=transform, layout=_layout(model, None),
        role="validation data")
    for i, (x, y) in enumerate(source.epoch_batches(0), 1):
        model.eval_step(_inputs(model, x), y)
        if on_batch is not None:
            on_batch(i, len(source))
    sums.add(model.read_metric_sums(reset=True))
    return sums


def _layout(model: Model, target_keys: Any) -> Any:
    """How dict samples split for this model: a loss computed in the graph takes no targets."""
    return layout_for(getattr(model.loss, "name", None) == "output", target_keys)


def _inputs(model: Model, x: Any, dropped: set[str] | None = None) -> Any:
    """A batch's inputs as the model takes them: the structure as given ({name: array} or a
    tuple in graph order), a one-input model's single array unwrapped. Dict keys that name no
    graph input are left out when others do (as Hugging Face's Trainer drops unused columns,
    such as 'idx' or 'text'); `dropped` collects them."""
    names = model.graph.inputs
    if isinstance(x, dict):
        known = [k for k in x if k in names]
        if known and len(known) < len(x):
            if dropped is not None:
                dropped.update(k for k in x if k not in names)
            x = {k: x[k] for k in known}
    return unwrap_single(x, len(names))


def _with_last(batches: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """(batch, is_last) pairs, one batch ahead: the last batch of an epoch flushes an accumulation
    group, also when an iterable's epoch is not as long as its first one."""
    it = iter(batches)
    try:
        ahead = next(it)
    except StopIteration:
        return
    for item in it:
        yield ahead, False
        ahead = item
    yield ahead, True


@dataclass
class _Run:
    """Where the run stands: everything besides device state that a checkpoint records."""

    epoch: int = 1                 # the epoch in progress (1-based)
    step: int = 0                  # steps done within it
    global_step: int = 0
    epoch_done: bool = False       # the checkpoint was written after the epoch's validation
    history: list[EpochMetrics] = field(default_factory=list)
    sums: _Sums = field(default_factory=_Sums)
    stopped_early: bool = False
    lr: float | None = None        # the rate of the epoch's latest optimizer step (metrics.jsonl's lr)


class Learner:
    """One training run of a compiled model: the loop, its schedule, monitor and checkpoints."""

    def __init__(self, model: Model, train_data: Data, valid_data: Data | None, config: TrainConfig,
                 reporter: Reporter, transforms: tuple[Transform | None, Transform | None] = (None, None),
                 resolved: dict[str, Any] | None = None):
        """`transforms`: per-batch input transforms (training, validation), e.g. a DataConfig's.
        `resolved`: what the caller resolved settings to, for config.json's "resolved" record."""
        self.model, self.train_data, self.valid_data, self.config, self.reporter = \
            model, train_data, valid_data, config, reporter
        self.resolved = dict(resolved or {})
        self.valid_transform = transforms[1]
        model._require_compiled()
        if config.clip_grad_norm is not None or config.accumulate != 1:  # else keep what compile() set
            model.configure_step(clip_norm=config.clip_grad_norm, accumulate=config.accumulate)
        # Data parallelism (anygrad.distributed): this rank's share of each global batch; rank 0 writes.
        parallel = data_parallel(model)
        self.writer = parallel is None or parallel.is_writer
        self.world_size = 1 if parallel is None else parallel.world_size
        layout = _layout(model, config.target_keys)
        if parallel is not None:
            if not (isinstance(train_data, tuple) and len(train_data) == 2):
                raise ConfigError("data-parallel training shards (inputs, targets) arrays; pass fit the arrays "
                                  "(or .npy memmaps) rather than a dataset object or an iterable of batches")
            self.loader = parallel.loader(*train_data, batch_size=config.batch_size, shuffle=config.shuffle,
                                          seed=config.seed, drop_last=config.drop_last, transform=transforms[0],
                                          prefetch=config.prefetch)
        else:
            self.loader = batch_source(train_data, batch_size=config.batch_size, shuffle=config.shuffle,
                                       seed=config.seed, drop_last=config.drop_last, transform=transforms[0],
                                       prefetch=config.prefetch, layout=layout)
        if isinstance(self.loader, TokenWindows):
            self.loader.bind(config.batch_size, config.seed)
        if valid_data is not None and not isinstance(valid_data, BatchSource):
            valid_data = batch_source(valid_data, batch_size=config.valid_batch_size or config.batch_size,
                                      shuffle=False, transform=transforms[1], layout=layout, role="validation data")
            self.valid_data = valid_data
        n = self.loader.n_samples
        if len(self.loader) == 0 and n == 0:
            raise ConfigError("the training data is empty (0 samples); pass fit some samples")
        if len(self.loader) == 0:
            raise ConfigError(f"no full batch of {config.batch_size} in {n if n is not None else 'the'} training "
                              "samples; use a smaller batch size or keep the last partial batch (no drop_last)"
                              if n is not None else f"{self.loader.what} yielded no batches")
        if n is not None and self.loader.sample_shape is not None and isinstance(self.loader, DataLoader):
            self._check_last_batch(n % config.batch_size if not config.drop_last else 0)
        self.steps = len(self.loader)
        self.log_every = config.log_every or max(1, self.steps // 10)
        self.out_dir = Path(config.artifacts_dir) if config.artifacts_dir else None
        self.ckpt_dir = self.out_dir / "checkpoints" if self.out_dir else None
        self.monitor = Monitor(config.monitor, config.mode, config.patience, config.min_delta)
        self.notes: list[str] = []  # said when the run begins
        if config.scheduler:  # the model runs the schedule (one mechanism with compile's scheduler=)
            if model.scheduler is not None and not getattr(model.scheduler, "from_fit", False):
                self.notes.append(f"note: --scheduler {config.scheduler} replaces the schedule compile() set")
            base = model.base_lrs[0] if getattr(model, "base_lrs", None) else model.lr
            model.set_scheduler(get_scheduler(config.scheduler, base_lr=base, run=self.run_facts(),
                                              **config.scheduler_options))
            model.scheduler.from_fit = True
        elif model.scheduler is not None and model.scheduler.from_fit:
            model.set_scheduler(None)  # an earlier fit's schedule ends with it
        self.scheduler = model.scheduler
        self._check_monitor()
        self._monitor_checked = False
        self._length_noted = False
        self._dropped: set[str] = set()
        if not self.loader.positionable and self.out_dir is not None:
            self.notes.append(f"note: {self.loader.what} is an iterable, which cannot be positioned mid-epoch: "
                              "checkpoints are written at epoch ends only, and a resumed run restarts an "
                              "interrupted epoch from its beginning with the weights it began with")
        self.run = _Run()
        self.guard = Guard(config.on_nan, model.state_dict, model.full_state, model.load_full_state)
        self.steplog = StepLog(self.out_dir) if self.out_dir is not None and self.writer else None
        self._valid_steps = len(self.valid_data) if self.valid_data is not None else 0

    def _check_last_batch(self, size: int) -> None:
        """Shape-check the training graph at the last partial batch now, not an epoch from now
        (BatchNorm cannot train on a batch of one sample, as in PyTorch)."""
        if size == 0:
            return
        n, shape = self.loader.n_samples, tuple(self.loader.sample_shape)
        full = min(self.config.batch_size, n)
        if full != size:  # a sample shape the model does not take is no fault of the last batch
            try:
                self.model.check_training_shape((full,) + shape)
            except ShapeError as e:
                raise ConfigError(f"the training data's samples have shape {shape}, which the model cannot "
                                  f"train on: {e}") from None
        try:
            self.model.check_training_shape((size,) + shape)
        except ShapeError as e:
            raise ConfigError(f"the last batch of each epoch holds {size} sample{'s' * (size != 1)} ({n} "
                              f"samples, batch size {self.config.batch_size}), which the model cannot train on: "
                              f"{e}") from None

    def _unmonitorable(self) -> str | None:
        """Why this run will have no value for the monitored metric, or None."""
        metric, model = self.config.monitor, self.model
        if metric.startswith("valid_") and (self.valid_data is None or len(self.valid_data) == 0):
            return "the run has no validation data (none given, or --valid-fraction 0)"
        base = metric.split("_", 1)[1] if metric.startswith(("train_", "valid_")) else metric
        if base in FIXED_MONITORS or base == "loss" or len(model.heads) != 1 or not model.loss.needs_target:
            return None  # per-output names: checked against the model's names at the first step
        family, loss = metric_family(base), model.loss
        if family == "label_accuracy" and loss.name != "bce_with_logits":
            return f"label_accuracy is counted for multi-label bce_with_logits, not for the loss {loss.name}"
        if family in ("mse", "mae") and loss.name not in ("mse", "l1"):
            return f"{family} is counted for the regression losses mse and l1, not for the loss {loss.name}"
        if family in ("accuracy", "top5", "pixel_accuracy", "perplexity") and not loss.classification:
            return f"the loss {loss.name} is not a classification loss, so no accuracy is counted"
        if family == "top5" and model.top_k is None:
            return "top-5 accuracy is counted for classifiers of more than 5 classes only"
        return None

    def _check_monitor_reported(self) -> None:
        """Once the first step program is built (the model's metric names known): a monitored
        metric the model does not report is an error when early stopping or the schedule needs
        it, else a note."""
        if self._monitor_checked:
            return
        self._monitor_checked = True
        metric, names = self.config.monitor, self.model.metric_names
        base = metric.split("_", 1)[1] if metric.startswith(("train_", "valid_")) else metric
        if metric in ("seconds", "lr", "samples_per_s") or base in names or not names:
            return
        choices = ", ".join(f"{p}_{n}" for n in names for p in ("train", "valid"))
        why = f"the model reports {', '.join(names)} (monitor one of {choices})"
        if self._metric_needed:
            raise ConfigError(f"--monitor {metric}: this model reports no metric '{base}'; {why}")
        self.reporter.message(f"note: no best checkpoint: '{metric}' has no value in this run: {why}")

    @property
    def _metric_needed(self) -> bool:
        """Whether early stopping or the schedule reads the monitored metric (so the run must have it)."""
        return self.config.patience is not None or (self.scheduler is not None and self.scheduler.needs_metric)

    def _check_monitor(self) -> None:
        """Before the first step: a monitored metric the run will never have is an error when early
        stopping or the plateau schedule depends on it, else a note (no best checkpoint)."""
        why = self._unmonitorable()
        if why is None:
            return
        if self._metric_needed:
            users = (["--patience"] if self.config.patience is not None else []) + \
                ([f"--scheduler {self.scheduler.name}"] if self.scheduler is not None and self.scheduler.needs_metric
                 else [])
            raise ConfigError(f"{' and '.join(users)} watch --monitor {self.config.monitor}, which this run cannot "
                              f"measure: {why}; choose another --monitor (e.g. train_loss)")
        if self.out_dir is not None:
            self.notes.append(f"note: no best checkpoint: {why}, so '{self.config.monitor}' has no value "
                              "(--monitor chooses another metric)")

    def run_facts(self) -> RunFacts:
        """What a scheduler may take from this run: its length in optimizer updates (an update
        every `accumulate` batches, and one for the last partial group of an epoch) and the
        direction of the monitored metric."""
        return RunFacts(self.config.epochs, -(-self.steps // self.config.accumulate), self.monitor.mode)

    # -- checkpoints --------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        r = self.run
        return {"fingerprint": self.model.fingerprint(), "epoch": r.epoch, "step": r.step,
                "global_step": r.global_step, "epoch_done": r.epoch_done, "stopped_early": r.stopped_early,
                "lr": r.lr, "micro_step": self.model.micro_step,
                "steps_per_epoch": self.steps, "history": [_finite(m.row()) for m in r.history],
                "sums": r.sums.state_dict(), "monitor": self.monitor.state_dict(), "world_size": self.world_size,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "param_groups": self.model.describe_groups(), "config": asdict(self.config)}

    def save_checkpoint(self, best: bool = False) -> Path | None:
        if self.ckpt_dir is None or not self.writer:
            return None
        state, meta = self.model.full_state(), self._meta()
        # under f16 a gradient sum may hold inf: the loss scaler skips that update (data
        # parallelism leaves the summed gradients in accum.<param> after it), not a divergence
        scaled = getattr(self.model, "precision", "f32") == "f16"
        bad = nonfinite_entries({k: v for k, v in state.items() if not k.startswith("anygrad.metric")
                                 and not (scaled and k.startswith(ACCUM_PREFIX))})
        if bad and self.config.on_nan != "warn":  # never a non-finite checkpoint: the last one stays the newest
            raise Diverged(f"{', '.join(bad[:3])} hold NaN or infinite values")
        path = ckpt.write(self.ckpt_dir, f"{ckpt.PREFIX}{self.run.global_step:08d}", state, meta)
        ckpt.prune(self.ckpt_dir, self.config.keep_checkpoints)
        if best:
            ckpt.write(self.ckpt_dir, ckpt.BEST, state, meta)
        return path

    def resume(self, path: Path | None = None, wording: Wording = PYTHON) -> Path:
        """Continue from checkpoint `path` (default: the newest in the artifacts folder); `wording`
        names the ways out (the CLI's flags or Model.fit's keywords)."""
        if path is None:
            if self.ckpt_dir is None:
                raise ConfigError("resuming needs the run's artifacts folder")
            path = ckpt.latest(self.ckpt_dir)
            if path is None and not self.ckpt_dir.exists() and not (self.ckpt_dir.parent / "config.json").exists():
                raise ckpt.CheckpointError(
                    f"{self.ckpt_dir.parent} holds no run to resume (no checkpoints, no config.json); start a "
                    f"run there without {wording.resume.format(folder=self.ckpt_dir.parent)}")
            if path is None:
                raise ckpt.CheckpointError(
                    f"no checkpoint in {self.ckpt_dir} to resume from; the run stopped before its first "
                    f"checkpoint, so start it again: in the same folder with {wording.overwrite} (which replaces "
                    f"what the stopped run left there), or in another {wording.folder}")
        c = ckpt.read(Path(path))
        m = c.meta
        if m.get("fingerprint") != self.model.fingerprint():
            raise ckpt.CheckpointError(f"{path}: this checkpoint belongs to another model (fingerprint "
                                       f"{m.get('fingerprint')}, this model's is {self.model.fingerprint()}); "
                                       "resume with the model file the run was started with")
        saved = m.get("config", {})
        now = asdict(self.config)
        diff = [k for k in now if k not in RESUMABLE_CHANGES and k in saved and saved[k] != now[k]]
        if diff:
            raise ckpt.CheckpointError(f"{path}: the checkpoint was made with different settings: " + ", ".join(
                f"{k} {saved[k]!r} (now {now[k]!r})" for k in diff) + "; resume with the run's own config.json")
        groups = self.model.describe_groups()
        if m.get("param_groups") is not None and m["param_groups"] != groups:
            raise ckpt.CheckpointError(f"{path}: the checkpoint was made with other parameter groups "
                                       f"({_groups_text(m['param_groups'])}; now {_groups_text(groups)}); resume "
                                       "with the optimizer and groups the run was started with")
        if not self.loader.positionable and not m.get("epoch_done") and int(m.get("step", 0) or 0) > 0:
            raise ckpt.CheckpointError(f"{path} was written mid-epoch (epoch {m.get('epoch')}, step {m.get('step')}),"
                                       f" but {self.loader.what} is an iterable, which cannot be positioned there; "
                                       "resume from a checkpoint written at an epoch end")
        # Another number of ranks pads the epoch's tail differently (DistributedSampler), which may
        # change its step count; a global step still covers the same samples of the epoch's order.
        if m.get("steps_per_epoch") != self.steps and m.get("world_size", 1) == self.world_size:
            raise ckpt.CheckpointError(f"{path}: the run had {m.get('steps_per_epoch')} steps per epoch, this "
                                       f"one {self.steps}: the training data differ")
        ckpt.validate(c, self.steps, {**self.model.state_dict(), **self.model.lr_states()},
                      allow_nonfinite=self.config.on_nan == "warn")
        try:
            self.model.load_full_state(c.state)
            r = self.run
            r.epoch, r.step, r.global_step = int(m["epoch"]), int(m["step"]), int(m["global_step"])
            r.epoch_done = bool(m["epoch_done"])
            r.lr = None if m.get("lr") is None else float(m["lr"])
            r.history = [EpochMetrics.from_row(row) for row in m["history"]]
            r.sums.load_state_dict(m["sums"])
            self.model.micro_step = int(m["micro_step"])
            self.monitor.load_state_dict(m["monitor"])
            if self.scheduler is not None:
                if m.get("scheduler") is None:
                    raise KeyError("scheduler")
                self.scheduler.load_state_dict(m["scheduler"])
        except (KeyError, TypeError, ValueError) as e:
            raise ckpt.CheckpointError(f"{path}: corrupt checkpoint record ({e!r})") from None
        if r.epoch_done:
            r.epoch, r.step, r.epoch_done = r.epoch + 1, 0, False
            r.sums = _Sums()
        # A run that stopped early stays stopped: its monitor's wait already reached the patience.
        # Under a larger --patience (now RESUMABLE) it has not, and the run goes on; --epochs alone
        # does not restart it (the stop is about the metric, not the length). Older checkpoints
        # without the flag: the monitor's state says it.
        r.stopped_early = bool(m.get("stopped_early", True)) and self.monitor.should_stop
        return Path(path)

    # -- the loop -----------------------------------------------------------------------------------
    def fit(self) -> FitResult:
        cfg, r, model = self.config, self.run, self.model
        if self.out_dir is not None and self.writer:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_json(self.out_dir / "config.json", config_record(
                model, cfg, self.resolved, scheduler=self.scheduler.config() if self.scheduler else None))
        if self.steplog is not None:  # per-step rows past the checkpoint resumed from are another history
            self.steplog.truncate(r.global_step)
        self.reporter.run_begin(RunInfo(model=model.source, device=model.backend.description,
                                        epochs=cfg.epochs, steps_per_epoch=self.steps, batch_size=cfg.batch_size,
                                        start_epoch=r.epoch, artifacts_dir=str(self.out_dir) if self.out_dir else None,
                                        valid_steps=self._valid_steps, history=[
                                            EpochInfo(m.epoch, _finite(m.row()), m.seconds,
                                                      m.epoch == self.monitor.best_epoch) for m in r.history],
                                        earlier_steps=self.steplog.steps() if self.steplog and r.global_step else []))
        for note in self.notes:
            self.reporter.message(note)
        if r.stopped_early:  # resumed after an early stop (see resume): nothing to train
            self.reporter.message(f"the run already stopped early at epoch {r.epoch - 1}: {cfg.monitor} has not "
                                  f"improved for {self.monitor.wait} epochs (best {self.monitor.best:.6g} at epoch "
                                  f"{self.monitor.best_epoch}); to train on, resume with a larger --patience")
        elif r.epoch > cfg.epochs:
            self.reporter.message(f"the run already finished its {cfg.epochs} epochs; to train on, resume with a "
                                  "larger --epochs")
        warned = interrupted = False
        already_stopped = r.stopped_early
        diverged = None
        with _graceful_interrupt(lambda: self.reporter.message(
                "stopping after this step, then writing a checkpoint (Ctrl-C again stops at once)")) as stop:
            try:
                while r.epoch <= cfg.epochs and not r.stopped_early:
                    if self._train_epoch(stop):
                        interrupted = True
                        break
                    self._end_epoch(warned)
                    warned = warned or self._diverged()
                    r.epoch, r.step, r.sums = r.epoch + 1, 0, _Sums()
            except Diverged as e:
                diverged = f"the run diverged at epoch {r.epoch} step {r.step}: {e}"
        closing = []  # said below the final view: what stopped the run and how to go on
        if diverged:
            last = ckpt.latest(self.ckpt_dir) if self.ckpt_dir is not None else None
            closing.append(f"{diverged}; stopped (--on-nan stop)" + (
                f"; the newest checkpoint {last} holds the last finite state" if last else ""))
        elif interrupted and not self.loader.positionable:
            closing.append(f"interrupted at epoch {r.epoch} step {r.step}/{self.steps}; {self.loader.what} "
                           "cannot resume mid-epoch, so no checkpoint of this step" + (
                               f"; anygrad train --resume {self.out_dir} restarts epoch {r.epoch} from the "
                               f"checkpoint of epoch {r.epoch - 1}" if self.out_dir and r.epoch > 1 else ""))
        elif interrupted:
            try:
                where = self.save_checkpoint()
            except Diverged as e:  # stopped between two checks, after the state went non-finite
                where, diverged = None, f"the run diverged before epoch {r.epoch} step {r.step}: {e}"
                closing.append(f"{diverged}; no checkpoint written (--on-nan stop)")
            closing.append(f"interrupted at epoch {r.epoch} step {r.step}/{self.steps}" + (
                f"; checkpoint {where}; continue with: anygrad train --resume {self.out_dir}" if where else ""))
        elif r.stopped_early and not already_stopped:
            self.reporter.message(f"early stop: {cfg.monitor} has not improved for {self.monitor.wait} epochs "
                                  f"(best {self.monitor.best:.6g} at epoch {self.monitor.best_epoch})")
        self.reporter.run_end(stopped_early=r.stopped_early, interrupted=interrupted)
        for text in closing:
            self.reporter.message(text)
        return FitResult(r.history, self.out_dir, r.stopped_early, interrupted, self.monitor.best_epoch, diverged,
                         r.history[-1].epoch if r.history else None)

    def _inputs(self, x: Any) -> Any:
        dropped: set[str] = set()
        x = _inputs(self.model, x, dropped)
        if dropped - self._dropped:
            self._dropped |= dropped
            self.reporter.message(f"note: the data's {', '.join(sorted(dropped))} name no input of the model "
                                  f"(inputs: {', '.join(self.model.graph.inputs)}); left out")
        return x

    def _train_epoch(self, stop: _StopFlag) -> bool:
        """Train the rest of epoch r.epoch; True when interrupted."""
        cfg, r, model = self.config, self.run, self.model
        start, done_before = time.perf_counter(), r.sums.count
        if r.step == 0:
            model.reset_metrics()
        self.guard.remember(r.global_step, model.micro_step)
        # A positionable source starts mid-epoch (after a resume) at batch r.step, the batches being
        # a function of (seed, epoch, position); an iterable starts epochs at their beginning only.
        batches = self.loader.epoch_batches(r.epoch - 1, r.step)
        for step, ((x, y), last) in enumerate(_with_last(batches), r.step + 1):
            r.lr = model.lr  # what this step's update (or its accumulation group's) uses
            model.train_step(self._inputs(x), y, flush=last)
            self._check_monitor_reported()
            r.step, r.global_step = step, r.global_step + 1
            if last and step != self.steps and not self._length_noted:
                self._length_noted = True
                self.reporter.message(f"note: epoch {r.epoch} of {self.loader.what} had {step} batches, the first "
                                      f"{self.steps}; progress and schedules count {self.steps} per epoch")
            if step % self.log_every == 0 and step < self.steps:
                r.sums.add(self._read())
                rate = (r.sums.count - done_before) / max(time.perf_counter() - start, 1e-9)
                info = StepInfo(r.epoch, step, self.steps, r.global_step, r.sums.mean_loss, r.sums.accuracy,
                                model.lr, rate, r.sums.means())
                self.reporter.step(info)
                if self.steplog is not None:
                    self.steplog.add(info)
            if model.strategy.agree(stop.requested):
                return True  # (every rank stops after the same step: a Ctrl-C reaches them at different ones)
            if cfg.checkpoint_every and r.global_step % cfg.checkpoint_every == 0 and step < self.steps \
                    and self.loader.positionable:
                if step % self.log_every and cfg.on_nan == "skip":  # go back before checkpointing a NaN
                    r.sums.add(self._read())
                self.save_checkpoint()
        r.sums.add(self._read())
        self._epoch_seconds = time.perf_counter() - start
        self._epoch_samples = r.sums.count - done_before
        return False

    def _end_epoch(self, warned: bool) -> None:
        cfg, r, model = self.config, self.run, self.model
        # The rate of the epoch's last optimizer step, whether the schedule moves per epoch or per
        # step (model.lr may already hold the next one); as the float32 device value without its
        # binary tail (0.001, not 0.0010000000475).
        lr = float(f"{r.lr if r.lr is not None else model.lr:.8g}")
        shown = getattr(self.reporter, "validation", None)
        on_batch = None if shown is None else lambda i, n: shown(ValidInfo(r.epoch, i, n))
        valid = _validate(model, self.valid_data, cfg.valid_batch_size or cfg.batch_size, self.valid_transform,
                          on_batch=on_batch) if self.valid_data is not None else _Sums()
        seconds = self._epoch_seconds
        train_extra, valid_extra = r.sums.extra(""), valid.extra("")
        extra: dict[str, float | None] = {}
        for name in list(train_extra) + [k for k in valid_extra if k not in train_extra]:
            extra[f"train_{name}"] = train_extra.get(name)
            if name not in TRAIN_ONLY_METRICS:
                extra[f"valid_{name}"] = valid_extra.get(name)
        metrics = EpochMetrics(r.epoch, r.sums.mean_loss, r.sums.accuracy, valid.mean_loss, valid.accuracy,
                               round(seconds, 3), r.sums.top_accuracy, valid.top_accuracy, lr,
                               round(self._epoch_samples / max(seconds, 1e-9), 1), extra)
        r.history.append(metrics)
        row = metrics.row()
        best = self.monitor.update(r.epoch, row) if self._monitorable(row) else False
        if self.scheduler is not None and self.scheduler.interval == "epoch":
            model.step_scheduler(self.monitor.value(row) if self.scheduler.needs_metric else None)
        r.stopped_early = self.monitor.should_stop
        self.reporter.epoch_end(EpochInfo(r.epoch, _finite(row), seconds, best))
        if not warned and self._diverged():
            self.reporter.message("warning: the loss is not finite; the run diverged (try a smaller learning rate)")
        if train_extra.get(SKIPPED_UPDATES) == 1.0:
            self.reporter.message(
                f"warning: every optimizer update of epoch {r.epoch} was skipped: the float16 gradients (or the "
                "forward) overflowed at every loss scale, so the weights did not change; train with "
                "precision='f32', or scale the inputs or the learning rate down")
        if self.out_dir is not None:
            if self.writer:
                write_metrics(self.out_dir / "metrics.jsonl", r.history)
                save_weights(model, self.out_dir)
            r.step, r.epoch_done = self.steps, True
            self.save_checkpoint(best=best)
            r.epoch_done = False

    def _read(self) -> tuple[float, dict[str, tuple[float, float, bool]]]:
        """The device's metric sums since the last read (reset), after the divergence check."""
        return self._checked(self.model.read_metric_sums(reset=True))

    def _checked(self, read: tuple[float, dict[str, tuple[float, float, bool]]]
                 ) -> tuple[float, dict[str, tuple[float, float, bool]]]:
        """A metric read, after the divergence check (--on-nan): passed on when all is finite or
        the mode is warn; stop raises Diverged; skip restores the last finite state and drops it."""
        n, parts = read
        loss = parts.get("loss")
        problem = self.guard.problem(loss[0] / loss[1] if n and loss else None)
        if problem is None:
            self.guard.remember(self.run.global_step, self.model.micro_step)
            return read
        if self.config.on_nan == "stop":
            raise Diverged(problem)
        if self.config.on_nan == "skip":
            skipped, self.model.micro_step = self.guard.restore(self.run.global_step)
            self.reporter.message(f"warning: {problem} at epoch {self.run.epoch} step {self.run.step}; skipped "
                                  f"{skipped} (--on-nan skip)")
            return 0.0, {}
        if not self.guard.warned:
            self.guard.warned = True
            self.reporter.message(f"warning: {problem} at epoch {self.run.epoch} step {self.run.step}; training "
                                  "goes on (--on-nan warn)")
        return read

    def _monitorable(self, row: dict[str, Any]) -> bool:
        """Whether the monitored metric has a value (always, when _check_monitor found it needed)."""
        return row.get(self.config.monitor) is not None

    def _diverged(self) -> bool:
        m = self.run.history[-1] if self.run.history else None
        return m is not None and any(v is not None and not np.isfinite(v) for v in (m.train_loss, m.valid_loss))


def _groups_text(groups: Any) -> str:
    """Saved or current parameter groups in a few words, for a resume's error."""
    if not isinstance(groups, list):
        return repr(groups)
    return "; ".join(f"{g.get('group')}: {len(g.get('params', []))} tensors, {g.get('settings')}"
                     for g in groups if isinstance(g, dict))


def fit(model: Model, train_data: Data, valid_data: Data | None = None, config: TrainConfig | None = None,
        *, reporter: Reporter | None = None, log: Log | None = print, progress: Log | None = None,
        resume: bool | str | Path = False, transforms: tuple[Transform | None, Transform | None] = (None, None),
        resolved: dict[str, Any] | None = None, overwrite: bool = False, claim: bool = True,
        **settings: Any) -> FitResult:
    """Train a compiled model for `config.epochs` epochs (TrainConfig fields may be passed as keywords).

    `train_data` and `valid_data`: (inputs, targets) arrays, memmaps or .npy paths; an indexable
    dataset (a torch or Hugging Face Dataset, anything with __len__ and __getitem__), batched and
    shuffled by anygrad from (seed, epoch); a list of batches, a generator function or a torch
    DataLoader, whose batches come as they are; or anygrad.data.TokenWindows. Samples and batches
    are arrays, (inputs, targets) tuples or dicts, whose `target_keys` (default labels, label, y,
    target, targets; none for loss='output') are the targets. See anygrad.data.sources.

    Progress goes to `reporter` (default: a LineReporter over `log` and `progress`; with
    log=None its warnings go through Python's `warnings`). With
    `artifacts_dir`, metrics, weights and a checkpoint are written after every epoch; `resume`
    (True: the newest checkpoint there, or a checkpoint's .json path) continues a run.
    `resolved` goes into config.json's "resolved" record (e.g. {"normalisation": {"mean": ...,
    "std": ..., "on": "host"}, "classes": [...]}, which predict and eval read).

    The artifacts folder is claimed as `anygrad train` claims it (train/runfolder.py): one that
    holds another run is refused unless `resume` or `overwrite=True`, and files of the user's that a
    run would write over (or the model's own file) are never replaced. `claim=False`: the caller
    holds the folder already (train.run.run does).
    """
    check_fit_keywords(settings)
    for name, fn in (("log", log), ("progress", progress)):
        if fn is not None and not callable(fn):
            raise ConfigError(f"fit's {name} must be a function taking one line of text (e.g. print) or None, "
                              f"not {type(fn).__name__} {fn!r}")
    config = replace(config or TrainConfig(), **settings)
    if claim and getattr(model, "precision", None) in ("f32", "f16"):
        config = replace(config, precision=model.precision)  # recorded and compared on resume as compiled
    config.check(own_loss=getattr(model.loss, "name", None) == "output")
    if (config.param_groups or config.no_decay) and model.optimizer is not None and \
            config.optimizer_groups() != list(model.optimizer.param_groups):
        raise ConfigError("param_groups and no_decay are the optimizer's: compile(optimizer=AdamW(param_groups="
                          "[anygrad.optim.no_decay('*.bias'), ...])) and fit without them")
    learner = Learner(model, train_data, valid_data, config, reporter or LineReporter(log, progress), transforms,
                      resolved)
    folder: AbstractContextManager = nullcontext()
    if claim and learner.out_dir is not None and learner.writer:
        folder = RunFolder(learner.out_dir, resume=bool(resume), overwrite=overwrite, log=learner.reporter.message,
                           inputs=(model.source, config.model, config.weights, config.data_dir), wording=PYTHON)
    with folder:
        if resume:
            learner.resume(None if resume is True else Path(resume), PYTHON if claim else CLI)  # unclaimed: the CLI's
        return learner.fit()