"""Whole training steps of the founding MNIST convnet on wgpu against the numpy backend: same seed,
Dropout on, BatchNorm in training mode; losses, metrics, parameters and running statistics agree."""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import wgpu_backend

import anygrad
from anygrad import optim
from anygrad.backends import NumpyBackend
from anygrad.examples import FOUNDING_MODEL
from anygrad.optim import SGD

pytestmark = pytest.mark.wgpu
BATCH = 8


def _batches(steps: int):
    rng = np.random.default_rng(0)
    for _ in range(steps):
        yield (rng.standard_normal((BATCH, 1, 28, 28)).astype(np.float32),
               rng.integers(0, 10, BATCH).astype(np.int64))


def _train(backend, optimizer, steps: int, loss: str = "nll"):
    model = anygrad.load_onnx(str(FOUNDING_MODEL))
    model.compile(loss=loss, optimizer=optimizer, device=backend, seed=7)
    losses = [model.train_on_batch(x, y) for x, y in _batches(steps)]
    return model, losses


# Adaptive optimizers (Adam, RMSprop, ...) are compared op by op in test_wgpu_ops.py: on this model
# fc2.bias feeds a BatchNorm, so its true gradient is 0 and its float noise, normalised by Adam,
# decides the update's sign on each backend differently.
@pytest.mark.parametrize("optimizer,loss", [
    (lambda: SGD(lr=0.05, momentum=0.9), "nll"),
    (lambda: SGD(lr=0.02, momentum=0.5, nesterov=True, weight_decay=1e-3), "cross_entropy")])
def test_mnist_steps_match_numpy(optimizer, loss):
    wb = wgpu_backend()
    steps = 5 if loss == "nll" else 3
    mw, lw = _train(wb, optimizer(), steps, loss)
    mn, ln = _train(NumpyBackend(), optimizer(), steps, loss)
    np.testing.assert_allclose(lw, ln, rtol=1e-4, atol=1e-4)
    sw, sn = mw.state_dict(), mn.state_dict()
    assert set(sw) == set(sn)
    for name in sn:
        np.testing.assert_allclose(sw[name], sn[name], rtol=1e-4, atol=1e-4, err_msg=name)
    assert mw.read_metrics() == pytest.approx(mn.read_metrics(), rel=1e-5)
    # The RNG counter advanced identically (dropout masks of later steps stay in sync).
    np.testing.assert_array_equal(wb.get_state("anygrad.rng"), mn.backend.get_state("anygrad.rng"))
    # Inference mode (running statistics, no dropout) and the eval step.
    x, y = next(_batches(1))
    np.testing.assert_allclose(mw.predict(x), mn.predict(x), rtol=1e-4, atol=1e-4)
    assert mw.evaluate(x, y) == pytest.approx(mn.evaluate(x, y), rel=1e-4, abs=1e-5)


def test_training_step_is_few_kernels_and_in_place():
    wb = wgpu_backend()
    model, _ = _train(wb, SGD(lr=0.01, momentum=0.9), 1)
    (exe,) = [e for k, e in model._programs.items() if k[0] == "train"]
    from anygrad.backends.wgpu.kernels.kernels_elementwise import is_elementwise
    ew_nodes = sum(is_elementwise(n, exe.graph) for n in exe.graph.nodes)
    ew_kernels = sum(st.kernel.name.startswith("ew:") for st in exe.plan.steps)
    assert ew_kernels < ew_nodes
    # Conv/Gemm -> Relu: the activation runs in the GEMM's epilogue.
    assert not any(n.op == "Relu" for n in exe.prepared.nodes)
    # Every parameter, slot and running statistic is updated in its own buffer: no copies, and the
    # optimizer step is one dispatch over the parameter arena.
    assert not exe.plan.state_copies
    updates = [st.kernel.name for st in exe.plan.steps if "SGDUpdate" in st.kernel.name]
    assert updates == [f"ew:SGDUpdatex{len(model.param_names)}"]
    assert exe.plan.arenas and set(exe.plan.arenas[0].members) == set(model.param_names)
    # Inference: Dropout is the identity, planned as an alias (no kernel).
    model.predict(next(_batches(1))[0])
    (pred,) = [e for k, e in model._programs.items() if k[0] == "predict"]
    assert not any("Dropout" in st.kernel.name for st in pred.plan.steps)
    # Parameters packed into the arena still read and write one by one.
    w = wb.get_state("fc2.weight")
    wb.set_state("fc2.weight", w * 2)
    np.testing.assert_array_equal(wb.get_state("fc2.weight"), w * 2)
    np.testing.assert_array_equal(wb.get_state("fc2.bias"), model.state_dict()["fc2.bias"])


def _mlp() -> anygrad.Model:
    """x (N, 6) -> Gemm -> Tanh -> Gemm -> logits (N, 4): no BatchNorm, so every gradient is
    well conditioned and adaptive optimizers can be compared step by step."""
    from anygrad.ir import Graph, Node, TensorInfo
    rng = np.random.default_rng(3)
    g = Graph(inputs=["x"], outputs=["y"], name="mlp")
    g.info["x"] = TensorInfo(np.dtype(np.float32), ("N", 6))
    g.initializers = {"w1": rng.standard_normal((5, 6)).astype(np.float32) * 0.5,
                      "b1": rng.standard_normal(5).astype(np.float32) * 0.1,
                      "w2": rng.standard_normal((4, 5)).astype(np.float32) * 0.5,
                      "b2": np.zeros(4, np.float32)}
    g.params = ["w1", "b1", "w2", "b2"]
    g.nodes = [Node("Gemm", ["x", "w1", "b1"], ["h"], {"transB": 1}), Node("Tanh", ["h"], ["t"]),
               Node("Gemm", ["t", "w2", "b2"], ["y"], {"transB": 1})]
    return anygrad.Model(g)


@pytest.mark.parametrize("name,kwargs", [("Adam", {"weight_decay": 0.01, "amsgrad": True}), ("AdamW", {}),
                                         ("RMSprop", {"momentum": 0.9, "centered": True}),
                                         ("Adagrad", {"lr_decay": 0.1}), ("Adadelta", {"lr": 1.0})])
def test_adaptive_optimizers_fused_update(name, kwargs):
    from anygrad import optim
    wb = wgpu_backend()
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((7, 6)).astype(np.float32), rng.integers(0, 4, 7).astype(np.int64))
            for _ in range(4)]
    results = []
    for backend in (wb, NumpyBackend()):
        model = _mlp()
        model.compile(loss="cross_entropy", optimizer=getattr(optim, name)(**{"lr": 0.01, **kwargs}),
                      device=backend, seed=0)
        losses = [model.train_on_batch(x, y) for x, y in data]
        results.append((losses, model.state_dict(), model))
    (lw, sw, mw), (ln, sn, _) = results
    np.testing.assert_allclose(lw, ln, rtol=1e-5, atol=1e-6)
    for k in sn:
        np.testing.assert_allclose(sw[k], sn[k], rtol=1e-4, atol=1e-5, err_msg=k)
    (exe,) = [e for key, e in mw._programs.items() if key[0] == "train"]
    assert sum("Update" in st.kernel.name for st in exe.plan.steps) == 1


def test_adapter_with_eight_storage_buffers_per_stage():
    """The WebGPU default limit: every kernel of a training step (Adam with AMSGrad has the most
    state per parameter) binds at most 8 storage buffers."""
    import dataclasses
    wb = wgpu_backend()
    wb.caps = dataclasses.replace(wb.caps, max_storage_buffers_per_stage=8)
    opt = lambda: optim.Adam(lr=1e-3, amsgrad=True)
    _, lw = _train(wb, opt(), 2)
    _, ln = _train(NumpyBackend(), opt(), 2)
    np.testing.assert_allclose(lw, ln, rtol=1e-4, atol=1e-4)
