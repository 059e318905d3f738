"""Linear quantization (formulas: anygrad/ops/quant.py): QuantizeLinear, DequantizeLinear,
DynamicQuantizeLinear, MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv.

Inference ops, written as direct kernels (one invocation per output element). Quantized values
live widened in i32/u32 on the device; integer accumulations are exact in i32; requantization
scales in f32 (the numpy reference uses float64, so a product landing within an f32 ulp of .5
may round the other way).
"""
from __future__ import annotations

import math

import numpy as np

from ....ir.graph import Graph, Node
from ....ir.passes import resolved
from ....ops.nn import Window
from ....ops.quant import RANGES
from .kernel import AdapterCaps, Kernel, lowering
from .kernels_index import _coords, _kernel
from .wgsl import bindings, broadcast_index, shader, shape_of, strides, vtype


def _spread_index(x_shape, p_shape, axis: int, block: int, var: str = "i") -> str:
    """Index into a scale / zero point of shape p_shape for element `var` of x (scalar, per axis,
    or per block along the axis)."""
    if math.prod(p_shape) == 1 and not block:
        return "0u"
    st = strides(x_shape)
    if not block:
        return f"(({var} / {st[axis]}u) % {x_shape[axis]}u)"
    pst = strides(p_shape)
    terms = []
    for d, (e, s) in enumerate(zip(x_shape, st)):
        c = f"(({var} / {s}u) % {e}u)"
        if d == axis:
            c = f"({c} / {block}u)"
        terms.append(f"{c} * {pst[d]}u")
    return " + ".join(terms)


def _scalar(graph: Graph, value: str, var: str, reads: list, per: str = "0u") -> str:
    """Element `per` of a scale / zero point: a literal when it is a one-element constant (keeps
    QLinearConv's nine inputs within 8 storage bindings), else a bound read."""
    if not value:
        return "0"
    const = graph.initializers.get(value)
    if const is not None and np.asarray(const).size == 1:
        c = np.asarray(const).reshape(()).item()
        return repr(float(c)) if np.asarray(const).dtype.kind == "f" else f"{int(c)}"
    reads.append((var, vtype(graph, value), value))
    return f"{var}[{per if math.prod(shape_of(graph, value)) > 1 else '0u'}]"


def _range(graph: Graph, value: str) -> tuple[int, int]:
    return RANGES[np.dtype(graph.info[value].dtype)]


def _div(name: str, a: str, b: str) -> str:
    """`let name = a / b;` correctly rounded: WGSL's division may be 2.5 ulp off (NVIDIA's is),
    enough to carry a quotient across the .5 that round() then decides on. One fma residual
    step restores float32's rounding (and numpy's, which the ONNX references use)."""
    return f"let {name}0 = {a} / {b}; let {name} = {name}0 + fma(-{name}0, {b}, {a}) / {b};"


@lowering("QuantizeLinear")
def lower_quantize(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, scale = node.inputs[:2]
    zp = node.input(2)
    y = node.outputs[0]
    xs = shape_of(graph, x)
    axis, block = int(resolved(node, "axis")), int(node.attr("block_size", 0))
    lo, hi = _range(graph, y)
    si = _spread_index(xs, shape_of(graph, scale), axis, block)
    reads = [("x", "f32", x), ("sc", "f32", scale)]
    q = "round(q)"
    if zp:
        reads.append(("zp", vtype(graph, zp), zp))
        q += f" + f32(zp[{_spread_index(xs, shape_of(graph, zp), axis, block)}])"
    ty = vtype(graph, y)
    body = f"  {_div('q', 'x[i]', f'sc[{si}]')}\n  y[i] = {ty}(clamp({q}, {float(lo)}, {float(hi)}));"
    return [_kernel("QuantizeLinear", math.prod(xs), body, reads, [("y", ty, y)])]


@lowering("DequantizeLinear")
def lower_dequantize(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, scale = node.inputs[:2]
    zp = node.input(2)
    xs = shape_of(graph, x)
    axis, block = int(resolved(node, "axis")), int(node.attr("block_size", 0))
    reads = [("x", vtype(graph, x), x), ("sc", "f32", scale)]
    v = "f32(x[i])"
    if zp:
        reads.append(("zp", vtype(graph, zp), zp))
        v = f"({v} - f32(zp[{_spread_index(xs, shape_of(graph, zp), axis, block)}]))"
    body = f"  y[i] = {v} * sc[{_spread_index(xs, shape_of(graph, scale), axis, block)}];"
    return [_kernel("DequantizeLinear", math.prod(xs), body, reads, [("y", "f32", node.outputs[0])])]


@lowering("DynamicQuantizeLinear")
def lower_dynamic_quantize(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One workgroup finds the range and writes scale and zero point; then one invocation per element."""
    x = node.inputs[0]
    y, scale, zp = node.outputs[:3]
    n = math.prod(shape_of(graph, x))
    wg = 256
    body = f"""  var lo = 0.0;
  var hi = 0.0;
  for (var k = lid.x; k < {n}u; k += {wg}u) {{ lo = min(lo, x[k]); hi = max(hi, x[k]); }}
  shlo[lid.x] = lo;
  shhi[lid.x] = hi;
  workgroupBarrier();
  for (var t = {wg // 2}u; t > 0u; t = t >> 1u) {{
    if (lid.x < t) {{ shlo[lid.x] = min(shlo[lid.x], shlo[lid.x + t]); shhi[lid.x] = max(shhi[lid.x], shhi[lid.x + t]); }}
    workgroupBarrier();
  }}
  if (lid.x == 0u) {{
    {_div("s", "select(shhi[0] - shlo[0], 1.0, shhi[0] == shlo[0])", "255.0")}
    sc[0] = s;
    {_div("m", "shlo[0]", "s")}
    z[0] = u32(round(clamp(0.0 - m, 0.0, 255.0)));
  }}"""
    shared = f"var<workgroup> shlo: array<f32, {wg}>;\nvar<workgroup> shhi: array<f32, {wg}>;"
    k1 = Kernel("DynamicQuantizeLinear:range", shader(bindings([("x", "f32")], [("sc", "f32"), ("z", "u32")]), body,
                                                      wg=wg, shared=shared), (1, 1, 1), (x,), (scale, zp))
    k2 = _kernel("DynamicQuantizeLinear", n,
                 f"  {_div('q', 'x[i]', 'sc[0]')}\n  y[i] = u32(clamp(round(q) + f32(z[0]), 0.0, 255.0));",
                 [("x", "f32", x), ("sc", "f32", scale), ("z", "u32", zp)], [("y", "u32", y)])
    return [k1, k2]


# -- integer matmul ------------------------------------------------------------------------------
def _matmul_body(graph: Graph, a: str, b: str, azp: str, bzp: str, reads: list) -> str:
    """Statements computing `acc` (i32, exact) for output element i of a (batched) matmul;
    appends the zero points it binds to reads."""
    sa, sb = list(shape_of(graph, a)), list(shape_of(graph, b))
    a2 = [1] + sa if len(sa) == 1 else sa
    b2 = sb + [1] if len(sb) == 1 else sb
    m, k, n = a2[-2], a2[-1], b2[-1]
    batch = tuple(int(d) for d in np.broadcast_shapes(tuple(a2[:-2]), tuple(b2[:-2])))
    abase = broadcast_index(batch, a2[:-2], "bt") if batch else "0u"
    bbase = broadcast_index(batch, b2[:-2], "bt") if batch else "0u"
    za = f"i32({_scalar(graph, azp, 'za', reads, 'r')})"
    zb = f"i32({_scalar(graph, bzp, 'zb', reads, 'c')})"
    body = f"""  let bt = i / {m * n}u; let r = (i / {n}u) % {m}u; let c = i % {n}u;
  let ao = ({abase}) * {m * k}u + r * {k}u;
  let bo = ({bbase}) * {k * n}u + c;
  var acc = 0;
  for (var t = 0u; t < {k}u; t += 1u) {{ acc += (i32(A[ao + t]) - {za}) * (i32(B[bo + t * {n}u]) - {zb}); }}"""
    return body


@lowering("MatMulInteger")
def lower_matmul_integer(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    a, b = node.inputs[:2]
    azp, bzp = node.input(2), node.input(3)
    y = node.outputs[0]
    reads = [("A", vtype(graph, a), a), ("B", vtype(graph, b), b)]
    body = _matmul_body(graph, a, b, azp, bzp, reads)
    return [_kernel("MatMulInteger", math.prod(shape_of(graph, y)), body + "\n  y[i] = acc;", reads,
                    [("y", "i32", y)])]


def _requantize(graph: Graph, y: str, scale: str, yzp: str, reads: list) -> str:
    lo, hi = _range(graph, y)
    zp = f"f32({_scalar(graph, yzp, 'yz', reads)})"
    return f"  y[i] = {vtype(graph, y)}(clamp(round(f32(acc) * {scale} + {zp}), {float(lo)}, {float(hi)}));"


@lowering("QLinearMatMul")
def lower_qlinear_matmul(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    a, a_scale, azp, b, b_scale, bzp, y_scale, yzp = (list(node.inputs) + [""] * 8)[:8]
    y = node.outputs[0]
    reads = [("A", vtype(graph, a), a), ("B", vtype(graph, b), b)]
    body = _matmul_body(graph, a, b, azp, bzp, reads)
    scale = (f"(f32({_scalar(graph, a_scale, 'as_', reads)}) * f32({_scalar(graph, b_scale, 'bs', reads, 'c')}) / "
             f"f32({_scalar(graph, y_scale, 'ys', reads)}))")
    body += "\n" + _requantize(graph, y, scale, yzp, reads)
    return [_kernel("QLinearMatMul", math.prod(shape_of(graph, y)), body, reads, [("y", vtype(graph, y), y)])]


# -- integer convolution ---------------------------------------------------------------------------
def _conv_body(node: Node, graph: Graph, x: str, w: str, xzp: str, wzp: str, bias: str,
               reads: list) -> tuple[str, int]:
    xs, ws = shape_of(graph, x), shape_of(graph, w)
    win = Window.of(node, xs[2:])
    groups = int(node.attr("group", 1))
    co, cg = ws[0], ws[1]
    cog = co // groups
    P, S, K = math.prod(win.out), math.prod(win.spatial), math.prod(win.kernel)
    zx = f"i32({_scalar(graph, xzp, 'zx', reads)})"
    zw = f"i32({_scalar(graph, wzp, 'zw', reads, 'oc')})"
    if bias:
        reads.append(("bias", vtype(graph, bias), bias))
    lines = [f"  let img = i / {co * P}u; let oc = (i / {P}u) % {co}u; let pix = i % {P}u;",
             f"  {_coords('pix', win.out, 'o')}", f"  let grp = oc / {cog}u;",
             f"  var acc = {'i32(bias[oc])' if bias else '0'};",
             f"  for (var kk = 0u; kk < {cg * K}u; kk += 1u) {{",
             f"    let ci = kk / {K}u; let kf = kk % {K}u; {_coords('kf', win.kernel, 'k')}",
             "    var inside = true;", "    var at = 0u;"]
    for d, s in enumerate(strides(win.spatial)):
        lines += [f"    let p{d} = i32(o{d} * {win.strides[d]}u + k{d} * {win.dilations[d]}u) - {win.begin[d]};",
                  f"    inside = inside && p{d} >= 0 && p{d} < {win.spatial[d]};",
                  f"    at += u32(max(p{d}, 0)) * {s}u;"]
    lines += ["    if (!inside) { continue; }",
              (f"    acc += (i32(X[(img * {xs[1]}u + grp * {cg}u + ci) * {S}u + at]) - {zx}) * "
               f"(i32(W[(oc * {cg}u + ci) * {K}u + kf]) - {zw});"), "  }"]
    return "\n".join(lines), xs[0] * co * P


@lowering("ConvInteger")
def lower_conv_integer(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, w = node.inputs[:2]
    xzp, wzp = node.input(2), node.input(3)
    reads = [("X", vtype(graph, x), x), ("W", vtype(graph, w), w)]
    body, n = _conv_body(node, graph, x, w, xzp, wzp, "", reads)
    return [_kernel("ConvInteger", n, body + "\n  y[i] = acc;", reads, [("y", "i32", node.outputs[0])])]


@lowering("QLinearConv")
def lower_qlinear_conv(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, x_scale, xzp, w, w_scale, wzp, y_scale, yzp, bias = (list(node.inputs) + [""] * 9)[:9]
    y = node.outputs[0]
    reads = [("X", vtype(graph, x), x), ("W", vtype(graph, w), w)]
    body, n = _conv_body(node, graph, x, w, xzp, wzp, bias, reads)
    scale = (f"(f32({_scalar(graph, x_scale, 'xs_', reads)}) * f32({_scalar(graph, w_scale, 'wsc', reads, 'oc')}) / "
             f"f32({_scalar(graph, y_scale, 'ys', reads)}))")
    body += "\n" + _requantize(graph, y, scale, yzp, reads)
    return [_kernel("QLinearConv", n, body, reads, [("y", vtype(graph, y), y)])]
