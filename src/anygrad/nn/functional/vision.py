"""Padding and resampling, torch.nn.functional's vision functions: pad (one Pad node, or slices and
a Concat for circular) and interpolate (one Resize node).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ...errors import AnygradError, ConfigError
from ..tracing import SymInt, Tensor, as_tensor
from ._util import _slice, _t

# PyTorch's pad modes -> ONNX Pad's ("circular" is composed: ONNX's "wrap" needs opset 19)
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


def pad(x, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Tensor:
    """PyTorch's F.pad: `pad` lists (before, after) pairs from the last dim backwards; negative
    amounts crop. One Pad node with the amounts of every dim (ONNX's order: all befores, then
    all afters), or slices and a Concat per dim for mode="circular"."""
    x = _t(x)
    amounts = [int(p) for p in pad]
    rank = len(x.shape)
    if len(amounts) % 2 or len(amounts) > 2 * rank:
        raise ConfigError(f"pad: {len(amounts)} amounts for a tensor of rank {rank}; give (before, after) "
                          "pairs for at most every dim, last dim first")
    if mode != "constant" and value not in (None, 0, 0.0):
        raise ConfigError(f"pad: value is only used with mode='constant', not '{mode}'")
    per_dim = [(0, 0)] * rank
    for k in range(len(amounts) // 2):
        per_dim[rank - 1 - k] = (amounts[2 * k], amounts[2 * k + 1])
    if mode == "circular":
        return _circular_pad(x, per_dim)
    if mode not in _PAD_MODES:
        raise ConfigError(f"pad: mode '{mode}' is not supported; use one of constant, reflect, replicate, "
                          "circular")
    pads = x.tracer.const(np.array([b for b, _ in per_dim] + [a for _, a in per_dim], np.int64), np.int64)
    ins = [x, pads] + ([as_tensor(float(value), x)] if mode == "constant" and value else [])
    return x.tracer.op("Pad", ins, mode=_PAD_MODES[mode])


def _circular_pad(x: Tensor, per_dim: list[tuple[int, int]]) -> Tensor:
    for axis, (before, after) in enumerate(per_dim):
        if (before, after) == (0, 0):
            continue
        n = x.shape[axis]
        if isinstance(n, SymInt) or max(before, after) > n or min(before, after) < 0:
            raise ConfigError(f"pad: circular padding ({before}, {after}) of dim {axis} needs a static dim "
                              f"of at least that size and no cropping (dim {axis} is {n})")
        parts = ([_slice(x, [n - before], [n], [axis])] if before else []) + [x] + (
            [_slice(x, [0], [after], [axis])] if after else [])
        x = x.tracer.op("Concat", parts, axis=axis)
    return x


# PyTorch's interpolate modes -> (spatial rank or None for any, ONNX Resize attributes); the
# coordinate mode of the linear ones depends on align_corners.
_INTERPOLATE = {
    "nearest": (None, {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                       "nearest_mode": "floor"}),
    # floor((dst + 0.5) * scale): round half up of half_pixel's source coordinate
    "nearest-exact": (None, {"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
                             "nearest_mode": "round_prefer_ceil"}),
    "linear": (1, {"mode": "linear"}),
    "bilinear": (2, {"mode": "linear"}),
    "trilinear": (3, {"mode": "linear"}),
    "bicubic": (2, {"mode": "cubic", "cubic_coeff_a": -0.75}),
}


def interpolate(x, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None, antialias: bool = False) -> Tensor:
    """PyTorch's F.interpolate as one Resize node, as the exporter writes it: constant scales
    for scale_factor (PyTorch then samples with 1/scale_factor, as Resize does), the sizes
    Concat(Shape(x)[:2], size) for size (batch and channels stay as they are)."""
    x = _t(x)
    if mode not in _INTERPOLATE:
        raise ConfigError(f"interpolate: mode '{mode}' is not supported; use one of {', '.join(_INTERPOLATE)}")
    nd, attrs = _INTERPOLATE[mode]
    spatial = list(x.shape[2:])
    if nd is not None and len(spatial) != nd:
        raise ConfigError(f"interpolate: mode '{mode}' needs an input with {nd} spatial dims, got shape "
                          f"{tuple(x.shape)}")
    attrs = dict(attrs)
    if attrs["mode"] != "nearest":
        attrs["coordinate_transformation_mode"] = "align_corners" if align_corners else "half_pixel"
    elif align_corners is not None:
        raise ConfigError("interpolate: align_corners is only for the linear and cubic modes (as in PyTorch)")
    if antialias:
        raise ConfigError("interpolate: antialias=True is not supported (Resize's antialias needs opset 18)")
    if (size is None) == (scale_factor is None):
        raise ConfigError("interpolate: give exactly one of size and scale_factor")
    if any(isinstance(d, SymInt) for d in spatial):
        raise AnygradError(f"interpolate: the input's spatial size {tuple(spatial)} depends on a symbolic dim; "
                           "give the spatial dims as numbers in input_shape")
    n = len(spatial)
    if scale_factor is not None:
        scales = [float(f) for f in (scale_factor if isinstance(scale_factor, (tuple, list)) else [scale_factor] * n)]
        if len(scales) != n or any(f <= 0 for f in scales):
            raise ConfigError(f"interpolate: scale_factor must be a positive number or {n} of them, got {scale_factor}")
        # PyTorch's output size, computed in double; Resize computes it in float32
        sizes = [math.floor(int(d) * f) for d, f in zip(spatial, scales)]
        if recompute_scale_factor:  # PyTorch then samples as if the size had been given
            size, scale_factor = sizes, None
        elif sizes != [int(np.floor(np.float32(d) * np.float32(f))) for d, f in zip(spatial, scales)]:
            raise ConfigError(f"interpolate: scale_factor {scale_factor} gives output size {sizes} in PyTorch but "
                              "a different one in float32 (ONNX Resize); pass size= or recompute_scale_factor=True")
    empty = x.tracer.const(np.zeros(0, np.float32))
    if scale_factor is not None:
        scales_const = x.tracer.const(np.array([1.0, 1.0] + scales, np.float32))
        return x.tracer.op("Resize", [x, empty, scales_const], **attrs)
    size = [int(s) for s in (size if isinstance(size, (tuple, list)) else [size] * n)]
    if len(size) != n or any(s < 1 for s in size):
        raise ConfigError(f"interpolate: size must be a positive int or {n} of them, got {size}")
    leading = x.tracer.op("Shape", [x], start=0, end=2)
    sizes_t = x.tracer.op("Concat", [leading, x.tracer.const(np.array(size, np.int64), np.int64)], axis=0)
    return x.tracer.op("Resize", [x, empty, empty, sizes_t], **attrs)
