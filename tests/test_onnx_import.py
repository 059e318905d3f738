"""ONNX import/export on hand-built files: bad files, unsupported ops, external data, opsets,
attribute conversion, parameter classification, fresh initialisation, and the round trip
through save_onnx checked against onnxruntime."""
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import anygrad
from anygrad.backends import NumpyBackend
from anygrad.errors import ModelError, UnsupportedOpError
from anygrad.frontends import load_onnx, save_onnx, summarize
from anygrad.frontends.onnx_import import MAX_OPSET, MIN_OPSET
from anygrad.program import build_inference


def mlp_model(opset: int = 17, seed: int = 0, n_in: int = 16, n_hidden: int = 32, alpha: float = 1.0,
              beta: float = 1.0, trans_a: int = 0, trans_b: int = 1) -> onnx.ModelProto:
    """x -> Gemm(W1, b1) -> Relu -> Reshape(const shape) -> MatMul(W2) -> Add(b2)."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((n_hidden, n_in) if trans_b else (n_in, n_hidden)).astype(np.float32)
    b1 = rng.standard_normal(n_hidden).astype(np.float32)
    w2 = rng.standard_normal((n_hidden, 3)).astype(np.float32)
    b2 = rng.standard_normal(3).astype(np.float32)
    x_shape = ["batch", n_in] if not trans_a else [n_in, "batch"]
    nodes = [
        helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], name="/fc1/Gemm",
                         alpha=alpha, beta=beta, transA=trans_a, transB=trans_b),
        helper.make_node("Relu", ["h"], ["r"], name="/Relu"),
        helper.make_node("Constant", [], ["shape"], name="/Constant",
                         value=numpy_helper.from_array(np.array([-1, n_hidden], np.int64))),
        helper.make_node("Reshape", ["r", "shape"], ["r2"], name="/Reshape"),
        helper.make_node("MatMul", ["r2", "onnx::MatMul_7"], ["m"], name="/fc2/MatMul"),
        helper.make_node("Add", ["m", "fc2.bias"], ["y"], name="/fc2/Add"),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(w1, "fc1.weight"), numpy_helper.from_array(b1, "fc1.bias"),
                     numpy_helper.from_array(w2, "onnx::MatMul_7"), numpy_helper.from_array(b2, "fc2.bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def save(model: onnx.ModelProto, path: Path, **kw) -> Path:
    onnx.save_model(model, str(path), **kw)
    return path


def predict(model: anygrad.Model, x: np.ndarray) -> np.ndarray:
    """Inference through the numpy backend, without needing a loss to compile."""
    g = build_inference(model.graph, {model.input_name: x.shape})
    return NumpyBackend().compile(g).run({model.input_name: x})[g.outputs[0]]


def ort_run(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


# -- bad files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"this is not an onnx model at all\n", bytes(range(256)) * 8,
                                     b"\x08\x07\x12\x05hello"], ids=["empty", "text", "binary", "protobuf"])
def test_not_onnx_is_model_error_naming_the_file(tmp_path, content):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(ModelError) as e:
        load_onnx(path)
    assert "bad.onnx" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.999])
def test_truncated_file_is_model_error(tmp_path, fraction):
    data = mlp_model().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelError, match="cut.onnx"):
        load_onnx(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="nothere.onnx"):
        load_onnx(tmp_path / "nothere.onnx")


def test_corrupt_tensor_is_model_error(tmp_path):
    model = mlp_model()
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:10]
    with pytest.raises(ModelError, match="fc1.weight"):
        load_onnx(save(model, tmp_path / "m.onnx"))


# -- unsupported ops: one error listing everything ---------------------------------------------
def test_unsupported_ops_listed_together(tmp_path):
    nodes = [helper.make_node("FrobnicateOp", ["x"], ["a"], name="frob_1"),
             helper.make_node("Relu", ["a"], ["b"], name="relu"),
             helper.make_node("FrobnicateOp", ["b"], ["c"], name="frob_2"),
             helper.make_node("WibbleOp", ["c"], ["y"], name="wibble")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "u.onnx")
    with pytest.raises(UnsupportedOpError) as e:
        load_onnx(path)
    msg = str(e.value)
    for text in ("u.onnx", "FrobnicateOp", "frob_1", "frob_2", "WibbleOp", "wibble"):
        assert text in msg
    assert "Relu" not in msg
    summary = summarize(path)  # `anygrad info` reports instead of raising
    assert summary.unsupported == {"FrobnicateOp": ["frob_1", "frob_2"], "WibbleOp": ["wibble"]}
    assert not summary.supported


def test_custom_domain_op_is_unsupported(tmp_path):
    node = helper.make_node("Relu", ["x"], ["y"], name="ms_relu", domain="com.microsoft")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(UnsupportedOpError, match="com.microsoft.Relu"):
        load_onnx(save(model, tmp_path / "ms.onnx"))


def test_graph_attribute_is_clear_error(tmp_path):
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "b", [],
                               [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    node = helper.make_node("If", ["c"], ["y"], name="the_if", then_branch=branch, else_branch=branch)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                            helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = save(model, tmp_path / "if.onnx")
    with pytest.raises(ModelError, match="the_if"):
        load_onnx(path)
    assert summarize(path).unsupported == {"If": ["the_if"]}


# -- opsets ------------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [MIN_OPSET - 1, MAX_OPSET + 1])
def test_opset_out_of_range(tmp_path, opset):
    path = save(mlp_model(opset=opset), tmp_path / f"o{opset}.onnx")
    why = "older" if opset < MIN_OPSET else "newer"
    with pytest.raises(ModelError, match=rf"opset {opset}, {why} than.*{MIN_OPSET}-{MAX_OPSET}.*opset_version"):
        load_onnx(path)
    assert not summarize(path).opset_supported


@pytest.mark.parametrize("opset", [13, 20, 21, MAX_OPSET])
def test_opset_in_range(tmp_path, opset):
    path = save(mlp_model(opset=opset), tmp_path / "m.onnx")
    assert load_onnx(path).origin.opset == opset and summarize(path).opset_supported


def _opset_model(opset: int) -> tuple[onnx.ModelProto, np.ndarray]:
    """A small model of ops whose schema changed in `opset` (21: GroupNormalization's per-channel
    scale; 22: Conv, Elu, GlobalAveragePool; 23: RMSNormalization, RotaryEmbedding, Attention)."""
    rng = np.random.default_rng(opset)

    def init(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    if opset == 21:
        nodes = [helper.make_node("GroupNormalization", ["x", "s", "b"], ["g"], num_groups=2, epsilon=1e-3),
                 helper.make_node("Flatten", ["g"], ["f"]), helper.make_node("Relu", ["f"], ["y"])]
        inits, x_shape, y_shape = [init("s", 4), init("b", 4)], [2, 4, 3, 3], [2, 36]
    elif opset == 22:
        nodes = [helper.make_node("Conv", ["x", "w", "c"], ["h"], pads=[1, 1, 1, 1]),
                 helper.make_node("Elu", ["h"], ["e"], alpha=0.7),
                 helper.make_node("GlobalAveragePool", ["e"], ["y"])]
        inits, x_shape, y_shape = [init("w", 3, 2, 3, 3), init("c", 3)], [2, 2, 5, 5], [2, 3, 1, 1]
    else:  # (batch, seq 4, heads 2 x dim 4): RMSNorm -> rotary on q and k -> attention
        pos = numpy_helper.from_array(np.tile(np.arange(4, dtype=np.int64), (2, 1)), "pos")
        angle = np.arange(4)[:, None] / 10.0 ** (np.arange(2)[None, :])
        caches = [numpy_helper.from_array(np.cos(angle).astype(np.float32), "cos"),
                  numpy_helper.from_array(np.sin(angle).astype(np.float32), "sin")]
        nodes = [helper.make_node("RMSNormalization", ["x", "s"], ["n"], axis=-1, epsilon=1e-5),
                 helper.make_node("RotaryEmbedding", ["n", "cos", "sin", "pos"], ["q"], num_heads=2),
                 helper.make_node("Attention", ["q", "q", "n"], ["y"], q_num_heads=2, kv_num_heads=2,
                                  is_causal=1)]
        inits, x_shape, y_shape = [init("s", 8), pos, *caches], [2, 4, 8], [2, 4, 8]
    graph = helper.make_graph(nodes, f"opset{opset}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model, rng.standard_normal(x_shape).astype(np.float32)


@pytest.mark.parametrize("opset", [21, 22, 23])
def test_newer_opset_files_load_and_match_onnxruntime(tmp_path, opset):
    model, x = _opset_model(opset)
    path = save(model, tmp_path / f"opset{opset}.onnx")
    np.testing.assert_allclose(predict(load_onnx(path), x), ort_run(path, x), rtol=1e-4, atol=1e-5)


# -- external data -------------------------------------------------------------------------------
def save_external(tmp_path: Path) -> Path:
    path = tmp_path / "ext" / "model.onnx"
    path.parent.mkdir()
    save(mlp_model(), path, save_as_external_data=True, all_tensors_to_one_file=True,
         location="model.onnx.data", size_threshold=0)
    return path


def test_external_data_loads(tmp_path):
    path = save_external(tmp_path)
    assert (path.parent / "model.onnx.data").exists()
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    np.testing.assert_allclose(predict(load_onnx(path), x), ort_run(path, x), rtol=1e-5, atol=1e-5)


def test_external_data_missing(tmp_path):
    path = save_external(tmp_path)
    (path.parent / "model.onnx.data").unlink()
    with pytest.raises(ModelError, match="model.onnx.data.*missing"):
        load_onnx(path)


@pytest.mark.parametrize("location", ["../evil", "sub/../../evil", "/etc/passwd", "/tmp/evil"])
def test_external_data_outside_folder_refused(tmp_path, location):
    path = save_external(tmp_path)
    (tmp_path / "evil").write_bytes((path.parent / "model.onnx.data").read_bytes())  # exists, still refused
    model = onnx.load_model(str(path), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save_model(model, str(path))
    with pytest.raises(ModelError, match="refusing|absolute"):
        load_onnx(path)


# -- conversion ----------------------------------------------------------------------------------
def test_graph_conversion_and_state_classification(tmp_path):
    model = load_onnx(save(mlp_model(), tmp_path / "m.onnx"))
    g = model.graph
    assert g.inputs == ["x"] and g.outputs == ["y"]
    assert g.info["x"].shape == ("batch", 16) and g.info["x"].dtype == np.float32
    assert set(g.params) == {"fc1.weight", "fc1.bias", "onnx::MatMul_7", "fc2.bias"}
    assert g.buffers == []
    assert g.initializers["shape"].tolist() == [-1, 32] and "shape" not in g.params  # Constant folded
    gemm = next(n for n in g.nodes if n.op == "Gemm")
    assert gemm.attrs == {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 1}
    assert isinstance(gemm.attrs["transB"], int) and isinstance(gemm.attrs["alpha"], float)
    names = model.origin.torch_names
    assert names["fc1.weight"].key == "fc1.weight" and not names["fc1.weight"].transpose
    assert names["onnx::MatMul_7"].key == "fc2.weight" and names["onnx::MatMul_7"].transpose
    assert model.num_parameters() == 32 * 16 + 32 + 32 * 3 + 3


def test_graph_inputs_that_are_initializers_are_not_inputs(tmp_path):
    model = mlp_model()
    model.graph.input.append(helper.make_tensor_value_info("fc1.bias", TensorProto.FLOAT, [32]))
    m = load_onnx(save(model, tmp_path / "m.onnx"))
    assert m.graph.inputs == ["x"] and "fc1.bias" in m.graph.params


def test_summary(tmp_path):
    s = summarize(save(mlp_model(), tmp_path / "m.onnx"))
    assert s.opset == 17 and s.supported and s.unsupported == {}
    assert [(t.name, t.shape) for t in s.inputs] == [("x", ("batch", 16))]
    assert [(t.name, t.shape) for t in s.outputs] == [("y", ("batch", 3))]
    assert s.op_histogram == {"Add": 1, "Gemm": 1, "MatMul": 1, "Relu": 1, "Reshape": 1}
    assert s.num_parameters == 32 * 16 + 32 + 32 * 3 + 3


def test_fresh_init_follows_pytorch_linear(tmp_path):
    path = save(mlp_model(n_in=64, n_hidden=256), tmp_path / "m.onnx")
    a, b = load_onnx(path, init="fresh", seed=1), load_onnx(path, init="fresh", seed=1)
    c = load_onnx(path, init="fresh", seed=2)
    for name in a.graph.params:
        np.testing.assert_array_equal(a.graph.initializers[name], b.graph.initializers[name])
        assert not np.array_equal(a.graph.initializers[name], c.graph.initializers[name])
    bounds = {"fc1.weight": 1 / 8, "fc1.bias": 1 / 8, "onnx::MatMul_7": 1 / 16, "fc2.bias": 1 / 16}
    for name, bound in bounds.items():
        w = a.graph.initializers[name]
        assert w.dtype == np.float32 and np.abs(w).max() <= bound
        if w.size > 500:  # U(-b, b): std b/sqrt(3)
            assert abs(w.std() / (bound / np.sqrt(3)) - 1) < 0.1


# -- export round trip -------------------------------------------------------------------------
@settings(max_examples=8, deadline=None)
@given(alpha=st.sampled_from([1.0, 0.5]), beta=st.sampled_from([1.0, 2.0]), trans_a=st.integers(0, 1),
       trans_b=st.integers(0, 1), batch=st.integers(1, 5))
def test_import_export_roundtrip_matches_onnxruntime(tmp_path_factory, alpha, beta, trans_a, trans_b, batch):
    tmp = tmp_path_factory.mktemp("rt")
    src = save(mlp_model(alpha=alpha, beta=beta, trans_a=trans_a, trans_b=trans_b), tmp / "m.onnx")
    x = np.random.default_rng(batch).standard_normal((16, batch) if trans_a else (batch, 16)).astype(np.float32)
    model = load_onnx(src)
    ours = predict(model, x)
    np.testing.assert_allclose(ours, ort_run(src, x), rtol=1e-5, atol=1e-5)
    out = save_onnx(model, tmp / "out" / "exported.onnx")
    exported = onnx.load(str(out))
    assert exported.ir_version == 8 and exported.opset_import[0].version == 17
    np.testing.assert_allclose(ort_run(out, x), ours, rtol=1e-5, atol=1e-5)
    assert sorted(p.name for p in out.parent.iterdir()) == ["exported.onnx"]  # no temp left behind


def test_unknown_init_is_config_error(tmp_path):
    with pytest.raises(anygrad.errors.ConfigError, match="init"):
        load_onnx(save(mlp_model(), tmp_path / "m.onnx"), init="xavier")


def test_large_model_is_saved_with_external_data(tmp_path, monkeypatch):
    from anygrad.frontends import onnx_export
    monkeypatch.setattr(onnx_export, "_EXTERNAL_DATA_BYTES", 0)  # pretend the model is over 1.5 GB
    model = load_onnx(save(mlp_model(), tmp_path / "m.onnx"))
    out = save_onnx(model, tmp_path / "out" / "big.onnx")
    assert sorted(p.name for p in out.parent.iterdir()) == ["big.onnx", "big.onnx.data"]
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_allclose(ort_run(out, x), predict(model, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(predict(load_onnx(out), x), predict(model, x), rtol=1e-6)


# -- freezing ------------------------------------------------------------------------------------
def _founding_export(tmp_path: Path):
    """The founding model exported by examples/mnist/export.py (dropout off), and its torch Net."""
    import importlib.util
    import sys
    import warnings
    here = Path(__file__).resolve().parents[1] / "examples" / "mnist"
    sys.path.insert(0, str(here))
    try:
        spec = importlib.util.spec_from_file_location("mnist_export_for_freeze", here / "export.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net = module.export(tmp_path / "net.onnx", dropout=0.0)
    finally:
        sys.path.remove(str(here))
    return tmp_path / "net.onnx", net


def test_freeze_trains_like_torch_requires_grad_false(tmp_path):
    import torch
    path, net = _founding_export(tmp_path)
    model = load_onnx(path, freeze=["conv1.*"])
    assert model.frozen == ["conv1.weight", "conv1.bias"] and "conv1.weight" not in model.param_names
    before = model.state_dict()
    model.compile(loss="nll", optimizer=anygrad.optim.SGD(lr=0.02, momentum=0.9), device="cpu")
    net.train()
    net.conv1.requires_grad_(False)
    opt = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
    rng = np.random.default_rng(0)
    ours, theirs = [], []
    for _ in range(5):
        x = rng.standard_normal((16, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, 16)
        ours.append(model.train_on_batch(x, y))
        opt.zero_grad()
        loss = torch.nn.functional.nll_loss(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    after, full = model.state_dict(), model.full_state()
    for name in ("conv1.weight", "conv1.bias"):  # in the state and checkpoints, unchanged
        np.testing.assert_array_equal(after[name], before[name])
        np.testing.assert_array_equal(full[name], before[name])
        assert not any(k.startswith("optim.") and k.endswith(name) for k in full)
    assert not np.array_equal(after["conv2.weight"], before["conv2.weight"])
    moved = net.conv2.weight.detach().numpy()  # trained like torch, to float32 drift over 5 steps
    assert np.abs(after["conv2.weight"] - moved).max() <= 2e-3 * np.abs(moved).max()
    saved = onnx.load(str(save_onnx(model, tmp_path / "trained.onnx")))  # exported too
    weights = {t.name: numpy_helper.to_array(t) for t in saved.graph.initializer}
    np.testing.assert_array_equal(weights["conv1.weight"], before["conv1.weight"])


def test_freeze_after_compile_rebuilds_the_step_and_unfreeze_trains_again(tmp_path):
    path, _ = _founding_export(tmp_path)
    model = load_onnx(path).compile(loss="nll", optimizer=anygrad.optim.SGD(lr=0.1), device="cpu")
    fingerprint, everything = model.fingerprint(), model.param_names
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 8)
    model.train_step(x, y)
    assert model.freeze("fc*.weight", "norm2.*") == ["fc1.weight", "fc2.weight", "norm2.weight", "norm2.bias"]
    assert model.fingerprint() == fingerprint  # a checkpoint of the unfrozen run still fits
    frozen = {n: model.state_dict()[n] for n in model.frozen}
    model.train_step(x, y)
    state = model.state_dict()
    for name, value in frozen.items():
        np.testing.assert_array_equal(state[name], value)
    assert model.unfreeze("fc2.*") == ["fc2.weight", "fc2.bias"]  # fc2.bias was never frozen
    assert model.param_names == [n for n in everything if n not in ("fc1.weight", "norm2.weight", "norm2.bias")]
    model.train_step(x, y)
    assert not np.array_equal(model.state_dict()["fc2.weight"], frozen["fc2.weight"])
    np.testing.assert_array_equal(model.state_dict()["fc1.weight"], frozen["fc1.weight"])


def test_freeze_matches_pytorch_names_and_reports_unmatched_patterns(tmp_path):
    from anygrad.errors import ConfigError
    path = save(mlp_model(), tmp_path / "m.onnx")
    model = load_onnx(path)
    # the MatMul weight is 'onnx::MatMul_7' in the file, fc2.weight in PyTorch
    assert model.freeze("fc2.weight") == ["onnx::MatMul_7"]
    assert model.num_frozen_parameters() == 32 * 3 and model.num_parameters() == 16 * 32 + 32 + 3
    with pytest.raises(ConfigError, match=r"'fc3\.\*' matches no parameter; close names: .*fc"):
        model.freeze("fc3.*")
    with pytest.raises(ConfigError, match="conv9"):
        load_onnx(path, freeze=["conv9.*"])
    s = summarize(path, freeze=["fc1.*"])
    assert (s.num_parameters, s.num_frozen) == (32 * 3 + 3, 16 * 32 + 32)


# -- silent acceptances that are errors -----------------------------------------------------------
def test_founding_model_refuses_to_train_on_one_sample():
    from anygrad.errors import ShapeError
    from anygrad.examples import FOUNDING_MODEL
    model = load_onnx(FOUNDING_MODEL).compile(loss="nll", device="cpu")
    x = np.zeros((1, 1, 28, 28), np.float32)
    with pytest.raises(ShapeError, match="norm2.*more than 1 value per channel.*drop-last"):
        model.train_on_batch(x, np.array([3]))
    assert model.predict(x).shape == (1, 10)  # inference uses the running statistics


def _relu_model(x_info: onnx.ValueInfoProto, extra: list | None = None) -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")] + (extra or [])
    graph = helper.make_graph(nodes, "g", [x_info], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_input_without_shape_is_not_a_scalar(tmp_path):
    """No shape at all (rank unknown) is not rank 0: load_onnx says what is missing; the in-memory
    importer (ONNX backend) takes the shape of what it is fed."""
    shapeless = _relu_model(helper.make_tensor_value_info("x", TensorProto.FLOAT, None))
    path = save(shapeless, tmp_path / "noshape.onnx")
    with pytest.raises(ModelError, match="input 'x' declares no shape, not even its rank.*make_tensor_value_info"):
        load_onnx(path)
    assert summarize(path).inputs[0].shape == ("...",)
    model = anygrad.frontends.onnx_import.from_model_proto(shapeless)
    x = np.array([-1.0, 2.0], np.float32)
    np.testing.assert_array_equal(predict(model, x), np.maximum(x, 0))
    scalar = load_onnx(save(_relu_model(helper.make_tensor_value_info("x", TensorProto.FLOAT, [])),
                            tmp_path / "scalar.onnx"))
    assert scalar.input_shape == ()
    with pytest.raises(anygrad.AnygradError, match=r"expects shape \(\), got \(2,\)"):
        predict(scalar, x)


def test_two_nodes_writing_one_value_is_a_model_error(tmp_path):
    model = _relu_model(helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                        [helper.make_node("Neg", ["x"], ["y"], name="neg")])
    with pytest.raises(ModelError, match="Neg node 'neg' writes 'y', which Relu node 'relu' already defines"):
        load_onnx(save(model, tmp_path / "twice.onnx"))
    model = _relu_model(helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                        [helper.make_node("Constant", [], ["x"], name="c", value_float=1.0)])
    with pytest.raises(ModelError, match="Constant node 'c' writes 'x', which graph input 'x' already defines"):
        load_onnx(save(model, tmp_path / "input.onnx"))
