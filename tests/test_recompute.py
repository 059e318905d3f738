"""Memory budgets (issue 13 item 3): activation recomputation (ir/recompute.py) and the planner
fitting a budget, on lavapipe, against PyTorch and the numpy backend."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as tnn
from wgpu_util import has_adapter, no_adapter

import anygrad
from anygrad import nn
from anygrad.errors import ConfigError, DeviceError

BATCH, WIDTH = 64, 256


def _nets():
    torch.manual_seed(0)
    theirs = tnn.Sequential(tnn.Linear(16, WIDTH), tnn.SiLU(), tnn.Linear(WIDTH, WIDTH), tnn.SiLU(),
                            tnn.Linear(WIDTH, 4))
    ours = nn.Sequential(nn.Linear(16, WIDTH), nn.SiLU(), nn.Linear(WIDTH, WIDTH), nn.SiLU(), nn.Linear(WIDTH, 4))
    ours.load_state_dict({k: v.detach().numpy().copy() for k, v in theirs.state_dict().items()})
    return theirs, ours


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((BATCH, 16)).astype(np.float32), rng.standard_normal((BATCH, 4)).astype(np.float32)


def _torch_losses(theirs, steps: int) -> list[float]:
    x, y = (torch.from_numpy(a) for a in _data())
    opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(theirs(x), y)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def _train(ours, steps: int, **compile_args):
    model = ours.to_model(input_shape=(None, 16)).compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.1),
                                                          **compile_args)
    x, y = _data()
    return model, [model.train_on_batch(x, y) for _ in range(steps)]


def _same_bits(model, step, other, feeds) -> None:
    """`other` (a rewrite of the training step) computes step's outputs and state updates to the
    bit on the numpy backend, from the model's current state."""
    from anygrad.backends import NumpyBackend
    results = []
    for g in (step, other):
        nb = NumpyBackend()
        for name in g.state_names:
            nb.set_state(name, model.backend.get_state(name))
        results.append(nb.compile(g).run(feeds, list(g.outputs)))
        results[-1].update({t: nb.get_state(t) for t in g.state_updates.values()})
    for k, v in results[0].items():
        np.testing.assert_array_equal(results[1][k], v, err_msg=k)


def test_recompute_pass_keeps_the_step_on_the_numpy_backend():
    """The rewrite alone: SiLU's sigmoid and product are recomputed in the backward, and the
    rewritten step computes the original's outputs and state updates exactly (same ops, same inputs)."""
    from anygrad.ir.recompute import backward_start, recompute
    theirs, ours = _nets()
    model, plain = _train(ours, 2, device="cpu")
    np.testing.assert_allclose(plain, _torch_losses(theirs, 2), rtol=1e-5)
    step = _executable(model).graph
    lighter, values = recompute(step)
    assert len(values) == 4 and all(("Sigmoid" in v) or ("Mul" in v) for v in values)
    start = backward_start(lighter)
    for n in lighter.nodes[start:]:  # the backward reads only the copies
        assert n.name.startswith("grad.recompute") or not set(n.inputs) & set(values), n.label
    x, y = _data()
    feeds = dict(zip(step.inputs, (x, y)))
    _same_bits(model, step, lighter, feeds)


@pytest.mark.wgpu
def test_a_budget_that_needs_recomputation_trains_like_pytorch(monkeypatch):
    monkeypatch.setenv("ANYGRAD_RECOMPUTE_ELEMENTWISE", "0")  # the budget's own recomputation
    if not has_adapter():
        no_adapter()
    from anygrad.backends.wgpu.planning.planner import memory_report
    theirs, ours = _nets()
    want = _torch_losses(theirs, 3)
    _, ours_plain = _nets()
    plain_model, plain = _train(ours_plain, 3, device="wgpu")
    plain_exe = _executable(plain_model)
    full = memory_report(plain_exe.plan).total
    # Between the plan with recomputation (2 activations of 64 KiB fewer per step) and without.
    budget = full - 96 * 1024
    model, fitted = _train(ours, 3, device="wgpu", memory_budget=budget)
    exe = _executable(model)
    report = memory_report(exe.plan)
    assert len(exe.recomputed) == 4 and report.total <= budget < full
    np.testing.assert_array_equal(fitted, plain)  # recomputed values are the same bits
    np.testing.assert_allclose(fitted, want, rtol=1e-4)
    # The reported peak is what the executable allocated (buffers rounded up to 16 bytes).
    backend = model.backend
    buffers = list(exe.slots) + list(exe.inputs.values()) + list(exe.consts.values()) + list(exe.garenas.values())
    buffers += [backend.state[r.name].buffer for r in exe.plan.nbytes if r.kind == "state"]
    buffers += [backend.arenas[r.name][0] for r in exe.plan.nbytes if r.kind == "arena"]
    held = [b.size for b in {id(b): b for b in buffers}.values()]  # an arena holds many states
    assert report.total <= sum(held) <= report.total + 16 * len(held)
    assert sum(b.size for b in exe.slots) - 16 * len(exe.slots) < sum(exe.plan.slot_bytes) <= \
        sum(b.size for b in exe.slots)


@pytest.mark.wgpu
def test_a_budget_takes_the_tightest_placement_before_recomputing():
    """Over its budget, a step is first placed as tightly as the planner can: the rule that keeps a
    kernel's inputs out of the buffer it writes (faster reads) is dropped. A budget between that
    placement and the default one gets it, with nothing recomputed, and trains to the same bits
    as without a budget (and as the numpy backend, to float rounding)."""
    if not has_adapter():
        no_adapter()
    from anygrad.backends.wgpu.planning.planner import make_plan, memory_report
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((BATCH, 16)).astype(np.float32), rng.integers(0, 4, BATCH)

    def train(**compile_args):
        _, ours = _nets()
        model = ours.to_model(input_shape=(None, 16)).compile(loss="cross_entropy",
                                                              optimizer=anygrad.optim.SGD(lr=0.1), **compile_args)
        return model, [model.train_on_batch(x, y) for _ in range(3)]
    plain_model, plain = train(device="wgpu")
    exe = _executable(plain_model)
    full = memory_report(exe.plan).total
    tight = memory_report(make_plan(exe.plan.graph.copy(), plain_model.backend.caps, set(exe.graph.state_names),
                                    read_apart=False)).total
    assert tight < full - 32 * 1024
    budget = (tight + full) // 2
    model, fitted = train(device="wgpu", memory_budget=budget)
    fit = _executable(model)
    assert memory_report(fit.plan).total == tight and not fit.recomputed
    np.testing.assert_array_equal(fitted, plain)
    np.testing.assert_allclose(fitted, train(device="cpu")[1], rtol=1e-4)


@pytest.mark.wgpu
def test_a_budget_nothing_fits_names_the_batch_that_does(monkeypatch):
    monkeypatch.setenv("ANYGRAD_RECOMPUTE_ELEMENTWISE", "0")  # the budget's own recomputation
    if not has_adapter():
        no_adapter()
    _, ours = _nets()
    with pytest.raises(DeviceError, match=r"even with 4 activations recomputed in the backward, but the memory "
                                          r"budget is 700 KiB\. The largest batch that fits is about (\d+)") as e:
        _train(ours, 1, device="wgpu", memory_budget="700KiB")
    fit = int(str(e.value).rsplit("about ", 1)[1].rstrip("."))
    assert 0 < fit < BATCH
    with pytest.raises(ConfigError, match="memory_budget '1.5XB' is not a size"):
        _train(ours, 1, device="wgpu", memory_budget="1.5XB")


def _executable(model):
    """The compiled training step (the program that updates state)."""
    found = [e for key, e in model._programs.items() if key[0] == "train"]
    assert found, f"no compiled training step among {list(model._programs)}"
    return found[0]


@pytest.mark.wgpu
def test_info_plans_within_a_memory_budget(capsys):
    """`anygrad info --batch-size N --memory-budget SIZE`: the peak when it fits, else the error
    naming the batch that fits, which then fits."""
    if not has_adapter():
        no_adapter()
    from pathlib import Path

    from anygrad import cli
    mnist = str(Path(anygrad.__file__).parent / "examples" / "mnist.onnx")
    assert cli.main(["info", mnist, "--batch-size", "64", "--memory-budget", "12MB"]) != 0
    err = capsys.readouterr().err
    assert "but the memory budget is 11.5 MiB. The largest batch that fits is about" in err, err
    fit = int(err.rsplit("about ", 1)[1].split(".")[0])
    assert cli.main(["info", mnist, "--batch-size", str(fit), "--memory-budget", "12MB"]) == 0
    peak = capsys.readouterr().out.rsplit("peak: ", 1)[1].split()
    assert float(peak[0]) <= 11.5 and peak[1] == "MiB"


def test_batchnorm_relu_segments_are_recomputed_exactly():
    """A conv net: BatchNorm -> ReLU is recomputed from the BatchNorm input (its gradient keeps it);
    the copy's running statistics go unused, so the state is updated once, as before."""
    from anygrad.ir.recompute import recompute
    nn.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                        nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    model = net.to_model(input_shape=(None, 3, 8, 8)).compile(loss="cross_entropy",
                                                              optimizer=anygrad.optim.SGD(lr=0.1), device="cpu")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 4, 4)
    model.train_on_batch(x, y)
    step = _executable(model).graph
    lighter, values = recompute(step)
    assert sorted(v.split("/")[-1].rsplit("_output", 1)[0] for v in values) == \
        ["BatchNormalization", "BatchNormalization", "Relu", "Relu"]
    assert lighter.state_updates == step.state_updates
    feeds = dict(zip(step.inputs, (x, y)))
    _same_bits(model, step, lighter, feeds)


def test_f16_casts_are_recomputed_exactly_and_plan_smaller():
    """Mixed precision: the float32 copies of float16 values (a softmax's input) and the float16
    copies of weights are cast again in the backward instead of living across it
    (the casts of recompute.ELEMENTWISE); the step computes the same bits, and the wgpu planner keeps the rewrite
    because it plans fewer bytes (activations of a batch of 1024 outweigh the weights)."""
    from anygrad.backends.wgpu.kernels.kernel import AdapterCaps
    from anygrad.backends.wgpu.planning.planner import fit_plan, make_plan, memory_report
    from anygrad.ir.recompute import recompute
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 64), nn.Softmax(dim=-1), nn.Linear(64, 4))
    model = net.to_model(input_shape=(None, 16)).compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.1),
                                                         device="cpu", precision="f16")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((1024, 16)).astype(np.float32), rng.standard_normal((1024, 4)).astype(np.float32)
    model.train_on_batch(x, y)
    step = _executable(model).graph
    recast, values = recompute(step, frozenset({"Cast"}))
    assert values and all(n.op == "Cast" for n in recast.nodes if n.name.startswith("grad.recompute"))
    feeds = dict(zip(step.inputs, (x, y)))
    _same_bits(model, step, recast, feeds)
    caps = AdapterCaps(has_f16=True, is_cpu=False, max_storage_binding_size=1 << 30)
    states = set(step.state_names)
    plain = memory_report(make_plan(step.copy(), caps, states)).total
    prepared, plan, _ = fit_plan(step.copy(), caps, states, lambda gr: gr)
    assert any(n.name.startswith("grad.recompute") and n.op == "Cast" for n in prepared.nodes)
    assert memory_report(plan).total < plain


@pytest.mark.wgpu
def test_elementwise_values_are_recomputed_by_default(monkeypatch):
    """Without any budget the planner recomputes per-element forward values in the backward when
    that plans smaller (the tanh GELU's intermediates and output, read again by the backward):
    fewer activation bytes than with ANYGRAD_RECOMPUTE_ELEMENTWISE=0, the same losses. (With the
    GELU applied in the second Linear's operand loads, the default, its output is never stored
    and there is nothing to recompute: fewer bytes than storing it, and fewer kernels.)"""
    if not has_adapter():
        no_adapter()
    from anygrad.backends.wgpu.fusion.gemm_epilogues import prologue_enabled
    assert prologue_enabled()
    monkeypatch.setenv("ANYGRAD_WGPU_PROLOGUE", "0")
    from anygrad.backends.wgpu.planning.planner import memory_report
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((256, 16)).astype(np.float32), rng.standard_normal((256, 4)).astype(np.float32)
    runs, weights = {}, None
    for flag in ("0", "1"):
        monkeypatch.setenv("ANYGRAD_RECOMPUTE_ELEMENTWISE", flag)
        net = nn.Sequential(nn.Linear(16, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 4))
        weights = weights or {k: np.array(v) for k, v in net.state_dict().items()}
        net.load_state_dict(weights)
        model = net.to_model(input_shape=(None, 16)).compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.1),
                                                             device="wgpu")
        losses = [model.train_on_batch(x, y) for _ in range(3)]
        exe = _executable(model)
        runs[flag] = (losses, memory_report(exe.plan).activations, len(exe.plan.steps))
    (plain, plain_bytes, plain_kernels), (lighter, lighter_bytes, kernels) = runs["0"], runs["1"]
    assert lighter_bytes < plain_bytes and kernels > plain_kernels   # the GELU again, in the backward
    np.testing.assert_allclose(lighter, plain, rtol=1e-6)
    monkeypatch.setenv("ANYGRAD_WGPU_PROLOGUE", "1")
    net.load_state_dict(weights)
    model = net.to_model(input_shape=(None, 16)).compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.1),
                                                         device="wgpu")
    fused = [model.train_on_batch(x, y) for _ in range(3)]
    exe = _executable(model)
    assert memory_report(exe.plan).activations < plain_bytes and len(exe.plan.steps) < plain_kernels
    np.testing.assert_allclose(fused, plain, rtol=1e-5)
