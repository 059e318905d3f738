"""The trainable model users hold: an imported Graph, its state, and compiled programs per shape."""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .backends.base import Backend, Executable
from .batch import Batch, check_batch_sizes, parse_inputs, structure, take, to_numpy
from .errors import ConfigError, DataError
from .facade import operation
from .ir.graph import Graph
from .ir.passes import RNG_STATE
from .losses import LOSSES, Loss, get_loss
from .optim.base import Optimizer
from .optim.groups import ResolvedGroup, match_names, resolve_groups
from .optim.schedulers import GroupSchedule
from .program import (
    METRIC_PREFIX,
    METRIC_STATE,
    SAMPLE_COUNT,
    TARGET,
    TARGET_PREFIX,
    Head,
    MetricSpec,
    build_eval_step,
    build_inference,
    build_train_step,
    build_update_step,
    top_k_for,
    training_forward,
)
from .strategy import SingleDevice, TrainStrategy, for_devices


def _identities_of(graph: Graph, name: str) -> set[str]:
    """Values that are `name` passed through Identity nodes (how exporters spell a tied tensor)."""
    same, grown = {name}, True
    while grown:
        grown = False
        for n in graph.nodes:
            if n.op == "Identity" and n.inputs[0] in same and n.outputs[0] not in same:
                same.add(n.outputs[0])
                grown = True
    return same - {name}


def _is_float_scalar(info: Any) -> bool:
    """Whether a graph value's declared info is one float number (shape () or all ones)."""
    shape = getattr(info, "shape", None)
    if shape is None or not all(isinstance(d, (int, np.integer)) and d == 1 for d in shape):
        return False
    return np.issubdtype(np.dtype(info.dtype), np.floating)


def _claim(backend: Backend, model: Any) -> None:
    """Bind `backend` to `model`, refusing a backend object another live Model trains on: a
    backend keeps state by name and initialises only what it lacks, so a second model with the
    same parameter names would start from the first one's optimizer state (momentum, step count)
    and overwrite its weights on the device, silently."""
    owner = getattr(backend, "_anygrad_owner", None)
    other = owner() if owner is not None else None
    if other is model:
        return
    if other is not None:
        raise ConfigError(f"device {backend.name!r}: this backend object already holds another Model's training "
                          "state; give each model its own (device='wgpu' opens one), or compile on it "
                          "once the other model is gone")
    if owner is not None:  # a model that is gone: its state must not seed this one's
        backend.release()
    backend._anygrad_owner = weakref.ref(model)


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
        known: dict[str, Any] = dict(getattr(self.origin, "torch_names", None) or {})
        known.update(getattr(self.torch_binding, "names", None) or {})
        trainable = set(self.graph.params + self.frozen)
        aliases = {n: {n} | ({known[n].key} if n in known else set())
                   for n in self._state_as_imported() if n in trainable}
        tied = getattr(self.torch_binding, "aliases", None) or {}  # key -> key of the same tensor
        for names in aliases.values():
            names |= {k for k, same in tied.items() if same in names}
        return aliases

    def freeze(self, *patterns: str) -> list[str]:
        """Stop training the parameters that match any of `patterns`, like requires_grad_(False):
        fnmatch globs over graph names and PyTorch state_dict names ('conv1.*', 'layer1.*.weight',
        'fc.bias'). Frozen tensors stay in the state, checkpoints and exports, and training leaves
        them unchanged. Returns the graph names the patterns matched (all frozen now); a pattern
        matching no parameter is a ConfigError. Compiled step programs are rebuilt on next use."""
        names = match_names(self.parameter_aliases(), patterns, "freeze")
        self._set_trainable([p for p in self.graph.params if p not in names])
        return names

    def unfreeze(self, *patterns: str) -> list[str]:
        """Make matching parameters (frozen by freeze()) trainable again; returns their graph names."""
        names = match_names(self.parameter_aliases(), patterns, "unfreeze")
        self._set_trainable(self.graph.params + [p for p in self.frozen if p in names])
        return names

    def set_padding_idx(self, name: str, index: int) -> list[str]:
        """Give the embedding table `name` (a graph or PyTorch name, or a glob) PyTorch's
        `nn.Embedding(padding_idx=index)` semantics, which an ONNX file cannot carry: lookups of
        row `index` pass no gradient back (the row keeps its values unless something else, a tied
        output layer, trains it). Marks every row lookup (Gather on axis 0) of the table; returns
        the graph names of the tables. Compiled step programs are rebuilt on next use."""
        tables = match_names(self.parameter_aliases(), [name], "padding_idx")
        marked = []
        for table in tables:
            rows = int(self.graph.initializers[table].shape[0])
            if not isinstance(index, (int, np.integer)) or not -rows <= index < rows:
                raise ConfigError(f"padding_idx for '{name}': {index!r} is not a row of its {rows} embeddings")
            reads = {table} | _identities_of(self.graph, table)
            lookups = [n for n in self.graph.nodes if n.op == "Gather" and n.inputs[0] in reads
                       and n.attr("axis", 0) in (0, -len(self.graph.initializers[table].shape))]
            if not lookups:
                raise ConfigError(f"padding_idx for '{name}': the graph never looks up rows of '{table}' "
                                  "(no Gather on axis 0 reads it), so it is not an embedding table")
            for n in lookups:
                n.attrs["padding_idx"] = int(index) % rows
            marked.append(table)
        self._programs.clear()
        return marked

    def _state_as_imported(self) -> list[str]:
        """state_names in the order they had before any freeze (frozen parameters back in place)."""
        if not self.frozen:
            return self.graph.state_names
        order = {n: i for i, n in enumerate(self._state_order or ())}
        params = sorted(self.graph.params + self.frozen, key=lambda n: order.get(n, len(order)))
        return params + [b for b in self.graph.buffers if b not in self.frozen]

    def _set_trainable(self, trainable: list[str]) -> None:
        g = self.graph
        if self._state_order is None:
            self._state_order = list(g.params)
        order = {n: i for i, n in enumerate(self._state_order)}
        keep = set(trainable)
        frozen = [p for p in g.params + self.frozen if p not in keep]
        g.params = sorted(keep, key=lambda n: order.get(n, len(order)))
        g.buffers = [b for b in g.buffers if b not in keep and b not in frozen] + frozen
        self.frozen = sorted(frozen, key=lambda n: order.get(n, len(order)))
        # Programs bake in which tensors get gradients and optimizer slots. A parameter's slots
        # stay in the backend's state while it is frozen, as torch.optim keeps them.
        self._programs.clear()
        if self.optimizer is not None:
            self._resolve_groups(keep_rates=True)

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
        from .devices import auto_backends, get_backend, use_torch_compile
        from .program import check_precision
        self.precision = check_precision(precision)
        devices = None
        self.auto_candidates = []
        if isinstance(device, str) and device.strip().lower() == "auto" and not torch_compile:
            candidates = auto_backends(limits=limits, memory_budget=memory_budget, precision=self.precision)
            device = candidates[0]
            self.auto_candidates = candidates if len(candidates) > 1 else []
        if isinstance(device, (list, tuple)) or (isinstance(device, str) and "," in device):
            from .devices import device_list, open_backends
            devices = open_backends(device_list(device) or list(device if isinstance(device, (list, tuple))
                                                                else [device]), limits, memory_budget)
            device = devices[0]
        self.heads = self._heads(loss, loss_weights, loss_options, loss_output)
        self.loss = self.heads[0].loss
        self._metric_specs = {}
        if optimizer is None:
            from .optim import SGD
            optimizer = SGD(lr=0.01)
        self.optimizer = optimizer
        self._resolve_groups(keep_rates=False)
        state = self.state_dict() if self.backend is not None else None
        backend = (device if isinstance(device, Backend)
                   else get_backend(device, limits=limits, memory_budget=memory_budget,
                                    precision=self.precision))
        for each in devices or [backend]:
            _claim(each, self)
            use_torch_compile(each, torch_compile)
        self.backend = backend
        for each in devices or [backend]:  # every device runs f16, or (one lacks it) every device f32
            if self.precision == "f16":
                self.precision = each.check_precision(self.precision)
        self.seed = seed
        self._programs.clear()
        for name in self.graph.state_names:
            value = state[name] if state and name in state else self.graph.initializers[name]
            self.backend.set_state(name, value)
        self.backend.set_state(RNG_STATE, np.array([seed & 0xFFFFFFFF, 0], np.uint32))
        for group, lr in zip(self.param_groups, self._group_lrs):  # this optimizer's rates, not a former one's
            self.backend.set_state(group.lr_state, np.array(lr, np.float32))
        self.configure_step(clip_norm=clip_norm, accumulate=accumulate)
        self.scheduler = None
        if scheduler is not None:
            self.set_scheduler(scheduler, scheduler_interval)
        elif scheduler_interval is not None:
            raise ConfigError(f"scheduler_interval={scheduler_interval!r} without a scheduler; "
                              "pass scheduler= too")
        self.devices = list(devices or [backend])
        self.strategy = for_devices(self, self.devices)  # several: DataParallel (anygrad.distributed)
        return self

    def _heads(self, loss: Any, weights: Mapping[str, float] | None, options: dict[str, Any],
               loss_output: str | None = None) -> list[Head]:
        """compile's loss/loss_weights/options as Heads (see compile)."""
        outputs = list(self.graph.outputs)
        if loss_output is not None and not (isinstance(loss, str) and loss.split(":")[0] == "output"):
            raise ConfigError(f"loss_output={loss_output!r} chooses the output of loss='output' (a model "
                              f"that returns its own loss), not of loss={loss!r}")
        if isinstance(loss, Mapping):
            if not loss:
                raise ConfigError(f"loss: an empty dict; name a loss per output, e.g. {{'{outputs[0]}': 'cross_entropy'}}")
            unknown = [k for k in loss if k not in outputs]
            if unknown:
                raise ConfigError(f"loss: the model has no output named {unknown[0]!r}; its outputs are {outputs}")
            if any(v == "output" for v in loss.values()):
                raise ConfigError("loss='output' trains the whole model on its own loss: pass it alone, not per output")
            used = set()
            chosen = {}
            for out in outputs:  # graph order: the first head's metrics keep the plain names
                if out in loss:
                    chosen[out] = self._one_loss(loss[out], options, used)
            left = set(options) - used
            if left:
                raise ConfigError(f"loss options {sorted(left)} are taken by none of the losses {dict(loss)}")
        else:
            one = self._one_loss(loss, options, None)
            chosen = {self._own_loss_output(one, loss_output) if not one.needs_target else outputs[0]: one}
        weights = dict(weights or {})
        unknown = [k for k in weights if k not in chosen]
        if unknown:
            raise ConfigError(f"loss_weights: {unknown[0]!r} is not an output with a loss (those are {list(chosen)})")
        heads = []
        for i, (out, lo) in enumerate(chosen.items()):
            w = weights.get(out, 1.0)
            if isinstance(w, bool) or not isinstance(w, (int, float, np.number)) or not np.isfinite(w):
                raise ConfigError(f"loss_weights['{out}'] must be a finite number, got {w!r}")
            heads.append(Head(out, lo, float(w), TARGET if i == 0 else TARGET_PREFIX + out))
        if not heads[0].loss.needs_target and weights:
            raise ConfigError("loss_weights do not apply to loss='output' (the model computes its own loss)")
        return heads

    def _own_loss_output(self, loss: Loss, requested: str | None) -> str:
        """Which output loss='output' minimises: the one named (loss='output:NAME' or
        loss_output=NAME); else the first output when it is a float scalar (a forward returning
        the loss first, as loss='output' always took); else the model's only scalar float
        output, wherever it stands (a forward returning (logits, loss)); several such scalars
        must be chosen between."""
        outputs, named = list(self.graph.outputs), loss.options.get("output")
        if requested is not None and named is not None and requested != named:
            raise ConfigError(f"loss='output:{named}' and loss_output={requested!r} name different outputs; "
                              "give one")
        requested = requested if requested is not None else named
        if requested is not None:
            if not isinstance(requested, str) or requested not in outputs:
                raise ConfigError(f"loss_output: the model has no output named {requested!r}; its outputs "
                                  f"are {outputs}")
            return requested
        scalars = [o for o in outputs if _is_float_scalar(self.graph.info.get(o))]
        if scalars and scalars[0] == outputs[0]:  # the loss first: the convention loss='output' always took
            return outputs[0]
        if len(scalars) > 1:
            first = scalars[0]
            raise ConfigError(f"loss='output': the model has several scalar float outputs "
                              f"({', '.join(scalars)}); choose the loss with loss='output:{first}' or "
                              f"loss_output='{first}' (CLI: --loss output:{first}); the others are reported "
                              "as metrics")
        return scalars[0] if scalars else outputs[0]  # none: the step's check names the first output's shape

    @staticmethod
    def _one_loss(loss: Any, options: dict[str, Any], used: set | None) -> Loss:
        """A Loss from a name (with the options it takes) or a Loss. `used`: collect the option
        names taken, for a dict of losses (each takes the options it knows); None: all must fit."""
        if isinstance(loss, Loss):
            if options and used is None:
                raise ConfigError(f"loss options {sorted(options)} go with a loss name, not a Loss object")
            return loss
        if used is None or not isinstance(loss, str) or loss not in LOSSES:
            return get_loss(loss, **options)
        import inspect
        takes = set(inspect.signature(LOSSES[loss]).parameters)
        mine = {k: v for k, v in options.items() if k in takes}
        used.update(mine)
        return get_loss(loss, **mine)

    def configure_step(self, clip_norm: float | None = None, accumulate: int = 1) -> Model:
        """Gradient clipping (max global 2-norm, like torch.nn.utils.clip_grad_norm_) and gradient
        accumulation (one optimizer update every `accumulate` train_step calls, loss scaled by
        1/accumulate). Both are compiled into the step programs, which are rebuilt."""
        if clip_norm is not None and not (float(clip_norm) > 0 and np.isfinite(clip_norm)):
            raise ConfigError(f"clip-grad-norm must be a positive number, got {clip_norm}")
        if int(accumulate) != accumulate or accumulate < 1:
            raise ConfigError(f"accumulate must be a whole number of batches >= 1, got {accumulate}")
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.accumulate = int(accumulate)
        self.micro_step = 0
        self._programs = {k: v for k, v in self._programs.items() if k[0] != "train"}
        return self

    @property
    def top_k(self) -> int | None:
        """k of the top-k accuracy the programs count (None: not a >5-class classifier, or the
        device has no kernel for it)."""
        if self.loss is None or not self.loss.classification or not self._supports("CountTopK"):
            return None
        info = self.graph.info.get(self.heads[0].output if self.heads else self.graph.outputs[0])
        if info is None or info.shape is None or len(info.shape) != 2:  # per-sample classes only
            return None
        return top_k_for(info, True)

    def _supports(self, op: str) -> bool:
        """Whether the compiled backend runs `op` (each backend answers for itself)."""
        return self.backend is None or bool(self.backend.supports(op))

    def require_compiled(self) -> Backend:
        """The backend training runs on; a ConfigError before compile()."""
        if self.backend is None or self.loss is None:
            raise ConfigError("call model.compile(loss=..., optimizer=..., device=...) first")
        return self.backend

    _require_compiled = require_compiled  # (the name this module's methods use)

    def _program(self, kind: str, inputs: Batch, targets: Batch | None = None, phase: str = "step") -> Executable:
        shapes = {n: tuple(v.shape) for n, v in inputs.items()}
        target_shapes = {n: tuple(v.shape) for n, v in (targets or {}).items()}
        # (kind, first input's shape, first target's shape, phase, every shape): the first four as
        # they were when models had one input and one target
        first_target = next(iter(target_shapes.values()), None)
        key = (kind, next(iter(shapes.values())), first_target, phase,
               tuple(shapes.items()) + tuple(target_shapes.items()))
        if key not in self._programs:
            backend = self._require_compiled()
            report: dict[str, MetricSpec] = {}
            if kind == "train":
                graph = build_train_step(self.graph, shapes, target_shapes, self.heads, self.optimizer,
                                         clip_norm=self.clip_norm, accumulate=self.accumulate, phase=phase,
                                         top_k=self.top_k, report=report, sync_batchnorm=self.sync_batchnorm,
                                         precision=self.precision, groups=self.param_groups)
            # Evaluation and prediction run in float32 even for f16 training: no backward to fit, and
            # BatchNorm's running statistics lag the weights early in training, so inference-mode
            # activations can pass float16's 65504 where the training step's do not.
            elif kind == "eval":
                graph = build_eval_step(self.graph, shapes, target_shapes, self.heads, top_k=self.top_k,
                                        report=report)
            else:
                graph = build_inference(self.graph, shapes)
            self._programs[key] = backend.compile(graph)
            self._metric_specs.update(report)
        return self._programs[key]

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
        heads = [h for h in self.heads if h.loss.needs_target]
        if not self.heads:
            raise ConfigError("call model.compile(loss=..., optimizer=..., device=...) first")
        if not heads:
            if y is not None:
                raise ConfigError("loss='output' takes no targets: the model computes its own loss; pass labels "
                                  f"as model inputs (its inputs are {self.input_names})")
            return {}
        if y is None:
            names = [h.output for h in heads]
            raise ConfigError(f"loss '{heads[0].loss.name}' needs targets: train_on_batch(inputs, targets)"
                              + (f" with targets by output name {names}" if len(names) > 1 else "")
                              + "; a model that computes its own loss compiles with loss='output'")
        raw = structure(y, [h.output for h in heads], "target")
        out = {}
        for h in heads:
            what = f"targets of output '{h.output}'" if len(heads) > 1 else "targets"
            value = to_numpy(raw[h.output], what)
            try:
                out[h.target] = h.loss.targets(value)
            except DataError as e:
                if len(heads) == 1:
                    raise
                raise DataError(f"{what}: {e}") from None
        if len(heads) > 1:
            # Targets are not checked against the inputs: a model may return flattened (batch *
            # tokens, vocab) logits, as nanoGPT does, for (batch * tokens,) targets, and a file's
            # declared output shapes may call that axis 'batch' too; the loss's shape rule checks
            # each target against its output when the step is built.
            check_batch_sizes({f"target of '{h.output}'": out[h.target] for h in heads}, "target")
        return out

    def _lead(self, name: str) -> Any:
        """The declared first dimension of graph value `name` (a symbol such as 'batch', or a size)."""
        info = self.graph.info.get(name)
        return info.shape[0] if info is not None and info.shape else None

    def _batch(self, x: Any, y: Any, need_targets: bool = True) -> tuple[Batch, Batch]:
        inputs = self.parse_inputs(x)
        return inputs, self.parse_targets(y, inputs) if need_targets or y is not None else {}

    # -- training and inference ----------------------------------------------------------
    def next_phase(self, flush: bool) -> str:
        """Which step program this micro-batch runs (see program.PHASES); advances micro_step.
        A strategy calls it once per micro-batch (`flush`: this one ends the accumulation)."""
        if self.accumulate == 1:
            return "step"
        phase = "first" if self.micro_step == 0 else "accumulate"
        self.micro_step += 1
        if flush or self.micro_step == self.accumulate:
            phase = "step" if self.micro_step == 1 else "apply"
            self.micro_step = 0
        return phase

    def train_program(self, inputs: Batch, targets: Batch, phase: str = "step") -> Executable:
        """The compiled training step for these parsed inputs and targets (their shapes) and `phase`
        (program.PHASES: "step" updates; "first"/"accumulate" only sum the gradients into the
        accum.<param> buffers, which is what a data-parallel strategy runs before its exchange).
        With device='auto' still choosing, the first call times the candidates."""
        if self.auto_candidates:
            self._choose_backend(inputs, targets)
        return self._program("train", inputs, targets, phase)

    def update_program(self) -> Executable:
        """The optimizer update alone (program.build_update_step), from the gradients in the
        accum.<param> buffers: what every replica runs after a data-parallel exchange."""
        g = self.graph
        key = ("update", tuple(g.params), self.clip_norm, id(self.optimizer), self.precision)
        if key not in self._programs:
            report: dict[str, MetricSpec] = {}  # f16: the skipped updates (counted by every replica alike)
            self._programs[key] = self.require_compiled().compile(
                build_update_step(g, self.optimizer, clip_norm=self.clip_norm, precision=self.precision,
                                  report=report, groups=self.param_groups))
            self._metric_specs.update(report)
        return self._programs[key]

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
        state = source.full_state()
        for name in source.graph.state_names:
            state.setdefault(name, source.graph.initializers[name])
        for name, value in state.items():
            self.backend.set_state(name, value)
        self.optimizer.lr = source.optimizer.lr
        self._group_lrs = source.group_lrs

    def _choose_backend(self, inputs: Batch, targets: Batch) -> None:
        """device='auto' with a wgpu GPU and torch's CUDA/MPS (devices.auto_backends): time this
        model's training step at this batch on each, keep the faster, say so, and release the
        others' memory. The timed steps train: every candidate starts from, and the winner goes
        on from, the state as it was before them. A candidate that cannot compile or run the
        step (an op it lacks, its memory) is left out, and said so; if none can, the first
        one's error is raised."""
        import sys
        candidates, self.auto_candidates = self.auto_candidates, []
        times: dict[int, float] = {}
        failed: dict[int, Exception] = {}
        before: dict[str, np.ndarray] | None = None
        for i, backend in enumerate(candidates):
            try:
                if backend is not self.backend:
                    self._use_backend(backend, before if before is not None else self.full_state())
                self._program("train", inputs, targets)  # its optimizer slots: loaded, or fresh
                before = before if before is not None else self.full_state()
                times[i] = self._time_step(inputs, targets)
            except Exception as e:  # noqa: BLE001  (any failure of one candidate: try the others)
                failed[i] = e
        if not times:
            raise failed[0]
        best = min(times, key=times.get)
        self._use_backend(candidates[best], before)
        for i, backend in enumerate(candidates):
            if i != best:
                backend.release()
        self.backend_trial = {candidates[i].description: ms for i, ms in times.items()}
        timed = ", ".join(f"{name} {ms:.2f} ms/step" for name, ms in self.backend_trial.items())
        skipped = "".join(f"; {candidates[i].description} left out ({type(e).__name__}: {e})"
                          for i, e in failed.items())
        print(f"anygrad: device auto: {timed}{skipped}; training on {self.backend.description}", file=sys.stderr)

    def _time_step(self, inputs: Batch, targets: Batch, warmup: int = 3, seconds: float = 1.0,
                   most: int = 10) -> float:
        """ms per training step on the current backend: after `warmup` steps (which compile it
        and capture torch's CUDA graph), up to `most` steps or `seconds`."""
        import time
        exe, feeds = self._program("train", inputs, targets), {**inputs, **targets}
        for _ in range(warmup):
            exe.run(feeds, fetch=[])
        # reading the metric sums, which every step adds to on the device, waits for the queued
        # steps (the RNG counter would not: torch keeps it on the host)
        self.read_metric_sums()
        steps, t0 = 0, time.perf_counter()
        while steps < most and (steps == 0 or time.perf_counter() - t0 < seconds):
            exe.run(feeds, fetch=[])
            steps += 1
        self.read_metric_sums()
        return 1e3 * (time.perf_counter() - t0) / steps

    def _use_backend(self, backend: Backend, state: dict[str, np.ndarray]) -> None:
        """Train on `backend` from `state` (a full_state()); programs compile anew."""
        _claim(backend, self)
        self.backend, self.devices = backend, [backend]
        self._programs.clear()
        for name, value in state.items():
            backend.set_state(name, value)

    def train_step(self, x: Any, y: Any = None, flush: bool = False) -> None:
        """One optimizer step (with accumulation: one micro-batch, the update every `accumulate`
        calls or now when `flush`); no readback (metric sums accumulate on the device).
        `x`: the inputs (see parse_inputs); `y`: the targets (see parse_targets; none for
        loss='output')."""
        inputs, targets = self._batch(x, y)
        self.strategy.train_step(self, inputs, targets, flush, False)
        self._after_update()

    def train_on_batch(self, x: Any, y: Any = None, flush: bool = False) -> float:
        """One optimizer step; returns the batch loss (before the update)."""
        inputs, targets = self._batch(x, y)
        loss = self.strategy.train_step(self, inputs, targets, flush, True)
        self._after_update()
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
        self._require_compiled()
        if scheduler is None:
            self.scheduler = None
            return None
        self.scheduler = GroupSchedule.build(scheduler, self.base_lrs, interval)
        self.group_lrs = self.scheduler.lrs
        return self.scheduler

    def step_scheduler(self, metric: float | None = None) -> list[float]:
        """Advance the schedule one step (one epoch, for interval "epoch"); `metric` feeds
        ReduceLROnPlateau. Returns every group's new rate."""
        if self.scheduler is None:
            raise ConfigError("step_scheduler: this model has no schedule; compile(..., scheduler=...) first")
        self.group_lrs = self.scheduler.step(metric)
        return self.group_lrs

    def _after_update(self) -> None:
        """A per-step schedule moves after each optimizer update (not after an accumulated
        micro-batch: with accumulate=k a step is k batches, as in PyTorch)."""
        if self.scheduler is not None and self.scheduler.interval == "step" and self.micro_step == 0:
            self.group_lrs = self.scheduler.step()

    def eval_step(self, x: Any, y: Any = None) -> None:
        """Accumulate validation loss and metric sums for one batch, in inference mode."""
        inputs, targets = self._batch(x, y)
        self._program("eval", inputs, targets).run({**inputs, **targets}, fetch=[])

    def predict(self, x: Any) -> np.ndarray | dict[str, np.ndarray]:
        """Model output in inference mode: an array, or {output name: array} for a model with
        several outputs. An uncompiled model predicts on the CPU, like a freshly built PyTorch
        module: inference needs no loss or optimizer."""
        if self.backend is None:
            self.compile(device="cpu")
        inputs = self.parse_inputs(x)
        exe = self._program("predict", inputs)
        out = exe.run(inputs)
        if len(exe.graph.outputs) == 1:
            return out[exe.graph.outputs[0]]
        return {n: out[n] for n in exe.graph.outputs}

    def evaluate(self, x: Any, y: Any = None, batch_size: int = 1000) -> dict[str, float]:
        """Mean loss and the metrics (see read_metrics) over (x, y) in inference mode."""
        self._require_compiled()
        inputs, targets = self._batch(x, y)
        n = len(next(iter(inputs.values())))
        self.reset_metrics()
        for i in range(0, n, batch_size):
            part = slice(i, i + batch_size)
            self.eval_step(take(inputs, part), self._by_output(take(targets, part)) if targets else None)
        return self.read_metrics(reset=True)

    def _by_output(self, targets: Batch) -> dict[str, np.ndarray]:
        """Targets by target input -> by output name (what parse_targets takes)."""
        return {h.output: targets[h.target] for h in self.heads if h.target in targets}

    # -- metrics (device-side sums) --------------------------------------------------------
    def metric_buffers(self) -> set[str]:
        """The names of the metric sums the step programs add to on the device (read_metric_sums)."""
        names = set(METRIC_STATE)
        for spec in self._metric_specs.values():
            names.update((spec.num, spec.den))
        for exe in self._programs.values():
            names.update(n for n in exe.graph.state_names if n.startswith(METRIC_PREFIX))
        return names

    def reset_metrics(self) -> None:
        self._require_compiled()
        self.strategy.reset_metrics(self, sorted(self.metric_buffers()))

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
        count, parts = self.read_metric_sums(reset)
        out = {"count": count}
        for key, (num, den, exp) in parts.items():
            mean = num / den
            out[key] = float(np.exp(min(mean, 700.0))) if exp else mean
        return out

    def read_metric_sums(self, reset: bool = False) -> tuple[float, dict[str, tuple[float, float, bool]]]:
        """The raw sums behind read_metrics: (samples, {metric: (numerator, denominator, exp)}),
        each metric's mean being numerator / denominator (exp of it for perplexity). A trainer
        adds these up over reads, so that each metric is weighted by its own denominator (tokens,
        pixels, elements), not by samples. Metrics without a denominator yet are left out."""
        backend = self._require_compiled()
        names = sorted(n for n in self.metric_buffers() if backend.has_state(n))
        sums = self.strategy.metric_sums(self, names)  # one read of every sum, over every device trained on
        n = sums.get(SAMPLE_COUNT, 0.0)
        parts: dict[str, tuple[float, float, bool]] = {}
        if n:
            for key, spec in self._metric_specs.items():
                den = sums.get(spec.den)
                if spec.num in sums and den:
                    parts[key] = (sums[spec.num], den, spec.exp)
        if reset:
            self.reset_metrics()
        return n, parts

    # -- state ------------------------------------------------------------------------------
    def _resolve_groups(self, keep_rates: bool) -> None:
        """The optimizer's parameter groups over the trainable parameters (optim/groups.py); each
        group's rate starts at its base_lr, or (`keep_rates`, after a freeze) stays where it was."""
        g = self.graph
        before = self._group_lrs
        self.param_groups = resolve_groups(self.optimizer, g.params, {p: tuple(g.initializers[p].shape)
                                                                      for p in g.params}, self.parameter_aliases())
        self._group_lrs = [before[i] if keep_rates and i < len(before) else grp.base_lr
                           for i, grp in enumerate(self.param_groups)]

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
        self._require_compiled()
        value = float(value)
        bases = [grp.base_lr for grp in self.param_groups]
        if len(bases) == 1 or bases[0] == 0:
            self.group_lrs = [value] * len(bases)
        else:
            self.group_lrs = [b * (value / bases[0]) for b in bases]
        self._group_lrs[0] = value  # exactly what was set (the scaling may round the first)

    @property
    def group_lrs(self) -> list[float]:
        """Each parameter group's current rate, in group order (param_groups); the setter
        writes the device buffers, so a scheduler moves them per step without a recompile."""
        self._require_compiled()
        return list(self._group_lrs)

    @group_lrs.setter
    def group_lrs(self, values: Iterable[float]) -> None:
        backend = self._require_compiled()
        values = list(values)
        if len(values) != len(self.param_groups):
            raise ConfigError(f"group_lrs: {len(values)} rates for {len(self.param_groups)} parameter groups")
        for group, v in zip(self.param_groups, values):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not (np.isfinite(v) and v >= 0):
                raise ConfigError(f"group_lrs: the rate of {group.label} must be a finite number >= 0, got {v!r}")
        for group, v in zip(self.param_groups, values):
            backend.set_state(group.lr_state, np.array(v, np.float32))
        self._group_lrs = [float(v) for v in values]
        if len(values) == 1:
            self.optimizer.lr = self._group_lrs[0]  # the optimizer shows the rate, as before groups

    @property
    def base_lrs(self) -> list[float]:
        """Each group's initial rate (torch's group['initial_lr']), which schedulers scale."""
        return [grp.base_lr for grp in self.param_groups]

    def describe_groups(self) -> list[dict[str, Any]]:
        """The parameter groups as JSON: label, selector, parameters (graph names), settings."""
        from .optim.groups import describe_groups
        return describe_groups(self.param_groups)

    def lr_states(self) -> dict[str, np.ndarray]:
        """Each group's rate buffer as a checkpoint holds it (name -> float32 scalar)."""
        return {grp.lr_state: np.array(lr, np.float32) for grp, lr in zip(self.param_groups, self._group_lrs)}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and buffers (running statistics) by graph name, as host arrays."""
        if self.backend is None:
            return {n: np.array(self.graph.initializers[n]) for n in self.graph.state_names}
        return {n: self.backend.get_state(n) if self.backend.has_state(n) else np.array(self.graph.initializers[n])
                for n in self.graph.state_names}

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
        backend = self._require_compiled()
        names = set(self.graph.state_names) | {RNG_STATE} | {g.lr_state for g in self.param_groups}
        for exe in self._programs.values():
            names.update(exe.graph.state_names)
        names.update(self.metric_buffers())
        return {n: backend.get_state(n) for n in sorted(names) if backend.has_state(n)}

    def load_full_state(self, state: dict[str, np.ndarray]) -> None:
        """Write a full_state() back. Programs compiled later keep these values (a backend only
        initialises state it lacks), so this may come before or after compiling."""
        backend = self._require_compiled()
        for name in self.graph.state_names:
            if name not in state:
                raise ConfigError(f"the saved state lacks '{name}' of this model")
        for name, value in state.items():
            info = self.graph.info.get(name)
            if info is not None and name in self.graph.state_names and tuple(info.shape) != tuple(value.shape):
                raise ConfigError(f"saved '{name}' has shape {tuple(value.shape)}, the model's is {tuple(info.shape)}")
            backend.set_state(name, np.asarray(value))
        for i, group in enumerate(self.param_groups):  # else keep the host's exact value (0.002, not its float32)
            if group.lr_state in state and np.float32(self._group_lrs[i]) != np.float32(state[group.lr_state]):
                self._group_lrs[i] = float(state[group.lr_state])
        if len(self.param_groups) == 1:
            self.optimizer.lr = self._group_lrs[0]
        self.strategy.state_loaded(self)

    def fingerprint(self) -> str:
        """A hash of the graph's structure and its state names, shapes and dtypes (not values):
        equal for the same model file whatever its weights, different for another model."""
        import hashlib
        import json
        g = self.graph
        desc = {"inputs": list(g.inputs), "outputs": list(g.outputs),
                "nodes": [[n.op, list(n.inputs), list(n.outputs)] for n in g.nodes],
                "state": [[n, str(np.asarray(g.initializers[n]).dtype), list(np.shape(g.initializers[n]))]
                          for n in self._state_as_imported()]}
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]

    def fit(self, train: tuple[np.ndarray, np.ndarray], valid: tuple[np.ndarray, np.ndarray] | None = None,
            *, overwrite: bool = False, **settings: Any):
        """Train for `epochs` with validation, metrics, early stopping, clipping, accumulation,
        schedulers, checkpoints (see anygrad.train.TrainConfig for every setting). An
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
