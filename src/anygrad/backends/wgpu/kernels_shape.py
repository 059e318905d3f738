"""Data movement: Transpose, Slice/SliceGrad, Concat, Split, Gather/GatherGrad.

Most are one "affine copy": for every element of an iteration shape, read the source at
base + sum(coord_d * src_mult_d) and write the destination at base + sum(coord_d * dst_mult_d).
Shapes are constants, so each kernel is a handful of integer divisions per element.
"""
from __future__ import annotations

import math
from typing import Sequence

from ...ir.graph import Graph, Node
from ...ops.shape import slice_bounds, slice_len, split_sizes
from .kernel import AdapterCaps, Kernel, lowering
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


def affine_copy(name: str, src: str, dst: str, ty: str, iter_shape: Sequence[int], src_base: int,
                src_mult: Sequence[int], dst_base: int, dst_mult: Sequence[int], zero_fill: int = 0) -> list[Kernel]:
    """Copy kernel; zero_fill > 0 first clears `dst` (that many elements) with a separate kernel."""
    kernels = []
    if zero_fill:
        body = f"  {flat_id()}\n  if (i >= {zero_fill}u) {{ return; }}\n  y[i] = {literal(0, ty)};"
        kernels.append(Kernel(f"{name}:zero", shader(bindings([], [("y", ty)]), body), grid(zero_fill), (), (dst,)))
    n = math.prod(iter_shape)
    body = (f"  {flat_id()}\n  if (i >= {n}u) {{ return; }}\n"
            f"  y[{_affine(iter_shape, dst_base, dst_mult)}] = x[{_affine(iter_shape, src_base, src_mult)}];")
    kernels.append(Kernel(name, shader(bindings([("x", ty)], [("y", ty)]), body), grid(n), (src,), (dst,)))
    return kernels


@lowering("Transpose")
def lower_transpose(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    perm = node.attr("perm")
    perm = list(perm) if perm is not None else list(range(len(shape)))[::-1]
    out = shape_of(graph, y)
    ist = strides(shape)
    return affine_copy("Transpose", x, y, vtype(graph, x), out, 0, [ist[p] for p in perm], 0, strides(out))


@lowering("Slice")
def lower_slice(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    infos = [graph.info.get(i) if i else None for i in node.inputs]
    bounds = slice_bounds(node, infos, shape)
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
    axis = int(node.attr("axis"))
    axis = axis + len(out) if axis < 0 else axis
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
    infos = [graph.info.get(i) if i else None for i in node.inputs]
    axis, sizes = split_sizes(node, shape, infos[1] if len(infos) > 1 else None)
    ist = strides(shape)
    kernels, offset = [], 0
    for y, size in zip(node.outputs, sizes):
        if y and size:
            out = shape_of(graph, y)
            kernels += affine_copy("Split", x, y, vtype(graph, x), out, offset * ist[axis], ist, 0, strides(out))
        offset += size
    return kernels


def _gather_geometry(node: Node, data_shape: tuple[int, ...], n_idx: int) -> tuple[int, int, int, int]:
    axis = int(node.attr("axis", 0))
    axis = axis + len(data_shape) if axis < 0 else axis
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
    """Scatter-add without atomics: every dx element sums the dy rows whose index points at it."""
    dy, idx = node.inputs[:2]
    dx = node.outputs[0]
    shape = tuple(int(d) for d in node.attr("shape"))
    outer, a, q, inner = _gather_geometry(node, shape, math.prod(shape_of(graph, idx)))
    n = outer * a * inner
    body = f"""  {flat_id()}
  if (i >= {n}u) {{ return; }}
  let o = i / {a * inner}u;
  let r = (i / {inner}u) % {a}u;
  let w = i % {inner}u;
  var acc = 0.0;
  for (var j = 0u; j < {q}u; j += 1u) {{
    var k = i32(ix[j]);
    if (k < 0) {{ k += {a}; }}
    if (u32(k) == r) {{ acc += dy[o * {q * inner}u + j * {inner}u + w]; }}
  }}
  dx[i] = acc;"""
    decls = bindings([("dy", "f32"), ("ix", vtype(graph, idx))], [("dx", "f32")])
    return [Kernel("GatherGrad", shader(decls, body), grid(n), (dy, idx), (dx,))]
