"""The RMSNorm fusion pass (ir/rmsnorm.py): written-out RMS normalisations (Hugging Face's
LlamaRMSNorm, nn.RMSNorm, a weightless one) become one RMSNormalization node, and training through
it matches PyTorch on the numpy and wgpu backends; chains that differ stay as they are."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fusion_util import trains_like_pytorch as _trains_like_pytorch

import anygrad
from anygrad.program import training_forward


class LlamaRMSNorm(torch.nn.Module):  # as transformers writes it
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d)), eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class Weightless(torch.nn.Module):  # x / sqrt(mean(x * x) + eps) over the last two dims
    def forward(self, x):
        x = x.reshape(x.shape[0], 2, 8)
        return (x / torch.sqrt((x * x).mean(dim=(-2, -1), keepdim=True) + 1e-5)).reshape(x.shape[0], 16)


class NotASuffix(torch.nn.Module):  # the mean over the first axis: not a norm over features
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)


class ReadElsewhere(torch.nn.Module):  # the mean square is also an output's term: left written out
    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6) + var


class Net(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(6, 16), norm, torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


NORMS = {"llama": lambda: LlamaRMSNorm(16), "nn.RMSNorm": lambda: torch.nn.RMSNorm(16, eps=1e-5),
         "weightless": Weightless}


def _model(make):
    module = Net(make())
    model = anygrad.from_torch(module, torch.zeros(4, 6), check=False)
    return model, module


def _ops(model) -> dict:
    return training_forward(model.graph, {model.graph.inputs[0]: (4, 6)}).op_histogram()


@pytest.mark.parametrize("norm", list(NORMS))
def test_written_out_rms_norm_becomes_one_node_and_trains_like_pytorch(norm):
    model, module = _model(NORMS[norm])
    ops = _ops(model)
    assert ops.get("RMSNormalization") == 1, ops
    assert not {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "Div"} & set(ops), ops
    _trains_like_pytorch(model, module, "cpu")


@pytest.mark.wgpu
def test_fused_rms_norm_trains_like_pytorch_on_wgpu():
    from wgpu_util import wgpu_backend
    wgpu_backend()  # skips without an adapter
    model, module = _model(NORMS["llama"])
    _trains_like_pytorch(model, module, "wgpu", rtol=1e-4)


@pytest.mark.parametrize("make", [NotASuffix, ReadElsewhere], ids=["not-a-suffix", "read-elsewhere"])
def test_chains_that_differ_stay_written_out_and_still_train(make):
    model, module = _model(make)
    ops = _ops(model)
    assert "RMSNormalization" not in ops and "ReduceMean" in ops, ops
    _trains_like_pytorch(model, module, "cpu")


def test_the_switch_keeps_the_written_out_form(monkeypatch):
    monkeypatch.setenv("ANYGRAD_FUSE_RMSNORM", "0")
    model, _ = _model(NORMS["llama"])
    assert "RMSNormalization" not in _ops(model)
