"""f16 products (kernels_gemm.half_math, Tiling.half): the shared GEMM tiles held as float16 and each
K tile's products summed in float16, then added into float32 accumulators.

Such a result differs from float32 math by the rounding of those partial sums, so the kernels are
held to the error bound of recursive summation in f16: KT * 2**-11 * sum(|a_i * b_i|) per output,
plus the f16 rounding of the stored result, against float64 on the same f16 operands. Training is
checked against PyTorch autocast and numpy's f16 (f32-product) losses over 20 steps.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from wgpu_util import wgpu_backend

import anygrad
from anygrad.backends.wgpu.kernels import gemm_wgsl, kernels_gemm
from anygrad.backends.wgpu.kernels.kernels_mma import uses_matrix_units
from anygrad.backends.wgpu.tuning import autotune, selftest
from anygrad.ir import Builder, Graph, TensorInfo

pytestmark = pytest.mark.wgpu
_F16, _F32 = 10, 1  # ONNX Cast codes
U16 = 2.0 ** -11  # float16's unit roundoff


@pytest.fixture
def half_backend(monkeypatch):
    """The test adapter as a GPU that passed the f16-product self-test (lavapipe, a software
    adapter, is never given f16 products on its own: it has no f16 ALUs to gain from)."""
    backend = wgpu_backend()
    if not backend.caps.has_f16:
        pytest.fail(f"{backend.adapter.summary} has no shader-f16 (lavapipe has it)")
    monkeypatch.setattr(backend, "caps", replace(backend.caps, f16_math=True, is_cpu=False))
    monkeypatch.delenv(kernels_gemm.F16_MATH_ENV, raising=False)
    return backend


def _matmul_graph(a_shape, b_shape, pins: dict, transpose_b: bool = False) -> Graph:
    """f32 a, b -> f16 -> MatMul (b transposed first: a vec4-along-k B operand) -> f32."""
    g = Graph(name="half-matmul")
    for name, shape in (("a", a_shape), ("b", b_shape)):
        g.inputs.append(name)
        g.info[name] = TensorInfo(np.dtype(np.float32), shape)
    bld = Builder(g, prefix="t")
    b16 = bld.op("Cast", ["b"], to=_F16)
    if transpose_b:
        b16 = bld.op("Transpose", [b16], perm=[1, 0])
    y = bld.op("MatMul", [bld.op("Cast", ["a"], to=_F16), b16], **pins)
    g.outputs = [bld.op("Cast", [y], to=_F32)]
    return g


HALF_TILINGS = {
    "shared4k8": {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 8},
    "shared8k16": {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16},
    "shared4k16p": {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 16, "_gemm_prefetch": 1},
    "shared8k16pu2": {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1,
                      "_gemm_unroll": 2},
    "shared8x16k16p": {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1,
                       "_gemm_tn": 16},
    "shared4k8pd": {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 8, "_gemm_prefetch": 2},
    "split2": {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 16, "_gemm_splits": 2},
}


@pytest.mark.parametrize("tiling", list(HALF_TILINGS))
@pytest.mark.parametrize("a_shape, b_shape, transpose_b", [((70, 64), (64, 36), False),
                                                            ((2, 33, 300), (20, 300), True)])
def test_f16_product_tilings_stay_within_the_f16_summation_bound(half_backend, tiling, a_shape, b_shape,
                                                                 transpose_b):
    pins = {**HALF_TILINGS[tiling], "_gemm_half": 1}
    kt = pins["_gemm_kt"]
    g = _matmul_graph(a_shape, b_shape, pins, transpose_b)
    rng = np.random.default_rng(3)
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32),
             "b": rng.standard_normal(b_shape).astype(np.float32)}
    exe = half_backend.compile(g)
    names = [st.kernel.name for st in exe.plan.steps]
    assert any(kernels_gemm.has_half_tiles(n) for n in names), names  # the f16-product tiling ran
    got = exe.run(feeds)[g.outputs[0]].astype(np.float64)
    a, b = (feeds[k].astype(np.float16).astype(np.float64) for k in "ab")
    b = b.T if transpose_b else b
    want = a @ b
    mass = np.abs(a) @ np.abs(b)
    err = np.abs(got - want)
    bound = kt * U16 * mass + U16 * np.abs(want) + 1e-6
    assert np.all(err <= bound), float(np.max(err / bound))
    # and it is f16 arithmetic, not f32's: the error is above what f32 products leave
    # (f16 output rounding alone), for some outputs
    assert np.max(err - U16 * np.abs(want)) > 0


def test_f32_operands_and_the_switch_keep_f32_products(half_backend, monkeypatch):
    """half_math: only float16 operands, only on a device whose self-test passed (caps.f16_math),
    and ANYGRAD_F16_MATH: 0 never, 1 always, auto (default) only where pinned (the autotuner)."""
    g = _matmul_graph((70, 64), (64, 36), {"_gemm_variant": "shared"})
    mm = next(n for n in g.nodes if n.op == "MatMul")
    from anygrad.ir import specialize
    g = specialize(g, {})
    caps = half_backend.caps
    assert not kernels_gemm.half_math(mm, g, caps)  # auto, unpinned
    monkeypatch.setenv(kernels_gemm.F16_MATH_ENV, "1")
    assert kernels_gemm.half_math(mm, g, caps)
    assert not kernels_gemm.half_math(mm, g, replace(caps, f16_math=False))
    monkeypatch.setenv(kernels_gemm.F16_MATH_ENV, "0")
    mm.attrs["_gemm_half"] = 1
    assert not kernels_gemm.half_math(mm, g, caps)
    monkeypatch.setenv(kernels_gemm.F16_MATH_ENV, "auto")
    assert kernels_gemm.half_math(mm, g, caps)
    g32 = Graph(name="f32")
    for name, shape in (("a", (70, 64)), ("b", (64, 36))):
        g32.inputs.append(name)
        g32.info[name] = TensorInfo(np.dtype(np.float32), shape)
    y = Builder(g32, prefix="t").op("MatMul", ["a", "b"], _gemm_half=1)
    g32.outputs = [y]
    g32 = specialize(g32, {})
    assert not kernels_gemm.half_math(g32.nodes[0], g32, caps)


def test_the_autotuner_offers_f16_products_for_f16_operands_only(half_backend):
    from anygrad.ir import specialize
    for dtype_cast, expect in ((True, True), (False, False)):
        g = Graph(name="tune")
        for name, shape in (("a", (256, 128)), ("b", (128, 256))):
            g.inputs.append(name)
            g.info[name] = TensorInfo(np.dtype(np.float32), shape)
        bld = Builder(g, prefix="t")
        ins = [bld.op("Cast", [v], to=_F16) for v in "ab"] if dtype_cast else ["a", "b"]
        g.outputs = [bld.op("MatMul", ins)]
        g = specialize(g, {})
        node = next(n for n in g.nodes if n.op == "MatMul")
        cands = autotune._candidates(node, g, half_backend.caps)
        halves = [pin for pin, kernels in cands if kernels_gemm.has_half_tiles(kernels[0].name)]
        assert bool(halves) == expect, [p for p, _ in cands]
        assert all(pin.get("_gemm_half") for pin in halves)


def test_the_f16_product_self_test_passes_here_and_catches_a_broken_kernel(half_backend, monkeypatch):
    assert selftest.f16_math_problem(half_backend) is None
    body = gemm_wgsl._shared_body

    def never_reset(*args, **kwargs):  # each K tile's partial sums added again at every later tile
        decl, lines = body(*args, **kwargs)
        return decl, [ln.split("; h")[0] + ";" if "vec4<f32>(h" in ln else ln for ln in lines]
    monkeypatch.setattr(gemm_wgsl, "_shared_body", never_reset)
    problem = selftest.f16_math_problem(half_backend)
    assert problem and "wrong" in problem and "f16 bound" in problem


def test_a_failed_f16_product_self_test_keeps_f16_training_with_f32_products(monkeypatch, capsys):
    backend = wgpu_backend()
    if not backend.caps.has_f16:
        pytest.fail(f"{backend.adapter.summary} has no shader-f16 (lavapipe has it)")
    monkeypatch.setattr(backend, "caps", replace(backend.caps, is_cpu=False))
    monkeypatch.setattr(backend.ctx, "f16_problem", "")
    monkeypatch.setattr(backend.ctx, "f16_math_problem", None)
    monkeypatch.setattr(selftest, "f16_math_problem", lambda b: "its float16-product matmul is wrong (test)")
    assert backend.check_precision("f16") == "f16"
    assert not backend.caps.f16_math
    assert "f16-product self-test failed" in capsys.readouterr().err
    monkeypatch.setattr(backend.ctx, "f16_math_problem", None)
    monkeypatch.setattr(selftest, "f16_math_problem", lambda b: None)
    assert backend.check_precision("f16") == "f16" and backend.caps.f16_math
    monkeypatch.setattr(backend, "caps", replace(backend.caps, f16_math=False))
    monkeypatch.setenv(kernels_gemm.F16_MATH_ENV, "0")
    monkeypatch.setattr(selftest, "f16_math_problem", lambda b: pytest.fail("ANYGRAD_F16_MATH=0 runs no self-test"))
    monkeypatch.setattr(backend.ctx, "f16_math_problem", None)
    assert backend.check_precision("f16") == "f16" and not backend.caps.f16_math


def _mlp(mod):
    return mod.Sequential(mod.Linear(64, 128), mod.ReLU(), mod.Linear(128, 128), mod.ReLU(), mod.Linear(128, 10))


def _cnn(mod):
    return mod.Sequential(mod.Conv2d(3, 32, 3, padding=1), mod.BatchNorm2d(32), mod.ReLU(), mod.MaxPool2d(2),
                          mod.Conv2d(32, 64, 3, padding=1), mod.ReLU(), mod.Flatten(), mod.Linear(64 * 4 * 4, 10))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_training_with_f16_products_follows_torch_autocast_for_20_steps(half_backend, monkeypatch, kind):
    """Every GEMM and conv (forward and both gradients) that takes the shared tiles uses f16
    products (ANYGRAD_F16_MATH=1); the losses stay within 1% of PyTorch autocast's (f32 products)
    over 20 steps, as close as numpy's f16 run is."""
    import torch
    from test_precision import _torch_autocast_losses

    from anygrad import nn
    monkeypatch.setenv(kernels_gemm.F16_MATH_ENV, "1")
    monkeypatch.setattr(half_backend.ctx, "f16_problem", "")
    rng = np.random.default_rng(0)
    make, shape, x = ((_mlp, (None, 64), rng.standard_normal((64, 64))) if kind == "mlp"
                      else (_cnn, (None, 3, 8, 8), rng.standard_normal((32, 3, 8, 8))))
    x = x.astype(np.float32)
    y = rng.integers(0, 10, len(x))
    torch.manual_seed(0)
    theirs, ours = make(torch.nn), make(nn)
    ours.load_state_dict({k: v.detach().numpy().copy() for k, v in theirs.state_dict().items()})
    model = ours.to_model(input_shape=shape)
    want = _torch_autocast_losses(theirs, kind, data=(x, y), lr=0.05)
    got = {}
    for device in ("cpu", half_backend):
        m = anygrad.Model(model.graph.copy()).compile("cross_entropy", anygrad.optim.SGD(lr=0.05, momentum=0.9),
                                                     device=device, precision="f16")
        got[device] = np.array([m.train_on_batch(x, y) for _ in range(20)])
    exe = next(e for k, e in m._programs.items() if k[0] == "train")
    # f16 products: the shared f16 tiles, or matrix units (f16 operands, f32 sums) where the adapter has
    # them (Dawn on a GPU: the rules put the CNN's second conv and its gradients there)
    halves = [st.kernel.name for st in exe.plan.steps
              if kernels_gemm.has_half_tiles(st.kernel.name) or uses_matrix_units(st.kernel)]
    assert len(halves) >= (5 if kind == "mlp" else 3), [st.kernel.name for st in exe.plan.steps]
    scale = np.abs(np.asarray(want)) + 0.05  # the CNN's loss goes to ~1e-3: relative to it plus a floor
    assert np.max(np.abs(got["cpu"] - want) / scale) < 1e-2
    assert np.max(np.abs(got[half_backend] - want) / scale) < 1e-2


@pytest.mark.slow
def test_a_tiny_gpt_with_f16_products_follows_torch_autocast(half_backend, monkeypatch):
    """Attention's batched matmuls (heads as a batch, K read transposed) and the MLP and head GEMMs
    with f16 products (ANYGRAD_F16_MATH=1), through the ONNX export of benchmarks/models.py's GPT
    decoder: 10 steps within 1% of PyTorch autocast."""
    import copy
    import sys
    from pathlib import Path

    import torch
    from test_precision import _torch_autocast_losses
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from models import _gpt_module
    monkeypatch.setenv(kernels_gemm.F16_MATH_ENV, "1")
    monkeypatch.setattr(half_backend.ctx, "f16_problem", "")
    torch.manual_seed(0)
    module = _gpt_module(96, 48, 128, 2, 1).train()  # head size 64, 48 tokens: tiled attention matmuls
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 96, (2, 48)), rng.integers(0, 96, (96,))
    want = _torch_autocast_losses(copy.deepcopy(module), "gpt", steps=10, data=(x, y))
    m = anygrad.from_torch(module, torch.from_numpy(x), check=False)
    m.compile("cross_entropy", anygrad.optim.SGD(lr=0.1, momentum=0.9), device=half_backend, precision="f16")
    got = [m.train_on_batch(x, y) for _ in range(10)]
    exe = next(e for k, e in m._programs.items() if k[0] == "train")
    halves = [st.kernel.name for st in exe.plan.steps if kernels_gemm.has_half_tiles(st.kernel.name)]
    assert len(halves) >= 8, [st.kernel.name for st in exe.plan.steps]
    np.testing.assert_allclose(got, want, rtol=1e-2)
