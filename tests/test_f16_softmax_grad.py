"""Mixed precision (issue 13, f16 memory): a softmax's gradient reads the float16 probabilities.

Under autocast a softmax computes in float32 and its output is cast to float16 for the matmul
that reads it (attention's P @ V). With ANYGRAD_F16_SOFTMAX_GRAD_READS_HALF on (the default)
SoftmaxGrad reads that float16 copy, so the float32 probabilities live only until the cast.
Unlike the loss reading the float16 logits (an exact f16 -> f32 widening, test_f16_loss.py) this
rounds what the gradient reads, so on/off differ by float16 rounding: checked against each
other and against torch.autocast + GradScaler with test_precision.py's tolerances.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_precision import _torch_autocast_losses, _train_exe
from wgpu_util import wgpu_backend

import anygrad
from anygrad import nn
from anygrad.program import F16_SOFTMAX_GRAD_ENV

STEPS = 8


def _attention(mod):
    class Attention(mod.Module):
        """One head of self-attention over (B, T, 8), mean-pooled into 4 classes."""

        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = mod.Linear(8, 8), mod.Linear(8, 8), mod.Linear(8, 8)
            self.out = mod.Linear(8, 4)

        def forward(self, x):
            scores = (self.q(x) @ self.k(x).transpose(1, 2)) * 0.35
            return self.out((scores.softmax(-1) @ self.v(x)).mean(1))
    return Attention()


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((16, 5, 8)).astype(np.float32), rng.integers(0, 4, 16)


def _pair():
    torch.manual_seed(0)
    theirs, ours = _attention(torch.nn), _attention(nn)
    ours.load_state_dict({k: v.detach().numpy().copy() for k, v in theirs.state_dict().items()})
    return theirs, ours.to_model(input_shape=(None, 5, 8))


def _run(device: str, on: bool, monkeypatch):
    monkeypatch.setenv(F16_SOFTMAX_GRAD_ENV, "1" if on else "0")
    _, model = _pair()
    m = model.compile("cross_entropy", anygrad.optim.SGD(lr=0.1, momentum=0.9),
                      device=wgpu_backend() if device == "wgpu" else device, precision="f16")
    x, y = _data()
    return m, [m.train_on_batch(x, y) for _ in range(STEPS)]


def test_the_softmax_gradient_reads_the_float16_probabilities(monkeypatch):
    graphs = {on: _train_exe(_run("cpu", on, monkeypatch)[0]).graph for on in (True, False)}
    for on, g in graphs.items():
        grad = next(n for n in g.nodes if n.op == "SoftmaxGrad")
        probs = next(n for n in g.nodes if n.op == "Softmax").outputs[0]
        assert g.info[probs].dtype == np.float32  # the softmax itself computes in float32
        assert g.info[grad.inputs[1]].dtype == (np.float16 if on else np.float32)
        assert g.info[grad.outputs[0]].dtype == np.float32
        readers = [n.op for n in g.nodes if probs in n.inputs]
        # on: the float32 probabilities feed only their float16 cast, so they die in the forward pass
        assert sorted(readers) == (["Cast"] if on else ["Cast", "SoftmaxGrad"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("wgpu", marks=pytest.mark.wgpu)])
def test_training_follows_torch_autocast_with_the_switch_on_or_off(device, monkeypatch):
    theirs, _ = _pair()
    want = _torch_autocast_losses(theirs, "attention", STEPS, data=_data())
    on_model, on = _run(device, True, monkeypatch)
    _, off = _run(device, False, monkeypatch)
    np.testing.assert_allclose(on, want, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(off, want, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(on, off, rtol=1e-3, atol=1e-4)
    off_state = _run("cpu", False, monkeypatch)[0].state_dict()
    for k, v in on_model.state_dict().items():
        np.testing.assert_allclose(v, off_state[k], rtol=5e-3, atol=5e-4, err_msg=k)
