"""Spectral ops: DFT and STFT as expansions (a DFT is a MatMul with constant cosine / sine
matrices, so both differentiate and run on every backend), and MelWeightMatrix (a constant).

Complex tensors are ONNX's (..., 2) real/imaginary pairs; a (..., 1) input is real.
"""
from __future__ import annotations

import numpy as np

from ..errors import UnsupportedOpError
from ..ir.builder import Builder
from ..ir.composite import defcomposite
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import ints_of, norm_axis, onnx_dtype


def _i64(b: Builder, values) -> str:
    return b.const(np.asarray(values, np.int64), np.int64, "ints")


def _dft_axis(node: Node, value, rank: int) -> int:
    """The transformed axis: an attribute up to opset 17, an input from opset 20 (default -2,
    which is opset 17's default axis 1 for the usual (batch, n, 2) signals)."""
    if node.attr("axis") is not None:
        return norm_axis(int(node.attr("axis")), rank)
    axis = ints_of(value, "axis", node)[0] if value is not None else -2
    return norm_axis(axis, rank)


def _dft_plan(node: Node, shape, length_value, axis_value) -> tuple[int, int, int, bool, bool]:
    """(axis, n = transform length, output bins, inverse, onesided)."""
    axis = _dft_axis(node, axis_value, len(shape))
    if axis == len(shape) - 1:
        raise UnsupportedOpError(f"{node.label}: the last axis holds the real/imaginary parts; it cannot be transformed")
    inverse, onesided = bool(node.attr("inverse", 0)), bool(node.attr("onesided", 0))
    if length_value is not None:
        n = ints_of(length_value, "dft_length", node)[0]
    else:
        n = 2 * (shape[axis] - 1) if inverse and onesided else shape[axis]
    bins = n if inverse or not onesided else n // 2 + 1
    return axis, n, bins, inverse, onesided


def _dft_infer(node: Node, ins: list) -> list[TensorInfo]:
    x = ins[0]
    axis, _, bins, inverse, onesided = _dft_plan(node, x.shape, _slot(ins, 1), _slot(ins, 2))
    shape = list(x.shape)
    shape[axis] = bins
    shape[-1] = 1 if inverse and onesided else 2
    return [TensorInfo(x.dtype, tuple(shape))]


def _slot(ins: list, i: int):
    return ins[i] if i < len(ins) and ins[i] is not None else None


def _matrices(n: int, rows: int, bins: int, inverse: bool, onesided: bool) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of 2 pi t k / n over (input index t < rows, output index k < bins), with the
    inverse's 1/n (and a one-sided inverse's doubling of the bins it stands in for)."""
    t = np.arange(rows)[:, None]
    k = np.arange(bins)[None, :]
    angle = 2 * np.pi * ((t * k) % n) / n
    cos, sin = np.cos(angle), np.sin(angle)
    if inverse:
        weight = np.ones((rows, 1))
        if onesided:  # each bin 0 < k < n/2 stands for itself and its conjugate
            weight = np.where((t == 0) | (2 * t == n), 1.0, 2.0)
        cos, sin = cos * weight / n, sin * weight / n
    return cos, sin


def _transform(b: Builder, real: str, imag: str | None, node: Node, n: int, bins: int, inverse: bool,
               onesided: bool) -> tuple[str, str | None]:
    """DFT over the last axis of real (+ i imag); returns (real, imag) or (real, None) for a
    one-sided inverse (a real signal)."""
    length = b.shape(real)[-1]
    rows = min(length, n // 2 + 1 if inverse and onesided else n)
    if rows < length:  # the transform reads only the first `rows` samples
        real = _cut(b, real, rows)
        imag = _cut(b, imag, rows) if imag else None
    cos, sin = _matrices(n, rows, bins, inverse, onesided)
    dtype = b.dtype(real)
    c, s = b.const(cos.astype(dtype), dtype, "dft_cos"), b.const(sin.astype(dtype), dtype, "dft_sin")
    sign = 1.0 if inverse else -1.0  # e^{-i..} forward, e^{+i..} inverse
    rc = b.op("MatMul", [real, c])
    rs = b.op("MatMul", [real, s])
    if inverse and onesided:
        return (b.op("Sub", [rc, b.op("MatMul", [imag, s])]) if imag else rc), None
    if imag is None:
        return rc, (rs if sign > 0 else b.op("Neg", [rs]))
    ic, is_ = b.op("MatMul", [imag, c]), b.op("MatMul", [imag, s])
    if sign > 0:
        return b.op("Sub", [rc, is_]), b.op("Add", [rs, ic])
    return b.op("Add", [rc, is_]), b.op("Sub", [ic, rs])


def _cut(b: Builder, x: str, rows: int) -> str:
    axis = len(b.shape(x)) - 1
    return b.op("Slice", [x, _i64(b, [0]), _i64(b, [rows]), _i64(b, [axis])])


def _parts(b: Builder, x: str) -> tuple[str, str | None]:
    """(real, imag or None) of a (..., 1|2) tensor, each without the last axis."""
    shape = b.shape(x)
    last = len(shape) - 1
    if shape[-1] == 1:
        return b.reshape(x, shape[:-1]), None
    pick = [b.op("Slice", [x, _i64(b, [i]), _i64(b, [i + 1]), _i64(b, [last])]) for i in (0, 1)]
    return b.reshape(pick[0], shape[:-1]), b.reshape(pick[1], shape[:-1])


def _join(b: Builder, real: str, imag: str | None) -> str:
    parts = [b.op("Unsqueeze", [p, _i64(b, [-1])]) for p in (real, imag) if p]
    return parts[0] if len(parts) == 1 else b.op("Concat", parts, axis=-1)


def _dft(b: Builder, node: Node) -> list[str]:
    x = node.inputs[0]
    length = b.info(node.input(1)) if node.input(1) else None
    axis_info = b.info(node.input(2)) if node.input(2) else None
    axis, n, bins, inverse, onesided = _dft_plan(node, b.shape(x), length, axis_info)
    real, imag = _parts(b, x)
    rank = len(b.shape(real))
    perm = [i for i in range(rank) if i != axis] + [axis]
    back = list(np.argsort(perm))
    real = b.op("Transpose", [real], perm=perm)
    imag = b.op("Transpose", [imag], perm=perm) if imag else None
    real, imag = _transform(b, real, imag, node, n, bins, inverse, onesided)
    real = b.op("Transpose", [real], perm=back)
    imag = b.op("Transpose", [imag], perm=back) if imag else None
    return [_join(b, real, imag)]


defcomposite("DFT", infer=_dft_infer, expand=_dft, nondiff=[1, 2])


# -- STFT --------------------------------------------------------------------------------------
def _stft_plan(node: Node, ins: list) -> tuple[int, int, int, int]:
    """(frame step, frame length, frames, bins)."""
    signal = ins[0]
    step = ints_of(ins[1], "frame_step", node)[0]
    window = _slot(ins, 2)
    frame = ints_of(ins[3], "frame_length", node)[0] if _slot(ins, 3) is not None else window.shape[0]
    frames = 1 + (signal.shape[1] - frame) // step
    bins = frame // 2 + 1 if int(node.attr("onesided", 1)) else frame
    return step, frame, frames, bins


def _stft_infer(node: Node, ins: list) -> list[TensorInfo]:
    _, _, frames, bins = _stft_plan(node, ins)
    return [TensorInfo(ins[0].dtype, (ins[0].shape[0], frames, bins, 2))]


def _stft(b: Builder, node: Node) -> list[str]:
    signal, window = node.input(0), node.input(2)
    infos = [b.info(i) if i else None for i in node.inputs]
    step, frame, frames, bins = _stft_plan(node, infos)
    index = np.arange(frames)[:, None] * step + np.arange(frame)[None, :]
    framed = b.op("Gather", [signal, _i64(b, index)], axis=1)  # (batch, frames, frame, 1|2)
    real, imag = _parts(b, framed)
    if window:
        real = b.op("Mul", [real, window])
        imag = b.op("Mul", [imag, window]) if imag else None
    onesided = bool(int(node.attr("onesided", 1)))
    real, imag = _transform(b, real, imag, node, frame, bins, False, onesided)
    return [_join(b, real, imag)]


defcomposite("STFT", infer=_stft_infer, expand=_stft, nondiff=[1, 3])


# -- MelWeightMatrix: triangular filters on the mel scale (a constant) --------------------------
def _scalar(value, node: Node, what: str) -> float:
    return float(np.asarray(value.const if isinstance(value, TensorInfo) else value).reshape(-1)[0])


def _mel_forward(node: Node, ins: list) -> np.ndarray:
    mels, n_dft, rate = (int(_scalar(v, node, w)) for v, w in zip(ins[:3], ("num_mel_bins", "dft_length", "sample_rate")))
    low, high = _scalar(ins[3], node, "lower_edge_hertz"), _scalar(ins[4], node, "upper_edge_hertz")
    to_mel = lambda hz: 2595 * np.log1p(hz / 700) / np.log(10)
    step = (to_mel(high) - to_mel(low)) / (mels + 2)
    hz = 700 * np.expm1((np.arange(mels + 2) * step + to_mel(low)) / 2595 * np.log(10))
    edges = (((n_dft + 1) * hz) // rate).astype(int)
    out = np.zeros((n_dft // 2 + 1, mels))
    for i in range(mels):
        left, center, right = edges[i:i + 3]
        if center == left:
            out[center, i] = 1
        else:
            out[left:center + 1, i] = (np.arange(left, center + 1) - left) / (center - left)
        if right > center:
            out[center:right, i] = (right - np.arange(center, right)) / (right - center)
    return out.astype(onnx_dtype(node.attr("output_datatype", 1), node))


def _mel_infer(node: Node, ins: list) -> list[TensorInfo]:
    mels, n_dft = (ints_of(v, w, node)[0] for v, w in zip(ins[:2], ("num_mel_bins", "dft_length")))
    return [TensorInfo(onnx_dtype(node.attr("output_datatype", 1), node), (n_dft // 2 + 1, mels))]


defop("MelWeightMatrix", infer=_mel_infer, forward=_mel_forward, nondiff=[0, 1, 2, 3, 4])
