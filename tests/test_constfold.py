"""Folding constant subgraphs through dtype/shape-only inputs (ir/constfold.py): what exporters emit
for ReLU6/Hardtanh bounds and bias-free Conv biases folds at compile time; nothing that depends on a
graph input or a trainable parameter folds. Checked against onnxruntime and PyTorch."""
from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import anygrad
from anygrad.backends import NumpyBackend
from anygrad.ir import set_training_mode, specialize
from anygrad.ir.constfold import fold_constant_subgraphs


def _model(tmp_path):
    X = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])
    Y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "lo"),
             numpy_helper.from_array(np.array(6.0, np.float64), "hi"),   # cast to X's dtype
             numpy_helper.from_array(np.array(0.25, np.float32), "zero_ish"),
             numpy_helper.from_array(np.array([3], np.int64), "shape3"),
             numpy_helper.from_array(np.array([1.0, -2.0, 3.0], np.float32), "W")]  # a parameter
    nodes = [helper.make_node("CastLike", ["lo", "X"], ["lo_c"]),
             helper.make_node("CastLike", ["hi", "X"], ["hi_c"]),
             helper.make_node("Mul", ["X", "W"], ["xw"]),
             helper.make_node("Clip", ["xw", "lo_c", "hi_c"], ["clipped"]),
             helper.make_node("CastLike", ["zero_ish", "clipped"], ["z"]),
             helper.make_node("Expand", ["z", "shape3"], ["bias"]),
             helper.make_node("CastLike", ["W", "X"], ["w_c"]),          # reads a parameter: stays
             helper.make_node("Add", ["clipped", "bias"], ["s"]),
             helper.make_node("Add", ["s", "w_c"], ["Y"])]
    m = helper.make_model(helper.make_graph(nodes, "g", [X], [Y], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    return path


def test_folds_casts_and_expands_of_constants_only(tmp_path):
    path = _model(tmp_path)
    model = anygrad.load_onnx(path)
    assert model.graph.params == ["W"]
    g = specialize(model.graph, {"X": (4, 3)})
    ops = collections.Counter(n.op for n in g.nodes)
    assert ops["Expand"] == 0 and ops["CastLike"] == 1  # only CastLike(W, X) is left
    (cast,) = [n for n in g.nodes if n.op == "CastLike"]
    assert cast.inputs[0] == "W" and "W" not in g.initializers or "W" in g.state_names
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32) * 4
    nb = NumpyBackend()
    for name in g.state_names:
        nb.set_state(name, g.initializers[name])
    got = nb.compile(g).run({"X": x})["Y"]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_never_folds_what_an_input_or_state_feeds():
    from anygrad.ir import Graph, Node, TensorInfo
    from anygrad.ir.passes import infer_shapes
    g = Graph(inputs=["x"], outputs=["a", "b"])
    g.nodes = [Node("CastLike", ["x", "c"], ["a"], {}), Node("Add", ["p", "c"], ["b"], {})]
    g.info["x"] = TensorInfo(np.dtype(np.float32), (2,))
    g.initializers = {"c": np.ones(2, np.float32), "p": np.ones(2, np.float32)}
    g.params = ["p"]
    infer_shapes(g)
    assert fold_constant_subgraphs(g) == 0
    assert all(g.info[v].const is None for v in ("a", "b"))


@pytest.mark.slow
def test_mobilenet_v2_step_loses_its_castlike_and_expand_nodes():
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    module = torchvision.models.mobilenet_v2(width_mult=0.25, num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    model = anygrad.from_torch(module, x, check=False)
    before = collections.Counter(n.op for n in model.graph.nodes)
    assert before["CastLike"] >= 52 and before["Expand"] >= 52  # what the exporter emits
    g = specialize(set_training_mode(model.graph, False), {model.graph.inputs[0]: (2, 3, 32, 32)})
    after = collections.Counter(n.op for n in g.nodes)
    assert after["CastLike"] == 0 and after["Expand"] == 0
    assert set(g.params) == set(model.graph.params)
    nb = NumpyBackend()
    for name in g.state_names:
        nb.set_state(name, g.initializers[name])
    got = nb.compile(g).run({g.inputs[0]: x.numpy()})[g.outputs[0]]
    with torch.no_grad():
        want = module(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
