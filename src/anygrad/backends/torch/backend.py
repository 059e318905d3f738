"""TorchBackend: the torch device (CUDA, MPS or CPU) and the state store every executable on it
shares; it compiles graphs into TorchExecutables (runtime.py) and moves values on and off the
device (pinned, asynchronous uploads on a GPU).

Separate from the executable: this is the long-lived object a Model holds (device choice,
torch.compile and CUDA-graph settings, state), while an executable is one compiled step.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ... import settings
from ...errors import ConfigError
from ...ir.graph import Graph, Node
from ...ir.passes import resolve_attributes
from ...ir.registry import get_op
from ..base import Backend
from .convert import TORCH_DTYPES, WIDENED, is_tensor, to_numpy, to_torch, torch_dtype
from .device import _torch, resolve_device
from .lowering import LOWERINGS
from .runtime import TorchExecutable


class TorchBackend(Backend):
    """A torch device (CUDA, MPS or CPU). State tensors live on it, shared by all executables."""

    name = "torch"

    def __init__(self, device: str = "torch", torch_compile: bool | str | None = None,
                 cuda_graph: bool | None = None):
        """`device`: torch, torch:cuda[:N], torch:mps or torch:cpu (torch: CUDA, else MPS, else CPU).
        `torch_compile`: trace the step with torch.compile (True: inductor; a string: that
        torch.compile backend, e.g. "aot_eager"); None: ANYGRAD_TORCH_COMPILE (1 or a backend name).
        `cuda_graph`: on CUDA, capture each step's device work as a CUDA graph on its third run and
        replay it after; None: yes, unless ANYGRAD_TORCH_CUDA_GRAPH=0."""
        self.torch = _torch()
        self.device = self.torch.device(resolve_device(device))
        if torch_compile is None:
            torch_compile = settings.get("ANYGRAD_TORCH_COMPILE")
            torch_compile = torch_compile if torch_compile not in ("0", "1") else torch_compile == "1"
        if cuda_graph is None:
            cuda_graph = settings.get("ANYGRAD_TORCH_CUDA_GRAPH")
        self.set_torch_compile(torch_compile)
        self.cuda_graph = bool(cuda_graph)
        self.state: dict[str, Any] = {}
        self.name = f"torch:{self.device.type}"

    def set_torch_compile(self, torch_compile: bool | str) -> None:
        """Whether (and with which torch.compile backend, default inductor) the executables this
        backend compiles from now on trace their steps with torch.compile."""
        backend = torch_compile if isinstance(torch_compile, str) else "inductor"
        if backend != "inductor":
            from torch._dynamo import list_backends
            known = list_backends(exclude_tags=())
            if backend not in known:
                raise ConfigError(f"torch.compile has no backend '{backend}'; use one of {', '.join(sorted(known))}")
        self.torch_compile = bool(torch_compile)
        self.compile_backend = backend

    @property
    def description(self) -> str:
        what = self.device.type
        if self.device.type == "cuda":
            what = f"cuda: {self.torch.cuda.get_device_name(self.device)}"
        compiled = ", torch.compile" if self.torch_compile else ""
        compiled += f" ({self.compile_backend})" if self.torch_compile and self.compile_backend != "inductor" else ""
        compiled += ", CUDA graphs" if self.cuda_graph and self.device.type == "cuda" else ""
        return f"torch {self.torch.__version__} ({what}{compiled})"

    def supports(self, op: str | Node) -> bool:
        """Every registered op: a torch kernel, else the numpy reference kernel on the host."""
        return get_op(op.op if isinstance(op, Node) else op) is not None

    def lowered(self, op: str | Node) -> bool:
        """Whether an op has a torch kernel (some node configurations may still fall back)."""
        return (op.op if isinstance(op, Node) else op) in LOWERINGS

    def compile(self, graph: Graph) -> TorchExecutable:
        resolve_attributes(graph)  # the lowerings read explicit attributes (ir/passes.py)
        for name in graph.state_names:
            if name not in self.state and name in graph.initializers:
                self.set_state(name, graph.initializers[name])
        return TorchExecutable(self, graph, torch_compile=self.torch_compile, cuda_graph=self.cuda_graph)

    def get_state(self, name: str) -> np.ndarray:
        return np.array(to_numpy(self.state[name]))

    def held(self, value: Any) -> Any:
        """How the store holds a value: a tensor on the device, or a host array for dtypes torch lacks."""
        if is_tensor(value) or np.asarray(value).dtype not in TORCH_DTYPES:
            return value
        return to_torch(value, self.device)

    def upload(self, value: Any) -> Any:
        """A host value (or a tensor) as a tensor on the device; dtypes torch lacks but int64 holds
        (WIDENED) become int64. To a GPU through pinned memory, asynchronously: a copy from pageable
        memory would wait for every kernel queued before it, once per step and per input."""
        if is_tensor(value):
            return value if value.device == self.device else value.to(self.device)
        if self.device.type != "cuda":
            return to_torch(value, self.device)
        arr = np.asarray(value)
        if arr.dtype in WIDENED:
            arr = arr.astype(np.int64)
        pinned = self.torch.empty(arr.shape, dtype=torch_dtype(arr.dtype), pin_memory=True)
        pinned.numpy()[...] = arr  # the caching host allocator reuses it once the copy is done
        return pinned.to(self.device, non_blocking=True)

    def set_state(self, name: str, value: np.ndarray) -> None:
        # an inference tensor, as every value a step makes (and then stores) is: torch.compile
        # guards on that difference, and would trace each compiled part a second time on step 2
        with self.torch.inference_mode():
            self.state[name] = self.held(np.array(value))

    def has_state(self, name: str) -> bool:
        return name in self.state

    def release(self) -> None:
        super().release()
        if self.device.type == "cuda":  # torch's caching allocator keeps freed blocks: give them back
            self.torch.cuda.empty_cache()
