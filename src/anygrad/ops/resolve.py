"""Attribute resolution (OpDef.resolve): each op family's attributes made explicit once shapes are
known, so that backends read `node.attrs` and the shapes and never re-derive what an ONNX
attribute means (anygrad.ir.passes.resolve_attributes runs these).

The contract, per family:
- windowed ops: kernel_shape, strides, dilations, pads (begins then ends) explicit, auto_pad
  gone (SAME_* turned into pads); Conv-like ops carry group, pools ceil_mode and count_include_pad;
- reductions: axes sorted and non-negative ([] with noop_with_empty_axes=1 is "no reduction"; an
  empty axes list without it became every axis), keepdims, from the attribute or the axes input;
- ops with an axis: the default filled in, made non-negative (CumSum/CumProd's axis input copied in);
- Transpose: perm; Pad: pads over every axis, mode, value (when constant); Slice: starts, ends,
  steps per input axis after ONNX's clamping (see shape.slice_bounds); Split: axis and split;
  Dropout: ratio and training_mode; losses: reduction; OneHot: depth; Trilu: k and upper; DepthToSpace/SpaceToDepth:
  mode and blocksize; Resize/Upsample: the interpolation attributes (resize.Interp), scales and roi
  per axis.

Every rule reads through the family's own helper, so there is one interpretation of each
attribute; each is idempotent. A value held by an input only known when the step runs is left
out: the numpy reference still runs the node, a backend that needs it names it (passes.resolved).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..ir.graph import Node, TensorInfo
from ..ir.registry import get_op, set_resolve
from ._util import norm_axis, slot
from .loss import loss_reduction
from .nn import dropout_ratio, window
from .reduce import REDUCTIONS, reduce_axes
from .resize import interp_of, resize_plan
from .shape import pad_amounts, pad_mode, slice_bounds, split_sizes

Ins = list[TensorInfo | None]
Attrs = dict[str, Any]


def _known(ins: Ins, *slots: int) -> bool:
    """Whether every present input among `slots` is a compile-time constant."""
    return all(slot(ins, s) is None or slot(ins, s).const is not None for s in slots)


def _static(*shapes) -> bool:
    return all(s is not None and all(isinstance(d, int) for d in s) for s in shapes)


def _scalar(info: TensorInfo | None) -> Any:
    return None if info is None or info.const is None else np.asarray(info.const).reshape(-1)


# -- windowed ops ------------------------------------------------------------------------------

def _shape(info: TensorInfo | None) -> tuple | None:
    return None if info is None else tuple(info.shape)


def _attr_shape(key: str) -> Callable[[Node], tuple | None]:
    return lambda node: None if node.attr(key) is None else tuple(node.attr(key))


# op -> (its input's shape, its weight's shape; None for a pool, whose kernel is kernel_shape)
Shape = Callable[[Node, Ins], tuple | None]
WINDOWED: dict[str, tuple[Shape, Shape | None]] = {
    "Conv": (lambda n, i: _shape(i[0]), lambda n, i: _shape(i[1])),
    "ConvInteger": (lambda n, i: _shape(i[0]), lambda n, i: _shape(i[1])),
    "QLinearConv": (lambda n, i: _shape(i[0]), lambda n, i: _shape(i[3])),
    "ConvGradInput": (lambda n, i: _attr_shape("input_shape")(n), lambda n, i: _shape(i[1])),
    "ConvGradWeight": (lambda n, i: _shape(i[1]), lambda n, i: _attr_shape("weight_shape")(n)),
    "MaxPool": (lambda n, i: _shape(i[0]), None),
    "AveragePool": (lambda n, i: _shape(i[0]), None),
    "MaxPoolGrad": (lambda n, i: _shape(i[1]), None),
    "AveragePoolGrad": (lambda n, i: _attr_shape("input_shape")(n), None),
}


def _resolve_window(node: Node, ins: Ins) -> Attrs:
    spatial_of, weight_of = WINDOWED[node.op]
    pool = weight_of is None
    shape = spatial_of(node, ins)
    kernel = tuple(node.attr("kernel_shape") or ()) if weight_of is None else (weight_of(node, ins) or ())[2:]
    if not _static(shape, kernel) or not kernel:
        return dict(node.attrs)
    auto_pad = node.attr("auto_pad", "NOTSET")
    same = (auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)).startswith("SAME")
    ceil = bool(node.attr("ceil_mode", 0)) and not same  # SAME's output size ignores ceil_mode
    win = window(node, shape[2:], kernel, ceil)
    attrs = {k: v for k, v in node.attrs.items() if k != "auto_pad"}
    attrs.update(win.attrs())
    if pool:
        attrs.update(ceil_mode=int(ceil), count_include_pad=int(node.attr("count_include_pad", 0)))
    else:
        attrs["group"] = int(node.attr("group", 1))
    return attrs


# -- reductions --------------------------------------------------------------------------------
def _resolve_reduce(node: Node, ins: Ins) -> Attrs:
    if ins[0] is None or not _known(ins, 1):
        return dict(node.attrs)
    axes = reduce_axes(node, ins, ins[0].rank)
    # noop_with_empty_axes=1: the axes list means exactly what it says, [] included
    return {**node.attrs, "axes": list(axes), "keepdims": int(node.attr("keepdims", 1)), "noop_with_empty_axes": 1}


# -- one axis ----------------------------------------------------------------------------------
def _rank(extra: int = 0) -> Callable[[Node, Ins], int]:
    return lambda node, ins: ins[0].rank + extra


def _shape_attr_rank(node: Node, ins: Ins) -> int:
    return len(node.attr("shape"))


# op -> (default axis, None when the attribute is required or optional without default; the rank
# the axis counts in)
AXIS: dict[str, tuple[int | None, Callable[[Node, Ins], int]]] = {
    **{op: (-1, _rank()) for op in ("Softmax", "LogSoftmax", "SoftmaxGrad", "LogSoftmaxGrad", "Hardmax",
                                    "LayerNormalization", "LayerNormGrad", "RMSNormalization", "RMSNormGrad",
                                    "TopK", "RotateHalf")},
    **{op: (0, _rank()) for op in ("Gather", "GatherElements", "ScatterElements", "Scatter", "ArgMax", "ArgMin")},
    **{op: (1, _rank()) for op in ("Flatten", "QuantizeLinear", "DequantizeLinear")},
    "Concat": (None, _rank()),
    "Compress": (None, _rank()),
    "OneHot": (-1, _rank(1)),
    "GatherGrad": (None, _shape_attr_rank),
    "GatherElementsGrad": (None, _shape_attr_rank),
}


def _resolve_axis(node: Node, ins: Ins) -> Attrs:
    default, rank_of = AXIS[node.op]
    axis = node.attr("axis", default)
    if axis is None or ins[0] is None:
        return dict(node.attrs)
    attrs = {**node.attrs, "axis": norm_axis(int(axis), rank_of(node, ins))}
    if node.op == "OneHot" and _scalar(slot(ins, 1)) is not None:
        attrs["depth"] = int(_scalar(ins[1])[0])
    return attrs


def _resolve_cumulative(node: Node, ins: Ins) -> Attrs:
    """CumSum / CumProd: the axis input as an attribute; exclusive and reverse explicit."""
    attrs = {**node.attrs, "exclusive": int(node.attr("exclusive", 0)), "reverse": int(node.attr("reverse", 0))}
    axis = _scalar(slot(ins, 1))
    if axis is not None:
        attrs["axis"] = norm_axis(int(axis[0]), ins[0].rank)
    return attrs


def _resolve_trilu(node: Node, ins: Ins) -> Attrs:
    attrs = {**node.attrs, "upper": int(node.attr("upper", 1))}
    if slot(ins, 1) is None:
        attrs["k"] = 0
    elif _scalar(ins[1]) is not None:
        attrs["k"] = int(_scalar(ins[1])[0])
    return attrs


def _resolve_transpose(node: Node, ins: Ins) -> Attrs:
    rank = ins[0].rank
    perm = node.attr("perm")
    return {**node.attrs, "perm": list(reversed(range(rank))) if perm is None else [norm_axis(int(p), rank) for p in perm]}


# -- shape ops ---------------------------------------------------------------------------------
def _resolve_pad(node: Node, ins: Ins) -> Attrs:
    if not _known(ins, 1, 3):
        return dict(node.attrs)
    shape = tuple(ins[0].shape)
    amounts = pad_amounts(node, ins, len(shape))
    attrs = {**node.attrs, "pads": [b for b, _ in amounts] + [a for _, a in amounts],
             "mode": pad_mode(node, shape, amounts)}
    value = slot(ins, 2)
    if value is None or (value.const is not None and np.asarray(value.const).size == 0):
        attrs["value"] = float(node.attr("value", 0.0))
    elif value.const is not None:
        attrs["value"] = np.asarray(value.const).reshape(()).item()
    return attrs


def _resolve_slice(node: Node, ins: Ins) -> Attrs:
    if not _known(ins, 1, 2, 3, 4) or not _static(tuple(ins[0].shape)):
        return dict(node.attrs)
    bounds = slice_bounds(node, ins, tuple(ins[0].shape))
    return {**node.attrs, "starts": [int(b[0]) for b in bounds], "ends": [int(b[1]) for b in bounds],
            "axes": list(range(len(bounds))), "steps": [int(b[2]) for b in bounds]}


def _resolve_split(node: Node, ins: Ins) -> Attrs:
    if not _known(ins, 1) or not _static(tuple(ins[0].shape)):
        return dict(node.attrs)
    axis, sizes = split_sizes(node, tuple(ins[0].shape), slot(ins, 1))
    return {**node.attrs, "axis": axis, "split": sizes}


# -- the rest ----------------------------------------------------------------------------------
def _resolve_dropout(node: Node, ins: Ins) -> Attrs:
    """ratio and training_mode (inputs 1 and 2 from opset 12) as attributes, defaults filled in."""
    attrs = dict(node.attrs)
    if _known(ins, 1):
        attrs["ratio"] = dropout_ratio(node, slot(ins, 1))
    if _known(ins, 2):
        attrs["training_mode"] = int(bool(_scalar(slot(ins, 2))[0])) if slot(ins, 2) is not None else 0
    return attrs


def _resolve_loss(node: Node, ins: Ins) -> Attrs:
    return {**node.attrs, "reduction": loss_reduction(node)}


def _resolve_rearrange(node: Node, ins: Ins) -> Attrs:
    mode = node.attr("mode", "DCR")
    return {**node.attrs, "mode": mode.decode() if isinstance(mode, bytes) else str(mode),
            "blocksize": int(node.attr("blocksize", 0))}


def _resolve_resize(node: Node, ins: Ins) -> Attrs:
    """The interpolation attributes with opset defaults (resize.Interp), and `scales` and `roi` per
    input axis (resize.resize_plan) when its inputs are constants. The reference keeps reading
    the inputs (or Upsample's own `scales`, which mean the same)."""
    attrs = {**node.attrs, **interp_of(node).attrs()}
    if node.op == "ResizeGrad" or not _known(ins, 1, 2, 3) or not _static(tuple(ins[0].shape)):
        return attrs
    plan = resize_plan(node, tuple(ins[0].shape), ins)
    return {**attrs, "scales": [float(s) for s in plan.scales], "roi": [float(r) for r in plan.roi]}


def _register() -> None:
    set_resolve([op for op in WINDOWED if get_op(op)], _resolve_window)
    set_resolve(list(REDUCTIONS), _resolve_reduce)
    set_resolve([op for op in AXIS if get_op(op)], _resolve_axis)
    set_resolve([op for op in ("CumSum", "CumProd") if get_op(op)], _resolve_cumulative)
    set_resolve(["Trilu"], _resolve_trilu)
    set_resolve(["Transpose"], _resolve_transpose)
    set_resolve(["Pad"], _resolve_pad)
    set_resolve(["Slice"], _resolve_slice)
    set_resolve(["Split"], _resolve_split)
    set_resolve(["Dropout"], _resolve_dropout)
    set_resolve(["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", "CrossEntropy", "CrossEntropyGrad",
                 "CrossEntropyMetrics"], _resolve_loss)
    set_resolve(["DepthToSpace", "SpaceToDepth"], _resolve_rearrange)
    set_resolve(["Resize", "Upsample", "ResizeGrad"], _resolve_resize)


_register()
