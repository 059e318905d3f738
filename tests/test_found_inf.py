"""FoundInf, the loss scaler's test (grad_scaler.found_inf): true exactly when some element of some
input is inf or NaN, as torch.amp.GradScaler decides, on the numpy reference, the torch backend and
wgpu (one count of non-finite bits per input, or per gradient arena: test_wgpu_f16_arena.py).
Finite values whose sum overflows float32 are not a reason to skip a step."""
from __future__ import annotations

import numpy as np
import pytest

from anygrad.backends.numpy import NumpyBackend
from anygrad.ir.graph import Node

BIG = np.float32(3e38)
CASES = {
    "finite": ([np.linspace(-2, 2, 10, dtype=np.float32), np.ones((3, 4), np.float32)], False),
    "sum overflows, values finite": ([np.full(7, BIG), np.full((2, 3), -BIG)], False),
    "inf in the second": ([np.zeros(5, np.float32), np.array([[1, np.inf], [2, 3]], np.float32)], True),
    "-inf": ([np.array([-np.inf, 0, 1], np.float32), np.ones(2, np.float32)], True),
    "NaN": ([np.ones(3, np.float32), np.array([0.5, np.nan], np.float32)], True),
    "a scalar": ([np.array(np.nan, np.float32)], True),
    "one element of many": ([np.where(np.arange(1 << 18) == 200_000, np.inf, 1.0).astype(np.float32)], True),
    # a later input reduced in several passes, which carry the earlier inputs' verdict along
    "bad first, many after": ([np.array([np.nan], np.float32), np.ones(1 << 18, np.float32)], True),
    "bad late in a long second": ([np.ones(3, np.float32),
                                   np.where(np.arange(1 << 18) == (1 << 18) - 1, -np.inf, 1).astype(np.float32)], True),
    "long and finite": ([np.ones(3, np.float32), np.full(1 << 18, BIG)], False),
    # more inputs than a kernel may bind (8 storage buffers on some adapters): the last one is bad
    "twelve inputs": ([np.ones(3, np.float32)] * 11 + [np.array([np.nan], np.float32)], True),
    "twelve finite": ([np.full(3, BIG)] * 12, False),
    # scalars go straight to the kernel that stores the bool, as many as it may bind, the rest reduced
    "twelve scalars, the last bad": ([np.array(1.0, np.float32)] * 11 + [np.array(-np.inf, np.float32)], True),
    "scalars and tensors": ([np.array(2.0, np.float32), np.ones(9, np.float32), np.array(np.nan, np.float32)], True),
}


def _graph(arrays):
    from wgpu_util import make_graph
    names = [f"x{i}" for i in range(len(arrays))]
    info = {n: (a.dtype, a.shape) for n, a in zip(names, arrays)} | {"found": (np.bool_, ())}
    return make_graph([Node("FoundInf", names, ["found"], name="found_inf")], names, ["found"], info), \
        dict(zip(names, arrays))


@pytest.mark.parametrize("case", CASES)
def test_numpy_reference(case):
    arrays, want = CASES[case]
    graph, feeds = _graph(arrays)
    assert bool(NumpyBackend().compile(graph).run(feeds)["found"]) is want


@pytest.mark.parametrize("case", CASES)
def test_torch_backend(case):
    pytest.importorskip("torch")
    from anygrad.backends.torch import TorchBackend
    arrays, want = CASES[case]
    graph, feeds = _graph(arrays)
    exe = TorchBackend("torch:cpu").compile(graph)
    assert exe.fallback_ops == []
    assert bool(exe.run(feeds)["found"]) is want


@pytest.mark.wgpu
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_wgpu(case, fuse):
    from wgpu_util import run_both
    arrays, want = CASES[case]
    graph, feeds = _graph(arrays)
    ref, got, exe = run_both(graph, feeds, fuse=fuse)
    assert bool(got["found"]) is want and bool(ref["found"]) is want
    assert all(step.kernel.name.startswith("FoundInf") for step in exe.plan.steps)
    if all(a.size == 1 for a in arrays) and len(arrays) <= 6:  # one kernel reads them all
        assert len(exe.plan.steps) == 1


def test_the_loss_scaler_builds_it_over_every_gradient():
    """The f16 training step tests its gradients with one FoundInf (and the loss with another, for
    the metrics' gate), where it used to sum them."""
    import anygrad
    from anygrad import nn
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    m = net.to_model(input_shape=(None, 4)).compile("cross_entropy", anygrad.optim.SGD(lr=0.1), device="cpu",
                                                   precision="f16")
    x, y = np.ones((2, 4), np.float32), np.array([0, 1])
    m.train_on_batch(x, y)
    step = next(e for k, e in m._programs.items() if k[0] == "train").graph
    tests = [n for n in step.nodes if n.op == "FoundInf"]
    assert sorted(len(n.inputs) for n in tests) == [1, len(step.params)]
    assert not [n for n in step.nodes if n.op in ("IsNaN", "Or")]


@pytest.mark.wgpu
def test_wgpu_scalars_past_the_binding_limit_are_reduced():
    """Under WebGPU's default limits (8 storage buffers a stage) twelve scalars do not fit the
    storing kernel: six are read there, the others go through the reduction chain."""
    from wgpu_util import run_both

    from anygrad.backends.wgpu import WgpuBackend
    for case in ("twelve scalars, the last bad", "twelve finite"):
        arrays, want = CASES[case]
        if case == "twelve finite":
            arrays = [np.array(BIG)] * 12
        graph, feeds = _graph(arrays)
        _, got, exe = run_both(graph, feeds, backend=WgpuBackend("wgpu", limits="webgpu-default"))
        assert bool(got["found"]) is want
        assert len(exe.plan.steps) == 1 + 6 and exe.plan.steps[-1].kernel.name == "FoundInf"
