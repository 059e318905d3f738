"""The tanh-GELU fusion pass (ir/gelu.py): written-out GELUs become one Gelu node, and training
through it matches PyTorch; chains that differ, or whose intermediates are read elsewhere, stay."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fusion_util import trains_like_pytorch as _trains_like_pytorch

import anygrad
from anygrad.program import training_forward

K = math.sqrt(2.0 / math.pi)


class Mlp(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.act = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def gelu_new(x):  # Hugging Face's GPT-2 activation, written out
    return 0.5 * x * (1.0 + torch.tanh(K * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_cubed(x):  # x^3 as products, the bracket on the left
    return (1.0 + torch.tanh(K * (0.044715 * (x * x * x) + x))) * x * 0.5


def _forward_ops(act) -> tuple[dict, anygrad.Model, torch.nn.Module]:
    module = Mlp(act)
    model = anygrad.from_torch(module, torch.zeros(4, 6), check=False)
    g = training_forward(model.graph, {model.graph.inputs[0]: (4, 6)})
    return g.op_histogram(), model, module


@pytest.mark.parametrize("act", [torch.nn.GELU(approximate="tanh"), gelu_new, gelu_cubed],
                         ids=["nn.GELU", "gelu_new", "cubed"])
def test_written_out_tanh_gelu_becomes_one_node_and_trains_like_pytorch(act):
    ops, model, module = _forward_ops(act)
    assert ops.get("Gelu") == 1 and "Tanh" not in ops and "Pow" not in ops
    _trains_like_pytorch(model, module, "cpu")
    np.testing.assert_allclose(model.state_dict()["fc1.weight"], module.fc1.weight.detach().numpy(),
                               rtol=1e-5, atol=1e-6)


def test_fused_and_written_out_gelu_agree_on_every_backend_step(monkeypatch):
    """The same steps with the pass off: the same losses to float32 noise."""
    losses = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ANYGRAD_FUSE_GELU", flag)
        _, model, _ = _forward_ops(gelu_new)
        model.compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.05, momentum=0.9), device="cpu")
        rng = np.random.default_rng(1)
        losses[flag] = [model.train_on_batch(rng.standard_normal((4, 6)).astype(np.float32),
                                             rng.standard_normal((4, 3)).astype(np.float32)) for _ in range(4)]
    np.testing.assert_allclose(losses["1"], losses["0"], rtol=1e-5)


def _not_quite(x):  # another constant: not a GELU
    return 0.5 * x * (1.0 + torch.tanh(K * (x + 0.05 * torch.pow(x, 3.0))))


class TwoReaders(torch.nn.Module):
    """The tanh's output is also an output of the model: the chain must stay."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 16)

    def forward(self, x):
        h = self.fc(x)
        t = torch.tanh(K * (h + 0.044715 * torch.pow(h, 3.0)))
        return 0.5 * h * (1.0 + t) + t


@pytest.mark.parametrize("module", [Mlp(_not_quite), TwoReaders()], ids=["constant", "shared-tanh"])
def test_chains_that_differ_stay_written_out(module):
    model = anygrad.from_torch(module, torch.zeros(4, 6), check=False)
    g = training_forward(model.graph, {model.graph.inputs[0]: (4, 6)})
    assert "Gelu" not in g.op_histogram() and "Tanh" in g.op_histogram()
    x = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(model.predict(x), module(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
