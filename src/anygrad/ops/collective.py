"""AllReduceSum: a sum over the data-parallel replicas inside the compiled step, and the SyncBatchNorm
rewrite built on it.

A backend runs the op with the reducer the run was given (backends.base.Exchange.reduce, which
a data-parallel strategy passes to each replica's run; `reduce_forward`): every replica runs the
same program, so the k-th AllReduceSum of each meets the others' k-th. Without one (one device, no
process group) it is the identity: the sum over one replica.

Modes (attribute `mode`):
- "sum": the sum of x over every replica (forward statistics);
- "weighted": sum over replicas r of n_r * x_r, divided by this replica's n (its samples): the
  gradient of "sum". Each replica's gradient is later weighted by its share n_r / N of the batch,
  so the gradient flowing into replica r' through a shared sum must be sum_r (n_r / n_r') dL_r/dS;
  with equal shares that is SyncBatchNorm's all-reduce of the backward sums;
- "count": x * N / n (a local count scaled to the whole batch's; no communication).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..ir.builder import Builder, GradContext
from ..ir.graph import Graph, Node, TensorInfo
from ..ir.infer import infer_node
from ..ir.registry import defop

Reducer = Callable[[np.ndarray, str], np.ndarray]
OP = "AllReduceSum"


def reduce_forward(reduce: Reducer | None, node: Node, ins: list[np.ndarray | None]) -> list[np.ndarray]:
    """AllReduceSum of ins[0] through `reduce` (a run's Exchange.reduce; None: the identity)."""
    x = np.asarray(ins[0])
    if reduce is None:
        return [x.copy()]
    return [np.asarray(reduce(x, str(node.attr("mode", "sum"))), dtype=x.dtype).reshape(x.shape)]


def _infer(node: Node, ins: list[TensorInfo | None]) -> list[TensorInfo]:
    return [TensorInfo(ins[0].dtype, ins[0].shape)]


def _forward(node: Node, ins: list[np.ndarray | None]) -> list[np.ndarray]:
    return reduce_forward(None, node, ins)  # the reference: one replica (backends pass a run's reducer)


def _grad(g: GradContext) -> list[str | None]:
    if g.node.attr("mode", "sum") != "sum":
        return [None]  # "weighted" is itself a gradient; "count" is a constant
    return [g.op("AllReduceSum", [g.dy], mode="weighted")]


defop(OP, infer=_infer, forward=_forward, grad=_grad, foldable=False, internal=True)


# -- SyncBatchNorm ------------------------------------------------------------------------------------
def sync_batch_norms(g: Graph) -> int:
    """Rewrite every training-mode BatchNormalization of `g` (a specialized training forward) into
    batch statistics over all replicas, as torch.nn.SyncBatchNorm: per-channel sums, AllReduceSum,
    the mean; centred sums of squares, AllReduceSum, the biased variance for the normalisation and
    the unbiased one (whole-batch count) for the running variance. The backward is autodiff's, so
    the gradient sums are all-reduced too ("weighted" mode). Returns how many were rewritten."""
    old, g.nodes = g.nodes, []
    b = Builder(g, prefix="syncbn")
    done = 0
    for node in old:
        if node.op != "BatchNormalization" or not node.attr("training_mode", 0):
            g.nodes.append(node)
            continue
        _sync_one(g, b, node)
        done += 1
    return done


def _emit(g: Graph, op: str, inputs: list[str], output: str, **attrs) -> str:
    """A node writing the original node's output name (state updates and consumers keep it)."""
    node = Node(op, inputs, [output], attrs, name=g.fresh(f"syncbn.{op}"))
    g.nodes.append(node)
    infer_node(g, node)
    return output


def _sync_one(g: Graph, b: Builder, node: Node) -> None:
    x, scale, bias, mean, var = node.inputs[:5]
    shape = b.shape(x)
    c = shape[1]
    dtype = b.dtype(x)
    eps = float(node.attr("epsilon", 1e-5))
    momentum = float(node.attr("momentum", 0.9))
    axes = b.const(np.array([0] + list(range(2, len(shape))), np.int64), np.int64, "axes")
    per_channel = (1, c) + (1,) * (len(shape) - 2)
    count = b.op("AllReduceSum", [b.const(np.full((), float(np.prod(shape)) / c, dtype))], mode="count")
    total = b.op("AllReduceSum", [b.op("ReduceSum", [x, axes], keepdims=1)], mode="sum")
    batch_mean = b.op("Div", [total, count])
    centred = b.op("Sub", [x, batch_mean])
    squares = b.op("AllReduceSum", [b.op("ReduceSum", [b.op("Mul", [centred, centred]), axes], keepdims=1)],
                   mode="sum")
    batch_var = b.op("Div", [squares, count])
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [batch_var, b.const(eps, dtype)])])])
    a = b.op("Mul", [inv, b.reshape(scale, per_channel)])
    _emit(g, "Add", [b.op("Mul", [centred, a]), b.reshape(bias, per_channel)], node.outputs[0])
    outs = node.outputs[1:3]
    if len(outs) >= 1 and outs[0]:  # running statistics, PyTorch's rule (unbiased variance)
        keep, take = b.const(momentum, dtype), b.const(1.0 - momentum, dtype)
        flat_mean = b.reshape(batch_mean, (c,))
        _emit(g, "Add", [b.op("Mul", [mean, keep]), b.op("Mul", [flat_mean, take])], outs[0])
        if len(outs) >= 2 and outs[1]:
            unbiased = b.op("Div", [b.op("Mul", [b.reshape(batch_var, (c,)), count]),
                                    b.op("Sub", [count, b.const(1.0, dtype)])])
            _emit(g, "Add", [b.op("Mul", [var, keep]), b.op("Mul", [unbiased, take])], outs[1])
