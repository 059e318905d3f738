"""Feature normalisations: LayerNormalization, RMSNormalization, GroupNormalization /
InstanceNormalization and their backward ops LayerNormGrad / RMSNormGrad / GroupNormGrad
(formulas: anygrad/ops/norm.py). RMSNorm is LayerNorm's kernels with a mean of zero.

All of them standardise contiguous rows: LayerNorm's rows are x.shape[:axis] x (the rest),
GroupNorm's are (N x groups) x (channels of the group x spatial). One kernel per row reads the
row once for every sum it needs (shifted by the row's first element, so the variance keeps its
precision; the gradient's four sums together) and then writes every element of the row: one
invocation per row with serial loops for short rows, else several rows a workgroup, a run of
lanes a row combining its sums in its own slice of workgroup memory (rowsplit.py's grouped
rows).
Parameter gradients (sums over rows, per scale/bias entry) are a second kernel reading the
per-row statistics the first one left in a scratch buffer; LayerNorm's dscale and dbias are one
read of dy and x and one kernel adding the slices (colsum.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ....ir.graph import Graph, Node
from ....ir.passes import resolved
from . import colsum, rowsplit
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .wgreduce import Part, reduce_code, shared_decl, use_subgroups
from .wgsl import bindings, broadcast_index, flat_id, grid, group_id, groups_grid, literal, shader, shape_of


@dataclass(frozen=True)
class RowSpec:
    """Rows of length `d` at `row * d`; `param` is a WGSL expression (in `row`, `k`) of the
    scale/bias index of element k of the row."""

    rows: int
    d: int
    param: str


def _row_kernel(name: str, spec: RowSpec, sums: list[tuple[str, str]], post: str, store: str,
                reads: list[tuple[str, str]], writes: list[tuple[str, str]], scratch=(),
                per_row: str = "") -> Kernel:
    """sums: (name, WGSL term in `e`, `p`, `k` and K, the row's first element) -> `let name` =
    the term summed over the row, all in one read of the row (one workgroup combine for all);
    post: statements after the sums; store: statements per element (e, p, k) after post;
    per_row: statements after post run once a row (its per-row outputs: kept out of the element
    loop, which stays straight-line); reads/writes: (var, value) bindings (all f32)."""
    d, rows = spec.d, spec.rows
    elem = f"let e = row * {d}u + k; let p = {spec.param};"
    acc = " ".join(f"a_{n} += {term};" for n, term in sums)
    parts = [Part(f"a_{n}", n) for n, _ in sums]
    path = rowsplit.row_path(d)
    if path == "row":
        kind, wg, shared, dims = "row", 64, "", grid(rows, 64)
        head = [f"  {flat_id(64)}", f"  if (i >= {rows}u) {{ return; }}", "  let row = i;"]

        def walk(body: str) -> str:
            return f"  for (var k = 0u; k < {d}u; k += 1u) {{ {elem} {body} }}"
        combine = "\n".join(f"  let {n} = a_{n};" for n, _ in sums)
        once = per_row
    else:  # several rows a workgroup (rowsplit.py); no subgroup op in a segmented combine
        lanes = rowsplit.row_lanes(rows, d)
        wg = rowsplit.GROUP_WG
        kind, shared, dims = f"rows{wg // lanes}x{lanes}", shared_decl(parts, wg), rowsplit.group_grid(rows, lanes)
        head = rowsplit.group_head(rows, lanes)

        def walk(body: str) -> str:
            return rowsplit.live(rowsplit.lane_loop(d, lanes, f"{elem} {body}"), rows, lanes)
        combine = reduce_code(parts, wg, subgroups=False, seg=lanes)
        once = rowsplit.live(f"  if (ln == 0u) {{ {per_row} }}", rows, lanes)
    # K: the row's first element (a spare row of the last workgroup reads row 0's instead)
    lines = head + [f"  let K = X[min(row, {rows - 1}u) * {d}u];"] + [f"  var a_{n} = 0.0;" for n, _ in sums]
    lines += [walk(acc), combine, post] + ([once] if per_row else []) + ([walk(store)] if store else [])
    decls = bindings([(v, "f32") for v, _ in reads], [(v, "f32") for v, _ in writes])
    src = shader(decls, "\n".join(lines), wg=wg, shared=shared)
    return Kernel(f"{name}:{kind}", src, dims, tuple(val for _, val in reads), tuple(val for _, val in writes),
                  scratch=tuple(scratch))


def _param_sum(name: str, n_out: int, count: int, prelude: str, term: str, reads: list[tuple[str, str]],
               out: str, scratch=(), sg: bool = False) -> Kernel:
    """out[o] = sum over q < count of `term` (after `prelude`, which may use o and q)."""
    decls = bindings([(v, "f32") for v, _ in reads], [("y", "f32")])
    if count <= 256 or n_out >= 4096:
        body = f"""  {flat_id()}
  if (i >= {n_out}u) {{ return; }}
  let o = i;
  var acc = 0.0;
  for (var q = 0u; q < {count}u; q += 1u) {{ {prelude} acc += {term}; }}
  y[o] = acc;"""
        return Kernel(f"{name}:serial", shader(decls, body), grid(n_out), tuple(v for _, v in reads), (out,),
                      scratch=tuple(scratch))
    wg = 64
    total = Part("acc", "total")
    body = f"""  {group_id()}
  if (g >= {n_out}u) {{ return; }}
  let o = g;
  var acc = 0.0;
  for (var q = lid.x; q < {count}u; q += {wg}u) {{ {prelude} acc += {term}; }}
{reduce_code([total], wg, sg)}
  if (lid.x == 0u) {{ y[o] = total; }}"""
    src = shader(decls, body, wg=wg, shared=shared_decl([total], wg), subgroups=sg)
    return Kernel(f"{name}:wg", src, groups_grid(n_out), tuple(v for _, v in reads), (out,), scratch=tuple(scratch))


def _param_columns(name: str, spec: RowSpec, dy: str, x: str, st: str, outs: list[tuple[str, str]],
                   scratch: tuple) -> list[Kernel]:
    """dscale and / or dbias (outs: (output, "dy_xhat" | "dy")) in one read of dy and x: a
    slicing kernel writing every sum's partials into one scratch, and one kernel adding the
    slices (colsum.py); a single slice is stored by the first kernel."""
    width = 4 if spec.d % 4 == 0 else 1
    geo = colsum.geometry(spec.rows, spec.d, width)
    vt = colsum.vec_type("f32", width)
    row = f"({{q}}) * {geo.cols}u + c"
    xhat = any(what == "dy_xhat" for _, what in outs)
    loads = f"let dy{{k}} = DY[{row}];"
    if xhat:
        loads += f" let x{{k}} = X[{row}]; let m{{k}} = ST[2u * ({{q}})]; let s{{k}} = ST[2u * ({{q}}) + 1u];"
    terms = ["dy{k} * (x{k} - m{k}) * s{k}" if what == "dy_xhat" else "dy{k}" for _, what in outs]
    reads = [("DY", dy)] + ([("X", x), ("ST", st)] if xhat else [])
    types = {"DY": vt, "X": vt, "ST": "f32"}
    n = len(outs)
    init = colsum.splat("0.0", "f32", width)
    if geo.slices == 1:
        names = [f"D{j}" for j in range(n)]
        decls = bindings([(v, types[v]) for v, _ in reads], [(v, vt) for v in names])
        src = colsum.slice_shader(geo, vt, decls, loads, terms, "{a} + {b}", init, [f"{v}[c] = {{v}};" for v in names])
        return [Kernel(f"{name}:params:cols", src, colsum.slice_grid(geo), tuple(v for _, v in reads),
                       tuple(out for out, _ in outs), scratch=scratch)]
    part = f"{st}.slices"
    sc = tuple(scratch) + (Scratch(part, geo.slices * n * spec.d),)
    decls = bindings([(v, types[v]) for v, _ in reads], [("P", vt)])
    stores = [f"P[(slice * {n}u + {j}u) * {geo.cols}u + c] = {{v}};" for j in range(n)]
    src = colsum.slice_shader(geo, vt, decls, loads, terms, "{a} + {b}", init, stores)
    first = Kernel(f"{name}:params:cols", src, colsum.slice_grid(geo), tuple(v for _, v in reads), (part,),
                   scratch=sc)
    names = [f"D{j}" for j in range(n)]
    body = colsum.finish_body(n, spec.d, geo.slices, "f32", "{a} + {b}", "0.0", [f"{v}[o] = {{v}};" for v in names])
    src = shader(bindings([("P", "f32")], [(v, "f32") for v in names]), body, wg=colsum.WG)
    last = Kernel(f"{name}:params:slices", src, grid(n * spec.d, colsum.WG), (part,), tuple(out for out, _ in outs),
                  scratch=sc)
    return [first, last]


_STAT_SUMS = [("s1", "X[e] - K"), ("s2", "(X[e] - K) * (X[e] - K)")]


def _stat_post(d: int, eps: str) -> str:
    """mean and 1/std (`inv`) from sums shifted by the row's first element K, which keeps the
    variance's precision when the mean is far from zero (as BatchNorm's statistics do)."""
    fd = literal(d, "f32")
    return (f"  let m1 = s1 / {fd};\n  let mean = K + m1;\n"
            f"  let inv = 1.0 / sqrt(max(s2 / {fd} - m1 * m1, 0.0) + {eps});")


# RMSNorm's statistic: no mean (0, so that LayerNorm's stores and gradient formulas apply as written)
_RMS_SUMS = [("s2", "X[e] * X[e]")]


def _rms_post(d: int, eps: str) -> str:
    return f"  let m1 = 0.0;\n  let mean = 0.0;\n  let inv = 1.0 / sqrt(s2 / {literal(d, 'f32')} + {eps});"


# -- LayerNormalization -----------------------------------------------------------------------
def _ln_spec(node: Node, graph: Graph, x: str, scale: str) -> RowSpec:
    shape = shape_of(graph, x)
    axis = int(resolved(node, "axis"))
    norm = shape[axis:]
    param = broadcast_index(norm, shape_of(graph, scale), "k")
    return RowSpec(math.prod(shape[:axis]), math.prod(norm), param)


@lowering("LayerNormalization")
def lower_layer_norm(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.input(2)
    spec = _ln_spec(node, graph, x, scale)
    eps = literal(float(node.attr("epsilon", 1e-5)), "f32")
    reads = [("X", x), ("SC", scale)] + ([("B", bias)] if bias else [])
    store = "Y[e] = (X[e] - mean) * inv * SC[p]" + (" + B[p];" if bias else ";")
    writes = [("Y", node.outputs[0])]
    outs = (node.outputs + ["", ""])[1:3]
    per_row = ""
    if outs[0]:
        writes.append(("M", outs[0]))
        per_row += " M[row] = mean;"
    if outs[1]:
        writes.append(("IS", outs[1]))
        per_row += " IS[row] = inv;"
    return [_row_kernel("LayerNorm", spec, _STAT_SUMS, _stat_post(spec.d, eps), store, reads, writes,
                        per_row=per_row)]


@lowering("RMSNormalization")
def lower_rms_norm(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, scale = node.inputs[0], node.inputs[1]
    spec = _ln_spec(node, graph, x, scale)
    eps = literal(float(node.attr("epsilon", 1e-5)), "f32")
    return [_row_kernel("RMSNorm", spec, _RMS_SUMS, _rms_post(spec.d, eps), "Y[e] = X[e] * inv * SC[p];",
                        [("X", x), ("SC", scale)], [("Y", node.outputs[0])])]


@lowering("RMSNormGrad")
def lower_rms_norm_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dy, x, scale = node.inputs[:3]
    dx, dscale = (list(node.outputs) + ["", ""])[:2]
    spec = _ln_spec(node, graph, x, scale)
    eps = literal(float(node.attr("epsilon", 1e-5)), "f32")
    return _norm_grad("RMSNormGrad", spec, eps, dy, x, scale, dx, [
        (dscale, "dy_xhat", spec.d, spec.rows, f"let row = q; let e = q * {spec.d}u + o;"),
    ], use_subgroups(caps), columns=True, caps=caps, residual=node.input(3) if node.attr("_residual") else "",
        centered=False)


@lowering("LayerNormGrad")
def lower_layer_norm_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dy, x, scale = node.inputs[:3]
    dx, dscale, dbias = (list(node.outputs) + ["", "", ""])[:3]
    spec = _ln_spec(node, graph, x, scale)
    eps = literal(float(node.attr("epsilon", 1e-5)), "f32")
    return _norm_grad("LayerNormGrad", spec, eps, dy, x, scale, dx, [
        # (output, entries, count, prelude giving e and row from o, q)
        (dscale, "dy_xhat", spec.d, spec.rows, f"let row = q; let e = q * {spec.d}u + o;"),
        (dbias, "dy", spec.d, spec.rows, f"let row = q; let e = q * {spec.d}u + o;"),
    ], use_subgroups(caps), columns=True, caps=caps, residual=node.input(3) if node.attr("_residual") else "")


def _norm_grad(name: str, spec: RowSpec, eps: str, dy: str, x: str, scale: str, dx: str, sums: list,
               sg: bool, columns: bool = False, caps: AdapterCaps | None = None, residual: str = "",
               centered: bool = True) -> list[Kernel]:
    """dx by rows (keeping mean and 1/std per row in a scratch), then each parameter gradient
    (columns: entries are neighbours in memory, summed by _param_columns). `residual`: a value of
    dx's shape added to it in the store (fusion.ROW_RESIDUAL_OPS). centered=False: RMSNorm's
    (mean 0: no mean term in dx, and the kept mean is 0)."""
    st = f"normgrad.{dx or sums[0][0]}"
    sc = (Scratch(st, 2 * spec.rows),)
    fd = literal(spec.d, "f32")
    if centered:
        row_sums = _STAT_SUMS + [("s3", "DY[e] * SC[p]"), ("s4", "DY[e] * SC[p] * (X[e] - K)")]
        # mg = mean(dy * scale), mgx = mean(dy * scale * xhat) = inv * (s4 - (mean - K) * s3) / d
        post = _stat_post(spec.d, eps) + f"\n  let mg = s3 / {fd};\n  let mgx = inv * (s4 - m1 * s3) / {fd};"
    else:
        row_sums = _RMS_SUMS + [("s4", "DY[e] * SC[p] * X[e]")]
        post = _rms_post(spec.d, eps) + f"\n  let mg = 0.0;\n  let mgx = inv * s4 / {fd};"
    keep = "ST[2u * row] = mean; ST[2u * row + 1u] = inv;"
    store = ""
    writes = [("ST", st)]
    reads = [("DY", dy), ("X", x), ("SC", scale)]
    if dx:
        store = "DX[e] = inv * (DY[e] * SC[p] - mg - (X[e] - mean) * inv * mgx)"
        store += " + RS[e];" if residual else ";"
        reads += [("RS", residual)] if residual else []
        writes.append(("DX", dx))
    kernels = [_row_kernel(name, spec, row_sums, post, store, reads, writes, scratch=sc, per_row=keep)]
    if columns and any(out for out, *_ in sums):
        outs = [(out, what) for out, what, *_ in sums if out]
        return kernels + _param_columns(name, spec, dy, x, st, outs, sc)
    for out, what, n_out, count, prelude in sums:
        if not out:
            continue
        term = "DY[e] * (X[e] - ST[2u * row]) * ST[2u * row + 1u]" if what == "dy_xhat" else "DY[e]"
        reads = [("DY", dy), ("X", x), ("ST", st)] if what == "dy_xhat" else [("DY", dy)]
        own = sc if what == "dy_xhat" else ()
        kernels.append(_param_sum(f"{name}:{what}", n_out, count, prelude, term, reads, out, scratch=own, sg=sg))
    return kernels


# -- GroupNormalization / InstanceNormalization ------------------------------------------------
def _gn_geometry(node: Node, graph: Graph, x: str) -> tuple[int, int, int, int]:
    """(N, C, spatial, groups)."""
    shape = shape_of(graph, x)
    groups = int(shape[1]) if node.op == "InstanceNormalization" else int(node.attr("num_groups"))
    return shape[0], shape[1], math.prod(shape[2:]), groups


def _gn_spec(n: int, c: int, s: int, groups: int, entries: int) -> RowSpec:
    """Rows (n, group); the parameter of element k is its channel, or its group when the
    parameters are per group."""
    cpg = c // groups
    param = f"(row % {groups}u) * {cpg}u + k / {s}u" if entries == c else f"row % {groups}u"
    return RowSpec(n * groups, cpg * s, param)


@lowering("GroupNormalization", "InstanceNormalization")
def lower_group_norm(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, scale, bias = node.inputs[:3]
    n, c, s, groups = _gn_geometry(node, graph, x)
    eps = literal(float(node.attr("epsilon", 1e-5)), "f32")
    spec = _gn_spec(n, c, s, groups, shape_of(graph, scale)[0])
    bspec = _gn_spec(n, c, s, groups, shape_of(graph, bias)[0])
    store = f"let pb = {bspec.param}; Y[e] = (X[e] - mean) * inv * SC[p] + B[pb];"
    return [_row_kernel(node.op, spec, _STAT_SUMS, _stat_post(spec.d, eps), store, [("X", x), ("SC", scale), ("B", bias)],
                        [("Y", node.outputs[0])])]


@lowering("GroupNormGrad")
def lower_group_norm_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dy, x, scale = node.inputs[:3]
    dx, dscale, dbias = (list(node.outputs) + ["", "", ""])[:3]
    shape = shape_of(graph, x)
    n, c, s, groups = shape[0], shape[1], math.prod(shape[2:]), int(node.attr("num_groups"))
    eps = literal(float(node.attr("epsilon", 1e-5)), "f32")
    spec = _gn_spec(n, c, s, groups, shape_of(graph, scale)[0])
    cpg = c // groups

    def param_sum(out: str, entries: int, what: str):
        cpp = c // entries  # channels per parameter entry (1, or a whole group)
        prelude = (f"let b = q / {cpp * s}u; let e = (b * {c}u + o * {cpp}u) * {s}u + q % {cpp * s}u; "
                   f"let row = b * {groups}u + (o * {cpp}u) / {cpg}u;")
        return (out, what, entries, n * cpp * s, prelude)

    sums = []
    if dscale:
        sums.append(param_sum(dscale, shape_of(graph, scale)[0], "dy_xhat"))
    if dbias:
        sums.append(param_sum(dbias, int(node.attr("bias_shape")[0]), "dy"))
    return _norm_grad("GroupNormGrad", spec, eps, dy, x, scale, dx, sums, use_subgroups(caps))
