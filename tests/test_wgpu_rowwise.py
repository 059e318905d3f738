"""Row-wise kernels of the transformer path against the numpy backend: cross-entropy (forward,
gradient, every option), CountCorrect with its top-k output, Softmax / LogSoftmax and their
gradients, LayerNorm and its gradient. Each runs both on rows that one workgroup (or one
invocation) takes whole and on rows split across workgroups (rowsplit.py), reached on small
shapes by lowering the split thresholds; two runs must give the same bits."""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import assert_close, op_graph, run_both, wgpu_backend

from anygrad.backends.wgpu.kernels import rowsplit

pytestmark = pytest.mark.wgpu

RNG = np.random.default_rng(11)


def randn(*shape, lo=None):
    x = RNG.standard_normal(shape).astype(np.float32)
    return np.abs(x) + lo if lo is not None else x


@pytest.fixture(scope="module")
def backend():
    return wgpu_backend()


@pytest.fixture(params=["whole", "split"])
def split(request, monkeypatch):
    """'split': rows are cut into chunks of 16+ elements, up to 512 workgroups in all."""
    if request.param == "split":
        monkeypatch.setattr(rowsplit, "SPLIT_MIN", 16)
        monkeypatch.setattr(rowsplit, "TARGET_GROUPS", 512)
    return request.param == "split"


def check(backend, op, inputs, attrs=None, *, kernels=(), rtol=1e-4, atol=1e-5, **kw):
    """op (and its input gradients unless grad=False) on numpy and wgpu; every prefix in
    `kernels` names a kernel of the plan; a second run gives the same bits."""
    graph, feeds = op_graph(op, inputs, attrs, **kw)
    want, got, exe = run_both(graph, feeds, backend=backend)
    assert_close(want, got, rtol, atol, what=op)
    names = [st.kernel.name for st in exe.plan.steps]
    for prefix in kernels:
        assert any(n.startswith(prefix) for n in names), f"{op}: no {prefix} kernel in {names}"
    again = exe.run(feeds)
    for k, v in got.items():
        np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(v), err_msg=f"{op} {k}: second run differs")
    return names


def targets(n, c, shape=None, ignore=None):
    t = RNG.integers(0, c, size=shape or (n,)).astype(np.int64)
    if ignore is not None:
        t.reshape(-1)[::3] = ignore
    return t


def stats_kernel(split: bool) -> str:
    return "partial" if split else "stats"


# -- cross-entropy ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_reductions_ignore_index(backend, split, reduction):
    """Long rows (300 classes): a workgroup per row, or 19 chunks of 16 per row when split."""
    x = randn(6, 300) * 3
    names = check(backend, "CrossEntropy", [x, targets(6, 300, ignore=-100)],
                  {"log_input": 0, "reduction": reduction, "ignore_index": -100}, rtol=2e-4,
                  kernels=(f"CrossEntropy:{stats_kernel(split)}", "CrossEntropy:rows", "CrossEntropyGrad:dx"))
    assert ("CrossEntropy:sum" in names) == (reduction != "none")


@pytest.mark.parametrize("log_input", [0, 1])
@pytest.mark.parametrize("shape", [(3, 200, 2), (5, 200), (5, 199)])
def test_cross_entropy_smoothing_and_weights(backend, split, log_input, shape):
    """Label smoothing with class weights (their total from one kernel), on spatial targets
    (N, C, d): the class axis has stride d; and on (N, C) rows, whose gradient goes 4 classes
    an invocation where C allows (200) and one where it does not (199)."""
    x = randn(*shape) * 2
    if log_input:
        x = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    w = randn(shape[1], lo=0.1)
    check(backend, "CrossEntropy", [x, targets(shape[0], shape[1], (shape[0], *shape[2:]), ignore=-1), w],
          {"log_input": log_input, "reduction": "mean", "ignore_index": -1, "label_smoothing": 0.2},
          const=[2], rtol=3e-4, atol=3e-5, kernels=("CrossEntropy:weight-total", "CrossEntropyGrad:dx"))


def test_cross_entropy_every_sample_ignored(backend, split):
    """mean over no sample: nan loss and a zero gradient, as PyTorch."""
    x = randn(4, 100)
    graph, feeds = op_graph("CrossEntropy", [x, np.full(4, -100, np.int64)],
                            {"log_input": 0, "reduction": "mean", "ignore_index": -100})
    want, got, _ = run_both(graph, feeds, backend=backend)
    assert np.isnan(got["out0"]) and np.isnan(want["out0"])
    grads = [k for k in got if k != "out0"]
    for k in grads:
        np.testing.assert_array_equal(got[k], want[k])


def test_softmax_cross_entropy_log_prob_output(backend, split):
    """ONNX SoftmaxCrossEntropyLoss with its log_prob output: x - lse of each row, from the split
    statistics too."""
    x = randn(5, 130) * 2
    check(backend, "SoftmaxCrossEntropyLoss", [x, targets(5, 130)], {"reduction": "sum"}, n_outputs=2,
          rtol=2e-4, kernels=("SoftmaxCrossEntropyLoss:logp",))


def test_nll_needs_no_statistics(backend):
    """NLL without smoothing reads only the targets' log-probabilities: no statistics pass."""
    x = randn(7, 50)
    names = check(backend, "NegativeLogLikelihoodLoss", [x, targets(7, 50)], {"reduction": "mean"})
    assert not any(n.endswith((":stats", ":partial")) for n in names)


def test_short_rows_take_one_invocation(backend):
    """Ten classes: one invocation per row (no workgroup reduction), rows summed in blocks of
    256 over 600 samples (three blocks)."""
    x = randn(600, 10) * 2
    check(backend, "CrossEntropy", [x, targets(600, 10, ignore=-100), randn(10, lo=0.1)],
          {"log_input": 0, "reduction": "mean", "ignore_index": -100}, const=[2], rtol=2e-4,
          kernels=("CrossEntropy:stats", "CrossEntropy:rows", "CrossEntropy:sum"))


# -- CrossEntropyMetrics: the loss with the counts, the gradient reusing its log-sum-exp -------------------
@pytest.mark.parametrize("reduction,smooth,log_input", [("mean", 0.0, 0), ("sum", 0.1, 0), ("none", 0.0, 0),
                                                        ("mean", 0.2, 1)])
def test_cross_entropy_metrics(backend, split, reduction, smooth, log_input):
    """Loss, per-row log-sum-exp, correct and top-3 counts from one statistics kernel, and the
    gradient without one. ignore_index 3 is a real class: the loss and the counts skip those rows
    (a hit there counts neither way, as the metrics of a token-level model need)."""
    n, c = 30, 120
    x = randn(n, c) * 2
    x[1, 3] = x[1].max() + 1  # row 1 (target 3, ignored) would be a hit
    if log_input:
        x = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    t = targets(n, c)
    t[::4] = np.argmax(x[::4], axis=1)
    t[1::6] = 3
    attrs = {"log_input": log_input, "reduction": reduction, "ignore_index": 3, "k": 3}
    if smooth:
        attrs["label_smoothing"] = smooth
    names = check(backend, "CrossEntropyMetrics", [x, t, randn(c, lo=0.1)], attrs, const=[2], n_outputs=4,
                  rtol=3e-4, atol=3e-5, kernels=(f"CrossEntropyMetrics:{stats_kernel(split)}",
                                                 "CrossEntropyMetrics:sum", "CrossEntropyGrad:dx"))
    assert not any(n.startswith("CrossEntropyGrad:") and n.endswith(("stats", "partial")) for n in names)


# -- CountCorrect and its top-k output -------------------------------------------------------------------
@pytest.mark.parametrize("k_out", [False, True])
def test_count_correct_and_top_k(backend, split, k_out):
    """Hits on purpose (the target made the argmax), ties at the max (the first index wins, as
    numpy's argmax), ignored targets, and a target tied with others for the top-k rule."""
    n, c = 40, 300
    x = np.round(randn(n, c) * 2, 1)
    t = targets(n, c)
    t[::2] = np.argmax(x[::2], axis=1)
    x[3, 7] = x[3, 250] = x[3].max() + 1  # tie at the max: index 7 counts, 250 does not
    t[3] = 250
    t[5] = -100
    t[6] = c + 4  # out of range: never a hit
    attrs = {"k": 5} if k_out else {}
    check(backend, "CountCorrect", [x, t], attrs, n_outputs=2 if k_out else 1, feed=[0, 1], grad=False,
          kernels=(f"CountCorrect:{stats_kernel(split)}", "CountCorrect:rows", "CountCorrect:sum"))


def test_count_correct_spatial(backend, split):
    """(N, C, d) scores: the class axis strided, spatial targets."""
    x = randn(3, 90, 4)
    t = np.argmax(x, axis=1)
    t[0, :2] = 0
    check(backend, "CountCorrect", [x, t.astype(np.int64)], {"k": 3}, n_outputs=2, feed=[0, 1], grad=False)


# -- Softmax / LogSoftmax and their gradients ------------------------------------------------------------
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,axis", [((4, 300), 1), ((3, 200, 2), 1), ((50, 40), -1)])
def test_softmax_rows(backend, split, op, shape, axis):
    """Whole rows: several rows a workgroup (300, 200 long; rowsplit.row_lanes) or one invocation
    (40 long) per row, one kernel; split: partial statistics, the per-row combine, then every
    element. The axis may be strided."""
    x = randn(*shape) * 4
    x.reshape(-1)[::7] += 30  # large logits: the online max must rescale its sum
    length = shape[axis]
    if length <= rowsplit.SERIAL_MAX:
        kernels = (f"{op}:row", f"{op}Grad:row")
    elif split:
        kernels = (f"{op}:partial", f"{op}:rows", f"{op}:write", f"{op}Grad:partial", f"{op}Grad:write")
    else:
        lanes = rowsplit.row_lanes(x.size // length, length)
        kind = f"rows{rowsplit.GROUP_WG // lanes}x{lanes}"
        kernels = (f"{op}:{kind}", f"{op}Grad:{kind}")
    names = check(backend, op, [x], {"axis": axis}, rtol=2e-4, atol=2e-5, kernels=kernels)
    if not split or length <= rowsplit.SERIAL_MAX:
        assert len([n for n in names if n.startswith(op)]) == 2, names  # one kernel each way


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("length", [40, 300])
def test_softmax_masked_rows(backend, split, op, length):
    """Attention masks fill with the lowest f32 (torch.finfo.min) or -inf: half-masked rows, a
    fully masked row (uniform, numpy's answer, not 0/0), -inf before the first finite element."""
    x = randn(6, length)
    lowest = np.finfo(np.float32).min
    x[:, length // 2:] = lowest
    x[2, :] = lowest
    x[4, :7] = lowest
    x[5, :3] = -np.inf  # masked leading elements, then finite ones
    graph, feeds = op_graph(op, [x], {"axis": -1}, grad=False, feed=[0])
    want, got, _ = run_both(graph, feeds, backend=backend)
    # LogSoftmax's outputs reach -inf and ~-3.4e38: no scale-relative atol (assert_close's) here
    np.testing.assert_allclose(got["out0"], want["out0"], rtol=2e-4, atol=2e-5)
    assert np.isfinite(want["out0"][2]).all() and np.isinf(want["out0"][5, :3]).all() == (op == "LogSoftmax")


# -- LayerNorm and its gradient -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,kind", [((40, 48), "row"), ((5, 300), "rows2x128"), ((3, 2100), "rows1x256")])
def test_layer_norm_one_read_per_row(backend, shape, kind):
    """Statistics from sums shifted by the row's first element, in one read: rows far from zero
    (mean 50, std 0.5) keep their variance; the gradient's four sums share one combine. dscale
    and dbias in one pass (colsum.py, sliced forms tested in test_wgpu_colsum.py)."""
    d = shape[-1]
    x = randn(*shape) * 0.5 + 50
    names = check(backend, "LayerNormalization", [x, randn(d), randn(d)], {"axis": -1}, n_outputs=3,
                  rtol=1e-3, atol=1e-4, kernels=(f"LayerNorm:{kind}", f"LayerNormGrad:{kind}",
                                                 "LayerNormGrad:params:cols"))
    grad = next(k for k in names if k.startswith("LayerNormGrad:row"))
    assert grad.endswith(kind)


def test_group_norm_one_read_per_row(backend):
    check(backend, "GroupNormalization", [randn(2, 4, 90) + 3, randn(4), randn(4)], {"num_groups": 2},
          rtol=5e-4, atol=5e-5, kernels=("GroupNormalization:rows4x64", "GroupNormGrad:rows4x64"))


# -- a whole training step over a vocabulary -------------------------------------------------------------------
def _vocab_step(fused: bool = True):
    """Linear 16 -> 300 classes, label-smoothed cross-entropy with ignored targets, SGD with
    momentum, top-5 counted: the step program as the trainer builds it. fused=False: the loss
    is scaled by 1 after the CrossEntropy node, so the step counts with a CountCorrect node."""
    import dataclasses

    from anygrad.ir import Graph, Node, TensorInfo
    from anygrad.losses import cross_entropy
    from anygrad.optim import SGD
    from anygrad.program import build_train_step

    loss = cross_entropy(label_smoothing=0.1)
    if not fused:
        build = loss.build
        loss = dataclasses.replace(loss, build=lambda b, out, t: b.op("Mul", [build(b, out, t), b.const(1.0)]))

    g = Graph(name="vocab", inputs=["x"], outputs=["logits"])
    g.info["x"] = TensorInfo(np.dtype(np.float32), (12, 16))
    g.initializers = {"W": (RNG.standard_normal((16, 300)) * 0.5).astype(np.float32),
                      "b": (RNG.standard_normal(300) * 0.1).astype(np.float32)}
    g.params = ["W", "b"]
    g.nodes = [Node("Gemm", ["x", "W", "b"], ["logits"])]
    return build_train_step(g, {"x": (12, 16)}, (12,), loss, SGD(lr=0.1, momentum=0.9), top_k=5)


@pytest.mark.parametrize("fused", [True, False])
def test_vocabulary_step_matches_numpy_and_repeats_bits(backend, split, fused):
    """The step's loss node counts correct and top-5 too (CrossEntropyMetrics: one read of the
    logits forward, one more for the gradient, which reuses the forward's log-sum-exp); loss,
    both counts and the updated weights match numpy over two steps, and a rerun from the same
    state gives the same bits."""
    from anygrad.backends import NumpyBackend
    from anygrad.program import TARGET, TOPK_SUM

    step = _vocab_step(fused)
    ops = [n.op for n in step.nodes]
    assert "CountTopK" not in ops
    grad = next(n for n in step.nodes if n.op == "CrossEntropyGrad")
    if fused:
        assert "CountCorrect" not in ops and "CrossEntropy" not in ops
        node = next(n for n in step.nodes if n.op == "CrossEntropyMetrics")
        assert len(node.outputs) == 4 and grad.inputs[4] == node.outputs[1]  # the gradient reuses the lse
    else:  # both counts from one CountCorrect node
        assert [len(n.outputs) for n in step.nodes if n.op == "CountCorrect"] == [2] and len(grad.inputs) == 3
    state = {name: np.asarray(step.initializers[name]) for name in step.params + step.buffers}
    x = RNG.standard_normal((12, 16)).astype(np.float32)
    t = RNG.integers(0, 300, 12).astype(np.int64)
    t[::5] = -100
    logits = x @ state["W"] + state["b"]
    t[1::5] = np.argmax(logits[1::5], axis=1)  # some hits for sure
    feeds = {"x": x, TARGET: t}

    def run(b, steps=2):
        for name, value in state.items():
            b.set_state(name, value)
        exe = b.compile(step)
        outs = [exe.run(feeds) for _ in range(steps)]
        return outs, {name: np.asarray(b.get_state(name)) for name in state}

    want, want_state = run(NumpyBackend())
    got, got_state = run(backend)
    names = [st.kernel.name for st in backend.compile(step).plan.steps]
    reads_logits = [n for n in names if n.startswith(("CrossEntropy", "CountCorrect"))
                    and n.endswith((":stats", ":partial", ":dx"))]
    if fused:
        assert reads_logits == [f"CrossEntropyMetrics:{stats_kernel(split)}", "CrossEntropyGrad:dx"], names
    for w, g_ in zip(want, got):
        assert_close(w, g_, rtol=2e-4, atol=2e-5, what="step")
    for name in state:
        np.testing.assert_allclose(got_state[name], want_state[name], rtol=2e-4, atol=2e-5, err_msg=name)
    assert want_state[TOPK_SUM] > 0
    again, again_state = run(backend)
    for a, g_ in zip(again, got):
        for k, v in g_.items():
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(v), err_msg=f"{k}: rerun differs")
    for name in state:
        np.testing.assert_array_equal(again_state[name], got_state[name], err_msg=f"{name}: rerun differs")
