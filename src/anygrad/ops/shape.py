"""Ops that move data without arithmetic: Reshape, Transpose, ..."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import const_ints


def reshape_target(node: Node, in_shape: tuple, spec: list[int]) -> tuple[int, ...]:
    """ONNX Reshape: 0 copies the input dim (unless allowzero), -1 is inferred."""
    allowzero = node.attr("allowzero", 0)
    out = [in_shape[i] if (d == 0 and not allowzero) else d for i, d in enumerate(spec)]
    if out.count(-1) > 1:
        raise ShapeError(f"{node.label}: more than one -1 in target shape {spec}")
    total = int(np.prod(in_shape, dtype=np.int64))
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1], dtype=np.int64))
        if known == 0 or total % known:
            raise ShapeError(f"{node.label}: cannot reshape {tuple(in_shape)} to {spec}")
        out[out.index(-1)] = total // known
    if int(np.prod(out, dtype=np.int64)) != total:
        raise ShapeError(f"{node.label}: cannot reshape {tuple(in_shape)} ({total} elements) to {spec}")
    return tuple(int(d) for d in out)


def _reshape_infer(node, ins):
    return [TensorInfo(ins[0].dtype, reshape_target(node, ins[0].shape, const_ints(ins[1], "shape", node)))]


def _reshape_forward(node, ins):
    return ins[0].reshape(reshape_target(node, ins[0].shape, [int(v) for v in ins[1]]))


def _grad_to_input_shape(g: GradContext):
    return [g.reshape(g.dy, g.shape(g.x[0]))] + [None] * (len(g.x) - 1)


defop("Reshape", infer=_reshape_infer, forward=_reshape_forward, grad=_grad_to_input_shape, nondiff=[1])


def _perm(node: Node, rank: int) -> list[int]:
    perm = node.attr("perm")
    return list(perm) if perm is not None else list(range(rank))[::-1]


def _transpose_infer(node, ins):
    perm = _perm(node, ins[0].rank)
    return [TensorInfo(ins[0].dtype, tuple(ins[0].shape[p] for p in perm))]


def _transpose_grad(g: GradContext):
    perm = _perm(g.node, len(g.shape(g.x[0])))
    return [g.op("Transpose", [g.dy], perm=[int(i) for i in np.argsort(perm)])]


defop("Transpose", infer=_transpose_infer, grad=_transpose_grad,
      forward=lambda node, ins: np.ascontiguousarray(np.transpose(ins[0], _perm(node, ins[0].ndim))))


def _expand_infer(node, ins):
    from ._util import broadcast_shape
    return [TensorInfo(ins[0].dtype, broadcast_shape(ins[0].shape, tuple(const_ints(ins[1], "shape", node))))]


defop("Expand", infer=_expand_infer, nondiff=[1],
      forward=lambda node, ins: np.ascontiguousarray(
          np.broadcast_to(ins[0], np.broadcast_shapes(ins[0].shape, tuple(int(v) for v in ins[1])))),
      grad=lambda g: [g.unbroadcast(g.dy, g.shape(g.x[0])), None])
