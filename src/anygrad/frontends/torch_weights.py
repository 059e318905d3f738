"""PyTorch state_dicts in and out of a Model imported from ONNX.

The graph's state (params and BatchNorm buffers) is named by ONNX initializer names; a PyTorch
state_dict by module paths. Each graph tensor is matched to a state_dict key by these rules, the
first that applies:

1. the name the importer recorded (`model.origin.torch_names`: `conv1.weight`, or the module scope
   of a renamed `onnx::MatMul_12`, with its transposition), or one learnt by an earlier load;
2. the graph name itself is a key (names the importer did not recognise; weights.npz files);
3. a dynamo placeholder name `p_fc1_weight` / `b_norm1_running_mean` whose rest, with dots as
   underscores, is exactly one key;
4. shape, only for graph tensors whose PyTorch name is not known for certain (renamed by the
   exporter, like `onnx::MatMul_12`, whose module-scope name is a guess): a leftover graph tensor
   and a leftover key are paired when each is the *only* leftover on its side whose shape fits the
   other (equal, or transposed for a 2-D weight). Order is never used, so two same-shaped
   leftovers (two Linear(8, 8) weights) stay unmatched and are reported as ambiguous. A tensor
   with a certain name (`fc2.weight` in the file, or learnt by a load) never matches another key,
   as in PyTorch: a renamed key is missing + unexpected, not loaded.

A tensor is bound only in the orientation the graph reads it, never as the shapes happen to fit:
one the exporter stored under its state_dict name or a placeholder name is the module's tensor as
held (a GPT-2 Conv1D weight is (in, out), a Linear's (out, in)); a renamed (constant-folded) one
is a Linear's weight.T when the graph multiplies by it from the right as stored, where the folded
`x @ weight.T` ends up (`onnx_import.folded_linear_weights`). A checkpoint tensor in the other
orientation is mis-shaped, and a renamed tensor whose uses disagree is left unmatched. Matches by
rules 3 and 4 are remembered (`Model.torch_binding`) for the way back out.

Tied weights (a GPT's `lm_head.weight` that IS `wte.weight`) reach the graph as one tensor under
one of their names. A key the graph does not use is accepted as another name of a key it does use
when both are the same tensor: the same view of one storage (torch tensors, .pt files, numpy arrays
sharing memory) or, for formats that cannot say so (.safetensors, .npz), exactly equal non-constant
values of the same shape and dtype. The model remembers such aliases (`TorchBinding.aliases`) and
exports its current value under every name, so PyTorch's strict load sees the whole state_dict and
the tied storage ends up with the trained value.

`*.num_batches_tracked` keys of BatchNorm layers are accepted and not loaded; on export they hold
the count from the loaded file plus the optimizer steps taken since (one BatchNorm update per step;
with gradient accumulation, per update rather than per micro-batch).
"""
from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ModelError
from ..optim.base import STEP_STATE
from ..torchfile import MAX_NESTING
from ..torchfile.tensors import FormatError
from .onnx_import import TorchName, folded_linear_weights

if TYPE_CHECKING:
    from ..model import Model

NUM_BATCHES = "num_batches_tracked"
_PLACEHOLDER = re.compile(r"^[pb]_(.+)$")  # torch.export names parameters p_*, buffers b_*
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DataParallel / DDP, torch.compile


def placeholder_path(name: str) -> str | None:
    """The state_dict key, '.' spelt '_', in a torch.export placeholder name (p_fc_weight -> fc_weight);
    None for other names."""
    m = _PLACEHOLDER.match(name)
    return m.group(1) if m else None


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file names (peft.utils.constants)
ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class AdapterFile:
    """How peft saves a model's adapters (from_torch of a peft model learns it from peft)."""

    names: dict[str, str]  # the module's state_dict key -> the name in adapter_model.safetensors
    config: str  # adapter_config.json as peft writes it


@dataclass
class TorchBinding:
    """What a Model learnt about its PyTorch counterpart beyond the importer's record."""

    names: dict[str, TorchName] = field(default_factory=dict)  # graph name -> key, from the last load
    batches_base: int = 0  # num_batches_tracked at the last load, less the steps taken by then
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # entries the graph does not use (from_torch)
    aliases: dict[str, str] = field(default_factory=dict)  # key -> the key of the same (tied) tensor in the graph
    exporter: str = ""  # the torch.onnx exporter from_torch used: "dynamo" or "torchscript"
    adapters: AdapterFile | None = None  # a peft model's adapters (from_torch), for save_adapters


@dataclass
class LoadResult:
    """What `load_state_dict` did (PyTorch's missing/unexpected keys, plus shape mismatches)."""

    loaded: list[str]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]


# -- reading whatever the user hands us ---------------------------------------------------------
def _to_numpy(value: Any, memo: dict[Any, Any] | None = None, depth: int = 0) -> Any:
    """A torch tensor (duck-typed: no torch import) or array-like -> numpy; containers recurse.

    A dict met twice (shared, or inside itself) becomes one converted dict, so a cycle ends here
    and the state_dict search sees it as the cycle it is; nesting deeper than the search goes is
    left alone."""
    if isinstance(value, np.ndarray):
        return value
    memo = {} if memo is None else memo
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        # one tensor under two names (tied weights) becomes one array, even where converting copies
        view = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), str(value.dtype), str(value.device)) \
            if hasattr(value, "data_ptr") and value.numel() > 0 else id(value)
        if view not in memo:
            t = value.detach().cpu()
            try:
                memo[view] = t.numpy()
            except TypeError:  # bfloat16 and friends have no numpy dtype
                memo[view] = t.float().numpy()
        return memo[view]
    if isinstance(value, Mapping):
        if id(value) in memo:
            return memo[id(value)]
        if depth > MAX_NESTING:
            return value
        out: dict[Any, Any] = {}
        memo[id(value)] = out
        for k, v in value.items():
            out[k] = _to_numpy(v, memo, depth + 1)
        return out
    if isinstance(value, (int, float, np.generic)) and not isinstance(value, bool):
        return np.asarray(value)
    return value


def read_state_dict(source: Any, key: str | None = None) -> dict[str, np.ndarray]:
    """A flat name -> array dict from a path (.pt/.pth/.bin, .safetensors, .npz) or a mapping of
    numpy arrays / torch tensors (a checkpoint dict around the state_dict is searched, or `key`)."""
    return _read(source, key)[0]


def _read(source: Any, key: str | None) -> tuple[dict[str, np.ndarray], bool]:
    """read_state_dict, and whether ties must be told by value: formats that store every name as
    its own copy (.npz, .safetensors) cannot say that two names are one tensor."""
    from .. import torchfile
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not os.path.lexists(path):
            raise ModelError(f"{path}: no such weights file")
        torchfile.check_regular(path)  # a folder, a FIFO or a device is refused before any read
        flat = path.suffix == ".npz" or torchfile.is_safetensors(path)
        if key is not None and flat:
            raise ModelError(f"{path}: key={key!r} (--weights-key) names the entry of a torch.save checkpoint "
                             f"dict that holds the state_dict, but a {path.suffix or '.safetensors'} file is the "
                             "state_dict itself; leave the key out")
        if path.suffix == ".npz":
            return torchfile.read_npz_arrays(path), True
        if torchfile.is_safetensors(path):
            return torchfile.load_safetensors(path), True
        return torchfile.load(path, key=key), False
    if not isinstance(source, Mapping):
        raise ModelError("load_state_dict takes a path or a dict of arrays/tensors, "
                         f"not {type(source).__name__}")
    converted = _to_numpy(source)
    try:
        sd = torchfile.find_state_dict(converted, key)
    except FormatError as e:
        raise ModelError(f"the dict passed to load_state_dict: {e}") from None
    if sd is None:
        raise ModelError("no state_dict (names -> arrays/tensors) found in the dict passed to load_state_dict"
                         f"{f' under key {key!r}' if key else ''}; it holds keys {list(source)[:10]}")
    return sd, False


def _view(a: Any) -> tuple | None:
    """Where an array's elements are and how it walks them: equal for two names of one tensor."""
    if not isinstance(a, np.ndarray) or a.size == 0:
        return None
    return a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str


def _same_values(a: Any, b: Any) -> bool:
    # a constant tensor (a fresh LayerNorm weight, zeros) equal to another says nothing about ties
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype
            and a.size > 1 and not (a == a.flat[0]).all() and np.array_equal(a, b))


def ties(sd: dict[str, np.ndarray], used: set[str], by_value: bool) -> dict[str, str]:
    """Keys of `sd` outside `used` that name the same tensor as a used key -> that key."""
    by_view = {}
    for k in sorted(used):
        by_view.setdefault(_view(sd[k]), k)
    by_view.pop(None, None)
    out = {}
    for k, v in sd.items():
        if k in used:
            continue
        same = by_view.get(_view(v))
        if same is None and by_value:
            same = next((u for u in sorted(used) if _same_values(sd[u], v)), None)
        if same is not None:
            out[k] = same
    return out


def _strip_wrapper(sd: dict[str, np.ndarray], wanted: set[str]) -> dict[str, np.ndarray]:
    """Drop a `module.` (DataParallel) or `_orig_mod.` (torch.compile) prefix every key carries."""
    for prefix in _WRAPPER_PREFIXES:
        if sd and all(k.startswith(prefix) for k in sd) and not any(k in wanted for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items()}
    return sd


# -- matching names ------------------------------------------------------------------------------
def recorded_names(model: Model) -> dict[str, TorchName]:
    """Graph name -> PyTorch name, as far as the importer and earlier loads know. A model no ONNX
    file describes (anygrad.nn) holds its tensors under their PyTorch names, as certain_names says."""
    origin = getattr(model, "origin", None)
    names = (dict(origin.torch_names) if origin is not None
             else {g: TorchName(g) for g in model.graph.state_names})
    binding = getattr(model, "torch_binding", None)
    if binding is not None:
        names.update(binding.names)
    return {g: tn for g, tn in names.items() if g in model.graph.initializers}


def certain_names(model: Model) -> set[str]:
    """Graph tensors whose PyTorch name is known, not guessed: initializers that carry their
    state_dict name, names learnt by an earlier load, and every name of a model no ONNX file
    describes (anygrad.nn traces its modules under their PyTorch names)."""
    origin = getattr(model, "origin", None)
    binding = getattr(model, "torch_binding", None)
    certain = ({g for g, tn in origin.torch_names.items() if tn.key == g} if origin is not None
               else set(model.graph.state_names))
    return certain | (set(binding.names) if binding is not None else set())


def _fits(graph_shape: tuple, key_shape: tuple, transpose: bool | None) -> bool:
    """Whether a checkpoint tensor of `key_shape` is the graph tensor read in that orientation."""
    if transpose is None:  # the graph cannot say: nothing is bound
        return False
    return graph_shape == (key_shape[::-1] if transpose and len(key_shape) == 2 else key_shape)


def orientations(model: Model) -> dict[str, bool | None]:
    """Graph tensor -> whether it holds its PyTorch tensor transposed, as the graph says (None:
    its uses disagree). Recorded names know; a tensor the exporter renamed is told by its uses."""
    folded = folded_linear_weights(model.graph)
    known = recorded_names(model)
    return {g: known[g].transpose if g in known else folded.get(g, False) for g in model.graph.state_names}


def match(model: Model, shapes: dict[str, tuple]) -> tuple[dict[str, TorchName], dict[str, str]]:
    """(graph name -> TorchName for keys in `shapes`, graph name -> expected key for the rest).

    The second dict names, for graph tensors left unmatched, the key they were recorded under
    (for error messages)."""
    graph = model.graph
    known = recorded_names(model)
    gshape = {g: tuple(graph.initializers[g].shape) for g in graph.state_names}
    out: dict[str, TorchName] = {}
    taken: set[str] = set()

    def take(g: str, tn: TorchName) -> None:
        out[g] = tn
        taken.add(tn.key)

    # 1. recorded names, in their recorded orientation (a key may feed several graph tensors:
    # untied BatchNorm copies)
    for g in gshape:
        tn = known.get(g)
        if tn is not None and tn.key in shapes:
            take(g, tn)
    # 2. the graph name is a key; 3. dynamo placeholder names: the module's tensors as held
    underscored: dict[str, list[str]] = {}
    for k in shapes:
        underscored.setdefault(k.replace(".", "_"), []).append(k)
    for g in gshape:
        if g in out:
            continue
        if g in shapes and g not in taken:
            take(g, TorchName(g))
            continue
        cands = [k for k in underscored.get(placeholder_path(g), []) if k not in taken]
        if len(cands) == 1:
            take(g, TorchName(cands[0]))
    # 4. unique shapes, in the orientation the graph reads the tensor, one pass (no elimination
    # chains, no order), for names not known for certain
    certain = certain_names(model)
    orient = orientations(model)
    left_g = [g for g in gshape if g not in out and g not in certain]
    left_k = [k for k in shapes if k not in taken and not k.endswith(NUM_BATCHES)]
    fits = {g: [k for k in left_k if _fits(gshape[g], shapes[k], orient[g])] for g in left_g}
    fitted_by: dict[str, list[str]] = {}
    for g, ks in fits.items():
        for k in ks:
            fitted_by.setdefault(k, []).append(g)
    for g, ks in fits.items():
        if len(ks) == 1 and len(fitted_by[ks[0]]) == 1:
            take(g, TorchName(ks[0], bool(orient[g])))
    expected = {g: known[g].key if g in known else g for g in gshape if g not in out}
    return out, expected


def _bn_prefixes(keys) -> set[str]:
    return {k[:-len("running_mean")] for k in keys if k.endswith(".running_mean")}


# -- loading -------------------------------------------------------------------------------------
def steps_taken(model: Model) -> int:
    """Optimizer steps run on the model's backend (0 before the first training step)."""
    backend = model.backend
    if backend is not None and backend.has_state(STEP_STATE):
        return round(float(backend.get_state(STEP_STATE)))
    return 0


def binding_of(model: Model) -> TorchBinding:
    """The model's TorchBinding, created on first use."""
    if getattr(model, "torch_binding", None) is None:
        model.torch_binding = TorchBinding()
    return model.torch_binding


def _shape(s: tuple) -> str:
    return "(" + ", ".join(map(str, s)) + ")"


def load_state_dict(model: Model, source: Any, strict: bool = True, key: str | None = None) -> LoadResult:
    """Load a PyTorch state_dict (a path or a dict) into the model's params and BatchNorm buffers.

    strict=True: every graph tensor must be found with the right shape and every key used,
    otherwise nothing is loaded and one ModelError lists all missing, unexpected and mis-shaped
    keys. strict=False: loads the entries that match and returns the rest in the LoadResult."""
    where = f" from {source}" if isinstance(source, (str, os.PathLike)) else ""
    sd, by_value = _read(source, key)
    graph = model.graph
    recorded = recorded_names(model)
    wanted = {tn.key for tn in recorded.values()} | set(graph.state_names)
    sd = _strip_wrapper(sd, wanted)
    shapes = {k: tuple(np.shape(v)) for k, v in sd.items()}
    mapping, expected = match(model, shapes)

    values: dict[str, np.ndarray] = {}
    mismatched: dict[str, str] = {}  # key -> what is wrong (PyTorch layout on both sides)
    for g, tn in mapping.items():
        target = graph.initializers[g]
        value = np.asarray(sd[tn.key])
        value = value.T if tn.transpose and value.ndim == 2 else value
        if value.shape != target.shape:
            mismatched[tn.key] = (f"{tn.key}: checkpoint has {_shape(shapes[tn.key])}, the model needs "
                                  f"{_shape(target.shape[::-1] if tn.transpose else target.shape)}")
            continue
        values[g] = np.ascontiguousarray(value, dtype=target.dtype)
    used = {tn.key for tn in mapping.values()}
    tied = ties(sd, {tn.key for g, tn in mapping.items() if g in values}, by_value)
    bn = _bn_prefixes(used)
    missing: dict[str, str] = {}
    for g, k in expected.items():
        shape = graph.initializers[g].shape
        shape = shape[::-1] if g in recorded and recorded[g].transpose and len(shape) == 2 else shape
        missing[k] = f"{k}{'' if k == g else f' (ONNX {g!r})'} {_shape(shape)}"
    unexpected = {k: f"{k} {_shape(shapes[k])}" for k in sd if k not in used and k not in tied
                  and not (k.endswith(NUM_BATCHES) and k[:-len(NUM_BATCHES)] in bn)}
    carried = _integer_buffers(model, sd, unexpected, mismatched)

    if (strict and (missing or unexpected or mismatched)) or not values:
        why = "strict=True" if values else "no entry matches"
        lines = [f"cannot load the state_dict{where} into {model.source} ({why}):"]
        for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mismatched)):
            if items:
                lines.append(f"  {label} ({len(items)}): " + "; ".join(items.values()))
        certain = certain_names(model)
        orient = orientations(model)
        ambiguous = {}  # graph tensors that shape alone could pair with several keys, or none
        for g in (g for g in expected if g not in certain):
            gs = tuple(graph.initializers[g].shape)
            if orient[g] is None:
                ambiguous[g] = f"{g} {_shape(gs)} is read both as stored and transposed"
                continue
            fits = [k for k in unexpected if _fits(gs, shapes[k], orient[g])]
            if len(fits) > 1:
                ambiguous[g] = f"{g} {_shape(gs)} fits {', '.join(fits)}"
        if ambiguous:
            lines.append(f"  ambiguous ({len(ambiguous)}; no PyTorch name recorded, and shape alone cannot tell): "
                         + "; ".join(ambiguous.values()))
        if strict and values:
            lines.append("pass strict=False (--weights-partial) to load the entries that match")
        raise ModelError("\n".join(lines))

    backend = model.backend
    for g, value in values.items():
        graph.initializers[g] = value
        if backend is not None:
            backend.set_state(g, value)
    binding = binding_of(model)
    # a graph name matched as itself (weights.npz) teaches nothing: keep the importer's name
    binding.names.update({g: mapping[g] for g in values if not (mapping[g].key == g and g in recorded)})
    binding.aliases.update(tied)
    binding.extra.update(carried)
    counts = [int(np.asarray(sd[p + NUM_BATCHES]).reshape(-1)[0]) for p in sorted(bn)
              if p + NUM_BATCHES in sd and np.size(sd[p + NUM_BATCHES]) == 1]
    if counts:
        binding.batches_base = max(counts) - steps_taken(model)
    loaded = sorted({mapping[g].key for g in values} | set(tied))
    return LoadResult(loaded, sorted(missing), list(unexpected), list(mismatched))


def _integer_buffers(model: Model, sd: Mapping[str, Any], unexpected: dict[str, str],
                     mismatched: dict[str, str]) -> dict[str, np.ndarray]:
    """Keys of `unexpected` that name an integer buffer of the ONNX file (a Swin's
    relative_position_index), which import folded into the graph's constants: accepted when the
    checkpoint holds the same value, carried along for export, and mis-shaped (the graph cannot
    compute with another value) when not. Removes them from `unexpected`; returns the accepted."""
    held = getattr(getattr(model, "origin", None), "int_buffers", None) or {}
    carried = {}
    for k in [k for k in unexpected if k in held]:
        del unexpected[k]
        value = np.asarray(sd[k])
        if value.shape == held[k].shape and np.array_equal(value, held[k]):
            carried[k] = value
        else:
            mismatched[k] = (f"{k}: the graph computes with the file's {held[k].dtype} constant {_shape(held[k].shape)}, "
                             f"the checkpoint holds another value {_shape(value.shape)}; export the ONNX file "
                             f"from the module of this checkpoint")
    return carried


# -- exporting -----------------------------------------------------------------------------------
def to_torch_state_dict(model: Model) -> dict[str, np.ndarray]:
    """The model's state under PyTorch names, as numpy arrays in PyTorch's layout.

    Graph tensors with no known PyTorch name keep their graph name (with a warning), so
    `module.load_state_dict(strict=True)` reports them rather than silently dropping them."""
    names = recorded_names(model)
    state = model.state_dict()
    binding = getattr(model, "torch_binding", None)
    count = np.array((binding.batches_base if binding else 0) + steps_taken(model), np.int64)
    out: dict[str, np.ndarray] = {}
    unnamed = []
    for g in model.graph.state_names:
        tn = names.get(g)
        if tn is None:
            unnamed.append(g)
            tn = TorchName(g)
        if tn.key in out:
            continue  # one PyTorch tensor used by several graph tensors (untied copies)
        value = state[g]
        out[tn.key] = np.ascontiguousarray(value.T if tn.transpose and value.ndim == 2 else value)
        if tn.key.endswith(".running_var"):  # PyTorch's order: running_mean, running_var, count
            out[tn.key[:-len("running_var")] + NUM_BATCHES] = count
    for prefix in _bn_prefixes(out):
        out.setdefault(prefix + NUM_BATCHES, count)
    if binding is not None:
        for k, same in binding.aliases.items():  # the current value under every name of a tied tensor
            if same in out:
                out.setdefault(k, out[same])
        for k, v in binding.extra.items():
            out.setdefault(k, v)
    if unnamed:
        warnings.warn(f"{model.source}: no PyTorch name known for {', '.join(unnamed)}; exported under their "
                      "ONNX names (load a PyTorch state_dict first to teach anygrad the names)", stacklevel=3)
    return out


def save_safetensors(model: Model, path: str | os.PathLike) -> Path:
    """weights.safetensors with PyTorch names: `module.load_state_dict(safetensors.torch.load_file(path))`."""
    from ..torchfile import save_safetensors as write
    path = Path(path)
    write(to_torch_state_dict(model), path, metadata={"format": "pt"})
    return path


def save_adapters(model: Model, folder: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the trained adapters alone, the way back to PyTorch for a model with frozen weights.

    A model from_torch made of a peft model: `folder/adapter_model.safetensors` under peft's names
    and peft's `adapter_config.json`, so `PeftModel.from_pretrained(base, folder)` (or
    `model.load_adapter(folder)`) loads them. Any other model with frozen parameters: its
    trainable parameters under their PyTorch names, for `module.load_state_dict(..., strict=False)`.
    Files already in `folder` are kept unless `overwrite`. Returns the safetensors path."""
    from ..fsutil import atomic_write
    binding = getattr(model, "torch_binding", None)
    adapters = binding.adapters if binding is not None else None
    state = to_torch_state_dict(model)
    if adapters is not None:
        absent = sorted(k for k in adapters.names if k not in state)
        if absent:
            raise ModelError(f"save_adapters: the model holds no tensor for peft's {', '.join(absent[:5])}")
        tensors = {saved: state[key] for key, saved in adapters.names.items()}
    else:
        if not model.frozen:
            raise ModelError("save_adapters: nothing in this model is frozen, so every parameter is trained; "
                             "save them all with save_safetensors (freeze the base weights, or pass a "
                             "module with requires_grad=False ones to from_torch, to train adapters)")
        names = recorded_names(model)
        keys = {names[g].key if g in names else g for g in model.graph.params}
        keys |= {k for k, same in (binding.aliases if binding is not None else {}).items() if same in keys}
        tensors = {k: v for k, v in state.items() if k in keys}
    folder = Path(folder)
    files = [folder / ADAPTER_WEIGHTS] + ([folder / ADAPTER_CONFIG] if adapters is not None else [])
    there = [f.name for f in files if os.path.lexists(f)]
    if there and not overwrite:
        raise ModelError(f"save_adapters: {folder} already holds {', '.join(there)}; pass overwrite=True to "
                         "replace them, or choose another folder")
    if folder.exists() and not folder.is_dir():
        raise ModelError(f"save_adapters: {folder} is a file, not a folder; pass a folder to hold the adapters")
    folder.mkdir(parents=True, exist_ok=True)
    from ..torchfile import save_safetensors as write
    write(tensors, files[0], metadata={"format": "pt"})
    if adapters is not None:
        atomic_write(files[1], adapters.config)
    return files[0]


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterFile", "LoadResult", "TorchBinding", "binding_of",
           "certain_names", "load_state_dict", "match", "read_state_dict", "save_adapters", "save_safetensors",
           "ties", "to_torch_state_dict"]
