"""The writer: walks the graph once, in order, and writes the module's source (`generate`)."""
from __future__ import annotations

import keyword
import re
import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import AnygradError
from ...ir.graph import Node, TensorInfo
from ...ir.registry import get_op
from ...model import Model
from .format import _BUILTINS, INDENT, _array, _identifier, _module_path, _num, _op_part, _snake, _str, _value
from .patterns import _COMPOSITES, _FUNCTIONS, _LAYERS, Composite, Function, Layer, LayerUse
from .shapes import _PER_BATCH_LIMIT, _Dim, _dynamic_reshape, _Graph, _private_chain_nodes

_RANDOM = {
    "Dropout",
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
}
# Inputs these ops read only for their shape or dtype: a static one makes the output a constant.
_SHAPE_ONLY: dict[str, tuple[int, ...]] = {"Shape": (0,), "Size": (0,), "CastLike": (1,), "EyeLike": (0,)}
_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "Pow": "**", "MatMul": "@"}


# -- the module tree (attributes, nested as the PyTorch module was) ---------------------------------
@dataclass
class _Leaf:
    ctor: str
    is_module: bool = True
    order: int | None = None  # where its first state tensor is in the file (PyTorch's state_dict order)


class _Tree:
    """Dotted paths -> nested attributes; paths that cannot nest are flattened to one name."""

    def __init__(self, reserved: set[str]):
        self.root: dict[str, Any] = {}
        self.reserved = reserved

    def _fits(self, parts: list[str]) -> bool:
        if (
            not parts
            or not parts[0].isidentifier()
            or keyword.iskeyword(parts[0])
            or parts[0] in self.reserved
        ):
            return False
        node = self.root
        for i, p in enumerate(parts):
            if not (p.isidentifier() and not keyword.iskeyword(p) or p.isdigit()) or (
                i and p in self.reserved
            ):
                return False
            if p in node:
                if i == len(parts) - 1 or isinstance(node[p], _Leaf):
                    return False
                node = node[p]
            else:
                return True
        return False

    def add(self, path: str, leaf: _Leaf, default: str) -> str:
        """Insert under `path` (or a free name derived from it); returns the path used."""
        parts = path.split(".") if path else []
        if not self._fits(parts):
            base = _identifier("_".join(parts) if parts else default, default)
            base = base + "_" if base in self.reserved else base
            path, k = base, 1
            while not self._fits([path]):
                path, k = f"{base}_{k}", k + 1
            parts = [path]
        node = self.root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = leaf
        return ".".join(parts)

    def has(self, path: str) -> bool:
        node: Any = self.root
        for p in path.split("."):
            if not isinstance(node, dict) or p not in node:
                return False
            node = node[p]
        return True

    @staticmethod
    def _is_list(node: dict[str, Any]) -> bool:
        keys = list(node)
        return (
            all(k.isdigit() for k in keys)
            and all(not isinstance(v, _Leaf) or v.is_module for v in node.values())
            and max(int(k) for k in keys) < len(keys) + 16
        )

    def access(self, path: str) -> str:
        """`self.layer1[0].conv1` for "layer1.0.conv1"."""
        node, out = self.root, "self"
        for p in path.split("."):
            if isinstance(node, dict) and self._is_list(node):
                out += f"[{p}]"
            elif p.isidentifier():
                out += f".{p}"
            else:
                out = f'getattr({out}, "{p}")'
            node = node[p]
        return out

    @classmethod
    def _order(cls, node: Any) -> int | None:
        if isinstance(node, _Leaf):
            return node.order
        orders = [o for o in (cls._order(v) for v in node.values()) if o is not None]
        return min(orders, default=None)

    @classmethod
    def ordered(cls, node: dict[str, Any]) -> list[tuple[str, Any]]:
        """Children in PyTorch's state_dict order (by their first state tensor in the file);
        a stateless one stays right after the sibling it followed."""
        keys, last = [], -1.0
        for i, (name, child) in enumerate(node.items()):
            order = cls._order(child)
            last = float(order) if order is not None else last + 1e-6
            keys.append((last, i))
        return [item for _, item in sorted(zip(keys, node.items()))]

    def render(self, node: Any, depth: int) -> str:
        if isinstance(node, _Leaf):
            return node.ctor
        pad, inner = INDENT * depth, INDENT * (depth + 1)
        if self._is_list(node):
            items = [node.get(str(i)) for i in range(max(int(k) for k in node) + 1)]
            body = [self.render(v, depth + 1) if v is not None else "nn.Identity()" for v in items]
            return "nn.ModuleList([\n" + "".join(f"{inner}{b},\n" for b in body) + pad + "])"
        named = [f"{k}={self.render(v, depth + 1)}" for k, v in self.ordered(node) if k.isidentifier()]
        numbered = [
            f'"{k}": {self.render(v, depth + 1)}' for k, v in self.ordered(node) if not k.isidentifier()
        ]
        body = named + (["**{" + ", ".join(numbered) + "}"] if numbered else [])
        return "_container(\n" + "".join(f"{inner}{b},\n" for b in body) + pad + ")"


# -- the writer ----------------------------------------------------------------------------------------
@dataclass
class Generated:
    code: str
    state: dict[str, np.ndarray]  # the generated Model's state_dict, from the ONNX file's weights


def _reserved_names() -> set[str]:
    from ...nn.module import Module  # only for the names an attribute must not shadow

    return {n for n in dir(Module) if not n.startswith("__")} | {"from_file"}


_REF = re.compile("\x00([^\x00]*)\x00")


class _Writer:
    """Walks the graph once, in order, writing forward lines and collecting layer attributes.

    Attribute access (`self.layer1[0].conv1`) depends on the whole tree (a container is a
    ModuleList only when all its children are numbered modules), so lines hold `ref(path)`
    placeholders until `resolve`."""

    def __init__(self, model: Model):
        self.G = _Graph(model)
        self.tree = _Tree(_reserved_names())
        self.layers: dict[str, Layer] = {}  # path -> layer
        self.state_ref: dict[str, str] = {}  # graph state tensor -> expression (graph layout)
        self.free_state: dict[str, str] = {}  # path of a free Parameter/Buffer -> graph tensor
        self.scope_paths: dict[str, str] = {}  # module scope of a stateless layer -> its path
        self.leaf_scopes: dict[str, Function] = {}  # scopes that were stateless layers
        self.composites: dict[int, Composite] = {}  # first node -> the function it starts
        self.lines: list[str] = []
        self.vars: dict[str, str] = {}  # graph value -> Python expression
        self.taken = {"self", "F", "nn", "np", "_container", "Model", "Trainable", "load", "os", "Path"}

    @staticmethod
    def ref(path: str) -> str:
        return f"\x00{path}\x00"

    def resolve(self, text: str) -> str:
        return _REF.sub(lambda m: self.tree.access(m.group(1)), text)

    # names
    def var(self, base: str) -> str:
        base = _identifier(base, "x")
        base = base + "_" if base in _BUILTINS else base
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def out_var(self, value: str, base: str) -> str:
        """The variable for a node output: the graph output's own name when it is one."""
        if value in self.G.g.outputs and value.isidentifier() and not keyword.iskeyword(value):
            base = value
        return self.var(base)

    def is_tensor(self, v: str) -> bool:
        return v in self.vars or v in self.G.params or v in self.G.buffers

    # operands
    def expr(self, value: str, like: str | None = None) -> str:
        """Python for a graph value: a variable, the state it is, or a constant literal
        (`F.constant(..., like)` where a tensor operand is needed)."""
        if not value:
            return "None"
        if value in self.vars:
            return self.vars[value]
        G = self.G
        if value in G.params or value in G.buffers:
            if value not in self.state_ref:
                self.add_free_state(value)
            return self.state_ref[value]
        a = G.const(value)
        if a is None:
            raise AnygradError(f"codegen: value '{value}' is used before it is computed")
        if like is None:
            return _array(np.asarray(a))
        return f"F.constant({_array(np.asarray(a))}, {like})"

    def add_free_state(self, value: str) -> None:
        """A parameter or buffer no layer owns: an attribute of its own (zeros until loaded)."""
        G = self.G
        a = G.g.initializers[value]
        kind = "Parameter" if value in G.params else "Buffer"
        ctor = f"nn.{kind}(np.zeros({tuple(a.shape)}, dtype=np.{a.dtype.name}))"
        path = self.tree.add(G.torch_names.get(value, value), _Leaf(ctor, False, G.order[value]), "param")
        self.state_ref[value] = self.ref(path)
        self.free_state[path] = value

    # layers
    def add_layer(self, use: LayerUse, node: Node) -> str | None:
        """The path of the layer attribute for `use`: the same layer called again is reused;
        weights another layer already holds (tied) are left to the generic path (None)."""
        layer = use.layer
        for path, known in self.layers.items():
            if known == layer:
                return path
        if any(tensor in self.state_ref for tensor, _ in layer.state.values()):
            return None
        hint = use.path_hint or ".".join(_module_path(node.name))
        order = min(self.G.order[tensor] for tensor, _ in layer.state.values())
        path = self.tree.add(hint, _Leaf(layer.ctor, True, order), layer.kind)
        self.layers[path] = layer
        for attr, (tensor, transposed) in layer.state.items():
            self.state_ref[tensor] = f"{self.ref(path)}.{attr}" + (".t()" if transposed else "")
        return path

    def assign(self, value: str, base: str, code: str) -> None:
        y = self.out_var(value, base)
        self.lines.append(f"{y} = {code}")
        self.vars[value] = y

    # the walk
    def forward(self) -> None:
        G = self.G
        nodes = [n for n in G.g.nodes if id(n) in G.live]
        for node in nodes:  # constants first: the layer rules read them (a zero bias is no bias)
            if not any(o in G.g.outputs for o in node.outputs):
                self._fold(node)
        G.live = G._live()  # what only folded nodes read is not written either
        nodes = [n for n in nodes if id(n) in G.live]
        # Layer patterns first: a pattern may start before its anchor (Transpose(W) before MatMul).
        matches: dict[int, LayerUse] = {}
        held: set[int] = set()  # nodes waiting for their anchor's decision
        for node in nodes:
            rule, composite = _LAYERS.get(node.op), _COMPOSITES.get(node.op)
            use = rule(G, node) if rule and id(node) not in held else None
            if use is not None:
                matches[id(node)] = use
                held.update(id(m) for m in use.nodes if m is not node)
            c = composite(G, node) if composite and id(node) not in held else None
            if c is not None:
                self.composites[id(node)] = c
                held.update(id(m) for m in c.nodes if m is not node)
        reshapes: dict[int, tuple[list[Any], list[Node]]] = {}
        for node in nodes:
            found = _dynamic_reshape(G, node) if node.op == "Reshape" and id(node) not in held else None
            if found is not None and not any(id(m) in held for m in found[1]):
                reshapes[id(node)] = found
        held.update(_private_chain_nodes(G, reshapes))
        done: set[int] = set()
        leaf_scopes = self.leaf_scopes = self._stateless_scopes()
        for node in nodes:
            if id(node) in done:
                continue
            if id(node) in reshapes:
                dims, chain = reshapes[id(node)]
                if node.inputs[0] in self.vars:
                    x = self.vars[node.inputs[0]]
                    text = ", ".join(
                        d.text(self.expr(d.tensor)) if isinstance(d, _Dim) else str(d) for d in dims
                    )
                    base = "_".join(_module_path(node.name) + [_op_part(node.name, node.op)])
                    self.assign(node.outputs[0], base, f"F.reshape({x}, [{text}])")
                    done.update(id(m) for m in chain)
                    continue
                held.difference_update(id(m) for m in chain)
                for m in chain:  # written once, though other reshapes may share it
                    if any(o and o not in self.vars for o in m.outputs):
                        self._stateless(m, leaf_scopes)
                    done.add(id(m))
            c = self.composites.get(id(node))
            if c is not None:
                if c.x in self.vars:
                    scope = ".".join(_module_path(node.name))
                    self._call(
                        c.function, self.vars[c.x], c.y, scope, "_".join(scope.split(".") + [c.function.fn])
                    )
                    done.update(id(n) for n in c.nodes)
                    continue
                held.difference_update(id(m) for m in c.nodes)
            use = matches.get(id(node))
            if use is None and id(node) in held:
                continue
            path = self.add_layer(use, node) if use is not None and use.x in self.vars else None
            if path is not None:
                done.update(id(n) for n in use.nodes)
                self.assign(use.y, path.replace(".", "_"), f"{self.ref(path)}({self.vars[use.x]})")
                continue
            if use is not None:  # not a layer after all: its other nodes are written as they are
                held.difference_update(id(m) for m in use.nodes)
                for m in use.nodes[: use.nodes.index(node)]:
                    self._stateless(m, leaf_scopes)
                    done.add(id(m))
            self._stateless(node, leaf_scopes)

    def _stateless_scopes(self) -> dict[str, Function]:
        """Module scopes that hold one stateless op kind only (`/relu/Relu`, `/pool/...`): these
        were layers of their own (nn.ReLU(), nn.AdaptiveAvgPool2d(1)) in the PyTorch module."""
        G = self.G
        by_scope: dict[str, list[Node]] = {}
        for n in G.g.nodes:
            if id(n) in G.live:
                by_scope.setdefault(".".join(_module_path(n.name)), []).append(n)
        weighted = {G.torch_names.get(v, v).rpartition(".")[0] for v in G.params | G.buffers}
        out: dict[str, Function] = {}
        for scope, nodes in by_scope.items():
            if not scope or any(w == scope or w.startswith(scope + ".") for w in weighted):
                continue
            if any(s.startswith(scope + ".") for s in by_scope):
                continue
            members = {id(m) for c in self.composites.values() for m in c.nodes[1:]}
            functions = [
                self.composites[id(n)].function
                if id(n) in self.composites
                else _FUNCTIONS[n.op](G, n)
                if n.op in _FUNCTIONS
                else None
                for n in nodes
                if id(n) not in members
            ]
            kinds = {(f.cls, f.cls_args, f.fn_args) for f in functions if f is not None}
            if all(f is not None and f.cls for f in functions) and len(kinds) == 1:
                out[scope] = functions[0]
        return out

    def _fold(self, node: Node) -> None:
        """Compute a node whose inputs are all constants now (exporters leave such chains).

        Shapes count as constants where they are: a node is run for both stand-in batch sizes,
        with the inputs it reads only for their shape or dtype (`_SHAPE_ONLY`) standing in as
        zero-stride arrays, and folded when both runs agree. Small results that differ (a shape
        holding the batch size) are kept per stand-in, so what is computed from their static
        part folds too: the dynamo exporter's zero bias Expand(CastLike(0, x), Shape(W)[:1]),
        the attention scale 1 / sqrt(Shape(q)[-1])."""
        G = self.G
        op = get_op(node.op)
        if op is None or op.forward is None or node.op in _RANDOM or not node.inputs:
            return
        if any(v in G.per_batch for v in node.inputs) and not all(G.small(o) for o in node.outputs if o):
            return  # a batch-sized tensor, not a shape: not worth computing here
        runs = []
        for side, info in enumerate((G.info, G.info_alt)):
            values = []
            for i, v in enumerate(node.inputs):
                a = G.const(v) if v else None
                if a is None and v in G.per_batch:
                    a = G.per_batch[v][side]
                elif a is None and v and i in _SHAPE_ONLY.get(node.op, ()):
                    inf = info.get(v)  # a zero-stride stand-in: only its shape and dtype are read
                    a = None if inf is None or inf.shape is None else np.broadcast_to(
                        np.zeros((), inf.dtype), tuple(int(d) for d in inf.shape))
                if v and a is None:
                    return
                values.append(a)
            try:
                runs.append([np.asarray(o) for o in op.run(node, values)])
            except Exception:  # noqa: BLE001  (not foldable here: written as a node instead)
                return
        a, b = runs
        if all(x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b)):
            G.folded.update((o, x) for o, x in zip(node.outputs, a) if o)
            return
        for o, x, y in zip(node.outputs, a, b):  # depends on the batch size: not a constant
            if o and x.size <= _PER_BATCH_LIMIT and y.size <= _PER_BATCH_LIMIT:
                G.per_batch[o] = (x, y)

    def _stateless(self, node: Node, leaf_scopes: dict[str, Function]) -> None:
        G = self.G
        scope = ".".join(_module_path(node.name))
        base = "_".join(_module_path(node.name) + [_op_part(node.name, node.op)])
        ins = node.inputs
        if all(o in G.folded for o in node.outputs if o):
            return  # computed before the walk
        if node.op == "Slice" and ins and self.is_tensor(ins[0]):
            index = self._index(node)
            if index is not None:
                self.assign(node.outputs[0], base, f"{self.expr(ins[0])}[{index}]")
                return
        if node.op == "Identity" and ins and ins[0] in self.vars:
            self.vars[node.outputs[0]] = self.vars[ins[0]]
            return
        if node.op in _BINARY and len(ins) == 2 and any(self.is_tensor(v) for v in ins):
            self.assign(node.outputs[0], base, self._binary(node))
            return
        if node.op == "Concat" and ins and all(self.is_tensor(v) for v in ins) and len(node.outputs) == 1:
            parts = ", ".join(self.expr(v) for v in ins)
            self.assign(node.outputs[0], base, f"F.cat([{parts}], dim={int(node.attr('axis'))})")
            return
        f = None  # a PyTorch form takes one tensor; other inputs are constants it reads
        if (
            node.op in _FUNCTIONS
            and ins
            and self.is_tensor(ins[0])
            and not any(self.is_tensor(v) for v in ins[1:])
        ):
            f = _FUNCTIONS[node.op](G, node)
        if f is None:
            self._generic(node, base)
            return
        self._call(f, self.expr(ins[0]), node.outputs[0], scope, base)

    def _call(self, f: Function, x: str, y: str, scope: str, base: str) -> None:
        """`self.<scope>(x)` when the scope was a stateless layer of its own, else `F.<fn>(x, ...)`."""
        if scope in self.leaf_scopes and f.cls:
            if scope not in self.scope_paths:
                args = f.cls_args if f.cls_args is not None else f.fn_args
                self.scope_paths[scope] = self.tree.add(scope, _Leaf(f"nn.{f.cls}({args})"), _snake(f.cls))
            path = self.scope_paths[scope]
            self.assign(y, path.replace(".", "_"), f"{self.ref(path)}({x})")
        else:
            self.assign(y, base, f"F.{f.fn}({x}{', ' + f.fn_args if f.fn_args else ''})")

    def _index(self, node: Node) -> str | None:
        """Slice with constant starts/ends/axes/steps as Python indexing: x[:, :, :8]."""
        G = self.G
        x, *rest = node.inputs
        arrays = [G.const(v) for v in rest]
        rank = G.rank(x)
        if len(rest) < 2 or any(a is None for a in arrays) or rank is None:
            return None
        starts, ends = arrays[0].tolist(), arrays[1].tolist()
        axes = arrays[2].tolist() if len(arrays) > 2 else list(range(len(starts)))
        steps = arrays[3].tolist() if len(arrays) > 3 else [1] * len(starts)
        if any(s <= 0 for s in steps) or len({a % rank for a in axes}) != len(axes):
            return None
        parts = [":"] * rank
        for start, end, axis, step in zip(starts, ends, axes, steps):
            text = (str(start) if start else "") + ":" + (str(end) if end < 2**62 else "")
            parts[axis % rank] = text + (f":{step}" if step != 1 else "")
        while len(parts) > 1 and parts[-1] == ":":
            parts.pop()
        return ", ".join(parts)

    def _binary(self, node: Node) -> str:
        G = self.G
        sides = []
        for v, other in zip(node.inputs, reversed(node.inputs)):
            if self.is_tensor(v):
                sides.append(self.expr(v))
                continue
            a = np.asarray(G.const(v))
            if a.ndim == 0 and a.dtype == G.dtype(other) and node.op != "MatMul":
                number = _num(a.item(), a.dtype)  # a Python number takes the tensor's dtype
                sides.append(f"({number})" if number.startswith("-") and not sides else number)  # -1 ** x
            else:
                sides.append(self.expr(v, like=self.expr(other)))
        return f"{sides[0]} {_BINARY[node.op]} {sides[1]}"

    def _generic(self, node: Node, base: str) -> None:
        G = self.G
        args = [f'"{node.op}"'] + [self.expr(v) for v in node.inputs]
        for k, v in node.attrs.items():
            ok = k.isidentifier() and not keyword.iskeyword(k) and k != "n_out"
            args.append(f"{k}={_value(v)}" if ok else f"**{{{k!r}: {_value(v)}}}")
        used = [i for i, o in enumerate(node.outputs) if not G.unused(o)]
        n_out = max(used, default=0) + 1
        if n_out > 1:
            args.append(f"n_out={n_out}")
        call = f"F.onnx_op({', '.join(args)})"
        if len(call) > 80 or "\n" in call:
            call = "F.onnx_op(\n" + "".join(textwrap.indent(f"{a},", INDENT) + "\n" for a in args) + ")"
        if n_out == 1:
            self.assign(node.outputs[0], base, call)
            return
        names = []
        for i, o in enumerate(node.outputs[:n_out]):
            if G.unused(o):
                names.append("_")
            else:
                names.append(self.out_var(o, f"{base}_{i}"))
                self.vars[o] = names[-1]
        self.lines.append(f"{', '.join(names)} = {call}")

    # the result
    def state(self) -> dict[str, np.ndarray]:
        inits = self.G.g.initializers
        out: dict[str, np.ndarray] = {}
        for path, layer in self.layers.items():
            for attr, (tensor, transposed) in layer.state.items():
                a = np.asarray(inits[tensor])
                out[f"{path}.{attr}"] = np.ascontiguousarray(a.T if transposed else a)
            for counter in layer.counters:
                out[f"{path}.{counter}"] = np.array(0, np.int64)
        for path, tensor in self.free_state.items():
            out[path] = np.asarray(inits[tensor])
        return out


def _input_shape(info: TensorInfo) -> str:
    dims = [None if (i == 0 and isinstance(d, str)) else d for i, d in enumerate(info.shape)]
    return (
        "("
        + ", ".join(_str(d) if isinstance(d, str) else repr(d) for d in dims)
        + ("," if len(dims) == 1 else "")
        + ")"
    )


def generate(
    model: Model,
    source: str = "model.onnx",
    module: str = "model.py",
    weights: str = "model.safetensors",
    command: str | None = None,
    weights_written: bool = True,
) -> Generated:
    """Python source of a `Model(anygrad.nn.Module)` for an imported model, and its state_dict.

    `source`, `module` and `weights` are the names written into the file (the ONNX file, the
    generated file, the weights file relative to it); `command` how to regenerate it, less the
    --no-weights added when the weights are not written; `weights_written` whether the weights file
    is written beside it (the docstring says where weights come from otherwise)."""
    g = model.graph
    if not g.inputs:
        raise AnygradError(f"{source}: the graph has no inputs; nothing to generate a forward for")
    w = _Writer(model)
    inputs = []
    for name in g.inputs:
        v = w.var(
            name if name.isidentifier() and not keyword.iskeyword(name) and name not in _BUILTINS else "x"
        )
        w.vars[name] = v
        inputs.append(v)
    w.forward()
    # an output that is a constant still has to be a tensor of the traced graph
    returns = [w.resolve(w.expr(o) if w.is_tensor(o) else w.expr(o, like=inputs[0])) for o in g.outputs]
    init_lines = [f"self.{k} = {w.tree.render(v, 0)}" for k, v in w.tree.ordered(w.tree.root)]
    forward_lines = [w.resolve(line) for line in w.lines]
    base = command or f"anygrad codegen {source} -o {module}"
    command = base if weights_written else f"{base} --no-weights"
    first = g.info[g.inputs[0]]
    dtype = first.dtype.name
    if weights_written:
        weights_doc = f"""
    model = Model.from_file()     # the weights of {source} (in {weights})"""
    else:  # what from_file reads by default is not there: say how to get it, and what else loads
        where = textwrap.fill(f"Written without its weights (--no-weights). To write them beside this file as {weights}, "
                              "where Model.from_file() looks by default, run:", 96)
        other = textwrap.fill("from_file also takes any state_dict file with PyTorch's names: the weights.safetensors "
                              f"of an `anygrad train {source}` run, or a .pt/.pth saved by torch.save (read without "
                              "torch).", 96)
        weights_doc = f"""
{where}

    {base} --weights-only

{other}

    model = Model.from_file("runs/<run>/weights.safetensors")"""
    header = f'''"""PyTorch-style code for {source}, generated by `anygrad codegen`.

Regenerate it with: {command}
{weights_doc}
    model = Model()               # fresh, initialised as PyTorch initialises these layers
    trainable = model.to_model()  # an anygrad.Model: compile, fit, predict, save ONNX
    model.load_from(trainable)    # trained weights back in; model.state_dict() has PyTorch names
"""
from __future__ import annotations

import os
from pathlib import Path
'''
    # one block of third-party imports: the generated file lives in the user's project
    used = "\n".join(init_lines + forward_lines + returns)  # import only what the code uses
    imports = ["", "import numpy as np"] if re.search(r"\bnp\.", used) else [""]
    imports += ["from anygrad import Model as Trainable", "from anygrad import nn"]
    if re.search(r"\bF\.", used):
        imports.append("from anygrad.nn import functional as F")
    imports.append("from anygrad.torchfile import load")
    consts = [
        "",
        f"WEIGHTS = Path(__file__).parent / {_str(weights)}",
        f"INPUT_NAME = {_str(g.inputs[0])}",
        f"INPUT_SHAPE = {_input_shape(first)}",
        f"OUTPUT_NAME = {_str(g.outputs[0])}",
    ]
    container = '''


def _container(**layers: nn.Module | nn.Parameter) -> nn.Module:
    """A module that only holds layers under their PyTorch names (the parent's forward calls them)."""
    module = nn.Module()
    for name, layer in layers.items():
        setattr(module, name, layer)
    return module'''
    uses_container = any("_container(" in line for line in init_lines)
    body = [
        "",
        "",
        "",
        "class Model(nn.Module):",
        f"{INDENT}def __init__(self) -> None:",
        f"{INDENT * 2}super().__init__()",
        *[textwrap.indent(line, INDENT * 2) for line in init_lines],
        "",
        f"{INDENT}def forward(self, {', '.join(inputs)}):",
        *[textwrap.indent(line, INDENT * 2) for line in forward_lines],
        f"{INDENT * 2}return {', '.join(returns)}",
        "",
        f"{INDENT}@classmethod",
        f"{INDENT}def from_file(cls, path: str | os.PathLike = WEIGHTS) -> Model:",
        f'{INDENT * 2}"""A Model holding the weights of a state_dict file: .safetensors, or a .pt/.pth',
        f'{INDENT * 2}written by torch.save (read without torch)."""',
        f"{INDENT * 2}model = cls()",
        f"{INDENT * 2}model.load_state_dict(load(path))",
        f"{INDENT * 2}return model",
        "",
        f"{INDENT}def to_model(self, input_shape=INPUT_SHAPE, dtype={_str(dtype)}, input_name=INPUT_NAME,",
        f"{INDENT}             output_name=OUTPUT_NAME) -> Trainable:",
        f'{INDENT * 2}"""Trace forward into a trainable anygrad.Model (defaults: the ONNX file\'s input',
        f'{INDENT * 2}and output)."""',
        f"{INDENT * 2}return super().to_model(input_shape, dtype, input_name, output_name)",
    ]
    code = (
        header + "\n".join(imports + consts) + (container if uses_container else "") + "\n".join(body) + "\n"
    )
    return Generated(code, w.state())
