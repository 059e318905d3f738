"""`anygrad.from_torch(module, example_input)`: a PyTorch module straight to a trainable Model.

The only place in anygrad that imports torch, lazily: everything else works from ONNX files and
numpy. The module is exported in training mode (BatchNorm and Dropout kept, no constant folding,
so every parameter stays an initializer), imported, and given the module's own state_dict, which
also teaches the model every PyTorch name for `to_torch_state_dict` (tied weights included: the
state_dict is copied with its shared storages, so both names of a tied tensor stay one tensor).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.numpy import NumpyBackend
from ..errors import AnygradError, ConfigError, ModelError
from ..model import Model
from ..program import build_inference
from .onnx_import import load_onnx
from .torch_weights import (
    ADAPTER_CONFIG,
    AdapterFile,
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
        raise AnygradError("this needs PyTorch, which is not installed: pip install 'anygrad-train[torch]'") from None
    return torch


def to_torch_tensors(state: dict[str, np.ndarray]) -> dict[str, Any]:
    """numpy arrays -> torch tensors (copies), for `module.load_state_dict`."""
    torch = _torch()
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


EXPORTERS = ("dynamo", "torchscript")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # the dynamo exporter colours its messages
CAUSE_LINES = 30  # a cause longer than this is cut (with a count); torch's own summaries are far shorter


@dataclass
class Examples:
    """The example inputs as the exported graph takes them: every tensor is a graph input named
    after the forward's parameter (or the dict's key); other values (flags such as
    `return_dict=False`) are passed as given, so the trace bakes them in."""

    names: list[str]  # graph inputs, in order
    values: list[Any]  # their example tensors
    args: tuple  # the positional examples as the user gave them
    kwargs: dict[str, Any]  # the keyword examples as the user gave them
    positions: list[int | str]  # where each graph input goes: a positional index or a keyword

    def call(self, values: Sequence[Any]) -> tuple[tuple, dict]:
        """(args, kwargs) for the module, with `values` in place of the example tensors."""
        args, kwargs = list(self.args), dict(self.kwargs)
        for where, v in zip(self.positions, values):
            if isinstance(where, int):
                args[where] = v
            else:
                kwargs[where] = v
        return tuple(args), kwargs


def _examples(module: Any, example_input: Any) -> Examples:
    """Name the examples: positional ones after the forward's parameters (`forward(self, ids, mask)`
    -> 'ids', 'mask'), keyword ones by their keys, in the order forward declares them."""
    torch = _torch()
    if isinstance(example_input, Mapping):
        kwargs, args = dict(example_input), ()
    else:
        args = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
        kwargs = {}
    try:
        every = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature (a C extension, a wrapped call)
        every = []
    params = [p for p in every if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p.name for p in params if p.kind != p.KEYWORD_ONLY]
    arg_names = positional[:len(args)] if len(positional) >= len(args) else [f"input{i}" for i in range(len(args))]
    unknown = [k for k in kwargs if k not in {p.name for p in params}]
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in every):
        raise ConfigError(f"from_torch: {type(module).__name__}.forward takes no argument named "
                          f"{', '.join(map(repr, unknown))}; it takes {', '.join(p.name for p in params) or 'none'}")
    order = {p.name: i for i, p in enumerate(params)}
    keys = sorted(kwargs, key=lambda k: order.get(k, len(order)))
    slots = [(n, i, args[i]) for i, n in enumerate(arg_names)] + [(k, k, kwargs[k]) for k in keys]
    inputs = [(n, where, v) for n, where, v in slots if isinstance(v, torch.Tensor)]
    return Examples([n for n, _, _ in inputs], [v for _, _, v in inputs], args, kwargs,
                    [where for _, where, _ in inputs])


def _feeds(ex: Examples) -> dict[str, np.ndarray]:
    return {n: v.detach().cpu().numpy() for n, v in zip(ex.names, ex.values)}


@contextlib.contextmanager
def _positional(module: Any, ex: Examples):
    """While the exporter runs, the module's forward takes the graph inputs positionally, by
    name, and passes them on as the user's examples were passed. Both exporters then see one
    plain signature, whatever the real one is: a Hugging Face or peft `forward(*args, **kwargs)`
    gets its keywords (TorchScript drops keywords a signature does not name), and torch.export
    its dynamic shapes per input. The module itself is exported (an instance attribute shadows
    its forward, removed afterwards), so its tensors keep their state_dict names."""
    before = module.__dict__.get("forward", _ABSENT)  # an instance-level forward (accelerate's hooks)
    original = module.forward

    def forward(*values: Any) -> Any:
        args, kwargs = ex.call(values)
        return _graph_outputs(original(*args, **kwargs))

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ex.names])
    object.__setattr__(module, "forward", forward)
    try:
        yield module
    finally:
        if before is _ABSENT:
            del module.__dict__["forward"]
        else:
            object.__setattr__(module, "forward", before)


_ABSENT = object()


def _graph_outputs(out: Any) -> Any:
    """What the graph returns: a dict's (a ModelOutput's) tensors, in order, as a tuple; other
    entries (a DynamicCache, which neither exporter can return; tuples of hidden states) are left
    out. Anything else as the module returns it."""
    if isinstance(out, Mapping):
        return tuple(v for _, v in _entries(out))
    return out


def _export(module: Any, ex: Examples, path: Path, exporter: str, opset: int | None,
            output_names: list[str], verbose: bool, dynamic: dict[str, dict[int, str]] | None = None) -> None:
    torch = _torch()
    axes = {n: {0: "batch", **(dynamic or {}).get(n, {})} if v.dim() else None for n, v in zip(ex.names, ex.values)}
    if exporter == "dynamo":
        dims: dict[str, Any] = {}  # one torch.export.Dim per name: inputs that share a name share the size
        # dynamic_shapes, not dynamic_axes: torch converts dynamic_axes by position and fails on
        # keyword inputs ("Failed to convert 'dynamic_axes' to 'dynamic_shapes'", "4 not in VR[10, 10]")
        options = {"dynamic_shapes": tuple({a: dims.setdefault(d, torch.export.Dim(d)) for a, d in spec.items()}
                                           if spec else None for spec in axes.values()),
                   "optimize": False,  # the dynamo optimizer fuses BatchNorm into Gemm
                   "verbose": None if verbose else False}
    else:
        options = {"dynamic_axes": {n: {0: "batch", **(dynamic or {}).get(n, {})} for n in ex.names + output_names},
                   "verbose": False}
    with warnings.catch_warnings(), _quiet(not verbose), _positional(module, ex) as shim:
        warnings.simplefilter("ignore")  # deprecation and tracer notes about the exporter, not the model
        torch.onnx.export(shim, tuple(ex.values), str(path), dynamo=exporter == "dynamo",
                          opset_version=opset or (DYNAMO_OPSET if exporter == "dynamo" else DEFAULT_OPSET),
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=ex.names, output_names=output_names, **options)


def _dynamic_axes(dynamic: Any, ex: Examples) -> dict[str, dict[int, str]]:
    """from_torch's `dynamic`, checked: {input name: {axis: dim name}}, axes past the batch axis
    of the inputs the example has."""
    if dynamic is None:
        return {}
    if not isinstance(dynamic, Mapping):
        raise ConfigError(f"from_torch: dynamic takes {{input name: {{axis: name}}}}, such as "
                          f"{{'input_ids': {{1: 'seq'}}}}; got {type(dynamic).__name__}")
    shapes = {n: tuple(v.shape) for n, v in zip(ex.names, ex.values)}
    out: dict[str, dict[int, str]] = {}
    for name, spec in dynamic.items():
        if name not in shapes:
            raise ConfigError(f"from_torch: dynamic names {name!r}, which is no tensor input; the inputs are "
                              f"{', '.join(map(repr, shapes))}")
        if not isinstance(spec, Mapping):
            raise ConfigError(f"from_torch: dynamic[{name!r}] takes {{axis: name}}, such as {{1: 'seq'}}; "
                              f"got {spec!r}")
        rank = len(shapes[name])
        for axis, dim in spec.items():
            if not isinstance(axis, int) or isinstance(axis, bool) or not 1 <= axis < rank:
                raise ConfigError(f"from_torch: dynamic[{name!r}] axis {axis!r}: give an axis from 1 to {rank - 1} "
                                  f"of its shape {shapes[name]} (axis 0, the batch, is always dynamic)")
            if not isinstance(dim, str) or not dim.isidentifier() or dim == "batch":
                raise ConfigError(f"from_torch: dynamic[{name!r}][{axis}] names the dim, such as 'seq', not "
                                  f"{dim!r} ('batch' is axis 0's)")
        out[name] = dict(spec)
    return out


@contextlib.contextmanager
def _quiet(on: bool):
    """Silence stdout and stderr at the file-descriptor level while the exporter runs: it prints
    progress lines, and torch, onnx and the model's library print tracebacks and notes through
    print, logging handlers and C++, which no Python-level redirect reaches."""
    if not on:
        yield
        return
    saved = []
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        with open(os.devnull, "w") as null:
            for fd in (1, 2):
                saved.append((fd, os.dup(fd)))
                os.dup2(null.fileno(), fd)
    except (OSError, ValueError, AttributeError):  # no real descriptors (an embedding host): Python level only
        for fd, copy_fd in saved:
            os.dup2(copy_fd, fd)
            os.close(copy_fd)
        saved = []
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        for fd, copy_fd in saved:
            os.dup2(copy_fd, fd)
            os.close(copy_fd)


def exporter_cause(e: BaseException) -> str:
    """What went wrong inside the exporter, in words: the innermost exception of the chain (the
    dynamo exporter wraps the real cause, `AssertionError: 4 not in VR[10, 10]`, in a
    TorchExportError whose message is advice), without colour codes, every line of it."""
    chain = [e]
    while (nxt := chain[-1].__cause__ or (None if chain[-1].__suppress_context__ else chain[-1].__context__)) \
            is not None and nxt not in chain:
        chain.append(nxt)
    root = chain[-1]
    text = _ANSI.sub("", str(root)).strip()
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > CAUSE_LINES:
        lines = lines[:CAUSE_LINES] + [f"... ({len(lines) - CAUSE_LINES} more lines)"]
    cause = f"{type(root).__name__}: " + "\n    ".join(lines) if lines else type(root).__name__
    if root is not e:
        cause += f" (raised inside {type(e).__name__})"
    return cause


def _export_any(module: Any, ex: Examples, path: Path, first: str, opset: int | None,
                output_names: list[str], verbose: bool, dynamic: dict[str, dict[int, str]] | None = None) -> str:
    """Export with `first`, or else with the other exporter (saying so in one line); returns the
    exporter that wrote `path`. When both fail, a ModelError carries each one's cause."""
    causes = {}
    for exporter in (first, *[x for x in EXPORTERS if x != first]):
        try:
            _export(module, ex, path, exporter, opset, output_names, verbose, dynamic)
        except AnygradError:
            raise
        except Exception as e:  # noqa: BLE001  (the exporters fail in many ways: keep each one's cause)
            causes[exporter] = exporter_cause(e)
            continue
        if causes:
            failed = next(iter(causes))
            print(f"anygrad: from_torch: the {failed} exporter failed on {type(module).__name__} "
                  f"({causes[failed].splitlines()[0]}); exported with {exporter} instead", file=sys.stderr)
        return exporter
    name = type(module).__name__
    raise ModelError(
        f"torch.onnx.export could not export {name} with either exporter:\n"
        + "\n".join(f"  {x}: {c}" for x, c in causes.items())
        + f"\nTo try: make {name} export with torch.export.export(module, args, kwargs) (the dynamo exporter's "
        "first step; https://pytorch.org/docs/stable/export.html); pass the inputs the forward needs, "
        "as tensors; see what the exporters print with from_torch(..., verbose=True); or export the "
        "ONNX file yourself and load it with anygrad.load_onnx")


def from_torch(module: Any, example_input: Any, *, dynamo: bool = True, opset: int | None = None,
               path: str | os.PathLike | None = None, output_name: str | Sequence[str] = "output",
               check: bool = True, verbose: bool = False, dynamic: Mapping[str, Mapping[int, str]] | None = None
               ) -> Model:
    """Export `module` (an nn.Module) to ONNX in training mode and import it as a trainable Model
    with the module's current weights.

    `example_input` is one tensor, a tuple of them (the forward's positional arguments) or a dict
    of keyword arguments, each with a batch dim of 2 or more (BatchNorm cannot normalise one
    sample in training mode); the batch dim stays symbolic, every other dim is fixed to the
    example's size unless `dynamic` names it: `dynamic={"input_ids": {1: "seq"}, "labels": {1:
    "seq"}}` keeps axis 1 of those inputs symbolic (inputs naming the same dim take the same
    size), so the model trains and predicts on any sequence length. Graph inputs are named after the
    forward's parameters (`forward(self, ids, mask)` gives inputs 'ids' and 'mask') or the dict's
    keys (`{"input_ids": ..., "labels": ...}`, also for a `forward(*args, **kwargs)` such as a
    peft model's); an example that is not a tensor (`return_dict=False`) is passed as given and
    is no graph input. `dynamo` (default) tries the torch.export-based exporter first, which
    torch 2.9+ makes its default and which exports what TorchScript cannot (Hugging Face Llama,
    Qwen, GPT-2); dynamo=False the deprecated TorchScript one first. When the first fails, the
    other is tried, with one line on stderr; when both fail, the ModelError gives each one's
    cause. The model's `torch_binding.exporter` says which one wrote the graph. `opset`: the ONNX
    opset to export (default 18 with dynamo, its own, and 17 with TorchScript). With `path` the
    ONNX file is kept there, else it is temporary. `verbose`: let the exporters print their
    progress and notes (silenced by default).

    Outputs: one tensor is named `output_name`; a dict (a Hugging Face ModelOutput) gives its
    tensors as outputs named by its keys ('loss', 'logits'; 'logits' alone too), without its other
    entries (a cache, tuples of hidden states); a tuple of several 'output',
    'output1', ...; a list `output_name` names them all. The module is left as it was (its mode
    and state, which tracing in training mode moves).

    What ONNX cannot say is carried from the module: parameters with requires_grad=False come in
    frozen (no gradient, no optimizer state: `model.frozen`; a peft/LoRA model trains only its
    adapters, and `model.save_adapters(folder)` writes them as peft does), buffers are not
    trained, and an `nn.Embedding(padding_idx=i)` passes no gradient to row i. With `check`
    (default), the imported model's inference output is compared with the module's in eval mode
    on the example input; a difference beyond float32 noise is a ModelError naming the first
    parameter that differs, so a wrongly bound model is never trained silently."""
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"from_torch needs a torch.nn.Module, not {type(module).__name__}")
    ex = _examples(module, example_input)
    if not ex.names:
        raise ConfigError(f"from_torch: no example input of {type(module).__name__} is a tensor; pass the "
                          "forward's inputs as a tensor, a tuple of tensors or a dict of them")
    axes = _dynamic_axes(dynamic, ex)
    output_names = _output_names(module, ex, output_name)
    pristine = copy.deepcopy(module.state_dict())  # deepcopy keeps tied tensors sharing one storage
    modes = {m: m.training for m in module.modules()}  # submodules may differ (a frozen BatchNorm in eval)
    with tempfile.TemporaryDirectory(prefix="anygrad-") as tmp:
        file = Path(path) if path is not None else Path(tmp) / "model.onnx"
        module.train(True)
        try:
            exporter = _export_any(module, ex, file, "dynamo" if dynamo else "torchscript", opset,
                                   output_names, verbose, axes)
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
    binding = binding_of(model)
    binding.exporter = exporter
    # Parameters the forward pass never uses are not in the graph; keep them so the exported
    # state_dict still loads into the module with strict=True.
    binding.extra.update({k: state[k] for k in result.unexpected})
    _carry_padding_idx(model, module)
    _carry_requires_grad(model, module)
    binding.adapters = peft_adapters(module)
    if check:
        _check_forward(model, module, ex, state)
    return model


def _carry_requires_grad(model: Model, module: Any) -> list[str]:
    """Parameters with requires_grad=False come in frozen (Model.freeze): no gradient, no optimizer
    state, unchanged by training. Returns the graph names frozen."""
    graph_name = _graph_names_of(model)
    trainable = set(model.graph.params)
    frozen = {graph_name[k] for k, p in module.named_parameters(remove_duplicate=False)
              if not p.requires_grad and graph_name.get(k) in trainable}
    if not frozen:
        return []
    return model.freeze(*(_literal(g) for g in sorted(frozen)))


def _literal(name: str) -> str:
    """An fnmatch pattern that matches exactly `name` (PyTorch names may hold '[', '*' or '?')."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)


def peft_adapters(module: Any) -> AdapterFile | None:
    """What `save_adapters` needs to write a peft model's adapters as peft does: the active
    adapter's config file and each saved tensor's name (peft's get_peft_model_state_dict, which
    knows LoRA, DoRA, biases and modules_to_save) by the module's state_dict key. None for a
    module that is not a peft model."""
    if not any(c.__module__.startswith("peft.") for c in type(module).__mro__):
        return None  # peft is imported only for its own models
    from peft import PeftModel, get_peft_model_state_dict
    configs = module.peft_config if isinstance(module, PeftModel) else None
    if not isinstance(configs, Mapping) or not configs:
        return None  # a peft tuner layer passed alone: its trainable tensors are saved by PyTorch name
    adapter = getattr(module, "active_adapter", None)
    adapter = adapter if isinstance(adapter, str) and adapter in configs else next(iter(configs))
    where = {t.data_ptr(): k for k, t in module.state_dict(keep_vars=True).items() if t.numel()}
    names = {}
    for saved, t in get_peft_model_state_dict(module, adapter_name=adapter).items():
        key = where.get(t.data_ptr()) if t.numel() else None
        if key is None:
            return None  # a tensor peft builds on the fly: no faithful mapping; saved by PyTorch name
        names[key] = saved
    # peft's own save writes the config as peft would for this model (inference_mode, auto_mapping,
    # base_model_name_or_path); it fills in fields of the user's config, which are put back
    before = copy.deepcopy(configs[adapter].__dict__)
    try:
        with tempfile.TemporaryDirectory(prefix="anygrad-") as tmp, warnings.catch_warnings(), _quiet(True):
            warnings.simplefilter("ignore")
            module.save_pretrained(tmp, selected_adapters=[adapter])
            config = next(Path(tmp).rglob(ADAPTER_CONFIG)).read_text()
    finally:
        configs[adapter].__dict__.update(before)
    return AdapterFile(names, config)


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
    """The top-level (key, value) pairs of an output structure: keys for dicts (only their
    tensors: the graph returns those, see _graph_outputs), None for positions; one pair for a
    lone tensor."""
    if isinstance(out, Mapping):
        return [(str(k), v) for k, v in out.items() if hasattr(v, "detach")]
    if isinstance(out, (tuple, list)):
        return [(None, v) for v in out]
    return [(None, out)]


def _output_names(module: Any, ex: Examples, output_name: str | Sequence[str]) -> list[str]:
    """Graph output names (see from_torch's docstring). A dict names its tensors by their keys,
    however many: a Hugging Face ModelOutput is {'logits'} without labels and {'loss', 'logits'}
    with them, and `compile(loss={"logits": ...})` must find 'logits' in both."""
    if not isinstance(output_name, str):
        names = [str(n) for n in output_name]
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"from_torch: output_name needs distinct names, got {list(output_name)}")
        return names
    out = _eval_forward(module, *ex.call(ex.values))
    pairs = _entries(out)
    if isinstance(out, Mapping):
        return [k for k, _ in pairs] or [output_name]
    if len(pairs) == 1 or not all(hasattr(v, "detach") for _, v in pairs):  # one, or nested (caches)
        return [output_name]
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


def _check_forward(model: Model, module: Any, ex: Examples, state: dict[str, np.ndarray]) -> None:
    """The imported model's inference output against the module's, in eval mode, on the examples."""
    pairs = _entries(_eval_forward(module, *ex.call(ex.values)))
    expected = pairs[0][1] if pairs else None
    if not hasattr(expected, "detach"):
        return  # an output structure the graph does not mirror: nothing to compare
    expected = expected.detach().cpu().double().numpy()
    feeds = _feeds(ex)
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
