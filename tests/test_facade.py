"""anygrad.facade: the Model methods whose work anygrad.train and anygrad.frontends register."""
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import anygrad
from anygrad import data, facade, frontends, train
from anygrad.errors import ConfigError


def _linear(path: Path) -> anygrad.Model:
    """One Gemm (3 -> 2), weights named as PyTorch's nn.Linear would."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "fc.weight"),
             numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "fc.bias")]
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "fc.weight", "fc.bias"], ["y"], transB=1)], "lin",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return anygrad.load_onnx(str(path))


def test_import_anygrad_registers_every_operation_from_its_package():
    for name, op in facade.OPERATIONS.items():
        package = {"anygrad.train": train, "anygrad.frontends": frontends, "anygrad.data": data}[op.package]
        function = facade.operation(name)
        assert function.__module__.startswith(package.__name__), (name, function.__module__)
    assert facade.operation("fit") is train.fit and facade.operation("one_pass") is data.one_pass


def test_model_methods_reach_the_registered_functions(tmp_path):
    model = _linear(tmp_path / "lin.onnx")
    weight = np.asarray(model.graph.initializers["fc.weight"])
    state = model.to_torch_state_dict(as_numpy=True)
    np.testing.assert_array_equal(state["fc.weight"], weight)
    model.load_state_dict({"fc.weight": weight * 2, "fc.bias": state["fc.bias"]})
    np.testing.assert_array_equal(model.to_torch_state_dict(as_numpy=True)["fc.weight"], weight * 2)


def test_an_unregistered_operation_names_the_package_to_import(tmp_path, monkeypatch):
    model = _linear(tmp_path / "lin.onnx")
    monkeypatch.delitem(facade._registered, "fit")
    with pytest.raises(ConfigError, match=r"'fit' needs anygrad\.train: import it"):
        model.fit((np.zeros((4, 3), np.float32), np.zeros((4, 2), np.float32)))
    monkeypatch.delitem(facade._registered, "save_safetensors")
    with pytest.raises(ConfigError, match=r"anygrad\.frontends"):
        model.save_safetensors(tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()


def test_only_declared_operations_can_be_registered():
    with pytest.raises(KeyError, match="OPERATIONS"):
        facade.register("predict", lambda model: None)
