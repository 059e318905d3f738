"""MatMul (batched, broadcasting) and Gemm."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

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


def _permute(g: GradContext, x: str, perm: list[int]) -> str:
    """Transpose x by perm; a Reshape (no data movement) when only size-1 axes move."""
    shape = g.shape(x)
    if [p for p in perm if shape[p] != 1] == [i for i in range(len(shape)) if shape[i] != 1]:
        return g.reshape(x, tuple(shape[p] for p in perm))
    return g.op("Transpose", [x], perm=perm)


def _prod(dims) -> int:
    return int(np.prod(dims, dtype=np.int64))


def _batched_product(g: GradContext, left: str, right: str, trans_left: bool, trans_right: bool) -> str:
    """left^T? @ right^T? over matching (or broadcast) batch dims: one Gemm with transA/transB when
    the right one is a single matrix (the left's batch joins its rows), else a MatMul whose operand transposes the wgpu backend folds into
    its loads (a Transpose of the last two axes)."""
    sl, sr = g.shape(left), g.shape(right)
    if _prod(sr[:-2]) == 1 and (_prod(sl[:-2]) == 1 or not trans_left):
        # one right matrix: the left operand's batch folds into its rows (dx = dy @ W^T of a Linear)
        rows = _prod(sl[:-1]) if not trans_left else sl[-2]
        y = g.op("Gemm", [g.reshape(left, (rows, sl[-1]) if not trans_left else sl[-2:]),
                          g.reshape(right, sr[-2:])], transA=int(trans_left), transB=int(trans_right))
        return g.reshape(y, sl[:-1] + g.shape(y)[-1:]) if not trans_left else y
    return g.op("MatMul", [_swap_last(g, left) if trans_left else left,
                           _swap_last(g, right) if trans_right else right])


def _weight_grad(g: GradContext, x: str, dy: str, own: tuple, other: str, left: bool) -> str:
    """Gradient of the MatMul operand with (padded) batch dims `own`, `other` being the other
    (rank-padded) operand and dy the output gradient, all of rank L + 2 with batch dims `out`.

    Where the operand is broadcast over some batch dims ("reduced" dims), those dims join the GEMM's
    reduction (K = reduced x rows) instead of a per-batch product summed afterwards: the gradient
    of a weight shared across (batch, tokens) is one (d_in, B*T) @ (B*T, d_out) GEMM and no
    (B, d_in, d_out) tensor ever exists. Kept batch dims go first (a Transpose only when a reduced
    dim precedes a kept one), so the reduced dims and the matrix rows are contiguous."""
    out = g.shape(dy)[:-2]
    L = len(out)
    red = [i for i in range(L) if own[i] == 1 and out[i] != 1]
    kept = [i for i in range(L) if i not in red]
    R = _prod([out[i] for i in red])
    s_other = g.shape(other)
    if left:
        # dA[kept, m, k] = sum_{red, n} dy[kept, red, m, n] * B[kept, red, k, n]
        dy_r = g.reshape(_permute(g, dy, kept + [L] + red + [L + 1]),
                         tuple(out[i] for i in kept) + (g.shape(dy)[-2], R * g.shape(dy)[-1]))
        b_r = g.reshape(_permute(g, other, kept + [L] + red + [L + 1]),
                        tuple(s_other[i] for i in kept) + (s_other[-2], R * s_other[-1]))
        grad = _batched_product(g, dy_r, b_r, False, True)
    else:
        # dB[kept, k, n] = sum_{red, m} A[kept, red, m, k] * dy[kept, red, m, n]
        a_r = g.reshape(_permute(g, other, kept + red + [L, L + 1]),
                        tuple(s_other[i] for i in kept) + (R * s_other[-2], s_other[-1]))
        dy_r = g.reshape(_permute(g, dy, kept + red + [L, L + 1]),
                         tuple(out[i] for i in kept) + (R * g.shape(dy)[-2], g.shape(dy)[-1]))
        grad = _batched_product(g, a_r, dy_r, True, False)
    # kept dims are in their original order and the reduced ones have size 1 in `own`
    return g.reshape(grad, tuple(own) + g.shape(x)[-2:])


def _matmul_grad(g: GradContext):
    a, b = g.x
    sa, sb = g.shape(a), g.shape(b)
    if not all(isinstance(d, int) for d in sa + sb):
        raise ShapeError(f"{g.node.label}: the MatMul gradient needs static shapes; specialize the graph first")
    # Promote 1-D operands to matrices and pad both to the output's batch rank, so one rule covers
    # every case (reshapes only: no data moves).
    a2 = (1,) + sa if len(sa) == 1 else sa
    b2 = sb + (1,) if len(sb) == 1 else sb
    out_batch = broadcast_shape(a2[:-2], b2[:-2])
    L = len(out_batch)
    pa = (1,) * (L - len(a2) + 2) + a2[:-2]
    pb = (1,) * (L - len(b2) + 2) + b2[:-2]
    ap = g.reshape(a, pa + a2[-2:])
    bp = g.reshape(b, pb + b2[-2:])
    dy = g.reshape(g.dy, out_batch + (a2[-2], b2[-1]))
    da = db = None
    if g.need(0):
        da = g.reshape(_weight_grad(g, ap, dy, pa, bp, left=True), sa)
    if g.need(1):
        db = g.reshape(_weight_grad(g, bp, dy, pb, ap, left=False), sb)
    return [da, db]


defop("MatMul", infer=_matmul_infer, grad=_matmul_grad,
      forward=lambda node, ins: np.matmul(ins[0], ins[1]).astype(ins[0].dtype, copy=False))


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


def gemm(node: Node, ins, matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul) -> np.ndarray:
    """Gemm's values with `matmul` for the product (the numpy backend passes its threaded one)."""
    a, b = ins[0], ins[1]
    a = a.T if node.attr("transA", 0) else a
    b = b.T if node.attr("transB", 0) else b
    ab = matmul(a, b)
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


defop("Gemm", infer=_gemm_infer, forward=gemm, grad=_gemm_grad)
