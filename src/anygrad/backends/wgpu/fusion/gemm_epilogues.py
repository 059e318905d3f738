"""GEMM epilogues and prologues (fusion passes): a MatMul/Gemm's bias, residual Add, activation
(or activation gradient) and Where run in its epilogue (fuse_epilogues), and an activation read
only by GEMMs runs in their operand loads (fuse_prologues). Under float16 a fused step rounds to
f16 where the separate kernel would (gemm_spec.Output.rounds).
"""
from __future__ import annotations

import numpy as np

from .... import settings
from ....ir.graph import Graph, Node
from ..kernels import matrix_units
from ..kernels.gemm_spec import EPILOGUE_ACTIVATIONS, EPILOGUE_GRADS
from ..kernels.kernel import AdapterCaps
from ..kernels.kernels_gemm import EPILOGUE_INPUTS, PROLOGUE_ATTRS, operand_type
from ..kernels.wgsl import shape_of, size_of
from .gemm_layout import GEMM_OPS, has_bias
from .views import ALIAS_LIKE


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
    its own kernel would (gemm_spec.Output.rounds: the same bits as the separate kernels).
    With ANYGRAD_WGPU_F16_EPILOGUES=0 float32 only."""
    kinds = (np.float32, np.float16) if f16_epilogues_enabled() else (np.float32,)
    return all(v in graph.info and np.dtype(graph.info[v].dtype) in kinds for v in values)


def _last_step(gemm: Node) -> str:
    """The epilogue step (gemm_spec.Output.rounds) whose result is the fused GEMM's output now."""
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


def _read_at_own_index(graph: Graph, gemm: Node, other: str, out: str, reshaped: bool = False) -> bool:
    """Whether the GEMM's epilogue can read `other` per output element, at the result's own
    index: floats, the output's own shape (or, `reshaped` on the way, as many elements: Hugging
    Face's Conv1D is a 2-D addmm viewed back as 3-D), result stored in row-major order, no
    activation applied yet."""
    if not _floats(graph, (other, gemm.outputs[0], out)):
        return False
    same = (shape_of(graph, gemm.outputs[0]) == shape_of(graph, out) if not reshaped
            else size_of(graph, gemm.outputs[0]) == size_of(graph, out))
    return (gemm.attr("_epilogue") is None and gemm.attr("_permY") is None and other != gemm.outputs[0]
            and shape_of(graph, other) == shape_of(graph, out) and same)


def _residual_fits(graph: Graph, gemm: Node, other: str, out: str, reshaped: bool = False) -> bool:
    """A residual the GEMM can add per output element (x + Linear(h), a transformer block's skip
    connection; a ResNet block's input gradient), before any activation (the graph's order of adds)."""
    return not gemm.attr("_residual") and _read_at_own_index(graph, gemm, other, out, reshaped)


def _put(gemm: Node, role: str, value: str) -> None:
    """`value` as the GEMM's epilogue input `role` (kernels_gemm.EPILOGUE_INPUTS)."""
    slot = EPILOGUE_INPUTS[role]
    gemm.inputs[len(gemm.inputs):slot + 1] = [""] * max(0, slot + 1 - len(gemm.inputs))
    gemm.inputs[slot] = value


# Convolutions whose result may take an activation gradient (EPILOGUE_GRADS) in its store: the
# input gradient, where ReLU's gradient sits between it and a BatchNorm's (ResNet-50: 32 ReluGrad
# kernels, 0.6 ms of an H200 step). 2-D only: the N-D kernels take no epilogue.
GRAD_EPILOGUE_CONVS = frozenset({"ConvGradInput"})

def _grad_conv(p: Node, supports_epilogue: set[str]) -> bool:
    return p.op in GRAD_EPILOGUE_CONVS & supports_epilogue and len(p.attr("input_shape") or ()) == 4


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
    ... see EPILOGUE_ACTIVATIONS), Conv -> Relu, and an activation's gradient into the GEMM or
    convolution input gradient (GRAD_EPILOGUE_CONVS) that computes its dy. The fused GEMM takes the place of the last node
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
                if p is None or not (p.op in GEMM_OPS & supports_epilogue or _grad_conv(p, supports_epilogue)):
                    continue
                if (via is None and p.op in GEMM_OPS and not has_bias(p) and not p.attr("_residual")
                        and p.attr("_epilogue") is None and _bias_fits(graph, p, other, n.outputs[0])):
                    _round_output(graph, p)
                    _put(p, "bias", other)
                    if p.op == "Gemm":
                        p.attrs["beta"] = 1.0
                elif _residual_fits(graph, p, other, n.outputs[0], reshaped=via is not None) and residual_enabled():
                    _round_output(graph, p)
                    _put(p, "residual", other)
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
            _put(p, "where", n.inputs[0])
            p.attrs["_where"] = (fill, slot == 2)  # the fill is Where's true branch when the GEMM is the false one
        elif n.op in EPILOGUE_GRADS and len(n.inputs) == 2 and grad_epilogue_enabled():
            # dy's GEMM applies the gradient, reading x at its own index as it reads a residual
            # (through the reshape back to 3-D after a 2-D Gemm, which the fused GEMM replaces),
            # after the residual it may have taken (a ResNet block's input gradient: two paths' sum)
            (p, via), x = gemm_behind(n.inputs[0]), n.inputs[1]
            if (p is None or not (p.op in GEMM_OPS & supports_epilogue or _grad_conv(p, supports_epilogue))
                    or has_bias(p) or x == n.inputs[0]
                    or not _read_at_own_index(graph, p, x, n.outputs[0], reshaped=via is not None)):
                continue
            _round_output(graph, p)
            _put(p, "activation_x", x)
            p.attrs.update(_epilogue=n.op, _epilogue_attrs=dict(n.attrs), _epilogue_arg=True)
            if via is not None:
                absorbed.add(id(via))
        else:
            if len(n.inputs) != 1:
                continue
            p = sole_input(n.inputs[0])
            if (p is None or p.op not in supports_epilogue or p.attr("_epilogue") is not None
                    or (p.op in GRAD_EPILOGUE_CONVS and not _grad_conv(p, supports_epilogue))):
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


def prologue_enabled() -> bool:
    """ANYGRAD_WGPU_PROLOGUE=0: an activation read only by GEMMs stays a kernel of its own."""
    return settings.get("ANYGRAD_WGPU_PROLOGUE") != "0"


def _on_matrix_units(gemm: Node, graph: Graph, caps: AdapterCaps) -> bool:
    """Whether the adapter has matrix units for this GEMM's operand type. Their kernels ran 2-3.6x
    slower with a prologue in their loads: GPT-2 small f16 on Dawn (H200, 2026-12-04, tuned), the
    second Linear's forward 0.19 ms against the first's 0.11 at the same FLOPs, its weight
    gradient 0.33 ms against its mirror's 0.09; the activation's own kernel writes and rereads 12 MB
    in a few microseconds. So there the activation stays a kernel (ANYGRAD_WGPU_PROLOGUE=1: fused
    anyway). Small GEMMs that the rules leave on ALUs lose their prologue too: their activations
    are small."""
    units = matrix_units.units_of(caps)
    operand = operand_type(gemm, graph)
    return units is not None and operand is not None and bool(matrix_units.usable_configs(units, operand))


def fuse_prologues(graph: Graph, protected: set[str], caps: AdapterCaps | None = None) -> None:
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
    spare_units = settings.get("ANYGRAD_WGPU_PROLOGUE") == "auto" and caps is not None

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
                    node.attr(PROLOGUE_ATTRS[slot]) is None and not (spare_units and _on_matrix_units(node, graph, caps)):
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
