"""Module, Parameter, Buffer: PyTorch's model-building API over numpy state, traced into a Graph.

A Module registers its submodules, parameters and buffers as attributes, in order, and names them
as PyTorch does (`conv1.weight`, `norm1.running_mean`), so PyTorch state_dicts load by name.
`to_model` traces `forward` once, with a symbolic batch dim, into the Graph an ONNX import
would give (initializers named by the state_dict keys) and wraps it in an `anygrad.Model`.
There is no train()/eval() behaviour to switch: training and inference are graph rewrites
(BatchNormalization, Dropout) that the Model applies; `train()`/`eval()` exist for ported code.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AnygradError, ConfigError
from ..model import Model
from .tracing import Operand, Tensor, Tracer, require_tracer, tracing


def _host_array(value: Any) -> np.ndarray:
    """numpy array of a state_dict value (numpy, or anything with .detach().cpu().numpy())."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _as_float(data: Any) -> np.ndarray:
    array = _host_array(data)
    return array.astype(np.float32) if array.dtype == np.float64 else array.copy()


class Parameter(Operand):
    """A trainable tensor of a Module (numpy data); usable in forward like a Tensor."""

    def __init__(self, data: Any, requires_grad: bool = True):
        self.data = _as_float(data)
        self.requires_grad = requires_grad

    def _t(self) -> Tensor:
        return require_tracer("a Parameter").lift(self)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def numpy(self) -> np.ndarray:
        return self.data.copy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.data if dtype is None else self.data.astype(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"


class Buffer(Parameter):
    """Non-trainable state (BatchNorm running statistics); `persistent` ones are in the state_dict."""

    def __init__(self, data: Any, persistent: bool = True):
        super().__init__(data, requires_grad=False)
        self.persistent = persistent


@dataclass
class IncompatibleKeys:
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


class Module:
    """Base class of every layer and model: subclass it, assign layers in __init__, write forward."""

    training = True

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})

    # -- registration -----------------------------------------------------------------------
    def _dicts(self) -> tuple[dict, dict, dict]:
        try:
            return self.__dict__["_parameters"], self.__dict__["_buffers"], self.__dict__["_modules"]
        except KeyError:
            raise AnygradError(
                f"{type(self).__name__}: call super().__init__() before assigning layers or parameters"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, (Parameter, Module))
            or name in self.__dict__.get("_parameters", ())
            or name in self.__dict__.get("_modules", ())
            or name in self.__dict__.get("_buffers", ())
        ):
            params, buffers, modules = self._dicts()
            if isinstance(value, Buffer):
                target = buffers
            elif isinstance(value, Module):
                target = modules
            elif isinstance(value, Parameter) or value is None:
                target = params  # None: an absent optional parameter (bias=False)
            else:
                raise AnygradError(
                    f"{type(self).__name__}.{name}: cannot replace a registered parameter, "
                    f"buffer or module by a {type(value).__name__}"
                )
            for d in (params, buffers, modules):
                if d is not target:
                    d.pop(name, None)
            target[name] = value  # a reassigned name keeps its place in the order, as in torch
            self.__dict__.pop(name, None)
            return
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:  # only called when normal lookup fails
        for key in ("_parameters", "_buffers", "_modules"):
            d = self.__dict__.get(key)
            if d is not None and name in d:
                return d[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for d in self._dicts():
            if name in d:
                del d[name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        self._dicts()[0][name] = param

    def register_buffer(self, name: str, value: Any, persistent: bool = True) -> None:
        self._dicts()[1][name] = None if value is None else Buffer(value, persistent)

    def add_module(self, name: str, module: Module | None) -> None:
        self._dicts()[2][name] = module

    # -- forward ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer = require_tracer(f"calling {type(self).__name__}")
        with tracer.scope(self):
            return self.forward(*args, **kwargs)

    # -- traversal (PyTorch order: own parameters, own buffers, then children depth first) ------
    def named_children(self) -> Iterator[tuple[str, Module]]:
        yield from ((k, m) for k, m in self._modules.items() if m is not None)

    def children(self) -> Iterator[Module]:
        return (m for _, m in self.named_children())

    def named_modules(self, prefix: str = "", _seen: set | None = None) -> Iterator[tuple[str, Module]]:
        seen = set() if _seen is None else _seen
        if id(self) in seen:
            return
        seen.add(id(self))
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name, seen)

    def modules(self) -> Iterator[Module]:
        return (m for _, m in self.named_modules())

    def _named_members(self, key: str, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        for path, module in self.named_modules(prefix):
            for name, value in module.__dict__[key].items():
                if value is None or id(value) in seen:
                    continue
                seen.add(id(value))
                yield (f"{path}.{name}" if path else name), value

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        return self._named_members("_parameters", prefix)

    def parameters(self) -> Iterator[Parameter]:
        return (p for _, p in self.named_parameters())

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Buffer]]:
        return self._named_members("_buffers", prefix)

    def buffers(self) -> Iterator[Buffer]:
        return (b for _, b in self.named_buffers())

    def num_parameters(self) -> int:
        return int(sum(p.data.size for p in self.parameters()))

    def _state_items(self) -> Iterator[tuple[str, Parameter]]:
        for path, module in self.named_modules():
            dot = f"{path}." if path else ""
            for name, p in module._parameters.items():
                if p is not None:
                    yield dot + name, p
            for name, b in module._buffers.items():
                if b is not None and b.persistent:
                    yield dot + name, b

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and persistent buffers by PyTorch name, as numpy copies."""
        return {name: p.data.copy() for name, p in self._state_items()}

    def load_state_dict(self, state: dict[str, Any] | str | os.PathLike, strict: bool = True) -> IncompatibleKeys:
        """Copy values in by name from a state_dict or a file (.pt/.pth read without torch,
        .safetensors, .npz). Every missing, unexpected (strict) and mis-shaped key is reported
        together in one AnygradError; nothing is changed when any is found."""
        if isinstance(state, (str, os.PathLike)):
            from .. import torchfile
            state = torchfile.load(state)
        own = dict(self._state_items())
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        arrays = {k: _host_array(v) for k, v in state.items() if k in own}
        misshaped = [
            f"{k}: given {tuple(a.shape)}, expected {own[k].shape}"
            for k, a in arrays.items()
            if tuple(a.shape) != own[k].shape
        ]
        problems = []
        if strict and missing:
            problems.append(f"{len(missing)} missing key(s): {', '.join(missing)}")
        if strict and unexpected:
            problems.append(f"{len(unexpected)} unexpected key(s): {', '.join(unexpected)}")
        if misshaped:
            problems.append(f"{len(misshaped)} key(s) of the wrong shape: {'; '.join(misshaped)}")
        if problems:
            raise AnygradError(
                f"cannot load the state_dict into {type(self).__name__}: "
                + ". ".join(problems)
                + ". Check that the model definition matches the one that saved it"
                + (" (or pass strict=False to skip missing/unexpected keys)" if not misshaped else "")
            )
        for k, a in arrays.items():
            own[k].data = a.astype(own[k].data.dtype)
        return IncompatibleKeys(missing, unexpected)

    def load_from(self, model: Model) -> Module:
        """Copy a Model's current state (e.g. after training) back into this module by name."""
        state = model.state_dict()
        own = dict(self._state_items()) | dict(self.named_buffers())  # non-persistent buffers too
        foreign = [k for k in state if k not in own]
        misshaped = [k for k in state if k in own and tuple(state[k].shape) != own[k].shape]
        if foreign or misshaped:
            raise AnygradError(
                f"the model's state does not fit {type(self).__name__}: unknown name(s) {foreign[:10]}, "
                f"other shapes for {misshaped[:10]}; was the model traced from this module?"
            )
        for k, value in state.items():
            own[k].data = np.array(value, dtype=own[k].data.dtype)
        return self

    def init_parameters(self, seed: int) -> Module:
        """Redraw every layer's initial values (PyTorch defaults) from a generator seeded by `seed`."""
        rng = np.random.default_rng(seed)
        for m in self.modules():
            reset = getattr(m, "reset_parameters", None)
            if reset is not None:
                reset(rng)
        return self

    # -- compatibility with PyTorch code (modes are graph rewrites here) -------------------------
    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    # -- tracing ------------------------------------------------------------------------------------
    def to_model(
        self,
        input_shape: Sequence[int | str | None],
        dtype: Any = np.float32,
        input_name: str = "input",
        output_name: str = "output",
    ) -> Model:
        """Trace forward into a trainable anygrad.Model (None/str dims stay symbolic)."""
        return trace(self, input_shape, dtype, input_name, output_name)

    # -- printing -----------------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        children = [f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ("\n" + "\n".join(children) + "\n)" if children else ")")


def trace(
    module: Module,
    input_shape: Sequence[int | str | None],
    dtype: Any = np.float32,
    input_name: str = "input",
    output_name: str = "output",
) -> Model:
    """Trace `module.forward` once into a Graph and return it as a trainable `anygrad.Model`.

    Dims given as None (or a name) are symbolic: the model then runs at any size there (the
    batch). The graph's initializers are the module's parameters and buffers by state_dict name.
    """
    if not isinstance(module, Module):
        raise ConfigError(f"trace needs an anygrad.nn.Module, got {type(module).__name__}")
    if isinstance(input_shape, (str, bytes)) or not hasattr(input_shape, "__iter__"):
        raise ConfigError(f"input_shape must be a tuple of dims, batch first, like (None, {input_shape!r}), "
                          f"got {type(input_shape).__name__} {input_shape!r}")
    tracer = Tracer(name=type(module).__name__)
    for path, m in module.named_modules():
        tracer.module_paths[id(m)] = path
    for name, p in module._state_items():
        tracer.add_state(p, name)
    for name, b in module.named_buffers():  # non-persistent buffers are graph constants of their own
        tracer.add_state(b, name)
    with tracing(tracer):
        x = tracer.input(input_name, tuple(input_shape), dtype)
        out = module(x)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or not all(isinstance(o, Operand) for o in outs):
        raise AnygradError(
            f"{type(module).__name__}.forward must return a tensor (or a tuple of tensors), "
            f"got {type(out).__name__}"
        )
    names = [output_name] if len(outs) == 1 else [f"{output_name}_{i}" for i in range(len(outs))]
    with tracing(tracer):
        graph = tracer.finish([o._t() for o in outs], names)
    by_name = dict(module._state_items()) | dict(module.named_buffers())
    used = [n for n in by_name if n in graph.initializers]
    graph.params = [n for n in used if by_name[n].requires_grad]
    graph.buffers = [n for n in used if not by_name[n].requires_grad]
    return Model(graph, source=f"anygrad.nn:{type(module).__name__}")
