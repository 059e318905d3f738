"""Convolution and pooling lowerings (WGSL), 1-D and 2-D (a 1-D op is a 2-D one with height 1).

- Conv: implicit GEMM per group (M = output channels, N = batch x output pixels, K = input
  channels x taps); the im2col gather happens inside the GEMM's B loads. Bias and the `_epilogue`
  are applied in the GEMM's store. 1x1 stride-1 unpadded convs skip the window arithmetic (a plain
  batched matmul); depthwise convs (group == C_in == C_out) get a direct kernel.
- ConvGradInput: implicit GEMM over the transposed-conv gather (M = input channels, N = batch x
  input pixels, K = output channels x taps); taps whose stride does not divide read zero.
- ConvGradWeight: GEMM over (batch x output pixels) with K split into a Scratch buffer + reduce
  when the weight is small next to the reduction (it always is for small CNNs).
- Pools: one invocation per output (forward) or per input element (gradients gather over the
  windows that cover them, so no atomics and the sums are deterministic). Max pools take four
  neighbours along a row an invocation where the row is a multiple of 4 long (`_lanes_fit`).

Window geometry is `anygrad.ops.nn.Window.of` over the node's resolved attributes (explicit pads,
strides, dilations, ceil_mode: ir/passes.resolve_attributes), the layout the numpy reference uses.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from ....errors import UnsupportedOpError
from ....ir.graph import Graph, Node
from ....ops.nn import Window
from .gemm_spec import (
    EPILOGUES,
    Binding,
    GemmSpec,
    Operand,
    Output,
    TapGather,
    TapMajor,
    fold_grid,
    linear_id,
    u,
)
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .kernels_conv_nd import CONV_ND
from .kernels_gemm import gemm_kernels, static_shape, variant_of
from .kernels_pool_nd import LOWEST, POOL_ND
from .wgsl import WG, bindings, flat_id, shader, vtype
from .wgsl import grid as thread_grid

NEG_INF = "bitcast<f32>(0xff800000u)"


@dataclass(frozen=True)
class Geo:
    """A sliding window over (B, C, H, W) input, 1-D ops lifted to H = 1."""

    B: int
    C: int
    H: int
    W: int
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    ph: int        # begin pads
    pw: int
    eh: int        # end pads (count_include_pad counts them)
    ew: int
    OH: int
    OW: int

    @property
    def P(self) -> int:
        return self.OH * self.OW

    @property
    def HW(self) -> int:
        return self.H * self.W

    @property
    def taps(self) -> int:
        return self.kh * self.kw

    @property
    def pointwise(self) -> bool:
        """1x1, stride 1, no padding: the conv is a plain matmul over pixels."""
        return (self.taps == 1 and self.sh == self.sw == 1 and not (self.ph or self.pw or self.eh or self.ew))


def geometry(node: Node, x_shape: tuple[int, ...]) -> Geo:
    """The layout of a windowed node (resolved attributes) over an input of `x_shape`."""
    nd = len(x_shape) - 2
    if nd not in (1, 2):
        raise UnsupportedOpError(f"{node.label}: the wgpu backend runs 1-D and 2-D {node.op} only "
                                 f"(input {tuple(x_shape)}); use the numpy backend for {nd}-D")
    w = Window.of(node, x_shape[2:])

    def two(t):
        return (1,) + tuple(t) if nd == 1 else tuple(t)

    (H, W), (kh, kw), (sh, sw), (dh, dw) = two(w.spatial), two(w.kernel), two(w.strides), two(w.dilations)
    (ph, pw), (eh, ew), (OH, OW) = (two(w.begin) if nd == 2 else (0,) + w.begin,
                                    two(w.end) if nd == 2 else (0,) + w.end, two(w.out))
    return Geo(x_shape[0], x_shape[1], H, W, kh, kw, sh, sw, dh, dw, ph, pw, eh, ew, OH, OW)


# -- im2col pieces (WGSL preludes in terms of the loader's r, c) --------------------------------
PIXEL_NAMES = {True: ("img", "pix", "oy", "ox"), False: ("img", "pix", "iy", "ix")}  # what _pixel defines


def _pixel(var: str, g: Geo, out_side: bool) -> str:
    """img, oy, ox (or iy, ix) of flat pixel column `var` = img * pixels + pixel."""
    P, Wd = (g.P, g.OW) if out_side else (g.HW, g.W)
    y, x = ("oy", "ox") if out_side else ("iy", "ix")
    return (f"let img = {var} / {u(P)}; let pix = {var} % {u(P)}; "
            f"let {y} = pix / {u(Wd)}; let {x} = pix % {u(Wd)};")


def _tap(var: str, g: Geo, ch: str) -> str:
    """channel, ky, kx of flat row `var` = channel * taps + tap."""
    return (f"let {ch} = {var} / {u(g.taps)}; let tap = {var} % {u(g.taps)}; "
            f"let ky = tap / {u(g.kw)}; let kx = tap % {u(g.kw)};")


def _gather_forward(g: Geo) -> tuple[str, str]:
    """(prelude, valid) giving input coordinates yy, xx of output (oy, ox) at tap (ky, kx)."""
    pre = (f"let yy = i32(oy * {u(g.sh)} + ky * {u(g.dh)}) - {g.ph}; "
           f"let xx = i32(ox * {u(g.sw)} + kx * {u(g.dw)}) - {g.pw};")
    valid = f"yy >= 0 && yy < {g.H} && xx >= 0 && xx < {g.W}"
    return pre, valid


def _x_index(g: Geo, ch: str) -> str:
    return f"((img * {u(g.C)} + {ch}) * {u(g.H)} + u32(yy)) * {u(g.W)} + u32(xx)"


def _x_gather(g: Geo, ch: str) -> tuple[str, str, str]:
    """(prelude, valid, index) of the input element under output (oy, ox) at tap (ky, kx).

    A window that never leaves the input (no padding) needs no bounds test, and its index is a
    pixel part plus a tap part: a GEMM tile load that keeps one of them fixed per invocation (its
    own column or k) lets the compiler hoist that part out of the K loop."""
    inside = (not (g.ph or g.pw) and (g.OH - 1) * g.sh + (g.kh - 1) * g.dh < g.H
              and (g.OW - 1) * g.sw + (g.kw - 1) * g.dw < g.W)
    if not inside:
        pre, valid = _gather_forward(g)
        return pre, valid, _x_index(g, ch)
    pix = f"img * {u(g.C * g.HW)} + oy * {u(g.sh * g.W)} + ox * {u(g.sw)}"
    tap = f"({ch}) * {u(g.HW)} + ky * {u(g.dh * g.W)} + kx * {u(g.dw)}"
    return "", "", f"({pix}) + ({tap})"


def _conv_shapes(node: Node, graph: Graph, x: str, w: str):
    xs = static_shape(graph, x, node)
    ws = static_shape(graph, w, node)
    return xs, ws, int(node.attr("group", 1))


def _weights_by_tap(node: Node, w: str, Co: int, Cg: int, taps: int, caps: AdapterCaps) -> tuple[str, Kernel]:
    """(scratch name, kernel) of the weights reordered Wp[co][tap][ci] = W[co][ci][tap]: the A
    operand of a tap-major GemmSpec reads them in K order, four at a time, as the plain form reads W."""
    name = f"{node.outputs[0]}__bytap"
    body = (f"  let co = i / {u(taps * Cg)}; let tap = (i / {u(Cg)}) % {u(taps)}; let ci = i % {u(Cg)};\n"
            f"  Wp[i] = W[(co * {u(Cg)} + ci) * {u(taps)} + tap];")
    k = flat_kernel("WeightsByTap", [w], ["W"], name, "Wp", Co * Cg * taps, body, caps, wg=WG)
    return name, replace(k, scratch=(Scratch(name, Co * Cg * taps),))


def _tap_xy(g: Geo) -> str:
    return f"let ky = tap / {u(g.kw)}; let kx = tap % {u(g.kw)};"


# -- Conv forward -------------------------------------------------------------------------------
@lowering("Conv", epilogue=True)
def lower_conv(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    if len(static_shape(graph, node.inputs[0], node)) > 4:
        return CONV_ND[node.op](node, graph)
    xs, ws, G = _conv_shapes(node, graph, node.inputs[0], node.inputs[1])
    g = geometry(node, xs)
    Co, Cg = ws[0], ws[1]
    Cog = Co // G
    has_bias = bool(node.input(2))
    if G == g.C == Co and Cg == 1:
        return [_depthwise(node, g, has_bias, caps)]
    K = Cg * g.taps
    N = g.B * g.P
    a = Operand("Wt", Cog, K, f"(bt * {u(Cog)} + r) * {u(K)} + c", contig=1)
    if g.pointwise:
        b = Operand("X", K, N, f"(img * {u(g.C)} + bt * {u(Cg)} + r) * {u(g.P)} + pix",
                    prelude=f"let img = c / {u(g.P)}; let pix = c % {u(g.P)};",
                    contig=1 if g.P % 4 == 0 else None)
    else:
        pre, valid, index = _x_gather(g, f"bt * {u(Cg)} + ci")
        b = Operand("X", K, N, index, prelude=_tap("r", g, "ci") + " " + pre, valid=valid,
                    hoist=_pixel("c", g, True), hoisted=PIXEL_NAMES[True])
    reads = [Binding(node.inputs[1], "Wt"), Binding(node.inputs[0], "X")]
    if has_bias:
        reads.append(Binding(node.inputs[2], "Bias"))
    out = Output("Y", f"(img * {u(Co)} + bt * {u(Cog)} + r) * {u(g.P)} + pix",
                 prelude=f"let img = c / {u(g.P)}; let pix = c % {u(g.P)};", contig=g.P % 4 == 0,
                 bias=f"Bias[bt * {u(Cog)} + r]" if has_bias else "", epilogue=node.attr("_epilogue"))
    spec = GemmSpec("Conv" + ("1x1" if g.pointwise else ""), Cog, N, K, G, a, b, out, tuple(reads),
                    Binding(node.outputs[0], "Y"))
    if not g.pointwise:
        wp, permute = _weights_by_tap(node, node.inputs[1], Co, Cg, g.taps, caps)
        pre, valid, base = _x_gather(g, f"bt * {u(Cg)}")
        taps = TapGather(Cg, g.HW, f"{_pixel('c', g, True)} {_tap_xy(g)} {pre}", base, valid)
        spec = replace(spec, tap_major=TapMajor(replace(
            spec, a=Operand("Wt", Cog, K, f"(bt * {u(Cog)} + r) * {u(K)} + c", contig=1),
            b=taps.operand("X", K, N), reads=(Binding(wp, "Wt"),) + tuple(reads[1:])), (permute,)))
    # split-K when the output grid is small: ResNet-18's last stage at 32x32 input (1x1 pixels,
    # 512 channels, K = 4608) ran 64 workgroups of 64x64 for 0.58 ms (4 TFLOP/s) on an H200
    return gemm_kernels(spec, caps, **variant_of(node, graph, caps))


def _depthwise(node: Node, g: Geo, has_bias: bool, caps: AdapterCaps) -> Kernel:
    """One invocation per output: the window of one channel times that channel's filter."""
    pre, valid = _gather_forward(g)
    reads = [node.inputs[0], node.inputs[1]] + ([node.inputs[2]] if has_bias else [])
    body = f"""
  let img = i / {u(g.C * g.P)}; let ch = (i / {u(g.P)}) % {u(g.C)};
  let pix = i % {u(g.P)}; let oy = pix / {u(g.OW)}; let ox = pix % {u(g.OW)};
  var acc = 0.0;
  for (var ky = 0u; ky < {u(g.kh)}; ky = ky + 1u) {{
    for (var kx = 0u; kx < {u(g.kw)}; kx = kx + 1u) {{
      {pre}
      if ({valid}) {{
        acc = fma(X[((img * {u(g.C)} + ch) * {u(g.H)} + u32(yy)) * {u(g.W)} + u32(xx)],
                  Wt[ch * {u(g.taps)} + ky * {u(g.kw)} + kx], acc);
      }}
    }}
  }}
  var y = acc{" + Bias[ch]" if has_bias else ""};
  Y[i] = {EPILOGUES[node.attr("_epilogue")]};"""
    return flat_kernel("Conv[depthwise]", reads, ["X", "Wt"] + (["Bias"] if has_bias else []),
                       node.outputs[0], "Y", g.B * g.C * g.P, body, caps)


# -- Conv gradients -----------------------------------------------------------------------------
@lowering("ConvGradInput")
def lower_conv_grad_input(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    if len(node.attr("input_shape")) > 4:
        return CONV_ND[node.op](node, graph)
    dy, w = node.inputs[0], node.inputs[1]
    ws = static_shape(graph, w, node)
    xs = tuple(int(d) for d in node.attr("input_shape"))
    G = int(node.attr("group", 1))
    g = geometry(node, xs)
    Co, Cg = ws[0], ws[1]
    Cog = Co // G
    if (g.sh > 1 or g.sw > 1) and g.dh == g.dw == 1:
        return _grad_input_by_phase(node, g, G, Co, Cg, caps, variant_of(node, graph, caps))
    K = Cog * g.taps
    N = g.B * g.HW
    if g.pointwise:
        a = Operand("Wt", Cg, Cog, f"(bt * {u(Cog)} + c) * {u(Cg)} + r", contig=0)
        b = Operand("DY", Cog, N, f"(img * {u(Co)} + bt * {u(Cog)} + r) * {u(g.P)} + pix",
                    prelude=f"let img = c / {u(g.P)}; let pix = c % {u(g.P)};",
                    contig=1 if g.P % 4 == 0 else None)
    else:
        a = Operand("Wt", Cg, K, f"((bt * {u(Cog)} + co) * {u(Cg)} + r) * {u(g.taps)} + tap",
                    prelude=f"let co = c / {u(g.taps)}; let tap = c % {u(g.taps)};")
        # input pixel (iy, ix) receives from output (oy, ox) through tap (ky, kx) when
        # oy * sh + ky * dh - ph == iy, i.e. oy = (iy + ph - ky * dh) / sh exactly.
        stride1 = g.sh == g.sw == 1
        pre = (_tap("r", g, "co") + " "
               f"let ty = i32(iy + {u(g.ph)}) - i32(ky * {u(g.dh)}); "
               f"let tx = i32(ix + {u(g.pw)}) - i32(kx * {u(g.dw)}); "
               f"let oy = u32(ty) / {u(g.sh)}; let ox = u32(tx) / {u(g.sw)};")
        valid = (f"ty >= 0 && tx >= 0 && u32(ty) % {u(g.sh)} == 0u && u32(tx) % {u(g.sw)} == 0u "
                 f"&& oy < {u(g.OH)} && ox < {u(g.OW)}")
        index = f"((img * {u(Co)} + bt * {u(Cog)} + co) * {u(g.OH)} + oy) * {u(g.OW)} + ox"
        if stride1:
            # u32 arithmetic that wraps below zero: one unsigned test per axis, and the index as
            # a pixel part plus a tap part (see _x_gather)
            pre = (_tap("r", g, "co") + " "
                   f"let oy = iy + {u(g.ph)} - ky * {u(g.dh)}; let ox = ix + {u(g.pw)} - kx * {u(g.dw)};")
            valid = f"oy < {u(g.OH)} && ox < {u(g.OW)}"
            index = (f"(img * {u(Co * g.P)} + iy * {u(g.OW)} + ix + {u(g.ph * g.OW + g.pw)}) + "
                     f"((bt * {u(Cog)} + co) * {u(g.P)} - ky * {u(g.dh * g.OW)} - kx * {u(g.dw)})")
        b = Operand("DY", K, N, index, prelude=pre, valid=valid, hoist=_pixel("c", g, False),
                    hoisted=PIXEL_NAMES[False])
    out = Output("DX", f"(img * {u(g.C)} + bt * {u(Cg)} + r) * {u(g.HW)} + pix",
                 prelude=f"let img = c / {u(g.HW)}; let pix = c % {u(g.HW)};", contig=g.HW % 4 == 0)
    spec = GemmSpec("ConvGradInput" + ("1x1" if g.pointwise else ""), Cg, N, K, G, a, b, out,
                    (Binding(w, "Wt"), Binding(dy, "DY")), Binding(node.outputs[0], "DX"))
    if not g.pointwise and stride1:
        wp, permute = _weights_by_tap(node, w, Co, Cg, g.taps, caps)
        taps = TapGather(Cog, g.P, f"{_pixel('c', g, False)} {_tap_xy(g)} "
                                   f"let oy = iy + {u(g.ph)} - ky * {u(g.dh)}; let ox = ix + {u(g.pw)} - kx * {u(g.dw)};",
                         f"((img * {u(Co)} + bt * {u(Cog)}) * {u(g.OH)} + oy) * {u(g.OW)} + ox",
                         f"oy < {u(g.OH)} && ox < {u(g.OW)}")
        a = Operand("Wt", Cg, K, f"((bt * {u(Cog)} + co) * {u(g.taps)} + tap) * {u(Cg)} + r",
                    prelude=f"let tap = c / {u(Cog)}; let co = c % {u(Cog)};", contig=0 if Cg % 4 == 0 else None)
        spec = replace(spec, tap_major=TapMajor(replace(
            spec, a=a, b=taps.operand("DY", K, N), reads=(Binding(wp, "Wt"), Binding(dy, "DY"))), (permute,)))
    # split-K when the output grid is small: ResNet-18's last stage at 32x32 input (1x1 pixels,
    # 512 channels, K = 4608) ran 64 workgroups of 64x64 for 0.58 ms (4 TFLOP/s) on an H200
    return gemm_kernels(spec, caps, **variant_of(node, graph, caps))


def _phase_taps(p: int, pad: int, stride: int, k: int) -> tuple[int, int, int]:
    """(first tap, taps, output offset) of the input rows p, p + stride, ... of a strided conv:
    input row i gets output row (i + pad - t) / stride through tap t, exactly when t = p + pad
    (mod stride), so those taps are t0, t0 + stride, ..., and row p + stride * j reads output
    row j + q - n through the n-th of them."""
    t0 = (p + pad) % stride
    return t0, max(0, -(-(k - t0) // stride)), (p + pad - t0) // stride


def _grad_input_by_phase(node: Node, g: Geo, G: int, Co: int, Cg: int, caps: AdapterCaps,
                         pins: dict) -> list[Kernel]:
    """The input gradient of a strided conv, one GEMM per phase of the input grid (sub-pixel
    decomposition). Each input pixel of phase (py, px) receives only from the taps congruent to
    it modulo the stride, so a phase's GEMM reduces over those taps alone: the one-GEMM form
    reduced over every tap and masked 3/4 of the products away at stride 2 (H100, ResNet-50's
    stride-2 input gradients: 1.8-2.2 ms each, 14% of the step). A phase that no tap reaches
    (a 1x1 conv at stride 2 reaches one in four) is zero: the whole gradient is cleared first,
    four floats an invocation, and the other phases' GEMMs then write theirs. (Clearing only the
    empty phases, one float an invocation with its phase tested, took 0.96 ms of ResNet-50's step
    on an H200, three kernels for 270 MB; clearing all 359 MB with vec4 stores took 285 us.)"""
    dy, w = node.inputs[0], node.inputs[1]
    Cog = Co // G
    kernels: list[Kernel] = []
    empty = []
    for py, px in ((py, px) for py in range(g.sh) for px in range(g.sw)):
        Hp, Wp = -(-(g.H - py) // g.sh), -(-(g.W - px) // g.sw)   # input rows / columns of the phase
        (ky0, nky, qy), (kx0, nkx, qx) = _phase_taps(py, g.ph, g.sh, g.kh), _phase_taps(px, g.pw, g.sw, g.kw)
        if Hp <= 0 or Wp <= 0:
            continue
        if nky * nkx == 0:
            empty.append((py, px))
            continue
        nt = nky * nkx
        # image and phase-grid position (jy, jx) of column c: input pixel (py + sh jy, px + sw jx)
        phase_pixel = (f"let img = c / {u(Hp * Wp)}; let pix = c % {u(Hp * Wp)}; "
                       f"let jy = pix / {u(Wp)}; let jx = pix % {u(Wp)};")
        a = Operand("Wt", Cg, Cog * nt, f"((bt * {u(Cog)} + co) * {u(Cg)} + r) * {u(g.taps)} + ky * {u(g.kw)} + kx",
                    prelude=(f"let co = c / {u(nt)}; let t = c % {u(nt)}; "
                             f"let ky = {u(ky0)} + (t / {u(nkx)}) * {u(g.sh)}; "
                             f"let kx = {u(kx0)} + (t % {u(nkx)}) * {u(g.sw)};"))
        # oy = jy + qy - n wraps below zero as u32: one unsigned test per axis
        b = Operand("DY", Cog * nt, g.B * Hp * Wp,
                    f"((img * {u(Co)} + bt * {u(Cog)} + co) * {u(g.OH)} + oy) * {u(g.OW)} + ox",
                    prelude=(f"let co = r / {u(nt)}; let t = r % {u(nt)}; "
                             f"let oy = jy + {u(qy)} - t / {u(nkx)}; let ox = jx + {u(qx)} - t % {u(nkx)};"),
                    valid=f"oy < {u(g.OH)} && ox < {u(g.OW)}",
                    hoist=phase_pixel, hoisted=("img", "pix", "jy", "jx"))
        out = Output("DX", f"((img * {u(g.C)} + bt * {u(Cg)} + r) * {u(g.H)} + {u(py)} + jy * {u(g.sh)}) * {u(g.W)}"
                           f" + {u(px)} + jx * {u(g.sw)}",
                     prelude=phase_pixel)
        spec = GemmSpec(f"ConvGradInput:phase{py}{px}", Cg, g.B * Hp * Wp, Cog * nt, G, a, b, out,
                        (Binding(w, "Wt"), Binding(dy, "DY")), Binding(node.outputs[0], "DX"))
        wp, permute = _weights_by_tap(node, w, Co, Cg, g.taps, caps)
        taps = TapGather(Cog, g.P, f"{phase_pixel} let oy = jy + {u(qy)} - tap / {u(nkx)}; "
                                   f"let ox = jx + {u(qx)} - tap % {u(nkx)};",
                         f"((img * {u(Co)} + bt * {u(Cog)}) * {u(g.OH)} + oy) * {u(g.OW)} + ox",
                         f"oy < {u(g.OH)} && ox < {u(g.OW)}")
        a_t = Operand("Wt", Cg, Cog * nt,
                      f"((bt * {u(Cog)} + co) * {u(g.taps)} + ky * {u(g.kw)} + kx) * {u(Cg)} + r",
                      prelude=(f"let t = c / {u(Cog)}; let co = c % {u(Cog)}; "
                               f"let ky = {u(ky0)} + (t / {u(nkx)}) * {u(g.sh)}; "
                               f"let kx = {u(kx0)} + (t % {u(nkx)}) * {u(g.sw)};"),
                      contig=0 if Cg % 4 == 0 else None)
        spec = replace(spec, tap_major=TapMajor(replace(
            spec, a=a_t, b=taps.operand("DY", Cog * nt, g.B * Hp * Wp),
            reads=(Binding(wp, "Wt"), Binding(dy, "DY"))), (permute,)))
        # split-K where the phase's grid is small: the phases run one after another, so they
        # share one scratch value (sized for the largest); ResNet-18's last stage at 32 px (1x1
        # phases, 512 columns) ran two workgroups for 0.2-0.3 ms a phase on an H200
        kernels += gemm_kernels(spec, caps, **pins)
    if empty:
        total = g.B * g.C * g.HW
        # workgroups of WG (256), as the elementwise kernels and copies: 64 made 1.4M of them for
        # ResNet-50's first downsampling (the 285 us above, 1.3 TB/s)
        if total % 4 == 0:
            clear = flat_kernel("ConvGradInput:clear", [], [], node.outputs[0], "DX", total // 4,
                                "  DX[i] = vec4<f32>(0.0);", caps, wg=WG, ty="vec4<f32>")
        else:
            clear = flat_kernel("ConvGradInput:clear", [], [], node.outputs[0], "DX", total, "  DX[i] = 0.0;",
                                caps, wg=WG)
        kernels.insert(0, clear)
    return kernels


@lowering("ConvGradWeight")
def lower_conv_grad_weight(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    if len(node.attr("weight_shape")) > 4:
        return CONV_ND[node.op](node, graph)
    dy, x = node.inputs[0], node.inputs[1]
    xs = static_shape(graph, x, node)
    ws = tuple(int(d) for d in node.attr("weight_shape"))
    G = int(node.attr("group", 1))
    g = geometry(node, xs)
    Co, Cg = ws[0], ws[1]
    Cog = Co // G
    N = Cg * g.taps          # one output column per (input channel, tap)
    K = g.B * g.P            # reduced over every output pixel of every image
    a = Operand("DY", Cog, K, f"(img * {u(Co)} + bt * {u(Cog)} + r) * {u(g.P)} + pix",
                prelude=f"let img = c / {u(g.P)}; let pix = c % {u(g.P)};", contig=1 if g.P % 4 == 0 else None)
    if g.pointwise:
        b = Operand("X", K, N, f"(img * {u(g.C)} + bt * {u(Cg)} + c) * {u(g.P)} + pix",
                    prelude=f"let img = r / {u(g.P)}; let pix = r % {u(g.P)};", contig=0 if g.P % 4 == 0 else None)
    else:
        pre, valid, index = _x_gather(g, f"bt * {u(Cg)} + ci")
        b = Operand("X", K, N, index,
                    prelude=_pixel("r", g, True) + " " + _tap("c", g, "ci") + " " + pre, valid=valid,
                    fast=0)   # neighbouring pixels (k) are neighbouring addresses
    out = Output("DW", f"(bt * {u(Cog)} + r) * {u(N)} + c", contig=N % 4 == 0)
    spec = GemmSpec("ConvGradWeight", Cog, N, K, G, a, b, out, (Binding(dy, "DY"), Binding(x, "X")),
                    Binding(node.outputs[0], "DW"))
    if not g.pointwise:
        # columns by (tap, channel), stored back to the weight's (channel, tap) order
        pre, valid, base = _x_gather(g, f"bt * {u(Cg)}")
        taps = TapGather(Cg, g.HW, f"{_pixel('r', g, True)} {_tap_xy(g)} {pre}", base, valid, axis=1)
        spec = replace(spec, tap_major=TapMajor(replace(
            spec, b=taps.operand("X", K, N),
            out=Output("DW", f"(bt * {u(Cog)} + r) * {u(N)} + (c % {u(Cg)}) * {u(g.taps)} + c / {u(Cg)}"))))
    return gemm_kernels(spec, caps, **variant_of(node, graph, caps), allow_split=True)


# -- one-invocation-per-element kernels (depthwise conv, pools) -----------------------------------
def flat_kernel(name: str, reads: list[str], read_vars: list[str], write: str, write_var: str, total: int,
                body: str, caps: AdapterCaps, wg: int = 64, ty: str = "f32") -> Kernel:
    """A shader running `body` once per flat index i < total (grid folded within the adapter limit);
    every buffer holds elements of WGSL type `ty`."""
    grid = fold_grid(max(1, math.ceil(total / wg)), caps)
    decls = [f"@group(0) @binding({i}) var<storage, read> {v}: array<{ty}>;" for i, v in enumerate(read_vars)]
    decls.append(f"@group(0) @binding({len(reads)}) var<storage, read_write> {write_var}: array<{ty}>;")
    wgsl = "\n".join(decls + [
        f"@compute @workgroup_size({wg}, 1, 1)",
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {",
        f"  let i = ({linear_id(grid)}) * {u(wg)} + li;",
        f"  if (i >= {u(total)}) {{ return; }}",
        body, "}"]) + "\n"
    return Kernel(name, wgsl, grid, tuple(reads), (write,))


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
    pre, valid = _gather_forward(g)
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
    pre, valid = _gather_forward(g)
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
