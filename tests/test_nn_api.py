"""anygrad.nn against PyTorch: the same model written in both, same weights, same numbers."""

import numpy as np
import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as TF
from hypothesis import given, settings
from hypothesis import strategies as st

import anygrad
import anygrad.nn.functional as F
from anygrad import AnygradError, nn
from anygrad.autodiff import gradients
from anygrad.backends import NumpyBackend
from anygrad.examples import FOUNDING_MODEL
from anygrad.ir import Builder, specialize


# -- the founding MNIST model, written twice ------------------------------------------------------
class Net(nn.Module):
    def __init__(self, p: float = 0.3):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.conv3 = nn.Conv2d(16, 24, 3)
        self.norm1 = nn.BatchNorm2d(24)
        self.dropout1 = nn.Dropout(p)
        self.fc1 = nn.Linear(24 * 22 * 22, 32)
        self.fc2 = nn.Linear(32, 10)
        self.norm2 = nn.BatchNorm1d(10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        x = self.norm1(x)
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = self.dropout1(x)
        x = self.norm2(self.fc2(x))
        return F.log_softmax(x, dim=1)


class TorchNet(tnn.Module):
    def __init__(self, p: float = 0.3):
        super().__init__()
        self.conv1 = tnn.Conv2d(1, 8, 3)
        self.conv2 = tnn.Conv2d(8, 16, 3)
        self.conv3 = tnn.Conv2d(16, 24, 3)
        self.norm1 = tnn.BatchNorm2d(24)
        self.dropout1 = tnn.Dropout(p)
        self.fc1 = tnn.Linear(24 * 22 * 22, 32)
        self.fc2 = tnn.Linear(32, 10)
        self.norm2 = tnn.BatchNorm1d(10)

    def forward(self, x):
        x = TF.relu(self.conv1(x))
        x = TF.relu(self.conv2(x))
        x = TF.relu(self.conv3(x))
        x = self.norm1(x)
        x = torch.flatten(x, 1)
        x = TF.relu(self.fc1(x))
        x = self.dropout1(x)
        x = self.norm2(self.fc2(x))
        return TF.log_softmax(x, dim=1)


def numpy_state(module: tnn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def randomise_bn(module: tnn.Module, seed: int) -> None:
    """Non-trivial BatchNorm parameters and statistics, so loading them is really tested."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, tnn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(1 + 0.5 * torch.rand(m.running_var.shape, generator=g))


def mnist_batch(seed: int, n: int = 8):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n).astype(np.int64)


def test_traced_graph_is_the_importers_graph():
    model = Net().to_model(input_shape=(None, 1, 28, 28))
    g = model.graph
    assert [n.op for n in g.nodes] == [
        "Conv",
        "Relu",
        "Conv",
        "Relu",
        "Conv",
        "Relu",
        "BatchNormalization",
        "Flatten",
        "Gemm",
        "Relu",
        "Dropout",
        "Gemm",
        "BatchNormalization",
        "LogSoftmax",
    ]
    imported = anygrad.load_onnx(FOUNDING_MODEL).graph
    assert g.params == imported.params and g.buffers == imported.buffers
    assert [n.name for n in g.nodes] == [n.name for n in imported.nodes]  # TorchScript-style scopes
    assert g.info["input"].shape == ("batch", 1, 28, 28) and g.info["output"].shape == ("batch", 10)
    bn = g.nodes[6]
    assert bn.attrs["momentum"] == pytest.approx(0.9) and bn.attrs["epsilon"] == pytest.approx(1e-5)


def test_founding_model_predict_matches_pytorch_eval():
    torch.manual_seed(0)
    tnet = TorchNet()
    randomise_bn(tnet, 1)
    net = Net()
    net.load_state_dict(numpy_state(tnet))
    model = net.to_model(input_shape=(None, 1, 28, 28)).compile(loss="nll", device="cpu")
    x, _ = mnist_batch(0, 5)
    with torch.no_grad():
        expected = tnet.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-5, atol=1e-5)
    # the batch dim is symbolic: another batch size runs the same model
    np.testing.assert_allclose(model.predict(x[:3]), expected[:3], rtol=1e-5, atol=1e-5)


def test_founding_model_trains_like_pytorch_and_state_comes_back():
    torch.manual_seed(1)
    tnet = TorchNet(p=0.0).train()
    net = Net(p=0.0)
    net.load_state_dict(numpy_state(tnet))
    model = net.to_model(input_shape=(None, 1, 28, 28)).compile(
        loss="nll", optimizer=anygrad.optim.SGD(lr=0.05, momentum=0.9), device="cpu"
    )
    opt = torch.optim.SGD(tnet.parameters(), lr=0.05, momentum=0.9)
    ours, theirs = [], []
    for step in range(3):
        x, y = mnist_batch(10 + step, 16)
        ours.append(model.train_on_batch(x, y))
        opt.zero_grad()
        loss = TF.nll_loss(tnet(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    # trained state back into the module, by PyTorch names
    net.load_from(model)
    expected = numpy_state(tnet)
    for name, value in net.state_dict().items():
        if name.endswith("num_batches_tracked"):
            continue  # not counted by the graph (momentum is fixed)
        scale = np.abs(expected[name]).max()
        assert np.abs(value - expected[name]).max() <= 1e-3 * scale + 1e-6, name
    assert set(model.state_dict()) <= set(net.state_dict())


def test_load_state_dict_reports_every_problem_at_once():
    net = Net()
    state = numpy_state(TorchNet())
    del state["conv2.bias"], state["norm2.running_var"]
    state["extra.weight"] = np.zeros(3, np.float32)
    state["fc2.weight"] = np.zeros((10, 31), np.float32)
    before = net.state_dict()
    with pytest.raises(AnygradError) as err:
        net.load_state_dict(state)
    msg = str(err.value)
    for key in ("conv2.bias", "norm2.running_var", "extra.weight", "fc2.weight", "(10, 31)", "(10, 32)"):
        assert key in msg
    for k, v in net.state_dict().items():  # nothing was loaded
        np.testing.assert_array_equal(v, before[k])
    # strict=False skips missing/unexpected keys but never a wrong shape
    with pytest.raises(AnygradError, match="fc2.weight"):
        net.load_state_dict(state, strict=False)
    state["fc2.weight"] = np.ones((10, 32), np.float32)
    result = net.load_state_dict(state, strict=False)
    assert result.missing_keys == ["conv2.bias", "norm2.running_var"] and result.unexpected_keys == [
        "extra.weight"
    ]
    np.testing.assert_array_equal(net.fc2.weight.data, 1)


def test_state_dict_keys_and_dtypes_match_pytorch():
    ours, theirs = Net().state_dict(), numpy_state(TorchNet())
    assert list(ours) == list(theirs)
    for k in ours:
        assert ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype, k


def test_fresh_init_statistics_look_like_pytorch():
    nn.manual_seed(5)
    ours = Net().state_dict()
    torch.manual_seed(5)
    theirs = numpy_state(TorchNet())
    for k, theirs_v in theirs.items():
        v = ours[k]
        if k.startswith("norm"):  # ones and zeros exactly
            np.testing.assert_array_equal(v, theirs_v, err_msg=k)
            continue
        weight = theirs[k.replace(".bias", ".weight")]
        bound = 1 / np.sqrt(np.prod(weight.shape[1:]))  # kaiming_uniform(a=sqrt(5)) and the bias bound
        assert np.abs(v).max() <= bound and np.abs(theirs_v).max() <= bound, k
        if v.size >= 200:
            assert abs(v.std() / theirs_v.std() - 1) < 0.1, k
            assert abs(v.mean()) < 0.1 * bound, k
    # seeded: same seed, same values; init_parameters redraws from its own generator
    nn.manual_seed(5)
    again = Net().state_dict()
    assert all(np.array_equal(again[k], ours[k]) for k in ours)
    a, b = Net().init_parameters(3).state_dict(), Net().init_parameters(3).state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    emb = nn.Embedding(1000, 8).weight.data
    assert abs(emb.std() - 1) < 0.05 and abs(emb.mean()) < 0.05


# -- a residual block, forward and gradients -----------------------------------------------------------
class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding="same", bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + x)


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.block = Block(6)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = self.pool(self.block(self.stem(x)))
        return self.fc(x.view(x.size(0), -1))


class TorchBlock(tnn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = tnn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = tnn.BatchNorm2d(c)
        self.conv2 = tnn.Conv2d(c, c, 3, padding="same", bias=False)
        self.bn2 = tnn.BatchNorm2d(c)

    def forward(self, x):
        out = TF.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return TF.relu(out + x)


class TorchResNet(tnn.Module):
    def __init__(self):
        super().__init__()
        self.stem = tnn.Sequential(tnn.Conv2d(3, 6, 3, stride=2, padding=1), tnn.BatchNorm2d(6), tnn.ReLU())
        self.block = TorchBlock(6)
        self.pool = tnn.AdaptiveAvgPool2d(1)
        self.fc = tnn.Linear(6, 5)

    def forward(self, x):
        x = self.pool(self.block(self.stem(x)))
        return self.fc(x.view(x.size(0), -1))


def test_residual_model_forward_and_gradients_match_pytorch():
    torch.manual_seed(2)
    tnet = TorchResNet()
    randomise_bn(tnet, 3)
    net = ResNet()
    net.load_state_dict(numpy_state(tnet))
    model = net.to_model(input_shape=(None, 3, 10, 10))
    reshape = next(n for n in model.graph.nodes if n.op == "Reshape")
    assert list(model.graph.initializers[reshape.inputs[1]]) == [0, -1]  # x.size(0) stays symbolic
    lr = 0.5
    model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=lr), device="cpu")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 3, 10, 10)).astype(np.float32)
    y = rng.integers(0, 5, 6).astype(np.int64)
    with torch.no_grad():
        expected = tnet.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-5, atol=1e-5)

    tnet.train()
    loss = TF.cross_entropy(tnet(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    ours_loss = model.train_on_batch(x, y)
    assert ours_loss == pytest.approx(loss.item(), rel=1e-5)
    before = numpy_state(tnet)
    grads = {k: p.grad.numpy() for k, p in tnet.named_parameters()}
    state = model.state_dict()
    for k, g in grads.items():  # one plain SGD step: p - lr * grad
        ours_grad = (before[k] - state[k]) / lr
        np.testing.assert_allclose(ours_grad, g, rtol=1e-3, atol=1e-5 * max(1.0, np.abs(g).max()), err_msg=k)
    for k in before:  # running statistics were updated as in PyTorch
        if "running" in k:
            np.testing.assert_allclose(
                state[k], tnet.state_dict()[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k
            )


# -- layers and functions one by one (inference output and one SGD step against PyTorch) ---------------
class Wrap(nn.Module):
    def __init__(self, layer: nn.Module, head: int):
        super().__init__()
        self.layer = layer
        self.head = nn.Linear(head, 3)

    def forward(self, x):
        return self.head(self.layer(x).flatten(1))


class TorchWrap(tnn.Module):
    def __init__(self, layer: tnn.Module, head: int):
        super().__init__()
        self.layer = layer
        self.head = tnn.Linear(head, 3)

    def forward(self, x):
        return self.head(self.layer(x).flatten(1))


LAYERS = {
    "maxpool": (lambda: nn.MaxPool2d(2), lambda: tnn.MaxPool2d(2), (2, 6, 6), 18),
    "maxpool_pad_stride": (
        lambda: nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
        lambda: tnn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
        (2, 6, 6),
        32,
    ),
    "avgpool": (
        lambda: nn.AvgPool2d(3, stride=2, padding=1),
        lambda: tnn.AvgPool2d(3, stride=2, padding=1),
        (2, 6, 6),
        18,
    ),
    "adaptive_2": (lambda: nn.AdaptiveAvgPool2d(2), lambda: tnn.AdaptiveAvgPool2d(2), (2, 6, 6), 8),
    "conv_groups_dilation": (
        lambda: nn.Conv2d(2, 4, 3, stride=2, padding=2, dilation=2, groups=2),
        lambda: tnn.Conv2d(2, 4, 3, stride=2, padding=2, dilation=2, groups=2),
        (2, 6, 6),
        36,
    ),
    "conv_same_even": (
        lambda: nn.Conv2d(2, 3, 4, padding="same"),
        lambda: tnn.Conv2d(2, 3, 4, padding="same"),
        (2, 5, 5),
        75,
    ),
    "conv1d": (lambda: nn.Conv1d(2, 3, 3, padding=1), lambda: tnn.Conv1d(2, 3, 3, padding=1), (2, 7), 21),
    "layernorm": (lambda: nn.LayerNorm([4, 5]), lambda: tnn.LayerNorm([4, 5]), (3, 4, 5), 60),
    "linear_3d": (lambda: nn.Linear(5, 4), lambda: tnn.Linear(5, 4), (3, 5), 12),
    "gelu": (lambda: nn.GELU(), lambda: tnn.GELU(), (4, 5), 20),
    "gelu_tanh": (lambda: nn.GELU("tanh"), lambda: tnn.GELU("tanh"), (4, 5), 20),
    "silu": (lambda: nn.SiLU(), lambda: tnn.SiLU(), (4, 5), 20),
    "leaky": (lambda: nn.LeakyReLU(0.2), lambda: tnn.LeakyReLU(0.2), (4, 5), 20),
    "sigmoid_tanh": (
        lambda: nn.Sequential(nn.Sigmoid(), nn.Tanh()),
        lambda: tnn.Sequential(tnn.Sigmoid(), tnn.Tanh()),
        (4, 5),
        20,
    ),
    "softmax": (lambda: nn.Softmax(dim=-1), lambda: tnn.Softmax(dim=-1), (4, 5), 20),
    "batchnorm1d_3d": (lambda: nn.BatchNorm1d(4), lambda: tnn.BatchNorm1d(4), (4, 5), 20),
    "flatten_identity": (
        lambda: nn.Sequential(nn.Identity(), nn.Flatten(2)),
        lambda: tnn.Sequential(tnn.Identity(), tnn.Flatten(2)),
        (2, 3, 4),
        24,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_matches_pytorch(name):
    ours_fn, theirs_fn, shape, head = LAYERS[name]
    torch.manual_seed(0)
    tnet = TorchWrap(theirs_fn(), head)
    randomise_bn(tnet, 0)
    net = Wrap(ours_fn(), head)
    net.load_state_dict(numpy_state(tnet))
    model = net.to_model(input_shape=(None,) + shape)
    model.compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.1), device="cpu")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4,) + shape).astype(np.float32)
    y = rng.standard_normal((4, 3)).astype(np.float32)
    with torch.no_grad():
        expected = tnet.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-5, atol=1e-5)
    tnet.train()
    opt = torch.optim.SGD(tnet.parameters(), lr=0.1)
    loss = TF.mse_loss(tnet(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    opt.step()
    assert model.train_on_batch(x, y) == pytest.approx(loss.item(), rel=1e-5)
    state = model.state_dict()
    for k, v in numpy_state(tnet).items():
        if k in state:
            np.testing.assert_allclose(state[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_embedding_and_tensor_ops_match_pytorch():
    class Tok(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.proj = nn.Linear(4, 2)

        def forward(self, idx):
            h = self.emb(idx)  # (N, L, 4)
            h = (h * 2 - 1) / 3 + h**2
            h = h.transpose(1, 2).permute(0, 2, 1)  # back to (N, L, 4)
            pooled = h.mean(dim=1) + h[:, 0] - h[:, -1:].sum(1)
            return self.proj(pooled).log_softmax(1)

    net = Tok()
    w = net.state_dict()
    idx = np.array([[1, 2, 3], [6, 0, 6]], np.int64)
    model = net.to_model(input_shape=(None, 3), dtype=np.int64).compile(loss="nll", device="cpu")
    t_emb = torch.from_numpy(w["emb.weight"])
    h = t_emb[torch.from_numpy(idx)]
    h = (h * 2 - 1) / 3 + h**2
    pooled = h.mean(1) + h[:, 0] - h[:, -1:].sum(1)
    expected = TF.log_softmax(
        pooled @ torch.from_numpy(w["proj.weight"]).T + torch.from_numpy(w["proj.bias"]), 1
    )
    np.testing.assert_allclose(model.predict(idx), expected.numpy(), rtol=1e-5, atol=1e-5)
    assert np.isfinite(model.train_on_batch(idx, np.array([0, 1])))  # Gather has a gradient


def test_batch_dependent_reshape_and_misuse_fail_clearly():
    class Baked(nn.Module):
        def forward(self, x):
            return x.reshape(int(x.shape[0]) * 4)  # a number computed from the batch size

    with pytest.raises(AnygradError, match="batch size"):
        Baked().to_model(input_shape=(None, 4))

    class Symbolic(nn.Module):
        def forward(self, x):
            return x.reshape(x.shape[0] * 2, -1)  # SymInt arithmetic keeps it symbolic

    model = Symbolic().to_model(input_shape=(None, 4)).compile(loss="mse", device="cpu")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(model.predict(x), x.reshape(6, 2))

    with pytest.raises(AnygradError, match="super"):

        class NoInit(nn.Module):
            def __init__(self):
                self.fc = nn.Linear(2, 2)

        NoInit()
    with pytest.raises(AnygradError, match="to_model"):
        nn.Linear(2, 2)(np.zeros((1, 2), np.float32))


def test_saved_onnx_of_a_traced_model_runs_in_onnxruntime(tmp_path):
    import onnxruntime as ort

    net = ResNet()
    model = net.to_model(input_shape=(None, 3, 10, 10)).compile(device="cpu")
    path = anygrad.save_onnx(model, tmp_path / "resnet.onnx")
    x = np.random.default_rng(0).standard_normal((2, 3, 10, 10)).astype(np.float32)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x})[0], model.predict(x), rtol=1e-5, atol=1e-5)


def test_traced_model_trains_on_wgpu_like_on_numpy():
    from wgpu_util import wgpu_backend

    backend = wgpu_backend()
    net = ResNet().init_parameters(11)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 3, 10, 10)).astype(np.float32)
    y = rng.integers(0, 5, 4).astype(np.int64)
    losses = {}
    for name, device in (("cpu", "cpu"), ("wgpu", backend)):
        model = net.to_model(input_shape=(None, 3, 10, 10))
        model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.1, momentum=0.9), device=device)
        losses[name] = [model.train_on_batch(x, y) for _ in range(2)]
    np.testing.assert_allclose(losses["wgpu"], losses["cpu"], rtol=1e-4)


@settings(max_examples=12, deadline=None)
@given(
    stride=st.integers(1, 2),
    padding=st.sampled_from([0, 1, (1, 0), "valid"]),
    dilation=st.integers(1, 2),
    groups=st.sampled_from([1, 2]),
    bias=st.booleans(),
    size=st.integers(5, 7),
)
def test_conv2d_options_match_pytorch(stride, padding, dilation, groups, bias, size):
    torch.manual_seed(0)
    theirs = tnn.Conv2d(2, 4, 3, stride=stride, padding=padding, dilation=dilation, groups=groups, bias=bias)
    ours = nn.Conv2d(2, 4, 3, stride=stride, padding=padding, dilation=dilation, groups=groups, bias=bias)
    ours.load_state_dict(numpy_state(theirs))
    x = np.random.default_rng(size).standard_normal((2, 2, size, size)).astype(np.float32)
    model = ours.to_model(input_shape=(None, 2, size, size)).compile(device="cpu")
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-5, atol=1e-5)


def test_dropout_is_active_in_training_only():
    nn.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 3))
    model = net.to_model(input_shape=(None, 8)).compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.0))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 8)).astype(np.float32), np.zeros((32, 3), np.float32)
    eval_loss = float(np.mean(model.predict(x) ** 2))
    train_losses = [model.train_on_batch(x, y) for _ in range(2)]  # lr 0: only the mask changes
    assert all(abs(t - eval_loss) > 1e-3 for t in train_losses)
    assert train_losses[0] != train_losses[1]  # a fresh mask every step
    np.testing.assert_array_equal(model.predict(x), model.predict(x))


def test_layer_norm_composition_matches_the_op(monkeypatch):
    """Without a LayerNormalization op the layer is composed from elementwise ops and reductions."""
    nn.manual_seed(1)
    net = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    rng = np.random.default_rng(2)
    x, y = (
        rng.standard_normal((4, 3, 5)).astype(np.float32),
        rng.standard_normal((4, 3, 2)).astype(np.float32),
    )
    fused = net.to_model(input_shape=(None, 3, 5)).compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.5))
    from anygrad.nn.functional import normalization
    registry_get_op = normalization.get_op
    monkeypatch.setattr(
        normalization, "get_op", lambda name: None if name == "LayerNormalization" else registry_get_op(name)
    )
    composed = net.to_model(input_shape=(None, 3, 5)).compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.5))
    assert "LayerNormalization" in fused.graph.op_histogram()
    assert "LayerNormalization" not in composed.graph.op_histogram()
    np.testing.assert_allclose(composed.predict(x), fused.predict(x), rtol=1e-5, atol=1e-6)
    assert composed.train_on_batch(x, y) == pytest.approx(fused.train_on_batch(x, y), rel=1e-5)
    a, b = composed.state_dict(), fused.state_dict()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)


# -- more layers and functions: outputs and gradients against PyTorch ------------------------------
def torch_like_gradients(ours: nn.Module, theirs: tnn.Module, x: np.ndarray, *, static: bool = False,
                         seed: int = 0, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Load theirs' state into ours by name, then compare the output and the gradients of
    sum(output * R) (R fixed, random) with respect to the input (when float) and every parameter.
    The gradients come from anygrad's autodiff over the traced graph, run on the numpy backend.
    The batch dim is traced symbolic unless `static` (a loss against constant targets)."""
    ours.load_state_dict(numpy_state(theirs))
    model = ours.to_model(input_shape=x.shape if static else (None,) + x.shape[1:], dtype=x.dtype)
    g = specialize(model.graph, {"input": x.shape})
    b = Builder(g, prefix="check")
    r = np.random.default_rng(seed).standard_normal(b.shape("output")).astype(np.float32)
    loss = b.op("ReduceSum", [b.op("Mul", ["output", b.const(r)])], keepdims=0)
    wrt = (["input"] if x.dtype.kind == "f" else []) + list(g.params)
    grads = gradients(g, loss, wrt)
    g.outputs = ["output"] + [grads[w] for w in wrt]
    got = NumpyBackend().compile(g).run({"input": x})

    tx = torch.from_numpy(x).requires_grad_(x.dtype.kind == "f")
    expected = theirs(tx)
    (expected * torch.from_numpy(r)).sum().backward()
    np.testing.assert_allclose(got["output"], expected.detach().numpy(), rtol=rtol, atol=atol, err_msg="output")
    theirs_grads = {k: p.grad for k, p in theirs.named_parameters()} | {"input": tx.grad}
    for w in wrt:
        want = theirs_grads[w]
        want = np.zeros(got[grads[w]].shape, np.float32) if want is None else want.numpy()
        np.testing.assert_allclose(got[grads[w]], want, rtol=rtol, atol=atol * max(1.0, np.abs(want).max()),
                                   err_msg=f"gradient of {w}")


class Apply(nn.Module):
    """Calls a function of x (a functional call, or a chain of layers in `layers`)."""

    def __init__(self, fn, *layers):
        super().__init__()
        self.fn = fn
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        return self.fn(x, *self.layers)


class TorchApply(tnn.Module):
    def __init__(self, fn, *layers):
        super().__init__()
        self.fn = fn
        self.layers = tnn.ModuleList(layers)

    def forward(self, x):
        return self.fn(x, *self.layers)


def layer(ours, theirs):
    """A case that applies one layer: (our module, PyTorch's)."""
    return lambda: (Apply(lambda x, m: m(x), ours()), TorchApply(lambda x, m: m(x), theirs()))


def function(ours, theirs):
    return lambda: (Apply(ours), TorchApply(theirs))


def classes(*shape, k: int = 4, ignore: bool = False) -> np.ndarray:
    t = np.random.default_rng(7).integers(0, k, shape)
    if ignore:
        t.reshape(-1)[::3] = -100  # every third sample ignored
    return t.astype(np.int64)


IMAGE = (2, 3, 6, 7)
CLASS_WEIGHT = np.array([0.5, 2.0, 1.0, 1.5], np.float32)
KEEP = np.random.default_rng(3).random((5, 5)) < 0.7  # a boolean attention mask
np.fill_diagonal(KEEP, True)  # every query keeps a key (a row of -inf only gives nan)

FUNCTIONS = {
    # activations, as layers (PyTorch's defaults and options)
    "relu6": (layer(nn.ReLU6, tnn.ReLU6), IMAGE),
    "hardswish": (layer(nn.Hardswish, tnn.Hardswish), IMAGE),
    "hardsigmoid": (layer(nn.Hardsigmoid, tnn.Hardsigmoid), IMAGE),
    "hardtanh": (layer(lambda: nn.Hardtanh(-2.0, 1.5), lambda: tnn.Hardtanh(-2.0, 1.5)), IMAGE),
    "softplus": (layer(nn.Softplus, tnn.Softplus), IMAGE),
    "softplus_beta_threshold": (layer(lambda: nn.Softplus(2.0, 3.0), lambda: tnn.Softplus(2.0, 3.0)), IMAGE),
    "prelu_one": (layer(nn.PReLU, tnn.PReLU), IMAGE),
    "prelu_channels": (layer(lambda: nn.PReLU(3, init=0.1), lambda: tnn.PReLU(3, init=0.1)), IMAGE),
    "prelu_2d": (layer(lambda: nn.PReLU(5), lambda: tnn.PReLU(5)), (4, 5)),
    "mish": (layer(nn.Mish, tnn.Mish), IMAGE),
    "selu": (layer(nn.SELU, tnn.SELU), IMAGE),
    "elu": (layer(lambda: nn.ELU(0.7), lambda: tnn.ELU(0.7)), IMAGE),
    "celu": (layer(lambda: nn.CELU(0.5), lambda: tnn.CELU(0.5)), IMAGE),
    "silu": (layer(nn.SiLU, tnn.SiLU), IMAGE),
    "gelu_tanh": (layer(lambda: nn.GELU(approximate="tanh"), lambda: tnn.GELU(approximate="tanh")), IMAGE),
    "softsign": (layer(nn.Softsign, tnn.Softsign), IMAGE),
    "logsigmoid": (layer(nn.LogSigmoid, tnn.LogSigmoid), IMAGE),
    # functional forms
    "f_activations": (function(
        lambda x: F.relu6(x) + F.hardswish(x) * F.hardsigmoid(x) - F.hardtanh(x, -0.5, 0.5) + F.softplus(x, 0.5)
        + F.mish(x) + F.selu(x) + F.elu(x, 0.3) + F.silu(x) + F.gelu(x) + F.celu(x, 2.0),
        lambda x: TF.relu6(x) + TF.hardswish(x) * TF.hardsigmoid(x) - TF.hardtanh(x, -0.5, 0.5)
        + TF.softplus(x, 0.5) + TF.mish(x) + TF.selu(x) + TF.elu(x, 0.3) + TF.silu(x) + TF.gelu(x) + TF.celu(x, 2.0),
    ), IMAGE),
    "logsigmoid_far_negative": (function(lambda x: F.logsigmoid(x * 60), lambda x: TF.logsigmoid(x * 60)), IMAGE),
    # padding and resampling
    "pad_constant_crop": (function(lambda x: F.pad(x, (1, -2, 0, 1), value=0.5),
                                   lambda x: TF.pad(x, (1, -2, 0, 1), value=0.5)), IMAGE),
    "pad_reflect": (function(lambda x: F.pad(x, (2, 1, 1, 3), mode="reflect"),
                             lambda x: TF.pad(x, (2, 1, 1, 3), mode="reflect")), IMAGE),
    "pad_replicate": (function(lambda x: F.pad(x, (2, 1, 1, 3), mode="replicate"),
                               lambda x: TF.pad(x, (2, 1, 1, 3), mode="replicate")), IMAGE),
    "pad_circular": (function(lambda x: F.pad(x, (2, 1, 1, 3), mode="circular"),
                              lambda x: TF.pad(x, (2, 1, 1, 3), mode="circular")), IMAGE),
    "nearest_scale": (function(lambda x: F.interpolate(x, scale_factor=2),
                               lambda x: TF.interpolate(x, scale_factor=2)), IMAGE),
    "nearest_size": (function(lambda x: F.interpolate(x, size=(4, 11)),
                              lambda x: TF.interpolate(x, size=(4, 11))), IMAGE),
    "nearest_exact": (function(lambda x: F.interpolate(x, size=(9, 5), mode="nearest-exact"),
                               lambda x: TF.interpolate(x, size=(9, 5), mode="nearest-exact")), IMAGE),
    "bilinear_scale": (function(lambda x: F.interpolate(x, scale_factor=(1.5, 2.0), mode="bilinear"),
                                lambda x: TF.interpolate(x, scale_factor=(1.5, 2.0), mode="bilinear")), IMAGE),
    "bilinear_align_corners": (function(
        lambda x: F.interpolate(x, size=(11, 4), mode="bilinear", align_corners=True),
        lambda x: TF.interpolate(x, size=(11, 4), mode="bilinear", align_corners=True)), IMAGE),
    "upsample_layer": (layer(lambda: nn.Upsample(size=(5, 9), mode="bilinear"),
                             lambda: tnn.Upsample(size=(5, 9), mode="bilinear")), IMAGE),
    "linear_1d": (function(lambda x: F.interpolate(x, scale_factor=3, mode="linear", recompute_scale_factor=True),
                           lambda x: TF.interpolate(x, scale_factor=3, mode="linear", recompute_scale_factor=True)),
                  (2, 3, 5)),
    # adaptive pools whose output does not divide the input (overlapping, uneven bins)
    "adaptive_avg_uneven": (layer(lambda: nn.AdaptiveAvgPool2d((4, 3)), lambda: tnn.AdaptiveAvgPool2d((4, 3))), IMAGE),
    "adaptive_max_uneven": (layer(lambda: nn.AdaptiveMaxPool2d((4, None)), lambda: tnn.AdaptiveMaxPool2d((4, None))),
                            IMAGE),
    "adaptive_max_larger": (layer(lambda: nn.AdaptiveMaxPool2d(9), lambda: tnn.AdaptiveMaxPool2d(9)), IMAGE),
    "adaptive_max_global": (layer(lambda: nn.AdaptiveMaxPool2d(1), lambda: tnn.AdaptiveMaxPool2d(1)), IMAGE),
    "adaptive_1d": (layer(lambda: nn.AdaptiveAvgPool1d(3), lambda: tnn.AdaptiveAvgPool1d(3)), (2, 3, 7)),
    # batch statistics always (training and inference alike)
    "batchnorm_no_running_stats": (layer(lambda: nn.BatchNorm2d(3, track_running_stats=False),
                                         lambda: tnn.BatchNorm2d(3, track_running_stats=False)), IMAGE),
    "batchnorm1d_no_running_stats": (layer(lambda: nn.BatchNorm1d(5, affine=False, track_running_stats=False),
                                           lambda: tnn.BatchNorm1d(5, affine=False, track_running_stats=False)),
                                     (4, 5)),
    # losses inside forward (a scalar output; constant targets, so the batch is static)
    "cross_entropy": (function(lambda x: F.cross_entropy(x, classes(2, 6, 7)),
                               lambda x: TF.cross_entropy(x, torch.from_numpy(classes(2, 6, 7)))), (2, 4, 6, 7)),
    "cross_entropy_weight_ignore": (function(
        lambda x: F.cross_entropy(x, classes(6, ignore=True), weight=CLASS_WEIGHT),
        lambda x: TF.cross_entropy(x, torch.from_numpy(classes(6, ignore=True)), torch.from_numpy(CLASS_WEIGHT)),
    ), (6, 4)),
    "cross_entropy_probabilities": (function(
        lambda x: F.cross_entropy(x, F.softmax(x * 0.5, 1), reduction="sum"),
        lambda x: TF.cross_entropy(x, torch.softmax(x * 0.5, 1), reduction="sum")), (6, 4)),
    "nll_loss_none": (function(lambda x: F.nll_loss(F.log_softmax(x, 1), classes(6), reduction="none"),
                               lambda x: TF.nll_loss(TF.log_softmax(x, 1), torch.from_numpy(classes(6)),
                                                     reduction="none")), (6, 4)),
    "mse_l1": (function(lambda x: F.mse_loss(x, x[:1] * 0.5) + F.l1_loss(x, np.float32(0.25), reduction="sum"),
                        lambda x: TF.mse_loss(x, (x[:1] * 0.5).expand_as(x))
                        + TF.l1_loss(x, torch.full_like(x, 0.25), reduction="sum")), (3, 4)),
    "bce_with_logits": (function(
        lambda x: F.binary_cross_entropy_with_logits(x * 30, F.sigmoid(x[:, :1]) * np.ones(4, np.float32),
                                                     weight=CLASS_WEIGHT, pos_weight=CLASS_WEIGHT[::-1].copy()),
        lambda x: TF.binary_cross_entropy_with_logits(x * 30, torch.sigmoid(x[:, :1]).expand(-1, 4),
                                                      weight=torch.from_numpy(CLASS_WEIGHT),
                                                      pos_weight=torch.from_numpy(CLASS_WEIGHT[::-1].copy()))),
        (3, 4)),
    # attention: (N, heads, L, E) from one input
    "sdpa_causal": (function(lambda x: F.scaled_dot_product_attention(x, x * 0.5, x - 1, is_causal=True),
                             lambda x: TF.scaled_dot_product_attention(x, x * 0.5, x - 1, is_causal=True)),
                    (2, 2, 5, 4)),
    "sdpa_bool_mask_scale": (function(
        lambda x: F.scaled_dot_product_attention(x, x * 0.5, x - 1, attn_mask=KEEP, scale=0.3),
        lambda x: TF.scaled_dot_product_attention(x, x * 0.5, x - 1, attn_mask=torch.from_numpy(KEEP), scale=0.3)),
        (2, 2, 5, 4)),
    "sdpa_float_mask": (function(
        lambda x: F.scaled_dot_product_attention(x, x, x, attn_mask=np.where(KEEP, 0.5, -2.0).astype(np.float32)),
        lambda x: TF.scaled_dot_product_attention(
            x, x, x, attn_mask=torch.from_numpy(np.where(KEEP, 0.5, -2.0).astype(np.float32)))), (2, 2, 5, 4)),
}


LOSSES = ("cross_entropy", "nll_loss", "mse_l1", "bce")


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function_outputs_and_gradients_match_pytorch(name):
    make, shape = FUNCTIONS[name]
    torch.manual_seed(0)
    ours, theirs = make()
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    static = name.startswith(LOSSES)
    torch_like_gradients(ours, theirs, x, static=static)


def test_embedding_padding_row_gets_no_gradient_as_in_pytorch():
    torch.manual_seed(0)
    for padding_idx in (0, -2):  # negative: counted from the end, as in PyTorch
        theirs = tnn.Embedding(7, 4, padding_idx=padding_idx)
        ours = nn.Embedding(7, 4, padding_idx=padding_idx)
        assert ours.padding_idx == theirs.padding_idx and not ours.weight.data[theirs.padding_idx].any()
        idx = np.array([[1, 0, 5, 5], [0, 0, 6, 2]], np.int64)
        torch_like_gradients(Apply(lambda x, m: m(x), ours), TorchApply(lambda x, m: m(x), theirs), idx)
    # a padding row that is not zero cannot be expressed: refused, naming the option
    ours.weight.data[5] = 1.0
    with pytest.raises(AnygradError, match="padding_idx"):
        ours.to_model(input_shape=(None, 4), dtype=np.int64)


class InvertedResidual(nn.Module):
    """MobileNetV2/V3 block: expand (1x1, BN, ReLU6), depthwise (3x3, BN, Hardswish), squeeze-excite
    (Hardsigmoid gate), project (1x1, BN), residual."""

    def __init__(self, c: int, expand: int):
        super().__init__()
        hidden = c * expand
        self.expand = nn.Sequential(nn.Conv2d(c, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True))
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
                                       nn.BatchNorm2d(hidden), nn.Hardswish())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(hidden, 4, 1), nn.ReLU(), nn.Conv2d(4, hidden, 1),
                                nn.Hardsigmoid())
        self.project = nn.Sequential(nn.Conv2d(hidden, c, 1, bias=False), nn.BatchNorm2d(c))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d((2, 3)), nn.Flatten(), nn.Linear(c * 6, 5))

    def forward(self, x):
        h = self.depthwise(self.expand(x))
        return self.head(x + self.project(h * self.se(h)))


class TorchInvertedResidual(tnn.Module):
    def __init__(self, c: int, expand: int):
        super().__init__()
        hidden = c * expand
        self.expand = tnn.Sequential(tnn.Conv2d(c, hidden, 1, bias=False), tnn.BatchNorm2d(hidden),
                                     tnn.ReLU6(inplace=True))
        self.depthwise = tnn.Sequential(tnn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
                                        tnn.BatchNorm2d(hidden), tnn.Hardswish())
        self.se = tnn.Sequential(tnn.AdaptiveAvgPool2d(1), tnn.Conv2d(hidden, 4, 1), tnn.ReLU(),
                                 tnn.Conv2d(4, hidden, 1), tnn.Hardsigmoid())
        self.project = tnn.Sequential(tnn.Conv2d(hidden, c, 1, bias=False), tnn.BatchNorm2d(c))
        self.head = tnn.Sequential(tnn.AdaptiveAvgPool2d((2, 3)), tnn.Flatten(), tnn.Linear(c * 6, 5))

    def forward(self, x):
        h = self.depthwise(self.expand(x))
        return self.head(x + self.project(h * self.se(h)))


def test_mobilenet_block_loads_a_torch_state_dict_and_trains_like_pytorch(tmp_path):
    torch.manual_seed(4)
    tnet = TorchInvertedResidual(4, 3)
    randomise_bn(tnet, 5)
    torch.save(tnet.state_dict(), tmp_path / "block.pt")
    net = InvertedResidual(4, 3)
    assert list(net.state_dict()) == list(tnet.state_dict())
    net.load_state_dict(tmp_path / "block.pt")  # by PyTorch's names, read without torch
    model = net.to_model(input_shape=(None, 4, 7, 7))
    ops = model.graph.op_histogram()
    assert ops["Clip"] == 1 and ops["HardSwish"] == 1 and ops["HardSigmoid"] == 1
    x = np.random.default_rng(6).standard_normal((6, 4, 7, 7)).astype(np.float32) * 2
    y = np.random.default_rng(7).integers(0, 5, 6).astype(np.int64)
    model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.2), device="cpu")
    with torch.no_grad():
        expected = tnet.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-5, atol=1e-5)
    tnet.train()  # one SGD step on batch statistics, then every parameter and running statistic
    opt = torch.optim.SGD(tnet.parameters(), lr=0.2)
    loss = TF.cross_entropy(tnet(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    opt.step()
    assert model.train_on_batch(x, y) == pytest.approx(loss.item(), rel=1e-5)
    state = model.state_dict()
    for k, v in numpy_state(tnet).items():
        if not k.endswith("num_batches_tracked"):
            np.testing.assert_allclose(state[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_batchnorm_without_running_stats_has_pytorchs_state_and_uses_batch_statistics():
    ours, theirs = nn.BatchNorm2d(3, track_running_stats=False), tnn.BatchNorm2d(3, track_running_stats=False)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight", "bias"]
    model = ours.to_model(input_shape=(None, 3, 4, 4)).compile(loss="mse", device="cpu")
    x = np.random.default_rng(0).standard_normal((5, 3, 4, 4)).astype(np.float32) * 3 + 1
    with torch.no_grad():  # eval mode: still the batch's statistics
        np.testing.assert_allclose(model.predict(x), theirs.eval()(torch.from_numpy(x)).numpy(), rtol=1e-5,
                                   atol=1e-5)


MISUSE = {
    "BatchNorm2d momentum=None": (lambda: nn.BatchNorm2d(3, momentum=None), "momentum=None"),
    "Embedding max_norm": (lambda: nn.Embedding(5, 2, max_norm=1.0), "max_norm"),
    "AdaptiveMaxPool2d indices": (lambda: nn.AdaptiveMaxPool2d(2, return_indices=True), "return_indices"),
    "interpolate align_corners": (lambda: Apply(lambda x: F.interpolate(x, scale_factor=2, align_corners=True)),
                                  "align_corners"),
    "interpolate both sizes": (lambda: Apply(lambda x: F.interpolate(x, size=4, scale_factor=2)), "exactly one"),
    "interpolate float32 size": (  # 7 * (31 / 7) is 31 in double, 30 in float32
        lambda: Apply(lambda x: F.interpolate(F.pad(x, (1, 1, 1, 1)), scale_factor=31 / 7)), "recompute_scale"),
    "pad mode": (lambda: Apply(lambda x: F.pad(x, (1, 1), mode="mirror")), "mode 'mirror'"),
    "pad odd": (lambda: Apply(lambda x: F.pad(x, (1, 1, 1))), "pairs"),
    "sdpa causal and mask": (lambda: Apply(lambda x: F.scaled_dot_product_attention(x, x, x, KEEP, is_causal=True)),
                             "not both"),
    "cross_entropy label_smoothing": (lambda: Apply(lambda x: F.cross_entropy(x, np.zeros(3, np.int64),
                                                                             label_smoothing=0.1)),
                                      "label_smoothing"),
    "adaptive pool symbolic": (lambda: Apply(lambda x: F.adaptive_avg_pool2d(x.reshape(3, 1, 3, -1), 2)),
                               "symbolic"),
    "prelu slopes": (lambda: nn.PReLU(4), "slopes"),
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_unsupported_options_fail_naming_the_option(case):
    make, message = MISUSE[case]
    with pytest.raises(AnygradError, match=message):
        make().to_model(input_shape=(3, 3, 5, 5) if "symbolic" not in case else (None, 3, 5, 3))


class Everything(nn.Module):
    """The new layers and functions in one model, for the ONNX round trip."""

    def __init__(self):
        super().__init__()
        self.block = InvertedResidual(3, 2)
        self.prelu = nn.PReLU(3)
        self.norm = nn.BatchNorm2d(3, track_running_stats=False)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)

    def forward(self, x):  # (N, 3, 5, 5)
        h = self.norm(self.prelu(F.pad(x, (1, 1, 0, 2), mode="reflect")))  # (N, 3, 7, 7)
        h = F.interpolate(self.up(h), size=(5, 5)) + F.mish(x) + F.softplus(x, 2.0, 1.0) + F.logsigmoid(x)
        h = F.adaptive_max_pool2d(F.selu(h), (3, 4)) + F.celu(F.softsign(x[:, :, :3, :4]))
        att = F.scaled_dot_product_attention(h, h, h, attn_mask=KEEP[:3, :3]) + F.scaled_dot_product_attention(
            h, h, h, is_causal=True)
        return F.log_softmax(self.block(att), dim=1)  # (N, 3, 3, 4) through the whole block


def test_saved_onnx_with_the_new_functions_runs_in_onnxruntime(tmp_path):
    import onnxruntime as ort

    nn.manual_seed(2)
    model = Everything().to_model(input_shape=(None, 3, 5, 5)).compile(device="cpu")
    ops = model.graph.op_histogram()  # the MobileNet block's operators reach onnxruntime too
    assert all(ops[op] for op in ("Clip", "HardSwish", "HardSigmoid", "Conv", "BatchNormalization",
                                  "GlobalAveragePool"))
    path = anygrad.save_onnx(model, tmp_path / "everything.onnx")
    x = np.random.default_rng(0).standard_normal((3, 3, 5, 5)).astype(np.float32)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"input": x})[0], model.predict(x), rtol=1e-5, atol=1e-5)
