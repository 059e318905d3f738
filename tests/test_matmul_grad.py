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


# -- planned memory of a GPT-style step --------------------------------------------------------
T, D, H, V = 2, 48, 128, 1024   # tokens, model width, MLP width, vocabulary


def _gpt_like_step(batch: int) -> Graph:
    """Embedding-sized input (batch, T, D) -> Linear(D, H) + bias -> Gelu -> Linear(H, D) -> head
    Linear(D, V), weights stored (out, in) and applied as x @ W.T as the exporters write them, and
    the gradients of a sum-of-squares loss for every weight."""
    f32 = np.dtype(np.float32)
    g = Graph(name="gpt_like")
    g.inputs = ["x"]
    g.info["x"] = TensorInfo(f32, (batch, T, D))
    rng = np.random.default_rng(0)
    weights = {"w1": (H, D), "b1": (H,), "w2": (D, H), "w3": (V, D)}
    for name, shape in weights.items():
        g.initializers[name] = rng.standard_normal(shape).astype(np.float32)
    g.params = list(weights)
    g.nodes = [Node("Transpose", ["w1"], ["w1t"], {"perm": [1, 0]}, name="t1"),
               Node("MatMul", ["x", "w1t"], ["h0"], name="fc1"),
               Node("Add", ["h0", "b1"], ["h1"], name="bias1"),
               Node("Gelu", ["h1"], ["h2"], name="gelu"),
               Node("Transpose", ["w2"], ["w2t"], {"perm": [1, 0]}, name="t2"),
               Node("MatMul", ["h2", "w2t"], ["h3"], name="fc2"),
               Node("Transpose", ["w3"], ["w3t"], {"perm": [1, 0]}, name="t3"),
               Node("MatMul", ["h3", "w3t"], ["logits"], name="head"),
               Node("Mul", ["logits", "logits"], ["sq"], name="sq"),
               Node("ReduceSum", ["sq"], ["loss"], {"keepdims": 0}, name="loss")]
    g.outputs = ["loss"]
    s = specialize(g, {"x": (batch, T, D)})
    grads = gradients(s, "loss", list(weights))
    s.outputs = ["loss"] + [grads[w] for w in weights]
    return s


def test_gpt_like_step_has_no_per_sample_weight_gradient():
    graph = _gpt_like_step(6)
    shapes = _value_shapes(graph)
    for d_in, d_out in [(D, H), (H, D), (D, V), (H, V)]:
        for shape in [(6, d_in, d_out), (6, d_out, d_in)]:
            assert shape not in shapes


def test_gpt_like_step_planned_bytes_grow_with_tokens_not_weights():
    """The wgpu planner's temporaries grow by about a few activations per sample, never by a
    weight-sized gradient per sample (the head's D x V alone is 192 KiB a sample)."""
    pytest.importorskip("wgpu")
    from anygrad.backends.wgpu.fusion.passes import prepare
    from anygrad.backends.wgpu.kernels.kernel import AdapterCaps, ops_where
    from anygrad.backends.wgpu.planning.planner import make_plan

    caps = AdapterCaps()

    def planned(batch: int) -> int:
        graph = _gpt_like_step(batch)
        prepared = prepare(graph, caps, ops_where("epilogue"))
        plan = make_plan(prepared, caps, set())
        return sum(plan.slot_bytes)

    small, large = planned(4), planned(12)
    per_sample = (large - small) / 8
    activations = T * (D + H + H + D + V) * 4       # one sample's forward values, in bytes
    assert per_sample <= 4 * activations, (per_sample, activations)
    assert per_sample < D * V * 4 / 4
