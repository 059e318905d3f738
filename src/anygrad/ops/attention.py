"""Transformer building blocks as composite ops: Attention (opset 23+), RotaryEmbedding, SwiGLU
and CausalConvWithState (RMSNormalization is a primitive: ops/norm.py).

Each is an `expand` rule over primitive ops (MatMul, Softmax, Where, Concat, Conv...): once input
shapes are static `specialize` replaces the node by its expansion, so these ops differentiate
through their primitives' gradient rules and run on every backend with no kernels of their own.
Masks that depend only on shapes (causal, sliding windows) are built here as constants.
"""
from __future__ import annotations

import numpy as np

from ..errors import UnsupportedOpError
from ..ir.builder import Builder
from ..ir.composite import defcomposite
from ..ir.graph import Node, TensorInfo
from ._util import ONNX_CODES, norm_axis, onnx_dtype, same_as_first


def _i64(b: Builder, values) -> str:
    return b.const(np.asarray(values, np.int64), np.int64, "ints")


def _scalar(b: Builder, value: float, dtype) -> str:
    return b.const(np.asarray(value, dtype), dtype, "scalar")


def _slice(b: Builder, x: str, axis: int, start: int, end: int) -> str:
    return b.op("Slice", [x, _i64(b, [start]), _i64(b, [end]), _i64(b, [axis])])


def _to_heads(b: Builder, x: str, heads: int) -> str:
    """(B, S, H*D) -> (B, H, S, D)."""
    batch, seq, hidden = b.shape(x)
    return b.op("Transpose", [b.reshape(x, (batch, seq, heads, hidden // heads))], perm=[0, 2, 1, 3])


# -- Attention -------------------------------------------------------------------------------
def _heads(node: Node, q_shape, k_shape) -> tuple[int, int]:
    if len(q_shape) == 3:
        if node.attr("q_num_heads") is None or node.attr("kv_num_heads") is None:
            raise UnsupportedOpError(f"{node.label}: 3-D inputs need the q_num_heads and kv_num_heads attributes")
        return int(node.attr("q_num_heads")), int(node.attr("kv_num_heads"))
    return int(q_shape[1]), int(k_shape[1])


def _attention_infer(node: Node, ins: list) -> list[TensorInfo]:
    q, k, v = ins[:3]
    past = ins[4] if len(ins) > 4 else None
    hq, hk = _heads(node, q.shape, k.shape)
    batch = q.shape[0]
    if len(q.shape) == 3:
        sq, d, kv_len, dv = q.shape[1], q.shape[2] // hq, k.shape[1], v.shape[2] // hk
        y = (batch, sq, hq * dv)
    else:
        sq, d, kv_len, dv = q.shape[2], q.shape[3], k.shape[2], v.shape[3]
        y = (batch, hq, sq, dv)
    total = kv_len + (past.shape[2] if past is not None else 0)
    shapes = [y, (batch, hk, total, d), (batch, hk, total, dv), (batch, hq, sq, total)]
    return [TensorInfo(q.dtype, s) for s in shapes[:len(node.outputs)]]


def _additive(b: Builder, mask: str, dtype) -> str:
    """A boolean mask (True = attend) as an additive bias: 0 where allowed, -inf elsewhere."""
    if b.dtype(mask) != np.bool_:
        return mask
    return b.op("Where", [mask, _scalar(b, 0.0, dtype), _scalar(b, -np.inf, dtype)])


def _allowed_bias(b: Builder, allowed: str | np.ndarray, dtype) -> str:
    if isinstance(allowed, np.ndarray):
        return b.const(np.where(allowed, 0.0, -np.inf).astype(dtype), dtype, "mask")
    return _additive(b, allowed, dtype)


def _frontier(b: Builder, sq: int, skv: int, offset: int | str, test) -> str | np.ndarray:
    """Which (query i, key j) pairs pass test(i + offset - j). offset is a number (same for all
    batches: a constant mask of shape (sq, skv)) or an int64 value of shape (B,) (per batch)."""
    rel = np.arange(sq)[:, None] - np.arange(skv)[None, :]  # i - j
    if isinstance(offset, int):
        return test(rel + offset, np)
    diff = b.op("Add", [_i64(b, rel.reshape(1, 1, sq, skv)), b.reshape(offset, (b.shape(offset)[0], 1, 1, 1))])
    return test(diff, b)


def _le(bound: int):
    """The test diff <= bound, in numpy (constant masks) or as graph ops."""
    def test(diff, ns):
        if ns is np:
            return diff <= bound
        return ns.op("LessOrEqual", [diff, _i64(ns, bound)])
    return test


def _ge(bound: int):
    def test(diff, ns):
        if ns is np:
            return diff >= bound
        return ns.op("GreaterOrEqual", [diff, _i64(ns, bound)])
    return test


def _attention_bias(b: Builder, node: Node, dtype, sq: int, skv: int, past_len: int) -> str | None:
    """The additive bias (0 / -inf / float mask) over (..., sq, skv), or None when there is none."""
    mask, nonpad = node.input(3), node.input(6)
    terms: list[str] = []
    if mask:
        short = skv - b.shape(mask)[-1]
        if short > 0:  # a mask shorter than the keys masks out the rest
            fill = np.zeros(b.shape(mask)[:-1] + (short,), b.dtype(mask))
            if fill.dtype != np.bool_:
                fill[...] = -np.inf
            mask = b.op("Concat", [mask, b.const(fill, fill.dtype, "mask_fill")], axis=-1)
        terms.append(_additive(b, mask, dtype))
    # A query at block index i sits at absolute position i + offset.
    offset: int | str = past_len
    if nonpad and not past_len:
        offset = b.op("Sub", [b.op("Cast", [nonpad], to=ONNX_CODES[np.dtype(np.int64)]), _i64(b, sq)])
    if int(node.attr("is_causal", 0)):
        terms.append(_allowed_bias(b, _frontier(b, sq, skv, offset, _ge(0)), dtype))
    left, right = int(node.attr("left_window_size", -1)), int(node.attr("right_window_size", -1))
    if left >= 0:
        terms.append(_allowed_bias(b, _frontier(b, sq, skv, offset, _le(left)), dtype))
    if right >= 0:
        terms.append(_allowed_bias(b, _frontier(b, sq, skv, offset, _ge(-right)), dtype))
    if nonpad:
        lengths = b.reshape(b.op("Cast", [nonpad], to=ONNX_CODES[np.dtype(np.int64)]), (b.shape(nonpad)[0], 1, 1, 1))
        valid = b.op("Less", [_i64(b, np.arange(skv).reshape(1, 1, 1, skv)), lengths])
        terms.append(_additive(b, valid, dtype))
    return b.add_all(terms) if terms else None


def _may_mask_whole_rows(b: Builder, bias: str) -> bool:
    const = b.info(bias).const
    return const is None or bool(np.isneginf(np.asarray(const)).all(axis=-1).any())


def _repeat_heads(b: Builder, x: str, reps: int) -> str:
    """(B, H, S, D) -> (B, H*reps, S, D), each head repeated in place: h0 h0 h1 h1 ..."""
    if reps == 1:
        return x
    batch, heads, seq, d = b.shape(x)
    tiled = b.op("Expand", [b.op("Unsqueeze", [x, _i64(b, [2])]), _i64(b, [batch, heads, reps, seq, d])])
    return b.reshape(tiled, (batch, heads * reps, seq, d))


def _attention(b: Builder, node: Node) -> list[str]:
    q, k, v = node.inputs[:3]
    past_k, past_v = node.input(4), node.input(5)
    dtype = b.dtype(q)
    rank3 = len(b.shape(q)) == 3
    hq, hk = _heads(node, b.shape(q), b.shape(k))
    if rank3:
        q, k, v = _to_heads(b, q, hq), _to_heads(b, k, hk), _to_heads(b, v, hk)
    scale = node.attr("scale")
    scale = 1.0 / np.sqrt(b.shape(q)[3]) if scale is None else float(scale)
    root = _scalar(b, np.sqrt(scale), dtype)  # scale split over Q and K, as ONNX's function body does
    present_k = b.op("Concat", [past_k, k], axis=2) if past_k else k
    present_v = b.op("Concat", [past_v, v], axis=2) if past_v else v
    sq, skv = b.shape(q)[2], b.shape(present_k)[2]
    bias = _attention_bias(b, node, dtype, sq, skv, b.shape(past_k)[2] if past_k else 0)

    reps = hq // hk if hq != hk and hq % hk == 0 else 1
    keys, values = _repeat_heads(b, present_k, reps), _repeat_heads(b, present_v, reps)
    kt = b.op("Transpose", [b.op("Mul", [keys, root])], perm=[0, 1, 3, 2])
    qk = b.op("MatMul", [b.op("Mul", [q, root]), kt])
    softcap = float(node.attr("softcap", 0.0))
    if softcap > 0:
        cap = _scalar(b, softcap, dtype)
        qk = b.op("Mul", [b.op("Tanh", [b.op("Div", [qk, cap])]), cap])
    logits = b.op("Add", [qk, bias]) if bias else qk
    biased = logits  # qk_matmul_output_mode 2 shows it as is, -inf rows included

    masked_rows = None
    if bias and _may_mask_whole_rows(b, bias):
        # A row with no attendable key gives zero probabilities (and output), as ONNX specifies;
        # its logits are replaced first so the softmax (and its gradient) stay finite.
        row_max = b.op("ReduceMax", [bias, _i64(b, [-1])], keepdims=1)
        masked_rows = b.op("Equal", [row_max, _scalar(b, -np.inf, dtype)])
        logits = b.op("Where", [masked_rows, _scalar(b, 0.0, dtype), logits])
    precision = node.attr("softmax_precision")
    low = precision is not None and onnx_dtype(precision, node) != dtype
    if low:
        logits = b.op("Cast", [logits], to=int(precision))
    probs = b.op("Softmax", [logits], axis=-1)
    if masked_rows:
        probs = b.op("Where", [masked_rows, _scalar(b, 0.0, b.dtype(probs)), probs])
    if low:
        probs = b.op("Cast", [probs], to=ONNX_CODES[np.dtype(dtype)])
    y = b.op("MatMul", [probs, values])
    if rank3:
        batch, heads, seq, dv = b.shape(y)
        y = b.reshape(b.op("Transpose", [y], perm=[0, 2, 1, 3]), (batch, seq, heads * dv))

    outs = [y, present_k, present_v]
    if len(node.outputs) > 3 and node.outputs[3]:
        mode = int(node.attr("qk_matmul_output_mode", 0))
        # (as ONNX's reference: modes 0 and 1 give the scores after softcap, before the bias)
        outs.append({0: qk, 1: qk, 2: biased, 3: probs}.get(mode, qk))
    return [o if name else "" for o, name in zip(outs, node.outputs)]


defcomposite("Attention", infer=_attention_infer, expand=_attention, nondiff=[3, 6])


# -- RotaryEmbedding -------------------------------------------------------------------------
def _rotary_embedding(b: Builder, node: Node) -> list[str]:
    x, cos, sin, positions = node.input(0), node.input(1), node.input(2), node.input(3)
    shape = b.shape(x)
    if len(shape) == 4:  # (B, H, S, D) -> (B, S, H, D)
        x = b.op("Transpose", [x], perm=[0, 2, 1, 3])
    else:
        heads = int(node.attr("num_heads", 0))
        if not heads:
            raise UnsupportedOpError(f"{node.label}: 3-D input needs the num_heads attribute")
        x = b.reshape(x, (shape[0], shape[1], heads, shape[2] // heads))
    batch, seq, heads, d = b.shape(x)
    rd = int(node.attr("rotary_embedding_dim", 0)) or d
    half = rd // 2
    if positions:
        cos, sin = b.op("Gather", [cos, positions], axis=0), b.op("Gather", [sin, positions], axis=0)
    cos, sin = (b.op("Unsqueeze", [c, _i64(b, [2])]) for c in (cos, sin))  # (B, S, 1, rd/2)
    rotated = _slice(b, x, 3, 0, rd) if rd < d else x
    if int(node.attr("interleaved", 0)):
        pairs = b.reshape(rotated, (batch, seq, heads, half, 2))
        x1, x2 = (b.reshape(_slice(b, pairs, 4, i, i + 1), (batch, seq, heads, half)) for i in (0, 1))
    else:
        x1, x2 = _slice(b, rotated, 3, 0, half), _slice(b, rotated, 3, half, rd)
    real = b.op("Sub", [b.op("Mul", [cos, x1]), b.op("Mul", [sin, x2])])
    imag = b.op("Add", [b.op("Mul", [sin, x1]), b.op("Mul", [cos, x2])])
    if int(node.attr("interleaved", 0)):
        both = b.op("Concat", [b.op("Unsqueeze", [real, _i64(b, [-1])]), b.op("Unsqueeze", [imag, _i64(b, [-1])])],
                    axis=-1)
        rotated = b.reshape(both, (batch, seq, heads, rd))
    else:
        rotated = b.op("Concat", [real, imag], axis=-1)
    out = b.op("Concat", [rotated, _slice(b, x, 3, rd, d)], axis=-1) if rd < d else rotated
    if len(shape) == 4:
        return [b.op("Transpose", [out], perm=[0, 2, 1, 3])]
    return [b.reshape(out, shape)]


defcomposite("RotaryEmbedding", infer=same_as_first, expand=_rotary_embedding, nondiff=[3])


# -- SwiGLU: Swish(A, alpha) * B ---------------------------------------------------------------
def _swiglu(b: Builder, node: Node) -> list[str]:
    a, gate = node.inputs[:2]
    alpha = _scalar(b, float(node.attr("alpha", 1.0)), b.dtype(a))
    return [b.op("Mul", [b.op("Mul", [a, b.op("Sigmoid", [b.op("Mul", [a, alpha])])]), gate])]


defcomposite("SwiGLU", infer=same_as_first, expand=_swiglu)


# -- CausalConvWithState: depthwise causal Conv1d over [past state, input] ---------------------
def _causal_conv_infer(node: Node, ins: list) -> list[TensorInfo]:
    x, w = ins[0], ins[1]
    batch, channels, _ = x.shape
    k = w.shape[2]
    return [TensorInfo(x.dtype, tuple(x.shape)), TensorInfo(x.dtype, (batch, channels, k - 1))][:len(node.outputs)]


def _causal_conv(b: Builder, node: Node) -> list[str]:
    x, w, bias, past = node.input(0), node.input(1), node.input(2), node.input(3)
    batch, channels, length = b.shape(x)
    k = b.shape(w)[2]
    dtype = b.dtype(x)
    if not past and k > 1:
        past = b.const(np.zeros((batch, channels, k - 1), dtype), dtype, "state")
    padded = b.op("Concat", [past, x], axis=2) if k > 1 else x
    y = b.op("Conv", [padded, w] + ([bias] if bias else []), group=channels, kernel_shape=[k])
    activation = node.attr("activation", "none")
    if activation in ("silu", "swish"):
        y = b.op("Mul", [y, b.op("Sigmoid", [y])])
    elif activation != "none":
        raise UnsupportedOpError(f"{node.label}: activation '{activation}'; expected none, silu or swish")
    total = length + k - 1
    state = (_slice(b, padded, 2, total - (k - 1), total) if k > 1
             else b.const(np.zeros((batch, channels, 0), dtype), dtype, "state"))
    return [y, state][:len(node.outputs)]


defcomposite("CausalConvWithState", infer=_causal_conv_infer, expand=_causal_conv)


# -- LinearAttention: a recurrent state (B, H_kv, d_k, d_v) updated once per time step --------
UPDATE_RULES = {"linear": (False, False), "gated": (True, False), "delta": (False, True), "gated_delta": (True, True)}


def _linear_attention_dims(node: Node, q_shape, k_shape, v_shape) -> tuple[int, int, int, int]:
    hq, hk = node.attr("q_num_heads"), node.attr("kv_num_heads")
    if hq is None or hk is None or int(hq) % int(hk):
        raise UnsupportedOpError(f"{node.label}: needs q_num_heads a multiple of kv_num_heads")
    return int(hq), int(hk), q_shape[2] // int(hq), v_shape[2] // int(hk)


def _linear_attention_infer(node: Node, ins: list) -> list[TensorInfo]:
    q, k, v = ins[:3]
    hq, hk, dk, dv = _linear_attention_dims(node, q.shape, k.shape, v.shape)
    past = ins[3] if len(ins) > 3 else None
    state = TensorInfo(past.dtype if past is not None else q.dtype, (q.shape[0], hk, dk, dv))
    return [TensorInfo(q.dtype, (q.shape[0], q.shape[1], hq * dv)), state][:len(node.outputs)]


def _linear_attention(b: Builder, node: Node) -> list[str]:
    """The recurrence unrolled over the (static) sequence length, in float32 as ONNX specifies."""
    rule = node.attr("update_rule", "gated_delta")
    if rule not in UPDATE_RULES:
        raise UnsupportedOpError(f"{node.label}: update_rule '{rule}'; expected one of {sorted(UPDATE_RULES)}")
    gating, delta = UPDATE_RULES[rule]
    q, k, v, past, decay, beta = (node.input(i) for i in range(6))
    dtype = b.dtype(q)
    hq, hk, dk, dv = _linear_attention_dims(node, b.shape(q), b.shape(k), b.shape(v))
    batch, steps = b.shape(q)[:2]
    f32 = ONNX_CODES[np.dtype(np.float32)]

    def f(x: str) -> str:
        return x if b.dtype(x) == np.float32 else b.op("Cast", [x], to=f32)

    q4, k4, v4 = (_to_heads(b, f(x), h) for x, h in ((q, hq), (k, hk), (v, hk)))
    if decay:  # (B, T, H_kv) per head, or (B, T, H_kv * d_k) per key dim -> (B, H_kv, T, 1 | d_k)
        decay = _to_heads(b, f(decay), hk)
    if beta:  # (B, T, H_kv | 1) -> (B, H_kv | 1, T, 1)
        beta = _to_heads(b, f(beta), b.shape(beta)[2])
    state = f(past) if past else b.const(np.zeros((batch, hk, dk, dv), np.float32), np.float32, "state")
    scale = node.attr("scale")
    scale = _scalar(b, 1.0 / np.sqrt(dk) if not scale else float(scale), np.float32)
    outs = []
    for t in range(steps):
        q_t, k_t, v_t = (_slice(b, x, 2, t, t + 1) for x in (q4, k4, v4))  # (B, H, 1, d)
        if gating:  # state *= exp(decay_t), per head or per key dim (rows of the state)
            g = b.op("Exp", [_slice(b, decay, 2, t, t + 1)])
            state = b.op("Mul", [state, b.op("Transpose", [g], perm=[0, 1, 3, 2])])
        if delta:  # write only what the state does not already predict for this key
            retrieved = b.op("MatMul", [k_t, state])
            v_t = b.op("Mul", [_slice(b, beta, 2, t, t + 1), b.op("Sub", [v_t, retrieved])])
        state = b.op("Add", [state, b.op("MatMul", [b.op("Transpose", [k_t], perm=[0, 1, 3, 2]), v_t])])
        read = _repeat_heads(b, state, hq // hk)
        outs.append(b.op("Mul", [b.op("MatMul", [q_t, read]), scale]))
    y = b.op("Concat", outs, axis=2) if len(outs) > 1 else outs[0]  # (B, H_q, T, d_v)
    y = b.reshape(b.op("Transpose", [y], perm=[0, 2, 1, 3]), (batch, steps, hq * dv))
    if dtype != np.float32:
        y = b.op("Cast", [y], to=ONNX_CODES[np.dtype(dtype)])
    state_dtype = b.dtype(past) if past else dtype
    if state_dtype != np.float32:
        state = b.op("Cast", [state], to=ONNX_CODES[np.dtype(state_dtype)])
    return [y, state][:len(node.outputs)]


defcomposite("LinearAttention", infer=_linear_attention_infer, expand=_linear_attention)


# -- TensorScatter: write an update into a KV cache at per-batch positions ---------------------
def _tensor_scatter(b: Builder, node: Node) -> list[str]:
    cache, update, where = node.input(0), node.input(1), node.input(2)
    shape, ushape = b.shape(cache), b.shape(update)
    rank = len(shape)
    axis = norm_axis(int(node.attr("axis", -2)), rank)
    mode = node.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        raise UnsupportedOpError(f"{node.label}: mode '{mode}'; expected linear or circular")
    steps = [1] * rank
    steps[axis] = ushape[axis]
    index = _i64(b, np.arange(ushape[axis]).reshape(steps))
    if where:
        start = [1] * rank
        start[0] = shape[0]
        index = b.op("Add", [index, b.reshape(b.op("Cast", [where], to=ONNX_CODES[np.dtype(np.int64)]), start)])
    if mode == "circular":
        index = b.op("Mod", [index, _i64(b, shape[axis])])
    index = b.op("Expand", [index, _i64(b, ushape)])
    return [b.op("ScatterElements", [cache, index, update], axis=axis)]


defcomposite("TensorScatter", infer=same_as_first, expand=_tensor_scatter, nondiff=[2])


# -- ai.onnx.preview.FlexAttention without score/prob modifiers: plain (GQA) attention -------
def _flex_attention(b: Builder, node: Node) -> list[str]:
    attrs = {k: node.attrs[k] for k in ("scale", "softmax_precision") if node.attr(k) is not None}
    return _attention(b, Node("Attention", node.inputs[:3], node.outputs[:1], attrs, node.name))[:1]


defcomposite("ai.onnx.preview.FlexAttention", expand=_flex_attention,
      infer=lambda node, ins: _attention_infer(Node("Attention", node.inputs, node.outputs[:1]), ins)[:1])
