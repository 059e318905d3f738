"""Indexing, cumulative and remaining reduction lowerings: GatherElements/GatherND and their
gradients, ScatterElements/ScatterND, TopK, OneHot, Hardmax, CumSum, Tile, Trilu, Einsum,
DepthToSpace/SpaceToDepth, EyeLike, AbsoluteError and ReduceL1/LogSum/LogSumExp/Prod.

Index checks: a negative index counts from the end, as the reference's; one still out of range
after that is moved past the end of the tensor it addresses, so torch's own bounds check raises
(on the CPU; a device-side assert on a GPU), as the Gather lowering leaves it: reading the
indices back to check them would sync every step. Constant indices are checked when the graph is
compiled, and an out-of-range one declines the node, so the reference raises its own error.

Scatters never use atomics on a GPU (index_put_ with accumulate sorts its indices, as GatherGrad
explains), and a plain scatter with repeated positions keeps the last update, as numpy's
assignment does, rather than whichever write lands last.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...ops.index import parse_einsum, rearrange
from .lowering import Site, TorchKernel, add_rows, device_constants, is_float, lowering


def _kinds(site: Site, slots: tuple[int, ...], kinds: str) -> bool:
    return all(not site.has(i) or site.dtype(i).kind in kinds for i in slots)


def _const_in_range(site: Site, slot: int, dims: np.ndarray) -> bool:
    """False only for constant indices that some entry falls outside (negative: from the end)."""
    idx = site.const(slot)
    if idx is None:
        return True
    idx = idx.astype(np.int64)
    return bool(np.all((idx >= -dims) & (idx < dims)))


def _put_last(acc: Any, index: Any, rows: Any) -> Any:
    """acc[index[i]] = rows[i], the last i winning where indices repeat (numpy's assignment).
    Each position's last update is found by a max over update numbers (exact in any order);
    the others are sent to a spare row that is dropped."""
    import torch
    n = acc.shape[0]
    order = torch.arange(index.shape[0], device=index.device)
    last = torch.full((n + 1,), -1, dtype=order.dtype, device=index.device)
    last = last.scatter_reduce(0, index, order, "amax")
    target = torch.where(last[index] == order, index, n)
    spare = torch.cat([acc, acc[:1]])
    spare.index_put_((target,), rows)
    return spare[:n]


def _element_lin(idx: Any, shape: tuple[int, ...], axis: int) -> Any:
    """Flat positions in a tensor of `shape` of the elements GatherElements/ScatterElements
    address: idx's own coordinates, the `axis` one taken from idx (already non-negative)."""
    import torch
    strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
    lin = idx * strides[axis]
    for d, n in enumerate(idx.shape):
        if d != axis and n > 1:
            view = [1] * idx.dim()
            view[d] = n
            lin = lin + (torch.arange(n, device=idx.device) * strides[d]).reshape(view)
    return lin.reshape(-1)


def _positive(idx: Any, dim: int, bad: int) -> Any:
    """ONNX indices from the back made positive; out of range either way -> `bad` (past every
    buffer the kernels index, so torch's bounds check raises)."""
    import torch
    idx = idx.long()
    idx = torch.where(idx < 0, idx + dim, idx)
    return torch.where((idx < 0) | (idx >= dim), bad, idx)


# -- GatherElements, its gradient, ScatterElements ------------------------------------------------------
@lowering("GatherElements")
def _gather_elements(site: Site) -> TorchKernel | None:
    import torch
    shape = site.shape(0)
    axis = int(site.resolved("axis"))
    if not _kinds(site, (1,), "iu") or not _const_in_range(site, 1, np.int64(shape[axis])):
        return None
    dim = shape[axis]
    return lambda ins: [torch.gather(ins[0], axis, _positive(ins[1], dim, dim))]


@lowering("GatherElementsGrad")
def _gather_elements_grad(site: Site) -> TorchKernel | None:
    """dy summed into zeros of the data shape (attribute `shape`) at the gathered elements."""
    if not is_float(site.dtype(0)) or not _kinds(site, (1,), "iu"):
        return None
    import torch
    shape = tuple(int(d) for d in site.attr("shape"))
    axis = int(site.resolved("axis"))
    size = int(np.prod(shape, dtype=np.int64))
    if not _const_in_range(site, 1, np.int64(shape[axis])):
        return None

    def gather_elements_grad(ins):
        dy, idx = ins
        lin = _element_lin(_positive(idx, shape[axis], size), shape, axis)
        lin = torch.where(lin >= size, size, lin)
        acc = torch.zeros(size, dtype=dy.dtype, device=dy.device)
        return [add_rows(acc, lin, dy.reshape(-1)).reshape(shape)]
    return gather_elements_grad


_SCATTER_REDUCE = {"mul": "prod", "max": "amax", "min": "amin"}


def _scatter_rows(red: str) -> Any:
    """(acc (P, ...), index (M,), rows (M, ...)) -> acc with the rows combined at index."""
    if red == "none":
        return _put_last
    if red == "add":
        return add_rows
    how = _SCATTER_REDUCE[red]

    def reduce_rows(acc, index, rows):
        full = index.reshape((-1,) + (1,) * (rows.dim() - 1)).expand(rows.shape)
        return acc.scatter_reduce(0, full, rows, how)
    return reduce_rows


def _reduction(site: Site) -> str | None:
    red = site.attr("reduction", "none")
    return red if red in ("none", "add") or red in _SCATTER_REDUCE else None


@lowering("ScatterElements")
def _scatter_elements(site: Site) -> TorchKernel | None:
    red = _reduction(site)
    shape = site.shape(0)
    axis = int(site.resolved("axis"))
    if red is None or site.dtype(0).kind not in "iuf" or not _kinds(site, (1,), "iu") \
            or not _const_in_range(site, 1, np.int64(shape[axis])):
        return None
    size = int(np.prod(shape, dtype=np.int64))
    combine = _scatter_rows(red)

    def scatter_elements(ins):
        data, idx, upd = ins
        lin = _element_lin(_positive(idx, shape[axis], size + 1), shape, axis)
        lin = lin.clamp(max=size + 1)
        out = combine(data.reshape(-1).clone(), lin, upd.to(data.dtype).reshape(-1))
        return [out.reshape(shape)]
    return scatter_elements


# -- GatherND, its gradient, ScatterND -------------------------------------------------------------
def _nd_lin(idx: Any, dims: tuple[int, ...], bad: int) -> Any:
    """Flat positions (over `dims`, the first k axes) of an (..., k) index tensor's entries;
    `bad` where any coordinate is out of range."""
    import torch
    lin = torch.zeros(idx.shape[:-1], dtype=torch.int64, device=idx.device)
    invalid = torch.zeros(idx.shape[:-1], dtype=torch.bool, device=idx.device)
    stride = 1
    for j in reversed(range(len(dims))):
        c = idx[..., j].long()
        c = torch.where(c < 0, c + dims[j], c)
        invalid = invalid | (c < 0) | (c >= dims[j])
        lin = lin + c * stride
        stride *= dims[j]
    return torch.where(invalid, bad, lin)


def _nd_plan(site: Site, shape: tuple[int, ...], idx_shape: tuple[int, ...]) -> tuple[int, int, int, int, tuple]:
    """(batches, positions per batch P, elements per position R, entries per batch M, dims)."""
    b = int(site.attr("batch_dims", 0))
    k = idx_shape[-1]
    nb = int(np.prod(shape[:b], dtype=np.int64))
    dims = tuple(shape[b:b + k])
    p = int(np.prod(dims, dtype=np.int64))
    r = int(np.prod(shape[b + k:], dtype=np.int64))
    m = int(np.prod(idx_shape[b:-1], dtype=np.int64))
    return nb, p, r, m, dims


def _nd_const_ok(site: Site, slot: int, dims: tuple[int, ...]) -> bool:
    return not dims or _const_in_range(site, slot, np.asarray(dims, np.int64))


def _batched_lin(idx: Any, nb: int, p: int, m: int, dims: tuple[int, ...]) -> Any:
    """Flat row numbers into an (nb * P, R) view of the data, one per index entry."""
    import torch
    bad = nb * p + 1
    lin = _nd_lin(idx.reshape(nb, m, len(dims)), dims, bad)
    if nb > 1:
        lin = torch.where(lin == bad, bad, lin + (torch.arange(nb, device=idx.device) * p).reshape(nb, 1))
    return lin.reshape(-1)


@lowering("GatherND")
def _gather_nd(site: Site) -> TorchKernel | None:
    if not _kinds(site, (1,), "iu"):
        return None
    nb, p, r, m, dims = _nd_plan(site, site.shape(0), site.shape(1))
    if not _nd_const_ok(site, 1, dims):
        return None
    out = site.out_shape()

    def gather_nd(ins):
        data, idx = ins
        rows = data.reshape(nb * p, r).index_select(0, _batched_lin(idx, nb, p, m, dims))
        return [rows.reshape(out)]
    return gather_nd


@lowering("GatherNDGrad")
def _gather_nd_grad(site: Site) -> TorchKernel | None:
    if not is_float(site.dtype(0)) or not _kinds(site, (1,), "iu"):
        return None
    import torch
    shape = tuple(int(d) for d in site.attr("shape"))
    nb, p, r, m, dims = _nd_plan(site, shape, site.shape(1))
    if not _nd_const_ok(site, 1, dims):
        return None

    def gather_nd_grad(ins):
        dy, idx = ins
        acc = torch.zeros((nb * p, r), dtype=dy.dtype, device=dy.device)
        return [add_rows(acc, _batched_lin(idx, nb, p, m, dims), dy.reshape(nb * m, r)).reshape(shape)]
    return gather_nd_grad


@lowering("ScatterND")
def _scatter_nd(site: Site) -> TorchKernel | None:
    red = _reduction(site)
    if red is None or site.dtype(0).kind not in "iuf" or not _kinds(site, (1,), "iu"):
        return None
    shape = site.shape(0)
    k = site.shape(1)[-1]
    dims = tuple(shape[:k])
    if not _nd_const_ok(site, 1, dims):
        return None
    p = int(np.prod(dims, dtype=np.int64))
    r = int(np.prod(shape[k:], dtype=np.int64))
    combine = _scatter_rows(red)

    def scatter_nd(ins):
        data, idx, upd = ins
        lin = _nd_lin(idx, dims, p + 1).reshape(-1)
        out = combine(data.reshape(p, r).clone(), lin, upd.to(data.dtype).reshape(-1, r))
        return [out.reshape(shape)]
    return scatter_nd


# -- TopK, Hardmax, OneHot ------------------------------------------------------------------------
@lowering("TopK")
def _topk(site: Site) -> TorchKernel | None:
    """A stable sort, then the first k: ties keep the lower index first, as the reference's
    stable argsorts (torch.topk leaves their order open). Sorted output whatever `sorted` says,
    as the reference's."""
    if site.dtype(0).kind not in "iuf":
        return None
    import torch
    axis = int(site.resolved("axis"))
    k, largest = site.out_shape()[axis], bool(site.attr("largest", 1))   # k: the output's extent

    def topk(ins):
        values, order = torch.sort(ins[0], dim=axis, descending=largest, stable=True)
        return [values.narrow(axis, 0, k), order.narrow(axis, 0, k)]
    return topk


@lowering("Hardmax")
def _hardmax(site: Site) -> TorchKernel | None:
    if site.dtype(0).kind not in "iuf":
        return None
    import torch
    shape = site.shape(0)
    axis = int(site.resolved("axis"))
    n = shape[axis]

    def hardmax(ins):  # argmax: the first maximum, as numpy's
        hot = torch.nn.functional.one_hot(torch.argmax(ins[0], dim=axis), n)
        return [torch.movedim(hot, -1, axis)]
    return hardmax


@lowering("OneHot")
def _onehot(site: Site) -> TorchKernel | None:
    """Integer indices only: numpy truncates float indices by a cast whose out-of-range result
    is the platform's."""
    depth = site.attr("depth")
    if depth is None or not _kinds(site, (0,), "iu"):
        return None
    import torch
    axis = int(site.resolved("axis"))

    def onehot(ins):
        idx, values = ins[0].long(), ins[2].reshape(-1)
        idx = torch.where(idx < 0, idx + depth, idx)  # still out of range: all "off"
        hot = idx.unsqueeze(-1) == torch.arange(depth, device=idx.device)
        return [torch.where(torch.movedim(hot, -1, axis), values[1], values[0])]
    return onehot


# -- CumSum, CumProd, Tile, Trilu, DepthToSpace, SpaceToDepth, EyeLike -------------------------------
def _cumulative(site: Site, scan: Callable, identity: Callable) -> TorchKernel | None:
    """CumSum / CumProd: `scan(x, axis)` along the resolved axis, reversed and exclusive as asked
    (exclusive: element i combines the elements before i, the input shifted by one `identity`)."""
    axis = site.attr("axis")
    if axis is None or site.dtype(0).kind not in "iuf":
        return None  # an axis known only at run time: the reference kernel reads it
    import torch
    axis = int(axis)
    n = site.shape(0)[axis]
    exclusive, reverse = bool(site.resolved("exclusive")), bool(site.resolved("reverse"))

    def cumulative(ins):
        x = torch.flip(ins[0], [axis]) if reverse else ins[0]
        if exclusive:
            x = torch.cat([identity(x.narrow(axis, 0, 1)), x.narrow(axis, 0, n - 1)], dim=axis)
        c = scan(x, axis)
        return [torch.flip(c, [axis]) if reverse else c]
    return cumulative


@lowering("CumSum")
def _cumsum(site: Site) -> TorchKernel | None:
    import torch
    return _cumulative(site, lambda x, axis: torch.cumsum(x, dim=axis), torch.zeros_like)


@lowering("CumProd")
def _cumprod(site: Site) -> TorchKernel | None:
    import torch
    # integers wrap in their own dtype, as numpy's
    return _cumulative(site, lambda x, axis: torch.cumprod(x, dim=axis, dtype=x.dtype), torch.ones_like)


@lowering("Tile")
def _tile(site: Site) -> TorchKernel | None:
    shape, out = site.shape(0), site.out_shape()
    if 0 in shape:   # an empty input tiles to an empty output of any repeats
        return None
    reps = [o // d for d, o in zip(shape, out)]   # the repeats, from the shapes (as wgpu reads them)
    if not reps:
        return lambda ins: [ins[0]]
    return lambda ins: [ins[0].repeat(reps)]


@lowering("Trilu")
def _trilu(site: Site) -> TorchKernel | None:
    k = site.attr("k")
    if k is None:
        return None  # k known only at run time: the reference kernel reads it
    import torch
    fn = torch.triu if site.resolved("upper") else torch.tril
    return lambda ins: [fn(ins[0], k)]


@lowering("DepthToSpace", "SpaceToDepth")
def _depth_space(site: Site) -> TorchKernel | None:
    plan = rearrange(site.node.op, site.shape(0), int(site.resolved("blocksize")), site.resolved("mode"))
    return lambda ins: [ins[0].reshape(plan.split).permute(plan.perm).reshape(plan.out)]


@lowering("EyeLike")
def _eyelike(site: Site) -> TorchKernel | None:
    shape = site.shape(0)
    if len(shape) != 2:
        return None
    import torch
    k = int(site.attr("k", 0))
    n, m = shape

    def eyelike(ins):  # ones where column - row == k; the runtime casts to the output dtype
        dev = ins[0].device
        return [(torch.arange(m, device=dev) - torch.arange(n, device=dev).reshape(n, 1)) == k]
    return eyelike


# -- Einsum ------------------------------------------------------------------------------------------
@lowering("Einsum")
def _einsum(site: Site) -> TorchKernel | None:
    """The equation with its ellipsis spelled out (ops.index.parse_einsum). Declines a letter
    that one operand broadcasts from 1, mixed dtypes and integers (no integer matmul on GPUs)."""
    shapes = [site.shape(i) for i in range(len(site.ins))]
    dtypes = {site.dtype(i) for i in range(len(site.ins))}
    if len(dtypes) != 1 or not is_float(next(iter(dtypes))):
        return None
    spec = parse_einsum(site.node, shapes)
    if any(spec.sizes[c] != d for term, s in zip(spec.inputs, shapes) for c, d in zip(term, s)):
        return None
    import torch
    equation = spec.equation
    return lambda ins: [torch.einsum(equation, *ins)]


# -- AbsoluteError ------------------------------------------------------------------------------------
@lowering("AbsoluteError", "AbsoluteErrorGrad")
def _absolute_error(site: Site) -> TorchKernel | None:
    """|x - y|; its gradient (dy, x, y) -> dy * sign(x - y) (sign(0) = 0, as PyTorch)."""
    if not all(is_float(site.dtype(i)) for i in range(len(site.ins))):
        return None
    import torch
    if site.node.op == "AbsoluteError":
        return lambda ins: [torch.abs(ins[0] - ins[1])]
    return lambda ins: [ins[0] * torch.sign(ins[1] - ins[2])]


# -- ReduceL1, ReduceLogSum, ReduceLogSumExp, ReduceProd ------------------------------------------
@lowering("ReduceL1", "ReduceLogSum", "ReduceLogSumExp", "ReduceProd")
def _reduce_more(site: Site) -> TorchKernel | None:
    import torch
    op = site.node.op
    kind = site.dtype(0).kind
    if kind not in "iuf" or (op in ("ReduceLogSum", "ReduceLogSumExp") and kind != "f"):
        return None
    shape = site.shape(0)
    axes, keep = list(site.resolved("axes")), bool(site.resolved("keepdims"))
    if not axes:  # noop_with_empty_axes: each element its own group
        one = {"ReduceL1": torch.abs, "ReduceLogSum": torch.log}.get(op, lambda x: x)
        return lambda ins: [one(ins[0])]
    if op == "ReduceL1":
        return lambda ins: [torch.sum(torch.abs(ins[0]), dim=axes, keepdim=keep)]
    if op == "ReduceLogSum":
        return lambda ins: [torch.log(torch.sum(ins[0], dim=axes, keepdim=keep))]
    if op == "ReduceLogSumExp":
        return lambda ins: [torch.logsumexp(ins[0], dim=axes, keepdim=keep)]
    # torch.prod takes one dim: the reduced axes moved last and flattened into one
    kept = [i for i in range(len(shape)) if i not in axes]
    perm = kept + axes
    out = site.out_shape()
    flat = tuple(shape[i] for i in kept) + (-1,)
    return lambda ins: [torch.prod(ins[0].permute(perm).reshape(flat), dim=-1).reshape(out)]


# -- Det and its gradient (linear algebra in float64, rounded once, as the reference) ---------------
@lowering("Det")
def _det(site: Site) -> TorchKernel | None:
    if not is_float(site.dtype(0)) or site.dtype(0) == np.float16:
        return None
    import torch

    def det(ins):
        return [torch.linalg.det(ins[0].to(torch.float64)).to(ins[0].dtype)]
    return det


@lowering("DetGrad")
def _det_grad(site: Site) -> TorchKernel | None:
    """dy * cofactors(x), the cofactors from the (n-1)-minors' determinants (defined for singular x)."""
    if not is_float(site.dtype(1)) or site.dtype(1) == np.float16:
        return None
    import torch
    n = site.shape(1)[-1]
    keep = np.array([[k for k in range(n) if k != i] for i in range(n)], np.int64).reshape(n, max(n - 1, 0))
    signs = np.array([[(-1.0) ** (i + j) for j in range(n)] for i in range(n)])
    index_of, signs_of = device_constants(site, [keep]), device_constants(site, [signs], floats=True)
    batch = site.shape(1)[:-2]

    def det_grad(ins):
        dy, x = ins[0].to(torch.float64), ins[1].to(torch.float64)
        if n == 1:
            cof = torch.ones_like(x)
        else:
            rows, = index_of(x.device)  # (n, n-1): minor (i, j) keeps rows keep[i] and columns keep[j]
            minors = x[..., rows[:, None, :, None], rows[None, :, None, :]]
            cof = torch.linalg.det(minors) * signs_of(x.device, torch.float64)[0]
        out = dy.reshape(batch + (1, 1)) * cof
        return [out.to(ins[1].dtype)]
    return det_grad
