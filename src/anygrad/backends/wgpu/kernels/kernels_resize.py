"""Resize / Upsample and ResizeGrad (formulas: anygrad/ops/index.py).

Resize is separable: on each resized axis it applies a small (out x in) interpolation matrix,
the one the numpy reference builds (`interp_matrix`), so nearest, linear and cubic modes, every
coordinate mode, antialias and exclude_outside come out identical. The matrices are baked into
the shader as sparse per-axis tables (for each output index: its taps and weights); one
invocation per output element sums the product of taps over the resized axes. The gradient is
the same kernel over the transposed tables (for each input index: the outputs that read it).
"""
from __future__ import annotations

import math

import numpy as np

from ....ir.graph import Graph, Node
from ....ir.passes import resolved
from ....ops.resize import Interp, interp_matrices
from .kernel import AdapterCaps, Kernel, lowering
from .wgsl import bindings, flat_id, grid, literal, shader, shape_of, strides, vtype


def _table(name: str, ty: str, values) -> str:
    vals = list(values) or [0]
    lits = ", ".join(literal(v, ty) for v in vals)
    return f"var<private> {name}: array<{ty}, {len(vals)}> = array<{ty}, {len(vals)}>({lits});"


def _sparse_rows(m: np.ndarray) -> tuple[list[int], list[int], list[float]]:
    """CSR of matrix m: row offsets, column indices, weights."""
    off, cols, ws = [0], [], []
    for row in m:
        nz = np.nonzero(row)[0]
        cols += [int(c) for c in nz]
        ws += [float(row[c]) for c in nz]
        off.append(len(cols))
    return off, cols, ws


def separable(name: str, x: str, y: str, in_shape, out_shape, mats: list, ty_in: str, ty_out: str,
              outside: list | None = None, fill: float = 0.0) -> Kernel:
    """y[o] = sum over taps of prod_d M_d[o_d, i_d] * x[i]; mats[d] (out_d x in_d) or None for
    an axis copied as is. outside[d]: output rows that take `fill` instead."""
    n = math.prod(out_shape)
    ost, ist = strides(out_shape), strides(in_shape)
    helpers, lines = [], [f"  {flat_id()}", f"  if (i >= {n}u) {{ return; }}"]
    for d, e in enumerate(out_shape):
        lines.append(f"  let c{d} = (i / {ost[d]}u) % {e}u;")
    loops, src = [], []
    any_outside = []
    for d, m in enumerate(mats):
        if m is None:
            src.append(f"c{d} * {ist[d]}u")
            continue
        off, cols, ws = _sparse_rows(m)
        helpers += [_table(f"OFF{d}", "i32", off), _table(f"COL{d}", "i32", cols), _table(f"WT{d}", "f32", ws)]
        loops.append(d)
        src.append(f"u32(COL{d}[t{d}]) * {ist[d]}u")
        if outside is not None and np.any(outside[d]):
            helpers.append(_table(f"OUT{d}", "i32", [int(v) for v in outside[d]]))
            any_outside.append(f"OUT{d}[c{d}] != 0")
    lines.append("  var acc = 0.0;")
    indent = "  "
    for d in loops:
        lines.append(f"{indent}for (var t{d} = OFF{d}[c{d}]; t{d} < OFF{d}[c{d} + 1u]; t{d} += 1) {{")
        indent += "  "
    weight = " * ".join(f"WT{d}[t{d}]" for d in loops) or "1.0"
    lines.append(f"{indent}acc += {weight} * f32(x[{' + '.join(src) or '0u'}]);")
    for _ in loops:
        indent = indent[:-2]
        lines.append(f"{indent}}}")
    value = "acc" if ty_out == "f32" else f"{ty_out}(round(acc))"
    if any_outside:
        value = f"select({value}, {literal(fill, ty_out)}, {' || '.join(any_outside)})"
    lines.append(f"  y[i] = {value};")
    src_text = shader(bindings([("x", ty_in)], [("y", ty_out)]), "\n".join(lines), helpers="\n".join(helpers))
    return Kernel(name, src_text, grid(n), (x,), (y,))


@lowering("Resize", "Upsample")
def lower_resize(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape, out = shape_of(graph, x), shape_of(graph, y)
    it = Interp.resolved(node)
    mats, outside = interp_matrices(it, shape, out, list(resolved(node, "scales")), list(resolved(node, "roi")))
    ty = vtype(graph, x)
    return [separable(node.op, x, y, shape, out, mats, ty, ty, outside, it.extrapolation)]


@lowering("ResizeGrad")
def lower_resize_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dy, dx = node.inputs[0], node.outputs[0]
    shape = tuple(int(d) for d in node.attr("shape"))
    out = shape_of(graph, dy)
    mats, _ = interp_matrices(Interp.resolved(node), shape, out, list(node.attr("scales")), list(node.attr("roi")))
    mats_t = [None if m is None else np.ascontiguousarray(m.T) for m in mats]
    return [separable("ResizeGrad", dy, dx, out, shape, mats_t, "f32", "f32")]
