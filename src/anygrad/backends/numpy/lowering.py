"""The numpy backend's lowering registry: what it runs differently from an op's registry kernel.

- `KERNELS`: faster kernels of the same values as the op's registry kernel (conv.py: im2col
  convolutions; fastpaths.py).
- `INPLACE`: kernels that write output 0 over input 0 (same shape and dtype, checked at compile
  time) and return the op's outputs. Each computes exactly what the op's registry kernel computes.
- `BLOCKED`: ops whose numpy kernel can write output 0 (batch-major) in batch blocks and call an
  epilogue(batch slice, block) on each block once it is final, while it is still in cache; the
  epilogue changes the block in place. The executable runs an elementwise consumer of output 0
  this way (a Relu after a Conv...), saving a pass over memory. These kernels take the epilogue as
  an `epilogue=` keyword of the op's `forward`; it is the numpy backend's convention, not part of
  the op contract (`OpDef`), which other backends read.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import _parallel
from ...ir.graph import Node
from ...ops.linalg import gemm
from .conv import conv_grad_input_node, conv_grad_weight_node, conv_node
from .fastpaths import batch_norm, batch_norm_grad, maximum0

InplaceKernel = Callable[[Node, list[np.ndarray]], list[np.ndarray]]
Epilogue = Callable[[slice, np.ndarray], None]


def _relu_(node: Node, ins: list[np.ndarray]) -> list[np.ndarray]:
    return [maximum0(ins[0], out=ins[0])]


def _relu(node: Node, ins: list[np.ndarray]) -> list[np.ndarray]:
    return [maximum0(ins[0])]


def _listed(kernel) -> InplaceKernel:
    return lambda node, ins: [np.asarray(o) for o in kernel(node, ins)]


def _one(kernel) -> InplaceKernel:
    """A kernel of one output array as a kernel of the output list."""
    return lambda node, ins: [kernel(node, ins)]


def _matmul(node: Node, ins: list[np.ndarray]) -> np.ndarray:
    # the product cut into row blocks on every worker
    return _parallel.matmul(ins[0], ins[1]).astype(ins[0].dtype, copy=False)


KERNELS: dict[str, InplaceKernel] = {"Relu": _relu, "BatchNormalization": _listed(batch_norm),
                                     "BatchNormGrad": _listed(batch_norm_grad),
                                     "Conv": _one(conv_node), "ConvGradInput": _one(conv_grad_input_node),
                                     "ConvGradWeight": _one(conv_grad_weight_node), "MatMul": _one(_matmul),
                                     "Gemm": _one(lambda n, ins: gemm(n, ins, _parallel.matmul))}


def _relu_grad_(node: Node, ins: list[np.ndarray]) -> list[np.ndarray]:
    dy, y = ins
    return [np.multiply(dy, y > 0, out=dy)]


def _binary_(ufunc) -> InplaceKernel:
    return lambda node, ins: [ufunc(ins[0], ins[1], out=ins[0])]


INPLACE: dict[str, InplaceKernel] = {
    "Relu": _relu_,
    "ReluGrad": _relu_grad_,
    "Add": _binary_(np.add),
    "Sub": _binary_(np.subtract),
    "Mul": _binary_(np.multiply),
}

# Ops whose kernel accepts `epilogue=`: the im2col Conv and its input gradient (conv.py),
# BatchNormalization and its gradient over batch slices (fastpaths.py).
_BLOCKED_KERNELS = {"Conv": conv_node, "ConvGradInput": conv_grad_input_node,
                    "BatchNormalization": batch_norm, "BatchNormGrad": batch_norm_grad}
BLOCKED: frozenset[str] = frozenset(_BLOCKED_KERNELS)


def run_blocked(node: Node, ins: list[np.ndarray | None], epilogue: Epilogue) -> list[np.ndarray]:
    """A BLOCKED op's outputs as a list of arrays, epilogue applied to each block of output 0."""
    out = _BLOCKED_KERNELS[node.op](node, ins, epilogue=epilogue)
    if isinstance(out, (list, tuple)):
        return [np.asarray(o) for o in out]
    return [np.asarray(out)]


def run_split(kernel: InplaceKernel, node: Node, ins: list[np.ndarray]) -> list[np.ndarray]:
    """An in-place kernel over equal-shape contiguous inputs, one flat slice per worker (when
    big: `_parallel.SPLIT_MIN`)."""
    first = ins[0]
    if (first.size < _parallel.SPLIT_MIN or any(a.shape != first.shape for a in ins)
            or not all(a.flags.c_contiguous for a in ins) or (threads := _parallel.workers()) < 2):
        return kernel(node, ins)
    flat = [a.reshape(-1) for a in ins]
    parts = _parallel.ranges(first.size, threads)
    _parallel.map_shares(lambda share: [kernel(node, [a[s] for a in flat]) for s in share], parts, threads,
                         blas=False)
    return [first]
