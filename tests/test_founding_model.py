"""The founding example end to end: the MNIST convnet of examples/mnist/model.py, exported by
both PyTorch exporters, imported, trained 10 steps, and compared with PyTorch step by step."""
import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import anygrad
from anygrad.examples import FOUNDING_MODEL

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "mnist"
STEPS, BATCH = 10, 16


def _module(name: str):
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec = importlib.util.spec_from_file_location(f"mnist_{name}", EXAMPLE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLE))


export_mod = _module("export")
Net = export_mod.Net


def export(path: Path, dynamo: bool, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_mod.export(path, dynamo=dynamo, **kw)


def export_eval_default(path: Path, dynamo: bool) -> torch.nn.Module:
    """What a user gets from a plain export: eval mode, constant folding, dynamo's optimizer."""
    torch.manual_seed(0)
    model = Net().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(2, 1, 28, 28),), str(path), dynamo=dynamo, opset_version=17,
                          input_names=["input"], output_names=["log_probs"],
                          dynamic_axes={"input": {0: "batch"}, "log_probs": {0: "batch"}})
    return model


def batches():
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        yield (rng.standard_normal((BATCH, 1, 28, 28)).astype(np.float32),
               rng.integers(0, 10, BATCH).astype(np.int64))


def torch_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def compile_sgd(model: anygrad.Model) -> anygrad.Model:
    return model.compile(loss="nll", optimizer=anygrad.optim.SGD(lr=0.1, momentum=0.9), device="cpu")


@pytest.fixture(scope="module", params=[False, True], ids=["torchscript", "dynamo"])
def trained(request, tmp_path_factory):
    """Both sides trained 10 steps from the same exported weights, dropout off (p=0)."""
    path = tmp_path_factory.mktemp("founding") / "net.onnx"
    net = export(path, dynamo=request.param, dropout=0.0)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = compile_sgd(anygrad.load_onnx(path, init="onnx"))
    ours, theirs = [], []
    for x, y in batches():
        ours.append(model.train_on_batch(x, y))
        opt.zero_grad()
        loss = F.nll_loss(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    return path, net, model, np.array(ours), np.array(theirs)


def test_losses_match_pytorch(trained):
    _, _, _, ours, theirs = trained
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)


def test_trains_on_torch_cpu_like_numpy_and_pytorch(trained, one_torch_thread):
    """The same 10 steps on torch:cpu (the PyTorch backend): numpy's losses and state to float32
    noise, and so PyTorch's (weights to the same 1e-3 of their scale as numpy's against PyTorch's
    own training: PyTorch's CPU convolutions sum in another order than numpy's, e.g. on an AMD EPYC
    host with torch 2.14.1, conv1's weight ended 2.7e-4 of its scale away)."""
    path, _, model, ours, theirs = trained
    on_torch = anygrad.load_onnx(path, init="onnx").compile(
        loss="nll", optimizer=anygrad.optim.SGD(lr=0.1, momentum=0.9), device="torch:cpu")
    losses = np.array([on_torch.train_on_batch(x, y) for x, y in batches()])
    np.testing.assert_allclose(losses, ours, rtol=2e-5)
    np.testing.assert_allclose(losses, theirs, rtol=1e-4)
    want, got = model.state_dict(), on_torch.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert_close_to_scale(got[name], want[name], state_tolerance(name), name)


def state_tolerance(name: str) -> float:
    """Running statistics to 1e-4 of their scale; weights moved by O(1) in 10 steps of lr 0.1 with
    momentum, and float32 rounding differences through 3 convolutions leave them within 1e-3."""
    return 1e-4 if name.endswith(("running_mean", "running_var")) else 1e-3


def assert_close_to_scale(actual: np.ndarray, expected: np.ndarray, tol: float, name: str) -> None:
    """max |actual - expected| <= tol * max |expected| (float32 training drifts in absolute terms)."""
    assert actual.shape == expected.shape, name
    err, scale = np.abs(actual - expected).max(), np.abs(expected).max()
    assert err <= tol * scale, f"{name}: max difference {err:.3g} exceeds {tol} x {scale:.3g}"


def test_state_after_training_matches_pytorch(trained):
    _, net, model, _, _ = trained
    expected = torch_state(net)
    state = model.state_dict()
    for onnx_name, tname in model.origin.torch_names.items():
        value = state[onnx_name].T if tname.transpose else state[onnx_name]
        assert_close_to_scale(value, expected[tname.key], state_tolerance(tname.key), onnx_name)
    # every running statistic is known by its PyTorch name
    assert {n.key for n in model.origin.torch_names.values()} >= {
        f"norm{i}.{s}" for i in (1, 2) for s in ("running_mean", "running_var")}


def test_saved_onnx_matches_predict_and_pytorch(trained, tmp_path):
    _, net, model, _, _ = trained
    out = anygrad.save_onnx(model, tmp_path / "trained.onnx")
    x = next(batches())[0][:5]
    ours = model.predict(x)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x})[0], ours, rtol=1e-5, atol=1e-5)
    # an inference file, as PyTorch's eval export writes it: no Dropout left (the TorchScript
    # export has one; dynamo's spells dropout out in other ops)
    assert "Dropout" not in {n.op_type for n in onnx.load(str(out)).graph.node}
    net.eval()
    with torch.no_grad():
        assert_close_to_scale(ours, net(torch.from_numpy(x)).numpy(), 1e-3, "log_probs")


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_untrained_predict_matches_pytorch_eval(tmp_path, dynamo):
    """Training-mode export; predict runs it in inference mode, like net.eval()."""
    path = tmp_path / "net.onnx"
    net = export(path, dynamo=dynamo).eval()
    x = np.random.default_rng(3).standard_normal((2, 1, 28, 28)).astype(np.float32)
    model = compile_sgd(anygrad.load_onnx(path))
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-5, atol=1e-5)
    out = anygrad.save_onnx(model, tmp_path / "out.onnx")
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x})[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_default_eval_export_imports_and_trains(tmp_path, dynamo):
    """A plain eval-mode export (BatchNorm possibly folded, Dropout dropped) still loads and trains."""
    path = tmp_path / "eval.onnx"
    net = export_eval_default(path, dynamo)
    model = compile_sgd(anygrad.load_onnx(path))
    assert "Dropout" not in model.graph.op_histogram()
    bn = [n for n in model.graph.nodes if n.op == "BatchNormalization"]
    for node in bn:  # running statistics are state of their own, never a merged parameter
        assert node.inputs[3] in model.graph.buffers and node.inputs[4] in model.graph.buffers
        assert not {node.inputs[3], node.inputs[4]} & set(model.graph.params)
    x = np.random.default_rng(4).standard_normal((2, 1, 28, 28)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(model.predict(x), net(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)
    x, y = next(batches())
    assert np.isfinite(model.train_on_batch(x, y))


def test_fresh_init_matches_pytorch_initialisation():
    model = anygrad.load_onnx(FOUNDING_MODEL, init="fresh", seed=7)
    original = anygrad.load_onnx(FOUNDING_MODEL).graph.initializers
    torch.manual_seed(123)
    reference = torch_state(Net())
    names = model.origin.torch_names
    state = model.state_dict()
    assert set(state) == set(names)
    for onnx_name, tname in names.items():
        ours, theirs = state[onnx_name], reference[tname.key]
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        if tname.key.startswith("norm"):  # ones and zeros, exactly
            np.testing.assert_array_equal(ours, theirs, err_msg=onnx_name)
            continue
        assert not np.array_equal(ours, original[onnx_name]), onnx_name
        bound = np.abs(theirs).max()
        assert np.abs(ours).max() <= bound * 1.05 + 1e-7, onnx_name
        if ours.size >= 200:
            assert abs(ours.std() / theirs.std() - 1) < 0.1, onnx_name
            assert abs(ours.mean()) < 0.1 * bound, onnx_name
            assert np.abs(ours).max() > 0.95 * bound, onnx_name


def test_packaged_model_is_the_seeded_pytorch_model():
    assert FOUNDING_MODEL.is_file()
    assert (EXAMPLE / "mnist.onnx").resolve() == FOUNDING_MODEL.resolve()
    torch.manual_seed(0)
    expected = torch_state(Net())
    model = anygrad.load_onnx(FOUNDING_MODEL)
    assert model.num_parameters() == sum(v.size for k, v in expected.items() if "running" not in k
                                         and "num_batches" not in k)
    for onnx_name, tname in model.origin.torch_names.items():
        np.testing.assert_array_equal(model.graph.initializers[onnx_name], expected[tname.key])
    hist = model.graph.op_histogram()
    assert hist["BatchNormalization"] == 2 and hist["Dropout"] == 1 and hist["Conv"] == 3


def test_summary_of_packaged_model():
    s = anygrad.frontends.summarize(FOUNDING_MODEL)
    assert s.supported and s.opset == 17 and s.producer == "pytorch"
    assert [(t.name, t.shape) for t in s.inputs] == [("input", ("batch", 1, 28, 28))]
    assert [(t.name, t.shape) for t in s.outputs] == [("log_probs", ("batch", 10))]
    torch.manual_seed(0)
    net = Net()
    assert s.num_parameters == sum(p.numel() for p in net.parameters())
    assert s.num_buffers == sum(b.numel() for n, b in net.named_buffers() if "running" in n)
    assert s.op_histogram == {"Relu": 4, "Conv": 3, "BatchNormalization": 2, "Gemm": 2, "Dropout": 1,
                              "Flatten": 1, "LogSoftmax": 1}


def test_the_issue_api_snippet_runs_as_written():
    """The entry points as the founding write-up spells them (anygrad.optim.AdaGrad included)."""
    import anygrad
    import anygrad.optim
    from anygrad.examples import FOUNDING_MODEL

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    model = anygrad.load_onnx(str(FOUNDING_MODEL), init="fresh")
    model.compile(loss="nll", optimizer=anygrad.optim.AdaGrad(lr=1.0), device="cpu")
    before = model.predict(x)
    loss = model.train_on_batch(x, y)
    out = model.predict(x)
    assert isinstance(loss, float) and np.isfinite(loss)
    assert out.shape == (16, 10) and not np.allclose(out, before)  # parameters were updated
    np.testing.assert_allclose(np.exp(out).sum(1), 1, rtol=1e-5)  # log-probabilities, eval mode
