"""Ops that address elements by position within a tensor: TopK, OneHot, CumSum, Trilu, Einsum,
DepthToSpace/SpaceToDepth, and the predicates Mod, IsNaN, IsInf. Gathers and scatters by index
tensors are in gather_scatter.py (TopK's gradient is its GatherElementsGrad), Resize/Upsample
in resize.py.

Einsum's gradient is again an Einsum, with the equation rearranged; DepthToSpace/SpaceToDepth are
a reshape, a transpose and a reshape, so their gradient is the inverse permutation.
"""
from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np

from ..errors import AnygradError, ShapeError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._index_util import _axis, _str
from ._util import broadcast_infer, ints_of, norm_axis, same_as_first, slot


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
