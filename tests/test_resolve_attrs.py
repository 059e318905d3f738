"""specialize (and every training step) resolves node attributes to explicit values (issue 14):
no auto_pad, no negative or input-given axes, defaults filled in, so backends read node.attrs
and shapes. Resolution is idempotent and changes no result: the step's loss matches the numpy
reference run over the unresolved nodes."""
from __future__ import annotations

import numpy as np
import pytest

from anygrad.backends import NumpyBackend
from anygrad.ir import Builder, Graph, TensorInfo, get_op, infer_shapes, specialize
from anygrad.ir.passes import resolve_attributes
from anygrad.losses import get_loss
from anygrad.ops.reduce import REDUCTIONS
from anygrad.ops.resolve import AXIS, WINDOWED
from anygrad.optim import SGD
from anygrad.program import build_train_step

RNG = np.random.default_rng(0)
BATCH = 2


def _i64(b: Builder, values) -> str:
    return b.const(np.array(values, np.int64), np.int64)


def _param(g: Graph, name: str, shape) -> str:
    g.initializers[name] = (RNG.standard_normal(shape) * 0.3).astype(np.float32)
    g.info[name] = TensorInfo(np.dtype(np.float32), tuple(shape))
    g.params.append(name)
    return name


def _graph(shape) -> tuple[Graph, Builder]:
    g = Graph(name="m")
    g.inputs = ["x"]
    g.info["x"] = TensorInfo(np.dtype(np.float32), (BATCH,) + tuple(shape))
    return g, Builder(g, prefix="m")


def _convnet() -> Graph:
    """SAME convs and pools, a ceil-mode pool, a mean over axes given as an input, negative."""
    g, b = _graph((3, 9, 9))
    h = b.op("Conv", ["x", _param(g, "w1", (4, 3, 3, 3)), _param(g, "b1", (4,))], auto_pad="SAME_UPPER",
             strides=[2, 2])
    h = b.op("Relu", [h])
    h = b.op("MaxPool", [h], kernel_shape=[2, 2], auto_pad="SAME_LOWER")
    h = b.op("AveragePool", [h], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)
    h = b.op("Conv", [h, _param(g, "w2", (6, 4, 1, 1))], auto_pad="VALID")
    h = b.op("ReduceMean", [h, _i64(b, [-1, -2])], keepdims=0)
    g.outputs = [b.op("LogSoftmax", [h], axis=-1)]
    return g


def _shapes() -> Graph:
    """Pad (pads input, reflect), Slice (negative starts and steps), Split (sizes input), Concat
    on -2, Transpose without perm, reductions with empty axes, Gather on -1, Softmax's default."""
    g, b = _graph((4, 6))
    h = b.op("Mul", ["x", _param(g, "s", (4, 6))])
    h = b.op("Pad", [h, _i64(b, [0, 0, 1, 0, 0, 2])], mode="reflect")             # (N, 4, 9)
    h = b.op("Slice", [h, _i64(b, [-1, 0]), _i64(b, [-100, 8]), _i64(b, [-2, 2]), _i64(b, [-1, 2])])
    parts = b.ops("Split", [h, _i64(b, [1, 3])], 2, axis=-2)                     # (N, 1, 4), (N, 3, 4)
    h = b.op("Concat", [parts[1], parts[0], parts[1]], axis=-2)                   # (N, 7, 4)
    h = b.op("Transpose", [h])                                                    # (4, 7, N)
    h = b.op("Transpose", [h])
    total = b.op("ReduceSum", [h, _i64(b, np.zeros(0, np.int64))], keepdims=1)  # every axis
    same = b.op("ReduceSum", [h, _i64(b, np.zeros(0, np.int64))], noop_with_empty_axes=1)
    h = b.op("Add", [b.op("Mul", [same, b.const(0.1)]), total])
    h = b.op("Gather", [h, _i64(b, [0, 2, 3, 1])], axis=-1)                      # (N, 7, 4)
    h = b.op("ReduceMax", [h], axes=[-2], keepdims=0)                             # (N, 4)
    g.outputs = [b.op("LogSoftmax", [b.op("Softmax", [h])])]
    return g


def _resize() -> Graph:
    g, b = _graph((8, 2, 2))
    h = b.op("Mul", ["x", _param(g, "s", (8, 2, 2))])
    h = b.op("Resize", [h, "", b.const(np.array([1, 1, 2, 2], np.float32))], mode="linear")
    h = b.op("DepthToSpace", [h], blocksize=2)                                    # (N, 2, 8, 8)
    h = b.op("ReduceMean", [h], axes=[2, 3], keepdims=0)
    g.outputs = [b.op("LogSoftmax", [h], axis=1)]
    return g


MODELS = {"convnet": _convnet, "shapes": _shapes, "resize": _resize}


def _check_explicit(g: Graph) -> None:
    """Every node's attributes are what the backends read: nothing relative, nothing defaulted."""
    for n in g.nodes:
        assert n.attr("auto_pad", "NOTSET") == "NOTSET", n
        if n.op in WINDOWED:
            assert all(n.attr(k) is not None for k in ("kernel_shape", "strides", "dilations", "pads")), n
            assert len(n.attr("pads")) == 2 * len(n.attr("kernel_shape")), n
        if n.op in REDUCTIONS:
            assert n.attr("axes") is not None and list(n.attr("axes")) == sorted(n.attr("axes")), n
            assert all(a >= 0 for a in n.attr("axes")) and n.attr("keepdims") in (0, 1), n
        if n.op in AXIS and n.attr("axis") is not None:
            assert n.attr("axis") >= 0, n
        if n.op in AXIS and AXIS[n.op][0] is not None:
            assert n.attr("axis") is not None, n
        if n.op == "Pad":
            assert n.attr("mode") in ("constant", "reflect", "edge", "wrap") and n.attr("value") is not None, n
        if n.op == "Slice":
            assert all(n.attr(k) is not None for k in ("starts", "ends", "steps")), n
        if n.op == "Split":
            assert n.attr("axis") >= 0 and n.attr("split") is not None, n
        if n.op == "Transpose":
            assert n.attr("perm") is not None, n
        if n.op in ("Resize", "ResizeGrad"):
            assert all(n.attr(k) is not None for k in ("mode", "coordinate_transformation_mode", "nearest_mode",
                                                        "scales", "roi")), n


def _reference(model: Graph, shapes: dict, feeds: dict) -> list[np.ndarray]:
    """The forward by each op's reference kernel over the nodes as the model has them (unresolved)."""
    g = model.copy()
    for name, shape in shapes.items():
        g.info[name] = TensorInfo(g.info[name].dtype, shape)
    infer_shapes(g)
    values = {**g.initializers, **feeds}
    for n in g.nodes:
        outs = get_op(n.op).run(n, [values[i] if i else None for i in n.inputs])
        values.update(zip(n.outputs, outs))
    return [values[o] for o in g.outputs]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_specialize_leaves_every_attribute_explicit_and_the_forward_unchanged(name):
    model = MODELS[name]()
    shape = tuple(model.info["x"].shape)
    g = specialize(model, {"x": shape})
    _check_explicit(g)
    before = {id(n): dict(n.attrs) for n in g.nodes}
    resolve_attributes(g)
    assert all(n.attrs == before[id(n)] for n in g.nodes), "resolution is not idempotent"
    x = RNG.standard_normal(shape).astype(np.float32)
    got = NumpyBackend().compile(g).run({"x": x})
    want = _reference(model, {"x": shape}, {"x": x})
    for o, w in zip(g.outputs, want):
        np.testing.assert_allclose(got[o], w, rtol=1e-5, atol=1e-6)


def test_the_model_graph_keeps_its_own_attributes():
    """specialize works on a copy: the model (what ONNX export writes) keeps auto_pad and its axes."""
    model = _convnet()
    specialize(model, {"x": (2, 3, 9, 9)})
    assert [n.attr("auto_pad") for n in model.nodes if n.op == "Conv"] == ["SAME_UPPER", "VALID"]
    assert all(n.attr("axes") is None for n in model.nodes if n.op == "ReduceMean")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_training_step_is_resolved_and_trains_as_the_reference(name):
    model = MODELS[name]()
    batch, shape = BATCH, tuple(model.info["x"].shape)
    out_classes = {"convnet": 6, "shapes": 4, "resize": 2}[name]
    step = build_train_step(model, {"x": shape}, (batch,), get_loss("nll"), SGD(lr=0.1))
    _check_explicit(step)
    grads = {n.op for n in step.nodes}
    assert {"ConvGradInput", "MaxPoolGrad"} <= grads if name == "convnet" else True
    before = {id(n): dict(n.attrs) for n in step.nodes}
    resolve_attributes(step)
    assert all(n.attrs == before[id(n)] for n in step.nodes)

    x = RNG.standard_normal(shape).astype(np.float32)
    t = RNG.integers(0, out_classes, batch).astype(np.int64)
    got = NumpyBackend().compile(step).run({"x": x, step.inputs[-1]: t})
    logp = _reference(model, {"x": shape}, {"x": x})[0]
    want = -np.mean(logp[np.arange(batch), t])
    np.testing.assert_allclose(got[step.outputs[0]], want, rtol=1e-5)
