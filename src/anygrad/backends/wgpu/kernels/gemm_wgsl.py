"""WGSL generation for a GEMM spec and its tiling (gemm_wgsl): operand loaders, epilogues and
stores, the register variant's blocks and the shared variant's staged, swizzled tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ....ir.graph import Node
from .gemm_spec import EPILOGUES, Binding, GemmSpec, Operand, Output, Tiling, f, fold_grid, linear_id, u
from .halfstore import round_half
from .kernel import AdapterCaps
from .kernels_elementwise import EW, Emit, Val


# -- WGSL generation ----------------------------------------------------------------------------
def _decl(i: int, b: Binding, access: str) -> str:
    elem = "vec4<f32>" if b.vec4 else b.elem
    return f"@group(0) @binding({i}) var<storage, {access}> {b.var}: array<{elem}>;"


def _scalar_read(var: str, vec4: bool, idx: str) -> str:
    return f"{var}[({idx}) >> 2u][({idx}) & 3u]" if vec4 else f"{var}[{idx}]"


def _loader(fn: str, op: Operand, vec4: bool, helpers: dict[str, str] | None = None) -> str:
    """fn_el(bt, r, c) -> f32 (0 outside), and fn_v(bt, r, c) -> vec4 along op.contig when vec4-bound;
    with a hoisted prelude also fn_elh(bt, r, c, <hoisted names>): fn_el given those values.
    With op.apply, each element read goes through that activation (fn_act; its helper functions
    into `helpers`, shared with the epilogue's); outside the operand it stays 0, as the operand
    the activation's output would be."""
    guard = f"if (r >= {u(op.rows)} || c >= {u(op.cols)}) {{ return {{zero}}; }}"
    valid = f"if (!({op.valid})) {{ return {{zero}}; }}" if op.valid else ""
    act = (lambda e: f"{fn}_act({e})") if op.apply else (lambda e: e)

    def scalar(name: str, params: str, pre: str) -> list[str]:
        return [f"fn {name}(bt: u32, r: u32, c: u32{params}) -> f32 {{",
                "  " + guard.replace("{zero}", "0.0"), f"  {pre}", "  " + valid.replace("{zero}", "0.0"),
                f"  let idx = {op.index};", f"  return {act(_scalar_read(op.var, vec4, 'idx'))};", "}"]

    out = _act_fn(f"{fn}_act", op.apply, helpers, op.apply_half) if op.apply else []
    out += scalar(f"{fn}_el", "", op.full_prelude)
    if op.hoist:
        out += scalar(f"{fn}_elh", "".join(f", {h}: u32" for h in op.hoisted), op.prelude)
    if vec4:
        read = f"{op.var}[({op.index}) >> 2u]"
        if op.apply:
            read = f"vec4<f32>({', '.join(act(f'w[{q}]') for q in range(4))})"
        out += [f"fn {fn}_v(bt: u32, r: u32, c: u32) -> vec4<f32> {{",
                "  " + guard.replace("{zero}", "vec4<f32>(0.0)"), f"  {op.full_prelude}",
                "  " + valid.replace("{zero}", "vec4<f32>(0.0)")]
        out += ([f"  let w = {op.var}[({op.index}) >> 2u];"] if op.apply else []) + [f"  return {read};", "}"]
    return "\n".join(out)


def _act_fn(name: str, apply: tuple, helpers: dict[str, str] | None, half: bool = False) -> list[str]:
    """`fn name(x: f32) -> f32`: the activation apply = (op, sorted attrs), by its elementwise
    table row; the functions it calls go into `helpers` (or before it, without); `half`: its
    result rounded to f16, as the activation's own kernel would store it."""
    c = Emit()
    op, attrs = apply
    (v,) = EW[op].emit(c, Node(op, ["x"], ["y"], dict(attrs)), [Val("x", "f32")], ["f32"])
    own = [] if helpers is not None else list(c.helpers.values())
    if helpers is not None:
        helpers.update(c.helpers)
    return own + [f"fn {name}(x: f32) -> f32 {{"] + c.lines + [f"  return {_rounded(v.expr, half)};", "}"]


def _rounded(expr: str, half: bool) -> str:
    """expr (f32) rounded to float16 when `half`: a float16 value of the graph, held in a register
    instead of stored (halfstore.round_half; the shader gets its definition with its f16 bindings)."""
    return round_half(expr) if half else expr


def _activation(out: Output, helpers: dict[str, str] | None = None) -> tuple[str, str, str]:
    """(helper functions, statements, result expression) applying out.epilogue to `y`; with
    `helpers`, the helper functions go there instead (shared with the operands' prologues)."""
    if out.epilogue in EPILOGUES:
        return "", "", EPILOGUES[out.epilogue]
    c = Emit()
    pre = ""
    if out.operand:  # read once: the gradient's formula may use x several times
        node = Node(out.epilogue, ["y", "x"], ["z"], dict(out.epilogue_attrs))
        (v,) = EW[out.epilogue].emit(c, node, [Val("y", "f32"), Val("ex", "f32")], ["f32"])
        pre = f"  let ex = {out.operand};\n"
    else:
        node = Node(out.epilogue, ["y"], ["z"], dict(out.epilogue_attrs))
        (v,) = EW[out.epilogue].emit(c, node, [Val("y", "f32")], ["f32"])
    if helpers is not None:
        helpers.update(c.helpers)
        return "", pre + "\n".join(c.lines) + "\n", v.expr
    return "\n".join(c.helpers.values()), pre + "\n".join(c.lines) + "\n", v.expr


def _epi_fn(out: Output, with_bias: bool, helpers: dict[str, str] | None = None) -> str:
    def step(name: str, line: str) -> str:
        return line + (f"  y = {_rounded('y', True)};\n" if name in out.rounds else "")
    bias = step("bias", f"  y = y + {out.bias};\n") if (with_bias and out.bias) else ""
    bias += step("residual", f"  y = y + {out.residual};\n") if (with_bias and out.residual) else ""
    alpha = f" * {f(out.alpha)}" if out.alpha != 1.0 else ""
    own, lines, result = _activation(out, helpers)
    result = _rounded(result, "epilogue" in out.rounds and out.epilogue is not None)
    if with_bias and out.mask:
        lines += f"  let z = {result};\n"
        result = f"select(z, {out.fill}, {out.mask})"
    return (f"{own}\nfn epi(bt: u32, r: u32, c: u32, v: f32) -> f32 {{\n  var y = v{alpha};\n"
            f"{step('gemm', '')}{bias}{lines}  return {result};\n}}")


def _store_fn(out: Output, M: int, N: int) -> str:
    """st4(bt, s, r, c, v): store four results c..c+3 (c % 4 == 0) of row r, through epi."""
    vals = ", ".join(f"epi(bt, r, c + {q}u, v[{q}])" for q in range(4))
    if out.contig:
        return (f"fn st4(bt: u32, s: u32, r: u32, c: u32, v: vec4<f32>) {{\n"
                f"  if (r >= {u(M)} || c >= {u(N)}) {{ return; }}\n  {out.prelude}\n"
                f"  {out.var}[({out.index}) >> 2u] = vec4<f32>({vals});\n}}")
    return (f"fn st1(bt: u32, s: u32, r: u32, c: u32, v: f32) {{\n"
            f"  if (r >= {u(M)} || c >= {u(N)}) {{ return; }}\n  {out.prelude}\n"
            f"  {out.var}[{out.index}] = epi(bt, r, c, v);\n}}\n"
            f"fn st4(bt: u32, s: u32, r: u32, c: u32, v: vec4<f32>) {{\n"
            + "".join(f"  st1(bt, s, r, c + {q}u, v[{q}]);\n" for q in range(4)) + "}")


def _a_block(t: Tiling, vec: bool, contig: int | None) -> list[str]:
    """Statements defining a{i}: vec4 of A[m0+i, k..k+3] for i < TM."""
    lines = []
    if vec and contig == 1:
        lines += [f"let a{i} = a_v(bt, m0 + {i}u, k);" for i in range(t.tm)]
    elif vec and contig == 0:
        for ib in range(t.tm // 4):
            lines += [f"let ta{kk}_{ib} = a_v(bt, m0 + {4 * ib}u, k + {kk}u);" for kk in range(4)]
            lines += [f"let a{4 * ib + q} = vec4<f32>(" + ", ".join(f"ta{kk}_{ib}[{q}]" for kk in range(4)) + ");"
                      for q in range(4)]
    else:
        lines += [f"let a{i} = vec4<f32>(" + ", ".join(f"a_el(bt, m0 + {i}u, k + {kk}u)" for kk in range(4)) + ");"
                  for i in range(t.tm)]
    return lines


def _b_block(t: Tiling, vec: bool, contig: int | None) -> list[str]:
    """Statements defining b{kk}_{j}: vec4 of B[k+kk, n0+4j..n0+4j+3]."""
    lines = []
    nj = t.tn // 4
    if vec and contig == 1:
        lines += [f"let b{kk}_{j} = b_v(bt, k + {kk}u, n0 + {4 * j}u);" for kk in range(4) for j in range(nj)]
    elif vec and contig == 0:
        lines += [f"let tb{c} = b_v(bt, k, n0 + {c}u);" for c in range(t.tn)]
        lines += [f"let b{kk}_{j} = vec4<f32>(" + ", ".join(f"tb{4 * j + q}[{kk}]" for q in range(4)) + ");"
                  for kk in range(4) for j in range(nj)]
    else:
        lines += [f"let b{kk}_{j} = vec4<f32>(" + ", ".join(f"b_el(bt, k + {kk}u, n0 + {4 * j + q}u)"
                                                         for q in range(4)) + ");"
                  for kk in range(4) for j in range(nj)]
    return lines


def _fma_block(t: Tiling, a: str, b: str) -> list[str]:
    """acc{i}_{j} += a(i)[kk] * b(kk, j) for one k step; a/b are format strings."""
    return [f"acc{i}_{j} = fma(vec4<f32>({a.format(i=i, kk=kk)}), {b.format(kk=kk, j=j)}, acc{i}_{j});"
            for kk in range(4) for i in range(t.tm) for j in range(t.tn // 4)]


def _vec_ok(op: Operand) -> bool:
    """A vec4 load along op.contig is valid when that extent is a multiple of 4."""
    if op.contig is None:
        return False
    return (op.rows if op.contig == 0 else op.cols) % 4 == 0


@dataclass(frozen=True)
class _Stage:
    """Copying one operand's tile into workgroup memory: element l (of `count`, spread over the
    invocations) has index statements, a global load of type `vtype` and statements storing
    that value `v` into the tile."""
    count: int
    index: tuple[str, ...]
    load: str
    vtype: str
    store: tuple[str, ...]
    swizzled: bool = False  # the tile's rows are permuted (_sw): reads must apply the same XOR
    hoist: tuple[str, ...] = ()  # statements run once before the K loop (the copy's fixed column)


def _sw(on: bool, k: str) -> str:
    """XOR applied to a tile row's vec4 index at K offset `k`. A scalar copy with K fastest has
    the 32 invocations of a warp store into 16 rows at once; unpermuted, rows 128 floats apart
    all fall on one bank (16-way conflicts: H100, the LM head's input gradient over an odd K ran
    at 14-22 TFLOP/s, 23-31 swizzled). ((k >> 2) ^ k) & 7 gives any 8 consecutive rows distinct
    groups of banks; it permutes vec4s within aligned groups of 8, so the tile's rows must be
    whole groups (a multiple of 32 floats)."""
    return f" ^ (((({k}) >> 2u) ^ ({k})) & 7u)" if on else ""


def _swizzled(index: str, on: bool, k: str) -> str:
    """`index` XOR-permuted at K offset `k` (_sw), parenthesised whole: WGSL's grammar takes only
    unary operands beside `^` (Tint refuses `a / 4u ^ b` and `a + b ^ c`, which naga accepts)."""
    return f"(({index}){_sw(on, k)})" if on else f"({index})"


# Workgroup tiles as arrays of rows (As[k][m]) rather than one flat array (As[k * BM4 + m]): naga
# clamps every dynamic index into a workgroup array (wgpu's Vulkan backend lowers WGSL with the
# Restrict bounds-check policy), and a flat index is clamped whole at every load, where a row's
# constant index needs no clamp and the clamped column (lid + a constant) is the same in every
# K step (the flat form measured slower; docs/benchmark-history.md, removed switches).


F16_MATH_ENV = "ANYGRAD_F16_MATH"  # auto | 1 | 0: half_math


def _at(arr: str, row: str, col: str) -> str:
    """Element (row, col) of a workgroup tile (rows of vec4s)."""
    return f"{arr}[{row}][{col}]"


def _tile_decl(arr: str, rows: int, width: int, halves: int = 1, elem: str = "f32") -> str:
    t = f"array<array<vec4<{elem}>, {width}>, {rows}>"
    return f"var<workgroup> {arr}: {t if halves == 1 else f'array<{t}, {halves}>'};"


def _stages(spec: GemmSpec, t: Tiling, va: bool, vb: bool) -> tuple[_Stage, _Stage]:
    """How A (KT x BM) and B (KT x BN) are staged, as vec4 rows along M / N: vec4 global loads
    where the operand is contiguous (coalesced along its contiguous axis), else scalars."""
    bm, bn, kt = t.bm, t.bn, t.kt
    bm4, bn4, kt4 = bm // 4, bn // 4, kt // 4

    def scatter(arr: str, k: str, x: str) -> tuple[str, ...]:
        """Write vec4 v (four consecutive k at column x) into the k-major tile."""
        return tuple(f"{_at(arr, f'{k} + {c}u', f'{x} / 4u')}[{x} % 4u] = v[{c}];" for c in range(4))

    if va and spec.a.contig == 1:       # vec4 along k
        a = _Stage(bm * kt4, (f"let kq = (l % {u(kt4)}) * 4u; let mm = l / {u(kt4)};",),
                   f"a_v(bt, mb * {u(bm)} + mm, k0 + kq)", "vec4<f32>", scatter("As", "kq", "mm"))
    elif va and spec.a.contig == 0:     # vec4 along m
        a = _Stage(bm4 * kt, (f"let mq = l % {u(bm4)}; let kk = l / {u(bm4)};",),
                   f"a_v(bt, mb * {u(bm)} + mq * 4u, k0 + kk)", "vec4<f32>",
                   (f"{_at('As', 'kk', 'mq')} = v;",))
    else:
        a_fast = spec.a.fast if spec.a.fast is not None else spec.a.contig
        a_map = (f"let kk = l % {u(kt)}; let mm = l / {u(kt)};" if a_fast == 1
                 else f"let mm = l % {u(bm)}; let kk = l / {u(bm)};")
        sw = t.swizzle and a_fast == 1 and bm % 32 == 0
        a = _Stage(bm * kt, (a_map,), f"a_el(bt, mb * {u(bm)} + mm, k0 + kk)", "f32",
                   (f"{_at('As', 'kk', _swizzled('mm / 4u', sw, 'kk'))}[mm % 4u] = v;",), sw)
    if vb and spec.b.contig == 1:       # vec4 along n
        b = _Stage(bn4 * kt, (f"let nq = l % {u(bn4)}; let kk = l / {u(bn4)};",),
                   f"b_v(bt, k0 + kk, nb * {u(bn)} + nq * 4u)", "vec4<f32>",
                   (f"{_at('Bs', 'kk', 'nq')} = v;",))
    elif vb and spec.b.contig == 0:     # vec4 along k
        b = _Stage(bn * kt4, (f"let kq = (l % {u(kt4)}) * 4u; let nn = l / {u(kt4)};",),
                   f"b_v(bt, k0 + kq, nb * {u(bn)} + nn)", "vec4<f32>", scatter("Bs", "kq", "nn"))
    else:
        b_fast = spec.b.fast if spec.b.fast is not None else spec.b.contig
        b_map = (f"let kk = l % {u(kt)}; let nn = l / {u(kt)};" if b_fast == 0
                 else f"let nn = l % {u(bn)}; let kk = l / {u(bn)};")
        sw = t.swizzle and b_fast == 0 and bn % 32 == 0
        load, hoist = f"b_el(bt, k0 + kk, nb * {u(bn)} + nn)", ()
        if t.hoist and spec.b.hoist and b_fast != 0 and (t.wx * t.wy) % bn == 0:
            # every copy of this invocation reads column tid % BN, in every K tile: its decode
            # (an im2col pixel: two divisions and two remainders) runs once, before the K loop
            load = f"b_elh(bt, k0 + kk, nb * {u(bn)} + nn, {', '.join(spec.b.hoisted)})"
            hoist = (f"let c = nb * {u(bn)} + tid % {u(bn)};", spec.b.hoist)
        b = _Stage(bn * kt, (b_map,), load, "f32",
                   (f"{_at('Bs', 'kk', _swizzled('nn / 4u', sw, 'kk'))}[nn % 4u] = v;",), sw, hoist)
    return a, b


def _unrolls(st: _Stage, nt: int) -> bool:
    return st.count % nt == 0 and st.count // nt <= 16


def _shared_body(spec: GemmSpec, t: Tiling, va: bool, vb: bool, unroll: bool) -> tuple[str, list[str]]:
    """Workgroup-memory variant: each K tile of A and B is staged in workgroup memory, then every
    invocation multiplies its TM x TN block out of it.

    Two things keep the multiply fed. An invocation's block is TM/4 x TN/4 sub-blocks of 4 x 4,
    WY (WX) vec4s apart, so that neighbouring invocations read neighbouring vec4s of the tile (no
    bank conflicts; the stores coalesce too). And where the copies unroll, the next K tile's global
    loads are issued into registers before the multiply of this one and written to workgroup
    memory after it, so their latency hides behind the FMAs (register prefetch)."""
    bm4, bn4, kt = t.bm // 4, t.bn // 4, t.kt
    nt = t.wx * t.wy
    elem = "f16" if t.half else "f32"
    decl = _tile_decl("As", kt, bm4, elem=elem) + "\n" + _tile_decl("Bs", kt, bn4, elem=elem)
    stages = _stages(spec, t, va, vb)
    if t.half:  # each element rounded to f16 once, as it is staged (the operands are f16: exact)
        stages = tuple(replace(st, load=f"{st.vtype.replace('f32', 'f16')}({st.load})",
                               vtype=st.vtype.replace("f32", "f16")) for st in stages)
    sa, sb = (st.swizzled for st in stages)
    acc = "h" if t.half else "acc"
    blocks = [(4 * ib + q, j) for ib in range(t.tm // 4) for q in range(4) for j in range(t.tn // 4)]
    fmas = [f"  {acc}{i}_{j} = fma(vec4<{elem}>(av{i // 4}[{i % 4}]), bv{j}, {acc}{i}_{j});" for i, j in blocks]
    # half: the K tile's f16 partial sums go into the f32 accumulators once per tile
    flush = [f"acc{i}_{j} = acc{i}_{j} + vec4<f32>(h{i}_{j}); h{i}_{j} = vec4<f16>(0.0h);"
             for i, j in blocks] if t.half else []
    if unroll:   # constant tile offsets, loads scheduled ahead of the FMAs
        compute = []
        for kk in range(kt):
            compute += (["{"] + [f"  let av{ib} = {_at('As', u(kk), _swizzled(f'{u(ib * t.wy)} + lid.y', sa, u(kk)))};"
                                 for ib in range(t.tm // 4)]
                        + [f"  let bv{j} = {_at('Bs', u(kk), _swizzled(f'{u(j * t.wx)} + lid.x', sb, u(kk)))};"
                           for j in range(t.tn // 4)]
                        + fmas + ["}"])
        compute += flush
    else:
        step = t.unroll if kt % t.unroll == 0 else 1

        def k_step(kk: str) -> list[str]:
            return ([f"  let av{ib} = {_at('As', kk, _swizzled(f'{u(ib * t.wy)} + lid.y', sa, kk))};"
                     for ib in range(t.tm // 4)]
                    + [f"  let bv{j} = {_at('Bs', kk, _swizzled(f'{u(j * t.wx)} + lid.x', sb, kk))};"
                       for j in range(t.tn // 4)] + fmas)
        if step == 1:
            compute = [f"for (var kk = 0u; kk < {u(kt)}; kk = kk + 1u) {{"] + k_step("kk") + ["}"]
        else:
            compute = [f"for (var k0s = 0u; k0s < {u(kt)}; k0s = k0s + {u(step)}) {{"]
            for d in range(step):
                compute += ["{"] + k_step(f"(k0s + {u(d)})") + ["}"]
            compute += ["}"]
        compute += flush
    head = [f"  let tid = lid.x + lid.y * {u(t.wx)};"] + [f"  {ln}" for st in stages for ln in st.hoist]
    head += [f"  var h{i}_{j} = vec4<f16>(0.0h);" for i, j in blocks] if t.half else []
    unrolled = all(_unrolls(st, nt) for st in stages)
    if not (t.prefetch and unrolled):
        copy = []
        for st in stages:
            # unrolled into straight code where the invocations divide the tile, so index
            # arithmetic shared by the copies (the pixel decode of one k) is computed once
            copies = ([[f"let l = tid + {u(i * nt)};"] for i in range(st.count // nt)] if unrolled
                      else [[]])
            for pre in copies:
                inner = pre + list(st.index) + [f"let v = {st.load};"] + list(st.store)
                copy += (["{"] + [f"  {ln}" for ln in inner] + ["}"] if unrolled else
                         [f"for (var l = tid; l < {u(st.count)}; l = l + {u(nt)}) {{"]
                         + [f"  {ln}" for ln in inner] + ["}"])
        body = (head + [f"  for (var k0 = kb; k0 < ke; k0 = k0 + {u(kt)}) {{"]
                + ["    " + ln for ln in copy] + ["    workgroupBarrier();"]
                + ["    " + ln for ln in compute] + ["    workgroupBarrier();", "  }"])
        return decl, body
    if t.double:
        decl = _tile_decl("As", kt, bm4, 2, elem) + "\n" + _tile_decl("Bs", kt, bn4, 2, elem)
    regs, fetch, put = [], [], []
    for name, st in zip("ab", stages):
        for i in range(st.count // nt):
            r = f"p{name}{i}"
            regs.append(f"  var {r}: {st.vtype};")
            # the index arithmetic is repeated at the store: registers hold values only
            fetch += ["{", f"  let l = tid + {u(i * nt)};"] + [f"  {ln}" for ln in st.index] + [f"  {r} = {st.load};", "}"]
            put += ["{", f"  let l = tid + {u(i * nt)};"] + [f"  {ln}" for ln in st.index] + [f"  let v = {r};"]
            put += [f"  {ln}" for ln in st.store] + ["}"]
    if t.double:
        # tile i is multiplied out of half i % 2 while tile i + 1 is stored into the other half:
        # the barrier ending step i - 1 (everyone done reading that half) comes before the store
        def half(lines: list[str], which: str) -> list[str]:
            return [ln.replace("As[", f"As[{which}][").replace("Bs[", f"Bs[{which}][") for ln in lines]
        body = (head + regs + ["  {", "    let k0 = kb;"] + ["    " + ln for ln in fetch]
                + ["    let cur = 0u;"] + ["    " + ln for ln in half(put, "cur")] + ["  }", "  workgroupBarrier();",
                                                                                        "  var cur = 0u;"]
                + [f"  for (var k0 = kb; k0 < ke; k0 = k0 + {u(kt)}) {{",
                   f"    let more = k0 + {u(kt)} < ke;",
                   "    if (more) {", f"      let k0 = k0 + {u(kt)};"] + ["      " + ln for ln in fetch] + ["    }"]
                + ["    " + ln for ln in half(compute, "cur")]
                + ["    if (more) {", "      let cur = 1u - cur;"] + ["      " + ln for ln in half(put, "cur")] + ["    }"]
                + ["    workgroupBarrier();", "    cur = 1u - cur;", "  }"])
        return decl, body
    body = (head + regs + ["  {", "    let k0 = kb;"] + ["    " + ln for ln in fetch] + ["  }"]
            + [f"  for (var k0 = kb; k0 < ke; k0 = k0 + {u(kt)}) {{"]
            + ["    " + ln for ln in put] + ["    workgroupBarrier();",
                                              f"    if (k0 + {u(kt)} < ke) {{",
                                              f"      let k0 = k0 + {u(kt)};"]
            + ["      " + ln for ln in fetch] + ["    }"]
            + ["    " + ln for ln in compute] + ["    workgroupBarrier();", "  }"])
    return decl, body


GROUP_M = 8  # rows of tiles walked together (tile order, _tile_order)


def _tile_order(nN: int, nM: int) -> list[str]:
    """(mb, nb) of workgroup `lin` within its problem: GROUP_M rows of tiles at a time, down the
    rows first, so the workgroups running at once share B's column panels and A's row panels in
    L2, instead of each row of tiles streaming all of B (Triton's grouped ordering). With
    nM <= GROUP_M that is simply: every row of tiles of a column panel, one after the other."""
    t = f"(lin % {u(nN * nM)})"
    if nM == 1:
        return [f"  let nb = {t};", "  let mb = 0u;"]
    return [f"  let tg = {t} / {u(GROUP_M * nN)};",
            f"  let first_m = tg * {u(GROUP_M)};",
            f"  let gm = min({u(nM)} - first_m, {u(GROUP_M)});",
            f"  let tr = {t} - tg * {u(GROUP_M * nN)};",
            "  let mb = first_m + tr % gm;",
            "  let nb = tr / gm;"]


def gemm_wgsl(spec: GemmSpec, t: Tiling, caps: AdapterCaps, splits: int = 1, ksplit: int = 0,
              out: Output | None = None, write: Binding | None = None, with_bias: bool = True) -> tuple[str, tuple]:
    """(shader, grid, read values) of one GEMM kernel; with splits > 1, problem `s` of the grid
    covers K range [s * ksplit, (s + 1) * ksplit) and `out` is the Scratch of partial sums."""
    out = out or spec.out
    write = write or spec.write
    M, N, K = spec.M, spec.N, spec.K
    nN, nM = math.ceil(N / t.bn), math.ceil(M / t.bm)
    total = nN * nM * spec.batch * splits
    grid = fold_grid(total, caps)
    va, vb = _vec_ok(spec.a), _vec_ok(spec.b)
    if spec.a.contig == 0 and t.tm % 4:
        va = False
    reads = [replace(spec.reads[0], vec4=va), replace(spec.reads[1], vec4=vb)]
    reads += list(spec.reads[2:]) if with_bias else []
    if splits == 1:
        kstep = t.kt if t.variant == "shared" else 4
        ksplit = math.ceil(K / kstep) * kstep
    decls = [_decl(i, b, "read") for i, b in enumerate(reads)]
    decls.append(_decl(len(reads), replace(write, vec4=out.contig), "read_write"))
    nj = t.tn // 4
    accs = [f"  var acc{i}_{j} = vec4<f32>(0.0);" for i in range(t.tm) for j in range(nj)]
    head = [
        f"@compute @workgroup_size({t.wx}, {t.wy}, 1)",
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {",
        f"  let lin = {linear_id(grid)};",
        f"  if (lin >= {u(total)}) {{ return; }}",
    ] + _tile_order(nN, nM) + [
        f"  let bt = (lin / {u(nN * nM)}) % {u(spec.batch)};",
        f"  let s = lin / {u(nN * nM * spec.batch)};",
        f"  let m0 = mb * {u(t.bm)} + lid.y * {u(t.tm)};",
        f"  let n0 = nb * {u(t.bn)} + lid.x * {u(t.tn)};",
        f"  let kb = s * {u(ksplit)};",
        f"  let ke = min(kb + {u(ksplit)}, {u(K)});",
    ] + accs
    body: list[str] = []
    shared_decl = ""
    if t.variant == "register":
        body += ["  for (var k = kb; k < ke; k = k + 4u) {"]
        body += ["    " + ln for ln in _a_block(t, va, spec.a.contig) + _b_block(t, vb, spec.b.contig)]
        body += ["    " + ln for ln in _fma_block(t, "a{i}[{kk}]", "b{kk}_{j}")]
        body += ["  }"]
    else:
        # the K-tile loop unrolled: H100, split-K GEMMs (short K ranges) and convs +2-29%, but
        # prefetched GEMMs over the whole K 0-17% slower (4096^3: 35.4 -> 29.5 TFLOP/s)
        shared_decl, body = _shared_body(spec, t, va, vb, unroll=not (t.prefetch and splits == 1))
    if t.variant == "shared":   # sub-blocks WY (WX) vec4s apart (_shared_body)
        stores = [f"  st4(bt, s, mb * {u(t.bm)} + lid.y * 4u + {u(ib * t.wy * 4 + q)}, "
                  f"nb * {u(t.bn)} + lid.x * 4u + {u(j * t.wx * 4)}, acc{4 * ib + q}_{j});"
                  for ib in range(t.tm // 4) for q in range(4) for j in range(nj)]
    else:
        stores = [f"  st4(bt, s, m0 + {i}u, n0 + {4 * j}u, acc{i}_{j});" for i in range(t.tm) for j in range(nj)]
    helpers: dict[str, str] = {}
    loaders = [_loader("a", spec.a, reads[0].vec4, helpers), _loader("b", spec.b, reads[1].vec4, helpers),
               _epi_fn(out, with_bias, helpers)]
    wgsl = "\n".join((["enable f16;"] if t.half and t.variant == "shared" else []) + decls + [shared_decl]
                     + list(helpers.values()) + loaders + [_store_fn(out, M, N)]
                     + head + body + stores + ["}"]) + "\n"
    return wgsl, grid, tuple(b.value for b in reads)
