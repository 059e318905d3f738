"""Softmax / LogSoftmax and their gradients, BatchNormalization and BatchNormGrad, Dropout.

Softmax-like ops work on rows along one axis (outer x axis x inner); BatchNorm statistics take
one workgroup per channel. Dropout and DropoutGrad are elementwise table rows (fusable); the
mask is drawn from the counter-based generator of anygrad/rng.py, bit for bit.
"""
from __future__ import annotations

import math

import numpy as np

from ... import rng
from ...ir.graph import Graph, Node
from ...ops._util import norm_axis
from ...ops.nn import dropout_scale
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .kernels_elementwise import Emit, Val, ew
from .wgsl import WG, bindings, flat_id, grid, group_id, groups_grid, literal, shader, shape_of

# -- rows along an axis ---------------------------------------------------------------------------


def rows(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """(outer, axis length, inner) of a tensor around axis."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


_ROW_HEAD = """  {flat_id}
  if (i >= {n_rows}u) {{ return; }}
  let base = (i / {inner}u) * {a}u * {inner}u + i % {inner}u;"""

# body per op: `at(k)` is the flat index of element k of the row.
_ROW_BODY = {
    "Softmax": """  var m = x0[at(0u)];
  for (var k = 1u; k < {a}u; k += 1u) {{ m = max(m, x0[at(k)]); }}
  var s = 0.0;
  for (var k = 0u; k < {a}u; k += 1u) {{ s += exp(x0[at(k)] - m); }}
  for (var k = 0u; k < {a}u; k += 1u) {{ y0[at(k)] = exp(x0[at(k)] - m) / s; }}""",
    "LogSoftmax": """  var m = x0[at(0u)];
  for (var k = 1u; k < {a}u; k += 1u) {{ m = max(m, x0[at(k)]); }}
  var s = 0.0;
  for (var k = 0u; k < {a}u; k += 1u) {{ s += exp(x0[at(k)] - m); }}
  let ls = log(s);
  for (var k = 0u; k < {a}u; k += 1u) {{ y0[at(k)] = (x0[at(k)] - m) - ls; }}""",
    "SoftmaxGrad": """  var s = 0.0;
  for (var k = 0u; k < {a}u; k += 1u) {{ s += x0[at(k)] * x1[at(k)]; }}
  for (var k = 0u; k < {a}u; k += 1u) {{ y0[at(k)] = x1[at(k)] * (x0[at(k)] - s); }}""",
    "LogSoftmaxGrad": """  var s = 0.0;
  for (var k = 0u; k < {a}u; k += 1u) {{ s += x0[at(k)]; }}
  for (var k = 0u; k < {a}u; k += 1u) {{ y0[at(k)] = x0[at(k)] - exp(x1[at(k)]) * s; }}""",
}


@lowering(*_ROW_BODY)
def lower_softmax(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    shape = shape_of(graph, node.inputs[0])
    axis = norm_axis(int(node.attr("axis", -1)), len(shape))
    outer, a, inner = rows(shape, axis)
    n_rows = outer * inner
    ins = list(node.inputs[:2] if node.op.endswith("Grad") else node.inputs[:1])
    decls = bindings([(f"x{k}", "f32") for k in range(len(ins))], [("y0", "f32")])
    helper = f"var<private> base_: u32;\nfn at(k: u32) -> u32 {{ return base_ + k * {inner}u; }}"
    body = _ROW_HEAD.format(flat_id=flat_id(), n_rows=n_rows, inner=inner, a=a) + "\n  base_ = base;\n"
    body += _ROW_BODY[node.op].format(a=a)
    return [Kernel(f"{node.op}:row", shader(decls, body, helpers=helper), grid(n_rows), tuple(ins),
                   (node.outputs[0],))]


# -- BatchNormalization ----------------------------------------------------------------------------
def _bn_geometry(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(N, C, S): x is (N, C, spatial...) with S spatial elements per channel and sample."""
    return shape[0], shape[1], math.prod(shape[2:])


def _chan_loop(n: int, c: int, s: int, expr: str, acc: str, wg: int) -> str:
    """Each invocation sums expr(idx) over its share of the channel's N*S elements into acc."""
    return (f"  for (var k = lid.x; k < {n * s}u; k += {wg}u) {{\n"
            f"    let idx = (k / {s}u) * {c * s}u + ch * {s}u + k % {s}u;\n"
            f"    {acc} += {expr};\n  }}")


def _tree(var: str, wg: int) -> str:
    """Sum sh_{var} over the workgroup; every invocation then reads the total from sh_{var}[0]."""
    return (f"  sh_{var}[lid.x] = {var};\n  workgroupBarrier();\n"
            f"  for (var t = {wg // 2}u; t > 0u; t = t >> 1u) {{\n"
            f"    if (lid.x < t) {{ sh_{var}[lid.x] += sh_{var}[lid.x + t]; }}\n    workgroupBarrier();\n  }}\n"
            f"  let {var}_total = sh_{var}[0];\n  workgroupBarrier();")


def _wg_for(count: int) -> int:
    return 256 if count >= 1024 else 64


@lowering("BatchNormalization")
def lower_batchnorm(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, scale, bias, mean, var = node.inputs[:5]
    y = node.outputs[0]
    n, c, s = _bn_geometry(shape_of(graph, x))
    eps = float(node.attr("epsilon", 1e-5))
    total = n * c * s
    apply_decls = bindings([("x", "f32"), ("scale", "f32"), ("bias", "f32"), ("st", "f32")], [("y", "f32")])
    apply_body = f"""  {flat_id()}
  if (i >= {total}u) {{ return; }}
  let ch = (i / {s}u) % {c}u;
  let a = scale[ch] * st[ch * 2u + 1u];
  let b = bias[ch] - st[ch * 2u] * a;
  y[i] = x[i] * a + b;"""
    if not node.attr("training_mode", 0):
        # y = x * a + b with the running statistics; stats computed per element (cheap, 2 loads).
        decls = bindings([("x", "f32"), ("scale", "f32"), ("bias", "f32"), ("mean", "f32"), ("var_", "f32")],
                         [("y", "f32")])
        body = f"""  {flat_id()}
  if (i >= {total}u) {{ return; }}
  let ch = (i / {s}u) % {c}u;
  let a = scale[ch] / sqrt(var_[ch] + {literal(eps, 'f32')});
  y[i] = x[i] * a + (bias[ch] - mean[ch] * a);"""
        return [Kernel("BatchNorm:eval", shader(decls, body), grid(total), (x, scale, bias, mean, var), (y,))]
    momentum = float(node.attr("momentum", 0.9))
    count = n * s
    wg = _wg_for(count)
    st = f"bnstats.{y}"
    outs = [o for o in node.outputs[1:3] if o]
    has_running = len(outs) == 2
    reads = [("x", "f32")] + ([("rm", "f32"), ("rv", "f32")] if has_running else [])
    writes = [("st", "f32")] + ([("rm_out", "f32"), ("rv_out", "f32")] if has_running else [])
    running = ""
    if has_running:
        unbias = count / max(count - 1, 1)
        running = (f"    rm_out[ch] = rm[ch] * {literal(momentum, 'f32')} + mean * {literal(1 - momentum, 'f32')};\n"
                   f"    rv_out[ch] = rv[ch] * {literal(momentum, 'f32')} + "
                   f"(var_ * {literal(unbias, 'f32')}) * {literal(1 - momentum, 'f32')};\n")
    shared = f"var<workgroup> sh_acc: array<f32, {wg}>;\nvar<workgroup> sh_acc2: array<f32, {wg}>;"
    body = f"""  let ch = wid.x;
  var acc = 0.0;
{_chan_loop(n, c, s, "x[idx]", "acc", wg)}
{_tree("acc", wg)}
  let mean = acc_total / {literal(count, 'f32')};
  var acc2 = 0.0;
{_chan_loop(n, c, s, "(x[idx] - mean) * (x[idx] - mean)", "acc2", wg)}
{_tree("acc2", wg)}
  let var_ = acc2_total / {literal(count, 'f32')};
  if (lid.x == 0u) {{
    st[ch * 2u] = mean;
    st[ch * 2u + 1u] = 1.0 / sqrt(var_ + {literal(eps, 'f32')});
{running}  }}"""
    stats = Kernel("BatchNorm:stats", shader(bindings(reads, writes), body, wg=wg, shared=shared), (c, 1, 1),
                   (x, *([mean, var] if has_running else [])), (st, *outs),
                   scratch=(Scratch(st, 2 * c),), inplace=(mean, var) if has_running else ())
    apply = Kernel("BatchNorm:apply", shader(apply_decls, apply_body), grid(total), (x, scale, bias, st), (y,),
                   scratch=(Scratch(st, 2 * c),))
    return [stats, apply]


@lowering("BatchNormGrad")
def lower_batchnorm_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    dy, x, scale = node.inputs[:3]
    dx, dscale, dbias = (node.outputs + ["", "", ""])[:3]
    n, c, s = _bn_geometry(shape_of(graph, x))
    eps = float(node.attr("epsilon", 1e-5))
    training = bool(node.attr("training", 1))
    count = n * s
    wg = _wg_for(count)
    st = f"bngrad.{dx or dscale}"
    # st per channel: mean, inv_std, dbias, dscale
    if training:
        reads = [("dy", "f32"), ("x", "f32")]
        stats_in = (dy, x)
        mean_part = f"""  var acc = 0.0;
{_chan_loop(n, c, s, "x[idx]", "acc", wg)}
{_tree("acc", wg)}
  let mean = acc_total / {literal(count, 'f32')};
  var acc2 = 0.0;
{_chan_loop(n, c, s, "(x[idx] - mean) * (x[idx] - mean)", "acc2", wg)}
{_tree("acc2", wg)}
  let inv = 1.0 / sqrt(acc2_total / {literal(count, 'f32')} + {literal(eps, 'f32')});"""
    else:
        reads = [("dy", "f32"), ("x", "f32"), ("rmean", "f32"), ("rvar", "f32")]
        stats_in = (dy, x, node.inputs[3], node.inputs[4])
        mean_part = f"""  let mean = rmean[ch];
  let inv = 1.0 / sqrt(rvar[ch] + {literal(eps, 'f32')});"""
    outs = [("st", "f32")]
    out_names = [st]
    store = ""
    if dscale:
        outs.append(("dscale", "f32"))
        out_names.append(dscale)
        store += "    dscale[ch] = db2_total;\n"
    if dbias:
        outs.append(("dbias", "f32"))
        out_names.append(dbias)
        store += "    dbias[ch] = db_total;\n"
    shared = "\n".join(f"var<workgroup> sh_{v}: array<f32, {wg}>;" for v in ("acc", "acc2", "db", "db2"))
    body = f"""  let ch = wid.x;
{mean_part}
  var db = 0.0;
  var db2 = 0.0;
  for (var k = lid.x; k < {count}u; k += {wg}u) {{
    let idx = (k / {s}u) * {c * s}u + ch * {s}u + k % {s}u;
    db += dy[idx];
    db2 += dy[idx] * ((x[idx] - mean) * inv);
  }}
{_tree("db", wg)}
{_tree("db2", wg)}
  if (lid.x == 0u) {{
    st[ch * 4u] = mean;
    st[ch * 4u + 1u] = inv;
    st[ch * 4u + 2u] = db_total;
    st[ch * 4u + 3u] = db2_total;
{store}  }}"""
    kernels = [Kernel("BatchNormGrad:stats", shader(bindings(reads, outs), body, wg=wg, shared=shared),
                      (c, 1, 1), stats_in, tuple(out_names), scratch=(Scratch(st, 4 * c),))]
    if dx:
        total = n * c * s
        if training:
            expr = (f"scale[ch] * inv / {literal(count, 'f32')} * (dy[i] * {literal(count, 'f32')} - st[ch * 4u + 2u]"
                    f" - (x[i] - st[ch * 4u]) * inv * st[ch * 4u + 3u])")
        else:
            expr = "dy[i] * (scale[ch] * inv)"
        body = f"""  {flat_id()}
  if (i >= {total}u) {{ return; }}
  let ch = (i / {s}u) % {c}u;
  let inv = st[ch * 4u + 1u];
  dx[i] = {expr};"""
        decls = bindings([("dy", "f32"), ("x", "f32"), ("scale", "f32"), ("st", "f32")], [("dx", "f32")])
        kernels.append(Kernel("BatchNormGrad:dx", shader(decls, body), grid(total), (dy, x, scale, st), (dx,),
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


def _const_scalar(c: Emit, node: Node, slot: int, default):
    name = node.input(slot)
    if not name:
        return default
    value = c.graph.initializers.get(name) if c.graph is not None else None
    if value is None:
        raise ValueError(f"{node.label}: input {slot} must be a compile-time constant on the wgpu backend")
    return np.asarray(value).reshape(()).item()


@ew("Dropout", raw=(3,), ignore=(1, 2))
def _dropout(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    ratio = float(_const_scalar(c, n, 1, 0.5))
    training = bool(_const_scalar(c, n, 2, False))
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


__all__ = ["WG", "group_id", "groups_grid", "lower_batchnorm", "lower_batchnorm_grad", "lower_softmax", "rows"]
