"""Optimizers vs torch.optim (float32, single-tensor path): parameters after every step agree."""
import inspect
import zlib

import numpy as np
import pytest
import torch

from anygrad import Model
from anygrad.errors import ConfigError
from anygrad.ir import Graph, Node, TensorInfo
from anygrad.losses import Loss
from anygrad.optim import OPTIMIZERS, SGD, Adam, get_optimizer
from anygrad.program import build_train_step

F32 = np.dtype(np.float32)
STEPS = 20

TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
         "adagrad": torch.optim.Adagrad, "adadelta": torch.optim.Adadelta, "rmsprop": torch.optim.RMSprop}

CASES = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    ("sgd", {"lr": 0.1, "weight_decay": 0.01, "maximize": True}),
    ("adam", {}),
    ("adam", {"lr": 0.1, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("adam", {"lr": 0.1, "weight_decay": 0.1}),
    ("adam", {"lr": 0.1, "amsgrad": True, "weight_decay": 0.05}),
    ("adam", {"lr": 0.05, "maximize": True}),
    ("adamw", {}),
    ("adamw", {"lr": 0.1, "weight_decay": 0.1}),
    ("adamw", {"lr": 0.1, "amsgrad": True}),
    ("adamw", {"lr": 0.05, "betas": (0.7, 0.95), "eps": 1e-3, "weight_decay": 0.05}),
    ("adamw", {"lr": 0.05, "maximize": True}),
    ("adamw", {"lr": 0.05, "maximize": True, "amsgrad": True, "weight_decay": 0.1}),
    ("adagrad", {}),
    ("adagrad", {"lr": 0.1, "lr_decay": 0.1}),
    ("adagrad", {"lr": 0.1, "weight_decay": 0.1, "initial_accumulator_value": 0.5, "eps": 1e-6}),
    ("adagrad", {"lr": 0.1, "maximize": True}),
    ("adagrad", {"lr": 0.1, "maximize": True, "weight_decay": 0.1, "lr_decay": 0.05}),
    ("adadelta", {}),
    ("adadelta", {"lr": 0.5, "rho": 0.5, "eps": 1e-4}),
    ("adadelta", {"weight_decay": 0.1, "maximize": True}),
    ("rmsprop", {}),
    ("rmsprop", {"lr": 0.01, "centered": True}),
    ("rmsprop", {"lr": 0.01, "momentum": 0.9}),
    ("rmsprop", {"lr": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.1, "alpha": 0.9}),
    ("rmsprop", {"lr": 0.01, "eps": 0.1}),
    ("rmsprop", {"lr": 0.01, "eps": 1e-3, "centered": True, "momentum": 0.9}),
    ("rmsprop", {"lr": 0.01, "maximize": True}),
    ("rmsprop", {"lr": 0.01, "maximize": True, "centered": True, "momentum": 0.5, "weight_decay": 0.1}),
]


def sum_loss() -> Loss:
    """loss = sum(model output); with output p * g, the gradient of p is exactly the input g."""
    return Loss("sum", lambda b, out, target: b.op("ReduceSum", [out], keepdims=0))


def probe_model(p0: np.ndarray) -> Model:
    g = Graph(inputs=["g"], outputs=["y"], name="probe")
    g.initializers = {"p": p0.copy()}
    g.params = ["p"]
    g.info["g"] = TensorInfo(F32, p0.shape)
    g.nodes = [Node("Mul", ["p", "g"], ["y"])]
    return Model(g)


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    # 1e-6 of the tensor's scale: float32 rounding (PyTorch fuses multiply-adds) adds up over steps.
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()), err_msg=what)


def trajectories(name: str, kwargs: dict, lr_at: dict | None = None):
    """Run anygrad and torch side by side for STEPS steps with the same gradients."""
    rng = np.random.default_rng(zlib.crc32(repr((name, sorted(kwargs.items()))).encode()))
    p0 = rng.standard_normal((3, 5)).astype(np.float32)
    grads = [rng.standard_normal(p0.shape).astype(np.float32) for _ in range(STEPS)]
    model = probe_model(p0).compile(loss=sum_loss(), optimizer=get_optimizer(name, **kwargs), device="cpu")
    p = torch.tensor(p0, requires_grad=True)
    opt = TORCH[name]([p], foreach=False, **kwargs)
    for k, grad in enumerate(grads):
        if lr_at and k in lr_at:
            model.lr = lr_at[k]
            for group in opt.param_groups:
                group["lr"] = lr_at[k]
        model.train_step(grad, np.zeros_like(grad))
        p.grad = torch.tensor(grad)
        opt.step()
        yield k, model.state_dict()["p"], p.detach().numpy()


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{'-'.join(map(str, k.items()))}" for n, k in CASES])
def test_matches_torch(name, kwargs):
    for k, ours, ref in trajectories(name, kwargs):
        assert_close(ours, ref, f"{name} {kwargs} step {k + 1}")


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad"])
def test_lr_change_without_recompile(name):
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "sgd" else {"lr": 0.1}
    for k, ours, ref in trajectories(name, kwargs, lr_at={5: 0.03, 12: 0.3}):
        assert_close(ours, ref, f"{name} step {k + 1}")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_defaults_are_torch_defaults(name):
    ours = OPTIMIZERS[name]()
    params = inspect.signature(TORCH[name].__init__).parameters
    for field, value in ours.config().items():
        if field == "name":
            continue
        default = params[field].default
        assert value == (tuple(default) if isinstance(default, tuple) else default), (name, field)


def test_one_update_op_per_parameter():
    rng = np.random.default_rng(0)
    g = Graph(inputs=["x"], outputs=["y"])
    g.initializers = {"W": rng.standard_normal((4, 3)).astype(np.float32), "b": np.zeros(4, np.float32)}
    g.params = ["W", "b"]
    g.info["x"] = TensorInfo(F32, ("N", 3))
    g.nodes = [Node("Gemm", ["x", "W", "b"], ["y"], {"transB": 1})]
    from anygrad.losses import get_loss
    step = build_train_step(g, {"x": (2, 3)}, (2, 4), get_loss("mse"), Adam(amsgrad=True))
    hist = step.op_histogram()
    assert hist["AdamUpdate"] == 2
    assert {v for v in step.state_updates.values() if v.startswith("optim.")} == {
        f"optim.{s}.{p}" for s in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") for p in ("W", "b")}


def test_config_errors():
    with pytest.raises(ConfigError, match="unknown optimizer"):
        get_optimizer("lbfgs")
    with pytest.raises(ConfigError, match="momentum_x"):
        get_optimizer("sgd", momentum_x=0.9)
    with pytest.raises(ConfigError, match="nesterov"):
        SGD(lr=0.1, nesterov=True)
    with pytest.raises(ConfigError, match="lr"):
        get_optimizer("adam", lr=-1.0)
    with pytest.raises(ConfigError, match="betas"):
        Adam(betas=(0.9, 1.0))
    assert get_optimizer("AdamW").config() == {"name": "adamw", "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                               "weight_decay": 1e-2, "amsgrad": False, "maximize": False}


@pytest.mark.parametrize("name,kwargs", [("sgd", {"lr": 0.1, "momentum": 0.9}), ("adam", {"lr": 0.01}),
                                         ("rmsprop", {"lr": 0.01, "centered": True})])
def test_linear_model_through_model_matches_torch(name, kwargs):
    """The real program path: Gemm model, mse loss, train_on_batch, vs torch.nn.Linear."""
    rng = np.random.default_rng(1)
    lin = torch.nn.Linear(3, 2)
    g = Graph(inputs=["x"], outputs=["y"], name="linear")
    g.initializers = {"W": lin.weight.detach().numpy().copy(), "b": lin.bias.detach().numpy().copy()}
    g.params = ["W", "b"]
    g.info["x"] = TensorInfo(F32, ("N", 3))
    g.nodes = [Node("Gemm", ["x", "W", "b"], ["y"], {"transB": 1})]
    model = Model(g).compile(loss="mse", optimizer=get_optimizer(name, **kwargs), device="cpu")
    opt = TORCH[name](lin.parameters(), foreach=False, **kwargs)
    for k in range(5):
        x = rng.standard_normal((8, 3)).astype(np.float32)
        y = rng.standard_normal((8, 2)).astype(np.float32)
        loss = model.train_on_batch(x, y)
        opt.zero_grad()
        ref = torch.nn.functional.mse_loss(lin(torch.tensor(x)), torch.tensor(y))
        ref.backward()
        opt.step()
        assert loss == pytest.approx(ref.item(), rel=1e-5)
        state = model.state_dict()
        np.testing.assert_allclose(state["W"], lin.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["b"], lin.bias.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert model.read_metrics()["count"] == 40


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_hyperparameter_is_refused_by_name(value):
    from anygrad.errors import ConfigError
    from anygrad.optim import SGD, AdamW
    with pytest.raises(ConfigError, match="adamw: lr must be a finite number"):
        AdamW(lr=value)
    with pytest.raises(ConfigError, match="sgd: momentum must be a finite number"):
        SGD(lr=0.1, momentum=value)
