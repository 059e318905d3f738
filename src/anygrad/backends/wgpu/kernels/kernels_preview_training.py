"""ONNX's preview training ops (ai.onnx.preview.training Adagrad, Adam, Momentum; formulas:
anygrad/ops/preview_training.py): per updated tensor, elementwise kernels reading the scalar
learning rate R and step T from their buffers. Adam is two kernels (moments, then the step) so
that no kernel binds more than 8 storage buffers."""
from __future__ import annotations

from ....ir.graph import Graph, Node
from ....ops.preview_training import DOMAIN, RULES
from .kernel import AdapterCaps, Kernel, lowering
from .kernels_index import _kernel
from .wgsl import literal, size_of, vtype


def _f(node: Node, key: str, default: float | None = None) -> str:
    return literal(float(node.attr(key, default)), "f32")


def _groups(node: Node) -> tuple[int, list[list[str]], list[list[str]]]:
    """(n, inputs per kind [X, G, states...] x n, outputs per kind [X, states...] x n)."""
    per = RULES[node.op.split(".")[-1]][1]
    tensors = node.inputs[2:]
    n = len(tensors) // per
    ins = [[tensors[k * n + i] for i in range(n)] for k in range(per)]
    outs = [[node.outputs[k * n + i] if k * n + i < len(node.outputs) else "" for i in range(n)]
            for k in range(per - 1)]
    return n, ins, outs


def _scalars(graph: Graph, node: Node) -> list[tuple[str, str, str]]:
    return [("R", vtype(graph, node.inputs[0]), node.inputs[0]), ("T", vtype(graph, node.inputs[1]), node.inputs[1])]


_HEAD = "  let r = f32(R[0]);\n  let t = f32(T[0]);\n"


@lowering(f"{DOMAIN}.Adagrad")
def lower_adagrad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    n, ins, outs = _groups(node)
    kernels = []
    for i in range(n):
        x, g, h = ins[0][i], ins[1][i], ins[2][i]
        body = _HEAD + f"""  let rate = r / (1.0 + t * {_f(node, 'decay_factor', 0.0)});
  let gg = {_f(node, 'norm_coefficient', 0.0)} * X[i] + G[i];
  let hh = H[i] + gg * gg;
  XO[i] = X[i] - rate * gg / (sqrt(hh) + {_f(node, 'epsilon', 1e-6)});
  HO[i] = hh;"""
        kernels.append(_kernel("Adagrad", size_of(graph, x), body,
                               _scalars(graph, node) + [("X", "f32", x), ("G", "f32", g), ("H", "f32", h)],
                               [("XO", "f32", outs[0][i]), ("HO", "f32", outs[1][i])]))
    return kernels


@lowering(f"{DOMAIN}.Momentum")
def lower_momentum(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    n, ins, outs = _groups(node)
    mode = node.attr("mode", "standard")
    nesterov = (mode.decode() if isinstance(mode, bytes) else mode) == "nesterov"
    alpha = _f(node, "alpha")
    kernels = []
    for i in range(n):
        x, g, v = ins[0][i], ins[1][i], ins[2][i]
        body = _HEAD + f"""  let gg = {_f(node, 'norm_coefficient')} * X[i] + G[i];
  let vv = {alpha} * V[i] + select(1.0, {_f(node, 'beta')}, t > 0.0) * gg;
  XO[i] = X[i] - r * {f'(gg + {alpha} * vv)' if nesterov else 'vv'};
  VO[i] = vv;"""
        kernels.append(_kernel("Momentum", size_of(graph, x), body,
                               _scalars(graph, node) + [("X", "f32", x), ("G", "f32", g), ("V", "f32", v)],
                               [("XO", "f32", outs[0][i]), ("VO", "f32", outs[1][i])]))
    return kernels


@lowering(f"{DOMAIN}.Adam")
def lower_adam(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    n, ins, outs = _groups(node)
    alpha, beta = _f(node, "alpha", 0.9), _f(node, "beta", 0.999)
    kernels = []
    for i in range(n):
        x, g, v, h = ins[0][i], ins[1][i], ins[2][i], ins[3][i]
        xo, vo, ho = outs[0][i], outs[1][i], outs[2][i]
        moments = f"""  let gg = {_f(node, 'norm_coefficient', 0.0)} * X[i] + G[i];
  VO[i] = {alpha} * V[i] + (1.0 - {alpha}) * gg;
  HO[i] = {beta} * H[i] + (1.0 - {beta}) * gg * gg;"""
        kernels.append(_kernel("Adam:moments", size_of(graph, x), moments,
                               [("X", "f32", x), ("G", "f32", g), ("V", "f32", v), ("H", "f32", h)],
                               [("VO", "f32", vo), ("HO", "f32", ho)]))
        step = _HEAD + f"""  let rate = select(r, r * sqrt(1.0 - pow({beta}, t)) / (1.0 - pow({alpha}, t)), t > 0.0);
  XO[i] = (1.0 - {_f(node, 'norm_coefficient_post', 0.0)}) * (X[i] - rate * V[i] / (sqrt(H[i]) + {_f(node, 'epsilon', 1e-6)}));"""
        kernels.append(_kernel("Adam:step", size_of(graph, x), step,
                               _scalars(graph, node) + [("X", "f32", x), ("V", "f32", vo), ("H", "f32", ho)],
                               [("XO", "f32", xo)]))
    return kernels
