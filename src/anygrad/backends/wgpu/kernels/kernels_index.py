"""Ops that address elements by index or position (formulas: anygrad/ops/index.py and
ops/metrics.py): GatherElements, GatherND, ScatterElements, ScatterND and their gradients, TopK,
CountTopK, OneHot, CumSum/CumProd, Trilu, DepthToSpace/SpaceToDepth, and the elementwise Mod, IsNaN,
IsInf.

WGSL has no float atomics, so every scatter is a gather seen from the destination, combining
the matches in index order: repeated indices are deterministic (the last write wins for
reduction 'none', as in numpy). The gradients (GatherElementsGrad, GatherNDGrad) first sort the
index positions by destination on the GPU (segments.py), so each destination reads only its own
entries. The forward scatters loop over the indices that could land on each element, fine at the
sizes they see in models.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ....ir.graph import Graph, Node
from ....ir.passes import resolved
from ....ops.index import rearrange
from .kernel import AdapterCaps, Kernel, lowering
from .kernels_elementwise import Emit, Val, ew
from .kernels_shape import affine_copy
from .segments import sorted_segments
from .wgsl import bindings, flat_id, grid, literal, shader, shape_of, strides, vtype


def _kernel(name: str, n: int, body: str, reads: list[tuple[str, str, str]], writes: list[tuple[str, str, str]],
            helpers: str = "") -> Kernel:
    """One invocation per element i < n; reads/writes: (var, WGSL type, value)."""
    src = shader(bindings([(v, t) for v, t, _ in reads], [(v, t) for v, t, _ in writes]),
                 f"  {flat_id()}\n  if (i >= {n}u) {{ return; }}\n{body}", helpers=helpers)
    return Kernel(name, src, grid(n), tuple(x for _, _, x in reads), tuple(x for _, _, x in writes))


def _coords(var: str, shape, prefix: str = "c") -> str:
    """`let c0 = ...; let c1 = ...;` the coordinates of flat index var over shape."""
    st = strides(shape)
    return " ".join(f"let {prefix}{d} = ({var} / {s}u) % {e}u;" for d, (e, s) in enumerate(zip(shape, st)))


def _dot(coords: list[str], shape) -> str:
    """Flat row-major offset of the coordinate expressions in a tensor of `shape`."""
    st = strides(shape)
    terms = [f"({c}) * {s}u" for c, s, e in zip(coords, st, shape) if e != 1]
    return " + ".join(terms) or "0u"


def _index(ity: str, expr: str, dim: int) -> str:
    """An index value as i32, counted from the back when negative (float indices truncate)."""
    v = f"i32(trunc({expr}))" if ity == "f32" else f"i32({expr})"
    return f"select({v}, {v} + {dim}, {v} < 0)"


def _axis(node: Node) -> int:
    return int(resolved(node, "axis"))


# -- GatherElements / its gradient / ScatterElements ------------------------------------------
@lowering("GatherElements")
def lower_gather_elements(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    data, idx = node.inputs[:2]
    ds, ishape = shape_of(graph, data), shape_of(graph, idx)
    axis = _axis(node)
    coords = [f"c{d}" for d in range(len(ds))]
    coords[axis] = "u32(k)"
    body = f"""  {_coords('i', ishape)}
  let k = {_index(vtype(graph, idx), 'ix[i]', ds[axis])};
  y[i] = x[{_dot(coords, ds)}];"""
    ty = vtype(graph, data)
    return [_kernel("GatherElements", math.prod(ishape), body, [("x", ty, data), ("ix", vtype(graph, idx), idx)],
                    [("y", ty, node.outputs[0])])]


def _element_key(ds, ishape, axis: int, ity: str) -> str:
    """seg_key(j): the flat data element index element j addresses (its own coordinates off
    `axis`, its index value on it), or the element count when the index is out of range."""
    coords = [f"c{d}" for d in range(len(ds))]
    coords[axis] = "u32(k)"
    return f"""fn seg_key(j: u32) -> u32 {{
  {_coords('j', ishape)}
  let k = {_index(ity, 'ix[j]', ds[axis])};
  if (k < 0 || k >= {ds[axis]}) {{ return {math.prod(ds)}u; }}
  return {_dot(coords, ds)};
}}"""


@lowering("GatherElementsGrad")
def lower_gather_elements_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """Index elements sorted by the dx element they address (segments.py), then each dx element
    sums its own dy entries in index order: O(|idx| + |dx|) work."""
    dy, idx = node.inputs[:2]
    ds = tuple(int(d) for d in node.attr("shape"))
    ishape = shape_of(graph, idx)
    axis = _axis(node)
    ity = vtype(graph, idx)
    return _segment_scatter("GatherElementsGrad", math.prod(ishape), math.prod(ds), 1,
                            _element_key(ds, ishape, axis, ity), idx, ity, [("dy", "f32", dy)], "0.0",
                            "v = v + dy[j];", ("dx", "f32", node.outputs[0]))


def _segment_scatter(name: str, q: int, n_keys: int, inner: int, key_fn: str, idx: str, ity: str,
                     reads: list[tuple[str, str, str]], init: str, combine: str,
                     out: tuple[str, str, str]) -> list[Kernel]:
    """out[r * inner + w] = `init` combined (`combine`: updates `v` from position `j` and `w`) with
    every position j whose seg_key is r, in increasing j: a scatter seen from its destination,
    each destination visiting only its own positions (segments.py sorts them on the GPU)."""
    seg = sorted_segments(name, q, n_keys, key_fn, [("ix", ity, idx)])
    body = f"""  let r = i / {inner}u;
  let w = i % {inner}u;
  var v = {init};
  for (var s = starts[r]; s < starts[r + 1u]; s += 1u) {{ let j = order[s]; {combine} }}
  {out[0]}[i] = v;"""
    k = _kernel(f"{name}:seg", n_keys * inner, body,
                reads + [("order", "u32", seg.order), ("starts", "u32", seg.starts)], [out])
    return seg.kernels + [replace(k, scratch=seg.scratch)]


def _reduction(node: Node) -> str:
    r = node.attr("reduction", "none")
    return r.decode() if isinstance(r, bytes) else str(r)


# how a scatter combines the current value `v` with an update `u`
_COMBINE = {"none": "v = {u};", "add": "v = v + {u};", "mul": "v = v * {u};", "max": "v = max(v, {u});",
            "min": "v = min(v, {u});"}


@lowering("ScatterElements", "Scatter")
def lower_scatter_elements(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    data, idx, upd = node.inputs[:3]
    ds, ishape = shape_of(graph, data), shape_of(graph, idx)
    axis = _axis(node)
    ty, ity = vtype(graph, data), vtype(graph, idx)
    comb = _COMBINE[_reduction(node)].format(u=f"{ty}(up[j])")
    return _segment_scatter("ScatterElements", math.prod(ishape), math.prod(ds), 1,
                            _element_key(ds, ishape, axis, ity), idx, ity,
                            [("x", ty, data), ("up", vtype(graph, upd), upd)], "x[i]", comb, ("y", ty, node.outputs[0]))


# -- GatherND / its gradient / ScatterND -------------------------------------------------------
def _nd_offset(ity: str, q: str, k: int, lead: tuple) -> str:
    """Flat offset (within one batch) of the slice that index row q (k entries) addresses."""
    st = strides(lead)
    return " + ".join(f"u32({_index(ity, f'ix[{q} * {k}u + {t}u]', lead[t])}) * {st[t]}u" for t in range(k)) or "0u"


@lowering("GatherND")
def lower_gather_nd(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    data, idx = node.inputs[:2]
    ds, ishape = shape_of(graph, data), shape_of(graph, idx)
    b = int(node.attr("batch_dims", 0))
    k = ishape[-1]
    inner = math.prod(ds[b + k:])
    per_batch_q = math.prod(ishape[b:-1])
    n = math.prod(ishape[:-1]) * inner
    ity = vtype(graph, idx)
    body = f"""  let q = i / {inner}u;
  let w = i % {inner}u;
  let bt = q / {per_batch_q}u;
  y[i] = x[bt * {math.prod(ds[b:])}u + ({_nd_offset(ity, 'q', k, ds[b:b + k])}) * {inner}u + w];"""
    ty = vtype(graph, data)
    return [_kernel("GatherND", n, body, [("x", ty, data), ("ix", ity, idx)], [("y", ty, node.outputs[0])])]


def _nd_key(ds, ishape, b: int, ity: str) -> str:
    """seg_key(j): the slice (batch x addressed slot, flat) index row j addresses, or the slice
    count when an index is out of range."""
    k = ishape[-1]
    lead = ds[b:b + k]
    bad = " || ".join(f"{_index(ity, f'ix[j * {k}u + {t}u]', lead[t])} < 0 || "
                      f"{_index(ity, f'ix[j * {k}u + {t}u]', lead[t])} >= {lead[t]}" for t in range(k)) or "false"
    return f"""fn seg_key(j: u32) -> u32 {{
  if ({bad}) {{ return {math.prod(ds[:b + k])}u; }}
  return (j / {math.prod(ishape[b:-1])}u) * {math.prod(lead)}u + {_nd_offset(ity, 'j', k, lead)};
}}"""


def _nd_scatter(name: str, ds, ishape, b: int, idx: str, ity: str, reads, init: str, combine: str,
                out) -> list[Kernel]:
    k = ishape[-1]
    return _segment_scatter(name, math.prod(ishape[:-1]), math.prod(ds[:b + k]), math.prod(ds[b + k:]),
                            _nd_key(ds, ishape, b, ity), idx, ity, reads, init, combine, out)


@lowering("GatherNDGrad")
def lower_gather_nd_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """Index rows sorted by the slice of dx they address (segments.py), then each dx element sums
    its slice's dy rows in index order: O(rows + slices) sort, O(|dx| + |dy|) sums."""
    dy, idx = node.inputs[:2]
    ds = tuple(int(d) for d in node.attr("shape"))
    ishape = shape_of(graph, idx)
    inner = math.prod(ds[int(node.attr("batch_dims", 0)) + ishape[-1]:])
    return _nd_scatter("GatherNDGrad", ds, ishape, int(node.attr("batch_dims", 0)), idx, vtype(graph, idx),
                       [("dy", "f32", dy)], "0.0", f"v = v + dy[j * {inner}u + w];", ("dx", "f32", node.outputs[0]))


@lowering("ScatterND")
def lower_scatter_nd(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    data, idx, upd = node.inputs[:3]
    ds, ishape = shape_of(graph, data), shape_of(graph, idx)
    ty = vtype(graph, data)
    inner = math.prod(ds[ishape[-1]:])
    comb = _COMBINE[_reduction(node)].format(u=f"{ty}(up[j * {inner}u + w])")
    return _nd_scatter("ScatterND", ds, ishape, 0, idx, vtype(graph, idx),
                       [("x", ty, data), ("up", vtype(graph, upd), upd)], "x[i]", comb, ("y", ty, node.outputs[0]))


@lowering("ScatterNDMulGrad")
def lower_scatter_nd_mul_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """d update j = dy * data at j's place, times the other updates landing on the same place
    (its place's segment of the sorted index rows, in index order)."""
    dy, data, idx, upd = node.inputs[:4]
    ds, ishape = shape_of(graph, data), shape_of(graph, idx)
    ity = vtype(graph, idx)
    k = ishape[-1]
    inner = math.prod(ds[k:])
    q_all = math.prod(ishape[:-1])
    seg = sorted_segments("ScatterNDMulGrad", q_all, math.prod(ds[:k]), _nd_key(ds, ishape, 0, ity),
                          [("ix", ity, idx)])
    body = f"""  let q = i / {inner}u;
  let w = i % {inner}u;
  let place = seg_key(q);
  var acc = dy[place * {inner}u + w] * x[place * {inner}u + w];
  for (var s = starts[place]; s < starts[place + 1u]; s += 1u) {{
    let r = order[s];
    if (r != q) {{ acc = acc * up[r * {inner}u + w]; }}
  }}
  y[i] = acc;"""
    kern = _kernel("ScatterNDMulGrad:seg", math.prod(shape_of(graph, upd)), body,
                   [("dy", "f32", dy), ("x", "f32", data), ("ix", ity, idx), ("up", "f32", upd),
                    ("order", "u32", seg.order), ("starts", "u32", seg.starts)],
                   [("y", "f32", node.outputs[0])], helpers=_nd_key(ds, ishape, 0, ity))
    return seg.kernels + [replace(kern, scratch=seg.scratch)]


# -- TopK, CountTopK ---------------------------------------------------------------------------
@lowering("TopK")
def lower_topk(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One invocation per row: k selection sweeps, each taking the best element that comes after
    the previous pick in the order (value, then lower index first), so ties resolve as numpy's
    stable sort does."""
    x = node.inputs[0]
    shape = shape_of(graph, x)
    axis = _axis(node)
    k = shape_of(graph, node.outputs[0])[axis]
    outer, a, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    cmp = ">" if node.attr("largest", 1) else "<"
    ty = vtype(graph, x)
    vals, inds = (list(node.outputs) + ["", ""])[:2]
    before = f"(va {cmp} vb || (va == vb && ia < ib))"
    helpers = f"""fn before(va: {ty}, ia: u32, vb: {ty}, ib: u32) -> bool {{ return {before}; }}"""
    store = []
    writes = []
    if vals:
        writes.append(("yv", ty, vals))
        store.append(f"yv[o * {k * inner}u + r * {inner}u + w] = x[base + best * {inner}u];")
    if inds:
        writes.append(("yi", "i32", inds))
        store.append(f"yi[o * {k * inner}u + r * {inner}u + w] = i32(best);")
    body = f"""  let o = i / {inner}u;
  let w = i % {inner}u;
  let base = o * {a * inner}u + w;
  var prev = 0xffffffffu;
  for (var r = 0u; r < {k}u; r += 1u) {{
    var best = 0xffffffffu;
    for (var e = 0u; e < {a}u; e += 1u) {{
      let v = x[base + e * {inner}u];
      if (prev != 0xffffffffu && !before(x[base + prev * {inner}u], prev, v, e)) {{ continue; }}
      if (best == 0xffffffffu || before(v, e, x[base + best * {inner}u], best)) {{ best = e; }}
    }}
    {' '.join(store)}
    prev = best;
  }}"""
    return [_kernel("TopK", outer * inner, body, [("x", ty, x)], writes, helpers=helpers)]


@lowering("CountTopK")
def lower_count_top_k(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    out, target = node.inputs[:2]
    shape = shape_of(graph, out)
    n, c, s = shape[0], shape[1], math.prod(shape[2:])
    k = int(node.attr("k", 5))
    wg = 256
    tty = vtype(graph, target)
    body = f"""  var hits = 0u;
  for (var i = lid.x; i < {n * s}u; i += {wg}u) {{
    let base = (i / {s}u) * {c * s}u + i % {s}u;
    let t = i32(tgt[i]);
    if (t < 0 || t >= {c}) {{ continue; }}
    let picked = x[base + u32(t) * {s}u];
    var higher = 0u;
    for (var j = 0u; j < {c}u; j += 1u) {{ if (x[base + j * {s}u] > picked) {{ higher += 1u; }} }}
    if (higher < {k}u) {{ hits += 1u; }}
  }}
  sh[lid.x] = hits;
  workgroupBarrier();
  for (var t = {wg // 2}u; t > 0u; t = t >> 1u) {{
    if (lid.x < t) {{ sh[lid.x] += sh[lid.x + t]; }}
    workgroupBarrier();
  }}
  if (lid.x == 0u) {{ y[0] = f32(sh[0]); }}"""
    decls = bindings([("x", "f32"), ("tgt", tty)], [("y", "f32")])
    return [Kernel("CountTopK", shader(decls, body, wg=wg, shared=f"var<workgroup> sh: array<u32, {wg}>;"),
                   (1, 1, 1), (out, target), (node.outputs[0],))]


# -- OneHot, CumSum, Trilu -----------------------------------------------------------------------
@lowering("OneHot")
def lower_one_hot(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    idx, values = node.inputs[0], node.inputs[2]
    y = node.outputs[0]
    out = shape_of(graph, y)
    depth, axis = int(resolved(node, "depth")), _axis(node)
    ishape = out[:axis] + out[axis + 1:]
    coords = [f"c{d}" for d in range(len(out)) if d != axis]
    ity, ty = vtype(graph, idx), vtype(graph, values)
    body = f"""  {_coords('i', out)}
  let k = {_index(ity, f'ix[{_dot(coords, ishape)}]', depth)};
  y[i] = select(v[0], v[1], k == i32(c{axis}));"""
    return [_kernel("OneHot", math.prod(out), body, [("ix", ity, idx), ("v", ty, values)], [("y", ty, y)])]


@lowering("CumSum", "CumProd")
def lower_cumsum(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One invocation per line along the axis: a running sum (product), walked backwards when
    reversed."""
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    axis = _axis(node)
    outer, a, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    ty = vtype(graph, x)
    exclusive = bool(node.attr("exclusive", 0))
    pos = f"{a - 1}u - t" if node.attr("reverse", 0) else "t"
    op = "*" if node.op == "CumProd" else "+"
    step = (f"y[at] = acc; acc = acc {op} x[at];" if exclusive else f"acc = acc {op} x[at]; y[at] = acc;")
    body = f"""  let base = (i / {inner}u) * {a * inner}u + i % {inner}u;
  var acc = {literal(1 if node.op == "CumProd" else 0, ty)};
  for (var t = 0u; t < {a}u; t += 1u) {{
    let at = base + ({pos}) * {inner}u;
    {step}
  }}"""
    return [_kernel(node.op, outer * inner, body, [("x", ty, x)], [("y", ty, y)])]


@lowering("Trilu")
def lower_trilu(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    k = int(resolved(node, "k"))
    rows, cols = shape[-2], shape[-1]
    keep = f"c >= r + {k}" if resolved(node, "upper") else f"c <= r + {k}"
    ty = vtype(graph, x)
    body = f"""  let r = i32((i / {cols}u) % {max(rows, 1)}u);
  let c = i32(i % {cols}u);
  y[i] = select({literal(0, ty)}, x[i], {keep});"""
    return [_kernel("Trilu", math.prod(shape), body, [("x", ty, x)], [("y", ty, y)])]


# -- DepthToSpace / SpaceToDepth: a transpose of a reshaped view ---------------------------------
@lowering("DepthToSpace", "SpaceToDepth")
def lower_rearrange(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    plan = rearrange(node.op, shape_of(graph, x), int(resolved(node, "blocksize")), resolved(node, "mode"))
    it = tuple(plan.split[p] for p in plan.perm)
    src = strides(plan.split)
    return affine_copy(node.op, x, y, vtype(graph, x), it, 0, [src[p] for p in plan.perm], 0, strides(it))


# -- elementwise: Mod, IsNaN, IsInf ------------------------------------------------------------
def _bits(x: str) -> str:
    return f"(bitcast<u32>({x}) & 0x7fffffffu)"


@ew("IsNaN")
def _isnan(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    return [c.let(f"select(0u, 1u, {_bits(a[0].expr)} > 0x7f800000u)", "u32")]


@ew("IsInf")
def _isinf(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    x = a[0].expr
    pos, neg = bool(n.attr("detect_positive", 1)), bool(n.attr("detect_negative", 1))
    sign = {(True, True): "true", (True, False): f"{x} > 0.0", (False, True): f"{x} < 0.0",
            (False, False): "false"}[(pos, neg)]
    return [c.let(f"select(0u, 1u, {_bits(x)} == 0x7f800000u && {sign})", "u32")]


@ew("Mod")
def _mod(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    t = ot[0]
    x, y = (v.expr if v.ty == t else f"{t}({v.expr})" for v in a[:2])
    if t == "f32":
        # fmod (the sign of the dividend); a finite dividend over an infinite divisor is itself
        finite_inf = f"{_bits(y)} == 0x7f800000u && {_bits(x)} < 0x7f800000u"
        # WGSL's division may be off by an ulp or two (NVIDIA's is): a quotient that rounds
        # across an integer leaves |r| >= |y| or r of the wrong sign, so step it back once.
        r = c.let(f"fma(-trunc({x} / {y}), {y}, {x})", t)
        r = c.let(f"select({r.expr}, {r.expr} - sign({r.expr}) * abs({y}), abs({r.expr}) >= abs({y}))", t)
        r = c.let(f"select({r.expr}, {r.expr} + sign({x}) * abs({y}), "
                  f"{r.expr} != 0.0 && sign({r.expr}) != sign({x}))", t)
        r = c.let(f"select({r.expr}, {x}, {finite_inf})", t)
    else:
        # x - y * (x / y), not x % y: NVIDIA's signed remainder gets mixed signs wrong; WGSL
        # defines x / 0 = x for integers, which makes this x when y is 0, as ONNX's tests want
        r = c.let(f"{x} - {y} * ({x} / {y})", t)
    if n.attr("fmod", 0) or t == "u32":
        return [r]
    zero = literal(0, t)
    if t == "f32":  # numpy's mod: the sign of the divisor, zeros included
        neg_b = c.let(f"(bitcast<u32>({y}) >> 31u) == 1u", "bool").expr
        r = c.let(f"select({r.expr}, {r.expr} + {y}, {r.expr} != 0.0 && (({r.expr} < 0.0) != {neg_b}))", t)
        return [c.let(f"select({r.expr}, select(0.0, bitcast<f32>(0x80000000u), {neg_b}), {r.expr} == 0.0)", t)]
    return [c.let(f"select({r.expr}, {r.expr} + {y}, {r.expr} != {zero} && (({r.expr} < {zero}) != ({y} < {zero})))",
                  t)]

