"""Ops that move data without arithmetic: Reshape, Transpose, Concat, Slice, Gather, ...

Shape and Size know their output as soon as the input's shape is known, so their shape rules
set TensorInfo.const even for a non-constant input: that is what folds the
Shape->Gather->Unsqueeze->Concat->Reshape chains exporters emit for `x.view(x.size(0), -1)`.
"""
from __future__ import annotations

import itertools
import os

import numpy as np

from ..errors import DataError, ShapeError, UnsupportedOpError
from ..ir.builder import Builder, GradContext
from ..ir.graph import Graph, Node, TensorInfo, info_of
from ..ir.registry import defop
from ._util import ONNX_CODES, axes_of, broadcast_shape, const_ints, dim_prod, ints_of, norm_axis, slot


def reshape_target(node: Node, in_shape: tuple, spec: list[int]) -> tuple[int, ...]:
    """ONNX Reshape: 0 copies the input dim (unless allowzero), -1 is inferred."""
    allowzero = node.attr("allowzero", 0)
    out = [in_shape[i] if (d == 0 and not allowzero) else d for i, d in enumerate(spec)]
    if out.count(-1) > 1:
        raise ShapeError(f"{node.label}: more than one -1 in target shape {spec}")
    if not all(isinstance(d, int) for d in in_shape):  # symbolic input (before specialize)
        return tuple(f"{dim_prod(in_shape)}/{dim_prod([d for d in out if d != -1])}" if d == -1 else d
                     for d in out)
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
    if ins[1].const is None and not ins[0].is_static and len(ins[1].shape) == 1:
        # Before `specialize` a target computed from a symbolic shape is not known yet: only the rank.
        return [TensorInfo(ins[0].dtype, tuple(f"{node.outputs[0]}.dim{i}" for i in range(ins[1].shape[0])))]
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
    if sorted(perm) != list(range(ins[0].rank)):
        raise ShapeError(f"{node.label}: perm {perm} is not a permutation of the {ins[0].rank} axes")
    return [TensorInfo(ins[0].dtype, tuple(ins[0].shape[p] for p in perm))]


def _transpose_grad(g: GradContext):
    perm = _perm(g.node, len(g.shape(g.x[0])))
    return [g.op("Transpose", [g.dy], perm=[int(i) for i in np.argsort(perm)])]


defop("Transpose", infer=_transpose_infer, grad=_transpose_grad,
      forward=lambda node, ins: np.ascontiguousarray(np.transpose(ins[0], _perm(node, ins[0].ndim))))


def _expand_infer(node, ins):
    return [TensorInfo(ins[0].dtype, broadcast_shape(ins[0].shape, tuple(const_ints(ins[1], "shape", node))))]


defop("Expand", infer=_expand_infer, nondiff=[1],
      forward=lambda node, ins: np.ascontiguousarray(
          np.broadcast_to(ins[0], np.broadcast_shapes(ins[0].shape, tuple(int(v) for v in ins[1])))),
      grad=lambda g: [g.unbroadcast(g.dy, g.shape(g.x[0])), None])


# -- layout ---------------------------------------------------------------------------------
def _flatten_shape(node: Node, shape: tuple) -> tuple:
    axis = norm_axis(node.attr("axis", 1), len(shape))
    if not 0 <= axis <= len(shape):
        raise ShapeError(f"{node.label}: axis {node.attr('axis', 1)} is out of range for rank {len(shape)}")
    return (dim_prod(shape[:axis]), dim_prod(shape[axis:]))


defop("Flatten", infer=lambda node, ins: [TensorInfo(ins[0].dtype, _flatten_shape(node, ins[0].shape))],
      forward=lambda node, ins: ins[0].reshape(_flatten_shape(node, ins[0].shape)),
      grad=_grad_to_input_shape)


def squeeze_shape(node: Node, shape: tuple, axes: list[int] | None) -> tuple:
    if axes is None:  # no axes: drop every 1
        return tuple(d for d in shape if d != 1)
    rank = len(shape)
    axes_n = {norm_axis(a, rank) for a in axes}
    for a in axes_n:
        if not 0 <= a < rank:
            raise ShapeError(f"{node.label}: axis {a} is out of range for rank {rank}")
        if isinstance(shape[a], int) and shape[a] != 1:
            raise ShapeError(f"{node.label}: cannot squeeze axis {a} of size {shape[a]} (shape {tuple(shape)})")
    return tuple(d for i, d in enumerate(shape) if i not in axes_n)


def unsqueeze_shape(node: Node, shape: tuple, axes: list[int] | None) -> tuple:
    if axes is None:
        raise ShapeError(f"{node.label}: Unsqueeze needs axes")
    rank = len(shape) + len(axes)
    axes_n = sorted(norm_axis(a, rank) for a in axes)
    if len(set(axes_n)) != len(axes_n) or any(not 0 <= a < rank for a in axes_n):
        raise ShapeError(f"{node.label}: invalid axes {list(axes)} for output rank {rank}")
    out = list(shape)
    for a in axes_n:  # ascending, so each position is already final
        out.insert(a, 1)
    return tuple(out)


def _axes_rule_infer(rule):
    return lambda node, ins: [TensorInfo(ins[0].dtype, rule(node, ins[0].shape, axes_of(node, ins)))]


def _axes_rule_forward(rule):
    return lambda node, ins: ins[0].reshape(rule(node, ins[0].shape, axes_of(node, ins)))


for _name, _rule in [("Squeeze", squeeze_shape), ("Unsqueeze", unsqueeze_shape)]:
    defop(_name, nondiff=[1], grad=_grad_to_input_shape, infer=_axes_rule_infer(_rule),
          forward=_axes_rule_forward(_rule))


# -- Concat / Split -------------------------------------------------------------------------
def _concat_axis(node: Node, rank: int) -> int:
    if node.attr("axis") is None:
        raise ShapeError(f"{node.label}: Concat needs the axis attribute")
    axis = norm_axis(node.attr("axis"), rank)
    if not 0 <= axis < rank:
        raise ShapeError(f"{node.label}: axis {node.attr('axis')} is out of range for rank {rank}")
    return axis


def _concat_infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    ins = [i for i in ins if i is not None]
    first = tuple(ins[0].shape)
    axis = _concat_axis(node, len(first))
    for inf in ins[1:]:
        s = tuple(inf.shape)
        if len(s) != len(first) or any(i != axis and isinstance(a, int) and isinstance(b, int) and a != b
                                       for i, (a, b) in enumerate(zip(first, s))):
            raise ShapeError(f"{node.label}: cannot concatenate shapes {[tuple(i.shape) for i in ins]} "
                             f"along axis {axis}")
    sizes = [inf.shape[axis] for inf in ins]
    total = sum(sizes) if all(isinstance(d, int) for d in sizes) else "+".join(map(str, sizes))
    return [TensorInfo(ins[0].dtype, first[:axis] + (total,) + first[axis + 1:])]


def slice_along(g: Builder, x: str, axis: int, start: int, end: int) -> str:
    """x[..., start:end, ...] on one axis, as a Slice with constant bounds."""
    def c(v):
        return g.const(np.array([v], np.int64), np.int64, "slice")
    return g.op("Slice", [x, c(start), c(end), c(axis)])


def _concat_grad(g: GradContext):
    axis = _concat_axis(g.node, len(g.shape(g.dy)))
    grads, offset = [], 0
    for i, x in enumerate(g.x):
        size = g.shape(x)[axis] if x else 0
        grads.append(slice_along(g, g.dy, axis, offset, offset + size) if x and g.need(i) else None)
        offset += size
    return grads


defop("Concat", infer=_concat_infer, grad=_concat_grad,
      forward=lambda node, ins: np.concatenate([i for i in ins if i is not None],
                                               axis=_concat_axis(node, ins[0].ndim)))


def split_sizes(node: Node, shape: tuple, split) -> tuple[int, list[int]]:
    """(axis, output sizes) of a Split: explicit sizes, or equal parts (the last one smaller)."""
    axis = norm_axis(node.attr("axis", 0), len(shape))
    if not 0 <= axis < len(shape):
        raise ShapeError(f"{node.label}: axis {node.attr('axis', 0)} is out of range for rank {len(shape)}")
    dim = shape[axis]
    sizes = node.attr("split") if node.attr("split") is not None else ints_of(split, "split", node)
    if sizes:
        if isinstance(dim, int) and sum(sizes) != dim:
            raise ShapeError(f"{node.label}: split sizes {list(sizes)} do not add up to {dim}")
        return axis, [int(s) for s in sizes]
    n = int(node.attr("num_outputs", len(node.outputs)))
    if not isinstance(dim, int):
        raise ShapeError(f"{node.label}: cannot split symbolic dim {dim} before the input shape is known")
    chunk = -(-dim // n)
    sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
    if sizes[-1] < 0:
        raise ShapeError(f"{node.label}: cannot split {dim} into {n} parts of {chunk}")
    return axis, sizes


def _split_infer(node, ins):
    axis, sizes = split_sizes(node, tuple(ins[0].shape), slot(ins, 1))
    if len(sizes) != len(node.outputs):
        raise ShapeError(f"{node.label}: {len(sizes)} parts {sizes} for {len(node.outputs)} outputs")
    s = tuple(ins[0].shape)
    return [TensorInfo(ins[0].dtype, s[:axis] + (n,) + s[axis + 1:]) for n in sizes]


def _split_forward(node, ins):
    axis, sizes = split_sizes(node, ins[0].shape, slot(ins, 1))
    return np.split(ins[0], np.cumsum(sizes)[:-1], axis=axis)


def _split_grad(g: GradContext):
    axis, _ = split_sizes(g.node, g.shape(g.x[0]), g.info(g.x[1]) if g.node.input(1) else None)
    parts = [dy if dy is not None else g.const(np.zeros(g.shape(y), g.dtype(y)), g.dtype(y), "zeros")
             for dy, y in zip(g.dys, g.y)]
    return [g.op("Concat", parts, axis=axis) if len(parts) > 1 else parts[0], None]


defop("Split", infer=_split_infer, forward=_split_forward, grad=_split_grad, nondiff=[1])


# -- constants and shape queries ------------------------------------------------------------
_CONSTANT_ATTRS = {
    # attribute: array from its value (the importer turns `value` TensorProtos into arrays)
    "value": lambda v: np.asarray(v),
    "value_float": lambda v: np.array(v, np.float32),
    "value_floats": lambda v: np.array(v, np.float32),
    "value_int": lambda v: np.array(v, np.int64),
    "value_ints": lambda v: np.array(v, np.int64),
}


def constant_value(node: Node) -> np.ndarray:
    for key, make in _CONSTANT_ATTRS.items():
        if node.attr(key) is not None:
            return make(node.attr(key))
    raise UnsupportedOpError(f"{node.label}: needs one of the attributes {sorted(_CONSTANT_ATTRS)} "
                             f"(got {sorted(node.attrs)}); sparse and string constants are not supported")


defop("Constant", infer=lambda node, ins: [info_of(constant_value(node))],
      forward=lambda node, ins: constant_value(node).copy())


def _shape_range(node: Node, rank: int) -> slice:
    """Shape's start/end (opset 15): negative counts from the back, then clamped to [0, rank]."""
    def clamp(v):
        v = v + rank if v < 0 else v
        return min(max(v, 0), rank)
    end = node.attr("end")
    return slice(clamp(node.attr("start", 0)), clamp(rank if end is None else end))


def _shape_infer(node, ins):
    dims = tuple(ins[0].shape)[_shape_range(node, ins[0].rank)]
    const = np.array(dims, np.int64) if all(isinstance(d, int) for d in dims) else None
    return [TensorInfo(np.dtype(np.int64), (len(dims),), const)]


def _size_infer(node, ins):
    n = dim_prod(ins[0].shape)
    return [TensorInfo(np.dtype(np.int64), (), np.array(n, np.int64) if isinstance(n, int) else None)]


# Known from the input's shape alone: the shape rule sets .const, so folding needs no constant input.
defop("Shape", infer=_shape_infer, nondiff=[0],
      forward=lambda node, ins: np.array(ins[0].shape[_shape_range(node, ins[0].ndim)], np.int64))
defop("Size", infer=_size_infer, nondiff=[0], forward=lambda node, ins: np.array(ins[0].size, np.int64))


def constant_of_shape_value(node: Node) -> np.ndarray:
    """ConstantOfShape's fill value as a 0-d array (default float32 0)."""
    value = node.attr("value")
    if value is None:
        return np.zeros((), np.float32)
    value = np.asarray(value)
    if value.size != 1:
        raise ShapeError(f"{node.label}: value must hold exactly one element, got shape {value.shape}")
    return value.reshape(())


def _memory_bytes() -> int:
    """This machine's physical memory (64 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 1 << 36


def _cos_infer(node, ins):
    shape = tuple(const_ints(ins[0], "shape", node))
    if any(d < 0 for d in shape):
        raise ShapeError(f"{node.label}: negative dimension in shape {shape}")
    dtype = constant_of_shape_value(node).dtype
    # the shape comes from the file: one that no memory can hold is refused before numpy tries
    nbytes, memory = int(np.prod(shape, dtype=object)) * dtype.itemsize, _memory_bytes()
    if nbytes > memory:
        raise ShapeError(f"{node.label}: a {dtype} tensor of shape {shape} would take {nbytes / 2**30:.4g} GiB, "
                         f"more than this machine's memory ({memory / 2**30:.4g} GiB); is the model's shape "
                         "input right?")
    return [TensorInfo(dtype, shape)]


defop("ConstantOfShape", infer=_cos_infer, nondiff=[0],
      forward=lambda node, ins: np.full(tuple(int(d) for d in ins[0]), constant_of_shape_value(node)))


def _range_args(node: Node, ins: list) -> tuple:
    values = [i.const if isinstance(i, TensorInfo) else i for i in ins[:3]]
    if any(v is None for v in values):
        raise ShapeError(f"{node.label}: start, limit and delta must be constants (known when the model is "
                         "compiled), so the output length is known")
    start, limit, delta = (np.asarray(v).reshape(()) for v in values)
    if delta == 0:
        raise ShapeError(f"{node.label}: delta is 0")
    return start, delta, max(int(np.ceil((limit - start) / delta)), 0)


def _range_forward(node, ins):
    start, delta, n = _range_args(node, ins)
    return (start + delta * np.arange(n)).astype(ins[0].dtype)  # ONNX: output[i] = start + i * delta


defop("Range", infer=lambda node, ins: [TensorInfo(ins[0].dtype, (_range_args(node, ins)[2],))],
      forward=_range_forward, nondiff=[0, 1, 2])


# -- Slice ----------------------------------------------------------------------------------
def slice_bounds(node: Node, ins: list, shape: tuple) -> list[tuple]:
    """Per axis (start, end, step) after ONNX's clamping rules; end -1 with a negative step means
    "through index 0". Unsliced axes get (0, dim, 1)."""
    if node.attr("steps") is not None:  # resolved (ops/resolve.py): these bounds, one per axis
        return list(zip(node.attr("starts"), node.attr("ends"), node.attr("steps")))
    if len(ins) > 1:  # opset 10+: inputs
        starts = ints_of(ins[1], "starts", node)
        ends = ints_of(ins[2], "ends", node)
        axes = ints_of(slot(ins, 3), "axes", node)
        steps = ints_of(slot(ins, 4), "steps", node)
    else:  # opset 1-9: attributes
        starts, ends, axes, steps = node.attr("starts"), node.attr("ends"), node.attr("axes"), None
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [norm_axis(a, rank) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ShapeError(f"{node.label}: starts, ends, axes and steps differ in length")
    if len(set(axes)) != len(axes) or any(not 0 <= a < rank for a in axes):
        raise ShapeError(f"{node.label}: invalid axes {axes} for rank {rank}")
    bounds: list[tuple] = [(0, d, 1) for d in shape]
    for a, start, end, step in zip(axes, starts, ends, steps):
        d = shape[a]
        if step == 0:
            raise ShapeError(f"{node.label}: step 0 on axis {a}")
        if not isinstance(d, int):  # symbolic (before specialize): a placeholder dim
            bounds[a] = (start, end, step)
            continue
        start = start + d if start < 0 else start
        end = end + d if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), d), min(max(end, 0), d)
        else:
            start, end = min(max(start, 0), d - 1), min(max(end, -1), d - 1)
        bounds[a] = (start, end, step)
    return bounds


def slice_len(start: int, end: int, step: int) -> int:
    return max(0, -((start - end) // step))  # ceil((end - start) / step)


def _slice_shape(shape: tuple, bounds: list[tuple]) -> tuple:
    return tuple(slice_len(*b) if isinstance(d, int) else (d if b == (0, d, 1) else f"{d}[{b[0]}:{b[1]}:{b[2]}]")
                 for d, b in zip(shape, bounds))


def _index(bounds) -> tuple:
    return tuple(slice(s, e if e >= 0 else None, st) for s, e, st in bounds)


def _slice_grad(g: GradContext):
    shape = g.shape(g.x[0])
    starts, ends, steps = zip(*slice_bounds(g.node, [g.info(i) if i else None for i in g.x], shape))
    dx = g.op("SliceGrad", [g.dy], shape=list(shape), starts=list(starts), ends=list(ends), steps=list(steps))
    return [dx] + [None] * (len(g.x) - 1)


defop("Slice", nondiff=[1, 2, 3, 4], grad=_slice_grad,
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, _slice_shape(
          tuple(ins[0].shape), slice_bounds(node, ins, tuple(ins[0].shape))))],
      forward=lambda node, ins: np.ascontiguousarray(ins[0][_index(slice_bounds(node, ins, ins[0].shape))]))


def _slice_grad_bounds(node: Node) -> list[tuple]:
    return list(zip(node.attr("starts"), node.attr("ends"), node.attr("steps")))


def _slice_grad_forward(node, ins):
    dx = np.zeros(tuple(node.attr("shape")), ins[0].dtype)
    dx[_index(_slice_grad_bounds(node))] = ins[0]
    return dx


def _slice_grad_grad(g: GradContext):
    starts, ends, steps = (g.node.attr(k) for k in ("starts", "ends", "steps"))
    # An end of -1 with a negative step means "through 0": as a Slice input that is -(dim + 1).
    ends = [e if e >= 0 else -(d + 1) for e, d in zip(ends, g.node.attr("shape"))]
    c = [g.const(np.array(v, np.int64), np.int64, "slice") for v in (starts, ends)]
    axes = g.const(np.arange(len(starts), dtype=np.int64), np.int64, "axes")
    return [g.op("Slice", [g.dy, c[0], c[1], axes, g.const(np.array(steps, np.int64), np.int64, "steps")])]


# The gradient of Slice: dy scattered into zeros of the input shape (attrs: shape, starts, ends,
# steps, full rank and already clamped, so a kernel maps out index i to start + i * step).
def _slice_grad_infer(node, ins):
    want = tuple(slice_len(*b) for b in _slice_grad_bounds(node))
    if tuple(ins[0].shape) != want:
        raise ShapeError(f"{node.label}: gradient of shape {tuple(ins[0].shape)} does not fit the slice "
                         f"(expected {want})")
    return [TensorInfo(ins[0].dtype, tuple(node.attr("shape")))]


defop("SliceGrad", internal=True, forward=_slice_grad_forward, grad=_slice_grad_grad, infer=_slice_grad_infer)


# -- Gather ---------------------------------------------------------------------------------
def _gather_axis(node: Node, rank: int) -> int:
    axis = norm_axis(node.attr("axis", 0), rank)
    if not 0 <= axis < rank:
        raise ShapeError(f"{node.label}: axis {node.attr('axis', 0)} is out of range for rank {rank}")
    return axis


def _gather_infer(node, ins):
    data, idx = ins
    shape = tuple(data.shape)
    axis = _gather_axis(node, len(shape))
    if idx.const is not None and isinstance(shape[axis], int) and idx.const.size:
        lo, hi = int(idx.const.min()), int(idx.const.max())
        if lo < -shape[axis] or hi >= shape[axis]:
            raise ShapeError(f"{node.label}: indices [{lo}, {hi}] out of range for axis {axis} of size {shape[axis]}")
    return [TensorInfo(data.dtype, shape[:axis] + tuple(idx.shape) + shape[axis + 1:])]


def _positive(idx: np.ndarray, dim: int) -> np.ndarray:
    idx = np.asarray(idx).astype(np.int64)
    return np.where(idx < 0, idx + dim, idx)


def _gather_forward(node, ins):
    data, idx = ins
    axis = _gather_axis(node, data.ndim)
    n = data.shape[axis]
    lo, hi = (int(idx.min()), int(idx.max())) if idx.size else (0, 0)  # two reductions, no copy
    if lo < -n or hi >= n:
        bad = hi if hi >= n else lo
        raise DataError(f"Gather node '{node.name}': index {int(bad)} is out of range [-{n}, {n}) for axis {axis} "
                        f"of size {n} (an embedding lookup needs ids below its number of rows)")
    return np.take(data, _positive(idx, n), axis=axis)


def _gather_grad(g: GradContext):
    shape = g.shape(g.x[0])
    axis = _gather_axis(g.node, len(shape))
    dy, idx = g.dy, g.x[1]
    pad = g.node.attr(PADDING_IDX)
    if pad is not None:  # nn.Embedding(padding_idx): lookups of that row pass no gradient back
        keep = g.op("Cast", [g.op("Not", [g.op("Equal", [idx, g.const(pad, g.dtype(idx), "padding_idx")])])],
                    to=ONNX_CODES[np.dtype(g.dtype(dy))])
        tail = len(shape) - axis - 1
        keep = g.reshape(keep, g.shape(idx) + (1,) * tail) if tail else keep
        dy = g.op("Mul", [dy, keep])
    return [g.op("GatherGrad", [dy, idx], axis=axis, shape=list(shape)), None]


# PADDING_IDX: the row an embedding lookup (Gather on axis 0) treats as PyTorch's padding_idx.
# Forward is unchanged, so a padding row that is not zero (a fine-tuned checkpoint) still reads
# as its values, as in PyTorch.
PADDING_IDX = "padding_idx"
defop("Gather", infer=_gather_infer, forward=_gather_forward, grad=_gather_grad, nondiff=[1],
      grad_attrs=[PADDING_IDX])


def _gather_grad_forward(node, ins):
    dy, idx = ins
    shape, axis = tuple(node.attr("shape")), node.attr("axis")
    idx = _positive(idx, shape[axis])
    dx = np.zeros(shape, dy.dtype)
    q = idx.ndim
    # Index dims to the front of dy and the gathered axis to the front of dx: then it is one add.at.
    dy_front = np.moveaxis(dy, list(range(axis, axis + q)), list(range(q)))
    np.add.at(np.moveaxis(dx, axis, 0), idx, dy_front)
    return dx


# The gradient of Gather: dy scatter-added into zeros of the data shape (repeated indices sum).
defop("GatherGrad", internal=True, nondiff=[1], forward=_gather_grad_forward,
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, tuple(node.attr("shape")))],
      grad=lambda g: [g.op("Gather", [g.dy, g.x[1]], axis=g.node.attr("axis")), None])


# -- Tile -----------------------------------------------------------------------------------
def _tile_repeats(node: Node, ins: list, rank: int) -> list[int]:
    repeats = ints_of(ins[1], "repeats", node)
    if len(repeats) != rank or any(r < 0 for r in repeats):
        raise ShapeError(f"{node.label}: repeats {repeats} must be {rank} non-negative counts")
    return repeats


def _tile_infer(node, ins):
    reps = _tile_repeats(node, ins, ins[0].rank)
    return [TensorInfo(ins[0].dtype, tuple(d * r if isinstance(d, int) else (d if r == 1 else f"{d}*{r}")
                                           for d, r in zip(ins[0].shape, reps)))]


def _tile_grad(g: GradContext):
    # Output index k * d + i along an axis holds input i: view dy as (r0, d0, r1, d1, ...) and sum the r's.
    shape = g.shape(g.x[0])
    reps = _tile_repeats(g.node, [g.info(i) for i in g.x], len(shape))
    split = g.reshape(g.dy, tuple(v for r, d in zip(reps, shape) for v in (r, d)))
    axes = g.const(np.arange(0, 2 * len(shape), 2, dtype=np.int64), np.int64, "axes")
    return [g.reshape(g.op("ReduceSum", [split, axes], keepdims=0), shape) if shape else g.dy, None]


defop("Tile", infer=_tile_infer, grad=_tile_grad, nondiff=[1],
      forward=lambda node, ins: np.tile(ins[0], _tile_repeats(node, ins, ins[0].ndim)))


# -- Pad ------------------------------------------------------------------------------------
# Every Pad mode is separable: output index j on an axis reads input index source(j) (or the
# constant, where source is -1), so forward is a take per axis and the gradient a scatter-add per
# axis. Negative pads crop, with the same maps.
def pad_source_index(mode: str, dim: int, before: int, after: int) -> np.ndarray:
    """For each position of a padded axis, the source index it reads in Pad `mode` (-1: the
    constant value)."""
    s = np.arange(dim + before + after) - before
    if mode == "constant":
        return np.where((s >= 0) & (s < dim), s, -1)
    if mode == "edge":
        return np.clip(s, 0, dim - 1)
    if mode == "wrap":
        return np.mod(s, dim)
    if mode == "reflect":
        if dim == 1:
            return np.zeros_like(s)
        period = 2 * (dim - 1)
        r = np.mod(s, period)
        return np.where(r < dim, r, period - r)
    raise ValueError(f"unknown mode {mode}")


def pad_amounts(node: Node, ins: list, rank: int) -> list[tuple[int, int]]:
    """(before, after) per axis, from the pads input (opset 11+, with optional axes) or attribute."""
    pads = ints_of(slot(ins, 1), "pads", node) if slot(ins, 1) is not None else node.attr("pads")
    axes = ints_of(slot(ins, 3), "axes", node)
    axes = list(range(rank)) if axes is None else [norm_axis(a, rank) for a in axes]
    if pads is None or len(pads) != 2 * len(axes):
        raise ShapeError(f"{node.label}: pads {pads} must hold 2 values per padded axis ({len(axes)} axes)")
    amounts = [(0, 0)] * rank
    for i, a in enumerate(axes):
        amounts[a] = (int(pads[i]), int(pads[i + len(axes)]))
    return amounts


def pad_mode(node: Node, shape: tuple, amounts) -> str:
    """Pad's mode (default constant), checked against the input `shape` and pad `amounts`."""
    mode = node.attr("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise UnsupportedOpError(f"{node.label}: Pad mode '{mode}' is not supported")
    for d, (b, a) in zip(shape, amounts):
        if mode == "reflect" and isinstance(d, int) and max(b, a) > d - 1:
            raise ShapeError(f"{node.label}: reflect padding {max(b, a)} must be smaller than the dim {d}")
    return mode


def _pad_infer(node, ins):
    shape = tuple(ins[0].shape)
    amounts = pad_amounts(node, ins, len(shape))
    pad_mode(node, shape, amounts)
    out = tuple(d + b + a if isinstance(d, int) else (d if (b, a) == (0, 0) else f"{d}+{b + a}")
                for d, (b, a) in zip(shape, amounts))
    if any(isinstance(d, int) and d < 0 for d in out):
        raise ShapeError(f"{node.label}: pads {amounts} crop more than the input shape {shape}")
    return [TensorInfo(ins[0].dtype, out)]


def _pad_forward(node, ins):
    x = ins[0]
    amounts = pad_amounts(node, ins, x.ndim)
    mode = pad_mode(node, x.shape, amounts)
    value = slot(ins, 2)
    value = node.attr("value", 0.0) if value is None or np.asarray(value).size == 0 else np.asarray(value).reshape(())
    for axis, (b, a) in enumerate(amounts):
        if (b, a) == (0, 0):
            continue
        src = pad_source_index(mode, x.shape[axis], b, a)
        x = np.take(x, np.maximum(src, 0), axis=axis)
        if mode == "constant":
            fill = [slice(None)] * x.ndim
            fill[axis] = src < 0
            x[tuple(fill)] = value
    return np.ascontiguousarray(x).astype(ins[0].dtype, copy=False)


def _pad_grad(g: GradContext):
    shape = g.shape(g.x[0])
    amounts = pad_amounts(g.node, [g.info(i) if i else None for i in g.x], len(shape))
    dx = g.op("PadGrad", [g.dy], shape=list(shape), before=[b for b, _ in amounts], after=[a for _, a in amounts],
              mode=pad_mode(g.node, shape, amounts))
    return [dx] + [None] * (len(g.x) - 1)


defop("Pad", infer=_pad_infer, forward=_pad_forward, grad=_pad_grad, nondiff=[1, 2, 3])


def _pad_grad_forward(node, ins):
    dx = ins[0]
    mode = node.attr("mode")
    for axis, (d, b, a) in enumerate(zip(node.attr("shape"), node.attr("before"), node.attr("after"))):
        if (b, a) == (0, 0):
            continue
        src = pad_source_index(mode, d, b, a)
        keep = src >= 0
        moved = np.moveaxis(dx, axis, 0)[keep]
        acc = np.zeros((d,) + moved.shape[1:], dx.dtype)
        np.add.at(acc, src[keep], moved)
        dx = np.moveaxis(acc, 0, axis)
    return np.ascontiguousarray(dx)


# The gradient of Pad: dy summed back onto the input positions each output read (attrs: shape,
# before, after, mode; full rank).
defop("PadGrad", internal=True, forward=_pad_grad_forward,
      infer=lambda node, ins: [TensorInfo(ins[0].dtype, tuple(node.attr("shape")))])


def merge_slice_grads(graph: Graph, b: Builder, terms: list[str]) -> list[str]:
    """Gradient terms of one value, with the SliceGrads of disjoint step-1 slices along one axis
    (attention's q/k/v split, a chunk) replaced by one Concat of their gradients, zeros only where
    no slice reads. Without this each SliceGrad zero-fills the whole input and the terms are added:
    n full-size writes and n-1 full-size adds instead of one copy."""
    if len(terms) < 2:
        return terms
    want = set(terms)
    nodes = {n.outputs[0]: n for n in graph.nodes if n.op == "SliceGrad" and n.outputs[0] in want}
    groups: dict[int, list[tuple[int, int, str, Node]]] = {}
    for t in terms:
        n = nodes.get(t)
        if n is None:
            continue
        shape, axis = n.attr("shape"), None
        for a, (s, e, st) in enumerate(_slice_grad_bounds(n)):
            if (s, e, st) != (0, shape[a], 1):
                if axis is not None or st != 1:
                    axis = -1
                    break
                axis = a
        if axis is not None and axis >= 0:
            groups.setdefault(axis, []).append((n.attr("starts")[axis], n.attr("ends")[axis], t, n))
    read = {i for n in graph.nodes for i in n.inputs}
    out = list(terms)
    for axis, parts in groups.items():
        parts.sort(key=lambda p: p[0])
        if len(parts) < 2 or any(p[1] > q[0] for p, q in itertools.pairwise(parts)) \
                or any(p[2] in read for p in parts):
            continue  # overlapping slices add up; a gradient read elsewhere stays
        shape = list(parts[0][3].attr("shape"))
        dtype = b.dtype(parts[0][2])
        pieces, at = [], 0
        for start, end, _, n in parts + [(shape[axis], shape[axis], None, None)]:
            if start > at:
                gap = shape[:axis] + [start - at] + shape[axis + 1:]
                pieces.append(b.const(np.zeros(gap, dtype), dtype, "zeros"))
            if n is not None:
                pieces.append(n.inputs[0])
            at = end
        dead = {id(p[3]) for p in parts}
        graph.nodes = [n for n in graph.nodes if id(n) not in dead]
        for p in parts:
            graph.info.pop(p[2], None)
        merged = b.op("Concat", pieces, axis=axis)
        out = [t for t in out if t not in {p[2] for p in parts}] + [merged]
    return out


# -- RotateHalf (internal: rotary embeddings' rotate_half, fused by ir/rotary.py) -------------------
# y = concat(-sign * x2, sign * x1) along `axis`, x1 and x2 the halves of x there: Llama's
# rotate_half (sign 1) is Slice, Slice, Neg and Concat written out. Its gradient is the same op
# with the sign flipped (d x1 = sign * dy2, d x2 = -sign * dy1).
def _rotate_half_infer(node: Node, ins):
    shape = tuple(ins[0].shape)
    axis = norm_axis(int(node.attr("axis", -1)), len(shape))
    if not 0 <= axis < len(shape) or shape[axis] % 2:
        raise ShapeError(f"{node.label}: RotateHalf needs an even dimension at axis {node.attr('axis', -1)}, "
                         f"got shape {shape}")
    return [TensorInfo(ins[0].dtype, shape)]


def _rotate_half(node: Node, ins):
    x = ins[0]
    axis, sign = norm_axis(int(node.attr("axis", -1)), x.ndim), int(node.attr("sign", 1))
    x1, x2 = np.split(x, 2, axis=axis)
    return np.concatenate([-sign * x2, sign * x1], axis=axis).astype(x.dtype)


defop("RotateHalf", internal=True, infer=_rotate_half_infer, forward=_rotate_half,
      grad=lambda g: [g.op("RotateHalf", [g.dy], axis=int(g.node.attr("axis", -1)),
                           sign=-int(g.node.attr("sign", 1)))])
