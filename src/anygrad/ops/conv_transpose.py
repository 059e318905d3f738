"""ConvTranspose (1-D, 2-D, 3-D), as a composite of the Conv input gradient.

A transposed convolution IS the input gradient of a convolution: ConvTranspose(X, W) with
pads (b, e) and output_padding p equals ConvGradInput(dY=X, W) of a Conv whose input has the
ConvTranspose's output shape and whose end pad is e - p. So ConvTranspose expands into the
internal ConvGradInput (which every backend already runs, wgpu included), a zero Pad when a pad
would be negative (output_shape larger than the natural size, or output_padding > end pad), and
a bias Add. Its gradients are ConvGradInput's: a Conv for X and a ConvGradWeight with the roles
of input and output swapped for W (see ops/nn.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError
from ..ir.builder import Builder
from ..ir.composite import defcomposite
from ..ir.graph import Node, TensorInfo


def _str_attr(node: Node, key: str, default: str) -> str:
    value = node.attr(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _ints(node: Node, key: str, default: list[int], nd: int) -> list[int]:
    value = [int(v) for v in (node.attr(key) or default)]
    if len(value) != len(default):
        raise ShapeError(f"{node.label}: {key} {value} must have {len(default)} entries for {nd} spatial dims")
    return value


@dataclass(frozen=True)
class Transposed:
    """Where the full transposed-conv result (length (X-1)*s + extent) lands in the output."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]      # pads cropped at the start (negative: zeros added)
    end: tuple[int, ...]        # pads cropped at the end, output_padding already taken off
    out: tuple[int, ...]        # output spatial shape
    group: int

    def core_pads(self) -> tuple[list[int], list[int]]:
        """Non-negative pads for ConvGradInput; the rest is a zero Pad around its result."""
        return [max(b, 0) for b in self.begin], [max(e, 0) for e in self.end]


def geometry(node: Node, x_shape, w_shape) -> Transposed:
    """Resolve strides/dilations/pads/auto_pad/output_padding/output_shape (ONNX rules)."""
    nd = len(x_shape) - 2
    kernel = tuple(int(k) for k in w_shape[2:])
    if node.attr("kernel_shape") is not None and tuple(int(k) for k in node.attr("kernel_shape")) != kernel:
        raise ShapeError(f"{node.label}: kernel_shape {list(node.attr('kernel_shape'))} differs from the "
                         f"weight's {list(kernel)}")
    strides = _ints(node, "strides", [1] * nd, nd)
    dilations = _ints(node, "dilations", [1] * nd, nd)
    out_pad = _ints(node, "output_padding", [0] * nd, nd)
    spatial = [int(d) for d in x_shape[2:]]
    full = [(i - 1) * s + (k - 1) * d + 1 + p
            for i, s, k, d, p in zip(spatial, strides, kernel, dilations, out_pad)]
    auto_pad = _str_attr(node, "auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise ShapeError(f"{node.label}: unknown auto_pad '{auto_pad}'")
    wanted = node.attr("output_shape")
    if wanted is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = ([int(o) for o in wanted][-nd:] if wanted is not None
               else [i * s for i, s in zip(spatial, strides)])
        total = [f - o for f, o in zip(full, out)]
        # The odd pad goes to the end for SAME_UPPER and to the start otherwise (the ONNX spec).
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
        end = [t - b for t, b in zip(total, begin)]
    else:
        pads = [0] * (2 * nd) if auto_pad == "VALID" else _ints(node, "pads", [0] * (2 * nd), nd)
        begin, end = pads[:nd], pads[nd:]
    out = [f - b - e for f, b, e in zip(full, begin, end)]
    if any(o < 1 for o in out):
        raise ShapeError(f"{node.label}: output spatial shape {out} is empty (input {spatial}, pads "
                         f"{begin + end})")
    return Transposed(kernel, tuple(strides), tuple(dilations), tuple(begin),
                      tuple(e - p for e, p in zip(end, out_pad)), tuple(out), int(node.attr("group", 1)))


def _infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    x, w = ins[0], ins[1]
    if x.rank < 3 or w.rank != x.rank:
        raise ShapeError(f"{node.label}: ConvTranspose needs X (N, C, ...) and W (C, M/group, ...) of equal "
                         f"rank, got {tuple(x.shape)} and {tuple(w.shape)}")
    group = int(node.attr("group", 1))
    if isinstance(x.shape[1], int) and x.shape[1] != w.shape[0]:
        raise ShapeError(f"{node.label}: X has {x.shape[1]} channels but W {tuple(w.shape)} expects {w.shape[0]}")
    if w.shape[0] % group:
        raise ShapeError(f"{node.label}: W's {w.shape[0]} input channels do not split into group={group}")
    m = w.shape[1] * group
    if len(ins) > 2 and ins[2] is not None and tuple(ins[2].shape) != (m,):
        raise ShapeError(f"{node.label}: bias shape {tuple(ins[2].shape)} is not ({m},)")
    if any(not isinstance(d, int) for d in x.shape[2:]):
        raise ShapeError(f"{node.label}: ConvTranspose needs static spatial dims, got {tuple(x.shape)}")
    geo = geometry(node, x.shape, w.shape)
    return [TensorInfo(x.dtype, (x.shape[0], m) + geo.out)]


def _expand(b: Builder, node: Node) -> list[str]:
    x, w = node.inputs[0], node.inputs[1]
    xs, ws = b.shape(x), b.shape(w)
    geo = geometry(node, xs, ws)
    begin, end = geo.core_pads()
    # zeros a negative pad adds, which ConvGradInput (cropping only) cannot give
    before = [c - g for c, g in zip(begin, geo.begin)]
    after = [c - g for c, g in zip(end, geo.end)]
    core = tuple(o - p - q for o, p, q in zip(geo.out, before, after))
    m = ws[1] * geo.group
    y = b.op("ConvGradInput", [x, w], kernel_shape=list(geo.kernel), strides=list(geo.strides),
             dilations=list(geo.dilations), pads=begin + end, group=geo.group,
             input_shape=[xs[0], m, *core])
    if any(before) or any(after):
        pads = [0, 0, *before, 0, 0, *after]
        y = b.op("Pad", [y, b.const(np.array(pads, np.int64), np.int64, "pads")])
    if node.input(2):
        bias = b.reshape(node.inputs[2], (1, m) + (1,) * len(geo.out))
        y = b.op("Add", [y, bias])
    return [y]


defcomposite("ConvTranspose", infer=_infer, expand=_expand)
