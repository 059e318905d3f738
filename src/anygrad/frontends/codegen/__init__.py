"""ONNX graph -> readable PyTorch-style Python: `anygrad codegen MODEL.onnx -o model.py`.

The generated module holds `class Model(anygrad.nn.Module)`: one attribute per layer, named and
nested as in the PyTorch module that was exported (`self.conv1`, `self.layer1[0].bn1`), so its
state_dict keys are PyTorch's and a `torch.save`d state_dict loads by name; a `forward` that
calls them in the graph's order. Traced, it gives the graph the ONNX importer gives (same ops,
same numbers, same gradients).

How a node becomes code, first rule that applies:
0. nodes whose inputs are all constants are computed now, counting static shapes and dtypes as
   constants (exporters leave shape chains behind: the dynamo exporter's zero bias of a
   bias-free conv, its attention scale); a shape that holds the batch size becomes
   `x.shape[0] * 2` inside `F.reshape`;
1. a layer with weights (`_LAYERS`: Conv, ConvTranspose, Gemm/MatMul(+Add) as Linear (a constant
   zero bias is no bias), BatchNormalization, LayerNormalization, Gather as Embedding) ->
   `self.<path>(x)`;
2. a stateless op, or a group of nodes (`_COMPOSITES`: the exporters' GELU), with a PyTorch form
   (`_FUNCTIONS`): a layer attribute when the exporter scoped it to a module of its own
   (`/pool/GlobalAveragePool` -> `self.pool = nn.AdaptiveAvgPool2d(1)`), else a functional call;
   arithmetic as operators, constant Slices as indexing (`x[:, :8]`), Concat as F.cat;
3. anything else -> `F.onnx_op("Op", ..., attr=...)`, so every importable graph can be written.

Weights no layer owns become `nn.Parameter`/`nn.Buffer` attributes. `write_code` also writes the
weights under the generated module's state_dict names (.safetensors), transposed where the file
held a Linear's weight as W.T. Limit: `Model.to_model()` traces a single input (anygrad.nn).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError
from ...fsutil import atomic_write
from .writer import Generated, generate


@dataclass
class Written:
    code: Path | None  # None: the weights only (write_module=False)
    weights: Path | None


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, text, fsync=False)


def write_code(
    model_path: str | os.PathLike,
    out: str | os.PathLike,
    weights_out: str | os.PathLike | None = None,
    write_weights: bool = True,
    command: str | None = None,
    write_module: bool = True,
) -> Written:
    """`anygrad codegen`: import the ONNX file, write the Python module and (unless told not to)
    the weights as .safetensors (default: beside the module, same stem). `command`, as generate's,
    is written into the module's docstring. `write_module=False` writes the weights only (the
    module at `out`, e.g. one written with --no-weights, stays as it is)."""
    from ..onnx_import import load_onnx
    from ...torchfile import save_safetensors

    model_path, out = Path(model_path), Path(out)
    if not (write_weights or write_module):
        raise ConfigError("nothing to write: the weights only (--weights-only) and no weights (--no-weights) exclude "
                          "each other")
    if out.suffix != ".py":
        raise ConfigError(f"{out}: the generated module needs a .py name")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent}: no such folder for the generated module")
    weights = Path(weights_out) if weights_out else out.with_suffix(".safetensors")
    if weights.suffix != ".safetensors":
        raise ConfigError(f"{weights}: the weights are written as safetensors; give a .safetensors name")
    model = load_onnx(model_path)
    folder = os.path.abspath(out.parent)
    rel = Path(os.path.relpath(os.path.abspath(weights), folder)).as_posix()
    if command is None:  # file names only: the same text wherever it is generated from
        command = f"anygrad codegen {model_path.name} -o {out.name}"
        command += f" --weights-out {rel}" if rel != out.with_suffix(".safetensors").name else ""
    generated = generate(model, model_path.name, out.name, rel, command, write_weights)
    if write_weights:
        save_safetensors(generated.state, weights)
    if write_module:
        _write_text(out, generated.code)
    return Written(out if write_module else None, weights if write_weights else None)


__all__ = ["Generated", "Written", "generate", "write_code"]
