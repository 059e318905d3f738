"""Mixed precision (issue 13 item 4): precision="f16" against PyTorch autocast + GradScaler and
against the float32 runs; float16 values on the numpy, torch and wgpu backends; loss scaling;
resume; the shader rewrite that stores float16 values as f16 on the device.

Tolerances (documented in README "Mixed precision"): over 20 steps, f16 losses agree with
torch.autocast('cpu', float16) + GradScaler to 1e-4 relative for an MLP (the same casts, the
same roundings: only summation order differs) and to 2e-3 relative or 1e-4 absolute for a CNN
with BatchNorm (whose loss falls from 1.2 to 7e-4, where f16 rounding noise shows); the f16 run
agrees with the float32 run to the same 2e-3 relative or 1e-4 absolute. wgpu and numpy compute every float16 op in float32 and round
its result to float16, so they agree to a few float16 ulps (fused elementwise chains on the
device skip the roundings between their ops).
"""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from wgpu_util import wgpu_backend

import anygrad
from anygrad import nn
from anygrad.errors import ConfigError, DeviceError
from anygrad.ir import Builder, Graph, TensorInfo, specialize
from anygrad.ir.autocast import HALF, autocast, half_values
from anygrad.optim import grad_scaler
from anygrad.program import build_train_step

STEPS = 20


def _mlp(mod):
    return mod.Sequential(mod.Linear(8, 16), mod.ReLU(), mod.Linear(16, 4))


def _cnn(mod):
    return mod.Sequential(mod.Conv2d(1, 4, 3, padding=1), mod.BatchNorm2d(4), mod.ReLU(), mod.MaxPool2d(2),
                          mod.Flatten(), mod.Linear(4 * 3 * 3, 3))


def _data(kind: str):
    rng = np.random.default_rng(0)
    if kind == "mlp":
        return rng.standard_normal((16, 8)).astype(np.float32), rng.integers(0, 4, 16)
    return rng.standard_normal((8, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, 8)


def _pair(kind: str):
    """(torch module, anygrad Model) with the same weights."""
    torch.manual_seed(0)
    make, shape = (_mlp, (None, 8)) if kind == "mlp" else (_cnn, (None, 1, 6, 6))
    theirs, ours = make(torch.nn), make(nn)
    ours.load_state_dict({k: v.detach().numpy().copy() for k, v in theirs.state_dict().items()})
    return theirs, ours.to_model(input_shape=shape)


def _torch_autocast_losses(theirs, kind: str, steps: int = STEPS, data=None, flat: bool = False,
                           lr: float = 0.1) -> list[float]:
    """torch.autocast(float16) + GradScaler on CPU, SGD(lr, momentum 0.9): the reference losses.
    `data`: (x, y) instead of _data(kind); `flat`: logits (..., V) and labels flattened to rows."""
    x, y = (torch.from_numpy(a) for a in (data if data is not None else _data(kind)))
    opt = torch.optim.SGD(theirs.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    out = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            scores = theirs(x)
            loss = (torch.nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), y.reshape(-1)) if flat
                    else torch.nn.functional.cross_entropy(scores, y))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append(float(loss.detach()))
    return out


def _ours(model, device, precision: str = "f16", steps: int = STEPS, kind: str = "mlp") -> tuple:
    m = anygrad.Model(model.graph.copy()).compile("cross_entropy", anygrad.optim.SGD(lr=0.1, momentum=0.9),
                                                 device=device, precision=precision)
    x, y = _data(kind)
    return m, [m.train_on_batch(x, y) for _ in range(steps)]


def _train_exe(model):
    return next(e for k, e in model._programs.items() if k[0] == "train")


# -- the graph pass --------------------------------------------------------------------------------
def test_autocast_puts_matmuls_and_activations_in_f16_and_keeps_weights_and_norms_f32():
    _, model = _pair("cnn")
    m, _ = _ours(model, "cpu", steps=1, kind="cnn")
    g = _train_exe(m).graph
    ops_of = {o: n.op for n in g.nodes for o in n.outputs}
    half_ops = {ops_of[v] for v in half_values(g)}
    assert {"Conv", "Gemm", "Relu", "MaxPool", "ConvGradWeight", "BatchNormalization", "BatchNormGrad"} <= half_ops
    assert not {"CrossEntropyMetrics", "SGDUpdate"} & half_ops
    bn = next(n for n in g.nodes if n.op == "BatchNormalization")  # f16 in and out, f32 statistics
    assert [g.info[v].dtype for v in bn.inputs] == [HALF] + [np.float32] * 4
    assert [g.info[v].dtype for v in bn.outputs] == [HALF, np.float32, np.float32]
    for p in g.params + g.buffers:  # master weights, BN statistics, optimizer state: float32
        assert g.info[p].dtype != HALF, p
    for produced, state in g.state_updates.items():
        assert g.info[produced].dtype == g.info[state].dtype, state
    # each parameter is cast once; its gradient comes back through a Cast to float32
    casts = [n for n in g.nodes if n.op == "Cast" and n.inputs[0] in g.params]
    assert len(casts) == len({n.inputs[0] for n in casts}) == 4  # conv and linear weight and bias


def _autocast_after_matmul(outputs) -> Graph:
    """autocast of h = x (2, 3) @ w (a 3 x 3 parameter of ones) followed by outputs(builder, h),
    which adds the nodes after h and returns the graph's outputs."""
    g = Graph(name="t")
    g.inputs, g.info["x"] = ["x"], TensorInfo(np.dtype(np.float32), (2, 3))
    g.initializers["w"] = np.ones((3, 3), np.float32)
    g.info["w"] = TensorInfo(np.dtype(np.float32), (3, 3))
    g.params = ["w"]
    b = Builder(g, prefix="t")
    g.outputs = outputs(b, b.op("MatMul", ["x", "w"]))
    return autocast(specialize(g, {"x": (2, 3)}))


def test_autocast_leaves_outputs_float32_and_casts_constants_once():
    def outputs(b, h):
        s = b.op("Softmax", [b.op("Mul", [h, b.const(0.5)])], axis=-1)
        return [b.op("Add", [h, b.const(1.0)]), s]
    half = _autocast_after_matmul(outputs)
    assert [half.info[o].dtype for o in half.outputs] == [np.float32, np.float32]
    ops = {n.outputs[0]: n for n in half.nodes}
    mul = next(n for n in half.nodes if n.op == "Mul")
    assert half.info[mul.outputs[0]].dtype == HALF  # the scalar constant was cast down, not h up
    assert half.info[mul.inputs[1]].dtype == HALF and mul.inputs[1] in half.initializers
    soft = next(n for n in half.nodes if n.op == "Softmax")
    assert half.info[soft.inputs[0]].dtype == np.float32 and ops[soft.inputs[0]].op == "Cast"


# -- against PyTorch autocast + GradScaler, and against float32 -------------------------------------
@pytest.mark.parametrize("kind, rtol", [("mlp", 1e-4), ("cnn", 2e-3)])
def test_f16_losses_follow_torch_autocast_for_20_steps(kind, rtol):
    theirs, model = _pair(kind)
    expected = _torch_autocast_losses(theirs, kind)
    m, got = _ours(model, "cpu", kind=kind)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=1e-4)
    assert m.read_metrics()["skipped_updates"] >= 0.0


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_f16_losses_stay_within_tolerance_of_f32(kind):
    _, model = _pair(kind)
    _, f16 = _ours(model, "cpu", kind=kind)
    _, f32 = _ours(model, "cpu", "f32", kind=kind)
    np.testing.assert_allclose(f16, f32, rtol=2e-3, atol=1e-4)
    assert f16 != f32  # really computed in float16


def test_torch_backend_runs_f16_like_numpy():
    _, model = _pair("cnn")
    _, cpu = _ours(model, "cpu", steps=5, kind="cnn")
    _, got = _ours(model, "torch:cpu", steps=5, kind="cnn")
    np.testing.assert_allclose(got, cpu, rtol=1e-3)


# -- loss scaling ---------------------------------------------------------------------------------------
def _tiny_regression(precision: str = "f16", loss_scaling: bool | None = None, weight: float = 1.0,
                     lr: float = 1.0):
    """One Linear(4, 2) without bias, mse: a step graph on a fresh numpy backend."""
    from anygrad.backends import NumpyBackend
    from anygrad.losses import get_loss
    from anygrad.optim import SGD
    ours = nn.Sequential(nn.Linear(4, 2, bias=False))
    ours.load_state_dict({"0.weight": np.full((2, 4), weight, np.float32)})
    model = ours.to_model(input_shape=(None, 4))
    step = build_train_step(model.graph, {model.input_name: (4, 4)}, (4, 2), get_loss("mse"), SGD(lr=lr),
                            precision=precision, loss_scaling=loss_scaling)
    backend = NumpyBackend()
    return backend, backend.compile(step)


def test_a_gradient_that_underflows_in_f16_trains_with_loss_scaling():
    """out = 1 exactly, target 1 - 2**-24: dL/dout = 2 * 2**-24 / 8 = 2**-26, below float16's
    smallest subnormal (2**-24), so without scaling the weight gradient is zero."""
    x = np.ones((4, 4), np.float32)
    y = np.full((4, 2), np.float32(1.0) - np.float32(2.0 ** -24), np.float32)
    moved = {}
    for precision, scaling in (("f16", False), ("f16", True), ("f32", None)):
        backend, exe = _tiny_regression(precision, scaling, weight=0.25, lr=1000.0)
        exe.run({exe.graph.inputs[0]: x, exe.graph.inputs[1]: y})
        moved[precision, scaling] = backend.get_state("0.weight") - np.float32(0.25)
    assert not moved["f16", False].any()  # the gradient was rounded to zero in float16
    assert moved["f16", True].any()
    np.testing.assert_allclose(moved["f16", True], moved["f32", None], rtol=1e-2)


def test_an_overflowing_step_is_skipped_and_the_scale_backs_off(monkeypatch):
    monkeypatch.setattr(grad_scaler, "GROWTH_INTERVAL", 3)
    x = np.ones((4, 4), np.float32)
    y = np.zeros((4, 2), np.float32)
    backend, exe = _tiny_regression(weight=1.0, lr=0.0)  # dL/dout = 1: times 2**16 overflows f16's 65504
    feeds = {exe.graph.inputs[0]: x, exe.graph.inputs[1]: y}
    w0 = backend.get_state("0.weight")
    exe.run(feeds)
    assert backend.get_state(grad_scaler.LOSS_SCALE) == 2.0 ** 15
    np.testing.assert_array_equal(backend.get_state("0.weight"), w0)  # the update was skipped
    assert backend.get_state(grad_scaler.SKIPPED_SUM) == 1.0
    assert backend.get_state("anygrad.step") == 0.0  # the optimizer did not count it
    scales = [float(backend.get_state(grad_scaler.LOSS_SCALE))]
    for _ in range(6):
        exe.run(feeds)
        scales.append(float(backend.get_state(grad_scaler.LOSS_SCALE)))
    # the weight gradient sums 4 rows of dL/dout * scale: it overflows until the scale is 2**13;
    # 3 finite steps (GROWTH_INTERVAL) then double it, and 2**14 overflows again
    assert scales == [2.0 ** 15, 2.0 ** 14, 2.0 ** 13, 2.0 ** 13, 2.0 ** 13, 2.0 ** 14, 2.0 ** 13]
    assert backend.get_state(grad_scaler.SKIPPED_SUM) == 4.0
    assert backend.get_state("anygrad.step") == 3.0  # the three finite steps updated (with lr 0: same weights)


def test_a_forward_that_overflows_f16_is_skipped_whole_and_reports_no_nan_loss():
    """Linear output 4 * 100 * 200 = 80000 > 65504: inf in float16, NaN after BatchNorm. The step
    changes nothing (BatchNorm's running statistics neither) and adds nothing to the metric sums."""
    ours = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    ours.load_state_dict({"0.weight": np.full((3, 4), 100.0, np.float32), "0.bias": np.zeros(3, np.float32)},
                         strict=False)
    m = ours.to_model(input_shape=(None, 4)).compile("mse", anygrad.optim.SGD(lr=0.01), device="cpu",
                                                     precision="f16")
    before = m.state_dict()
    y = np.zeros((8, 3), np.float32)
    assert not np.isfinite(m.train_on_batch(np.full((8, 4), 200.0, np.float32), y))
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    assert m.read_metrics() == {"count": 0.0, "skipped_updates": 1.0}  # no sample counted, no NaN
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32) * 1e-3
    loss = m.train_on_batch(x, y)
    metrics = m.read_metrics()
    assert np.isfinite(loss) and metrics["count"] == 8 and metrics["loss"] == pytest.approx(loss)
    assert metrics["skipped_updates"] == 0.5


def test_f16_resume_continues_bit_for_bit_with_the_loss_scale():
    _, model = _pair("mlp")
    x, y = _data("mlp")
    whole, losses = _ours(model, "cpu", steps=6)
    first, head = _ours(model, "cpu", steps=3)
    saved = first.full_state()
    assert grad_scaler.LOSS_SCALE in saved and grad_scaler.GROWTH_TRACKER in saved
    saved[grad_scaler.LOSS_SCALE] = np.array(2.0 ** 20, np.float32)  # a changed scale must come back
    resumed = anygrad.Model(model.graph.copy()).compile("cross_entropy", anygrad.optim.SGD(lr=0.1, momentum=0.9),
                                                       device="cpu", precision="f16")
    resumed.load_full_state(saved)
    resumed.train_on_batch(x, y)
    assert resumed.backend.get_state(grad_scaler.LOSS_SCALE) == 2.0 ** 19  # it overflowed: restored, then halved
    resumed.load_full_state(first.full_state())
    tail = [resumed.train_on_batch(x, y) for _ in range(3)]
    assert head + tail == losses
    for k, v in whole.full_state().items():
        np.testing.assert_array_equal(resumed.full_state()[k], v, err_msg=k)


def test_f16_with_gradient_accumulation_follows_f32():
    """Micro-batch gradients are unscaled before they are summed; the apply phase checks the sum
    (an inf in any micro-batch skips the whole update) and updates the scale once."""
    _, model = _pair("mlp")
    x, y = _data("mlp")
    losses = {}
    for precision in ("f32", "f16"):
        m = anygrad.Model(model.graph.copy()).compile("cross_entropy", anygrad.optim.Adam(lr=0.01), device="cpu",
                                                     precision=precision, accumulate=2)
        losses[precision] = [m.train_on_batch(x[i % 2::2], y[i % 2::2]) for i in range(12)]
    np.testing.assert_allclose(losses["f16"], losses["f32"], rtol=2e-3, atol=1e-4)
    assert m.backend.get_state(grad_scaler.LOSS_SCALE) <= grad_scaler.INIT_SCALE


def test_evaluate_and_predict_of_an_f16_model_run_in_f32():
    _, model = _pair("cnn")
    m, _ = _ours(model, "cpu", steps=2, kind="cnn")
    x, y = _data("cnn")
    m.evaluate(x, y)
    assert m.predict(x).dtype == np.float32
    for key, exe in m._programs.items():
        assert bool(half_values(exe.graph)) == (key[0] == "train"), key[0]


def test_bad_precision_is_a_config_error():
    _, model = _pair("mlp")
    with pytest.raises(ConfigError, match="precision must be one of f32, f16"):
        model.compile("cross_entropy", device="cpu", precision="bf16")


# -- wgpu ---------------------------------------------------------------------------------------------------
@pytest.mark.wgpu
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_wgpu_f16_steps_match_numpy(kind):
    backend = wgpu_backend()
    if not backend.caps.has_f16:
        pytest.fail(f"{backend.adapter.summary} has no shader-f16 (lavapipe has it)")
    _, model = _pair(kind)
    cpu, want = _ours(model, "cpu", steps=3, kind=kind)
    gpu, got = _ours(model, backend, steps=3, kind=kind)
    np.testing.assert_allclose(got, want, rtol=2e-3)
    for k, v in cpu.state_dict().items():
        np.testing.assert_allclose(gpu.state_dict()[k], v, rtol=2e-3, atol=2e-4, err_msg=k)
    steps = _train_exe(gpu).plan.steps
    assert not [st.kernel.name for st in steps if ":to_f" in st.kernel.name]  # every kernel rewritten


@pytest.mark.wgpu
def test_wgpu_f16_activation_buffers_take_two_bytes_per_element(monkeypatch):
    from anygrad.backends.wgpu.planning.planner import value_bytes
    # like for like: without the activation-gradient epilogue both precisions store dy
    monkeypatch.setenv("ANYGRAD_WGPU_GRAD_EPILOGUE", "0")
    backend = wgpu_backend()
    _, model = _pair("mlp")
    m, _ = _ours(model, backend, steps=1)
    exe = _train_exe(m)
    g, plan = exe.prepared, exe.plan
    hidden = [v for v in plan.root_of if v in g.info and g.info[v].shape == (16, 16) and g.info[v].dtype == HALF]
    assert hidden
    for v in hidden:
        assert value_bytes(g, v) == 16 * 16 * 2
        root = plan.root_of[v]
        if root.kind == "temp":  # its slot is sized by its tenants' bytes, 2 per f16 element
            assert plan.slot_bytes[plan.slot_of[root]] >= 16 * 16 * 2
        writers = [st.kernel.wgsl for st in plan.steps if root in st.writes]
        assert all(re.search(r"array<(vec4<)?f16>", w) and "enable f16;" in w for w in writers)
    shapes = {model.input_name: (512, 8)}
    step = {p: build_train_step(model.graph, shapes, (512,), m.loss, m.optimizer, precision=p) for p in ("f32", "f16")}
    act = {p: backend.memory_report(s).activations for p, s in step.items()}
    assert act["f16"] < 0.75 * act["f32"], act  # f16 weight copies and the f32 gradient arena stay


@pytest.mark.wgpu
def test_wgpu_refuses_f16_without_shader_f16():
    backend = wgpu_backend()
    backend.caps = replace(backend.caps, has_f16=False)
    _, model = _pair("mlp")
    with pytest.raises(DeviceError, match=r"shader-f16.*--precision f32") as e:
        model.compile("cross_entropy", device=backend, precision="f16")
    assert backend.adapter.summary in str(e.value)


@pytest.mark.wgpu
def test_wgpu_rewritten_elementwise_and_reduction_kernels_match_numpy():
    """Cast -> Mul -> ReduceSum -> Exp over float16 values: the elementwise and reduction kernels
    read and write f16 buffers; numpy computes each op in float32 and rounds."""
    from anygrad.backends import NumpyBackend
    backend = wgpu_backend()
    g = Graph(name="half")
    g.inputs, g.info["x"] = ["x"], TensorInfo(np.dtype(np.float32), (5, 37))
    b = Builder(g, prefix="h")
    h = b.op("Cast", ["x"], to=10)
    m = b.op("Mul", [h, b.op("Add", [h, b.const(np.float16(0.5), np.float16)])])
    r = b.op("ReduceSum", [m, b.const(np.array([1], np.int64), np.int64)], keepdims=0)
    g.outputs = [b.op("Cast", [r], to=1), m]
    x = np.random.default_rng(1).standard_normal((5, 37)).astype(np.float32) * 3
    want = NumpyBackend().compile(g).run({"x": x})
    exe = backend.compile(g)
    got = exe.run({"x": x})
    assert got[m].dtype == HALF and got[m].shape == (5, 37)
    # the device fuses Cast+Add+Mul into one kernel: h + 0.5 is not rounded to f16 in between
    np.testing.assert_allclose(got[m].astype(np.float32), want[m].astype(np.float32), rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(got[g.outputs[0]], want[g.outputs[0]], rtol=2e-3)
    shaders = [st.kernel.wgsl for st in exe.plan.steps]
    assert any("array<f16>" in w and "ReduceSum" in st.kernel.name for w, st in zip(shaders, exe.plan.steps))


# -- the shader rewrite, as text -----------------------------------------------------------------------
def test_rewrite_binding_reads_f32_and_rounds_stores():
    from anygrad.backends.wgpu.kernels.halfstore import rewrite_binding
    src = ("@group(0) @binding(0) var<storage, read> a: array<f32>;\n"
           "@group(0) @binding(1) var<storage, read_write> y: array<f32>;\n"
           "fn main() {\n  let i = 0u;\n  y[i] = a[i] * a[a_idx(i)];\n  y[i + 1u] += exp(y[i]);\n"
           "  if (a[i] >= 0.0) { y[i] = 1.0; }\n}\n")
    out = rewrite_binding(rewrite_binding(src, "a", "f32"), "y", "f32")
    assert out.startswith("enable f16;\n") and out.count("enable f16;") == 1
    assert "var<storage, read> a: array<f16>;" in out and "var<storage, read_write> y: array<f16>;" in out
    # stores round through the conversion function (exact where the driver's is not: halfstore.py)
    assert "y[i] = anygrad_to_f16(f32(a[i]) * f32(a[a_idx(i)]));" in out
    assert "y[i + 1u] = anygrad_to_f16(f32(y[i + 1u]) + (exp(f32(y[i]))));" in out
    assert "if (f32(a[i]) >= 0.0) { y[i] = anygrad_to_f16(1.0); }" in out
    assert out.count("fn anygrad_to_f16(") == 1


def test_rewrite_binding_vec4_operands_and_unrewritable_bindings():
    from anygrad.backends.wgpu.kernels.halfstore import half_kernels, rewrite_binding
    from anygrad.backends.wgpu.kernels.kernel import Kernel
    src = ("@group(0) @binding(0) var<storage, read> b: array<vec4<f32>>;\n"
           "@group(0) @binding(1) var<storage, read_write> y: array<vec4<f32>>;\n"
           "fn main() { let v = b[3u][2u]; y[1u] = b[0u] * v; y[2u][1u] = v; }\n")
    out = rewrite_binding(rewrite_binding(src, "b", "vec4<f32>"), "y", "vec4<f32>")
    assert "let v = vec4<f32>(b[3u])[2u];" in out
    assert "y[1u] = anygrad_to_f16x4(vec4<f32>(b[0u]) * v);" in out and "y[2u][1u] = anygrad_to_f16(v);" in out
    odd = ("@group(0) @binding(0) var<storage, read> a: array<f32>;\n"
           "@group(0) @binding(1) var<storage, read_write> y: array<f32>;\n"
           "fn main() { y[0] = f32(arrayLength(&a)); }\n")
    assert rewrite_binding(odd, "a", "f32") is None
    kern = Kernel("Odd", odd, (1, 1, 1), ("x",), ("out",))
    parts = half_kernels(kern, lambda v: True, lambda v: 10)
    assert [p.name for p in parts] == ["Odd:to_f32", "Odd"]  # a read through an f32 copy; the write rewritten
    assert parts[1].reads == ("@f32:x:0",) and "array<f16>" in parts[1].wgsl


@pytest.mark.wgpu
def test_wgpu_f16_self_test_passes_here_and_a_failing_one_falls_back_to_f32(monkeypatch, capsys):
    from anygrad.backends.wgpu.tuning.selftest import f16_problem
    backend = wgpu_backend()
    assert f16_problem(backend) is None
    monkeypatch.setattr(backend.ctx, "f16_problem", "its float16 matmul is wrong (relative error 3.2)")
    _, model = _pair("mlp")
    model.compile("cross_entropy", device=backend, precision="f16")
    assert model.precision == "f32"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "f16 self-test failed" in err and "training in f32" in err
    assert backend.adapter.summary in err


@pytest.mark.wgpu
@pytest.mark.slow
def test_a_tiny_gpt_trains_in_f16_on_wgpu_like_numpy_and_torch_autocast():
    """LayerNorm, softmax, GELU and the causal mask in float32 around float16 matmuls, through the
    ONNX export of benchmarks/models.py's GPT decoder."""
    import copy
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from models import _gpt_module
    backend = wgpu_backend()
    torch.manual_seed(0)
    module = _gpt_module(64, 8, 32, 2, 1).train()
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (16,))
    want = _torch_autocast_losses(copy.deepcopy(module), "gpt", steps=3, data=(x, y))
    got = {}
    for device in ("cpu", backend):
        m = anygrad.from_torch(module, torch.from_numpy(x), check=False)
        m.compile("cross_entropy", anygrad.optim.SGD(lr=0.1, momentum=0.9), device=device, precision="f16")
        got[device] = [m.train_on_batch(x, y) for _ in range(3)]
    np.testing.assert_allclose(got["cpu"], want, rtol=1e-3)
    np.testing.assert_allclose(got[backend], got["cpu"], rtol=1e-3)
    assert not [st.kernel.name for st in _train_exe(m).plan.steps if ":to_f" in st.kernel.name]


# -- the command line ------------------------------------------------------------------------------------
def test_cli_trains_in_f16_saves_it_in_config_and_resumes_with_the_loss_scale(tmp_path):
    import json
    from pathlib import Path

    from test_resume import _mlp

    from anygrad import cli
    from anygrad.data import write_idx
    from anygrad.data.mnist import MNIST_FILES
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 300), ("test", 60)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = (rng.integers(0, 20, (n, 28, 28)) + y[:, None, None] * 23).astype(np.uint8)
        write_idx(data / f"{MNIST_FILES['x_' + split].name}.gz", x)
        write_idx(data / f"{MNIST_FILES['y_' + split].name}.gz", y)
    model, run = _mlp(tmp_path / "mlp.onnx"), tmp_path / "run"
    assert cli.main(["train", str(model), "--data-dir", str(data), "--device", "cpu", "--epochs", "1",
                     "--batch-size", "50", "--precision", "f16", "--artifacts", str(run), "--quiet"]) == 0
    assert json.loads((run / "config.json").read_text())["precision"] == "f16"
    latest = max((run / "checkpoints").glob("ckpt-*.npz"))
    with np.load(latest) as z:
        scale = float(z[grad_scaler.LOSS_SCALE])
    assert scale < grad_scaler.INIT_SCALE  # this model overflows at 2**16 at first: backed off
    assert cli.main(["train", "--resume", str(run), "--epochs", "2", "--quiet"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and rows[0]["train_skipped_updates"] > 0
    assert all(np.isfinite(r["train_loss"]) for r in rows)
    assert Path(run / "weights.npz").exists()


@pytest.mark.wgpu
def test_wgpu_skips_overflowing_steps_inside_the_fused_update_like_numpy():
    """The gated update runs as one wgpu.FusedUpdate over the parameter arenas (the skip flag is
    one more input of that kernel); skipped steps, scales and Adam's state match numpy's."""
    backend = wgpu_backend()
    ours = nn.Sequential(nn.Linear(4, 2, bias=False))
    ours.load_state_dict({"0.weight": np.full((2, 4), 1.0, np.float32)})
    x, y = np.ones((4, 4), np.float32), np.zeros((4, 2), np.float32)
    states = {}
    for device in ("cpu", backend):
        m = ours.to_model(input_shape=(None, 4)).compile("mse", anygrad.optim.Adam(lr=1e-3), device=device,
                                                         precision="f16")
        for _ in range(5):
            m.train_on_batch(x, y)
        states[device] = m.full_state()
    want, got = states["cpu"], states[backend]
    assert want[grad_scaler.LOSS_SCALE] == 2.0 ** 13 and want[grad_scaler.SKIPPED_SUM] == 3.0
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-3, atol=1e-6, err_msg=k)
    names = [st.kernel.name for st in _train_exe(m).plan.steps]
    assert any(n.startswith("ew:AdamUpdatex1") for n in names), names


def test_autocast_keeps_pow_by_2_or_3_in_f16_and_other_pows_in_f32():
    """x ** 3 of an exported GELU-tanh is a product (torch's fused GELU runs in float16); a general
    pow is on autocast's float32 list."""
    half = _autocast_after_matmul(lambda b, h: [b.op("Pow", [h, b.const(3.0)]), b.op("Pow", [h, b.const(2.5)])])
    pows = [n for n in half.nodes if n.op == "Pow"]
    assert [half.info[n.inputs[0]].dtype for n in pows] == [HALF, np.float32]


@pytest.mark.wgpu
def test_wgpu_f16_casts_around_norms_and_softmax_fold_with_the_same_bits(monkeypatch):
    """A tiny GPT (benchmarks/models.py's decoder) trained in f16 on wgpu: the Casts between its
    f16 matmuls and its f32 LayerNorms and softmaxes cost no kernel (fusion.fold_float_casts: the
    row kernels store f16 and read f16 themselves), and 3 steps give the same bits as with the
    Casts as kernels (ANYGRAD_WGPU_CAST_FOLD=0): the same conversions, in other kernels."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from models import _gpt_module
    wgpu_backend()  # skips without an adapter
    torch.manual_seed(0)
    module = _gpt_module(64, 16, 32, 2, 2).train()
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 64, (2, 16)), rng.integers(0, 64, (32,))
    onnx_model = anygrad.from_torch(module, torch.from_numpy(x), check=False)
    runs = {}
    for fold in ("1", "0"):
        monkeypatch.setenv("ANYGRAD_WGPU_CAST_FOLD", fold)
        m = anygrad.Model(onnx_model.graph.copy()).compile(
            "cross_entropy", anygrad.optim.SGD(lr=0.1, momentum=0.9), device="wgpu", precision="f16")
        losses = [m.train_on_batch(x, y) for _ in range(3)]
        casts = sum(st.kernel.name == "ew:Cast" for st in _train_exe(m).plan.steps)
        runs[fold] = (losses, m.state_dict(), casts)
    (folded, w_folded, n_folded), (kept, w_kept, n_kept) = runs["1"], runs["0"]
    assert n_folded < n_kept, (n_folded, n_kept)
    np.testing.assert_array_equal(folded, kept)
    for k, v in w_kept.items():
        np.testing.assert_array_equal(w_folded[k], v, err_msg=k)


def test_fit_warns_when_every_update_of_an_epoch_was_skipped(capsys):
    """A forward that overflows float16 at every step: nothing trains, read_metrics still reports
    the skipped updates, fit says so, and the metrics have no (always empty) valid_ column for them."""
    ours = nn.Sequential(nn.Linear(4, 3))
    ours.load_state_dict({"0.weight": np.full((3, 4), 100.0, np.float32), "0.bias": np.zeros(3, np.float32)})
    m = ours.to_model(input_shape=(None, 4)).compile("mse", anygrad.optim.SGD(lr=0.01), device="cpu",
                                                     precision="f16")
    before = m.state_dict()
    x, y = np.full((16, 4), 200.0, np.float32), np.zeros((16, 3), np.float32)
    with pytest.raises(ConfigError, match="fit's log must be a function"):
        m.fit((x, y), epochs=1, log="lines")
    result = m.fit((x, y), (x * 1e-3, y), epochs=1, batch_size=8)
    out = capsys.readouterr().out
    assert "every optimizer update of epoch 1 was skipped" in out and "precision='f32'" in out
    row = result.history[0].row()
    assert row["train_skipped_updates"] == 1.0 and "valid_skipped_updates" not in row
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    # log=None silences the lines, not the warning: it goes through Python's warnings
    with pytest.warns(RuntimeWarning, match="every optimizer update of epoch 1 was skipped"):
        m.fit((x, y), epochs=1, batch_size=8, log=None)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("device", ["cpu", "cpu,cpu"])
def test_overflowing_f16_steps_count_alike_on_one_and_two_devices_without_numpy_warnings(device):
    """Data parallelism's gradient programs gate their metric sums on the loss as one device's
    step does, and neither prints numpy's overflow warnings (inf gradients are expected there)."""
    import warnings
    ours = nn.Sequential(nn.Linear(4, 3))
    ours.load_state_dict({"0.weight": np.full((3, 4), 100.0, np.float32), "0.bias": np.zeros(3, np.float32)})
    m = ours.to_model(input_shape=(None, 4)).compile("mse", anygrad.optim.Adam(lr=0.01), device=device,
                                                     precision="f16")
    x, y = np.full((16, 4), 200.0, np.float32), np.zeros((16, 3), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(2):
            m.train_on_batch(x, y)
    assert m.read_metrics() == {"count": 0.0, "skipped_updates": 1.0}


def test_skipped_f16_updates_on_two_devices_are_no_divergence_at_a_checkpoint(tmp_path):
    """Data parallelism leaves a skipped update's inf gradient sums in accum.<param>: the epoch's
    checkpoint is written (those buffers are the loss scaler's, not the run's state going bad)
    and every epoch runs, as on one device."""
    ours = nn.Sequential(nn.Linear(4, 3))
    ours.load_state_dict({"0.weight": np.full((3, 4), 100.0, np.float32), "0.bias": np.zeros(3, np.float32)})
    m = ours.to_model(input_shape=(None, 4)).compile("mse", anygrad.optim.SGD(lr=0.01), device="cpu,cpu",
                                                     precision="f16")
    x, y = np.full((16, 4), 200.0, np.float32), np.zeros((16, 3), np.float32)
    with pytest.warns(RuntimeWarning, match="was skipped"):   # log=None: through Python's warnings
        result = m.fit((x, y), epochs=2, batch_size=8, artifacts_dir=str(tmp_path / "run"), log=None)
    assert result.diverged is None and [h.epoch for h in result.history] == [1, 2]
    assert len(list((tmp_path / "run").rglob("*.json"))) >= 2
