"""Losses (values and gradients) vs torch.nn.functional; ONNX NLL/SCE ops; the CountCorrect metric."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from opcheck import check_op, run_op

from anygrad import Model
from anygrad.autodiff import gradients
from anygrad.backends import NumpyBackend
from anygrad.errors import ConfigError, ShapeError
from anygrad.ir import Builder, Graph, Node, TensorInfo, specialize
from anygrad.losses import LOSSES, get_loss
from anygrad.optim import SGD

F32 = np.dtype(np.float32)
FAST = settings(max_examples=25, deadline=None)


def loss_and_grad(name: str, output: np.ndarray, target: np.ndarray, **options):
    """Build `name` on a graph whose input is the model output; return (loss, d loss / d output)."""
    loss = get_loss(name, **options)
    g = Graph(inputs=["out", "target"], name=name)
    g.info["out"] = TensorInfo(F32, output.shape)
    g.info["target"] = TensorInfo(np.dtype(loss.target_dtype), target.shape)
    g = specialize(g, {})
    value = loss.build(Builder(g, prefix="loss"), "out", "target")
    grad = gradients(g, value, ["out"])["out"]
    g.outputs = [value, grad]
    res = NumpyBackend().compile(g).run({"out": output, "target": target.astype(loss.target_dtype)})
    return float(res[value]), res[grad]


def torch_loss_and_grad(fn, output: np.ndarray, target: torch.Tensor):
    x = torch.tensor(output, dtype=torch.float64, requires_grad=True)
    value = fn(x, target)
    value.backward()
    return value.item(), x.grad.numpy()


def assert_loss(name, output, target, torch_fn, torch_target, **options):
    ours, dours = loss_and_grad(name, output, target, **options)
    ref, dref = torch_loss_and_grad(torch_fn, output, torch_target)
    assert ours == pytest.approx(ref, rel=1e-5, abs=1e-6), name
    np.testing.assert_allclose(dours, dref, rtol=1e-4, atol=1e-6 * max(1.0, np.abs(dref).max()), err_msg=name)


shapes = st.tuples(st.integers(1, 6), st.integers(2, 6), st.lists(st.integers(1, 3), max_size=2))


def class_problem(data, n, c, spatial):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    logits = (rng.standard_normal((n, c, *spatial)) * 3).astype(np.float32)
    target = rng.integers(0, c, (n, *spatial)).astype(np.int64)
    return logits, target


# -- the losses ---------------------------------------------------------------------------------
@FAST
@given(shape=shapes, smoothing=st.sampled_from([0.0, 0.1, 0.37, 1.0]), data=st.data())
def test_cross_entropy(shape, smoothing, data):
    logits, target = class_problem(data, *shape)
    assert_loss("cross_entropy", logits, target,
                lambda x, t: F.cross_entropy(x, t, label_smoothing=smoothing), torch.tensor(target),
                label_smoothing=smoothing)


@FAST
@given(shape=shapes, smoothing=st.sampled_from([0.0, 0.2]), data=st.data())
def test_class_weights(shape, smoothing, data):
    logits, target = class_problem(data, *shape)
    if target.size > 1:
        target.flat[-1] = -100  # PyTorch's default ignore_index
    w = np.random.default_rng(shape[1]).uniform(0.1, 3.0, shape[1]).astype(np.float32)
    tw = torch.tensor(w, dtype=torch.float64)
    assert_loss("cross_entropy", logits, target,
                lambda x, t: F.cross_entropy(x, t, weight=tw, label_smoothing=smoothing), torch.tensor(target),
                label_smoothing=smoothing, weight=w.tolist())
    assert_loss("nll", logits, target, lambda x, t: F.nll_loss(x, t, weight=tw), torch.tensor(target), weight=w)


@FAST
@given(shape=shapes, data=st.data())
def test_nll_on_log_softmax(shape, data):
    logits, target = class_problem(data, *shape)
    logp = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), 1).numpy().astype(np.float32)
    assert_loss("nll", logp, target, F.nll_loss, torch.tensor(target))


@FAST
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), name=st.sampled_from(["mse", "l1", "bce_with_logits"]),
       data=st.data())
def test_elementwise_losses(shape, name, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    out = (rng.standard_normal(shape) * 4).astype(np.float32)
    if name == "bce_with_logits":
        out[..., 0] = rng.choice([-80.0, 80.0])  # far tails: the stable formula must not overflow
        target = rng.random(shape).astype(np.float32)
    else:
        target = rng.standard_normal(shape).astype(np.float32)
    fn = {"mse": F.mse_loss, "l1": F.l1_loss, "bce_with_logits": F.binary_cross_entropy_with_logits}[name]
    assert_loss(name, out, target, fn, torch.tensor(target, dtype=torch.float64))


@pytest.mark.parametrize("x", [80.0, -80.0, 30.0, -30.0])
def test_bce_with_logits_keeps_its_digits_in_both_tails(x):
    """Targets near the logit's own side: the loss is small beside x, and x - x*t (or -x*t) must not
    cancel (float32 lost four digits at x = 80, t = 0.9986 with max(x, 0) - x*t)."""
    t = np.array([0.9986448, 0.999, 0.5, 0.0013552, 0.001], np.float32)
    t = t if x > 0 else 1 - t
    out = np.full(t.shape, x, np.float32)
    for k in range(len(t)):
        assert_loss("bce_with_logits", out[k:k + 1], t[k:k + 1], F.binary_cross_entropy_with_logits,
                    torch.tensor(t[k:k + 1], dtype=torch.float64))


def test_l1_gradient_is_zero_at_ties():
    out = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    target = np.array([[1.0, 0.0], [3.0, 5.0]], np.float32)
    assert_loss("l1", out, target, F.l1_loss, torch.tensor(target, dtype=torch.float64))


def test_targets_reshaped_or_rejected():
    out = np.random.default_rng(0).standard_normal((4, 1)).astype(np.float32)
    target = np.arange(4, dtype=np.float32)  # (N,) against an (N, 1) output: same layout
    assert_loss("mse", out, target, F.mse_loss, torch.tensor(target[:, None], dtype=torch.float64))
    with pytest.raises(ShapeError, match="mse"):
        loss_and_grad("mse", out, np.zeros(5, np.float32))
    with pytest.raises(ShapeError, match="cross_entropy"):
        loss_and_grad("cross_entropy", np.zeros(4, np.float32), np.zeros(4, np.int64))


def test_loss_registry():
    assert {"cross_entropy", "nll", "mse", "l1", "bce_with_logits"} <= set(LOSSES)
    assert get_loss("cross_entropy").classification and get_loss("nll").target_dtype == np.int64
    assert not get_loss("mse").classification and get_loss("bce_with_logits").target_dtype == np.float32
    with pytest.raises(ConfigError, match="unknown loss"):
        get_loss("hinge")
    with pytest.raises(ConfigError, match="label_smoothing"):
        get_loss("cross_entropy", label_smoothing=1.5)
    with pytest.raises(ConfigError, match="nll"):
        get_loss("nll", label_smoothing=0.1)


# -- ONNX ops and the internal CrossEntropy with weights / ignore_index --------------------------
def weighted_problem(data, n, c, spatial):
    logits, target = class_problem(data, n, c, spatial)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    ignore = data.draw(st.sampled_from([None, -100, 1]))
    if ignore is not None:
        drop = rng.random(target.shape) < 0.3
        target[drop] = ignore
        target.flat[0] = 0  # at least one sample counts, so `mean` is defined
    weight = rng.uniform(0.2, 2.0, c).astype(np.float32) if data.draw(st.booleans()) else None
    return logits, target, weight, ignore


def torch_kwargs(weight, ignore, reduction):
    return {"weight": None if weight is None else torch.tensor(weight, dtype=torch.float64),
            "ignore_index": -100 if ignore is None else ignore, "reduction": reduction}


def onnx_attrs(ignore, reduction):
    return {"reduction": reduction, **({} if ignore is None else {"ignore_index": ignore})}


@FAST
@given(shape=shapes, reduction=st.sampled_from(["mean", "sum", "none"]), data=st.data())
def test_onnx_negative_log_likelihood_loss(shape, reduction, data):
    logits, target, weight, ignore = weighted_problem(data, *shape)
    check_op("NegativeLogLikelihoodLoss", [logits, target, weight], onnx_attrs(ignore, reduction),
             lambda x, t, w: F.nll_loss(x, t, **torch_kwargs(weight, ignore, reduction)), const=[2])


@FAST
@given(shape=shapes, reduction=st.sampled_from(["mean", "sum", "none"]), data=st.data())
def test_onnx_softmax_cross_entropy_loss(shape, reduction, data):
    logits, target, weight, ignore = weighted_problem(data, *shape)
    check_op("SoftmaxCrossEntropyLoss", [logits, target, weight], onnx_attrs(ignore, reduction),
             lambda x, t, w: F.cross_entropy(x, t, **torch_kwargs(weight, ignore, reduction)), const=[2])


@FAST
@given(shape=shapes, reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.05, 0.3]),
       data=st.data())
def test_label_smoothing_with_weights_and_ignore(shape, reduction, smoothing, data):
    logits, target, weight, ignore = weighted_problem(data, *shape)
    attrs = {**onnx_attrs(ignore, reduction), "label_smoothing": smoothing}
    check_op("CrossEntropy", [logits, target, weight], attrs,
             lambda x, t, w: F.cross_entropy(x, t, label_smoothing=smoothing, **torch_kwargs(weight, ignore, reduction)),
             const=[2])


def test_softmax_cross_entropy_log_prob_output_and_its_gradient():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5, 2)).astype(np.float32)
    t = rng.integers(0, 5, (4, 2)).astype(np.int64)
    r0, r1 = np.float32(0.7), rng.standard_normal(x.shape).astype(np.float32)
    g = Graph(inputs=["x"], outputs=["loss", "logp"], name="sce")
    g.info["x"] = TensorInfo(F32, x.shape)
    g.initializers["t"] = t
    g.nodes = [Node("SoftmaxCrossEntropyLoss", ["x", "t"], ["loss", "logp"], {"reduction": "mean"})]
    g = specialize(g, {})
    b = Builder(g)
    total = b.op("Add", [b.op("Mul", ["loss", b.const(r0)]),
                         b.op("ReduceSum", [b.op("Mul", ["logp", b.const(r1)])], keepdims=0)])
    grad = gradients(g, total, ["x"])["x"]
    g.outputs = ["loss", "logp", grad]
    res = NumpyBackend().compile(g).run({"x": x})
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    loss, logp = F.cross_entropy(xt, torch.tensor(t)), torch.log_softmax(xt, 1)
    (loss * float(r0) + (logp * torch.tensor(r1, dtype=torch.float64)).sum()).backward()
    np.testing.assert_allclose(res["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(res["logp"], logp.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res[grad], xt.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_onnx_ops_match_onnxruntime():
    """The ONNX spec's own reference: weighted mean with ignore_index, and spatial dims."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 2)).astype(np.float32)
    t = rng.integers(0, 4, (3, 2)).astype(np.int64)
    t[0, 1] = 2
    w = rng.uniform(0.5, 2, 4).astype(np.float32)
    for op in ("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"):
        for reduction in ("mean", "sum", "none"):
            attrs = {"reduction": reduction, "ignore_index": 2}
            node = helper.make_node(op, ["x", "t", "w"], ["y"], **attrs)
            graph = helper.make_graph([node], "g", [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
                helper.make_tensor_value_info("t", TensorProto.INT64, t.shape),
                helper.make_tensor_value_info("w", TensorProto.FLOAT, w.shape)],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
            sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            want = sess.run(None, {"x": x, "t": t, "w": w})[0]
            outs, _, _ = run_op(op, [x, t, w], attrs, grad=False)
            np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-6, err_msg=f"{op} {reduction}")


def test_bad_target_index_is_a_data_error():
    from anygrad.errors import DataError
    with pytest.raises(DataError, match="outside"):
        run_op("NegativeLogLikelihoodLoss", [np.zeros((2, 3), np.float32), np.array([0, 3])], {}, grad=False)


# -- accuracy -----------------------------------------------------------------------------------
@FAST
@given(n=st.integers(1, 8), c=st.integers(1, 5), spatial=st.lists(st.integers(1, 3), max_size=1), data=st.data())
def test_count_correct(n, c, spatial, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    out = rng.integers(0, 3, (n, c, *spatial)).astype(np.float32)  # small integers: many ties
    target = rng.integers(0, c, (n, *spatial)).astype(np.int64)
    outs, _, _ = run_op("CountCorrect", [out, target], {}, grad=False)
    assert outs[0].dtype == np.float32 and outs[0].shape == ()
    assert float(outs[0]) == float(np.sum(np.argmax(out, axis=1) == target))


def test_accuracy_through_the_model():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    g = Graph(inputs=["x"], outputs=["y"])
    g.initializers = {"W": w, "b": np.zeros(3, np.float32)}
    g.params = ["W", "b"]
    g.info["x"] = TensorInfo(F32, ("N", 4))
    g.nodes = [Node("Gemm", ["x", "W", "b"], ["y"], {"transB": 1})]
    model = Model(g).compile(loss="cross_entropy", optimizer=SGD(lr=0.1), device="cpu", label_smoothing=0.1)
    x = rng.standard_normal((10, 4)).astype(np.float32)
    y = rng.integers(0, 3, 10)
    logits = x @ w.T
    metrics = model.evaluate(x, y, batch_size=4)
    assert metrics["accuracy"] == pytest.approx(np.mean(np.argmax(logits, 1) == y))
    want = F.cross_entropy(torch.tensor(logits, dtype=torch.float64), torch.tensor(y), label_smoothing=0.1).item()
    assert metrics["loss"] == pytest.approx(want, rel=1e-5)
    first = model.train_on_batch(x, y)
    assert first == pytest.approx(want, rel=1e-5)
    assert model.train_on_batch(x, y) < first


@pytest.mark.parametrize("name", ["nll", "cross_entropy"])
def test_float_class_targets_whole_numbers_accepted_fractions_refused(name):
    """Labels as floats (1.0) mean the class; 1.7 is not silently truncated to class 1."""
    from anygrad.errors import DataError
    rng = np.random.default_rng(3)
    g = Graph(inputs=["x"], outputs=["y"])
    g.initializers = {"W": rng.standard_normal((3, 4)).astype(np.float32)}
    g.params = ["W"]
    g.info["x"] = TensorInfo(F32, ("N", 4))
    g.nodes = [Node("Gemm", ["x", "W"], ["z"], {"transB": 1}), Node("LogSoftmax", ["z"], ["y"], {"axis": 1})]
    model = Model(g).compile(loss=name, optimizer=SGD(lr=0.0), device="cpu")
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.integers(0, 3, 6)
    want = model.train_on_batch(x, y)
    assert model.train_on_batch(x, y.astype(np.float32)) == want
    assert model.train_on_batch(x, y.astype(np.float64).reshape(6, 1)) == want
    for bad in (y + 0.5, np.where(np.arange(6) == 2, np.nan, y)):
        with pytest.raises(DataError, match=f"loss '{name}' takes class indices.*non-integer"):
            model.train_on_batch(x, bad.astype(np.float32))
    with pytest.raises(DataError, match="non-integer"):
        model.evaluate(x, y + 0.25)
    with pytest.raises(DataError, match="dtype <U1"):
        model.train_on_batch(x, np.array(list("abcabc")))


@pytest.mark.parametrize("smoothing,ignore", [(0.0, -100), (0.1, 2)])
def test_cross_entropy_metrics_is_the_loss_with_the_counts(smoothing, ignore):
    """The fused op the step uses: PyTorch's loss and its gradient (through the forward's
    log-sum-exp), torch.logsumexp per sample, and CountCorrect's two counts on the targets not ignored."""
    rng = np.random.default_rng(5)
    out = rng.standard_normal((12, 9)).astype(np.float32) * 2
    target = rng.integers(0, 9, 12)
    target[::4] = ignore
    attrs = {"log_input": 0, "reduction": "mean", "ignore_index": ignore, "label_smoothing": smoothing, "k": 3}
    outs, grads, r = run_op("CrossEntropyMetrics", [out, target], attrs, n_outputs=4)
    x = torch.tensor(out, dtype=torch.float64, requires_grad=True)
    want = F.cross_entropy(x, torch.tensor(target), ignore_index=ignore, label_smoothing=smoothing)
    (want * float(r)).backward()
    np.testing.assert_allclose(outs[0], want.item(), rtol=1e-5)
    np.testing.assert_allclose(grads[0], x.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(outs[1], torch.logsumexp(x, 1).detach().numpy(), rtol=1e-6)
    counted = np.where(target == ignore, -1, target)  # ignored targets count neither way
    counts, _, _ = run_op("CountCorrect", [out, counted], {"k": 3}, n_outputs=2, grad=False)
    assert float(outs[2]) == float(np.sum(np.argmax(out, axis=1) == counted)) == float(counts[0])
    assert float(outs[3]) == float(counts[1]) == float(run_op("CountTopK", [out, counted], {"k": 3}, grad=False)[0][0])
