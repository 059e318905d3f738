"""MatMul (batched, broadcasting) and Gemm."""
from __future__ import annotations

import numpy as np

from .. import _parallel
from ..errors import ShapeError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import broadcast_shape


def _matmul_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    a, b = (tuple(i.shape) for i in ins)
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ShapeError(f"{node.label}: inner dimensions differ ({a} @ {b})")
    out = broadcast_shape(a2[:-2], b2[:-2]) + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return [TensorInfo(ins[0].dtype, out)]


def _swap_last(g: GradContext, x: str) -> str:
    r = len(g.shape(x))
    return g.op("Transpose", [x], perm=list(range(r - 2)) + [r - 1, r - 2])


def _matmul_grad(g: GradContext):
    a, b = g.x
    sa, sb = g.shape(a), g.shape(b)
    # Promote 1-D operands to matrices so one rule covers every case.
    a2 = g.reshape(a, (1,) + sa) if len(sa) == 1 else a
    b2 = g.reshape(b, sb + (1,)) if len(sb) == 1 else b
    out2 = _matmul_infer(g.node, [g.info(a2), g.info(b2)])[0].shape
    dy = g.reshape(g.dy, out2)
    da = db = None
    if g.need(0):
        da = g.reshape(g.unbroadcast(g.op("MatMul", [dy, _swap_last(g, b2)]), g.shape(a2)), sa)
    if g.need(1):
        db = g.reshape(g.unbroadcast(g.op("MatMul", [_swap_last(g, a2), dy]), g.shape(b2)), sb)
    return [da, db]


defop("MatMul", infer=_matmul_infer, grad=_matmul_grad,
      forward=lambda node, ins: _parallel.matmul(ins[0], ins[1]).astype(ins[0].dtype, copy=False))


def _gemm_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    a, b = ins[0].shape, ins[1].shape
    if len(a) != 2 or len(b) != 2:
        raise ShapeError(f"{node.label}: Gemm takes 2-D inputs, got {tuple(a)} and {tuple(b)}")
    m, k = (a[1], a[0]) if node.attr("transA", 0) else (a[0], a[1])
    k2, n = (b[1], b[0]) if node.attr("transB", 0) else (b[0], b[1])
    if k != k2:
        raise ShapeError(f"{node.label}: inner dimensions differ ({tuple(a)}, {tuple(b)}, "
                         f"transA={node.attr('transA', 0)}, transB={node.attr('transB', 0)})")
    if len(ins) > 2 and ins[2] is not None:
        broadcast_shape(ins[2].shape, (m, n))
    return [TensorInfo(ins[0].dtype, (m, n))]


def _gemm_forward(node: Node, ins):
    a, b = ins[0], ins[1]
    a = a.T if node.attr("transA", 0) else a
    b = b.T if node.attr("transB", 0) else b
    ab = _parallel.matmul(a, b)
    y = np.float32(node.attr("alpha", 1.0)) * ab if node.attr("alpha", 1.0) != 1.0 else ab
    if len(ins) > 2 and ins[2] is not None:
        beta = node.attr("beta", 1.0)
        y = y + (ins[2] if beta == 1.0 else np.float32(beta) * ins[2])
    return y.astype(ins[0].dtype, copy=False)


def _gemm_grad(g: GradContext):
    ta, tb = g.node.attr("transA", 0), g.node.attr("transB", 0)
    alpha, beta = g.node.attr("alpha", 1.0), g.node.attr("beta", 1.0)
    a, b = g.x[0], g.x[1]
    da = db = dc = None
    if g.need(0):
        da = (g.op("Gemm", [g.dy, b], alpha=alpha, transB=1 - tb) if not ta
              else g.op("Gemm", [b, g.dy], alpha=alpha, transA=tb, transB=1))
    if g.need(1):
        db = (g.op("Gemm", [a, g.dy], alpha=alpha, transA=1 - ta) if not tb
              else g.op("Gemm", [g.dy, a], alpha=alpha, transA=1, transB=ta))
    if g.need(2) and g.node.input(2):
        dyc = g.dy if beta == 1.0 else g.op("Mul", [g.dy, g.const(beta, g.dtype(g.dy))])
        dc = g.unbroadcast(dyc, g.shape(g.x[2]))
    return [da, db, dc]


defop("Gemm", infer=_gemm_infer, forward=_gemm_forward, grad=_gemm_grad)
