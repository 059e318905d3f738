"""ConvTranspose (1-D/2-D/3-D) forward and gradients against PyTorch in float64, nn.ConvTranspose2d,
exported models, and the expansion on wgpu."""
import math
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from opcheck import check_op, run_op

import anygrad
from anygrad import nn
from anygrad.autodiff import gradients
from anygrad.backends import NumpyBackend
from anygrad.errors import ShapeError
from anygrad.ir import Builder, Graph, Node, TensorInfo, specialize

CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def reference(x, w, b, strides, dilations, group, begin, end, out_pad):
    """The full transposed conv (no padding), then output_padding zeros and ONNX's (possibly
    asymmetric) pads cropped: independent of anygrad's geometry code."""
    nd = len(strides)
    y = CONV_T[nd](x, w, None, stride=strides, groups=group, dilation=dilations)
    amounts = []
    for d in reversed(range(nd)):  # F.pad: last dim first; negative amounts crop
        amounts += [-begin[d], out_pad[d] - end[d]]
    y = F.pad(y, amounts)
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * nd)
    return y


@st.composite
def cases(draw):
    nd = draw(st.sampled_from([1, 2, 2, 3]))
    small = nd == 3
    group = draw(st.sampled_from([1, 1, 2, 3]))
    cin, cout = group * draw(st.integers(1, 2)), group * draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 2 if small else 3)) for _ in range(nd)]
    strides = [draw(st.integers(1, 2 if small else 3)) for _ in range(nd)]
    dilations = [draw(st.integers(1, 2)) for _ in range(nd)]
    spatial = [draw(st.integers(1, 3 if small else 4)) for _ in range(nd)]
    out_pad = [draw(st.integers(0, max(s, d) - 1)) for s, d in zip(strides, dilations)]
    full = [(i - 1) * s + (k - 1) * d + 1 for i, s, k, d in zip(spatial, strides, kernel, dilations)]
    begin = [draw(st.integers(0, min(2, f - 1))) for f in full]
    end = [draw(st.integers(0, min(2, f + p - b - 1))) for f, p, b in zip(full, out_pad, begin)]
    bias = draw(st.booleans())
    return nd, group, cin, cout, kernel, strides, dilations, spatial, out_pad, begin, end, bias


@settings(max_examples=40, deadline=None)
@given(cases(), st.integers(0, 2**31 - 1))
def test_conv_transpose_matches_torch(case, seed):
    _, group, cin, cout, kernel, strides, dilations, spatial, out_pad, begin, end, bias = case
    rng = np.random.default_rng(seed)
    x = _randn(rng, 2, cin, *spatial)
    w = _randn(rng, cin, cout // group, *kernel)
    b = _randn(rng, cout) if bias else None
    attrs = {"strides": strides, "dilations": dilations, "group": group, "pads": begin + end,
             "output_padding": out_pad}
    if rng.random() < 0.5:
        attrs["kernel_shape"] = kernel
    check_op("ConvTranspose", [x, w, b], attrs,
             lambda x, w, b: reference(x, w, b, strides, dilations, group, begin, end, out_pad),
             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_pytorch_symmetric_padding(nd):
    """What PyTorch's exporter emits: symmetric pads, output_padding, against F.conv_transposeNd."""
    rng = np.random.default_rng(nd)
    x, w, b = _randn(rng, 2, 4, *[3] * nd), _randn(rng, 4, 3, *[3] * nd), _randn(rng, 6)
    attrs = {"strides": [2] * nd, "pads": [1] * (2 * nd), "output_padding": [1] * nd, "group": 2,
             "dilations": [1] * nd}
    check_op("ConvTranspose", [x, w, b], attrs,
             lambda x, w, b: CONV_T[nd](x, w, b, stride=2, padding=1, output_padding=1, groups=2), atol=1e-4)


@pytest.mark.parametrize("upper", [True, False])
def test_auto_pad_same_and_output_shape(upper):
    rng = np.random.default_rng(0)
    x, w = _randn(rng, 1, 2, 3, 4), _randn(rng, 2, 3, 3, 2)
    # SAME: output = input * stride; total pad = full - output, odd half placed by the mode
    full = [(3 - 1) * 2 + 3, (4 - 1) * 2 + 2]   # 7, 8 -> outputs 6, 8: totals 1, 0
    begin = [0 if upper else 1, 0]
    end = [1 if upper else 0, 0]
    check_op("ConvTranspose", [x, w], {"strides": [2, 2], "auto_pad": "SAME_UPPER" if upper else "SAME_LOWER"},
             lambda x, w: reference(x, w, None, [2, 2], [1, 1], 1, begin, end, [0, 0]), atol=1e-4)
    # output_shape larger than the full result: the extra rows are zeros at the end (PyTorch's
    # output_size), smaller: cropped as ONNX distributes the total pad
    for shape in ([8, 9], [5, 8]):
        total = [f - s for f, s in zip(full, shape)]
        begin = [t // 2 if upper else t - t // 2 for t in total]
        end = [t - bb for t, bb in zip(total, begin)]
        attrs = {"strides": [2, 2], "output_shape": shape}
        if upper:
            attrs["auto_pad"] = "SAME_UPPER"
        outs, _, _ = run_op("ConvTranspose", [x, w], attrs, grad=False)
        assert outs[0].shape == (1, 3, *shape)
        check_op("ConvTranspose", [x, w], attrs,
                 lambda x, w, begin=begin, end=end: reference(x, w, None, [2, 2], [1, 1], 1, begin, end, [0, 0]),
                 atol=1e-4)


def test_expands_to_conv_grad_input():
    """Specialize leaves only primitives the backends run: ConvGradInput (+ Pad, Add)."""
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype("float32"), ("N", 2, 3, 3))
    g.initializers = {"w": np.zeros((2, 4, 3, 3), np.float32), "b": np.zeros(4, np.float32)}
    g.params = ["w", "b"]
    g.nodes = [Node("ConvTranspose", ["x", "w", "b"], ["y"], {"strides": [2, 2], "output_shape": [8, 8]})]
    s = specialize(g, {"x": (5, 2, 3, 3)})
    assert [n.op for n in s.nodes if n.op not in ("Reshape",)] == ["ConvGradInput", "Pad", "Add"]
    assert s.info["y"].shape == (5, 4, 8, 8)


def test_bad_shapes_name_the_node():
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype("float32"), (1, 3, 4, 4))
    g.initializers = {"w": np.zeros((2, 4, 3, 3), np.float32)}
    g.nodes = [Node("ConvTranspose", ["x", "w"], ["y"], {}, name="up1")]
    with pytest.raises(ShapeError, match="up1.*3 channels"):
        specialize(g, {})


def test_double_backward_of_conv_matches_torch():
    """ConvGradInput's own gradient (a Conv and a swapped ConvGradWeight): the Hessian-vector
    product of a conv loss, as torch.autograd.grad with create_graph."""
    rng = np.random.default_rng(3)
    w, dy = _randn(rng, 4, 3, 3, 3), _randn(rng, 2, 4, 3, 2)
    attrs = {"strides": [2, 2], "pads": [1, 0, 1, 1], "kernel_shape": [3, 3], "dilations": [1, 1], "group": 1}
    check_op("ConvGradInput", [dy, w], {**attrs, "input_shape": [2, 3, 5, 5]},
             lambda dy, w: _conv2d_input(dy, w, (2, 3, 5, 5)), atol=1e-4)


def _conv2d_input(dy, w, shape):
    """dX of conv2d(pads [1, 0, 1, 1], stride 2) via autograd, differentiable (create_graph)."""
    xt = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    y = F.conv2d(F.pad(xt, (0, 1, 1, 1)), w, stride=2)
    (dx,) = torch.autograd.grad(y, xt, dy, create_graph=True)
    return dx


# -- nn.ConvTranspose2d -------------------------------------------------------------------------------
def test_layer_init_names_and_forward_match_torch():
    nn.manual_seed(0)
    layer = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
    ref = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
    sd = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    # PyTorch's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = (out/groups) * taps
    bound = 1 / math.sqrt(3 * 9)
    for k in ("weight", "bias"):
        assert np.abs(sd[k]).max() <= bound and np.abs(sd[k]).max() > 0.7 * bound
    ref.load_state_dict({k: torch.tensor(v) for k, v in sd.items()})
    x = np.random.default_rng(0).standard_normal((2, 4, 5, 5)).astype(np.float32)
    model = layer.to_model(input_shape=(None, 4, 5, 5))
    model.compile(loss="mse")
    np.testing.assert_allclose(model.predict(x), ref(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_layer_output_size():
    class Up(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)

        def forward(self, x):
            return self.up(x, output_size=(8, 7))

    net = Up()
    ref = torch.nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)
    ref.load_state_dict({k: torch.tensor(v) for k, v in net.up.state_dict().items()})
    x = np.random.default_rng(1).standard_normal((1, 2, 4, 4)).astype(np.float32)
    model = net.to_model(input_shape=(None, 2, 4, 4))
    model.compile(loss="mse")
    want = ref(torch.tensor(x), output_size=(8, 7)).detach().numpy()
    np.testing.assert_allclose(model.predict(x), want, rtol=1e-4, atol=1e-5)


# -- exported models -----------------------------------------------------------------------------------
class _UpNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up1 = torch.nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
        self.up2 = torch.nn.ConvTranspose1d(4, 2, 2, stride=2, groups=2, bias=False)

    def forward(self, x):
        y = torch.tanh(self.up1(x))
        return self.up2(y.flatten(2))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_exported_model_outputs_and_gradients(tmp_path, dynamo):
    torch.manual_seed(0)
    net = _UpNet().double()
    x = torch.randn(2, 3, 3, 4, dtype=torch.float64)
    path = tmp_path / "up.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {} if dynamo else {"do_constant_folding": False}
        torch.onnx.export(net.float(), (x.float(),), str(path), dynamo=dynamo, opset_version=17,
                          input_names=["x"], output_names=["y"], **kwargs)
    net.double()
    assert "ConvTranspose" in {n.op_type for n in onnx.load(str(path)).graph.node}
    model = anygrad.load_onnx(path)
    g = specialize(model.graph, {model.input_name: tuple(x.shape)})
    r = np.random.default_rng(0).standard_normal(g.info[g.outputs[0]].shape).astype(np.float32)
    b = Builder(g, prefix="t")
    loss = b.op("ReduceSum", [b.op("Mul", [g.outputs[0], b.const(r)])], keepdims=0)
    params = list(g.params)
    grads = gradients(g, loss, params)
    g.outputs = [g.outputs[0]] + [grads[p] for p in params]
    out = NumpyBackend().compile(g).run({model.input_name: x.numpy().astype(np.float32)})
    y = net(x)
    np.testing.assert_allclose(out[g.outputs[0]], y.detach().numpy(), rtol=1e-4, atol=1e-5)
    (y * torch.tensor(r, dtype=torch.float64)).sum().backward()
    want = {tuple(p.shape): p.grad.numpy() for p in net.parameters()}
    assert len(params) == len(want)  # shapes are distinct here: match gradients by shape
    for p in params:
        got = out[grads[p]]
        np.testing.assert_allclose(got, want[got.shape], rtol=1e-4, atol=1e-4, err_msg=p)


# -- wgpu -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attrs,shapes", [
    ({"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, ((2, 3, 3, 4), (3, 2, 3, 3))),
    ({"strides": [2, 1], "pads": [0, 1, 0, 0], "output_padding": [1, 0], "group": 2, "dilations": [1, 2]},
     ((1, 4, 3, 3), (4, 2, 2, 3))),
    ({"strides": [3], "output_shape": [9]}, ((2, 2, 3), (2, 3, 2))),
])
def test_trains_on_wgpu_like_numpy(attrs, shapes):
    from wgpu_util import check_wgpu
    rng = np.random.default_rng(0)
    xs, ws = shapes
    cout = ws[1] * attrs.get("group", 1)
    check_wgpu("ConvTranspose", [_randn(rng, *xs), _randn(rng, *ws), _randn(rng, cout)], attrs,
               rtol=2e-4, atol=1e-5)
