"""The numpy backend: the reference every other backend is tested against, and a real CPU device.

A compiled graph is a flat list of (kernel, node, input names, output names) plus the step at
which each temporary dies, so running it is one loop with no per-op decisions.

Memory traffic, not arithmetic, dominates the elementwise ops of a CNN step, so a few kernels
(`lowering.INPLACE`) may write their result over their first input when that input dies at this step
and nothing else (a view, another name, the state store) still refers to its buffer.

A CNN step allocates tens of arrays of tens of MB; glibc serves each from a fresh mmap and the
kernel zeroes every page on first touch, which costs as much as the op itself. The backend
therefore asks glibc (once, on Linux) to keep large freed blocks in the heap for reuse; the
process keeps its peak memory instead of returning it. `ANYGRAD_NUMPY_MALLOC=0` opts out.

An in-place kernel whose other operands have its output's shape is also an epilogue: when its
input 0 comes from an op that writes its output in batch blocks (`lowering.BLOCKED`: Conv,
ConvGradInput, BatchNormalization, BatchNormGrad) and nothing else reads that output, the
producer applies the kernel to each block while the block is in cache, and the consumer's step
just passes the array on: one pass over memory less (a Relu after each Conv, a ReluGrad after
each ConvGradInput). Same elementwise operations, same bits.

Set `ANYGRAD_NUMPY_PROFILE=1` (or `executable.profile = {}`) to record seconds per op type.
"""
from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Mapping, Sequence

import numpy as np

from ... import _parallel, settings
from ...errors import ShapeError
from ...ir.graph import Graph, Node
from ...ir.passes import resolve_attributes
from ...ir.registry import get_op
from ...ops import collective
from ..base import Backend, HostExecutable
from .half import reads_half, run_in_float32
from .lowering import BLOCKED, INPLACE, KERNELS, InplaceKernel, run_blocked, run_split

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_malloc_tuned = False


def keep_freed_memory() -> bool:
    """Serve large arrays from glibc's heap and keep freed ones for reuse (no page faults per
    step). True when glibc accepted it; a no-op elsewhere and after the first call."""
    global _malloc_tuned
    if _malloc_tuned or not sys.platform.startswith("linux") or not settings.get("ANYGRAD_NUMPY_MALLOC"):
        return _malloc_tuned
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...)
        return False
    # Some glibc versions cap the threshold at 32 MiB; take the largest one accepted.
    for limit in (1 << 30, 1 << 25):
        if libc.mallopt(_M_MMAP_THRESHOLD, limit) == 1:
            libc.mallopt(_M_TRIM_THRESHOLD, 2 * limit)
            _malloc_tuned = True
            break
    return _malloc_tuned


def _refs(env: dict, name: str) -> int:
    value = env[name]
    return sys.getrefcount(value)


# References to an array that only `env` holds, as seen from inside `_sole_owner` (same frame
# shape as `_refs`); measured rather than assumed, so it holds on any CPython.
_SOLE_REFS = _refs({"x": np.empty(1)}, "x")


def _sole_owner(env: dict, name: str) -> bool:
    """True when env[name] owns its buffer and nothing but env refers to it (a view of it would
    hold a reference through .base; a state array is also held by the state store)."""
    value = env[name]
    return (isinstance(value, np.ndarray) and value.base is None and value.flags.writeable
            and sys.getrefcount(value) <= _SOLE_REFS)


class NumpyExecutable(HostExecutable):
    def __init__(self, backend: NumpyBackend, graph: Graph):
        self.backend = backend
        self.graph = graph
        state = set(graph.state_names)
        self.consts = {k: v for k, v in graph.initializers.items() if k not in state}
        self.plan = [(get_op(n.op), n, n.inputs, n.outputs) for n in graph.nodes]
        # AllReduceSum steps: the sum over replicas goes through the run's Exchange.reduce
        self.exchanged = {k for k, n in enumerate(graph.nodes) if n.op == collective.OP}
        keep = set(graph.outputs) | set(graph.state_updates)
        last_use: dict[str, int] = {}
        for step, n in enumerate(graph.nodes):
            for i in n.inputs:
                last_use[i] = step
        # free[step] = temporaries no later node reads (never state, constants or outputs)
        self.free: list[list[str]] = [[] for _ in graph.nodes]
        produced = {o for n in graph.nodes for o in n.outputs}
        for name, step in last_use.items():
            if name in produced and name not in keep:
                self.free[step].append(name)
        self.input_info = {name: graph.info[name] for name in graph.inputs}
        # steps reading float16 (mixed precision): computed in float32, rounded (half.py)
        self.half: dict[int, list] = {
            step: [np.dtype(graph.info[o].dtype) if o in graph.info else None for o in n.outputs]
            for step, n in enumerate(graph.nodes) if reads_half(graph, n)}
        # step -> in-place kernel, where input 0 dies there and has the output's shape and dtype
        self.inplace: dict[int, InplaceKernel] = {
            step: INPLACE[n.op] for step, n in enumerate(graph.nodes)
            if n.op in INPLACE and n.inputs and n.inputs[0] in self.free[step]
            and n.inputs.count(n.inputs[0]) == 1 and self._fits(n)}
        # producer step -> consumer step whose in-place kernel runs as the producer's epilogue
        self.epilogue: dict[int, int] = self._epilogues()
        self.passed_on = set(self.epilogue.values())
        for step in self.passed_on:
            del self.inplace[step]
        self.profile: dict[str, float] | None = {} if settings.get("ANYGRAD_NUMPY_PROFILE") else None

    def _fits(self, node: Node) -> bool:
        """Output 0 can live in input 0's buffer: same shape, and every input of the output's
        dtype (so no ufunc casts differently from the registry kernel)."""
        out = self.graph.info.get(node.outputs[0])
        ins = [self.graph.info.get(i) for i in node.inputs if i]
        return (out is not None and all(i is not None and i.dtype == out.dtype for i in ins)
                and tuple(ins[0].shape) == tuple(out.shape))

    def _epilogues(self) -> dict[int, int]:
        """Producer/consumer pairs to fuse: the consumer's in-place kernel qualifies (above), its
        input 0 is output 0 of a blocked op read by nothing else, and its other inputs have the
        same shape (so a batch slice of each lines up with the block) and exist already when the
        producer runs."""
        graph, fused = self.graph, {}
        made_at = {o: step for step, n in enumerate(graph.nodes) for o in n.outputs if o}
        readers: dict[str, int] = {}
        for n in graph.nodes:
            for i in set(n.inputs):
                readers[i] = readers.get(i, 0) + 1
        for step in self.inplace:
            node = graph.nodes[step]
            producer = made_at.get(node.inputs[0])
            if producer is None or producer in fused or producer in self.half or readers[node.inputs[0]] != 1:
                continue
            source = graph.nodes[producer]
            shape = tuple(graph.info[node.outputs[0]].shape)
            if (source.op not in BLOCKED or source.outputs[0] != node.inputs[0] or not shape
                    or any(tuple(graph.info[i].shape) != shape or made_at.get(i, -1) >= producer
                           for i in node.inputs[1:])):
                continue
            fused[producer] = step
        return fused

    def _check_feed(self, name: str, value: np.ndarray) -> np.ndarray:
        inf = self.input_info[name]
        value = np.asarray(value)
        if tuple(value.shape) != tuple(inf.shape):
            raise ShapeError(f"input '{name}' has shape {tuple(value.shape)}; this executable was "
                             f"compiled for {tuple(inf.shape)}")
        return value.astype(inf.dtype, copy=False)

    def _execute(self, step: int, op, node: Node, ins: list[str], env: dict) -> list[np.ndarray]:
        if step in self.epilogue:
            consumer = self.graph.nodes[self.epilogue[step]]
            kernel, others = INPLACE[consumer.op], [env[i] for i in consumer.inputs[1:]]
            return run_blocked(node, [env[i] for i in ins],
                               lambda s, block: kernel(consumer, [block] + [o[s] for o in others]))
        if step in self.passed_on:
            return [env[ins[0]]]  # the producer already applied this op
        if step in self.exchanged:
            return collective.reduce_forward(self._reduce, node, [env[i] for i in ins])
        kernel = self.inplace.get(step)
        if kernel is not None and _sole_owner(env, ins[0]):
            return run_split(kernel, node, [env[i] for i in ins])
        fast = KERNELS.get(node.op)
        if step in self.half:
            return run_in_float32(op, node, [env[i] for i in ins], self.half[step], fast)
        if fast is not None:
            return fast(node, [env[i] for i in ins])
        return op.run(node, [env[i] for i in ins])

    @staticmethod
    def _store(env: dict, outs: list[str], values: list[np.ndarray]) -> None:
        # A helper, so no loop variable of run() keeps an extra reference to a temporary.
        for o, v in zip(outs, values):
            if o:
                env[o] = v

    def _run(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray | None] = {"": None}
        env.update(self.consts)
        env.update(self.backend.state)
        for name in self.graph.inputs:
            env[name] = self._check_feed(name, feeds[name])
        # One BLAS thread for the whole step: the kernels split their BLAS work over the
        # workers themselves (anygrad._parallel says why), and ANYGRAD_NUMPY_THREADS=1 means one.
        # Overflow, inf - inf and x / 0 give inf and NaN silently, as in PyTorch: under mixed
        # precision an inf gradient is an expected event the loss scaler handles (a skipped
        # update, in this program or in a data-parallel update program of f32 values), and a run
        # that diverges is the trainer's to report (--on-nan), not a numpy warning per op.
        with _parallel.serial_blas(), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for step, (op, node, ins, outs) in enumerate(self.plan):
                if self.profile is not None:
                    t0 = time.perf_counter()
                self._store(env, outs, self._execute(step, op, node, ins, env))
                if self.profile is not None:
                    self.profile[node.op] = self.profile.get(node.op, 0.0) + time.perf_counter() - t0
                for dead in self.free[step]:
                    del env[dead]
        for produced, target in self.graph.state_updates.items():
            self.backend.state[target] = env[produced]
        return {f: np.asarray(env[f]) for f in (fetch if fetch is not None else self.graph.outputs)}


class NumpyBackend(Backend):
    name = "cpu"

    def __init__(self) -> None:
        self.state: dict[str, np.ndarray] = {}
        keep_freed_memory()

    @property
    def description(self) -> str:
        return "cpu (numpy)"

    def compile(self, graph: Graph) -> NumpyExecutable:
        resolve_attributes(graph)  # as every backend: nodes added after specialize included
        for name in graph.state_names:
            if name not in self.state and name in graph.initializers:
                self.state[name] = np.array(graph.initializers[name])
        return NumpyExecutable(self, graph)

    def get_state(self, name: str) -> np.ndarray:
        return np.array(self.state[name])

    def set_state(self, name: str, value: np.ndarray) -> None:
        self.state[name] = np.array(value)

    def has_state(self, name: str) -> bool:
        return name in self.state
