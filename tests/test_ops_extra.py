"""Ops added for ONNX coverage (attention, math_extra, image, spectral, quant, bitwise): forward
and gradients against PyTorch in float64 (numpy where torch has no counterpart)."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from opcheck import check_op, run_op

from anygrad.ir import Graph, Node, TensorInfo, specialize


def _randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -- elementwise math ------------------------------------------------------------------------
TRIG = [("Tan", torch.tan, (-1.2, 1.2)), ("Asin", torch.asin, (-0.9, 0.9)), ("Acos", torch.acos, (-0.9, 0.9)),
        ("Atan", torch.atan, (-3, 3)), ("Sinh", torch.sinh, (-2, 2)), ("Cosh", torch.cosh, (-2, 2)),
        ("Asinh", torch.asinh, (-3, 3)), ("Acosh", torch.acosh, (1.1, 4)), ("Atanh", torch.atanh, (-0.9, 0.9))]


@pytest.mark.parametrize("op,fn,bounds", TRIG, ids=[t[0] for t in TRIG])
def test_trig_and_hyperbolic(op, fn, bounds):
    x = np.random.default_rng(0).uniform(*bounds, size=(3, 4)).astype(np.float32)
    check_op(op, [x], {}, fn)


@pytest.mark.parametrize("op,attrs,fn", [
    ("Swish", {"alpha": 1.5}, lambda x: x * torch.sigmoid(1.5 * x)),
    ("ThresholdedRelu", {"alpha": 0.3}, lambda x: torch.where(x > 0.3, x, torch.zeros_like(x))),
    ("Shrink", {"lambd": 0.4, "bias": 0.2}, lambda x: torch.where(x < -0.4, x + 0.2, torch.where(x > 0.4, x - 0.2,
                                                                                              torch.zeros_like(x)))),
    ("Shrink", {"lambd": 0.4}, lambda x: F.hardshrink(x, 0.4)),
])
def test_activation_expansions(op, attrs, fn):
    check_op(op, [_randn(np.random.default_rng(1), 4, 5)], attrs, fn)


def test_composite_ops_leave_only_primitives():
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype(np.float32), ("N", 3))
    g.nodes = [Node("Swish", ["x"], ["y"], {"alpha": 1.0})]
    assert [n.op for n in specialize(g, {"x": (2, 3)}).nodes] == ["Mul", "Sigmoid", "Mul"]


# -- normalizations and pools ----------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization(p):
    x = _randn(np.random.default_rng(2), 3, 4, 2)
    check_op("LpNormalization", [x], {"axis": 1, "p": p}, lambda t: F.normalize(t, p=p, dim=1, eps=0))


def test_mean_variance_normalization():
    x = _randn(np.random.default_rng(3), 2, 3, 4, 2)

    def ref(t):
        mean = t.mean(dim=(0, 2, 3), keepdim=True)
        std = ((t * t).mean(dim=(0, 2, 3), keepdim=True) - mean * mean).sqrt()
        return (t - mean) / (std + 1e-9)
    check_op("MeanVarianceNormalization", [x], {}, ref)


@pytest.mark.parametrize("size", [3, 5])
def test_lrn(size):
    x = _randn(np.random.default_rng(4), 2, 6, 3, 3)
    attrs = {"size": size, "alpha": 0.02, "beta": 0.75, "bias": 1.5}
    check_op("LRN", [x], attrs, lambda t: F.local_response_norm(t, size, alpha=0.02, beta=0.75, k=1.5))


def test_global_max_pool():
    x = _randn(np.random.default_rng(5), 2, 3, 4, 5)
    check_op("GlobalMaxPool", [x], {}, lambda t: t.amax(dim=(2, 3), keepdim=True))


@given(kernel=st.integers(1, 3), stride=st.integers(1, 2), pad=st.integers(0, 1))
@settings(max_examples=8, deadline=None)
def test_lp_pool_2(kernel, stride, pad):
    pad = min(pad, kernel // 2)
    x = _randn(np.random.default_rng(kernel), 1, 2, 5, 6)
    attrs = {"kernel_shape": [kernel, kernel], "strides": [stride, stride], "pads": [pad] * 4, "p": 2}
    check_op("LpPool", [x], attrs,
             lambda t: F.lp_pool2d(F.pad(t, (pad,) * 4), 2, kernel, stride), rtol=1e-4, atol=1e-5)


# -- Attention and friends -------------------------------------------------------------------
def _sdpa(q, k, v, mask=None, causal=False, scale=None, softcap=0.0):
    """Reference attention over (B, H, S, D), kv heads repeated h0 h0 h1 h1 ... for GQA."""
    reps = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        sq, skv = s.shape[-2:]
        # ONNX aligns the causal frontier to the cache: with no past, query i sees keys j <= i
        s = s.masked_fill(torch.ones(sq, skv, dtype=torch.bool).tril().logical_not(), float("-inf"))
    if mask is not None:
        s = s + mask
    return torch.softmax(s, -1) @ v


@given(hq=st.sampled_from([2, 4]), hk=st.sampled_from([1, 2]), causal=st.booleans(), mask=st.booleans(),
       softcap=st.sampled_from([0.0, 2.0]))
@settings(max_examples=10, deadline=None)
def test_attention_4d(hq, hk, causal, mask, softcap):
    rng = np.random.default_rng(hq * 10 + hk)
    q, k, v = _randn(rng, 2, hq, 3, 4), _randn(rng, 2, hk, 5, 4), _randn(rng, 2, hk, 5, 6)
    m = _randn(rng, 3, 5) if mask else None
    attrs = {"is_causal": int(causal), "softcap": softcap}
    check_op("Attention", [q, k, v, m], attrs,
             lambda q, k, v, m: _sdpa(q, k, v, m, causal, softcap=softcap), const=[3])


def test_attention_3d_scaled_with_past_and_bool_mask():
    rng = np.random.default_rng(7)
    q, k, v = _randn(rng, 2, 3, 8), _randn(rng, 2, 3, 4), _randn(rng, 2, 3, 6)  # 4 q heads, 2 kv heads
    pk, pv = _randn(rng, 2, 2, 2, 2), _randn(rng, 2, 2, 2, 3)
    mask = rng.random((3, 5)) > 0.3
    mask[:, 0] = True
    attrs = {"q_num_heads": 4, "kv_num_heads": 2, "scale": 0.7}

    def ref(q, k, v, m, pk, pv):
        heads = lambda t, h: t.reshape(2, 3, h, -1).transpose(1, 2)
        kk, vv = torch.cat([pk, heads(k, 2)], 2), torch.cat([pv, heads(v, 2)], 2)
        bias = torch.zeros(m.shape, dtype=torch.float64).masked_fill(~m, float("-inf"))
        y = _sdpa(heads(q, 4), kk, vv, bias, scale=0.7)
        return y.transpose(1, 2).reshape(2, 3, -1)
    check_op("Attention", [q, k, v, mask, pk, pv], attrs, ref, n_outputs=3)
    (_, present_k, _), _, _ = run_op("Attention", [q, k, v, mask, pk, pv], attrs, n_outputs=3, grad=False)
    np.testing.assert_allclose(present_k[:, :, :2], pk)


def test_attention_fully_masked_row_is_zero_and_finite_gradient():
    rng = np.random.default_rng(8)
    q, k, v = _randn(rng, 1, 1, 2, 4), _randn(rng, 1, 1, 3, 4), _randn(rng, 1, 1, 3, 4)
    mask = np.array([[True, True, False], [False, False, False]])
    (y,), grads, _ = run_op("Attention", [q, k, v, mask], {})
    np.testing.assert_array_equal(y[0, 0, 1], 0)
    assert all(np.isfinite(g).all() for g in grads.values())


def test_rms_normalization():
    rng = np.random.default_rng(9)
    x, scale = _randn(rng, 2, 3, 4), _randn(rng, 3, 4)
    check_op("RMSNormalization", [x, scale], {"axis": 1, "epsilon": 1e-3},
             lambda x, s: x / (x.pow(2).mean(dim=(1, 2), keepdim=True) + 1e-3).sqrt() * s)


@pytest.mark.parametrize("axis,sign", [(-1, 1), (1, -1)])
def test_rotate_half(axis, sign):
    """RotateHalf (ir/rotary.py's fused rotate_half) and its gradient, the same op with the sign flipped."""
    rng = np.random.default_rng(11)
    x = _randn(rng, 2, 4, 6)

    def ref(x):
        x1, x2 = x.chunk(2, dim=axis)
        return torch.cat((-x2, x1) if sign == 1 else (x2, -x1), dim=axis)
    check_op("RotateHalf", [x], {"axis": axis, "sign": sign}, ref)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 4])
def test_rotary_embedding(interleaved, rotary_dim):
    rng = np.random.default_rng(10)
    b, h, s, d = 2, 2, 3, 6
    rd = rotary_dim or d
    x = _randn(rng, b, h, s, d)
    angles = rng.uniform(0, 3, size=(5, rd // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pos = np.array([[0, 2, 4], [1, 1, 3]], np.int64)

    def ref(x, cos, sin, pos):
        c, s_ = cos[pos][:, None], sin[pos][:, None]  # (B, 1, S, rd/2)
        rot, rest = x[..., :rd], x[..., rd:]
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else rot.chunk(2, -1)
        real, imag = c * x1 - s_ * x2, s_ * x1 + c * x2
        rot = torch.stack([real, imag], -1).flatten(-2) if interleaved else torch.cat([real, imag], -1)
        return torch.cat([rot, rest], -1)
    check_op("RotaryEmbedding", [x, cos, sin, pos], {"interleaved": interleaved, "rotary_embedding_dim": rotary_dim},
             ref)


def test_swiglu():
    rng = np.random.default_rng(11)
    check_op("SwiGLU", [_randn(rng, 3, 4), _randn(rng, 3, 4)], {"alpha": 1.7},
             lambda a, g: a * torch.sigmoid(1.7 * a) * g)


@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv_with_state(with_state):
    rng = np.random.default_rng(12)
    x, w, bias = _randn(rng, 2, 3, 5), _randn(rng, 3, 1, 3), _randn(rng, 3)
    state = _randn(rng, 2, 3, 2) if with_state else None

    def ref(x, w, b, st_):
        pad = st_ if st_ is not None else torch.zeros(2, 3, 2, dtype=x.dtype)
        y = F.conv1d(torch.cat([pad, x], 2), w, b, groups=3)
        return y * torch.sigmoid(y)
    check_op("CausalConvWithState", [x, w, bias, state], {"activation": "silu"}, ref, n_outputs=2)


# -- image ops -------------------------------------------------------------------------------
@given(mode=st.sampled_from(["linear", "nearest", "cubic"]), padding=st.sampled_from(["zeros", "border", "reflection"]),
       align=st.booleans())
@settings(max_examples=12, deadline=None)
def test_grid_sample(mode, padding, align):
    # Bicubic with border/reflection padding: ONNX pads the sampling coordinate, torch each tap;
    # the conformance suite checks ONNX's version of those.
    assume(mode != "cubic" or padding == "zeros")
    rng = np.random.default_rng(13)
    x = _randn(rng, 2, 2, 4, 5)
    grid = rng.uniform(-1.3, 1.3, size=(2, 3, 4, 2)).astype(np.float32)
    torch_mode = {"linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}[mode]
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": int(align)}
    fn = lambda x, g: F.grid_sample(x, g.to(x.dtype), torch_mode, padding, align)
    if mode == "linear":
        check_op("GridSample", [x, grid], attrs, fn)
    else:  # gradients of the image only (nearest: the grid's is zero; cubic: not provided)
        check_op("GridSample", [x, grid], attrs, fn, const=[1])


def test_grid_sample_3d_linear():
    rng = np.random.default_rng(14)
    x, grid = _randn(rng, 1, 2, 3, 4, 3), rng.uniform(-1, 1, size=(1, 2, 2, 3, 3)).astype(np.float32)
    check_op("GridSample", [x, grid], {"mode": "linear"}, lambda x, g: F.grid_sample(x, g, "bilinear", "zeros", False))


@pytest.mark.parametrize("align", [0, 1])
def test_affine_grid(align):
    theta = _randn(np.random.default_rng(15), 2, 2, 3)
    size = np.array([2, 3, 4, 5], np.int64)
    check_op("AffineGrid", [theta, size], {"align_corners": align},
             lambda t, s: F.affine_grid(t, [2, 3, 4, 5], align_corners=bool(align)))


def test_col2im():
    rng = np.random.default_rng(16)
    x = _randn(rng, 1, 2 * 4, 15)  # blocks: 5 x 3 over the padded 6 x 6 image
    attrs = {"strides": [1, 2], "pads": [1, 0, 1, 1], "dilations": [1, 1]}
    image, block = np.array([4, 5], np.int64), np.array([2, 2], np.int64)
    check_op("Col2Im", [x, image, block], attrs, lambda x, i, b: _fold_ref(x))


def _fold_ref(x):
    # pads (1, 0) begin / (1, 1) end: fold into the padded image, then crop
    full = F.fold(x, (6, 6), (2, 2), stride=(1, 2))
    return full[:, :, 1:5, 0:5]


def test_center_crop_pad():
    x = _randn(np.random.default_rng(17), 3, 6, 2)
    (y,), _, _ = run_op("CenterCropPad", [x, np.array([4, 5], np.int64)], {"axes": [1, 2]})
    want = np.zeros((3, 4, 5), np.float32)
    want[:, :, 1:3] = x[:, 1:5, :]
    np.testing.assert_array_equal(y, want)


def test_max_unpool():
    rng = np.random.default_rng(18)
    xt = torch.tensor(_randn(rng, 1, 2, 4, 4), dtype=torch.float64)
    pooled, idx = F.max_pool2d(xt, 2, 2, return_indices=True)
    # ONNX indices count over the whole tensor; torch's per (n, c) plane
    flat = (idx + torch.arange(2).reshape(1, 2, 1, 1) * 16).numpy()
    check_op("MaxUnpool", [pooled.numpy().astype(np.float32), flat], {"kernel_shape": [2, 2], "strides": [2, 2]},
             lambda p, i: F.max_unpool2d(p, idx, 2, 2))


# -- spectral --------------------------------------------------------------------------------
@pytest.mark.parametrize("onesided", [0, 1])
def test_dft_real_forward(onesided):
    x = _randn(np.random.default_rng(19), 2, 6, 1)

    def ref(x, *_):
        f = torch.fft.rfft(x[..., 0], dim=1) if onesided else torch.fft.fft(x[..., 0], dim=1)
        return torch.stack([f.real, f.imag], -1)
    check_op("DFT", [x, None, np.array(1, np.int64)], {"onesided": onesided}, ref)


def test_dft_complex_inverse_with_length():
    x = _randn(np.random.default_rng(20), 2, 5, 2)

    def ref(x, n):
        f = torch.fft.ifft(torch.complex(x[..., 0], x[..., 1]), n=8, dim=1)
        return torch.stack([f.real, f.imag], -1)
    check_op("DFT", [x, np.array(8, np.int64)], {"inverse": 1, "axis": 1}, ref)


def test_stft_matches_torch():
    rng = np.random.default_rng(21)
    signal, window = _randn(rng, 2, 16, 1), np.hanning(6).astype(np.float32)

    def ref(s, step, w, length):
        f = torch.stft(s[..., 0], 6, 3, window=w, center=False, return_complex=True)  # (B, bins, frames)
        return torch.stack([f.real, f.imag], -1).transpose(1, 2)
    check_op("STFT", [signal, np.array(3, np.int64), window, np.array(6, np.int64)], {}, ref, const=[2])


# -- cumulative product, hardmax, misc -------------------------------------------------------
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod(exclusive, reverse):
    x = np.random.default_rng(22).uniform(0.5, 1.5, size=(3, 4)).astype(np.float32)

    def ref(x, axis):
        t = x.flip(1) if reverse else x
        if exclusive:
            t = torch.cat([torch.ones_like(t[:, :1]), t[:, :-1]], 1)
        y = torch.cumprod(t, 1)
        return y.flip(1) if reverse else y
    check_op("CumProd", [x, np.array(1, np.int64)], {"exclusive": exclusive, "reverse": reverse}, ref)


def test_hardmax_picks_first_maximum():
    x = np.array([[1, 3, 3, 0], [2, 2, 1, 1]], np.float32)
    (y,), _, _ = run_op("Hardmax", [x], {"axis": 1}, grad=False)
    np.testing.assert_array_equal(y, [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_compress_gradient():
    x = _randn(np.random.default_rng(23), 3, 4)
    cond = np.array([True, False, True, True])
    check_op("Compress", [x, cond], {"axis": 1}, lambda x, c: x[:, torch.tensor([0, 2, 3])])


def test_reverse_sequence_gradient():
    x = _randn(np.random.default_rng(24), 4, 3, 2)  # (time, batch, feature)
    lengths = np.array([4, 2, 0], np.int64)

    def ref(x, lens):
        parts = [torch.cat([x[:n, b].flip(0), x[n:, b]], 0) for b, n in enumerate([4, 2, 0])]
        return torch.stack(parts, 1)
    check_op("ReverseSequence", [x, lengths], {"batch_axis": 1, "time_axis": 0}, ref)


def _onnx_hamming(n, periodic, dtype):
    # ONNX's Hamming coefficients are 25/46 and 21/46 (torch's default: 0.54 and 0.46)
    return torch.hamming_window(n, periodic=periodic, alpha=25 / 46, beta=21 / 46, dtype=dtype)


@pytest.mark.parametrize("op,fn", [("HannWindow", torch.hann_window), ("HammingWindow", _onnx_hamming),
                                   ("BlackmanWindow", torch.blackman_window)])
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows(op, fn, periodic):
    (y,), _, _ = run_op(op, [np.array(10, np.int64)], {"periodic": periodic}, grad=False)
    np.testing.assert_allclose(y, fn(10, periodic=bool(periodic), dtype=torch.float64).numpy(), atol=1e-6)


def test_det_and_eyelike():
    a = _randn(np.random.default_rng(25), 2, 3, 3)
    check_op("Det", [a], {}, torch.linalg.det)
    # at a singular matrix the gradient is still the cofactor matrix (torch returns zeros there)
    singular = np.array([[1, 2], [2, 4]], np.float32)
    (_,), grads, r = run_op("Det", [singular], {})
    np.testing.assert_allclose(grads[0], r * np.array([[4, -2], [-2, 1]]), rtol=1e-6)
    (e,), _, _ = run_op("EyeLike", [np.zeros((3, 4), np.int32)], {"k": 1, "dtype": 1}, grad=False)
    np.testing.assert_array_equal(e, np.eye(3, 4, 1, dtype=np.float32))


@pytest.mark.parametrize("op,fill", [("ReduceMax", -np.inf), ("ReduceMin", np.inf), ("ReduceLogSumExp", -np.inf)])
def test_reductions_over_empty_sets(op, fill):
    x = np.zeros((2, 0, 3), np.float32)
    (y,), _, _ = run_op(op, [x, np.array([1], np.int64)], {"keepdims": 0}, grad=False)
    np.testing.assert_array_equal(y, np.full((2, 3), fill, np.float32))


# -- integer ops -----------------------------------------------------------------------------
def test_bitwise_and_shifts():
    rng = np.random.default_rng(26)
    a, b = rng.integers(0, 200, (3, 4)).astype(np.uint8), rng.integers(0, 200, (4,)).astype(np.uint8)
    for op, fn in [("BitwiseAnd", np.bitwise_and), ("BitwiseOr", np.bitwise_or), ("BitwiseXor", np.bitwise_xor)]:
        (y,), _, _ = run_op(op, [a, b], {}, grad=False)
        np.testing.assert_array_equal(y, fn(a, b))
    (y,), _, _ = run_op("BitwiseNot", [a], {}, grad=False)
    np.testing.assert_array_equal(y, ~a)
    shift = np.array([1, 2, 3, 0], np.uint8)
    (y,), _, _ = run_op("BitShift", [a, shift], {"direction": "RIGHT"}, grad=False)
    np.testing.assert_array_equal(y, a >> shift)
    (y,), _, _ = run_op("BitCast", [np.array([1.0], np.float32)], {"to": 6}, grad=False)
    np.testing.assert_array_equal(y, np.array([0x3F800000], np.int32))


@given(axis=st.sampled_from([0, 1]), block=st.sampled_from([0, 2]))
@settings(max_examples=4, deadline=None)
def test_quantize_dequantize_round_trip(axis, block):
    rng = np.random.default_rng(27)
    x = _randn(rng, 4, 6, scale=3.0)
    n = x.shape[axis] if not block else x.shape[axis] // block
    scale_shape = (n,) if not block else tuple(n if i == axis else d for i, d in enumerate(x.shape))
    scale = rng.uniform(0.02, 0.05, scale_shape).astype(np.float32)
    zp = rng.integers(-10, 10, scale_shape).astype(np.int8)
    attrs = {"axis": axis, "block_size": block}
    (q,), _, _ = run_op("QuantizeLinear", [x, scale, zp], attrs, grad=False, const=[0, 1])
    spread = lambda v: (np.repeat(v, block, axis) if block else
                        v.reshape([-1 if i == axis else 1 for i in range(2)]))
    want = np.clip(np.rint(x / spread(scale)) + spread(zp), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(q, want)
    (dq,), _, _ = run_op("DequantizeLinear", [q, scale, zp], attrs, grad=False, const=[1])
    np.testing.assert_allclose(dq, (want.astype(np.float32) - spread(zp)) * spread(scale), rtol=1e-6)


# -- recurrent / cache ops ---------------------------------------------------------------------
def _linear_attention_ref(q, k, v, state, decay, beta, hq, hk, scale):
    b, t, _ = q.shape
    heads = lambda x, h: x.reshape(b, t, h, -1).transpose(1, 2)
    q4, k4, v4 = heads(q, hq), heads(k, hk), heads(v, hk)
    g4 = heads(decay, hk) if decay is not None else None
    b4 = heads(beta, beta.shape[-1]) if beta is not None else None
    outs = []
    for i in range(t):
        if g4 is not None:
            state = state * g4[:, :, i, :].exp()[..., None]
        vt = v4[:, :, i]
        if b4 is not None:
            vt = b4[:, :, i] * (vt - torch.einsum("bhdm,bhd->bhm", state, k4[:, :, i]))
        state = state + k4[:, :, i, :, None] * vt[..., None, :]
        outs.append(scale * torch.einsum("bhd,bhdm->bhm", q4[:, :, i], state.repeat_interleave(hq // hk, 1)))
    return torch.stack(outs, 2).transpose(1, 2).reshape(b, t, -1), state


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_linear_attention(rule):
    rng = np.random.default_rng(30)
    b, t, hq, hk, dk, dv = 2, 3, 4, 2, 3, 2
    q, k, v = _randn(rng, b, t, hq * dk), _randn(rng, b, t, hk * dk), _randn(rng, b, t, hk * dv)
    past = _randn(rng, b, hk, dk, dv, scale=0.5)
    decay = -np.abs(_randn(rng, b, t, hk * dk)) if "gated" in rule else None
    beta = rng.uniform(0.2, 0.9, (b, t, hk)).astype(np.float32) if "delta" in rule else None
    attrs = {"update_rule": rule, "q_num_heads": hq, "kv_num_heads": hk}
    check_op("LinearAttention", [q, k, v, past, decay, beta], attrs,
             lambda q, k, v, s, g, be: _linear_attention_ref(q, k, v, s, g, be, hq, hk, 1 / math.sqrt(dk)),
             n_outputs=2)


def test_tensor_scatter_circular_gradient():
    rng = np.random.default_rng(31)
    cache, update = _randn(rng, 2, 2, 4, 3), _randn(rng, 2, 2, 2, 3)
    where = np.array([3, 1], np.int64)

    def ref(cache, update, where):
        out = cache.clone()
        for bi, start in enumerate([3, 1]):
            for s in range(2):
                out[bi, :, (start + s) % 4] = update[bi, :, s]
        return out
    check_op("TensorScatter", [cache, update, where], {"mode": "circular"}, ref)


def test_deform_conv_with_zero_offsets_is_conv_and_shifts_by_whole_pixels():
    rng = np.random.default_rng(32)
    x, w, bias = _randn(rng, 1, 4, 5, 5), _randn(rng, 6, 2, 3, 3), _randn(rng, 6)
    attrs = {"group": 2, "pads": [1, 1, 1, 1], "kernel_shape": [3, 3]}
    offset = np.zeros((1, 2 * 3 * 3, 5, 5), np.float32)
    (y,), _, _ = run_op("DeformConv", [x, w, offset, bias], attrs, grad=False)
    want = F.conv2d(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
                    torch.tensor(bias, dtype=torch.float64), padding=1, groups=2)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-5)
    offset[:, 1::2] = 1.0  # every tap one pixel to the right: the conv of x shifted left
    (y,), _, _ = run_op("DeformConv", [x, w, offset, bias], attrs, grad=False)
    shifted = F.pad(torch.tensor(x, dtype=torch.float64), (0, 2, 1, 1))  # tap j of column c reads x[c + j]
    want = F.conv2d(shifted, torch.tensor(w, dtype=torch.float64), torch.tensor(bias, dtype=torch.float64), groups=2)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-5)


def test_optional_has_element_on_tensors():
    (y,), _, _ = run_op("OptionalHasElement", [np.zeros(2, np.float32)], {}, grad=False)
    assert y.dtype == np.bool_ and bool(y)
    (y,), _, _ = run_op("OptionalHasElement", [], {}, grad=False)
    assert not bool(y)
