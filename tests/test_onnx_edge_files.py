"""ONNX files at the edges (issue 12, item 4): odd but parseable files end in an AnygradError that
names the file, valid models with local functions load, and topological sorting is linear."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from anygrad.errors import AnygradError, ModelError, ShapeError
from anygrad.frontends import load_onnx, summarize
from anygrad.frontends.onnx_import import from_model_proto
from anygrad.ir.graph import Graph, Node

X2 = h.make_tensor_value_info("x", T.FLOAT, ["batch", 2])
Y2 = h.make_tensor_value_info("y", T.FLOAT, ["batch", 2])


def make(nodes, inputs=(X2,), outputs=(Y2,), inits=(), functions=(), extra_opsets=()) -> onnx.ModelProto:
    g = h.make_graph(list(nodes), "g", list(inputs), list(outputs), list(inits))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17), *extra_opsets], functions=list(functions))
    m.ir_version = 8
    return m


def both_readers(path: Path):
    return [lambda: load_onnx(path), lambda: summarize(path)]


def test_constant_with_value_graphs_is_a_model_error(tmp_path):
    c = h.make_node("Constant", [], ["c"])
    c.attribute.append(h.make_attribute("value_graphs", [h.make_graph([], "s", [], [Y2])]))
    path = tmp_path / "vg.onnx"
    onnx.save(make([c, h.make_node("Add", ["x", "c"], ["y"])]), path)
    for read in both_readers(path):
        with pytest.raises(ModelError, match=r"vg\.onnx.*Constant with attribute 'value_graphs' is not supported"):
            read()


def test_non_utf8_value_names_are_a_model_error(tmp_path):
    m = make([h.make_node("Relu", ["x"], ["r"]), h.make_node("Relu", ["r"], ["y"])])
    data = m.SerializeToString()
    assert data.count(b"\x0a\x01r") == 1 and data.count(b"\x12\x01r") == 1  # node 2's input, node 1's output
    path = tmp_path / "names.onnx"
    path.write_bytes(data.replace(b"\x0a\x01r", b"\x0a\x01\xff").replace(b"\x12\x01r", b"\x12\x01\xff"))
    for read in both_readers(path):
        with pytest.raises(ModelError, match=r"names\.onnx: NodeProto\.(input|output) holds b'\\xff', which is not UTF-8"):
            read()
    with pytest.raises(ModelError, match="not UTF-8"):  # an in-memory ModelProto too
        from_model_proto(onnx.load_model_from_string(path.read_bytes()), "in memory")


def test_nul_in_external_data_location_is_a_model_error(tmp_path):
    m = make([h.make_node("Add", ["x", "w"], ["y"])], inits=[h.make_tensor("w", T.FLOAT, [2], [1.0, 2.0])])
    w = m.graph.initializer[0]
    w.ClearField("float_data")
    w.data_location = T.EXTERNAL
    entry = w.external_data.add()
    entry.key, entry.value = "location", "w.bin\x00/etc/passwd"
    path = tmp_path / "nul.onnx"
    onnx.save(m, path)
    for read in both_readers(path):
        with pytest.raises(ModelError, match=r"nul\.onnx: tensor 'w' keeps its data at .* a path with a NUL"):
            read()


def test_huge_constant_of_shape_is_refused_in_a_forward_pass(tmp_path):
    x = h.make_tensor_value_info("x", T.FLOAT, ["batch", 1])
    shape = h.make_tensor("s", T.INT64, [2], [10**5, 10**6])  # 373 GiB of float32
    m = make([h.make_node("ConstantOfShape", ["s"], ["c"]), h.make_node("Add", ["x", "c"], ["y"])],
             inputs=[x], outputs=[h.make_tensor_value_info("y", T.FLOAT, None)], inits=[shape])
    onnx.save(m, tmp_path / "cos.onnx")
    model = load_onnx(tmp_path / "cos.onnx")
    with pytest.raises(ShapeError, match=r"ConstantOfShape .* shape \(100000, 1000000\) would take 372.5 GiB, "
                                         r"more than this machine's memory"):
        model.predict(np.zeros((1, 1), np.float32))
    # one that fits is computed
    small = make([h.make_node("ConstantOfShape", ["s"], ["c"], value=h.make_tensor("v", T.FLOAT, [1], [2.0])),
                  h.make_node("Add", ["x", "c"], ["y"])], inputs=[x],
                 outputs=[h.make_tensor_value_info("y", T.FLOAT, None)], inits=[h.make_tensor("s", T.INT64, [2], [1, 3])])
    onnx.save(small, tmp_path / "small.onnx")
    np.testing.assert_array_equal(load_onnx(tmp_path / "small.onnx").predict(np.ones((1, 1), np.float32)),
                                  np.full((1, 3), 3.0, np.float32))


def test_model_with_local_functions_loads_and_matches_onnxruntime(tmp_path):
    fn = h.make_function("local", "scaled_relu", ["a", "b"], ["out"],
                         [h.make_node("Relu", ["a"], ["r"]), h.make_node("Mul", ["r", "b"], ["out"])],
                         [h.make_opsetid("", 17)])
    w = h.make_tensor("w", T.FLOAT, [2], [0.5, -3.0])
    m = make([h.make_node("scaled_relu", ["x", "w"], ["t"], domain="local"), h.make_node("Neg", ["t"], ["y"])],
             inits=[w], functions=[fn], extra_opsets=[h.make_opsetid("local", 1)])
    onnx.checker.check_model(m)
    path = tmp_path / "fn.onnx"
    onnx.save(m, path)
    x = np.array([[1.0, -2.0], [3.0, 4.0]], np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(load_onnx(path).predict(x), want, rtol=1e-6)
    assert summarize(path).op_histogram == {"Relu": 1, "Mul": 1, "Neg": 1}


class CountingList(list):
    """A node's input list that counts how often it is walked."""
    walks = 0

    def __iter__(self):
        CountingList.walks += 1
        return super().__iter__()


def test_toposort_is_linear_for_a_graph_stored_in_reverse(tmp_path):
    n = 3000
    chain = [Node("Relu", CountingList(["x" if i == 0 else f"v{i}"]), [f"v{i + 1}"], {}, f"n{i}") for i in range(n)]
    g = Graph(name="g")
    g.inputs, g.outputs, g.nodes = ["x"], [f"v{n}"], chain[::-1]
    CountingList.walks = 0
    g.toposort()
    assert [nd.name for nd in g.nodes] == [f"n{i}" for i in range(n)]
    assert CountingList.walks <= 2 * n  # each node's inputs looked at once or twice, not once per pass
    # and a 10k-node file stored in reverse order is read (the sort took 29 s before)
    k = 10_000
    nodes = [h.make_node("Relu", ["x" if i == 0 else f"v{i}"], ["y" if i == k - 1 else f"v{i + 1}"]) for i in range(k)]
    onnx.save(make(nodes[::-1]), tmp_path / "rev.onnx")
    assert summarize(tmp_path / "rev.onnx").op_histogram == {"Relu": k}


def test_toposort_still_reports_cycles_and_missing_values():
    g = Graph(name="g")
    g.inputs, g.outputs = ["x"], ["b"]
    g.nodes = [Node("Relu", ["b"], ["a"], {}, "one"), Node("Relu", ["a"], ["b"], {}, "two")]
    with pytest.raises(AnygradError, match="cycle"):
        g.toposort()
    g.nodes = [Node("Relu", ["nowhere"], ["b"], {}, "one")]
    with pytest.raises(AnygradError, match=r"uses value\(s\) \['nowhere'\] that nothing produces"):
        g.toposort()


def test_split_to_sequence_rewrite_keeps_working(tmp_path):
    """(The rewrite into Slices found each SequenceAt with list.index: quadratic in the graph.)"""
    x = h.make_tensor_value_info("x", T.FLOAT, ["batch", 6])
    split = h.make_tensor("split", T.INT64, [3], [1, 2, 3])
    nodes = [h.make_node("SplitToSequence", ["x", "split"], ["seq"], axis=1)]
    for i in (2, 0):
        nodes.append(h.make_node("SequenceAt", ["seq", f"pos{i}"], [f"part{i}"]))
    nodes.append(h.make_node("ReduceSum", ["part2"], ["s2"], keepdims=1))
    nodes.append(h.make_node("Mul", ["part0", "s2"], ["y"]))
    inits = [split, h.make_tensor("pos2", T.INT64, [], [2]), h.make_tensor("pos0", T.INT64, [], [0])]
    m = make(nodes, inputs=[x], outputs=[h.make_tensor_value_info("y", T.FLOAT, ["batch", 1])], inits=inits)
    path = tmp_path / "split.onnx"
    onnx.save(m, path)
    xv = np.arange(12, dtype=np.float32).reshape(2, 6)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": xv})[0]
    model = load_onnx(path)
    assert "SequenceAt" not in model.graph.op_histogram()
    np.testing.assert_allclose(model.predict(xv), want, rtol=1e-6)
