"""Optimizer updates over several steps: wgpu vs the numpy backend vs torch.optim, and why whole
founding-model runs with Adam differ between the backends from the second step on.

Given the same gradients, every update kernel agrees with numpy to float32 rounding, and numpy
with torch.optim (the probe model below makes the gradient an input, exactly).

On the founding MNIST model some true gradients are exactly 0 because of BatchNorm's invariance to
a per-feature shift: fc2.bias (it feeds norm2), and, for an fc1 unit that is active and kept by
Dropout on every sample of the batch, that unit's fc1.bias and its fc1.weight entries whose input
(norm1's output) is the same on every sample (a ReLU dead on the whole batch). Computed in float32
they are rounding noise (1e-9 to 5e-7 here), of the order of Adam's eps = 1e-8, and Adam's first
step moves each by lr * g / (|g| + eps): a sizeable fraction of lr, its sign set by the noise and
the same for a whole row, so a unit's pre-activation shifts coherently (by +0.42 on numpy, -0.09 on
wgpu, 0 in exact arithmetic, on the batch below). The next step's new Dropout mask turns that
batch-constant shift, which norm2 had cancelled, into a loss change (0.5% here; fc2.bias's noisy
moves change only norm2's running mean, not the training loss). Neither backend is wrong: with the
noise-decided moves undone both give PyTorch float64's second loss. So these runs are compared by
transplanting state and undoing those moves, which the test checks tightly.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from wgpu_util import wgpu_backend

import anygrad
from anygrad import Model
from anygrad.backends import NumpyBackend
from anygrad.examples import FOUNDING_MODEL
from anygrad.ir import Graph, Node, TensorInfo
from anygrad.losses import Loss
from anygrad.optim import get_optimizer

STEPS = 3
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
         "adagrad": torch.optim.Adagrad, "adadelta": torch.optim.Adadelta, "rmsprop": torch.optim.RMSprop}
VARIANTS = [
    ("sgd", {"lr": 0.01}), ("sgd", {"lr": 0.01, "momentum": 0.9}),
    ("sgd", {"lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.01, "momentum": 0.9, "dampening": 0.1, "maximize": True}),
    ("adam", {"lr": 0.01}), ("adam", {"lr": 0.01, "amsgrad": True}),
    ("adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    ("adamw", {"lr": 0.01}), ("adamw", {"lr": 0.01, "amsgrad": True}),
    ("adagrad", {"lr": 0.01, "lr_decay": 0.01, "weight_decay": 0.1}),
    ("adadelta", {"lr": 1.0, "weight_decay": 0.1}),
    ("rmsprop", {"lr": 0.01}), ("rmsprop", {"lr": 0.01, "momentum": 0.9, "centered": True}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in VARIANTS]


def _probe(p0: np.ndarray) -> tuple[Model, Loss]:
    """y = p * g with loss sum(y): the gradient of p is exactly the input g, on every backend."""
    g = Graph(inputs=["g"], outputs=["y"], name="probe")
    g.initializers = {"p": p0.copy()}
    g.params = ["p"]
    g.info["g"] = TensorInfo(np.dtype(np.float32), p0.shape)
    g.nodes = [Node("Mul", ["p", "g"], ["y"])]
    model = Model(g)
    loss = Loss("sum", lambda b, out, target: b.op("ReduceSum", [out], keepdims=0))
    return model, loss


def _gradients(seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal((6, 5)).astype(np.float32)
    grads = [rng.standard_normal(p0.shape).astype(np.float32) for _ in range(STEPS)]
    for g in grads:
        g[0] *= np.float32(1e-9)  # below Adam's eps: where g / (sqrt(v) + eps) is most sensitive
        g[1, :2] = 0.0
    return p0, grads


def _run(device, name: str, kwargs: dict, p0: np.ndarray, grads: list[np.ndarray]) -> list[dict]:
    """The parameter and optimizer slots (full_state's `optim.*`) after each step."""
    model, loss = _probe(p0)
    model.compile(loss=loss, optimizer=get_optimizer(name, **kwargs), device=device)
    out = []
    for g in grads:
        model.train_step(g, np.zeros_like(g))
        state = model.full_state()
        out.append({k: v for k, v in state.items() if k == "p" or k.startswith("optim.")})
    return out


@pytest.mark.wgpu
@pytest.mark.parametrize("name,kwargs", VARIANTS, ids=IDS)
def test_update_kernels_match_numpy_over_steps(name, kwargs):
    p0, grads = _gradients(len(name) * 31 + len(kwargs))
    wgpu = _run(wgpu_backend(), name, kwargs, p0, grads)
    ref = _run(NumpyBackend(), name, kwargs, p0, grads)
    for step, (w, n) in enumerate(zip(wgpu, ref), 1):
        assert sorted(w) == sorted(n)
        for key in n:
            # float32 rounding: WGSL's exp/log/sqrt/division against numpy's, a few ulps per step
            scale = float(np.abs(n[key]).max()) or 1.0
            np.testing.assert_allclose(w[key], n[key], rtol=2e-6, atol=2e-7 * scale,
                                       err_msg=f"{name} {kwargs} step {step}: {key}")


@pytest.mark.parametrize("name,kwargs", VARIANTS, ids=IDS)
def test_numpy_updates_match_torch_optim(name, kwargs):
    p0, grads = _gradients(len(name) * 31 + len(kwargs))
    ours = _run(NumpyBackend(), name, kwargs, p0, grads)
    p = torch.tensor(p0, requires_grad=True)
    opt = TORCH[name]([p], foreach=False, **kwargs)
    for step, (g, state) in enumerate(zip(grads, ours), 1):
        p.grad = torch.tensor(g)
        opt.step()
        ref = p.detach().numpy()
        np.testing.assert_allclose(state["p"], ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()),
                                   err_msg=f"{name} {kwargs} step {step}")
        slots = opt.state[p]
        for key, value in state.items():
            slot = key.split(".")[1] if key.startswith("optim.") else None
            if slot in slots:
                want = slots[slot].numpy()
                np.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()),
                                           err_msg=f"{name} {kwargs} step {step}: {slot}")


# -- the founding model ------------------------------------------------------------------------------
SLOTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _founding(device):
    model = anygrad.load_onnx(FOUNDING_MODEL)
    model.compile(loss="nll", optimizer=get_optimizer("adam", lr=1e-3, amsgrad=True), device=device)
    return model


@pytest.mark.wgpu
def test_founding_model_adam_differs_only_by_noise_decided_first_moves():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 4)
    cpu, gpu = _founding(NumpyBackend()), _founding(wgpu_backend())
    initial = cpu.state_dict()
    loss1 = [cpu.train_on_batch(x, y), gpu.train_on_batch(x, y)]
    np.testing.assert_allclose(loss1[1], loss1[0], rtol=1e-6)
    s_cpu, s_gpu = cpu.full_state(), gpu.full_state()

    # Step 1: gradients (exp_avg = 0.1 g) agree to float32 noise; parameters agree to rounding
    # except where both gradients are below that noise, i.e. where the true gradient is 0.
    grads = {p: [s[f"optim.exp_avg.{p}"].astype(np.float64) * 10 for s in (s_cpu, s_gpu)] for p in cpu.param_names}
    # the backward's float32 noise: some 1e-6 of the largest gradient (4.1, fc1.weight's) vs float64
    noise = 1e-5 * max(np.abs(g[0]).max() for g in grads.values())
    decided = {}
    for p, (g_cpu, g_gpu) in grads.items():
        np.testing.assert_allclose(g_gpu, g_cpu, rtol=0, atol=noise, err_msg=f"gradient of {p}")
        decided[p] = (np.abs(g_cpu) < noise) & (np.abs(g_gpu) < noise)
        keep = ~decided[p]
        np.testing.assert_allclose(s_gpu[p][keep], s_cpu[p][keep], rtol=0, atol=1e-7, err_msg=p)
    # fc2.bias feeds norm2 in training mode: its true gradient is 0 on any batch
    assert decided["fc2.bias"].all()

    # Step 2 from the same state: the same loss (the step itself agrees; only state differed).
    loss2_cpu = cpu.train_on_batch(x, y)
    gpu.load_full_state(s_cpu)
    np.testing.assert_allclose(gpu.train_on_batch(x, y), loss2_cpu, rtol=1e-5)

    # Step 2 with the noise-decided moves undone (what exact arithmetic gives: g = 0, no move)
    # on each backend's own state: the backends agree again.
    def undone(state: dict) -> dict:
        state = {k: v.copy() for k, v in state.items()}
        for p, mask in decided.items():
            state[p][mask] = initial[p][mask]
            for slot in SLOTS:
                state[f"optim.{slot}.{p}"][mask] = 0.0
        return state
    cpu.load_full_state(undone(s_cpu))
    gpu.load_full_state(undone(s_gpu))
    np.testing.assert_allclose(gpu.train_on_batch(x, y), cpu.train_on_batch(x, y), rtol=1e-5)
