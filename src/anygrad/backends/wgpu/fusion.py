"""Graph rewrites before lowering (on a copy): fewer, bigger kernels.

- Elementwise fusion groups elementwise nodes of one output shape into a `wgpu.Fused` node
  evaluated per element in registers. A group is emitted at the position of its last member, so
  a node may join a group only when no node outside the group, placed before it, reads a value
  the group produces (that reader would otherwise run before the group's kernel); this also rules
  out cycles. Independent groups of one shape then merge the same way (horizontal fusion).
- Transposes, Slices, Concats and constant scales around a MatMul/Gemm become its operand and
  result layouts (gemm_layout.py): the GEMM's loads and stores do the data movement.
- GEMM -> Add(bias) -> activation and Conv -> Relu: bias and activation run in the GEMM's
  epilogue (a third input, attrs `_epilogue`/`_epilogue_attrs`). Under float16 each fused step
  whose result the graph holds in float16 rounds to f16 there (attr `_round`), so the fused
  kernel gives the bits the separate kernels would (ANYGRAD_WGPU_F16_EPILOGUES=0: float32 only).
- Optimizer updates of one kind become one `wgpu.FusedUpdate` over arenas (see group_updates).
- Under float16 (ANYGRAD_WGPU_F16_ARENA): the loss scaler's test (FoundInf) reads each gradient
  arena in one reduction (arena_finite_check), and the weights' float16 copies are one cast of the
  parameter arena (arena_weight_casts).
- Dropout outside training becomes an Identity, which the planner aliases.
- Graph inputs of 1-byte elements (uint8 images) are uploaded four per u32 word and unpacked by an
  elementwise node, which fuses into whatever elementwise chain reads them (see pack_byte_inputs).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ... import settings
from ...ir.graph import Graph, Node, TensorInfo
from ...ir.passes import resolve_attributes
from ...ir.private_attrs import check_graph
from .gemm_layout import (
    ALIAS_LIKE,
    GEMM_OPS,
    canonical_transposes,
    fold_concats,
    fold_scales,
    fold_slices,
    fold_transposes,
    has_bias,
    scale_fold_enabled,
    slice_views_enabled,
)
from .kernel import AdapterCaps, ops_where
from .kernels_elementwise import UNPACK_BYTES, bound_count, is_elementwise, make_fused
from .kernels_gemm import EPILOGUE_ACTIVATIONS, EPILOGUE_GRADS, PROLOGUE_ATTRS
from .kernels_nn import BN_APPLY, BN_STATS
from .kernels_optim import ARENA_CAST, COPY, FUSED_UPDATE
from .kernels_reduce import NON_FINITE
from .wgsl import shape_of, size_of

MAX_GROUP = 48          # members per kernel: keeps shaders small and compile times short
MERGE_FREES_BELOW = 1 << 20  # bytes: a group that frees more runs in its own place (_merge_siblings)


def residual_enabled() -> bool:
    """ANYGRAD_WGPU_RESIDUAL=0: a residual Add after a GEMM stays a kernel of its own (the old way)."""
    return settings.get("ANYGRAD_WGPU_RESIDUAL")


def grad_epilogue_enabled() -> bool:
    """ANYGRAD_WGPU_GRAD_EPILOGUE=0: an activation gradient after a GEMM stays a kernel of its own."""
    return settings.get("ANYGRAD_WGPU_GRAD_EPILOGUE")


def f16_epilogues_enabled() -> bool:
    """ANYGRAD_WGPU_F16_EPILOGUES=0: GEMM epilogues and operand-load activations stay float32-only
    (a float16 step's bias, residual, activation and their gradients run as kernels of their own)."""
    return settings.get("ANYGRAD_WGPU_F16_EPILOGUES")


def _is_half(graph: Graph, v: str) -> bool:
    return v in graph.info and np.dtype(graph.info[v].dtype) == np.float16


def _floats(graph: Graph, values) -> bool:
    """All of `values` float32, or float16 too: each fused step then rounds its float16 result as
    its own kernel would (kernels_gemm.Output.rounds: the same bits as the separate kernels).
    With ANYGRAD_WGPU_F16_EPILOGUES=0 float32 only."""
    kinds = (np.float32, np.float16) if f16_epilogues_enabled() else (np.float32,)
    return all(v in graph.info and np.dtype(graph.info[v].dtype) in kinds for v in values)


def _last_step(gemm: Node) -> str:
    """The epilogue step (kernels_gemm.Output.rounds) whose result is the fused GEMM's output now."""
    if gemm.attr("_epilogue") is not None:
        return "epilogue"
    if gemm.attr("_residual"):
        return "residual"
    return "bias" if has_bias(gemm) else "gemm"


def _round_output(graph: Graph, gemm: Node) -> None:
    """Before another step joins the GEMM's epilogue: if its output so far is float16 in the graph,
    the step that computes it rounds to f16 (attr `_round`), as its stored value would be."""
    if _is_half(graph, gemm.outputs[0]):
        gemm.attrs["_round"] = tuple(sorted(set(gemm.attr("_round") or ()) | {_last_step(gemm)}))


def _is_widening(graph: Graph, n: Node) -> bool:
    """A Cast from float16 to float32 a GEMM before it may take in: the widening is exact, so the
    GEMM stores its rounded result as float32 (not with ANYGRAD_WGPU_F16_EPILOGUES=0)."""
    return (f16_epilogues_enabled() and n.op == "Cast" and len(n.inputs) == 1 and _is_half(graph, n.inputs[0])
            and n.outputs[0] in graph.info and np.dtype(graph.info[n.outputs[0]].dtype) == np.float32)


def _bias_fits(graph: Graph, gemm: Node, bias: str, out: str) -> bool:
    """A bias the GEMM can add per output element: along the last axis for MatMul (Linear's
    bias), any shape broadcasting to the 2-D output for Gemm; never one that grows the output."""
    if bias not in graph.info or not _floats(graph, (bias, gemm.outputs[0], out)):
        return False
    y, sb = shape_of(graph, gemm.outputs[0]), shape_of(graph, bias)
    if shape_of(graph, out) != y or len(sb) > len(y):
        return False
    if gemm.op == "MatMul":
        return all(d == 1 for d in sb[:-1]) and (not sb or sb[-1] in (1, y[-1]))
    return all(d in (1, e) for d, e in zip(sb[::-1], y[::-1]))


def _residual_fits(graph: Graph, gemm: Node, other: str, out: str, reshaped: bool = False) -> bool:
    """A residual the GEMM can add per output element (x + Linear(h), a transformer block's
    skip connection): float32, the output's own shape (or, `reshaped` on the way, as many
    elements: Hugging Face's Conv1D is a 2-D addmm viewed back as 3-D), result stored in
    row-major order (so the residual's index is the output's), before any activation (the
    graph's order of adds)."""
    if not _floats(graph, (other, gemm.outputs[0], out)):
        return False
    same = (shape_of(graph, gemm.outputs[0]) == shape_of(graph, out) if not reshaped
            else size_of(graph, gemm.outputs[0]) == size_of(graph, out))
    return (not gemm.attr("_residual") and gemm.attr("_epilogue") is None
            and gemm.attr("_permY") is None and other != gemm.outputs[0]
            and shape_of(graph, other) == shape_of(graph, out) and same)


# Row kernels whose first output may take a residual Add (input 3, attr `_residual`): in the
# backward pass, the residual stream's gradient plus a LayerNorm's (an RMSNorm's) input gradient.
ROW_RESIDUAL_OPS = frozenset({"LayerNormGrad", "RMSNormGrad"})


def _fuse_row_residual(graph: Graph, add: Node, sole_input, producers: dict[str, Node], absorbed: set[int],
                       order: dict[int, int]) -> None:
    """Add(other, p's first output) becomes p's store `+ other` when p is a row kernel of
    ROW_RESIDUAL_OPS and `other` exists before p runs (order: node id -> place). p keeps its
    place: its other outputs (LayerNorm's parameter gradients) may be read before the Add's."""
    for slot in (0, 1):
        p = sole_input(add.inputs[slot])
        other = add.inputs[1 - slot]
        if (p is None or p.op not in ROW_RESIDUAL_OPS or p.attr("_residual") or p.outputs[0] != add.inputs[slot]
                or not residual_enabled() or len(p.inputs) > 3):
            continue
        maker = producers.get(other)
        if (maker is not None and order.get(id(maker), len(order)) > order[id(p)]) or any(
                v not in graph.info or np.dtype(graph.info[v].dtype) != np.float32
                for v in (other, add.inputs[slot], add.outputs[0])):
            continue
        if not shape_of(graph, other) == shape_of(graph, add.inputs[slot]) == shape_of(graph, add.outputs[0]):
            continue
        p.inputs[3:] = [other]
        p.attrs["_residual"] = True
        p.outputs[0] = add.outputs[0]
        producers[add.outputs[0]] = p
        absorbed.add(id(add))
        return


def where_epilogue_enabled() -> bool:
    """ANYGRAD_WGPU_WHERE_EPILOGUE=0: a masked_fill of a GEMM's result stays a kernel of its own."""
    return settings.get("ANYGRAD_WGPU_WHERE_EPILOGUE")


def _where_fill(graph: Graph, gemm: Node, where: Node, slot: int) -> float | None:
    """The fill of Where(cond, ., .) whose input `slot` is the GEMM's result, when the GEMM can
    apply it as it stores (attr `_where`): the other branch a float constant of one element, the
    condition broadcasting into the result without growing it, float32. Else None."""
    other, out, cond = where.inputs[3 - slot], where.outputs[0], where.inputs[0]
    fill = graph.initializers.get(other)
    if fill is None or np.size(fill) != 1 or any(
            v not in graph.info for v in (cond, out, gemm.outputs[0])):
        return None
    shape = shape_of(graph, out)
    if (not _floats(graph, (out, gemm.outputs[0])) or shape_of(graph, gemm.outputs[0]) != shape
            or len(shape_of(graph, cond)) > len(shape)
            or np.broadcast_shapes(shape_of(graph, cond), shape) != shape):
        return None
    return float(np.asarray(fill).reshape(()))


def fuse_epilogues(graph: Graph, protected: set[str], supports_epilogue: set[str]) -> None:
    """A GEMM's bias Add, residual Add and activation run in its epilogue when nothing else reads
    the values in between: MatMul/Gemm -> Add(bias) -> Add(residual) -> activation (Relu, Gelu,
    ... see EPILOGUE_ACTIVATIONS), Conv -> Relu. The fused GEMM takes the place of the last node
    it absorbs. A residual is input 3 (input 2, the bias, may be empty) with attr `_residual`.
    Last of all, a masked_fill (Where with a constant branch; attention's causal mask over its
    scores): input 4 the condition, attr `_where`; nothing fuses into a GEMM after it."""
    users = graph.consumers()
    producers = graph.producers()
    replaced: dict[int, Node] = {}   # id(absorbed node) -> the GEMM now standing in its place
    moved = set()                    # ids of GEMMs moved to a later place
    absorbed: set[int] = set()       # ids of residual Adds a row kernel took over in its own place
    order = {id(m): k for k, m in enumerate(graph.nodes)}  # where each node will run (fused GEMMs move)

    def sole_input(v: str) -> Node | None:
        p = producers.get(v)
        if p is None or len(users.get(v, [])) != 1 or v in protected or p.attr("_where") is not None:
            return None
        return p

    def gemm_behind(v: str) -> tuple[Node | None, Node | None]:
        """(v's sole producer, or the GEMM behind a reshape or a float16 -> float32 Cast that is v's
        sole producer; that node, which the fused GEMM replaces, or None)."""
        p = sole_input(v)
        if p is not None and (p.op in ALIAS_LIKE or _is_widening(graph, p)) and p.inputs:
            q = sole_input(p.inputs[0])
            if q is not None and q.op in GEMM_OPS:
                return q, p
        return p, None

    for n in graph.nodes:
        if n.op == "Add" and len(n.inputs) == 2:
            for slot in (0, 1):
                p, via = gemm_behind(n.inputs[slot])
                other = n.inputs[1 - slot]
                if p is None or p.op not in GEMM_OPS & supports_epilogue:
                    continue
                if (via is None and not has_bias(p) and not p.attr("_residual") and p.attr("_epilogue") is None
                        and _bias_fits(graph, p, other, n.outputs[0])):
                    _round_output(graph, p)
                    p.inputs[2:] = [other]
                    if p.op == "Gemm":
                        p.attrs["beta"] = 1.0
                elif _residual_fits(graph, p, other, n.outputs[0], reshaped=via is not None) and residual_enabled():
                    _round_output(graph, p)
                    p.inputs[2:] = [p.input(2), other]
                    p.attrs["_residual"] = True
                else:
                    continue
                if via is not None:
                    absorbed.add(id(via))
                p.outputs[0] = n.outputs[0]
                replaced[id(n)] = p
                order[id(p)] = order[id(n)]  # it will run there
                moved.add(id(p))
                producers[n.outputs[0]] = p
                break
            else:
                _fuse_row_residual(graph, n, sole_input, producers, absorbed, order)
            continue
        if n.op == "Where" and len(n.inputs) == 3:
            for slot in (1, 2):
                p = sole_input(n.inputs[slot])
                if p is None or p.op not in GEMM_OPS & supports_epilogue or not where_epilogue_enabled():
                    continue
                fill = _where_fill(graph, p, n, slot)
                if fill is not None:
                    break
            else:
                continue
            _round_output(graph, p)
            p.inputs[2:] = [p.input(2), p.input(3), n.inputs[0]]
            p.attrs["_where"] = (fill, slot == 2)  # the fill is Where's true branch when the GEMM is the false one
        elif n.op in EPILOGUE_GRADS and len(n.inputs) == 2 and grad_epilogue_enabled():
            # dy's GEMM applies the gradient, reading x at its own index as it reads a residual
            # (through the reshape back to 3-D after a 2-D Gemm, which the fused GEMM replaces)
            (p, via), x = gemm_behind(n.inputs[0]), n.inputs[1]
            if (p is None or p.op not in GEMM_OPS & supports_epilogue or has_bias(p) or x == n.inputs[0]
                    or not _residual_fits(graph, p, x, n.outputs[0], reshaped=via is not None)):
                continue
            _round_output(graph, p)
            p.inputs[2:] = ["", x]
            p.attrs.update(_epilogue=n.op, _epilogue_attrs=dict(n.attrs), _epilogue_arg=True)
            if via is not None:
                absorbed.add(id(via))
        else:
            if len(n.inputs) != 1:
                continue
            p = sole_input(n.inputs[0])
            if p is None or p.op not in supports_epilogue or p.attr("_epilogue") is not None:
                continue
            if n.op == "Relu":
                p.attrs["_epilogue"] = "relu"  # relu(f16(y)) == f16(relu(y)): no rounding needed between
            elif (n.op in EPILOGUE_ACTIVATIONS and p.op in GEMM_OPS
                  and _floats(graph, (p.outputs[0], n.outputs[0]))):
                _round_output(graph, p)
                p.attrs["_epilogue"] = n.op
                p.attrs["_epilogue_attrs"] = dict(n.attrs)
            elif _is_widening(graph, n) and p.op in GEMM_OPS:
                _round_output(graph, p)  # the GEMM stores its float16 result widened to float32
            else:
                continue
        p.outputs[0] = n.outputs[0]
        replaced[id(n)] = p
        order[id(p)] = order[id(n)]
        moved.add(id(p))
        producers[n.outputs[0]] = p
    # each fused GEMM runs where the last node it absorbed ran (its bias may be computed late)
    final = {id(p): nid for nid, p in replaced.items()}
    nodes = []
    for n in graph.nodes:
        if id(n) in absorbed:
            continue
        if id(n) in moved:
            continue
        if id(n) in replaced:
            p = replaced[id(n)]
            if final[id(p)] == id(n):
                nodes.append(p)
            continue
        nodes.append(n)
    graph.nodes = nodes


# Row kernels of mixed precision's float32 islands (autocast computes norms and softmax in f32):
# the float16 values on their edges are read and written through halfstore.py's conversions.
FLOAT_ISLANDS = frozenset({"LayerNormalization", "LayerNormGrad", "RMSNormalization", "RMSNormGrad",
                           "Softmax", "SoftmaxGrad", "LogSoftmax", "LogSoftmaxGrad"})


def cast_fold_enabled() -> bool:
    """ANYGRAD_WGPU_CAST_FOLD=0: float Casts on the edges of the float32 islands stay kernels."""
    return settings.get("ANYGRAD_WGPU_CAST_FOLD")


def fold_float_casts(graph: Graph, protected: set[str]) -> None:
    """Casts between float32 and float16 on the edges of the float32 islands cost no kernel:
    - a row kernel whose float32 result only a Cast to float16 reads stores the float16 value
      itself (its store rounds as the Cast would: the same conversion, the same bits);
    - a float16 value widened by a Cast that only row kernels read is read by them directly (the
      widening is exact, and their reads convert).
    26 of the d-256 GPT's 34 f16 Cast kernels (the 34 took 3% of its H200 step)."""
    if not cast_fold_enabled():
        return
    producers = graph.producers()
    users = {v: [r for r, _ in rs] for v, rs in graph.consumers().items()}
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    dropped: set[int] = set()
    for n in graph.nodes:
        if n.op != "Cast" or len(n.inputs) != 1 or n.inputs[0] not in graph.info or n.outputs[0] not in graph.info:
            continue
        x, y = n.inputs[0], n.outputs[0]
        src, dst = np.dtype(graph.info[x].dtype), np.dtype(graph.info[y].dtype)
        p = producers.get(x)
        if (src, dst) == (f32, f16) and p is not None and p.op in FLOAT_ISLANDS and x not in protected \
                and [id(r) for r in users.get(x, [])] == [id(n)]:
            p.outputs[p.outputs.index(x)] = y
            producers[y] = p
        elif (src, dst) == (f16, f32) and y not in protected and users.get(y) \
                and all(r.op in FLOAT_ISLANDS for r in users[y]):
            for r in users[y]:
                r.inputs[:] = [x if v == y else v for v in r.inputs]
            users[x] = [r for r in users.get(x, []) if r is not n] + users[y]
        else:
            continue
        dropped.add(id(n))
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]


def prologue_enabled() -> bool:
    """ANYGRAD_WGPU_PROLOGUE=0: an activation read only by GEMMs stays a kernel of its own."""
    return settings.get("ANYGRAD_WGPU_PROLOGUE")


def fuse_prologues(graph: Graph, protected: set[str]) -> None:
    """An activation whose output only GEMMs read (as an operand, maybe through reshapes that
    nothing else reads) runs in those GEMMs' operand loads instead (attr `_prologueA` /
    `_prologueB`, kernels_gemm._prologue), and its output is never stored: an MLP's GELU before
    its second Linear, forward, and where the backward recomputes it for that Linear's weight
    gradient (planner.recompute_elementwise). Each element is activated once per tile that
    loads it (a few times over: N / BN), against a pass that writes and rereads all of them.
    For the activations a GEMM epilogue takes (EPILOGUE_ACTIVATIONS, Relu), float32 only;
    after fuse_epilogues, which takes an activation whose input only it reads."""
    if not prologue_enabled():
        return
    users = graph.consumers()

    def gemm_operands(v: str) -> list[tuple[Node, int]] | None:
        """(GEMM, operand slot) of every reader of v, looking through reshapes; None if any other
        node reads it (or a reshape of it), or a GEMM has a prologue there already."""
        found = []
        for node, slot in users.get(v, []):
            if node.op in ALIAS_LIKE and slot == 0 and node.outputs[0] not in protected:
                deeper = gemm_operands(node.outputs[0])
                if deeper is None:
                    return None
                found += deeper
            elif node.op in GEMM_OPS and slot <= 1 and node.inputs.count(v) == 1 and \
                    node.attr(PROLOGUE_ATTRS[slot]) is None:
                found.append((node, slot))
            else:
                return None
        return found

    dropped: set[int] = set()
    for n in graph.nodes:
        if (n.op not in EPILOGUE_ACTIVATIONS | {"Relu"} or len(n.inputs) != 1 or n.outputs[0] in protected
                or not _floats(graph, (n.inputs[0], n.outputs[0]))
                or graph.info[n.inputs[0]].dtype != graph.info[n.outputs[0]].dtype):
            continue
        operands = gemm_operands(n.outputs[0])
        if not operands:
            continue
        for reader, slot in users[n.outputs[0]]:  # a reshape now views the input: as many elements, same order
            reader.inputs[slot] = n.inputs[0]
        for gemm, slot in operands:  # a float16 activation rounds each element as its kernel would store it
            gemm.attrs[PROLOGUE_ATTRS[slot]] = (n.op, dict(n.attrs), _is_half(graph, n.outputs[0]))
        dropped.add(id(n))
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]


def fuse_elementwise(graph: Graph, caps: AdapterCaps, protected: set[str]) -> None:
    """Replace groups of elementwise nodes by wgpu.Fused nodes (in place on graph.nodes).

    protected: values that must be stored even when only group members read them (graph
    outputs, state updates)."""
    state = set(graph.state_names)
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    users = graph.consumers()
    # A gradient computed into its arena slice is read by its FusedUpdate through attrs, not
    # inputs: counted as a use here, so that no group holding its writer (joined or merged with a
    # later one) is emitted after the update, which would then read the slice before it is written.
    for n in graph.nodes:
        if n.op == FUSED_UPDATE:
            for v in n.attrs["grads"]:
                users.setdefault(v, []).append((n, -1))
    producers = graph.producers()
    group_of: dict[int, list[Node]] = {}   # id(node) -> its group's member list
    groups: list[list[Node]] = []
    limit = max(2, caps.max_storage_buffers_per_stage)

    def stored(members: list[Node]) -> list[str]:
        ids = {id(m) for m in members}
        out = []
        for m in members:
            for o in m.outputs:
                if o and (o in protected or any(id(u) not in ids for u, _ in users.get(o, []))):
                    out.append(o)
        return out or [members[-1].outputs[0]]

    def can_join(members: list[Node], node: Node) -> bool:
        if len(members) >= MAX_GROUP:
            return False
        if shape_of(graph, members[-1].outputs[0]) != shape_of(graph, node.outputs[0]):
            return False
        ids = {id(m) for m in members} | {id(node)}
        here = order[id(node)]
        for m in members:
            for o in m.outputs:
                for u, _ in users.get(o, []):
                    if id(u) not in ids and order[id(u)] < here:
                        return False
        trial = members + [node]
        return bound_count(graph, trial, stored(trial), state) <= limit

    for n in graph.nodes:
        if not is_elementwise(n, graph):
            continue
        joined = False
        for v in n.inputs:
            p = producers.get(v)
            if p is None or id(p) not in group_of:
                continue
            members = group_of[id(p)]
            if can_join(members, n):
                members.append(n)
                group_of[id(n)] = members
                joined = True
                break
        if not joined:
            members = [n]
            groups.append(members)
            group_of[id(n)] = members

    groups = _merge_siblings(graph, groups, users, order, stored, limit, state)
    group_of = {id(m): g for g in groups for m in g}
    new_nodes: list[Node] = []
    last = {id(g[-1]): g for g in groups}
    for n in graph.nodes:
        if id(n) not in group_of:
            new_nodes.append(n)
        elif id(n) in last:
            g = last[id(n)]
            new_nodes.append(make_fused(graph, g, stored(g), state))
    graph.nodes = new_nodes


# -- optimizer updates over arenas -------------------------------------------------------------------
ARENA_ALIGN = 64          # elements (256 bytes): every adapter's storage-offset alignment
HALF_ARENA_ALIGN = 128    # elements: 256 bytes also in the float16 copy of the arena (arena_weight_casts)


@dataclass(frozen=True)
class ArenaSpec:
    """State tensors that must lie back to back in one buffer, at these element offsets."""

    value: str                       # the graph value standing for the whole arena
    members: tuple[str, ...]         # state names
    offsets: tuple[int, ...]         # element offsets
    total: int                       # elements


def _aligned(n: int, align: int = ARENA_ALIGN) -> int:
    return -(-n // align) * align


def group_updates(graph: Graph, caps: AdapterCaps) -> None:
    """Merge the optimizer update nodes of one kind (same op, hyperparameters, lr and step) into
    one `wgpu.FusedUpdate` over arenas: parameters, each slot, and the gradients lie back to back,
    so the whole optimizer step is one dispatch updating every parameter in its own buffer."""
    users = graph.consumers()
    producers = graph.producers()
    state = set(graph.state_names)
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[Node]] = {}
    gates: dict[int, list[Node]] = {}  # update node -> its gating Where nodes (f16 loss scaling)
    update_ops = ops_where("update")
    for n in graph.nodes:
        if n.op not in update_ops:
            continue
        targets = [graph.state_updates.get(o) for o in n.outputs]
        state_in = [n.inputs[0]] + n.inputs[2:2 + len(n.outputs) - 1]
        found = None
        if targets != state_in:  # each output kept or not by Where(found, state, new) (grad_scaler.gate)?
            wheres = [_gate_of(users, o, s) for o, s in zip(n.outputs, state_in)]
            if any(w is None for w in wheres) or len({w.inputs[0] for w in wheres}) != 1:
                continue
            found = wheres[0].inputs[0]
            targets = [graph.state_updates.get(w.outputs[0]) for w in wheres]
            gates[id(n)] = wheres
        elif any(users.get(o) for o in n.outputs):
            continue
        if (targets != state_in or any(t not in state for t in state_in)
                or any(graph.info[v].dtype != np.float32 for v in state_in)):
            gates.pop(id(n), None)
            continue
        key = (n.op, repr(sorted(n.attrs.items())), n.inputs[-2], n.inputs[-1], found)
        groups.setdefault(key, []).append(n)
    half_cast = _half_cast_params(graph)
    for members in groups.values():
        gate_ids = {id(w) for m in members for w in gates.get(id(m), [])}
        # Parameters cast to float16 (f16 steps): slices of the float16 arena start on 256 bytes too.
        align = HALF_ARENA_ALIGN if any(m.inputs[0] in half_cast for m in members) else ARENA_ALIGN
        # Even one parameter gains: each arena is bound once (read_write), within 8 bindings.
        last = max(order[id(m)] for m in members)
        touched = {v for m in members for v in [m.inputs[0]] + m.inputs[2:2 + len(m.outputs) - 1]}
        grown = True
        while grown:  # values aliasing the state (Reshape of a weight) read its buffer too
            more = {n.outputs[0] for n in graph.nodes if n.op in ALIAS_LIKE and n.inputs[0] in touched}
            grown = not more <= touched
            touched |= more
        # Everything reading those tensors must run before the fused update (placed at the last member).
        # ... and nothing may need their old values after it (outputs, other state updates).
        if (any(order[id(u)] > last and id(u) not in gate_ids for v in touched for u, _ in users.get(v, []))
                or touched & (set(graph.outputs) | set(graph.state_updates))):
            continue
        # Bindings: gradients, lr, step, (the skip flag,) and each arena once (read_write).
        if 3 + bool(gate_ids) + len(members[0].outputs) > caps.max_storage_buffers_per_stage:
            continue
        # Each arena must fit one storage binding: split into chunks that do.
        budget = caps.max_storage_binding_size // 4
        chunk: list[Node] = []
        size = 0
        for m in members + [None]:
            n = _aligned(size_of(graph, m.inputs[0]), align) if m is not None else 0
            if m is None or (chunk and size + n > budget):
                if chunk:
                    _fuse_group(graph, chunk, producers, state, [gates.get(id(c), []) for c in chunk], align)
                chunk, size = [], 0
            if m is not None:
                chunk.append(m)
                size += n


def _gate_of(users: dict, value: str, state_name: str) -> Node | None:
    """The Where(found, state, value) that is value's only use (a loss-scaled step's skip), or None."""
    use = users.get(value, [])
    if len(use) != 1:
        return None
    w, slot = use[0]
    return w if w.op == "Where" and slot == 2 and w.inputs[1] == state_name else None


def _fuse_group(graph: Graph, members: list[Node], producers: dict[str, Node], state: set[str],
                gates: list[list[Node]] | None = None, align: int = ARENA_ALIGN) -> None:
    first = members[0]
    wheres = [w for ws in (gates or []) for w in ws]
    n_slots = len(first.outputs) - 1
    params = [m.inputs[0] for m in members]
    gid = hashlib.sha1(("|".join([first.op] + params)).encode()).hexdigest()[:10]
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += _aligned(size_of(graph, p), align)
    arenas = []
    for j in range(n_slots + 1):
        names = tuple(m.inputs[0] if j == 0 else m.inputs[1 + j] for m in members)
        arenas.append(ArenaSpec(f"@arena:{gid}:{j}", names, tuple(offsets), total))
    garena = f"@garena:{gid}"
    for v in [a.value for a in arenas] + [garena]:
        graph.info[v] = TensorInfo(np.dtype(np.float32), (total,))
    # Each gradient is computed straight into its slice of the gradient arena when its storage is
    # a fresh temporary of its own; otherwise it is copied there.
    claims, copies, claimed_roots = [], [], set()
    for m in members:
        g = m.inputs[1]
        root = g
        while root in producers and producers[root].op in ALIAS_LIKE:
            root = producers[root].inputs[0]
        fresh = (root in producers and root not in state and root not in graph.inputs
                 and root not in graph.initializers and root not in claimed_roots and root not in graph.outputs)
        if not fresh:
            root = graph.fresh(f"{g}.arena")
            graph.info[root] = TensorInfo(np.dtype(np.float32), graph.info[g].shape)
            copies.append(Node(COPY, [g], [root], name=graph.fresh("copy")))
        claimed_roots.add(root)
        claims.append(root)
    lr, step = first.inputs[-2], first.inputs[-1]
    ins = [arenas[0].value, garena] + [a.value for a in arenas[1:]] + [lr, step]
    outs = [a.value for a in arenas]
    attrs = {"op": first.op, "attrs": dict(first.attrs), "arenas": arenas, "grads": claims, "offsets": offsets,
             "garena": garena}
    if wheres:  # each arena keeps its old values where the flag says the step is skipped
        ins.append(wheres[0].inputs[0])
        attrs["gate"] = [graph.fresh(f"{v}.new") for v in outs]
        for v in attrs["gate"]:
            graph.info[v] = TensorInfo(np.dtype(np.float32), (total,))
    fused = Node(FUSED_UPDATE, ins, outs, attrs, name=f"{first.op}x{len(members)}")
    for m in members:
        for o in m.outputs:
            graph.state_updates.pop(o, None)
    for w in wheres:
        graph.state_updates.pop(w.outputs[0], None)
    ids = {id(m) for m in members}
    # by identity: list.index compares Nodes field by field (a dataclass), node after node
    last = max(k for k, n in enumerate(graph.nodes) if id(n) in ids)
    drop = ids | {id(w) for w in wheres}
    nodes = []
    for k, n in enumerate(graph.nodes):
        if id(n) not in drop:
            nodes.append(n)
        if k == last:
            nodes.extend(copies + [fused])
    graph.nodes = nodes


def _merge_siblings(graph: Graph, groups: list[list[Node]], users, order, stored, limit: int,
                    state: set[str]) -> list[list[Node]]:
    """Horizontal fusion: independent groups of one shape become one kernel (emitted at the later
    one's place) when nothing between them reads what the earlier one stores, and the earlier one
    frees little: moved later, it would hold what it reads last (a float16 weight gradient it
    widens into its arena) alive across the kernels in between, at the backward pass's peak."""
    groups = sorted(groups, key=lambda g: order[id(g[-1])])
    fixed = set(graph.initializers) | set(graph.inputs)

    def frees(a: list[Node]) -> int:
        """Bytes of the computed values nothing after group `a` reads."""
        ids, end = {id(m) for m in a}, order[id(a[-1])]
        last = {v for m in a for v in m.inputs if v and v not in fixed and v in graph.info
                and all(id(u) in ids or order[id(u)] <= end for u, _ in users.get(v, []))}
        return sum(size_of(graph, v) * np.dtype(graph.info[v].dtype).itemsize for v in last)
    merged: list[list[Node]] = []
    for g in groups:
        target = None
        for a in reversed(merged):
            if (shape_of(graph, a[-1].outputs[0]) != shape_of(graph, g[-1].outputs[0])
                    or len(a) + len(g) > MAX_GROUP or frees(a) >= MERGE_FREES_BELOW):
                continue
            ids = {id(m) for m in a + g}
            here = order[id(g[-1])]
            if any(id(u) not in ids and order[id(u)] <= here
                   for m in a for o in m.outputs if o for u, _ in users.get(o, [])):
                continue
            trial = sorted(a + g, key=lambda m: order[id(m)])
            if bound_count(graph, trial, stored(trial), state) <= limit:
                target = a
                break
        if target is None:
            merged.append(list(g))
        else:
            target.extend(g)
            target.sort(key=lambda m: order[id(m)])
    return merged


F16_ARENA_ENV = "ANYGRAD_WGPU_F16_ARENA"


def f16_arena_enabled() -> bool:
    """ANYGRAD_WGPU_F16_ARENA=0 keeps the float16 step's per-tensor work as the graph builds it
    (the per-gradient finite check), for A/B runs; default on."""
    return settings.get(F16_ARENA_ENV)


def _alias_root(v: str, producers: dict[str, Node]) -> str:
    while v in producers and producers[v].op in ALIAS_LIKE:
        v = producers[v].inputs[0]
    return v


def arena_finite_check(graph: Graph) -> None:
    """The loss scaler's test (grad_scaler.found_inf: FoundInf over the gradients) reads each
    gradient arena whole, in one reduction, instead of each gradient in it, for the
    wgpu.FusedUpdate nodes that the test gates.

    The reduction (wgpu.NonFinite, kernels_reduce.py) counts the elements of the whole garena
    buffer whose exponent bits are all ones (inf or NaN; the zero padding between slices counts
    nothing) and yields +inf when that count is positive, else 0: FoundInf reads that scalar in
    place of the arena's gradients (kernels_reduce.lower_found_inf), and it is non-finite exactly
    when one of them is. A count, not a sum of the values, so it decides exactly like torch's
    GradScaler (a sum of finite float32 gradients could overflow to inf and skip a good step); and
    not max(|x|), whose NaN handling WGSL leaves to the implementation.

    An arena is taken only when every gradient in it is one of FoundInf's inputs (so the test reads
    no gradient it did not read before). Its node is placed before the first reader of the test,
    after the copies into those arenas (moved there from in front of their updates); its inputs
    after the garena name the values written into it (each gradient computed into its slice, or the
    copy there), so that later passes (elementwise fusion, which emits a group at its last member)
    keep their writers before it. The lowering reads only the garena."""
    if not f16_arena_enabled():
        return
    producers = graph.producers()
    users = graph.consumers()
    updates = [n for n in graph.nodes if n.op == FUSED_UPDATE and n.attrs.get("gate")]
    for found in dict.fromkeys(n.inputs[-1] for n in updates):
        gated = [n for n in updates if n.inputs[-1] == found]
        _arena_finite_check(graph, found, gated, producers, users)
        producers = graph.producers()
        users = graph.consumers()


def _is_half_cast(graph: Graph, n: Node) -> bool:
    return (n.op == "Cast" and len(n.inputs) == 1 and len(n.outputs) == 1
            and np.dtype(graph.info[n.outputs[0]].dtype) == np.float16
            and np.dtype(graph.info[n.inputs[0]].dtype) == np.float32)


def _half_cast_params(graph: Graph) -> set[str]:
    """Trainable parameters some Cast reads straight into float16 (autocast, and recompute's copies)."""
    if not f16_arena_enabled():
        return set()
    params = set(graph.params)
    return {n.inputs[0] for n in graph.nodes if _is_half_cast(graph, n) and n.inputs[0] in params}


def arena_weight_casts(graph: Graph) -> None:
    """The float16 copies of the weights (autocast's Cast(param -> float16), and the copies
    ir/recompute.py places in the backward) as one cast of the whole parameter arena per step: a
    wgpu.ArenaCast writes `@garena:{gid}:f16` (a float16 buffer of the arena's size and layout,
    held like the gradient arena: its own buffer, zeroed at creation), and each cast's value becomes
    that weight's slice of it (planner Root "gslice"; group_updates aligned the arena to 128
    elements so that every slice starts on a 256-byte boundary). The cast is placed where the
    first of those Casts was: the parameters change only in the fused update, after every reader.
    Parameters in the arena that nothing casts (a BatchNorm's, kept float32) are cast too, unread:
    a few more elements, no more kernels. The float16 weights stay in memory through the step (2
    bytes a parameter), where recomputation let each die after its forward reads."""
    if not f16_arena_enabled():
        return
    for upd in [n for n in graph.nodes if n.op == FUSED_UPDATE]:
        spec = upd.attrs["arenas"][0]
        offset = dict(zip(spec.members, spec.offsets))
        casts = [n for n in graph.nodes if _is_half_cast(graph, n) and n.inputs[0] in offset
                 and offset[n.inputs[0]] % HALF_ARENA_ALIGN == 0 and n.outputs[0] not in graph.outputs
                 and n.outputs[0] not in graph.state_updates]
        if not casts:
            continue
        half = f"{upd.attrs['garena']}:f16"
        graph.info[half] = TensorInfo(np.dtype(np.float16), (spec.total,))
        upd.attrs["half"] = half
        upd.attrs["half_slices"] = {n.outputs[0]: offset[n.inputs[0]] for n in casts}
        cast = Node(ARENA_CAST, [spec.value], [half], name="ArenaCast")
        drop = {id(n) for n in casts}
        first = min(k for k, n in enumerate(graph.nodes) if id(n) in drop)
        nodes = []
        for k, n in enumerate(graph.nodes):
            if k == first:
                nodes.append(cast)
            if id(n) not in drop:
                nodes.append(n)
        graph.nodes = nodes


def _arena_finite_check(graph: Graph, found: str, gated: list[Node], producers: dict[str, Node],
                        users: dict) -> None:
    test = producers.get(found)
    if test is None or test.op != "FoundInf" or found in graph.outputs or found in graph.state_updates:
        return
    tested = {_alias_root(v, producers): v for v in test.inputs}  # gradient (alias root) -> FoundInf's input
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    first_use = min(order[id(u)] for u, _ in users[found])
    copies_of = {n.outputs[0]: n for n in graph.nodes if n.op == COPY}
    taken, moved, checks = set(), [], []
    for upd in gated:
        roots, srcs, cps = [], [], []
        for claim in upd.attrs["grads"]:
            cp = copies_of.get(claim)
            src = cp.inputs[0] if cp is not None else claim
            if src not in producers:  # a graph input or a state tensor: not a gradient of this step
                roots = None
                break
            roots.append(_alias_root(src, producers))
            srcs.append(src)
            if cp is not None:
                cps.append(cp)
        if (roots is None or any(r not in tested or tested[r] in taken for r in roots)
                or any(order[id(producers[v])] >= first_use for v in srcs)):
            continue
        taken |= {tested[r] for r in roots}
        moved += cps
        w = graph.fresh(f"{upd.attrs['garena']}.nonfinite")
        graph.info[w] = TensorInfo(np.dtype(np.float32), ())
        # the values written into the arena (a gradient, or its copy) after the garena: ordering edges
        checks.append(Node(NON_FINITE, [upd.attrs["garena"]] + list(upd.attrs["grads"]), [w],
                           name=graph.fresh("nonfinite")))
    if not checks:
        return
    test.inputs = [c.outputs[0] for c in checks] + [v for v in test.inputs if v not in taken]
    drop = {id(n) for n in moved + [test]}
    nodes = []
    for k, n in enumerate(graph.nodes):
        if k == first_use:
            nodes += moved + checks + [test]
        if id(n) not in drop:
            nodes.append(n)
    graph.nodes = nodes


def split_batchnorm(graph: Graph) -> None:
    """Every training BatchNormalization as its statistics (BN_STATS, a reduction) and its
    normalisation (BN_APPLY, an elementwise op), so that fuse_elementwise runs the normalisation
    in the kernel of the ReLU or residual Add after it: one pass over the activation instead of
    two, and the BN output is stored only when something outside that kernel reads it (the
    backward reads the BN input and the ReLU output). ANYGRAD_WGPU_BN_SPLIT=0 keeps the node
    whole (A/B runs)."""
    if not settings.get("ANYGRAD_WGPU_BN_SPLIT"):
        return
    nodes = []
    for n in graph.nodes:
        x = n.input(0)
        if n.op != "BatchNormalization" or not n.attr("training_mode", 0) or len(shape_of(graph, x)) < 2:
            nodes.append(n)
            continue
        shape = shape_of(graph, x)
        channels, spatial = shape[1], int(np.prod(shape[2:], dtype=np.int64))
        stats = f"{n.outputs[0]}@bnstats"
        graph.info[stats] = TensorInfo(np.dtype(np.float32), (2 * channels,))
        running = (list(n.outputs[1:3]) + ["", ""])[:2]
        origin = {"_origin": n.label}  # errors name the model's node (planner._label)
        nodes.append(Node(BN_STATS, list(n.inputs[:5]), [stats] + running, {**n.attrs, **origin}, name=n.name))
        nodes.append(Node(BN_APPLY, [x, n.inputs[1], n.inputs[2], stats], [n.outputs[0]],
                          {"channels": channels, "spatial": spatial, **origin}, name=f"{n.name}/apply"))
    graph.nodes = nodes


def inference_dropout_to_identity(graph: Graph) -> None:
    """Dropout outside training (no training flag, or a constant false one) is the identity: make it
    an Identity, which the planner turns into an alias (no kernel), when its mask is unused."""
    users = graph.consumers()
    for n in graph.nodes:
        if n.op != "Dropout" or any(users.get(o) or o in graph.outputs for o in n.outputs[1:] if o):
            continue
        flag = n.input(2)
        if flag and (flag not in graph.initializers or bool(np.asarray(graph.initializers[flag]).reshape(()))):
            continue
        n.op, n.inputs, n.outputs, n.attrs = "Identity", [n.inputs[0]], [n.outputs[0]], {}


def whole_slices_to_identity(graph: Graph) -> None:
    """A Slice that takes all of its input in order (and the SliceGrad of one) is the identity:
    make it an Identity, which the planner aliases. Hugging Face's causal LMs slice the last
    hidden state this way for `logits_to_keep=0`, a copy of (batch, tokens, d) each way."""
    for n in graph.nodes:
        if n.op not in ("Slice", "SliceGrad") or not n.inputs or not n.outputs[0]:
            continue
        steps = n.attrs.get("steps")
        if (steps is not None and all(int(k) == 1 for k in steps)
                and shape_of(graph, n.inputs[0]) == shape_of(graph, n.outputs[0])
                and graph.info[n.inputs[0]].dtype == graph.info[n.outputs[0]].dtype):
            n.op, n.inputs, n.outputs, n.attrs = "Identity", [n.inputs[0]], [n.outputs[0]], {}


# -- 1-byte graph inputs ----------------------------------------------------------------------------
PACKED = "@u8x4:"   # prefix of the packed input standing in for a 1-byte graph input
BYTE_DTYPES = frozenset({np.dtype(np.uint8), np.dtype(np.int8), np.dtype(np.bool_)})


def packed_name(name: str) -> str:
    return PACKED + name


def pack_byte_inputs(graph: Graph) -> None:
    """Upload uint8/int8/bool graph inputs as they are stored, four elements per u32 word.

    The input becomes '@u8x4:<name>' (the array's bytes seen as u32 words, padded to a whole word,
    so a batch uploads x.nbytes rounded up to 4), and a wgpu.UnpackBytes node in front of the graph
    recomputes <name> as one u32/i32 per element, the kernel contract every consumer expects. The
    unpack is elementwise, so it fuses into the elementwise chain reading the input (the Cast ->
    Sub -> Div of an in-graph normalisation reads the words directly); any other consumer reads it
    from a temporary it writes. The runtime writes the feed of <name> into '@u8x4:<name>'."""
    unpack = []
    for k, name in enumerate(graph.inputs):
        info = graph.info[name]
        if np.dtype(info.dtype) not in BYTE_DTYPES or info.size == 0:
            continue
        packed = packed_name(name)
        graph.info[packed] = TensorInfo(np.dtype(np.uint32), (-(-info.size // 4),))
        graph.inputs[k] = packed
        unpack.append(Node(UNPACK_BYTES, [packed], [name], name=f"unpack {name}"))
    graph.nodes = unpack + graph.nodes


def prepare(graph: Graph, caps: AdapterCaps, supports_epilogue: set[str], fuse: bool = True) -> Graph:
    """A copy of graph rewritten for lowering (its attributes resolved: what the lowerings read)."""
    g = resolve_attributes(graph.copy())
    protected = set(g.outputs) | set(g.state_updates)
    inference_dropout_to_identity(g)
    whole_slices_to_identity(g)
    pack_byte_inputs(g)  # not an optimisation: the runtime uploads those inputs packed either way
    if fuse:
        # first, so that the optimizer grouping sees the GEMMs that now read the weights directly
        if scale_fold_enabled():
            canonical_transposes(g, protected)
        fold_transposes(g, protected)
        if scale_fold_enabled():
            fold_scales(g, protected)        # a scale between a Transpose and a MatMul, once the
            fold_transposes(g, protected)    # MatMuls read through the others, then that Transpose
        if slice_views_enabled():
            fold_slices(g, protected, caps)
        group_updates(g, caps)
        arena_finite_check(g)  # after group_updates: the gradient arenas it reduces
        arena_weight_casts(g)
        # Gradients computed into their arena slice are read only through FusedUpdate's attrs.
        claimed = {v for n in g.nodes if n.op == FUSED_UPDATE for v in n.attrs["grads"]}
        protected = set(g.outputs) | set(g.state_updates) | claimed
        fuse_epilogues(g, protected, supports_epilogue)
        fuse_prologues(g, protected)
        fold_float_casts(g, protected)
        split_batchnorm(g)
        fuse_elementwise(g, caps, protected)
        if slice_views_enabled():
            fold_concats(g, protected, caps)   # last: it gives a value several writers
    check_graph(g.nodes)  # every private attribute the rewrites (and pins) set is declared
    return g
