"""Edges of the anygrad.nn path: PyTorch names on export, torch's parameter order on
reassignment, the fixed-dims hint, and to_model's input_shape check."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn as tnn

import anygrad
from anygrad import nn
from anygrad.errors import ConfigError, ShapeError


def small_model() -> anygrad.Model:
    return nn.Sequential(nn.Linear(4, 3)).to_model(input_shape=(None, 4))


def test_an_nn_model_exports_under_its_pytorch_names_without_a_warning(tmp_path):
    model = small_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sd = model.to_torch_state_dict()
        model.save_safetensors(tmp_path / "m.safetensors")
    assert list(sd) == ["0.weight", "0.bias"]
    ref = tnn.Sequential(tnn.Linear(4, 3))
    ref.load_state_dict(sd, strict=True)
    np.testing.assert_array_equal(ref[0].weight.detach().numpy(), model.state_dict()["0.weight"])


def test_an_nn_model_round_trips_a_pytorch_state_dict():
    torch.manual_seed(0)
    ref = tnn.Sequential(tnn.Linear(4, 3))
    model = small_model()
    model.load_state_dict(ref.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sd = model.to_torch_state_dict(as_numpy=True)
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(sd[k], v.numpy())


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 3)
        self.l2 = nn.Linear(3, 2)


class TorchTwo(tnn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = tnn.Linear(4, 3)
        self.l2 = tnn.Linear(3, 2)


def test_reassigning_a_parameter_keeps_its_place_as_in_torch():
    ours, theirs = Two(), TorchTwo()
    ours.l1.weight = nn.Parameter(np.zeros((3, 4), np.float32))
    theirs.l1.weight = tnn.Parameter(torch.zeros(3, 4))
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert not np.asarray(ours.state_dict()["l1.weight"]).any()


def test_reassigning_a_submodule_keeps_its_place_as_in_torch():
    ours, theirs = Two(), TorchTwo()
    ours.l1 = nn.Linear(4, 3)
    theirs.l1 = tnn.Linear(4, 3)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_children()] == ["l1", "l2"]


def test_a_failed_reassignment_leaves_the_parameter_in_place():
    net = Two()
    with pytest.raises(anygrad.AnygradError, match="cannot replace"):
        net.l1.weight = 3
    assert [n for n, _ in net.named_parameters()] == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]


def test_a_fixed_size_says_what_the_input_takes_without_blaming_from_torch():
    model = small_model()
    model.compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.1), device="cpu")
    x, y = np.zeros((2, 5), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ShapeError) as e:
        model.train_on_batch(x, y)
    text = str(e.value)
    assert "takes shape (batch, 4), got (2, 5)" in text
    assert "takes size 4 on axis 1, the data has 5" in text
    assert "when the model was exported" not in text and "from_torch fixes" not in text
    assert "if the model came from from_torch" in text  # only as a condition


@pytest.mark.parametrize("shape", [5, 5.0, "5"])
def test_to_model_wants_a_tuple_input_shape(shape):
    with pytest.raises(ConfigError, match=r"input_shape must be a tuple .*like \(None, "):
        nn.Sequential(nn.Linear(4, 3)).to_model(input_shape=shape)


def test_to_model_takes_a_list_or_torch_size():
    assert small_model().graph.inputs
    nn.Sequential(nn.Linear(4, 3)).to_model(input_shape=[None, 4])
    nn.Sequential(nn.Linear(4, 3)).to_model(input_shape=torch.Size([2, 4]))
