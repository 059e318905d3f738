"""Reductions over arbitrary axes (ReduceSum, ReduceMean, ReduceMax, ...).

The input is viewed as kept dims x reduced dims (adjacent dims of one kind merged, size-1 dims
dropped). Many outputs with short reductions: one invocation per output, a serial loop. Few
outputs with long reductions: one workgroup per output, strided partial sums then a workgroup
combine (wgreduce.py: subgroup ops where the adapter has them, else a tree in workgroup memory).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ir.graph import Graph, Node
from ...ops.reduce import reduce_axes
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


SPLIT_MIN = 1 << 14   # reductions longer than this split over several workgroups per output
PER_GROUP = 4096      # elements each workgroup of a split reduction takes


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
    (pre/post may use m[o], o being the output index)."""
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
    post = comb.post.format(x="acc", n=literal(n_red, ty))
    if n_out >= 1024 or n_red <= 32:
        body = f"""  {flat_id()}
  if (i >= {n_out}u) {{ return; }}
  let o = i;
  let b = base_of(i);
  var acc: {ty} = {init};
  for (var r = 0u; r < {n_red}u; r += 1u) {{ acc = {step}; }}
  y[i] = {post};"""
        return [Kernel(f"{name}:serial", shader(decls, body, helpers=helpers), grid(n_out), (x,) + more, (y,),
                       scratch=scratch)]
    wg = 256 if n_red >= 256 else 64
    sg = use_subgroups(caps)
    parts = 1
    if n_red >= SPLIT_MIN and n_out < 256:
        parts = min(256, -(-n_red // PER_GROUP))
    if parts == 1:
        head = (f"  {group_id()}\n  if (g >= {n_out}u) {{ return; }}\n  let o = g;\n  let b = base_of(g);\n"
                f"  let lo = 0u;\n  let hi = {n_red}u;")
        src = _wg_shader(decls, helpers, ty, wg, comb.op, init, head, step, f"y[g] = {post};", sg)
        return [Kernel(f"{name}:wg", src, groups_grid(n_out), (x,) + more, (y,), scratch=scratch)]
    # Two stages: n_out x parts workgroups write partials, then one workgroup per output combines them.
    chunk = -(-n_red // parts)
    part = f"reduce.parts.{y}"
    head = (f"  {group_id()}\n  if (g >= {n_out * parts}u) {{ return; }}\n  let o = g / {parts}u;\n  let b = base_of(o);\n"
            f"  let lo = (g % {parts}u) * {chunk}u;\n  let hi = min(lo + {chunk}u, {n_red}u);")
    src = _wg_shader(decls, helpers, ty, wg, comb.op, init, head, step, "y[g] = acc;", sg)
    stage1 = Kernel(f"{name}:split", src,
                    groups_grid(n_out * parts), (x,) + more, (part,),
                    scratch=(Scratch(part, n_out * parts, ty),) + tuple(scratch))
    wg2 = 64
    head = f"  {group_id()}\n  if (g >= {n_out}u) {{ return; }}\n  let o = g;\n  let lo = g * {parts}u;\n  let hi = lo + {parts}u;"
    src = _wg_shader(decls, helpers, ty, wg2, comb.op, init, head, comb.op.format(a="acc", b="x[r]"),
                     f"y[g] = {post};", sg)
    stage2 = Kernel(f"{name}:combine", src,
                    groups_grid(n_out), (part,) + more, (y,),
                    scratch=(Scratch(part, n_out * parts, ty),) + tuple(scratch))
    return [stage1, stage2]


@lowering(*COMBINE)
def lower_reduce(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x = node.inputs[0]
    shape = shape_of(graph, x)
    infos = [graph.info.get(i) if i else None for i in node.inputs]
    axes = reduce_axes(node, infos, len(shape))
    return reduce_kernels(node.op, x, node.outputs[0], shape, axes, vtype(graph, x), COMBINE[node.op], caps)


# log(sum(exp(x - m))) + m with m the (finite) maximum: a max reduction, then a sum that reads it.
_SAFE_MAX = "fn mm(o: u32) -> f32 { let v = m[o]; return select(0.0, v, abs(v) < 3.4e38); }"


@lowering("ReduceLogSumExp")
def lower_logsumexp(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    infos = [graph.info.get(i) if i else None for i in node.inputs]
    axes = reduce_axes(node, infos, len(shape))
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
