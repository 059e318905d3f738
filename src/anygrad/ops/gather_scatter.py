"""Gathers and scatters by index tensors: GatherElements and ScatterElements (Scatter), GatherND
and ScatterND, with their internal gradient ops. (Gather along an axis is in shape.py.)

One module because each is the other's gradient: gradients of gathers are scatter-adds
(internal *Grad ops that take the data shape as an attribute, so no zero tensor is
materialised); gradients of scatters are gathers.
"""
from __future__ import annotations

import numpy as np

from ..errors import AnygradError, ShapeError, UnsupportedOpError
from ..ir.builder import GradContext
from ..ir.graph import Node, TensorInfo
from ..ir.registry import defop
from ._index_util import _axis, _shape_attr_infer, _str


def _positive(idx: np.ndarray, dim) -> np.ndarray:
    """ONNX indices may count from the back."""
    idx = np.asarray(idx).astype(np.int64)
    return np.where(idx < 0, idx + np.asarray(dim, np.int64), idx)


def _zeros_like(g: GradContext, name: str) -> str:
    return g.const(np.zeros(g.shape(name), g.dtype(name)), g.dtype(name), "zeros")


# -- GatherElements / ScatterElements -------------------------------------------------------
def _element_index(idx: np.ndarray, axis: int) -> tuple:
    """Full coordinates of every element of `idx`, with the `axis` coordinate taken from idx."""
    coords = list(np.indices(idx.shape, sparse=True))
    coords[axis] = idx
    return tuple(coords)


def _gather_elements_infer(node, ins):
    data, idx = ins
    if len(idx.shape) != len(data.shape):
        raise ShapeError(f"{node.label}: indices rank {len(idx.shape)} differs from data rank {len(data.shape)}")
    _axis(node, len(data.shape))
    return [TensorInfo(data.dtype, tuple(idx.shape))]


def _gather_elements_forward(node, ins):
    data, idx = ins
    axis = _axis(node, data.ndim)
    return data[_element_index(_positive(idx, data.shape[axis]), axis)]


def _gather_elements_grad(g: GradContext):
    shape = g.shape(g.x[0])
    return [g.op("GatherElementsGrad", [g.dy, g.x[1]], axis=_axis(g.node, len(shape)), shape=list(shape)), None]


def _gather_elements_grad_forward(node, ins):
    dy, idx = ins
    shape, axis = tuple(node.attr("shape")), node.attr("axis")
    dx = np.zeros(shape, dy.dtype)
    np.add.at(dx, _element_index(_positive(idx, shape[axis]), axis), dy)  # repeated indices sum
    return dx


defop("GatherElements", infer=_gather_elements_infer, forward=_gather_elements_forward,
      grad=_gather_elements_grad, nondiff=[1])
# dy scatter-added into zeros of the data shape (attrs: axis, shape). Also TopK's gradient.
defop("GatherElementsGrad", internal=True, nondiff=[1], infer=_shape_attr_infer,
      forward=_gather_elements_grad_forward,
      grad=lambda g: [g.op("GatherElements", [g.dy, g.x[1]], axis=g.node.attr("axis")), None])

# reduction attribute -> numpy ufunc applied at repeated positions ("none": plain assignment)
_SCATTER_UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _reduction(node: Node) -> str:
    red = _str(node, "reduction", "none")
    if red != "none" and red not in _SCATTER_UFUNCS:
        raise UnsupportedOpError(f"{node.label}: reduction '{red}' is not supported "
                                 f"(supported: none, {', '.join(_SCATTER_UFUNCS)})")
    return red


def _scatter_into(out: np.ndarray, where: tuple, updates: np.ndarray, reduction: str) -> np.ndarray:
    if reduction == "none":
        out[where] = updates
    else:
        _SCATTER_UFUNCS[reduction].at(out, where, updates)
    return out


def _scatter_elements_infer(node, ins):
    data, idx, upd = ins
    if tuple(idx.shape) != tuple(upd.shape) or len(idx.shape) != len(data.shape):
        raise ShapeError(f"{node.label}: indices {tuple(idx.shape)} and updates {tuple(upd.shape)} must have "
                         f"one shape, of the rank of data {tuple(data.shape)}")
    _axis(node, len(data.shape))
    _reduction(node)
    return [TensorInfo(data.dtype, tuple(data.shape))]


def _scatter_elements_forward(node, ins):
    data, idx, upd = ins
    axis = _axis(node, data.ndim)
    where = _element_index(_positive(idx, data.shape[axis]), axis)
    return _scatter_into(data.copy(), where, upd.astype(data.dtype), _reduction(node))


def _no_scatter_grad(g: GradContext, red: str):
    raise AnygradError(f"{g.node.label}: the gradient of {g.node.op} with reduction '{red}' is not supported "
                       "(only 'none' and 'add'" + (" and 'mul'" if g.node.op == "ScatterND" else "") + ")")


def _scatter_elements_grad(g: GradContext):
    red = _reduction(g.node)
    if red not in ("none", "add"):
        _no_scatter_grad(g, red)
    axis = _axis(g.node, len(g.shape(g.x[0])))
    idx, upd = g.x[1], g.x[2]
    ddata = dupd = None
    if g.need(0):  # overwritten positions pass nothing back to data
        ddata = g.dy if red == "add" else g.op("ScatterElements", [g.dy, idx, _zeros_like(g, upd)], axis=axis)
    if g.need(2):
        dupd = g.op("GatherElements", [g.dy, idx], axis=axis)
    return [ddata, None, dupd]


for _name in ("ScatterElements", "Scatter"):  # Scatter: the opset 9-10 name of ScatterElements
    defop(_name, infer=_scatter_elements_infer, forward=_scatter_elements_forward,
          grad=_scatter_elements_grad, nondiff=[1])


# -- GatherND / ScatterND --------------------------------------------------------------------
def _nd_where(idx: np.ndarray, shape: tuple) -> tuple:
    """Index tuple of the slices an (..., k) index tensor addresses in a tensor of `shape`."""
    k = idx.shape[-1]
    flat = _positive(idx.reshape(-1, k), np.array(shape[:k], np.int64))
    return tuple(flat.T)


def _gather_nd_shape(node: Node, data: tuple, idx: tuple) -> tuple:
    b = int(node.attr("batch_dims", 0))
    k = idx[-1]
    if not isinstance(k, int) or k > len(data) - b or tuple(data[:b]) != tuple(idx[:b]):
        raise ShapeError(f"{node.label}: indices {idx} do not address data {data} with batch_dims {b}")
    return tuple(idx[:-1]) + tuple(data[b + k:])


def _per_batch(node: Node, data_shape: tuple, idx: np.ndarray):
    """(batch count, data shape within a batch, indices per batch) for batch_dims."""
    b = int(node.attr("batch_dims", 0))
    nb = int(np.prod(data_shape[:b], dtype=np.int64))
    return nb, tuple(data_shape[b:]), idx.reshape((nb,) + idx.shape[b:])


def _gather_nd_forward(node, ins):
    data, idx = ins
    nb, inner, idx_b = _per_batch(node, data.shape, idx)
    data_b = data.reshape((nb,) + inner)
    out = np.stack([data_b[i][_nd_where(idx_b[i], inner)] for i in range(nb)])
    return out.reshape(_gather_nd_shape(node, data.shape, idx.shape))


def _gather_nd_grad_forward(node, ins):
    dy, idx = ins
    shape = tuple(node.attr("shape"))
    nb, inner, idx_b = _per_batch(node, shape, idx)
    dx = np.zeros((nb,) + inner, dy.dtype)
    k = idx.shape[-1]
    dy_b = dy.reshape((nb, -1) + inner[k:])
    for i in range(nb):
        np.add.at(dx[i], _nd_where(idx_b[i], inner), dy_b[i])
    return dx.reshape(shape)


defop("GatherND", nondiff=[1],
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, _gather_nd_shape(node, tuple(ins[0].shape),
                                                                        tuple(ins[1].shape)))],
      forward=_gather_nd_forward,
      grad=lambda g: [g.op("GatherNDGrad", [g.dy, g.x[1]], shape=list(g.shape(g.x[0])),
                           batch_dims=int(g.node.attr("batch_dims", 0))), None])
# dy scatter-added into zeros of the data shape (attrs: shape, batch_dims).
defop("GatherNDGrad", internal=True, nondiff=[1], infer=_shape_attr_infer, forward=_gather_nd_grad_forward,
      grad=lambda g: [g.op("GatherND", [g.dy, g.x[1]], batch_dims=g.node.attr("batch_dims")), None])


def _scatter_nd_infer(node, ins):
    data, idx, upd = ins
    k = idx.shape[-1]
    want = tuple(idx.shape[:-1]) + tuple(data.shape[k:]) if isinstance(k, int) and k <= len(data.shape) else None
    if want is None or tuple(upd.shape) != want:
        raise ShapeError(f"{node.label}: updates {tuple(upd.shape)} do not fit indices {tuple(idx.shape)} "
                         f"into data {tuple(data.shape)} (expected {want})")
    _reduction(node)
    return [TensorInfo(data.dtype, tuple(data.shape))]


def _scatter_nd_forward(node, ins):
    data, idx, upd = ins
    k = idx.shape[-1]
    upd = upd.reshape((-1,) + data.shape[k:]).astype(data.dtype)
    return _scatter_into(data.copy(), _nd_where(idx, data.shape), upd, _reduction(node))


def _scatter_nd_mul_grad_forward(node, ins):
    """d updates of a multiplying ScatterND: dy * data * (the other updates at the same place)."""
    dy, data, idx, upd = ins
    k = idx.shape[-1]
    where = _nd_where(idx, data.shape)
    u = upd.reshape((-1,) + data.shape[k:])
    base = (dy * data)[where]
    linear = np.ravel_multi_index(where, data.shape[:k]) if k else np.zeros(len(u), np.int64)
    out = np.empty_like(u)
    for j in range(len(u)):  # product over the other updates that land on the same slice
        others = (linear == linear[j])
        others[j] = False
        out[j] = base[j] * np.prod(u[others], axis=0)
    return out.reshape(upd.shape)


def _scatter_nd_grad(g: GradContext):
    red = _reduction(g.node)
    data, idx, upd = g.x
    if red not in ("none", "add", "mul"):
        _no_scatter_grad(g, red)
    ddata = dupd = None
    if g.need(0):
        ddata = {"add": lambda: g.dy,
                 "none": lambda: g.op("ScatterND", [g.dy, idx, _zeros_like(g, upd)]),
                 "mul": lambda: g.op("ScatterND", [g.dy, idx, upd], reduction="mul")}[red]()
    if g.need(2):
        dupd = (g.op("ScatterNDMulGrad", [g.dy, data, idx, upd]) if red == "mul"
                else g.op("GatherND", [g.dy, idx]))
    return [ddata, None, dupd]


defop("ScatterND", infer=_scatter_nd_infer, forward=_scatter_nd_forward, grad=_scatter_nd_grad, nondiff=[1])
# Inputs: dy, data, indices, updates -> d updates.
defop("ScatterNDMulGrad", internal=True, nondiff=[1, 2, 3], forward=_scatter_nd_mul_grad_forward,
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, tuple(ins[3].shape))])
