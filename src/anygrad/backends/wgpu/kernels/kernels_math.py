"""Trigonometric and hyperbolic functions (elementwise table rows; their gradients are built from
primitive ops by anygrad/ops/math_extra.py), Hardmax, EyeLike, ReverseSequence, Det/DetGrad,
ConstantOfShape (when too large to fold), the bitwise integer ops (BitwiseAnd/Or/Xor/Not,
BitShift, BitCast), and the classic-ML TfIdfVectorizer and Binarizer."""
from __future__ import annotations

import math

from ....ir.graph import Graph, Node
from ....ir.passes import resolved
from .kernel import AdapterCaps, Kernel, lowering
from .kernels_elementwise import Emit, Val, ew
from .kernels_index import _kernel
from .wgsl import literal, shape_of, strides, vtype

# op -> WGSL expression of x; the inverse hyperbolics are written so that they keep their
# precision for negative and small arguments (odd functions through |x|).
TRIG = {
    "Tan": "tan({x})",
    "Asin": "atan2({x}, sqrt((1.0 - {x}) * (1.0 + {x})))",  # some drivers' asin/acos lose 3 digits
    "Acos": "atan2(sqrt((1.0 - {x}) * (1.0 + {x})), {x})",
    "Atan": "atan({x})",
    "Sinh": "sinh({x})",
    "Cosh": "cosh({x})",
    "Asinh": "sign({x}) * log(abs({x}) + sqrt({x} * {x} + 1.0))",
    "Acosh": "log({x} + sqrt({x} * {x} - 1.0))",
    "Atanh": "0.5 * log((1.0 + {x}) / (1.0 - {x}))",
}


@ew(*TRIG)
def _trig(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    return [c.let(TRIG[n.op].format(x=a[0].expr), "f32")]


@lowering("Hardmax")
def lower_hardmax(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One invocation per row: 1 at the first maximum, 0 elsewhere."""
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    axis = int(resolved(node, "axis"))
    outer, a, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    ty = vtype(graph, x)
    body = f"""  let base = (i / {inner}u) * {a * inner}u + i % {inner}u;
  var best = x[base];
  var arg = 0u;
  for (var k = 1u; k < {a}u; k += 1u) {{
    let v = x[base + k * {inner}u];
    if (v > best) {{ best = v; arg = k; }}
  }}
  for (var k = 0u; k < {a}u; k += 1u) {{ y[base + k * {inner}u] = select({literal(0, ty)}, {literal(1, ty)}, k == arg); }}"""
    return [_kernel("Hardmax", outer * inner, body, [("x", ty, x)], [("y", ty, y)])]


@lowering("EyeLike")
def lower_eye_like(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    y = node.outputs[0]
    rows, cols = shape_of(graph, y)
    ty = vtype(graph, y)
    k = int(node.attr("k", 0))
    body = f"""  let r = i32(i / {cols}u);
  let c = i32(i % {cols}u);
  y[i] = select({literal(0, ty)}, {literal(1, ty)}, c - r == {k});"""
    return [_kernel("EyeLike", rows * cols, body, [], [("y", ty, y)])]


@lowering("ReverseSequence")
def lower_reverse_sequence(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    x, lengths = node.inputs[:2]
    y = node.outputs[0]
    shape = shape_of(graph, x)
    b_axis, t_axis = int(node.attr("batch_axis", 1)), int(node.attr("time_axis", 0))
    st = strides(shape)
    ty, lty = vtype(graph, x), vtype(graph, lengths)
    body = f"""  let b = (i / {st[b_axis]}u) % {shape[b_axis]}u;
  let t = i32((i / {st[t_axis]}u) % {shape[t_axis]}u);
  let n = i32(lens[b]);
  let src = select(t, n - 1 - t, t < n);
  y[i] = x[u32(i32(i) + (src - t) * {st[t_axis]})];"""
    return [_kernel("ReverseSequence", math.prod(shape), body, [("x", ty, x), ("lens", lty, lengths)],
                    [("y", ty, y)])]


# -- bitwise ops (integers live in i32/u32 on the device: results are wrapped to the dtype's width)
def _wrap(c: Emit, n: Node, v: Val) -> Val:
    import numpy as np
    dt = np.dtype(c.graph.info[n.outputs[0]].dtype) if c.graph is not None else np.dtype(np.int32)
    bits = 8 * dt.itemsize
    if bits >= 32:
        return v
    if dt.kind == "u":
        return c.let(f"{v.expr} & {(1 << bits) - 1}u", v.ty)
    return c.let(f"({v.expr} << {32 - bits}u) >> {32 - bits}u", v.ty)  # sign-extend the low bits


_BITWISE = {"BitwiseAnd": "&", "BitwiseOr": "|", "BitwiseXor": "^"}


@ew(*_BITWISE)
def _bitwise(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    return [c.let(f"{a[0].expr} {_BITWISE[n.op]} {ot[0]}({a[1].expr})", ot[0])]


@ew("BitwiseNot")
def _bitwise_not(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    return [_wrap(c, n, c.let(f"~{a[0].expr}", ot[0]))]


@ew("BitShift")
def _bit_shift(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    d = n.attr("direction")
    d = d.decode() if isinstance(d, bytes) else d
    if d not in ("LEFT", "RIGHT"):
        raise ValueError(f"direction must be LEFT or RIGHT, not {d!r}")
    amount = f"u32({a[1].expr})"
    x = a[0].expr
    # WGSL takes the shift modulo 32; numpy gives 0 for shifts past the width
    if d == "LEFT":
        expr = f"select({x} << {amount}, {ot[0]}(0), {amount} >= 32u)"
    elif ot[0] == "i32":  # arithmetic shift: past the width only the sign is left
        expr = f"{x} >> min({amount}, 31u)"
    else:
        expr = f"select({x} >> {amount}, 0u, {amount} >= 32u)"
    return [_wrap(c, n, c.let(expr, ot[0]))]


def _elimination(n: int) -> str:
    """Statements turning `m` (an n x n private array) into `det`, its determinant: Gaussian
    elimination with partial pivoting."""
    return f"""  var det = 1.0;
  for (var c = 0u; c < {n}u; c += 1u) {{
    var p = c;
    for (var r = c + 1u; r < {n}u; r += 1u) {{ if (abs(m[r * {n}u + c]) > abs(m[p * {n}u + c])) {{ p = r; }} }}
    if (m[p * {n}u + c] == 0.0) {{ det = 0.0; break; }}
    if (p != c) {{
      det = -det;
      for (var k = 0u; k < {n}u; k += 1u) {{
        let t = m[c * {n}u + k]; m[c * {n}u + k] = m[p * {n}u + k]; m[p * {n}u + k] = t;
      }}
    }}
    let piv = m[c * {n}u + c];
    det = det * piv;
    for (var r = c + 1u; r < {n}u; r += 1u) {{
      let f = m[r * {n}u + c] / piv;
      for (var k = c; k < {n}u; k += 1u) {{ m[r * {n}u + k] -= f * m[c * {n}u + k]; }}
    }}
  }}"""


@lowering("Det")
def lower_det(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One invocation per matrix, in registers."""
    x, y = node.inputs[0], node.outputs[0]
    shape = shape_of(graph, x)
    n = shape[-1]
    if n * n > 1024:
        raise ValueError(f"Det of {n}x{n} matrices (at most 32x32 on the wgpu backend)")
    body = f"""  var m: array<f32, {n * n}>;
  for (var k = 0u; k < {n * n}u; k += 1u) {{ m[k] = x[i * {n * n}u + k]; }}
{_elimination(n)}
  y[i] = det;"""
    return [_kernel("Det", math.prod(shape[:-2]), body, [("x", "f32", x)], [("y", "f32", y)])]


@lowering("DetGrad")
def lower_det_grad(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """dx[i, j] = dy * the cofactor of (i, j): one invocation per element, the minor's
    determinant by elimination."""
    dy, x = node.inputs[:2]
    shape = shape_of(graph, x)
    n = shape[-1]
    if n * n > 1024:
        raise ValueError(f"Det of {n}x{n} matrices (at most 32x32 on the wgpu backend)")
    if n == 1:
        body = "  y[i] = dy[i];"
    else:
        k = n - 1
        body = f"""  let b = i / {n * n}u; let ei = (i / {n}u) % {n}u; let ej = i % {n}u;
  var m: array<f32, {k * k}>;
  for (var r = 0u; r < {k}u; r += 1u) {{
    for (var c2 = 0u; c2 < {k}u; c2 += 1u) {{
      m[r * {k}u + c2] = x[b * {n * n}u + (r + select(0u, 1u, r >= ei)) * {n}u + c2 + select(0u, 1u, c2 >= ej)];
    }}
  }}
{_elimination(k)}
  y[i] = dy[b] * select(det, -det, ((ei + ej) & 1u) == 1u);"""
    return [_kernel("DetGrad", math.prod(shape), body, [("dy", "f32", dy), ("x", "f32", x)],
                    [("y", "f32", node.outputs[0])])]


@ew("ai.onnx.ml.Binarizer")
def _binarizer(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    t = ot[0]
    return [c.let(f"select({literal(0, t)}, {literal(1, t)}, f32({a[0].expr}) > {literal(float(n.attr('threshold', 0.0)), 'f32')})", t)]


@lowering("ConstantOfShape")
def lower_constant_of_shape(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """Only reached for outputs too large to fold into a constant at compile time."""
    from ....ops.shape import constant_of_shape_value
    y = node.outputs[0]
    ty = vtype(graph, y)
    return [_kernel("ConstantOfShape", math.prod(shape_of(graph, y)),
                    f"  y[i] = {literal(constant_of_shape_value(node).item(), ty)};", [], [("y", ty, y)])]


@ew("BitCast")
def _bit_cast(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    """Same-width reinterpretation. 32-bit types are one WGSL bitcast; narrower ones live widened
    in 32 bits (signed: sign-extended, unsigned: zero-extended), so they re-extend. 64-bit types
    are held truncated on the device and cannot be reinterpreted."""
    import numpy as np
    src = np.dtype(c.graph.info[n.inputs[0]].dtype)
    dst = np.dtype(c.graph.info[n.outputs[0]].dtype)
    if src.itemsize == 8:
        raise ValueError(f"BitCast of 64-bit {src} (held in 32 bits on the device)")
    v = c.let(f"bitcast<{ot[0]}>({a[0].expr})", ot[0])
    bits = 8 * dst.itemsize
    if bits >= 32 or dst.kind == "b":
        return [v]
    if dst.kind == "u":
        return [c.let(f"{v.expr} & {(1 << bits) - 1}u", ot[0])]
    return [c.let(f"({v.expr} << {32 - bits}u) >> {32 - bits}u", ot[0])]


# -- TfIdfVectorizer (formulas: anygrad/ops/ml.py) ----------------------------------------------------
def _table(name: str, ty: str, values) -> str:
    vals = [int(v) for v in values] or [0]
    lits = ", ".join(literal(v, ty) for v in vals)
    return f"var<private> {name}: array<{ty}, {len(vals)}> = array<{ty}, {len(vals)}>({lits});"


_TFIDF_OUT = {"TF": "count", "IDF": "select(0.0, WT[col], count > 0.0)", "TFIDF": "count * WT[col]"}


@lowering("TfIdfVectorizer")
def lower_tfidf(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One invocation per (row, column): counts the pooled n-grams of that column in the row
    (unigrams once, longer grams once per skip distance), the pool baked in as tables."""
    from ....ops.ml import ngram_pool
    x, y = node.inputs[0], node.outputs[0]
    xs = shape_of(graph, x)
    rows, length = (xs[0], xs[1]) if len(xs) == 2 else (1, xs[0])
    pool = ngram_pool(node)
    width = max(node.attr("ngram_indexes")) + 1
    lo, hi = int(node.attr("min_gram_length")), int(node.attr("max_gram_length"))
    grams = [(g, col) for g, col in pool.items() if lo <= len(g) <= hi]
    tokens, starts, lens, cols = [], [], [], []
    for g, col in grams:
        starts.append(len(tokens))
        tokens += list(g)
        lens.append(len(g))
        cols.append(col)
    mode = node.attr("mode", "TF")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    weights = list(node.attr("weights") or [1.0] * width)
    helpers = "\n".join([_table("TOK", "i32", tokens), _table("GST", "i32", starts), _table("GLEN", "i32", lens),
                         _table("GCOL", "i32", cols),
                         f"var<private> WT: array<f32, {width}> = array<f32, {width}>("
                         + ", ".join(literal(float(v), "f32") for v in weights) + ");"])
    skips = int(node.attr("max_skip_count", 0)) + 1
    body = f"""  let r = i / {width}u; let col = i32(i % {width}u);
  var count = 0.0;
  for (var g = 0u; g < {len(grams)}u; g += 1u) {{
    if (GCOL[g] != col) {{ continue; }}
    let n = u32(GLEN[g]);
    let last_skip = select({skips}u, 1u, n == 1u);
    for (var skip = 1u; skip <= last_skip; skip += 1u) {{
      for (var s = 0u; s + skip * (n - 1u) < {length}u; s += 1u) {{
        var hit = true;
        for (var t = 0u; t < n; t += 1u) {{
          if (i32(x[r * {length}u + s + skip * t]) != TOK[u32(GST[g]) + t]) {{ hit = false; break; }}
        }}
        if (hit) {{ count += 1.0; }}
      }}
    }}
  }}
  y[i] = {_TFIDF_OUT[mode]};"""
    return [_kernel("TfIdfVectorizer", rows * width, body, [("x", vtype(graph, x), x)], [("y", "f32", y)],
                    helpers=helpers)]


@ew("OptionalGetElement")
def _optional_get(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    return [a[0]]  # a present optional is its tensor


# -- ai.onnx.ml.TreeEnsemble (formulas: anygrad/ops/ml.py) ----------------------------------------------
@lowering("ai.onnx.ml.TreeEnsemble")
def lower_tree_ensemble(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One invocation per (row, target): walks every tree (node tables baked in) and aggregates the
    leaves of that target."""
    import numpy as np

    from ....ops.ml import tree_member_sets
    x, y = node.inputs[0], node.outputs[0]
    rows, feats = shape_of(graph, x)
    a = {k: np.asarray(node.attr(k)).reshape(-1) for k in (
        "nodes_splits", "nodes_featureids", "nodes_modes", "nodes_truenodeids", "nodes_falsenodeids",
        "nodes_trueleafs", "nodes_falseleafs", "leaf_targetids", "leaf_weights", "tree_roots")}
    modes = a["nodes_modes"].astype(int)
    true_leaf, false_leaf = a["nodes_trueleafs"].astype(bool), a["nodes_falseleafs"].astype(bool)
    missing = node.attr("nodes_missing_value_tracks_true")
    missing = np.asarray(missing, bool).reshape(-1) if missing is not None else np.zeros(len(modes), bool)
    sets = tree_member_sets(node, modes, a["nodes_truenodeids"], a["nodes_falsenodeids"], true_leaf, false_leaf,
                             a["tree_roots"])
    agg = int(node.attr("aggregate_function", 1))
    if agg not in (0, 1, 2, 3):
        raise ValueError(f"aggregate_function {agg}")
    targets = int(node.attr("n_targets"))
    trees = len(a["tree_roots"])
    offs, members = [0], []
    for i in range(len(modes)):
        members += sorted(sets.get(i, ()))
        offs.append(len(members))

    def ftable(name, vals):  # private initializers must be constant: no bitcasts (NaN splits are unused)
        vals = [0.0 if np.isnan(v) else float(np.clip(v, -3.4028234663852886e38, 3.4028234663852886e38))
                for v in vals] or [0.0]
        return f"var<private> {name}: array<f32, {len(vals)}> = array<f32, {len(vals)}>(" + \
            ", ".join(literal(v, "f32") for v in vals) + ");"
    helpers = "\n".join([
        ftable("SPLIT", a["nodes_splits"]), _table("FEAT", "i32", a["nodes_featureids"]), _table("MODE", "i32", modes),
        _table("TID", "i32", a["nodes_truenodeids"]), _table("FID", "i32", a["nodes_falsenodeids"]),
        _table("TLEAF", "i32", true_leaf), _table("FLEAF", "i32", false_leaf), _table("MISS", "i32", missing),
        _table("LTGT", "i32", a["leaf_targetids"]), ftable("LW", a["leaf_weights"]), _table("ROOT", "i32", a["tree_roots"]),
        _table("MOFF", "i32", offs), ftable("MVAL", members)])
    start = {0: "0.0", 1: "0.0", 2: "3.4028234663852886e38", 3: "-3.4028234663852886e38"}[agg]
    combine = {0: f"acc += w / {float(trees)};", 1: "acc += w;", 2: "acc = min(acc, w);", 3: "acc = max(acc, w);"}[agg]
    body = f"""  let r = i / {targets}u; let tgt = i32(i % {targets}u);
  var acc = {start};
  for (var tr = 0u; tr < {trees}u; tr += 1u) {{
    var k = ROOT[tr];
    var leaf = TLEAF[k] != 0 && FLEAF[k] != 0 && TID[k] == FID[k];
    for (var step = 0u; step < {len(modes) + 1}u && !leaf; step += 1u) {{
      let v = f32(x[r * {feats}u + u32(FEAT[k])]);
      let s = SPLIT[k];
      var go = false;
      switch MODE[k] {{
        case 0: {{ go = v <= s; }}
        case 1: {{ go = v < s; }}
        case 2: {{ go = v >= s; }}
        case 3: {{ go = v > s; }}
        case 4: {{ go = v == s; }}
        case 5: {{ go = v != s; }}
        default: {{ for (var m = MOFF[k]; m < MOFF[k + 1]; m += 1) {{ if (MVAL[m] == v) {{ go = true; }} }} }}
      }}
      let nan = (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
      go = go || (MISS[k] != 0 && nan);
      if (go) {{ leaf = TLEAF[k] != 0; k = TID[k]; }} else {{ leaf = FLEAF[k] != 0; k = FID[k]; }}
    }}
    if (LTGT[k] == tgt) {{ let w = LW[k]; {combine} }}
  }}
  y[i] = acc;"""
    return [_kernel("TreeEnsemble", rows * targets, body, [("x", vtype(graph, x), x)], [("y", "f32", y)],
                    helpers=helpers)]
