"""ONNX file -> anygrad IR Graph -> trainable Model.

Reading is defensive: a file that is not ONNX, is truncated, points its external data outside
its folder, uses an opset or op anygrad does not know, fails here with one message that names
the file, before anything runs. What the importer learns about the file (opset, PyTorch
state_dict names of the weights) is kept in an `OnnxOrigin` so the model can be written back.
"""
from __future__ import annotations

import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.inliner  # a submodule `import onnx` does not load
from google.protobuf.descriptor import FieldDescriptor
from onnx import AttributeProto, TensorProto, numpy_helper

from ..errors import ConfigError, ModelError
from ..ir.graph import Graph, Node, Shape, TensorInfo
from ..ir.passes import check_supported, unsupported_ops
from ..ir.registry import get_op
from ..model import Model
from ..torchfile.safe_io import open_regular
from .init import fresh_init
from .op_support import INFERENCE, OpSupport, by_level, op_support

# Files of these default-domain opsets load. MAX_OPSET is the newest opset whose changed ops all
# pass ONNX's conformance cases here (value types anygrad cannot hold at any opset aside);
# tests/test_onnx_import.py checks that against onnx's schemas and the expected-failure list.
MIN_OPSET, MAX_OPSET = 13, 28
DEFAULT_DOMAINS = ("", "ai.onnx")

# ONNX element types anygrad can hold, and their numpy dtypes (one table, both directions).
ELEM_TYPES: dict[int, np.dtype] = {
    TensorProto.FLOAT: np.dtype(np.float32), TensorProto.DOUBLE: np.dtype(np.float64),
    TensorProto.FLOAT16: np.dtype(np.float16), TensorProto.BOOL: np.dtype(np.bool_),
    TensorProto.INT8: np.dtype(np.int8), TensorProto.INT16: np.dtype(np.int16),
    TensorProto.INT32: np.dtype(np.int32), TensorProto.INT64: np.dtype(np.int64),
    TensorProto.UINT8: np.dtype(np.uint8), TensorProto.UINT16: np.dtype(np.uint16),
    TensorProto.UINT32: np.dtype(np.uint32), TensorProto.UINT64: np.dtype(np.uint64),
}
NUMPY_ELEM_TYPES: dict[np.dtype, int] = {v: k for k, v in ELEM_TYPES.items()}


@dataclass(frozen=True)
class TorchName:
    """Where an ONNX initializer comes from in the PyTorch module's state_dict."""

    key: str
    transpose: bool = False  # the ONNX tensor is the PyTorch tensor transposed (MatMul weights)


@dataclass
class OnnxOrigin:
    """What a Model remembers about the ONNX file it came from (used when writing it back)."""

    path: Path
    ir_version: int
    opset_imports: dict[str, int]
    producer: str = ""
    torch_names: dict[str, TorchName] = field(default_factory=dict)
    # Integer initializers named like module state (a Swin's `attn.relative_position_index`): buffers
    # the graph computes with as constants (folded at import), which the module's state_dict holds.
    int_buffers: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def opset(self) -> int:
        return max((v for d, v in self.opset_imports.items() if d in DEFAULT_DOMAINS), default=0)


# -- reading the file -----------------------------------------------------------------------------
def _tensors(model: onnx.ModelProto):
    """Every TensorProto that may hold external data: initializers and tensor attributes."""
    def walk(graph: onnx.GraphProto):
        yield from graph.initializer
        for node in graph.node:
            for a in node.attribute:
                if a.type == AttributeProto.TENSOR:
                    yield a.t
                elif a.type == AttributeProto.TENSORS:
                    yield from a.tensors
                elif a.type == AttributeProto.GRAPH:
                    yield from walk(a.g)
                elif a.type == AttributeProto.GRAPHS:
                    for g in a.graphs:
                        yield from walk(g)
    yield from walk(model.graph)


def _check_external_data(model: onnx.ModelProto, path: Path) -> None:
    """External data must be a relative path inside the model's folder, and must exist."""
    folder = path.parent.resolve()
    for t in _tensors(model):
        if t.data_location != TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in t.external_data if e.key == "location"), "")
        if "\0" in location:  # (the OS cannot even look such a path up)
            raise ModelError(f"{path}: tensor '{t.name}' keeps its data at {location!r}, a path with a NUL "
                             "character; the file is corrupt")
        rel = Path(location)
        if not location or rel.is_absolute() or location.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", location):
            raise ModelError(f"{path}: tensor '{t.name}' keeps its data at '{location}', an absolute or "
                             "empty path; anygrad only reads external data stored next to the model")
        target = (folder / rel).resolve()
        if ".." in rel.parts or not target.is_relative_to(folder):
            raise ModelError(f"{path}: tensor '{t.name}' keeps its data at '{location}', outside the "
                             "model's folder; refusing to read it")
        if not target.is_file():
            raise ModelError(f"{path}: external data file '{location}' for tensor '{t.name}' is missing; "
                             f"copy it next to the model (expected {target})")


def read_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Parse and sanity-check an ONNX file (and its external data); ModelError when unreadable."""
    path = Path(path)
    if not os.path.lexists(path):
        raise ModelError(f"{path}: no such model file")
    try:
        with open_regular(path) as f:  # never a FIFO or a device, which would block or never end
            data = f.read()
        model = onnx.load_model_from_string(data)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001  (protobuf DecodeError and friends: any failure is a bad file)
        raise ModelError(f"{path}: not a readable ONNX model (corrupt or truncated?): "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")) from None
    # Random bytes can parse as an (almost) empty protobuf message; a real model has these.
    if model.ir_version <= 0 or not model.opset_import or not model.HasField("graph") or not model.graph.output:
        raise ModelError(f"{path}: not an ONNX model (no IR version, opset or graph outputs); "
                         "is it corrupt, truncated, or another format?")
    _check_strings(model, str(path))
    _check_external_data(model, path)
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{path}: cannot read external data: {e}") from None
    if model.functions:
        try:
            model = onnx.inliner.inline_local_functions(model)
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"{path}: cannot inline the model's local functions: {e}") from None
    return model


def _check_strings(message: Any, source: str) -> None:
    """Every string field of the file is valid UTF-8. protobuf hands a string field that is not as
    `bytes`, which would then travel as a value name through the whole program."""
    todo = [message]
    while todo:
        m = todo.pop()
        for fd, value in m.ListFields():
            if fd.type == FieldDescriptor.TYPE_MESSAGE:
                todo.extend(value if fd.is_repeated else [value])
            elif fd.type == FieldDescriptor.TYPE_STRING:
                for v in (value if fd.is_repeated else [value]):
                    if not isinstance(v, str):
                        raise ModelError(f"{source}: {type(m).__name__}.{fd.name} holds {bytes(v)[:40]!r}, which is "
                                         "not UTF-8 text as ONNX requires (a corrupt or hand-edited file?)")


def default_opset(model: onnx.ModelProto) -> int | None:
    """The version of the default ONNX domain the file imports (None when it imports none)."""
    return max((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), default=None)


def check_opset(model: onnx.ModelProto, source: str) -> int:
    opset = default_opset(model)
    if opset is None:
        raise ModelError(f"{source}: imports no default-domain ONNX opset")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        why = "older than" if opset < MIN_OPSET else "newer than"
        raise ModelError(f"{source} uses ONNX opset {opset}, {why} anygrad supports (opsets {MIN_OPSET}-{MAX_OPSET}). "
                         "Re-export with torch.onnx.export(..., opset_version=17), or convert it with "
                         f"onnx.version_converter.convert_version(model, {min(max(opset, MIN_OPSET), MAX_OPSET)})")
    return opset


# -- converting to the IR ---------------------------------------------------------------------------
def _tensor(t: TensorProto, source: str) -> np.ndarray:
    if t.data_type not in ELEM_TYPES:
        raise ModelError(f"{source}: tensor '{t.name}' has element type "
                         f"{TensorProto.DataType.Name(t.data_type)}, which anygrad does not support")
    try:
        return np.array(numpy_helper.to_array(t))
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{source}: tensor '{t.name}' is corrupt: {e}") from None


_ATTR_VALUES: dict[int, Callable[[AttributeProto, str], Any]] = {
    AttributeProto.INT: lambda a, s: int(a.i),
    AttributeProto.FLOAT: lambda a, s: float(a.f),
    AttributeProto.STRING: lambda a, s: a.s.decode("utf-8"),
    AttributeProto.INTS: lambda a, s: [int(v) for v in a.ints],
    AttributeProto.FLOATS: lambda a, s: [float(v) for v in a.floats],
    AttributeProto.STRINGS: lambda a, s: [v.decode("utf-8") for v in a.strings],
    AttributeProto.TENSOR: lambda a, s: _tensor(a.t, s),
    AttributeProto.TENSORS: lambda a, s: [_tensor(t, s) for t in a.tensors],
}


@dataclass(frozen=True)
class UnreadAttr:
    """An attribute anygrad cannot hold (a subgraph of If/Loop/Scan). Kept in place so that
    `summarize` can list the op; `load_onnx` refuses the node."""

    kind: str


def _attrs(node: onnx.NodeProto, source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in node.attribute:
        convert = _ATTR_VALUES.get(a.type)
        out[a.name] = (convert(a, source) if convert is not None
                       else UnreadAttr(AttributeProto.AttributeType.Name(a.type)))
    return out


def check_attrs(g: Graph, source: str) -> None:
    for n in g.nodes:
        for key, value in n.attrs.items():
            if isinstance(value, UnreadAttr):
                raise ModelError(f"{source}: {n.label} has a {value.kind} attribute '{key}' "
                                 "(control flow / subgraphs), which anygrad does not support")


def _constant_value(node: Node, source: str) -> np.ndarray:
    """The value of an ONNX Constant node, whichever attribute holds it."""
    if len(node.attrs) != 1:
        raise ModelError(f"{source}: {node.label} has attributes {sorted(node.attrs)}; a Constant has exactly one")
    (key, v), = node.attrs.items()
    if key == "value":
        return v
    table = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
             "value_ints": np.int64}
    if key not in table:
        raise ModelError(f"{source}: {node.label}: Constant with attribute '{key}' is not supported (anygrad "
                         "reads tensor, float and int constants)")
    return np.array(v, table[key])


def _value_info(vi: onnx.ValueInfoProto, source: str, rank_known: bool = False) -> TensorInfo:
    """The declared dtype and shape. A tensor declared without any shape gets shape None (rank
    unknown, as opposed to () for a scalar) unless `rank_known` (outputs, which are inferred)."""
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or tt.elem_type not in ELEM_TYPES:
        raise ModelError(f"{source}: value '{vi.name}' is not a tensor of a supported element type")
    if not tt.HasField("shape") and not rank_known:
        return TensorInfo(ELEM_TYPES[tt.elem_type], None)  # type: ignore[arg-type]
    shape: list[int | str] = []
    for i, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value"):
            shape.append(int(d.dim_value))
        elif d.dim_param:
            shape.append(d.dim_param)
        else:  # unknown dim: a symbol of its own (the batch, in practice)
            shape.append("batch" if i == 0 else f"{vi.name}.dim{i}")
    return TensorInfo(ELEM_TYPES[tt.elem_type], tuple(shape))


def to_graph(model: onnx.ModelProto, source: str) -> Graph:
    """A faithful IR copy of the ONNX graph (Constant nodes become initializers)."""
    og = model.graph
    g = Graph(name=og.name or "graph")
    g.initializers = {t.name: _tensor(t, source) for t in og.initializer}
    # What defines each value so far: a second definition is a corrupt graph, not a silent overwrite.
    defined = {name: f"initializer '{name}'" for name in g.initializers}
    defined.update((vi.name, f"graph input '{vi.name}'") for vi in og.input if vi.name not in defined)
    for i, onode in enumerate(og.node):
        op = onode.op_type if onode.domain in DEFAULT_DOMAINS else f"{onode.domain}.{onode.op_type}"
        node = Node(op, list(onode.input), list(onode.output), _attrs(onode, source), onode.name)
        for out in filter(None, node.outputs):
            if out in defined:
                raise ModelError(f"{source}: {node.label} writes '{out}', which {defined[out]} already "
                                 "defines; every value needs exactly one producer (a corrupt or hand-edited "
                                 "graph?)")
            defined[out] = node.label
        if op == "Constant":
            g.initializers[node.outputs[0]] = _constant_value(node, source)
        else:
            g.nodes.append(node)
    g.inputs = [vi.name for vi in og.input if vi.name not in g.initializers]
    for vi in og.input:
        if vi.name not in g.initializers:
            g.info[vi.name] = _value_info(vi, source)
    for vi in og.output:
        if vi.name not in g.initializers:
            g.info[vi.name] = _value_info(vi, source, rank_known=True)
    g.outputs = [vi.name for vi in og.output]
    return g


def _split_sequences_to_slices(g: Graph) -> None:
    """SplitToSequence read only by SequenceAt at constant positions (what the dynamo exporter
    writes for torch.split/chunk) becomes one Slice per SequenceAt: no sequence values remain.
    Other sequence uses are left alone (and reported as unsupported)."""
    readers: dict[str, list[Node]] = {}
    for n in g.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n)
    drop: set[int] = set()
    position = {id(n): k for k, n in enumerate(g.nodes)}  # (list.index per rewrite would be quadratic)
    for n in g.nodes:
        if n.op != "SplitToSequence" or n.outputs[0] in g.outputs:
            continue
        users = readers.get(n.outputs[0], [])
        split = g.initializers.get(n.input(1)) if n.input(1) else None
        positions = [g.initializers.get(u.input(1)) for u in users]
        if (split is None or not all(u.op == "SequenceAt" and u.inputs[0] == n.outputs[0] for u in users)
                or any(p is None or p.size != 1 for p in positions)):
            continue  # no split sizes (chunks of 1, keepdims), or a dynamic use of the sequence
        axis = int(n.attrs.get("axis", 0))
        sizes = [int(v) for v in np.reshape(split, -1)]
        starts = np.cumsum([0] + sizes) if split.ndim == 1 else None
        rewritten = []
        for u, pos in zip(users, positions):
            i = int(np.reshape(pos, -1)[0])
            if starts is None:  # a scalar split: equal chunks of that size
                if i < 0:
                    break  # counts from the end, which the static graph does not know
                lo, hi = i * sizes[0], (i + 1) * sizes[0]
            else:
                i = i + len(sizes) if i < 0 else i
                lo, hi = int(starts[i]), int(starts[i + 1])
            consts = []
            for what, v in (("starts", lo), ("ends", hi), ("axes", axis)):
                name = f"{u.outputs[0]}.slice_{what}"
                g.initializers[name] = np.array([v], np.int64)
                consts.append(name)
            rewritten.append((u, Node("Slice", [n.inputs[0], *consts], list(u.outputs), {}, u.name)))
        else:
            for u, s in rewritten:
                g.nodes[position[id(u)]] = s
            drop.add(id(n))
    g.nodes = [n for n in g.nodes if id(n) not in drop]


# -- making it trainable --------------------------------------------------------------------------
def _state_slots(node: Node) -> frozenset[int]:
    """Input slots holding state an op updates itself (BatchNorm running stats)."""
    op = get_op(node.op)
    return op.nondiff if op is not None and op.set_mode is not None else frozenset()


# Names PyTorch gives the inputs of stateful ops, for copies the importer has to make.
_SLOT_NAMES = {"BatchNormalization": {1: "weight", 2: "bias", 3: "running_mean", 4: "running_var"}}


def _untie_state(g: Graph) -> None:
    """Give every running-statistics input its own initializer.

    Exporters merge initializers with equal values (a fresh BatchNorm's running_var equals its
    weight: ones), either by reusing one name or through an Identity node. Training updates
    them separately, so each stateful use gets its own copy.
    """
    # Identity(initializer) is such a merge (TorchScript, eval mode): make its output a real
    # initializer again. This also unties a weight deliberately shared through an Identity,
    # which exporters do not emit for shared nn.Parameters (those reuse one name).
    kept = []
    for n in g.nodes:
        if (n.op == "Identity" and n.inputs and n.inputs[0] in g.initializers
                and n.outputs[0] not in g.outputs):
            g.initializers[n.outputs[0]] = np.array(g.initializers[n.inputs[0]])
        else:
            kept.append(n)
    g.nodes = kept
    uses = Counter(i for n in g.nodes for i in n.inputs if i in g.initializers)
    for n in g.nodes:
        for slot in sorted(_state_slots(n)):
            name = n.input(slot)
            value = g.initializers.get(name)
            if value is None or value.dtype.kind != "f" or value.ndim < 1 or uses[name] <= 1:
                continue  # absent, a scalar option (Dropout's ratio), or used here only
            uses[name] -= 1
            new = _copy_name(g, n, slot)
            g.initializers[new] = np.array(g.initializers[name])
            n.inputs[slot] = new


def _copy_name(g: Graph, node: Node, slot: int) -> str:
    names = _SLOT_NAMES.get(node.op, {})
    scale = node.input(1)
    if slot in names and scale.endswith(".weight"):
        candidate = f"{scale[:-len('weight')]}{names[slot]}"
        if candidate not in g.initializers:
            return candidate
    return g.fresh(f"{node.name or node.op}.input{slot}")


def classify_state(g: Graph, constants: set[str] = frozenset()) -> None:
    """params: float tensors a gradient reaches; buffers: float tensors only ops update (running
    statistics); everything else (shapes, axes, scalars, Constant nodes) stays constant."""
    slots: dict[str, list[tuple[Node, int]]] = {}
    for n in g.nodes:
        for i, v in enumerate(n.inputs):
            if v in g.initializers:
                slots.setdefault(v, []).append((n, i))
    params, buffers = [], []
    for name, array in g.initializers.items():
        if name in constants or array.dtype.kind != "f" or array.ndim < 1 or name not in slots:
            continue
        op_of = [(n, i, get_op(n.op)) for n, i in slots[name]]
        if any(op is None or i not in op.nondiff for n, i, op in op_of):
            params.append(name)
        elif all(i in _state_slots(n) for n, i, op in op_of):
            buffers.append(name)
    g.params = params
    g.buffers = [b for b in buffers if b not in params]


_STATE_DICT_KEY = re.compile(r"^[A-Za-z_][\w]*(\.[\w]+)*\.(weight|bias|running_mean|running_var)$")
# (op, slot) -> state_dict suffix, for initializers named by the exporter ("onnx::MatMul_12").
_PARAM_SUFFIX = {("Conv", 1): "weight", ("Conv", 2): "bias", ("ConvTranspose", 1): "weight",
                 ("ConvTranspose", 2): "bias", ("Gemm", 1): "weight", ("Gemm", 2): "bias",
                 ("MatMul", 1): "weight", **{("BatchNormalization", k): v
                                             for k, v in _SLOT_NAMES["BatchNormalization"].items()}}


def torch_names(g: Graph) -> dict[str, TorchName]:
    """ONNX initializer name -> PyTorch state_dict key, where the file tells us.

    The TorchScript and dynamo exporters keep state_dict names (`conv1.weight`); a Linear may
    reach ONNX as a MatMul over the transposed weight, and TorchScript scopes node names by
    module (`/fc1/MatMul`), which names weights the exporter renamed.
    """
    out: dict[str, TorchName] = {}
    folded = folded_linear_weights(g)
    for n in g.nodes:
        for slot, v in enumerate(n.inputs):
            if v not in g.state_names or v in out:
                continue
            if _STATE_DICT_KEY.match(v):
                # The exporter stores a tensor under its state_dict name only as the module holds it:
                # a GPT-2 Conv1D weight (in, out) read by Gemm(transB=0) is not a transposed Linear.
                out[v] = TorchName(v)
            elif ((n.op, slot) in _PARAM_SUFFIX and n.name.startswith("/") and n.name.count("/") >= 2
                  and folded.get(v) is not None):
                scope = ".".join(n.name.strip("/").split("/")[:-1])
                out[v] = TorchName(f"{scope}.{_PARAM_SUFFIX[n.op, slot]}", folded[v])
    return out


_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.\w+)+$")


def int_buffers(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The file's integer initializers named like state_dict keys (`blocks.0.attn.index`, not
    `onnx::Gather_7` or `val_3`), by name, before import folds them into other constants."""
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer
            if ELEM_TYPES.get(t.data_type, np.dtype(np.float32)).kind in "biu" and _MODULE_PATH.match(t.name)}


def folded_linear_weights(g: Graph) -> dict[str, bool | None]:
    """Renamed initializers (constant-folded by the exporter) -> whether the graph reads them as a
    Linear's weight.T: True when every use multiplies from the right as stored (MatMul, or Gemm
    without transB), where the folded Transpose of `x @ weight.T` ends up; False when no use does;
    None when the uses disagree, and the orientation cannot be told from the graph."""
    uses: dict[str, set[bool]] = {}
    for n in g.nodes:
        for slot, v in enumerate(n.inputs):
            if v in g.initializers and not _STATE_DICT_KEY.match(v):
                right = slot == 1 and (n.op == "MatMul" or (n.op == "Gemm" and not n.attr("transB", 0)))
                uses.setdefault(v, set()).add(right)
    return {v: next(iter(kinds)) if len(kinds) == 1 else None for v, kinds in uses.items()}


def _convert(path: Path, strict_opset: bool = True) -> tuple[onnx.ModelProto, Graph, set[str]]:
    return _convert_proto(read_model(path), f"'{path}'", strict_opset)


def _convert_proto(model: onnx.ModelProto, source: str,
                   strict_opset: bool = True) -> tuple[onnx.ModelProto, Graph, set[str]]:
    if strict_opset:
        check_opset(model, source)
    _check_strings(model, source)  # (again: a ModelProto may come from memory, not read_model)
    try:
        g = to_graph(model, source)
        _split_sequences_to_slices(g)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001  (a malformed graph must not escape as a traceback)
        raise ModelError(f"{source}: cannot convert the ONNX graph: {e}") from None
    try:
        g.toposort()  # every value produced before use: catches files cut at a field boundary
    except ModelError as e:
        raise ModelError(f"{source}: {e}") from None
    constants = set(g.initializers) - {t.name for t in model.graph.initializer}
    return model, g, constants


def _patterns(freeze: str | Sequence[str]) -> Sequence[str]:
    """`freeze` as a list of patterns: one string is one pattern, not its characters."""
    return [freeze] if isinstance(freeze, str) else freeze


def load_onnx(path: str | os.PathLike, init: str = "onnx", seed: int = 0, freeze: Sequence[str] = (),
              padding_idx: Mapping[str, int] | None = None) -> Model:
    """Import an ONNX file as a trainable `anygrad.Model`.

    init="onnx" keeps the weights in the file; init="fresh" re-initialises them the way
    PyTorch initialises each layer (seeded by `seed`). `freeze`: patterns of parameters not to
    train (see Model.freeze). ONNX does not say which initializers are PyTorch buffers, so every
    float tensor a gradient reaches is a parameter, a fixed positional-encoding table included:
    freeze such tables here. `padding_idx`: embedding table (graph or PyTorch name) -> the row
    PyTorch's `nn.Embedding(padding_idx=...)` gives no gradient, which ONNX cannot say either
    (see Model.set_padding_idx).
    """
    path = Path(path)
    model = from_model_proto(read_model(path), f"'{path}'", init, seed, origin_path=path, freeze=freeze)
    for name in model.graph.inputs:
        if model.graph.info[name].shape is None:  # the CLI, data pipeline and export need the rank
            raise ModelError(f"'{path}': graph input '{name}' declares no shape, not even its rank; anygrad "
                             "needs it. Declare it when exporting (torch.onnx.export does), or in the file: "
                             "replace the input by onnx.helper.make_tensor_value_info("
                             f"'{name}', <element type>, ['batch', ...])")
    for table, row in (padding_idx or {}).items():
        model.set_padding_idx(table, row)
    return model


def from_model_proto(proto: onnx.ModelProto, source: str = "<model>", init: str = "onnx", seed: int = 0,
                     strict_opset: bool = True, origin_path: Path | None = None,
                     freeze: Sequence[str] = ()) -> Model:
    """Import an in-memory ONNX ModelProto (external data already loaded) as an `anygrad.Model`.

    `source` names the model in error messages. strict_opset=False accepts any default-domain
    opset (the ONNX conformance backend runs every opset's node tests; files stay within
    MIN_OPSET-MAX_OPSET). An input declared without a shape (rank unknown) takes the shape of
    whatever it is fed (`specialize`); load_onnx refuses such files instead, as its users
    (CLI, data pipeline, export) rely on the declared rank.
    """
    if init not in ("onnx", "fresh"):
        raise ConfigError(f"init must be 'onnx' or 'fresh', not '{init}'")
    if proto.functions:
        try:
            proto = onnx.inliner.inline_local_functions(proto)
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"{source}: cannot inline the model's local functions: {e}") from None
    model, g, constants = _convert_proto(proto, source, strict_opset)
    check_supported(g, source)
    check_attrs(g, source)
    _untie_state(g)
    # Drop initializers nothing reads (exporters leave some behind).
    used = {i for n in g.nodes for i in n.inputs} | set(g.outputs)
    g.initializers = {k: v for k, v in g.initializers.items() if k in used}
    classify_state(g, constants)
    if init == "fresh":
        kept = fresh_init(g, seed)
        if kept:
            warnings.warn(f"{source}: no PyTorch initialiser known for {', '.join(kept)}; "
                          "kept the values from the file", stacklevel=2)
    origin = OnnxOrigin(origin_path or Path(source), model.ir_version, {o.domain: o.version for o in model.opset_import},
                        model.producer_name, torch_names(g), int_buffers(model))
    m = Model(g, source=str(origin_path or source))
    m.origin = origin
    if freeze:
        m.freeze(*_patterns(freeze))
    return m


# -- summary for `anygrad info` ----------------------------------------------------------------------
@dataclass
class TensorSummary:
    name: str
    dtype: str
    shape: Shape  # ("...",) for an input declared without any shape


@dataclass
class ModelSummary:
    path: Path
    producer: str
    ir_version: int
    opset: int | None
    opset_supported: bool
    inputs: list[TensorSummary]
    outputs: list[TensorSummary]
    op_histogram: dict[str, int]
    num_parameters: int
    num_buffers: int
    unsupported: dict[str, list[str]]  # op type -> node names
    support: dict[str, OpSupport] = field(default_factory=dict)  # op type -> training / inference only / not
    num_frozen: int = 0  # parameters summarize(freeze=...) took out of training (not in num_parameters)

    @property
    def supported(self) -> bool:
        return self.opset_supported and not self.unsupported

    @property
    def inference_only(self) -> dict[str, list[str]]:
        """Op type -> the nodes a parameter's gradient would have to cross without a grad rule."""
        return {op: list(s.blocking) for op, s in by_level(self.support, INFERENCE).items()}

    @property
    def trainable(self) -> bool:
        return self.supported and not self.inference_only


def summarize(path: str | os.PathLike, freeze: Sequence[str] = ()) -> ModelSummary:
    """What is in an ONNX file, without raising for unsupported ops or opsets (ModelError only
    when the file cannot be read at all; ConfigError for a `freeze` pattern matching nothing).
    With `freeze` (as load_onnx's), matching parameters count as frozen, not trainable."""
    path = Path(path)
    model, g, constants = _convert(path, strict_opset=False)
    opset = default_opset(model)
    ok = opset is not None and MIN_OPSET <= opset <= MAX_OPSET
    missing = unsupported_ops(g)
    _untie_state(g)
    classify_state(g, constants)
    frozen: list[str] = []
    if freeze:
        m = Model(g, source=str(path))
        m.origin = OnnxOrigin(path, model.ir_version, {}, torch_names=torch_names(g))
        frozen = m.freeze(*_patterns(freeze))
    support = op_support(g)

    def tensors(names: list[str]) -> list[TensorSummary]:
        return [TensorSummary(n, str(g.info[n].dtype), tuple(g.info[n].shape) if g.info[n].shape is not None
                              else ("...",)) for n in names if n in g.info]

    return ModelSummary(path, model.producer_name, model.ir_version, opset, ok, tensors(g.inputs),
                        tensors(g.outputs), g.op_histogram(),
                        int(sum(g.initializers[p].size for p in g.params)),
                        int(sum(g.initializers[b].size for b in g.buffers if b not in frozen)), missing, support,
                        int(sum(g.initializers[p].size for p in frozen)))
