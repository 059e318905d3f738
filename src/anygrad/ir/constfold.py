"""Constant folding through ops that read only the dtype or shape of some inputs.

Shape inference (`passes.infer_node`) folds a node when all its inputs are constants. Exporters
also emit nodes that read a *variable* input for its dtype or shape only: PyTorch's ReLU6 and
Hardtanh export `Clip(x, CastLike(min_val, x), CastLike(max_val, x))`, and a bias-free Conv gets
`Expand(CastLike(0, x), [C])` as its bias. Those subgraphs are constant once shapes are static, yet
without this pass every training step recomputes them (MobileNetV2: 122 CastLike and 52 Expand
nodes). This pass evaluates them with the ops' numpy reference kernels; what they feed, if all
its other inputs are constant too, folds in the same sweep.

Never folded: anything whose value depends on a graph input, a trainable parameter or a buffer
(state), ops marked not foldable (random, metrics), and results larger than the fold limit.
"""
from __future__ import annotations

import numpy as np

from .graph import Graph, info_of
from .registry import get_op

# Inputs whose *value* the op never reads, only dtype and shape: (op type) -> input slots.
METADATA_INPUTS: dict[str, frozenset[int]] = {
    "CastLike": frozenset({1}),
    "EyeLike": frozenset({0}),
    "Shape": frozenset({0}),
    "Size": frozenset({0}),
}
FOLD_LIMIT = 1 << 20  # elements: a folded constant is uploaded and held; shape-sized data is tiny


def _placeholder(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """An array of the right dtype and shape that costs no memory (all strides 0)."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def fold_constant_subgraphs(graph: Graph) -> int:
    """Give every node computable from constants alone (dtype/shape-only inputs allowed) a constant
    value in graph.info; `passes.fold_constants` then turns them into initializers. Needs inferred
    static shapes and topological order (run after `infer_shapes`). Returns the nodes folded."""
    variable = set(graph.state_names) | set(graph.state_updates.values()) | set(graph.inputs)
    folded = 0
    for node in graph.nodes:
        op = get_op(node.op)
        if op is None or not op.foldable:
            continue
        outs = [graph.info.get(o) for o in node.outputs if o]
        if (not outs or any(o is None or not o.is_static for o in outs)
                or all(o.const is not None for o in outs)
                or any(o in variable for o in node.outputs)
                or sum(o.size for o in outs) > FOLD_LIMIT):
            continue
        meta = METADATA_INPUTS.get(node.op, frozenset())
        args: list[np.ndarray | None] = []
        has_value = True
        reads_value = False
        for k, name in enumerate(node.inputs):
            inf = graph.info.get(name) if name else None
            if not name:
                args.append(None)
            elif inf is None:
                has_value = False
            elif k in meta:
                if not inf.is_static:
                    has_value = False
                else:
                    args.append(_placeholder(np.dtype(inf.dtype), tuple(inf.shape)))
            elif inf.const is None or name in variable:
                has_value = False
            else:
                args.append(inf.const)
                reads_value = True
            if not has_value:
                break
        if not has_value or not reads_value:
            continue
        try:
            values = op.run(node, args)
        except Exception:  # noqa: BLE001, S112  (the reference kernel refuses: the node stays a kernel)
            continue
        new = [info_of(np.array(v)) for v in values]  # a copy: never a view of a placeholder
        named = [o for o in node.outputs if o]
        if len(new) < len(node.outputs) or any(
                tuple(graph.info[o].shape) != tuple(n.shape) or np.dtype(graph.info[o].dtype) != n.dtype
                for o, n in zip(node.outputs, new) if o):
            continue  # the kernel disagrees with the shape rule: do not guess
        for o, n in zip(node.outputs, new):
            if o:
                graph.info[o] = n
        folded += bool(named)
    return folded
