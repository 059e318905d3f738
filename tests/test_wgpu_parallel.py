"""Kernels split for parallelism (issue 11): reductions of every shape, the embedding gradient by
a GPU counting sort, max-pool gradients from precomputed window maxima, and grids folded past
the adapter's workgroups-per-dimension limit. Each against the numpy backend on lavapipe, the
large-shape paths reached on small shapes by lowering the module thresholds, and each checked to
give the same bits on a second run."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from wgpu_util import assert_close, op_graph, run_both, wgpu_backend

from anygrad.backends.wgpu.kernels import kernels_reduce

pytestmark = pytest.mark.wgpu

RNG = np.random.default_rng(11)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def backend():
    return wgpu_backend()  # skips the module when there is no adapter


def check(backend, op, inputs, attrs=None, *, kernels=(), rtol=1e-4, atol=1e-5, grad=True, const=(), feed=()):
    """wgpu vs numpy (outputs and gradients), that the plan took the kernels named in `kernels`
    (substrings of kernel names), and that a second run gives the same bits."""
    graph, feeds = op_graph(op, inputs, attrs, grad=grad, const=const, feed=feed)
    want, got, exe = run_both(graph, feeds, backend=backend)
    assert_close(want, got, rtol, atol, what=op)
    names = [st.kernel.name for st in exe.plan.steps]
    for k in kernels:
        assert any(k in n for n in names), f"{op}: no kernel '{k}' in {names}"
    again = exe.run(feeds)
    for name, value in got.items():
        assert np.asarray(value).tobytes() == np.asarray(again[name]).tobytes(), f"{op} {name}: bits differ"
    return exe


# -- reductions ------------------------------------------------------------------------------------
@pytest.fixture
def small_reduce(monkeypatch):
    """Thresholds scaled down so small shapes take the split paths that large ones take."""
    monkeypatch.setattr(kernels_reduce, "TARGET_THREADS", 64)
    monkeypatch.setattr(kernels_reduce, "TARGET_GROUPS", 16)
    monkeypatch.setattr(kernels_reduce, "MIN_CHUNK", 4)
    monkeypatch.setattr(kernels_reduce, "PER_GROUP", 64)
    monkeypatch.setattr(kernels_reduce, "SHORT", 8)


REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL1", "ReduceL2",
              "ReduceLogSumExp", "ReduceLogSum", "ReduceProd"]


def _reduce_input(op, *shape):
    x = randn(*shape)
    if op in ("ReduceLogSum", "ReduceProd"):  # positive sums; products near 1
        return np.abs(x) + 0.5 if op == "ReduceLogSum" else (1.0 + 0.01 * x).astype(np.float32)
    return x


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("shape,axes,kernel", [
    ((300, 7), (0,), ":cols"),          # many-ish outputs, long column reduction (bias gradient shape)
    ((5, 3000), (1,), ":split"),        # few outputs, long rows
    ((40, 6, 50), (0, 2), ":split"),    # rows over two merged-apart axes, chunked
    ((2, 90, 3, 5), (1,), ":cols"),     # reduced axis in the middle: kept axes innermost
    ((1000,), (0,), ":split"),          # one output
    ((6, 5), (1,), ":cols"),            # short rows: one slice of colsum.py's lanes
])
def test_reduce_split_paths(backend, small_reduce, op, shape, axes, kernel):
    x = _reduce_input(op, *shape)
    check(backend, op, [x, np.array(axes, np.int64)], {"keepdims": 0}, kernels=[kernel], rtol=3e-4, atol=1e-4)


def test_reduce_integer_max_split(backend, small_reduce):
    x = RNG.integers(-1000, 1000, size=(300, 7)).astype(np.int64)
    check(backend, "ReduceMax", [x, np.array([0], np.int64)], {"keepdims": 1}, kernels=[":cols"], grad=False,
          feed=(0,))


def test_reduce_default_thresholds_bias_gradient_shape(backend):
    """A bias gradient (rows x features summed over rows) at the real thresholds: many invocations,
    never one invocation per output looping over every row."""
    exe = check(backend, "ReduceSum", [randn(2048, 40), np.array([0], np.int64)], {"keepdims": 0},
                kernels=[":cols"], rtol=3e-4, atol=1e-4)
    first = next(st.kernel for st in exe.plan.steps if st.kernel.name == "ReduceSum:cols")
    assert first.workgroups[0] * 256 >= 40 * 64  # 40 outputs x 64 chunks of 32 rows


# -- grids past the per-dimension limit --------------------------------------------------------------
@pytest.fixture
def tiny_grid_backend():
    """A backend whose adapter limit reads 3 workgroups per dimension (27 per dispatch)."""
    b = wgpu_backend()
    b.caps = replace(b.caps, max_workgroups_per_dim=3)
    return b


@pytest.mark.parametrize("op,inputs,attrs", [
    ("Exp", lambda: [randn(40, 50)], {}),                                    # 8 workgroups, flat ids
    ("ReduceSum", lambda: [randn(20, 300), np.array([1], np.int64)], {"keepdims": 0}),  # barriers
    ("Softmax", lambda: [randn(20, 70)], {"axis": 1}),
    ("BatchNormalization", lambda: [randn(6, 3, 10, 10), randn(3), randn(3), np.zeros(3, np.float32),
                                    np.ones(3, np.float32)], {"training_mode": 1}),
])
def test_grid_fold_runs_every_kernel_within_the_limit(tiny_grid_backend, op, inputs, attrs):
    ins = inputs()
    n_out = 3 if op == "BatchNormalization" else 1
    graph, feeds = op_graph(op, ins, attrs, n_outputs=n_out, const=(3, 4) if n_out == 3 else ())
    want, got, exe = run_both(graph, feeds, backend=tiny_grid_backend)
    assert_close(want, got, 2e-4, 1e-5, what=op)
    grids = [st.kernel.workgroups for st in exe.plan.steps]
    assert all(max(g) <= 3 for g in grids), grids
    assert any(g[1] > 1 or g[2] > 1 for g in grids), grids  # something was folded


def test_grid_fold_keeps_ids_of_a_3d_grid():
    """The folded kernel sees the workgroup_id / num_workgroups / global_invocation_id of the grid
    it was written for: a kernel writing them per invocation, compared with numpy."""
    from anygrad.backends.wgpu.kernels.kernel import Kernel
    from anygrad.backends.wgpu.kernels.wgsl import bindings, shader
    from anygrad.backends.wgpu.planning.gridfold import fold_kernel

    b = wgpu_backend()
    X, Y, Z, W = 5, 4, 3, 2
    n = X * Y * Z * W
    body = f"""  let k = ((wid.z * nwg.y + wid.y) * nwg.x + wid.x) * {W}u + lid.x;
  out[k * 4u] = gid.x; out[k * 4u + 1u] = gid.y; out[k * 4u + 2u] = gid.z; out[k * 4u + 3u] = nwg.x * 100u + nwg.y * 10u + nwg.z;"""
    kern = Kernel("ids", shader(bindings([], [("out", "u32")]), body, wg=W), (X, Y, Z), (), ("ids",))
    folded = fold_kernel(kern, 4)
    assert max(folded.workgroups) <= 4 and np.prod(folded.workgroups) >= X * Y * Z
    got = _run_raw(b, folded, n * 4).reshape(Z, Y, X, W, 4)
    z, y, x, w = np.meshgrid(np.arange(Z), np.arange(Y), np.arange(X), np.arange(W), indexing="ij")
    np.testing.assert_array_equal(got[..., 0], x * W + w)
    np.testing.assert_array_equal(got[..., 1], y)
    np.testing.assert_array_equal(got[..., 2], z)
    assert (got[..., 3] == X * 100 + Y * 10 + Z).all()


def _run_raw(b, kern, n_u32: int) -> np.ndarray:
    """Dispatch one kernel with a single u32 output buffer and read it back."""
    buf = b.create_buffer(n_u32 * 4, b.storage_usage, "out")
    pipe = b.pipeline(kern.wgsl, kern.entry, (False,), kern.name)
    bgl, _ = b.layout((False,))
    bg = b.device.create_bind_group(layout=bgl, entries=[{"binding": 0, "resource": {"buffer": buf}}])
    enc = b.device.create_command_encoder()
    cpass = enc.begin_compute_pass()
    cpass.set_pipeline(pipe)
    cpass.set_bind_group(0, bg)
    cpass.dispatch_workgroups(*kern.workgroups)
    cpass.end()
    b.device.queue.submit([enc.finish()])
    return np.frombuffer(b.read(buf, n_u32 * 4), np.uint32).copy()


# -- embedding gradient: counting sort + segmented sums -------------------------------------------------
@pytest.fixture(params=[8, 3], ids=["radix8", "radix3"])
def radix_bits(request, monkeypatch):
    """8 bits a pass (the default), and 3 (several passes on a small vocabulary: odd and even
    ping-pong, keys wider than one pass)."""
    from anygrad.backends.wgpu.kernels import segments
    monkeypatch.setattr(segments, "BITS", request.param)


@pytest.mark.parametrize("data_shape,axis,idx", [
    ((50, 6), 0, lambda: RNG.integers(-50, 50, size=(3, 300))),         # 900 tokens: several blocks
    ((4, 300, 5), 1, lambda: RNG.integers(0, 300, size=(700,))),         # outer > 1, 2 passes at 8 bits
    ((7, 3), 0, lambda: np.full((600,), 2)),                              # one hot row (all equal)
    ((1000,), 0, lambda: RNG.integers(0, 1000, size=(33,))),              # inner 1, sparse
])
def test_gather_grad_sorted_segments(backend, radix_bits, data_shape, axis, idx):
    exe = check(backend, "Gather", [randn(*data_shape), idx().astype(np.int64)], {"axis": axis},
                kernels=["GatherGrad:sort.scatter", "GatherGrad:sum"], rtol=1e-5, atol=1e-6)
    assert not any(st.kernel.name == "GatherGrad" for st in exe.plan.steps)


@pytest.mark.parametrize("data_shape,axis,idx", [
    ((3, 5, 4), 1, lambda: np.array(0)),                           # a select, x[:, 0]: one position
    ((3, 6, 2), 0, lambda: np.array([2, -1, 2, 0])),               # repeats and a negative index
    ((6, 4), 0, lambda: RNG.integers(-6, 6, size=(2, 4))),         # 8 positions: the largest few
])
def test_gather_grad_few_indices(backend, data_shape, axis, idx):
    """A handful of positions (a select, q/k/v from a packed projection) take one kernel, no sort,
    and sum repeats in index order as the sorted path does."""
    exe = check(backend, "Gather", [randn(*data_shape), idx().astype(np.int64)], {"axis": axis},
                kernels=["GatherGrad:few"], rtol=1e-5, atol=1e-6)
    assert not any("sort" in st.kernel.name for st in exe.plan.steps)


def test_gather_grad_matches_sequential_scatter_add_bits(backend):
    """Each row sums in index order: bit-identical to numpy's np.add.at."""
    graph, feeds = op_graph("Gather", [randn(40, 3), RNG.integers(0, 40, size=(2000,)).astype(np.int64)],
                            {"axis": 0})
    want, got, _ = run_both(graph, feeds, backend=backend)
    grad = graph.outputs[-1]
    assert np.asarray(got[grad]).tobytes() == np.asarray(want[grad]).tobytes()


@pytest.fixture
def small_scan_tiles(monkeypatch):
    """Scan tiles of 4 x 4 vec4s (64 counts) and one workgroup for at most 2 of them, so that
    small inputs reach the tiled loop and the multi-level scan (nested twice) that large ones do."""
    from anygrad.backends.wgpu.kernels import segments
    monkeypatch.setattr(segments, "SCAN_WG", 4)
    monkeypatch.setattr(segments, "ONE_GROUP_TILES", 2)


def _run_scan(b, n: int, counts: np.ndarray) -> tuple[list[str], np.ndarray]:
    """segments' scan kernels over `counts` (n u32) on the device, read back."""
    from anygrad.backends.wgpu.kernels.segments import _scan_kernels
    kernels, scratch = _scan_kernels("t", "h", n)
    sizes = {"h": n, **{sc.name: sc.elements for sc in scratch}}
    bufs = {k: b.create_buffer(4 * v, b.storage_usage, k) for k, v in sizes.items()}
    b.device.queue.write_buffer(bufs["h"], 0, counts.astype(np.uint32).tobytes())
    enc = b.device.create_command_encoder()
    for kern in kernels:
        ro = (True,) * len(kern.reads) + (False,) * len(kern.writes)
        bgl, _ = b.layout(ro)
        bg = b.device.create_bind_group(layout=bgl, entries=[
            {"binding": k, "resource": {"buffer": bufs[v]}} for k, v in enumerate(kern.reads + kern.writes)])
        cpass = enc.begin_compute_pass()
        cpass.set_pipeline(b.pipeline(kern.wgsl, kern.entry, ro, kern.name))
        cpass.set_bind_group(0, bg)
        cpass.dispatch_workgroups(*kern.workgroups)
        cpass.end()
    b.device.queue.submit([enc.finish()])
    return [k.name for k in kernels], np.frombuffer(b.read(bufs["h"], n * 4), np.uint32).copy()


@pytest.mark.parametrize("small,n,levels", [
    (False, 4, 0), (False, 256, 0), (False, 4000, 0),           # one tile (huge counts at n = 4: u32 wrap)
    (False, 13568, 0),                                          # 4 tiles in one workgroup
    (False, 5 * 4096 - 256, 1),                                 # 5 tiles: a workgroup each
    (True, 120, 0), (True, 256, 1), (True, 1200, 1),            # small tiles: loop, multi-level
    (True, 4096 * 3 + 256 * 5, 2),                              # nested twice, padded totals
])
def test_sort_scan_matches_numpy(backend, request, small, n, levels):
    """The radix sort's exclusive prefix sum, bit for bit: one tile, several tiles through one
    workgroup, and a tile per workgroup (nested when the tile totals are many)."""
    if small:
        request.getfixturevalue("small_scan_tiles")
    counts = RNG.integers(0, 1 << 31, size=n, dtype=np.uint32) if n == 4 else RNG.integers(0, 300, size=n)
    names, got = _run_scan(backend, n, counts)
    want = np.concatenate([[0], np.cumsum(counts.astype(np.uint64))[:-1]]).astype(np.uint32)
    np.testing.assert_array_equal(got, want)
    assert names.count("t:sort.scan.tiles") == levels, names


@pytest.mark.parametrize("small", [False, True], ids=["default", "small_tiles"])
def test_gather_grad_two_passes_several_scan_tiles_bits(backend, request, small):
    """A vocabulary past 256 rows (two radix passes) and 16,000 tokens (four scan tiles in one
    workgroup; with small tiles, the multi-level scan): each row still sums in index order, as
    np.add.at does."""
    if small:
        request.getfixturevalue("small_scan_tiles")
    graph, feeds = op_graph("Gather", [randn(700, 2), RNG.integers(0, 700, size=(16000,)).astype(np.int64)],
                            {"axis": 0})
    want, got, exe = run_both(graph, feeds, backend=backend)
    grad = graph.outputs[-1]
    assert np.asarray(got[grad]).tobytes() == np.asarray(want[grad]).tobytes()
    names = [st.kernel.name for st in exe.plan.steps]
    assert names.count("GatherGrad:sort.scatter") == 2
    assert ("GatherGrad:sort.scan.tiles" in names) == small


@pytest.mark.parametrize("dshape,ishape,axis", [((40, 6), (700, 6), 0), ((3, 300), (3, 500), 1),
                                                ((2, 3, 5), (2, 2, 7), 2)])
def test_gather_elements_grad_sorted_segments(backend, radix_bits, dshape, ishape, axis):
    idx = RNG.integers(-dshape[axis], dshape[axis], size=ishape).astype(np.int64)
    check(backend, "GatherElements", [randn(*dshape), idx], {"axis": axis},
          kernels=["GatherElementsGrad:sort.scatter", "GatherElementsGrad:seg"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dshape,ishape,b", [((30, 5), (600, 1), 0), ((4, 5, 3), (300, 2), 0),
                                             ((3, 4, 5), (3, 200, 1), 1)])
def test_gather_nd_grad_sorted_segments(backend, radix_bits, dshape, ishape, b):
    k = ishape[-1]
    idx = np.stack([RNG.integers(-dshape[b + t], dshape[b + t], size=ishape[:-1]) for t in range(k)], -1)
    check(backend, "GatherND", [randn(*dshape), idx.astype(np.int64)], {"batch_dims": b},
          kernels=["GatherNDGrad:sort.scatter", "GatherNDGrad:seg"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max"])
def test_scatters_visit_only_their_segment(backend, radix_bits, reduction):
    """ScatterElements / ScatterND (forward, and on the gradient paths of scatters) through the
    sorted segments, with many repeated destinations over several sort blocks."""
    grad = reduction in ("none", "add")
    upd = (1.0 + 0.01 * randn(600, 4)).astype(np.float32)  # products of many updates stay near 1
    idx = RNG.integers(-20, 20, size=(600, 4)).astype(np.int64)
    check(backend, "ScatterElements", [randn(20, 4), idx, upd], {"axis": 0, "reduction": reduction},
          kernels=["ScatterElements:seg"], grad=grad, rtol=1e-4, atol=1e-5)
    idx_nd = RNG.integers(-30, 30, size=(500, 1)).astype(np.int64)
    upd_nd = (1.0 + 0.01 * randn(500, 3)).astype(np.float32)
    check(backend, "ScatterND", [randn(30, 3), idx_nd, upd_nd], {"reduction": reduction},
          kernels=["ScatterND:seg"] + (["ScatterNDMulGrad:seg"] if reduction == "mul" else []),
          grad=grad or reduction == "mul", rtol=1e-4, atol=1e-5)


# -- pooling gradients: window maxima once, then a gather ------------------------------------------
@pytest.mark.parametrize("xs,attrs,kernel", [
    ((3, 4, 16, 16), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, "MaxPoolGrad:gather"),
    ((1, 2, 9, 7), {"kernel_shape": [3, 2], "strides": [2, 1], "dilations": [2, 1], "ceil_mode": 1},
     "MaxPoolGrad:gather"),
    ((2, 2, 5, 6, 7), {"kernel_shape": [2, 3, 2], "strides": [2, 2, 1], "pads": [1, 1, 0, 0, 1, 1]},
     "MaxPoolGrad[nd]:gather"),
])
def test_max_pool_grad_gathers_from_window_maxima(backend, xs, attrs, kernel):
    x = np.round(randn(*xs) * 2) / 2  # ties: only the first maximum of a window gets its gradient
    exe = check(backend, "MaxPool", [x], attrs, kernels=[kernel.replace("gather", "argmax"), kernel])
    assert len([st for st in exe.plan.steps if "MaxPoolGrad" in st.kernel.name]) == 2


# -- BatchNorm statistics: channels split until the reduction has enough workgroups -------------------
def test_batchnorm_few_channels_split_into_partials(backend, monkeypatch):
    from anygrad.backends.wgpu.kernels import kernels_nn
    monkeypatch.setattr(kernels_nn, "MIN_PER_GROUP", 16)
    monkeypatch.setattr(kernels_nn, "TARGET_GROUPS", 24)  # 3 channels x 8 partials
    c = 3
    graph, feeds = op_graph("BatchNormalization", [randn(4, c, 10, 10), randn(c), randn(c),
                                                   np.zeros(c, np.float32), np.ones(c, np.float32)],
                            {"training_mode": 1}, n_outputs=3, const=(3, 4))
    want, got, exe = run_both(graph, feeds, backend=backend)
    assert_close(want, got, 2e-4, 1e-5, what="BatchNormalization")
    partial = [st.kernel for st in exe.plan.steps if st.kernel.name.endswith(":partial")]
    assert partial and all(k.workgroups[0] == c * 8 for k in partial), [k.workgroups for k in partial]
    again = exe.run(feeds)
    assert all(np.asarray(got[k]).tobytes() == np.asarray(again[k]).tobytes() for k in got)


@pytest.mark.parametrize("shape,axes", [((3, 0), (1,)), ((0, 4), (1,)), ((0, 40), (0,))])
def test_reduce_empty(backend, small_reduce, shape, axes):
    check(backend, "ReduceSum", [np.zeros(shape, np.float32), np.array(axes, np.int64)], {"keepdims": 0},
          grad=False, feed=(0,))
