"""Subgroup-matrix GEMM and convolution kernels (kernels_mma.py) run on a Dawn adapter with matrix
units, each against numpy's float64 forward of the same float16 operands.

Every GEMM layout the lowering has (transposed operands, batches, broadcast batches, Gemm's
transA/transB, bias + activation epilogues, alpha, split-K) and the three convolution kernels
(forward, input gradient, weight gradient), on shapes that do not divide the tiles. Operands and
results are float16 in device memory (halfstore.stored_half, as the planner binds them); the
products accumulate in f32, so the error is about the f16 rounding of the stored result.

Skips where wgpudawn is not installed or no adapter lists chromium-experimental-subgroup-matrix
with f16 configs (CI, lavapipe: Dawn refuses lavapipe); runs on the device machine.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import anygrad.ops  # noqa: F401  (registers the op forwards)
from anygrad.backends.wgpu.kernels import kernels_conv, kernels_gemm  # noqa: F401  (register the lowerings)
from anygrad.backends.wgpu.kernels.halfstore import stored_half
from anygrad.backends.wgpu.kernels.kernel import LOWERINGS, AdapterCaps
from anygrad.backends.wgpu.kernels.kernels_mma import FEATURES, uses_matrix_units
from anygrad.backends.wgpu.kernels.matrix_units import MatrixConfig, MatrixUnits
from anygrad.ir import Graph, Node, TensorInfo, get_op, infer_node
from anygrad.ir.passes import resolve_attributes

pytestmark = pytest.mark.wgpu
F16 = np.dtype("float16")
U16 = 2.0 ** -11


@functools.cache
def dawn() -> tuple:
    """(wgpu module, device, caps) of the first Dawn adapter with f16 subgroup matrices."""
    from anygrad.backends.wgpu.device import implementation
    if not implementation.available("dawn"):
        pytest.skip("wgpudawn is not installed (pip install 'anygrad[dawn]')")
    impl = implementation.load("dawn")
    wgpu = impl.module
    for adapter in wgpu.gpu.enumerate_adapters_sync():
        if not all(f in adapter.features for f in FEATURES):
            continue
        raw = impl.matrix_configs(adapter)
        configs = tuple(MatrixConfig(int(c["m"]), int(c["n"]), int(c["k"]), str(c["component_type"]).lower(),
                                     str(c["result_component_type"]).lower()) for c in raw)
        if not any(c.operand == "f16" and c.result == "f32" for c in configs):
            continue
        lim = adapter.limits
        keys = ("max-compute-workgroup-storage-size", "max-storage-buffer-binding-size", "max-buffer-size",
                "max-compute-invocations-per-workgroup")
        from wgpudawn.backends.dawn import extras
        stamps = [f for f in ("timestamp-query",) if f in adapter.features]   # benchmarks/gemm_mma.py's timing
        device = extras.request_device_sync(adapter, required_features=list(FEATURES) + stamps,
                                            required_limits={k: lim[k] for k in keys})
        size = max(impl.subgroup_sizes(adapter)) or 32
        caps = AdapterCaps(max_storage_binding_size=int(lim["max-storage-buffer-binding-size"]),
                           max_workgroup_storage=int(lim["max-compute-workgroup-storage-size"]),
                           max_invocations_per_workgroup=int(lim["max-compute-invocations-per-workgroup"]),
                           has_subgroups=True, has_f16=True, is_cpu=False,
                           adapter_facts=MatrixUnits(configs, size, True, True))
        return wgpu, device, caps
    pytest.skip("no Dawn adapter with f16 subgroup matrices (chromium-experimental-subgroup-matrix)")


def run_kernels(kernels, graph: Graph, feeds: dict[str, np.ndarray], outs: list[str]) -> dict[str, np.ndarray]:
    """Bind (f16 values as f16, others f32), dispatch in order, read back `outs` in their dtype."""
    wgpu, dev, _ = dawn()
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST

    def dtype(v: str) -> np.dtype:
        info = graph.info.get(v)
        return F16 if info is not None and info.dtype == F16 else np.dtype(np.float32)
    bufs = {}
    for name, arr in feeds.items():
        data = np.ascontiguousarray(arr, dtype=dtype(name)).reshape(-1).tobytes()
        bufs[name] = dev.create_buffer_with_data(data=data + bytes((-len(data)) % 16), usage=usage)
    sizes: dict[str, int] = {}
    for k in kernels:   # a scratch several kernels declare (the phases' split-K) takes the largest, as planned
        for s in k.scratch:
            sizes[s.name] = max(sizes.get(s.name, 16), 4 * s.elements)
    for name, size in sizes.items():
        bufs[name] = dev.create_buffer(size=size, usage=usage)
    for name in outs:
        n = int(np.prod(graph.info[name].shape)) * dtype(name).itemsize
        bufs[name] = dev.create_buffer_with_data(data=b"\xff" * (n + (-n) % 16), usage=usage)  # NaN
    enc = dev.create_command_encoder()
    for k in kernels:
        module = dev.create_shader_module(code=k.wgsl)
        pipe = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": k.entry})
        bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
            {"binding": i, "resource": {"buffer": bufs[v], "offset": 0, "size": bufs[v].size}}
            for i, v in enumerate(list(k.reads) + list(k.writes))])
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(*k.workgroups)
        cp.end()
    dev.queue.submit([enc.finish()])
    return {name: np.frombuffer(dev.queue.read_buffer(bufs[name]), dtype(name))[:int(np.prod(graph.info[name].shape))]
            .reshape(graph.info[name].shape).copy() for name in outs}


def check_mma(op: str, inputs: list[np.ndarray | None], attrs: dict, pin: dict | None = None):
    """Lower one node with float16 operands on matrix units, run it on Dawn, compare to the op's
    numpy forward in float64 on the same f16 values: |err| <= 2 u |y| + 8 u 2^-8 sum |a b| style
    bound, i.e. f16 rounding of the result plus f32 accumulation."""
    _, _, caps = dawn()
    g = Graph()
    names = []
    halves = [None if a is None else np.asarray(a, np.float32).astype(F16) for a in inputs]
    for i, a in enumerate(halves):
        if a is None:
            names.append("")
            continue
        names.append(f"x{i}")
        g.info[f"x{i}"] = TensorInfo(F16, tuple(a.shape))
    node = Node(op, names, ["y0"], {**attrs, "_gemm_variant": "mma", **(pin or {})}, name="n")
    g.nodes = [node]
    wide = [None if a is None else a.astype(np.float64) for a in halves]
    if op == "MatMul":   # the layout attrs (gemm_layout.py) are the backend's own: no op forward knows them
        want, mag = _matmul(wide, attrs), _matmul([np.abs(a) for a in wide], attrs)
        g.info["y0"] = TensorInfo(F16, want.shape)
    else:
        infer_node(g, node)
        g.info["y0"] = TensorInfo(F16, g.info["y0"].shape)
        want = np.asarray(get_op(op).run(node, wide)[0], np.float64)
        mag = np.asarray(get_op(op).run(node, [None if a is None else np.abs(a) for a in wide])[0], np.float64)
    if attrs.get("_epilogue") == "relu":
        want = np.maximum(want, 0)
    kernels = stored_half(LOWERINGS[op](node, resolve_attributes(g), caps), g)
    assert any(uses_matrix_units(k) for k in kernels), [k.name for k in kernels]
    got = run_kernels(kernels, g, {n: a for n, a in zip(names, halves) if n}, ["y0"])["y0"].astype(np.float64)
    bound = 2 * U16 * np.abs(want) + 2.0 ** -16 * mag + 1e-6
    bad = np.abs(got - want) > bound
    assert not bad.any(), (f"{op} {attrs} {pin}: {bad.sum()} of {bad.size} outside the bound, worst "
                           f"{np.max(np.abs(got - want) - bound):.3g}; kernels {[k.name for k in kernels]}")
    return kernels


def _matmul(ab: list[np.ndarray], attrs: dict) -> np.ndarray:
    """MatMul with gemm_layout's operand perms, result perm and alpha, in float64."""
    a, b = (x if attrs.get(k) is None else np.transpose(x, attrs[k]) for x, k in zip(ab, ("_permA", "_permB")))
    y = np.matmul(a, b) * attrs.get("_alpha", 1.0)
    return y if attrs.get("_permY") is None else np.transpose(y, attrs["_permY"])


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


PLANS = {"rules": {}, "b2t64": {"_gemm_block": 2, "_gemm_threads": 64}, "b4k64": {"_gemm_block": 4, "_gemm_kt": 64},
         "b2t256": {"_gemm_block": 2, "_gemm_threads": 256}, "prefetch": {"_gemm_prefetch": 1},
         "b2t64p": {"_gemm_block": 2, "_gemm_threads": 64, "_gemm_prefetch": 1},
         "double": {"_gemm_prefetch": 2, "_gemm_threads": 128}, "b2t64pd": {"_gemm_block": 2, "_gemm_threads": 64, "_gemm_prefetch": 2}}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("sa,sb,attrs", [
    ((70, 100), (100, 36), {}),                            # edges on every axis
    ((129, 64), (64, 130), {}),
    ((2, 33, 48), (48, 20), {}),                           # batch folds into M
    ((3, 17, 40), (3, 40, 24), {}),                        # batched
    ((2, 1, 9, 32), (3, 32, 8), {}),                       # broadcast batches
    ((50, 72), (40, 72), {"_permB": [1, 0]}),              # x @ W.T
    ((72, 50), (72, 40), {"_permA": [1, 0]}),              # dW = x.T @ dy
    ((2, 6, 40, 16), (2, 6, 16, 40), {"_permY": [0, 2, 1, 3]}),  # attention's head merge
    ((64, 300), (300, 48), {"_alpha": 0.125}),
])
def test_matmul_layouts(sa, sb, attrs, plan):
    check_mma("MatMul", [rnd(*sa, seed=1), rnd(*sb, seed=2)], attrs, PLANS[plan])


def _numpy_view(base: np.ndarray, view: np.ndarray) -> tuple:
    """(shape, strides, offset) in elements of a numpy view of `base`, as gemm_layout writes them."""
    item = base.itemsize
    offset = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
    return tuple(view.shape), tuple(st // item for st in view.strides), int(offset)


@pytest.mark.parametrize("plan", ["rules", "b2t64", "prefetch", "double"])
@pytest.mark.parametrize("heads,dh", [(2, 32), (3, 24)])
def test_matmul_reads_strided_views_and_stores_through_one(heads, dh, plan):
    """nn.MultiheadAttention's scores on matrix units as fold_views and fold_result_layouts leave
    them: q and k read as strided views of one (L, B, 3d) projection (k^T through `_permB`), the
    (B, H, L, L) scores stored transposed into an (L, B, H, L) buffer (`_intoY`), scaled by
    `_alpha`; against float64 on the same f16 values. Head dims of 24 break the vec4 loads."""
    _, _, caps = dawn()
    L, B = 40, 2
    d = heads * dh
    proj = rnd(L, B, 3 * d, seed=7).astype(F16)
    split = proj.reshape(L, B, 3, heads, dh)
    q, k = split[:, :, 0].transpose(1, 2, 0, 3), split[:, :, 1].transpose(1, 2, 0, 3)   # (B, H, L, D)
    stored = np.zeros((L, B, heads, L), F16)
    into = _numpy_view(stored, stored.transpose(1, 2, 0, 3))
    g = Graph()
    g.info["x"] = TensorInfo(F16, proj.shape)
    g.info["y"] = TensorInfo(F16, stored.shape)
    node = Node("MatMul", ["x", "x"], ["y"], {"_viewA": _numpy_view(proj, q), "_viewB": _numpy_view(proj, k),
                                              "_permB": [0, 1, 3, 2], "_alpha": 0.125, "_intoY": into,
                                              "_gemm_variant": "mma", **PLANS[plan]}, name="qk")
    g.nodes = [node]
    kernels = stored_half(LOWERINGS["MatMul"](node, resolve_attributes(g), caps), g)
    assert any(uses_matrix_units(kern) for kern in kernels), [kern.name for kern in kernels]
    got = run_kernels(kernels, g, {"x": proj}, ["y"])["y"].astype(np.float64)
    scores = np.matmul(q.astype(np.float64), np.swapaxes(k.astype(np.float64), -1, -2)) * 0.125
    want = scores.transpose(2, 0, 1, 3)
    mag = np.matmul(np.abs(q.astype(np.float64)), np.abs(np.swapaxes(k, -1, -2).astype(np.float64))).transpose(2, 0, 1, 3)
    bound = 2 * U16 * np.abs(want) + 2.0 ** -16 * mag + 1e-6
    assert not (np.abs(got - want) > bound).any(), float(np.max(np.abs(got - want) - bound))


@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_transposes_bias_and_relu(ta, tb):
    m, k, n = 45, 70, 66
    a = rnd(k, m, seed=3) if ta else rnd(m, k, seed=3)
    b = rnd(n, k, seed=4) if tb else rnd(k, n, seed=4)
    check_mma("Gemm", [a, b, rnd(n, seed=5)], {"transA": ta, "transB": tb, "_epilogue": "relu"})


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("m,k,n", [(40, 2000, 24),
                                   (256, 1024, 512),   # whole tiles
                                   (200, 1024, 300)])  # whole tiles and edges
def test_split_k(m, k, n, splits, prefetch):
    # pinned double tiles of the 8-subgroup plans do not fit 48 KiB at the default K tile: 4 subgroups
    wide = {"_gemm_threads": 128} if prefetch == 2 and m > 64 else {}
    kernels = check_mma("MatMul", [rnd(m, k, seed=6), rnd(k, n, seed=7)], {},
                        {"_gemm_splits": splits, "_gemm_prefetch": prefetch, **wide})
    assert any("splitK" in k.name for k in kernels)


CONVS = [((2, 8, 13, 11), (16, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
         ((2, 16, 12, 12), (24, 16, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
         ((1, 32, 7, 9), (40, 32, 1, 1), {}),
         ((2, 12, 10, 10), (20, 6, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
         # a ResNet stem: 3 channels (the plain order), its pixel decode hoisted (b_elh)
         ((2, 3, 22, 20), (64, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]})]


# channels a multiple of the K tile: the tap-major form (one tap decode a K tile, kernels_mma.taps_fit)
BY_TAP = [((2, 32, 9, 10), (64, 32, 3, 3), {"pads": [1, 1, 1, 1]}),
          ((2, 32, 12, 11), (32, 32, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
          ((1, 64, 6, 7), (64, 32, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
          ((2, 32, 8, 8), (32, 32, 2, 2), {})]


def _explicit(xs, ws, attrs):
    from anygrad.ops.nn import window
    win = window(Node("Conv", [], ["y"], attrs), xs[2:], ws[2:])
    return {**win.attrs(), "group": attrs.get("group", 1)}, win.out


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("xs,ws,attrs", CONVS)
def test_conv_forward(xs, ws, attrs, prefetch):
    check_mma("Conv", [rnd(*xs, seed=8), rnd(*ws, seed=9), rnd(ws[0], seed=10)], {**attrs, "_epilogue": "relu"},
              {"_gemm_prefetch": prefetch})


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("xs,ws,attrs", CONVS)
def test_conv_input_gradient(xs, ws, attrs, prefetch):
    explicit, out = _explicit(xs, ws, attrs)
    check_mma("ConvGradInput", [rnd(xs[0], ws[0], *out, seed=11), rnd(*ws, seed=12)],
              {**explicit, "input_shape": list(xs)}, {"_gemm_prefetch": prefetch})


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("xs,ws,attrs", BY_TAP)
def test_convs_by_tap(xs, ws, attrs, prefetch):
    pin = {"_gemm_prefetch": prefetch}
    fwd = check_mma("Conv", [rnd(*xs, seed=15), rnd(*ws, seed=16), rnd(ws[0], seed=17)], attrs, pin)
    explicit, out = _explicit(xs, ws, attrs)
    grad = check_mma("ConvGradInput", [rnd(xs[0], ws[0], *out, seed=18), rnd(*ws, seed=19)],
                     {**explicit, "input_shape": list(xs)}, pin)
    for ks in (fwd, grad):
        assert "WeightsByTap" in [k.name for k in ks] and any("b_at(" in k.wgsl for k in ks if uses_matrix_units(k))
    wgrad = check_mma("ConvGradWeight", [rnd(xs[0], ws[0], *out, seed=20), rnd(*xs, seed=21)],
                      {**explicit, "weight_shape": list(ws)}, pin)
    assert any("b_tg4(" in k.wgsl for k in wgrad if uses_matrix_units(k))


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("xs,ws,attrs", BY_TAP)
def test_convs_by_tap_with_more_columns_than_invocations(xs, ws, attrs, prefetch):
    """One subgroup of 32 on 64-column tiles: each invocation keeps two columns of B's tile by
    tap (kernels_mma._stage_b_taps), as Intel's 64-invocation workgroups do on 128 columns."""
    pin = {"_gemm_prefetch": prefetch, "_gemm_threads": 32}
    fwd = check_mma("Conv", [rnd(*xs, seed=15), rnd(*ws, seed=16), rnd(ws[0], seed=17)], attrs, pin)
    explicit, out = _explicit(xs, ws, attrs)
    grad = check_mma("ConvGradInput", [rnd(xs[0], ws[0], *out, seed=18), rnd(*ws, seed=19)],
                     {**explicit, "input_shape": list(xs)}, pin)
    for ks in (fwd, grad):
        assert any("tb_base[1] = b_at(" in k.wgsl for k in ks if uses_matrix_units(k)), [k.name for k in ks]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("xs,ws,attrs", CONVS)
def test_conv_weight_gradient(xs, ws, attrs, prefetch):
    explicit, out = _explicit(xs, ws, attrs)
    check_mma("ConvGradWeight", [rnd(xs[0], ws[0], *out, seed=13), rnd(*xs, seed=14)],
              {**explicit, "weight_shape": list(ws)}, {"_gemm_prefetch": prefetch})


# -- whole training steps on Dawn against PyTorch autocast --------------------------------------------
def _gpt_and_cnn(kind: str):
    """(torch module, one batch, flat logits) of a model whose GEMMs are large enough for the
    rules to put them on matrix units (matrix_units.MIN_FLOPS_BY_DEFAULT)."""
    import sys
    from pathlib import Path

    import torch
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    if kind == "gpt":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from models import _gpt_module
        x = rng.integers(0, 256, (8, 32))
        return _gpt_module(256, 32, 128, 4, 2).train(), (x, rng.integers(0, 256, (8 * 32,)))
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
                                 torch.nn.Conv2d(32, 64, 3, padding=1, stride=2), torch.nn.ReLU(),
                                 torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    return module.train(), (rng.standard_normal((16, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 16))


@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_f16_training_on_matrix_units_follows_torch_autocast(kind):
    """10 SGD-momentum steps under precision="f16" on Dawn, with the GEMMs and convolutions on
    subgroup matrices, against torch.autocast(float16) + GradScaler: test_precision.py's
    tolerance for a model with BatchNorm (2e-3 relative or 1e-4 absolute)."""
    import copy

    import torch
    from test_precision import _torch_autocast_losses, _train_exe
    from wgpu_util import dawn_backend

    import anygrad
    dawn()   # skips without f16 subgroup matrices
    backend = dawn_backend()
    module, (x, y) = _gpt_and_cnn(kind)
    want = _torch_autocast_losses(copy.deepcopy(module), kind, steps=10, data=(x, y))
    m = anygrad.from_torch(module, torch.from_numpy(x), check=False)
    m.compile("cross_entropy", anygrad.optim.SGD(lr=0.1, momentum=0.9), device=backend, precision="f16")
    got = [m.train_on_batch(x, y) for _ in range(10)]
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-4)
    on_units = [st.kernel.name for st in _train_exe(m).plan.steps if uses_matrix_units(st.kernel)]
    assert len(on_units) >= 3, [st.kernel.name for st in _train_exe(m).plan.steps]


def test_timestamps_are_not_quantized():
    """Dawn rounds timestamps down to 2^16 ns unless its `timestamp_quantization` toggle is off
    (implementation.DAWN_OFF_TOGGLES): every profiled kernel then read 0, 65.5 or 131 us. Raw
    timestamps around empty passes are multiples of 2^16 only by chance (1 in 65,536 each)."""
    from anygrad.backends.wgpu.tuning.profiling import FEATURE as STAMPS
    from anygrad.backends.wgpu.tuning.profiling import TimestampProfiler
    _, dev, _ = dawn()
    if STAMPS not in dev.features:
        pytest.skip("this Dawn adapter has no timestamp-query")
    prof = TimestampProfiler(dev, [f"pass{i}" for i in range(8)])
    enc = dev.create_command_encoder()
    prof.encode_runs(enc, [[] for _ in range(8)])
    dev.queue.submit([enc.finish()])
    stamps = prof._read()[:16]
    assert (stamps > 0).all() and (stamps % (1 << 16) != 0).any(), stamps
