"""Matrix-unit planning and shader generation (matrix_units.py, kernels_mma.py), for every config
shape the vendors offer, without a GPU: Dawn's numerical tests are test_matrix_units_dawn.py.

For each config (NVIDIA/AMD 16x16x16, NVIDIA's 16x8x16 and 16x8x8, Apple's 8x8x8 in f16 and f32,
Intel's 8x16x16 on subgroups of 16) the GEMM lowerings (layouts, batches, split-K, epilogues) and
the three convolution kernels are planned and rendered, and the WGSL is checked for what Dawn
requires: the right enables and matrix types, a workgroup of whole subgroups, matrix offsets and
strides built from subgroup-uniform values only, tiles that divide into fragments and fit the
workgroup storage. A numpy emulation of the planned grid and tile loop checks the indexing on
odd shapes against float64.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest

import anygrad.ops  # noqa: F401  (registers the op forwards)
from anygrad.backends.wgpu.device.adapters import AdapterFacts
from anygrad.backends.wgpu.device.adapters import MatrixConfig as AdapterConfig
from anygrad.backends.wgpu.kernels import kernels_conv, kernels_gemm  # noqa: F401  (register the lowerings)
from anygrad.backends.wgpu.kernels.gemm_wgsl import GROUP_M
from anygrad.backends.wgpu.kernels.halfstore import stored_half
from anygrad.backends.wgpu.kernels.kernel import LOWERINGS, AdapterCaps
from anygrad.backends.wgpu.kernels.kernels_mma import uses_matrix_units
from anygrad.backends.wgpu.kernels.matrix_units import MatrixConfig, MatrixUnits, MmaPlan, plan_mma, units_of
from anygrad.backends.wgpu.kernels.wgsl import workgroup_bytes
from anygrad.ir import Graph, Node, TensorInfo, infer_node
from anygrad.ir.passes import resolve_attributes

# config -> (operand dtype, subgroup size of the vendor that lists it)
CONFIGS = {
    "16x16x16": (MatrixConfig(16, 16, 16), 32),          # NVIDIA (Vulkan), AMD RDNA3
    "16x8x16": (MatrixConfig(16, 8, 16), 32),            # NVIDIA
    "16x8x8": (MatrixConfig(16, 8, 8), 32),              # NVIDIA
    "apple8x8x8f16": (MatrixConfig(8, 8, 8), 32),        # Apple M1+ simdgroup matrices
    "apple8x8x8f32": (MatrixConfig(8, 8, 8, "f32"), 32),
    "intel8x16x16": (MatrixConfig(8, 16, 16), 16),       # Intel Xe2, subgroups of 16
}


def caps_for(key: str) -> AdapterCaps:
    cfg, size = CONFIGS[key]
    return AdapterCaps(max_workgroup_storage=32768, max_invocations_per_workgroup=256, has_f16=True,
                       adapter_facts=MatrixUnits((cfg,), size, True, True))


def node_kernels(op: str, shapes: list[tuple], attrs: dict, caps: AdapterCaps, dtype) -> tuple[list, Graph]:
    g = Graph()
    names = []
    for i, s in enumerate(shapes):
        names.append(f"x{i}")
        g.info[f"x{i}"] = TensorInfo(np.dtype(dtype), tuple(s))
    node = Node(op, names, ["y0"], dict(attrs), name="n")
    g.nodes = [node]
    if "y_shape" in attrs:
        g.info["y0"] = TensorInfo(np.dtype(dtype), attrs.pop("y_shape"))
    else:
        infer_node(g, node)
        g.info["y0"] = TensorInfo(np.dtype(dtype), g.info["y0"].shape)
    return stored_half(LOWERINGS[op](node, resolve_attributes(g), caps), g), g


_CONV = {"dilations": [1, 1], "group": 1, "kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1]}
CASES = {
    "matmul": ("MatMul", [(70, 100), (100, 36)], {}),
    "x_wT": ("MatMul", [(50, 72), (40, 72)], {"_permB": [1, 0], "y_shape": (50, 40)}),
    "xT_dy": ("MatMul", [(72, 50), (72, 40)], {"_permA": [1, 0], "y_shape": (50, 40)}),
    "batched": ("MatMul", [(3, 17, 40), (3, 40, 24)], {}),
    "broadcast": ("MatMul", [(2, 1, 9, 32), (3, 32, 8)], {}),
    "head_merge": ("MatMul", [(2, 6, 40, 16), (2, 6, 16, 40)], {"_permY": [0, 2, 1, 3], "y_shape": (2, 40, 6, 40)}),
    "split_k": ("MatMul", [(40, 2000), (2000, 24)], {"_gemm_splits": 4}),
    "gemm_bias_relu": ("Gemm", [(70, 45), (66, 70), (66,)], {"transA": 1, "transB": 1, "_epilogue": "relu"}),
    "gelu_epilogue": ("MatMul", [(64, 96), (96, 128)], {"_epilogue": "Gelu"}),
    "conv": ("Conv", [(2, 8, 13, 11), (16, 8, 3, 3), (16,)], {"pads": [1, 1, 1, 1], "_epilogue": "relu"}),
    "conv_grad_input": ("ConvGradInput", [(2, 16, 13, 11), (16, 8, 3, 3)], {**_CONV, "input_shape": [2, 8, 13, 11]}),
    "conv_grad_input_strided": ("ConvGradInput", [(2, 24, 6, 6), (24, 16, 3, 3)],
                                {**_CONV, "strides": [2, 2], "input_shape": [2, 16, 12, 12]}),
    # 6 channels, no multiple of four: the plain (channel, tap) columns
    "conv_grad_weight": ("ConvGradWeight", [(2, 16, 13, 11), (2, 6, 13, 11)], {**_CONV, "weight_shape": [16, 6, 3, 3]}),
    # channels a multiple of the K tile: the tap-major form (GemmSpec.tap_major, b_at / b_tg)
    "conv_by_tap": ("Conv", [(2, 32, 13, 11), (48, 32, 3, 3), (48,)], {"pads": [1, 1, 1, 1]}),
    "conv_grad_input_by_tap": ("ConvGradInput", [(2, 64, 13, 11), (64, 32, 3, 3)],
                               {**_CONV, "input_shape": [2, 32, 13, 11]}),
    "conv_grad_weight_by_tap": ("ConvGradWeight", [(2, 16, 13, 11), (2, 8, 13, 11)],
                                {**_CONV, "weight_shape": [16, 8, 3, 3]}),
    "conv_grad_input_strided_by_tap": ("ConvGradInput", [(2, 32, 6, 6), (32, 32, 3, 3)],
                                       {**_CONV, "strides": [2, 2], "input_shape": [2, 32, 12, 12]}),
}

_MATRIX_CALL = re.compile(r"subgroupMatrix(Load<M[LR]>|Store)\(&(T[abc]), ")


def _args(text: str, start: int) -> list[str]:
    """The comma-separated arguments of the call whose '(' is just before `start`."""
    depth, arg, out = 0, "", []
    for ch in text[start:]:
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                return out + [arg.strip()]
            depth -= 1
        if ch == "," and depth == 0:
            out.append(arg.strip())
            arg = ""
        else:
            arg += ch
    raise AssertionError("unclosed call")


def _lets(wgsl: str) -> dict[str, str]:
    return dict(re.findall(r"let (\w+) = ([^;]+);", wgsl))


def _uniform(expr: str, lets: dict[str, str], seen: frozenset = frozenset()) -> bool:
    """Built from literals, workgroup_id, subgroup_id and lets of those (recursively) only."""
    for name in re.findall(r"[A-Za-z_]\w*", re.sub(r"\b\d+u\b", "", expr)):
        # k0: the K loop's counter, from kb (a let of workgroup_id) in uniform steps
        if name in ("wid", "sg", "x", "y", "z", "min", "u", "k0"):
            continue
        if name in seen or name not in lets or not _uniform(lets[name], lets, seen | {name}):
            return False
    return True


def _plan_of(name: str, caps: AdapterCaps) -> MmaPlan:
    m = re.search(r"\[mma (\d+)x(\d+)k(\d+)p?d? sg(\d+)", name)
    assert m, name
    return m


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("key", list(CONFIGS))
def test_plans_and_shaders_for_every_config(key, case, prefetch):
    cfg, size = CONFIGS[key]
    caps = caps_for(key)
    if prefetch == 2:  # double tiles of the default plans take more than 32 KiB (an H200's 48)
        caps = replace(caps, max_workgroup_storage=65536)
    op, shapes, attrs = CASES[case]
    dtype = np.float16 if cfg.operand == "f16" else np.float32
    kernels, _ = node_kernels(op, shapes, {**attrs, "_gemm_variant": "mma", "_gemm_prefetch": prefetch}, caps, dtype)
    mma = [k for k in kernels if uses_matrix_units(k)]
    assert mma, [k.name for k in kernels]
    # by tap on every config (kernels_mma.taps_fit): on Intel's subgroups of 16, whose 4-subgroup
    # tiles are wider than their 64 invocations, each invocation keeps two columns of B's tile
    by_tap = case.endswith("_by_tap")
    along_n = op == "ConvGradWeight"   # the weight gradient's columns by tap: no weight copy
    assert ("WeightsByTap" in [k.name for k in kernels[:2]]) == (by_tap and not along_n), [k.name for k in kernels]
    for k in mma:
        w = k.wgsl
        assert bool(re.search(r"b_at\(bt, (tb_c|n0 \+ li \+ \d+u), tb_k /", w)) == (by_tap and not along_n)
        # several columns an invocation where the tile is wider than the workgroup
        assert ("tb_base[1] = b_at(" in w) == (by_tap and not along_n and size == 16), k.name
        assert ("b_tg4(bt, " in w) == (by_tap and along_n)
        # a plain conv's im2col column decoded once before the K loop where each invocation keeps one
        if op == "Conv" and "b_at(" not in w:
            bn = int(_plan_of(k.name, caps).group(2))
            threads = int(re.search(r"@workgroup_size\((\d+), 1, 1\)", w).group(1))
            hoisted = "b_elh(bt, k" in w and w.index("let c = n0 + li %") < w.index("for (var k0")
            assert hoisted == (threads % bn == 0), k.name
        assert f"{cfg.m}x{cfg.n}x{cfg.k}" in k.name
        assert ("p sg" in k.name or "pd sg" in k.name) == bool(prefetch)
        assert ("d sg" in k.name) == (prefetch == 2)
        # double tiles: two buffers, each K tile's matrix loads at its buffer's offset, and one
        # barrier a K tile (the multiplies are followed by the next tile's stores, not a barrier)
        loop = w[w.index("for (var k0"):]
        loop = loop[:loop.index("\n  }\n")]
        assert loop.count("workgroupBarrier();") == (1 if prefetch == 2 else 2), loop
        assert ("&Ta, oa + (" in w) == (prefetch == 2)
        assert re.search(r"^enable f16;", w, re.MULTILINE) and "enable chromium_experimental_subgroup_matrix;" in w
        assert f"alias ML = subgroup_matrix_left<{cfg.operand}, {cfg.k}, {cfg.m}>;" in w
        assert f"alias MR = subgroup_matrix_right<{cfg.operand}, {cfg.n}, {cfg.k}>;" in w
        assert f"alias MC = subgroup_matrix_result<f32, {cfg.n}, {cfg.m}>;" in w
        bm, bn, bk, sgs = map(int, _plan_of(k.name, caps).groups())
        assert bm % cfg.m == 0 and bn % cfg.n == 0 and bk % cfg.k == 0
        threads = int(re.search(r"@workgroup_size\((\d+), 1, 1\)", w).group(1))
        assert threads == sgs * size and threads % size == 0 and threads <= caps.max_invocations_per_workgroup
        assert workgroup_bytes(w) <= caps.max_workgroup_storage
        # every matrix load and store: offsets and strides subgroup-uniform, never invocation ids
        lets = _lets(w)
        calls = list(_MATRIX_CALL.finditer(w))
        assert len(calls) >= 3
        for c in calls:
            args = _args(w, c.end())
            offset, stride = (args[0], args[2]) if c.group(1).startswith("Load") else (args[0], args[3])
            for expr in (offset, stride):
                assert _uniform(expr, {n: e for n, e in lets.items() if n not in ("li", "lane", "l")}), (expr, k.name)
                assert not re.search(r"\b(li|lane|lid|local_invocation\w*)\b", expr)
        # operands bound as the graph's dtype: f16 storage for f16 values (halfstore rewrote them)
        if cfg.operand == "f16" and not by_tap:   # by tap, A is the f32 weight copy (WeightsByTap)
            assert re.search(r"@binding\(0\) var<storage, read> \w+: array<(vec4<)?f16>?>;", w), w[:600]


@pytest.mark.parametrize("key", list(CONFIGS))
def test_every_shader_compiles_under_tint(key):
    """Every case above, with and without the prefetch and double tiles, through Tint (Dawn's
    Null backend, tests/wgpu_util.tint_device): the types, builtins, uniformity and the matrix
    extension's rules as Dawn enforces them, which only the device machine checked before."""
    import wgpu_util
    wgpu_util.tint_device()
    cfg, _ = CONFIGS[key]
    dtype = np.float16 if cfg.operand == "f16" else np.float32
    rejected = []
    for case, (op, shapes, attrs) in CASES.items():
        for prefetch in (0, 1, 2):
            caps = replace(caps_for(key), max_workgroup_storage=65536) if prefetch == 2 else caps_for(key)
            kernels, _ = node_kernels(op, shapes, {**attrs, "_gemm_variant": "mma", "_gemm_prefetch": prefetch},
                                      caps, dtype)
            rejected += [(case, prefetch, k.name, why) for k in kernels if (why := wgpu_util.tint_rejects(k.wgsl))]
    assert not rejected, rejected[:5]


@pytest.mark.parametrize("case,threads,a_kmajor,b_nmajor", [
    ("matmul", 128, False, False),
    ("x_wT", 256, False, True),       # B stored transposed, 8 subgroups: B as (n, k)
    ("x_wT", 128, False, False),      # ... 4 subgroups: B keeps its rows (B_NMAJOR_SUBGROUPS)
    ("xT_dy", 128, True, False),      # A stored transposed: A as (k, m) on any plan
    ("conv_grad_weight_by_tap", 256, True, True),   # B gathered along K by tap; DY (143 px) along M
])
def test_tiles_laid_out_along_their_copies_walk(case, threads, a_kmajor, b_nmajor):
    """kernels_mma.tile_majors: each tile's stores and its matrix loads agree on its layout (a
    (k, m) tile read column-major, a (k, n) one row-major), and the layouts follow the copies."""
    op, shapes, attrs = CASES[case]
    caps = replace(caps_for("16x16x16"), max_workgroup_storage=49152, max_invocations_per_workgroup=1024)
    # shapes large enough for 8 subgroups (the plans shrink to small matrices)
    big = {"matmul": ([(256, 128), (128, 256)], {}), "x_wT": ([(256, 128), (256, 128)], {"y_shape": (256, 256)}),
           "xT_dy": ([(128, 256), (128, 256)], {"y_shape": (256, 256)}),
           "conv_grad_weight_by_tap": ([(2, 128, 13, 11), (2, 32, 13, 11)], {"weight_shape": [128, 32, 3, 3]})}
    shapes, extra = big.get(case, (shapes, {}))
    pin = {**{k: v for k, v in attrs.items() if k != "y_shape"}, **extra, "_gemm_variant": "mma", "_gemm_threads": threads}
    kernels, _ = node_kernels(op, shapes, pin, caps, np.float16)
    (k,) = [k for k in kernels if uses_matrix_units(k)]
    w = k.wgsl
    assert f"sg{threads // 32} " in k.name, k.name
    for tile, major in (("Ta", a_kmajor), ("Tb", b_nmajor)):
        loads = re.findall(rf"subgroupMatrixLoad<M[LR]>\(&{tile}, [^;]*, (true|false), (\d+)u\)", w)
        assert loads and {c for c, _ in loads} == {"true" if major else "false"}, (tile, loads[:2], k.name)
        stride = int(loads[0][1])
        # a (k, m) tile's rows are BM (+ pad) long, a row-major A tile's BK (+ pad)
        bm, bn, bk = map(int, re.search(r"mma (\d+)x(\d+)k(\d+)", k.name).groups())
        want = ((bm if tile == "Ta" else bk) if major else (bk if tile == "Ta" else bn)) + 8
        assert stride == want, (tile, stride, want, k.name)
        stores = re.findall(rf"{tile}\[[^\]]*\* {stride}u", w)
        assert stores, (tile, k.name)
    import wgpu_util
    wgpu_util.tint_device()
    assert wgpu_util.tint_rejects(w) == ""


def test_tint_rejects_what_dawn_would():
    """The check above can fail: a non-uniform barrier and an f16 -> f32 let are refused."""
    import wgpu_util
    assert "uniform control flow" in wgpu_util.tint_rejects(
        "@compute @workgroup_size(1) fn main(@builtin(local_invocation_index) li: u32) { if (li == 0u) { workgroupBarrier(); } }")
    assert "f16" in wgpu_util.tint_rejects("enable f16;\n@compute @workgroup_size(1) fn main() { let x: f16 = 1.0; let y: f32 = x; }")
    assert wgpu_util.tint_rejects("@compute @workgroup_size(1) fn main() {}") == ""


def test_no_matrix_units_or_another_operand_type_falls_back_to_alu_kernels():
    cfg, _ = CONFIGS["16x16x16"]
    with_units = caps_for("16x16x16")
    plain = replace(with_units, adapter_facts=None)
    shapes = [(256, 256), (256, 256)]
    # the rules: matrix units for f16 operands where the adapter has an f16 config, ALUs otherwise
    assert all(uses_matrix_units(k) for k in node_kernels("MatMul", shapes, {}, with_units, np.float16)[0])
    assert not any(uses_matrix_units(k) for k in node_kernels("MatMul", shapes, {}, plain, np.float16)[0])
    assert not any(uses_matrix_units(k) for k in node_kernels("MatMul", shapes, {}, with_units, np.float32)[0])
    no_f16 = replace(with_units, adapter_facts=MatrixUnits((cfg,), 32, True, has_f16=False))
    assert not any(uses_matrix_units(k) for k in node_kernels("MatMul", shapes, {}, no_f16, np.float16)[0])
    # a pinned candidate the adapter cannot take raises ValueError: the autotuner skips it
    for caps, dtype in ((plain, np.float16), (with_units, np.float32), (no_f16, np.float16)):
        with pytest.raises(ValueError):
            node_kernels("MatMul", shapes, {"_gemm_variant": "mma"}, caps, dtype)


def test_units_read_from_the_adapter_facts_dawn_reports():
    facts = AdapterFacts("dawn", (32, 32), (AdapterConfig(16, 8, 8, "f16", "f32"), AdapterConfig(16, 16, 16, "f16", "f32"),
                                             AdapterConfig(16, 16, 32, "i8", "i32")), has_f16=True, has_subgroups=True)
    units = units_of(AdapterCaps(adapter_facts=facts))
    assert units.subgroup_size == 32 and units.subgroup_id and units.has_f16
    plan = plan_mma(4096, 4096, 4096, AdapterCaps(max_workgroup_storage=49152), "f16", units)
    assert plan.config == MatrixConfig(16, 16, 16) and plan.threads % 32 == 0
    assert units_of(AdapterCaps(adapter_facts=AdapterFacts("native"))) is None


def test_the_rules_give_the_widest_plans_two_shallow_tiles_where_they_fit():
    units = MatrixUnits((MatrixConfig(16, 16, 16),), 32)
    h200 = AdapterCaps(max_workgroup_storage=49152, max_invocations_per_workgroup=1024)
    rule = plan_mma(4096, 4096, 4096, h200, "f16", units, prefetch=True, double=None)
    assert (rule.subgroups, rule.bk, rule.double) == (8, 16, True) and rule.workgroup_bytes() <= 49152
    assert "128x256k16pd sg8" in rule.tag
    # less workgroup storage, no prefetch, a pinned K tile or 4 subgroups: one tile, as pinned
    for caps, kw in ((AdapterCaps(max_workgroup_storage=32768, max_invocations_per_workgroup=1024), {}),
                     (h200, {"prefetch": False}), (h200, {"bk": 32}), (h200, {"threads": 128})):
        plan = plan_mma(4096, 4096, 4096, caps, "f16", units, **{"prefetch": True, "double": None, **kw})
        assert not plan.double, (kw, plan.tag)
    # pinned double tiles that do not fit are refused (the autotuner skips the candidate)
    with pytest.raises(ValueError, match="two tiles"):
        plan_mma(4096, 4096, 4096, h200, "f16", units, bk=32, prefetch=True, double=True)


def test_plans_fit_small_workgroup_storage_and_small_shapes():
    units = MatrixUnits((MatrixConfig(16, 16, 16),), 32)
    small = AdapterCaps(max_workgroup_storage=16384)
    p = plan_mma(4096, 4096, 4096, small, "f16", units)
    assert p.workgroup_bytes() <= 16384
    thin = plan_mma(16, 4096, 512, AdapterCaps(max_workgroup_storage=32768), "f16", units)
    assert thin.bm == 16   # no padding rows beyond the one fragment M needs


def _tile_order(lin: int, nN: int, nM: int) -> tuple[int, int]:
    """gemm_wgsl._tile_order in Python: (mb, nb) of workgroup `lin`."""
    t = lin % (nN * nM)
    if nM == 1:
        return 0, t
    tg = t // (GROUP_M * nN)
    first = tg * GROUP_M
    gm = min(nM - first, GROUP_M)
    tr = t - tg * GROUP_M * nN
    return first + tr % gm, tr // gm


def emulate(a: np.ndarray, b: np.ndarray, p: MmaPlan, splits: int = 1) -> np.ndarray:
    """The planned kernel's grid, subgroups, fragments and K tiles in numpy (float64): every
    workgroup stages zero-padded tiles, each subgroup accumulates its fragments, and each fragment
    is stored with the kernel's bounds check; split-K partials are summed as the reduce does."""
    (M, K), N = a.shape, b.shape[1]
    cfg = p.config
    ksplit = math.ceil(math.ceil(K / splits) / p.bk) * p.bk
    nN, nM = math.ceil(N / p.bn), math.ceil(M / p.bm)
    out = np.full((splits, M, N), np.nan)
    written = np.zeros((splits, M, N), int)
    for lin in range(nN * nM * splits):
        mb, nb = _tile_order(lin, nN, nM)
        s = lin // (nN * nM)
        m0, n0, kb = mb * p.bm, nb * p.bn, s * ksplit
        ke = min(kb + ksplit, K)
        for sg in range(p.subgroups):
            sr, sc = (sg // p.sg_cols) * p.sub_m, (sg % p.sg_cols) * p.sub_n
            acc = np.zeros((p.frag_rows, p.frag_cols, cfg.m, cfg.n))
            for k0 in range(kb, ke, p.bk):
                ta = np.zeros((p.bm, p.bk))
                tb = np.zeros((p.bk, p.bn))
                rows, cols, ks = min(p.bm, M - m0), min(p.bn, N - n0), min(p.bk, K - k0)
                ta[:rows, :ks] = a[m0:m0 + rows, k0:k0 + ks]
                tb[:ks, :cols] = b[k0:k0 + ks, n0:n0 + cols]
                for kk in range(0, p.bk, cfg.k):
                    for i in range(p.frag_rows):
                        for j in range(p.frag_cols):
                            left = ta[sr + i * cfg.m: sr + (i + 1) * cfg.m, kk:kk + cfg.k]
                            right = tb[kk:kk + cfg.k, sc + j * cfg.n: sc + (j + 1) * cfg.n]
                            acc[i, j] += left @ right
            for i in range(p.frag_rows):
                for j in range(p.frag_cols):
                    for rr in range(cfg.m):
                        for cc in range(cfg.n):
                            r, c = m0 + sr + i * cfg.m + rr, n0 + sc + j * cfg.n + cc
                            if r < M and c < N:
                                out[s, r, c] = acc[i, j, rr, cc]
                                written[s, r, c] += 1
    assert (written[:-1] == 1).all() if splits > 1 else (written == 1).all()
    return np.nansum(out, axis=0) if splits > 1 else out[0]


@pytest.mark.parametrize("key", list(CONFIGS))
@pytest.mark.parametrize("M,N,K,splits,block,threads", [(37, 53, 41, 1, None, None), (130, 67, 100, 1, 2, 128),
                                                        (20, 36, 300, 3, 1, 64)])
def test_emulated_tile_loop_matches_float64_on_odd_shapes(key, M, N, K, splits, block, threads):
    cfg, size = CONFIGS[key]
    caps = caps_for(key)
    p = plan_mma(M, N, K, caps, cfg.operand, block=block, threads=threads and threads * size // 32)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    np.testing.assert_allclose(emulate(a, b, p, splits), a @ b, rtol=1e-10, atol=1e-10)


def _gelu_then_matmul(dtype) -> Graph:
    g = Graph(inputs=["h"], outputs=["y"])
    g.info["h"] = TensorInfo(np.dtype(dtype), (256, 512))
    g.initializers = {"W": np.zeros((512, 256), dtype)}
    g.info["W"] = TensorInfo(np.dtype(dtype), (512, 256))
    g.nodes = [Node("Gelu", ["h"], ["a"], name="act"), Node("MatMul", ["a", "W"], ["y"], name="mm")]
    for n in g.nodes:
        infer_node(g, n)
    return g


@pytest.mark.parametrize("setting, units, fused", [("auto", True, False), ("auto", False, True), ("1", True, True),
                                                   ("0", False, False)])
def test_activations_stay_out_of_the_loads_of_gemms_on_matrix_units(monkeypatch, setting, units, fused):
    """fuse_prologues leaves an activation a kernel of its own where its GEMM runs on matrix units
    (their kernels ran 2-3.6x slower with it in their loads), unless ANYGRAD_WGPU_PROLOGUE=1;
    on ALUs (no matrix units for the operand type) it goes into the loads as before."""
    from anygrad.backends.wgpu.fusion.passes import prepare
    from anygrad.backends.wgpu.kernels.kernel import ops_where
    monkeypatch.setenv("ANYGRAD_WGPU_PROLOGUE", setting)
    caps = caps_for("16x16x16") if units else AdapterCaps(has_f16=True)
    g = prepare(_gelu_then_matmul(np.float16), caps, ops_where("epilogue"))
    assert len(g.nodes) == (1 if fused else 2) and g.nodes[-1].op == "MatMul", [n.op for n in g.nodes]
    assert (g.nodes[-1].attr("_prologueA") is not None) == fused
