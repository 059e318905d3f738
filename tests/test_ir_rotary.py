"""The rotate_half fusion pass (ir/rotary.py): rotary embeddings' written-out half rotation becomes
one RotateHalf node, and training through it matches PyTorch on the numpy and wgpu backends;
Concats that are not a rotate_half stay as they are."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fusion_util import trains_like_pytorch as _trains_like_pytorch

import anygrad
from anygrad.program import training_forward


def rotate_half(x):  # as transformers writes it
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def mirrored(x):  # cat(x2, -x1): RotateHalf with sign -1
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def not_halves(x):  # thirds: left written out
    return torch.cat((-x[..., 4:], x[..., :4]), dim=-1)


def read_elsewhere(x):  # x2 is also read by the output: left written out
    x1, x2 = x[..., :3], x[..., 3:]
    return torch.cat((-x2, x1), dim=-1) + x2.sum()


class Rope(torch.nn.Module):
    """A Linear, then x * cos + rotate(x) * sin over heads of 6 (cos and sin fixed), then a Linear."""

    def __init__(self, rotate):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.rotate = torch.nn.Linear(6, 12), torch.nn.Linear(12, 3), rotate
        angles = torch.arange(3.0)[:, None] * torch.tensor([1.0, 0.5, 0.25]).repeat(2)[None]
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x):
        h = self.fc1(x).reshape(x.shape[0], 2, 6)
        h = h * self.cos[:2] + self.rotate(h) * self.sin[:2]
        return self.fc2(h.reshape(x.shape[0], 12))


def _model(rotate):
    module = Rope(rotate)
    return anygrad.from_torch(module, torch.zeros(4, 6), check=False), module


def _ops(model) -> dict:
    return training_forward(model.graph, {model.graph.inputs[0]: (4, 6)}).op_histogram()


@pytest.mark.parametrize("rotate", [rotate_half, mirrored], ids=["rotate_half", "mirrored"])
def test_rotate_half_becomes_one_node_and_trains_like_pytorch(rotate):
    model, module = _model(rotate)
    ops = _ops(model)
    assert ops.get("RotateHalf") == 1 and "Concat" not in ops and "Neg" not in ops, ops
    _trains_like_pytorch(model, module, "cpu")


@pytest.mark.wgpu
def test_fused_rotate_half_trains_like_pytorch_on_wgpu():
    from wgpu_util import wgpu_backend
    wgpu_backend()  # skips without an adapter
    model, module = _model(rotate_half)
    _trains_like_pytorch(model, module, "wgpu", rtol=1e-4)


@pytest.mark.parametrize("rotate", [not_halves, read_elsewhere], ids=["not-halves", "read-elsewhere"])
def test_concats_that_differ_stay_written_out_and_still_train(rotate):
    model, module = _model(rotate)
    ops = _ops(model)
    assert "RotateHalf" not in ops and "Concat" in ops, ops
    _trains_like_pytorch(model, module, "cpu")


def test_the_switch_keeps_the_written_out_form(monkeypatch):
    monkeypatch.setenv("ANYGRAD_FUSE_ROTARY", "0")
    model, _ = _model(rotate_half)
    assert "RotateHalf" not in _ops(model)
