"""Ops that address elements by index or position: gathers and scatters, TopK, OneHot, CumSum,
Trilu, Einsum, DepthToSpace/SpaceToDepth, Resize/Upsample, and the predicates Mod, IsNaN, IsInf.

Gradients of gathers are scatter-adds (internal *Grad ops that take the data shape as an
attribute, so no zero tensor is materialised); gradients of scatters are gathers. Einsum's
gradient is again an Einsum, with the equation rearranged. Resize is separable: on each axis it
is a small (out x in) interpolation matrix, so its gradient applies the transposed matrices.
"""
from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np

from ..errors import AnygradError, ShapeError, UnsupportedOpError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import broadcast_infer, ints_of, norm_axis, same_as_first, slot


def _axis(node: Node, rank: int, default: int = 0) -> int:
    axis = norm_axis(int(node.attr("axis", default)), rank)
    if not 0 <= axis < rank:
        raise ShapeError(f"{node.label}: axis {node.attr('axis', default)} is out of range for rank {rank}")
    return axis


def _positive(idx: np.ndarray, dim) -> np.ndarray:
    """ONNX indices may count from the back."""
    idx = np.asarray(idx).astype(np.int64)
    return np.where(idx < 0, idx + np.asarray(dim, np.int64), idx)


def _str(node: Node, key: str, default: str) -> str:
    value = node.attr(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _shape_attr_infer(node, ins):
    """Backward helpers that rebuild an input of the shape in attribute `shape`."""
    return [TensorInfo(ins[0].dtype, tuple(node.attr("shape")))]


def _zeros_like(g: GradContext, name: str) -> str:
    return g.const(np.zeros(g.shape(name), g.dtype(name)), g.dtype(name), "zeros")


# -- GatherElements / ScatterElements -------------------------------------------------------
def _element_index(idx: np.ndarray, axis: int) -> tuple:
    """Full coordinates of every element of `idx`, with the `axis` coordinate taken from idx."""
    coords = list(np.indices(idx.shape, sparse=True))
    coords[axis] = idx
    return tuple(coords)


def _gather_elements_infer(node, ins):
    data, idx = ins
    if len(idx.shape) != len(data.shape):
        raise ShapeError(f"{node.label}: indices rank {len(idx.shape)} differs from data rank {len(data.shape)}")
    _axis(node, len(data.shape))
    return [TensorInfo(data.dtype, tuple(idx.shape))]


def _gather_elements_forward(node, ins):
    data, idx = ins
    axis = _axis(node, data.ndim)
    return data[_element_index(_positive(idx, data.shape[axis]), axis)]


def _gather_elements_grad(g: GradContext):
    shape = g.shape(g.x[0])
    return [g.op("GatherElementsGrad", [g.dy, g.x[1]], axis=_axis(g.node, len(shape)), shape=list(shape)), None]


def _gather_elements_grad_forward(node, ins):
    dy, idx = ins
    shape, axis = tuple(node.attr("shape")), node.attr("axis")
    dx = np.zeros(shape, dy.dtype)
    np.add.at(dx, _element_index(_positive(idx, shape[axis]), axis), dy)  # repeated indices sum
    return dx


defop("GatherElements", infer=_gather_elements_infer, forward=_gather_elements_forward,
      grad=_gather_elements_grad, nondiff=[1])
# dy scatter-added into zeros of the data shape (attrs: axis, shape). Also TopK's gradient.
defop("GatherElementsGrad", internal=True, nondiff=[1], infer=_shape_attr_infer,
      forward=_gather_elements_grad_forward,
      grad=lambda g: [g.op("GatherElements", [g.dy, g.x[1]], axis=g.node.attr("axis")), None])

# reduction attribute -> numpy ufunc applied at repeated positions ("none": plain assignment)
_SCATTER_UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _reduction(node: Node) -> str:
    red = _str(node, "reduction", "none")
    if red != "none" and red not in _SCATTER_UFUNCS:
        raise UnsupportedOpError(f"{node.label}: reduction '{red}' is not supported "
                                 f"(supported: none, {', '.join(_SCATTER_UFUNCS)})")
    return red


def _scatter_into(out: np.ndarray, where: tuple, updates: np.ndarray, reduction: str) -> np.ndarray:
    if reduction == "none":
        out[where] = updates
    else:
        _SCATTER_UFUNCS[reduction].at(out, where, updates)
    return out


def _scatter_elements_infer(node, ins):
    data, idx, upd = ins
    if tuple(idx.shape) != tuple(upd.shape) or len(idx.shape) != len(data.shape):
        raise ShapeError(f"{node.label}: indices {tuple(idx.shape)} and updates {tuple(upd.shape)} must have "
                         f"one shape, of the rank of data {tuple(data.shape)}")
    _axis(node, len(data.shape))
    _reduction(node)
    return [TensorInfo(data.dtype, tuple(data.shape))]


def _scatter_elements_forward(node, ins):
    data, idx, upd = ins
    axis = _axis(node, data.ndim)
    where = _element_index(_positive(idx, data.shape[axis]), axis)
    return _scatter_into(data.copy(), where, upd.astype(data.dtype), _reduction(node))


def _no_scatter_grad(g: GradContext, red: str):
    raise AnygradError(f"{g.node.label}: the gradient of {g.node.op} with reduction '{red}' is not supported "
                       "(only 'none' and 'add'" + (" and 'mul'" if g.node.op == "ScatterND" else "") + ")")


def _scatter_elements_grad(g: GradContext):
    red = _reduction(g.node)
    if red not in ("none", "add"):
        _no_scatter_grad(g, red)
    axis = _axis(g.node, len(g.shape(g.x[0])))
    idx, upd = g.x[1], g.x[2]
    ddata = dupd = None
    if g.need(0):  # overwritten positions pass nothing back to data
        ddata = g.dy if red == "add" else g.op("ScatterElements", [g.dy, idx, _zeros_like(g, upd)], axis=axis)
    if g.need(2):
        dupd = g.op("GatherElements", [g.dy, idx], axis=axis)
    return [ddata, None, dupd]


for _name in ("ScatterElements", "Scatter"):  # Scatter: the opset 9-10 name of ScatterElements
    defop(_name, infer=_scatter_elements_infer, forward=_scatter_elements_forward,
          grad=_scatter_elements_grad, nondiff=[1])


# -- GatherND / ScatterND --------------------------------------------------------------------
def _nd_where(idx: np.ndarray, shape: tuple) -> tuple:
    """Index tuple of the slices an (..., k) index tensor addresses in a tensor of `shape`."""
    k = idx.shape[-1]
    flat = _positive(idx.reshape(-1, k), np.array(shape[:k], np.int64))
    return tuple(flat.T)


def _gather_nd_shape(node: Node, data: tuple, idx: tuple) -> tuple:
    b = int(node.attr("batch_dims", 0))
    k = idx[-1]
    if not isinstance(k, int) or k > len(data) - b or tuple(data[:b]) != tuple(idx[:b]):
        raise ShapeError(f"{node.label}: indices {idx} do not address data {data} with batch_dims {b}")
    return tuple(idx[:-1]) + tuple(data[b + k:])


def _per_batch(node: Node, data_shape: tuple, idx: np.ndarray):
    """(batch count, data shape within a batch, indices per batch) for batch_dims."""
    b = int(node.attr("batch_dims", 0))
    nb = int(np.prod(data_shape[:b], dtype=np.int64))
    return nb, tuple(data_shape[b:]), idx.reshape((nb,) + idx.shape[b:])


def _gather_nd_forward(node, ins):
    data, idx = ins
    nb, inner, idx_b = _per_batch(node, data.shape, idx)
    data_b = data.reshape((nb,) + inner)
    out = np.stack([data_b[i][_nd_where(idx_b[i], inner)] for i in range(nb)])
    return out.reshape(_gather_nd_shape(node, data.shape, idx.shape))


def _gather_nd_grad_forward(node, ins):
    dy, idx = ins
    shape = tuple(node.attr("shape"))
    nb, inner, idx_b = _per_batch(node, shape, idx)
    dx = np.zeros((nb,) + inner, dy.dtype)
    k = idx.shape[-1]
    dy_b = dy.reshape((nb, -1) + inner[k:])
    for i in range(nb):
        np.add.at(dx[i], _nd_where(idx_b[i], inner), dy_b[i])
    return dx.reshape(shape)


defop("GatherND", nondiff=[1],
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, _gather_nd_shape(node, tuple(ins[0].shape),
                                                                        tuple(ins[1].shape)))],
      forward=_gather_nd_forward,
      grad=lambda g: [g.op("GatherNDGrad", [g.dy, g.x[1]], shape=list(g.shape(g.x[0])),
                           batch_dims=int(g.node.attr("batch_dims", 0))), None])
# dy scatter-added into zeros of the data shape (attrs: shape, batch_dims).
defop("GatherNDGrad", internal=True, nondiff=[1], infer=_shape_attr_infer, forward=_gather_nd_grad_forward,
      grad=lambda g: [g.op("GatherND", [g.dy, g.x[1]], batch_dims=g.node.attr("batch_dims")), None])


def _scatter_nd_infer(node, ins):
    data, idx, upd = ins
    k = idx.shape[-1]
    want = tuple(idx.shape[:-1]) + tuple(data.shape[k:]) if isinstance(k, int) and k <= len(data.shape) else None
    if want is None or tuple(upd.shape) != want:
        raise ShapeError(f"{node.label}: updates {tuple(upd.shape)} do not fit indices {tuple(idx.shape)} "
                         f"into data {tuple(data.shape)} (expected {want})")
    _reduction(node)
    return [TensorInfo(data.dtype, tuple(data.shape))]


def _scatter_nd_forward(node, ins):
    data, idx, upd = ins
    k = idx.shape[-1]
    upd = upd.reshape((-1,) + data.shape[k:]).astype(data.dtype)
    return _scatter_into(data.copy(), _nd_where(idx, data.shape), upd, _reduction(node))


def _scatter_nd_mul_grad_forward(node, ins):
    """d updates of a multiplying ScatterND: dy * data * (the other updates at the same place)."""
    dy, data, idx, upd = ins
    k = idx.shape[-1]
    where = _nd_where(idx, data.shape)
    u = upd.reshape((-1,) + data.shape[k:])
    base = (dy * data)[where]
    linear = np.ravel_multi_index(where, data.shape[:k]) if k else np.zeros(len(u), np.int64)
    out = np.empty_like(u)
    for j in range(len(u)):  # product over the other updates that land on the same slice
        others = (linear == linear[j])
        others[j] = False
        out[j] = base[j] * np.prod(u[others], axis=0)
    return out.reshape(upd.shape)


def _scatter_nd_grad(g: GradContext):
    red = _reduction(g.node)
    data, idx, upd = g.x
    if red not in ("none", "add", "mul"):
        _no_scatter_grad(g, red)
    ddata = dupd = None
    if g.need(0):
        ddata = {"add": lambda: g.dy,
                 "none": lambda: g.op("ScatterND", [g.dy, idx, _zeros_like(g, upd)]),
                 "mul": lambda: g.op("ScatterND", [g.dy, idx, upd], reduction="mul")}[red]()
    if g.need(2):
        dupd = (g.op("ScatterNDMulGrad", [g.dy, data, idx, upd]) if red == "mul"
                else g.op("GatherND", [g.dy, idx]))
    return [ddata, None, dupd]


defop("ScatterND", infer=_scatter_nd_infer, forward=_scatter_nd_forward, grad=_scatter_nd_grad, nondiff=[1])
# Inputs: dy, data, indices, updates -> d updates.
defop("ScatterNDMulGrad", internal=True, nondiff=[1, 2, 3], forward=_scatter_nd_mul_grad_forward,
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, tuple(ins[3].shape))])


# -- TopK ------------------------------------------------------------------------------------
def _topk_k(node: Node, ins: list) -> int:
    k = node.attr("k") if len(ins) < 2 or ins[1] is None else ints_of(ins[1], "K", node)[0]
    if k is None or k < 0:
        raise ShapeError(f"{node.label}: K must be a non-negative constant, got {k}")
    return int(k)


def _topk_infer(node, ins):
    shape = list(ins[0].shape)
    axis = _axis(node, len(shape), -1)
    k = _topk_k(node, ins)
    if isinstance(shape[axis], int) and k > shape[axis]:
        raise ShapeError(f"{node.label}: K={k} is larger than axis {axis} of size {shape[axis]}")
    shape[axis] = k
    return [TensorInfo(ins[0].dtype, tuple(shape)), TensorInfo(np.dtype(np.int64), tuple(shape))]


def _topk_forward(node, ins):
    x = ins[0]
    axis = _axis(node, x.ndim, -1)
    # Stable sorts, so that among equal values the lower index comes first, as ONNX asks. Largest:
    # sort the reversed axis ascending and read it backwards (negating would wrap unsigned ints).
    if node.attr("largest", 1):
        n = x.shape[axis]
        order = n - 1 - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
    idx = np.take(order, np.arange(_topk_k(node, ins)), axis=axis)
    return np.take_along_axis(x, idx, axis=axis), idx.astype(np.int64)


def _topk_grad(g: GradContext):
    shape = g.shape(g.x[0])
    indices = g.y[1] if g.node.outputs[1:] and g.y[1] else g.ops("TopK", g.x, 2, **g.node.attrs)[1]
    dx = g.op("GatherElementsGrad", [g.dy, indices], axis=_axis(g.node, len(shape), -1), shape=list(shape))
    return [dx] + [None] * (len(g.x) - 1)


defop("TopK", infer=_topk_infer, forward=_topk_forward, grad=_topk_grad, nondiff=[1])


# -- OneHot ----------------------------------------------------------------------------------
def _onehot_depth(node: Node, depth) -> int:
    return int(ints_of(depth, "depth", node)[0]) if isinstance(depth, TensorInfo) \
        else int(np.asarray(depth).reshape(-1)[0])


def _onehot_shape(node: Node, shape: tuple, depth: int) -> tuple:
    axis = norm_axis(int(node.attr("axis", -1)), len(shape) + 1)
    if not 0 <= axis <= len(shape):
        raise ShapeError(f"{node.label}: axis {node.attr('axis', -1)} is out of range for rank {len(shape) + 1}")
    return tuple(shape[:axis]) + (depth,) + tuple(shape[axis:])


def _onehot_infer(node, ins):
    idx, depth, values = ins
    if depth.const is None:
        raise ShapeError(f"{node.label}: depth must be a constant (known when the model is compiled)")
    return [TensorInfo(values.dtype, _onehot_shape(node, tuple(idx.shape), _onehot_depth(node, depth)))]


def _onehot_forward(node, ins):
    idx, depth, values = ins
    depth = _onehot_depth(node, depth)
    idx = np.asarray(idx).astype(np.int64)
    idx = np.where(idx < 0, idx + depth, idx)  # out of range stays all "off"
    hot = idx[..., None] == np.arange(depth)
    axis = norm_axis(int(node.attr("axis", -1)), idx.ndim + 1)
    off, on = np.asarray(values).reshape(-1)[:2]
    return np.where(np.moveaxis(hot, -1, axis), on, off).astype(values.dtype)


def _onehot_grad(g: GradContext):
    """values = [off, on]: d on = sum(dy where hot), d off = sum(dy) - d on."""
    idx, depth, values = g.x
    dtype = g.dtype(values)
    mask = g.op("OneHot", [idx, depth, g.const(np.array([0, 1]), dtype, "onoff")], axis=g.node.attr("axis", -1))
    d_on = g.op("ReduceSum", [g.op("Mul", [g.dy, mask])], keepdims=0)
    d_off = g.op("Sub", [g.op("ReduceSum", [g.dy], keepdims=0), d_on])
    return [None, None, g.op("Concat", [g.reshape(d_off, (1,)), g.reshape(d_on, (1,))], axis=0)]


defop("OneHot", infer=_onehot_infer, forward=_onehot_forward, grad=_onehot_grad, nondiff=[0, 1])


# -- CumSum ----------------------------------------------------------------------------------
def _cumsum_axis(node: Node, axis_in, rank: int) -> int:
    axis = norm_axis(ints_of(axis_in, "axis", node)[0], rank)
    if not 0 <= axis < rank:
        raise ShapeError(f"{node.label}: axis {axis} is out of range for rank {rank}")
    return axis


def _cumsum_forward(node, ins):
    x = ins[0]
    axis = _cumsum_axis(node, ins[1], x.ndim)
    reverse = bool(node.attr("reverse", 0))
    y = np.flip(x, axis) if reverse else x
    c = np.cumsum(y, axis=axis, dtype=x.dtype)
    if node.attr("exclusive", 0):  # shift by one: element i sums elements before i
        c = np.concatenate([np.zeros_like(np.take(c, [0], axis=axis)),
                            np.take(c, np.arange(x.shape[axis] - 1), axis=axis)], axis=axis)
    return np.ascontiguousarray(np.flip(c, axis) if reverse else c)


def _cumsum_infer(node, ins):
    _cumsum_axis(node, ins[1], ins[0].rank)
    return same_as_first(node, ins)


# The transpose of a running sum is the running sum in the other direction.
defop("CumSum", infer=_cumsum_infer, forward=_cumsum_forward, nondiff=[1],
      grad=lambda g: [g.op("CumSum", [g.dy, g.x[1]], exclusive=int(g.node.attr("exclusive", 0)),
                           reverse=1 - int(g.node.attr("reverse", 0))), None])


# -- Trilu -----------------------------------------------------------------------------------
def _trilu_forward(node, ins):
    x = ins[0]
    k = ints_of(slot(ins, 1), "k", node)
    k = k[0] if k else 0
    return np.triu(x, k) if node.attr("upper", 1) else np.tril(x, k)


def _trilu_infer(node, ins):
    if ins[0].rank < 2:
        raise ShapeError(f"{node.label}: input must have rank >= 2, got {tuple(ins[0].shape)}")
    ints_of(slot(ins, 1), "k", node)
    return same_as_first(node, ins)


defop("Trilu", infer=_trilu_infer, forward=_trilu_forward, nondiff=[1],
      grad=lambda g: [g.op("Trilu", [g.dy] + g.x[1:], upper=int(g.node.attr("upper", 1)))] + [None] * (len(g.x) - 1))


# -- Einsum ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EinsumSpec:
    """An equation with the ellipsis spelled out in letters and the output made explicit."""

    inputs: tuple[str, ...]
    output: str
    sizes: dict  # letter -> size (the largest, where an ellipsis dim broadcasts from 1)

    @property
    def equation(self) -> str:
        return ",".join(self.inputs) + "->" + self.output

    def unused_letters(self) -> list[str]:
        used = set("".join(self.inputs) + self.output)
        return [c for c in string.ascii_letters if c not in used]


def parse_einsum(node: Node, shapes: list[tuple]) -> EinsumSpec:
    eq = _str(node, "equation", "").replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ShapeError(f"{node.label}: equation '{eq}' has {len(terms)} operands, the node {len(shapes)} inputs")
    if any(not c.isalpha() for c in (lhs + rhs).replace("...", "").replace(",", "")):
        raise ShapeError(f"{node.label}: equation '{eq}' may hold only letters, ',', '...' and '->'")
    ell_ranks = [len(s) - len(t.replace("...", "")) for t, s in zip(terms, shapes) if "..." in t]
    free = [c for c in string.ascii_letters if c not in eq]
    ell = "".join(free[:max(ell_ranks, default=0)])
    inputs = []
    for t, s in zip(terms, shapes):
        n = len(s) - len(t.replace("...", ""))
        if n < 0 or (n and "..." not in t):
            raise ShapeError(f"{node.label}: operand '{t}' of equation '{eq}' does not fit shape {tuple(s)}")
        inputs.append(t.replace("...", ell[len(ell) - n:]))
    if arrow:
        output = rhs.replace("...", ell)
    else:  # implicit: the letters used once, in alphabetical order, after the ellipsis dims
        named = "".join(t.replace("...", "") for t in terms)
        output = ell + "".join(sorted(c for c in set(named) if named.count(c) == 1))
    sizes: dict[str, int] = {}
    for t, s in zip(inputs, shapes):
        for c, d in zip(t, s):
            known = sizes.get(c, 1)
            if known != 1 and d != 1 and known != d and isinstance(known, int) and isinstance(d, int):
                raise ShapeError(f"{node.label}: letter '{c}' of equation '{eq}' has sizes {known} and {d}")
            sizes[c] = d if known == 1 or not isinstance(d, int) else known  # symbolic (the batch) wins
    if len(set(output)) != len(output) or any(c not in sizes for c in output):
        raise ShapeError(f"{node.label}: output '{rhs}' of equation '{eq}' repeats a letter or uses one "
                         "no operand has")
    return EinsumSpec(tuple(inputs), output, sizes)


def _einsum_infer(node, ins):
    spec = parse_einsum(node, [tuple(i.shape) for i in ins])
    return [TensorInfo(ins[0].dtype, tuple(spec.sizes[c] for c in spec.output))]


def _einsum_forward(node, ins):
    spec = parse_einsum(node, [i.shape for i in ins])
    return np.asarray(np.einsum(spec.equation, *ins, optimize=len(ins) > 2)).astype(ins[0].dtype, copy=False)


def _einsum_operand_grad(g: GradContext, spec: EinsumSpec, shapes: list[tuple], i: int) -> str:
    """d operand i = an Einsum of dy with the other operands, written to operand i's letters.

    Three things the plain swap of subscripts cannot express get one extra operand each: a letter
    repeated in operand i (a diagonal) gets an identity matrix to a fresh letter, a letter that only
    operand i has (summed there) gets a vector of ones, and dims where operand i broadcasts from 1
    are left out and restored by a Reshape (which sums them, as broadcasting's gradient must).
    """
    fresh = iter(spec.unused_letters())

    def new_letter() -> str:
        try:
            return next(fresh)
        except StopIteration:
            raise AnygradError(f"{g.node.label}: equation '{spec.equation}' uses too many letters to build "
                               "its gradient (52 at most)") from None

    def broadcast(j: int, pos: int) -> bool:
        return shapes[j][pos] == 1 and spec.sizes[spec.inputs[j][pos]] > 1

    dtype = g.dtype(g.dy)
    terms, operands = [spec.output], [g.dy]
    for j, term in enumerate(spec.inputs):
        if j != i:
            terms.append("".join(new_letter() if broadcast(j, p) else c for p, c in enumerate(term)))
            operands.append(g.x[j])
    target, seen = [], set()
    for p, c in enumerate(spec.inputs[i]):
        if broadcast(i, p):
            continue
        if c in seen:
            f = new_letter()
            terms.append(c + f)
            operands.append(g.const(np.eye(spec.sizes[c]), dtype, "eye"))
            c = f
        seen.add(c)
        target.append(c)
    available = set("".join(terms))
    for c in target:
        if c not in available:
            terms.append(c)
            operands.append(g.const(np.ones(spec.sizes[c]), dtype, "ones"))
    grad = g.op("Einsum", operands, equation=",".join(terms) + "->" + "".join(target))
    return g.reshape(grad, shapes[i])


def _einsum_grad(g: GradContext):
    shapes = [g.shape(x) for x in g.x]
    spec = parse_einsum(g.node, shapes)
    return [_einsum_operand_grad(g, spec, shapes, i) if g.need(i) else None for i in range(len(g.x))]


defop("Einsum", infer=_einsum_infer, forward=_einsum_forward, grad=_einsum_grad)


# -- DepthToSpace / SpaceToDepth ---------------------------------------------------------------
@dataclass(frozen=True)
class Rearrange:
    """A pure permutation of elements: reshape to `split`, transpose by `perm`, reshape to `out`."""

    split: tuple
    perm: tuple
    out: tuple


def rearrange(op: str, shape: tuple, blocksize: int, mode: str) -> Rearrange:
    """DepthToSpace / SpaceToDepth of an input of `shape` as reshape -> transpose -> reshape, from
    explicit attributes (mode DCR/CRD; SpaceToDepth's mode from opset 25)."""
    bs = int(blocksize)
    if bs < 1 or len(shape) != 4:
        raise ShapeError(f"{op}: needs a 4-D input (N, C, H, W) and blocksize >= 1, "
                         f"got shape {tuple(shape)} and blocksize {bs}")
    n, c, h, w = shape
    if op == "DepthToSpace":
        if c % (bs * bs):
            raise ShapeError(f"{op}: channels {c} are not divisible by blocksize^2 = {bs * bs}")
        out = (n, c // (bs * bs), h * bs, w * bs)
        if mode == "CRD":
            return Rearrange((n, c // (bs * bs), bs, bs, h, w), (0, 1, 4, 2, 5, 3), out)
        return Rearrange((n, bs, bs, c // (bs * bs), h, w), (0, 3, 4, 1, 5, 2), out)
    if h % bs or w % bs:
        raise ShapeError(f"{op}: spatial dims {h}x{w} are not divisible by blocksize {bs}")
    perm = (0, 1, 3, 5, 2, 4) if mode == "CRD" else (0, 3, 5, 1, 2, 4)
    return Rearrange((n, c, h // bs, bs, w // bs, bs), perm, (n, c * bs * bs, h // bs, w // bs))


def _rearrange_plan(node: Node, shape: tuple) -> Rearrange:
    try:
        return rearrange(node.op, tuple(shape), int(node.attr("blocksize", 0)), _str(node, "mode", "DCR"))
    except ShapeError as e:
        raise ShapeError(f"{node.label}: {str(e).split(': ', 1)[1]}") from None


def _rearrange_grad(plan):
    def rule(g: GradContext):
        r = plan(g.node, g.shape(g.x[0]))
        moved = g.reshape(g.dy, tuple(r.split[p] for p in r.perm))
        back = g.op("Transpose", [moved], perm=[int(p) for p in np.argsort(r.perm)])
        return [g.reshape(back, g.shape(g.x[0]))]
    return rule


for _name, _plan in [("DepthToSpace", _rearrange_plan), ("SpaceToDepth", _rearrange_plan)]:
    defop(_name, grad=_rearrange_grad(_plan),
          infer=lambda node, ins, p=_plan: [TensorInfo(ins[0].dtype, p(node, tuple(ins[0].shape)).out)],
          forward=lambda node, ins, p=_plan: np.ascontiguousarray(
              np.transpose(ins[0].reshape(p(node, ins[0].shape).split), p(node, ins[0].shape).perm)
          ).reshape(p(node, ins[0].shape).out))


# -- Resize / Upsample ---------------------------------------------------------------------------
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


# -- Mod, IsNaN, IsInf ---------------------------------------------------------------------------
def _mod_forward(node, ins):
    a, b = ins
    fn = np.fmod if node.attr("fmod", 0) else np.mod  # fmod: sign of a; mod: sign of b
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(fn(a, b)).astype(a.dtype)


def _mod_grad(g: GradContext):
    """a - q*b with q = trunc(a/b) (fmod) or floor(a/b) (mod); q = (a - y) / b either way."""
    a, b = g.x
    da = g.unbroadcast(g.dy, g.shape(a)) if g.need(0) else None
    db = None
    if g.need(1):
        q = g.op("Div", [g.op("Sub", [a, g.y[0]]), b])
        db = g.unbroadcast(g.op("Neg", [g.op("Mul", [g.dy, q])]), g.shape(b))
    return [da, db]


def _bool_like(node, ins):
    return [TensorInfo(np.dtype(np.bool_), tuple(ins[0].shape))]


def _isinf(node, ins):
    x = ins[0]
    return (np.isposinf(x) & bool(node.attr("detect_positive", 1))) | (np.isneginf(x) & bool(node.attr("detect_negative", 1)))


defop("Mod", infer=broadcast_infer, forward=_mod_forward, grad=_mod_grad)
defop("IsNaN", infer=_bool_like, nondiff=[0], forward=lambda node, ins: np.isnan(ins[0]))
defop("IsInf", infer=_bool_like, nondiff=[0], forward=_isinf)

