"""Conv, ConvGradInput and ConvGradWeight over any number of spatial dims, as direct loops
(kernels_conv.py sends 3-D convolutions here; its implicit-GEMM kernels handle 1-D and 2-D).

One invocation per output element: a Conv output sums its receptive field; an input-gradient
element gathers from the outputs whose windows cover it (no atomics); a weight-gradient element
sums over the batch and every output position. Simple rather than fast: 3-D convolutions are
rare in the models this backend trains. Window geometry: `anygrad.ops.nn.Window.of`
over the node's resolved attributes.
"""
from __future__ import annotations

import math

from ....ir.graph import Graph, Node
from ....ops.nn import Window
from .gemm_spec import EPILOGUES
from .kernel import Kernel
from .kernels_index import _coords, _kernel
from .wgsl import shape_of, strides


def _flat(names: list[str], shape) -> str:
    return " + ".join(f"{n} * {s}u" for n, s in zip(names, strides(shape))) or "0u"


def _loops(lines: list[str], header: list[str], indent: str) -> str:
    """Append nested-loop headers (each a list of lines) and return the innermost indent."""
    for h in header:
        lines += [indent + x for x in h]
        indent += "  "
    return indent


def _close(lines: list[str], depth: int, indent: str) -> None:
    for _ in range(depth):
        indent = indent[:-2]
        lines.append(f"{indent}}}")


def conv(node: Node, graph: Graph) -> list[Kernel]:
    x, w = node.inputs[:2]
    bias = node.input(2)
    xs, ws = shape_of(graph, x), shape_of(graph, w)
    win = Window.of(node, xs[2:])
    G = int(node.attr("group", 1))
    co, cg = ws[0], ws[1]
    cog = co // G
    nd = len(win.kernel)
    out = (xs[0], co) + win.out
    lines = [f"  let img = i / {math.prod(out[1:])}u; let oc = (i / {math.prod(win.out)}u) % {co}u;",
             f"  let pix = i % {math.prod(win.out)}u; {_coords('pix', win.out, 'o')}",
             f"  let grp = oc / {cog}u;", "  var acc = 0.0;"]
    heads = [[f"for (var ci = 0u; ci < {cg}u; ci += 1u) {{"]]
    for d in range(nd):
        heads.append([f"for (var k{d} = 0u; k{d} < {win.kernel[d]}u; k{d} += 1u) {{",
                      f"  let p{d} = i32(o{d} * {win.strides[d]}u + k{d} * {win.dilations[d]}u) - {win.begin[d]};",
                      f"  if (p{d} < 0 || p{d} >= {win.spatial[d]}) {{ continue; }}"])
    ind = _loops(lines, heads, "  ")
    pos = _flat([f"u32(p{d})" for d in range(nd)], win.spatial)
    kpos = _flat([f"k{d}" for d in range(nd)], win.kernel)
    lines.append(f"{ind}acc += X[((img * {xs[1]}u + grp * {cg}u + ci) * {math.prod(win.spatial)}u) + {pos}] * "
                 f"W[(oc * {cg}u + ci) * {math.prod(win.kernel)}u + {kpos}];")
    _close(lines, nd + 1, ind)
    lines += [f"  var y = acc{' + B[oc]' if bias else ''};", f"  Y[i] = {EPILOGUES[node.attr('_epilogue')]};"]
    reads = [("X", "f32", x), ("W", "f32", w)] + ([("B", "f32", bias)] if bias else [])
    return [_kernel("Conv[nd]", math.prod(out), "\n".join(lines), reads, [("Y", "f32", node.outputs[0])])]


def conv_grad_input(node: Node, graph: Graph) -> list[Kernel]:
    dy, w = node.inputs[:2]
    ws = shape_of(graph, w)
    xs = tuple(int(d) for d in node.attr("input_shape"))
    win = Window.of(node, xs[2:])
    G = int(node.attr("group", 1))
    co, cg = ws[0], ws[1]
    cog = co // G
    nd = len(win.kernel)
    lines = [f"  let img = i / {math.prod(xs[1:])}u; let ic = (i / {math.prod(win.spatial)}u) % {xs[1]}u;",
             f"  let pix = i % {math.prod(win.spatial)}u; {_coords('pix', win.spatial, 'c')}",
             f"  let grp = ic / {cg}u; let ci = ic % {cg}u;", "  var acc = 0.0;"]
    heads = [[f"for (var oo = 0u; oo < {cog}u; oo += 1u) {{", f"  let oc = grp * {cog}u + oo;"]]
    for d in range(nd):
        heads.append([f"for (var k{d} = 0u; k{d} < {win.kernel[d]}u; k{d} += 1u) {{",
                      f"  let t{d} = i32(c{d} + {win.begin[d]}u) - i32(k{d} * {win.dilations[d]}u);",
                      (f"  if (t{d} < 0 || u32(t{d}) % {win.strides[d]}u != 0u || "
                       f"u32(t{d}) / {win.strides[d]}u >= {win.out[d]}u) {{ continue; }}")])
    ind = _loops(lines, heads, "  ")
    opos = _flat([f"(u32(t{d}) / {win.strides[d]}u)" for d in range(nd)], win.out)
    kpos = _flat([f"k{d}" for d in range(nd)], win.kernel)
    lines.append(f"{ind}acc += DY[(img * {co}u + oc) * {math.prod(win.out)}u + {opos}] * "
                 f"W[(oc * {cg}u + ci) * {math.prod(win.kernel)}u + {kpos}];")
    _close(lines, nd + 1, ind)
    lines.append("  DX[i] = acc;")
    return [_kernel("ConvGradInput[nd]", math.prod(xs), "\n".join(lines), [("DY", "f32", dy), ("W", "f32", w)],
                    [("DX", "f32", node.outputs[0])])]


def conv_grad_weight(node: Node, graph: Graph) -> list[Kernel]:
    dy, x = node.inputs[:2]
    xs = shape_of(graph, x)
    ws = tuple(int(d) for d in node.attr("weight_shape"))
    win = Window.of(node, xs[2:])
    G = int(node.attr("group", 1))
    co, cg = ws[0], ws[1]
    cog = co // G
    nd = len(win.kernel)
    P = math.prod(win.out)
    lines = [f"  let oc = i / {math.prod(ws[1:])}u; let ci = (i / {math.prod(win.kernel)}u) % {cg}u;",
             f"  let kk = i % {math.prod(win.kernel)}u; {_coords('kk', win.kernel, 'k')}",
             f"  let ic = (oc / {cog}u) * {cg}u + ci;", "  var acc = 0.0;"]
    heads = [[f"for (var q = 0u; q < {xs[0] * P}u; q += 1u) {{", f"  let img = q / {P}u; let pix = q % {P}u;",
              f"  {_coords('pix', win.out, 'o')}", "  var inside = true;"]
             + [f"  let p{d} = i32(o{d} * {win.strides[d]}u + k{d} * {win.dilations[d]}u) - {win.begin[d]};"
                f" inside = inside && p{d} >= 0 && p{d} < {win.spatial[d]};" for d in range(nd)]
             + ["  if (!inside) { continue; }"]]
    ind = _loops(lines, heads, "  ")
    pos = _flat([f"u32(p{d})" for d in range(nd)], win.spatial)
    lines.append(f"{ind}acc += DY[(img * {co}u + oc) * {P}u + pix] * "
                 f"X[(img * {xs[1]}u + ic) * {math.prod(win.spatial)}u + {pos}];")
    _close(lines, 1, ind)
    lines.append("  DW[i] = acc;")
    return [_kernel("ConvGradWeight[nd]", math.prod(ws), "\n".join(lines), [("DY", "f32", dy), ("X", "f32", x)],
                    [("DW", "f32", node.outputs[0])])]


# op -> N-D lowering, for kernels_conv.py to call on inputs of rank > 4
CONV_ND = {"Conv": conv, "ConvGradInput": conv_grad_input, "ConvGradWeight": conv_grad_weight}
