"""MaxPool / AveragePool and their gradients over any number of spatial dims (kernels_pool.py
sends 3-D pools here; its own kernels handle 1-D and 2-D).

Same scheme as the 2-D kernels: one invocation per output (forward) or per input element
(gradients: it gathers from every window that covers it, so no atomics and deterministic sums;
MaxPoolGrad first finds each window's maximum once, one invocation per output).
Window geometry comes from `anygrad.ops.nn.window`, the code the numpy reference uses.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ....ir.graph import Graph, Node
from ....ops.nn import Window
from .kernel import Kernel, Scratch
from .wgsl import bindings, flat_id, grid, shader, shape_of, vtype

NEG_INF = "bitcast<f32>(0xff800000u)"
LOWEST = {"f32": NEG_INF, "i32": "i32(-2147483647 - 1)", "u32": "0u"}  # the identity of max


def _geo(node: Node, x_shape: tuple[int, ...]):
    return Window.of(node, x_shape[2:])


def _strides(shape) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return out[::-1]


def _coords(var: str, shape, prefix: str) -> str:
    st = _strides(shape)
    return " ".join(f"let {prefix}{d} = ({var} / {s}u) % {e}u;" for d, (e, s) in enumerate(zip(shape, st)))


def _taps(w, body: str, indent: str = "  ") -> str:
    """Nested loops over the window of output (o0, o1, ...): p{d} is the input coordinate, the body
    runs only inside the input."""
    nd = len(w.kernel)
    lines = []
    for d in range(nd):
        pad = indent + "  " * d
        lines.append(f"{pad}for (var k{d} = 0u; k{d} < {w.kernel[d]}u; k{d} += 1u) {{")
        lines.append(f"{pad}  let p{d} = i32(o{d} * {w.strides[d]}u + k{d} * {w.dilations[d]}u) - {w.begin[d]};")
        lines.append(f"{pad}  if (p{d} < 0 || p{d} >= {w.spatial[d]}) {{ continue; }}")
    lines.append(indent + "  " * nd + body)
    for d in reversed(range(nd)):
        lines.append(indent + "  " * d + "}")
    return "\n".join(lines)


def _windows_over(w, body: str, indent: str = "  ") -> str:
    """Nested loops over the windows (o0, o1, ...) whose taps land on input (c0, c1, ...)."""
    nd = len(w.kernel)
    lines = []
    for d in range(nd):
        pad = indent + "  " * d
        lines.append(f"{pad}for (var k{d} = 0u; k{d} < {w.kernel[d]}u; k{d} += 1u) {{")
        lines.append(f"{pad}  let t{d} = i32(c{d} + {w.begin[d]}u) - i32(k{d} * {w.dilations[d]}u);")
        lines.append(f"{pad}  if (t{d} < 0 || u32(t{d}) % {w.strides[d]}u != 0u || u32(t{d}) / {w.strides[d]}u >= "
                     f"{w.out[d]}u) {{ continue; }}")
        lines.append(f"{pad}  let o{d} = u32(t{d}) / {w.strides[d]}u;")
    lines.append(indent + "  " * nd + body)
    for d in reversed(range(nd)):
        lines.append(indent + "  " * d + "}")
    return "\n".join(lines)


def _flat(prefix: str, shape) -> str:
    st = _strides(shape)
    return " + ".join(f"{prefix}{d} * {s}u" for d, s in enumerate(st))


def _position(w) -> str:
    """Flat input position (within one image and channel) of the tap at p0, p1, ..."""
    return " + ".join(f"u32(p{d}) * {s}u" for d, s in enumerate(_strides(w.spatial)))


def _first_max(w) -> str:
    """Flat input position (within one image and channel) of the first maximum of window (o...)."""
    nd = len(w.kernel)
    args = ", ".join(f"o{d}: u32" for d in range(nd))
    loops = _taps(w, f"let q = {_position(w)}; let v = X[base + q]; if (arg == 0xffffffffu || v > best) {{ best = v; arg = q; }}")
    return f"""fn first_max(base: u32, {args}) -> u32 {{
  var best = {NEG_INF};
  var arg = 0xffffffffu;
{loops}
  return arg;
}}"""


def _count_fn(w, include_pad: bool) -> str:
    nd = len(w.kernel)
    args = ", ".join(f"o{d}: u32" for d in range(nd))
    lines = [f"fn count({args}) -> f32 {{", "  var total = 1u;"]
    for d in range(nd):
        lo, hi = (0, w.spatial[d] + w.begin[d] + w.end[d]) if include_pad else (w.begin[d], w.begin[d] + w.spatial[d])
        lines += [f"  var n{d} = 0u;",
                  f"  for (var k = 0u; k < {w.kernel[d]}u; k += 1u) {{",
                  f"    let p = o{d} * {w.strides[d]}u + k * {w.dilations[d]}u;",
                  f"    if (p >= {lo}u && p < {hi}u) {{ n{d} += 1u; }}", "  }",
                  f"  total *= n{d};"]
    lines += ["  return f32(max(total, 1u));", "}"]
    return "\n".join(lines)


def _kernel(name: str, n: int, body: str, reads: list[tuple[str, str]], write: tuple[str, str],
            helpers: str = "", ty: str = "f32", types: tuple[str, ...] = ()) -> Kernel:
    """One invocation per element i < n; every buffer of type `ty`, or `types` (reads, then the write)."""
    types = types or (ty,) * (len(reads) + 1)
    src = shader(bindings([(v, t) for (v, _), t in zip(reads, types)], [(write[0], types[-1])]),
                 f"  {flat_id()}\n  if (i >= {n}u) {{ return; }}\n{body}", helpers=helpers)
    return Kernel(name, src, grid(n), tuple(x for _, x in reads), (write[1],))


def _outer(x_shape) -> int:
    return int(x_shape[0]) * int(x_shape[1])


def max_pool(node: Node, graph: Graph) -> list[Kernel]:
    xs = shape_of(graph, node.inputs[0])
    w = _geo(node, xs)
    P, S = math.prod(w.out), math.prod(w.spatial)
    ty = vtype(graph, node.inputs[0])  # integers compared as integers, as in the 2-D kernel
    body = f"""  let img = i / {P}u; let base = img * {S}u; let pix = i % {P}u;
  {_coords('pix', w.out, 'o')}
  var best = {LOWEST[ty]};
{_taps(w, f"best = max(best, X[base + {_position(w)}]);")}
  Y[i] = best;"""
    return [_kernel("MaxPool[nd]", _outer(xs) * P, body, [("X", node.inputs[0])], ("Y", node.outputs[0]), ty=ty)]


def max_pool_grad(node: Node, graph: Graph) -> list[Kernel]:
    """Each window's first maximum once (per output), then each input gathers the dy of the
    windows covering it whose maximum it is."""
    dy, x = node.inputs[:2]
    xs = shape_of(graph, x)
    w = _geo(node, xs)
    P, S = math.prod(w.out), math.prod(w.spatial)
    args = ", ".join(f"o{d}" for d in range(len(w.kernel)))
    arg = f"maxpool.arg.{node.outputs[0]}"
    sc = (Scratch(arg, _outer(xs) * P, "u32"),)
    body = f"""  let img = i / {P}u; let base = img * {S}u; let pix = i % {P}u;
  {_coords('pix', w.out, 'o')}
  ARG[i] = first_max(base, {args});"""
    first = _kernel("MaxPoolGrad[nd]:argmax", _outer(xs) * P, body, [("X", x)], ("ARG", arg), helpers=_first_max(w),
                    types=("f32", "u32"))
    inner = f"let o = obase + {_flat('o', w.out)}; if (ARG[o] == pix) {{ acc += DY[o]; }}"
    body = f"""  let img = i / {S}u; let obase = img * {P}u; let pix = i % {S}u;
  {_coords('pix', w.spatial, 'c')}
  var acc = 0.0;
{_windows_over(w, inner)}
  DX[i] = acc;"""
    second = _kernel("MaxPoolGrad[nd]:gather", _outer(xs) * S, body, [("DY", dy), ("ARG", arg)],
                     ("DX", node.outputs[0]), types=("f32", "u32", "f32"))
    return [replace(first, scratch=sc), replace(second, scratch=sc)]


def average_pool(node: Node, graph: Graph) -> list[Kernel]:
    xs = shape_of(graph, node.inputs[0])
    w = _geo(node, xs)
    P, S = math.prod(w.out), math.prod(w.spatial)
    args = ", ".join(f"o{d}" for d in range(len(w.kernel)))
    body = f"""  let img = i / {P}u; let base = img * {S}u; let pix = i % {P}u;
  {_coords('pix', w.out, 'o')}
  var acc = 0.0;
{_taps(w, f"acc += X[base + {_position(w)}];")}
  Y[i] = acc / count({args});"""
    return [_kernel("AveragePool[nd]", _outer(xs) * P, body, [("X", node.inputs[0])], ("Y", node.outputs[0]),
                    helpers=_count_fn(w, bool(node.attr("count_include_pad", 0))))]


def average_pool_grad(node: Node, graph: Graph) -> list[Kernel]:
    xs = tuple(int(d) for d in node.attr("input_shape"))
    w = _geo(node, xs)
    P, S = math.prod(w.out), math.prod(w.spatial)
    args = ", ".join(f"o{d}" for d in range(len(w.kernel)))
    body = f"""  let img = i / {S}u; let obase = img * {P}u; let pix = i % {S}u;
  {_coords('pix', w.spatial, 'c')}
  var acc = 0.0;
{_windows_over(w, f"acc += DY[obase + {_flat('o', w.out)}] / count({args});")}
  DX[i] = acc;"""
    return [_kernel("AveragePoolGrad[nd]", _outer(xs) * S, body, [("DY", node.inputs[0])], ("DX", node.outputs[0]),
                    helpers=_count_fn(w, bool(node.attr("count_include_pad", 0))))]


# op -> N-D lowering, for kernels_pool.py to call on inputs of rank > 4
POOL_ND = {"MaxPool": max_pool, "MaxPoolGrad": max_pool_grad, "AveragePool": average_pool,
           "AveragePoolGrad": average_pool_grad}
