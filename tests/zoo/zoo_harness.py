"""Shared machinery of the zoo: export a family with either PyTorch exporter, train it eight SGD
steps in PyTorch (the reference) and in anygrad, from the same weights on the same batches."""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from zoo_models import Family

import anygrad

STEPS = 8
EXPORTERS = ("torchscript", "dynamo")


def export(family: Family, path: Path, exporter: str, seed: int = 0) -> torch.nn.Module:
    """Write a seeded instance of the family to `path` in training mode; return the PyTorch model,
    whose state equals the file's.

    Tracing in training mode runs forward passes, which move BatchNorm's running statistics (no
    parameter); the pristine values are written back into the file, as examples/mnist/export.py does.
    """
    torch.manual_seed(seed)
    model = family.make().train()
    pristine = copy.deepcopy(model.state_dict())
    example = torch.from_numpy(family.batches(1, seed=123)[0][0])
    dynamo = exporter == "dynamo"
    options = {"optimize": False} if dynamo else {}  # the dynamo optimizer fuses BatchNorm away
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (example,), str(path), dynamo=dynamo, opset_version=17,
            training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
            input_names=["input"], output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "rows"}}, **options,
        )
    model.load_state_dict(pristine)
    _restore_initializers(path, pristine)
    return model


def _restore_initializers(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Overwrite the initializers named like state_dict entries with the given values."""
    proto = onnx.load(str(path))
    external = any(t.data_location == onnx.TensorProto.EXTERNAL
                   for t in onnx.load(str(path), load_external_data=False).graph.initializer)
    changed = False
    for t in proto.graph.initializer:
        if t.name in state:
            value = state[t.name].numpy()
            if not np.array_equal(numpy_helper.to_array(t), value):
                t.CopyFrom(numpy_helper.from_array(value, t.name))
                changed = True
    if changed:
        onnx.save_model(proto, str(path), save_as_external_data=external, location=f"{path.name}.data")


@dataclass
class Trajectory:
    losses: np.ndarray          # loss of each step, before its update
    model: object               # the trained model (torch.nn.Module or anygrad.Model)


def torch_trajectory(family: Family, model: torch.nn.Module) -> Trajectory:
    """The reference: STEPS plain SGD steps on a copy of `model`."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=family.lr)
    losses = []
    for x, y in family.batches(STEPS):
        opt.zero_grad()
        loss = family.torch_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return Trajectory(np.array(losses), model.eval())


def anygrad_trajectory(family: Family, path: Path, device) -> Trajectory:
    model = anygrad.load_onnx(path).compile(loss=family.loss, optimizer=anygrad.optim.SGD(lr=family.lr),
                                            device=device)
    return Trajectory(np.array([model.train_on_batch(x, y) for x, y in family.batches(STEPS)]), model)


def torch_predict(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(x)).numpy()
