"""Normalisation inside the graph: feed uint8 images to the device, normalise there.

A uint8 batch is a quarter of the float32 bytes to upload; the prologue `Cast -> Sub -> Div`
computes (x - 255 mean) / (255 std) = (x / 255 - mean) / std per channel before the model's
first op. Use it with DataLoader batches left as uint8 (no transform).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError
from ..ir.graph import Node, TensorInfo, info_of
from ..model import Model
from ..ops._util import ONNX_CODES

PREFIX = "input_norm"


def add_input_normalisation(model: Model, mean: Sequence[float], std: Sequence[float]) -> Model:
    """Make `model` take uint8 NCHW images and normalise them per channel in the graph (in place).

    Call before `compile`. The float input keeps its name inside the graph; the new uint8 input
    is called '<input>_uint8'.
    """
    if model.backend is not None:
        raise ConfigError("add_input_normalisation changes the graph: call it before model.compile()")
    g = model.graph
    old = model.input_name
    info = g.info[old]
    shape = tuple(info.shape)
    channels = shape[1] if len(shape) >= 2 else None
    mean, std = np.asarray(mean, np.float64).ravel(), np.asarray(std, np.float64).ravel()
    if len(shape) != 4 or not isinstance(channels, int) or len(mean) not in (1, channels) or len(std) != len(mean):
        raise ConfigError(f"input normalisation needs an NCHW image input and one mean/std per channel; the model's "
                          f"input '{old}' has shape {shape}, got {len(mean)} means and {len(std)} stds")
    if np.any(std <= 0):
        raise ConfigError(f"std must be positive, got {std.tolist()}")
    new = g.fresh(f"{old}_uint8")
    g.info[new] = TensorInfo(np.dtype(np.uint8), shape)
    g.inputs[0] = new
    # Plain nodes, not a Builder: the batch dimension is still symbolic here; `specialize`
    # infers these shapes with the rest of the graph.
    mean_c, std_c = g.fresh(f"{PREFIX}.mean"), g.fresh(f"{PREFIX}.std")
    for name, value in ((mean_c, 255.0 * mean), (std_c, 255.0 * std)):
        g.initializers[name] = value.reshape(1, -1, 1, 1).astype(np.float32)
        g.info[name] = info_of(g.initializers[name])
    cast, centred = g.fresh(f"{PREFIX}.cast"), g.fresh(f"{PREFIX}.centred")
    prologue = [Node("Cast", [new], [cast], {"to": ONNX_CODES[np.dtype(np.float32)]}, g.fresh(f"{PREFIX}.Cast")),
                Node("Sub", [cast, mean_c], [centred], {}, g.fresh(f"{PREFIX}.Sub")),
                Node("Div", [centred, std_c], [old], {}, g.fresh(f"{PREFIX}.Div"))]
    g.nodes = prologue + g.nodes
    return model
