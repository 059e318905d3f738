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

import builtins
import contextlib
import keyword
import math
import operator
import os
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import AnygradError, ConfigError
from .fsutil import atomic_write
from .ir.graph import Graph, Node, TensorInfo, info_of
from .ir.passes import infer_node
from .ir.registry import get_op
from .model import Model

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


# -- what a node becomes ---------------------------------------------------------------------------
@dataclass
class Layer:
    """A layer attribute: its constructor and which graph tensor each state entry holds."""

    kind: str  # default attribute name ("conv", "linear", ...)
    ctor: str  # "nn.Conv2d(1, 8, 3)"
    state: dict[str, tuple[str, bool]] = field(default_factory=dict)  # attr -> (initializer, transposed)
    counters: tuple[str, ...] = ()  # int64 buffers PyTorch keeps (num_batches_tracked), zero here


@dataclass
class LayerUse:
    layer: Layer
    x: str  # the input value
    y: str  # the output value
    nodes: list[Node]  # graph nodes it stands for
    path_hint: str = ""  # module path from the weight's state_dict name


@dataclass
class Function:
    """A stateless op in PyTorch form: F.<fn>(x, fn_args) or nn.<cls>(cls_args)(x)."""

    fn: str
    fn_args: str = ""
    cls: str | None = None
    cls_args: str | None = None  # default: fn_args


def _infer(g: Graph, alt: bool) -> dict[str, TensorInfo]:
    """Every value's shape with each symbolic input dim set to a stand-in size of its own, a
    second set when `alt` (values whose shape cannot be known here, like a shape fed as an input,
    stay unknown: their nodes are written generic)."""
    inferred = g.copy()
    symbols: dict[str, int] = {}
    for name in inferred.inputs:
        inf = inferred.info[name]
        for d in inf.shape:
            if not isinstance(d, int):
                symbols.setdefault(d, 11 + 2 * len(symbols) if alt else 2 + len(symbols))
        inferred.info[name] = TensorInfo(
            inf.dtype, tuple(d if isinstance(d, int) else symbols[d] for d in inf.shape)
        )
    state = set(g.state_names)
    for name, array in inferred.initializers.items():  # as infer_shapes: state is never a constant
        inferred.info[name] = TensorInfo(array.dtype, tuple(array.shape)) if name in state else info_of(array)
    for node in inferred.nodes:  # imported graphs are in order
        with contextlib.suppress(Exception):
            infer_node(inferred, node)
    return inferred.info


class _Graph:
    """The graph plus what the rules ask about it: shapes, state, uses, PyTorch names."""

    def __init__(self, model: Model):
        self.g = g = model.graph
        # Shapes for two stand-in sizes of the symbolic dims (as the nn tracer does): a dim that
        # differs between the two depends on the batch.
        self.info, self.info_alt = _infer(g, False), _infer(g, True)
        self.params, self.buffers = set(g.params), set(g.buffers)
        self.uses = g.consumers()
        self.producers = g.producers()
        self.folded: dict[str, np.ndarray] = {}  # outputs of nodes whose inputs are all constants
        # values computed from shapes that depend on the batch size: one per stand-in size
        self.per_batch: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.live = self._live()
        self.order = {name: i for i, name in enumerate(g.initializers)}
        origin = getattr(model, "origin", None)
        self.torch_names = {k: v.key for k, v in (origin.torch_names if origin else {}).items()}

    def _live(self) -> set[int]:
        """ids of the nodes an output depends on (dead ones are not written); a folded value is
        a constant, so what only it reads is dead too."""
        producers = self.g.producers()
        live: set[int] = set()
        todo = [o for o in self.g.outputs if o not in self.folded]
        while todo:
            n = producers.get(todo.pop())
            if n is not None and id(n) not in live:
                live.add(id(n))
                todo += [v for v in n.inputs if v and v not in self.folded]
        return live

    def dim(self, v: str, k: int) -> tuple[int, int] | None:
        """Dim k of v for both stand-in batch sizes (equal: a static dim)."""
        a, b = self.info.get(v), self.info_alt.get(v)
        if a is None or b is None or a.shape is None or b.shape is None or k >= len(a.shape):
            return None
        return int(a.shape[k]), int(b.shape[k])

    def small(self, v: str) -> bool:
        """Whether v's inferred shape is static and at most _PER_BATCH_LIMIT elements."""
        inf = self.info.get(v)
        return inf is not None and inf.shape is not None and inf.is_static and inf.size <= _PER_BATCH_LIMIT

    def rank(self, v: str) -> int | None:
        inf = self.info.get(v)
        return len(inf.shape) if inf is not None and inf.shape is not None else None

    def dtype(self, v: str) -> np.dtype | None:
        inf = self.info.get(v)
        return inf.dtype if inf is not None else None

    def param(self, v: str, ndim: int | None = None) -> np.ndarray | None:
        a = self.g.initializers.get(v) if v in self.params else None
        return a if a is not None and (ndim is None or a.ndim == ndim) else None

    def const(self, v: str) -> np.ndarray | None:
        """The value of a constant: an initializer that is not state, or a folded node output."""
        if not v or v in self.params or v in self.buffers:
            return None
        return self.folded.get(v, self.g.initializers.get(v))

    def buffer(self, v: str) -> np.ndarray | None:
        return self.g.initializers.get(v) if v in self.buffers else None

    def unused(self, v: str) -> bool:
        return not v or (v not in self.uses and v not in self.g.outputs)

    def only_use(self, v: str) -> Node | None:
        users = self.uses.get(v, [])
        return users[0][0] if len(users) == 1 and v not in self.g.outputs else None

    def module_of(self, weight: str, suffix: str = "weight") -> str:
        key = self.torch_names.get(weight, weight)
        return key[: -len(suffix) - 1] if key.endswith("." + suffix) else ""


def _bias(G: _Graph, v: str, size: int) -> str | None:
    """The bias parameter of a layer ("" for none), or None when the input is not one. A constant
    zero bias is none: the dynamo exporter writes a bias-free conv with a zero bias computed from
    the weight's shape."""
    if not v:
        return ""
    if G.param(v, 1) is not None:
        return v if G.param(v).shape == (size,) else None
    c = G.const(v)
    return "" if c is not None and c.shape == (size,) and not np.any(c) else None


def _conv(G: _Graph, n: Node) -> LayerUse | None:
    w = G.param(n.input(1))
    b = None if w is None else _bias(G, n.input(2), w.shape[0])
    if w is None or w.ndim not in (3, 4) or b is None:
        return None
    nd = w.ndim - 2
    auto_pad = n.attr("auto_pad", "NOTSET")
    pads = [0] * (2 * nd) if auto_pad == "VALID" else list(n.attr("pads", [0] * (2 * nd)))
    if auto_pad not in ("NOTSET", "VALID") or pads[:nd] != pads[nd:]:
        return None
    if list(n.attr("kernel_shape", w.shape[2:])) != list(w.shape[2:]):
        return None
    group = int(n.attr("group", 1))
    args = [str(w.shape[1] * group), str(w.shape[0]), _ints(list(w.shape[2:]))]
    options = {
        "stride": n.attr("strides", [1] * nd),
        "padding": pads[:nd],
        "dilation": n.attr("dilations", [1] * nd),
    }
    args += [f"{k}={_ints(v)}" for k, v in options.items() if any(int(x) != (k != "padding") for x in v)]
    args += [f"groups={group}"] * (group != 1) + ["bias=False"] * (not b)
    state = {"weight": (n.input(1), False)} | ({"bias": (b, False)} if b else {})
    layer = Layer("conv", f"nn.Conv{nd}d({', '.join(args)})", state)
    return LayerUse(layer, n.input(0), n.outputs[0], [n], G.module_of(n.input(1)))


def _conv_transpose(G: _Graph, n: Node) -> LayerUse | None:
    w = G.param(n.input(1))
    b = None if w is None else _bias(G, n.input(2), w.shape[1] * int(n.attr("group", 1)))
    if w is None or w.ndim not in (3, 4) or b is None or n.attr("output_shape") is not None:
        return None
    nd = w.ndim - 2
    pads = list(n.attr("pads", [0] * (2 * nd)))
    if n.attr("auto_pad", "NOTSET") != "NOTSET" or pads[:nd] != pads[nd:]:
        return None
    if list(n.attr("kernel_shape", w.shape[2:])) != list(w.shape[2:]):
        return None
    group = int(n.attr("group", 1))
    args = [str(w.shape[0]), str(w.shape[1] * group), _ints(list(w.shape[2:]))]
    options = {
        "stride": n.attr("strides", [1] * nd),
        "padding": pads[:nd],
        "output_padding": n.attr("output_padding", [0] * nd),
    }
    args += [f"{k}={_ints(v)}" for k, v in options.items() if any(int(x) != (k == "stride") for x in v)]
    args += [f"groups={group}"] * (group != 1) + ["bias=False"] * (not b)
    dilations = n.attr("dilations", [1] * nd)
    args += [f"dilation={_ints(dilations)}"] if any(int(d) != 1 for d in dilations) else []
    state = {"weight": (n.input(1), False)} | ({"bias": (b, False)} if b else {})
    layer = Layer("deconv", f"nn.ConvTranspose{nd}d({', '.join(args)})", state)
    return LayerUse(layer, n.input(0), n.outputs[0], [n], G.module_of(n.input(1)))


def _linear(weight: str, w: np.ndarray, transposed: bool, bias: str) -> Layer:
    out_f, in_f = (w.shape[1], w.shape[0]) if transposed else w.shape
    state = {"weight": (weight, transposed)} | ({"bias": (bias, False)} if bias else {})
    return Layer("linear", f"nn.Linear({in_f}, {out_f}" + (")" if bias else ", bias=False)"), state)


def _gemm(G: _Graph, n: Node) -> LayerUse | None:
    w, c = G.param(n.input(1), 2), n.input(2)
    if w is None or G.rank(n.input(0)) != 2 or n.attr("transA", 0) or float(n.attr("alpha", 1.0)) != 1.0:
        return None
    transposed = not n.attr("transB", 0)  # Gemm computes x @ W: PyTorch's weight is W.T
    out_f = w.shape[1] if transposed else w.shape[0]
    c = _bias(G, c, out_f)
    if c is None or (c and float(n.attr("beta", 1.0)) != 1.0):
        return None
    return LayerUse(
        _linear(n.input(1), w, transposed, c), n.input(0), n.outputs[0], [n], G.module_of(n.input(1))
    )


def _matmul(G: _Graph, n: Node) -> LayerUse | None:
    """MatMul(x, W.T) or MatMul(x, Transpose(W)), then maybe Add(bias): how exporters write a
    Linear without Gemm (over a >2-D input, or without bias)."""
    weight, before = n.input(1), []
    w, transposed = G.param(weight, 2), True
    t = G.producers.get(weight)
    if (
        w is None
        and t is not None
        and t.op == "Transpose"
        and list(t.attr("perm", [1, 0])) == [1, 0]
        and G.only_use(weight) is n
    ):
        weight, before, transposed = t.input(0), [t], False
        w = G.param(weight, 2)
    if w is None or (G.rank(n.input(0)) or 0) < 2:
        return None
    out_f = w.shape[1] if transposed else w.shape[0]
    add, bias = G.only_use(n.outputs[0]), ""
    if add is not None and add.op == "Add":
        other = add.inputs[1] if add.inputs[0] == n.outputs[0] else add.inputs[0]
        b = G.param(other, 1)
        if b is not None and b.shape == (out_f,) and other != n.outputs[0]:
            bias = other
    nodes, y = (before + [n, add], add.outputs[0]) if bias else (before + [n], n.outputs[0])
    return LayerUse(_linear(weight, w, transposed, bias), n.input(0), y, nodes, G.module_of(weight))


def _torch_momentum(onnx_momentum: float) -> float:
    """PyTorch's momentum m from ONNX's (1 - m), as the shortest decimal that gives it back."""
    target = np.float32(onnx_momentum)
    for digits in range(1, 10):
        m = round(1.0 - float(onnx_momentum), digits)
        if np.float32(1.0 - m) == target:
            return m
    return 1.0 - float(onnx_momentum)


def _batch_norm(G: _Graph, n: Node) -> LayerUse | None:
    x, scale, bias, mean, var = (n.input(i) for i in range(5))
    s = G.param(scale, 1)
    rank = G.rank(x)
    if (
        s is None
        or G.param(bias, 1) is None
        or G.buffer(mean) is None
        or G.buffer(var) is None
        or rank not in (2, 3, 4)
        or not all(G.unused(o) for o in n.outputs[1:])
    ):
        return None
    args = [str(s.shape[0])]
    eps, momentum = float(n.attr("epsilon", 1e-5)), _torch_momentum(n.attr("momentum", 0.9))
    if np.float32(eps) != np.float32(1e-5):
        args.append(f"eps={_num(eps)}")
    if np.float32(momentum) != np.float32(0.1):
        args.append(f"momentum={_num(momentum)}")
    state = {
        "weight": (scale, False),
        "bias": (bias, False),
        "running_mean": (mean, False),
        "running_var": (var, False),
    }
    layer = Layer(
        "norm", f"nn.BatchNorm{2 if rank == 4 else 1}d({', '.join(args)})", state, ("num_batches_tracked",)
    )
    return LayerUse(layer, x, n.outputs[0], [n], G.module_of(scale))


def _layer_norm(G: _Graph, n: Node) -> LayerUse | None:
    x, scale, bias = n.input(0), n.input(1), n.input(2)
    s, rank = G.param(scale), G.rank(x)
    if (
        s is None
        or rank is None
        or (bias and G.param(bias) is None)
        or int(n.attr("axis", -1)) % rank != rank - s.ndim
        or not all(G.unused(o) for o in n.outputs[1:])
    ):
        return None
    shape = str(s.shape[0]) if s.ndim == 1 else str(tuple(s.shape))
    eps = float(n.attr("epsilon", 1e-5))
    args = (
        [shape]
        + ([f"eps={_num(eps)}"] if np.float32(eps) != np.float32(1e-5) else [])
        + ([] if bias else ["bias=False"])
    )
    state = {"weight": (scale, False)} | ({"bias": (bias, False)} if bias else {})
    return LayerUse(
        Layer("norm", f"nn.LayerNorm({', '.join(args)})", state), x, n.outputs[0], [n], G.module_of(scale)
    )


def _embedding(G: _Graph, n: Node) -> LayerUse | None:
    w = G.param(n.input(0), 2)
    dtype = G.dtype(n.input(1))
    if w is None or int(n.attr("axis", 0)) != 0 or dtype is None or dtype.kind not in "iu":
        return None
    layer = Layer("embedding", f"nn.Embedding({w.shape[0]}, {w.shape[1]})", {"weight": (n.input(0), False)})
    return LayerUse(layer, n.input(1), n.outputs[0], [n], G.module_of(n.input(0)))


_LAYERS: dict[str, Callable[[_Graph, Node], LayerUse | None]] = {
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "Gemm": _gemm,
    "MatMul": _matmul,
    "BatchNormalization": _batch_norm,
    "LayerNormalization": _layer_norm,
    "Gather": _embedding,
}


# -- stateless ops with a PyTorch form ---------------------------------------------------------------
def _pool(G: _Graph, n: Node, fn: str, cls: str) -> Function | None:
    if G.rank(n.input(0)) != 4 or n.attr("auto_pad", "NOTSET") != "NOTSET" or n.attr("storage_order", 0):
        return None
    if len(n.outputs) > 1 and not all(G.unused(o) for o in n.outputs[1:]):
        return None
    kernel = list(n.attr("kernel_shape"))
    pads = list(n.attr("pads", [0] * 4))
    strides = list(n.attr("strides", [1, 1]))
    if pads[:2] != pads[2:] or any(2 * p > k for p, k in zip(pads[:2], kernel)):
        return None
    args = [_ints(kernel)] + ([] if strides == kernel else [f"stride={_ints(strides)}"])
    args += [f"padding={_ints(pads[:2])}"] if any(pads) else []
    dilations = list(n.attr("dilations", [1, 1]))
    if fn == "max_pool2d" and dilations != [1, 1]:
        args.append(f"dilation={_ints(dilations)}")
    elif dilations != [1, 1]:
        return None
    if n.attr("ceil_mode", 0):
        args.append("ceil_mode=True")
    if fn == "avg_pool2d" and any(pads) and not n.attr("count_include_pad", 0):
        args.append("count_include_pad=False")
    return Function(fn, ", ".join(args), cls)


def _softmax(fn: str, cls: str) -> Callable[[_Graph, Node], Function]:
    return lambda G, n: Function(fn, f"dim={int(n.attr('axis', -1))}", cls)


def _flatten(G: _Graph, n: Node) -> Function | None:
    return (
        Function("flatten", "1", "Flatten", "")
        if n.attr("axis", 1) == 1 and (G.rank(n.input(0)) or 0) >= 2
        else None
    )


def _alpha(fn: str, cls: str, default: float) -> Callable[[_Graph, Node], Function]:
    def rule(G: _Graph, n: Node) -> Function:
        alpha = float(n.attr("alpha", default))
        return Function(fn, "" if np.float32(alpha) == np.float32(default) else _num(alpha), cls)

    return rule


def _global_pool(fn: str, cls: str) -> Callable[[_Graph, Node], Function | None]:
    return lambda G, n: Function(fn, "1", cls) if G.rank(n.input(0)) == 4 else None


def _clip(G: _Graph, n: Node) -> Function | None:
    """Clip(x, 0, 6) is relu6, other constant bounds hardtanh (bounds as inputs or, before
    opset 11, attributes)."""
    bounds = []
    for i, attr in ((1, "min"), (2, "max")):
        c = G.const(n.input(i)) if n.input(i) else n.attr(attr)
        if c is None or np.size(c) != 1:
            return None
        bounds.append(float(np.asarray(c).reshape(-1)[0]))
    lo, hi = bounds
    if (lo, hi) == (0.0, 6.0):
        return Function("relu6", "", "ReLU6")
    return Function("hardtanh", f"{_num(lo)}, {_num(hi)}", "Hardtanh") if lo <= hi else None


def _hard_sigmoid(G: _Graph, n: Node) -> Function | None:
    """PyTorch's hardsigmoid is HardSigmoid(alpha=1/6, beta=0.5); other slopes are generic."""
    alpha, beta = float(n.attr("alpha", 0.2)), float(n.attr("beta", 0.5))
    if np.float32(alpha) != np.float32(1 / 6) or np.float32(beta) != np.float32(0.5):
        return None
    return Function("hardsigmoid", "", "Hardsigmoid")


def _selu(G: _Graph, n: Node) -> Function | None:
    """SELU with ONNX's default constants (PyTorch's, in float32)."""
    return None if n.attr("alpha") is not None or n.attr("gamma") is not None else Function("selu", "", "SELU")


def _dropout(G: _Graph, n: Node) -> Function | None:
    ratio = n.input(1)
    p = 0.5 if not ratio else G.const(ratio)
    if p is None or np.size(p) != 1 or (len(n.outputs) > 1 and not G.unused(n.outputs[1])):
        return None
    return Function("dropout", _num(float(np.asarray(p).reshape(-1)[0])), "Dropout")


def _transpose(G: _Graph, n: Node) -> Function | None:
    rank = G.rank(n.input(0))
    perm = n.attr("perm", list(reversed(range(rank))) if rank is not None else None)
    return None if perm is None else Function("permute", _value(list(perm)))


def _unsqueeze(G: _Graph, n: Node) -> Function | None:
    axes = G.const(n.input(1))
    return (
        Function("unsqueeze", str(int(axes.reshape(-1)[0]))) if axes is not None and axes.size == 1 else None
    )


def _reshape(G: _Graph, n: Node) -> Function | None:
    """Only targets that mean the same in PyTorch (no 0 = "copy this dim")."""
    shape = G.const(n.input(1))
    if shape is None or shape.ndim != 1 or 0 in shape.tolist() or n.attr("allowzero", 0):
        return None
    return Function("reshape", _value(shape.tolist()))


def _reduce(fn: str) -> Callable[[_Graph, Node], Function | None]:
    def rule(G: _Graph, n: Node) -> Function | None:
        """Axes as an attribute (older opsets) or a constant input (newer ones)."""
        a = G.const(n.input(1))
        if n.attr("noop_with_empty_axes", 0) or (n.input(1) and a is None):
            return None
        axes = n.attr("axes") if a is None else a.reshape(-1).tolist()
        keep = bool(n.attr("keepdims", 1))
        args = ([_value(list(axes))] if axes is not None else ["None"]) + (["keepdim=True"] if keep else [])
        return Function(fn, ", ".join(args)) if args != ["None"] else Function(fn)

    return rule


_FUNCTIONS: dict[str, Callable[[_Graph, Node], Function | None]] = {
    "Transpose": _transpose,
    "Unsqueeze": _unsqueeze,
    "Reshape": _reshape,
    "ReduceMean": _reduce("mean"),
    "ReduceSum": _reduce("sum"),
    "Relu": lambda G, n: Function("relu", "", "ReLU"),
    "Sigmoid": lambda G, n: Function("sigmoid", "", "Sigmoid"),
    "Tanh": lambda G, n: Function("tanh", "", "Tanh"),
    "Exp": lambda G, n: Function("exp"),
    "Log": lambda G, n: Function("log"),
    "Sqrt": lambda G, n: Function("sqrt"),
    "LeakyRelu": _alpha("leaky_relu", "LeakyReLU", 0.01),
    "Elu": _alpha("elu", "ELU", 1.0),
    "Softmax": _softmax("softmax", "Softmax"),
    "LogSoftmax": _softmax("log_softmax", "LogSoftmax"),
    "Flatten": _flatten,
    "GlobalAveragePool": _global_pool("adaptive_avg_pool2d", "AdaptiveAvgPool2d"),
    "GlobalMaxPool": _global_pool("adaptive_max_pool2d", "AdaptiveMaxPool2d"),
    "Clip": _clip,
    "HardSwish": lambda G, n: Function("hardswish", "", "Hardswish"),
    "HardSigmoid": _hard_sigmoid,
    "Softplus": lambda G, n: Function("softplus", "", "Softplus"),
    "Softsign": lambda G, n: Function("softsign", "", "Softsign"),
    "Selu": _selu,
    "Celu": _alpha("celu", "CELU", 1.0),
    "MaxPool": lambda G, n: _pool(G, n, "max_pool2d", "MaxPool2d"),
    "AveragePool": lambda G, n: _pool(G, n, "avg_pool2d", "AvgPool2d"),
    "Dropout": _dropout,
}


@dataclass
class Composite:
    """Several nodes that are one PyTorch function (the exporter's decomposition of F.gelu)."""

    function: Function
    x: str
    y: str
    nodes: list[Node]


def _is_number(G: _Graph, v: str, target: float) -> bool:
    a = G.const(v)
    return a is not None and a.size == 1 and bool(np.float32(a.reshape(-1)[0]) == np.float32(target))


def _other(n: Node, v: str) -> str:
    return n.inputs[1] if n.inputs[0] == v else n.inputs[0]


def _gelu(G: _Graph, n: Node) -> Composite | None:
    """x * (erf(x / sqrt 2) + 1) * 0.5: F.gelu as exported below opset 20 (the TorchScript
    exporter multiplies by x first, the dynamo one by 0.5 first: exact either way)."""
    if n.op != "Div" or len(n.inputs) != 2 or not _is_number(G, n.inputs[1], math.sqrt(2.0)):
        return None
    x = n.inputs[0]
    for last in ((("Mul", "x"), ("Mul", 0.5)), (("Mul", 0.5), ("Mul", "x"))):
        chain, v = [n], n.outputs[0]
        for op, check in (("Erf", None), ("Add", 1.0), *last):
            nxt = G.only_use(v)
            if nxt is None or nxt.op != op or (check is not None and len(nxt.inputs) != 2):
                break
            other = _other(nxt, v) if check is not None else ""
            if (check == "x" and other != x) or (isinstance(check, float) and not _is_number(G, other, check)):
                break
            chain.append(nxt)
            v = nxt.outputs[0]
        else:
            return Composite(Function("gelu", "", "GELU"), x, v, chain)
    return None


_COMPOSITES: dict[str, Callable[[_Graph, Node], Composite | None]] = {"Div": _gelu}


# Integer arithmetic on a dim that stays symbolic in the generated code (dims are positive, so
# ONNX's truncating Div is Python's floor division).
_DIM_OPS: dict[str, tuple[Callable[[int, int], int], str]] = {
    "Mul": (operator.mul, "*"), "Add": (operator.add, "+"), "Sub": (operator.sub, "-"), "Div": (operator.floordiv, "//"),
}


@dataclass(frozen=True)
class _Dim:
    """tensor.shape[k], then arithmetic with constants: `x.shape[0] * 2` (the dynamo exporter
    computes nn.MultiheadAttention's batch * heads this way)."""

    tensor: str
    k: int
    ops: tuple[tuple[str, int], ...] = ()

    def values(self, G: _Graph) -> tuple[int, int] | None:
        """The dim for both stand-in batch sizes."""
        pair = G.dim(self.tensor, self.k)
        for op, c in self.ops if pair is not None else ():
            pair = (_DIM_OPS[op][0](pair[0], c), _DIM_OPS[op][0](pair[1], c))
        return pair

    def text(self, tensor: str) -> str:
        out = f"{tensor}.shape[{self.k}]"
        for i, (op, c) in enumerate(self.ops):
            out = f"{f'({out})' if i else out} {_DIM_OPS[op][1]} {c}"
        return out


def _dim_arithmetic(G: _Graph, n: Node, chain: list[Node]) -> list[Any] | None:
    """[dim op c] for a one-element shape and an int constant (c on either side of * and +)."""
    if len(n.inputs) != 2:
        return None
    sides = [G.const(v) for v in n.inputs]
    k = 0 if sides[1] is not None else 1  # the dim's side
    c = sides[1 - k]
    if c is None or c.size != 1 or c.dtype.kind not in "iu" or sides[k] is not None:
        return None
    if k == 1 and n.op not in ("Mul", "Add"):
        return None
    dims = _shape_dims(G, n.inputs[k], chain)
    c = int(c.reshape(-1)[0])
    if dims is None or len(dims) != 1 or not isinstance(dims[0], _Dim) or (n.op == "Div" and c <= 0):
        return None
    d = dims[0]
    return [_Dim(d.tensor, d.k, d.ops + ((n.op, c),))]


def _shape_dims(G: _Graph, v: str, chain: list[Node]) -> list[Any] | None:
    """A shape computed from tensor shapes (Shape/Gather/Unsqueeze/Concat, arithmetic), as
    Python dims: ints, or a _Dim for tensor.shape[k]. `chain` collects the nodes it reads."""
    c = G.const(v)
    if c is not None:
        return [int(d) for d in c.reshape(-1)] if c.dtype.kind in "iu" and c.ndim <= 1 else None
    n = G.producers.get(v)
    if n is None:
        return None
    if n.op == "Shape":
        rank = G.rank(n.input(0))
        if rank is None:
            return None
        start, end = (
            max(0, min(rank, k + rank if k < 0 else k)) for k in (n.attr("start", 0), n.attr("end", rank))
        )
        out = [_Dim(n.input(0), k) for k in range(start, end)]
    elif n.op == "Gather" and int(n.attr("axis", 0)) == 0:
        src, idx = _shape_dims(G, n.input(0), chain), G.const(n.input(1))
        if src is None or idx is None or not all(-len(src) <= int(i) < len(src) for i in idx.reshape(-1)):
            return None
        out = [src[int(i)] for i in idx.reshape(-1)]
    elif n.op in ("Unsqueeze", "Squeeze", "Cast", "Identity", "Reshape"):
        out = _shape_dims(G, n.input(0), chain)  # scalar or 1-D: the same list of dims here
        if out is None or (n.op != "Cast" and n.op != "Identity" and len(out) != 1):
            return None
    elif n.op == "Slice":  # Shape(x)[1:3] with constant bounds
        src, bounds = _shape_dims(G, n.input(0), chain), [G.const(v) for v in n.inputs[1:]]
        if src is None or len(bounds) < 2 or any(b is None or b.size != 1 for b in bounds):
            return None
        start, end, *rest = (int(b.reshape(-1)[0]) for b in bounds)
        if rest[:1] not in ([], [0], [-1]) or rest[1:] not in ([], [1]):  # axis 0, step 1
            return None
        out = src[slice(start, end)]
    elif n.op in _DIM_OPS:
        out = _dim_arithmetic(G, n, chain)
        if out is None:
            return None
    elif n.op == "Concat" and int(n.attr("axis", 0)) == 0:
        parts = [_shape_dims(G, i, chain) for i in n.inputs]
        if any(p is None for p in parts):
            return None
        out = [d for p in parts for d in p]
    else:
        return None
    chain.append(n)
    return out


def _dynamic_reshape(G: _Graph, n: Node) -> tuple[list[Any], list[Node]] | None:
    """Reshape(x, Concat(Shape(x)[0], -1)): `x.view(x.size(0), -1)` as exported. Only targets the
    tracer writes back as they were: x's own dims in place, and at most one dim it has to infer
    (a -1, or another tensor's dim that may depend on the batch), no literal 0."""
    chain: list[Node] = []
    if G.const(n.input(1)) is not None:
        return None
    dims = _shape_dims(G, n.input(1), chain)
    if dims is None:
        return None
    x, unknown = n.input(0), 0
    for i, d in enumerate(dims):
        if d == 0 and not n.attr("allowzero", 0):
            dims[i] = _Dim(x, i)  # ONNX's 0: this dim of the input
        elif d == 0:
            return None
        elif d == -1 or (isinstance(d, _Dim) and not _in_place(G, d, x, i)):
            unknown += 1
    return (dims, chain) if unknown <= 1 else None  # more than one unknown: ambiguous


def _private_chain_nodes(G: _Graph, reshapes: dict[int, tuple[list[Any], list[Node]]]) -> set[int]:
    """The shape-chain nodes that only recognised reshapes (and other such chain nodes) read:
    they need not be written. Exporters share one chain between several views (the dynamo
    exporter's batch size for every head split); a chain node something else reads is written."""
    skip = {id(m) for _, chain in reshapes.values() for m in chain}
    nodes = {id(m): m for _, chain in reshapes.values() for m in chain}
    while True:
        readers = set(reshapes) | skip
        needed = {
            k for k in skip
            if any(o in G.g.outputs or any(id(u) not in readers and id(u) in G.live for u, _ in G.uses.get(o, []))
                   for o in nodes[k].outputs if o)
        }
        if not needed:
            return skip
        skip -= needed


def _in_place(G: _Graph, d: _Dim, x: str, i: int) -> bool:
    """Whether the tracer writes `d` at position i of x's reshape as a number or as 0 (a static
    dim, or the same batch-dependent dim as x's own dim i), not as -1."""
    pair, own = d.values(G), G.dim(x, i)
    return pair is not None and (pair[0] == pair[1] or pair == own)


_RANDOM = {
    "Dropout",
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
}
# Inputs these ops read only for their shape or dtype: a static one makes the output a constant.
_PER_BATCH_LIMIT = 1024  # elements of a batch-dependent value kept for folding what follows (shapes)
_SHAPE_ONLY: dict[str, tuple[int, ...]] = {"Shape": (0,), "Size": (0,), "CastLike": (1,), "EyeLike": (0,)}
_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "Pow": "**", "MatMul": "@"}


# -- the module tree (attributes, nested as the PyTorch module was) ---------------------------------
@dataclass
class _Leaf:
    ctor: str
    is_module: bool = True
    order: int | None = None  # where its first state tensor is in the file (PyTorch's state_dict order)


class _Tree:
    """Dotted paths -> nested attributes; paths that cannot nest are flattened to one name."""

    def __init__(self, reserved: set[str]):
        self.root: dict[str, Any] = {}
        self.reserved = reserved

    def _fits(self, parts: list[str]) -> bool:
        if (
            not parts
            or not parts[0].isidentifier()
            or keyword.iskeyword(parts[0])
            or parts[0] in self.reserved
        ):
            return False
        node = self.root
        for i, p in enumerate(parts):
            if not (p.isidentifier() and not keyword.iskeyword(p) or p.isdigit()) or (
                i and p in self.reserved
            ):
                return False
            if p in node:
                if i == len(parts) - 1 or isinstance(node[p], _Leaf):
                    return False
                node = node[p]
            else:
                return True
        return False

    def add(self, path: str, leaf: _Leaf, default: str) -> str:
        """Insert under `path` (or a free name derived from it); returns the path used."""
        parts = path.split(".") if path else []
        if not self._fits(parts):
            base = _identifier("_".join(parts) if parts else default, default)
            base = base + "_" if base in self.reserved else base
            path, k = base, 1
            while not self._fits([path]):
                path, k = f"{base}_{k}", k + 1
            parts = [path]
        node = self.root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = leaf
        return ".".join(parts)

    def has(self, path: str) -> bool:
        node: Any = self.root
        for p in path.split("."):
            if not isinstance(node, dict) or p not in node:
                return False
            node = node[p]
        return True

    @staticmethod
    def _is_list(node: dict[str, Any]) -> bool:
        keys = list(node)
        return (
            all(k.isdigit() for k in keys)
            and all(not isinstance(v, _Leaf) or v.is_module for v in node.values())
            and max(int(k) for k in keys) < len(keys) + 16
        )

    def access(self, path: str) -> str:
        """`self.layer1[0].conv1` for "layer1.0.conv1"."""
        node, out = self.root, "self"
        for p in path.split("."):
            if isinstance(node, dict) and self._is_list(node):
                out += f"[{p}]"
            elif p.isidentifier():
                out += f".{p}"
            else:
                out = f'getattr({out}, "{p}")'
            node = node[p]
        return out

    @classmethod
    def _order(cls, node: Any) -> int | None:
        if isinstance(node, _Leaf):
            return node.order
        orders = [o for o in (cls._order(v) for v in node.values()) if o is not None]
        return min(orders, default=None)

    @classmethod
    def ordered(cls, node: dict[str, Any]) -> list[tuple[str, Any]]:
        """Children in PyTorch's state_dict order (by their first state tensor in the file);
        a stateless one stays right after the sibling it followed."""
        keys, last = [], -1.0
        for i, (name, child) in enumerate(node.items()):
            order = cls._order(child)
            last = float(order) if order is not None else last + 1e-6
            keys.append((last, i))
        return [item for _, item in sorted(zip(keys, node.items()))]

    def render(self, node: Any, depth: int) -> str:
        if isinstance(node, _Leaf):
            return node.ctor
        pad, inner = INDENT * depth, INDENT * (depth + 1)
        if self._is_list(node):
            items = [node.get(str(i)) for i in range(max(int(k) for k in node) + 1)]
            body = [self.render(v, depth + 1) if v is not None else "nn.Identity()" for v in items]
            return "nn.ModuleList([\n" + "".join(f"{inner}{b},\n" for b in body) + pad + "])"
        named = [f"{k}={self.render(v, depth + 1)}" for k, v in self.ordered(node) if k.isidentifier()]
        numbered = [
            f'"{k}": {self.render(v, depth + 1)}' for k, v in self.ordered(node) if not k.isidentifier()
        ]
        body = named + (["**{" + ", ".join(numbered) + "}"] if numbered else [])
        return "_container(\n" + "".join(f"{inner}{b},\n" for b in body) + pad + ")"


# -- the writer ----------------------------------------------------------------------------------------
@dataclass
class Generated:
    code: str
    state: dict[str, np.ndarray]  # the generated Model's state_dict, from the ONNX file's weights


def _reserved_names() -> set[str]:
    from .nn.module import Module  # only for the names an attribute must not shadow

    return {n for n in dir(Module) if not n.startswith("__")} | {"from_file"}


_REF = re.compile("\x00([^\x00]*)\x00")


class _Writer:
    """Walks the graph once, in order, writing forward lines and collecting layer attributes.

    Attribute access (`self.layer1[0].conv1`) depends on the whole tree (a container is a
    ModuleList only when all its children are numbered modules), so lines hold `ref(path)`
    placeholders until `resolve`."""

    def __init__(self, model: Model):
        self.G = _Graph(model)
        self.tree = _Tree(_reserved_names())
        self.layers: dict[str, Layer] = {}  # path -> layer
        self.state_ref: dict[str, str] = {}  # graph state tensor -> expression (graph layout)
        self.free_state: dict[str, str] = {}  # path of a free Parameter/Buffer -> graph tensor
        self.scope_paths: dict[str, str] = {}  # module scope of a stateless layer -> its path
        self.leaf_scopes: dict[str, Function] = {}  # scopes that were stateless layers
        self.composites: dict[int, Composite] = {}  # first node -> the function it starts
        self.lines: list[str] = []
        self.vars: dict[str, str] = {}  # graph value -> Python expression
        self.taken = {"self", "F", "nn", "np", "_container", "Model", "Trainable", "load", "os", "Path"}

    @staticmethod
    def ref(path: str) -> str:
        return f"\x00{path}\x00"

    def resolve(self, text: str) -> str:
        return _REF.sub(lambda m: self.tree.access(m.group(1)), text)

    # names
    def var(self, base: str) -> str:
        base = _identifier(base, "x")
        base = base + "_" if base in _BUILTINS else base
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def out_var(self, value: str, base: str) -> str:
        """The variable for a node output: the graph output's own name when it is one."""
        if value in self.G.g.outputs and value.isidentifier() and not keyword.iskeyword(value):
            base = value
        return self.var(base)

    def is_tensor(self, v: str) -> bool:
        return v in self.vars or v in self.G.params or v in self.G.buffers

    # operands
    def expr(self, value: str, like: str | None = None) -> str:
        """Python for a graph value: a variable, the state it is, or a constant literal
        (`F.constant(..., like)` where a tensor operand is needed)."""
        if not value:
            return "None"
        if value in self.vars:
            return self.vars[value]
        G = self.G
        if value in G.params or value in G.buffers:
            if value not in self.state_ref:
                self.add_free_state(value)
            return self.state_ref[value]
        a = G.const(value)
        if a is None:
            raise AnygradError(f"codegen: value '{value}' is used before it is computed")
        if like is None:
            return _array(np.asarray(a))
        return f"F.constant({_array(np.asarray(a))}, {like})"

    def add_free_state(self, value: str) -> None:
        """A parameter or buffer no layer owns: an attribute of its own (zeros until loaded)."""
        G = self.G
        a = G.g.initializers[value]
        kind = "Parameter" if value in G.params else "Buffer"
        ctor = f"nn.{kind}(np.zeros({tuple(a.shape)}, dtype=np.{a.dtype.name}))"
        path = self.tree.add(G.torch_names.get(value, value), _Leaf(ctor, False, G.order[value]), "param")
        self.state_ref[value] = self.ref(path)
        self.free_state[path] = value

    # layers
    def add_layer(self, use: LayerUse, node: Node) -> str | None:
        """The path of the layer attribute for `use`: the same layer called again is reused;
        weights another layer already holds (tied) are left to the generic path (None)."""
        layer = use.layer
        for path, known in self.layers.items():
            if known == layer:
                return path
        if any(tensor in self.state_ref for tensor, _ in layer.state.values()):
            return None
        hint = use.path_hint or ".".join(_module_path(node.name))
        order = min(self.G.order[tensor] for tensor, _ in layer.state.values())
        path = self.tree.add(hint, _Leaf(layer.ctor, True, order), layer.kind)
        self.layers[path] = layer
        for attr, (tensor, transposed) in layer.state.items():
            self.state_ref[tensor] = f"{self.ref(path)}.{attr}" + (".t()" if transposed else "")
        return path

    def assign(self, value: str, base: str, code: str) -> None:
        y = self.out_var(value, base)
        self.lines.append(f"{y} = {code}")
        self.vars[value] = y

    # the walk
    def forward(self) -> None:
        G = self.G
        nodes = [n for n in G.g.nodes if id(n) in G.live]
        for node in nodes:  # constants first: the layer rules read them (a zero bias is no bias)
            if not any(o in G.g.outputs for o in node.outputs):
                self._fold(node)
        G.live = G._live()  # what only folded nodes read is not written either
        nodes = [n for n in nodes if id(n) in G.live]
        # Layer patterns first: a pattern may start before its anchor (Transpose(W) before MatMul).
        matches: dict[int, LayerUse] = {}
        held: set[int] = set()  # nodes waiting for their anchor's decision
        for node in nodes:
            rule, composite = _LAYERS.get(node.op), _COMPOSITES.get(node.op)
            use = rule(G, node) if rule and id(node) not in held else None
            if use is not None:
                matches[id(node)] = use
                held.update(id(m) for m in use.nodes if m is not node)
            c = composite(G, node) if composite and id(node) not in held else None
            if c is not None:
                self.composites[id(node)] = c
                held.update(id(m) for m in c.nodes if m is not node)
        reshapes: dict[int, tuple[list[Any], list[Node]]] = {}
        for node in nodes:
            found = _dynamic_reshape(G, node) if node.op == "Reshape" and id(node) not in held else None
            if found is not None and not any(id(m) in held for m in found[1]):
                reshapes[id(node)] = found
        held.update(_private_chain_nodes(G, reshapes))
        done: set[int] = set()
        leaf_scopes = self.leaf_scopes = self._stateless_scopes()
        for node in nodes:
            if id(node) in done:
                continue
            if id(node) in reshapes:
                dims, chain = reshapes[id(node)]
                if node.inputs[0] in self.vars:
                    x = self.vars[node.inputs[0]]
                    text = ", ".join(
                        d.text(self.expr(d.tensor)) if isinstance(d, _Dim) else str(d) for d in dims
                    )
                    base = "_".join(_module_path(node.name) + [_op_part(node.name, node.op)])
                    self.assign(node.outputs[0], base, f"F.reshape({x}, [{text}])")
                    done.update(id(m) for m in chain)
                    continue
                held.difference_update(id(m) for m in chain)
                for m in chain:  # written once, though other reshapes may share it
                    if any(o and o not in self.vars for o in m.outputs):
                        self._stateless(m, leaf_scopes)
                    done.add(id(m))
            c = self.composites.get(id(node))
            if c is not None:
                if c.x in self.vars:
                    scope = ".".join(_module_path(node.name))
                    self._call(
                        c.function, self.vars[c.x], c.y, scope, "_".join(scope.split(".") + [c.function.fn])
                    )
                    done.update(id(n) for n in c.nodes)
                    continue
                held.difference_update(id(m) for m in c.nodes)
            use = matches.get(id(node))
            if use is None and id(node) in held:
                continue
            path = self.add_layer(use, node) if use is not None and use.x in self.vars else None
            if path is not None:
                done.update(id(n) for n in use.nodes)
                self.assign(use.y, path.replace(".", "_"), f"{self.ref(path)}({self.vars[use.x]})")
                continue
            if use is not None:  # not a layer after all: its other nodes are written as they are
                held.difference_update(id(m) for m in use.nodes)
                for m in use.nodes[: use.nodes.index(node)]:
                    self._stateless(m, leaf_scopes)
                    done.add(id(m))
            self._stateless(node, leaf_scopes)

    def _stateless_scopes(self) -> dict[str, Function]:
        """Module scopes that hold one stateless op kind only (`/relu/Relu`, `/pool/...`): these
        were layers of their own (nn.ReLU(), nn.AdaptiveAvgPool2d(1)) in the PyTorch module."""
        G = self.G
        by_scope: dict[str, list[Node]] = {}
        for n in G.g.nodes:
            if id(n) in G.live:
                by_scope.setdefault(".".join(_module_path(n.name)), []).append(n)
        weighted = {G.torch_names.get(v, v).rpartition(".")[0] for v in G.params | G.buffers}
        out: dict[str, Function] = {}
        for scope, nodes in by_scope.items():
            if not scope or any(w == scope or w.startswith(scope + ".") for w in weighted):
                continue
            if any(s.startswith(scope + ".") for s in by_scope):
                continue
            members = {id(m) for c in self.composites.values() for m in c.nodes[1:]}
            functions = [
                self.composites[id(n)].function
                if id(n) in self.composites
                else _FUNCTIONS[n.op](G, n)
                if n.op in _FUNCTIONS
                else None
                for n in nodes
                if id(n) not in members
            ]
            kinds = {(f.cls, f.cls_args, f.fn_args) for f in functions if f is not None}
            if all(f is not None and f.cls for f in functions) and len(kinds) == 1:
                out[scope] = functions[0]
        return out

    def _fold(self, node: Node) -> None:
        """Compute a node whose inputs are all constants now (exporters leave such chains).

        Shapes count as constants where they are: a node is run for both stand-in batch sizes,
        with the inputs it reads only for their shape or dtype (`_SHAPE_ONLY`) standing in as
        zero-stride arrays, and folded when both runs agree. Small results that differ (a shape
        holding the batch size) are kept per stand-in, so what is computed from their static
        part folds too: the dynamo exporter's zero bias Expand(CastLike(0, x), Shape(W)[:1]),
        the attention scale 1 / sqrt(Shape(q)[-1])."""
        G = self.G
        op = get_op(node.op)
        if op is None or op.forward is None or node.op in _RANDOM or not node.inputs:
            return
        if any(v in G.per_batch for v in node.inputs) and not all(G.small(o) for o in node.outputs if o):
            return  # a batch-sized tensor, not a shape: not worth computing here
        runs = []
        for side, info in enumerate((G.info, G.info_alt)):
            values = []
            for i, v in enumerate(node.inputs):
                a = G.const(v) if v else None
                if a is None and v in G.per_batch:
                    a = G.per_batch[v][side]
                elif a is None and v and i in _SHAPE_ONLY.get(node.op, ()):
                    inf = info.get(v)  # a zero-stride stand-in: only its shape and dtype are read
                    a = None if inf is None or inf.shape is None else np.broadcast_to(
                        np.zeros((), inf.dtype), tuple(int(d) for d in inf.shape))
                if v and a is None:
                    return
                values.append(a)
            try:
                runs.append([np.asarray(o) for o in op.run(node, values)])
            except Exception:  # noqa: BLE001  (not foldable here: written as a node instead)
                return
        a, b = runs
        if all(x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b)):
            G.folded.update((o, x) for o, x in zip(node.outputs, a) if o)
            return
        for o, x, y in zip(node.outputs, a, b):  # depends on the batch size: not a constant
            if o and x.size <= _PER_BATCH_LIMIT and y.size <= _PER_BATCH_LIMIT:
                G.per_batch[o] = (x, y)

    def _stateless(self, node: Node, leaf_scopes: dict[str, Function]) -> None:
        G = self.G
        scope = ".".join(_module_path(node.name))
        base = "_".join(_module_path(node.name) + [_op_part(node.name, node.op)])
        ins = node.inputs
        if all(o in G.folded for o in node.outputs if o):
            return  # computed before the walk
        if node.op == "Slice" and ins and self.is_tensor(ins[0]):
            index = self._index(node)
            if index is not None:
                self.assign(node.outputs[0], base, f"{self.expr(ins[0])}[{index}]")
                return
        if node.op == "Identity" and ins and ins[0] in self.vars:
            self.vars[node.outputs[0]] = self.vars[ins[0]]
            return
        if node.op in _BINARY and len(ins) == 2 and any(self.is_tensor(v) for v in ins):
            self.assign(node.outputs[0], base, self._binary(node))
            return
        if node.op == "Concat" and ins and all(self.is_tensor(v) for v in ins) and len(node.outputs) == 1:
            parts = ", ".join(self.expr(v) for v in ins)
            self.assign(node.outputs[0], base, f"F.cat([{parts}], dim={int(node.attr('axis'))})")
            return
        f = None  # a PyTorch form takes one tensor; other inputs are constants it reads
        if (
            node.op in _FUNCTIONS
            and ins
            and self.is_tensor(ins[0])
            and not any(self.is_tensor(v) for v in ins[1:])
        ):
            f = _FUNCTIONS[node.op](G, node)
        if f is None:
            self._generic(node, base)
            return
        self._call(f, self.expr(ins[0]), node.outputs[0], scope, base)

    def _call(self, f: Function, x: str, y: str, scope: str, base: str) -> None:
        """`self.<scope>(x)` when the scope was a stateless layer of its own, else `F.<fn>(x, ...)`."""
        if scope in self.leaf_scopes and f.cls:
            if scope not in self.scope_paths:
                args = f.cls_args if f.cls_args is not None else f.fn_args
                self.scope_paths[scope] = self.tree.add(scope, _Leaf(f"nn.{f.cls}({args})"), _snake(f.cls))
            path = self.scope_paths[scope]
            self.assign(y, path.replace(".", "_"), f"{self.ref(path)}({x})")
        else:
            self.assign(y, base, f"F.{f.fn}({x}{', ' + f.fn_args if f.fn_args else ''})")

    def _index(self, node: Node) -> str | None:
        """Slice with constant starts/ends/axes/steps as Python indexing: x[:, :, :8]."""
        G = self.G
        x, *rest = node.inputs
        arrays = [G.const(v) for v in rest]
        rank = G.rank(x)
        if len(rest) < 2 or any(a is None for a in arrays) or rank is None:
            return None
        starts, ends = arrays[0].tolist(), arrays[1].tolist()
        axes = arrays[2].tolist() if len(arrays) > 2 else list(range(len(starts)))
        steps = arrays[3].tolist() if len(arrays) > 3 else [1] * len(starts)
        if any(s <= 0 for s in steps) or len({a % rank for a in axes}) != len(axes):
            return None
        parts = [":"] * rank
        for start, end, axis, step in zip(starts, ends, axes, steps):
            text = (str(start) if start else "") + ":" + (str(end) if end < 2**62 else "")
            parts[axis % rank] = text + (f":{step}" if step != 1 else "")
        while len(parts) > 1 and parts[-1] == ":":
            parts.pop()
        return ", ".join(parts)

    def _binary(self, node: Node) -> str:
        G = self.G
        sides = []
        for v, other in zip(node.inputs, reversed(node.inputs)):
            if self.is_tensor(v):
                sides.append(self.expr(v))
                continue
            a = np.asarray(G.const(v))
            if a.ndim == 0 and a.dtype == G.dtype(other) and node.op != "MatMul":
                number = _num(a.item(), a.dtype)  # a Python number takes the tensor's dtype
                sides.append(f"({number})" if number.startswith("-") and not sides else number)  # -1 ** x
            else:
                sides.append(self.expr(v, like=self.expr(other)))
        return f"{sides[0]} {_BINARY[node.op]} {sides[1]}"

    def _generic(self, node: Node, base: str) -> None:
        G = self.G
        args = [f'"{node.op}"'] + [self.expr(v) for v in node.inputs]
        for k, v in node.attrs.items():
            ok = k.isidentifier() and not keyword.iskeyword(k) and k != "n_out"
            args.append(f"{k}={_value(v)}" if ok else f"**{{{k!r}: {_value(v)}}}")
        used = [i for i, o in enumerate(node.outputs) if not G.unused(o)]
        n_out = max(used, default=0) + 1
        if n_out > 1:
            args.append(f"n_out={n_out}")
        call = f"F.onnx_op({', '.join(args)})"
        if len(call) > 80 or "\n" in call:
            call = "F.onnx_op(\n" + "".join(textwrap.indent(f"{a},", INDENT) + "\n" for a in args) + ")"
        if n_out == 1:
            self.assign(node.outputs[0], base, call)
            return
        names = []
        for i, o in enumerate(node.outputs[:n_out]):
            if G.unused(o):
                names.append("_")
            else:
                names.append(self.out_var(o, f"{base}_{i}"))
                self.vars[o] = names[-1]
        self.lines.append(f"{', '.join(names)} = {call}")

    # the result
    def state(self) -> dict[str, np.ndarray]:
        inits = self.G.g.initializers
        out: dict[str, np.ndarray] = {}
        for path, layer in self.layers.items():
            for attr, (tensor, transposed) in layer.state.items():
                a = np.asarray(inits[tensor])
                out[f"{path}.{attr}"] = np.ascontiguousarray(a.T if transposed else a)
            for counter in layer.counters:
                out[f"{path}.{counter}"] = np.array(0, np.int64)
        for path, tensor in self.free_state.items():
            out[path] = np.asarray(inits[tensor])
        return out


def _input_shape(info: TensorInfo) -> str:
    dims = [None if (i == 0 and isinstance(d, str)) else d for i, d in enumerate(info.shape)]
    return (
        "("
        + ", ".join(_str(d) if isinstance(d, str) else repr(d) for d in dims)
        + ("," if len(dims) == 1 else "")
        + ")"
    )


def generate(
    model: Model,
    source: str = "model.onnx",
    module: str = "model.py",
    weights: str = "model.safetensors",
    command: str | None = None,
    weights_written: bool = True,
) -> Generated:
    """Python source of a `Model(anygrad.nn.Module)` for an imported model, and its state_dict.

    `source`, `module` and `weights` are the names written into the file (the ONNX file, the
    generated file, the weights file relative to it); `command` how to regenerate it, less the
    --no-weights added when the weights are not written; `weights_written` whether the weights file
    is written beside it (the docstring says where weights come from otherwise)."""
    g = model.graph
    if not g.inputs:
        raise AnygradError(f"{source}: the graph has no inputs; nothing to generate a forward for")
    w = _Writer(model)
    inputs = []
    for name in g.inputs:
        v = w.var(
            name if name.isidentifier() and not keyword.iskeyword(name) and name not in _BUILTINS else "x"
        )
        w.vars[name] = v
        inputs.append(v)
    w.forward()
    # an output that is a constant still has to be a tensor of the traced graph
    returns = [w.resolve(w.expr(o) if w.is_tensor(o) else w.expr(o, like=inputs[0])) for o in g.outputs]
    init_lines = [f"self.{k} = {w.tree.render(v, 0)}" for k, v in w.tree.ordered(w.tree.root)]
    forward_lines = [w.resolve(line) for line in w.lines]
    base = command or f"anygrad codegen {source} -o {module}"
    command = base if weights_written else f"{base} --no-weights"
    first = g.info[g.inputs[0]]
    dtype = first.dtype.name
    if weights_written:
        weights_doc = f"""
    model = Model.from_file()     # the weights of {source} (in {weights})"""
    else:  # what from_file reads by default is not there: say how to get it, and what else loads
        where = textwrap.fill(f"Written without its weights (--no-weights). To write them beside this file as {weights}, "
                              "where Model.from_file() looks by default, run:", 96)
        other = textwrap.fill("from_file also takes any state_dict file with PyTorch's names: the weights.safetensors "
                              f"of an `anygrad train {source}` run, or a .pt/.pth saved by torch.save (read without "
                              "torch).", 96)
        weights_doc = f"""
{where}

    {base}

{other}

    model = Model.from_file("runs/<run>/weights.safetensors")"""
    header = f'''"""PyTorch-style code for {source}, generated by `anygrad codegen`.

Regenerate it with: {command}
{weights_doc}
    model = Model()               # fresh, initialised as PyTorch initialises these layers
    trainable = model.to_model()  # an anygrad.Model: compile, fit, predict, save ONNX
    model.load_from(trainable)    # trained weights back in; model.state_dict() has PyTorch names
"""
from __future__ import annotations

import os
from pathlib import Path
'''
    # one block of third-party imports: the generated file lives in the user's project
    used = "\n".join(init_lines + forward_lines + returns)  # import only what the code uses
    imports = ["", "import numpy as np"] if re.search(r"\bnp\.", used) else [""]
    imports += ["from anygrad import Model as Trainable", "from anygrad import nn"]
    if re.search(r"\bF\.", used):
        imports.append("from anygrad.nn import functional as F")
    imports.append("from anygrad.torchfile import load")
    consts = [
        "",
        f"WEIGHTS = Path(__file__).parent / {_str(weights)}",
        f"INPUT_NAME = {_str(g.inputs[0])}",
        f"INPUT_SHAPE = {_input_shape(first)}",
        f"OUTPUT_NAME = {_str(g.outputs[0])}",
    ]
    container = '''


def _container(**layers: nn.Module | nn.Parameter) -> nn.Module:
    """A module that only holds layers under their PyTorch names (the parent's forward calls them)."""
    module = nn.Module()
    for name, layer in layers.items():
        setattr(module, name, layer)
    return module'''
    uses_container = any("_container(" in line for line in init_lines)
    body = [
        "",
        "",
        "",
        "class Model(nn.Module):",
        f"{INDENT}def __init__(self) -> None:",
        f"{INDENT * 2}super().__init__()",
        *[textwrap.indent(line, INDENT * 2) for line in init_lines],
        "",
        f"{INDENT}def forward(self, {', '.join(inputs)}):",
        *[textwrap.indent(line, INDENT * 2) for line in forward_lines],
        f"{INDENT * 2}return {', '.join(returns)}",
        "",
        f"{INDENT}@classmethod",
        f"{INDENT}def from_file(cls, path: str | os.PathLike = WEIGHTS) -> Model:",
        f'{INDENT * 2}"""A Model holding the weights of a state_dict file: .safetensors, or a .pt/.pth',
        f'{INDENT * 2}written by torch.save (read without torch)."""',
        f"{INDENT * 2}model = cls()",
        f"{INDENT * 2}model.load_state_dict(load(path))",
        f"{INDENT * 2}return model",
        "",
        f"{INDENT}def to_model(self, input_shape=INPUT_SHAPE, dtype={_str(dtype)}, input_name=INPUT_NAME,",
        f"{INDENT}             output_name=OUTPUT_NAME) -> Trainable:",
        f'{INDENT * 2}"""Trace forward into a trainable anygrad.Model (defaults: the ONNX file\'s input',
        f'{INDENT * 2}and output)."""',
        f"{INDENT * 2}return super().to_model(input_shape, dtype, input_name, output_name)",
    ]
    code = (
        header + "\n".join(imports + consts) + (container if uses_container else "") + "\n".join(body) + "\n"
    )
    return Generated(code, w.state())


@dataclass
class Written:
    code: Path
    weights: Path | None


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, text, fsync=False)


def write_code(
    model_path: str | os.PathLike,
    out: str | os.PathLike,
    weights_out: str | os.PathLike | None = None,
    write_weights: bool = True,
    command: str | None = None,
) -> Written:
    """`anygrad codegen`: import the ONNX file, write the Python module and (unless told not to)
    the weights as .safetensors (default: beside the module, same stem). `command`, as generate's,
    is written into the module's docstring."""
    from .frontends.onnx_import import load_onnx
    from .torchfile import save_safetensors

    model_path, out = Path(model_path), Path(out)
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
    _write_text(out, generated.code)
    return Written(out, weights if write_weights else None)
