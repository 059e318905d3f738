"""MatMul's gradient rule: an operand broadcast over the other's batch dims gets its gradient as one
GEMM over the flattened batch (K = batch x rows), never as a batch of per-sample products summed
afterwards. Every broadcast case MatMul allows is checked against PyTorch (float64), and the
gradient graph is checked for the shapes it must not contain."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from opcheck import check_op

from anygrad.autodiff import gradients
from anygrad.ir import Builder, Graph, Node, TensorInfo, specialize

# (a shape, b shape): 1-D operands, a shared weight on either side, partial batch broadcast
# (leading, trailing, interleaved), both operands broadcast, and no broadcast at all.
CASES = {
    "linear_3d": ((3, 5, 4), (4, 6)),
    "linear_4d": ((2, 3, 5, 4), (4, 6)),
    "weight_left": ((6, 4), (3, 4, 5)),
    "weight_left_4d": ((6, 4), (2, 3, 4, 5)),
    "vec_left": ((4,), (3, 4, 5)),
    "vec_right": ((3, 5, 4), (4,)),
    "vec_both": ((4,), (4,)),
    "vec_left_2d": ((4,), (4, 5)),
    "vec_right_2d": ((5, 4), (4,)),
    "plain_2d": ((5, 4), (4, 6)),
    "batched_same": ((2, 3, 5, 4), (2, 3, 4, 6)),
    "weight_with_unit_batch": ((3, 5, 4), (1, 4, 6)),
    "b_leading_broadcast": ((2, 3, 5, 4), (3, 4, 6)),
    "b_trailing_broadcast": ((2, 3, 5, 4), (2, 1, 4, 6)),
    "a_leading_broadcast": ((3, 5, 4), (2, 3, 4, 6)),
    "a_trailing_broadcast": ((2, 1, 5, 4), (2, 3, 4, 6)),
    "both_broadcast": ((2, 1, 5, 4), (1, 3, 4, 6)),
    "both_broadcast_rank": ((3, 1, 5, 4), (2, 1, 4, 4, 6)),
    "unit_rows": ((2, 3, 1, 4), (4, 6)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matmul_gradient_matches_torch(name):
    sa, sb = CASES[name]
    rng = np.random.default_rng(len(name))
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    check_op("MatMul", [a, b], {}, torch.matmul, rtol=2e-4)


def _gradient_graph(sa: tuple, sb: tuple) -> Graph:
    g = Graph(name="mm")
    g.inputs = ["a", "b"]
    g.info["a"] = TensorInfo(np.dtype(np.float32), sa)
    g.info["b"] = TensorInfo(np.dtype(np.float32), sb)
    g.nodes = [Node("MatMul", ["a", "b"], ["y"], name="mm")]
    g.outputs = ["y"]
    s = specialize(g, {})
    bld = Builder(s, prefix="loss")
    loss = bld.op("ReduceSum", ["y"], keepdims=0)
    gradients(s, loss, ["a", "b"])
    return s


def _value_shapes(graph: Graph) -> set[tuple]:
    return {tuple(graph.info[o].shape) for n in graph.nodes for o in n.outputs if o}


@pytest.mark.parametrize("sa, sb, banned", [
    ((8, 16, 32), (32, 48), (8, 32, 48)),              # Linear over (batch, tokens, d)
    ((2, 8, 16, 32), (32, 48), (2, 8, 32, 48)),
    ((2, 8, 16, 32), (32, 48), (16, 32, 48)),
    ((48, 32), (8, 32, 16), (8, 48, 32)),              # weight on the left
    ((2, 4, 16, 32), (4, 32, 48), (2, 4, 32, 48)),     # a per-head weight shared over the batch
])
def test_no_per_sample_weight_gradient(sa, sb, banned):
    graph = _gradient_graph(sa, sb)
    assert banned not in _value_shapes(graph)


def test_shared_weight_gradient_is_one_gemm_with_transposed_operand():
    """The (d_in, B*T) @ (B*T, d_out) product: a Gemm reading the activations transposed (transA),
    with K = B*T, and no Transpose or ReduceSum node in the gradient."""
    graph = _gradient_graph((8, 16, 32), (32, 48))
    ops = [n.op for n in graph.nodes]
    assert "Transpose" not in ops and ops.count("ReduceSum") == 1  # the loss only
    gemms = [n for n in graph.nodes if n.op == "Gemm"]
    assert any(n.attr("transA") == 1 and graph.info[n.inputs[0]].shape == (128, 32)
               and graph.info[n.inputs[1]].shape == (128, 48) for n in gemms)
