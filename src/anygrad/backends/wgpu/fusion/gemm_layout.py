"""GEMM layouts: data movement around a MatMul or Gemm folded into its loads and stores.

Rewrites of a graph about to be lowered (fusion.prepare runs them, fold_concats last) that
replace copy kernels by the operand and result layouts the GEMM kernels take
(kernels_gemm.lower_matmul):

- Transposes feeding or read from a GEMM: transA/transB, `_permA`/`_permB`/`_permY`
  (fold_transposes), after the exporters' 3-D K^T is made one Transpose (canonical_transposes);
- reshapes, transposes, slices and one-index gathers read only by MatMuls: a strided view of
  their input, `_viewA`/`_viewB` (fold_views);
- a Concat of MatMul results: each stored at its place in the Concat's output, `_intoY`
  (fold_concats);
- a constant scale next to a MatMul: its alpha, `_alpha` (fold_scales).
"""
from __future__ import annotations

import numpy as np

from .... import settings
from ....ir.graph import Graph, Node
from ..kernels.kernel import AdapterCaps
from ..kernels.kernels_elementwise import literal_value
from ..kernels.wgsl import shape_of
from ..kernels.wgsl import strides as _strides
from .views import (
    ALIAS_LIKE,
    VIEW_OPS,
    drop_unread,
    operand_view,
    perm_of,
    reshaped_strides,
    stored_view,
    too_big_to_bind,
)

GEMM_OPS = frozenset({"MatMul", "Gemm"})
_TRANS = {"Gemm": ("transA", "transB"), "MatMul": ("_permA", "_permB")}


def _swap(rank: int) -> list[int]:
    return list(range(rank - 2)) + [rank - 1, rank - 2]


def _swaps_last_two(graph: Graph, node: Node) -> bool:
    """A Transpose exchanging the last two axes and keeping the others (x.T, K^T, W.T)."""
    rank = len(shape_of(graph, node.inputs[0]))
    return rank >= 2 and perm_of(graph, node) == _swap(rank)


def _then(first: list[int] | None, second: list[int]) -> list[int]:
    """The perm of transpose(transpose(x, first), second)."""
    return list(second) if first is None else [int(first[i]) for i in second]


def scale_fold_enabled() -> bool:
    """ANYGRAD_WGPU_SCALE_FOLD=0: constant scales next to MatMuls stay multiplications and the
    exporters' 3-D K^T stays Reshape, Transpose, Reshape (fold_scales, canonical_transposes)."""
    return settings.get("ANYGRAD_WGPU_SCALE_FOLD")


def slice_views_enabled() -> bool:
    """ANYGRAD_WGPU_SLICE_VIEWS=0: slices, transposes and gathers read by MatMuls stay copy
    kernels where fold_transposes leaves them (fold_views, fold_result_layouts), as do those
    next to fused elementwise kernels (elementwise.fold_elementwise_views), and a Concat of MatMul
    results too (fold_concats)."""
    return settings.get("ANYGRAD_WGPU_SLICE_VIEWS")


def has_bias(node: Node) -> bool:
    return bool(node.input(2))


def _is_matrix(graph: Graph, v: str) -> bool:
    shape = shape_of(graph, v)
    return len(shape) >= 2 and int(np.prod(shape[:-2], dtype=np.int64)) == 1


def _matrix_alias(graph: Graph, n: Node | None) -> bool:
    """A Reshape-like node between two single matrices of one shape (leading 1s added or dropped),
    which the gradient rules leave between a GEMM and a Transpose."""
    return (n is not None and n.op in ALIAS_LIKE and bool(n.inputs) and _is_matrix(graph, n.inputs[0])
            and _is_matrix(graph, n.outputs[0])
            and shape_of(graph, n.inputs[0])[-2:] == shape_of(graph, n.outputs[0])[-2:])


def _same_shape_alias(graph: Graph, n: Node | None) -> bool:
    return (n is not None and n.op in ALIAS_LIKE and bool(n.inputs)
            and shape_of(graph, n.inputs[0]) == shape_of(graph, n.outputs[0]))


def _swapped_operands(graph: Graph, p: Node) -> None:
    """Rewrite GEMM p to compute its result transposed: (A B)^T = B^T A^T."""
    ka, kb = _TRANS[p.op]
    a, b = p.inputs[0], p.inputs[1]
    if p.op == "Gemm":
        ta, tb = p.attr(ka, 0), p.attr(kb, 0)
        p.attrs[ka], p.attrs[kb] = 1 - tb, 1 - ta
    else:
        pa, pb = p.attr(ka), p.attr(kb)
        ra, rb = len(shape_of(graph, a)), len(shape_of(graph, b))
        p.attrs[ka], p.attrs[kb] = _then(pb, _swap(rb)), _then(pa, _swap(ra))
    p.inputs[0], p.inputs[1] = b, a


def _read_through(graph: Graph, n: Node, slot: int, producers: dict) -> bool:
    """Make GEMM n read the Transpose feeding its operand `slot` (maybe through matrix reshapes)
    from the Transpose's input instead. False when there is none to fold."""
    key = _TRANS[n.op][slot]
    v = n.inputs[slot]
    via_alias = False
    while True:
        p = producers.get(v)
        if p is not None and p.op == "Identity":   # an alias of any shape
            v = p.inputs[0]
        elif _is_matrix(graph, v) and _matrix_alias(graph, p):
            v, via_alias = p.inputs[0], True
        else:
            break
    t = producers.get(v)
    if t is None or t.op != "Transpose" or len(shape_of(graph, t.inputs[0])) < 2:
        return False
    rank = len(shape_of(graph, t.inputs[0]))
    if n.op == "Gemm" or via_alias:
        # a 2-D operand (Gemm) or a matrix seen through reshapes: only a swap, which toggles
        cur = n.attr(key)
        cur_rank = len(shape_of(graph, n.inputs[slot]))
        swapped = bool(cur) if n.op == "Gemm" else cur is not None and list(cur) == _swap(cur_rank)
        if not _swaps_last_two(graph, t) or (n.op == "MatMul" and cur is not None and not swapped):
            return False
        if n.op == "Gemm":
            n.attrs[key] = 1 - n.attr(key, 0)
        else:
            n.attrs[key] = None if swapped else _swap(rank)
    else:
        n.attrs[key] = _then(perm_of(graph, t), n.attr(key) or list(range(rank)))
    n.inputs[slot] = t.inputs[0]
    return True


_SCALED = (np.dtype(np.float32), np.dtype(np.float16))


def _scale_of(graph: Graph, n: Node) -> tuple[str, float] | None:
    """(x, s) when n multiplies a float32 or float16 tensor x by a one-element float constant s.
    A float16 x is then scaled in the MatMul's f32 accumulator, not rounded to f16 first."""
    if n.op != "Mul" or len(n.inputs) != 2:
        return None
    for slot in (0, 1):
        x, c = n.inputs[slot], n.inputs[1 - slot]
        value = literal_value(graph, c, set(graph.state_names))
        if (value is not None and np.issubdtype(value.dtype, np.floating) and x in graph.info
                and np.dtype(graph.info[x].dtype) in _SCALED and shape_of(graph, x) == shape_of(graph, n.outputs[0])):
            return x, float(value.reshape(()))
    return None


def fold_scales(graph: Graph, protected: set[str]) -> None:
    """Multiplications by a constant next to a MatMul become its alpha (attr `_alpha`, applied
    before any bias): a scaled operand that only MatMuls read (scaled dot-product attention as
    the exporters write it, q * s^0.5 and k^T * s^0.5, and the backward's reads of them), and a
    result only the multiplication reads (the backward's ds * s^0.5). Each is an elementwise
    kernel fewer, and the Transposes around it can then fold into the MatMul's loads."""
    users = graph.consumers()
    producers = graph.producers()
    drop = set()
    for n in graph.nodes:
        found = _scale_of(graph, n)
        if found is None or n.outputs[0] in protected:
            continue
        x, scale = found
        y = n.outputs[0]
        readers = users.get(y, [])
        p = producers.get(x)
        if readers and all(u.op == "MatMul" and k in (0, 1) for u, k in readers):
            for u, k in readers:
                u.inputs[k] = x
                u.attrs["_alpha"] = float(u.attr("_alpha", 1.0)) * scale
            users.setdefault(x, []).extend(users.pop(y))
            drop.add(id(n))
        elif (p is not None and p.op == "MatMul" and len(users.get(x, [])) == 1 and x not in protected
              and not p.input(2) and p.attr("_epilogue") is None):
            p.attrs["_alpha"] = float(p.attr("_alpha", 1.0)) * scale
            p.outputs[0] = y
            producers[y] = p
            drop.add(id(n))
    graph.nodes = [n for n in graph.nodes if id(n) not in drop]


def canonical_transposes(graph: Graph, protected: set[str]) -> None:
    """Reshape -> swap of the last two axes -> Reshape, where the reshapes only merge the
    leading axes and split them back (the exporters' K^T of a 4-D attention tensor, done in 3-D),
    becomes one Transpose of the 4-D tensor, which fold_transposes can then fold."""
    users = graph.consumers()
    producers = graph.producers()
    drop = set()
    for t in graph.nodes:
        if t.op != "Transpose" or not _swaps_last_two(graph, t):
            continue
        r1 = producers.get(t.inputs[0])
        after = users.get(t.outputs[0], [])
        if r1 is None or r1.op not in ALIAS_LIKE or len(after) != 1 or after[0][0].op not in ALIAS_LIKE:
            continue
        r2 = after[0][0]
        x = r1.inputs[0]
        sx, mid, sy = shape_of(graph, x), shape_of(graph, r1.outputs[0]), shape_of(graph, r2.outputs[0])
        if (len(sx) < 2 or sx[-2:] != mid[-2:] or sy != sx[:-2] + (sx[-1], sx[-2])
                or len(users.get(r1.outputs[0], [])) != 1
                or any(v in protected for v in (r1.outputs[0], t.outputs[0]))):
            continue
        swap = Node("Transpose", [x], [r2.outputs[0]], {"perm": _swap(len(sx))}, name=t.name)
        graph.nodes[graph.nodes.index(r2)] = swap
        drop |= {id(r1), id(t)}
    graph.nodes = [n for n in graph.nodes if id(n) not in drop]


def fold_transposes(graph: Graph, protected: set[str]) -> None:
    """Transposes around GEMMs become operand and result layouts, not kernels.

    - A transposed GEMM result: for a swap of the last two axes, (A B)^T = B^T A^T, the GEMM with
      its operands swapped and transposed (the weight gradient of `x @ W.T`, through the gradient
      of the Transpose); any other perm of a MatMul result becomes its stored layout (`_permY`,
      attention's head merge).
    - A transposed operand is read through the Transpose by the GEMM's loads: Gemm's own
      transA/transB for a 2-D swap, MatMul's `_permA`/`_permB` for any perm (x @ W.T,
      attention's K^T and head split, the gradients' dy @ W^T).
    Reshapes that only add or drop leading 1s between a single matrix and the GEMM are looked
    through. A Transpose nothing else reads is then dropped."""
    users = graph.consumers()
    producers = graph.producers()
    drop = set()
    for n in graph.nodes:
        if n.op != "Transpose":
            continue
        chain, renames, v = [], [], n.inputs[0]
        while len(users.get(v, [])) == 1 and v not in protected:
            a = producers.get(v)
            if _same_shape_alias(graph, a):   # a reshape to its own shape: a name, not a view
                renames.append(a)
            elif _matrix_alias(graph, a):
                chain.append(a)
            else:
                break
            v = a.inputs[0]
        p = producers.get(v)
        if (p is None or p.op not in GEMM_OPS or has_bias(p) or v in protected or len(users.get(v, [])) != 1
                or any(len(shape_of(graph, x)) < 2 for x in p.inputs[:2]) or p.attr("_permY") is not None):
            continue
        if _swaps_last_two(graph, n) and (not chain or _is_matrix(graph, n.inputs[0])):
            _swapped_operands(graph, p)
        elif p.op == "MatMul" and not chain:
            p.attrs["_permY"] = perm_of(graph, n)
        else:
            continue
        p.outputs[0] = n.outputs[0]
        producers[n.outputs[0]] = p   # a Transpose of this one may fold next
        drop |= {id(n)} | {id(c) for c in chain + renames}
    graph.nodes = [n for n in graph.nodes if id(n) not in drop]
    producers = graph.producers()
    for n in graph.nodes:
        if n.op in GEMM_OPS:
            for slot in (0, 1):
                while _read_through(graph, n, slot, producers):  # K^T^T folds twice (dq = ds @ K)
                    pass
    drop_unread(graph, protected, "Transpose")


_VIEW_KEYS = ("_viewA", "_viewB")


def fold_views(graph: Graph, protected: set[str], caps: AdapterCaps) -> None:
    """Layout nodes (reshapes, transposes, slices, gathers of one index) that only MatMuls and
    Gemms read become a strided view in their operand loads: no copy kernel, nothing stored. It is
    attention's q, k, v cut from one qkv projection: Slices in GPT-style models (3 copies a layer,
    read again by the backward pass: the d-256 GPT's 12 Slice kernels took 0.2 ms of a 15 ms step
    on an H100), and nn.MultiheadAttention's unflatten, transpose, gathers and head split as
    dynamo exports it (torchvision's ViT: 7 Transpose and Gather kernels a layer's forward). A
    GEMM reads the view through attrs `_viewA` / `_viewB`: (shape, strides, offset) of its
    operand within the base (kernels_gemm.lower_matmul, _gemm_operand), still through its
    `_permA`/`_permB` (a Gemm's transA / transB).
    The base must fit one binding (bindsplit does not split views)."""
    producers = graph.producers()
    users = graph.consumers()

    def readable(x: Node) -> bool:  # read only by layout nodes and GEMM operands: it can go
        return x.outputs[0] not in protected and all(
            u.op in VIEW_OPS or (u.op in GEMM_OPS and k in (0, 1)) for u, k in users.get(x.outputs[0], []))
    folded = False
    for n in graph.nodes:
        if n.op not in GEMM_OPS:
            continue
        for slot in (0, 1):
            if n.attr(_VIEW_KEYS[slot]) is not None:
                continue
            found = operand_view(graph, n.inputs[slot], producers, readable)
            if found is None or too_big_to_bind(graph, found[0], caps):
                continue
            base, view, _ = found
            n.inputs[slot] = base
            n.attrs[_VIEW_KEYS[slot]] = view
            folded = True
    if folded:
        drop_unread(graph, protected, VIEW_OPS)


_STORED_AT_INDEX = ("_permY", "_intoY", "_residual", "_epilogue_arg", "_where")  # epilogues read at the result's index


def fold_result_layouts(graph: Graph, protected: set[str]) -> None:
    """A MatMul result that reaches its one reader only through reshapes and transposes is
    stored in the layout that reader reads (`_intoY`: the result as a strided view of the final
    value): no Transpose kernel. It is nn.MultiheadAttention's backward as dynamo exports it,
    dq, dk and dv each MatMul -> Reshape -> Transpose(1, 0, 2) -> Reshape -> GatherGrad
    (torchvision's ViT: 3 Transpose kernels a layer). A Transpose right after the MatMul is
    fold_transposes' `_permY` already; here the reshapes around it are seen through too."""
    users = graph.consumers()
    drop: set[int] = set()
    for n in graph.nodes:
        if n.op != "MatMul" or any(n.attr(a) for a in _STORED_AT_INDEX):
            continue
        found = stored_view(graph, n.outputs[0], users, protected)
        if found is None:
            continue
        n.attrs["_intoY"], chain = found
        n.outputs[0] = chain[-1].outputs[0]
        drop |= {id(c) for c in chain}
    graph.nodes = [n for n in graph.nodes if id(n) not in drop]


def _concat_part(graph: Graph, x: str, strides: tuple[int, ...], offset: int, users: dict, producers: dict,
                 protected: set[str]) -> tuple[Node, list[Node], tuple] | None:
    """(MatMul, reshapes in between, (shape, strides, offset) of its result) when Concat input
    x (at `strides` and `offset` in the Concat's output) is a MatMul's result, maybe reshaped,
    that nothing else reads and that can be stored at such strides."""
    chain, v, shape = [], x, shape_of(graph, x)
    st: tuple[int, ...] | None = strides
    while True:
        if v in protected or len(users.get(v, [])) != 1:
            return None
        p = producers.get(v)
        if p is None or p.op not in ALIAS_LIKE:
            break
        chain.append(p)
        v = p.inputs[0]
        st = reshaped_strides(shape, st, shape_of(graph, v))
        if st is None:
            return None
        shape = shape_of(graph, v)
    if (p is None or p.op != "MatMul" or p.attr("_residual") or p.attr("_epilogue_arg") or p.attr("_intoY") is not None
            or p.outputs[0] != v):
        return None
    return p, chain, (tuple(shape), st, offset)


def fold_concats(graph: Graph, protected: set[str], caps: AdapterCaps) -> None:
    """A Concat whose every input is a MatMul's result that nothing else reads (maybe reshaped)
    becomes those MatMuls storing their results straight into the Concat's output, each at its
    strided place (attr `_intoY`): no copy kernels, no separate results. It is the backward of
    attention's q, k, v split: dq, dk and dv assembled into the qkv projection's gradient (12 copy
    kernels, 0.2 ms of the d-256 GPT's 15 ms step on an H100). Runs last: the Concat's output
    then has several writers, which only the planner sees (kernel by kernel), not other passes."""
    users = graph.consumers()
    producers = graph.producers()
    drop: set[int] = set()
    for n in graph.nodes:
        if (n.op != "Concat" or not n.inputs or not all(n.inputs) or n.outputs[0] in protected
                or too_big_to_bind(graph, n.outputs[0], caps)):
            continue
        out_shape = shape_of(graph, n.outputs[0])
        axis = int(n.attrs.get("axis", 0)) % max(1, len(out_shape))
        out_st = tuple(_strides(out_shape))
        parts, at = [], 0
        for x in n.inputs:
            found = _concat_part(graph, x, out_st, at * out_st[axis], users, producers, protected)
            if found is None or graph.info[x].dtype != graph.info[n.outputs[0]].dtype:
                break
            parts.append(found)
            at += shape_of(graph, x)[axis]
        else:
            if len({id(p) for p, _, _ in parts}) != len(parts):
                continue   # one MatMul feeding two parts
            for p, chain, view in parts:
                p.attrs["_intoY"] = view
                p.outputs[0] = n.outputs[0]
                drop |= {id(c) for c in chain}
            drop.add(id(n))
    graph.nodes = [n for n in graph.nodes if id(n) not in drop]
