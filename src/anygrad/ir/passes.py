"""Graph passes: specialization to a batch shape, shape inference, constant folding, DCE, and
attribute resolution (every node's attributes made explicit for the backends)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ShapeError, UnsupportedOpError
from .builder import Builder
from .constfold import fold_constant_subgraphs
from .graph import Graph, Node, Shape, TensorInfo, info_of
from .infer import infer_node
from .registry import get_op


def unsupported_ops(graph: Graph) -> dict[str, list[str]]:
    """Op type -> names of the nodes that use it, for every op without a registry entry."""
    missing: dict[str, list[str]] = {}
    for n in graph.nodes:
        if get_op(n.op) is None:
            missing.setdefault(n.op, []).append(n.name or n.outputs[0])
    return missing


def check_supported(graph: Graph, source: str = "the model") -> None:
    missing = unsupported_ops(graph)
    if missing:
        listing = "; ".join(f"{op} ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
                            for op, names in sorted(missing.items()))
        raise UnsupportedOpError(
            f"{source} uses {len(missing)} op type(s) anygrad does not support: {listing}. "
            "Rewrite those layers, or open an issue naming the ops.")


def infer_shapes(graph: Graph) -> None:
    """(Re)infer every value's shape. Parameters and state are never treated as constants."""
    variable = set(graph.state_names) | set(graph.state_updates.values())
    for name, array in graph.initializers.items():
        inf = info_of(array)
        if name in variable:
            inf.const = None
        graph.info[name] = inf
    graph.toposort()
    for node in graph.nodes:
        infer_node(graph, node)


def specialize(graph: Graph, input_shapes: Mapping[str, Shape]) -> Graph:
    """A copy with input shapes bound (symbolic dims replaced), shapes inferred, constants folded."""
    g = graph.copy()
    for name, shape in input_shapes.items():
        if name not in g.info:
            raise ShapeError(f"the model has no input named '{name}' (inputs: {g.inputs})")
        declared = g.info[name].shape
        shape = tuple(int(d) for d in shape)
        if declared is None:  # declared without a shape: it takes the shape it is fed
            declared = shape
        if len(declared) != len(shape) or any(isinstance(d, int) and d != s for d, s in zip(declared, shape)):
            raise ShapeError(f"input '{name}' expects shape {tuple(declared)}, got {shape}")
        g.info[name] = TensorInfo(g.info[name].dtype, shape)
    infer_shapes(g)
    expand_composites(g)
    fold_constant_subgraphs(g)  # CastLike(const, x) and what it feeds: constant once shapes are known
    fold_constants(g)
    resolve_attributes(g)
    return g


def resolve_attributes(graph: Graph) -> Graph:
    """Make every node's attributes explicit with its op's `resolve` rule (OpDef.resolve): pads
    instead of auto_pad, non-negative sorted axes, defaults filled in, constant inputs (axes,
    pads, starts, split sizes, ratios, scales) copied into attributes. Backends read only
    `node.attrs` and the shapes; they never re-derive what an ONNX attribute means.

    Runs at the end of `specialize` and again on a whole step graph before a backend lowers it
    (autodiff, losses and optimizers add nodes after specialisation). Idempotent; a node whose
    resolution needs an input only known when the step runs keeps its attributes (the numpy
    reference runs it; a backend that needs the value says so by name).
    """
    for node in graph.nodes:
        op = get_op(node.op)
        if op is None or op.resolve is None:
            continue
        ins = [graph.info.get(i) if i else None for i in node.inputs]
        if any(name and inf is None for name, inf in zip(node.inputs, ins)):
            continue  # not inferred (a graph under construction): nothing to resolve against
        node.attrs = op.resolve(node, ins)  # type: ignore[arg-type]
    return graph


def resolved(node: Node, key: str) -> Any:
    """A resolved attribute a backend needs; absent when resolution needed an input the compiled
    step does not know (a ShapeError naming the node), or when the graph skipped `resolve_attributes`."""
    value = node.attrs.get(key)
    if value is None:
        raise ShapeError(f"{node.label}: attribute '{key}' is not known when the model is compiled "
                         "(its input must be a constant)")
    return value.decode() if isinstance(value, bytes) else value


def expand_composites(graph: Graph) -> None:
    """Replace composite nodes (ops with an `expand` rule) by the primitive ops they stand for.

    Needs static shapes (run after `infer_shapes`). The expansion's results take the composite
    node's output names, so nothing downstream changes.
    """
    if not any(getattr(get_op(n.op), "expand", None) for n in graph.nodes):
        return
    nodes, graph.nodes = graph.nodes, []
    for node in nodes:
        op = get_op(node.op)
        if op is None or op.expand is None:
            graph.nodes.append(node)
            continue
        start = len(graph.nodes)
        results = op.expand(Builder(graph, prefix=node.name or node.op), node)
        produced = {o for n in graph.nodes[start:] for o in n.outputs}
        renamed: dict[str, str] = {}
        for result, wanted in zip(results, node.outputs):
            if not wanted:
                continue
            result = renamed.get(result, result)
            if result in produced:  # rename the producing node's output in place
                rename = {result: wanted}
                for n in graph.nodes[start:]:
                    n.outputs = [rename.get(o, o) for o in n.outputs]
                    n.inputs = [rename.get(i, i) for i in n.inputs]
                graph.info[wanted] = graph.info.pop(result)
                renamed[result] = wanted
            else:  # an input or constant passed straight through
                graph.nodes.append(Node("Identity", [result], [wanted], {}, name=f"{node.name}.out"))
                infer_node(graph, graph.nodes[-1])


def fold_constants(graph: Graph) -> None:
    """Replace nodes whose outputs are all known constants by initializers, then drop dead code."""
    kept = []
    for n in graph.nodes:
        infos = [graph.info.get(o) for o in n.outputs if o]
        if infos and all(i is not None and i.const is not None for i in infos):
            for o in n.outputs:
                if o:
                    graph.initializers[o] = graph.info[o].const  # type: ignore[assignment]
        else:
            kept.append(n)
    graph.nodes = kept
    graph.dce()


# The training step's random-number state: uint32 [seed, counter]. Ops that draw random numbers
# (Dropout) take it as an extra input; the counter advances once per training step.
RNG_STATE = "anygrad.rng"


def set_training_mode(graph: Graph, training: bool) -> Graph:
    """A copy of the graph rewritten for training or for inference (ops with a `set_mode`)."""
    g = graph.copy()
    for node in list(g.nodes):
        op = get_op(node.op)
        if op is not None and op.set_mode is not None:
            op.set_mode(g, node, training)
    return g
