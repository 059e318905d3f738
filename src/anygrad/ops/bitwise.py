"""Bitwise ops on integer tensors: BitShift, BitwiseAnd/Or/Xor/Not. Not differentiable."""
from __future__ import annotations

import numpy as np

from ..errors import UnsupportedOpError
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._util import broadcast_infer, onnx_dtype, same_as_first

BINARY = {"BitwiseAnd": np.bitwise_and, "BitwiseOr": np.bitwise_or, "BitwiseXor": np.bitwise_xor}

for _name, _fn in BINARY.items():
    defop(_name, infer=broadcast_infer, nondiff=[0, 1],
          forward=lambda node, ins, f=_fn: np.asarray(f(ins[0], ins[1])).astype(ins[0].dtype, copy=False))

defop("BitwiseNot", infer=same_as_first, nondiff=[0], forward=lambda node, ins: np.invert(ins[0]))

SHIFTS = {"LEFT": np.left_shift, "RIGHT": np.right_shift}


def _bit_shift(node: Node, ins: list) -> np.ndarray:
    direction = node.attr("direction")
    if direction not in SHIFTS:
        raise UnsupportedOpError(f"{node.label}: direction must be LEFT or RIGHT, not {direction!r}")
    x, n = ins
    return np.asarray(SHIFTS[direction](x, n.astype(x.dtype, copy=False))).astype(x.dtype, copy=False)


defop("BitShift", infer=broadcast_infer, nondiff=[0, 1], forward=_bit_shift)


# -- BitCast: reinterpret the bits as another type of the same width --------------------------
def _bitcast_dtype(node: Node, dtype) -> np.dtype:
    to = onnx_dtype(node.attr("to"), node)
    if to.itemsize != np.dtype(dtype).itemsize:
        raise UnsupportedOpError(f"{node.label}: BitCast needs types of one width, not {np.dtype(dtype)} -> {to}")
    return to


defop("BitCast", nondiff=[0], forward=lambda node, ins: ins[0].view(_bitcast_dtype(node, ins[0].dtype)),
      infer=lambda node, ins: [TensorInfo(_bitcast_dtype(node, ins[0].dtype), tuple(ins[0].shape))])
