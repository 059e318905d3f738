"""anygrad as an `onnx.backend.base.Backend`, so ONNX's own conformance suite can run against it.

A BackendRep runs the imported graph as the file says: no `set_training_mode` rewrite, so a
node whose attributes or inputs ask for training behaviour (BatchNormalization training_mode=1,
Dropout with training_mode true) runs that way; random ops then draw from anygrad's
counter-based RNG. Each distinct set of input shapes is specialized and compiled once.

anygrad's shape rules want shape-like operands (Reshape's shape, Slice's starts, pads, axes)
to be constants, as they are in exported models. Node tests feed them as graph inputs, so when
a graph cannot be specialized with every input left dynamic, the inputs that reach such slots
(an op's `nondiff` slots) are baked in as constants, from the values of that run.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.backend.base import Backend as OnnxBackend
from onnx.backend.base import BackendRep, namedtupledict

from ..backends.base import Backend, Executable
from ..backends.numpy import NumpyBackend
from ..errors import ShapeError
from ..ir.graph import Graph, TensorInfo
from ..ir.passes import RNG_STATE, specialize
from ..ir.registry import get_op
from .onnx_import import NUMPY_ELEM_TYPES, from_model_proto

# ONNX backend device names -> anygrad device names.
DEVICES = {"CPU": "cpu", "WGPU": "wgpu"}


def _device(device: str) -> str:
    name = DEVICES.get(device.upper().split(":")[0])
    if name is None:
        raise ValueError(f"anygrad's ONNX backend knows devices {sorted(DEVICES)}, not '{device}'")
    return name


def _shape_like_inputs(graph: Graph) -> set[str]:
    """Graph inputs that reach some op's slot that takes no gradient (shapes, axes, pads,
    indices), directly or through other nodes (the function bodies of *_expanded cases)."""
    producers = graph.producers()
    seen: set[str] = set()
    todo = [name for n in graph.nodes if (op := get_op(n.op)) is not None
            for slot, name in enumerate(n.inputs) if name and slot in op.nondiff]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in producers:
            todo.extend(i for i in producers[name].inputs if i)
    return seen & set(graph.inputs)


# Ops that draw random numbers when the file asks for training behaviour: op -> (slot of the
# training_mode input, slot where the op takes the RNG state). Wiring the state in lets the node
# run as the file says; its values then follow anygrad's counter-based RNG, not ONNX's.
_RANDOM_OPS = {"Dropout": (2, 3)}


def _wire_rng(graph: Graph) -> None:
    for n in graph.nodes:
        slots = _RANDOM_OPS.get(n.op)
        if slots is None or not n.input(slots[0]) or n.input(slots[1]):
            continue
        n.inputs = n.inputs + [""] * (slots[1] - len(n.inputs)) + [RNG_STATE]
        if RNG_STATE not in graph.initializers:
            graph.initializers[RNG_STATE] = np.zeros(2, np.uint32)
            graph.buffers.append(RNG_STATE)


@functools.cache
def _have_wgpu() -> bool:  # asked once per test case by BackendTest: probe the adapters once
    try:
        from ..devices import list_adapters
        return bool(list_adapters())
    except Exception:  # noqa: BLE001  (wgpu missing or broken: the device is not there)
        return False


@dataclass
class _Compiled:
    exe: Executable
    baked: tuple[str, ...] = ()  # inputs folded in as constants (then compiled for one run only)


@dataclass
class AnygradBackendRep(BackendRep):
    """One imported ONNX model, ready to run on one anygrad device."""

    graph: Graph
    backend: Backend
    output_names: list[str]
    shapeless: frozenset[str] = frozenset()  # inputs the file declares without a shape
    _cache: dict[tuple, _Compiled] = field(default_factory=dict)
    baked: tuple[str, ...] = ()  # inputs the last run had to fold in as constants

    def _feeds(self, inputs: Any) -> dict[str, np.ndarray]:
        names = self.graph.inputs
        if isinstance(inputs, Mapping):
            return {n: np.asarray(inputs[n]) for n in names}
        if isinstance(inputs, np.ndarray) and len(names) == 1:
            inputs = [inputs]
        inputs = list(inputs)
        if len(inputs) != len(names):
            raise ValueError(f"the model takes {len(names)} input(s) {names}, got {len(inputs)}")
        return {n: np.asarray(v) for n, v in zip(names, inputs)}

    def _graph_for(self, feeds: dict[str, np.ndarray], baked: Sequence[str]) -> Graph:
        g = self.graph.copy()
        for name in self.shapeless:
            g.info[name] = TensorInfo(g.info[name].dtype, tuple(feeds[name].shape))
        for name in baked:
            g.initializers[name] = feeds[name].astype(g.info[name].dtype, copy=False)
            g.inputs.remove(name)
        return specialize(g, {n: feeds[n].shape for n in g.inputs})

    def _compile(self, feeds: dict[str, np.ndarray]) -> _Compiled:
        shapes = tuple((n, v.shape) for n, v in feeds.items())
        if shapes in self._cache:
            return self._cache[shapes]
        try:
            compiled = _Compiled(self.backend.compile(self._graph_for(feeds, ())))
            self._cache[shapes] = compiled
            return compiled
        except ShapeError:
            baked = tuple(n for n in self.graph.inputs if n in _shape_like_inputs(self.graph))
            if not baked:
                raise
        # Baked values are part of the program: compiled for this run only.
        return _Compiled(self.backend.compile(self._graph_for(feeds, baked)), baked)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        feeds = self._feeds(inputs)
        compiled = self._compile(feeds)
        self.baked = compiled.baked
        live = {n: v for n, v in feeds.items() if n not in compiled.baked}
        out = compiled.exe.run(live, fetch=self.output_names)
        return namedtupledict("Outputs", self.output_names)(*(out[n] for n in self.output_names))


class AnygradBackend(OnnxBackend):
    """`onnx.backend.base.Backend` over anygrad: device "CPU" (numpy) or "WGPU"."""

    _wgpu: Backend | None = None  # one wgpu device for all reps: creating one is slow

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            name = _device(device)
        except ValueError:
            return False
        return name == "cpu" or _have_wgpu()

    @classmethod
    def _backend(cls, device: str) -> Backend:
        if _device(device) == "cpu":
            return NumpyBackend()
        if cls._wgpu is None:
            from ..devices import get_backend
            AnygradBackend._wgpu = get_backend("wgpu")
        return cls._wgpu

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> AnygradBackendRep:
        source = f"'{model.graph.name or 'model'}'"
        m = from_model_proto(model, source, strict_opset=False)
        graph = m.graph
        _wire_rng(graph)
        backend = cls._backend(device)
        for name in graph.state_names:
            backend.set_state(name, graph.initializers[name])
        shapeless = frozenset(vi.name for vi in model.graph.input
                              if vi.name in graph.inputs and not vi.type.tensor_type.HasField("shape"))
        return AnygradBackendRep(graph, backend, list(graph.outputs), shapeless)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[np.dtype, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple:
        """Run one node: wrap it in a model whose inputs are `inputs` (a list, or a dict by name)."""
        names = [n for n in node.input if n]
        values = [np.asarray(inputs[n]) for n in names] if isinstance(inputs, Mapping) else \
            [np.asarray(v) for v in inputs]
        graph_inputs = [helper.make_tensor_value_info(n, NUMPY_ELEM_TYPES[v.dtype], v.shape)
                        for n, v in zip(names, values)]
        if outputs_info is not None:
            outs = [helper.make_tensor_value_info(n, NUMPY_ELEM_TYPES[np.dtype(dt)], shape)
                    for n, (dt, shape) in zip(node.output, outputs_info)]
        else:
            outs = [helper.make_empty_tensor_value_info(n) for n in node.output if n]
        proto = helper.make_model(helper.make_graph([node], "run_node", graph_inputs, outs),
                                  opset_imports=[helper.make_opsetid("", kwargs.get("opset_version", 17))])
        if outputs_info is None:  # output types from ONNX's own shape inference
            proto = onnx.shape_inference.infer_shapes(proto)
            typed = {vi.name: vi for vi in proto.graph.value_info}
            for o in proto.graph.output:
                if o.name in typed:
                    o.CopyFrom(typed[o.name])
        return cls.prepare(proto, device).run(values)


# The names the onnx backend API conventionally exports at module level.
prepare = AnygradBackend.prepare
run_model = AnygradBackend.run_model
run_node = AnygradBackend.run_node
supports_device = AnygradBackend.supports_device
