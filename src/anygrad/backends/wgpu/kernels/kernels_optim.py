"""Optimizer updates as elementwise table rows: (param, grad, slots..., lr, step) -> (param', slots'...).

The formulas follow anygrad/optim/*.py operation for operation (which follow torch.optim), with
Python-float hyperparameters as f32 literals. Step-dependent scalars (bias corrections) are
computed per invocation in f32; `1 - beta^step` goes through log/expm1 so it keeps its relative
precision for small steps. Being elementwise, an update fuses with the gradient math before it
and is planned in place into the parameter's and slots' own buffers.
"""
from __future__ import annotations

import math

from ....ir.graph import Graph, Node
from .kernel import AdapterCaps, Kernel, lowering
from .kernels_elementwise import FUSED, Emit, Val, ew, lower_fused
from .wgsl import literal

FUSED_UPDATE = "wgpu.FusedUpdate"
COPY = "wgpu.Copy"
ARENA_CAST = "wgpu.ArenaCast"  # the whole parameter arena to float16 (fusion.arena_weight_casts)


@ew(COPY)
def _copy(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    return [a[0]]


@lowering(FUSED_UPDATE)
def lower_fused_update(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One update over whole arenas: reads and writes the same arena values (in place)."""
    mids = node.attrs.get("gate")
    if not mids:
        member = Node(node.attrs["op"], list(node.inputs), list(node.outputs), node.attrs["attrs"], node.name)
        members = [member]
    else:  # a loss-scaled step: Where(skip, old, new) per arena (optim/grad_scaler.py), in the same pass
        skip = node.inputs[-1]
        member = Node(node.attrs["op"], list(node.inputs[:-1]), list(mids), node.attrs["attrs"], node.name)
        members = [member] + [Node("Where", [skip, out, mid], [out]) for out, mid in zip(node.outputs, mids)]
    fused = Node(FUSED, list(node.inputs), list(node.outputs), {"members": members, "literals": {}},
                 name=node.name)
    return lower_fused(fused, graph, caps)

@lowering(ARENA_CAST)
def lower_arena_cast(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """One elementwise cast over the whole arena (not an elementwise node itself, so that fusion
    neither merges it nor moves it after the readers of the slices)."""
    cast = Node("Cast", list(node.inputs), list(node.outputs), {"to": 10}, name=node.name)
    return lower_fused(Node(FUSED, list(node.inputs), list(node.outputs), {"members": [cast], "literals": {}},
                            name=node.name), graph, caps)

_ONE_MINUS_POW = """fn one_minus_pow(log_beta: f32, step: f32) -> f32 {
  // 1 - beta^step = -expm1(step * log(beta)), accurate also when the result is tiny.
  let x = step * log_beta;
  if (abs(x) < 0.01) { return -(x + x * x * (0.5 + x * (1.0 / 6.0 + x / 24.0))); }
  return 1.0 - exp(x);
}"""


def F(v: float) -> str:
    return literal(v, "f32")


def _common(c: Emit, h: dict, p: Val, g: Val) -> Val:
    """maximize and (coupled) weight decay: the gradient every optimizer starts from."""
    gx = g.expr
    if h.get("maximize"):
        gx = c.let(f"-{gx}", "f32").expr
    if h.get("weight_decay") and not h.get("decoupled"):
        gx = c.let(f"{gx} + {F(h['weight_decay'])} * {p.expr}", "f32").expr
    return Val(gx, "f32")


def _lerp(c: Emit, a: str, b: str, w: float) -> Val:
    """torch.lerp's two branches, as anygrad.optim.base.lerp."""
    if abs(w) < 0.5:
        return c.let(f"{a} + {F(w)} * ({b} - {a})", "f32")
    return c.let(f"{b} - ({b} - {a}) * {F(1.0 - float(_f32(w)))}", "f32")


def _f32(v: float) -> float:
    import numpy as np
    return float(np.float32(v))


@ew("SGDUpdate", update=True)
def _sgd(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    h = n.attrs
    p, lr, step = a[0], a[-2], a[-1]
    g = _common(c, h, p, a[1])
    outs = []
    if h.get("momentum"):
        s = a[2]
        buf = c.let(f"select({s.expr} * {F(h['momentum'])} + {F(1 - h.get('dampening', 0.0))} * {g.expr}, "
                    f"{g.expr}, {step.expr} == 1.0)", "f32")
        outs.append(buf)
        g = c.let(f"{g.expr} + {F(h['momentum'])} * {buf.expr}", "f32") if h.get("nesterov") else buf
    return [c.let(f"{p.expr} - {lr.expr} * {g.expr}", "f32")] + outs


@ew("AdamUpdate", update=True)
def _adam(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    h = n.attrs
    beta1, beta2 = (float(b) for b in h["betas"])
    p, lr, step = a[0], a[-2], a[-1]
    c.helper("one_minus_pow", _ONE_MINUS_POW)
    if h.get("weight_decay") and h.get("decoupled"):
        p = c.let(f"{p.expr} * (1.0 - {lr.expr} * {F(h['weight_decay'])})", "f32")
    g = _common(c, h, p, a[1])
    m, v = a[2], a[3]
    exp_avg = _lerp(c, m.expr, g.expr, 1 - beta1)
    exp_avg_sq = c.let(f"{v.expr} * {F(beta2)} + {F(1 - beta2)} * {g.expr} * {g.expr}", "f32")
    outs = [exp_avg, exp_avg_sq]
    second = exp_avg_sq
    if h.get("amsgrad"):
        second = c.let(f"max({a[4].expr}, {exp_avg_sq.expr})", "f32")
        outs.append(second)
    log1 = F(math.log(beta1)) if beta1 > 0 else "-1e30"
    log2 = F(math.log(beta2)) if beta2 > 0 else "-1e30"
    step_size = c.let(f"{lr.expr} / one_minus_pow({log1}, {step.expr})", "f32")
    bc2 = c.let(f"sqrt(one_minus_pow({log2}, {step.expr}))", "f32")
    denom = c.let(f"sqrt({second.expr}) / {bc2.expr} + {F(h['eps'])}", "f32")
    return [c.let(f"{p.expr} - {step_size.expr} * {exp_avg.expr} / {denom.expr}", "f32")] + outs


@ew("AdagradUpdate", update=True)
def _adagrad(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    h = n.attrs
    p, lr, step = a[0], a[-2], a[-1]
    g = _common(c, h, p, a[1])
    clr = c.let(f"{lr.expr} / (1.0 + ({step.expr} - 1.0) * {F(h.get('lr_decay', 0.0))})", "f32")
    total = c.let(f"{a[2].expr} + {g.expr} * {g.expr}", "f32")
    return [c.let(f"{p.expr} - {clr.expr} * {g.expr} / (sqrt({total.expr}) + {F(h['eps'])})", "f32"), total]


@ew("AdadeltaUpdate", update=True)
def _adadelta(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    h = n.attrs
    rho, eps = float(h["rho"]), float(h["eps"])
    p, lr = a[0], a[-2]
    g = _common(c, h, p, a[1])
    sq, acc = a[2], a[3]
    square_avg = c.let(f"{sq.expr} * {F(rho)} + {F(1 - rho)} * {g.expr} * {g.expr}", "f32")
    std = c.let(f"sqrt({square_avg.expr} + {F(eps)})", "f32")
    delta = c.let(f"sqrt({acc.expr} + {F(eps)}) / {std.expr} * {g.expr}", "f32")
    acc_delta = c.let(f"{acc.expr} * {F(rho)} + {F(1 - rho)} * {delta.expr} * {delta.expr}", "f32")
    return [c.let(f"{p.expr} - {lr.expr} * {delta.expr}", "f32"), square_avg, acc_delta]


@ew("RMSpropUpdate", update=True)
def _rmsprop(c: Emit, n: Node, a: list, ot: list[str]) -> list[Val]:
    h = n.attrs
    alpha = float(h["alpha"])
    p, lr = a[0], a[-2]
    g = _common(c, h, p, a[1])
    names = ["square_avg"] + (["momentum_buffer"] if h["momentum"] > 0 else []) + \
        (["grad_avg"] if h["centered"] else [])
    slot = dict(zip(names, a[2:2 + len(names)]))
    out = {"square_avg": c.let(f"{slot['square_avg'].expr} * {F(alpha)} + {F(1 - alpha)} * {g.expr} * {g.expr}",
                               "f32")}
    if h["centered"]:
        out["grad_avg"] = _lerp(c, slot["grad_avg"].expr, g.expr, 1 - alpha)
        avg = c.let(f"sqrt({out['square_avg'].expr} - {out['grad_avg'].expr} * {out['grad_avg'].expr})", "f32")
    else:
        avg = c.let(f"sqrt({out['square_avg'].expr})", "f32")
    avg = c.let(f"{avg.expr} + {F(h['eps'])}", "f32")
    if h["momentum"] > 0:
        buf = out["momentum_buffer"] = c.let(
            f"{slot['momentum_buffer'].expr} * {F(h['momentum'])} + {g.expr} / {avg.expr}", "f32")
        new_p = c.let(f"{p.expr} - {lr.expr} * {buf.expr}", "f32")
    else:
        new_p = c.let(f"{p.expr} - {lr.expr} * {g.expr} / {avg.expr}", "f32")
    return [new_p] + [out[s] for s in names]
