"""from_torch with what people's modules hold: parameters with requires_grad=False (frozen: no
gradient, no optimizer state, bit-identical after training, as in PyTorch), dict outputs named by
their keys, the exporter quiet unless asked, the other exporter tried when the first fails, and the
exporters' real causes when both fail. Every export here asks for dynamo first."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import anygrad
from anygrad.errors import ModelError
from anygrad.frontends.from_torch import exporter_cause

STEPS = 5


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.embed(x)))))


def frozen_net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = Net()
    net.embed.requires_grad_(False)  # a pretrained stem
    net.body.bias.requires_grad_(False)
    return net


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def torch_losses(net: torch.nn.Module, data, lr: float = 0.05, weight_decay: float = 0.1) -> list[float]:
    # every parameter goes to the optimizer, as a script's `AdamW(net.parameters())` does: those
    # without requires_grad get no gradient, so no update, no weight decay and no state
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    out = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def test_requires_grad_false_comes_in_frozen_and_trains_like_pytorch():
    net = frozen_net()
    ref = copy.deepcopy(net)
    data = batches()
    model = anygrad.from_torch(net, data[0][0])
    assert model.torch_binding.exporter == "dynamo"
    frozen_keys = {"embed.weight", "embed.bias", "body.bias"}
    named = model.parameter_aliases()  # graph name -> its names, the PyTorch key among them
    assert {k for g in model.frozen for k in named[g] if k in net.state_dict()} == frozen_keys
    assert model.num_frozen_parameters() == sum(p.numel() for p in net.parameters() if not p.requires_grad)
    assert model.num_parameters() == sum(p.numel() for p in net.parameters() if p.requires_grad)

    model.compile(loss="cross_entropy", optimizer=anygrad.optim.AdamW(lr=0.05, weight_decay=0.1), device="cpu")
    ours = [model.train_on_batch(x.numpy(), y.numpy()) for x, y in data]
    np.testing.assert_allclose(ours, torch_losses(ref, data), rtol=1e-5)

    state = model.to_torch_state_dict(as_numpy=True)
    for k, v in ref.state_dict().items():
        if k in frozen_keys:
            assert np.array_equal(state[k], v.numpy()), f"{k} moved"
        else:
            np.testing.assert_allclose(state[k], v.numpy(), rtol=1e-4, atol=1e-6, err_msg=k)
    slots = [k for k in model.full_state() if k.startswith("optim.") and k != "optim.step"]
    assert slots and not [k for k in slots if any(g in k for g in model.frozen)], slots
    assert net.embed.weight.requires_grad is False  # the module is left as it was


def test_save_adapters_writes_the_trainable_parameters_only(tmp_path):
    net = frozen_net()
    model = anygrad.from_torch(net, batches(1)[0][0])
    model.compile(optimizer=anygrad.optim.SGD(lr=0.1), device="cpu")
    x, y = batches(1)[0]
    model.train_on_batch(x.numpy(), y.numpy())
    path = model.save_adapters(tmp_path / "adapters")
    from safetensors.torch import load_file
    saved = load_file(path)
    assert set(saved) == {"body.weight", "head.weight", "head.bias"}
    trained = model.to_torch_state_dict()
    fresh = frozen_net()
    fresh.load_state_dict(saved, strict=False)  # the way back: onto the untouched base
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, trained[k]), k
    with pytest.raises(ModelError, match="overwrite=True"):
        model.save_adapters(tmp_path / "adapters")
    assert model.save_adapters(tmp_path / "adapters", overwrite=True) == path

    everything = anygrad.from_torch(Net(), x)
    with pytest.raises(ModelError, match="nothing in this model is frozen"):
        everything.save_adapters(tmp_path / "none")
    assert not (tmp_path / "none").exists()


class Heads(torch.nn.Module):
    def __init__(self, keys):
        super().__init__()
        self.keys = keys
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        return {k: h * (i + 1) for i, k in enumerate(self.keys)}


@pytest.mark.parametrize("keys", [("logits",), ("logits", "scores")])
def test_a_dict_names_the_outputs_by_its_keys_also_with_one_key(keys):
    torch.manual_seed(0)
    net = Heads(keys)
    x, y = batches(1)[0]
    model = anygrad.from_torch(net, x)
    assert model.output_names == list(keys)
    model.compile(loss={"logits": "cross_entropy"}, optimizer=anygrad.optim.SGD(lr=0.1), device="cpu")
    loss = model.train_on_batch(x.numpy(), {"logits": y.numpy()})
    assert loss == pytest.approx(torch.nn.functional.cross_entropy(net(x)["logits"], y).item(), rel=1e-5)


def test_the_exporter_is_quiet_unless_asked(capfd):
    x = batches(1)[0][0]
    anygrad.from_torch(Net(), x)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    anygrad.from_torch(Net(), x, verbose=True)
    out, err = capfd.readouterr()
    assert "[torch.onnx]" in out + err


class Branchy(torch.nn.Module):
    """Control flow on a tensor's value: torch.export cannot trace it, TorchScript follows the
    branch the example takes."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 5)

    def forward(self, x):
        h = self.fc(x)
        if h.abs().sum() >= 0:
            h = torch.relu(h)
        return h


class Hopeless(Branchy):
    def forward(self, x):
        h = self.fc(x)
        if h.abs().sum() >= 0:
            h = torch.diff(h, dim=1)  # no TorchScript symbolic for aten::diff
        return h


def test_dynamo_failing_falls_back_to_torchscript_in_one_line(capfd):
    torch.manual_seed(0)
    net = Branchy()
    x = batches(1)[0][0]
    model = anygrad.from_torch(net, x)
    assert model.torch_binding.exporter == "torchscript"
    out, err = capfd.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "dynamo exporter failed on Branchy" in lines[0] and "torchscript instead" in lines[0]
    assert "data-dependent" in lines[0] and "\x1b" not in lines[0]
    np.testing.assert_allclose(model.predict(x.numpy()), net(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_both_exporters_failing_gives_each_real_cause(capfd):
    with pytest.raises(ModelError) as e:
        anygrad.from_torch(Hopeless(), batches(1)[0][0])
    msg = str(e.value)
    assert "\x1b" not in msg
    assert "dynamo: GuardOnDataDependentSymNode" in msg and "data-dependent" in msg
    assert "if h.abs().sum() >= 0" in msg  # a later line of torch's message: not cut at the first
    assert "torchscript: UnsupportedOperatorError" in msg and "aten::diff" in msg
    assert "torch.export.export" in msg and "verbose=True" in msg and "load_onnx" in msg  # what to try
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.filterwarnings("ignore")
def test_the_cause_inside_torchs_export_error_is_found():
    """The dynamo exporter's own error is advice with colour codes; the cause is its __cause__.
    (from_torch passes dynamic_shapes and no longer meets this one: torch's dynamic_axes
    conversion of keyword inputs is what raised it.)"""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3)
    net = transformers.BertForSequenceClassification(cfg)
    feeds = {"input_ids": torch.randint(0, 100, (4, 10)), "attention_mask": torch.ones(4, 10, dtype=torch.long),
             "labels": torch.randint(0, 3, (4,))}
    names = list(feeds)
    try:
        torch.onnx.export(net, (), None, kwargs=feeds, dynamo=True, verbose=False, input_names=names,
                          dynamic_axes={n: {0: "batch"} for n in names})
    except Exception as e:  # noqa: BLE001  (torch's own exception type)
        error = e
    else:
        pytest.skip("this torch converts dynamic_axes of keyword inputs: no TorchExportError to read")
    assert "\x1b[" in str(error)
    cause = exporter_cause(error)
    assert cause.startswith("AssertionError: 4 not in VR[10, 10]") and "\x1b" not in cause
