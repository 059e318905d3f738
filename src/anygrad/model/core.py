"""The Model users hold: an imported Graph, its state, and the programs compiled for it per shape.

The class keeps every method users call (and the attributes the rest of anygrad reads); the work
behind them lives in the modules beside it, one job each: configure (compile), heads (losses and
targets), freezing, programs (the compiled-step cache), rates (learning rates and the schedule),
metrics, state (weights and checkpoints) and placement (backends and device='auto').
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..backends.base import Backend, Executable
from ..batch import Batch, is_torch_tensor, parse_inputs, take
from ..errors import ConfigError
from ..facade import operation
from ..ir.graph import Graph
from ..losses import Loss
from ..optim.base import Optimizer
from ..optim.groups import ResolvedGroup
from ..optim.schedulers import GroupSchedule
from ..program import Head, MetricSpec, training_forward
from ..strategy import SingleDevice, TrainStrategy
from . import configure, freezing, heads, metrics, placement, programs, rates
from . import state as model_state


class Model:
    """A model imported from ONNX (or built with anygrad.nn), trainable on any backend."""

    def __init__(self, graph: Graph, source: str = "model"):
        self.graph = graph
        self.source = source
        self.origin = None  # what the frontend learnt about the file (anygrad.frontends.OnnxOrigin)
        self.torch_binding = None  # PyTorch names learnt by load_state_dict (frontends.torch_weights)
        self.loss: Loss | None = None      # the first head's loss (what most code asks about)
        self.heads: list[Head] = []        # every output with a loss (compile's loss=...)
        self._metric_specs: dict[str, MetricSpec] = {}  # what read_metrics reports, from the programs
        self.optimizer: Optimizer | None = None
        self.param_groups: list[ResolvedGroup] = []  # the optimizer's groups over this model (compile)
        self._group_lrs: list[float] = []            # each group's current rate (host copy of its buffer)
        self.backend: Backend | None = None
        self.seed = 0
        self._programs: dict[tuple, Executable] = {}
        self.clip_norm: float | None = None  # gradient clipping by global norm, inside the step
        self.accumulate = 1                  # micro-batches per optimizer update
        self.precision = "f32"               # "f16": mixed precision (compile's precision=)
        self.micro_step = 0                  # micro-batches accumulated since the last update
        self.frozen: list[str] = []          # parameters freeze() made buffers (graph names)
        self._state_order: list[str] | None = None  # the parameters' order before the first freeze
        self.sync_batchnorm = False  # BatchNorm statistics summed over the replicas a strategy runs (AllReduceSum)
        self.strategy: TrainStrategy = SingleDevice()  # how training steps reach the devices (strategy.py)
        self.devices: list[Backend] = []  # the backends compile() opened: the first is `backend`
        self.auto_candidates: list[Backend] = []  # device="auto" still choosing: timed on the first step
        self.backend_trial: dict[str, float] = {}  # that timing: ms per step by backend description
        self.scheduler: GroupSchedule | None = None  # the learning-rate schedule (compile's scheduler=)

    # -- introspection --------------------------------------------------------------------
    @property
    def input_name(self) -> str:
        return self.graph.inputs[0]

    @property
    def input_names(self) -> list[str]:
        """The graph's inputs in order: what a tuple batch lists, and the keys of a dict batch."""
        return list(self.graph.inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self.graph.outputs)

    @property
    def target_names(self) -> list[str]:
        """The outputs that take targets (the keys of a dict of targets); [] for loss='output'."""
        return [h.output for h in self.heads if h.loss.needs_target]

    @property
    def input_shape(self) -> tuple:
        return tuple(self.graph.info[self.input_name].shape)

    @property
    def param_names(self) -> list[str]:
        return list(self.graph.params)

    def num_parameters(self) -> int:
        """Trainable parameters (frozen ones not included: see num_frozen_parameters)."""
        return int(sum(self.graph.initializers[p].size for p in self.graph.params))

    def num_frozen_parameters(self) -> int:
        return int(sum(self.graph.initializers[p].size for p in self.frozen))

    # -- freezing -----------------------------------------------------------------------------
    def parameter_aliases(self) -> dict[str, set[str]]:
        """Graph name -> the names a pattern may use for it: the graph name, the PyTorch
        state_dict key the importer (or the last load_state_dict) recorded, and the other keys of
        a tied tensor."""
        return freezing.parameter_aliases(self)

    def freeze(self, *patterns: str) -> list[str]:
        """Stop training the parameters that match any of `patterns`, like requires_grad_(False):
        fnmatch globs over graph names and PyTorch state_dict names ('conv1.*', 'layer1.*.weight',
        'fc.bias'). Frozen tensors stay in the state, checkpoints and exports, and training leaves
        them unchanged. Returns the graph names the patterns matched (all frozen now); a pattern
        matching no parameter is a ConfigError. Compiled step programs are rebuilt on next use."""
        return freezing.freeze(self, patterns)

    def unfreeze(self, *patterns: str) -> list[str]:
        """Make matching parameters (frozen by freeze()) trainable again; returns their graph names."""
        return freezing.unfreeze(self, patterns)

    def set_padding_idx(self, name: str, index: int) -> list[str]:
        """Give the embedding table `name` (a graph or PyTorch name, or a glob) PyTorch's
        `nn.Embedding(padding_idx=index)` semantics, which an ONNX file cannot carry: lookups of
        row `index` pass no gradient back (the row keeps its values unless something else, a tied
        output layer, trains it). Marks every row lookup (Gather on axis 0) of the table; returns
        the graph names of the tables. Compiled step programs are rebuilt on next use."""
        return freezing.set_padding_idx(self, name, index)

    # -- setup ----------------------------------------------------------------------------
    def compile(self, loss: str | Loss | Mapping[str, str | Loss] = "cross_entropy",
                optimizer: Optimizer | None = None, device: str | Backend | list = "cpu", seed: int = 0, *,
                loss_weights: Mapping[str, float] | None = None, clip_norm: float | None = None,
                accumulate: int = 1, limits: str | None = None, memory_budget: int | str | None = None,
                torch_compile: bool | str = False, precision: str = "f32", scheduler: Any = None,
                scheduler_interval: str | None = None, loss_output: str | None = None,
                **loss_options: Any) -> Model:
        """Choose the loss, optimizer and device.

        `loss`: a name (cross_entropy, nll, mse, l1, bce_with_logits) or a Loss for the first
        output; a dict {output name: loss} for several outputs, each trained on its own targets
        (passed by output name), their losses summed with `loss_weights` (default 1 each);
        or "output": the model's own scalar loss output (a forward that returns the loss, also
        as (logits, loss)) is minimised, with no targets: its only scalar float output, wherever
        it stands; with several, name it with "output:NAME" or `loss_output=NAME`. `loss_options`
        go to the named losses that take them
        (ignore_index, reduction, label_smoothing, weight, class_axis).
        `device`: one device, or several ('wgpu:0,wgpu:1' or a list) that share each batch;
        'auto': the best there is (devices.get_backend), or, with a wgpu GPU and torch's CUDA/MPS
        both there, whichever runs this model's first training steps faster (timed then, printed,
        in `backend_trial`; the timed steps leave no trace in the state).
        `limits`, `memory_budget` (wgpu): a weaker adapter's limits profile, and the bytes a step
        may hold (default: the profile's budget); see README "Small GPUs".
        `torch_compile` (torch devices only, else a ConfigError): the step goes through
        torch.compile (True: inductor; or a torch.compile backend's name), with CUDA graphs on CUDA.
        `precision`: "f32", or "f16" to train in mixed precision as torch.autocast + GradScaler do
        (float16 activations and matmul/conv operands, float32 master weights, optimizer state,
        softmax, norms and losses; dynamic loss scaling); evaluate and predict stay float32.
        See README "Mixed precision".
        `scheduler`: the learning-rate schedule (see set_scheduler: an anygrad Scheduler, a torch
        scheduler converted by anygrad.optim.from_torch, or a function step -> lr factor), advanced
        per optimizer update (`scheduler_interval` "step") in train_on_batch, train_step and fit,
        or per epoch of fit ("epoch"). See docs/optimizers.md."""
        return configure.compile_model(
            self, loss, optimizer, device, seed, loss_weights=loss_weights, clip_norm=clip_norm,
            accumulate=accumulate, limits=limits, memory_budget=memory_budget, torch_compile=torch_compile,
            precision=precision, scheduler=scheduler, scheduler_interval=scheduler_interval,
            loss_output=loss_output, loss_options=loss_options)

    def configure_step(self, clip_norm: float | None = None, accumulate: int = 1) -> Model:
        """Gradient clipping (max global 2-norm, like torch.nn.utils.clip_grad_norm_) and gradient
        accumulation (one optimizer update every `accumulate` train_step calls, loss scaled by
        1/accumulate). Both are compiled into the step programs, which are rebuilt."""
        return configure.configure_step(self, clip_norm, accumulate)

    @property
    def top_k(self) -> int | None:
        """k of the top-k accuracy the programs count (None: not a >5-class classifier, or the
        device has no kernel for it)."""
        return programs.top_k(self)

    def _supports(self, op: str) -> bool:
        """Whether the compiled backend runs `op` (each backend answers for itself)."""
        return self.backend is None or bool(self.backend.supports(op))

    def require_compiled(self) -> Backend:
        """The backend training runs on; a ConfigError before compile()."""
        if self.backend is None or self.loss is None:
            raise ConfigError("call model.compile(loss=..., optimizer=..., device=...) first")
        return self.backend

    _require_compiled = require_compiled  # (the name Model's methods and the learner use)

    def check_training_shape(self, batch_shape: tuple | Mapping[str, tuple]) -> None:
        """Raise the ShapeError a training step for this input shape (one input) or these shapes
        by input name would raise, without building it."""
        shapes = dict(batch_shape) if isinstance(batch_shape, Mapping) else {self.input_name: tuple(batch_shape)}
        training_forward(self.graph, {n: tuple(s) for n, s in shapes.items()})

    def parse_inputs(self, x: Any) -> Batch:
        """A batch's inputs as {input name: array}: from a dict by name, a tuple in graph order, or
        one array (one-input models); numpy arrays or torch tensors. Errors name the input."""
        return parse_inputs(x, self.graph)

    def parse_targets(self, y: Any, inputs: Batch | None = None) -> Batch:
        """A batch's targets as {target input: array} for the outputs with a loss: one array (one
        such output), a dict by output name, or a tuple in output order."""
        return heads.parse_targets(self.heads, self.input_names, y)

    def _lead(self, name: str) -> Any:
        """The declared first dimension of graph value `name` (a symbol such as 'batch', or a size)."""
        info = self.graph.info.get(name)
        return info.shape[0] if info is not None and info.shape else None

    def _batch(self, x: Any, y: Any, need_targets: bool = True) -> tuple[Batch, Batch]:
        inputs = self.parse_inputs(x)
        return inputs, self.parse_targets(y, inputs) if need_targets or y is not None else {}

    # -- training -------------------------------------------------------------------------
    def next_phase(self, flush: bool) -> str:
        """Which step program this micro-batch runs (see program.PHASES); advances micro_step.
        A strategy calls it once per micro-batch (`flush`: this one ends the accumulation)."""
        return programs.next_phase(self, flush)

    def train_program(self, inputs: Batch, targets: Batch, phase: str = "step") -> Executable:
        """The compiled training step for these parsed inputs and targets (their shapes) and `phase`
        (program.PHASES: "step" updates; "first"/"accumulate" only sum the gradients into the
        accum.<param> buffers, which is what a data-parallel strategy runs before its exchange).
        With device='auto' still choosing, the first call times the candidates."""
        if self.auto_candidates:
            self._choose_backend(inputs, targets)
        return programs.program(self, "train", inputs, targets, phase)

    def update_program(self) -> Executable:
        """The optimizer update alone (program.build_update_step), from the gradients in the
        accum.<param> buffers: what every replica runs after a data-parallel exchange."""
        return programs.update_program(self)

    def clear_programs(self) -> None:
        """Drop the compiled programs (their settings changed: sync_batchnorm, clipping, freezing);
        the next steps compile anew. The state stays."""
        self._programs.clear()

    def programs(self, kind: str = "train") -> dict[tuple, Executable]:
        """The compiled programs of `kind` ("train", "eval", "predict", "update") by their key
        (kind, first input's shape, first target's shape, phase, every shape)."""
        return {k: e for k, e in self._programs.items() if k[0] == kind}

    def replica(self, backend: Backend) -> Model:
        """A Model on `backend` sharing this one's graph, losses, optimizer and step settings, with
        programs of its own and a copy of this one's full state (a data-parallel replica)."""
        import copy
        r = copy.copy(self)
        r.backend, r.devices, r._programs, r.micro_step = backend, [backend], {}, 0
        r.strategy = SingleDevice()
        r.take_state(self)
        return r

    def take_state(self, source: Model) -> None:
        """This model's backend takes `source`'s full state and learning rates (a replica following
        the model it was made of)."""
        model_state.take_state(self, source)

    def _choose_backend(self, inputs: Batch, targets: Batch) -> None:
        """device='auto' with a wgpu GPU and torch's CUDA/MPS (devices.auto_backends): time this
        model's training step at this batch on each, keep the faster, say so, and release the
        others' memory. The timed steps train: every candidate starts from, and the winner goes
        on from, the state as it was before them. A candidate that cannot compile or run the
        step (an op it lacks, its memory) is left out, and said so; if none can, the first
        one's error is raised."""
        placement.choose_backend(self, inputs, targets)

    def train_step(self, x: Any, y: Any = None, flush: bool = False) -> None:
        """One optimizer step (with accumulation: one micro-batch, the update every `accumulate`
        calls or now when `flush`); no readback (metric sums accumulate on the device).
        `x`: the inputs (see parse_inputs); `y`: the targets (see parse_targets; none for
        loss='output')."""
        inputs, targets = self._batch(x, y)
        self.strategy.train_step(self, inputs, targets, flush, False)
        rates.after_update(self)

    def train_on_batch(self, x: Any, y: Any = None, flush: bool = False) -> float:
        """One optimizer step; returns the batch loss (before the update)."""
        inputs, targets = self._batch(x, y)
        loss = self.strategy.train_step(self, inputs, targets, flush, True)
        rates.after_update(self)
        return loss

    # -- the learning-rate schedule -------------------------------------------------------
    def set_scheduler(self, scheduler: Any, interval: str | None = None) -> GroupSchedule | None:
        """Schedule every parameter group's rate (what compile's `scheduler=` does): an anygrad
        Scheduler (get_scheduler; each group scaled from its own initial rate, as torch does), a
        torch scheduler converted by anygrad.optim.from_torch, or a function `step -> factor`
        of the initial rates (LambdaLR); None removes the schedule. `interval`: "step" (advance
        after every optimizer update, in train_on_batch, train_step and fit) or "epoch" (fit
        advances it after each epoch; elsewhere call step_scheduler()); default: the
        scheduler's own. The rates go to the device's rate buffers, without a recompile."""
        return rates.set_scheduler(self, scheduler, interval)

    def step_scheduler(self, metric: float | None = None) -> list[float]:
        """Advance the schedule one step (one epoch, for interval "epoch"); `metric` feeds
        ReduceLROnPlateau. Returns every group's new rate."""
        return rates.step_scheduler(self, metric)

    # -- inference and evaluation --------------------------------------------------------
    def eval_step(self, x: Any, y: Any = None) -> None:
        """Accumulate validation loss and metric sums for one batch, in inference mode."""
        inputs, targets = self._batch(x, y)
        programs.program(self, "eval", inputs, targets).run({**inputs, **targets}, fetch=[])

    def predict(self, x: Any, batch_size: int | None = None) -> np.ndarray | dict[str, np.ndarray]:
        """Model output in inference mode: an array, or {output name: array} for a model with
        several outputs. `batch_size`: predict in batches of that many samples and concatenate
        (default: all at once). An uncompiled model predicts on the CPU, like a freshly built
        PyTorch module: inference needs no loss or optimizer."""
        _check_batch_size(batch_size, allow_none=True)
        if self.backend is None:
            self.compile(device="cpu")
        if _is_source(x):  # what fit takes: a DataLoader, a dataset, batches; their outputs in order
            parts = [self._predict_batch(self.parse_inputs(xb))
                     for xb, _ in self._one_pass(x, batch_size or 1000, with_targets=False, what="predict")]
            if not parts:
                raise ConfigError("predict() got a data source with no batches")
            return _concatenate(parts)
        inputs = self.parse_inputs(x)
        n = len(next(iter(inputs.values())))
        parts = [self._predict_batch(take(inputs, slice(i, i + batch_size))) for i in range(0, n, batch_size)] \
            if batch_size is not None and n > batch_size else [self._predict_batch(inputs)]
        return _concatenate(parts)

    def _one_pass(self, source: Any, batch_size: int, with_targets: bool, what: str) -> Iterable[tuple[Any, Any]]:
        """The (x, y) batches of a data source, once, as fit reads them (anygrad.data, through the facade)."""
        return operation("one_pass")(source, batch_size=batch_size, with_targets=with_targets, role=f"{what}'s data",
                                     loss_in_graph=getattr(self.loss, "name", None) == "output")

    def _predict_batch(self, inputs: Batch) -> np.ndarray | dict[str, np.ndarray]:
        exe = programs.program(self, "predict", inputs)
        out = exe.run(inputs)
        if len(exe.graph.outputs) == 1:
            return out[exe.graph.outputs[0]]
        return {n: out[n] for n in exe.graph.outputs}

    def evaluate(self, x: Any, y: Any = None, batch_size: int = 1000) -> dict[str, float]:
        """Mean loss and the metrics (see read_metrics) over (x, y) in inference mode. `x` alone
        may also be an (inputs, targets) tuple, as fit's validation data, or a data source (an
        anygrad or torch DataLoader, any iterable of (x, y) batches), whose own batches are used."""
        self._require_compiled()
        _check_batch_size(batch_size)
        if _is_source(x):  # what fit takes as validation data: a DataLoader, a dataset, batches
            if y is not None:
                raise ConfigError("evaluate(): a data source brings its own targets; pass it alone, without y")
            batches = (self._batch(xb, yb) for xb, yb in self._one_pass(x, batch_size, with_targets=True,
                                                                         what="evaluate"))
        else:
            if (y is None and isinstance(x, tuple) and len(x) == 2 and len(self.graph.inputs) == 1
                    and getattr(self.loss, "name", None) != "output"):
                x, y = x  # (inputs, targets), as fit's validation data
            inputs, targets = self._batch(x, y)
            n = len(next(iter(inputs.values())))
            batches = ((take(inputs, slice(i, i + batch_size)), take(targets, slice(i, i + batch_size)) if targets
                        else targets) for i in range(0, n, batch_size))
        self.reset_metrics()
        steps = 0
        for part_inputs, part_targets in batches:  # other names: the generator above reads inputs, targets
            self.eval_step(part_inputs, heads.by_output(self.heads, part_targets) if part_targets else None)
            steps += 1
        if not steps and _is_source(x):
            raise ConfigError("evaluate() got a data source with no batches")
        return self.read_metrics(reset=True)

    # -- metrics (device-side sums) --------------------------------------------------------
    def metric_buffers(self) -> set[str]:
        """The names of the metric sums the step programs add to on the device (read_metric_sums)."""
        return metrics.metric_buffers(self)

    def reset_metrics(self) -> None:
        metrics.reset_metrics(self)

    @property
    def metric_names(self) -> list[str]:
        """The keys read_metrics reports besides 'count' (known once a step program is built):
        'loss' always; per output with a loss (prefixed '<output>_' when there are several):
        accuracy and top5 (classifiers), accuracy and perplexity (token-level class targets, ignored
        positions skipped), pixel_accuracy (per-pixel classes), mse and mae (mse/l1),
        label_accuracy (multi-label bce_with_logits), '<output>_loss' with several; the model's
        other scalar outputs by name for loss='output'."""
        return list(self._metric_specs)

    def read_metrics(self, reset: bool = False) -> dict[str, float]:
        """The metric sums since the last reset as means: {'count': samples, 'loss': ..., ...}
        (see metric_names)."""
        return metrics.read_metrics(self, reset)

    def read_metric_sums(self, reset: bool = False) -> tuple[float, dict[str, tuple[float, float, bool]]]:
        """The raw sums behind read_metrics: (samples, {metric: (numerator, denominator, exp)}),
        each metric's mean being numerator / denominator (exp of it for perplexity). A trainer
        adds these up over reads, so that each metric is weighted by its own denominator (tokens,
        pixels, elements), not by samples. Metrics without a denominator yet are left out."""
        return metrics.read_metric_sums(self, reset)

    # -- learning rates ------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The rate the next update uses (of the first parameter group, with several: what
        torch users log as param_groups[0]['lr']). The host copy, which the setter and
        load_full_state keep equal to the device's buffer: reading that would cost a readback
        per call (per step). Setting it with several groups scales every group's rate by the
        same factor relative to its base_lr (value / the first group's base_lr), as torch's
        schedulers scale each group; when the first group's base_lr is 0, every group gets
        `value`. Per-group rates: group_lrs."""
        self._require_compiled()
        return float(self._group_lrs[0])

    @lr.setter
    def lr(self, value: float) -> None:
        rates.set_lr(self, value)

    @property
    def group_lrs(self) -> list[float]:
        """Each parameter group's current rate, in group order (param_groups); the setter
        writes the device buffers, so a scheduler moves them per step without a recompile."""
        self._require_compiled()
        return list(self._group_lrs)

    @group_lrs.setter
    def group_lrs(self, values: Iterable[float]) -> None:
        rates.set_group_lrs(self, values)

    @property
    def base_lrs(self) -> list[float]:
        """Each group's initial rate (torch's group['initial_lr']), which schedulers scale."""
        return [grp.base_lr for grp in self.param_groups]

    def describe_groups(self) -> list[dict[str, Any]]:
        """The parameter groups as JSON: label, selector, parameters (graph names), settings."""
        from ..optim.groups import describe_groups
        return describe_groups(self.param_groups)

    def lr_states(self) -> dict[str, np.ndarray]:
        """Each group's rate buffer as a checkpoint holds it (name -> float32 scalar)."""
        return rates.lr_states(self)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and buffers (running statistics) by graph name, as host arrays."""
        return model_state.state_dict(self)

    def sync_to_graph(self) -> Graph:
        """The model graph with the current state written into its initializers."""
        for name, value in self.state_dict().items():
            self.graph.initializers[name] = value
        return self.graph

    # -- everything a checkpoint needs -------------------------------------------------------
    def full_state(self) -> dict[str, np.ndarray]:
        """All persistent device state by name: parameters, buffers, and what only the compiled
        step programs hold (optimizer slots `optim.*`, accumulation sums, lr, step, RNG counter,
        metric sums). Restoring it with load_full_state() continues training bit for bit."""
        return model_state.full_state(self)

    def load_full_state(self, state: dict[str, np.ndarray]) -> None:
        """Write a full_state() back. Programs compiled later keep these values (a backend only
        initialises state it lacks), so this may come before or after compiling."""
        model_state.load_full_state(self, state)

    def fingerprint(self) -> str:
        """A hash of the graph's structure and its state names, shapes and dtypes (not values):
        equal for the same model file whatever its weights, different for another model."""
        return model_state.fingerprint(self)

    def fit(self, train: tuple[np.ndarray, np.ndarray], valid: tuple[np.ndarray, np.ndarray] | None = None,
            *, overwrite: bool = False, **settings: Any):
        """Train for `epochs` with validation, metrics, early stopping, clipping, accumulation,
        schedulers, checkpoints (the keywords: anygrad.train.config.FIT_SETTINGS; the optimizer, loss,
        precision and device are compile()'s, and a keyword of theirs is refused here). An
        `artifacts_dir` that holds another run is refused unless `resume=True` continues it or
        `overwrite=True` replaces it; files of yours there are never replaced."""
        return operation("fit")(self, train, valid, overwrite=overwrite, **settings)

    # -- PyTorch interop (anygrad.frontends.torch_weights, through anygrad.facade) ---------------
    def load_state_dict(self, state_dict: Any, strict: bool = True, key: str | None = None) -> Any:
        """Load PyTorch weights: a state_dict (numpy arrays or torch tensors) or a .pt/.pth,
        .safetensors or .npz path; `key` picks the entry of a checkpoint dict. Returns a LoadResult;
        with strict=True any missing, unexpected or mis-shaped key raises (all listed)."""
        return operation("load_state_dict")(self, state_dict, strict=strict, key=key)

    def to_torch_state_dict(self, as_numpy: bool = False) -> dict[str, Any]:
        """The state under PyTorch names, ready for `module.load_state_dict` (torch tensors, which
        needs torch; numpy arrays with as_numpy=True)."""
        state = operation("to_torch_state_dict")(self)
        return state if as_numpy else operation("to_torch_tensors")(state)

    def save_safetensors(self, path: Any) -> Any:
        """Write the state with PyTorch names to a .safetensors file; returns its Path."""
        return operation("save_safetensors")(self, path)

    def save_adapters(self, folder: Any, overwrite: bool = False) -> Any:
        """Write only the trained adapters to `folder`: peft's adapter_model.safetensors and
        adapter_config.json for a model from_torch made of a peft model (PeftModel.from_pretrained
        loads them), else the trainable parameters of a model with frozen ones, by PyTorch name.
        Returns the safetensors path."""
        return operation("save_adapters")(self, folder, overwrite=overwrite)


def _check_batch_size(batch_size: Any, allow_none: bool = False) -> None:
    """A ConfigError for a batch_size that is not a whole number >= 1."""
    if batch_size is None and allow_none:
        return
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ConfigError(f"batch_size must be a whole number >= 1, got {batch_size!r}")


def _is_source(x: Any) -> bool:
    """Whether evaluate/predict got a data source (a DataLoader, a dataset, an iterable of batches,
    a .npy path: fit's forms) rather than arrays, tensors, a dict of inputs or an (x, y) tuple."""
    if isinstance(x, list):  # a list of batches, (x, y) pairs or dicts, as fit reads it
        return bool(x) and isinstance(x[0], (tuple, Mapping))
    return not (isinstance(x, (np.ndarray, np.generic, Mapping, tuple, int, float, bool)) or is_torch_tensor(x))


def _concatenate(parts: list) -> np.ndarray | dict[str, np.ndarray]:
    """Batches of predictions joined along the batch axis (per output for several outputs)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], dict):
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return np.concatenate(parts)
