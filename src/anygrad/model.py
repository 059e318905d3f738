"""The trainable model users hold: an imported Graph, its state, and compiled programs per shape."""
from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .backends.base import Backend, Executable
from .errors import ConfigError
from .ir.graph import Graph
from .ir.passes import RNG_STATE
from .losses import Loss, get_loss
from .optim.base import LR_STATE, Optimizer
from .program import (
    CORRECT_SUM,
    LOSS_SUM,
    METRIC_STATE,
    SAMPLE_COUNT,
    TARGET,
    TOPK_SUM,
    build_eval_step,
    build_inference,
    build_train_step,
    top_k_for,
    training_forward,
)


def match_names(aliases: Mapping[str, Iterable[str]], patterns: Iterable[str], what: str) -> list[str]:
    """The keys of `aliases` one of whose names matches one of the fnmatch `patterns`, in the
    order of `aliases`. A pattern matching nothing is a ConfigError naming a few close names."""
    matched: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{what}: patterns are non-empty strings such as 'conv1.*', got {pattern!r}")
        hits = {key for key, names in aliases.items() if any(fnmatch.fnmatchcase(n, pattern) for n in names)}
        if not hits:
            every = sorted({n for names in aliases.values() for n in names})
            close = difflib.get_close_matches(pattern.replace("*", "").replace("?", ""), every, n=5, cutoff=0.3)
            raise ConfigError(f"{what}: '{pattern}' matches no parameter; "
                              + (f"close names: {', '.join(close or every[:5])}" if every else "there are none")
                              + " (fnmatch globs over graph and PyTorch names, e.g. 'conv1.*')")
        matched |= hits
    return [key for key in aliases if key in matched]


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


class Model:
    """A model imported from ONNX (or built with anygrad.nn), trainable on any backend."""

    def __init__(self, graph: Graph, source: str = "model"):
        self.graph = graph
        self.source = source
        self.origin = None  # what the frontend learnt about the file (anygrad.frontends.OnnxOrigin)
        self.torch_binding = None  # PyTorch names learnt by load_state_dict (frontends.torch_weights)
        self.loss: Loss | None = None
        self.optimizer: Optimizer | None = None
        self.backend: Backend | None = None
        self.seed = 0
        self._programs: dict[tuple, Executable] = {}
        self.clip_norm: float | None = None  # gradient clipping by global norm, inside the step
        self.accumulate = 1                  # micro-batches per optimizer update
        self.micro_step = 0                  # micro-batches accumulated since the last update
        self.frozen: list[str] = []          # parameters freeze() made buffers (graph names)
        self._state_order: list[str] | None = None  # the parameters' order before the first freeze

    # -- introspection --------------------------------------------------------------------
    @property
    def input_name(self) -> str:
        return self.graph.inputs[0]

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

    # -- setup ----------------------------------------------------------------------------
    def compile(self, loss: str | Loss = "cross_entropy", optimizer: Optimizer | None = None,
                device: str | Backend = "cpu", seed: int = 0, *, clip_norm: float | None = None,
                accumulate: int = 1, limits: str | None = None, memory_budget: int | str | None = None,
                **loss_options: Any) -> Model:
        from .devices import get_backend
        self.loss = get_loss(loss, **loss_options) if isinstance(loss, str) else loss
        if optimizer is None:
            from .optim import SGD
            optimizer = SGD(lr=0.01)
        self.optimizer = optimizer
        state = self.state_dict() if self.backend is not None else None
        self.backend = (device if isinstance(device, Backend)
                        else get_backend(device, limits=limits, memory_budget=memory_budget))
        self.seed = seed
        self._programs.clear()
        for name in self.graph.state_names:
            value = state[name] if state and name in state else self.graph.initializers[name]
            self.backend.set_state(name, value)
        self.backend.set_state(RNG_STATE, np.array([seed & 0xFFFFFFFF, 0], np.uint32))
        self.configure_step(clip_norm=clip_norm, accumulate=accumulate)
        return self

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
        info = self.graph.info.get(self.graph.outputs[0])
        return None if info is None else top_k_for(info, True)

    def _supports(self, op: str) -> bool:
        supports = getattr(self.backend, "supports", None)
        if supports is not None:
            return bool(supports(op))
        if self.backend is None or self.backend.name == "cpu":
            return True
        try:  # the wgpu backend: an op it has a lowering for
            from .backends.wgpu.kernel import LOWERINGS
        except ImportError:
            return False
        return op in LOWERINGS

    def _require_compiled(self) -> Backend:
        if self.backend is None or self.loss is None:
            raise ConfigError("call model.compile(loss=..., optimizer=..., device=...) first")
        return self.backend

    def _program(self, kind: str, batch_shape: tuple, target_shape: tuple | None = None,
                 phase: str = "step") -> Executable:
        key = (kind, batch_shape, target_shape, phase)
        if key not in self._programs:
            backend = self._require_compiled()
            shapes = {self.input_name: batch_shape}
            if kind == "train":
                graph = build_train_step(self.graph, shapes, target_shape, self.loss, self.optimizer,
                                         clip_norm=self.clip_norm, accumulate=self.accumulate, phase=phase,
                                         top_k=self.top_k)
            elif kind == "eval":
                graph = build_eval_step(self.graph, shapes, target_shape, self.loss, top_k=self.top_k)
            else:
                graph = build_inference(self.graph, shapes)
            self._programs[key] = backend.compile(graph)
        return self._programs[key]

    def check_training_shape(self, batch_shape: tuple) -> None:
        """Raise the ShapeError a training step for this input shape would raise, without building it."""
        training_forward(self.graph, {self.input_name: tuple(batch_shape)})

    def _feeds(self, x: np.ndarray, y: np.ndarray | None = None) -> dict[str, np.ndarray]:
        feeds = {self.input_name: np.asarray(x)}
        if y is not None:
            feeds[TARGET] = self.loss.targets(y) if self.loss is not None else np.asarray(y)
        return feeds

    # -- training and inference ----------------------------------------------------------
    def _next_phase(self, flush: bool) -> str:
        """Which step program this micro-batch runs (see program.PHASES); advances micro_step."""
        if self.accumulate == 1:
            return "step"
        phase = "first" if self.micro_step == 0 else "accumulate"
        self.micro_step += 1
        if flush or self.micro_step == self.accumulate:
            phase = "step" if self.micro_step == 1 else "apply"
            self.micro_step = 0
        return phase

    def _train_program(self, x: np.ndarray, y: np.ndarray, flush: bool) -> Executable:
        phase = self._next_phase(flush)  # a lone flushed micro-batch: "step", its loss still scaled by 1/N
        return self._program("train", tuple(np.shape(x)), tuple(np.shape(y)), phase)

    def train_step(self, x: np.ndarray, y: np.ndarray, flush: bool = False) -> None:
        """One optimizer step (with accumulation: one micro-batch, the update every `accumulate`
        calls or now when `flush`); no readback (metric sums accumulate on the device)."""
        self._train_program(x, y, flush).run(self._feeds(x, y), fetch=[])

    def train_on_batch(self, x: np.ndarray, y: np.ndarray, flush: bool = False) -> float:
        """One optimizer step; returns the batch loss (before the update)."""
        exe = self._train_program(x, y, flush)
        out = exe.run(self._feeds(x, y), fetch=[exe.graph.outputs[0]])
        return float(out[exe.graph.outputs[0]])

    def eval_step(self, x: np.ndarray, y: np.ndarray) -> None:
        """Accumulate validation loss/accuracy sums for one batch, in inference mode."""
        self._program("eval", tuple(np.shape(x)), tuple(np.shape(y))).run(self._feeds(x, y), fetch=[])

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Model output in inference mode. An uncompiled model predicts on the CPU, like a
        freshly built PyTorch module: inference needs no loss or optimizer."""
        if self.backend is None:
            self.compile(device="cpu")
        exe = self._program("predict", tuple(np.shape(x)))
        return exe.run(self._feeds(x))[exe.graph.outputs[0]]

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 1000) -> dict[str, float]:
        """Mean loss and accuracy over (x, y) in inference mode."""
        self.reset_metrics()
        for i in range(0, len(x), batch_size):
            self.eval_step(x[i:i + batch_size], y[i:i + batch_size])
        return self.read_metrics(reset=True)

    # -- metrics (device-side sums) --------------------------------------------------------
    def reset_metrics(self) -> None:
        backend = self._require_compiled()
        for name in METRIC_STATE:
            backend.set_state(name, np.zeros((), np.float32))

    def read_metrics(self, reset: bool = False) -> dict[str, float]:
        backend = self._require_compiled()
        n = float(backend.get_state(SAMPLE_COUNT)) if backend.has_state(SAMPLE_COUNT) else 0.0
        out = {"count": n}
        if n:
            out["loss"] = float(backend.get_state(LOSS_SUM)) / n
            if self.loss.classification:
                out["accuracy"] = float(backend.get_state(CORRECT_SUM)) / n
            if self.top_k is not None and backend.has_state(TOPK_SUM):
                out[f"top{self.top_k}"] = float(backend.get_state(TOPK_SUM)) / n
        if reset:
            self.reset_metrics()
        return out

    # -- state ------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The rate the next update uses. The host copy, which the setter and load_full_state keep
        equal to the device's LR_STATE: reading that would cost a readback per call (per step)."""
        self._require_compiled()
        return float(self.optimizer.lr)

    @lr.setter
    def lr(self, value: float) -> None:
        self._require_compiled().set_state(LR_STATE, np.array(value, np.float32))
        self.optimizer.lr = float(value)

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
        names = set(self.graph.state_names) | {RNG_STATE}
        for exe in self._programs.values():
            names.update(exe.graph.state_names)
        names.update(METRIC_STATE)
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
        if LR_STATE in state and np.float32(self.optimizer.lr) != np.float32(state[LR_STATE]):
            self.optimizer.lr = float(state[LR_STATE])  # else keep the host's exact value (0.002, not its float32)

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
            **settings: Any):
        """Train for `epochs` with validation, metrics, early stopping, clipping, accumulation,
        schedulers, checkpoints (see anygrad.train.TrainConfig for every setting)."""
        from .train import fit
        return fit(self, train, valid, **settings)

    # -- PyTorch interop (anygrad.frontends.torch_weights) ---------------------------------------
    def load_state_dict(self, state_dict: Any, strict: bool = True, key: str | None = None) -> Any:
        """Load PyTorch weights: a state_dict (numpy arrays or torch tensors) or a .pt/.pth,
        .safetensors or .npz path; `key` picks the entry of a checkpoint dict. Returns a LoadResult;
        with strict=True any missing, unexpected or mis-shaped key raises (all listed)."""
        from .frontends.torch_weights import load_state_dict
        return load_state_dict(self, state_dict, strict=strict, key=key)

    def to_torch_state_dict(self, as_numpy: bool = False) -> dict[str, Any]:
        """The state under PyTorch names, ready for `module.load_state_dict` (torch tensors, which
        needs torch; numpy arrays with as_numpy=True)."""
        from .frontends.torch_weights import to_torch_state_dict
        state = to_torch_state_dict(self)
        if as_numpy:
            return state
        from .frontends.from_torch import to_torch_tensors
        return to_torch_tensors(state)

    def save_safetensors(self, path: Any) -> Any:
        """Write the state with PyTorch names to a .safetensors file; returns its Path."""
        from .frontends.torch_weights import save_safetensors
        return save_safetensors(self, path)
