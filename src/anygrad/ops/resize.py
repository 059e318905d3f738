"""Resize and Upsample (nearest, linear, cubic; every coordinate transformation mode), with the
public helpers backends read their semantics from: Interp (the attributes normalised across
opsets), resize_plan (output shape, scales, roi) and the per-axis interpolation matrices.

Resize is separable: on each axis it is a small (out x in) interpolation matrix, so its gradient
(the internal ResizeGrad op) applies the transposed matrices.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._index_util import _shape_attr_infer, _str
from ._util import ints_of, norm_axis, slot

# Original coordinate of output index x (float32 arrays, as onnxruntime computes them), from the
# scale s and the input/output lengths.
_COORDINATES = {
    "half_pixel": lambda x, s, n_in, n_out: (x + 0.5) / s - 0.5,
    "pytorch_half_pixel": lambda x, s, n_in, n_out: (x + 0.5) / s - 0.5 if n_out > 1 else 0 * x,
    "align_corners": lambda x, s, n_in, n_out: (x * np.float32(n_in - 1) / np.float32(n_out - 1)
                                                if n_out > 1 else 0 * x),
    "asymmetric": lambda x, s, n_in, n_out: x / s,
    "tf_half_pixel_for_nn": lambda x, s, n_in, n_out: (x + 0.5) / s,
    "half_pixel_symmetric": lambda x, s, n_in, n_out: (
        np.float32(n_in / 2) * (1 - np.float32(n_out) / (s * n_in)) + (x + 0.5) / s - 0.5),
}

_NEAREST = {
    "round_prefer_floor": lambda x, s: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x, s: np.floor(x + 0.5),
    "floor": lambda x, s: np.floor(x),
    "ceil": lambda x, s: np.ceil(x),
    # Upsample and Resize-10: truncate when enlarging, round up when shrinking (as onnxruntime)
    "simple": lambda x, s: np.floor(x) if s >= 1 else np.ceil(x),
}


@dataclass(frozen=True)
class Interp:
    """How one Resize node interpolates (the attributes, normalised across opsets)."""

    mode: str
    coordinates: str
    nearest: str
    cubic_a: float
    exclude_outside: bool
    antialias: bool
    extrapolation: float  # tf_crop_and_resize: the value of outputs that map outside the input

    @classmethod
    def resolved(cls, node: Node) -> Interp:
        """The Interp of a node whose attributes are resolved (ops/resolve.py: every one of
        `attrs()` explicit), read as they stand."""
        a = node.attrs
        missing = [k for k in ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a",
                               "exclude_outside", "antialias", "extrapolation_value") if k not in a]
        if missing:
            raise ShapeError(f"{node.label}: attributes {missing} are not resolved (anygrad.ir.passes.resolve_attributes)")
        text = {k: v.decode() if isinstance(v, bytes) else str(v)
                for k, v in a.items() if k in ("mode", "coordinate_transformation_mode", "nearest_mode")}
        return cls(text["mode"], text["coordinate_transformation_mode"], text["nearest_mode"], float(a["cubic_coeff_a"]),
                   bool(a["exclude_outside"]), bool(a["antialias"]), float(a["extrapolation_value"]))

    def attrs(self) -> dict:
        return {"mode": self.mode, "coordinate_transformation_mode": self.coordinates,
                "nearest_mode": self.nearest, "cubic_coeff_a": self.cubic_a,
                "exclude_outside": int(self.exclude_outside), "antialias": int(self.antialias),
                "extrapolation_value": self.extrapolation}


def interp_of(node: Node) -> Interp:
    """The node's Resize/Upsample attributes as one checked Interp (mode, coordinate transform,
    nearest rounding, cubic coefficient, ...), opset defaults filled in: the op's semantics,
    read by every backend."""
    legacy = node.op == "Upsample" or (node.op == "Resize" and len(node.inputs) == 2)  # opset <= 10
    mode = _str(node, "mode", "nearest")
    if mode in ("bilinear", "trilinear"):  # Upsample-7 spelling
        mode = "linear"
    it = Interp(mode,
                "asymmetric" if legacy else _str(node, "coordinate_transformation_mode", "half_pixel"),
                "simple" if legacy else _str(node, "nearest_mode", "round_prefer_floor"),
                float(node.attr("cubic_coeff_a", -0.75)), bool(node.attr("exclude_outside", 0)),
                bool(node.attr("antialias", 0)), float(node.attr("extrapolation_value", 0.0)))
    checks = [(it.mode in ("nearest", "linear", "cubic"), f"mode '{it.mode}'"),
              (it.coordinates in _COORDINATES or it.coordinates == "tf_crop_and_resize",
               f"coordinate_transformation_mode '{it.coordinates}'"),
              (it.nearest in _NEAREST, f"nearest_mode '{it.nearest}'"),
              (not (it.antialias and it.mode == "nearest"), "antialias with mode nearest")]
    problems = [what for ok, what in checks if not ok]
    if problems:
        raise UnsupportedOpError(f"{node.label}: {', '.join(problems)} not supported (modes nearest/linear/cubic; "
                                 f"coordinate modes {', '.join(_COORDINATES)}, tf_crop_and_resize)")
    return it


def _floats(value) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, TensorInfo):
        if value.const is None:
            return None
        value = value.const
    return np.asarray(value, np.float32).reshape(-1)


@dataclass(frozen=True)
class ResizePlan:
    out: tuple  # output shape
    scales: list[float]  # per axis
    roi: list[float]  # per axis start, end (tf_crop_and_resize; 0, 1 elsewhere)


def resize_plan(node: Node, shape: tuple, ins: list) -> ResizePlan:
    rank = len(shape)
    roi = None
    if node.op == "Upsample":
        scales, sizes = (np.asarray(node.attr("scales"), np.float32) if node.attr("scales") is not None
                         else _floats(slot(ins, 1))), None
    elif len(ins) == 2:  # Resize-10: (X, scales)
        scales, sizes = _floats(ins[1]), None
    else:  # Resize-11+: (X, roi, scales, sizes)
        scales = _floats(slot(ins, 2))
        sizes = ints_of(slot(ins, 3), "sizes", node) or None  # an empty tensor means absent
        roi = _floats(slot(ins, 1)) if slot(ins, 1) is not None else None
    if scales is not None and scales.size == 0:
        scales = None
    if scales is None and sizes is None:
        raise ShapeError(f"{node.label}: needs constant scales or sizes (known when the model is compiled)")
    axes = node.attr("axes")
    axes = list(range(rank)) if axes is None else [norm_axis(int(a), rank) for a in axes]
    given = list(scales) if scales is not None else list(sizes)
    if len(given) != len(axes):
        raise ShapeError(f"{node.label}: {len(given)} scales/sizes for {len(axes)} axes of input {tuple(shape)}")
    out, full, box = list(shape), [1.0] * rank, [0.0, 1.0] * rank
    if roi is not None and roi.size:
        if roi.size != 2 * len(axes):
            raise ShapeError(f"{node.label}: roi holds {roi.size} values, expected 2 per axis ({2 * len(axes)})")
        for i, a in enumerate(axes):
            box[2 * a], box[2 * a + 1] = float(roi[i]), float(roi[i + len(axes)])
    if scales is not None:
        for a, s in zip(axes, scales):
            if s <= 0:
                raise ShapeError(f"{node.label}: scale {s} must be positive")
            full[a] = float(s)
            if isinstance(shape[a], int):
                out[a] = int(np.floor(np.float32(shape[a]) * np.float32(s)))
            elif s != 1:  # a symbolic dim (before specialize)
                out[a] = f"{shape[a]}*{float(s)}"
    else:
        ratios = [np.float32(n) / np.float32(shape[a]) for a, n in zip(axes, sizes)]
        policy = _str(node, "keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":  # one scale for all axes, the smaller or the larger
            one = (min if policy == "not_larger" else max)(ratios)
            ratios = [one] * len(axes)
            sizes = [int(np.floor(shape[a] * one + 0.5)) for a in axes]
        for a, n, r in zip(axes, sizes, ratios):
            out[a], full[a] = int(n), float(r)
    return ResizePlan(tuple(out), full, box)


def _keys_cubic(d: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel at distances d >= 0 (zero from 2 on)."""
    return np.where(d <= 1, ((a + 2) * d - (a + 3)) * d * d + 1,
                    np.where(d < 2, ((a * d - 5 * a) * d + 8 * a) * d - 4 * a, 0.0))


def interp_matrix(it: Interp, n_in: int, n_out: int, scale: float, roi=(0.0, 1.0)) -> tuple[np.ndarray, np.ndarray]:
    """The (n_out, n_in) matrix one axis of a Resize applies, and which output rows lie outside
    the input (tf_crop_and_resize only: they take the extrapolation value instead)."""
    xs = np.arange(n_out, dtype=np.float32)
    if it.coordinates == "tf_crop_and_resize":
        lo, hi = np.float32(roi[0]), np.float32(roi[1])
        x = (xs * (hi - lo) * np.float32(n_in - 1) / np.float32(n_out - 1) if n_out > 1
             else 0 * xs + (hi - lo) * np.float32(n_in - 1) / 2) + lo * np.float32(n_in - 1)
        outside = (x < 0) | (x > n_in - 1)
    else:
        x = _COORDINATES[it.coordinates](xs, np.float32(scale), n_in, n_out)
        outside = np.zeros(n_out, bool)
    x = np.asarray(x, np.float32)
    rows = np.arange(n_out)
    m = np.zeros((n_out, n_in), np.float64)
    if it.mode == "nearest":
        m[rows, np.clip(_NEAREST[it.nearest](x, scale), 0, n_in - 1).astype(np.int64)] = 1
    else:
        # Taps around left = the index just below x (ratio in (0, 1]), as ONNX's reference; with
        # antialias a downsampling filter is stretched by 1/scale (more taps, renormalised).
        left = np.ceil(x).astype(np.int64) - 1
        ratio = (x - left).astype(np.float64)
        s = min(scale, 1.0) if it.antialias else 1.0
        reach = 1 if it.mode == "linear" else 2
        start = int(np.floor(-reach / s)) + 1
        offsets = np.arange(start, 2 - start)[:, None]
        d = np.abs((offsets - ratio[None, :]) * s)
        weights = np.clip(1 - d, 0, 1) if it.mode == "linear" else _keys_cubic(d, it.cubic_a)
        if it.antialias:
            weights = weights / weights.sum(axis=0)
        index = left[None, :] + offsets
        if it.exclude_outside:
            inside = (index >= 0) & (index < n_in)
            weights = weights * inside / np.sum(weights * inside, axis=0)
        for k in range(len(offsets)):  # beyond the edges: the edge element
            np.add.at(m, (rows, np.clip(index[k], 0, n_in - 1)), weights[k])
    m[outside] = 0
    return m, outside


def _apply_per_axis(x: np.ndarray, mats: list[np.ndarray | None], transpose: bool) -> np.ndarray:
    out_dtype = x.dtype
    for axis, m in enumerate(mats):
        if m is None:
            continue
        m = (m.T if transpose else m).astype(x.dtype if np.issubdtype(x.dtype, np.floating) else np.float64)
        x = np.moveaxis(np.tensordot(m, np.moveaxis(x, axis, 0), axes=1), 0, axis)
    if not np.issubdtype(out_dtype, np.floating):
        x = np.rint(x)
    return np.ascontiguousarray(x).astype(out_dtype)


def interp_matrices(it: Interp, in_shape: tuple, out_shape: tuple, scales: list[float], roi: list[float]):
    """Per axis (None where the axis is unchanged) the interpolation matrix and outside rows."""
    mats, outside = [], []
    for a, (n_in, n_out, s) in enumerate(zip(in_shape, out_shape, scales)):
        m, out = interp_matrix(it, n_in, n_out, s, roi[2 * a:2 * a + 2])
        same = n_in == n_out and np.array_equal(m, np.eye(n_in))
        mats.append(None if same else m)
        outside.append(out)
    return mats, outside


def _resize_infer(node, ins):
    interp_of(node)
    if not ins[0].is_static and any(i is not None and i.const is None for i in ins[1:]):
        # Scales or sizes computed from a symbolic shape are known only after `specialize`.
        return [TensorInfo(ins[0].dtype, tuple(f"{node.outputs[0]}.dim{i}" for i in range(ins[0].rank)))]
    return [TensorInfo(ins[0].dtype, resize_plan(node, tuple(ins[0].shape), ins).out)]


def _resize_forward(node, ins):
    x = ins[0]
    plan = resize_plan(node, x.shape, ins)
    it = interp_of(node)
    mats, outside = interp_matrices(it, x.shape, plan.out, plan.scales, plan.roi)
    y = _apply_per_axis(x, mats, transpose=False)
    for axis, rows in enumerate(outside):
        if rows.any():
            index = [slice(None)] * y.ndim
            index[axis] = rows
            y[tuple(index)] = it.extrapolation
    return y


def _resize_grad(g: GradContext):
    shape = g.shape(g.x[0])
    plan = resize_plan(g.node, shape, [g.info(i) if i else None for i in g.x])
    dx = g.op("ResizeGrad", [g.dy], shape=list(shape), scales=plan.scales, roi=plan.roi, **interp_of(g.node).attrs())
    return [dx] + [None] * (len(g.x) - 1)


def _resize_grad_forward(node, ins):
    dy = ins[0]
    shape = tuple(node.attr("shape"))
    mats, _ = interp_matrices(interp_of(node), shape, dy.shape, list(node.attr("scales")), list(node.attr("roi")))
    return _apply_per_axis(dy, mats, transpose=True)


for _name in ("Resize", "Upsample"):
    defop(_name, infer=_resize_infer, forward=_resize_forward, grad=_resize_grad, nondiff=[1, 2, 3])
# The gradient of Resize: dy through the transposed interpolation matrices (attrs: shape of the
# input, scales and roi per axis, and Resize's interpolation attributes, already normalised).
defop("ResizeGrad", internal=True, infer=_shape_attr_infer, forward=_resize_grad_forward)
