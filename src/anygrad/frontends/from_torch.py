"""`anygrad.from_torch(module, example_input)`: a PyTorch module straight to a trainable Model.

The only place in anygrad that imports torch, lazily: everything else works from ONNX files and
numpy. The module is exported in training mode (BatchNorm and Dropout kept, no constant folding,
so every parameter stays an initializer), imported, and given the module's own state_dict, which
also teaches the model every PyTorch name for `to_torch_state_dict` (tied weights included: the
state_dict is copied with its shared storages, so both names of a tied tensor stay one tensor).
"""
from __future__ import annotations

import copy
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AnygradError, ConfigError, ModelError
from ..model import Model
from .onnx_import import load_onnx
from .torch_weights import binding_of, load_state_dict, placeholder_path, read_state_dict, recorded_names

DEFAULT_OPSET = 17


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise AnygradError("this needs PyTorch, which is not installed: pip install anygrad[torch]") from None
    return torch


def to_torch_tensors(state: dict[str, np.ndarray]) -> dict[str, Any]:
    """numpy arrays -> torch tensors (copies), for `module.load_state_dict`."""
    torch = _torch()
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


def _export(module: Any, args: tuple, path: Path, dynamo: bool, opset: int,
            input_names: list[str], output_names: list[str]) -> None:
    torch = _torch()
    axes = {n: {0: "batch"} for n in input_names + output_names}
    options = {"optimize": False} if dynamo else {}  # the dynamo optimizer fuses BatchNorm into Gemm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation and tracer notes about the exporter, not the model
        torch.onnx.export(module, args, str(path), dynamo=dynamo, opset_version=opset,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=input_names, output_names=output_names, dynamic_axes=axes, **options)


def from_torch(module: Any, example_input: Any, *, dynamo: bool = False, opset: int = DEFAULT_OPSET,
               path: str | os.PathLike | None = None, input_name: str = "input",
               output_name: str = "output") -> Model:
    """Export `module` (an nn.Module) to ONNX in training mode and import it as a trainable Model
    with the module's current weights.

    `example_input` is one tensor (or a tuple of them) with a batch dim of 2 or more (BatchNorm
    cannot normalise one sample in training mode); the batch dim stays symbolic. `dynamo` picks the
    torch.export-based exporter. With `path` the ONNX file is kept there, else it is temporary.
    The module is left as it was (its mode and state, which tracing in training mode moves)."""
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"from_torch needs a torch.nn.Module, not {type(module).__name__}")
    args = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    input_names = [input_name] if len(args) == 1 else [f"{input_name}{i}" for i in range(len(args))]
    pristine = copy.deepcopy(module.state_dict())  # deepcopy keeps tied tensors sharing one storage
    modes = {m: m.training for m in module.modules()}  # submodules may differ (a frozen BatchNorm in eval)
    with tempfile.TemporaryDirectory(prefix="anygrad-") as tmp:
        file = Path(path) if path is not None else Path(tmp) / "model.onnx"
        module.train(True)
        try:
            _export(module, args, file, dynamo, opset, input_names, [output_name])
        except AnygradError:
            raise
        except Exception as e:  # the exporter fails in many ways: say which, and for which module
            raise ModelError(f"torch.onnx.export could not export {type(module).__name__}: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        finally:
            module.load_state_dict(pristine)
            for m, training in modes.items():
                m.training = training
        model = load_onnx(file)
    state = read_state_dict(pristine)  # tied tensors become one array under both names
    result = load_state_dict(model, state, strict=False)
    constants = _buffers_are_not_parameters(model, module, set(state))
    missing = [k for k in result.missing if k not in constants]
    if missing or result.mismatched:
        raise ModelError(f"from_torch: the exported graph of {type(module).__name__} does not match its "
                         f"state_dict: missing {missing}, mis-shaped {result.mismatched}")
    # Parameters the forward pass never uses are not in the graph; keep them so the exported
    # state_dict still loads into the module with strict=True.
    binding_of(model).extra = {k: state[k] for k in result.unexpected}
    return model


def _buffers_are_not_parameters(model: Model, module: Any, saved: set[str]) -> set[str]:
    """The importer calls every float initializer a gradient reaches a parameter; the module knows
    better. A persistent buffer (register_buffer: a positional table, a shift) becomes a graph
    buffer -- saved and exported, never moved by the optimizer -- and a non-persistent one, which no
    state_dict holds, a constant. Returns the graph names made constants."""
    graph = model.graph
    names = recorded_names(model)
    buffers = {k for k, _ in module.named_buffers()} - {k for k, _ in module.named_parameters()}
    transient = buffers - saved
    transient_paths = {k.replace(".", "_") for k in transient}  # as dynamo's placeholders spell them
    constants = set()
    for g in list(graph.params):
        key = names[g].key if g in names else g
        if key in buffers & saved:
            graph.params.remove(g)
            graph.buffers.append(g)
        elif key in transient or placeholder_path(key) in transient_paths:
            graph.params.remove(g)
            constants.add(g)
    return constants


__all__ = ["from_torch", "to_torch_tensors"]
