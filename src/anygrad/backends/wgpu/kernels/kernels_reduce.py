"""Reductions over arbitrary axes (ReduceSum, ReduceMean, ReduceMax, ...).

The input is viewed as kept dims x reduced dims (adjacent dims of one kind merged, size-1 dims
dropped), n_out x n_red. Both axes are split so that every shape has enough parallelism: the
reduced axis into chunks whose partial results a second pass (the same scheme, on a smaller
shape) combines. Within a chunk, either one invocation sums it serially (kept axes innermost:
neighbouring invocations read neighbouring outputs) or one workgroup strides over it and
combines (wgreduce.py: subgroup ops where the adapter has them, else a tree in workgroup memory).
Column reductions that need more than one pass run colsum.py's two kernels (slices of lanes
combined in workgroup memory, vec4 where contiguous, then one serial pass over the slices).
"""
from __future__ import annotations

from dataclasses import dataclass

from ....ir.graph import Graph, Node
from ....ir.passes import resolved
from . import colsum
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .wgreduce import Part, reduce_code, shared_decl, use_subgroups
from .wgsl import (
    bindings,
    flat_id,
    grid,
    group_id,
    groups_grid,
    literal,
    shader,
    shape_of,
    size_of,
    strides,
    vtype,
)


@dataclass(frozen=True)
class Combine:
    init: str            # "zero" | "one" | "-inf" | "+inf"
    op: str              # "{a} + {b}" style
    pre: str = "{x}"     # applied to each element
    post: str = "{x}"    # applied to the total ({n} = reduced count)


COMBINE = {
    "ReduceSum": Combine("zero", "{a} + {b}"),
    "ReduceMean": Combine("zero", "{a} + {b}", post="{x} / {n}"),
    "ReduceMax": Combine("-inf", "max({a}, {b})"),
    "ReduceMin": Combine("+inf", "min({a}, {b})"),
    "ReduceProd": Combine("one", "{a} * {b}"),
    "ReduceSumSquare": Combine("zero", "{a} + {b}", pre="{x} * {x}"),
    "ReduceL1": Combine("zero", "{a} + {b}", pre="abs({x})"),
    "ReduceL2": Combine("zero", "{a} + {b}", pre="{x} * {x}", post="sqrt({x})"),
    "ReduceLogSum": Combine("zero", "{a} + {b}", post="log({x})"),
}


def _init(kind: str, ty: str) -> str:
    if kind == "zero":
        return literal(0, ty)
    if kind == "one":
        return literal(1, ty)
    if ty == "f32":
        return literal(float("-inf") if kind == "-inf" else float("inf"), ty)
    if ty == "i32":
        return "i32(-2147483647 - 1)" if kind == "-inf" else "i32(2147483647)"
    return "0u" if kind == "-inf" else "4294967295u"


def split_dims(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(kept, reduced) lists of (extent, input stride), adjacent dims of one kind merged."""
    st = strides(shape)
    merged: list[list] = []  # [extent, stride, reduced?]
    for d, (e, s) in enumerate(zip(shape, st)):
        if e == 1:
            continue
        red = d in axes
        if merged and merged[-1][2] == red and merged[-1][1] == s * e:
            merged[-1][0] *= e
            merged[-1][1] = s
        else:
            merged.append([e, s, red])
    kept = [(e, s) for e, s, r in merged if not r]
    reduced = [(e, s) for e, s, r in merged if r]
    return kept, reduced


def offset_fn(name: str, dims: list[tuple[int, int]]) -> str:
    """WGSL fn mapping a flat index over dims (row-major) to an input offset."""
    lines = [f"fn {name}(k: u32) -> u32 {{", "  var rem = k;", "  var off = 0u;"]
    for e, s in reversed(dims):
        lines.append(f"  off += (rem % {e}u) * {s}u;")
        lines.append(f"  rem = rem / {e}u;")
    lines += ["  return off;", "}"]
    return "\n".join(lines)


# Every reduction aims for at least this much parallelism, whatever its shape (n_out x n_red).
# Column reductions: one invocation per output and chunk, each a chain of loads; 2^18 invocations
# (a full H100/H200: 132 SMs x 2048) keep enough loads in flight to approach memory bandwidth,
# where 2^16 left a (16384, 1024) bias gradient latency-bound at ~15% of it (GPT profile).
TARGET_THREADS = 1 << 18
TARGET_GROUPS = 512       # workgroups of a row reduction (one workgroup per output and chunk)
MIN_CHUNK = 32            # shortest run of the reduced axis one invocation sums
PER_GROUP = 4096          # fewest elements a workgroup of a split row reduction takes
SHORT = 32                # reductions this short are one invocation's serial loop
UNROLL = 4                # loads a column reduction's invocation issues before adding them


def _ordered_loop(ty: str, lo: str, hi: str, load: str, op: str, pre: str) -> str:
    """`acc` combined over r in [lo, hi) in order, UNROLL loads issued before their combines: the
    same order of operations as a plain loop (the same bits), with more loads in flight."""
    loads = "\n".join(f"    let v{k}: {ty} = {load.format(r=f'r + {k}u')};" for k in range(UNROLL))
    adds = " ".join(f"acc = {op.format(a='acc', b=pre.format(x=f'v{k}'))};" for k in range(UNROLL))
    tail = op.format(a="acc", b=pre.format(x=load.format(r="r")))
    return f"""  var r = {lo};
  for (; r + {UNROLL - 1}u < {hi}; r += {UNROLL}u) {{
{loads}
    {adds}
  }}
  for (; r < {hi}; r += 1u) {{ acc = {tail}; }}"""


def _wg_shader(decls: str, helpers: str, ty: str, wg: int, combine: str, init: str, head: str, loop: str,
               store: str, sg: bool) -> str:
    """`head` (defines b, lo, hi), strided partials over [lo, hi), the workgroup combine, then
    `store` (in `acc`) by the first invocation."""
    part = Part("acc", "total", combine, init, ty)
    body = f"""{head}
  var acc: {ty} = {init};
  for (var r = lo + lid.x; r < hi; r += {wg}u) {{ acc = {loop}; }}
{reduce_code([part], wg, sg)}
  if (lid.x == 0u) {{ acc = total; {store} }}"""
    return shader(decls, body, wg=wg, helpers=helpers, shared=shared_decl([part], wg), subgroups=sg)


def reduce_kernels(name: str, x: str, y: str, shape: tuple[int, ...], axes: tuple[int, ...], ty: str,
                   comb: Combine, caps: AdapterCaps, aux: str = "", scratch: tuple = ()) -> list[Kernel]:
    """Kernels reducing x over axes into y. `aux`: an extra per-output f32 input, bound as `m`
    (pre/post may use m[o], o being the output index).

    Two layouts, by which axis is contiguous in memory:
    - columns (the kept axes are innermost, e.g. a bias gradient summing rows, or a short
      reduction): one invocation per output and chunk of the reduced axis, neighbours reading
      neighbouring outputs; chunks are added up by the same scheme on the n_chunks x n_out partials.
    - rows (the reduced axes are innermost): one workgroup per output and chunk, its invocations
      striding over the chunk, then a workgroup combine; partials n_out x n_chunks again by the
      same scheme.
    Chunk counts depend only on the shape, so the order of every sum is fixed: same bits each run.
    """
    kept, reduced = split_dims(shape, axes)
    n_out = 1
    for e, _ in kept:
        n_out *= e
    n_red = 1
    for e, _ in reduced:
        n_red *= e
    helpers = offset_fn("base_of", kept) + "\n" + offset_fn("red_of", reduced)
    extra = [("m", "f32")] if aux else []
    more = (aux,) if aux else ()
    decls = bindings([("x", ty)] + extra, [("y", ty)])
    init = _init(comb.init, ty)
    step = comb.op.format(a="acc", b=comb.pre.format(x="x[b + red_of(r)]"))
    load = "x[b + red_of({r})]"
    post = comb.post.format(x="acc", n=literal(n_red, ty))
    # The partials' own reduction: plain combine, and the total's post with the original count.
    rest = Combine(comb.init, comb.op, post=comb.post.replace("{n}", literal(n_red, ty)))
    rows = bool(reduced) and reduced[-1][1] == 1 and n_red > SHORT
    if not rows:
        parts = max(1, min(-(-TARGET_THREADS // max(1, n_out)), -(-n_red // MIN_CHUNK)))
        chunk = max(1, -(-n_red // parts))
        parts = max(1, -(-n_red // chunk))  # empty outputs or an empty reduction: one serial pass
        if parts == 1:
            body = f"""  {flat_id()}
  if (i >= {n_out}u) {{ return; }}
  let o = i;
  let b = base_of(i);
  var acc: {ty} = {init};
{_ordered_loop(ty, "0u", f"{n_red}u", load, comb.op, comb.pre)}
  y[i] = {post};"""
            return [Kernel(f"{name}:serial", shader(decls, body, helpers=helpers), grid(n_out), (x,) + more,
                           (y,), scratch=scratch)]
        return _column_kernels(name, x, y, kept, helpers, n_out, n_red, ty, comb, aux, scratch)
    wg = 256 if n_red >= 256 else 64
    sg = use_subgroups(caps)
    parts = max(1, min(n_red // PER_GROUP, -(-TARGET_GROUPS // max(1, n_out))))
    if parts == 1:
        head = (f"  {group_id()}\n  if (g >= {n_out}u) {{ return; }}\n  let o = g;\n  let b = base_of(g);\n"
                f"  let lo = 0u;\n  let hi = {n_red}u;")
        src = _wg_shader(decls, helpers, ty, wg, comb.op, init, head, step, f"y[g] = {post};", sg)
        return [Kernel(f"{name}:wg", src, groups_grid(n_out), (x,) + more, (y,), scratch=scratch)]
    # n_out x parts workgroups write partials (output-major: the next pass reduces rows again).
    chunk = -(-n_red // parts)
    parts = -(-n_red // chunk)
    part = f"reduce.parts.{y}"
    sc = (Scratch(part, n_out * parts, ty),) + tuple(scratch)
    head = (f"  {group_id()}\n  if (g >= {n_out * parts}u) {{ return; }}\n  let o = g / {parts}u;\n"
            f"  let b = base_of(o);\n  let lo = (g % {parts}u) * {chunk}u;\n  let hi = min(lo + {chunk}u, {n_red}u);")
    src = _wg_shader(decls, helpers, ty, wg, comb.op, init, head, step, "y[g] = acc;", sg)
    first = Kernel(f"{name}:split", src, groups_grid(n_out * parts), (x,) + more, (part,), scratch=sc)
    return [first] + reduce_kernels(f"{name}:partials", part, y, (n_out, parts), (1,), ty, rest, caps, aux, sc)


def _column_kernels(name: str, x: str, y: str, kept: list[tuple[int, int]], helpers: str, n_out: int, n_red: int,
                    ty: str, comb: Combine, aux: str, scratch: tuple) -> list[Kernel]:
    """The columns layout in two kernels (colsum.py): slices of the reduced axis, lanes of each
    combined in workgroup memory, then one serial pass over the slices (none for one slice).
    vec4 loads when the innermost kept dim is contiguous and whole vec4s: every other stride is
    then a multiple of its extent, so each vec4 is 4 neighbouring outputs of one reduced index.
    An aux input stays scalar (pre and post read it per output)."""
    width = 4 if not aux and kept and kept[-1][1] == 1 and kept[-1][0] % 4 == 0 else 1
    geo = colsum.geometry(n_red, n_out, width)
    vt = colsum.vec_type(ty, width)
    extra = [("m", "f32")] if aux else []
    more = (aux,) if aux else ()
    at = "b + red_of({q})" if width == 1 else "(b + red_of({q})) / 4u"
    head = f"  let b = base_of(c * {width}u);" + ("\n  let o = c;" if aux else "")
    loads = f"let v{{k}}: {vt} = x[{at}];"
    term = comb.pre.format(x="v{k}")
    init = colsum.splat(_init(comb.init, ty), ty, width)
    post = comb.post.format(x="{v}", n=literal(n_red, ty))
    if geo.slices == 1:
        decls = bindings([("x", vt)] + extra, [("y", vt)])
        src = colsum.slice_shader(geo, vt, decls, loads, [term], comb.op, init, [f"y[c] = {post};"], helpers, head)
        return [Kernel(f"{name}:cols", src, colsum.slice_grid(geo), (x,) + more, (y,), scratch=scratch)]
    part = f"reduce.parts.{y}"
    sc = (Scratch(part, geo.slices * n_out, ty),) + tuple(scratch)
    decls = bindings([("x", vt)] + extra, [("P", vt)])
    store = f"P[slice * {geo.cols}u + c] = {{v}};"
    src = colsum.slice_shader(geo, vt, decls, loads, [term], comb.op, init, [store], helpers, head)
    first = Kernel(f"{name}:cols", src, colsum.slice_grid(geo), (x,) + more, (part,), scratch=sc)
    body = colsum.finish_body(1, n_out, geo.slices, ty, comb.op, _init(comb.init, ty), [f"y[o] = {post};"])
    src = shader(bindings([("P", ty)] + extra, [("y", ty)]), body, wg=colsum.WG)
    last = Kernel(f"{name}:partials:serial", src, grid(n_out, colsum.WG), (part,) + more, (y,), scratch=sc)
    return [first, last]


@lowering(*COMBINE)
def lower_reduce(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x = node.inputs[0]
    shape = shape_of(graph, x)
    axes = tuple(resolved(node, "axes"))
    return reduce_kernels(node.op, x, node.outputs[0], shape, axes, vtype(graph, x), COMBINE[node.op], caps)


# The loss scaler's finite check over a whole gradient arena (fusion.arena_finite_check): the count
# of elements whose exponent bits are all ones (inf or NaN, tested by bits), then +inf when it is
# positive and 0 otherwise, so that IsNaN/IsInf read it as they read a sum of the gradients.
# Inputs after the first are ordering edges for the graph passes; the kernels read only the first.
NON_FINITE = "wgpu.NonFinite"
_NON_FINITE = Combine("zero", "{a} + {b}", pre="select(0.0, 1.0, (bitcast<u32>({x}) & 0x7f800000u) == 0x7f800000u)",
                      post="bitcast<f32>(select(0u, 0x7f800000u, {x} > 0.0))")


@lowering(NON_FINITE)
def lower_non_finite(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x = node.inputs[0]
    n = 1
    for e in shape_of(graph, x):
        n *= e
    return reduce_kernels("NonFinite", x, node.outputs[0], (n,), (0,), "f32", _NON_FINITE, caps)


# FoundInf(x1, ..., xn) -> bool. Scalars (the loss; a gradient arena's NonFinite count from
# fusion.arena_finite_check) are tested by the kernel that stores the bool (u32 1 or 0), as many
# as it may bind. Every other input is a NonFinite reduction, each adding the one before it (its
# aux input, m), so the last is +inf when any of them holds an inf or NaN; the storing kernel reads
# that one too. Any number of inputs of any size, at most the adapter's bindings a kernel.
_FOUND_CHAIN = Combine("zero", "{a} + {b}", pre=_NON_FINITE.pre,
                       post="bitcast<f32>(select(0u, 0x7f800000u, {x} > 0.0 || m[o] > 0.0))")


@lowering("FoundInf")
def lower_found_inf(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    y = node.outputs[0]
    sizes = {x: size_of(graph, x) for x in node.inputs}
    room = max(1, caps.max_storage_buffers_per_stage - 2)  # the bool, and the chain's total
    direct = [x for x in node.inputs if sizes[x] == 1][:room]
    kernels: list[Kernel] = []
    last = ""
    for j, x in enumerate(x for x in node.inputs if x not in direct):
        part = f"{y}.found{j}"
        kernels += reduce_kernels(f"FoundInf{j}", x, part, (sizes[x],), (0,), "f32",
                                  _FOUND_CHAIN if last else _NON_FINITE, caps, aux=last, scratch=(Scratch(part, 1),))
        last = part
    reads = direct + ([last] if last else [])
    bad = " || ".join(f"(bitcast<u32>(s{k}[0]) & 0x7f800000u) == 0x7f800000u" for k in range(len(reads)))
    body = f"  if (i > 0u) {{ return; }}\n  y[0] = select(0u, 1u, {bad});"
    decls = bindings([(f"s{k}", "f32") for k in range(len(reads))], [("y", "u32")])
    return kernels + [Kernel("FoundInf", shader(decls, f"  {flat_id()}\n{body}"), grid(1), tuple(reads), (y,))]


# log(sum(exp(x - m))) + m with m the (finite) maximum: a max reduction, then a sum that reads it.
_SAFE_MAX = "fn mm(o: u32) -> f32 { let v = m[o]; return select(0.0, v, abs(v) < 3.4e38); }"


@lowering("ReduceLogSumExp")
def lower_logsumexp(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    axes = tuple(resolved(node, "axes"))
    n_out = 1
    for d, e in enumerate(shape):
        n_out *= 1 if d in axes else e
    m = f"lse.max.{y}"
    sc = (Scratch(m, n_out),)
    first = reduce_kernels("ReduceLogSumExp:max", x, m, shape, axes, "f32", COMBINE["ReduceMax"], caps, scratch=sc)
    comb = Combine("zero", "{a} + {b}", pre="exp({x} - mm(o))", post="log({x}) + mm(o)")
    second = reduce_kernels("ReduceLogSumExp", x, y, shape, axes, "f32", comb, caps, aux=m, scratch=sc)
    return first + [Kernel(k.name, k.wgsl.replace("\n@compute", "\n" + _SAFE_MAX + "\n@compute", 1), k.workgroups,
                           k.reads, k.writes, k.entry, k.scratch, k.inplace) for k in second]
