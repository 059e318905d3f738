"""Shape-rule helpers the op families share."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..ir.graph import Node, Shape, TensorInfo


def broadcast_shape(*shapes: Shape) -> Shape:
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError as e:
        raise ShapeError(f"shapes {list(shapes)} do not broadcast") from e


def same_as_first(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    return [TensorInfo(ins[0].dtype, ins[0].shape)]


def broadcast_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    return [TensorInfo(ins[0].dtype, broadcast_shape(*[i.shape for i in ins if i is not None]))]


def const_ints(info: TensorInfo | None, what: str, node: Node) -> list[int] | None:
    """Integer values of an input that must be known at compile time (axes, shapes, pads)."""
    if info is None:
        return None
    if info.const is None:
        raise ShapeError(f"{node.label}: input '{what}' must be a constant (known when the model is compiled)")
    return [int(v) for v in np.asarray(info.const).reshape(-1)]


def axes_of(node: Node, ins: list, slot: int = 1) -> list[int] | None:
    """Axes from the attribute (older opsets) or from a constant input (newer opsets)."""
    if node.attr("axes") is not None:
        return list(node.attr("axes"))
    if len(ins) > slot and ins[slot] is not None:
        value = ins[slot]
        if isinstance(value, TensorInfo):
            return const_ints(value, "axes", node)
        return [int(v) for v in np.asarray(value).reshape(-1)]
    return None


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def dim_prod(dims) -> int | str:
    """Product of dims; symbolic when any dim is (before `specialize` binds the batch)."""
    if all(isinstance(d, int) for d in dims):
        return int(np.prod(dims, dtype=np.int64))
    return "*".join(str(d) for d in dims)


def ints_of(value, what: str, node: Node) -> list[int] | None:
    """Integer values of an input slot, from a TensorInfo (infer) or an array (forward)."""
    if value is None:
        return None
    if isinstance(value, TensorInfo):
        return const_ints(value, what, node)
    return [int(v) for v in np.asarray(value).reshape(-1)]


def shape_of(value) -> tuple:
    """The shape of an input slot, whether a TensorInfo (infer) or an array (forward)."""
    return tuple(value.shape)


def dtype_of(value) -> np.dtype:
    return np.dtype(value.dtype)


def slot(ins: list, i: int):
    """Input i, or None when the optional input is absent."""
    return ins[i] if i < len(ins) else None


# ONNX TensorProto.DataType codes; one table both ways (Cast, ConstantOfShape, importers).
ONNX_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.float32), 2: np.dtype(np.uint8), 3: np.dtype(np.int8), 4: np.dtype(np.uint16),
    5: np.dtype(np.int16), 6: np.dtype(np.int32), 7: np.dtype(np.int64), 9: np.dtype(np.bool_),
    10: np.dtype(np.float16), 11: np.dtype(np.float64), 12: np.dtype(np.uint32), 13: np.dtype(np.uint64),
}
ONNX_CODES: dict[np.dtype, int] = {v: k for k, v in ONNX_DTYPES.items()}


def onnx_dtype(code: int, node: Node | None = None) -> np.dtype:
    try:
        return ONNX_DTYPES[int(code)]
    except KeyError:
        where = f"{node.label}: " if node is not None else ""
        raise UnsupportedOpError(f"{where}ONNX data type code {code} is not supported "
                                 f"(supported: {sorted(ONNX_DTYPES)})") from None


def is_float(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating)
