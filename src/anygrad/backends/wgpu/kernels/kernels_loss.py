"""Class-index losses (CrossEntropy, NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss), their
gradient, CountCorrect (with its optional top-k output) and ArgMax/ArgMin, plus the elementwise
losses as table rows.

A sample is a row along the class axis (spatial dims allowed). Its softmax statistics (online
max and sum of exp, split across workgroups for long rows that are few: rowsplit.py), the
argmax and the count of classes above the target's come from one read of the scores; one
invocation per row then finishes the row (loss term, weight, log-sum-exp, hits) and the rows
are summed per workgroup and then by one workgroup, in a fixed order. The gradient recomputes
the per-row log-sum-exp the same way and writes every element of dx in parallel. A target
outside [0, C) cannot raise on a GPU: it counts as ignored (the numpy backend raises DataError).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ....ir.graph import Graph, Node
from ....ir.passes import resolved
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .kernels_elementwise import ew
from .rowsplit import ROWS_WG, Rows, Stats, combine_code, partial_kernel, parts, row_pass
from .wgreduce import Part, reduce_code, shared_decl, use_subgroups
from .wgsl import bindings, flat_id, grid, literal, shader, shape_of, vtype


def _rows(graph: Graph, x: str) -> Rows:
    """Rows along the class axis of a class-score tensor (N, C, spatial...): one per sample."""
    shape = shape_of(graph, x)
    return Rows(shape[0] * math.prod(shape[2:]), shape[1], math.prod(shape[2:]))


@dataclass(frozen=True)
class ClassLoss:
    """What a class-index loss node asks for (ops/loss.py's module docstring has the formulas)."""

    log_input: bool
    reduction: str
    smooth: float
    ignore_index: int | None
    weighted: bool

    @staticmethod
    def of(node: Node, weight: str) -> ClassLoss:
        log_input = {"NegativeLogLikelihoodLoss": True, "SoftmaxCrossEntropyLoss": False}.get(
            node.op, bool(node.attr("log_input", 0)))
        ignore = node.attr("ignore_index")
        return ClassLoss(log_input, resolved(node, "reduction"), float(node.attr("label_smoothing", 0.0)),
                         None if ignore is None else int(ignore), bool(weight))

    def target(self, c: int, row: str = "row") -> str:
        """Lets of sample `row`: t (target), ok (in [0, C) and not ignored), wt (its weight, 0 if not ok)."""
        ignored = f" && t != {literal(self.ignore_index, 'i32')}" if self.ignore_index is not None else ""
        return f"""  let t = i32(tgt[{row}]);
  let ok = t >= 0 && t < {c}{ignored};
  let ts = select(0u, u32(t), ok);
  let wt = select(0.0, {"w[ts]" if self.weighted else "1.0"}, ok);"""

    def w_k(self) -> str:
        return "w[k]" if self.weighted else "1.0"

    def weight_total(self, c: int) -> str:
        """sum_c w_c: a literal, or the scalar the weight-total kernel leaves in `wtot`."""
        return "wtot[0]" if self.weighted else literal(c, "f32")


def _weight_total(w: str, c: int, out: str, sg: bool) -> Kernel:
    """sum_c w[c] into out[0] (label smoothing with class weights needs it once, not per row)."""
    total = Part("acc", "total")
    body = f"""  var acc = 0.0;
  for (var k = lid.x; k < {c}u; k += {ROWS_WG}u) {{ acc += w[k]; }}
{reduce_code([total], ROWS_WG, sg)}
  if (lid.x == 0u) {{ y[0] = total; }}"""
    src = shader(bindings([("w", "f32")], [("y", "f32")]), body, wg=ROWS_WG, shared=shared_decl([total], ROWS_WG),
                 subgroups=sg)
    return Kernel("CrossEntropy:weight-total", src, (1, 1, 1), (w,), (out,), scratch=(Scratch(out, 1),))


def _class_inputs(graph: Graph, x: str, target: str, weight: str, wtot: str) -> list[tuple[str, str, str]]:
    reads = [("x", "f32", x), ("tgt", vtype(graph, target), target)]
    if weight:
        reads.append(("w", "f32", weight))
    if wtot:
        reads.append(("wtot", "f32", wtot))
    return reads


def _row_stats(name: str, cl: ClassLoss, r: Rows, reads, rec: str, counts: int,
               sg: bool) -> tuple[list[Kernel], Stats | None]:
    """The per-row statistics a class loss needs from one read of the scores: softmax max and
    sum (not for NLL), sum_c w_c (x_c - x_t) with label smoothing, the argmax and the count of
    classes above the target's for `counts` of (correct, top-k). None: nothing to read."""
    sums = (f"{cl.w_k()} * (v - pk)",) if cl.smooth else ()
    st = Stats(softmax=not cl.log_input, argmax=counts > 0, greater="pk" if counts > 1 else "", sums=sums)
    if not (st.softmax or st.argmax or sums):
        return [], None
    prelude = cl.target(r.length) + "\n" + _picked(r)
    return [partial_kernel(name, r, st, "x", reads, prelude, rec, sg)], st


def _picked(r: Rows) -> str:
    """tv (the target is a class) and pk (its score, or the row's first when it is not)."""
    return (f"  let tv = t >= 0 && t < {r.length};\n"
            f"  let pk = x[base + select(0u, u32(t), tv) * {r.inner}u];")


def _lse(st: Stats | None) -> str:
    return "r_m + log(r_s)" if st is not None and st.softmax else "0.0"


@lowering("CrossEntropy", "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", "CrossEntropyMetrics")
def lower_class_loss(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """Statistics per (row, chunk of classes), then per row the loss term and weight (and its
    log-sum-exp when log-probabilities or the fused op's row output need it, and the hits for
    CrossEntropyMetrics' counts), then the sums over rows."""
    x, target = node.inputs[0], node.inputs[1]
    weight = node.input(2)
    loss = node.outputs[0]
    fused = node.op == "CrossEntropyMetrics"
    outs = list(node.outputs) + ["", "", ""]
    logp_out = "" if fused else outs[1]
    lse_out = outs[1] if fused else (f"ce.lse.{loss}" if logp_out else "")
    count_outs = [v for v in outs[2:4] if v] if fused else []
    cl = ClassLoss.of(node, weight)
    r = _rows(graph, x)
    sg = use_subgroups(caps)
    kernels = []
    wtot = f"ce.wtot.{loss}" if cl.smooth and weight else ""
    if wtot:
        kernels.append(_weight_total(weight, r.length, wtot, sg))
    reads = _class_inputs(graph, x, target, weight, wtot)
    rec = f"ce.rec.{loss}"
    k = int(node.attr("k", 0))
    stat_kernels, st = _row_stats(node.op, cl, r, reads, rec, len(count_outs), sg)
    kernels += stat_kernels
    lp = f"(x[base + ts * {r.inner}u] - lse)"
    if cl.smooth:  # -sum_c q_c logp_c, q from ops/loss.py; sum_c w_c logp_c = r_sum0 + (pk - lse) * sum_c w_c
        okf = "select(0.0, 1.0, ok)"
        term = (f"  s0 = -{literal(cl.smooth / r.length, 'f32')} * {okf} * (r_sum0 + (pk - lse) * "
                f"{cl.weight_total(r.length)}) - {literal(1 - cl.smooth, 'f32')} * wt * {lp};")
    else:
        term = f"  s0 = select(0.0, -wt * {lp}, ok);"  # an ignored row's -inf log-probability stays out
    per_row = [cl.target(r.length), f"  let base = {r.base('row')};", _picked(r),
               combine_code(r, st) if st is not None else "", f"  let lse = {_lse(st)};", term, "  s1 = wt;"]
    if count_outs:
        per_row.append("  s2 = select(0.0, 1.0, ok && u32(t) == r_arg);")  # ok: a class, not ignore_index
    if len(count_outs) > 1:
        per_row.append(f"  s3 = select(0.0, 1.0, ok && r_cnt < {k}u);")
    row_reads = reads + ([("rec", "f32", rec)] if st is not None else [])
    row_writes = []
    if lse_out:
        per_row.append("  lse_out[row] = lse;")
        row_writes.append(("lse_out", "f32", lse_out))
    scratch = (Scratch(rec, r.rows * parts(r) * st.width),) if st is not None else ()
    scratch += (Scratch(lse_out, r.rows),) if logp_out else ()
    scratch += (Scratch(wtot, 1),) if wtot else ()
    final, final_writes = [], []
    if cl.reduction == "none":
        per_row.append("  y[row] = s0;")
        row_writes.append(("y", "f32", loss))
    else:
        final.append("    y[0] = t0 / t1;" if cl.reduction == "mean" else "    y[0] = t0;")
        final_writes.append(("y", "f32", loss))
    for j, v in enumerate(count_outs):
        final.append(f"    y{j}[0] = t{2 + j};")
        final_writes.append((f"y{j}", "f32", v))
    sums = ["s0", "s1"] + [f"s{2 + j}" for j in range(len(count_outs))] if final else []
    kernels += row_pass(node.op, r.rows, row_reads, row_writes, "\n".join(per_row), sums, "\n".join(final), [],
                        final_writes, scratch, sg)
    if logp_out:
        n = r.rows * r.length
        body = f"""  {flat_id()}
  if (i >= {n}u) {{ return; }}
  y[i] = x[i] - lse[{r.row_of('i')}];"""
        kernels.append(Kernel(f"{node.op}:logp", shader(bindings([("x", "f32"), ("lse", "f32")], [("y", "f32")]), body),
                              grid(n), (x, lse_out), (logp_out,), scratch=scratch))
    return kernels


@lowering("CrossEntropyGrad")
def lower_class_loss_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """Per row: the log-sum-exp (split rows: from per-chunk statistics) and the weight, summed
    for `mean`; then every element of dx at once, reading the logits one more time."""
    dy, x, target = node.inputs[:3]
    weight = node.input(3)
    dx = node.outputs[0]
    cl = ClassLoss.of(node, weight)
    r = _rows(graph, x)
    sg = use_subgroups(caps)
    kernels = []
    wtot = f"ceg.wtot.{dx}" if cl.smooth and weight else ""
    if wtot:
        kernels.append(_weight_total(weight, r.length, wtot, sg))
    reads = _class_inputs(graph, x, target, weight, wtot)
    lse_in = node.input(4)  # the forward's per-row log-sum-exp (CrossEntropyMetrics): no statistics pass
    st = Stats(softmax=True) if not cl.log_input and not lse_in else None
    rec, lse_buf, scale_buf = f"ceg.rec.{dx}", lse_in or f"ceg.lse.{dx}", f"ceg.scale.{dx}"
    scratch = (Scratch(wtot, 1),) if wtot else ()
    if st is not None:
        prelude = ""
        kernels.append(partial_kernel("CrossEntropyGrad", r, st, "x", reads, prelude, rec, sg))
        scratch += (Scratch(rec, r.rows * parts(r) * st.width), Scratch(lse_buf, r.rows))
    if cl.reduction == "mean":
        scratch += (Scratch(scale_buf, 1),)
    if st is not None or cl.reduction == "mean":
        per_row = [cl.target(r.length)]
        row_writes = []
        if st is not None:
            per_row += [combine_code(r, st), f"  lse_out[row] = {_lse(st)};"]
            row_writes.append(("lse_out", "f32", lse_buf))
        sums = []
        if cl.reduction == "mean":  # scale = dy / sum of w[t] over samples not ignored (0 if none)
            per_row.append("  s0 = wt;")
            sums = ["s0"]
        final = "    scale[0] = select(0.0, dy[0] / t0, t0 != 0.0);"
        kernels += row_pass("CrossEntropyGrad", r.rows, reads + ([("rec", "f32", rec)] if st is not None else []),
                            row_writes, "\n".join(per_row), sums, final, [("dy", "f32", dy)],
                            [("scale", "f32", scale_buf)], scratch, sg)
    sc = {"mean": "scale[0]", "sum": "dy[0]", "none": "dy[row]"}[cl.reduction]
    okf = "select(0.0, 1.0, ok)"
    q = f"select(0.0, {literal(1 - cl.smooth, 'f32')} * wt, ok && ts == k)"
    if cl.smooth:
        q += f" + {literal(cl.smooth / r.length, 'f32')} * {cl.w_k()} * {okf}"
    if cl.log_input:
        grad = f"-({q}) * sc"
    else:
        qsum = (f"{literal(1 - cl.smooth, 'f32')} * wt + {literal(cl.smooth / r.length, 'f32')} * "
                f"{cl.weight_total(r.length)} * {okf}") if cl.smooth else "wt"
        grad = f"(exp(x[e] - lse[row]) * ({qsum}) - ({q})) * sc"
    n = r.rows * r.length
    # Rows of contiguous classes (the usual (N, C) logits) go 4 classes per invocation through
    # vec4 loads and stores: the scalar form moved 1.7 TB/s on an H200 (158 us for GPT's
    # 16,384 x 2,048 logits), well below what the elementwise kernels reach.
    w = 4 if r.inner == 1 and r.length % 4 == 0 else 1
    if w == 4:
        lanes = "\n".join(f"""  {{
    let k = k0 + {j}u;
    let xe = xv[{j}];
    g[{j}] = {grad.replace("x[e]", "xe")};
  }}""" for j in range(4))
        body = f"""  {flat_id()}
  if (i >= {n // 4}u) {{ return; }}
  let e0 = i * 4u;
  let row = {r.row_of('e0')};
  let k0 = {r.index_of('e0')};
{cl.target(r.length)}
  let sc = {sc};
  let xv = x[i];
  var g: vec4<f32>;
{lanes}
  dx[i] = g;"""
    else:
        body = f"""  {flat_id()}
  let e = i;
  if (e >= {n}u) {{ return; }}
  let row = {r.row_of('e')};
  let k = {r.index_of('e')};
{cl.target(r.length)}
  let sc = {sc};
  dx[e] = {grad};"""
    ty = "vec4<f32>" if w == 4 else "f32"
    dreads = [(v, ty if v == "x" else t, val) for v, t, val in reads] + [("dy", "f32", dy)]
    if not cl.log_input:
        dreads.append(("lse", "f32", lse_buf))
    if cl.reduction == "mean":
        dreads.append(("scale", "f32", scale_buf))
    decls = bindings([(v, t) for v, t, _ in dreads], [("dx", ty)])
    # Each invocation reads the logits only at the elements it writes: dx may take their storage
    # once a planner lets temporaries share (they are dead after this kernel in a training step).
    kernels.append(Kernel("CrossEntropyGrad:dx", shader(decls, body), grid(n // w), tuple(v for _, _, v in dreads),
                          (dx,), scratch=scratch, inplace=(x,)))
    return kernels


@lowering("CountCorrect")
def lower_count_correct(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """Per (row, chunk of classes) the first index of the max (and, for the top-k output, how
    many classes score above the target's), then per row the hits, summed over rows."""
    out, target = node.inputs[:2]
    r = _rows(graph, out)
    sg = use_subgroups(caps)
    top_k = len(node.outputs) > 1 and bool(node.outputs[1])
    tty = vtype(graph, target)
    reads = [("x", "f32", out), ("tgt", tty, target)]
    st = Stats(argmax=True, greater="pk" if top_k else "")
    prelude = (f"""  let t = i32(tgt[row]);
  let ok = t >= 0 && t < {r.length};
  let pk = x[base + select(0u, u32(t), ok) * {r.inner}u];""")
    rec = f"cc.rec.{node.outputs[0]}"
    kernels = [partial_kernel("CountCorrect", r, st, "x", reads, prelude, rec, sg)]
    per_row = [f"  let base = {r.base('row')};", combine_code(r, st), "  let t = i32(tgt[row]);",
               "  s0 = select(0.0, 1.0, t >= 0 && u32(t) == r_arg);"]
    writes = [("y", "f32", node.outputs[0])]
    final = "    y[0] = t0;"
    if top_k:
        per_row.append(f"  s1 = select(0.0, 1.0, t >= 0 && t < {r.length} && r_cnt < {int(node.attr('k', 5))}u);")
        writes.append(("yk", "f32", node.outputs[1]))
        final += " yk[0] = t1;"
    kernels += row_pass("CountCorrect", r.rows, reads + [("rec", "f32", rec)], [], "\n".join(per_row),
                        ["s0", "s1"] if top_k else ["s0"], final, [], writes,
                        (Scratch(rec, r.rows * parts(r) * st.width),), sg)
    return kernels


@lowering("ArgMax", "ArgMin")
def lower_argmax(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x = node.inputs[0]
    shape = shape_of(graph, x)
    axis = int(resolved(node, "axis"))
    outer, a, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    cmp = ">" if node.op == "ArgMax" else "<"
    if node.attr("select_last_index", 0):
        cmp += "="
    ty = vtype(graph, x)
    body = f"""  {flat_id()}
  if (i >= {outer * inner}u) {{ return; }}
  let base = (i / {inner}u) * {a * inner}u + i % {inner}u;
  var best = x[base];
  var arg = 0u;
  for (var k = 1u; k < {a}u; k += 1u) {{
    let v = x[base + k * {inner}u];
    if (v {cmp} best) {{ best = v; arg = k; }}
  }}
  y[i] = i32(arg);"""
    decls = bindings([("x", ty)], [("y", "i32")])
    return [Kernel(node.op, shader(decls, body), grid(outer * inner), (x,), (node.outputs[0],))]


# -- elementwise losses (fusable table rows) ------------------------------------------------------
@ew("BinaryCrossEntropyWithLogits")
def _bce(c, n, a, ot):
    x, y = a[0].expr, a[1].expr
    # max(x, 0) - x*y per sign, without cancellation (ops/loss.py's reference says why)
    return [c.let(f"select((1.0 - {y}) * {x}, -{y} * {x}, {x} < 0.0) + log(1.0 + exp(-abs({x})))", "f32")]


@ew("BinaryCrossEntropyWithLogitsGrad")
def _bce_grad(c, n, a, ot):
    dy, x, y = a[0].expr, a[1].expr, a[2].expr
    e = c.let(f"exp(-abs({x}))", "f32")
    sig = c.let(f"select({e.expr} / (1.0 + {e.expr}), 1.0 / (1.0 + {e.expr}), {x} >= 0.0)", "f32")
    return [c.let(f"{dy} * ({sig.expr} - {y})", "f32")]


@ew("AbsoluteError")
def _abs_err(c, n, a, ot):
    return [c.let(f"abs({a[0].expr} - {a[1].expr})", "f32")]


@ew("AbsoluteErrorGrad")
def _abs_err_grad(c, n, a, ot):
    return [c.let(f"{a[0].expr} * sign({a[1].expr} - {a[2].expr})", "f32")]
