"""GEMM-family WGSL kernels (MatMul, Gemm, Conv and its gradients, pools) against the numpy op forwards.

Each lowering runs through a minimal runner (buffers from numpy, one pipeline per Kernel, one submit),
in both the register-only and the workgroup-memory variant, on shapes that do not divide the tiles.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wgpu_util import no_adapter

import anygrad.ops  # noqa: F401  (registers the op forwards)
from anygrad.backends.wgpu.kernels import gemm_spec, kernels_conv, kernels_gemm  # noqa: F401  (lowerings)
from anygrad.backends.wgpu.kernels.kernel import LOWERINGS, AdapterCaps
from anygrad.backends.wgpu.tuning.autotune import CANDIDATES
from anygrad.ir import Graph, Node, TensorInfo, get_op, infer_node
from anygrad.ir.passes import resolve_attributes

wgpu = pytest.importorskip("wgpu")
pytestmark = pytest.mark.wgpu

F32 = np.dtype("float32")
CPU = AdapterCaps(is_cpu=True)
GPU = AdapterCaps(is_cpu=False)
VARIANTS = [{"_gemm_variant": "register"}, {"_gemm_variant": "shared"},
            {"_gemm_variant": "register", "_gemm_block": 8}, {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16},
            {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 8, "_gemm_prefetch": 1},
            {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1, "_gemm_unroll": 2},
            {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1, "_gemm_tn": 16},
            # two workgroup tiles (Tiling.double): within the default 16 KiB of workgroup storage
            {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 8, "_gemm_prefetch": 2},
            {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 8, "_gemm_prefetch": 2}]
VARIANT_IDS = ["register4", "shared4", "register8", "shared8k16", "shared4k8p", "shared8k16pu2", "shared8x16k16p",
               "shared4k8pd", "shared8k8pd"]   # the rules prefetch GEMMs, not convs


@functools.cache
def _device():
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    if adapter is None:
        no_adapter()  # skips; fails under ANYGRAD_REQUIRE_WGPU=1
    # the adapter's own workgroup storage (lavapipe: 32 KiB), so two-tile candidates run too
    storage = "max-compute-workgroup-storage-size"
    return adapter.request_device_sync(required_limits={storage: adapter.limits[storage]})


def run_kernels(kernels, feeds: dict[str, np.ndarray], sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Bind, dispatch (one pass per kernel, one submit), read back every written value in `sizes`."""
    dev = _device()
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    bufs = {}
    for name, arr in feeds.items():
        data = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
        data = np.concatenate([data, np.zeros((-data.size) % 4, np.float32)]) if data.size % 4 else data
        bufs[name] = dev.create_buffer_with_data(data=data.tobytes() if data.size else bytes(16), usage=usage)
    for k in kernels:
        for s in k.scratch:
            bufs[s.name] = dev.create_buffer(size=max(16, 4 * s.elements), usage=usage)
    for name, n in sizes.items():  # NaN where nothing is written: a reused buffer holds old values
        bufs[name] = dev.create_buffer_with_data(data=np.full(max(4, n + (-n) % 4), np.nan, np.float32).tobytes(),
                                                 usage=usage)
    enc = dev.create_command_encoder()
    for k in kernels:
        module = dev.create_shader_module(code=k.wgsl)
        pipe = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": k.entry})
        names = list(k.reads) + list(k.writes)
        bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
            {"binding": i, "resource": {"buffer": bufs[v], "offset": 0, "size": bufs[v].size}}
            for i, v in enumerate(names)])
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(*k.workgroups)
        cp.end()
    dev.queue.submit([enc.finish()])
    return {name: np.frombuffer(dev.queue.read_buffer(bufs[name]), np.float32)[:n].copy()
            for name, n in sizes.items()}


def check_op(op: str, inputs: list[np.ndarray | None], attrs: dict, caps: AdapterCaps = CPU,
             rtol: float = 1e-4, atol: float = 1e-4, n_outputs: int = 1):
    """Lower one node, run it on the adapter, compare to the op's numpy forward."""
    g = Graph()
    names = []
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        names.append(f"x{i}")
        g.info[f"x{i}"] = TensorInfo(F32, tuple(a.shape))
    node = Node(op, names, [f"y{k}" for k in range(n_outputs)], dict(attrs), name="n")
    g.nodes = [node]
    infer_node(g, node)
    want = get_op(op).run(node, [None if a is None else a for a in inputs])
    if attrs.get("_epilogue") == "relu":
        want = [np.maximum(w, 0) for w in want]
    kernels = LOWERINGS[op](node, resolve_attributes(g), caps)
    feeds = {f"x{i}": a for i, a in enumerate(inputs) if a is not None}
    sizes = {f"y{k}": int(np.prod(g.info[f"y{k}"].shape)) for k in range(n_outputs)}
    got = run_kernels(kernels, feeds, sizes)
    for k in range(n_outputs):
        w = np.asarray(want[k], np.float32)
        np.testing.assert_allclose(got[f"y{k}"].reshape(w.shape), w, rtol=rtol, atol=atol,
                                   err_msg=f"{op} {attrs} {[None if a is None else a.shape for a in inputs]}")
    return kernels


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- MatMul / Gemm --------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("sa,sb", [
    ((5, 7), (7, 3)), ((8, 12), (12, 16)), ((33, 17), (17, 29)), ((1, 4), (4, 1)),
    ((7,), (7, 5)), ((6, 9), (9,)), ((9,), (9,)),
    ((2, 3, 5, 8), (8, 4)), ((2, 1, 3, 4), (5, 4, 6)), ((3, 6, 4), (3, 4, 8)), ((4, 5), (2, 5, 3)),
])
def test_matmul(sa, sb, variant):
    check_op("MatMul", [rnd(*sa, seed=1), rnd(*sb, seed=2)], {**variant})


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("m,k,n", [(5, 7, 3), (16, 12, 8), (19, 33, 10)])
def test_gemm(m, k, n, ta, tb, variant):
    a = rnd(*((k, m) if ta else (m, k)), seed=3)
    b = rnd(*((n, k) if tb else (k, n)), seed=4)
    check_op("Gemm", [a, b, rnd(n, seed=5)], {"transA": ta, "transB": tb, "alpha": 0.5, "beta": 2.0,
                                            **variant})


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("cshape", [None, (1,), (6, 1), (6, 9), (9,)])
def test_gemm_bias_broadcast_and_relu(cshape, variant):
    c = None if cshape is None else rnd(*cshape, seed=6)
    kernels = check_op("Gemm", [rnd(6, 11, seed=7), rnd(9, 11, seed=8), c],
                       {"transB": 1, **variant})
    assert len(kernels) == 1
    node = Node("Gemm", ["x0", "x1"] + (["x2"] if c is not None else []), ["y0"], {"transB": 1, "_epilogue": "relu"})
    g = Graph()
    g.info.update({"x0": TensorInfo(F32, (6, 11)), "x1": TensorInfo(F32, (9, 11)),
                   "y0": TensorInfo(F32, (6, 9))})
    if c is not None:
        g.info["x2"] = TensorInfo(F32, cshape)
    a, b = rnd(6, 11, seed=7), rnd(9, 11, seed=8)
    feeds = {"x0": a, "x1": b} | ({"x2": c} if c is not None else {})
    got = run_kernels(LOWERINGS["Gemm"](node, resolve_attributes(g), CPU), feeds, {"y0": 54})["y0"].reshape(6, 9)
    want = a @ b.T + (c if c is not None else 0)
    np.testing.assert_allclose(got, np.maximum(want, 0), rtol=1e-4, atol=1e-4)


def test_long_k_weight_gradient_takes_128x128_split_tiles(monkeypatch):
    """A weight gradient's long K (tokens or pixels) gets 8x8 blocks (128x128 tiles) split over K
    even when M x N is small; scaled down: LONG_K 512, K 1200 (transA, as dW = X^T dY)."""
    monkeypatch.setattr(gemm_spec, "LONG_K", 512)
    t = gemm_spec.choose_tiling(128, 256, 1200, GPU)
    assert (t.variant, t.tm, t.bm, t.bn) == ("shared", 8, 128, 128)
    kernels = check_op("Gemm", [rnd(1200, 128, seed=3), rnd(1200, 256, seed=4), rnd(256, seed=5)],
                       {"transA": 1}, GPU, rtol=1e-3, atol=1e-3)
    assert "shared 128x128" in kernels[0].name and "splitK" in kernels[0].name
    assert gemm_spec.choose_tiling(128, 256, 511, GPU).tm == 4
    # without split-K, with a grid that fills the GPU, or with part tiles, 64x64 tiles stay
    assert gemm_spec.choose_tiling(128, 256, 1200, GPU, split=False).tm == 4
    assert gemm_spec.choose_tiling(128, 256, 1200, GPU, batch=512).tm == 4
    assert gemm_spec.choose_tiling(192, 768, 1200, GPU).tm == 4


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 40), n=st.integers(1, 40), batch=st.sampled_from([(), (2,), (2, 1)]),
       variant=st.sampled_from(VARIANTS))
def test_matmul_random_shapes(m, k, n, batch, variant):
    check_op("MatMul", [rnd(*batch, m, k, seed=m), rnd(*batch[:1], k, n, seed=n)], {**variant})


@pytest.mark.parametrize("caps", [CPU, GPU], ids=["cpu", "gpu"])
def test_matmul_split_k(caps):
    """Long K, small output: the split-K GEMM + reduce pair."""
    kernels = check_op("MatMul", [rnd(6, 2050, seed=9), rnd(2050, 5, seed=10)], {}, caps, rtol=1e-3, atol=1e-3)
    assert len(kernels) == 2 and kernels[0].scratch


@pytest.mark.parametrize("n,splits", [(12, 3), (16, 5), (7, 4)])
def test_split_k_reduce_applies_alpha_bias_and_relu(n, splits):
    """The reduce sums the partials, then applies alpha, the bias and the epilogue, as the
    unsplit Gemm does, at widths that are and are not a multiple of 4."""
    pin = {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 16, "_gemm_splits": splits}
    kernels = check_op("Gemm", [rnd(6, 704, seed=60), rnd(n, 704, seed=61), rnd(n, seed=62)],
                       {"transB": 1, "alpha": 0.5, "_epilogue": "relu", **pin}, GPU, rtol=1e-4, atol=1e-4)
    assert len(kernels) == 2 and kernels[0].scratch and f"splitK {splits}" in kernels[0].name
    kernels = check_op("MatMul", [rnd(2, 6, 704, seed=63), rnd(704, n, seed=64)], pin, GPU, rtol=1e-4, atol=1e-4)
    assert len(kernels) == 2 and kernels[0].scratch


def _lowered(op: str, shapes: list[tuple], attrs: dict, caps: AdapterCaps):
    g = Graph()
    for i, shape in enumerate(shapes):
        g.info[f"x{i}"] = TensorInfo(F32, shape)
    node = Node(op, [f"x{i}" for i in range(len(shapes))], ["y0"], dict(attrs), name="n")
    g.nodes = [node]
    infer_node(g, node)
    return LOWERINGS[op](node, resolve_attributes(g), caps)


def test_many_splits_reduce_by_tree_only_outputs_too_few_to_fill_the_gpu():
    """64 splits of 6 x 5 outputs: a workgroup per output sums them (run here); of 2048 x 256
    outputs (GPT b128's head weight gradient): one invocation per output, reading neighbouring
    partials (the tree's strided reads took 5.3 ms of a 14.8 ms step on an H200)."""
    pin = {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 16, "_gemm_splits": 64}
    small = check_op("MatMul", [rnd(6, 8192, seed=65), rnd(8192, 5, seed=66)], pin, GPU, rtol=1e-3, atol=1e-3)
    assert "splitK 64" in small[0].name and "var<workgroup> part" in small[1].wgsl
    large = _lowered("MatMul", [(2048, 8192), (8192, 256)], pin, GPU)
    assert "splitK 64" in large[0].name and "var<workgroup>" not in large[1].wgsl
    assert math.prod(large[1].workgroups) * 64 >= 2048 * 256


# -- convolutions -------------------------------------------------------------------------------
CONVS = [  # x shape, w shape, attrs
    ((2, 3, 7, 6), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 3, 9, 8), (5, 3, 3, 2), {"strides": [2, 1], "dilations": [2, 1], "pads": [1, 0, 2, 1]}),
    ((1, 4, 6, 5), (6, 2, 3, 2), {"group": 2, "strides": [1, 2]}),
    ((2, 3, 6, 7), (3, 1, 3, 3), {"group": 3, "pads": [1, 1, 1, 1], "strides": [2, 2]}),   # depthwise
    ((1, 3, 5, 6), (6, 1, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}),                    # channel multiplier
    ((2, 8, 4, 4), (5, 8, 1, 1), {}),                                                    # 1x1, P % 4 == 0
    ((2, 3, 3, 5), (4, 3, 1, 1), {}),                                                    # 1x1, odd P
    ((2, 4, 5, 5), (8, 4, 1, 1), {"strides": [2, 2]}),                                   # strided 1x1
    ((2, 3, 10), (4, 3, 3), {"strides": [2], "pads": [1, 2]}),                           # 1-D
    ((2, 2, 5, 6), (3, 2, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((3, 4, 8, 8), (8, 4, 2, 2), {"strides": [2, 2]}),                                   # K % 4 == 0
]


def _conv_ids():
    return [f"{x}-{w}-{a}" for x, w, a in CONVS]


def _explicit(xs, ws, attrs):
    """Explicit attributes (auto_pad resolved), as the Conv gradient rule emits them."""
    from anygrad.ops.nn import window
    win = window(Node("Conv", [], ["y"], attrs), xs[2:], ws[2:])
    return {**win.attrs(), "group": attrs.get("group", 1)}, win.out


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("xs,ws,attrs", CONVS, ids=_conv_ids())
def test_conv(xs, ws, attrs, variant):
    check_op("Conv", [rnd(*xs, seed=11), rnd(*ws, seed=12), rnd(ws[0], seed=13)],
             {**attrs, **variant, "_epilogue": "relu"})
    check_op("Conv", [rnd(*xs, seed=11), rnd(*ws, seed=12)], {**attrs, **variant})


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("xs,ws,attrs", CONVS, ids=_conv_ids())
def test_conv_grad_input(xs, ws, attrs, variant):
    explicit, out = _explicit(xs, ws, attrs)
    dy = rnd(xs[0], ws[0], *out, seed=14)
    check_op("ConvGradInput", [dy, rnd(*ws, seed=15)],
             {**explicit, "input_shape": list(xs), **variant})


@pytest.mark.parametrize("attrs,side", [({"pads": [1, 1, 1, 1]}, 16), ({"strides": [2, 2], "pads": [1, 0, 1, 0]}, 32),
                                        ({}, 18)], ids=["pad1", "stride2", "inside"])
@pytest.mark.parametrize("cout,block", [(32, 4), (128, 8)])
def test_conv_pixel_decode_hoisted_out_of_the_k_loop(attrs, side, cout, block):
    """Where each invocation copies one im2col column for the whole K loop (the workgroup's
    invocations a multiple of the tile width), that column's pixel decode runs once before the
    loop (b_elh); the forward conv and the input gradient against numpy, padded, strided and not."""
    import re
    xs, ws = (2, 5, side, side), (cout, 5, 3, 3)
    variant = {"_gemm_variant": "shared", "_gemm_block": block, "_gemm_kt": 16}
    kernels = check_op("Conv", [rnd(*xs, seed=21), rnd(*ws, seed=22), rnd(cout, seed=23)], {**attrs, **variant}, GPU)
    explicit, out = _explicit(xs, ws, attrs)
    grad = check_op("ConvGradInput", [rnd(xs[0], ws[0], *out, seed=24), rnd(*ws, seed=25)],
                    {**explicit, "input_shape": list(xs), **variant}, GPU)
    hoisted = 0
    for k in (kernels[0], grad[0]):
        bm, bn = map(int, re.search(r"shared (\d+)x(\d+)", k.name).groups())
        whole = (bm // block) * (bn // block) % bn == 0
        assert ("b_elh(bt, k0 + kk" in k.wgsl and "let c = nb *" in k.wgsl) == whole, k.name
        hoisted += whole
    assert hoisted >= 1


@pytest.mark.parametrize("xs,ws,attrs", [
    ((2, 8, 12, 12), (16, 8, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),     # ResNet's 3x3 downsampling
    ((2, 16, 9, 11), (8, 16, 1, 1), {"strides": [2, 2]}),                          # 1x1: 3 of 4 phases empty
    ((1, 4, 13, 10), (6, 2, 3, 2), {"strides": [3, 2], "pads": [2, 0, 1, 1], "group": 2}),
    ((2, 3, 7, 9), (4, 3, 5, 5), {"strides": [2, 3], "pads": [2, 2, 2, 2]}),
    ((1, 2, 5, 5), (3, 2, 2, 2), {"strides": [3, 3]}),                             # rows no tap reaches
])
@pytest.mark.parametrize("variant", [{}, {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16}],
                         ids=["rules", "shared8"])
def test_strided_conv_grad_input_by_phase(xs, ws, attrs, variant):
    """A strided input gradient runs one GEMM per phase of the input grid over the taps that reach
    it (after clearing the whole gradient where a phase is reached by none); against numpy, GPU
    rules and pinned shared tiles."""
    explicit, out = _explicit(xs, ws, attrs)
    dy = rnd(xs[0], ws[0], *out, seed=31)
    kernels = check_op("ConvGradInput", [dy, rnd(*ws, seed=32)],
                       {**explicit, "input_shape": list(xs), **variant}, GPU, rtol=1e-3, atol=1e-3)
    sh, sw = attrs["strides"]
    assert sum(":phase" in k.name for k in kernels) <= sh * sw and any(":phase" in k.name for k in kernels)
    # phases no tap reaches: the whole gradient is cleared before the phases' GEMMs (a reused buffer
    # holds old values; run_kernels starts it at NaN)
    reached = sum(k.name.startswith("ConvGradInput:phase") and "reduce" not in k.name for k in kernels)
    assert [k.name for k in kernels].count("ConvGradInput:clear") == (reached < sh * sw)
    assert "clear" not in "".join(k.name for k in kernels[1:])


@pytest.mark.parametrize("xs,ws,attrs", [
    ((2, 8, 7, 9), (6, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 4, 9, 8), (8, 4, 3, 2), {"pads": [0, 1, 2, 0], "dilations": [2, 1]}),
    ((1, 8, 10, 10), (8, 4, 3, 3), {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 4, 6, 6), (5, 4, 2, 2), {}),                                                  # inside: no bounds test
])
@pytest.mark.parametrize("variant", [{"_gemm_variant": "shared", "_gemm_kt": 8}, {"_gemm_variant": "register"}],
                         ids=["shared", "register"])
def test_tap_major_form_of_convs_matches_numpy(xs, ws, attrs, variant):
    """The tap-major form the matrix-unit kernels take (GemmSpec.tap_major: K ordered (tap,
    channel), the weights copied into that order first), run element by element by the ALU
    kernels (layout "bytap"): forward, input gradient (stride 1 and by phase), weight gradient,
    against numpy."""
    pin = {**variant, "_gemm_layout": "bytap"}
    kernels = check_op("Conv", [rnd(*xs, seed=41), rnd(*ws, seed=42), rnd(ws[0], seed=43)],
                       {**attrs, **pin, "_epilogue": "relu"}, GPU)
    explicit, out = _explicit(xs, ws, attrs)
    grad = check_op("ConvGradInput", [rnd(xs[0], ws[0], *out, seed=44), rnd(*ws, seed=45)],
                    {**explicit, "input_shape": list(xs), **pin}, GPU)
    for ks in (kernels, grad):
        assert ks[0].name == "WeightsByTap" or ks[1].name == "WeightsByTap", [k.name for k in ks]
        assert [k.name for k in ks].count("WeightsByTap") == 1   # once, however many phases use it
        assert any(k.flops for k in ks if k.name.startswith(("Conv", "ConvGradInput")))
    # the weight gradient's columns by (tap, channel), stored in the weight's own order
    wgrad = check_op("ConvGradWeight", [rnd(xs[0], ws[0], *out, seed=46), rnd(*xs, seed=47)],
                     {**explicit, "weight_shape": list(ws), **pin}, GPU)
    assert "(c % " in wgrad[0].wgsl


def test_strided_conv_grad_input_phases_split_k_on_small_grids():
    """A phase with a handful of columns and a long K (a deep stage at a small image) splits K
    like any GEMM: the phases share the split scratch, one after another; against numpy."""
    xs, ws, attrs = (1, 8, 4, 4), (256, 8, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}
    explicit, out = _explicit(xs, ws, attrs)
    kernels = check_op("ConvGradInput", [rnd(xs[0], ws[0], *out, seed=33), rnd(*ws, seed=34)],
                       {**explicit, "input_shape": list(xs)}, GPU, rtol=1e-3, atol=1e-3)
    assert sum("splitK reduce" in k.name for k in kernels) >= 2, [k.name for k in kernels]


@pytest.mark.parametrize("caps", [CPU, GPU], ids=["cpu", "gpu"])
@pytest.mark.parametrize("xs,ws,attrs", CONVS, ids=_conv_ids())
def test_conv_grad_weight(xs, ws, attrs, caps):
    explicit, out = _explicit(xs, ws, attrs)
    dy = rnd(xs[0], ws[0], *out, seed=16)
    check_op("ConvGradWeight", [dy, rnd(*xs, seed=17)], {**explicit, "weight_shape": list(ws)}, caps)


@pytest.mark.parametrize("caps", [CPU, GPU], ids=["cpu", "gpu"])
def test_conv_grad_weight_split_k(caps):
    """A small weight reduced over many pixels: split-K partials in a Scratch buffer + reduce."""
    xs, ws = (6, 8, 14, 14), (16, 8, 3, 3)
    explicit, out = _explicit(xs, ws, {})
    dy = rnd(xs[0], ws[0], *out, seed=18)
    kernels = check_op("ConvGradWeight", [dy, rnd(*xs, seed=19)], {**explicit, "weight_shape": list(ws)}, caps,
                       rtol=1e-3, atol=1e-3)
    assert len(kernels) == 2 and kernels[0].scratch


@pytest.mark.parametrize("xs,ws,attrs,kind", [
    ((2, 64, 4, 4), (8, 64, 3, 3), {"pads": [1, 1, 1, 1]}, "splitK"),       # small grid, K = 576
    ((1, 64, 2, 2), (4, 64, 3, 3), {"pads": [1, 1, 1, 1]}, "dot"),          # tiny output: dot kernel
    ((2, 300, 3, 3), (8, 300, 1, 1), {}, "splitK"),                          # 1x1, K = 300 channels
])
def test_conv_and_input_gradient_split_k_on_small_grids(xs, ws, attrs, kind):
    """Few output tiles over a long K (a late ResNet stage at small spatial size): the forward
    conv and the input gradient split K like the weight gradient, bias and ReLU in the reduce."""
    kernels = check_op("Conv", [rnd(*xs, seed=40), rnd(*ws, seed=41), rnd(ws[0], seed=42)],
                       {**attrs, "_epilogue": "relu"}, GPU, rtol=1e-3, atol=1e-3)
    assert kind in kernels[0].name, [k.name for k in kernels]
    explicit, out = _explicit(xs, ws, attrs)
    kernels = check_op("ConvGradInput", [rnd(xs[0], ws[0], *out, seed=43), rnd(*ws, seed=44)],
                       {**explicit, "input_shape": list(xs)}, GPU, rtol=1e-3, atol=1e-3)
    assert len(kernels) >= 1


def test_grid_folds_past_the_dimension_limit():
    """A grid larger than max_workgroups_per_dim is folded into 2-D / 3-D."""
    caps = AdapterCaps(is_cpu=True, max_workgroups_per_dim=4)
    kernels = check_op("MatMul", [rnd(40, 8, seed=20), rnd(8, 300, seed=21)], {}, caps)
    grid = kernels[0].workgroups
    assert max(grid) <= 4 and grid[2] > 1
    kernels = check_op("MaxPool", [rnd(2, 3, 12, 12, seed=20)], {"kernel_shape": [2, 2]}, caps)
    assert max(kernels[0].workgroups) <= 4


@settings(max_examples=10, deadline=None)
@given(b=st.integers(1, 3), cin=st.integers(1, 5), cout=st.integers(1, 6), h=st.integers(3, 9), w=st.integers(3, 9),
       k=st.integers(1, 3), stride=st.integers(1, 3), pad=st.integers(0, 1), dil=st.integers(1, 2),
       variant=st.sampled_from(VARIANTS))
def test_conv_random_shapes(b, cin, cout, h, w, k, stride, pad, dil, variant):
    if (k - 1) * dil + 1 > min(h, w) + 2 * pad:
        return
    xs, ws = (b, cin, h, w), (cout, cin, k, k)
    attrs = {"strides": [stride, stride], "pads": [pad] * 4, "dilations": [dil, dil]}
    check_op("Conv", [rnd(*xs, seed=h), rnd(*ws, seed=w), rnd(cout, seed=k)], {**attrs, **variant})
    explicit, out = _explicit(xs, ws, attrs)
    check_op("ConvGradInput", [rnd(b, cout, *out, seed=1), rnd(*ws, seed=2)],
             {**explicit, "input_shape": list(xs), **variant})
    check_op("ConvGradWeight", [rnd(b, cout, *out, seed=3), rnd(*xs, seed=4)],
             {**explicit, "weight_shape": list(ws), **variant})


# -- pools --------------------------------------------------------------------------------------
POOLS = [
    ((2, 3, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((2, 2, 7, 5), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 2, 7, 8), {"kernel_shape": [3, 2], "strides": [2, 3], "ceil_mode": 1}),
    ((1, 2, 6, 7), {"kernel_shape": [3, 3], "strides": [1, 1], "dilations": [2, 1], "pads": [0, 1, 2, 1]}),
    ((2, 3, 9), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
]


@pytest.mark.parametrize("xs,attrs", POOLS, ids=[str(p) for p in POOLS])
def test_max_pool(xs, attrs):
    x = rnd(*xs, seed=22)
    check_op("MaxPool", [x], attrs)
    from anygrad.ops.nn import window
    out = window(Node("MaxPool", [], ["y"], attrs), xs[2:], attrs["kernel_shape"], bool(attrs.get("ceil_mode"))).out
    check_op("MaxPoolGrad", [rnd(*xs[:2], *out, seed=23), x], attrs)
    # ties: the gradient goes to the first maximum of each window only
    check_op("MaxPoolGrad", [rnd(*xs[:2], *out, seed=24), np.round(x).clip(-1, 1)], attrs)


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("xs,attrs", [p for p in POOLS if "dilations" not in p[1]],
                         ids=[str(p) for p in POOLS if "dilations" not in p[1]])
def test_average_pool(xs, attrs, include_pad):
    attrs = {**attrs, "count_include_pad": include_pad}
    check_op("AveragePool", [rnd(*xs, seed=25)], attrs)
    from anygrad.ops.nn import window
    out = window(Node("AveragePool", [], ["y"], attrs), xs[2:], attrs["kernel_shape"],
                 bool(attrs.get("ceil_mode"))).out
    check_op("AveragePoolGrad", [rnd(*xs[:2], *out, seed=26)], {**attrs, "input_shape": list(xs)})


@pytest.mark.parametrize("xs", [(2, 3, 5, 7), (3, 4, 1, 1), (2, 5, 9)])
def test_global_average_pool(xs):
    check_op("GlobalAveragePool", [rnd(*xs, seed=27)], {})


# -- tiny outputs over a long K (the "dot" kernel) and the thin-and-wide register rule ------------
@pytest.mark.parametrize("caps", [CPU, GPU], ids=["cpu", "gpu"])
@pytest.mark.parametrize("xs,ws", [((3, 1, 12, 12), (8, 1, 3, 3)),      # conv1-like: 8 x 9 outputs, 2 row blocks
                                   ((2, 2, 7, 9), (3, 2, 2, 3)),        # odd K (2 x 6 x 7 pixels), 3 x 12 outputs
                                   ((40, 1, 11, 11), (5, 1, 3, 3))])    # K = 3240: split K + tree reduce
def test_conv_grad_weight_dot(xs, ws, caps):
    explicit, out = _explicit(xs, ws, {})
    dy = rnd(xs[0], ws[0], *out, seed=22)
    kernels = check_op("ConvGradWeight", [dy, rnd(*xs, seed=23)],
                       {**explicit, "weight_shape": list(ws), "_gemm_variant": "dot"}, caps, rtol=1e-3, atol=1e-3)
    assert kernels[0].name.startswith("ConvGradWeight[dot")


def test_dot_is_the_gpu_default_for_tiny_outputs():
    xs, ws = (3, 1, 12, 12), (8, 1, 3, 3)
    explicit, out = _explicit(xs, ws, {})
    kernels = check_op("ConvGradWeight", [rnd(xs[0], ws[0], *out, seed=24), rnd(*xs, seed=25)],
                       {**explicit, "weight_shape": list(ws)}, GPU, rtol=1e-3, atol=1e-3)
    assert kernels[0].name.startswith("ConvGradWeight[dot 4x9")
    # the fc2 weight gradient of the MNIST model: dY^T (10 x batch) @ h (batch x 32)
    kernels = check_op("Gemm", [rnd(70, 10, seed=26), rnd(70, 32, seed=27)], {"transA": 1}, GPU)
    assert kernels[0].name.startswith("Gemm[dot")
    # a large output keeps the tiled GEMM
    kernels = check_op("Gemm", [rnd(70, 40, seed=26), rnd(70, 32, seed=27)], {"transA": 1}, GPU)
    assert "dot" not in kernels[0].name


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 12), k=st.integers(1, 700), n=st.integers(1, 70), ta=st.integers(0, 1),
       bias=st.booleans(), relu=st.booleans())
def test_gemm_dot_random_shapes(m, k, n, ta, bias, relu):
    """Blocks that do not divide M or N (n up to 70 > 63 outputs: two column blocks), bias, alpha, relu."""
    a = rnd(*((k, m) if ta else (m, k)), seed=k)
    attrs = {"transA": ta, "alpha": 0.75, "_gemm_variant": "dot"} | ({"_epilogue": "relu"} if relu else {})
    check_op("Gemm", [a, rnd(k, n, seed=n)] + ([rnd(n, seed=1)] if bias else []), attrs, GPU, rtol=1e-3, atol=1e-3)


def test_matmul_dot_batched_split_k():
    kernels = check_op("MatMul", [rnd(2, 7, 3000, seed=28), rnd(2, 3000, 5, seed=29)], {"_gemm_variant": "dot"}, GPU,
                       rtol=1e-3, atol=1e-3)
    assert len(kernels) == 2 and kernels[0].scratch


def test_thin_and_wide_uses_register8_on_gpus_only():
    """<= 8 rows over enough columns to fill a GPU with 8x8 blocks: register, block 8 (H200: conv2 dX)."""
    from anygrad.backends.wgpu.kernels.gemm_spec import choose_tiling
    t = choose_tiling(8, 676_000, 144, GPU)
    assert (t.variant, t.tm, t.tn) == ("register", 8, 8)
    assert choose_tiling(8, 43_264, 144, GPU).variant == "shared"      # batch 64: too few blocks
    assert choose_tiling(16, 676_000, 144, GPU).variant == "shared"
    assert choose_tiling(8, 676_000, 144, CPU).tm == 4


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 3), cin=st.integers(1, 4), cout=st.integers(1, 9), h=st.integers(3, 10), w=st.integers(3, 10),
       k=st.integers(1, 3), stride=st.sampled_from([1, 1, 2]), pad=st.sampled_from([0, 0, 1]), dil=st.integers(1, 2),
       caps=st.sampled_from([CPU, GPU]))
def test_conv_gathers_unpadded_and_stride1(b, cin, cout, h, w, k, stride, pad, dil, caps):
    """The bounds-test-free im2col gather (no padding) and the unsigned stride-1 input-gradient
    gather, through each adapter kind's default tilings (GPU: dot, 8-deep thin tiles, fitted tiles)."""
    if (k - 1) * dil + 1 > min(h, w) + 2 * pad:
        return
    xs, ws = (b, cin, h, w), (cout, cin, k, k)
    attrs = {"strides": [stride, stride], "pads": [pad] * 4, "dilations": [dil, dil]}
    check_op("Conv", [rnd(*xs, seed=h), rnd(*ws, seed=w)], attrs, caps)
    explicit, out = _explicit(xs, ws, attrs)
    check_op("ConvGradInput", [rnd(b, cout, *out, seed=5), rnd(*ws, seed=6)],
             {**explicit, "input_shape": list(xs)}, caps)
    check_op("ConvGradWeight", [rnd(b, cout, *out, seed=7), rnd(*xs, seed=8)],
             {**explicit, "weight_shape": list(ws)}, caps, rtol=1e-3, atol=1e-3)


def test_unpadded_gather_has_no_bounds_test():
    from anygrad.backends.wgpu.kernels.kernels_conv import _x_gather
    from anygrad.backends.wgpu.kernels.windows import geometry
    xs, ws = (2, 3, 8, 8), (4, 3, 3, 3)
    node = Node("Conv", ["x", "w"], ["y"], _explicit(xs, ws, {})[0])
    assert _x_gather(geometry(node, xs), "ci")[1] == ""
    padded = Node("Conv", ["x", "w"], ["y"], _explicit(xs, ws, {"pads": [1, 1, 1, 1]})[0])
    assert _x_gather(geometry(padded, xs), "ci")[1] != ""


def test_thin_wide_conv_stages_8_deep():
    """MNIST conv2-like at batch 30 (N = 17,280 output pixels, 16 channels): the GPU default stages
    K 8 deep in 16 x 128 tiles; the fitted 16 x 72 weight-gradient tile keeps 16."""
    xs, ws = (30, 8, 26, 26), (16, 8, 3, 3)
    explicit, out = _explicit(xs, ws, {})
    kernels = check_op("Conv", [rnd(*xs, seed=30), rnd(*ws, seed=31)], {}, GPU, rtol=1e-3, atol=1e-3)
    assert kernels[0].name == "Conv[shared 16x128k8]"
    kernels = check_op("ConvGradWeight", [rnd(30, 16, *out, seed=32), rnd(*xs, seed=33)],
                       {**explicit, "weight_shape": list(ws)}, GPU, rtol=1e-3, atol=1e-3)
    assert kernels[0].name.startswith("ConvGradWeight[shared 16x72k16 splitK")


@pytest.mark.parametrize("m,k,n,prefetched", [(128, 40, 128, True), (256, 48, 128, True), (33, 17, 29, False)])
def test_shared_tiles_prefetch_where_the_copies_unroll(m, k, n, prefetched):
    """The shared variant's two copy forms: K tiles prefetched into registers (copies unrolled), and
    a plain copy loop (a tile that does not divide over the invocations); both against numpy,
    with bias and ReLU through the strided sub-block stores."""
    attrs = {"_gemm_variant": "shared", "_gemm_block": 8 if prefetched else 4, "_gemm_kt": 16,
             "_epilogue": "relu", "transB": 1}
    kernels = check_op("Gemm", [rnd(m, k, seed=7), rnd(n, k, seed=8), rnd(n, seed=9)], attrs, caps=GPU)
    wgsl = kernels[0].wgsl
    assert ("var pa0" in wgsl) == prefetched and ("for (var l = tid" in wgsl) != prefetched


@pytest.mark.parametrize("ta,tb,swizzled", [(0, 0, "A"), (0, 1, "AB"), (1, 1, "B"), (1, 0, "")])
@pytest.mark.parametrize("layout", [None, "plain"])
def test_scalar_k_fastest_copies_store_swizzled_rows(ta, tb, swizzled, layout):
    """An odd K leaves no vec4 loads: a row-major A (or a transposed B) is copied scalar with K
    fastest, and its tile rows are XOR-permuted against bank conflicts. Reads must undo exactly
    that permutation, prefetched or not, whole tiles and a ragged edge; checked against numpy,
    and with the permutation off ('plain')."""
    m, k, n = 250, 37, 250   # whole 128- and 64-row tiles, and a ragged edge
    a = rnd(k, m, seed=11) if ta else rnd(m, k, seed=11)
    b = rnd(n, k, seed=12) if tb else rnd(k, n, seed=12)
    for var in ({"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16},
                {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 8, "_gemm_prefetch": 1}):
        attrs = {"transA": ta, "transB": tb, **var} | ({"_gemm_layout": layout} if layout else {})
        wgsl = check_op("Gemm", [a, b, rnd(n, seed=13)], attrs, caps=GPU, rtol=1e-3, atol=1e-3)[0].wgsl
        assert ("((mm / 4u) ^" in wgsl) == ("A" in swizzled and not layout)
        assert ("((nn / 4u) ^" in wgsl) == ("B" in swizzled and not layout)


def test_k_loop_two_steps_a_pass_matches_numpy():
    """Tiling.unroll = 2 (an autotuner candidate): the rolled K-tile loop of a prefetched GEMM
    takes two K steps a pass; whole and ragged K tiles, against numpy."""
    for m, k, n in ((130, 40, 70), (64, 64, 128)):
        a, b = rnd(m, k, seed=1), rnd(k, n, seed=2)
        pin = {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1, "_gemm_unroll": 2}
        kern = check_op("MatMul", [a, b], pin, caps=GPU, rtol=1e-3, atol=1e-3)[0]
        assert "k0s = k0s + 2u" in kern.wgsl and "u2]" in kern.name


@pytest.mark.parametrize("pin", [p for p in CANDIDATES if p], ids=lambda p: "-".join(f"{k[6:]}{v}" for k, v in p.items()))
def test_every_autotuner_candidate_matches_numpy(pin):
    """Each tiling the autotuner may pick computes what numpy does, at ragged M/N edges and a K
    long enough to split; one it cannot take raises (the autotuner skips it)."""
    storage = _device().limits["max-compute-workgroup-storage-size"]
    caps = AdapterCaps(is_cpu=False, max_workgroup_storage=storage)
    ran = 0
    for m, k, n in ((130, 300, 70), (64, 64, 128)):
        try:
            check_op("MatMul", [rnd(2, m, k, seed=1), rnd(k, n, seed=2)], pin, caps=caps, rtol=1e-3, atol=1e-3)
            ran += 1
        except ValueError as e:
            if "matrix units" in str(e):  # tests/test_matrix_units_dawn.py runs these where they exist
                pytest.skip(f"{pin} needs subgroup matrices, which this adapter lacks")
            assert "workgroup" in str(e) or "fit" in str(e), e
    if not ran and storage < 48 << 10:
        pytest.skip(f"{pin} needs more than this adapter's {storage} bytes of workgroup storage")
    assert ran, f"{pin} ran on no shape"


def test_two_workgroup_tiles_match_numpy():
    """Tiling.double (prefetch 2, an autotuner candidate): K tile i multiplied out of one half of
    workgroup memory while tile i + 1 is stored into the other, one barrier a tile; ragged K and
    M/N edges, whole-K and split-K (unrolled) loops, against numpy. A pin whose two tiles exceed
    the workgroup storage is refused (the autotuner skips it)."""
    for m, k, n, caps in ((250, 40, 250, GPU), (64, 64, 128, GPU), (128, 1100, 128, GPU)):
        a, b = rnd(m, k, seed=1), rnd(k, n, seed=2)
        pin = {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 8, "_gemm_prefetch": 2}
        kernels = check_op("MatMul", [a, b], pin, caps=caps, rtol=1e-3, atol=1e-3)
        assert "1u - cur" in kernels[0].wgsl and "pd" in kernels[0].name
    with pytest.raises(ValueError, match="workgroup storage"):
        check_op("MatMul", [rnd(128, 64), rnd(64, 128)],
                 {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 2}, caps=GPU)


@pytest.mark.parametrize("nN,nM", [(1, 1), (5, 1), (1, 9), (7, 8), (3, 17), (40, 25)])
def test_tile_order_visits_every_tile_once(nN, nM):
    """The grouped tile order (GROUP_M rows of tiles at a time) is a permutation of the tiles,
    last partial group included: its WGSL statements evaluated for every workgroup."""
    import re

    from anygrad.backends.wgpu.kernels.gemm_wgsl import _tile_order
    code = [re.sub(r"(\d+)u\b", r"\1", ln.strip().removeprefix("let ").rstrip(";")).replace("/", "//")
            for ln in _tile_order(nN, nM)]
    seen = set()
    for lin in range(nN * nM):
        env = {"lin": lin, "min": min}
        for ln in code:
            name, expr = ln.split(" = ", 1)
            env[name] = eval(expr, env)  # our own generated arithmetic
        assert 0 <= env["mb"] < nM and 0 <= env["nb"] < nN
        seen.add((env["mb"], env["nb"]))
    assert len(seen) == nN * nM


def test_grouped_tile_order_on_many_rows_of_tiles():
    """18 rows of 64-row tiles (more than GROUP_M, a partial last group) against numpy."""
    check_op("MatMul", [rnd(1100, 12, seed=21), rnd(12, 40, seed=22)], {"_gemm_variant": "register"}, caps=GPU)
