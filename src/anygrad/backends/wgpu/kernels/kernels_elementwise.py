"""Elementwise ops as WGSL expressions, and the fused kernel that evaluates a group of them.

Every elementwise op is one table row: a function that, given WGSL expressions for its inputs
(already loaded for the current element), emits `let` lines and returns its outputs'
expressions. The fusion pass (fusion/elementwise.py) groups chains of such nodes into one `wgpu.Fused` node;
its lowering here evaluates the whole group per element in registers and stores only the values
something outside the group needs. A lone elementwise node is a group of one.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ....ir.graph import Graph, Node
from .kernel import AdapterCaps, Kernel, OpLowering, lowering, register
from .wgsl import (
    WG,
    bindings,
    broadcast_index,
    flat_id,
    grid,
    literal,
    shader,
    shape_of,
    size_of,
    strided_index,
    vtype,
)

FUSED = "wgpu.Fused"


@dataclass
class Val:
    expr: str
    ty: str


@dataclass
class Emit:
    """Code generation state for one fused kernel."""

    lines: list[str] = field(default_factory=list)
    helpers: dict[str, str] = field(default_factory=dict)
    index: str = "i"                     # the current flat element index (u32)
    graph: Graph | None = None           # for compile-time constants (e.g. Dropout's ratio)
    _n: int = 0

    def let(self, expr: str, ty: str) -> Val:
        self._n += 1
        name = f"v{self._n}"
        self.lines.append(f"  let {name}: {ty} = {expr};")
        return Val(name, ty)

    def helper(self, name: str, text: str) -> str:
        self.helpers[name] = text
        return name


EmitFn = Callable[[Emit, Node, list, list[str]], list[Val]]


@dataclass(frozen=True)
class EwOp:
    emit: EmitFn
    raw: frozenset[int] = frozenset()     # inputs bound whole (the emitter indexes them itself)
    ignore: frozenset[int] = frozenset()  # compile-time inputs (shapes): never bound


EW: dict[str, EwOp] = {}


def _single(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    return lower_single(node, graph, caps)


def ew(*names: str, raw=(), ignore=(), update: bool = False):
    """Register an elementwise op: its table row, and a lowering for when it is not fused
    (`update`: an optimizer update, OpLowering.update)."""
    def deco(fn: EmitFn) -> EmitFn:
        for n in names:
            if n in EW:  # a second emitter would silently replace the first, as imports order them
                raise ValueError(f"elementwise op {n} registered twice")
            EW[n] = EwOp(fn, frozenset(raw), frozenset(ignore))
            register(n, OpLowering(_single, update=update))
        return fn
    return deco


def _lit(v, ty):
    return literal(v, ty)


def _to(v: Val, ty: str) -> str:
    if v.ty == ty:
        return v.expr
    if ty == "u32" and v.ty == "f32":
        return f"u32(max({v.expr}, 0.0))"
    return f"{ty}({v.expr})"


# -- arithmetic --------------------------------------------------------------------------------
_BIN = {"Add": "+", "Sub": "-", "Mul": "*"}


@ew("Add", "Sub", "Mul")
def _arith(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    return [c.let(f"{_to(a[0], ot[0])} {_BIN[n.op]} {_to(a[1], ot[0])}", ot[0])]


@ew("Div")
def _div(c, n, a, ot):
    t = ot[0]
    if t == "f32":
        return [c.let(f"{_to(a[0], t)} / {_to(a[1], t)}", t)]
    # Integer division by zero is defined (returns the dividend) in WGSL; numpy's is undefined too.
    return [c.let(f"{_to(a[0], t)} / {_to(a[1], t)}", t)]


_POW = """fn pow_f(a: f32, b: f32) -> f32 {
  // WGSL pow is undefined for a < 0; numpy gives the real result when b is an integer.
  if (b == 2.0) { return a * a; }
  if (b == 1.0) { return a; }
  if (b == 0.0) { return 1.0; }
  let r = pow(abs(a), b);
  if (a < 0.0 && b == round(b)) {
    if (abs(b % 2.0) == 1.0) { return -r; }
    return r;
  }
  if (a == 0.0 && b > 0.0) { return 0.0; }
  return pow(a, b);
}"""


@ew("Pow")
def _pow(c, n, a, ot):
    c.helper("pow_f", _POW)
    e = f"pow_f(f32({a[0].expr}), f32({a[1].expr}))"
    return [c.let(e if ot[0] == "f32" else f"{ot[0]}({e})", ot[0])]


@ew("Max", "Min")
def _maxmin(c, n, a, ot):
    fn = n.op.lower()
    expr = _to(a[0], ot[0])
    for v in a[1:]:
        expr = f"{fn}({expr}, {_to(v, ot[0])})"
    return [c.let(expr, ot[0])]


@ew("Sum", "Mean")
def _sum(c, n, a, ot):
    expr = " + ".join(_to(v, ot[0]) for v in a if v is not None)
    if n.op == "Mean":
        expr = f"({expr}) / {_lit(len(a), ot[0])}"
    return [c.let(expr, ot[0])]


# -- unary ------------------------------------------------------------------------------------
_UNARY = {
    "Neg": "-({x})", "Abs": "abs({x})", "Exp": "exp({x})", "Sqrt": "sqrt({x})",
    "Relu": "max({x}, {zero})", "Reciprocal": "1.0 / {x}", "Floor": "floor({x})", "Ceil": "ceil({x})",
    "Sign": "sign({x})", "Sin": "sin({x})", "Cos": "cos({x})", "Round": "round({x})",
}


@ew(*_UNARY)
def _unary(c, n, a, ot):
    t = ot[0]
    zero = _lit(0, t)
    return [c.let(_UNARY[n.op].format(x=_to(a[0], t), zero=zero), t)]


@ew("Log")
def _log(c, n, a, ot):
    # WGSL lets log be off by 2^-21 absolute near 1 (NVIDIA is), which ruins log(1 + tiny), as in
    # softplus; there u = x - 1 is exact and its series is accurate to float32
    x = a[0].expr
    u = c.let(f"{x} - 1.0", "f32").expr
    return [c.let(f"select(log({x}), {u} * (1.0 - {u} * (0.5 - {u} * (1.0 / 3.0 - {u} * 0.25))), "
                  f"abs({u}) < 1e-2)", "f32")]


@ew("Identity", "Expand", ignore=(1,))
def _identity(c, n, a, ot):
    return [Val(_to(a[0], ot[0]), ot[0])]


@ew("LeakyRelu")
def _leaky(c, n, a, ot):
    x = a[0].expr
    return [c.let(f"select({x} * {_lit(n.attr('alpha', 0.01), 'f32')}, {x}, {x} >= 0.0)", "f32")]


@ew("Sigmoid")
def _sigmoid(c, n, a, ot):
    e = c.let(f"exp(-abs({a[0].expr}))", "f32")
    return [c.let(f"select({e.expr} / (1.0 + {e.expr}), 1.0 / (1.0 + {e.expr}), {a[0].expr} >= 0.0)", "f32")]


@ew("Tanh")
def _tanh(c, n, a, ot):
    # exp(-2|x|) never overflows, unlike some drivers' tanh for large |x|.
    t = c.let(f"exp(-2.0 * abs({a[0].expr}))", "f32")
    x = a[0].expr  # near 0, 1 - exp(-2|x|) loses the digits: the series x - x^3/3 instead
    return [c.let(f"select(sign({x}) * (1.0 - {t.expr}) / (1.0 + {t.expr}), {x} * (1.0 - {x} * {x} / 3.0), "
                  f"abs({x}) < 5e-3)", "f32")]


@ew("Softplus")
def _softplus(c, n, a, ot):
    x = a[0].expr
    e = c.let(f"exp(-abs({x}))", "f32").expr  # log1p(e) by its series where 1 + e rounds e away
    return [c.let(f"max({x}, 0.0) + select(log(1.0 + {e}), {e} * (1.0 - {e} * (0.5 - {e} / 3.0)), {e} < 1e-3)",
                  "f32")]


_ERF = """fn erf_f(x: f32) -> f32 {
  // Abramowitz & Stegun 7.1.26 refined: max abs error 1.5e-7.
  let t = 1.0 / (1.0 + 0.3275911 * abs(x));
  let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
                 + 0.254829592) * t * exp(-x * x);
  return sign(x) * y;
}"""


@ew("Erf")
def _erf(c, n, a, ot):
    c.helper("erf_f", _ERF)
    return [c.let(f"erf_f({a[0].expr})", "f32")]


@ew("Clip")
def _clip(c, n, a, ot):
    t = ot[0]
    x = _to(a[0], t)
    lo = a[1] if len(a) > 1 and a[1] is not None else None
    hi = a[2] if len(a) > 2 and a[2] is not None else None
    if lo is None and n.attr("min") is not None:
        lo = Val(_lit(n.attr("min"), t), t)
    if hi is None and n.attr("max") is not None:
        hi = Val(_lit(n.attr("max"), t), t)
    if lo is not None:
        x = f"max({x}, {_to(lo, t)})"
    if hi is not None:
        x = f"min({x}, {_to(hi, t)})"
    return [c.let(x, t)]


@ew("ClipGrad")
def _clip_grad(c, n, a, ot):
    dy, x = a[0].expr, a[1]
    keep = []
    lo = a[2] if len(a) > 2 and a[2] is not None else None
    hi = a[3] if len(a) > 3 and a[3] is not None else None
    if lo is None and n.attr("min") is not None:
        lo = Val(_lit(n.attr("min"), x.ty), x.ty)
    if hi is None and n.attr("max") is not None:
        hi = Val(_lit(n.attr("max"), x.ty), x.ty)
    if lo is not None:
        keep.append(f"{x.expr} >= {_to(lo, x.ty)}")
    if hi is not None:
        keep.append(f"{x.expr} <= {_to(hi, x.ty)}")
    cond = " && ".join(f"({k})" for k in keep) or "true"
    return [c.let(f"select({_lit(0, ot[0])}, {dy}, {cond})", ot[0])]


@ew("ErfGrad")
def _erf_grad(c, n, a, ot):
    x = a[1].expr
    return [c.let(f"{a[0].expr} * {_lit(2.0 / np.sqrt(np.pi), 'f32')} * exp(-{x} * {x})", "f32")]


@ew("CastLike", ignore=(1,))
def _cast_like(c, n, a, ot):
    return _cast(c, n, a, ot)


@ew("Cast")
def _cast(c, n, a, ot):
    t = ot[0]
    if t == "u32" and a[0].ty != "u32" and c.graph is not None \
            and c.graph.info[n.outputs[0]].dtype == np.bool_:  # to bool: nonzero test
        return [c.let(f"select(0u, 1u, {a[0].expr} != {_lit(0, a[0].ty)})", t)]
    if t == "i32" and a[0].ty == "f32":
        return [c.let(f"i32(trunc({a[0].expr}))", t)]
    return [c.let(_to(a[0], t), t)]


# -- comparisons and logic (bools are u32 0/1 on the device) --------------------------------------
_CMP = {"Equal": "==", "Less": "<", "Greater": ">", "LessOrEqual": "<=", "GreaterOrEqual": ">="}


@ew(*_CMP)
def _cmp(c, n, a, ot):
    t = a[0].ty if a[0].ty == a[1].ty else "f32"
    return [c.let(f"select(0u, 1u, {_to(a[0], t)} {_CMP[n.op]} {_to(a[1], t)})", "u32")]


_LOGIC = {"And": "&", "Or": "|", "Xor": "^"}


@ew(*_LOGIC)
def _logic(c, n, a, ot):
    return [c.let(f"{a[0].expr} {_LOGIC[n.op]} {a[1].expr}", "u32")]


@ew("Not")
def _not(c, n, a, ot):
    return [c.let(f"1u - {a[0].expr}", "u32")]


@ew("Where")
def _where(c, n, a, ot):
    t = ot[0]
    return [c.let(f"select({_to(a[2], t)}, {_to(a[1], t)}, {a[0].expr} != 0u)", t)]


# -- graph inputs of 1-byte elements, uploaded four per u32 word (fusion.pack_byte_inputs) -------
UNPACK_BYTES = "wgpu.UnpackBytes"


@ew(UNPACK_BYTES, raw=(0,))
def _unpack_bytes(c, n, a, ot):
    # Element i is byte i & 3 of word i >> 2 (WGSL storage is little-endian); int8 sign-extends
    # through the arithmetic shift of an i32, uint8/bool are masked.
    i = c.index
    w = f"{a[0].expr}[{i} >> 2u]"
    if ot[0] == "i32":
        return [c.let(f"bitcast<i32>({w} << ((3u - ({i} & 3u)) * 8u)) >> 24u", "i32")]
    return [c.let(f"({w} >> (({i} & 3u) * 8u)) & 0xffu", "u32")]


# -- backward helpers --------------------------------------------------------------------------
@ew("ReluGrad")
def _relu_grad(c, n, a, ot):
    return [c.let(f"select(0.0, {a[0].expr}, {a[1].expr} > 0.0)", "f32")]


@ew("LeakyReluGrad")
def _leaky_grad(c, n, a, ot):
    dy, x = a[0].expr, a[1].expr
    return [c.let(f"select({dy} * {_lit(n.attr('alpha', 0.01), 'f32')}, {dy}, {x} >= 0.0)", "f32")]


@ew("SigmoidGrad")
def _sigmoid_grad(c, n, a, ot):
    return [c.let(f"{a[0].expr} * {a[1].expr} * (1.0 - {a[1].expr})", "f32")]


@ew("TanhGrad")
def _tanh_grad(c, n, a, ot):
    return [c.let(f"{a[0].expr} * (1.0 - {a[1].expr} * {a[1].expr})", "f32")]


# -- the fused kernel -----------------------------------------------------------------------------
def is_elementwise(node: Node, graph: Graph) -> bool:
    """Whether node can be evaluated per output element (all outputs share one shape)."""
    if node.op not in EW or node.op == "Identity":  # Identity is an alias (no kernel at all)
        return False
    shapes = {shape_of(graph, o) for o in node.outputs if o}
    return len(shapes) == 1


def literal_value(graph: Graph, name: str, state: set[str]) -> np.ndarray | None:
    """A one-element constant that can be written into the shader instead of bound."""
    if name in state or name not in graph.initializers:
        return None
    value = np.asarray(graph.initializers[name])
    return value if value.size == 1 else None


def make_fused(graph: Graph, members: list[Node], outputs: list[str], state: set[str]) -> Node:
    """A wgpu.Fused node standing for members (in order), storing `outputs`."""
    produced = {o for m in members for o in m.outputs if o}
    inputs, literals = [], {}
    for m in members:
        op = EW[m.op]
        for k, v in enumerate(m.inputs):
            if not v or v in produced or k in op.ignore or v in inputs or v in literals:
                continue
            lit = None if k in op.raw else literal_value(graph, v, state)
            if lit is not None:
                literals[v] = lit.reshape(())
            else:
                inputs.append(v)
    return Node(FUSED, inputs, list(outputs), {"members": members, "literals": literals},
                name="+".join(m.op for m in members))


def bound_count(graph: Graph, members: list[Node], outputs: list[str], state: set[str]) -> int:
    return len(make_fused(graph, members, outputs, state).inputs) + len(outputs)


# Each invocation of a vectorised kernel evaluates LANES consecutive elements: one vec4 load per
# input and one vec4 store per output put 16 bytes per binding in flight instead of 4, which is
# what a memory-bound kernel needs to approach DRAM bandwidth on a large GPU (a GPT's GELU over
# 16.8M floats ran at 1.3 of an H200's 4.8 TB/s one element per invocation).
LANES = 4
_COMPONENTS = "xyzw"


def _aligned_view(view: tuple | None, out_shape: tuple[int, ...]) -> str | None:
    """The vec4 index of a strided view (fold_elementwise_views) read or stored four elements at
    a time, where its last axis is contiguous and every start 4-aligned; None where it is not."""
    if view is None:
        return None
    _, st, offset = view
    if st[-1] != 1 or offset % LANES or any(x % LANES for x in st[:-1]):
        return None
    return strided_index(out_shape[:-1] + (out_shape[-1] // LANES,), tuple(x // LANES for x in st[:-1]) + (1,),
                         offset // LANES)


def _vec_loads(graph: Graph, inputs: list[str], raw: set[str], out_shape: tuple[int, ...], bound: int,
               caps: AdapterCaps, views: dict | None = None, stores: dict | None = None
               ) -> dict[int, tuple[bool, str]] | None:
    """Per bound input's position, (loaded as a vec4?, its index in vec4 units of the output) for a kernel
    taking LANES consecutive elements per invocation; None where that layout does not hold.

    Four consecutive output elements (the last axis a multiple of 4) are four consecutive
    elements of an input that keeps the last axis (one vec4 load), or one element of an input
    broadcast along it (one scalar load, used four times). Inputs bound whole (raw) index
    themselves per lane. A kernel over the adapter's storage-buffer limit stays scalar: bindpack.py
    packs only scalar reads. Inputs read and results stored through strided views (`views`,
    `stores`: position -> (member name, view)) go four at a time where the view allows
    (_aligned_view); one that does not keeps the whole kernel scalar."""
    if (not out_shape or out_shape[-1] % LANES or 0 in out_shape
            or bound > caps.max_storage_buffers_per_stage):
        return None
    views, stores = views or {}, stores or {}
    if any(_aligned_view(view, out_shape) is None for _, view in list(views.values()) + list(stores.values())):
        return None
    quad = out_shape[:-1] + (out_shape[-1] // LANES,)
    loads: dict[int, tuple[bool, str]] = {k: (True, _aligned_view(view, out_shape)) for k, (_, view) in views.items()}
    for k, v in enumerate(inputs):
        if v in raw or k in views:
            continue
        shape = (1,) * (len(out_shape) - len(shape_of(graph, v))) + shape_of(graph, v)
        if shape[-1] == out_shape[-1]:
            loads[k] = (True, broadcast_index(quad, shape[:-1] + (quad[-1],)))
        elif shape[-1] == 1:
            loads[k] = (False, broadcast_index(quad, shape))
        else:
            return None
    return loads


@lowering(FUSED)
def lower_fused(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    members: list[Node] = node.attrs["members"]
    literals: dict = node.attrs["literals"]
    out_shape = shape_of(graph, members[-1].outputs[0])
    n = size_of(graph, members[-1].outputs[0])
    raw = {m.inputs[k] for m in members for k in EW[m.op].raw if k < len(m.inputs)}
    outs = list(node.outputs)
    # inputs read through a strided view of the bound value, results stored through one of the
    # value bound for them (fold_elementwise_views): position -> (member name, view)
    views, stores = node.attr("_views") or {}, node.attr("_stores") or {}
    bound = len(set(node.inputs) | set(outs))
    loads = _vec_loads(graph, list(node.inputs), raw, out_shape, bound, caps, views, stores)
    lanes = 1 if loads is None else LANES
    c = Emit(graph=graph)
    # A value both read and written (a fused update over an arena) is bound once, read_write.
    reads, read_names, loaded = [], [], {}
    for k, v in enumerate(node.inputs):
        ty = vtype(graph, v)
        var = f"y{outs.index(v)}" if v in outs else f"x{len(reads)}"
        scalar = (strided_index(out_shape, views[k][1][1], views[k][1][2]) if k in views
                  else broadcast_index(out_shape, shape_of(graph, v)))
        vec, index = (loads or {}).get(k, (False, scalar))
        if v not in outs:
            reads.append((var, f"vec4<{ty}>" if vec else ty))
            read_names.append(v)
        # (expression, element type, a vec4 whose lane the element is), by the members' name
        loaded[views[k][0] if k in views else v] = (
            (var, ty, False) if v in raw else (c.let(f"{var}[{index}]", f"vec4<{ty}>" if vec else ty).expr, ty, vec))
    results: list[list[str]] = [[] for _ in outs]
    for lane in range(lanes):
        c.index = "i" if lanes == 1 else f"(i * {LANES}u + {lane}u)"
        env: dict[str, Val] = {}
        for v, (expr, ty, vec) in loaded.items():
            env[v] = Val(f"{expr}.{_COMPONENTS[lane]}" if vec else expr, ty)
        for v, value in literals.items():
            ty = vtype(graph, v)
            env[v] = Val(literal(value, ty), ty)
        for m in members:
            skip = EW[m.op].ignore
            args = [env[v] if v and k not in skip else None for k, v in enumerate(m.inputs)]
            vals = EW[m.op].emit(c, m, args, [vtype(graph, o) if o else "f32" for o in m.outputs])
            for o, val in zip(m.outputs, vals):
                if o:
                    env[o] = val
        for k, o in enumerate(outs):
            results[k].append(env[stores[k][0] if k in stores else o].expr)
    wty = [vtype(graph, o) for o in outs]
    writes = [(f"y{k}", t if lanes == 1 else f"vec4<{t}>") for k, t in enumerate(wty)]
    body = [f"  {flat_id()}", f"  if (i >= {n // lanes}u) {{ return; }}", *c.lines]
    values = [lv[0] if lanes == 1 else f"vec4<{t}>({', '.join(lv)})" for t, lv in zip(wty, results)]
    at = {k: (_aligned_view(view, out_shape) if lanes > 1 else strided_index(out_shape, view[1], view[2]))
          for k, (_, view) in stores.items()}
    body += [f"  y{k}[{at.get(k, 'i')}] = {value};" for k, value in enumerate(values)]
    src = shader(bindings(reads, writes), "\n".join(body), helpers="\n".join(c.helpers.values()))
    # in place only where every element is read and written at one index
    viewed = {node.inputs[k] for k in views}
    aligned = () if stores else tuple(v for v in read_names if v not in raw and v not in viewed
                                      and shape_of(graph, v) == out_shape)
    return [Kernel(f"ew:{node.name}"[:120], src, grid(n // lanes, WG), tuple(read_names), tuple(outs),
                   inplace=aligned)]


def lower_single(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """A lone elementwise node (no fusion pass ran): a group of one."""
    return lower_fused(make_fused(graph, [node], [o for o in node.outputs if o], set(graph.state_names)),
                       graph, caps)
