"""`anygrad.from_torch(module, example_input)`: a PyTorch module straight to a trainable Model.

The only place in anygrad that imports torch, lazily: everything else works from ONNX files and
numpy. The module is exported in training mode (BatchNorm and Dropout kept, no constant folding,
so every parameter stays an initializer), imported, and given the module's own state_dict, which
also teaches the model every PyTorch name for `to_torch_state_dict` (tied weights included: the
state_dict is copied with its shared storages, so both names of a tied tensor stay one tensor).
"""
from __future__ import annotations

import copy
import inspect
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.numpy import NumpyBackend
from ..errors import AnygradError, ConfigError, ModelError
from ..model import Model
from ..program import build_inference
from .onnx_import import load_onnx
from .torch_weights import (
    binding_of,
    load_state_dict,
    placeholder_path,
    read_state_dict,
    recorded_names,
)

DEFAULT_OPSET = 17  # the TorchScript exporter's
# The dynamo exporter builds opset 18 and down-converts to an older one with onnx's version
# converter, which fails on a training-mode ResNet (ReduceMean axes that are not constants) and
# prints that failure's traceback, though the export goes on: so it is asked for its own opset.
DYNAMO_OPSET = 18


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


def _export(module: Any, args: tuple, kwargs: dict, path: Path, dynamo: bool, opset: int,
            input_names: list[str], output_names: list[str]) -> None:
    torch = _torch()
    axes = {n: {0: "batch"} for n in input_names + output_names}
    options = {"optimize": False} if dynamo else {}  # the dynamo optimizer fuses BatchNorm into Gemm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation and tracer notes about the exporter, not the model
        torch.onnx.export(module, args, str(path), kwargs=kwargs or None, dynamo=dynamo, opset_version=opset,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=input_names, output_names=output_names, dynamic_axes=axes, **options)


def _examples(module: Any, example_input: Any) -> tuple[tuple, dict, list[str]]:
    """(positional examples, keyword examples, graph input names): inputs are named after the
    forward's parameters (`forward(self, ids, mask)` -> 'ids', 'mask'), keyword examples by their
    keys, in the order forward declares them."""
    if isinstance(example_input, Mapping):
        kwargs, args = dict(example_input), ()
    else:
        args = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
        kwargs = {}
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):  # a forward without a signature (a C extension, a wrapped call)
        params = []
    positional = [p.name for p in params if p.kind != p.KEYWORD_ONLY]
    names = positional[:len(args)] if len(positional) >= len(args) else [f"input{i}" for i in range(len(args))]
    unknown = [k for k in kwargs if k not in {p.name for p in params}]
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in inspect.signature(module.forward).parameters.values()):
        raise ConfigError(f"from_torch: {type(module).__name__}.forward takes no argument named "
                          f"{', '.join(map(repr, unknown))}; it takes {', '.join(p.name for p in params) or 'none'}")
    order = {p.name: i for i, p in enumerate(params)}
    names += sorted(kwargs, key=lambda k: order.get(k, len(order)))
    return args, kwargs, names


def _feeds(args: tuple, kwargs: dict, names: list[str]) -> dict[str, np.ndarray]:
    values = list(args) + [kwargs[k] for k in names[len(args):]]
    return {n: v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v) for n, v in zip(names, values)}


def from_torch(module: Any, example_input: Any, *, dynamo: bool = True, opset: int | None = None,
               path: str | os.PathLike | None = None, output_name: str | Sequence[str] = "output",
               check: bool = True) -> Model:
    """Export `module` (an nn.Module) to ONNX in training mode and import it as a trainable Model
    with the module's current weights.

    `example_input` is one tensor, a tuple of them (the forward's positional arguments) or a dict
    of keyword arguments, each with a batch dim of 2 or more (BatchNorm cannot normalise one
    sample in training mode); the batch dim stays symbolic. Graph inputs are named after the
    forward's parameters (`forward(self, ids, mask)` gives inputs 'ids' and 'mask'). `dynamo`
    (default) picks the torch.export-based exporter, which torch 2.9+ makes its default and which
    exports what TorchScript cannot (Hugging Face Llama, Qwen, GPT-2); dynamo=False the deprecated
    TorchScript one. `opset`: the ONNX opset to export (default 18 with dynamo, its own, and
    17 without). With `path` the ONNX file is kept there, else it is
    temporary. Outputs: one tensor is named `output_name`; a dict (a Hugging Face ModelOutput)
    of several tensors gives outputs named by its keys ('loss', 'logits'); a tuple of several
    'output', 'output1', ...; a list `output_name` names them all. The module is left as it was (its mode and state, which tracing in training mode
    moves).

    What ONNX cannot say is carried from the module: buffers are not trained, and an
    `nn.Embedding(padding_idx=i)` passes no gradient to row i. With `check` (default), the
    imported model's inference output is compared with the module's in eval mode on the example
    input; a difference beyond float32 noise is a ModelError naming the first parameter that
    differs, so a wrongly bound model is never trained silently."""
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"from_torch needs a torch.nn.Module, not {type(module).__name__}")
    args, kwargs, input_names = _examples(module, example_input)
    output_names = _output_names(module, args, kwargs, output_name)
    pristine = copy.deepcopy(module.state_dict())  # deepcopy keeps tied tensors sharing one storage
    modes = {m: m.training for m in module.modules()}  # submodules may differ (a frozen BatchNorm in eval)
    with tempfile.TemporaryDirectory(prefix="anygrad-") as tmp:
        file = Path(path) if path is not None else Path(tmp) / "model.onnx"
        module.train(True)
        try:
            _export(module, args, kwargs, file, dynamo, opset or (DYNAMO_OPSET if dynamo else DEFAULT_OPSET),
                    input_names, output_names)
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
    binding_of(model).extra.update({k: state[k] for k in result.unexpected})
    _carry_padding_idx(model, module)
    if check:
        _check_forward(model, module, args, kwargs, input_names, state)
    return model


def _eval_forward(module: Any, args: tuple, kwargs: dict) -> Any:
    """The module's output in eval mode without gradients; its modes are restored."""
    torch = _torch()
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with torch.no_grad():
            return module(*args, **kwargs)
    finally:
        for m, training in modes.items():
            m.training = training


def _entries(out: Any) -> list[tuple[str | None, Any]]:
    """The top-level (key, value) pairs of an output structure: keys for dicts (None values
    left out, as exporters do), None for positions; one pair for a lone tensor."""
    if isinstance(out, Mapping):
        return [(str(k), v) for k, v in out.items() if v is not None]
    if isinstance(out, (tuple, list)):
        return [(None, v) for v in out]
    return [(None, out)]


def _output_names(module: Any, args: tuple, kwargs: dict, output_name: str | Sequence[str]) -> list[str]:
    """Graph output names (see from_torch's docstring)."""
    if not isinstance(output_name, str):
        names = [str(n) for n in output_name]
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"from_torch: output_name needs distinct names, got {list(output_name)}")
        return names
    pairs = _entries(_eval_forward(module, args, kwargs))
    if len(pairs) == 1 or not all(hasattr(v, "detach") for _, v in pairs):  # one, or nested (caches)
        return [output_name]
    if all(k is not None for k, _ in pairs):
        return [k for k, _ in pairs]
    return [output_name] + [f"{output_name}{i}" for i in range(1, len(pairs))]


def _graph_names_of(model: Model) -> dict[str, str]:
    """PyTorch key -> graph name, for every name the model knows a graph tensor by (tied aliases too)."""
    out = {k: g for g, keys in model.parameter_aliases().items() for k in keys}
    for g in model.graph.buffers:
        out.setdefault(g, g)
    for key, same in binding_of(model).aliases.items():
        if same in out:
            out.setdefault(key, out[same])
    return out


def _carry_padding_idx(model: Model, module: Any) -> None:
    """nn.Embedding(padding_idx): the exported Gather cannot say that row gets no gradient."""
    torch = _torch()
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    graph_name = _graph_names_of(model)
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None:
            tables = {graph_name[k] for k in names_of.get(id(m.weight), []) if k in graph_name}
            for table in sorted(tables):  # none: the forward never looks this table up
                model.set_padding_idx(table, m.padding_idx)


def _check_forward(model: Model, module: Any, args: tuple, kwargs: dict, input_names: list[str],
                   state: dict[str, np.ndarray]) -> None:
    """The imported model's inference output against the module's, in eval mode, on the examples."""
    pairs = _entries(_eval_forward(module, args, kwargs))
    expected = pairs[0][1] if pairs else None
    if not hasattr(expected, "detach"):
        return  # an output structure the graph does not mirror: nothing to compare
    expected = expected.detach().cpu().double().numpy()
    feeds = _feeds(args, kwargs, input_names)
    graph = build_inference(model.graph, {n: tuple(v.shape) for n, v in feeds.items()})
    got = NumpyBackend().compile(graph).run(feeds)[graph.outputs[0]]
    if got.shape != expected.shape:
        raise ModelError(f"from_torch: {type(module).__name__} returns shape {expected.shape} in eval mode, "
                         f"but the imported model returns {got.shape}")
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    diff = float(np.abs(got.astype(np.float64) - expected).max(initial=0.0))
    if not diff <= FORWARD_TOLERANCE * scale:
        raise ModelError(f"from_torch: the imported {type(module).__name__} differs from the module by {diff:.3g} "
                         f"on the example input (float32 noise is below {FORWARD_TOLERANCE * scale:.1g}): "
                         f"{_first_difference(model, state)}. Please report this with the model's code")


FORWARD_TOLERANCE = 1e-4  # relative to the output's scale: float32 noise through deep models stays far below


def _first_difference(model: Model, state: dict[str, np.ndarray]) -> str:
    """The first graph tensor whose bound value is not the module's tensor (or why none is)."""
    names = recorded_names(model)
    for g in model.graph.state_names:
        tn = names.get(g)
        if tn is None or tn.key not in state:
            continue
        ours = model.graph.initializers[g]
        theirs = np.asarray(state[tn.key])
        theirs = theirs.T if tn.transpose and theirs.ndim == 2 else theirs
        if ours.shape != theirs.shape or not np.array_equal(ours, theirs.astype(ours.dtype)):
            return f"parameter '{tn.key}' (ONNX '{g}') is bound differently from the module's tensor"
    return "every parameter holds the module's values, so an op computes differently"


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
