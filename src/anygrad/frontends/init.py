"""Fresh initialisation: each parameter re-drawn the way PyTorch initialises the layer it feeds.

The layer is read off the consuming op and input slot (Conv weight, Gemm bias, BatchNorm
running variance, ...). PyTorch's Conv and Linear use kaiming_uniform(a=sqrt(5)) for weights,
i.e. U(-b, b) with b = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2)), which is
1/sqrt(fan_in); biases are U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with the weight's fan_in.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..ir.graph import Graph, Node

Init = Callable[[np.random.Generator, tuple[int, ...], int], np.ndarray]


def kaiming_uniform(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, a: float = math.sqrt(5)):
    gain = math.sqrt(2.0 / (1.0 + a * a))
    bound = gain * math.sqrt(3.0 / fan_in) if fan_in else 0.0
    return rng.uniform(-bound, bound, shape)


def bias_uniform(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int):
    bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0
    return rng.uniform(-bound, bound, shape)


def ones(rng, shape, fan_in):
    return np.ones(shape)


def zeros(rng, shape, fan_in):
    return np.zeros(shape)


def normal(rng, shape, fan_in):
    return rng.standard_normal(shape)


# fan_in of the weight a node multiplies by (PyTorch's _calculate_fan_in_and_fan_out: dim 1
# times the receptive field, for Conv [out, in/g, k..] and ConvTranspose [in, out/g, k..] alike).
def _conv_fan_in(g: Graph, node: Node) -> int:
    return int(np.prod(g.initializers[node.inputs[1]].shape[1:]))


def _gemm_fan_in(g: Graph, node: Node) -> int:
    w = g.initializers[node.inputs[1]].shape
    return int(w[1] if node.attr("transB", 0) else w[0])


def _matmul_fan_in(g: Graph, node: Node) -> int:
    return int(g.initializers[node.inputs[1]].shape[0])


_FAN_IN = {"Conv": _conv_fan_in, "ConvTranspose": _conv_fan_in, "Gemm": _gemm_fan_in, "MatMul": _matmul_fan_in}

# (op, input slot) -> initialiser
RULES: dict[tuple[str, int], Init] = {
    ("Conv", 1): kaiming_uniform, ("Conv", 2): bias_uniform,
    ("ConvTranspose", 1): kaiming_uniform, ("ConvTranspose", 2): bias_uniform,
    ("Gemm", 1): kaiming_uniform, ("Gemm", 2): bias_uniform,
    ("MatMul", 1): kaiming_uniform,
    ("BatchNormalization", 1): ones, ("BatchNormalization", 2): zeros,
    ("BatchNormalization", 3): zeros, ("BatchNormalization", 4): ones,
    ("LayerNormalization", 1): ones, ("LayerNormalization", 2): zeros,
    ("InstanceNormalization", 1): ones, ("InstanceNormalization", 2): zeros,
    ("GroupNormalization", 1): ones, ("GroupNormalization", 2): zeros,
    ("Gather", 0): normal,  # nn.Embedding
}


def _linear_bias_fan_in(g: Graph, node: Node, slot: int) -> int | None:
    """A MatMul followed by Add(bias) is a Linear: the bias takes the MatMul weight's fan_in."""
    if node.op != "Add":
        return None
    producers = g.producers()
    other = producers.get(node.inputs[1 - slot]) if len(node.inputs) == 2 else None
    if other is not None and other.op == "MatMul" and other.input(1) in g.initializers:
        return _matmul_fan_in(g, other)
    return None


def fresh_init(graph: Graph, seed: int = 0) -> list[str]:
    """Re-initialise params and buffers in place; returns the names no rule covered (kept)."""
    rng = np.random.default_rng(seed)
    uses: dict[str, list[tuple[Node, int]]] = {}
    for n in graph.nodes:
        for i, v in enumerate(n.inputs):
            uses.setdefault(v, []).append((n, i))
    kept = []
    for name in graph.params + graph.buffers:
        old = graph.initializers[name]
        value = None
        for node, slot in uses.get(name, []):
            rule = RULES.get((node.op, slot))
            if rule is not None:
                fan_in = _FAN_IN[node.op](graph, node) if node.op in _FAN_IN else 0
                value = rule(rng, old.shape, fan_in)
                break
            fan_in = _linear_bias_fan_in(graph, node, slot)
            if fan_in is not None:
                value = bias_uniform(rng, old.shape, fan_in)
                break
        if value is None:
            kept.append(name)
        else:
            graph.initializers[name] = np.asarray(value).astype(old.dtype)
    return kept
