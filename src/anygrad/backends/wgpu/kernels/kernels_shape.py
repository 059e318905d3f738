"""Data movement: Transpose, Slice/SliceGrad, Concat, Split, Gather/GatherGrad.

Most are one "affine copy": for every element of an iteration shape, read the source at
base + sum(coord_d * src_mult_d) and write the destination at base + sum(coord_d * dst_mult_d).
Shapes are constants, so each kernel is a handful of integer divisions per element.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ....ir.graph import Graph, Node
from ....ir.passes import resolved
from ....ops.shape import pad_source_index, slice_len
from .kernel import AdapterCaps, Kernel, lowering
from .segments import sorted_segments
from .wgsl import bindings, flat_id, grid, literal, shader, shape_of, strides, vtype


def _affine(iter_shape: Sequence[int], base: int, mult: Sequence[int], var: str = "i") -> str:
    """base + sum_d coord_d(var) * mult_d, coords of var over iter_shape (row-major)."""
    terms = [f"{base}" if base >= 0 else f"({base})"]
    st = strides(iter_shape)
    for d, (e, s, m) in enumerate(zip(iter_shape, st, mult)):
        if e == 1 or m == 0:
            continue
        coord = var if s == 1 else f"({var} / {s}u)"
        if d > 0:
            coord = f"({coord} % {e}u)"
        terms.append(f"i32({coord}) * {m}")
    return f"u32({' + '.join(terms)})"


def _in_vec4s(iter_shape: Sequence[int], src_base: int, src_mult: Sequence[int], dst_base: int,
              dst_mult: Sequence[int]) -> tuple | None:
    """The same copy in units of four elements, or None when four consecutive elements of the
    last axis are not four consecutive, 4-aligned elements on both sides. Copies move 16 bytes an
    invocation then: a head split or a qkv slice is memory-bound, and one f32 an invocation keeps
    too few bytes in flight for a large GPU's bandwidth (the elementwise kernels' reason too)."""
    if not iter_shape or iter_shape[-1] % 4 or 0 in iter_shape or src_mult[-1] != 1 or dst_mult[-1] != 1:
        return None
    rest = [m for e, m in zip(list(iter_shape[:-1]) * 2, list(src_mult[:-1]) + list(dst_mult[:-1])) if e != 1]
    if src_base % 4 or dst_base % 4 or any(m % 4 for m in rest):
        return None

    def quarter(mult: Sequence[int]) -> list[int]:
        return [m // 4 for m in mult[:-1]] + [1]
    return ((*iter_shape[:-1], iter_shape[-1] // 4), src_base // 4, quarter(src_mult), dst_base // 4,
            quarter(dst_mult))


def affine_copy(name: str, src: str, dst: str, ty: str, iter_shape: Sequence[int], src_base: int,
                src_mult: Sequence[int], dst_base: int, dst_mult: Sequence[int], zero_fill: int = 0) -> list[Kernel]:
    """Copy kernel; zero_fill > 0 first clears `dst` (that many elements) with a separate kernel."""
    kernels = []
    if zero_fill:
        body = f"  {flat_id()}\n  if (i >= {zero_fill}u) {{ return; }}\n  y[i] = {literal(0, ty)};"
        kernels.append(Kernel(f"{name}:zero", shader(bindings([], [("y", ty)]), body), grid(zero_fill), (), (dst,)))
    quad = _in_vec4s(iter_shape, src_base, src_mult, dst_base, dst_mult)
    if quad is not None:
        iter_shape, src_base, src_mult, dst_base, dst_mult = quad
        ty = f"vec4<{ty}>"
    n = math.prod(iter_shape)
    body = (f"  {flat_id()}\n  if (i >= {n}u) {{ return; }}\n"
            f"  y[{_affine(iter_shape, dst_base, dst_mult)}] = x[{_affine(iter_shape, src_base, src_mult)}];")
    kernels.append(Kernel(name, shader(bindings([("x", ty)], [("y", ty)]), body), grid(n), (src,), (dst,)))
    return kernels


@lowering("Transpose")
def lower_transpose(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    perm = [int(p) for p in resolved(node, "perm")]
    out = shape_of(graph, y)
    ist = strides(shape)
    return affine_copy("Transpose", x, y, vtype(graph, x), out, 0, [ist[p] for p in perm], 0, strides(out))


@lowering("Slice")
def lower_slice(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    bounds = list(zip(resolved(node, "starts"), resolved(node, "ends"), resolved(node, "steps")))
    out = tuple(slice_len(*b) for b in bounds)
    ist = strides(shape)
    base = sum(b[0] * s for b, s in zip(bounds, ist))
    return affine_copy("Slice", x, y, vtype(graph, x), out, base, [b[2] * s for b, s in zip(bounds, ist)],
                       0, strides(out))


@lowering("SliceGrad")
def lower_slice_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dy, dx = node.inputs[0], node.outputs[0]
    shape = tuple(int(d) for d in node.attr("shape"))
    bounds = list(zip(node.attr("starts"), node.attr("ends"), node.attr("steps")))
    it = shape_of(graph, dy)
    ost = strides(shape)
    base = sum(int(b[0]) * s for b, s in zip(bounds, ost))
    return affine_copy("SliceGrad", dy, dx, vtype(graph, dy), it, 0, strides(it), base,
                       [int(b[2]) * s for b, s in zip(bounds, ost)], zero_fill=math.prod(shape))


@lowering("Concat")
def lower_concat(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    y = node.outputs[0]
    out = shape_of(graph, y)
    axis = int(resolved(node, "axis"))
    ost = strides(out)
    kernels, offset = [], 0
    for x in node.inputs:
        if not x:
            continue
        shape = shape_of(graph, x)
        if math.prod(shape):
            kernels += affine_copy("Concat", x, y, vtype(graph, x), shape, 0, strides(shape), offset * ost[axis], ost)
        offset += shape[axis]
    return kernels


@lowering("Split")
def lower_split(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x = node.inputs[0]
    shape = shape_of(graph, x)
    axis, sizes = int(resolved(node, "axis")), resolved(node, "split")
    ist = strides(shape)
    kernels, offset = [], 0
    for y, size in zip(node.outputs, sizes):
        if y and size:
            out = shape_of(graph, y)
            kernels += affine_copy("Split", x, y, vtype(graph, x), out, offset * ist[axis], ist, 0, strides(out))
        offset += size
    return kernels


def _gather_geometry(node: Node, data_shape: tuple[int, ...], n_idx: int) -> tuple[int, int, int, int]:
    axis = int(resolved(node, "axis"))
    return math.prod(data_shape[:axis]), data_shape[axis], n_idx, math.prod(data_shape[axis + 1:])


@lowering("Gather")
def lower_gather(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    data, idx = node.inputs[:2]
    y = node.outputs[0]
    outer, a, q, inner = _gather_geometry(node, shape_of(graph, data), math.prod(shape_of(graph, idx)))
    n = outer * q * inner
    ity, ty = vtype(graph, idx), vtype(graph, data)
    body = f"""  {flat_id()}
  if (i >= {n}u) {{ return; }}
  let o = i / {q * inner}u;
  let j = (i / {inner}u) % {q}u;
  var k = i32(ix[j]);
  if (k < 0) {{ k += {a}; }}
  y[i] = x[o * {a * inner}u + u32(k) * {inner}u + i % {inner}u];"""
    decls = bindings([("x", ty), ("ix", ity)], [("y", ty)])
    return [Kernel("Gather", shader(decls, body), grid(n), (data, idx), (y,))]


@lowering("GatherGrad")
def lower_gather_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """Scatter-add without atomics: the index positions sorted by the row they address
    (segments.py), then every dx element sums its row's dy entries in index order.
    Work O(q + a) for the sort, O(outer x (a + q) x inner) for the sums."""
    dy, idx = node.inputs[:2]
    dx = node.outputs[0]
    shape = tuple(int(d) for d in node.attr("shape"))
    outer, a, q, inner = _gather_geometry(node, shape, math.prod(shape_of(graph, idx)))
    if q <= FEW_INDICES:
        return [_gather_grad_few(dy, idx, dx, vtype(graph, idx), outer, a, q, inner)]
    key = f"""fn seg_key(j: u32) -> u32 {{
  var k = i32(ix[j]);
  if (k < 0) {{ k += {a}; }}
  return select({a}u, u32(k), k >= 0 && k < {a});
}}"""
    seg = sorted_segments("GatherGrad", q, a, key, [("ix", vtype(graph, idx), idx)])
    n = outer * a * inner
    body = f"""  {flat_id()}
  if (i >= {n}u) {{ return; }}
  let o = i / {a * inner}u;
  let r = (i / {inner}u) % {a}u;
  let w = i % {inner}u;
  let row = o * {q * inner}u + w;
  var acc = 0.0;
  for (var s = starts[r]; s < starts[r + 1u]; s += 1u) {{ acc += dy[row + order[s] * {inner}u]; }}
  dx[i] = acc;"""
    decls = bindings([("dy", "f32"), ("order", "u32"), ("starts", "u32")], [("dx", "f32")])
    return seg.kernels + [Kernel("GatherGrad:sum", shader(decls, body), grid(n), (dy, seg.order, seg.starts), (dx,),
                                 scratch=seg.scratch)]


# A Gather of this few positions (a select such as x[:, 0], or q/k/v taken from a packed
# projection) needs no sort: each dx element checks every index itself, O(dx x q).
FEW_INDICES = 8


def _gather_grad_few(dy: str, idx: str, dx: str, ity: str, outer: int, a: int, q: int, inner: int) -> Kernel:
    """dx[o, r, w] = sum over j (in index order, as the sorted path adds them) with ix[j] == r of
    dy[o, j, w]: one kernel, every element written (zeros where no index points)."""
    n = outer * a * inner
    terms = "\n".join(
        f"  k = i32(ix[{j}]); if (k < 0) {{ k += {a}; }} if (k == i32(r)) {{ acc += dy[row + {j * inner}u]; }}"
        for j in range(q))
    body = f"""  {flat_id()}
  if (i >= {n}u) {{ return; }}
  let o = i / {a * inner}u;
  let r = (i / {inner}u) % {a}u;
  let row = o * {q * inner}u + i % {inner}u;
  var acc = 0.0;
  var k = 0;
{terms}
  dx[i] = acc;"""
    decls = bindings([("dy", "f32"), ("ix", ity)], [("dx", "f32")])
    return Kernel("GatherGrad:few", shader(decls, body), grid(n), (dy, idx), (dx,))


# -- per-axis index tables: Tile, Pad, PadGrad ----------------------------------------------------------
def _table(name: str, values) -> str:
    vals = ", ".join(f"{int(v)}" for v in values)
    return f"var<private> {name}: array<i32, {len(values)}> = array<i32, {len(values)}>({vals});"


def table_gather(name: str, src: str, dst: str, ty: str, in_shape: Sequence[int], out_shape: Sequence[int],
                 tables: dict[int, Sequence[int]], fill: str, fill_value: str = "") -> Kernel:
    """y[out coords] = x[table_d[c_d] per axis] (identity on axes without a table); a -1 entry
    anywhere selects `fill` instead (or element 0 of value `fill_value`, bound as `pv`)."""
    n = math.prod(out_shape)
    ost, ist = strides(out_shape), strides(in_shape)
    helpers = "\n".join(_table(f"T{d}", t) for d, t in tables.items())
    lines = [f"  {flat_id()}", f"  if (i >= {n}u) {{ return; }}", "  var src = 0;", "  var inside = true;"]
    for d, (e, s) in enumerate(zip(out_shape, ost)):
        coord = f"i32((i / {s}u) % {e}u)"
        if d in tables:
            lines.append(f"  let c{d} = T{d}[(i / {s}u) % {e}u];")
            lines.append(f"  inside = inside && c{d} >= 0;")
            coord = f"c{d}"
        lines.append(f"  src += {coord} * {ist[d]};")
    if fill_value:
        fill = "pv[0]"
    lines.append(f"  y[i] = select({fill}, x[u32(max(src, 0))], inside);")
    reads = [("x", ty)] + ([("pv", ty)] if fill_value else [])
    return Kernel(name, shader(bindings(reads, [("y", ty)]), "\n".join(lines), helpers=helpers), grid(n),
                  (src,) + ((fill_value,) if fill_value else ()), (dst,))


@lowering("RotateHalf")
def lower_rotate_half(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """concat(-sign * x2, sign * x1) of x's halves along axis: one gather an element (a vec4 one
    where the halves are whole vec4 runs of the last axis, as a rotary head dim's are)."""
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    axis, sign = int(resolved(node, "axis")), int(node.attr("sign", 1))
    d, inner, ty = shape[axis], math.prod(shape[axis + 1:]), vtype(graph, x)
    width = 4 if inner == 1 and (d // 2) % 4 == 0 else 1
    n, d = math.prod(shape) // width, d // width
    half = d // 2 * inner
    vty = f"vec4<{ty}>" if width == 4 else ty
    first, second = ("-", "") if sign == 1 else ("", "-")
    body = (f"  {flat_id()}\n  if (i >= {n}u) {{ return; }}\n"
            f"  if ((i / {inner}u) % {d}u < {d // 2}u) {{ y[i] = {first}x[i + {half}u]; }}"
            f" else {{ y[i] = {second}x[i - {half}u]; }}")
    return [Kernel(f"RotateHalf{'x4' if width == 4 else ''}", shader(bindings([("x", vty)], [("y", vty)]), body),
                   grid(n), (x,), (y,))]


@lowering("Tile")
def lower_tile(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape, out = shape_of(graph, x), shape_of(graph, y)
    tables = {d: [j % s for j in range(o)] for d, (s, o) in enumerate(zip(shape, out)) if s != o}
    return [table_gather("Tile", x, y, vtype(graph, x), shape, out, tables, literal(0, vtype(graph, x)))]


@lowering("Pad")
def lower_pad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    pads, mode = resolved(node, "pads"), resolved(node, "mode")
    amounts = list(zip(pads[:len(shape)], pads[len(shape):]))
    ty = vtype(graph, x)
    # a fill value computed at run time is read from its buffer; a constant one was resolved
    fill_value = node.input(2) if "value" not in node.attrs else ""
    value = node.attrs.get("value", 0.0)
    tables = {d: pad_source_index(mode, s, b, a).tolist() for d, (s, (b, a)) in enumerate(zip(shape, amounts))
              if (b, a) != (0, 0)}
    return [table_gather("Pad", x, y, ty, shape, shape_of(graph, y), tables, literal(value, ty), fill_value)]


@lowering("PadGrad")
def lower_pad_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One scatter-free pass per padded axis: each input position sums the outputs that read it."""
    dy, dx = node.inputs[0], node.outputs[0]
    shape = [int(d) for d in node.attr("shape")]
    mode = node.attr("mode")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    axes = [(d, int(b), int(a)) for d, (b, a) in enumerate(zip(node.attr("before"), node.attr("after")))
            if (b, a) != (0, 0)]
    cur = list(shape_of(graph, dy))
    src = dy
    kernels = []
    from .kernel import Scratch
    for k, (axis, b, a) in enumerate(axes):
        d = shape[axis]
        source = pad_source_index(mode, d, b, a)
        pre = [[j for j, s in enumerate(source) if s == i] for i in range(d)]
        offs = [0]
        for p in pre:
            offs.append(offs[-1] + len(p))
        flat = [j for p in pre for j in p] or [0]
        out = cur[:axis] + [d] + cur[axis + 1:]
        last = k == len(axes) - 1
        dst = dx if last else f"padgrad.{dx}.{k}"
        n = math.prod(out)
        inner = math.prod(out[axis + 1:])
        helpers = _table("OFF", offs) + "\n" + _table("PRE", flat)
        body = f"""  {flat_id()}
  if (i >= {n}u) {{ return; }}
  let o = i / {d * inner}u;
  let c = (i / {inner}u) % {d}u;
  let w = i % {inner}u;
  var acc = 0.0;
  for (var t = OFF[c]; t < OFF[c + 1u]; t += 1) {{
    acc += x[o * {cur[axis] * inner}u + u32(PRE[t]) * {inner}u + w];
  }}
  y[i] = acc;"""
        scratch = tuple(Scratch(f"padgrad.{dx}.{j}", math.prod(shape_of(graph, dy))) for j in range(len(axes) - 1))
        kernels.append(Kernel("PadGrad", shader(bindings([("x", "f32")], [("y", "f32")]), body, helpers=helpers),
                              grid(n), (src,), (dst,), scratch=scratch))
        src, cur = dst, out
    if not axes:
        n = math.prod(shape)
        kernels.append(table_gather("PadGrad:copy", dy, dx, "f32", shape, shape, {}, "0.0"))
    return kernels
