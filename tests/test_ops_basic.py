"""Basic op families (elementwise, reductions, shape ops, linalg): forward and gradients against
PyTorch in float64 (onnxruntime where PyTorch has no equivalent, e.g. Slice with negative steps),
over shapes and attributes drawn by hypothesis."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from opcheck import check_op, run_op

from anygrad.ir import get_op

SETTINGS = settings(max_examples=20, deadline=None)
FEW = settings(max_examples=12, deadline=None)

dims = st.integers(1, 4)
shapes = st.lists(dims, min_size=0, max_size=4).map(tuple)
nonscalar = st.lists(dims, min_size=1, max_size=4).map(tuple)
seeds = st.integers(0, 2**31 - 1)


def normal(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def positive(seed: int, shape, lo=0.5, hi=2.0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


@st.composite
def broadcast_pair(draw):
    """Two shapes that broadcast: dims of the second set to 1 or dropped from the front; maybe swapped."""
    a = draw(shapes)
    b = [1 if draw(st.booleans()) else d for d in a][draw(st.integers(0, len(a))):]
    pair = (a, tuple(b))
    return pair[::-1] if draw(st.booleans()) else pair


@st.composite
def axes_for(draw, rank: int):
    """A subset of axes of a tensor of rank `rank`, each maybe written negatively."""
    chosen = draw(st.lists(st.integers(0, rank - 1), unique=True, max_size=rank)) if rank else []
    return [a - rank if draw(st.booleans()) else a for a in chosen]


def torch_dims(axes, rank, noop):
    """ONNX axes -> a torch dim tuple (None: no reduction at all)."""
    if not axes:
        return None if noop else tuple(range(rank))
    return tuple(a % rank for a in axes)


# -- binary elementwise ----------------------------------------------------------------------
BINARY = {
    "Add": (torch.add, normal, normal),
    "Sub": (torch.sub, normal, normal),
    "Mul": (torch.mul, normal, normal),
    "Div": (torch.div, normal, positive),
    "Pow": (torch.pow, positive, normal),
}


@pytest.mark.parametrize("op", sorted(BINARY))
@SETTINGS
@given(pair=broadcast_pair(), seed=seeds)
def test_binary_broadcast(op, pair, seed):
    fn, make_a, make_b = BINARY[op]
    a, b = make_a(seed, pair[0]), make_b(seed + 1, pair[1])
    check_op(op, [a, b], {}, fn, seed=seed % 1000)


def test_integer_div_truncates():
    outs, _, _ = run_op("Div", [np.array([7, -7, 6], np.int64), np.array([2, 2, -4], np.int64)], grad=False)
    np.testing.assert_array_equal(outs[0], [3, -3, -1])


# -- unary elementwise -----------------------------------------------------------------------
UNARY = {
    # op: (torch reference, input maker, attrs)
    "Neg": (torch.neg, normal, {}),
    "Identity": (lambda x: x, normal, {}),
    "Exp": (torch.exp, normal, {}),
    "Log": (torch.log, positive, {}),
    "Sqrt": (torch.sqrt, positive, {}),
    "Relu": (torch.relu, normal, {}),
    "LeakyRelu": (lambda x: torch.nn.functional.leaky_relu(x, 0.2), normal, {"alpha": 0.2}),
    "Sigmoid": (torch.sigmoid, lambda s, sh: 4 * normal(s, sh), {}),
    "Tanh": (torch.tanh, normal, {}),
    "Abs": (torch.abs, normal, {}),
    "Sign": (torch.sign, normal, {}),
    "Reciprocal": (torch.reciprocal, positive, {}),
    "Erf": (torch.erf, lambda s, sh: 2 * normal(s, sh), {}),
    "Floor": (torch.floor, lambda s, sh: 3 * normal(s, sh), {}),
    "Ceil": (torch.ceil, lambda s, sh: 3 * normal(s, sh), {}),
    "Round": (torch.round, lambda s, sh: 3 * normal(s, sh), {}),  # both round half to even
}


@pytest.mark.parametrize("op", sorted(UNARY))
@FEW
@given(shape=shapes, seed=seeds)
def test_unary(op, shape, seed):
    fn, make, attrs = UNARY[op]
    check_op(op, [make(seed, shape)], attrs, fn, seed=seed % 1000)


@FEW
@given(shape=shapes, seed=seeds, alpha=st.floats(-2.0, 2.0, allow_subnormal=False) | st.just(0.01))
def test_leaky_relu_alpha(shape, seed, alpha):
    """Any slope, the ONNX default 0.01 included (the attribute absent), like torch's leaky_relu."""
    attrs = {} if alpha == 0.01 else {"alpha": alpha}
    check_op("LeakyRelu", [normal(seed, shape)], attrs,
             lambda x: torch.nn.functional.leaky_relu(x, float(np.float32(alpha))), seed=seed % 1000)


F = torch.nn.functional
ACTIVATIONS = {
    # op: (attrs, torch reference)
    "Gelu": ({}, F.gelu),
    "Gelu-tanh": ({"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh")),
    "Elu": ({"alpha": 0.7}, lambda x: F.elu(x, 0.7)),
    "Selu": ({}, F.selu),
    "Celu": ({"alpha": 1.3}, lambda x: F.celu(x, 1.3)),
    "Softplus": ({}, F.softplus),
    "Softsign": ({}, F.softsign),
    "HardSigmoid": ({"alpha": 1 / 6, "beta": 0.5}, F.hardsigmoid),
    "HardSwish": ({}, F.hardswish),
    "Mish": ({}, F.mish),
    "Tanhshrink": ({}, F.tanhshrink),
    "Sin": ({}, torch.sin),
    "Cos": ({}, torch.cos),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@FEW
@given(shape=shapes, seed=seeds)
def test_activation(name, shape, seed):
    attrs, fn = ACTIVATIONS[name]
    x = 3 * normal(seed, shape)
    x = np.where(np.abs(np.abs(x) - 3) < 0.05, x + 0.2, x).astype(np.float32)  # hard kinks at +-3
    check_op(name.split("-")[0], [x], attrs, fn, seed=seed % 1000)


@FEW
@given(shape=st.lists(dims, min_size=2, max_size=4).map(tuple), per_channel=st.booleans(), seed=seeds)
def test_prelu(shape, per_channel, seed):
    # ONNX slope for channels is (C, 1, 1...); scalar otherwise
    slope_shape = (shape[1],) + (1,) * (len(shape) - 2) if per_channel else (1,)
    slope = np.random.default_rng(seed).uniform(0.05, 0.5, slope_shape).astype(np.float32)
    check_op("PRelu", [normal(seed, shape), slope], {}, lambda x, w: F.prelu(x, w.reshape(-1)))


def test_erf_accuracy_over_range():
    import math
    x = np.linspace(-6, 6, 2001)
    got = run_op("Erf", [x], grad=False)[0][0]
    want = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=1e-7)


def test_logic_ops():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 3, (3, 4)).astype(np.float32), rng.integers(0, 3, (4,)).astype(np.float32)
    cases = {"Equal": torch.eq, "Less": torch.lt, "LessOrEqual": torch.le, "Greater": torch.gt,
             "GreaterOrEqual": torch.ge}
    for op, fn in cases.items():
        out = run_op(op, [a, b], grad=False)[0][0]
        assert out.dtype == np.bool_
        np.testing.assert_array_equal(out, fn(torch.tensor(a), torch.tensor(b)).numpy(), err_msg=op)
    p, q = a > 0, b > 1
    for op, fn in {"And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor}.items():
        np.testing.assert_array_equal(run_op(op, [p, q], grad=False)[0][0], fn(p, q), err_msg=op)
    np.testing.assert_array_equal(run_op("Not", [p], grad=False)[0][0], ~p)


def test_comparison_blocks_no_gradient():
    """Where(x > 0, x, 0): the condition carries no gradient, the selected branch does."""
    x = normal(3, (3, 4))
    check_op("Where", [x > 0, x, np.zeros((), np.float32)], {},
             lambda c, x, z: torch.where(c, x, z), const=[2])


@SETTINGS
@given(shape=nonscalar, seed=seeds, data=st.data())
def test_where_broadcast(shape, seed, data):
    cond_shape = data.draw(st.sampled_from([shape, shape[1:], (1,) * len(shape)]))
    y_shape = data.draw(st.sampled_from([shape, shape[-1:], ()]))
    c = np.random.default_rng(seed).random(cond_shape) > 0.5
    check_op("Where", [c, normal(seed, shape), normal(seed + 1, y_shape)], {}, torch.where)


@FEW
@given(shape=shapes, seed=seeds, which=st.sampled_from(["both", "min", "max", "attrs", "none"]))
def test_clip(shape, seed, which):
    # keep x away from the bounds, where the gradient is a matter of convention
    x = normal(seed, shape)
    x = np.where(np.abs(np.abs(x) - 0.5) < 0.05, x + 0.2, x).astype(np.float32)
    lo, hi = np.array(-0.5, np.float32), np.array(0.5, np.float32)
    inputs, attrs = {"both": ([x, lo, hi], {}), "min": ([x, lo], {}), "max": ([x, None, hi], {}),
                     "attrs": ([x], {"min": -0.5, "max": 0.5}), "none": ([x], {})}[which]
    tmin = -0.5 if which in ("both", "min", "attrs") else None
    tmax = 0.5 if which in ("both", "max", "attrs") else None
    check_op("Clip", inputs, attrs, lambda x, *rest: torch.clamp(x, tmin, tmax) if tmin or tmax else x * 1,
             const=[1, 2])


@FEW
@given(shape=shapes, seed=seeds, which=st.sampled_from(["both", "min", "max"]),
       lo=st.sampled_from([-0.5, 0.0, 0.3]), hi=st.sampled_from([-0.2, 0.3, 0.5]), ties=st.booleans())
def test_clip_gradient_of_tensor_bounds_matches_torch_clamp(shape, seed, which, lo, hi, ties):
    """min/max as differentiable tensors: they receive the gradient of the elements they clip
    (PyTorch's conventions at ties, and for min > max, where every element is max)."""
    x = normal(seed, shape)
    if ties and x.size:  # elements exactly on a bound
        x.reshape(-1)[::2] = lo if which != "max" else hi
    lo_t, hi_t = np.array(lo, np.float32), np.array(hi, np.float32)
    inputs = {"both": [x, lo_t, hi_t], "min": [x, lo_t], "max": [x, None, hi_t]}[which]
    # torch 2.14 changed clamp's conventions at ties and for lo == hi; anygrad keeps 2.13's
    ref = clamp_inclusive if TORCH_VERSION >= (2, 14) else (lambda x, lo=None, hi=None: torch.clamp(x, lo, hi))
    check_op("Clip", inputs, {}, ref)


TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def clamp_inclusive(x, lo=None, hi=None):
    """torch.clamp with PyTorch's gradient conventions up to 2.13 (anygrad's): x takes the gradient
    where lo <= x <= hi, a bound the elements it clipped, lo only while lo < hi. torch 2.14 splits
    ties between x and a tensor bound, and gives lo == hi's clipped elements to lo; at a tie the
    gradient is a matter of convention. Written with masks, not clamp, so autograd derives it."""
    xd = x.detach()
    keep = torch.ones_like(xd, dtype=torch.bool)
    below = torch.zeros_like(keep)
    above = torch.zeros_like(keep)
    if lo is not None:
        keep &= xd >= lo.detach()
        below = xd < lo.detach()
    if hi is not None:
        keep &= xd <= hi.detach()
        above = xd > hi.detach()
    if lo is not None and hi is not None:
        below &= lo.detach() < hi.detach()
        above |= (hi.detach() <= lo.detach()) & (xd < lo.detach())  # lo >= hi: every clipped element is hi
    zero = torch.zeros((), dtype=x.dtype)
    out = torch.where(keep, x, zero)
    if lo is not None:
        out = out + torch.where(below, lo.expand_as(x), zero)
    if hi is not None:
        out = out + torch.where(above, hi.expand_as(x), zero)
    return out


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
@SETTINGS
@given(pair=broadcast_pair(), n=st.integers(1, 3), seed=seeds)
def test_variadic(op, pair, n, seed):
    shapes_ = [pair[i % 2] for i in range(n)]
    xs = [normal(seed + i, s) for i, s in enumerate(shapes_)]

    def ref(*ts):
        combine = {"Sum": torch.add, "Mean": torch.add, "Max": torch.maximum, "Min": torch.minimum}[op]
        out = ts[0]
        for t in ts[1:]:
            out = combine(out, t)
        return out / len(ts) if op == "Mean" else out * 1
    check_op(op, xs, {}, ref)


def test_max_splits_gradient_between_ties_like_torch():
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([1.0, 5.0, 0.0], np.float32)
    check_op("Max", [a, b], {}, torch.maximum)
    check_op("Min", [a, b], {}, torch.minimum)


@pytest.mark.parametrize("to,dtype", [(11, np.float64), (10, np.float16), (7, np.int64), (6, np.int32),
                                      (9, np.bool_), (1, np.float32)])
def test_cast(to, dtype):
    x = (3 * normal(0, (2, 5))).astype(np.float32)
    out = run_op("Cast", [x], {"to": to}, grad=False)[0][0]
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, x.astype(dtype))
    if np.issubdtype(dtype, np.floating) and dtype != np.float16:
        check_op("Cast", [x], {"to": to}, lambda t: t * 1)


def test_cast_int_to_float_and_castlike():
    i = np.array([[1, -2, 3]], np.int64)
    out = run_op("Cast", [i], {"to": 1})[0][0]
    assert out.dtype == np.float32 and out.tolist() == [[1.0, -2.0, 3.0]]
    x = normal(1, (2, 3))
    out = run_op("CastLike", [x, np.zeros((), np.float64)], const=[1])[0][0]
    assert out.dtype == np.float64
    check_op("CastLike", [x, np.zeros((), np.float64)], {}, lambda x, _: x * 1, const=[1])


# -- reductions ------------------------------------------------------------------------------
REDUCE = {
    # op: (torch reference(x, dims, keepdim) with dims None = no reduction, input maker, gradient?)
    "ReduceSum": (lambda x, d, k: x * 1 if d is None else torch.sum(x, d, keepdim=k), normal, True),
    "ReduceMean": (lambda x, d, k: x * 1 if d is None else torch.mean(x, d, keepdim=k), normal, True),
    "ReduceMax": (lambda x, d, k: x * 1 if d is None else torch.amax(x, d, keepdim=k), normal, True),
    "ReduceMin": (lambda x, d, k: x * 1 if d is None else torch.amin(x, d, keepdim=k), normal, True),
    "ReduceProd": (lambda x, d, k: x * 1 if d is None else _prod(x, d, k), normal, True),
    "ReduceL1": (lambda x, d, k: x.abs() if d is None else x.abs().sum(d, keepdim=k), normal, True),
    "ReduceL2": (lambda x, d, k: (x * x).sqrt() if d is None else torch.linalg.vector_norm(x, 2, d, keepdim=k),
                 normal, True),
    "ReduceSumSquare": (lambda x, d, k: x * x if d is None else (x * x).sum(d, keepdim=k), normal, True),
    "ReduceLogSum": (lambda x, d, k: x.log() if d is None else x.sum(d, keepdim=k).log(), positive, True),
    "ReduceLogSumExp": (lambda x, d, k: x * 1 if d is None else torch.logsumexp(x, d, keepdim=k), normal, True),
}


def _prod(x, dims, keepdim):
    for d in sorted(dims, reverse=True):
        x = torch.prod(x, d, keepdim=keepdim)
    return x


@pytest.mark.parametrize("op", sorted(REDUCE))
@SETTINGS
@given(shape=nonscalar, seed=seeds, keepdims=st.sampled_from([0, 1]), noop=st.sampled_from([0, 1]),
       as_input=st.booleans(), data=st.data())
def test_reduce(op, shape, seed, keepdims, noop, as_input, data):
    fn, make, grad = REDUCE[op]
    axes = data.draw(axes_for(len(shape)))
    x = make(seed, shape)
    attrs = {"keepdims": keepdims, "noop_with_empty_axes": noop}
    inputs = [x]
    if as_input:
        inputs.append(np.array(axes, np.int64))
    elif axes:
        attrs["axes"] = axes
    dims_ = torch_dims(axes, len(shape), noop)
    check_op(op, inputs, attrs, lambda t, *_: fn(t, dims_, bool(keepdims)), grad=grad, rtol=2e-4)


@SETTINGS
@given(shape=nonscalar, seed=seeds, keepdims=st.sampled_from([0, 1]), zeros=st.integers(0, 3), data=st.data())
def test_reduce_prod_gradient_with_zeros(shape, seed, keepdims, zeros, data):
    """Zeros in a group: one zero gets the product of the others, the rest 0; two zeros: all 0.
    torch.prod reduces one dim at a time, a reference independent of the running-product rule."""
    axes = data.draw(axes_for(len(shape)))
    x = normal(seed, shape)
    flat = x.reshape(-1)
    flat[np.random.default_rng(seed).permutation(flat.size)[:zeros]] = 0.0
    attrs = {"keepdims": keepdims, **({"axes": axes} if axes else {})}
    dims_ = torch_dims(axes, len(shape), 0)
    check_op("ReduceProd", [x], attrs, lambda t: _prod(t, dims_, bool(keepdims)), rtol=1e-4)


def test_reduce_prod_gradient_one_and_two_zeros():
    x = np.array([[0.0, 2.0, 3.0], [0.0, 0.0, 5.0], [1.0, 2.0, 4.0]], np.float32)
    _, grads, r = run_op("ReduceProd", [x], {"axes": [1], "keepdims": 0})
    want = np.array([[6.0, 0.0, 0.0], [0.0, 0.0, 0.0], [8.0, 4.0, 2.0]], np.float32) * r[:, None]
    np.testing.assert_allclose(grads[0], want, rtol=1e-6)  # finite where y / x would be inf or nan


def test_reduce_max_splits_ties_like_torch_amax():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], np.float32)
    check_op("ReduceMax", [x], {"axes": [1], "keepdims": 0}, lambda t: torch.amax(t, 1))


def test_reduce_l2_zero_norm_gradient_is_zero():
    x = np.zeros((2, 3), np.float32)
    _, grads, _ = run_op("ReduceL2", [x], {"axes": [1]})
    np.testing.assert_array_equal(grads[0], np.zeros_like(x))


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@SETTINGS
@given(shape=nonscalar, seed=seeds, keepdims=st.sampled_from([0, 1]), last=st.sampled_from([0, 1]),
       data=st.data())
def test_argmax_argmin(op, shape, seed, keepdims, last, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = np.random.default_rng(seed).integers(0, 3, shape).astype(np.float32)  # plenty of ties
    out = run_op(op, [x], {"axis": axis, "keepdims": keepdims, "select_last_index": last}, grad=False)[0][0]
    best = (x.max if op == "ArgMax" else x.min)(axis=axis, keepdims=True)
    positions = np.where(x == best, np.expand_dims(np.arange(shape[axis]), tuple(
        i for i in range(len(shape)) if i != axis % len(shape))), -1 if last else shape[axis])
    want = positions.max(axis=axis, keepdims=True) if last else positions.min(axis=axis, keepdims=True)
    if not keepdims:
        want = np.squeeze(want, axis)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, want)
    if not last:  # torch returns the first extreme index
        t = (torch.argmax if op == "ArgMax" else torch.argmin)(torch.tensor(x), axis, keepdim=bool(keepdims))
        np.testing.assert_array_equal(out, t.numpy())


# -- linalg ----------------------------------------------------------------------------------
@SETTINGS
@given(m=dims, k=dims, n=dims, batch=broadcast_pair(), vec=st.sampled_from(["", "a", "b"]), seed=seeds)
def test_matmul(m, k, n, batch, vec, seed):
    a_shape = (k,) if vec == "a" else batch[0] + (m, k)
    b_shape = (k,) if vec == "b" else batch[1] + (k, n)
    check_op("MatMul", [normal(seed, a_shape), normal(seed + 1, b_shape)], {}, torch.matmul, rtol=2e-4)


@SETTINGS
@given(m=dims, k=dims, n=dims, ta=st.sampled_from([0, 1]), tb=st.sampled_from([0, 1]),
       c=st.sampled_from(["none", "scalar", "row", "col", "full"]), alpha=st.sampled_from([1.0, 0.5]),
       beta=st.sampled_from([1.0, -2.0]), seed=seeds)
def test_gemm(m, k, n, ta, tb, c, alpha, beta, seed):
    a = normal(seed, (k, m) if ta else (m, k))
    b = normal(seed + 1, (n, k) if tb else (k, n))
    c_shape = {"none": None, "scalar": (), "row": (n,), "col": (m, 1), "full": (m, n)}[c]
    inputs = [a, b] + ([normal(seed + 2, c_shape)] if c_shape is not None else [])

    def ref(a, b, c=None):
        y = alpha * ((a.T if ta else a) @ (b.T if tb else b))
        return y if c is None else y + beta * c
    check_op("Gemm", inputs, {"transA": ta, "transB": tb, "alpha": alpha, "beta": beta}, ref, rtol=2e-4)


# -- shape ops -------------------------------------------------------------------------------
@SETTINGS
@given(shape=nonscalar, seed=seeds, data=st.data())
def test_reshape_zero_and_minus_one(shape, seed, data):
    target = list(shape[::-1]) if data.draw(st.booleans()) else list(shape)
    # 0 copies the input dim at that position (only where the dims agree, to stay valid)
    spec = [0 if i < len(shape) and shape[i] == d and data.draw(st.booleans()) else d for i, d in enumerate(target)]
    if data.draw(st.booleans()):
        spec[data.draw(st.integers(0, len(spec) - 1))] = -1
    check_op("Reshape", [normal(seed, shape), np.array(spec, np.int64)], {}, lambda t, _: t.reshape(target))


def test_reshape_allowzero():
    x = np.zeros((0, 3), np.float32)
    out = run_op("Reshape", [x, np.array([3, 0], np.int64)], {"allowzero": 1}, grad=False)[0][0]
    assert out.shape == (3, 0)
    out = run_op("Reshape", [normal(0, (2, 3)), np.array([0, 3], np.int64)], {"allowzero": 0}, grad=False)[0][0]
    assert out.shape == (2, 3)


@SETTINGS
@given(shape=shapes, seed=seeds, data=st.data())
def test_transpose(shape, seed, data):
    perm = data.draw(st.permutations(range(len(shape))))
    if data.draw(st.booleans()):
        check_op("Transpose", [normal(seed, shape)], {"perm": list(perm)}, lambda t: t.permute(tuple(perm)))
    else:  # default: reverse the axes
        check_op("Transpose", [normal(seed, shape)], {}, lambda t: t.permute(tuple(reversed(range(len(shape))))))


@SETTINGS
@given(pair=broadcast_pair(), seed=seeds)
def test_expand(pair, seed):
    small, big = sorted(pair, key=len)
    # the target may itself hold 1s where the input is larger (ONNX Expand broadcasts both ways)
    out_shape = np.broadcast_shapes(small, big)
    check_op("Expand", [normal(seed, small), np.array(big, np.int64)], {},
             lambda t, _: t.expand(tuple(out_shape)) * 1)


@SETTINGS
@given(shape=shapes, seed=seeds, data=st.data())
def test_flatten(shape, seed, data):
    axis = data.draw(st.integers(-len(shape), len(shape)))
    pos = axis + len(shape) if axis < 0 else axis
    lead = int(np.prod(shape[:pos]))
    check_op("Flatten", [normal(seed, shape)], {"axis": axis}, lambda t: t.reshape(lead, -1))


@SETTINGS
@given(shape=nonscalar, n=st.integers(1, 3), seed=seeds, data=st.data())
def test_concat(shape, n, seed, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    shapes_ = [tuple(data.draw(dims) if i == axis % len(shape) else d for i, d in enumerate(shape)) for _ in range(n)]
    xs = [normal(seed + i, s) for i, s in enumerate(shapes_)]
    check_op("Concat", xs, {"axis": axis}, lambda *ts: torch.cat(ts, axis))


@SETTINGS
@given(shape=nonscalar, seed=seeds, data=st.data())
def test_split(shape, seed, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    d = shape[axis]
    mode = data.draw(st.sampled_from(["input", "attr", "equal", "num_outputs"]))
    x = normal(seed, shape)
    if mode in ("input", "attr"):
        cut = sorted(data.draw(st.lists(st.integers(0, d), max_size=2)))
        sizes = np.diff([0] + cut + [d]).tolist()
        inputs = [x, np.array(sizes, np.int64)] if mode == "input" else [x]
        attrs = {"axis": axis} if mode == "input" else {"axis": axis, "split": sizes}
    else:  # ONNX: parts of ceil(d / n), the last one what is left (maybe nothing)
        n = data.draw(st.integers(1, d))
        chunk = -(-d // n)
        assume(d - chunk * (n - 1) >= 0)
        sizes = [chunk] * (n - 1) + [d - chunk * (n - 1)]
        inputs, attrs = [x], ({"axis": axis} if mode == "equal" else {"axis": axis, "num_outputs": n})
    outs = run_op("Split", inputs, attrs, n_outputs=len(sizes), grad=False)[0]
    want = torch.split(torch.tensor(x), sizes, axis)
    assert len(outs) == len(want)
    for o, w in zip(outs, want):
        np.testing.assert_array_equal(o, w.numpy())
    check_op("Split", inputs, attrs, lambda t, *_: torch.split(t, sizes, axis), n_outputs=len(sizes))


@SETTINGS
@given(shape=shapes, seed=seeds, data=st.data())
def test_tile(shape, seed, data):
    reps = [data.draw(st.integers(1, 3)) for _ in shape]
    check_op("Tile", [normal(seed, shape), np.array(reps, np.int64)], {}, lambda t, _: t.repeat(tuple(reps)) * 1)


TORCH_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


@SETTINGS
@given(shape=st.lists(st.integers(2, 4), min_size=3, max_size=4).map(tuple), seed=seeds,
       mode=st.sampled_from(sorted(TORCH_PAD_MODES)), with_axes=st.booleans(), data=st.data())
def test_pad(shape, seed, mode, with_axes, data):
    rank = len(shape)
    # torch pads the last 1-2 dims in the non-constant modes; constant mode may crop (negative pads)
    n = data.draw(st.integers(rank - 2, 2))  # what torch supports: 3-D pads 1-2 dims, 4-D pads 2
    lo = -1 if mode == "constant" else 0
    amounts = [(data.draw(st.integers(lo, 2 if mode != "reflect" else 1)),
                data.draw(st.integers(lo, 2 if mode != "reflect" else 1))) for _ in range(n)]
    padded = list(range(rank - n, rank))
    torch_pads = [v for b, a in reversed(amounts) for v in (b, a)]
    inputs = [normal(seed, shape)]
    if with_axes:  # opset 18: pads only for the listed axes
        inputs += [np.array([b for b, _ in amounts] + [a for _, a in amounts], np.int64),
                   np.array(1.5, np.float32), np.array(padded, np.int64)]
    else:
        full = [(0, 0)] * (rank - n) + amounts
        inputs += [np.array([b for b, _ in full] + [a for _, a in full], np.int64), np.array(1.5, np.float32)]
    value = 1.5 if mode == "constant" else None
    check_op("Pad", inputs, {"mode": mode},
             lambda t, *_: F.pad(t, torch_pads, mode=TORCH_PAD_MODES[mode], value=value), const=[2])


def test_pad_opset2_attributes_and_errors():
    from anygrad.errors import ShapeError
    x = normal(0, (2, 3))
    check_op("Pad", [x], {"pads": [0, 1, 1, 2], "value": 0.5}, lambda t: F.pad(t, (1, 2, 0, 1), value=0.5))
    with pytest.raises(ShapeError, match="Pad node"):
        run_op("Pad", [x, np.array([0, 3, 0, 0], np.int64)], {"mode": "reflect"})


@pytest.mark.parametrize("attrs,want", [
    ({"value": np.arange(6, dtype=np.float32).reshape(2, 3)}, np.arange(6, dtype=np.float32).reshape(2, 3)),
    ({"value_float": 2.5}, np.array(2.5, np.float32)),
    ({"value_floats": [1.0, 2.0]}, np.array([1.0, 2.0], np.float32)),
    ({"value_int": 7}, np.array(7, np.int64)),
    ({"value_ints": [3, -1]}, np.array([3, -1], np.int64)),
])
def test_constant(attrs, want):
    out = run_op("Constant", [], attrs, grad=False)[0][0]
    assert out.dtype == want.dtype and out.shape == want.shape
    np.testing.assert_array_equal(out, want)


@SETTINGS
@given(shape=shapes, seed=seeds, as_input=st.booleans(), data=st.data())
def test_squeeze(shape, seed, as_input, data):
    shape = tuple(data.draw(st.sampled_from([1, d])) for d in shape)
    ones = [i for i, d in enumerate(shape) if d == 1]
    axes = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(ones), unique=True) if ones else st.none()))
    axes = None if axes is None else [a - len(shape) if data.draw(st.booleans()) else a for a in axes]
    inputs = [normal(seed, shape)]
    attrs = {}
    if axes is not None:
        if as_input:
            inputs.append(np.array(axes, np.int64))
        else:
            attrs["axes"] = axes
    want = tuple(d for i, d in enumerate(shape) if not (d == 1 and (axes is None or i in [a % len(shape) for a in axes])))
    check_op("Squeeze", inputs, attrs, lambda t, *_: t.reshape(want))


@SETTINGS
@given(shape=shapes, seed=seeds, as_input=st.booleans(), data=st.data())
def test_unsqueeze(shape, seed, as_input, data):
    rank = len(shape) + data.draw(st.integers(1, 2))
    axes = data.draw(st.lists(st.integers(0, rank - 1), unique=True, min_size=rank - len(shape),
                              max_size=rank - len(shape)))
    want = list(shape)
    for a in sorted(axes):
        want.insert(a, 1)
    axes = [a - rank if data.draw(st.booleans()) else a for a in axes]
    inputs, attrs = ([normal(seed, shape), np.array(axes, np.int64)], {}) if as_input else \
        ([normal(seed, shape)], {"axes": axes})
    check_op("Unsqueeze", inputs, attrs, lambda t, *_: t.reshape(want))


@SETTINGS
@given(shape=shapes, start=st.none() | st.integers(-5, 5), end=st.none() | st.integers(-5, 5))
def test_shape_and_size(shape, start, end):
    attrs = {k: v for k, v in {"start": start, "end": end}.items() if v is not None}
    out = run_op("Shape", [np.zeros(shape, np.float32)], attrs, grad=False)[0][0]
    np.testing.assert_array_equal(out, np.array(shape[slice(start, end)], np.int64))
    assert out.dtype == np.int64
    size = run_op("Size", [np.zeros(shape, np.float32)], grad=False)[0][0]
    assert size.shape == () and int(size) == int(np.prod(shape))


@SETTINGS
@given(shape=nonscalar, idx_shape=st.lists(st.integers(1, 3), max_size=2).map(tuple), seed=seeds,
       data=st.data())
def test_gather(shape, idx_shape, seed, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    d = shape[axis]
    idx = np.random.default_rng(seed).integers(-d, d, idx_shape).astype(np.int64)  # negatives, repeats

    def ref(t, _):
        flat = torch.tensor((idx % d).reshape(-1))
        picked = torch.index_select(t, axis, flat)
        ax = axis % len(shape)
        return picked.reshape(shape[:ax] + idx_shape + shape[ax + 1:])
    check_op("Gather", [normal(seed, shape), idx], {"axis": axis}, ref)


def test_gather_with_runtime_indices_is_an_embedding():
    """Indices fed at run time (token ids): forward and the scatter-add gradient of the table."""
    from anygrad.autodiff import gradients
    from anygrad.backends import NumpyBackend
    from anygrad.ir import Graph, Node, TensorInfo, specialize

    table = normal(0, (6, 3))
    g = Graph(inputs=["ids"], outputs=["loss"])
    g.info["ids"] = TensorInfo(np.dtype(np.int64), ("N", 4))
    g.initializers = {"E": table}
    g.params = ["E"]
    g.nodes = [Node("Gather", ["E", "ids"], ["emb"], {"axis": 0}), Node("Mul", ["emb", "emb"], ["sq"]),
               Node("ReduceSum", ["sq"], ["loss"], {"keepdims": 0})]
    s = specialize(g, {"ids": (2, 4)})
    gr = gradients(s, "loss", ["E"])
    s.outputs = ["loss", "emb", gr["E"]]
    ids = np.array([[0, 5, 5, -1], [2, 2, 2, 0]], np.int64)
    out = NumpyBackend().compile(s).run({"ids": ids})
    t = torch.tensor(table, dtype=torch.float64, requires_grad=True)
    emb = torch.nn.functional.embedding(torch.tensor(ids % 6), t)
    (emb * emb).sum().backward()
    np.testing.assert_allclose(out["emb"], emb.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(out[gr["E"]], t.grad.numpy(), rtol=1e-5)


def test_gather_out_of_range_is_a_shape_error():
    from anygrad.errors import ShapeError
    with pytest.raises(ShapeError, match="Gather node"):
        run_op("Gather", [normal(0, (3, 2)), np.array([3], np.int64)], {"axis": 0})


@pytest.mark.parametrize("attrs,dtype,fill", [({}, np.float32, 0.0),
                                              ({"value": np.array([2.5], np.float32)}, np.float32, 2.5),
                                              ({"value": np.array([3], np.int64)}, np.int64, 3),
                                              ({"value": np.array([1.0], np.float64)}, np.float64, 1.0)])
def test_constant_of_shape(attrs, dtype, fill):
    out = run_op("ConstantOfShape", [np.array([2, 3], np.int64)], attrs, grad=False)[0][0]
    assert out.dtype == dtype and out.shape == (2, 3) and (out == fill).all()
    empty = run_op("ConstantOfShape", [np.array([0], np.int64)], attrs, grad=False)[0][0]
    assert empty.shape == (0,)


def _ort_slice(x, starts, ends, axes, steps):
    """onnxruntime's Slice (opset 13), the reference for ONNX's clamping rules."""
    inits = [helper.make_tensor(n, TensorProto.INT64, [len(v)], v)
             for n, v in zip(["s", "e", "a", "t"], [starts, ends, axes, steps])]
    graph = helper.make_graph([helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@SETTINGS
@given(shape=nonscalar, seed=seeds, data=st.data())
def test_slice_against_onnxruntime(shape, seed, data):
    rank = len(shape)
    axes = data.draw(st.lists(st.integers(0, rank - 1), unique=True, min_size=1, max_size=rank))
    starts = [data.draw(st.integers(-7, 7) | st.sampled_from([-2**63, 2**63 - 1])) for _ in axes]
    ends = [data.draw(st.integers(-7, 7) | st.sampled_from([-2**63, 2**63 - 1])) for _ in axes]
    steps = [data.draw(st.sampled_from([1, 2, 3, -1, -2])) for _ in axes]
    # onnxruntime's kernel reads end=INT64_MAX with a negative step as "through index 0", where the
    # spec (and ONNX's own shape inference) clamps it to dim-1: an empty slice. Leave that case out.
    ends = [e if not (e == 2**63 - 1 and s < 0) else 7 for e, s in zip(ends, steps)]
    neg_axes = [a - rank if data.draw(st.booleans()) else a for a in axes]
    x = normal(seed, shape)
    want = _ort_slice(x, starts, ends, neg_axes, steps)
    ints = [np.array(v, np.int64) for v in (starts, ends, neg_axes, steps)]
    out = run_op("Slice", [x] + ints, grad=False)[0][0]
    np.testing.assert_array_equal(out, want)

    # gradient: which input index each output position reads, per axis, from onnxruntime too
    picks = []
    for a in range(rank):
        if a in axes:
            i = axes.index(a)
            picks.append(_ort_slice(np.arange(shape[a], dtype=np.float32), [starts[i]], [ends[i]], [0],
                                    [steps[i]]).astype(np.int64))
        else:
            picks.append(np.arange(shape[a]))

    def ref(t, *_):
        for a, p in enumerate(picks):
            t = torch.index_select(t, a, torch.tensor(p, dtype=torch.int64))
        return t
    check_op("Slice", [x] + ints, {}, ref)


def test_slice_opset1_attributes():
    x = normal(0, (4, 5))
    check_op("Slice", [x], {"starts": [1, -3], "ends": [100, -1], "axes": [0, 1]}, lambda t: t[1:, -3:-1])


@pytest.mark.parametrize("start,limit,delta,dtype", [(0, 5, 1, np.int64), (10, 2, -3, np.int64),
                                                     (1.0, 2.0, 0.25, np.float32), (3, 3, 1, np.int32),
                                                     (-2.5, 1.0, 0.5, np.float64)])
def test_range(start, limit, delta, dtype):
    args = [np.array(v, dtype) for v in (start, limit, delta)]
    out = run_op("Range", args, const=[0, 1, 2], grad=False)[0][0]
    want = torch.arange(start, limit, delta, dtype=torch.float64).numpy()
    assert out.dtype == dtype
    np.testing.assert_allclose(out, want)


def test_every_op_in_these_families_is_registered():
    names = ["Add", "Sub", "Mul", "Div", "Pow", "Neg", "Identity", "Exp", "Log", "Sqrt", "Relu", "LeakyRelu",
             "Sigmoid", "Tanh", "MatMul", "Gemm", "Reshape", "Transpose", "Expand", "ReduceSum", "Flatten",
             "Concat", "Constant", "Squeeze", "Unsqueeze", "Shape", "Size", "Gather", "Cast", "ConstantOfShape",
             "Slice", "Range", "Equal", "Less", "Greater", "Where", "Not", "Abs", "Sign", "Reciprocal", "Clip",
             "Min", "Max", "Sum", "Mean", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2",
             "ReduceLogSumExp", "ArgMax", "ArgMin", "Erf", "Split", "Tile", "PRelu", "Pad"] + sorted(
                 {n.split("-")[0] for n in ACTIVATIONS})
    missing = [n for n in names if get_op(n) is None]
    assert not missing
    assert all(get_op(n).internal for n in ["GatherGrad", "SliceGrad", "ClipGrad", "ErfGrad", "PadGrad"])


def test_internal_scatter_ops_differentiate_to_their_forward_ops():
    """GatherGrad's gradient is a Gather, SliceGrad's a Slice: double backward works."""
    idx = np.array([[0, 2, 2]], np.int64)  # repeated index: contributions add up
    check_op("GatherGrad", [normal(1, (1, 3, 3)), idx], {"axis": 0, "shape": [4, 3]},
             lambda t, _: torch.zeros(4, 3, dtype=t.dtype).index_add(0, torch.tensor([0, 2, 2]), t.reshape(3, 3)))
    check_op("SliceGrad", [normal(2, (3, 2))], {"shape": [5, 2], "starts": [4, 0], "ends": [-1, 2],
                                                 "steps": [-2, 1]},
             lambda t: torch.zeros(5, 2, dtype=t.dtype).index_add(0, torch.tensor([4, 2, 0]), t))
