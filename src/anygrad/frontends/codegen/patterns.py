"""What a node becomes: layers with weights (`_LAYERS`), stateless ops with a PyTorch form
(`_FUNCTIONS`), groups of nodes that are one PyTorch function (`_COMPOSITES`)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...ir.graph import Node
from .format import _ints, _num, _value
from .shapes import _Graph


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
