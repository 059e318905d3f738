"""anygrad Model -> ONNX file for inference, with the trained weights and running statistics.

The graph is written back in inference mode (BatchNorm on running statistics, no Dropout), with
the opset and IR version of the file it came from, so any ONNX runtime runs the trained model.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, helper, numpy_helper

from ..errors import ModelError, first_line
from ..ir.graph import Graph, Node, TensorInfo
from ..ir.passes import set_training_mode
from ..ir.registry import get_op
from .onnx_import import NUMPY_ELEM_TYPES

DEFAULT_OPSET = 17
DEFAULT_IR_VERSION = 8
# Above this the protobuf limit (2 GiB) is near: tensors go to `<name>.data` next to the model.
_EXTERNAL_DATA_BYTES = 1_500_000_000

_ENCODE = {
    AttributeProto.INT: int, AttributeProto.FLOAT: float, AttributeProto.STRING: str,
    AttributeProto.INTS: lambda v: [int(x) for x in v],
    AttributeProto.FLOATS: lambda v: [float(x) for x in v],
    AttributeProto.STRINGS: lambda v: [str(x) for x in v],
    AttributeProto.TENSOR: lambda v: numpy_helper.from_array(np.asarray(v)),
}


def _guess_type(value: Any) -> int:
    """The attribute type of a Python value, for attributes the op's schema does not list."""
    if isinstance(value, np.ndarray):
        return AttributeProto.TENSOR
    if isinstance(value, (bool, int, np.integer)):
        return AttributeProto.INT
    if isinstance(value, (float, np.floating)):
        return AttributeProto.FLOAT
    if isinstance(value, str):
        return AttributeProto.STRING
    items = list(value)
    if items and all(isinstance(v, str) for v in items):
        return AttributeProto.STRINGS
    if items and all(isinstance(v, (int, np.integer)) for v in items):
        return AttributeProto.INTS
    return AttributeProto.FLOATS if items else AttributeProto.INTS


def _node(node: Node, opset: int) -> onnx.NodeProto:
    try:
        schema_attrs = onnx.defs.get_schema(node.op, opset, "").attributes
    except onnx.defs.SchemaError:  # not an ONNX op: attribute types from the Python values
        schema_attrs = {}
    attrs = []
    op = get_op(node.op)
    for key, value in node.attrs.items():
        if op is not None and key in op.grad_attrs:
            continue  # anygrad's gradient semantics (padding_idx): nothing for inference to read
        kind = int(schema_attrs[key].type) if key in schema_attrs else _guess_type(value)
        if kind not in _ENCODE:
            raise ModelError(f"{node.label}: cannot write attribute '{key}' to ONNX")
        attrs.append(helper.make_attribute(key, _ENCODE[kind](value), attr_type=kind))
    proto = helper.make_node(node.op, node.inputs, node.outputs, name=node.name or None)
    proto.attribute.extend(attrs)
    return proto


def _value_info(name: str, info: TensorInfo | None) -> onnx.ValueInfoProto:
    if info is None:
        return helper.make_empty_tensor_value_info(name)
    elem = NUMPY_ELEM_TYPES.get(np.dtype(info.dtype))
    if elem is None:
        raise ModelError(f"value '{name}' has dtype {info.dtype}, which ONNX files cannot hold here")
    return helper.make_tensor_value_info(name, elem, [d if isinstance(d, int) else str(d) for d in info.shape])


def inference_graph(model) -> Graph:
    """The model's graph in inference mode with the current state, internal ops removed."""
    g = set_training_mode(model.sync_to_graph() if model.backend is not None else model.graph, False)
    g.state_updates = {}
    _drop_dropout(g)
    g.dce()
    internal = sorted({n.op for n in g.nodes if get_op(n.op) is None or get_op(n.op).internal})
    if internal:
        raise ModelError(f"cannot write ONNX: the inference graph still uses internal op(s) {internal}")
    return g


def _drop_dropout(g: Graph) -> None:
    """Inference-mode Dropout is the identity: the exported file has none (as PyTorch's eval export).
    Readers of its output read its input instead; a graph output keeps its name through an Identity."""
    outputs = set(g.outputs)
    read = {v for n in g.nodes for v in n.inputs} | outputs
    rename: dict[str, str] = {}
    kept = []
    for n in g.nodes:
        n.inputs = [rename.get(v, v) for v in n.inputs]
        mask_read = len(n.outputs) > 1 and n.outputs[1] in read
        if n.op != "Dropout" or mask_read:
            kept.append(n)
        elif n.outputs[0] in outputs:
            kept.append(Node("Identity", [n.inputs[0]], [n.outputs[0]], name=n.name))
        else:
            rename[n.outputs[0]] = n.inputs[0]
    g.nodes = kept


def to_onnx(model) -> onnx.ModelProto:
    g = inference_graph(model)
    origin = getattr(model, "origin", None)
    opsets = dict(origin.opset_imports) if origin is not None else {"": DEFAULT_OPSET}
    opset = opsets.get("", opsets.get("ai.onnx", DEFAULT_OPSET))
    graph = helper.make_graph(
        [_node(n, opset) for n in g.nodes], g.name,
        [_value_info(i, g.info.get(i)) for i in g.inputs],
        [_value_info(o, model.graph.info.get(o)) for o in g.outputs],
        initializer=[numpy_helper.from_array(np.array(v, order="C"), k) for k, v in g.initializers.items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                              producer_name="anygrad")
    proto.ir_version = origin.ir_version if origin is not None else DEFAULT_IR_VERSION
    return proto


def save_onnx(model, path: str | os.PathLike) -> Path:
    """Write `model` as an inference ONNX file (atomically: a temporary name, then renamed)."""
    from ..version import __version__
    path = Path(path)
    proto = to_onnx(model)
    proto.producer_version = __version__
    external = proto.ByteSize() > _EXTERNAL_DATA_BYTES
    if not external:
        try:
            onnx.checker.check_model(proto)
        except onnx.checker.ValidationError as e:
            raise ModelError(f"cannot write {path}: the exported graph is not valid ONNX: "
                             f"{first_line(e)}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        data_name = f"{path.name}.data"
        onnx.save_model(proto, str(tmp / path.name), save_as_external_data=external,
                        all_tensors_to_one_file=True, location=data_name)
        if external:
            os.replace(tmp / data_name, path.parent / data_name)
        os.replace(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
