"""TorchBackend and its executable: a compiled graph run with torch tensor operations.

Compiling a graph asks each node's lowering (`lowering.LOWERINGS`) for a torch kernel. A node
without one (an op, mode or dtype no lowering covers) runs the op's numpy reference kernel on
host copies of its inputs: correct, but a round trip through the CPU on a GPU device, so the
executable lists those ops (`fallback_ops`) and `anygrad info`/logs can say so. An op with
neither a lowering nor a reference kernel is refused by `supports`, before anything runs.

Values live as torch tensors on the device; values of dtypes torch cannot hold (uint32: the
RNG state) stay numpy arrays on the host. Every step is functional: kernels never write over
their inputs, state updates rebind the state store's tensors after the step.

With `torch_compile=True` (or ANYGRAD_TORCH_COMPILE=1), each maximal run of lowered nodes
between two fallbacks becomes one function traced by `torch.compile` (inductor, default mode).
Not CUDA graphs ("reduce-overhead"): those reuse their output buffers on the next call, and the
step's outputs are the next step's state.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError, DataError, DeviceError, ShapeError, UnsupportedOpError
from ...ir.graph import Graph, Node
from ...ir.registry import get_op
from ..base import Backend, Executable
from . import kernels_elementwise, kernels_loss, kernels_nn, kernels_optim, kernels_shape  # noqa: F401
from .convert import TORCH_DTYPES, WIDENED, is_tensor, to_numpy, to_torch, torch_dtype
from .lowering import LOWERINGS, Site


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ConfigError("the torch backend needs PyTorch: pip install 'anygrad[torch]' "
                          "(or choose device='cpu' or 'wgpu')") from e
    return torch


def resolve_device(device: str) -> str:
    """'torch' / 'torch:cuda[:N]' / 'torch:mps' / 'torch:cpu' -> a torch device string, checked."""
    torch = _torch()
    want = device.partition(":")[2] or "best"
    if want == "best":
        return best_torch_device() or "cpu"
    kind = want.split(":")[0]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device '{device}': torch sees no CUDA GPU (torch {torch.__version__}, "
                              f"CUDA build {torch.version.cuda}); use torch:cpu, wgpu or cpu")
        index = want.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise DeviceError(f"device '{device}': there are {torch.cuda.device_count()} CUDA devices "
                              f"(torch:cuda:0 to :{torch.cuda.device_count() - 1})")
        return want
    if kind == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError(f"device '{device}': torch's MPS (Apple GPU) is not available here; "
                              "use torch:cpu, wgpu or cpu")
        return "mps"
    if want == "cpu":
        return "cpu"
    raise ConfigError(f"unknown torch device '{device}'; use torch, torch:cuda, torch:cuda:N, torch:mps "
                      "or torch:cpu")


def best_torch_device() -> str | None:
    """'cuda' or 'mps' when torch has that GPU, else None (the caller decides about the CPU)."""
    torch = _torch()
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return None


# Ops that take class-index targets (slot): a target fed as a graph input is range-checked on the
# host before it is uploaded, so the kernel need not read a verdict back from the device (a sync
# per step on a GPU); a bad index would otherwise be a device-side assert there.
TARGET_SLOTS = {"CrossEntropy": 1, "NegativeLogLikelihoodLoss": 1, "SoftmaxCrossEntropyLoss": 1,
                "CrossEntropyMetrics": 1}


def node_site(graph: Graph, node: Node) -> Site:
    slot = TARGET_SLOTS.get(node.op)
    checked = frozenset({slot}) if slot is not None and node.input(slot) in graph.inputs else frozenset()
    return Site(node, [graph.info.get(i) if i else None for i in node.inputs],
                [graph.info.get(o) if o else None for o in node.outputs], checked)


def lower(site: Site) -> Callable | None:
    """The torch kernel for a node, or None: no lowering, a dtype torch cannot hold, an empty tensor,
    or the lowering declines this node's configuration."""
    fn = LOWERINGS.get(site.node.op)
    if fn is None:
        return None
    for k, info in enumerate(site.ins + site.outs):
        if info is None:
            continue
        dtype = np.dtype(info.dtype)
        # unsigned inputs up to 32 bits reach a kernel as int64 (exact); no output may be one
        held = dtype in TORCH_DTYPES or (k < len(site.ins) and dtype in WIDENED)
        if not held or not all(isinstance(d, int) for d in info.shape) or 0 in tuple(info.shape):
            return None
    return fn(site)


@dataclass
class _Step:
    node: Node
    kernel: Callable  # torch kernel (lowered) or numpy reference kernel (fallback)
    lowered: bool
    out_dtypes: list[np.dtype | None] = field(default_factory=list)
    torch_dtypes: list[Any] = field(default_factory=list)  # of the outputs, for lowered steps


@dataclass
class _Segment:
    """Consecutive lowered steps run as one function (the unit torch.compile traces)."""

    steps: list[_Step]
    reads: list[str]     # values it takes from outside
    writes: list[str]    # values later steps, the state store or the caller need
    fn: Callable | None = None


class TorchExecutable(Executable):
    def __init__(self, backend: TorchBackend, graph: Graph, torch_compile: bool = False):
        self.backend = backend
        self.graph = graph
        self.device = backend.device
        state = set(graph.state_names)
        self.consts = {k: self._const(v) for k, v in graph.initializers.items() if k not in state}
        steps: list[_Step] = []
        self.fallback_ops: list[str] = []
        self.target_checks: list[tuple[str, int, int | None, str]] = []  # (input, classes, ignore, node)
        for node in graph.nodes:
            op = get_op(node.op)
            if op is None:
                raise UnsupportedOpError(f"{node.label}: the torch backend cannot run op {node.op} "
                                         "(no torch kernel and no reference kernel)")
            site = node_site(graph, node)
            for slot in site.host_checked:
                x = graph.info[node.inputs[0]]
                self.target_checks.append((node.inputs[slot], int(x.shape[1]), node.attrs.get("ignore_index"),
                                           node.label))
            out_dtypes = [None if o is None else np.dtype(o.dtype) for o in site.outs]
            kernel = lower(site)
            if kernel is None:
                if node.op not in self.fallback_ops:
                    self.fallback_ops.append(node.op)
                steps.append(_Step(node, op.run, False, out_dtypes))
            else:
                steps.append(_Step(node, kernel, True, out_dtypes,
                                   [None if d is None else torch_dtype(d) for d in out_dtypes]))
        self.segments = self._segments(steps)
        self.torch_compile = torch_compile
        if torch_compile:
            torch = _torch()
            for seg in self.segments:
                if isinstance(seg, _Segment):
                    seg.fn = torch.compile(self._segment_fn(seg), dynamic=False)
        self.input_info = {name: graph.info[name] for name in graph.inputs}

    def _const(self, value: np.ndarray) -> Any:
        value = np.asarray(value)
        return to_torch(value, self.device) if value.dtype in TORCH_DTYPES else value

    def _segments(self, steps: list[_Step]) -> list[_Step | _Segment]:
        """Steps grouped: each maximal run of lowered steps becomes a _Segment."""
        groups: list[list[_Step]] = []
        for st in steps:
            if st.lowered and groups and groups[-1][0].lowered:
                groups[-1].append(st)
            else:
                groups.append([st])
        needed_after: list[set[str]] = []
        later = set(self.graph.outputs) | set(self.graph.state_updates)
        for g in reversed(groups):
            needed_after.append(set(later))
            for st in g:
                later.update(i for i in st.node.inputs if i)
        needed_after.reverse()
        out: list[_Step | _Segment] = []
        for g, after in zip(groups, needed_after):
            if not g[0].lowered:
                out.append(g[0])
                continue
            made, reads = set(), []
            for st in g:
                for i in st.node.inputs:
                    if i and i not in made and i not in reads:
                        reads.append(i)
                made.update(o for o in st.node.outputs if o)
            writes = [o for st in g for o in st.node.outputs if o and o in after]
            out.append(_Segment(g, reads, writes))
        return out

    @staticmethod
    def _segment_fn(seg: _Segment) -> Callable:
        def run(*values: Any) -> tuple:
            env = dict(zip(seg.reads, values))
            for st in seg.steps:
                outs = st.kernel([env[i] if i else None for i in st.node.inputs])
                for o, v, want in zip(st.node.outputs, outs, st.torch_dtypes):
                    if o:
                        env[o] = v if v.dtype == want else v.to(want)
            return tuple(env[w] for w in seg.writes)
        return run

    def _check_feed(self, name: str, value: Any) -> Any:
        inf = self.input_info[name]
        shape = tuple(value.shape)
        if shape != tuple(inf.shape):
            raise ShapeError(f"input '{name}' has shape {shape}; this executable was compiled for "
                             f"{tuple(inf.shape)}")
        dtype = np.dtype(inf.dtype)
        if dtype not in TORCH_DTYPES:
            return to_numpy(value, dtype)
        return to_torch(np.asarray(value).astype(dtype, copy=False), self.device)

    def run(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        env: dict[str, Any] = dict(self.consts)
        env.update(self.backend.state)
        for name, classes, ignore, label in self.target_checks:
            _check_targets(np.asarray(feeds[name]), classes, ignore, label)
        for name in self.graph.inputs:
            env[name] = self._check_feed(name, feeds[name])
        for seg in self.segments:
            if isinstance(seg, _Segment):
                fn = seg.fn or self._segment_fn(seg)
                values = [to_torch(env[r], self.device) for r in seg.reads]
                env.update(zip(seg.writes, fn(*values)))
            else:
                self._fallback(seg, env)
        for produced, target in self.graph.state_updates.items():
            self.backend.state[target] = self.backend.held(env[produced])
        names = fetch if fetch is not None else self.graph.outputs
        return {f: to_numpy(env[f]) for f in names}

    @staticmethod
    def _fallback(st: _Step, env: dict[str, Any]) -> None:
        """The op's numpy reference kernel on host copies of its inputs."""
        outs = st.kernel(st.node, [to_numpy(env[i]) if i else None for i in st.node.inputs])
        for o, v in zip(st.node.outputs, outs):
            if o:
                env[o] = v


def _check_targets(target: np.ndarray, classes: int, ignore: int | None, label: str) -> None:
    """ops.loss's check of class-index targets, on the host copy the caller fed."""
    bad = ((target < 0) | (target >= classes)) & (target != ignore if ignore is not None else True)
    if bad.any():
        raise DataError(f"{label}: target class index {int(target[bad].flat[0])} is outside [0, {classes}); "
                        "check the labels or the model's number of classes")


class TorchBackend(Backend):
    """A torch device (CUDA, MPS or CPU). State tensors live on it, shared by all executables."""

    name = "torch"

    def __init__(self, device: str = "torch", torch_compile: bool | None = None):
        """`device`: torch, torch:cuda[:N], torch:mps or torch:cpu (torch: CUDA, else MPS, else CPU).
        `torch_compile`: trace the step with torch.compile; None: ANYGRAD_TORCH_COMPILE=1."""
        self.torch = _torch()
        self.device = self.torch.device(resolve_device(device))
        if torch_compile is None:
            torch_compile = os.environ.get("ANYGRAD_TORCH_COMPILE", "0") not in ("", "0")
        self.torch_compile = bool(torch_compile)
        self.state: dict[str, Any] = {}
        self.name = f"torch:{self.device.type}"

    @property
    def description(self) -> str:
        what = self.device.type
        if self.device.type == "cuda":
            what = f"cuda: {self.torch.cuda.get_device_name(self.device)}"
        compiled = ", torch.compile" if self.torch_compile else ""
        return f"torch {self.torch.__version__} ({what}{compiled})"

    def supports(self, op: str | Node) -> bool:
        """Every registered op: a torch kernel, else the numpy reference kernel on the host."""
        return get_op(op.op if isinstance(op, Node) else op) is not None

    def lowered(self, op: str | Node) -> bool:
        """Whether an op has a torch kernel (some node configurations may still fall back)."""
        return (op.op if isinstance(op, Node) else op) in LOWERINGS

    def compile(self, graph: Graph) -> TorchExecutable:
        for name in graph.state_names:
            if name not in self.state and name in graph.initializers:
                self.set_state(name, graph.initializers[name])
        return TorchExecutable(self, graph, torch_compile=self.torch_compile)

    def get_state(self, name: str) -> np.ndarray:
        return np.array(to_numpy(self.state[name]))

    def held(self, value: Any) -> Any:
        """How the store holds a value: a tensor on the device, or a host array for dtypes torch lacks."""
        if is_tensor(value) or np.asarray(value).dtype not in TORCH_DTYPES:
            return value
        return to_torch(value, self.device)

    def set_state(self, name: str, value: np.ndarray) -> None:
        self.state[name] = self.held(np.array(value))

    def has_state(self, name: str) -> bool:
        return name in self.state
