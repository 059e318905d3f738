"""IR passes: shape inference errors, specialize, constant folding of exporter shape subgraphs,
DCE, toposort, and autodiff's bookkeeping (accumulation, unused parameters)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from anygrad.autodiff import gradients
from anygrad.backends import NumpyBackend
from anygrad.errors import ModelError, ShapeError
from anygrad.ir import Graph, Node, TensorInfo, specialize

F32 = np.dtype(np.float32)


def i64(*values) -> np.ndarray:
    return np.array(values, np.int64)


def graph_with_input(shape, name="x") -> Graph:
    g = Graph(inputs=[name])
    g.info[name] = TensorInfo(F32, tuple(shape))
    return g


def run(g: Graph, **feeds) -> dict[str, np.ndarray]:
    return NumpyBackend().compile(g).run(feeds)


# -- shape inference errors name the node ----------------------------------------------------
@pytest.mark.parametrize("node,inits,shape,match", [
    (Node("Add", ["x", "w"], ["y"], name="bad_add"), {"w": np.zeros((4,), np.float32)}, (2, 3),
     "Add node 'bad_add'.*broadcast"),
    (Node("MatMul", ["x", "w"], ["y"], name="mm"), {"w": np.zeros((4, 2), np.float32)}, (2, 3),
     "MatMul node 'mm'.*inner"),
    (Node("Reshape", ["x", "s"], ["y"], name="rs"), {"s": i64(4, -1)}, (2, 3), "Reshape node 'rs'"),
    (Node("Concat", ["x", "w"], ["y"], {"axis": 0}, name="cat"), {"w": np.zeros((2, 4), np.float32)},
     (2, 3), "Concat node 'cat'"),
    (Node("Transpose", ["x"], ["y"], {"perm": [0, 5]}, name="tp"), {}, (2, 3), "Transpose node 'tp'"),
    (Node("Squeeze", ["x", "a"], ["y"], name="sq"), {"a": i64(1)}, (2, 3), "Squeeze node 'sq'"),
    (Node("ReduceSum", ["x", "a"], ["y"], name="rsum"), {"a": i64(4)}, (2, 3), "ReduceSum node 'rsum'"),
    (Node("Gather", ["x", "i"], ["y"], {"axis": 1}, name="ga"), {"i": i64(3)}, (2, 3), "Gather node 'ga'"),
    (Node("Reshape", ["x", "x"], ["y"], name="dyn"), {}, (2,), "Reshape node 'dyn'.*constant"),
])
def test_shape_errors_name_the_node(node, inits, shape, match):
    g = graph_with_input(shape)
    g.initializers.update(inits)
    g.nodes = [node]
    g.outputs = ["y"]
    with pytest.raises(ShapeError, match=match):
        specialize(g, {"x": shape})


# -- specialize ------------------------------------------------------------------------------
def _mlp(batch="N") -> Graph:
    g = graph_with_input((batch, 3))
    g.initializers = {"W": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}
    g.params = ["W", "b"]
    g.nodes = [Node("MatMul", ["x", "W"], ["h"]), Node("Add", ["h", "b"], ["a"]), Node("Relu", ["a"], ["y"])]
    g.outputs = ["y"]
    return g


def test_specialize_binds_symbolic_batch():
    g = _mlp()
    s = specialize(g, {"x": (5, 3)})
    assert s.info["x"].shape == (5, 3) and s.info["y"].shape == (5, 4)
    assert g.info["x"].shape == ("N", 3)  # the original is untouched
    assert specialize(g, {"x": (2, 3)}).info["y"].shape == (2, 4)
    # parameters are state, never folded as constants
    assert [n.op for n in s.nodes] == ["MatMul", "Add", "Relu"]


@pytest.mark.parametrize("shape", [(5,), (5, 3, 1), (5, 4), ()])
def test_specialize_rejects_wrong_rank_or_dims(shape):
    with pytest.raises(ShapeError, match="input 'x' expects shape"):
        specialize(_mlp(), {"x": shape})


def test_specialize_rejects_unknown_input():
    with pytest.raises(ShapeError, match="no input named 'images'"):
        specialize(_mlp(), {"images": (5, 3)})


# -- folding the shape subgraphs exporters emit ----------------------------------------------
def _view_batch_minus_one(shape_op_attrs: dict | None = None, via_constants: bool = False) -> Graph:
    """x.view(x.size(0), -1) as the TorchScript exporter writes it:
    Shape -> Gather(0) -> Unsqueeze(0) -> Concat(with [-1]) -> Reshape."""
    g = graph_with_input(("N", 2, 3, 4))
    if via_constants:  # index/axes/-1 as Constant nodes instead of initializers
        g.nodes += [Node("Constant", [], ["idx"], {"value": np.array(0, np.int64)}),
                    Node("Constant", [], ["axes"], {"value_ints": [0]}),
                    Node("Constant", [], ["minus1"], {"value": i64(-1)})]
    else:
        g.initializers.update({"idx": np.array(0, np.int64), "axes": i64(0), "minus1": i64(-1)})
    g.nodes += [Node("Shape", ["x"], ["shape"]),
                Node("Gather", ["shape", "idx"], ["n"], {"axis": 0}),
                Node("Unsqueeze", ["n", "axes"], ["n1"]),
                Node("Concat", ["n1", "minus1"], ["target"], {"axis": 0}),
                Node("Reshape", ["x", "target"], ["y"], name="view")]
    g.outputs = ["y"]
    return g


@pytest.mark.parametrize("via_constants", [False, True])
def test_shape_gather_unsqueeze_concat_reshape_folds(via_constants):
    g = _view_batch_minus_one(via_constants=via_constants)
    s = specialize(g, {"x": (5, 2, 3, 4)})
    assert [n.op for n in s.nodes] == ["Reshape"]
    target = s.nodes[0].inputs[1]
    np.testing.assert_array_equal(s.initializers[target], [5, -1])
    assert s.info["y"].shape == (5, 24)
    # the intermediate constants are gone
    assert set(s.initializers) == {target}
    x = np.random.default_rng(0).standard_normal((5, 2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(run(s, x=x)["y"], x.reshape(5, -1))


def test_shape_slice_concat_reshape_folds():
    """The dynamo exporter's flavour: Shape(start=0, end=1) or Shape -> Slice, then Concat."""
    g = graph_with_input(("N", 2, 3))
    g.initializers.update({"rest": i64(-1), "s0": i64(0), "s1": i64(1)})
    g.nodes = [Node("Shape", ["x"], ["head"], {"start": 0, "end": 1}),
               Node("Shape", ["x"], ["full"]),
               Node("Slice", ["full", "s0", "s1"], ["head2"]),
               Node("Concat", ["head", "rest"], ["t1"], {"axis": 0}),
               Node("Concat", ["head2", "rest"], ["t2"], {"axis": 0}),
               Node("Reshape", ["x", "t1"], ["y1"]), Node("Reshape", ["x", "t2"], ["y2"])]
    g.outputs = ["y1", "y2"]
    s = specialize(g, {"x": (4, 2, 3)})
    assert [n.op for n in s.nodes] == ["Reshape", "Reshape"]
    assert s.info["y1"].shape == s.info["y2"].shape == (4, 6)


def test_shape_of_symbolic_input_is_not_constant_before_specialize():
    from anygrad.ir import infer_shapes
    g = _view_batch_minus_one()
    infer_shapes(g)
    assert g.info["shape"].const is None and g.info["shape"].shape == (4,)
    assert g.info["y"].rank == 2  # the target's values wait for specialize; its length gives the rank
    # Shape(start=1) of ('N', 2, 3, 4) does not touch the symbolic dim: known already
    g2 = graph_with_input(("N", 2, 3, 4))
    g2.nodes = [Node("Shape", ["x"], ["tail"], {"start": 1})]
    g2.outputs = ["tail"]
    infer_shapes(g2)
    np.testing.assert_array_equal(g2.info["tail"].const, [2, 3, 4])


class _ViewNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.fc = torch.nn.Linear(2 * 4 * 4, 3)
        self.fc2 = torch.nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        h = self.conv(x)
        return self.fc(h.view(h.size(0), -1)) + self.fc2(torch.flatten(h, 1))


@pytest.mark.parametrize("dynamo", [False, True])
def test_exported_view_and_flatten_fold(tmp_path, dynamo):
    """Both PyTorch exporters, with a dynamic batch: after specialize no shape arithmetic is left."""
    import warnings

    from anygrad import load_onnx
    from anygrad.ir import get_op

    torch.manual_seed(0)
    net = _ViewNet().eval()
    x = torch.randn(2, 1, 6, 6)
    path = tmp_path / "view.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("batch", min=2)
            torch.onnx.export(net, (x,), str(path), dynamo=True, dynamic_shapes=({0: batch},),
                              input_names=["x"], output_names=["y"])
        else:
            torch.onnx.export(net, (x,), str(path), dynamo=False, input_names=["x"], output_names=["y"],
                              dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17)
    if get_op("Conv") is None:
        pytest.skip("Conv is not registered yet (ops/nn.py)")
    graph = load_onnx(path).graph
    s = specialize(graph, {graph.inputs[0]: (5, 1, 6, 6)})
    shape_ops = {"Shape", "Gather", "Unsqueeze", "Concat", "Slice", "Squeeze", "Cast", "Range",
                 "ConstantOfShape", "Constant", "Size", "Equal", "Where"}
    leftover = [n.op for n in s.nodes if n.op in shape_ops]
    assert not leftover, f"shape ops left after folding: {leftover} in {s.op_histogram()}"
    xb = torch.randn(5, 1, 6, 6)
    got = NumpyBackend().compile(s).run({graph.inputs[0]: xb.numpy()})[s.outputs[0]]
    with torch.no_grad():
        np.testing.assert_allclose(got, net(xb).numpy(), rtol=1e-4, atol=1e-5)


# -- DCE and toposort ------------------------------------------------------------------------
def test_dce_drops_dead_nodes_keeps_state_updates():
    g = graph_with_input((2,))
    g.initializers = {"count": np.zeros((), np.float32), "one": np.ones((), np.float32),
                      "unused": np.ones(3, np.float32)}
    g.buffers = ["count"]
    g.nodes = [Node("Neg", ["x"], ["y"]),
               Node("Exp", ["x"], ["dead"]), Node("Neg", ["dead"], ["dead2"]),
               Node("Add", ["count", "one"], ["count_next"])]
    g.state_updates = {"count_next": "count"}
    g.outputs = ["y"]
    g.dce()
    assert [n.outputs[0] for n in g.nodes] == ["y", "count_next"]
    assert set(g.initializers) == {"count", "one"}
    assert "dead" not in g.info and "dead2" not in g.info
    backend = NumpyBackend()
    exe = backend.compile(specialize(g, {"x": (2,)}))
    exe.run({"x": np.ones(2, np.float32)})
    exe.run({"x": np.ones(2, np.float32)})
    assert backend.get_state("count") == 2.0


def _chain() -> Graph:
    g = graph_with_input((3,))
    g.initializers = {"c": np.ones(3, np.float32)}
    g.nodes = [Node("Add", ["x", "c"], ["a"]), Node("Mul", ["a", "x"], ["b"]), Node("Exp", ["b"], ["e"]),
               Node("Sub", ["e", "a"], ["s"]), Node("Neg", ["s"], ["y"]), Node("Relu", ["a"], ["r"]),
               Node("Add", ["y", "r"], ["z"])]
    g.outputs = ["z"]
    return g


def test_toposort_orders_a_shuffled_graph():
    g = _chain()
    x = np.array([0.5, -1.0, 2.0], np.float32)
    want = run(specialize(g, {"x": (3,)}), x=x)["z"]
    for seed in range(5):
        random.Random(seed).shuffle(g.nodes)
        g.toposort()
        seen = set(g.inputs) | set(g.initializers)
        for n in g.nodes:
            assert all(i in seen for i in n.inputs), f"{n.label} before its inputs"
            seen.update(n.outputs)
        np.testing.assert_allclose(run(specialize(g, {"x": (3,)}), x=x)["z"], want)


def test_toposort_reports_cycle_and_missing_value():
    g = _chain()
    g.nodes.append(Node("Neg", ["loop_b"], ["loop_a"], name="loop1"))
    g.nodes.append(Node("Neg", ["loop_a"], ["loop_b"], name="loop2"))
    with pytest.raises(ModelError, match="cycle"):
        g.toposort()
    g = _chain()
    g.nodes.append(Node("Add", ["z", "ghost"], ["w"], name="haunted"))
    with pytest.raises(ModelError, match="ghost"):
        g.toposort()


# -- autodiff --------------------------------------------------------------------------------
def _grads(g: Graph, feeds: dict, wrt: list[str], loss: str = "loss") -> dict[str, np.ndarray]:
    s = specialize(g, {k: v.shape for k, v in feeds.items()})
    gr = gradients(s, loss, wrt)
    s.outputs = [loss] + [gr[w] for w in wrt]
    out = NumpyBackend().compile(s).run(feeds)
    return {w: out[gr[w]] for w in wrt}


def test_value_used_twice_accumulates():
    g = graph_with_input((4,))
    g.nodes = [Node("Mul", ["x", "x"], ["sq"]), Node("ReduceSum", ["sq"], ["loss"], {"keepdims": 0})]
    g.outputs = ["loss"]
    x = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    np.testing.assert_allclose(_grads(g, {"x": x}, ["x"])["x"], 2 * x)


def test_residual_and_unused_parameter():
    g = graph_with_input((2, 3))
    rng = np.random.default_rng(0)
    W = rng.standard_normal((3, 3)).astype(np.float32)
    U = rng.standard_normal((3, 3)).astype(np.float32)
    g.initializers = {"W": W, "U": U}
    g.params = ["W", "U"]
    # y = relu(x @ W) + x ; loss = sum(y * y) ; U is never used
    g.nodes = [Node("MatMul", ["x", "W"], ["h"]), Node("Relu", ["h"], ["r"]), Node("Add", ["r", "x"], ["y"]),
               Node("Mul", ["y", "y"], ["yy"]), Node("ReduceSum", ["yy"], ["loss"], {"keepdims": 0})]
    g.outputs = ["loss"]
    x = rng.standard_normal((2, 3)).astype(np.float32)
    got = _grads(g, {"x": x}, ["x", "W", "U"])

    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tW = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    y = torch.relu(tx @ tW) + tx
    (y * y).sum().backward()
    np.testing.assert_allclose(got["x"], tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["W"], tW.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["U"], np.zeros_like(U))


def test_gradient_through_folded_shape_chain():
    """The view subgraph folds, and the gradient flows through the Reshape it leaves."""
    g = _view_batch_minus_one()
    g.nodes.append(Node("Mul", ["y", "y"], ["yy"]))
    g.nodes.append(Node("ReduceSum", ["yy"], ["loss"], {"keepdims": 0}))
    g.outputs = ["loss"]
    x = np.random.default_rng(1).standard_normal((3, 2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(_grads(g, {"x": x}, ["x"])["x"], 2 * x, rtol=1e-6)


def _swish_infer(node, ins):
    return [TensorInfo(ins[0].dtype, ins[0].shape)]


def _swish_expand(b, node):
    x = node.inputs[0]
    beta = b.const(np.float32(node.attrs.get("beta", 1.0)))
    return [b.op("Mul", [x, b.op("Sigmoid", [b.op("Mul", [x, beta])])]), x]


def test_composite_op_expands_and_differentiates():
    """An op given by an expansion runs (forward derived from it), specializes to its primitives,
    and trains through them: same values and gradients as torch."""
    from anygrad.ir import defcomposite, defop, get_op

    with pytest.raises(ValueError, match="defcomposite"):   # an expansion alone is no forward kernel for defop
        defop("test.Swish3", infer=_swish_infer, expand=_swish_expand)
    if get_op("test.Swish2") is None:
        defcomposite("test.Swish2", infer=lambda n, ins: [_swish_infer(n, ins)[0]] * 2, expand=_swish_expand)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    g = Graph(inputs=["x"], outputs=["y", "same"])
    g.initializers = {"w": np.full((3,), 0.5, np.float32)}
    g.params = ["w"]
    g.info["x"] = TensorInfo(np.dtype("float32"), ("N", 3))
    g.nodes = [Node("Mul", ["x", "w"], ["h"]), Node("test.Swish2", ["h"], ["s", "same"], {"beta": 2.0}, "sw"),
               Node("ReduceSum", ["s"], ["y"], {"keepdims": 0})]
    s = specialize(g, {"x": (4, 3)})
    assert "test.Swish2" not in {n.op for n in s.nodes}
    grads = gradients(s, "y", ["w"])
    s.outputs = ["y", "same", grads["w"]]
    out = NumpyBackend().compile(s).run({"x": x})
    y, same, gw = (out[k] for k in s.outputs)

    xt = torch.tensor(x, dtype=torch.float64)
    wt = torch.full((3,), 0.5, dtype=torch.float64, requires_grad=True)
    h = xt * wt
    yt = (h * torch.sigmoid(2.0 * h)).sum()
    yt.backward()
    np.testing.assert_allclose(y, yt.item(), rtol=1e-5)
    np.testing.assert_allclose(same, h.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(gw, wt.grad.numpy(), rtol=1e-5)
    # the derived reference kernel agrees with the expansion
    out = get_op("test.Swish2").run(Node("test.Swish2", ["a"], ["o1", "o2"], {"beta": 2.0}), [x])
    np.testing.assert_allclose(out[0], x / (1 + np.exp(-2 * x)), rtol=1e-6)
