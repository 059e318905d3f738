"""Tracing a Module's forward into the one IR Graph.

A `Tensor` is a symbolic value: a graph value name plus the tracer that owns the graph. Every
operation on it appends ONNX nodes (the ones the PyTorch exporter would emit), so a traced model
is the same Graph an ONNX import produces and every pass, backend and the trainer apply as is.

The batch dim stays symbolic without teaching every shape rule about symbols: the forward is
traced once, but each node's shape is inferred twice, for two different stand-in batch sizes
(`Tracer.graph` and `Tracer.shadow`). A dim that differs between the two depends on the batch;
`Tensor.shape` hands such dims out as `SymInt`s, and a Reshape whose target uses one writes 0
(copy the input dim) or -1 (infer) instead of a number, so the graph fits every batch size.
"""

from __future__ import annotations

import contextlib
import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import AnygradError, ShapeError
from ..ir.graph import Graph, Node, TensorInfo, info_of
from ..ir.infer import infer_node

# Stand-in sizes of the k-th symbolic input dim in the two shape traces (any two distinct
# values > 1 work; 1 would broadcast).
_TRACE_A = (2, 3, 4, 5, 6, 7)
_TRACE_B = (11, 13, 17, 19, 23, 29)


class SymInt(int):
    """A dim that depends on the batch size: the value in the main trace, `alt` in the other.

    Arithmetic with ints keeps both values, so `x.shape[0] * 2` stays symbolic."""

    def __new__(cls, value: int, alt: int):
        obj = super().__new__(cls, value)
        obj.alt = int(alt)
        return obj

    def _both(self, other, fn) -> SymInt | int:
        oa, ob = (int(other), other.alt) if isinstance(other, SymInt) else (other, other)
        if not isinstance(oa, (int, np.integer)):
            return NotImplemented
        a, b = fn(int(self), int(oa)), fn(self.alt, int(ob))
        return a if a == b else SymInt(a, b)

    def __add__(self, o):
        return self._both(o, operator.add)

    def __mul__(self, o):
        return self._both(o, operator.mul)

    def __sub__(self, o):
        return self._both(o, operator.sub)

    def __rsub__(self, o):
        return self._both(o, lambda a, b: b - a)

    def __floordiv__(self, o):
        return self._both(o, operator.floordiv)

    __radd__ = __add__
    __rmul__ = __mul__

    def __repr__(self) -> str:
        return f"SymInt({int(self)}|{self.alt})"


def _pair(d: Any) -> tuple[int, int]:
    return (int(d), d.alt) if isinstance(d, SymInt) else (int(d), int(d))


class Tracer:
    """Builds one Graph from a forward pass: inputs, state (parameters, buffers), constants, nodes."""

    def __init__(self, name: str = "graph"):
        self.graph = Graph(name=name)
        self.shadow = Graph(name=name)  # same nodes, inferred with the other stand-in batch sizes
        self.symbols: dict[str, tuple[int, int]] = {}  # symbolic dim name -> (value A, value B)
        self.state: dict[int, str] = {}  # id(Parameter/Buffer) -> graph name
        self.scopes: list[str] = []
        self.module_paths: dict[int, str] = {}
        self.input_shapes: dict[str, tuple] = {}  # declared shapes, symbols kept
        self._used = Counter()

    # -- naming (as the TorchScript exporter: "/conv1/Conv", "/Relu_1", "/conv1/Conv_output_0") --
    def _unique(self, base: str) -> str:
        n = self._used[base]
        self._used[base] += 1
        return base if n == 0 else f"{base}_{n}"

    def _scoped(self, op: str) -> str:
        return self._unique("/" + "/".join(self.scopes + [op]))

    @contextlib.contextmanager
    def scope(self, module: Any) -> Iterator[None]:
        path = self.module_paths.get(id(module), type(module).__name__)
        parts = [p for p in path.split(".") if p]
        saved = self.scopes
        self.scopes = parts
        try:
            yield
        finally:
            self.scopes = saved

    def _set_info(self, name: str, a: TensorInfo, b: TensorInfo) -> None:
        self.graph.info[name] = a
        self.shadow.info[name] = b

    # -- values ----------------------------------------------------------------------------
    def input(self, name: str, shape: Sequence[int | str | None], dtype: Any) -> Tensor:
        dims_a, dims_b, symbolic = [], [], []
        for i, d in enumerate(shape):
            if d is None or isinstance(d, str):
                k = len(self.symbols)
                if k >= len(_TRACE_A):
                    raise AnygradError(f"input '{name}': at most {len(_TRACE_A)} symbolic dims are supported")
                sym = d if isinstance(d, str) else ("batch" if i == 0 else f"{name}.dim{i}")
                self.symbols[sym] = (_TRACE_A[k], _TRACE_B[k])
                dims_a.append(_TRACE_A[k])
                dims_b.append(_TRACE_B[k])
                symbolic.append(sym)
            else:
                dims_a.append(int(d))
                dims_b.append(int(d))
                symbolic.append(int(d))
        dt = np.dtype(dtype)
        self.graph.inputs.append(name)
        self._set_info(name, TensorInfo(dt, tuple(dims_a)), TensorInfo(dt, tuple(dims_b)))
        self.input_shapes[name] = tuple(symbolic)
        return Tensor(self, name)

    def add_state(self, obj: Any, name: str) -> None:
        """Register a Parameter or Buffer under its state_dict name (not yet in the graph)."""
        self.state.setdefault(id(obj), name)

    def lift(self, obj: Any) -> Tensor:
        """A Tensor for a Parameter/Buffer (its initializer, added on first use)."""
        name = self.state.get(id(obj))
        if name is None:
            raise AnygradError(
                "a Parameter or Buffer that does not belong to the traced module was used in "
                "forward; assign it as an attribute of the module (or a submodule)"
            )
        if name not in self.graph.initializers:
            array = np.array(obj.data)  # a copy: training must not write into the module
            self.graph.initializers[name] = array
            inf = TensorInfo(array.dtype, tuple(array.shape))  # state is never a constant
            self._set_info(name, inf, TensorInfo(inf.dtype, inf.shape))
        return Tensor(self, name)

    def const(self, value: Any, dtype: Any = np.float32) -> Tensor:
        array = np.asarray(value, dtype=dtype)
        name = self._scoped("Constant") + "_output_0"
        self.graph.initializers[name] = array
        self._set_info(name, info_of(array), info_of(array))
        return Tensor(self, name)

    # -- nodes -----------------------------------------------------------------------------
    def ops(self, op: str, inputs: Sequence[Tensor | None], n_out: int = 1, **attrs: Any) -> list[Tensor]:
        name = self._scoped(op)
        names = [i.name if i is not None else "" for i in inputs]
        while names and not names[-1]:
            names.pop()
        node = Node(op, names, [f"{name}_output_{i}" for i in range(n_out)], attrs, name)
        try:
            infer_node(self.graph, node)
        except ShapeError as e:  # name the inputs with their symbolic dims, not the stand-in sizes
            shapes = ", ".join(str(self._symbolic(i)) for i in names if i)
            raise ShapeError(f"{e} (input shapes: {shapes})") from None
        try:
            infer_node(self.shadow, node)
        except ShapeError as e:
            raise ShapeError(
                f"{node.label} only fits one batch size: {e}. Use -1 or x.shape[0] instead "
                "of a number computed from the batch size"
            ) from None
        self.graph.nodes.append(node)
        return [Tensor(self, o) for o in node.outputs]

    def op(self, op: str, inputs: Sequence[Tensor | None], **attrs: Any) -> Tensor:
        return self.ops(op, inputs, 1, **attrs)[0]

    def shape_of(self, name: str) -> tuple[int, ...]:
        a, b = self.graph.info[name].shape, self.shadow.info[name].shape
        return tuple(x if x == y else SymInt(x, y) for x, y in zip(a, b))

    def reshape_spec(self, x: Tensor, shape: Sequence[Any]) -> list[int]:
        """A Reshape target that fits every batch size: batch-dependent entries become 0 or -1."""
        in_a, in_b = self.graph.info[x.name].shape, self.shadow.info[x.name].shape
        pairs = [_pair(d) for d in shape]
        spec = self._spec(pairs, in_a, in_b)
        if spec.count(-1) > 1 and (-1, -1) in pairs:
            # the user's -1 may resolve to the same size in both traces: then it is a plain number
            i = pairs.index((-1, -1))
            rest = pairs[:i] + pairs[i + 1 :]
            known = [int(np.prod([p[k] for p in rest], dtype=np.int64)) for k in (0, 1)]
            totals = [int(np.prod(s, dtype=np.int64)) for s in (in_a, in_b)]
            if all(known) and totals[0] % known[0] == 0 and totals[0] // known[0] * known[1] == totals[1]:
                pairs[i] = (totals[0] // known[0],) * 2
                spec = self._spec(pairs, in_a, in_b)
        if spec.count(-1) > 1:
            raise ShapeError(
                f"reshape of {tuple(self.shape_of(x.name))} to {tuple(shape)}: more than one "
                "dim is unknown or depends on the batch size"
            )
        return spec

    @staticmethod
    def _spec(pairs: list[tuple[int, int]], in_a: tuple, in_b: tuple) -> list[int]:
        spec = []
        for i, (a, b) in enumerate(pairs):
            if a == b:
                spec.append(a)
            elif i < len(in_a) and (in_a[i], in_b[i]) == (a, b):
                spec.append(0)  # the input's own dim at this position
            else:
                spec.append(-1)
        return spec

    # -- result ----------------------------------------------------------------------------
    def finish(self, outputs: Sequence[Tensor], names: Sequence[str]) -> Graph:
        """The model Graph: outputs renamed, only input/output infos kept (as an ONNX import)."""
        g = self.graph
        rename: dict[str, str] = {}
        for t, new in zip(outputs, names):
            producer = next((n for n in g.nodes if t.name in n.outputs), None)
            if producer is None or t.name in rename or t.name in g.outputs:
                # an input, a parameter, or a value returned twice: copy it out
                node = Node("Identity", [t.name], [new], {}, self._scoped("Identity"))
                g.nodes.append(node)
                infer_node(g, node)
                infer_node(self.shadow, node)
            else:
                rename[t.name] = new
            g.outputs.append(new)
        for n in g.nodes:
            n.inputs = [rename.get(i, i) for i in n.inputs]
            n.outputs = [rename.get(o, o) for o in n.outputs]
        for old, new in rename.items():
            self.graph.info[new] = self.graph.info[old]
            self.shadow.info[new] = self.shadow.info[old]
        infos = {name: TensorInfo(g.info[name].dtype, self.input_shapes[name]) for name in g.inputs}
        for name in g.outputs:
            infos[name] = TensorInfo(g.info[name].dtype, self._symbolic(name))
        g.info = infos
        return g

    def _symbolic(self, name: str) -> tuple:
        out = []
        for i, (a, b) in enumerate(zip(self.graph.info[name].shape, self.shadow.info[name].shape)):
            if a == b:
                out.append(int(a))
            else:  # a symbol of the input, or a dim derived from one (named after the value)
                sym = next((s for s, ab in self.symbols.items() if ab == (a, b)), f"{name}.dim{i}")
                out.append(sym)
        return tuple(out)


# -- the active tracer ---------------------------------------------------------------------------
_ACTIVE: list[Tracer] = []


def active() -> Tracer | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def tracing(tracer: Tracer) -> Iterator[Tracer]:
    _ACTIVE.append(tracer)
    try:
        yield tracer
    finally:
        _ACTIVE.pop()


def require_tracer(what: str) -> Tracer:
    t = active()
    if t is None:
        raise AnygradError(
            f"{what} can only be used inside forward while the module is traced; build a "
            "model with module.to_model(input_shape=...) and call predict/train_on_batch on it"
        )
    return t


# -- operands: Tensor and Parameter share the operator overloads --------------------------------
class Operand:
    """Operator overloads and PyTorch-style methods; subclasses say how to become a Tensor."""

    def _t(self) -> Tensor:
        raise NotImplementedError

    # arithmetic (Python scalars become constants of the tensor's dtype)
    def __add__(self, o):
        return _binary("Add", self, o)

    def __radd__(self, o):
        return _binary("Add", o, self)

    def __sub__(self, o):
        return _binary("Sub", self, o)

    def __rsub__(self, o):
        return _binary("Sub", o, self)

    def __mul__(self, o):
        return _binary("Mul", self, o)

    def __rmul__(self, o):
        return _binary("Mul", o, self)

    def __truediv__(self, o):
        return _binary("Div", self, o)

    def __rtruediv__(self, o):
        return _binary("Div", o, self)

    def __pow__(self, o):
        return _binary("Pow", self, o)

    def __rpow__(self, o):
        return _binary("Pow", o, self)

    def __matmul__(self, o):
        return _binary("MatMul", self, o)

    def __rmatmul__(self, o):
        return _binary("MatMul", o, self)

    def __neg__(self):
        return self._t()._unary("Neg")

    def __pos__(self):
        return self._t()

    def __getitem__(self, index):
        from .functional import getitem

        return getitem(self._t(), index)

    # PyTorch-style methods (thin wrappers over anygrad.nn.functional)
    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    @property
    def ndim(self) -> int:
        return self.dim()

    def reshape(self, *shape):
        from .functional import reshape

        return reshape(self._t(), *shape)

    view = reshape

    def flatten(self, start_dim: int = 0, end_dim: int = -1):
        from .functional import flatten

        return flatten(self._t(), start_dim, end_dim)

    def transpose(self, dim0: int, dim1: int):
        from .functional import transpose

        return transpose(self._t(), dim0, dim1)

    def permute(self, *dims):
        from .functional import permute

        return permute(self._t(), *dims)

    def t(self):
        return self.transpose(0, 1)

    @property
    def T(self):
        return self.permute(*reversed(range(self.dim())))

    def unsqueeze(self, dim: int):
        from .functional import unsqueeze

        return unsqueeze(self._t(), dim)

    def squeeze(self, dim: int | None = None):
        from .functional import squeeze

        return squeeze(self._t(), dim)

    def sum(self, dim=None, keepdim: bool = False):
        from .functional import sum as sum_

        return sum_(self._t(), dim, keepdim)

    def mean(self, dim=None, keepdim: bool = False):
        from .functional import mean

        return mean(self._t(), dim, keepdim)

    def amax(self, dim=None, keepdim: bool = False):
        from .functional import amax

        return amax(self._t(), dim, keepdim)

    def softmax(self, dim: int):
        from .functional import softmax

        return softmax(self._t(), dim)

    def log_softmax(self, dim: int):
        from .functional import log_softmax

        return log_softmax(self._t(), dim)

    def relu(self):
        return self._t()._unary("Relu")

    def sigmoid(self):
        return self._t()._unary("Sigmoid")

    def tanh(self):
        return self._t()._unary("Tanh")

    def exp(self):
        return self._t()._unary("Exp")

    def log(self):
        return self._t()._unary("Log")

    def sqrt(self):
        return self._t()._unary("Sqrt")

    def abs(self):
        return self._t()._unary("Abs")


class Tensor(Operand):
    """A value of the graph being traced."""

    __slots__ = ("name", "tracer")

    def __init__(self, tracer: Tracer, name: str):
        self.tracer = tracer
        self.name = name

    def _t(self) -> Tensor:
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        """Static dims as ints, batch-dependent dims as SymInt (usable in reshape/view)."""
        return self.tracer.shape_of(self.name)

    @property
    def dtype(self) -> np.dtype:
        return self.tracer.graph.info[self.name].dtype

    def _unary(self, op: str, **attrs) -> Tensor:
        return self.tracer.op(op, [self], **attrs)

    def __repr__(self) -> str:
        return f"Tensor('{self.name}', shape={self.shape}, dtype={self.dtype})"

    def __bool__(self):
        raise AnygradError(
            f"the truth value of traced tensor '{self.name}' is unknown while tracing; "
            "control flow cannot depend on tensor values"
        )

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self):
        raise AnygradError("iterating over a traced tensor is not supported; index it instead")


def as_tensor(value: Any, like: Tensor | None = None) -> Tensor:
    """A Tensor for a Tensor, Parameter/Buffer, or a constant (numbers take `like`'s dtype)."""
    if isinstance(value, Operand):
        return value._t()
    tracer = like.tracer if like is not None else require_tracer("a constant")
    array = np.asarray(value)
    if like is not None and array.dtype.kind in "biuf" and not isinstance(value, np.ndarray):
        array = array.astype(like.dtype)
    elif array.dtype == np.float64:
        array = array.astype(np.float32)
    return tracer.const(array, array.dtype)


def _binary(op: str, a: Any, b: Any) -> Tensor:
    ta = a._t() if isinstance(a, Operand) else None
    tb = b._t() if isinstance(b, Operand) else None
    like = ta if ta is not None else tb
    return like.tracer.op(op, [as_tensor(a, like), as_tensor(b, like)])
