"""GridSample / GridSampleGrad and Col2Im / Col2ImGrad (im2col), over any number of spatial
dims, and RoiAlign and DeformConv (formulas: anygrad/ops/image.py, ops/detection.py).

No float atomics in WGSL, so sums over runtime or overlapping positions are gathers or owned
slices: Col2Im gathers, per image element, every (kernel offset, block) that lands on it;
GridSample's image gradient gives each (image, channel) one invocation that owns its slice.
"""
from __future__ import annotations

import math

from ....ir.graph import Graph, Node
from ....ops.image import col2im_blocks
from .kernel import AdapterCaps, Kernel, lowering
from .kernels_index import _coords, _kernel
from .wgsl import shape_of, strides, vtype


def _geometry(node: Node, graph: Graph, cols: str, image_in: str, block_in: str):
    infos = [graph.info[cols], graph.info[image_in], graph.info[block_in]]
    return col2im_blocks(node, infos)


@lowering("Col2Im")
def lower_col2im(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    bl = _geometry(node, graph, *node.inputs[:3])
    out = shape_of(graph, y)
    nd = len(bl.image)
    kst, bst = strides(bl.kernel), strides(bl.counts)
    kprod, bprod = math.prod(bl.kernel), math.prod(bl.counts)
    lines = [f"  let nc = i / {math.prod(bl.image)}u;", f"  let pix = i % {math.prod(bl.image)}u;",
             f"  {_coords('pix', bl.image, 'c')}", "  var acc = 0.0;"]
    indent = "  "
    for d in range(nd):
        lines += [f"{indent}for (var k{d} = 0u; k{d} < {bl.kernel[d]}u; k{d} += 1u) {{",
                  f"{indent}  let t{d} = i32(c{d} + {bl.pads[d]}u) - i32(k{d} * {bl.dilations[d]}u);",
                  (f"{indent}  if (t{d} < 0 || u32(t{d}) % {bl.strides[d]}u != 0u || "
                   f"u32(t{d}) / {bl.strides[d]}u >= {bl.counts[d]}u) {{ continue; }}"),
                  f"{indent}  let b{d} = u32(t{d}) / {bl.strides[d]}u;"]
        indent += "  "
    kflat = " + ".join(f"k{d} * {kst[d]}u" for d in range(nd))
    bflat = " + ".join(f"b{d} * {bst[d]}u" for d in range(nd))
    lines.append(f"{indent}acc += x[(nc * {kprod}u + {kflat}) * {bprod}u + {bflat}];")
    for _ in range(nd):
        indent = indent[:-2]
        lines.append(f"{indent}}}")
    lines.append("  y[i] = acc;")
    ty = vtype(graph, x)
    return [_kernel("Col2Im", math.prod(out), "\n".join(lines), [("x", ty, x)], [("y", ty, y)])]


@lowering("Col2ImGrad")
def lower_col2im_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dy, x = node.inputs[:2]
    bl = _geometry(node, graph, x, node.inputs[2], node.inputs[3])
    nd = len(bl.image)
    kprod, bprod = math.prod(bl.kernel), math.prod(bl.counts)
    ist = strides(bl.image)
    lines = [f"  let nc = i / {kprod * bprod}u;", f"  let kf = (i / {bprod}u) % {kprod}u;", f"  let bf = i % {bprod}u;",
             f"  {_coords('kf', bl.kernel, 'k')}", f"  {_coords('bf', bl.counts, 'b')}", "  var inside = true;",
             "  var at = 0u;"]
    for d in range(nd):
        lines += [f"  let p{d} = i32(k{d} * {bl.dilations[d]}u + b{d} * {bl.strides[d]}u) - {bl.pads[d]};",
                  f"  inside = inside && p{d} >= 0 && p{d} < {bl.image[d]};",
                  f"  at += u32(max(p{d}, 0)) * {ist[d]}u;"]
    lines.append(f"  y[i] = select(0.0, dy[nc * {math.prod(bl.image)}u + at], inside);")
    return [_kernel("Col2ImGrad", math.prod(shape_of(graph, x)), "\n".join(lines), [("dy", "f32", dy)],
                    [("y", "f32", node.outputs[0])])]


# -- GridSample ----------------------------------------------------------------------------------
# Per spatial dim a WGSL function maps a grid value and a tap number to the input index, the
# tap's weight and d weight / d coordinate, whether it reads inside (zeros padding) and
# d coordinate / d grid value: the plan `_grid_taps` builds with numpy, per point.
_TAP_STRUCT = "struct Tap { idx: i32, w: f32, dw: f32, ok: f32, dc: f32 }"
_REFLECT = """fn reflect(x: f32, lo: f32, hi: f32) -> vec2<f32> {
  let span = hi - lo;
  let below = x < lo;
  let above = x > hi;
  let dist = select(x - hi, lo - x, below);
  let n = select(0.0, trunc(dist / span), span > 0.0);
  let r = dist - n * span;
  let even = n - 2.0 * floor(n / 2.0) == 0.0;
  let v = select(select(x, select(lo + r, hi - r, even), above), select(hi - r, lo + r, even), below);
  let s = select(select(1.0, select(1.0, -1.0, even), above), select(1.0, -1.0, even), below);
  return vec2<f32>(v, s);
}"""
_CUBIC_W = """fn cubic_near(s: f32) -> vec2<f32> {
  let a = -0.75;
  return vec2<f32>(((a + 2.0) * s - (a + 3.0)) * s * s + 1.0, (3.0 * (a + 2.0) * s - 2.0 * (a + 3.0)) * s);
}
fn cubic_far(s: f32) -> vec2<f32> {
  let a = -0.75;
  return vec2<f32>(((a * s - 5.0 * a) * s + 8.0 * a) * s - 4.0 * a, (3.0 * a * s - 10.0 * a) * s + 8.0 * a);
}"""


def _grid_attrs(node: Node) -> tuple[str, str, bool, int]:
    from ....ops.image import MODES

    def text(key, default):
        v = node.attr(key, default)
        return v.decode() if isinstance(v, bytes) else str(v)
    mode = MODES.get(text("mode", "linear"))
    padding = text("padding_mode", "zeros")
    if mode is None or padding not in ("zeros", "border", "reflection"):
        raise ValueError(f"mode '{node.attr('mode')}' / padding_mode '{padding}'")
    return mode, padding, bool(node.attr("align_corners", 0)), {"nearest": 1, "linear": 2, "cubic": 4}[mode]


def _tap_fn(d: int, size: int, mode: str, padding: str, align: bool) -> str:
    f = float
    coord = f"(g + 1.0) / 2.0 * {f(size - 1)}" if align else f"((g + 1.0) * {f(size)} - 1.0) / 2.0"
    dc = f(size - 1) / 2 if align else f(size) / 2
    lo, hi = (0.0, f(size - 1)) if align else (-0.5, f(size) - 0.5)
    top = f(size - 1)
    lines = [f"fn tap{d}(g: f32, t: u32) -> Tap {{", f"  var x = {coord};", f"  var dc = {dc};"]
    if mode == "nearest":
        lines += ["  x = round(x);", "  dc = 0.0;"]
    if padding == "border":
        lines.append(f"  if (x < {lo} || x > {hi}) {{ dc = 0.0; x = clamp(x, 0.0, {top}); }}")
    elif padding == "reflection":
        lines += [f"  let rf = reflect(x, {lo}, {hi});", "  x = rf.x;", "  dc = dc * rf.y;"]
    lines += ["  var base = floor(x);", "  let fr = x - base;", "  var off = 0.0;", "  var w = 1.0;", "  var dw = 0.0;"]
    if mode == "nearest":
        lines.append("  base = x;")
    elif mode == "linear":
        lines.append("  if (t == 0u) { w = 1.0 - fr; dw = -1.0; } else { off = 1.0; w = fr; dw = 1.0; }")
    else:
        lines += ["  var c = vec2<f32>(0.0);",
                  "  if (t == 0u) { off = -1.0; c = cubic_far(fr + 1.0); }",
                  "  else if (t == 1u) { c = cubic_near(fr); }",
                  "  else if (t == 2u) { off = 1.0; c = cubic_near(1.0 - fr); c.y = -c.y; }",
                  "  else { off = 2.0; c = cubic_far(2.0 - fr); c.y = -c.y; }",
                  "  w = c.x;", "  dw = c.y;"]
    lines += ["  var idx = base + off;", "  var ok = 1.0;"]
    if padding == "zeros":
        lines.append(f"  ok = select(0.0, 1.0, idx >= 0.0 && idx <= {top});")
    elif padding == "border":
        lines.append(f"  idx = clamp(idx, 0.0, {top});")
    else:
        lines.append(f"  idx = trunc(reflect(idx, {lo}, {hi}).x);")
    lines += [f"  idx = clamp(idx, 0.0, {top});", "  return Tap(i32(idx), w, dw, ok, dc);", "}"]
    return "\n".join(lines)


def _grid_helpers(node: Node, dims: tuple[int, ...]) -> tuple[str, int]:
    mode, padding, align, taps = _grid_attrs(node)
    parts = [_TAP_STRUCT, _REFLECT, _CUBIC_W] + [_tap_fn(d, s, mode, padding, align) for d, s in enumerate(dims)]
    return "\n".join(parts), taps


def _combos(nd: int, taps: int, grid_base: str, inner: str, indent: str = "  ") -> list[str]:
    """Nested loops over one tap per dim: T{d} holds dim d's Tap; `inner` runs in the middle."""
    lines = []
    for d in range(nd):
        pad = indent + "  " * d
        lines += [f"{pad}for (var t{d} = 0u; t{d} < {taps}u; t{d} += 1u) {{",
                  f"{pad}  let T{d} = tap{d}(gr[{grid_base} + {nd - 1 - d}u], t{d});"]
    lines += [indent + "  " * nd + line for line in inner.split("\n")]
    for d in reversed(range(nd)):
        lines.append(indent + "  " * d + "}")
    return lines


def _sample_geometry(graph: Graph, x: str, grid: str):
    xs, gs = shape_of(graph, x), shape_of(graph, grid)
    dims = xs[2:]
    return xs[0], xs[1], dims, math.prod(dims), math.prod(gs[1:-1]), len(dims)


def _offset(dims) -> str:
    st = strides(dims)
    return " + ".join(f"u32(T{d}.idx) * {s}u" for d, s in enumerate(st))


@lowering("GridSample")
def lower_grid_sample(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, grid = node.inputs[:2]
    n, c, dims, s, p, nd = _sample_geometry(graph, x, grid)
    helpers, taps = _grid_helpers(node, dims)
    ok = " * ".join(f"T{d}.ok" for d in range(nd))
    w = " * ".join(f"T{d}.w" for d in range(nd))
    body = [f"  let nc = i / {p}u;", f"  let pt = i % {p}u;", f"  let gb = ((nc / {c}u) * {p}u + pt) * {nd}u;",
            "  var acc = 0.0;"]
    body += _combos(nd, taps, "gb", f"acc += {w} * {ok} * x[nc * {s}u + {_offset(dims)}];")
    body.append("  y[i] = acc;")
    return [_kernel("GridSample", n * c * p, "\n".join(body), [("x", "f32", x), ("gr", "f32", grid)],
                    [("y", "f32", node.outputs[0])], helpers=helpers)]


@lowering("GridSampleGrad")
def lower_grid_sample_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """d x: one invocation per (image, channel) walks every output point and adds into its own
    slice (no two invocations touch one element); d grid: one invocation per output point."""
    dy, x, grid = node.inputs[:3]
    dx, dgrid = (list(node.outputs) + ["", ""])[:2]
    n, c, dims, s, p, nd = _sample_geometry(graph, x, grid)
    helpers, taps = _grid_helpers(node, dims)
    ok = " * ".join(f"T{d}.ok" for d in range(nd))
    w = " * ".join(f"T{d}.w" for d in range(nd))
    kernels = []
    if dx:
        body = [f"  let gbase = (i / {c}u) * {p}u;",
                f"  for (var e = 0u; e < {s}u; e += 1u) {{ dxo[i * {s}u + e] = 0.0; }}",
                f"  for (var pt = 0u; pt < {p}u; pt += 1u) {{",
                f"    let g = dy[i * {p}u + pt];", f"    let gb = (gbase + pt) * {nd}u;"]
        body += _combos(nd, taps, "gb", f"dxo[i * {s}u + {_offset(dims)}] += {w} * {ok} * g;", indent="    ")
        body.append("  }")
        kernels.append(_kernel("GridSampleGrad:dx", n * c, "\n".join(body), [("dy", "f32", dy), ("gr", "f32", grid)],
                               [("dxo", "f32", dx)], helpers=helpers))
    if dgrid:
        inner = ["var along = 0.0;",
                 f"for (var ch = 0u; ch < {c}u; ch += 1u) {{",
                 f"  let nc = (i / {p}u) * {c}u + ch;",
                 f"  along += dy[nc * {p}u + i % {p}u] * x[nc * {s}u + {_offset(dims)}];", "}"]
        for d in range(nd):
            others = " * ".join(f"T{j}.w" for j in range(nd) if j != d) or "1.0"
            inner.append(f"acc[{nd - 1 - d}] += along * {ok} * {others} * T{d}.dw * T{d}.dc;")
        body = [f"  var acc: array<f32, {nd}>;", f"  let gb = i * {nd}u;"]
        body += _combos(nd, taps, "gb", "\n".join(inner))
        body += [f"  for (var k = 0u; k < {nd}u; k += 1u) {{ dg[gb + k] = acc[k]; }}"]
        kernels.append(_kernel("GridSampleGrad:dgrid", n * p, "\n".join(body),
                               [("dy", "f32", dy), ("x", "f32", x), ("gr", "f32", grid)], [("dg", "f32", dgrid)],
                               helpers=helpers))
    return kernels


# -- RoiAlign (formulas: anygrad/ops/detection.py) ----------------------------------------------------
_ROI_AXIS = """fn roi_axis(pos0: f32, size: u32) -> vec4<f32> {
  // (low index, high index, weight of high, valid) of one sample coordinate
  let valid = pos0 >= -1.0 && pos0 <= f32(size);
  var pos = max(pos0, 0.0);
  var low = floor(pos);
  var high = low + 1.0;
  if (low >= f32(size) - 1.0) { low = f32(size) - 1.0; high = low; pos = low; }
  return vec4<f32>(low, high, pos - low, select(0.0, 1.0, valid));
}"""


@lowering("RoiAlign")
def lower_roi_align(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, rois, batch = node.inputs[:3]
    y = node.outputs[0]
    _, c, height, width = shape_of(graph, x)
    nr, _, oh, ow = shape_of(graph, y)

    def text(key, default):
        v = node.attr(key, default)
        return v.decode() if isinstance(v, bytes) else str(v)
    mode = text("mode", "avg")
    if mode not in ("avg", "max"):
        raise ValueError(f"mode '{mode}'")
    ratio, scale = int(node.attr("sampling_ratio", 0)), float(node.attr("spatial_scale", 1.0))
    half = text("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    f = float
    body = f"""  let n = i / {c * oh * ow}u; let ch = (i / {oh * ow}u) % {c}u;
  let py = (i / {ow}u) % {oh}u; let px = i % {ow}u;
  let base = (u32(bi[n]) * {c}u + ch) * {height * width}u;
  let x0 = rois[n * 4u] * {f(scale)} - {0.5 if half else 0.0};
  let y0 = rois[n * 4u + 1u] * {f(scale)} - {0.5 if half else 0.0};
  var rw = rois[n * 4u + 2u] * {f(scale)} - {0.5 if half else 0.0} - x0;
  var rh = rois[n * 4u + 3u] * {f(scale)} - {0.5 if half else 0.0} - y0;
  {"" if half else "rw = max(rw, 1.0); rh = max(rh, 1.0);"}
  let gh = {f"{ratio}u" if ratio > 0 else f"u32(max(ceil(rh / {f(oh)}), 0.0))"};
  let gw = {f"{ratio}u" if ratio > 0 else f"u32(max(ceil(rw / {f(ow)}), 0.0))"};
  let bh = rh / {f(oh)}; let bw = rw / {f(ow)};
  var acc = {"0.0" if mode == "avg" else "bitcast<f32>(0xff800000u)"};
  for (var iy = 0u; iy < gh; iy += 1u) {{
    let ay = roi_axis(y0 + f32(py) * bh + (f32(iy) + 0.5) * bh / f32(gh), {height}u);
    for (var ix = 0u; ix < gw; ix += 1u) {{
      let ax = roi_axis(x0 + f32(px) * bw + (f32(ix) + 0.5) * bw / f32(gw), {width}u);
      let ok = ay.w * ax.w;
      let ylo = u32(ay.x) * {width}u; let yhi = u32(ay.y) * {width}u;
      let t0 = x[base + ylo + u32(ax.x)] * (1.0 - ay.z) * (1.0 - ax.z) * ok;
      let t1 = x[base + ylo + u32(ax.y)] * (1.0 - ay.z) * ax.z * ok;
      let t2 = x[base + yhi + u32(ax.x)] * ay.z * (1.0 - ax.z) * ok;
      let t3 = x[base + yhi + u32(ax.y)] * ay.z * ax.z * ok;
      {"acc += t0 + t1 + t2 + t3;" if mode == "avg" else "acc = max(acc, max(max(t0, t1), max(t2, t3)));"}
    }}
  }}
  y[i] = {"acc / f32(max(gh * gw, 1u))" if mode == "avg" else "acc"};"""
    return [_kernel("RoiAlign", nr * c * oh * ow, body,
                    [("x", "f32", x), ("rois", "f32", rois), ("bi", vtype(graph, batch), batch)], [("y", "f32", y)],
                    helpers=_ROI_AXIS)]


# -- DeformConv (2-D; formulas: anygrad/ops/image.py) ----------------------------------------------
@lowering("DeformConv")
def lower_deform_conv(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One invocation per output: every tap samples its channel bilinearly (zeros outside) at its
    learned offset, times the mask, times the weight."""
    x, w, offset = node.inputs[:3]
    bias, mask = node.input(3), node.input(4)
    xs, ws = shape_of(graph, x), shape_of(graph, w)
    if len(xs) != 4:
        raise ValueError("2-D DeformConv only")
    n, c, height, width = xs
    oc, cg, kh, kw = ws
    group, og = int(node.attr("group", 1)), int(node.attr("offset_group", 1))
    sh, sw = node.attr("strides") or [1, 1]
    dh, dw = node.attr("dilations") or [1, 1]
    pads = node.attr("pads") or [0, 0, 0, 0]
    oh, ow = shape_of(graph, offset)[2:]
    P = oh * ow
    body = f"""  let img = i / {oc * P}u; let o = (i / {P}u) % {oc}u; let pix = i % {P}u;
  let py = pix / {ow}u; let px = pix % {ow}u;
  let grp = o / {oc // group}u;
  var acc = {"B[o]" if bias else "0.0"};
  for (var ci = 0u; ci < {cg}u; ci += 1u) {{
    let ch = grp * {cg}u + ci;
    let ogi = ch / {c // og}u;
    let xb = (img * {c}u + ch) * {height * width}u;
    for (var ki = 0u; ki < {kh}u; ki += 1u) {{
      for (var kj = 0u; kj < {kw}u; kj += 1u) {{
        let tap = ((img * {og}u + ogi) * {kh}u + ki) * {kw}u + kj;
        let h = f32(i32(py * {sh}u + ki * {dh}u) - {pads[0]}) + OFF[(tap * 2u) * {P}u + pix];
        let wv = f32(i32(px * {sw}u + kj * {dw}u) - {pads[1]}) + OFF[(tap * 2u + 1u) * {P}u + pix];
        let h0 = floor(h); let w0 = floor(wv);
        var s = 0.0;
        for (var a = 0u; a < 2u; a += 1u) {{
          for (var b = 0u; b < 2u; b += 1u) {{
            let hi = h0 + f32(a); let wi = w0 + f32(b);
            if (hi >= 0.0 && hi <= {float(height - 1)} && wi >= 0.0 && wi <= {float(width - 1)}) {{
              s += (1.0 - abs(h - hi)) * (1.0 - abs(wv - wi)) * X[xb + u32(hi) * {width}u + u32(wi)];
            }}
          }}
        }}
        {"s = s * M[tap * " + str(P) + "u + pix];" if mask else ""}
        acc += s * W[((o * {cg}u + ci) * {kh}u + ki) * {kw}u + kj];
      }}
    }}
  }}
  y[i] = acc;"""
    reads = [("X", "f32", x), ("W", "f32", w), ("OFF", "f32", offset)]
    reads += [("B", "f32", bias)] if bias else []
    reads += [("M", "f32", mask)] if mask else []
    return [_kernel("DeformConv", n * oc * P, body, reads, [("y", "f32", node.outputs[0])])]
