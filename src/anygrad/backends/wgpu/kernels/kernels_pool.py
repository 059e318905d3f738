"""Pooling lowerings (WGSL), 1-D and 2-D (a 1-D op is a 2-D one with height 1): one invocation
per output (forward) or per input element (gradients gather over the windows that cover them, so
no atomics and the sums are deterministic). Max pools take four neighbours along a row an
invocation where the row is a multiple of 4 long (`_lanes_fit`). Inputs of rank > 4 go to
kernels_pool_nd.py.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from ....ir.graph import Graph, Node
from .gemm_spec import u
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .kernels_gemm import static_shape
from .kernels_pool_nd import LOWEST, POOL_ND
from .wgsl import bindings, flat_id, shader, vtype
from .wgsl import grid as thread_grid
from .windows import Geo, flat_kernel, gather_forward, geometry

NEG_INF = "bitcast<f32>(0xff800000u)"


def _pool_geo(node: Node, x_shape) -> Geo:
    return geometry(node, tuple(x_shape))


def _out_coords(g: Geo, i: str = "i") -> str:
    """img, ch, oy, ox of flat output `i`, and base: its input plane's first element."""
    return (f"let img = {i} / {u(g.C * g.P)}; let ch = ({i} / {u(g.P)}) % {u(g.C)}; "
            f"let pix = {i} % {u(g.P)}; let oy = pix / {u(g.OW)}; let ox = pix % {u(g.OW)}; "
            f"let base = (img * {u(g.C)} + ch) * {u(g.HW)};")


def _in_coords(g: Geo, i: str = "i") -> str:
    """img, ch, pix (iy, ix) of flat input `i`, and the first elements of its input and output planes."""
    return (f"let img = {i} / {u(g.C * g.HW)}; let ch = ({i} / {u(g.HW)}) % {u(g.C)}; "
            f"let pix = {i} % {u(g.HW)}; let iy = pix / {u(g.W)}; let ix = pix % {u(g.W)}; "
            f"let base = (img * {u(g.C)} + ch) * {u(g.HW)}; let obase = (img * {u(g.C)} + ch) * {u(g.P)};")


def _windows_over(g: Geo, inner: str) -> str:
    """Run `inner` for every output window (oy, ox) whose tap (ky, kx) lands on input (iy, ix)."""
    return f"""
  for (var ky = 0u; ky < {u(g.kh)}; ky = ky + 1u) {{
    let ty = i32(iy + {u(g.ph)}) - i32(ky * {u(g.dh)});
    if (ty < 0 || u32(ty) % {u(g.sh)} != 0u || u32(ty) / {u(g.sh)} >= {u(g.OH)}) {{ continue; }}
    let oy = u32(ty) / {u(g.sh)};
    for (var kx = 0u; kx < {u(g.kw)}; kx = kx + 1u) {{
      let tx = i32(ix + {u(g.pw)}) - i32(kx * {u(g.dw)});
      if (tx < 0 || u32(tx) % {u(g.sw)} != 0u || u32(tx) / {u(g.sw)} >= {u(g.OW)}) {{ continue; }}
      let ox = u32(tx) / {u(g.sw)};
{inner}
    }}
  }}"""


def _argmax_fn(g: Geo) -> str:
    """First maximum (row-major taps, strict >) of window (oy, ox) as a flat input pixel."""
    return f"""
fn first_max(base: u32, oy: u32, ox: u32) -> u32 {{
  var best = {NEG_INF};
  var arg = 0xffffffffu;
  for (var ky = 0u; ky < {u(g.kh)}; ky = ky + 1u) {{
    let yy = i32(oy * {u(g.sh)} + ky * {u(g.dh)}) - {g.ph};
    if (yy < 0 || yy >= {g.H}) {{ continue; }}
    for (var kx = 0u; kx < {u(g.kw)}; kx = kx + 1u) {{
      let xx = i32(ox * {u(g.sw)} + kx * {u(g.dw)}) - {g.pw};
      if (xx < 0 || xx >= {g.W}) {{ continue; }}
      let p = u32(yy) * {u(g.W)} + u32(xx);
      let v = X[base + p];
      if (arg == 0xffffffffu || v > best) {{ best = v; arg = p; }}
    }}
  }}
  return arg;
}}"""


@lowering("MaxPool")
def lower_max_pool(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    if len(static_shape(graph, node.inputs[0], node)) > 4:
        return POOL_ND[node.op](node, graph)
    g = _pool_geo(node, static_shape(graph, node.inputs[0], node))
    ty = vtype(graph, node.inputs[0])  # integer pools too: as f32 their bits are denormals a GPU flushes
    if _lanes_fit(g.OW, g.B * g.C * g.P, _span(g)):
        return [_max_pool_lanes(node, g, ty)]
    pre, valid = gather_forward(g)
    body = f"""  {_out_coords(g)}
  var best = {LOWEST[ty]};
  for (var ky = 0u; ky < {u(g.kh)}; ky = ky + 1u) {{
    for (var kx = 0u; kx < {u(g.kw)}; kx = kx + 1u) {{
      {pre}
      if ({valid}) {{ best = max(best, X[base + u32(yy) * {u(g.W)} + u32(xx)]); }}
    }}
  }}
  Y[i] = best;"""
    return [flat_kernel("MaxPool", [node.inputs[0]], ["X"], node.outputs[0], "Y", g.B * g.C * g.P, body, caps,
                        ty=ty)]


@lowering("MaxPoolGrad")
def lower_max_pool_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """Two gathers: each window's first maximum once (one invocation per output), then each input
    element sums the dy of the windows covering it whose maximum it is. Work O(outputs x taps +
    inputs x taps), not a window's maximum recomputed for every input it covers. Each gather takes
    four elements an invocation where its rows allow (`_lanes_fit`), else one."""
    if len(static_shape(graph, node.inputs[1], node)) > 4:
        return POOL_ND[node.op](node, graph)
    dy, x = node.inputs[0], node.inputs[1]
    g = _pool_geo(node, static_shape(graph, x, node))
    arg = f"maxpool.arg.{node.outputs[0]}"
    sc = (Scratch(arg, g.B * g.C * g.P, "u32"),)
    n_out, n_in = g.B * g.C * g.P, g.B * g.C * g.HW
    first = (_argmax_lanes(g, x, arg, sc) if _lanes_fit(g.OW, n_out, _span(g))
             else _argmax_scalar(g, x, arg, sc))
    second = (_gather_lanes(g, dy, arg, node.outputs[0], sc) if _lanes_fit(g.W, n_in)
              else _gather_scalar(g, dy, arg, node.outputs[0], sc))
    return [first, second]


def _argmax_scalar(g: Geo, x: str, arg: str, sc: tuple[Scratch, ...]) -> Kernel:
    n_out = g.B * g.C * g.P
    body = f"  {flat_id()}\n  if (i >= {u(n_out)}) {{ return; }}\n  {_out_coords(g)}\n  ARG[i] = first_max(base, oy, ox);"
    return Kernel("MaxPoolGrad:argmax", shader(bindings([("X", "f32")], [("ARG", "u32")]), body,
                                               helpers=_argmax_fn(g)), thread_grid(n_out), (x,), (arg,), scratch=sc)


def _gather_scalar(g: Geo, dy: str, arg: str, dx: str, sc: tuple[Scratch, ...]) -> Kernel:
    n_in = g.B * g.C * g.HW
    inner = f"      let o = obase + oy * {u(g.OW)} + ox; if (ARG[o] == pix) {{ acc = acc + DY[o]; }}"
    body = (f"  {flat_id()}\n  if (i >= {u(n_in)}) {{ return; }}\n  {_in_coords(g)}\n  var acc = 0.0;"
            f"{_windows_over(g, inner)}\n  DX[i] = acc;")
    return Kernel("MaxPoolGrad:gather", shader(bindings([("DY", "f32"), ("ARG", "u32")], [("DX", "f32")]), body),
                  thread_grid(n_in), (dy, arg), (dx,), scratch=sc)


# -- max pools four elements along a row an invocation ---------------------------------------------
# One element an invocation ran the ResNet-50 stem's pool (3x3 stride 2) on an H200 (4.8 TB/s) at
# 1.5 TB/s forward and 0.66 TB/s in the gradient's gather: each element redid the window arithmetic
# and reloaded what its neighbours load. Four neighbours along a row share it: their windows overlap,
# so each input column (forward) or window (gather) is loaded once for all four, and the four
# results leave in one vec4 store. Each lane keeps the scalar kernel's order (taps row-major for the
# maximum and the first maximum, windows in the scalar gather's order for the sums), so the bits
# match it. Rows that do not fit (_lanes_fit) keep one element an invocation.
LANES = 4
MAX_SPAN = 32   # input columns under four neighbouring windows that one invocation holds at most
NO_ARG = "0xffffffffu"


def _span(g: Geo) -> int:
    """Input columns from the first tap of output column ox to the last of ox + 3."""
    return (LANES - 1) * g.sw + (g.kw - 1) * g.dw + 1


def _lanes_fit(width: int, total: int, span: int = 1) -> bool:
    """Whether an invocation takes four elements of rows `width` long: whole vec4s that never
    straddle rows (width % 4 == 0), something to store (a vec4 binding of an empty value's
    placeholder fails validation), and a span its registers hold."""
    return width % LANES == 0 and total > 0 and span <= MAX_SPAN


def _lane_taps(g: Geo, tap: Callable[[int, int], str]) -> str:
    """For outputs (oy, ox + lane), lane < 4: each window row's input columns x0 + c are loaded
    once (v{c}; ok{c}: inside the input), then tap(lane, c) runs for each lane's taps in the scalar
    kernels' order (ky, then kx ascending). A column outside the input loads a clamped address
    instead: the shaders run without bounds checks."""
    cols = sorted({lane * g.sw + kx * g.dw for lane in range(LANES) for kx in range(g.kw)})
    loads = "\n".join(f"    let ok{c} = x0 + {c} >= 0 && x0 + {c} < {g.W}; "
                      f"let v{c} = X[row + u32(clamp(x0 + {c}, 0, {g.W - 1}))];" for c in cols)
    taps = "\n".join("    " + tap(lane, lane * g.sw + kx * g.dw) for kx in range(g.kw) for lane in range(LANES))
    return f"""  let x0 = i32(ox * {u(g.sw)}) - {g.pw};
  for (var ky = 0u; ky < {u(g.kh)}; ky = ky + 1u) {{
    let yy = i32(oy * {u(g.sh)} + ky * {u(g.dh)}) - {g.ph};
    if (yy < 0 || yy >= {g.H}) {{ continue; }}
    let row = base + u32(yy) * {u(g.W)};
{loads}
{taps}
  }}"""


def _lanes_body(g: Geo, init: str, taps: str, store: str) -> str:
    """Invocation i takes outputs 4i .. 4i + 3 (one row: OW % 4 == 0)."""
    n = g.B * g.C * g.P // LANES
    return (f"  {flat_id()}\n  if (i >= {u(n)}) {{ return; }}\n  {_out_coords(g, f'(i * {u(LANES)})')}\n"
            f"{init}\n{taps}\n  {store}")


def _lane_vars(decl: str) -> str:
    return "\n".join("  " + decl.format(lane=lane) for lane in range(LANES))


def _lanes_vec(ty: str, var: str) -> str:
    return f"vec4<{ty}>({', '.join(f'{var}{lane}' for lane in range(LANES))})"


def _max_pool_lanes(node: Node, g: Geo, ty: str) -> Kernel:
    body = _lanes_body(g, _lane_vars(f"var b{{lane}} = {LOWEST[ty]};"),
                       _lane_taps(g, lambda lane, c: f"if (ok{c}) {{ b{lane} = max(b{lane}, v{c}); }}"),
                       f"Y[i] = {_lanes_vec(ty, 'b')};")
    return Kernel("MaxPool", shader(bindings([("X", ty)], [("Y", f"vec4<{ty}>")]), body),
                  thread_grid(g.B * g.C * g.P // LANES), (node.inputs[0],), (node.outputs[0],))


def _argmax_lanes(g: Geo, x: str, arg: str, sc: tuple[Scratch, ...]) -> Kernel:
    """first_max of four neighbouring windows: strict >, the first valid tap taken whatever it holds."""
    def tap(lane: int, c: int) -> str:
        return (f"if (ok{c} && (a{lane} == {NO_ARG} || v{c} > m{lane})) {{ m{lane} = v{c}; "
                f"a{lane} = u32(yy) * {u(g.W)} + u32(x0 + {c}); }}")
    body = _lanes_body(g, _lane_vars(f"var m{{lane}} = {NEG_INF}; var a{{lane}} = {NO_ARG};"),
                       _lane_taps(g, tap), f"ARG[i] = {_lanes_vec('u32', 'a')};")
    return Kernel("MaxPoolGrad:argmax", shader(bindings([("X", "f32")], [("ARG", "vec4<u32>")]), body),
                  thread_grid(g.B * g.C * g.P // LANES), (x,), (arg,), scratch=sc)


def _gather_lanes(g: Geo, dy: str, arg: str, dx: str, sc: tuple[Scratch, ...]) -> Kernel:
    """dx of inputs (iy, ix + lane): the windows that may cover any of the four, each loaded once.

    An element's sum takes a window's dy only if the window's argmax is that element, which already
    implies the window covers it; so the candidates can be a plain block of windows (rows and
    columns whose taps could reach the four), visited bottom-right to top-left: the order in which
    the scalar gather meets them (ky, kx ascending), so each lane's sum adds the same terms in the
    same order. A lane whose argmax differs keeps its sum untouched (select, not a + 0.0)."""
    n = g.B * g.C * g.HW // LANES
    body = f"""  {flat_id()}
  if (i >= {u(n)}) {{ return; }}
  {_in_coords(g, f"(i * {u(LANES)})")}
  let pix4 = vec4<u32>(pix) + vec4<u32>(0u, 1u, 2u, 3u);
  {_candidates("oy", "iy", g.ph - (g.kh - 1) * g.dh, g.ph, g.sh, g.OH)}
  {_candidates("ox", "ix", g.pw - (g.kw - 1) * g.dw, g.pw + LANES - 1, g.sw, g.OW)}
  var acc = vec4<f32>(0.0);
  for (var oy = oy_hi; oy >= oy_lo; oy = oy - 1) {{
    let orow = obase + u32(oy) * {u(g.OW)};
    for (var ox = ox_hi; ox >= ox_lo; ox = ox - 1) {{
      let o = orow + u32(ox);
      acc = select(acc, acc + DY[o], vec4<u32>(ARG[o]) == pix4);
    }}
  }}
  DX[i] = acc;"""
    return Kernel("MaxPoolGrad:gather", shader(bindings([("DY", "f32"), ("ARG", "u32")], [("DX", "vec4<f32>")]),
                                               body), thread_grid(n), (dy, arg), (dx,), scratch=sc)


def _candidates(v: str, coord: str, first: int, last: int, stride: int, out: int) -> str:
    """WGSL defining {v}_lo, {v}_hi (i32): the outputs along one axis whose taps can land on padded
    positions coord + first .. coord + last, clamped to the outputs: ceil((coord + first) / stride)
    .. floor((coord + last) / stride), both computed on non-negative numbers."""
    return (f"let {v}_lo = max(i32({coord}) + {first + stride - 1}, 0) / {stride}; "
            f"let {v}_hi = min((i32({coord}) + {last}) / {stride}, {out - 1});")


def _count_fns(g: Geo, include_pad: bool) -> str:
    """Divisor of window (oy, ox): taps inside the input (or inside input + explicit pads), per dim."""
    lo_y, hi_y = (0, g.H + g.ph + g.eh) if include_pad else (g.ph, g.ph + g.H)
    lo_x, hi_x = (0, g.W + g.pw + g.ew) if include_pad else (g.pw, g.pw + g.W)
    return f"""
fn count(oy: u32, ox: u32) -> f32 {{
  var cy = 0u;
  for (var ky = 0u; ky < {u(g.kh)}; ky = ky + 1u) {{
    let yy = oy * {u(g.sh)} + ky * {u(g.dh)};
    if (yy >= {u(lo_y)} && yy < {u(hi_y)}) {{ cy = cy + 1u; }}
  }}
  var cx = 0u;
  for (var kx = 0u; kx < {u(g.kw)}; kx = kx + 1u) {{
    let xx = ox * {u(g.sw)} + kx * {u(g.dw)};
    if (xx >= {u(lo_x)} && xx < {u(hi_x)}) {{ cx = cx + 1u; }}
  }}
  return f32(max(cy * cx, 1u));
}}"""


def _with_fns(k: Kernel, fns: str) -> Kernel:
    return Kernel(k.name, k.wgsl.replace("@compute", fns + "\n@compute", 1), k.workgroups, k.reads, k.writes)


@lowering("AveragePool")
def lower_average_pool(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    if len(static_shape(graph, node.inputs[0], node)) > 4:
        return POOL_ND[node.op](node, graph)
    g = _pool_geo(node, static_shape(graph, node.inputs[0], node))
    pre, valid = gather_forward(g)
    body = f"""  {_out_coords(g)}
  var acc = 0.0;
  for (var ky = 0u; ky < {u(g.kh)}; ky = ky + 1u) {{
    for (var kx = 0u; kx < {u(g.kw)}; kx = kx + 1u) {{
      {pre}
      if ({valid}) {{ acc = acc + X[base + u32(yy) * {u(g.W)} + u32(xx)]; }}
    }}
  }}
  Y[i] = acc / count(oy, ox);"""
    k = flat_kernel("AveragePool", [node.inputs[0]], ["X"], node.outputs[0], "Y", g.B * g.C * g.P, body, caps)
    return [_with_fns(k, _count_fns(g, bool(node.attr("count_include_pad", 0))))]


@lowering("AveragePoolGrad")
def lower_average_pool_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    if len(node.attr("input_shape")) > 4:
        return POOL_ND[node.op](node, graph)
    g = _pool_geo(node, tuple(int(d) for d in node.attr("input_shape")))
    inner = f"      acc = acc + DY[obase + oy * {u(g.OW)} + ox] / count(oy, ox);"
    body = f"  {_in_coords(g)}\n  var acc = 0.0;{_windows_over(g, inner)}\n  DX[i] = acc;"
    k = flat_kernel("AveragePoolGrad", [node.inputs[0]], ["DY"], node.outputs[0], "DX", g.B * g.C * g.HW,
                    body, caps)
    return [_with_fns(k, _count_fns(g, bool(node.attr("count_include_pad", 0))))]


@lowering("GlobalAveragePool")
def lower_global_average_pool(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    xs = static_shape(graph, node.inputs[0], node)
    rows, n = xs[0] * xs[1], math.prod(xs[2:])
    body = f"""  var acc = 0.0;
  for (var p = 0u; p < {u(n)}; p = p + 1u) {{ acc = acc + X[i * {u(n)} + p]; }}
  Y[i] = acc / {float(n)!r};"""
    return [flat_kernel("GlobalAveragePool", [node.inputs[0]], ["X"], node.outputs[0], "Y", rows, body, caps)]
