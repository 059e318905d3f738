"""The trainable model users hold: an imported Graph, its state, and compiled programs per shape."""
from __future__ import annotations

from typing import Any

import numpy as np

from .backends.base import Backend, Executable
from .errors import ConfigError
from .ir.graph import Graph
from .ir.passes import RNG_STATE
from .losses import Loss, get_loss
from .optim.base import LR_STATE, Optimizer
from .program import CORRECT_SUM, LOSS_SUM, METRIC_STATE, SAMPLE_COUNT, TARGET, build_eval_step, build_inference, build_train_step


class Model:
    """A model imported from ONNX (or built with anygrad.nn), trainable on any backend."""

    def __init__(self, graph: Graph, source: str = "model"):
        self.graph = graph
        self.source = source
        self.origin = None  # what the frontend learnt about the file (anygrad.frontends.OnnxOrigin)
        self.loss: Loss | None = None
        self.optimizer: Optimizer | None = None
        self.backend: Backend | None = None
        self.seed = 0
        self._programs: dict[tuple, Executable] = {}

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
        return int(sum(self.graph.initializers[p].size for p in self.graph.params))

    # -- setup ----------------------------------------------------------------------------
    def compile(self, loss: str | Loss = "cross_entropy", optimizer: Optimizer | None = None,
                device: str | Backend = "cpu", seed: int = 0, **loss_options: Any) -> "Model":
        from .devices import get_backend
        self.loss = get_loss(loss, **loss_options) if isinstance(loss, str) else loss
        if optimizer is None:
            from .optim import SGD
            optimizer = SGD(lr=0.01)
        self.optimizer = optimizer
        state = self.state_dict() if self.backend is not None else None
        self.backend = device if isinstance(device, Backend) else get_backend(device)
        self.seed = seed
        self._programs.clear()
        for name in self.graph.state_names:
            value = state[name] if state and name in state else self.graph.initializers[name]
            self.backend.set_state(name, value)
        self.backend.set_state(RNG_STATE, np.array([seed & 0xFFFFFFFF, 0], np.uint32))
        return self

    def _require_compiled(self) -> Backend:
        if self.backend is None or self.loss is None:
            raise ConfigError("call model.compile(loss=..., optimizer=..., device=...) first")
        return self.backend

    def _program(self, kind: str, batch_shape: tuple, target_shape: tuple | None = None) -> Executable:
        key = (kind, batch_shape, target_shape)
        if key not in self._programs:
            backend = self._require_compiled()
            shapes = {self.input_name: batch_shape}
            if kind == "train":
                graph = build_train_step(self.graph, shapes, target_shape, self.loss, self.optimizer)
            elif kind == "eval":
                graph = build_eval_step(self.graph, shapes, target_shape, self.loss)
            else:
                graph = build_inference(self.graph, shapes)
            self._programs[key] = backend.compile(graph)
        return self._programs[key]

    def _feeds(self, x: np.ndarray, y: np.ndarray | None = None) -> dict[str, np.ndarray]:
        feeds = {self.input_name: np.asarray(x)}
        if y is not None:
            feeds[TARGET] = np.asarray(y)
        return feeds

    # -- training and inference ----------------------------------------------------------
    def train_step(self, x: np.ndarray, y: np.ndarray) -> None:
        """One optimizer step; no readback (metric sums accumulate on the device)."""
        exe = self._program("train", tuple(np.shape(x)), tuple(np.shape(y)))
        exe.run(self._feeds(x, y), fetch=[])

    def train_on_batch(self, x: np.ndarray, y: np.ndarray) -> float:
        """One optimizer step; returns the batch loss (before the update)."""
        exe = self._program("train", tuple(np.shape(x)), tuple(np.shape(y)))
        out = exe.run(self._feeds(x, y), fetch=[exe.graph.outputs[0]])
        return float(out[exe.graph.outputs[0]])

    def eval_step(self, x: np.ndarray, y: np.ndarray) -> None:
        """Accumulate validation loss/accuracy sums for one batch, in inference mode."""
        self._program("eval", tuple(np.shape(x)), tuple(np.shape(y))).run(self._feeds(x, y), fetch=[])

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Model output in inference mode."""
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
        if reset:
            self.reset_metrics()
        return out

    # -- state ------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return float(self._require_compiled().get_state(LR_STATE)) if self.backend.has_state(LR_STATE) \
            else float(self.optimizer.lr)

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
