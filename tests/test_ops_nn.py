"""Neural-network ops (Conv, pools, BatchNormalization, Dropout, Softmax) against PyTorch in float64."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from opcheck import check_op, run_op

from anygrad import rng as anyrng
from anygrad.autodiff import gradients
from anygrad.backends import NumpyBackend
from anygrad.errors import AnygradError, ShapeError
from anygrad.ir import RNG_STATE, Builder, Graph, Node, TensorInfo, set_training_mode, specialize


def _randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _torch_pad(pads):
    """ONNX [b1, b2, ..., e1, e2, ...] -> F.pad's (last dim first) (b_last, e_last, ...)."""
    nd = len(pads) // 2
    out = []
    for d in reversed(range(nd)):
        out += [pads[d], pads[nd + d]]
    return tuple(out)


def _same_pads(spatial, kernel, strides, dilations, upper):
    begin, end = [], []
    for i, k, s, d in zip(spatial, kernel, strides, dilations):
        out = -(-i // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - i)
        small, big = total // 2, total - total // 2
        begin.append(small if upper else big)
        end.append(big if upper else small)
    return begin + end


CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


# -- Conv ----------------------------------------------------------------------------------------
@st.composite
def conv_cases(draw):
    nd = draw(st.sampled_from([2, 2, 2, 1, 3]))
    kind = draw(st.sampled_from(["dense", "grouped", "depthwise"]))
    group = {"dense": 1, "grouped": draw(st.integers(2, 3)), "depthwise": draw(st.integers(1, 4))}[kind]
    cin = group * (1 if kind == "depthwise" else draw(st.integers(1, 3)))
    m = group * draw(st.integers(1, 2 if kind == "depthwise" else 3))
    small = nd == 3
    kernel = [draw(st.integers(1, 2 if small else 3)) for _ in range(nd)]
    strides = [draw(st.integers(1, 2 if small else 3)) for _ in range(nd)]
    dilations = [draw(st.integers(1, 2)) for _ in range(nd)]
    auto_pad = draw(st.sampled_from(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    pads = [draw(st.integers(0, 2)) for _ in range(2 * nd)]
    spatial = [(k - 1) * d + 1 + draw(st.integers(0, 2 if small else 5)) for k, d in zip(kernel, dilations)]
    return {"nd": nd, "n": draw(st.integers(1, 2)), "cin": cin, "m": m, "group": group, "kernel": kernel,
            "strides": strides, "dilations": dilations, "auto_pad": auto_pad, "pads": pads,
            "spatial": spatial,
            "bias": draw(st.booleans()), "seed": draw(st.integers(0, 1000))}


@settings(max_examples=30, deadline=None)
@given(conv_cases())
def test_conv_matches_torch(c):
    rng = np.random.default_rng(c["seed"])
    x = _randn(rng, c["n"], c["cin"], *c["spatial"])
    w = _randn(rng, c["m"], c["cin"] // c["group"], *c["kernel"])
    b = _randn(rng, c["m"]) if c["bias"] else None
    attrs = {"strides": c["strides"], "dilations": c["dilations"], "group": c["group"]}
    if c["auto_pad"] == "NOTSET":
        attrs["pads"] = pads = c["pads"]
    else:
        attrs["auto_pad"] = c["auto_pad"]
        upper = c["auto_pad"] == "SAME_UPPER"
        pads = ([0] * 2 * c["nd"] if c["auto_pad"] == "VALID" else
                _same_pads(c["spatial"], c["kernel"], c["strides"], c["dilations"], upper))
    if c["auto_pad"] != "VALID" and np.random.default_rng(c["seed"]).random() < 0.5:
        attrs["kernel_shape"] = c["kernel"]

    def ref(x, w, b=None):
        return CONV[c["nd"]](F.pad(x, _torch_pad(pads)), w, b, stride=c["strides"], dilation=c["dilations"],
                             groups=c["group"])

    check_op("Conv", [x, w, b] if b is not None else [x, w], attrs, ref, rtol=1e-4, atol=1e-5)


def test_conv_same_output_shape_and_gradient_op_names():
    """SAME keeps ceil(in / stride); the gradient is ConvGradInput/ConvGradWeight + ReduceSum."""
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype("float32"), ("N", 3, 9, 8))
    rng = np.random.default_rng(0)
    g.initializers = {"w": _randn(rng, 4, 3, 3, 3), "b": _randn(rng, 4)}
    g.params = ["w", "b"]
    g.nodes = [Node("Conv", ["x", "w", "b"], ["y"], {"auto_pad": "SAME_UPPER", "strides": [2, 2]})]
    s = specialize(g, {"x": (2, 3, 9, 8)})
    assert s.info["y"].shape == (2, 4, 5, 4)
    b = Builder(s)
    loss = b.op("ReduceSum", ["y"], keepdims=0)
    gradients(s, loss, ["x", "w", "b"])
    ops = {n.op for n in s.nodes}
    assert {"ConvGradInput", "ConvGradWeight"} <= ops
    gi = next(n for n in s.nodes if n.op == "ConvGradInput")
    assert gi.attrs["input_shape"] == [2, 3, 9, 8] and "auto_pad" not in gi.attrs
    assert gi.attrs["pads"] == [1, 0, 1, 1]  # total pads (2, 1): SAME_UPPER puts the odd one at the end


def test_conv_mnist_shapes_large_batch_chunks():
    """A batch big enough to be split into several im2col chunks still matches PyTorch."""
    rng = np.random.default_rng(3)
    x = _randn(rng, 70, 16, 24, 24)
    w = _randn(rng, 24, 16, 3, 3)
    b = _randn(rng, 24)
    check_op("Conv", [x, w, b], {}, lambda x, w, b: F.conv2d(x, w, b), rtol=1e-4, atol=1e-4)


def test_conv_rejects_bad_attributes():
    rng = np.random.default_rng(0)
    x = _randn(rng, 1, 3, 5, 5)
    with pytest.raises(AnygradError, match="channels"):
        run_op("Conv", [x, _randn(rng, 2, 2, 3, 3)], {}, grad=False)
    with pytest.raises(AnygradError, match="kernel_shape"):
        run_op("Conv", [x, _randn(rng, 2, 3, 3, 3)], {"kernel_shape": [2, 2]}, grad=False)
    with pytest.raises(AnygradError, match="does not fit"):
        run_op("Conv", [x, _randn(rng, 2, 3, 3, 3)], {"dilations": [3, 3]}, grad=False)


# -- pooling -------------------------------------------------------------------------------------
@st.composite
def pool_cases(draw):
    nd = draw(st.sampled_from([2, 2, 1]))
    kernel = [draw(st.integers(1, 3)) for _ in range(nd)]
    strides = [draw(st.integers(1, 3)) for _ in range(nd)]
    pads = [draw(st.integers(0, k // 2)) for k in kernel]  # PyTorch: symmetric, at most half the kernel
    dilations = [draw(st.integers(1, 2)) for _ in range(nd)]
    spatial = [(k - 1) * d + 1 + draw(st.integers(0, 5)) for k, d in zip(kernel, dilations)]
    return {"nd": nd, "kernel": kernel, "strides": strides, "pads": pads, "dilations": dilations,
            "ceil_mode": draw(st.booleans()), "count_include_pad": draw(st.booleans()),
            "shape": (draw(st.integers(1, 2)), draw(st.integers(1, 3)), *spatial),
            "seed": draw(st.integers(0, 1000))}


MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d}
AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d}


@settings(max_examples=25, deadline=None)
@given(pool_cases())
def test_max_pool_matches_torch(c):
    x = _randn(np.random.default_rng(c["seed"]), *c["shape"])
    attrs = {"kernel_shape": c["kernel"], "strides": c["strides"], "pads": c["pads"] * 2,
             "dilations": c["dilations"], "ceil_mode": int(c["ceil_mode"])}
    check_op("MaxPool", [x], attrs, lambda x: MAXPOOL[c["nd"]](
        x, c["kernel"], c["strides"], c["pads"], dilation=c["dilations"], ceil_mode=c["ceil_mode"]))


@settings(max_examples=25, deadline=None)
@given(pool_cases())
def test_average_pool_matches_torch(c):
    x = _randn(np.random.default_rng(c["seed"]), *c["shape"])
    attrs = {"kernel_shape": c["kernel"], "strides": c["strides"], "pads": c["pads"] * 2,
             "ceil_mode": int(c["ceil_mode"]), "count_include_pad": int(c["count_include_pad"])}
    check_op("AveragePool", [x], attrs, lambda x: AVGPOOL[c["nd"]](
        x, c["kernel"], c["strides"], c["pads"], ceil_mode=c["ceil_mode"],
        count_include_pad=c["count_include_pad"]))


def test_max_pool_ties_route_to_first_max_like_torch():
    x = np.ones((1, 1, 4, 4), np.float32)
    x[0, 0, 2:, 2:] = 3.0
    check_op("MaxPool", [x], {"kernel_shape": [2, 2], "strides": [1, 1]}, lambda x: F.max_pool2d(x, 2, 1))


def test_max_pool_same_upper_and_asymmetric_pads():
    x = _randn(np.random.default_rng(5), 2, 2, 7, 6)
    check_op("MaxPool", [x], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
             lambda x: F.max_pool2d(F.pad(x, _torch_pad(_same_pads((7, 6), (3, 3), (2, 2), (1, 1), True)),
                                          value=-math.inf), 3, 2))
    check_op("AveragePool", [x], {"kernel_shape": [2, 3], "pads": [0, 1, 1, 0], "count_include_pad": 1},
             lambda x: F.avg_pool2d(F.pad(x, _torch_pad([0, 1, 1, 0])), (2, 3), 1))


def test_max_pool_indices_output_is_rejected():
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype("float32"), (1, 1, 4, 4))
    g.nodes = [Node("MaxPool", ["x"], ["y", "idx"], {"kernel_shape": [2, 2]}, name="pool1")]
    with pytest.raises(AnygradError, match="pool1.*Indices"):
        specialize(g, {})


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=3, max_size=5), seed=st.integers(0, 2**31 - 1))
def test_global_average_pool(shape, seed):
    x = _randn(np.random.default_rng(seed), *shape)
    spatial = tuple(range(2, len(shape)))
    check_op("GlobalAveragePool", [x], {}, lambda x: x.mean(dim=spatial, keepdim=True), seed=seed % 1000)


# -- BatchNormalization --------------------------------------------------------------------------
TORCH_BN = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}


@st.composite
def bn_cases(draw):
    rank = draw(st.integers(2, 5))
    shape = [draw(st.integers(1, 4)) for _ in range(rank)]
    training = draw(st.booleans())
    if training and np.prod([d for i, d in enumerate(shape) if i != 1]) < 2:
        shape[0] = 2  # training needs more than one value per channel
    return {"shape": tuple(shape), "training": training, "seed": draw(st.integers(0, 2**31 - 1)),
            "eps": draw(st.sampled_from([1e-5, 1e-3, 0.1])),
            "momentum": draw(st.floats(0.0, 1.0))}  # ONNX momentum = 1 - PyTorch's


def _bn_inputs(shape, seed):
    rng = np.random.default_rng(seed)
    c = shape[1]
    return [_randn(rng, *shape) * 2 + 1, _randn(rng, c), _randn(rng, c), _randn(rng, c),
            rng.uniform(0.5, 2, c).astype(np.float32)]


@settings(max_examples=40, deadline=None)
@given(bn_cases())
def test_batch_norm_matches_torch(c):
    """Output and gradients (batch or running statistics), and in training the running-statistics
    update (PyTorch's unbiased variance), against torch's BatchNorm module in float64."""
    shape, eps, momentum, training = c["shape"], c["eps"], c["momentum"], c["training"]
    x, scale, bias, mean, var = _bn_inputs(shape, c["seed"])
    attrs = {"epsilon": eps, "momentum": momentum, "training_mode": int(training)}
    outs, _, _ = run_op("BatchNormalization", [x, scale, bias, mean, var], attrs, const=(3, 4),
                        n_outputs=3 if training else 1, grad=False)
    bn = TORCH_BN[len(shape)](shape[1], eps=eps, momentum=1 - momentum).double().train(training)
    with torch.no_grad():
        for p, v in ((bn.weight, scale), (bn.bias, bias), (bn.running_mean, mean), (bn.running_var, var)):
            p.copy_(torch.tensor(v))
        y = bn(torch.tensor(x, dtype=torch.float64))
    # float32 rounding of x (relative 2**-24) is amplified by scale / sqrt(var + eps): with two
    # close values per channel and eps 1e-5 that is ~300x, beyond any fixed tolerance.
    axes = tuple(i for i in range(len(shape)) if i != 1)
    var_used = x.astype(np.float64).var(axis=axes) if training else var.astype(np.float64)
    gain = float(np.max(np.abs(scale) / np.sqrt(var_used + eps)))
    atol = 1e-5 + 8 * 2.0**-24 * float(np.abs(x).max()) * gain
    np.testing.assert_allclose(outs[0], y.numpy(), rtol=1e-4, atol=atol)
    if training:
        np.testing.assert_allclose(outs[1], bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(outs[2], bn.running_var.numpy(), rtol=1e-5, atol=1e-5)

    def ref(x, s, b, m, v):
        return F.batch_norm(x, m.double(), v.double(), s, b, training=training, eps=eps)

    check_op("BatchNormalization", [x, scale, bias, mean, var], attrs, ref, const=(3, 4), seed=c["seed"] % 1000,
             atol=atol)


def _bn_graph():
    g = Graph(inputs=["x"], outputs=["y"], name="bn")
    g.info["x"] = TensorInfo(np.dtype("float32"), ("N", 3, 4, 4))
    g.initializers = {"s": np.ones(3, np.float32), "b": np.zeros(3, np.float32),
                      "rm": np.zeros(3, np.float32), "rv": np.ones(3, np.float32)}
    g.params = ["s", "b", "rm", "rv"]  # as an importer that does not know better might list them
    g.nodes = [Node("BatchNormalization", ["x", "s", "b", "rm", "rv"], ["y"], {"momentum": 0.9}, name="bn1")]
    return g


def test_batch_norm_set_mode_training_and_back():
    t = set_training_mode(_bn_graph(), True)
    node = t.nodes[0]
    assert node.attrs["training_mode"] == 1 and len(node.outputs) == 3 and all(node.outputs)
    assert t.state_updates == {node.outputs[1]: "rm", node.outputs[2]: "rv"}
    assert set(t.buffers) >= {"rm", "rv"} and t.params == ["s", "b"]
    # Running the training graph updates the running statistics like torch (momentum 0.1).
    s = specialize(t, {"x": (5, 3, 4, 4)})
    backend = NumpyBackend()
    x = _randn(np.random.default_rng(0), 5, 3, 4, 4)
    backend.compile(s).run({"x": x})
    bn = torch.nn.BatchNorm2d(3, momentum=0.1).double().train()
    bn(torch.tensor(x, dtype=torch.float64))
    np.testing.assert_allclose(backend.state["rm"], bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(backend.state["rv"], bn.running_var.numpy(), rtol=1e-5, atol=1e-6)

    e = set_training_mode(t, False)
    node = e.nodes[0]
    assert node.attrs["training_mode"] == 0 and node.outputs == ["y"] and e.state_updates == {}


@pytest.mark.parametrize("shape,ok", [((1, 10), False), ((1, 4, 1, 1), False), ((1, 3, 1), False),
                                      ((2, 10), True), ((1, 4, 2, 1), True)])
def test_batch_norm_training_needs_more_than_one_value_per_channel(shape, ok):
    """As PyTorch: BatchNorm1d on a batch of one cannot train (it would silently output beta)."""
    bn = TORCH_BN[len(shape)](shape[1]).train()
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype("float32"), ("N",) + shape[1:])
    c = shape[1]
    g.initializers = {"s": np.ones(c, np.float32), "b": np.zeros(c, np.float32), "rm": np.zeros(c, np.float32),
                      "rv": np.ones(c, np.float32)}
    g.params = ["s", "b"]
    g.nodes = [Node("BatchNormalization", ["x", "s", "b", "rm", "rv"], ["y"], name="norm2")]
    train = set_training_mode(g, True)
    if ok:
        bn(torch.zeros(shape))
        specialize(train, {"x": shape})
        return
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(torch.zeros(shape))
    with pytest.raises(ShapeError, match="norm2.*more than 1 value per channel.*drop-last"):
        specialize(train, {"x": shape})
    specialize(set_training_mode(g, False), {"x": shape})  # inference on one sample is fine


# -- Dropout -------------------------------------------------------------------------------------
def _dropout_graph(ratio=0.3, shape=(64, 128)):
    g = Graph(inputs=["x"], outputs=["y"], name="drop")
    g.info["x"] = TensorInfo(np.dtype("float32"), ("N",) + shape[1:])
    g.initializers = {"ratio": np.array(ratio, np.float32)}
    g.nodes = [Node("Dropout", ["x", "ratio"], ["h"], name="d1"),
               Node("Dropout", ["h", "ratio"], ["y"], name="d2")]
    return g


def _train_graph(ratio, shape):
    t = set_training_mode(_dropout_graph(ratio, shape), True)
    t.initializers[RNG_STATE] = np.array([7, 0], np.uint32)
    t.buffers.append(RNG_STATE)
    return t


def test_dropout_set_mode():
    t = _train_graph(0.3, (64, 128))
    d1, d2 = t.nodes
    assert d1.inputs[3] == RNG_STATE and t.initializers[d1.inputs[2]].dtype == bool
    assert bool(t.initializers[d1.inputs[2]]) and len(d1.outputs) == 2 and d1.outputs[1]
    assert {d1.attrs["salt"], d2.attrs["salt"]} == {0, 1}
    e = set_training_mode(t, False)
    assert all(n.inputs == [n.inputs[0], "ratio"] for n in e.nodes)
    x = _randn(np.random.default_rng(0), 64, 128)
    out = NumpyBackend().compile(specialize(e, {"x": x.shape})).run({"x": x})
    np.testing.assert_array_equal(out["y"], x)  # inference: identity


def test_dropout_without_ratio_defaults_to_half():
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype("float32"), (100, 100))
    g.nodes = [Node("Dropout", ["x"], ["y"], name="d")]
    t = set_training_mode(g, True)
    assert t.nodes[0].inputs[1] == "" and t.nodes[0].inputs[3] == RNG_STATE
    t.initializers[RNG_STATE] = np.array([3, 9], np.uint32)
    t.buffers.append(RNG_STATE)
    x = np.ones((100, 100), np.float32)
    y = NumpyBackend().compile(specialize(t, {})).run({"x": x})["y"]
    assert set(np.unique(y)) == {0.0, 2.0} and abs((y == 0).mean() - 0.5) < 0.03


@pytest.mark.parametrize("ratio", [0.2, 0.7])
def test_dropout_ratio_attribute_of_old_opsets(ratio):
    """Opsets 7-11 give the ratio as an attribute (no input 1): it must be used, not 0.5."""
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype("float32"), (200, 100))
    g.nodes = [Node("Dropout", ["x"], ["y"], {"ratio": ratio}, name="d")]
    t = set_training_mode(g, True)
    t.initializers[RNG_STATE] = np.array([3, 9], np.uint32)
    t.buffers.append(RNG_STATE)
    s = specialize(t, {})
    b = Builder(s)
    r = _randn(np.random.default_rng(1), 200, 100)
    s.outputs += [gradients(s, b.op("ReduceSum", [b.op("Mul", ["y", b.const(r)])], keepdims=0), ["x"])["x"]]
    x = np.ones((200, 100), np.float32)
    y, dx = NumpyBackend().compile(s).run({"x": x}).values()
    kept = y != 0
    assert abs((1 - kept.mean()) - ratio) < 0.02
    np.testing.assert_allclose(y[kept], np.float32(1 / (1 - ratio)), rtol=1e-6)
    np.testing.assert_allclose(dx, r * kept / np.float32(1 - ratio), rtol=1e-6)
    e = specialize(set_training_mode(t, False), {})  # inference: identity whatever the ratio
    np.testing.assert_array_equal(NumpyBackend().compile(e).run({"x": x})["y"], x)


def _run_dropout(x, ratio, state, salt=0, training=True):
    g = Graph(inputs=["x"], outputs=["y", "mask"])
    g.info["x"] = TensorInfo(np.dtype("float32"), x.shape)
    g.initializers = {"ratio": np.array(ratio, np.float32), "train": np.array(training),
                      RNG_STATE: np.array(state, np.uint32)}
    g.nodes = [Node("Dropout", ["x", "ratio", "train", RNG_STATE], ["y", "mask"], {"salt": salt})]
    s = specialize(g, {})
    b = Builder(s)
    r = _randn(np.random.default_rng(1), *x.shape)
    loss = b.op("ReduceSum", [b.op("Mul", ["y", b.const(r)])], keepdims=0)
    s.outputs += [gradients(s, loss, ["x"])["x"]]
    y, mask, dx = NumpyBackend().compile(s).run({"x": x}).values()
    return y, mask, dx, r


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), ratio=st.floats(0.0, 0.95),
       training=st.booleans(), seed=st.integers(0, 2**32 - 1), counter=st.integers(0, 2**32 - 1))
def test_dropout_matches_torch_scaling(shape, ratio, training, seed, counter):
    """Training: the mask is the shared counter-based generator's and drops a `ratio` share
    (within 5 binomial standard deviations); kept elements and their gradient are scaled by
    1/(1-ratio), torch.nn.functional.dropout's formula, written out in torch in float64 on the
    same mask. Inference: the identity, gradient included."""
    x = _randn(np.random.default_rng(seed), *shape)
    y, mask, dx, r = _run_dropout(x, ratio, [seed, counter], training=training)
    if not training:
        np.testing.assert_array_equal(y, x)
        np.testing.assert_array_equal(dx, r)
        return
    assert mask.dtype == bool and abs((1 - mask.mean()) - ratio) <= 5 * np.sqrt(ratio * (1 - ratio) / x.size) + 1e-9
    u = anyrng.uniform(seed, counter, 0, x.size).reshape(x.shape)
    np.testing.assert_array_equal(mask, u >= np.float32(ratio))
    keep = torch.tensor(mask, dtype=torch.float64)
    want = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    held = float(np.float32(ratio))  # the ratio as the float32 model input holds it
    out = want * keep / (1 - held)  # torch.nn.functional.dropout's formula, on this mask
    (out * torch.tensor(r, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(y, out.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dx, want.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_dropout_mask_depends_on_seed_counter_salt_only():
    x = _randn(np.random.default_rng(0), 32, 64)
    base = _run_dropout(x, 0.5, [1, 5])[1]
    np.testing.assert_array_equal(base, _run_dropout(x, 0.5, [1, 5])[1])
    assert (base != _run_dropout(x, 0.5, [1, 6])[1]).any()
    assert (base != _run_dropout(x, 0.5, [1, 5], salt=1)[1]).any()
    assert (base != _run_dropout(x, 0.5, [2, 5])[1]).any()


def test_dropout_training_graph_two_nodes_draw_different_masks():
    t = _train_graph(0.5, (16, 32))
    t.outputs = ["y", t.nodes[0].outputs[1], t.nodes[1].outputs[1]]
    x = np.ones((16, 32), np.float32)
    backend = NumpyBackend()
    out = backend.compile(specialize(t, {"x": x.shape})).run({"x": x})
    m1, m2 = out[t.outputs[1]], out[t.outputs[2]]
    assert (m1 != m2).any()
    np.testing.assert_allclose(out["y"], m1 * m2 * 4.0)


# -- Softmax / LogSoftmax ------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_softmax_and_log_softmax(shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = _randn(np.random.default_rng(data.draw(st.integers(0, 100))), *shape) * 5
    attrs = {"axis": axis}
    check_op("Softmax", [x], attrs, lambda x: torch.softmax(x, axis))
    check_op("LogSoftmax", [x], attrs, lambda x: torch.log_softmax(x, axis))


def test_softmax_default_axis_is_last_and_stable():
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, 0.0, 5.0]], np.float32)
    check_op("Softmax", [x], {}, lambda x: torch.softmax(x, -1))
    check_op("LogSoftmax", [x], {}, lambda x: torch.log_softmax(x, -1))
