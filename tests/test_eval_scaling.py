"""`anygrad eval` says what it does to the samples of a run that was not normalised: uint8
pixels are scaled to [0, 1], float samples are used as stored (BatchTransform)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from anygrad import cli
from anygrad.inference import Normalisation, input_normalisation


def _linear(path: Path, features: int = 4, classes: int = 3) -> Path:
    w = numpy_helper.from_array(np.random.default_rng(0).normal(0, 0.1, (features, classes)).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(classes, np.float32), "b")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["logits"])], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
                              [w, b])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("dtype, says", [("float32", "float32 values as stored, not scaled"),
                                         ("uint8", "uint8 pixels scaled to [0, 1]")])
def test_eval_says_how_unnormalised_samples_are_read(tmp_path, capsys, dtype, says):
    rng = np.random.default_rng(1)
    x = (rng.normal(0, 1, (20, 4)) if dtype == "float32" else rng.integers(0, 255, (20, 4))).astype(dtype)
    np.savez(tmp_path / "d.npz", x=x, y=rng.integers(0, 3, 20))
    run = tmp_path / "run"
    assert cli.main(["train", str(_linear(tmp_path / "m.onnx")), "--dataset", "npz", "--data-dir",
                     str(tmp_path / "d.npz"), "--normalize", "none", "--epochs", "1", "--batch-size", "10",
                     "--device", "cpu", "--artifacts", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--device", "cpu"]) == 0
    data_line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("data: "))
    assert f"not normalised ({says}), like the run" in data_line
    assert ("pixels" in data_line) == (dtype == "uint8")


def test_the_dtype_free_text_names_both():
    norm = input_normalisation({"dataset": "npz", "normalize": "none"}, "npz")
    assert norm.mean is None and "uint8 pixels scaled to [0, 1], other dtypes as stored" in norm.how
    assert Normalisation((0.5,), (0.2,), "like the run (mean 0.5, std 0.2)").for_dtype(np.float32) == \
        "like the run (mean 0.5, std 0.2)"
