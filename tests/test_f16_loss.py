"""Mixed precision (issue 13, f16 memory): the fused cross-entropy reads the float16 logits.

With ANYGRAD_F16_LOSS_READS_HALF on (the default) the f16 training step feeds CrossEntropyMetrics
and CrossEntropyGrad the float16 head output instead of autocast's float32 copy of it: the loss
and metrics are computed in float32 (f16 -> f32 is exact) and the logits' gradient is written in
float16. The old graph computed the same float32 gradient and rounded it to float16 in the Cast's
backward, so both graphs round the same number once: on/off losses agree bit for bit on numpy and
torch:cpu. On wgpu the old graph fuses the head's bias add into the float32 Cast, skipping the
float16 rounding of the logits that numpy and torch make; reading the float16 logits brings that
rounding back, so wgpu "on" agrees with numpy to 1e-6 relative and with wgpu "off" to 5e-5 (the
size of one skipped f16 rounding in a loss of ~2). Against torch.autocast + GradScaler the
tolerances of test_precision.py hold.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_precision import _data, _ours, _pair, _torch_autocast_losses, _train_exe
from wgpu_util import wgpu_backend

import anygrad
from anygrad import nn
from anygrad.ir import Builder, Graph, TensorInfo
from anygrad.program import F16_LOSS_ENV, loss_reads_half

STEPS = 5
B, T, D, V = 2, 3, 4, 7  # the token-level case: logits (B, T, V), labels (B, T)


def _check_on_off(device: str, model, on, off, run) -> None:
    """The tolerances of the module docstring; on wgpu every kernel reads the float16 logits itself
    (halfstore.py rewrote its bindings: no f32 conversion copy beside it)."""
    if device == "wgpu":
        np.testing.assert_allclose(on, run("cpu", True)[1], rtol=1e-6, atol=0)
        assert not [st.kernel.name for st in _train_exe(model).plan.steps if ":to_f" in st.kernel.name]
        np.testing.assert_allclose(on, off, rtol=5e-5, atol=0)
    else:
        np.testing.assert_array_equal(on, off)


def _device(name: str):
    return wgpu_backend() if name == "wgpu" else name  # a fresh backend per model


def _float32_values_of(g: Graph, shapes) -> list[str]:
    return [o for n in g.nodes for o in n.outputs
            if o and g.info[o].dtype == np.float32 and tuple(g.info[o].shape) in shapes]


def _mlp_run(device: str, reads_half: bool, monkeypatch):
    monkeypatch.setenv(F16_LOSS_ENV, "1" if reads_half else "0")
    _, model = _pair("mlp")
    return _ours(model, _device(device), steps=STEPS)


# -- a classifier: on == off, and both follow torch autocast ---------------------------------------------
DEVICES = ["cpu", "torch:cpu", pytest.param("wgpu", marks=pytest.mark.wgpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_reading_the_float16_logits_trains_like_the_float32_copy(device, monkeypatch):
    on_model, on = _mlp_run(device, True, monkeypatch)
    _, off = _mlp_run(device, False, monkeypatch)
    _check_on_off(device, on_model, on, off, lambda d, f: _mlp_run(d, f, monkeypatch))
    theirs, _ = _pair("mlp")
    want = _torch_autocast_losses(theirs, "mlp", STEPS)
    np.testing.assert_allclose(on, want, rtol=1e-4 if device == "cpu" else 1e-3, atol=1e-4)
    for k, v in _mlp_run("cpu", False, monkeypatch)[0].state_dict().items():
        np.testing.assert_allclose(on_model.state_dict()[k], v, rtol=2e-3, atol=2e-4, err_msg=k)


def test_the_step_has_no_float32_logits_and_no_float32_logits_gradient(monkeypatch):
    logits = (16, 4)  # _data("mlp"): 16 samples, 4 classes
    graphs = {flag: _train_exe(_mlp_run("cpu", flag, monkeypatch)[0]).graph for flag in (True, False)}
    g = graphs[True]
    assert not _float32_values_of(g, {logits}), _float32_values_of(g, {logits})
    loss = next(n for n in g.nodes if n.op == "CrossEntropyMetrics")
    grad = next(n for n in g.nodes if n.op == "CrossEntropyGrad")
    assert g.info[loss.inputs[0]].dtype == np.float16 and g.info[grad.inputs[1]].dtype == np.float16
    assert g.info[loss.outputs[0]].dtype == np.float32 and g.info[loss.outputs[1]].dtype == np.float32
    assert g.info[grad.outputs[0]].dtype == np.float16
    old = graphs[False]  # the A/B switch builds the old graph: the float32 copy and its gradient
    kinds = {next(n.op for n in old.nodes if v in n.outputs) for v in _float32_values_of(old, {logits})}
    assert kinds == {"Cast", "CrossEntropyGrad"}


def test_evaluate_after_training_is_the_same_with_the_switch_on_or_off(monkeypatch):
    """Validation runs in float32 (test_precision.py), so it has no float16 logits to read."""
    x, y = _data("mlp")
    got = [_mlp_run("cpu", flag, monkeypatch)[0].evaluate(x, y, batch_size=16) for flag in (True, False)]
    assert got[0] == got[1]


def test_a_cast_another_reader_needs_stays_and_the_loss_still_reads_half(monkeypatch):
    """A graph output (the logits for the user) keeps its float32 Cast; only the loss's edge moves."""
    g = Graph(name="t")
    g.inputs = ["h", "t"]
    g.info["h"] = TensorInfo(np.dtype(np.float16), (3, 5))
    g.info["t"] = TensorInfo(np.dtype(np.int64), (3,))
    b = Builder(g, prefix="x")
    wide = b.op("Cast", ["h"], to=1)
    loss = b.op("CrossEntropy", [wide, "t"], log_input=0, reduction="mean")
    g.outputs = [loss, wide]
    loss_reads_half(g)
    ce = next(n for n in g.nodes if n.op == "CrossEntropy")
    assert ce.inputs[0] == "h" and g.info[loss].dtype == np.float32
    assert any(n.op == "Cast" and n.outputs == [wide] for n in g.nodes)
    monkeypatch.setenv(F16_LOSS_ENV, "0")
    ce.inputs[0] = wide
    loss_reads_half(g)
    assert ce.inputs[0] == wide


@pytest.mark.parametrize("device", ["cpu", "torch:cpu"])
def test_float16_scores_compute_in_float32_in_every_kernel(device):
    """CrossEntropy (+ gradient) of float16 scores == of their float32 copy, the gradient rounded once."""
    from anygrad.autodiff import gradients
    from anygrad.backends import NumpyBackend
    from anygrad.backends.torch import TorchBackend
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 5)) * 4).astype(np.float16)
    t = rng.integers(0, 5, 6)
    out = {}
    for dtype in (np.float16, np.float32):
        g = Graph(name="ce")
        g.inputs = ["x", "t"]
        g.info["x"] = TensorInfo(np.dtype(dtype), x.shape)
        g.info["t"] = TensorInfo(np.dtype(np.int64), t.shape)
        b = Builder(g, prefix="ce")
        loss = b.op("CrossEntropy", ["x", "t"], log_input=0, reduction="mean", ignore_index=-100)
        dx = gradients(g, loss, ["x"])["x"]
        g.outputs = [loss, dx]
        exe = (NumpyBackend() if device == "cpu" else TorchBackend(device)).compile(g)
        got = exe.run({"x": x.astype(dtype), "t": t})
        out[dtype] = [np.asarray(got[v]) for v in g.outputs]
    (loss16, dx16), (loss32, dx32) = out[np.float16], out[np.float32]
    assert loss16.dtype == np.float32 and dx16.dtype == np.float16
    np.testing.assert_array_equal(loss16, loss32)
    np.testing.assert_array_equal(dx16, dx32.astype(np.float16))


# -- token-level logits (B, T, V): the (B*T, V) reshape moves to the float16 value -----------------------
def _lm_pair():
    torch.manual_seed(0)
    make = lambda mod: mod.Sequential(mod.Linear(D, 16), mod.ReLU(), mod.Linear(16, V))
    theirs, ours = make(torch.nn), make(nn)
    ours.load_state_dict({k: v.detach().numpy().copy() for k, v in theirs.state_dict().items()})
    return theirs, ours.to_model(input_shape=(None, T, D))


def _lm_data():
    rng = np.random.default_rng(1)
    return rng.standard_normal((B, T, D)).astype(np.float32), rng.integers(0, V, (B, T))


def _lm_run(device: str, reads_half: bool, monkeypatch):
    monkeypatch.setenv(F16_LOSS_ENV, "1" if reads_half else "0")
    _, model = _lm_pair()
    m = anygrad.Model(model.graph.copy()).compile("cross_entropy", anygrad.optim.SGD(lr=0.1, momentum=0.9),
                                                 device=_device(device), precision="f16")
    x, y = _lm_data()
    return m, [m.train_on_batch(x, y) for _ in range(STEPS)]


@pytest.mark.parametrize("device", DEVICES)
def test_token_level_logits_read_half_and_train_like_the_float32_copy(device, monkeypatch):
    m, on = _lm_run(device, True, monkeypatch)
    _, off = _lm_run(device, False, monkeypatch)
    _check_on_off(device, m, on, off, lambda d, f: _lm_run(d, f, monkeypatch))
    theirs, _ = _lm_pair()
    want = _torch_autocast_losses(theirs, "lm", STEPS, data=_lm_data(), flat=True)
    np.testing.assert_allclose(on, want, rtol=1e-3, atol=1e-4)
    if device == "cpu":
        g = _train_exe(m).graph
        assert not _float32_values_of(g, {(B, T, V), (B * T, V)})
        loss = next(n for n in g.nodes if n.op == "CrossEntropyMetrics")
        assert g.info[loss.inputs[0]].dtype == np.float16 and tuple(g.info[loss.inputs[0]].shape) == (B * T, V)
        assert "perplexity" in m.read_metrics()
