"""Mixed precision as a graph pass: torch.autocast(dtype=float16) applied to a specialised graph.

Run on the forward graph before the loss and autodiff are built, so the gradient graph follows
the casts by itself (the gradient of a Cast is a Cast back): weight gradients arrive in the
float32 of the master weights, and the optimizer and its state never see float16.

The op lists follow torch.autocast's CUDA lists (torch/csrc/autograd/autocast_mode.cpp):

- `HALF_OPS` ("lower_precision_fp"): matrix products and convolutions. Their float inputs,
  weights included, are cast to float16 (a parameter through a Cast node, one per parameter, so
  its gradient comes back as float32; a constant folded once). Backends compute them with
  float32 accumulation and round the result to float16.
- `FLOAT_OPS` ("fp32"): softmax, norms, reductions, exp/log/pow and the like read float32; their
  float16 inputs are cast up and their outputs are float32. Pow by a constant 2 or 3 is a product
  and stays with the other ops (exported GELU-tanh holds x**3, which torch's fused GELU computes
  in float16).
- `FLOAT_COMPUTE_OPS`: BatchNormalization reads its input as it comes (float16 after a
  convolution) with float32 scale, bias and running statistics, and writes its output in the
  input's dtype, as cuDNN does; like every op that reads float16, backends compute it in float32
  and round the result. Its gradient (BatchNormGrad) does the same: dX float16, dscale and dbias
  float32. No float32 copy of the activation is made or kept for the backward.
- Every other op runs in the widest float type of its inputs (torch's type promotion), except that
  a float32 constant or parameter next to a float16 activation is cast down (a bias added after a
  MatMul, a scalar constant): as `F.linear` casts its bias, and as a 0-dim tensor does not
  promote a tensor in torch.

Graph outputs and state updates keep their dtype (a float32 Cast under their own name), so the
loss, the metrics and `predict` read float32 as before.
"""
from __future__ import annotations

import numpy as np

from .graph import Graph, Node, info_of
from .infer import infer_node

HALF = np.dtype(np.float16)
FLOAT = np.dtype(np.float32)
_ONNX_CODE = {HALF: 10, FLOAT: 1}  # TensorProto.FLOAT16 / FLOAT (the code table lives in ops/, a layer above)

HALF_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})
FLOAT_OPS = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "GroupNormalization", "InstanceNormalization",
    "LpNormalization", "MeanVarianceNormalization", "RMSNormalization", "SimplifiedLayerNormalization",
    "ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceProd", "CumSum", "GlobalAveragePool", "GlobalLpPool", "LpPool",
    "Exp", "Log", "Pow", "Reciprocal", "Softplus", "Acos", "Asin", "Cosh", "Sinh", "Tan",
})
FLOAT_COMPUTE_OPS = frozenset({"BatchNormalization"})
_EXPLICIT = frozenset({"Cast", "CastLike"})
LAYOUT_OPS = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})  # the model asked for a dtype: left alone
PRECISIONS = ("f32", "f16")


def _is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind == "f"


def _is_product(g: Graph, node: Node) -> bool:
    """Pow by a constant 2 or 3: a product (x * x * x), which torch runs in float16; ONNX exports of
    GELU(approximate='tanh') hold one, and in float32 it would widen the whole GELU."""
    if node.op != "Pow" or len(node.inputs) < 2:
        return False
    exponent = g.info[node.inputs[1]].const
    return exponent is not None and np.asarray(exponent).size == 1 and float(np.asarray(exponent)) in (2.0, 3.0)


class _Caster:
    """Cast nodes and cast constants, each made once per (value, dtype)."""

    def __init__(self, g: Graph):
        self.g = g
        self.state = set(g.state_names)
        self.cache: dict[tuple[str, np.dtype], str] = {}
        self.producer: dict[str, Node] = {}  # of the values the pass has emitted so far

    def dtype(self, value: str) -> np.dtype:
        return np.dtype(self.g.info[value].dtype)

    def is_weight(self, value: str) -> bool:
        """A parameter (or constant), or a layout op's view of one."""
        while value in self.producer and self.producer[value].op in LAYOUT_OPS:
            value = self.producer[value].inputs[0]
        return value in self.g.initializers

    def is_fixed(self, value: str) -> bool:
        """A parameter or a constant (not computed from the batch)."""
        return value in self.g.initializers

    def to(self, value: str, dtype: np.dtype) -> str:
        if self.dtype(value) == dtype:
            return value
        key = (value, dtype)
        if key not in self.cache:
            g = self.g
            name = g.fresh(f"{value}.{dtype.name}")
            layout = self.producer.get(value)
            if value in g.initializers and value not in self.state:  # a constant: cast it once, now
                g.initializers[name] = np.asarray(g.initializers[value]).astype(dtype)
                g.info[name] = info_of(g.initializers[name])
            elif layout is not None and layout.op in LAYOUT_OPS and self.is_weight(value):
                # A transposed (reshaped) weight: cast the weight, then transpose the copy, so that
                # the transpose still meets its matmul (backends fold it into the operand loads).
                node = Node(layout.op, [self.to(layout.inputs[0], dtype)] + list(layout.inputs[1:]), [name],
                            dict(layout.attrs), g.fresh(f"autocast.{layout.op}"))
                g.nodes.append(node)
                infer_node(g, node)
            else:
                node = Node("Cast", [value], [name], {"to": _ONNX_CODE[dtype]}, g.fresh("autocast.Cast"))
                g.nodes.append(node)
                infer_node(g, node)
            self.cache[key] = name
        return self.cache[key]


def autocast(graph: Graph, dtype: np.dtype = HALF) -> Graph:
    """A copy of a specialised graph with float16 activations and matmul/conv operands (see the
    module docstring); float32 master weights stay the graph's parameters."""
    dtype = np.dtype(dtype)
    if dtype != HALF:
        raise ValueError(f"autocast to {dtype} is not supported (float16 only)")
    g = graph.copy()
    nodes, g.nodes = g.nodes, []
    cast = _Caster(g)
    pinned = {v: np.dtype(g.info[v].dtype) for v in list(g.outputs) + list(g.state_updates) if v in g.info}
    rename: dict[str, str] = {}
    for node in nodes:
        node.inputs = [rename.get(i, i) for i in node.inputs]
        floats = [k for k, v in enumerate(node.inputs) if v and _is_float(cast.dtype(v))]
        halves = [k for k in floats if cast.dtype(node.inputs[k]) == HALF]
        if node.op in _EXPLICIT or node.op in FLOAT_COMPUTE_OPS:
            pass
        elif node.op in HALF_OPS:
            for k in floats:
                node.inputs[k] = cast.to(node.inputs[k], HALF)
        elif node.op in FLOAT_OPS and not _is_product(g, node):
            for k in halves:
                node.inputs[k] = cast.to(node.inputs[k], FLOAT)
        elif halves:
            wide = [k for k in floats if cast.dtype(node.inputs[k]) != HALF]
            down = all(cast.is_fixed(node.inputs[k]) for k in wide)
            for k in (wide if down else halves):
                node.inputs[k] = cast.to(node.inputs[k], HALF if down else FLOAT)
        g.nodes.append(node)
        infer_node(g, node)
        cast.producer.update((o, node) for o in node.outputs if o)
        for j, out in enumerate(node.outputs):
            if out in pinned and np.dtype(g.info[out].dtype) != pinned[out]:
                inner = g.fresh(f"{out}.{g.info[out].dtype.name}")
                node.outputs[j] = inner
                g.info[inner] = g.info[out]
                g.nodes.append(Node("Cast", [inner], [out], {"to": _ONNX_CODE[pinned[out]]}, g.fresh("autocast.Cast")))
                infer_node(g, g.nodes[-1])
                rename[out] = inner  # later readers keep the float16 value
    return g


def half_values(graph: Graph) -> list[str]:
    """The float16 values a graph computes (for memory reports and tests)."""
    return [o for n in graph.nodes for o in n.outputs if o and np.dtype(graph.info[o].dtype) == HALF]


__all__ = ["FLOAT_COMPUTE_OPS", "FLOAT_OPS", "HALF_OPS", "PRECISIONS", "autocast", "half_values"]
