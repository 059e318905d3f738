"""FusedAttention and FusedAttentionGrad (formulas: anygrad/ops/fused_attention.py) as flash
attention: no (T, S) scores, probabilities or gradients ever reach memory.

Forward: a workgroup per (batch x head, block of BLOCK_Q query rows), one invocation per query
row holding its (pre-scaled) query and output accumulator. Keys and values stream through
workgroup memory a tile of BC rows at a time; each invocation scores the tile, then rescales its
running output once per tile (online softmax: running max m and sum l). It writes the output
and the row's log-sum-exp (lse) for the backward. With `causal`, tiles past the block's last
visible key are never loaded.

Backward, deterministic without atomics (every output element has one writer):
  stats: per query row, lse and delta = rowsum(dO * O) side by side in one scratch buffer
         (one binding instead of two: the dK/dV kernel is at 8 storage buffers with a mask);
  dq:    a workgroup per query block, key/value tiles through workgroup memory, one invocation
         per query row: p = exp(s - lse), dp = dO v, ds = p (dp - delta), dq += ds k;
  dkdv:  a workgroup per key block, query/dO tiles (with their lse and delta) through workgroup
         memory, one invocation per key row: dv += p dO, dk += ds q.
Tile sizes follow the adapter's workgroup memory (16 KiB on the weakest); head dims are at
most ir/attention.MAX_HEAD_DIM, kept per invocation in private arrays.
"""
from __future__ import annotations

import math

import numpy as np

from ....errors import UnsupportedOpError
from ....ir.graph import Graph, Node
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .wgsl import bindings, grid, groups_grid, literal, shader, shape_of, strides

BLOCK_Q = 64       # query (forward, dq) or key (dkdv) rows per workgroup: one invocation each
MAX_BLOCK_K = 64   # rows per tile through workgroup memory, fewer when the memory is short
VEC4 = True        # head dims that are multiples of 4 move and multiply as vec4 (4 independent FMAs)

NEG_INF = literal(-math.inf, "f32")
POS_INF = literal(math.inf, "f32")


def _tile(caps: AdapterCaps, floats_per_row: int, extra: int = 0) -> int:
    """The largest power of two <= MAX_BLOCK_K whose rows (floats_per_row each) fit."""
    budget = caps.max_workgroup_storage // 4 - extra
    bc = 1
    while bc * 2 <= MAX_BLOCK_K and bc * 2 * floats_per_row <= budget:
        bc *= 2
    if bc * floats_per_row > budget:
        raise ValueError(f"attention tile of {floats_per_row} floats does not fit {caps.max_workgroup_storage} bytes")
    return bc


def _block(rows: int) -> int:
    """Rows per workgroup: at most BLOCK_Q, the blocks of equal size (65 rows run as 2 x 40, not
    64 + 1), a multiple of 8 invocations."""
    blocks = -(-rows // BLOCK_Q)
    per, quantum = -(-rows // blocks), min(8, BLOCK_Q)
    return -(-per // quantum) * quantum


class _Geo:
    """Shapes and the mask's index arithmetic of one attention node."""

    def __init__(self, node: Node, graph: Graph, q: str, k: str, v: str, mask: str):
        for x in (q, k, v) + ((mask,) if mask else ()):
            if graph.info[x].dtype != np.float32:  # ir/attention.py fuses float32 chains only
                raise UnsupportedOpError(f"{node.label}: the wgpu attention kernels take float32, not "
                                         f"{graph.info[x].dtype} ('{x}'); set ANYGRAD_FUSE_ATTENTION=0")
        qs, ks, vs = shape_of(graph, q), shape_of(graph, k), shape_of(graph, v)
        self.lead = qs[:-2]
        self.bh = math.prod(self.lead)
        self.t, self.d = qs[-2], qs[-1]
        self.s, self.dv = ks[-2], vs[-1]
        self.scale = literal(float(node.attr("scale")), "f32")
        self.causal = bool(int(node.attr("causal", 0)))
        self.offset = int(node.attr("causal_offset", 0))
        self.mask = mask
        # Rows of q, k, v, dO... as vec4s: one 16-byte load and four independent FMAs per step.
        self.w = 4 if VEC4 and self.d % 4 == 0 and self.dv % 4 == 0 else 1
        self.ty = "vec4<f32>" if self.w == 4 else "f32"
        self.d4, self.dv4 = self.d // self.w, self.dv // self.w
        if mask:
            rank = len(qs)
            ms = (1,) * (rank - len(shape_of(graph, mask))) + shape_of(graph, mask)
            st = [0 if d == 1 else s for d, s in zip(ms, strides(ms))]
            full = self.lead + (self.t, self.s)
            lead_st = strides(self.lead)
            terms = [f"((bh / {lead_st[a]}u) % {self.lead[a]}u) * {st[a]}u"
                     for a in range(len(self.lead)) if st[a] and full[a] > 1]
            self.mask_base = " + ".join(terms) if terms else "0u"
            self.m_t, self.m_s = st[-2], st[-1]

    def hsum(self, x: str) -> str:
        return f"dot({x}, vec4<f32>(1.0))" if self.w == 4 else x

    def splat(self, x: str) -> str:
        return f"{self.ty}({x})"

    def bias(self, i: str, j: str) -> str:
        """WGSL: the mask's value at (query i, key j) of head `bh` (`mb` the head's base)."""
        if not self.mask:
            return "0.0"
        return f"M[mb + {i} * {self.m_t}u + {j} * {self.m_s}u]"

    def mask_base_stmt(self) -> str:
        return f"  let mb = {self.mask_base};" if self.mask else ""

    def key_end(self, last_row: str) -> str:
        """Keys the query rows up to `last_row` may see: all, or up to the causal frontier."""
        if not self.causal:
            return f"{self.s}u"
        return f"min({self.s}u, {last_row} + {self.offset + 1}u)"


def _head_group(nblocks: int, bh: int) -> str:
    return f"""  let g = wid.x + wid.y * nwg.x;
  if (g >= {bh * nblocks}u) {{ return; }}
  let bh = g / {nblocks}u;
  let blk = g % {nblocks}u;"""


def _load_rows(dst: str, src: str, row0: str, rows: str, width: int, bc: int, wg: int, scale: str = "") -> str:
    """Statements copying `rows` rows (a WGSL expression, at most bc) of `width` floats from src,
    starting at row `row0`, into the workgroup array dst (times `scale` when given)."""
    mul = f" * {scale}" if scale else ""
    return (f"    for (var e = lid.x; e < {bc * width}u; e += {wg}u) {{\n"
            f"      if (e / {width}u < {rows}) {{ {dst}[e] = {src}[{row0} * {width}u + e]{mul}; }}\n"
            f"    }}")


def _row_prologue(geo: _Geo, nblocks: int, br: int, rows: int, idx: str, flat: str,
                  regs: list[tuple[str, int]]) -> str:
    """WGSL opening a kernel with one invocation per row of a block: the head and block,
    this invocation's row `idx` of `rows`, `idx`c that row clamped to the last (an invocation past
    the end still joins every barrier and tile load), `flat` its row in the (bh x rows) layout,
    the mask's base, and zeroed private arrays `regs` (name, length in geo.ty)."""
    arrays = "\n".join(f"  var {name}: array<{geo.ty}, {n}>;" for name, n in regs)
    return f"""{_head_group(nblocks, geo.bh)}
  let {idx} = blk * {br}u + lid.x;
  let {idx}c = min({idx}, {rows - 1}u);
  let {flat} = bh * {rows}u + {idx}c;
{geo.mask_base_stmt()}
{arrays}"""


def _load_row(dst: str, src: str, row: str, width: int, scale: str = "") -> str:
    """A statement copying row `row` (width elements) of src into the private array dst (times `scale`)."""
    mul = f" * {scale}" if scale else ""
    return f"  for (var c = 0u; c < {width}u; c++) {{ {dst}[c] = {src}[{row} * {width}u + c]{mul}; }}"


def _key_tiles(geo: _Geo, br: int, bc: int) -> str:
    """WGSL opening the loop of a query-block kernel (forward, dq) over the key/value tiles its rows
    may see: each tile's jn <= bc rows of K and V into workgroup memory (`_kv_shared`), between
    barriers. The caller writes the loop's body and closes it."""
    return f"""  let kend = {geo.key_end(f"min(blk * {br}u + {br - 1}u, {geo.t - 1}u)")};
  for (var kb = 0u; kb < kend; kb += {bc}u) {{
    workgroupBarrier();
    let jn = min({bc}u, {geo.s}u - kb);
{_load_rows("KS", "K", f"(bh * {geo.s}u + kb)", "jn", geo.d4, bc, br)}
{_load_rows("VS", "V", f"(bh * {geo.s}u + kb)", "jn", geo.dv4, bc, br)}
    workgroupBarrier();"""


def _kv_shared(geo: _Geo, bc: int) -> str:
    """The workgroup arrays of `_key_tiles`: a tile of keys and one of values."""
    return f"var<workgroup> KS: array<{geo.ty}, {bc * geo.d4}>;\nvar<workgroup> VS: array<{geo.ty}, {bc * geo.dv4}>;"


def _grad_prob(geo: _Geo, q: str, k: str, dout: str, v: str, i: str, j: str) -> str:
    """WGSL of the backward's inner step for query row i and key j: `sa` = (scaled) q . k, `pa` = dO . v,
    `sv` the score with the mask's bias, `p` = exp(sv - lse) (0 for a masked score or a row with no
    visible key; `lse` a WGSL value in scope). q, k, dout, v: element c of each row, as WGSL
    expressions of `c`."""
    return f"""      var sa = {geo.splat("0.0")};
      for (var c = 0u; c < {geo.d4}u; c++) {{ sa = fma({q}, {k}, sa); }}
      var pa = {geo.splat("0.0")};
      for (var c = 0u; c < {geo.dv4}u; c++) {{ pa = fma({dout}, {v}, pa); }}
      let sv = {geo.hsum("sa")} + {geo.bias(i, j)};
      let p = select(0.0, exp(sv - lse), lse < {POS_INF} && sv > {NEG_INF});"""


def _forward(node: Node, graph: Graph, caps: AdapterCaps) -> Kernel:
    q, k, v = node.inputs[:3]
    mask = node.input(3)
    geo = _Geo(node, graph, q, k, v, mask)
    t, ty, d4, dv4 = geo.t, geo.ty, geo.d4, geo.dv4
    br = _block(t)
    bc = _tile(caps, geo.d + geo.dv)
    nqb = -(-t // br)
    lse_out = node.outputs[1] if len(node.outputs) > 1 else ""
    reads = [("Q", q, ty), ("K", k, ty), ("V", v, ty)] + ([("M", mask, "f32")] if mask else [])
    writes = [("O", node.outputs[0], ty)] + ([("LSE", lse_out, "f32")] if lse_out else [])
    causal_hide = f"if (j > ic + {geo.offset}u) {{ sv = {NEG_INF}; }}" if geo.causal else ""
    write_lse = f"    LSE[row] = select({POS_INF}, m + log(l), l > 0.0);" if lse_out else ""
    body = f"""{_row_prologue(geo, nqb, br, t, "i", "row", [("qr", d4), ("o", dv4)])}
  var sc: array<f32, {bc}>;
{_load_row("qr", "Q", "row", d4, geo.scale)}
  var m = {NEG_INF};
  var l = 0.0;
{_key_tiles(geo, br, bc)}
    var tmax = {NEG_INF};
    for (var jj = 0u; jj < jn; jj++) {{
      let j = kb + jj;
      var acc = {geo.splat("0.0")};
      for (var c = 0u; c < {d4}u; c++) {{ acc = fma(qr[c], KS[jj * {d4}u + c], acc); }}
      var sv = {geo.hsum("acc")} + {geo.bias("ic", "j")};
      {causal_hide}
      sc[jj] = sv;
      tmax = max(tmax, sv);
    }}
    let mn = max(m, tmax);
    if (mn > {NEG_INF}) {{
      let corr = select(0.0, exp(m - mn), m > {NEG_INF});
      l = l * corr;
      for (var c = 0u; c < {dv4}u; c++) {{ o[c] = o[c] * corr; }}
      for (var jj = 0u; jj < jn; jj++) {{
        let p = select(0.0, exp(sc[jj] - mn), sc[jj] > {NEG_INF});
        l += p;
        let pv = {geo.splat("p")};
        for (var c = 0u; c < {dv4}u; c++) {{ o[c] = fma(pv, VS[jj * {dv4}u + c], o[c]); }}
      }}
      m = mn;
    }}
  }}
  if (i < {t}u) {{
    let inv = select(0.0, 1.0 / l, l > 0.0);
    for (var c = 0u; c < {dv4}u; c++) {{ O[row * {dv4}u + c] = o[c] * inv; }}
{write_lse}
  }}"""
    shared = _kv_shared(geo, bc)
    decls = bindings([(n, tp) for n, _, tp in reads], [(n, tp) for n, _, tp in writes])
    return Kernel(f"FusedAttention:fwd{'-vec4' if geo.w == 4 else ''}", shader(decls, body, wg=br, shared=shared),
                  groups_grid(geo.bh * nqb), tuple(val for _, val, _ in reads), tuple(val for _, val, _ in writes))


@lowering("FusedAttention")
def lower_fused_attention(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    return [_forward(node, graph, caps)]


def _stats(dout: str, out: str, lse: str, st: str, rows: int, dv: int, sc: tuple) -> Kernel:
    decls = bindings([("DO", "f32"), ("O", "f32"), ("LSE", "f32")], [("ST", "f32")])
    body = f"""  let i = gid.x + gid.y * (nwg.x * 64u);
  if (i >= {rows}u) {{ return; }}
  var acc = 0.0;
  for (var c = 0u; c < {dv}u; c++) {{ acc = fma(DO[i * {dv}u + c], O[i * {dv}u + c], acc); }}
  ST[2u * i] = LSE[i];
  ST[2u * i + 1u] = acc;"""
    return Kernel("FusedAttentionGrad:stats", shader(decls, body, wg=64), grid(rows, 64), (dout, out, lse), (st,),
                  scratch=sc)


def _grad_dq(node: Node, geo: _Geo, caps: AdapterCaps, dout: str, q: str, k: str, v: str, st: str, dq: str,
             sc: tuple) -> Kernel:
    t, ty, d4, dv4 = geo.t, geo.ty, geo.d4, geo.dv4
    br = _block(t)
    bc = _tile(caps, geo.d + geo.dv)
    nqb = -(-t // br)
    reads = [("DO", dout, ty), ("Q", q, ty), ("K", k, ty), ("V", v, ty), ("ST", st, "f32")] + (
        [("M", geo.mask, "f32")] if geo.mask else [])
    stop = f"if (j > ic + {geo.offset}u) {{ break; }}" if geo.causal else ""
    body = f"""{_row_prologue(geo, nqb, br, t, "i", "row", [("qr", d4), ("dor", dv4), ("acc", d4)])}
{_load_row("qr", "Q", "row", d4, geo.scale)}
{_load_row("dor", "DO", "row", dv4)}
  let lse = ST[2u * row];
  let delta = ST[2u * row + 1u];
{_key_tiles(geo, br, bc)}
    for (var jj = 0u; jj < jn; jj++) {{
      let j = kb + jj;
      {stop}
{_grad_prob(geo, "qr[c]", f"KS[jj * {d4}u + c]", "dor[c]", f"VS[jj * {dv4}u + c]", "ic", "j")}
      let ds = {geo.splat(f"p * ({geo.hsum('pa')} - delta)")};
      for (var c = 0u; c < {d4}u; c++) {{ acc[c] = fma(ds, KS[jj * {d4}u + c], acc[c]); }}
    }}
  }}
  if (i < {t}u) {{
    for (var c = 0u; c < {d4}u; c++) {{ DQ[row * {d4}u + c] = acc[c] * {geo.scale}; }}
  }}"""
    shared = _kv_shared(geo, bc)
    decls = bindings([(n, tp) for n, _, tp in reads], [("DQ", ty)])
    return Kernel(f"FusedAttentionGrad:dq{'-vec4' if geo.w == 4 else ''}", shader(decls, body, wg=br, shared=shared),
                  groups_grid(geo.bh * nqb), tuple(val for _, val, _ in reads), (dq,), scratch=sc)


def _grad_dkdv(node: Node, geo: _Geo, caps: AdapterCaps, dout: str, q: str, k: str, v: str, st: str,
               dk: str, dv_out: str, sc: tuple) -> Kernel:
    t, s, ty, d4, dv4 = geo.t, geo.s, geo.ty, geo.d4, geo.dv4
    br = _block(s)
    bc = _tile(caps, geo.d + geo.dv + 2)
    nkb = -(-s // br)
    reads = [("DO", dout, ty), ("Q", q, ty), ("K", k, ty), ("V", v, ty), ("ST", st, "f32")] + (
        [("M", geo.mask, "f32")] if geo.mask else [])
    # Queries before the block's first key minus the offset see none of its keys: skip their tiles.
    if geo.causal:
        first = f"select(0u, ((blk * {br}u - {geo.offset}u) / {bc}u) * {bc}u, blk * {br}u > {geo.offset}u)"
        skip = f"if (jc > i + {geo.offset}u) {{ continue; }}"
    else:
        first, skip = "0u", ""
    body = f"""{_row_prologue(geo, nkb, br, s, "j", "krow", [("kr", d4), ("vr", dv4), ("dk", d4), ("dvv", dv4)])}
{_load_row("kr", "K", "krow", d4)}
{_load_row("vr", "V", "krow", dv4)}
  for (var qb = {first}; qb < {t}u; qb += {bc}u) {{
    workgroupBarrier();
    let n = min({bc}u, {t}u - qb);
{_load_rows("QS", "Q", f"(bh * {t}u + qb)", "n", d4, bc, br, geo.scale)}
{_load_rows("DOS", "DO", f"(bh * {t}u + qb)", "n", dv4, bc, br)}
    for (var e = lid.x; e < {bc}u; e += {br}u) {{
      if (e < n) {{ LS[e] = ST[2u * (bh * {t}u + qb + e)]; DS[e] = ST[2u * (bh * {t}u + qb + e) + 1u]; }}
    }}
    workgroupBarrier();
    for (var ii = 0u; ii < n; ii++) {{
      let i = qb + ii;
      {skip}
      let lse = LS[ii];
{_grad_prob(geo, f"QS[ii * {d4}u + c]", "kr[c]", f"DOS[ii * {dv4}u + c]", "vr[c]", "i", "jc")}
      let pv = {geo.splat("p")};
      for (var c = 0u; c < {dv4}u; c++) {{ dvv[c] = fma(pv, DOS[ii * {dv4}u + c], dvv[c]); }}
      let ds = {geo.splat(f"p * ({geo.hsum('pa')} - DS[ii])")};
      for (var c = 0u; c < {d4}u; c++) {{ dk[c] = fma(ds, QS[ii * {d4}u + c], dk[c]); }}
    }}
  }}
  if (j < {s}u) {{
    for (var c = 0u; c < {d4}u; c++) {{ DK[krow * {d4}u + c] = dk[c]; }}
    for (var c = 0u; c < {dv4}u; c++) {{ DV[krow * {dv4}u + c] = dvv[c]; }}
  }}"""
    shared = (f"var<workgroup> QS: array<{ty}, {bc * d4}>;\nvar<workgroup> DOS: array<{ty}, {bc * dv4}>;\n"
              f"var<workgroup> LS: array<f32, {bc}>;\nvar<workgroup> DS: array<f32, {bc}>;")
    decls = bindings([(n, tp) for n, _, tp in reads], [("DK", ty), ("DV", ty)])
    return Kernel(f"FusedAttentionGrad:dkdv{'-vec4' if geo.w == 4 else ''}",
                  shader(decls, body, wg=br, shared=shared), groups_grid(geo.bh * nkb),
                  tuple(val for _, val, _ in reads), (dk, dv_out), scratch=sc)


@lowering("FusedAttentionGrad")
def lower_fused_attention_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dout, q, k, v, out, lse = node.inputs[:6]
    mask = node.input(6)
    dq, dk, dv = (list(node.outputs) + ["", "", ""])[:3]
    geo = _Geo(node, graph, q, k, v, mask)
    st = f"attn.stats.{dq or dk or dv}"
    sc = (Scratch(st, 2 * geo.bh * geo.t),)
    kernels = [_stats(dout, out, lse, st, geo.bh * geo.t, geo.dv, sc)]
    if dq:
        kernels.append(_grad_dq(node, geo, caps, dout, q, k, v, st, dq, sc))
    if dk or dv:
        kernels.append(_grad_dkdv(node, geo, caps, dout, q, k, v, st, dk, dv, sc))
    return kernels
