"""GEMM kernels on matrix units (subgroup matrices), for any GemmSpec: MatMul and Gemm in every
layout kernels_gemm.lower_matmul has, and the implicit-GEMM convolutions of kernels_conv.py.

The kernel takes its operands and its result from the spec exactly as the ALU kernels do:
- each K tile of A (BM x BK) and of B (BK x BN) is copied into workgroup memory through the
  spec's own element loaders (`a_el` / `a_v`: transposes, strided views, batch offsets, im2col
  gathers and fused prologues all live there), zero outside the matrix, so edges need no case of
  their own;
- each subgroup multiplies its block of result fragments out of those tiles;
- each fragment is stored to a small workgroup buffer and written out through the spec's store
  (`st4`: alpha, bias, residual, activation, mask, float16 rounding, any stored layout, split-K
  partials).
Offsets and strides of every matrix operation come from workgroup_id and subgroup_id alone, as
subgroup matrices require; local_invocation_index only places the element copies.

The WGSL of the matrix operations is written by one renderer (`SubgroupMatrixWgsl`): types, load,
multiply-accumulate, store. naga's `wgpu_cooperative_matrix` dialect (coop_mat16x16<f16, A>,
coopLoad, coopMultiplyAdd, coopStore) can be a second renderer with the same four methods once
wgpu-native enables it (wgpu-native#516).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .gemm_spec import Binding, GemmSpec, Output, fold_grid, linear_id, u
from .gemm_splitk import _split_pair, choose_splits
from .gemm_wgsl import _decl, _epi_fn, _loader, _scalar_read, _store_fn, _tile_order, _vec_ok
from .kernel import AdapterCaps, Kernel
from .matrix_units import MatrixConfig, MmaPlan, plan_mma


@dataclass(frozen=True)
class SubgroupMatrixWgsl:
    """Dawn's `chromium_experimental_subgroup_matrix` (WGSL): the one place matrix operations are
    spelled. Matrices are row-major in the arrays they are loaded from and stored to."""

    extension: str = "chromium_experimental_subgroup_matrix"

    def enables(self, cfg: MatrixConfig, subgroup_builtins: bool) -> list[str]:
        # f16 first: halfstore.with_enable looks for it on a line of its own
        return (["enable f16;"] + (["enable subgroups;"] if subgroup_builtins else [])
                + [f"enable {self.extension};"])

    def types(self, cfg: MatrixConfig) -> list[str]:
        """Aliases ML (m x k left), MR (k x n right), MC (m x n result)."""
        return [f"alias ML = subgroup_matrix_left<{cfg.operand}, {cfg.k}, {cfg.m}>;",
                f"alias MR = subgroup_matrix_right<{cfg.operand}, {cfg.n}, {cfg.k}>;",
                f"alias MC = subgroup_matrix_result<{cfg.result}, {cfg.n}, {cfg.m}>;"]

    def zero(self) -> str:
        return "MC()"

    def load_left(self, arr: str, offset: str, stride: str, col_major: bool = False) -> str:
        return f"subgroupMatrixLoad<ML>(&{arr}, {offset}, {str(col_major).lower()}, {stride})"

    def load_right(self, arr: str, offset: str, stride: str, col_major: bool = False) -> str:
        return f"subgroupMatrixLoad<MR>(&{arr}, {offset}, {str(col_major).lower()}, {stride})"

    def multiply_add(self, a: str, b: str, c: str) -> str:
        return f"subgroupMatrixMultiplyAccumulate({a}, {b}, {c})"

    def store(self, arr: str, offset: str, value: str, stride: str) -> str:
        return f"subgroupMatrixStore(&{arr}, {offset}, {value}, false, {stride});"


DIALECT = SubgroupMatrixWgsl()
FEATURES = ("chromium-experimental-subgroup-matrix", "shader-f16", "subgroups")  # what a device must enable


@dataclass(frozen=True)
class _Copy:
    """How one operand's K tile goes into workgroup memory: element group `l` (one vec4 or one
    element) is located by `index`, read by `load` (a template over the tile's first k, `{k}`)
    and written by `stores` (a template over the value read, `{v}`, and the tile's offset in its
    workgroup array, `{o}`: "" or "oa + " / "ob + " for double tiles)."""

    count: int                 # element groups in the tile
    index: str
    load: str
    stores: tuple[str, ...]
    vec: bool                  # a group is a vec4<f32> (else one f32)
    offset: str = ""           # what `{o}` becomes in the stores
    fixed: tuple[str, ...] = ()   # statements run once before the K loop
    setup: tuple[str, ...] = ()   # statements run once a K tile (templates over `{k}`) before its loads
    walks: str = ""               # the axis (m, n or k) neighbouring invocations walk (tile_majors)

    def store(self, value: str) -> list[str]:
        return [s.format(v=value, o=self.offset) for s in self.stores]

    def body(self, k: str, value: str) -> list[str]:
        return [self.index, f"let {value} = {self.load.format(k=k)};"] + self.store(value)

    def tile(self, k: str, lines: list[str]) -> list[str]:
        """`lines` (this tile's element loads) after the tile's setup, in a block of their own."""
        if not self.setup:
            return lines
        return ["{"] + [f"  {s.format(k=k)}" for s in self.setup] + [f"  {ln}" for ln in lines] + ["}"]


def _copies(count: int, threads: int, body: list[str]) -> list[str]:
    """`body` (using l, the element-group number) for l = li, li + threads, ... < count: straight
    code where the invocations divide the tile (shared index arithmetic folds), else a loop."""
    if count % threads == 0 and count // threads <= 16:
        out = []
        for i in range(count // threads):
            out += ["{", f"  let l = li + {u(i * threads)};"] + [f"  {ln}" for ln in body] + ["}"]
        return out
    return ([f"for (var l = li; l < {u(count)}; l = l + {u(threads)}) {{"] + [f"  {ln}" for ln in body] + ["}"])


def _stage_a(spec: GemmSpec, p: MmaPlan, vec: bool, cast: str) -> _Copy:
    """Copy A's BM x BK tile at (row m0, k) into Ta (laid out as p.a_at says)."""
    bm, bk = p.bm, p.bk
    if vec and spec.a.contig == 1:     # four consecutive k a load
        return _Copy(bm * bk // 4, f"let kq = (l % {u(bk // 4)}) * 4u; let mm = l / {u(bk // 4)};",
                     "a_v(bt, m0 + mm, {k} + kq)",
                     tuple(f"Ta[{{o}}{p.a_at('mm', f'kq + {u(q)}')}] = {cast}({{v}}[{q}]);" for q in range(4)), True,
                     walks="k")
    if vec and spec.a.contig == 0:     # four consecutive rows a load (A stored transposed)
        return _Copy(bm * bk // 4, f"let mq = (l % {u(bm // 4)}) * 4u; let kk = l / {u(bm // 4)};",
                     "a_v(bt, m0 + mq, {k} + kk)",
                     tuple(f"Ta[{{o}}{p.a_at(f'mq + {u(q)}', 'kk')}] = {cast}({{v}}[{q}]);" for q in range(4)), True,
                     walks="m")
    fast = spec.a.fast if spec.a.fast is not None else spec.a.contig
    index = (f"let kk = l % {u(bk)}; let mm = l / {u(bk)};" if fast == 1
             else f"let mm = l % {u(bm)}; let kk = l / {u(bm)};")
    return _Copy(bm * bk, index, "a_el(bt, m0 + mm, {k} + kk)", (f"Ta[{{o}}{p.a_at('mm', 'kk')}] = {cast}({{v}});",),
                 False, walks="k" if fast == 1 else "m")


NONE = "0xffffffffu"   # b_at's address of a tap outside the input


def taps_fit(spec: GemmSpec, p: MmaPlan) -> bool:
    """Whether the tap-major form's B copy applies to this plan. Along K: every K tile within
    one tap, and each invocation on one column of the tile for the whole kernel (so its tap
    decode is once a tile). Along N: four channels a copy, each invocation on one k of the tile."""
    g = spec.b.taps
    if g is None:
        return False
    if g.axis == 1:
        return g.channels % 4 == 0 and p.bn % 4 == 0 and p.threads % p.bk == 0
    # fewer invocations than columns (Intel's subgroups of 16: 64 invocations, 128 columns):
    # each invocation keeps bn / threads columns
    return g.channels % p.bk == 0 and (p.threads % p.bn == 0 or p.bn % p.threads == 0)


def _stage_b_taps(spec: GemmSpec, p: MmaPlan, cast: str) -> _Copy:
    """Copy B's tile of a TapGather operand: column n0 + li % BN is this invocation's for every
    K tile; each tile finds its tap's base address once (b_at), then each element is base plus
    its channel's offset (b_tg)."""
    g = spec.b.taps
    bn, bk = p.bn, p.bk
    if g.axis == 1:   # k li % BK for the whole kernel, four channels of one tap a copy
        return _Copy(bn * bk // 4, f"let kk = li % {u(bk)}; let nq = (l / {u(bk)}) * 4u;",
                     "b_tg4(bt, {k} + kk, n0 + nq)",
                     tuple(f"Tb[{{o}}{p.b_at('kk', f'nq + {u(q)}')}] = {cast}({{v}}[{q}]);" for q in range(4)), True,
                     walks="k")
    index = f"let nn = l % {u(bn)}; let kk = l / {u(bn)};"
    store = (f"Tb[{{o}}{p.b_at('kk', 'nn')}] = {cast}({{v}});",)
    tile_k = ("let tb_k = {k};", f"let tb_ch = tb_k % {u(g.channels)};")
    cols = bn // p.threads
    if cols <= 1:   # one column an invocation: column n0 + li % BN
        return _Copy(bn * bk, index, "b_tg(tb_base, tb_ch + kk)", store, False,
                     fixed=(f"let tb_c = n0 + li % {u(bn)};",),
                     setup=tile_k + (f"let tb_base = b_at(bt, tb_c, tb_k / {u(g.channels)});",), walks="n")
    # columns n0 + li + j * threads, j < cols: element l's is j = (l / threads) % cols
    return _Copy(bn * bk, index + f" let tj = (l / {u(p.threads)}) % {u(cols)};", "b_tg(tb_base[tj], tb_ch + kk)",
                 store, False, fixed=(f"var tb_base: array<u32, {cols}>;",),
                 setup=tile_k + tuple(f"tb_base[{j}] = b_at(bt, n0 + li + {u(j * p.threads)}, tb_k / {u(g.channels)});"
                                      for j in range(cols)), walks="n")


def _tap_fns(spec: GemmSpec, vec4: bool) -> list[str]:
    """Along K: b_at(bt, c, tap), the index of channel 0 under (tap, column c), NONE outside, and
    b_tg(base, ch), the element of channel ch there (0 at NONE). Along N: b_tg4(bt, r, n), the
    four channels from column n's at row r. Each through the operand's prologue if any."""
    op, g = spec.b, spec.b.taps
    read = _scalar_read(op.var, vec4, f"base + ch * {u(g.stride)}")
    act = (lambda e: f"b_act({e})") if op.apply else (lambda e: e)
    if g.axis == 1:
        reads = ", ".join(act(_scalar_read(op.var, vec4, f"base + {u(q * g.stride)}")) for q in range(4))
        return ["fn b_tg4(bt: u32, r: u32, n: u32) -> vec4<f32> {",
                f"  let tap = n / {u(g.channels)}; let ch = n % {u(g.channels)};",
                f"  if (r >= {u(op.rows)} || tap >= {u(op.cols // g.channels)}) {{ return vec4<f32>(0.0); }}",
                f"  {g.prelude}"] + ([f"  if (!({g.ok})) {{ return vec4<f32>(0.0); }}"] if g.ok else []) + [
                f"  let base = ({g.base}) + ch * {u(g.stride)};", f"  return vec4<f32>({reads});", "}"]
    return ["fn b_at(bt: u32, c: u32, tap: u32) -> u32 {",
            f"  if (c >= {u(op.cols)} || tap >= {u(op.rows // g.channels)}) {{ return {NONE}; }}",
            f"  {g.prelude}"] + ([f"  if (!({g.ok})) {{ return {NONE}; }}"] if g.ok else []) + [
            f"  return {g.base};", "}",
            "fn b_tg(base: u32, ch: u32) -> f32 {",
            f"  if (base == {NONE}) {{ return 0.0; }}",
            f"  return {act(read)};", "}"]



def _stage_b(spec: GemmSpec, p: MmaPlan, vec: bool, cast: str) -> _Copy:
    """Copy B's BK x BN tile at (k, column n0) into Tb (laid out as p.b_at says)."""
    if taps_fit(spec, p):
        return _stage_b_taps(spec, p, cast)
    bn, bk = p.bn, p.bk
    if vec and spec.b.contig == 1:     # four consecutive columns a load
        return _Copy(bn * bk // 4, f"let nq = (l % {u(bn // 4)}) * 4u; let kk = l / {u(bn // 4)};",
                     "b_v(bt, {k} + kk, n0 + nq)",
                     tuple(f"Tb[{{o}}{p.b_at('kk', f'nq + {u(q)}')}] = {cast}({{v}}[{q}]);" for q in range(4)), True,
                     walks="n")
    if vec and spec.b.contig == 0:     # four consecutive k a load (B stored transposed: x @ W.T)
        return _Copy(bn * bk // 4, f"let kq = (l % {u(bk // 4)}) * 4u; let nn = l / {u(bk // 4)};",
                     "b_v(bt, {k} + kq, n0 + nn)",
                     tuple(f"Tb[{{o}}{p.b_at(f'kq + {u(q)}', 'nn')}] = {cast}({{v}}[{q}]);" for q in range(4)), True,
                     walks="k")
    fast = spec.b.fast if spec.b.fast is not None else spec.b.contig
    index = (f"let kk = l % {u(bk)}; let nn = l / {u(bk)};" if fast == 0
             else f"let nn = l % {u(bn)}; let kk = l / {u(bn)};")
    walks = "k" if fast == 0 else "n"
    store = (f"Tb[{{o}}{p.b_at('kk', 'nn')}] = {cast}({{v}});",)
    if spec.b.hoist and fast != 0 and p.threads % bn == 0:
        # each invocation on column n0 + li % BN for the whole kernel: its im2col pixel decoded
        # once, before the K loop (the ALU tiles' b_elh)
        return _Copy(bn * bk, index, f"b_elh(bt, {{k}} + kk, n0 + nn, {', '.join(spec.b.hoisted)})", store, False,
                     fixed=(f"let c = n0 + li % {u(bn)};", spec.b.hoist), walks=walks)
    return _Copy(bn * bk, index, "b_el(bt, {k} + kk, n0 + nn)", store, False, walks=walks)


# B's tile as (n, k) only on plans of this many subgroups. H200 f16, x @ W.T (gemm_mma --layout
# nt, 2026-12-03): on 128 x 256 tiles of 8 subgroups 4096^3 149 against 133 TFLOP/s, GPT-2's
# 2048x768x3072 0.18 against 0.49 ms; on 64 x 64 tiles of 4 it lost 1.7-5.4x (4096^3 38 against
# 66). A as (k, m) won on every plan measured (x.T @ dy, 4096^3: 181 against 108).
B_NMAJOR_SUBGROUPS = 8


def tile_majors(spec: GemmSpec, p: MmaPlan) -> MmaPlan:
    """The plan with each workgroup tile laid out along the axis its copy's neighbouring
    invocations walk (MmaPlan.a_kmajor, b_nmajor): their stores then go to neighbouring
    addresses instead of a padded row apart."""
    walk_a = _stage_a(spec, p, _vec_ok(spec.a), "f32").walks
    walk_b = _stage_b(spec, p, _vec_ok(spec.b), "f32").walks
    return replace(p, a_kmajor=walk_a == "m", b_nmajor=walk_b == "k" and p.subgroups == B_NMAJOR_SUBGROUPS)


MAX_PREFETCH_SLOTS = 32   # element groups one invocation holds for the next K tile (registers)


def prefetch_slots(copy: _Copy, threads: int) -> int:
    """Element groups per invocation for a register prefetch of this copy (the last one guarded
    where the invocations do not divide the tile); 0 where that would take too many registers."""
    n = math.ceil(copy.count / threads)
    return n if n <= MAX_PREFETCH_SLOTS else 0


def _k_loop(copies: list[tuple[str, _Copy]], p: MmaPlan, step: list[str]) -> list[str]:
    """The K loop: stage both tiles, barrier, multiply, barrier. With p.prefetch, the next K tile
    is read into registers before this one is multiplied, so global-memory latency (an im2col
    gather's most of all) overlaps the matrix units' work instead of stalling every subgroup at
    the barrier; the copy into workgroup memory then only moves registers. A copy too large for
    registers (prefetch_slots 0: an element-wise gather of a wide tile) is read in the loop."""
    def ind(lines: list[str]) -> list[str]:
        return ["    " + ln for ln in lines]
    head = [f"  for (var k0 = kb; k0 < ke; k0 = k0 + {u(p.bk)}) {{"]
    # double tiles: this K tile's buffer (uniform: k0 and kb are), and no barrier after the
    # multiplies: the next store goes to the other buffer, which every subgroup finished reading
    # before it passed this K tile's barrier
    tail = ["  }"] if p.double else ["    workgroupBarrier();", "  }"]
    if p.double:
        head += [f"    let buf = ((k0 - kb) / {u(p.bk)}) % 2u;",
                 f"    let oa = buf * {u(p.tile_a)};", f"    let ob = buf * {u(p.tile_b)};"]
        copies = [(name, replace(c, offset=f"o{name} + ")) for name, c in copies]
    fixed = [f"  {ln}" for _, c in copies for ln in c.fixed]
    if not p.prefetch:
        stage = [ln for _, c in copies for ln in c.tile("k0", _copies(c.count, p.threads, c.body("k0", "v")))]
        return fixed + head + ind(stage) + ["    workgroupBarrier();"] + ind(step) + tail
    decl, load, store = list(fixed), [], []
    e = p.config.operand  # registers of the operand type: f16 operands take half (their values are f16)
    for name, c in copies:
        slots = prefetch_slots(c, p.threads)
        if not slots:
            store += c.tile("k0", _copies(c.count, p.threads, c.body("k0", "v")))
            continue
        typ = f"vec4<{e}>" if c.vec else e
        mine = []
        for i in range(slots):
            reg = f"p{name}{i}"
            decl.append(f"  var {reg}: {typ};")
            # the last slot is guarded where the invocations do not divide the tile
            whole = (i + 1) * p.threads <= c.count
            at = ["{", f"  let l = li + {u(i * p.threads)};", "  if (l < " + u(c.count) + ") {" if not whole else "  {",
                  f"  {c.index}"]
            mine += at + [f"  {reg} = {typ}({c.load.format(k='{k}')});", "  }", "}"]
            store += at + [f"  {ln}" for ln in c.store(reg)] + ["  }", "}"]
        load += c.tile("{k}", mine)
    first = [ln.replace("{k}", "kb") for ln in load]
    nxt = [ln.replace("{k}", f"(k0 + {u(p.bk)})") for ln in load]
    return (decl + ["  " + ln for ln in first] + head + ind(store)
            + ["    workgroupBarrier();"] + ind(nxt) + ind(step) + tail)


def mma_wgsl(spec: GemmSpec, p: MmaPlan, caps: AdapterCaps, splits: int = 1, ksplit: int = 0,
             out: Output | None = None, write: Binding | None = None, with_bias: bool = True,
             dialect: SubgroupMatrixWgsl = DIALECT) -> tuple[str, tuple, tuple]:
    """(shader, grid, read values) of one subgroup-matrix GEMM kernel; with splits > 1, problem
    `s` covers K range [s * ksplit, (s + 1) * ksplit) and `out` is the Scratch of partial sums
    (as gemm_wgsl.gemm_wgsl)."""
    out = out or spec.out
    write = write or spec.write
    cfg = p.config
    M, N, K = spec.M, spec.N, spec.K
    nN, nM = math.ceil(N / p.bn), math.ceil(M / p.bm)
    total = nN * nM * spec.batch * splits
    grid = fold_grid(total, caps)
    va, vb = _vec_ok(spec.a), _vec_ok(spec.b)
    reads = [replace(spec.reads[0], vec4=va), replace(spec.reads[1], vec4=vb)]
    reads += list(spec.reads[2:]) if with_bias else []
    if splits == 1:
        ksplit = math.ceil(K / p.bk) * p.bk
    decls = [_decl(i, b, "read") for i, b in enumerate(reads)]
    decls.append(_decl(len(reads), replace(write, vec4=out.contig), "read_write"))
    e = cfg.operand
    cast = e   # loaders return f32: f16 operands round exactly (they are f16 values), f32 ones stay
    sa, sb, sc = p.stride_a, p.stride_b, p.stride_c
    frag = cfg.m * sc
    tiles = [f"var<workgroup> Ta: array<{e}, {p.buffers * p.tile_a}>;",
             f"var<workgroup> Tb: array<{e}, {p.buffers * p.tile_b}>;",
             f"var<workgroup> Tc: array<f32, {p.subgroups * frag}>;"]
    builtins = ["@builtin(workgroup_id) wid: vec3<u32>", "@builtin(local_invocation_index) li: u32"]
    if p.by_subgroup_id:
        builtins += ["@builtin(subgroup_id) sg: u32", "@builtin(subgroup_invocation_id) lane: u32"]
    frags = [(i, j) for i in range(p.frag_rows) for j in range(p.frag_cols)]
    head = [f"@compute @workgroup_size({p.threads}, 1, 1)",
            f"fn main({', '.join(builtins)}) {{",
            f"  let lin = {linear_id(grid)};",
            f"  if (lin >= {u(total)}) {{ return; }}"] + _tile_order(nN, nM) + [
            f"  let bt = (lin / {u(nN * nM)}) % {u(spec.batch)};",
            f"  let s = lin / {u(nN * nM * spec.batch)};",
            f"  let m0 = mb * {u(p.bm)};",
            f"  let n0 = nb * {u(p.bn)};",
            f"  let kb = s * {u(ksplit)};",
            f"  let ke = min(kb + {u(ksplit)}, {u(K)});"]
    if not p.by_subgroup_id:
        head += ["  let sg = 0u;", "  let lane = li;"]
    # this subgroup's block within the workgroup tile: uniform (subgroup_id and constants)
    head += [f"  let sr = (sg / {u(p.sg_cols)}) * {u(p.sub_m)};",
             f"  let sc = (sg % {u(p.sg_cols)}) * {u(p.sub_n)};"]
    head += [f"  var c{i}_{j} = {dialect.zero()};" for i, j in frags]
    step = []
    oa, ob = ("oa + ", "ob + ") if p.double else ("", "")
    for kk in range(0, p.bk, cfg.k):
        step += ["{"]
        step += [f"  let a{i} = {dialect.load_left('Ta', oa + p.a_at(f'sr + {u(i * cfg.m)}', u(kk)), u(sa), p.a_kmajor)};"
                 for i in range(p.frag_rows)]
        step += [f"  let b{j} = {dialect.load_right('Tb', ob + p.b_at(u(kk), f'sc + {u(j * cfg.n)}'), u(sb), p.b_nmajor)};"
                 for j in range(p.frag_cols)]
        step += [f"  c{i}_{j} = {dialect.multiply_add(f'a{i}', f'b{j}', f'c{i}_{j}')};" for i, j in frags]
        step += ["}"]
    copies = [("a", _stage_a(spec, p, va, cast)), ("b", _stage_b(spec, p, vb, cast))]
    loop = _k_loop(copies, p, step)
    # results: fragment by fragment through this subgroup's slice of Tc, then the spec's store
    groups = cfg.m * cfg.n // 4
    per_lane = math.ceil(groups / p.subgroup_size)
    stores = []
    for i, j in frags:
        stores += [f"  {dialect.store('Tc', f'sg * {u(frag)}', f'c{i}_{j}', u(sc))}", "  workgroupBarrier();"]
        for q in range(per_lane):
            g = f"lane + {u(q * p.subgroup_size)}" if q else "lane"
            stores += [f"  if ({g} < {u(groups)}) {{",
                       f"    let rr = ({g}) / {u(cfg.n // 4)}; let cc = (({g}) % {u(cfg.n // 4)}) * 4u;",
                       f"    let o = sg * {u(frag)} + rr * {u(sc)} + cc;",
                       (f"    st4(bt, s, m0 + sr + {u(i * cfg.m)} + rr, n0 + sc + {u(j * cfg.n)} + cc, "
                        "vec4<f32>(Tc[o], Tc[o + 1u], Tc[o + 2u], Tc[o + 3u]));"),
                       "  }"]
        stores += ["  workgroupBarrier();"]
    helpers: dict[str, str] = {}
    loaders = [_loader("a", spec.a, reads[0].vec4, helpers), _loader("b", spec.b, reads[1].vec4, helpers),
               _epi_fn(out, with_bias, helpers)]
    if taps_fit(spec, p):
        loaders += _tap_fns(spec, reads[1].vec4)
    wgsl = "\n".join(dialect.enables(cfg, p.by_subgroup_id) + dialect.types(cfg) + decls + tiles
                     + list(helpers.values()) + loaders + [_store_fn(out, M, N)]
                     + head + loop + stores + ["}"]) + "\n"
    return wgsl, grid, tuple(b.value for b in reads)


# choose_splits fills the GPU with invocations; a matrix-unit workgroup counts as this many, so
# the split-K rule aims at ~256 workgroups (2 an SM on an H200), each with a long K range, instead
# of 1,024 short ones: ResNet-50's weight gradients (64-512 output rows over 200,000 pixels) took
# 100-500 splits, whose reduces cost 4.2 ms of a 45.5 ms step (1.2 ms at this weight, the split
# GEMMs no slower; H200 f16, 2026-12-03)
MMA_WORKGROUP_WEIGHT = 512


@dataclass(frozen=True)
class _SplitView:
    """The fields gemm_splitk.choose_splits reads of a tiling, for a plan (its workgroups'
    invocations as wx x wy, its K tile as the split step)."""

    bm: int
    bn: int
    wx: int
    wy: int
    kt: int
    variant: str = "shared"


def mma_kernels(spec: GemmSpec, caps: AdapterCaps, operand: str, allow_split: bool = True,
                block: int | None = None, kt: int | None = None, threads: int | None = None,
                want_splits: int | None = None, prefetch: int | None = None, lane_tiles: bool = True) -> list[Kernel]:
    """The kernel list of one GEMM-shaped op on matrix units: one kernel, or a split-K kernel
    writing partial sums and the ALU reduce that finishes them (alpha, bias, epilogue).
    prefetch: 0 none, 1 the next K tile into registers, 2 that and double tiles (MmaPlan); None
    the rules (prefetch, and double tiles where plan_mma's rule gives them). lane_tiles: tiles
    laid out along their copies' walk (tile_majors) where they fit; False keeps both row-major.
    ValueError where the adapter has no matrix units for `operand` or the tiles do not fit."""
    p = plan_mma(spec.M, spec.N, spec.K, caps, operand, block=block, bk=kt, threads=threads,
                 prefetch=prefetch is None or prefetch > 0, double=None if prefetch is None else prefetch == 2)
    before: tuple[Kernel, ...] = ()
    if spec.tap_major is not None and taps_fit(spec.tap_major.spec, p):
        spec, before = spec.tap_major.spec, tuple(spec.tap_major.before)
    if lane_tiles:   # B as (n, k) is a little larger than (k, n) (the pad): only where it fits
        laid = tile_majors(spec, p)
        p = next(q for q in (laid, replace(laid, b_nmajor=False), p) if q.workgroup_bytes() <= caps.max_workgroup_storage)
    view = _SplitView(p.bm, p.bn, MMA_WORKGROUP_WEIGHT, 1, p.bk)
    splits, ksplit = choose_splits(spec, view, caps, want_splits) if allow_split else (1, 0)  # type: ignore[arg-type]
    if splits == 1:
        wgsl, grid, reads = mma_wgsl(spec, p, caps)
        kernels = [Kernel(f"{spec.name}[{p.tag}]", wgsl, grid, reads, (spec.write.value,))]
    else:
        kernels = _split_pair(spec, caps, splits, p.tag,
                              lambda part, sb: mma_wgsl(spec, p, caps, splits, ksplit, out=part, write=sb,
                                                        with_bias=False))
    return list(before) + kernels   # `before` declares the Scratch the GEMM reads (one declaration serves a node)


def uses_matrix_units(kernel: Kernel) -> bool:
    """Whether a kernel multiplies on matrix units (its name carries the plan's tag)."""
    return "[mma " in kernel.name


__all__ = ["DIALECT", "FEATURES", "SubgroupMatrixWgsl", "mma_kernels", "mma_wgsl", "uses_matrix_units"]
