"""ONNX optional-value ops over plain tensors. anygrad has no optional type: a present tensor is
an optional holding it, and an absent input ("") an empty one."""
from __future__ import annotations

import numpy as np

from ..ir.graph import TensorInfo
from ..ir.registry import defop
from ._util import same_as_first


def _has_element(node, ins: list) -> list[TensorInfo]:
    present = bool(ins) and ins[0] is not None
    return [TensorInfo(np.dtype(np.bool_), (), np.array(present))]


defop("OptionalHasElement", infer=_has_element, nondiff=[0],
      forward=lambda node, ins: np.array(bool(ins) and ins[0] is not None))
defop("OptionalGetElement", infer=same_as_first, forward=lambda node, ins: ins[0].copy(),
      grad=lambda g: [g.dy])
