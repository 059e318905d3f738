"""Values and names as Python source: the vocabulary of the codegen writer."""
from __future__ import annotations

import builtins
import keyword
import re
import textwrap
from typing import Any

import numpy as np

INDENT = "    "
_BUILTINS = set(dir(builtins))


# -- formatting values as Python source -----------------------------------------------------------
def _num(v: Any, dtype: np.dtype | None = None) -> str:
    """A number as the shortest literal that gives the same value (in float32 unless the dtype
    says otherwise: ONNX attributes are float32)."""
    if isinstance(v, (bool, np.bool_)):
        return repr(bool(v))
    if isinstance(v, (int, np.integer)):
        return repr(int(v))
    f = float(v)
    if not np.isfinite(f):
        return f"float('{f}')"
    if dtype is not None and dtype != np.float32:
        return repr(f)
    text = np.format_float_positional(np.float32(f), unique=True, trim="0")
    if len(text) > 10:  # 1e-05 reads better than 0.00001
        sci = np.format_float_scientific(np.float32(f), unique=True, trim="-")
        text = sci if len(sci) < len(text) else text
    return text


def _value(v: Any) -> str:
    """An attribute value (number, string, list, tensor) as a literal."""
    if isinstance(v, np.ndarray):
        return _array(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, str):
        return _str(v)
    return _num(v)


def _array(a: np.ndarray) -> str:
    """np.array([...], dtype=np.float32), reshaped when not 1-D, wrapped to readable lines."""
    dtype = f"np.{a.dtype.name}" if a.dtype.name != "bool" else "np.bool_"
    items = [_num(x, a.dtype) for x in a.reshape(-1).tolist()]
    if a.ndim == 0:
        return f"np.array({items[0]}, dtype={dtype})"
    body = ", ".join(items)
    if len(body) > 70:
        body = "\n" + textwrap.indent(textwrap.fill(body, 90), INDENT) + "\n"
    text = f"np.array([{body}], dtype={dtype})"
    return text if a.ndim == 1 else f"{text}.reshape{tuple(a.shape)}"


def _str(s: str) -> str:
    """A string literal in double quotes (the style of the generated file)."""
    text = repr(s)
    return f'"{s}"' if text == f"'{s}'" and '"' not in s else text


def _ints(v: list[int]) -> str:
    """A kernel/stride/padding list as PyTorch writes it: 3 for [3, 3], (3, 1) otherwise."""
    v = [int(x) for x in v]
    return str(v[0]) if len(set(v)) == 1 else str(tuple(v))


def _snake(name: str) -> str:
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return re.sub(r"\W+", "_", name).strip("_").lower()


def _identifier(name: str, fallback: str = "x") -> str:
    name = re.sub(r"\W+", "_", name).strip("_") or fallback
    if name[0].isdigit():
        name = f"{fallback}_{name}"
    return name + "_" if keyword.iskeyword(name) else name


def _module_path(node_name: str) -> list[str]:
    """The module path of a node from its TorchScript-style name.

    "/layer1/layer1.0/conv1/Conv" -> ["layer1", "0", "conv1"]: a nested module's scope repeats its
    parent's name ("layer1.0" inside "layer1"), anygrad's tracer writes plain segments ("0")."""
    if not node_name.startswith("/"):
        return []
    path: list[str] = []
    for seg in [p for p in node_name.split("/") if p][:-1]:
        if path and seg.startswith(path[-1] + "."):
            path = path[:-1] + seg.split(".")
        else:
            path += seg.split(".")
    return path


def _op_part(node_name: str, op: str) -> str:
    """ "/layer1/layer1.0/Relu_1" -> "relu_1"; an unscoped or foreign name -> the op's name."""
    last = node_name.rsplit("/", 1)[-1] if node_name.startswith("/") else ""
    return _snake(last) if last.startswith(op) else _snake(op)
