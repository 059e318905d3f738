"""Softmax / LogSoftmax and their gradients, BatchNormalization and BatchNormGrad, Dropout.

Softmax-like ops work on rows along one axis (outer x axis x inner); BatchNorm statistics take
one workgroup per channel. Dropout and DropoutGrad are elementwise table rows (fusable); the
mask is drawn from the counter-based generator of anygrad/rng.py, bit for bit.
"""
from __future__ import annotations

import math

from .... import rng
from ....ir.graph import Graph, Node
from ....ir.passes import resolved
from ....ops.nn import dropout_scale
from . import rowsplit
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .kernels_elementwise import Emit, Val, ew
from .rowsplit import Rows, Stats
from .wgreduce import Part, reduce_code, shared_decl, use_subgroups
from .wgsl import bindings, flat_id, grid, literal, shader, shape_of

# -- rows along an axis ---------------------------------------------------------------------------


def rows(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """(outer, axis length, inner) of a tensor around axis."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


# Per op: the statistics of a row (rowsplit.py: v is x0's element, e its flat index) and the
# store of each element from them. x0 is the input (the forward ops) or dy (the gradients, x1 is
# the forward's output).
_ROWWISE = {
    "Softmax": (Stats(softmax=True), "exp(x0[e] - r_m) / r_s"),
    "LogSoftmax": (Stats(softmax=True), "(x0[e] - r_m) - log(r_s)"),
    "SoftmaxGrad": (Stats(sums=("v * x1[e]",)), "x1[e] * (x0[e] - r_sum0)"),
    "LogSoftmaxGrad": (Stats(sums=("v",)), "x0[e] - exp(x1[e]) * r_sum0"),
}


@lowering(*_ROWWISE)
def lower_softmax(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One read of a row for its statistics (online max and sum of exp for the forward ops, one
    sum for the gradients), then the row's elements written. Rows taken whole are one kernel:
    an invocation a short row, else several rows a workgroup (rowsplit.lane_kernel); long rows
    that are few are split across workgroups: partial statistics, a per-row combine, then every element at once."""
    shape = shape_of(graph, node.inputs[0])
    outer, a, inner = rows(shape, int(resolved(node, "axis")))
    r = Rows(outer * inner, a, inner)
    st, store = _ROWWISE[node.op]
    ins = tuple(node.inputs[:2] if node.op.endswith("Grad") else node.inputs[:1])
    reads = [(f"x{k}", "f32", v) for k, v in enumerate(ins)]
    sg = use_subgroups(caps)
    p = rowsplit.parts(r)
    if p == 1 and rowsplit.row_path(a) == "lanes":
        return [rowsplit.lane_kernel(node.op, r, st, reads, store, node.outputs[0])]
    if p == 1:  # a short row: an invocation a row
        code, shared = rowsplit.stats_code(r, st, "x0", 1, "0u", f"{a}u", sg)
        head = [f"  {flat_id(64)}", f"  if (i >= {r.rows}u) {{ return; }}", "  let row = i;"]
        write = f"  for (var k = 0u; k < {a}u; k += 1u) {{ let e = base + k * {inner}u; y0[e] = {store}; }}"
        body = "\n".join(head + [f"  let base = {r.base('row')};", code, write])
        decls = bindings([(v, ty) for v, ty, _ in reads], [("y0", "f32")])
        src = shader(decls, body, wg=64, shared=shared, subgroups=False)
        return [Kernel(f"{node.op}:row", src, grid(r.rows, 64), ins, (node.outputs[0],))]
    y = node.outputs[0]
    rec, stats = f"rows.rec.{y}", f"rows.stats.{y}"
    scratch = (Scratch(rec, r.rows * p * st.width), Scratch(stats, 3 * r.rows))
    kernels = [rowsplit.partial_kernel(node.op, r, st, "x0", reads, "", rec, sg)]
    keep = "  st[3u * row] = r_m; st[3u * row + 1u] = r_s;" + (" st[3u * row + 2u] = r_sum0;" if st.sums else "")
    kernels += rowsplit.row_pass(node.op, r.rows, [("rec", "f32", rec)], [("st", "f32", stats)],
                                 rowsplit.combine_code(r, st) + "\n" + keep, [], "", [], [], scratch, sg)
    n = r.rows * a
    body = f"""  {flat_id()}
  let e = i;
  if (e >= {n}u) {{ return; }}
  let row = {r.row_of('e')};
  let r_m = st[3u * row];
  let r_s = st[3u * row + 1u];
  {"let r_sum0 = st[3u * row + 2u];" if st.sums else ""}
  y0[e] = {store};"""
    decls = bindings([(v, ty) for v, ty, _ in reads] + [("st", "f32")], [("y0", "f32")])
    kernels.append(Kernel(f"{node.op}:write", shader(decls, body), grid(n), ins + (stats,), (y,), scratch=scratch))
    return kernels


# -- BatchNormalization ----------------------------------------------------------------------------
# Per-channel statistics in one pass: sums of (x - k) and (x - k)^2 (and dy, dy * (x - k) for the
# gradient) with k = the channel's first element, so var = E[(x-k)^2] - E[x-k]^2 keeps its
# precision. A channel is split over several workgroups whose partial sums a second kernel
# combines, enough of them that the whole reduction has TARGET_GROUPS workgroups (few channels,
# or few channels x long ones) and each takes at least MIN_PER_GROUP elements; a short one is
# summed and combined by one workgroup.
#
# Every kernel reads x / y / dy / dx as vec4 when S % 4 == 0 (then 4 consecutive elements share a
# channel): one 4-byte load per invocation kept too few bytes in flight to reach DRAM bandwidth on
# a big GPU (H200: 1.76 of 4.8 TB/s for BatchNorm:apply); other S stay scalar.
PER_GROUP = 4096       # a long channel gets a workgroup per this many elements (at most 256)
MIN_PER_GROUP = 1024   # no workgroup takes fewer
TARGET_GROUPS = 512
STATS_UNROLL = 4       # loads an invocation issues a pass of the per-channel sums (channel_stats)


def _bn_geometry(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(N, C, S): x is (N, C, spatial...) with S spatial elements per channel and sample."""
    return shape[0], shape[1], math.prod(shape[2:])


def _width(s: int) -> int:
    """Elements per load: 4 when S % 4 == 0, else 1."""
    return 4 if s % 4 == 0 else 1


def _elem_type(width: int) -> str:
    return "vec4<f32>" if width == 4 else "f32"


def _first(var: str, s: int, width: int) -> str:
    """Channel ch's first element of var (sample 0, pixel 0): the statistics' shift k."""
    return f"{var}[ch * {s // width}u]" + ("[0u]" if width == 4 else "")


def _parts(c: int, count: int) -> int:
    want = max(-(-count // PER_GROUP), -(-TARGET_GROUPS // c))
    return max(1, min(256, want, count // MIN_PER_GROUP))


def _horizontal(acc: str, width: int) -> str:
    """The sum of an accumulator's lanes, pairwise in a fixed order (same bits every run)."""
    return f"(({acc}.x + {acc}.y) + ({acc}.z + {acc}.w))" if width == 4 else acc


def channel_stats(name: str, n: int, c: int, s: int, reads: list[tuple[str, str, str]], shift: str,
                  sums: list[str], combine: str, writes: list[tuple[str, str]], scratch_name: str,
                  extra_scratch: tuple = (), inplace: tuple = (), subgroups: bool = False,
                  width: int = 1) -> list[Kernel]:
    """Kernels computing per-channel sums (WGSL exprs of idx and `k`, the channel's shift) and
    then `combine` (uses ch, s0.., writes outputs) once per channel.

    reads: (var, type, value); writes: (var, value) f32 outputs of combine; subgroups: combine
    the workgroup with subgroup ops (wgreduce.py); width 4: the per-element reads are vec4
    bindings, `idx` counts vec4s and the sums are vec4 expressions, accumulated per lane (four
    chains: more loads in flight, and each chain sums a quarter of the terms)."""
    count = n * s
    parts = _parts(c, count)
    wg = 256 if count >= 1024 else 64
    sw, steps = s // width, count // width  # a channel's run and (sample, pixel) range, in loads
    chunk = -(-steps // parts)
    m = len(sums)
    totals = [Part(_horizontal(f"a{j}", width), f"s{j}") for j in range(m)]
    shared = shared_decl(totals, wg)
    zero = "vec4<f32>(0.0)" if width == 4 else "0.0"
    # STATS_UNROLL loads an invocation a pass, each at a clamped index and its terms zeroed past
    # the chunk's end, so they are independent and in flight at once (one load a pass kept too
    # few bytes in flight: ResNet-50's BatchNorm statistics read at 42% of an H100's bandwidth)
    # (the first, q0 itself, is inside the chunk: the loop's condition)
    def at(q: str) -> str:
        return f"      let idx = ({q} / {sw}u) * {c * sw}u + ch * {sw}u + {q} % {sw}u;"
    loads = ["    {", at("q0")] + [f"      a{j} += {e};" for j, e in enumerate(sums)] + ["    }"]
    for t in range(1, STATS_UNROLL):
        loads += ["    {", f"      let q = min(q0 + {t * wg}u, hi - 1u); let ok = q0 + {t * wg}u < hi;", at("q")]
        loads += [f"      a{j} += select({zero}, {e}, ok);" for j, e in enumerate(sums)] + ["    }"]
    stage1 = f"""  let g = wid.x + wid.y * nwg.x;
  let ch = g / {parts}u;
  let lo = (g % {parts}u) * {chunk}u;
  let hi = min(lo + {chunk}u, {steps}u);
  let k = {shift};
{chr(10).join(f"  var a{j} = {zero};" for j in range(m))}
  for (var q0 = lo + lid.x; q0 < hi; q0 += {STATS_UNROLL * wg}u) {{
{chr(10).join(loads)}
  }}
{reduce_code(totals, wg, subgroups)}"""
    read_decl = [(v, ty) for v, ty, _ in reads]
    read_vals = tuple(val for _, _, val in reads)
    if parts == 1:
        body = stage1 + f"\n  if (lid.x == 0u) {{\n{combine}\n  }}"
        decls = bindings(read_decl, [(v, "f32") for v, _ in writes])
        return [Kernel(f"{name}:stats", shader(decls, body, wg=wg, shared=shared, subgroups=subgroups), (c, 1, 1),
                       read_vals, tuple(val for _, val in writes), scratch=extra_scratch, inplace=inplace)]
    part = f"{scratch_name}.parts"
    body = stage1 + "\n  if (lid.x == 0u) {\n" + "\n".join(
        f"    part[g * {m}u + {j}u] = s{j};" for j in range(m)) + "\n  }"
    decls = bindings(read_decl, [("part", "f32")])
    sc = (Scratch(part, c * parts * m),) + tuple(extra_scratch)
    k1 = Kernel(f"{name}:partial", shader(decls, body, wg=wg, shared=shared, subgroups=subgroups),
                (c * parts, 1, 1), read_vals, (part,), scratch=sc)
    # one workgroup per channel sums its partials (one invocation per channel summing up to 256
    # of them serially was latency-bound: 36-60 us for 24 channels on an H200)
    combined = [Part(f"a{j}", f"s{j}") for j in range(m)]
    body2 = f"""  let ch = wid.x;
  let k = {shift};
{chr(10).join(f"  var a{j} = 0.0;" for j in range(m))}
  for (var p = lid.x; p < {parts}u; p += 64u) {{
{chr(10).join(f"    a{j} += part[(ch * {parts}u + p) * {m}u + {j}u];" for j in range(m))}
  }}
{reduce_code(combined, 64, subgroups)}
  if (lid.x == 0u) {{
{combine}
  }}"""
    decls2 = bindings(read_decl + [("part", "f32")], [(v, "f32") for v, _ in writes])
    k2 = Kernel(f"{name}:combine", shader(decls2, body2, wg=64, shared=shared_decl(combined, 64),
                                          subgroups=subgroups),
                (c, 1, 1), read_vals + (part,),
                tuple(val for _, val in writes), scratch=sc, inplace=inplace)
    return [k1, k2]


def _per_element(name: str, n: int, c: int, s: int, width: int, elems: list[tuple[str, str]],
                 params: list[tuple[str, str]], lets: str, out: tuple[str, str], expr: str,
                 scratch: tuple = ()) -> Kernel:
    """out = expr at every element: `elems` (var, value) are bound per element, vec4 when width is
    4 (then expr, written for scalars, computes 4 lanes at once: the per-channel terms broadcast,
    each lane's arithmetic is the scalar kernel's), `params` (var, value) are per-channel f32 that
    `lets` reads once at channel `ch`."""
    ty = _elem_type(width)
    total = n * c * s // width
    decls = bindings([(v, ty) for v, _ in elems] + [(v, "f32") for v, _ in params], [(out[0], ty)])
    body = f"""  {flat_id()}
  if (i >= {total}u) {{ return; }}
  let ch = (i / {s // width}u) % {c}u;
{lets}
  {out[0]}[i] = {expr};"""
    return Kernel(name, shader(decls, body), grid(total), tuple(v for _, v in elems + params), (out[1],),
                  scratch=scratch)


@lowering("BatchNormalization")
def lower_batchnorm(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, scale, bias, mean, var = node.inputs[:5]
    y = node.outputs[0]
    n, c, s = _bn_geometry(shape_of(graph, x))
    width = _width(s)
    eps = literal(float(node.attr("epsilon", 1e-5)), "f32")
    if not node.attr("training_mode", 0):
        lets = f"  let a = scale[ch] / sqrt(var_[ch] + {eps});"
        return [_per_element("BatchNorm:eval", n, c, s, width, [("x", x)],
                             [("scale", scale), ("bias", bias), ("mean", mean), ("var_", var)],
                             lets, ("y", y), "x[i] * a + (bias[ch] - mean[ch] * a)")]
    st = f"bnstats.{y}"
    scratch = (Scratch(st, 2 * c),)
    lets = """  let a = scale[ch] * st[ch * 2u + 1u];
  let b = bias[ch] - st[ch * 2u] * a;"""
    apply = _per_element("BatchNorm:apply", n, c, s, width, [("x", x)], [("scale", scale), ("bias", bias), ("st", st)],
                         lets, ("y", y), "x[i] * a + b", scratch=scratch)
    return _batchnorm_stats(node, graph, caps, st, scratch) + [apply]


def _batchnorm_stats(node: Node, graph: Graph, caps: AdapterCaps, st: str, scratch: tuple) -> list[Kernel]:
    """The statistics kernels of a training BatchNormalization: per channel (mean, 1/std) into
    `st` (a Scratch of the node's own, or the BN_STATS node's output value), and the running
    mean and variance into outputs 1 and 2 when the node has them."""
    x, mean, var = node.inputs[0], node.inputs[3], node.inputs[4]
    n, c, s = _bn_geometry(shape_of(graph, x))
    width = _width(s)
    eps = literal(float(node.attr("epsilon", 1e-5)), "f32")
    momentum = float(node.attr("momentum", 0.9))
    count = n * s
    outs = [o for o in node.outputs[1:3] if o]
    has_running = len(outs) == 2
    mom, keep = literal(momentum, "f32"), literal(1 - momentum, "f32")
    combine = f"""    let d = s0 / {literal(count, 'f32')};
    let v = max(s1 / {literal(count, 'f32')} - d * d, 0.0);
    st[ch * 2u] = k + d;
    st[ch * 2u + 1u] = 1.0 / sqrt(v + {eps});"""
    reads = [("x", _elem_type(width), x)]
    writes = [("st", st)]
    if has_running:
        combine += f"""
    rm_out[ch] = rm[ch] * {mom} + (k + d) * {keep};
    rv_out[ch] = rv[ch] * {mom} + (v * {literal(count / max(count - 1, 1), 'f32')}) * {keep};"""
        reads += [("rm", "f32", mean), ("rv", "f32", var)]
        writes += [("rm_out", outs[0]), ("rv_out", outs[1])]
    return channel_stats("BatchNorm", n, c, s, reads, _first("x", s, width),
                         ["x[idx] - k", "(x[idx] - k) * (x[idx] - k)"], combine, writes, st, scratch,
                         inplace=(mean, var) if has_running else (), subgroups=use_subgroups(caps), width=width)


# A training BatchNormalization split in two (fusion.split_batchnorm), so that the normalisation
# runs in the elementwise kernel of what follows it (the ReLU, a residual Add): BN_STATS reads x
# once for each channel's (mean, 1/std) and the running statistics; BN_APPLY is an elementwise
# op whose per-channel inputs (scale, bias, those statistics) are bound whole and indexed by
# channel. The BN output is then stored only when something outside the fused group reads it.
BN_STATS = "wgpu.BatchNormStats"   # x, scale, bias, mean, var -> stats (2C), running mean, var
BN_APPLY = "wgpu.BatchNormApply"   # x, scale, bias, stats -> y; attrs channels, spatial


@lowering(BN_STATS)
def lower_batchnorm_stats(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    return _batchnorm_stats(node, graph, caps, node.outputs[0], ())


@ew(BN_APPLY, raw=(1, 2, 3))
def _batchnorm_apply(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    scale, bias, st = a[1].expr, a[2].expr, a[3].expr
    ch = c.let(f"({c.index} / {int(n.attrs['spatial'])}u) % {int(n.attrs['channels'])}u", "u32").expr
    k = c.let(f"{scale}[{ch}] * {st}[{ch} * 2u + 1u]", "f32").expr  # as BatchNorm:apply's a and b
    b = c.let(f"{bias}[{ch}] - {st}[{ch} * 2u] * {k}", "f32").expr
    return [c.let(f"{a[0].expr} * {k} + {b}", "f32")]


@lowering("BatchNormGrad")
def lower_batchnorm_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dy, x, scale = node.inputs[:3]
    dx, dscale, dbias = (node.outputs + ["", "", ""])[:3]
    n, c, s = _bn_geometry(shape_of(graph, x))
    width = _width(s)
    eps = literal(float(node.attr("epsilon", 1e-5)), "f32")
    training = bool(node.attr("training", 1))
    count = n * s
    cnt = literal(count, "f32")
    st = f"bngrad.{dx or dscale}"  # per channel: mean, inv_std, dbias, dscale
    ty = _elem_type(width)
    reads = [("dy", ty, dy), ("x", ty, x)]
    if training:
        shift = _first("x", s, width)
        sums = ["x[idx] - k", "(x[idx] - k) * (x[idx] - k)", "dy[idx]", "dy[idx] * (x[idx] - k)"]
        combine = f"""    let d = s0 / {cnt};
    let inv = 1.0 / sqrt(max(s1 / {cnt} - d * d, 0.0) + {eps});
    let db = s2;
    let ds = inv * (s3 - d * s2);
    let mean = k + d;"""
    else:
        reads += [("rmean", "f32", node.inputs[3]), ("rvar", "f32", node.inputs[4])]
        shift = "rmean[ch]"
        sums = ["dy[idx]", "dy[idx] * (x[idx] - k)"]
        combine = f"""    let inv = 1.0 / sqrt(rvar[ch] + {eps});
    let db = s0;
    let ds = inv * s1;
    let mean = k;"""
    combine += """
    st[ch * 4u] = mean;
    st[ch * 4u + 1u] = inv;
    st[ch * 4u + 2u] = db;
    st[ch * 4u + 3u] = ds;"""
    writes = [("st", st)]
    if dscale:
        combine += "\n    dscale[ch] = ds;"
        writes.append(("dscale", dscale))
    if dbias:
        combine += "\n    dbias[ch] = db;"
        writes.append(("dbias", dbias))
    kernels = channel_stats("BatchNormGrad", n, c, s, reads, shift, sums, combine, writes, st,
                            (Scratch(st, 4 * c),), subgroups=use_subgroups(caps), width=width)
    if dx:
        lets = "  let inv = st[ch * 4u + 1u];"
        if training:
            lets += """
  let mean = st[ch * 4u];
  let db = st[ch * 4u + 2u];
  let ds = st[ch * 4u + 3u];"""
            expr = f"scale[ch] * inv / {cnt} * (dy[i] * {cnt} - db - (x[i] - mean) * inv * ds)"
        else:
            expr = "dy[i] * (scale[ch] * inv)"
        kernels.append(_per_element("BatchNormGrad:dx", n, c, s, width, [("dy", dy), ("x", x)],
                                    [("scale", scale), ("st", st)], lets, ("dx", dx), expr,
                                    scratch=(Scratch(st, 4 * c),)))
    return kernels


# -- Dropout (elementwise rows) ----------------------------------------------------------------------
_RNG = f"""fn mix32(v: u32) -> u32 {{
  var x = v;
  x = x ^ (x >> 16u);
  x = x * {int(rng._M1)}u;
  x = x ^ (x >> 15u);
  x = x * {int(rng._M2)}u;
  x = x ^ (x >> 16u);
  return x;
}}
fn rng_key(seed: u32, step: u32, salt: u32) -> u32 {{
  var k = mix32(seed ^ {rng.GOLDEN}u);
  k = mix32(k ^ step);
  return mix32(k ^ salt);
}}
fn rng_uniform(key: u32, i: u32) -> f32 {{
  return f32(mix32(i ^ key) >> 8u) * {literal(1.0 / (1 << 24), 'f32')};
}}"""


@ew("Dropout", raw=(3,), ignore=(1, 2))
def _dropout(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    ratio, training = float(resolved(n, "ratio")), bool(resolved(n, "training_mode"))
    x = a[0].expr
    if not training or ratio == 0:
        return [Val(x, "f32"), Val("1u", "u32")]
    c.helper("rng", _RNG)
    state = a[3].expr
    key = c.let(f"rng_key({state}[0], {state}[1], {int(n.attr('salt', 0)) & 0xFFFFFFFF}u)", "u32")
    keep = c.let(f"select(0u, 1u, rng_uniform({key.expr}, {c.index}) >= {literal(ratio, 'f32')})", "u32")
    scale = literal(dropout_scale(ratio), "f32")
    return [c.let(f"select(0.0, {x} * {scale}, {keep.expr} != 0u)", "f32"), keep]


@ew("DropoutGrad")
def _dropout_grad(c, n, a, ot):
    scale = literal(dropout_scale(float(n.attr("ratio", 0.5))), "f32")
    return [c.let(f"select(0.0, {a[0].expr} * {scale}, {a[1].expr} != 0u)", "f32")]

