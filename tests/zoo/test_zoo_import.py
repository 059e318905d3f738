"""What the dynamo exporter writes for torch.split/chunk (SplitToSequence read by SequenceAt at
constant positions) imports as plain Slices, matching onnxruntime."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import anygrad


def _split_model(split: np.ndarray, positions: list[int]):
    nodes = [helper.make_node("SplitToSequence", ["x", "split"], ["seq"], axis=1)]
    inits = [numpy_helper.from_array(split, "split")]
    for k, p in enumerate(positions):
        inits.append(numpy_helper.from_array(np.array(p, np.int64), f"pos{k}"))
        nodes.append(helper.make_node("SequenceAt", ["seq", f"pos{k}"], [f"s{k}"]))
    nodes.append(helper.make_node("Concat", [f"s{k}" for k in range(len(positions))], ["y"], axis=1))
    graph = helper.make_graph(nodes, "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("split,positions", [
    (np.array(2, np.int64), [0, 2, 1]),            # torch.split(x, 2): equal chunks
    (np.array([1, 3, 2], np.int64), [2, -3, 1]),   # torch.split(x, [1, 3, 2]), negative positions
])
def test_split_to_sequence_imports_as_slices(tmp_path, split, positions):
    proto = _split_model(split, positions)
    path = tmp_path / "split.onnx"
    path.write_bytes(proto.SerializeToString())
    model = anygrad.load_onnx(path).compile(loss="mse", device="cpu")
    assert not {"SplitToSequence", "SequenceAt"} & set(model.graph.op_histogram())
    x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(model.predict(x), want)
