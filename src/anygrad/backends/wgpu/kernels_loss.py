"""Class-index losses (CrossEntropy, NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss), their
gradient, CountCorrect and ArgMax/ArgMin, plus the elementwise losses as table rows.

Per sample (class axis 1, spatial dims allowed) one invocation computes log-probabilities and
the weighted loss term; one workgroup then sums the terms and the weights. A target outside
[0, C) cannot raise on a GPU: it counts as ignored (the numpy backend raises DataError).
"""
from __future__ import annotations

import math

from ...ir.graph import Graph, Node
from ...ops.loss import _reduction
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .kernels_elementwise import ew
from .wgreduce import Part, reduce_code, shared_decl, use_subgroups
from .wgsl import bindings, flat_id, grid, literal, shader, shape_of, vtype

_SUM_WG = 256


def _geometry(graph: Graph, x: str) -> tuple[int, int, int]:
    """(N, C, S) of a class-score tensor (N, C, spatial...)."""
    shape = shape_of(graph, x)
    return shape[0], shape[1], math.prod(shape[2:])


def _sample_prelude(n: int, c: int, s: int, node: Node, has_weight: bool) -> str:
    """Defines for sample i: base (flat index of class 0), t (target), ok (not ignored), wt."""
    ignore = node.attr("ignore_index")
    ignored = f" && tgt[i] != {literal(ignore, 'i32')}" if ignore is not None else ""
    w_at = "w[u32(t)]" if has_weight else "1.0"
    return f"""  let base = (i / {s}u) * {c * s}u + i % {s}u;
  let t = tgt[i];
  let ok = t >= 0 && t < {c}{ignored};
  var wt = 0.0;
  if (ok) {{ wt = {w_at}; }}"""


def _logp_fn(log_input: bool, c: int, s: int) -> str:
    """fn logp(base, k) and the row's shift/log-sum (for softmax inputs)."""
    if log_input:
        return ""
    return f"""fn row_lse(base: u32) -> f32 {{
  var m = x[base];
  for (var k = 1u; k < {c}u; k += 1u) {{ m = max(m, x[base + k * {s}u]); }}
  var e = 0.0;
  for (var k = 0u; k < {c}u; k += 1u) {{ e += exp(x[base + k * {s}u] - m); }}
  return m + log(e);
}}"""


def _class_loss_attrs(node: Node) -> tuple[bool, str, float]:
    log_input = {"NegativeLogLikelihoodLoss": True, "SoftmaxCrossEntropyLoss": False}.get(
        node.op, bool(node.attr("log_input", 0)))
    return log_input, _reduction(node), float(node.attr("label_smoothing", 0.0))


@lowering("CrossEntropy", "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss")
def lower_class_loss(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, target = node.inputs[0], node.inputs[1]
    weight = node.input(2)
    loss = node.outputs[0]
    logp_out = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1] else ""
    log_input, reduction, smooth = _class_loss_attrs(node)
    n, c, s = _geometry(graph, x)
    samples = n * s
    terms = f"ce.terms.{loss}"
    reads = [("x", "f32"), ("tgt", "i32")] + ([("w", "f32")] if weight else [])
    writes = [("terms", "f32")] + ([("logp", "f32")] if logp_out else [])
    lse = "0.0" if log_input else "row_lse(base)"
    wsum = "1.0" if not weight else "wsum_"
    # Per-sample term: -sum_c q_c logp_c, with q from the module docstring of ops/loss.py.
    if smooth:
        w_c = "w[k]" if weight else "1.0"
        term = f"""  var acc = 0.0;
  for (var k = 0u; k < {c}u; k += 1u) {{
    let lp = x[base + k * {s}u] - lse;
    var q = {literal(smooth / c, 'f32')} * {w_c} * select(0.0, 1.0, ok);
    if (ok && u32(t) == k) {{ q += {literal(1 - smooth, 'f32')} * wt; }}
    acc -= q * lp;
  }}"""
    else:
        term = f"""  var acc = 0.0;
  if (ok) {{ acc = -wt * (x[base + u32(t) * {s}u] - lse); }}"""
    store_logp = ""
    if logp_out:
        store_logp = f"  for (var k = 0u; k < {c}u; k += 1u) {{ logp[base + k * {s}u] = x[base + k * {s}u] - lse; }}"
    body = f"""  {flat_id()}
  if (i >= {samples}u) {{ return; }}
{_sample_prelude(n, c, s, node, bool(weight))}
  let lse = {lse};
{term}
  terms[i] = acc;
  terms[{samples}u + i] = wt;
{store_logp}"""
    del wsum
    k1 = Kernel(f"{node.op}:terms", shader(bindings(reads, writes), body, helpers=_logp_fn(log_input, c, s)),
                grid(samples), tuple(v for v in (x, target, weight) if v), (terms,) + ((logp_out,) if logp_out else ()),
                scratch=(Scratch(terms, 2 * samples),))
    if reduction == "none":
        body = f"""  {flat_id()}
  if (i >= {samples}u) {{ return; }}
  y[i] = terms[i];"""
        k2 = Kernel(f"{node.op}:copy", shader(bindings([("terms", "f32")], [("y", "f32")]), body), grid(samples),
                    (terms,), (loss,), scratch=(Scratch(terms, 2 * samples),))
        return [k1, k2]
    final = "a_total / b_total" if reduction == "mean" else "a_total"
    k2 = Kernel(f"{node.op}:sum", _pair_sum_shader(samples, final, use_subgroups(caps)), (1, 1, 1), (terms,),
                (loss,),
                scratch=(Scratch(terms, 2 * samples),))
    return [k1, k2]


def _pair_sum_shader(count: int, final: str, sg: bool) -> str:
    """One workgroup: a = sum terms[0:count], b = sum terms[count:2count]; y[0] = final."""
    wg = _SUM_WG
    totals = [Part("a", "a_total"), Part("b", "b_total")]
    body = f"""  var a = 0.0;
  var b = 0.0;
  for (var k = lid.x; k < {count}u; k += {wg}u) {{ a += terms[k]; b += terms[{count}u + k]; }}
{reduce_code(totals, wg, sg)}
  if (lid.x == 0u) {{
    y[0] = {final};
  }}"""
    return shader(bindings([("terms", "f32")], [("y", "f32")]), body, wg=wg, shared=shared_decl(totals, wg),
                  subgroups=sg)


@lowering("CrossEntropyGrad")
def lower_class_loss_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dy, x, target = node.inputs[:3]
    weight = node.input(3)
    dx = node.outputs[0]
    log_input, reduction, smooth = _class_loss_attrs(node)
    n, c, s = _geometry(graph, x)
    samples = n * s
    scr = f"ceg.{dx}"
    kernels = []
    reads = [("dy", "f32"), ("x", "f32"), ("tgt", "i32")] + ([("w", "f32")] if weight else [])
    inputs = (dy, x, target) + ((weight,) if weight else ())
    if reduction == "mean":
        # scale = dy / sum(w[t]) over samples not ignored (0 when all are ignored).
        sg = use_subgroups(caps)
        weights = Part("b", "total")
        body = f"""  var b = 0.0;
  for (var i = lid.x; i < {samples}u; i += {_SUM_WG}u) {{
{_sample_prelude(n, c, s, node, bool(weight))}
    b += wt;
  }}
{reduce_code([weights], _SUM_WG, sg)}
  if (lid.x == 0u) {{
    scale[0] = select(0.0, dy[0] / total, total != 0.0);
  }}"""
        decls = bindings(reads, [("scale", "f32")])
        kernels.append(Kernel("CrossEntropyGrad:scale",
                              shader(decls, body, wg=_SUM_WG, shared=shared_decl([weights], _SUM_WG),
                                     subgroups=sg),
                              (1, 1, 1), inputs, (scr,), scratch=(Scratch(scr, 1),)))
        scale_expr = "scale[0]"
        reads2 = reads + [("scale", "f32")]
        inputs2 = inputs + (scr,)
    else:
        scale_expr = "dy[i]" if reduction == "none" else "dy[0]"
        reads2, inputs2 = reads, inputs
    w_c = "w[k]" if weight else "1.0"
    q = f"select(0.0, {literal(1 - smooth, 'f32')} * wt, ok && u32(t) == k)"
    if smooth:
        q += f" + {literal(smooth / c, 'f32')} * {w_c} * select(0.0, 1.0, ok)"
    if log_input:
        grad = f"-({q}) * sc"
        pre = ""
    else:
        wsum = "wsum_c" if weight else literal(c, "f32")
        qsum = f"{literal(1 - smooth, 'f32')} * wt + {literal(smooth / c, 'f32')} * {wsum} * select(0.0, 1.0, ok)" \
            if smooth else "wt"
        grad = f"(exp(x[base + k * {s}u] - lse) * qsum - ({q})) * sc"
        pre = f"  let lse = row_lse(base);\n  let qsum = {qsum};"
        if weight and smooth:
            pre = (f"  var wsum_c = 0.0;\n  for (var k = 0u; k < {c}u; k += 1u) {{ wsum_c += w[k]; }}\n" + pre)
    body = f"""  {flat_id()}
  if (i >= {samples}u) {{ return; }}
{_sample_prelude(n, c, s, node, bool(weight))}
  let sc = {scale_expr};
{pre}
  for (var k = 0u; k < {c}u; k += 1u) {{ dx[base + k * {s}u] = {grad}; }}"""
    kernels.append(Kernel("CrossEntropyGrad:dx",
                          shader(bindings(reads2, [("dx", "f32")]), body, helpers=_logp_fn(log_input, c, s)),
                          grid(samples), inputs2, (dx,), scratch=(Scratch(scr, 1),) if reduction == "mean" else ()))
    return kernels


@lowering("CountCorrect")
def lower_count_correct(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    out, target = node.inputs[:2]
    n, c, s = _geometry(graph, out)
    samples = n * s
    wg = _SUM_WG
    tty = vtype(graph, target)
    sg = use_subgroups(caps)
    count = Part("hits", "total", init="0u", ty="u32")
    body = f"""  var hits = 0u;
  for (var i = lid.x; i < {samples}u; i += {wg}u) {{
    let base = (i / {s}u) * {c * s}u + i % {s}u;
    var best = x[base];
    var arg = 0u;
    for (var k = 1u; k < {c}u; k += 1u) {{
      let v = x[base + k * {s}u];
      if (v > best) {{ best = v; arg = k; }}
    }}
    if ({tty}(arg) == tgt[i]) {{ hits += 1u; }}
  }}
{reduce_code([count], wg, sg)}
  if (lid.x == 0u) {{ y[0] = f32(total); }}"""
    decls = bindings([("x", "f32"), ("tgt", tty)], [("y", "f32")])
    src = shader(decls, body, wg=wg, shared=shared_decl([count], wg), subgroups=sg)
    return [Kernel("CountCorrect", src,
                   (1, 1, 1), (out, target), (node.outputs[0],))]


@lowering("ArgMax", "ArgMin")
def lower_argmax(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x = node.inputs[0]
    shape = shape_of(graph, x)
    axis = int(node.attr("axis", 0))
    axis = axis + len(shape) if axis < 0 else axis
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
    return [c.let(f"max({x}, 0.0) - {x} * {y} + log(1.0 + exp(-abs({x})))", "f32")]


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
