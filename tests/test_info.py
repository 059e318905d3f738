"""`anygrad info`: which ops of an ONNX file anygrad can train through, only run, or not run at all."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from anygrad import cli
from anygrad.frontends import summarize
from anygrad.frontends.op_support import INFERENCE, TRAINING, UNSUPPORTED
from anygrad.ir import registry


@pytest.fixture(autouse=True)
def det_without_grad(monkeypatch):
    """Det stands for an op with a forward kernel and no gradient rule, whatever the registry
    grows later (a real ONNX op, so the files stay valid ONNX)."""
    monkeypatch.setitem(registry._REGISTRY, "Det", dataclasses.replace(registry.get_op("Det"), grad=None,
                                                                       expand=None))


def _model(path: Path, *, det_on: str = "h", unknown: bool = True) -> Path:
    """x (3, 3) -> MatMul(W) -> h -> Relu -> ArgMax; Det(det_on); optionally FrobnicateOp(r)."""
    w = numpy_helper.from_array(np.eye(3, dtype=np.float32) * 2, "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("ArgMax", ["r"], ["am"], name="argmax", axis=1),
             helper.make_node("Det", [det_on], ["d"], name="det")]
    outputs = [helper.make_tensor_value_info("r", TensorProto.FLOAT, [3, 3]),
               helper.make_tensor_value_info("am", TensorProto.INT64, [3, 1]),
               helper.make_tensor_value_info("d", TensorProto.FLOAT, [])]
    if unknown:
        nodes.append(helper.make_node("FrobnicateOp", ["r"], ["f"], name="frob"))
        outputs.append(helper.make_tensor_value_info("f", TensorProto.FLOAT, [3, 3]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])], outputs,
                              [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_summary_sorts_ops_by_support(tmp_path):
    s = summarize(_model(tmp_path / "m.onnx"))
    levels = {op: sup.level for op, sup in s.support.items()}
    assert levels == {"MatMul": TRAINING, "Relu": TRAINING, "ArgMax": TRAINING,  # ArgMax: its input is nondiff
                      "Det": INFERENCE, "FrobnicateOp": UNSUPPORTED}
    assert s.inference_only == {"Det": ["det"]} and s.unsupported == {"FrobnicateOp": ["frob"]}
    assert not s.supported and not s.trainable


def test_info_prints_the_three_levels_and_fails_on_unsupported_ops(tmp_path, capsys):
    assert cli.main(["info", str(_model(tmp_path / "m.onnx"))]) == 1
    out = capsys.readouterr().out
    lines = [line.split(":", 1) for line in out.splitlines()]
    table = {k.strip(): v.strip() for k, v in (pair for pair in lines if len(pair) == 2)}
    assert table["training"] == "ArgMax, MatMul, Relu"
    assert table["inference only"] == "Det (1 node)"
    assert table["not supported"] == "FrobnicateOp"
    assert table["unsupported ops"] == "FrobnicateOp (1 node)"
    assert "cannot run or train this model" in out


def test_inference_only_model_exits_0_and_says_it_cannot_train(tmp_path, capsys):
    path = _model(tmp_path / "m.onnx", unknown=False)
    s = summarize(path)
    assert s.supported and not s.trainable
    assert cli.main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "inference only: Det (1 node)" in out and "unsupported ops: none" in out
    assert "can run this model (predict, eval) but cannot train it" in out


def test_an_op_without_gradient_off_the_gradient_path_still_trains(tmp_path, capsys):
    """Det of the input alone: no parameter's gradient crosses it, so training is fine."""
    path = _model(tmp_path / "m.onnx", det_on="x", unknown=False)
    s = summarize(path)
    assert s.support["Det"].level == TRAINING and s.trainable
    assert cli.main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "inference only: none" in out and "cannot train" not in out


@pytest.mark.parametrize("opset", [23, 28, 29, 12])
def test_info_accepts_the_opsets_load_onnx_accepts(tmp_path, capsys, opset):
    from anygrad.errors import ModelError
    from anygrad.frontends.onnx_import import MAX_OPSET, MIN_OPSET, load_onnx
    path = _model(tmp_path / "m.onnx", det_on="x", unknown=False)
    model = onnx.load(str(path))
    model.opset_import[0].version = opset
    onnx.save(model, str(path))
    ok = MIN_OPSET <= opset <= MAX_OPSET
    assert cli.main(["info", str(path)]) == (0 if ok else 1)
    out = capsys.readouterr().out
    assert f"opset {opset}" in out and (f"unsupported opset: {opset}" in out) != ok
    if ok:
        load_onnx(path)
    else:
        with pytest.raises(ModelError, match=f"opset {opset}"):
            load_onnx(path)
