"""Shape, layout, indexing, reductions and matrix products.

The graph is specialized, so a reshaping op's output shape is known: Reshape, Flatten, Squeeze
and Unsqueeze are one `reshape` to it, whatever their attributes and shape inputs say.
"""
from __future__ import annotations

import numpy as np

from ...ops.shape import pad_source_index, slice_len
from .lowering import Site, add_rows, device_constants, is_float, lowering


@lowering("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(site: Site):
    shape = site.out_shape()
    return lambda ins: [ins[0].reshape(shape)]


@lowering("Expand")
def _expand(site: Site):
    shape = site.out_shape()
    return lambda ins: [ins[0].expand(shape)]


@lowering("Transpose")
def _transpose(site: Site):
    perm = [int(p) for p in site.resolved("perm")]
    return lambda ins: [ins[0].permute(perm)]


@lowering("Concat")
def _concat(site: Site):
    import torch
    axis = int(site.resolved("axis"))
    return lambda ins: [torch.cat([x for x in ins if x is not None], dim=axis)]


@lowering("RotateHalf")
def _rotate_half(site: Site):
    """concat(-sign * x2, sign * x1) of x's halves along axis (ops/shape.py)."""
    import torch
    axis, sign = int(site.resolved("axis")), int(site.attr("sign", 1))

    def rotate(ins):
        x1, x2 = torch.chunk(ins[0], 2, dim=axis)
        return [torch.cat((-x2, x1) if sign == 1 else (x2, -x1), dim=axis)]
    return rotate


@lowering("Gather")
def _gather(site: Site):
    import torch
    shape = site.shape(0)
    axis = int(site.resolved("axis"))
    out = site.out_shape()
    dim = shape[axis]

    def gather(ins):
        data, idx = ins
        idx = torch.where(idx < 0, idx + dim, idx).reshape(-1).long()
        return [data.index_select(axis, idx).reshape(out)]
    return gather


@lowering("GatherGrad")
def _gather_grad(site: Site):
    """(dy, indices) -> dy summed into zeros of the data shape at the gathered rows (repeated
    indices add up; negative ones count from the end). Gather's padding_idx is applied before,
    in the graph (dy masked), so this kernel never sees it.

    Deterministic on every device, never atomics (lowering.add_rows)."""
    if not is_float(site.dtype(0)):
        return None
    import torch
    shape = tuple(int(d) for d in site.attr("shape"))
    axis = int(site.resolved("axis"))
    q = len(site.shape(1))
    dim = shape[axis]
    rest = shape[:axis] + shape[axis + 1:]

    def gather_grad(ins):
        dy, idx = ins
        idx = idx.reshape(-1).long()
        idx = torch.where(idx < 0, idx + dim, idx)
        # index dims of dy to the front, the gathered axis of dx to the front: one row sum
        rows = torch.movedim(dy, list(range(axis, axis + q)), list(range(q))).reshape((idx.numel(),) + rest)
        dx = add_rows(torch.zeros((dim,) + rest, dtype=dy.dtype, device=dy.device), idx, rows)
        return [torch.movedim(dx, 0, axis)]
    return gather_grad


@lowering("Slice")
def _slice(site: Site):
    import torch
    bounds = list(zip(site.resolved("starts"), site.resolved("ends"), site.resolved("steps")))
    if all(step > 0 for _, _, step in bounds):
        index = tuple(slice(s, e, st) for s, e, st in bounds)
        return lambda ins: [ins[0][index]]
    # torch slicing has no negative steps: the same elements walked forwards, then flipped
    index, flips = [], []
    for axis, (s, e, st) in enumerate(bounds):
        n = slice_len(s, e, st)
        if st > 0 or n == 0:
            index.append(slice(s, e, st) if st > 0 else slice(0, 0))
            continue
        index.append(slice(s + (n - 1) * st, s + 1, -st))
        flips.append(axis)
    index_t = tuple(index)
    return lambda ins: [torch.flip(ins[0][index_t], flips)]


@lowering("Split")
def _split(site: Site):
    import torch
    axis, sizes = int(site.resolved("axis")), list(site.resolved("split"))
    return lambda ins: list(torch.split(ins[0], sizes, dim=axis))


# -- reductions ------------------------------------------------------------------------------------
@lowering("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL2")
def _reduce(site: Site):
    import torch
    op = site.node.op
    if site.dtype(0).kind not in "iuf" or (op in ("ReduceMean", "ReduceL2") and not is_float(site.dtype(0))):
        return None
    axes, keep = list(site.resolved("axes")), bool(site.resolved("keepdims"))
    if not axes:
        fns = {"ReduceSumSquare": lambda x: x * x, "ReduceL2": lambda x: torch.sqrt(x * x)}
        fn = fns.get(op, lambda x: x)
        return lambda ins: [fn(ins[0])]
    if op == "ReduceSum":
        return lambda ins: [torch.sum(ins[0], dim=axes, keepdim=keep)]
    if op == "ReduceMean":
        return lambda ins: [torch.mean(ins[0], dim=axes, keepdim=keep)]
    if op == "ReduceSumSquare":
        return lambda ins: [torch.sum(ins[0] * ins[0], dim=axes, keepdim=keep)]
    if op == "ReduceL2":
        return lambda ins: [torch.sqrt(torch.sum(ins[0] * ins[0], dim=axes, keepdim=keep))]
    fn = torch.amax if op == "ReduceMax" else torch.amin
    return lambda ins: [fn(ins[0], dim=axes, keepdim=keep)]


@lowering("ArgMax", "ArgMin")
def _arg(site: Site):
    if site.attr("select_last_index", 0) or site.dtype(0).kind not in "iuf":
        return None
    import torch
    axis = int(site.resolved("axis"))
    keep = bool(site.attr("keepdims", 1))
    fn = torch.argmax if site.node.op == "ArgMax" else torch.argmin
    return lambda ins: [fn(ins[0], dim=axis, keepdim=keep)]  # ties: the first index, as numpy


# -- matrix products --------------------------------------------------------------------------------
@lowering("MatMul")
def _matmul(site: Site):
    if not (is_float(site.dtype(0)) and is_float(site.dtype(1))):
        return None
    import torch
    if site.dtype(1) == site.dtype(0):
        return lambda ins: [torch.matmul(ins[0], ins[1])]
    return lambda ins: [torch.matmul(ins[0], ins[1].to(ins[0].dtype))]


@lowering("Gemm")
def _gemm(site: Site):
    if not all(is_float(site.dtype(i)) for i in range(len(site.ins)) if site.has(i)):
        return None
    ta, tb = site.attr("transA", 0), site.attr("transB", 0)
    alpha, beta = site.attr("alpha", 1.0), site.attr("beta", 1.0)
    alpha32, beta32 = float(np.float32(alpha)), float(np.float32(beta))
    has_c = site.has(2)
    same = site.dtype(1) == site.dtype(0)

    def gemm(ins):
        a = ins[0].t() if ta else ins[0]
        b = ins[1].t() if tb else ins[1]
        if has_c and a.element_size() == 2 and ins[2].dtype == a.dtype and a.dim() == 2:
            # f16/bf16: one rounding of a @ b + c, as F.linear under autocast (addmm); apart it rounds twice
            return [ins[2].addmm(a, b if same else b.to(a.dtype), beta=beta32, alpha=alpha32)]
        y = a @ (b if same else b.to(a.dtype))
        if alpha != 1.0:
            y = y * alpha32
        if has_c:
            y = y + (ins[2] if beta == 1.0 else ins[2] * beta32)
        return [y]
    return gemm


# -- Pad, its gradient, Slice's gradient -------------------------------------------------------------
def _device_const(site: Site, arr: np.ndarray):
    """One compile-time index array as fn(device) -> its tensor there (lowering.device_constants)."""
    get = device_constants(site, [arr])
    return lambda device: get(device)[0]


def _torch_pads(amounts: list[tuple[int, int]]) -> list[int]:
    """(before, after) per axis -> F.pad's flat list, last axis first."""
    return [p for b, a in reversed(amounts) for p in (b, a)]


@lowering("Pad")
def _pad(site: Site):
    """Constant padding (negative amounts crop) is F.pad; edge, wrap and reflect gather each axis
    by the reference's source index (ops.shape.pad_source_index)."""
    if site.dtype(0).kind not in "iuf":
        return None
    import torch
    import torch.nn.functional as F
    shape = site.shape(0)
    pads, mode, value = site.resolved("pads"), site.resolved("mode"), site.attr("value")
    if value is None:
        return None  # a constant value known only at run time: the reference kernel reads it
    amounts = list(zip(pads[:len(shape)], pads[len(shape):]))
    if mode == "constant":
        pads = _torch_pads(amounts)
        return lambda ins: [F.pad(ins[0], pads, value=value)]
    gathers = [(axis, _device_const(site, pad_source_index(mode, d, b, a)))
               for axis, (d, (b, a)) in enumerate(zip(shape, amounts)) if (b, a) != (0, 0)]

    def pad(ins):
        x = ins[0]
        for axis, idx in gathers:
            x = torch.index_select(x, axis, idx(x.device))
        return [x]
    return pad


def _scatter_add_rows(dy, idx, rows: int, axis: int):
    """Rows of dy (along axis) summed into `rows` rows at idx, in a fixed order (add_rows)."""
    import torch
    moved = torch.movedim(dy, axis, 0)
    acc = add_rows(torch.zeros((rows,) + tuple(moved.shape[1:]), dtype=dy.dtype, device=dy.device), idx, moved)
    return torch.movedim(acc, 0, axis)


@lowering("PadGrad")
def _pad_grad(site: Site):
    """dy summed back onto the positions each output read: constant padding's is the inverse
    F.pad (a crop, or zeros where the forward cropped); the other modes add rows at the
    reference's source indices."""
    if not is_float(site.dtype(0)):
        return None
    import torch
    import torch.nn.functional as F
    shape = tuple(int(d) for d in site.attr("shape"))
    before, after, mode = site.attr("before"), site.attr("after"), site.attr("mode")
    amounts = list(zip((int(b) for b in before), (int(a) for a in after)))
    if mode == "constant":
        pads = [-p for p in _torch_pads(amounts)]
        return lambda ins: [F.pad(ins[0], pads)]
    axes = []
    for axis, (d, (b, a)) in enumerate(zip(shape, amounts)):
        if (b, a) == (0, 0):
            continue
        src = pad_source_index(mode, d, b, a)
        keep = np.flatnonzero(src >= 0)
        axes.append((axis, d, _device_const(site, keep), _device_const(site, src[keep])))

    def pad_grad(ins):
        dx = ins[0]
        for axis, d, keep, src in axes:
            dx = _scatter_add_rows(torch.index_select(dx, axis, keep(dx.device)), src(dx.device), d, axis)
        return [dx]
    return pad_grad


@lowering("SliceGrad")
def _slice_grad(site: Site):
    """dy written into zeros of the input shape at the slice (negative steps: dy flipped, into
    the same positions walked forwards)."""
    import torch
    shape = tuple(int(d) for d in site.attr("shape"))
    index, flips = [], []
    for axis, (start, end, step) in enumerate(zip(site.attr("starts"), site.attr("ends"), site.attr("steps"))):
        n = slice_len(int(start), int(end), int(step))
        if step > 0:
            index.append(slice(int(start), int(start) + (n - 1) * int(step) + 1, int(step)))
        else:
            first = int(start) + (n - 1) * int(step)
            index.append(slice(first, int(start) + 1, -int(step)))
            flips.append(axis)
    index_t = tuple(index)

    def slice_grad(ins):
        dy = ins[0]
        dx = torch.zeros(shape, dtype=dy.dtype, device=dy.device)
        dx[index_t] = torch.flip(dy, flips) if flips else dy
        return [dx]
    return slice_grad
