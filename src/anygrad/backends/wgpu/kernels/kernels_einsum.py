"""Einsum (and the Einsums its gradient rule emits) as one direct kernel.

One invocation per output element loops over every combination of the summed letters and adds
the product of the operands there. Each operand's offset is a sum over its letters of
coordinate x stride (a letter repeated in an operand, a diagonal, adds its strides; a dim that
broadcasts from 1 gets stride 0). Simple and exact for any equation; the contractions models
export (attention's bhqd,bhkd->bhqk) are small next to the matmuls around them.
"""
from __future__ import annotations

import math

from ....ir.graph import Graph, Node
from ....ops.index import parse_einsum
from .kernel import AdapterCaps, Kernel, lowering
from .wgsl import bindings, flat_id, grid, shader, shape_of, strides, vtype


def _offset(term: str, shape, coord: dict[str, str]) -> str:
    st = strides(shape)
    parts = [f"{coord[c]} * {s}u" for c, s, d in zip(term, st, shape) if d != 1]
    return " + ".join(parts) or "0u"


@lowering("Einsum")
def lower_einsum(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    shapes = [shape_of(graph, x) for x in node.inputs]
    spec = parse_einsum(node, shapes)
    y = node.outputs[0]
    out = shape_of(graph, y)
    summed = [c for c in dict.fromkeys("".join(spec.inputs)) if c not in spec.output]
    ssizes = [int(spec.sizes[c]) for c in summed]
    total = math.prod(ssizes)
    coord: dict[str, str] = {}
    lines = [f"  {flat_id()}", f"  if (i >= {math.prod(out)}u) {{ return; }}"]
    for c, e, s in zip(spec.output, out, strides(out)):
        lines.append(f"  let o_{c} = (i / {s}u) % {e}u;")
        coord[c] = f"o_{c}"
    for c in summed:
        coord[c] = f"s_{c}"
    ty = vtype(graph, y)
    lines.append(f"  var acc = {ty}(0);")
    lines.append(f"  for (var r = 0u; r < {total}u; r += 1u) {{")
    for c, e, s in zip(summed, ssizes, strides(ssizes)):
        lines.append(f"    let s_{c} = (r / {s}u) % {e}u;")
    prod = " * ".join(f"{ty}(x{j}[{_offset(t, sh, coord)}])" for j, (t, sh) in enumerate(zip(spec.inputs, shapes)))
    lines += [f"    acc += {prod};", "  }", "  y[i] = acc;"]
    reads = [(f"x{j}", vtype(graph, x)) for j, x in enumerate(node.inputs)]
    src = shader(bindings(reads, [("y", ty)]), "\n".join(lines))
    return [Kernel("Einsum", src, grid(math.prod(out)), tuple(node.inputs), (y,))]
