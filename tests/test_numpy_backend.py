"""The numpy backend's executor mechanisms: in-place kernels over dead temporaries, the
per-op profile, and the malloc setting. Reference: the same graph run with in-place disabled
(every registry kernel allocates), which must give bit-identical results."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import anygrad.backends.numpy as nb
from anygrad import _parallel
from anygrad.backends import NumpyBackend
from anygrad.ir import Graph, Node, TensorInfo, specialize

F32 = np.dtype("float32")


def _graph(nodes, inputs, outputs, shapes, dtypes=None) -> Graph:
    g = Graph(inputs=list(inputs), outputs=list(outputs))
    for name in inputs:
        g.info[name] = TensorInfo((dtypes or {}).get(name, F32), shapes[name])
    g.nodes = nodes
    return specialize(g, shapes)


def _run(g: Graph, feeds: dict, inplace: bool = True) -> tuple[dict, nb.NumpyExecutable]:
    exe = NumpyBackend().compile(g)
    if not inplace:
        exe.inplace, exe.epilogue, exe.passed_on = {}, {}, set()
    return exe.run(feeds), exe


def _chain():
    # Relu's input dies there (in place), ReluGrad's dy dies there (in place), Add's first
    # input is read again later (never in place).
    nodes = [Node("Mul", ["x", "x"], ["a"]),          # a: fresh temporary
             Node("Relu", ["a"], ["r"]),              # in place over a
             Node("Neg", ["r"], ["dy"]),
             Node("ReluGrad", ["dy", "r"], ["g"]),    # in place over dy
             Node("Add", ["r", "g"], ["s"]),          # r dies here: in place
             Node("Sub", ["x", "s"], ["out"])]        # x is a feed: never overwritten
    return _graph(nodes, ["x"], ["out", "g"], {"x": (3, 4)})


def test_inplace_steps_are_chosen_and_exact():
    g = _chain()
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    x_copy = x.copy()
    got, exe = _run(g, {"x": x})
    ref, _ = _run(g, {"x": x}, inplace=False)
    assert {g.nodes[s].op for s in exe.inplace} == {"Relu", "ReluGrad", "Add"}
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])
    np.testing.assert_array_equal(x, x_copy)  # the caller's feed is untouched
    r = np.maximum(x * x, 0)
    np.testing.assert_array_equal(got["out"], x - (r + -r * (r > 0)))


def test_epilogues_fuse_into_blocked_producers(monkeypatch):
    """An in-place kernel after a producer that writes in batch blocks runs on each block (many
    blocks on 2 threads here); bit-identical to the unfused, allocating run."""
    from anygrad.backends.numpy import conv, fastpaths

    monkeypatch.setenv("ANYGRAD_NUMPY_THREADS", "2")
    for name, value in (("_COLS_BUDGET", 2000), ("_PARALLEL_MIN", 0)):
        monkeypatch.setattr(conv, name, value)
    monkeypatch.setattr(fastpaths, "_BLOCK", 100)
    monkeypatch.setattr(_parallel, "SPLIT_MIN", 16)
    window = {"kernel_shape": [3, 3], "strides": [1, 1], "dilations": [1, 1], "pads": [1, 1, 1, 1], "group": 1}
    nodes = [Node("Conv", ["x", "w"], ["c"], {"pads": [1, 1, 1, 1]}),
             Node("Relu", ["c"], ["r"]),                                  # into Conv
             Node("ConvGradInput", ["r", "w"], ["dx"], {**window, "input_shape": [6, 2, 5, 5]}),
             Node("ReluGrad", ["dx", "x"], ["g"]),                        # into ConvGradInput
             Node("BatchNormGrad", ["g", "x", "s"], ["bx", "bs", "bb"]),
             Node("Add", ["bx", "x"], ["out"])]                           # into BatchNormGrad
    g = _graph(nodes, ["x", "w", "s"], ["out", "bs", "bb"], {"x": (6, 2, 5, 5), "w": (3, 2, 3, 3), "s": (2,)})
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((6, 2, 5, 5)).astype(np.float32),
             "w": rng.standard_normal((3, 2, 3, 3)).astype(np.float32),
             "s": rng.standard_normal(2).astype(np.float32)}
    got, exe = _run(g, feeds)
    ref, _ = _run(g, feeds, inplace=False)
    assert {(g.nodes[p].op, g.nodes[c].op) for p, c in exe.epilogue.items()} == {
        ("Conv", "Relu"), ("ConvGradInput", "ReluGrad"), ("BatchNormGrad", "Add")}
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])


def test_a_live_view_blocks_inplace():
    """Reshape returns a view of its input; overwriting that input would corrupt the view."""
    nodes = [Node("Neg", ["x"], ["a"]),
             Node("Reshape", ["a", "shape"], ["v"]),  # v is a view of a, alive after Relu
             Node("Relu", ["a"], ["r"]),              # a dies here, but v still shares it
             Node("Add", ["v", "v"], ["out"])]
    g = Graph(inputs=["x"], outputs=["out", "r"])
    g.info["x"] = TensorInfo(F32, (2, 3))
    g.initializers["shape"] = np.array([3, 2], np.int64)
    g.info["shape"] = TensorInfo(np.dtype(np.int64), (2,))
    g.nodes = nodes
    g = specialize(g, {"x": (2, 3)})
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)  # a = -x: relu changes every entry
    got, exe = _run(g, {"x": x})
    assert any(g.nodes[s].op == "Relu" for s in exe.inplace)  # a candidate at compile time...
    np.testing.assert_array_equal(got["out"], -2 * x.reshape(3, 2))  # ...refused at run time
    np.testing.assert_array_equal(got["r"], np.zeros_like(x))


def test_dtype_mismatch_is_not_inplace():
    g = _graph([Node("Mul", ["i", "i"], ["a"]), Node("Add", ["a", "f"], ["out"])], ["i", "f"], ["out"],
               {"i": (4,), "f": (4,)}, {"i": np.dtype(np.int32)})
    _, exe = _run(g, {"i": np.arange(4, dtype=np.int32), "f": np.ones(4, np.float32)})
    assert not exe.inplace


def test_state_is_never_overwritten():
    """A state update's value is kept past the step; the next run reads it as state."""
    g = Graph(inputs=["x"], outputs=["out"])
    g.info["x"] = TensorInfo(F32, (4,))
    g.initializers["s"] = np.zeros(4, np.float32)
    g.info["s"] = TensorInfo(F32, (4,))
    g.buffers = ["s"]
    g.nodes = [Node("Add", ["s", "x"], ["s2"]), Node("Relu", ["s2"], ["out"])]
    g.state_updates = {"s2": "s"}
    g = specialize(g, {"x": (4,)})
    be = NumpyBackend()
    exe = be.compile(g)
    x = np.array([1, -2, 3, -4], np.float32)
    exe.run({"x": x})
    out = exe.run({"x": x})["out"]
    np.testing.assert_array_equal(be.get_state("s"), 2 * x)
    np.testing.assert_array_equal(out, np.maximum(2 * x, 0))


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from(["Relu", "Neg", "Exp", "Add", "Mul", "Sub"]), min_size=1, max_size=8),
       st.integers(0, 2**31 - 1))
def test_random_chains_match_allocating_run(ops, seed):
    """Random elementwise chains whose temporaries are read at varying distances."""
    nodes, live = [], ["x"]
    rng = np.random.default_rng(seed)
    for k, op in enumerate(ops):
        a = live[rng.integers(len(live))]
        ins = [a, live[rng.integers(len(live))]] if op in ("Add", "Mul", "Sub") else [a]
        nodes.append(Node(op, ins, [f"t{k}"]))
        live.append(f"t{k}")
    outs = [f"t{len(ops) - 1}", live[rng.integers(len(live))]]
    g = _graph(nodes, ["x"], list(dict.fromkeys(outs)), {"x": (5,)})
    x = rng.standard_normal(5).astype(np.float32)
    got, _ = _run(g, {"x": x})
    ref, _ = _run(g, {"x": x}, inplace=False)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])


def test_profile_records_seconds_per_op(monkeypatch):
    monkeypatch.setenv("ANYGRAD_NUMPY_PROFILE", "1")
    g = _chain()
    _, exe = _run(g, {"x": np.ones((3, 4), np.float32)})
    assert set(exe.profile) == {n.op for n in g.nodes}
    assert all(v >= 0 for v in exe.profile.values())


def test_keep_freed_memory_is_idempotent():
    first = nb.keep_freed_memory()
    assert nb.keep_freed_memory() == first
    a = np.ones(10_000_000, np.float32)  # large allocations still work and are zeroed by numpy
    assert float(np.zeros_like(a).sum()) == 0.0


def test_split_inplace_kernels_match(monkeypatch):
    """Big in-place elementwise work is split into one flat slice per thread."""
    monkeypatch.setattr(_parallel, "SPLIT_MIN", 4)
    monkeypatch.setenv("ANYGRAD_NUMPY_THREADS", "3")
    g = _chain()
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    got, exe = _run(g, {"x": x})
    ref, _ = _run(g, {"x": x}, inplace=False)
    assert exe.inplace
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])


@pytest.mark.parametrize("threads", ["1", "2", "3", "reference"])
@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [1, 2, 0, 1]])
@pytest.mark.parametrize("strides", [[1, 1], [2, 1]])
def test_conv_batch_chunks_on_threads(monkeypatch, threads, pads, strides):
    """Conv, ConvGradInput and ConvGradWeight split into many batch chunks over worker threads
    (the numpy backend's im2col kernels, single-threaded BLAS inside), and the registry's plain
    tap-by-tap kernels, agree with PyTorch in double."""
    torch = pytest.importorskip("torch")
    from anygrad.backends.numpy import conv
    from anygrad.ir.graph import Node
    from anygrad.ops import nn

    monkeypatch.setenv("ANYGRAD_NUMPY_THREADS", "1" if threads == "reference" else threads)
    monkeypatch.setattr(conv, "_COLS_BUDGET", 2000)  # a few samples per chunk: many chunks
    monkeypatch.setattr(conv, "_PARALLEL_MIN", 0)  # threads even for these small tensors
    kernels = nn if threads == "reference" else conv  # the registry's plain kernels, or the backend's
    blas_before = _parallel.blas_threads()[0]() if _parallel.blas_threads() else None
    rng = np.random.default_rng(2)
    x = rng.standard_normal((11, 4, 7, 6)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 2)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    node = Node("Conv", ["x", "w", "b"], ["y"], {"pads": pads, "strides": strides, "group": 2})
    win = nn.window(node, x.shape[2:], w.shape[2:])
    y = kernels.conv(x, w, b, win, 2)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    xpad = torch.nn.functional.pad(xt, (pads[1], pads[3], pads[0], pads[2]))
    yt = torch.nn.functional.conv2d(xpad, wt, torch.tensor(b, dtype=torch.float64), stride=strides, groups=2)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-4, atol=1e-4)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    yt.backward(torch.tensor(dy, dtype=torch.float64))
    dx = kernels.conv_grad_input(dy, w, win, 2, x.shape)
    dw = kernels.conv_grad_weight(dy, x, win, 2, w.shape)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, wt.grad.numpy(), rtol=1e-4, atol=1e-4)
    assert y.dtype == dx.dtype == dw.dtype == np.float32
    if blas_before is not None:
        assert _parallel.blas_threads()[0]() == blas_before  # the BLAS thread count is restored


def test_conv_weight_gradient_bits_do_not_depend_on_threads(monkeypatch):
    """The weight gradient sums batch chunks in batch order, each on a single-threaded BLAS:
    1, 2 and 3 workers give the same bits (a SIGKILL-resumed run must match the original)."""
    if not _parallel.blas_threads():
        pytest.skip("OpenBLAS's thread count cannot be set here, so BLAS work is never split over threads")
    from anygrad.backends.numpy import conv as nn
    from anygrad.ops.nn import Window

    monkeypatch.setattr(nn, "_PARALLEL_MIN", 0)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((40, 16, 24, 24)).astype(np.float32)  # big enough for OpenBLAS to thread
    dy = rng.standard_normal((40, 24, 22, 22)).astype(np.float32)
    win = Window((24, 24), (3, 3), (1, 1), (1, 1), (0, 0), (0, 0), (22, 22))
    monkeypatch.setattr(nn, "_COLS_BUDGET", 6 * nn._Im2col(x.shape, win, 1).footprint(24))  # 7 chunks
    got = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("ANYGRAD_NUMPY_THREADS", threads)
        got.append(nn.conv_grad_weight(dy, x, win, 1, (24, 16, 3, 3)))
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], got[2])


@pytest.mark.parametrize("threads", ["1", "3", "reference"])
def test_batchnorm_batch_slices_on_threads(monkeypatch, threads):
    """Training BatchNormalization and BatchNormGrad split into batch blocks over threads (the
    numpy backend's fast path), and the registry's plain reference kernels, agree with PyTorch
    in double (forward output, running statistics and all three gradients)."""
    torch = pytest.importorskip("torch")
    from anygrad.backends.numpy import fastpaths
    from anygrad.ir.graph import Node
    from anygrad.ops import nn

    monkeypatch.setenv("ANYGRAD_NUMPY_THREADS", "1" if threads == "reference" else threads)
    monkeypatch.setattr(_parallel, "SPLIT_MIN", 16)
    monkeypatch.setattr(fastpaths, "_BLOCK", 100)  # blocks of one or two samples
    forward, backward = ((nn._bn_forward, nn._bn_grad_forward) if threads == "reference"
                         else (fastpaths.batch_norm, fastpaths.batch_norm_grad))
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((7, 3, 4, 5)) * 2 + 1).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    scale, bias = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    mean, var = np.zeros(3, np.float32), np.ones(3, np.float32)
    fwd = Node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
               {"training_mode": 1, "momentum": 0.9})
    y, rm, rv = forward(fwd, [x, scale, bias, mean, var])
    dx, dscale, dbias = backward(Node("BatchNormGrad", ["dy", "x", "s"], ["dx", "ds", "db"]), [dy, x, scale])
    bn = torch.nn.BatchNorm2d(3, momentum=0.1).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor(scale)), bn.bias.copy_(torch.tensor(bias))
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    yt = bn(xt)
    yt.backward(torch.tensor(dy, dtype=torch.float64))
    for got, want in [(y, yt), (rm, bn.running_mean), (rv, bn.running_var), (dx, xt.grad),
                      (dscale, bn.weight.grad), (dbias, bn.bias.grad)]:
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_forked_child_runs_threaded_kernels(monkeypatch):
    """A child forked after the worker pools exist (DataLoader workers, ...) must not wait on
    the parent's threads."""
    import multiprocessing

    from anygrad.backends.numpy import fastpaths

    monkeypatch.setenv("ANYGRAD_NUMPY_THREADS", "2")
    monkeypatch.setattr(_parallel, "SPLIT_MIN", 16)
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    want = fastpaths._batch_stats(x)[1]  # creates the pool in this process
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(fastpaths._batch_stats, (x,)).get(timeout=60)[1]
    np.testing.assert_allclose(got, want)


def test_batchnorm_blocks_of_a_non_contiguous_input(monkeypatch):
    """BatchNorm reshapes batch blocks in place: an input in another memory order must give the
    same bits as its C-ordered copy."""
    from anygrad.backends.numpy import fastpaths as nn  # the blocked kernels
    from anygrad.ir.graph import Node

    monkeypatch.setattr(nn, "_BLOCK", 100)
    rng = np.random.default_rng(5)
    x = np.asfortranarray(rng.standard_normal((5, 3, 4, 4)).astype(np.float32))
    dy = np.asfortranarray(rng.standard_normal(x.shape).astype(np.float32))
    scale, bias = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    fwd = Node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], {"training_mode": 1})
    grad = Node("BatchNormGrad", ["dy", "x", "s"], ["dx", "ds", "db"])
    state = [np.zeros(3, np.float32), np.ones(3, np.float32)]
    for f, c in ((nn.batch_norm(fwd, [x, scale, bias, *state]),
                  nn.batch_norm(fwd, [np.ascontiguousarray(x), scale, bias, *state])),
                 (nn.batch_norm_grad(grad, [dy, x, scale]),
                  nn.batch_norm_grad(grad, [np.ascontiguousarray(dy), np.ascontiguousarray(x), scale]))):
        for a, b in zip(f, c):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("a, b", [((0, 5), (5, 3)), ((4, 0), (0, 3)), ((300, 2000), (2000, 40)),
                                  ((40, 2000), (2000, 3000)), ((2, 1, 200, 300), (5, 300, 400))])
def test_split_matmul_matches_one_call(monkeypatch, a, b):
    """Row or column blocks on the workers: the same bits on every call (a run repeats), and one
    single-threaded BLAS call's values to float32 rounding (BLAS sums a block's edge rows with other
    kernels than the middle of one big call, so the last bits may differ)."""
    if not _parallel.blas_threads():
        pytest.skip("OpenBLAS's thread count cannot be set here, so BLAS work is never split over threads")
    monkeypatch.setenv("ANYGRAD_NUMPY_THREADS", "3")
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal(a).astype(np.float32), rng.standard_normal(b).astype(np.float32)
    with _parallel.serial_blas():
        got, want = _parallel.matmul(x, y), np.matmul(x, y)
    assert got.shape == want.shape
    np.testing.assert_array_equal(_parallel.matmul(x, y), got)
    exact = np.matmul(x.astype(np.float64), y.astype(np.float64))
    bound = 4 * np.finfo(np.float32).eps * np.matmul(np.abs(x).astype(np.float64), np.abs(y).astype(np.float64))
    assert np.all(np.abs(got - exact) <= bound + np.abs(want - exact))


@pytest.mark.parametrize("training", [1, 0], ids=["training", "eval"])
def test_fast_batch_norm_is_the_reference_kernel(training):
    """The numpy backend's blocked, threaded BatchNorm and its gradient (fastpaths.py) compute the
    registry's plain reference (ops/nn.py), to float32 noise; over several batch blocks, with and
    without an epilogue (a Relu applied to each block)."""
    from anygrad.backends.numpy import fastpaths
    from anygrad.ir.registry import get_op
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 8, 30, 30)) * 3 + 1).astype(np.float32)  # 288,000 elements: 2 blocks
    dy = rng.standard_normal(x.shape).astype(np.float32)
    scale, bias = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    mean, var = rng.standard_normal(8).astype(np.float32), rng.uniform(0.5, 2, 8).astype(np.float32)
    fwd = Node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"][:3 if training else 1],
               {"training_mode": training, "momentum": 0.9, "epsilon": 1e-5})
    grad = Node("BatchNormGrad", ["dy", "x", "s", "m", "v"], ["dx", "ds", "db"], {"epsilon": 1e-5, "training": training})
    for node, ins, fast in ((fwd, [x, scale, bias, mean, var], fastpaths.batch_norm),
                            (grad, [dy, x, scale, mean, var], fastpaths.batch_norm_grad)):
        want = get_op(node.op).run(node, ins)
        got = fast(node, ins)
        relu = fast(node, ins, epilogue=lambda s, block: np.maximum(block, 0, out=block))
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()), err_msg=node.op)
        np.testing.assert_allclose(relu[0], np.maximum(want[0], 0), rtol=1e-4, atol=1e-4 * float(np.abs(want[0]).max()))
