"""Detection-style ops: NonMaxSuppression, Unique, RoiAlign.

NonMaxSuppression and Unique have outputs whose shapes depend on input values: anygrad's graphs
have static shapes, so they run when those inputs are known at compile time (constants; the ONNX
backend folds node-test inputs in as such) and raise ShapeError otherwise. None is differentiable
except RoiAlign's average mode through its image input, which is not provided (no gradient rule).
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import norm_axis


def _known(node: Node, info: TensorInfo | None, what: str):
    if info is None:
        return None
    if info.const is None:
        raise ShapeError(f"{node.label}: '{what}' must be known when the model is compiled "
                         "(the output's shape depends on its values)")
    return np.asarray(info.const)


def _folded_infer(forward, names: tuple[str, ...]):
    """Shape rule for a value-dependent op: evaluate it on the constant inputs."""
    def infer(node: Node, ins: list) -> list[TensorInfo]:
        values = [_known(node, i, n) for i, n in zip(ins, names)]
        outs = forward(node, values)
        outs = outs if isinstance(outs, list) else [outs]
        return [TensorInfo(o.dtype, o.shape, o) for o in outs][:len(node.outputs)]
    return infer


# -- NonMaxSuppression -------------------------------------------------------------------------
def _corners(boxes: np.ndarray, center: bool) -> np.ndarray:
    """(..., 4) boxes as (y1, x1, y2, x2) with y1 <= y2, x1 <= x2."""
    if center:  # (x_center, y_center, width, height)
        xc, yc, w, h = np.moveaxis(boxes, -1, 0)
        return np.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], -1)
    y1, x1, y2, x2 = np.moveaxis(boxes, -1, 0)
    return np.stack([np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)], -1)


def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    ih = np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0])
    iw = np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1])
    inter = np.where((ih > 0) & (iw > 0), ih * iw, 0.0)
    area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    union = area(box) + area(others) - inter
    ok = (inter > 0) & (area(box) > 0) & (area(others) > 0) & (union > 0)
    return np.where(ok, inter / np.where(union > 0, union, 1), 0.0)


def _scalar(value, default):
    return default if value is None or np.asarray(value).size == 0 else np.asarray(value).reshape(-1)[0]


def _nms_forward(node: Node, ins: list) -> np.ndarray:
    boxes, scores = ins[0], ins[1]
    limit = max(int(_scalar(ins[2] if len(ins) > 2 else None, 0)), 0)
    iou_threshold = float(_scalar(ins[3] if len(ins) > 3 else None, 0.0))
    score_threshold = ins[4] if len(ins) > 4 else None
    corners = _corners(boxes.astype(np.float64), bool(node.attr("center_point_box", 0)))
    selected = []
    for b in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[b, c]
            order = np.argsort(-s, kind="stable")  # best first; ties: lower index first
            if score_threshold is not None and np.asarray(score_threshold).size:
                order = order[s[order] > float(_scalar(score_threshold, 0.0))]
            kept: list[int] = []
            for i in order:
                if len(kept) >= limit:
                    break
                if not kept or not (_iou(corners[b, i], corners[b, kept]) > iou_threshold).any():
                    kept.append(int(i))
            selected += [(b, c, i) for i in kept]
    return np.array(selected, np.int64).reshape(-1, 3)


defop("NonMaxSuppression", nondiff=[0, 1, 2, 3, 4], forward=_nms_forward,
      infer=_folded_infer(_nms_forward, ("boxes", "scores", "max_output_boxes_per_class", "iou_threshold",
                                         "score_threshold")))


# -- Unique ------------------------------------------------------------------------------------
def _unique_forward(node: Node, ins: list) -> list[np.ndarray]:
    x = ins[0]
    axis = node.attr("axis")
    if axis is None:
        y, first, inverse, counts = np.unique(x, True, True, True)
        take = lambda idx: x.reshape(-1)[idx]
    else:
        axis = norm_axis(int(axis), x.ndim)
        y, first, inverse, counts = np.unique(x, True, True, True, axis=axis)
        take = lambda idx: np.take(x, idx, axis=axis)
    if not int(node.attr("sorted", 1)):  # order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
        y = take(first)
    return [y, first.astype(np.int64), inverse.reshape(-1).astype(np.int64), counts.astype(np.int64)]


defop("Unique", nondiff=[0], forward=_unique_forward, infer=_folded_infer(_unique_forward, ("X",)))


# -- RoiAlign ----------------------------------------------------------------------------------
def _roi_axis(start: float, bin_size: float, bins: int, grid: int, size: int):
    """Sample positions along one axis: low/high indices, weights (low, high), validity; (bins, grid)."""
    pos = start + np.arange(bins)[:, None] * bin_size + (np.arange(grid)[None, :] + 0.5) * bin_size / grid
    valid = (pos >= -1.0) & (pos <= size)
    pos = np.maximum(pos, 0)
    low = pos.astype(np.int64)
    edge = low >= size - 1
    low = np.where(edge, size - 1, low)
    high = np.where(edge, size - 1, low + 1)
    pos = np.where(edge, low, pos)
    frac = pos - low
    return low, high, 1 - frac, frac, valid


def _roi_align_forward(node: Node, ins: list) -> np.ndarray:
    x, rois, batch = ins[0], ins[1], np.asarray(ins[2]).reshape(-1)
    mode = node.attr("mode", "avg")
    if mode not in ("avg", "max"):
        raise UnsupportedOpError(f"{node.label}: mode '{mode}'; expected avg or max")
    oh, ow = int(node.attr("output_height", 1)), int(node.attr("output_width", 1))
    ratio, scale = int(node.attr("sampling_ratio", 0)), float(node.attr("spatial_scale", 1.0))
    half_pixel = node.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    height, width = x.shape[2:]
    out = np.zeros((len(batch), x.shape[1], oh, ow), np.float64)
    for n, (roi, b) in enumerate(zip(rois.astype(np.float64), batch)):
        x0, y0, x1, y1 = roi * scale - (0.5 if half_pixel else 0.0)
        rw, rh = x1 - x0, y1 - y0
        if not half_pixel:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        gh = ratio if ratio > 0 else int(np.ceil(rh / oh))
        gw = ratio if ratio > 0 else int(np.ceil(rw / ow))
        ylo, yhi, wyl, wyh, vy = _roi_axis(y0, rh / oh, oh, gh, height)
        xlo, xhi, wxl, wxh, vx = _roi_axis(x0, rw / ow, ow, gw, width)
        img = x[int(b)].astype(np.float64)  # (C, H, W)
        valid = vy[:, :, None, None] & vx[None, None, :, :]  # (oh, gh, ow, gw)
        terms = [img[:, ys[:, :, None, None], xs[None, None, :, :]] * (wy[:, :, None, None] * wx[None, None, :, :])
                 for ys, wy in ((ylo, wyl), (yhi, wyh)) for xs, wx in ((xlo, wxl), (xhi, wxh))]
        terms = [np.where(valid, t, 0.0) for t in terms]  # (C, oh, gh, ow, gw)
        if mode == "avg":
            out[n] = sum(terms).sum(axis=(2, 4)) / max(gh * gw, 1)
        else:  # ONNX's max mode: the largest weighted corner over all samples
            out[n] = np.max(np.maximum.reduce(terms), axis=(2, 4))
    return out.astype(x.dtype)


defop("RoiAlign", nondiff=[1, 2], forward=_roi_align_forward,
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, (ins[2].shape[0], ins[0].shape[1],
                                                         int(node.attr("output_height", 1)),
                                                         int(node.attr("output_width", 1))))])
