"""Convolution lowerings (WGSL), 1-D and 2-D (a 1-D op is a 2-D one with height 1); the pools
are kernels_pool.py, the window geometry both use windows.py.

- Conv: implicit GEMM per group (M = output channels, N = batch x output pixels, K = input
  channels x taps); the im2col gather happens inside the GEMM's B loads. Bias and the `_epilogue`
  are applied in the GEMM's store. 1x1 stride-1 unpadded convs skip the window arithmetic (a plain
  batched matmul); depthwise convs (group == C_in == C_out) get a direct kernel.
- ConvGradInput: implicit GEMM over the transposed-conv gather (M = input channels, N = batch x
  input pixels, K = output channels x taps); taps whose stride does not divide read zero.
- ConvGradWeight: GEMM over (batch x output pixels) with K split into a Scratch buffer + reduce
  when the weight is small next to the reduction (it always is for small CNNs).
- Each also has a tap-major form (GemmSpec.tap_major: the gathered axis ordered (tap, channel)),
  which the matrix-unit kernels take where the channels allow (kernels_mma.taps_fit).
"""
from __future__ import annotations

from dataclasses import replace

from ....ir.graph import Graph, Node
from .gemm_spec import (
    EPILOGUES,
    Binding,
    GemmSpec,
    Operand,
    Output,
    TapGather,
    TapMajor,
    u,
)
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .kernels_conv_nd import CONV_ND
from .kernels_gemm import epilogue_arg, epilogue_of, gemm_kernels, residual_arg, static_shape, variant_of
from .wgsl import WG
from .windows import Geo, flat_kernel, gather_forward, geometry

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
    return f"let {ch} = {var} / {u(g.taps)}; let tap = {var} % {u(g.taps)}; {_tap_xy(g)}"

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
        pre, valid = gather_forward(g)
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
    pre, valid = gather_forward(g)
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
def _grad_output(node: Node, reads: list[Binding], index: str, at_rc: str, **fields) -> Output:
    """The input gradient's store: at `index` (through the Output's prelude), with what
    fusion.fuse_epilogues may have moved into it: a residual Add (another path's gradient, as at
    a ResNet block's input) and an activation's gradient (ReLU's before a BatchNorm's gradient),
    each read at `at_rc`, the same element written in the (bt, r, c) the epilogue sees."""
    return Output("DX", index, residual=residual_arg(node, reads, at_rc), operand=epilogue_arg(node, reads, at_rc),
                  **epilogue_of(node), **fields)


@lowering("ConvGradInput", epilogue=True)
def lower_conv_grad_input(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    if len(node.attr("input_shape")) > 4:
        if node.attr("_epilogue"):
            raise NotImplementedError(f"{node.label}: an N-D input gradient takes no epilogue")
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
    reads = [Binding(w, "Wt"), Binding(dy, "DY")]
    out = _grad_output(node, reads, f"(img * {u(g.C)} + bt * {u(Cg)} + r) * {u(g.HW)} + pix",
                       f"((c / {u(g.HW)}) * {u(g.C)} + bt * {u(Cg)} + r) * {u(g.HW)} + c % {u(g.HW)}",
                       prelude=f"let img = c / {u(g.HW)}; let pix = c % {u(g.HW)};", contig=g.HW % 4 == 0)
    spec = GemmSpec("ConvGradInput" + ("1x1" if g.pointwise else ""), Cg, N, K, G, a, b, out,
                    tuple(reads), Binding(node.outputs[0], "DX"))
    if not g.pointwise and stride1:
        wp, permute = _weights_by_tap(node, w, Co, Cg, g.taps, caps)
        taps = TapGather(Cog, g.P, f"{_pixel('c', g, False)} {_tap_xy(g)} "
                                   f"let oy = iy + {u(g.ph)} - ky * {u(g.dh)}; let ox = ix + {u(g.pw)} - kx * {u(g.dw)};",
                         f"((img * {u(Co)} + bt * {u(Cog)}) * {u(g.OH)} + oy) * {u(g.OW)} + ox",
                         f"oy < {u(g.OH)} && ox < {u(g.OW)}")
        a = Operand("Wt", Cg, K, f"((bt * {u(Cog)} + co) * {u(g.taps)} + tap) * {u(Cg)} + r",
                    prelude=f"let tap = c / {u(Cog)}; let co = c % {u(Cog)};", contig=0 if Cg % 4 == 0 else None)
        spec = replace(spec, tap_major=TapMajor(replace(
            spec, a=a, b=taps.operand("DY", K, N), reads=(Binding(wp, "Wt"),) + tuple(reads[1:])), (permute,)))
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
    wp, permute = _weights_by_tap(node, w, Co, Cg, g.taps, caps)  # one copy for every phase's tap-major form
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
        at = "((img * {C} + bt * {Cg} + r) * {H} + {py} + jy * {sh}) * {W} + {px} + jx * {sw}"
        dims = {"C": u(g.C), "Cg": u(Cg), "H": u(g.H), "py": u(py), "sh": u(g.sh), "W": u(g.W), "px": u(px),
                "sw": u(g.sw)}
        grid = u(Hp * Wp)
        reads = [Binding(w, "Wt"), Binding(dy, "DY")]
        out = _grad_output(node, reads, at.format(**dims),
                           at.replace("img", "(c / {grid})").replace("jy", "((c % {grid}) / {Wp})")
                           .replace("jx", "((c % {grid}) % {Wp})").format(**dims, grid=grid, Wp=u(Wp)),
                           prelude=phase_pixel)
        spec = GemmSpec(f"ConvGradInput:phase{py}{px}", Cg, g.B * Hp * Wp, Cog * nt, G, a, b, out,
                        tuple(reads), Binding(node.outputs[0], "DX"))
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
            reads=(Binding(wp, "Wt"),) + tuple(reads[1:])), (permute,)))
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
    # each phase that took its tap-major form brought the weight copy: the first one serves all
    first = next((i for i, k in enumerate(kernels) if k == permute), len(kernels))
    return kernels[:first + 1] + [k for k in kernels[first + 1:] if k != permute]


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
