"""Which of a Model's parameters train: the names a pattern may use for a parameter (graph and
PyTorch names, tied keys), moving parameters between trainable and frozen, and PyTorch's
embedding padding_idx marked on the graph.

Separate from the Model class because it rewrites the graph's parameter/buffer lists and node
attributes by name patterns, apart from compiling and running steps (which it only invalidates).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError
from ..ir.graph import Graph
from ..optim.groups import match_names
from .rates import resolve_groups

if TYPE_CHECKING:
    from .core import Model


def _identities_of(graph: Graph, name: str) -> set[str]:
    """Values that are `name` passed through Identity nodes (how exporters spell a tied tensor)."""
    same, grown = {name}, True
    while grown:
        grown = False
        for n in graph.nodes:
            if n.op == "Identity" and n.inputs[0] in same and n.outputs[0] not in same:
                same.add(n.outputs[0])
                grown = True
    return same - {name}


def parameter_aliases(model: Model) -> dict[str, set[str]]:
    """Graph name -> the names a pattern may use for it (Model.parameter_aliases)."""
    known: dict[str, Any] = dict(getattr(model.origin, "torch_names", None) or {})
    known.update(getattr(model.torch_binding, "names", None) or {})
    trainable = set(model.graph.params + model.frozen)
    aliases = {n: {n} | ({known[n].key} if n in known else set())
               for n in state_as_imported(model) if n in trainable}
    tied = getattr(model.torch_binding, "aliases", None) or {}  # key -> key of the same tensor
    for names in aliases.values():
        names |= {k for k, same in tied.items() if same in names}
    return aliases


def freeze(model: Model, patterns: tuple[str, ...]) -> list[str]:
    """Make the parameters matching `patterns` buffers (Model.freeze); returns their graph names."""
    names = match_names(parameter_aliases(model), patterns, "freeze")
    set_trainable(model, [p for p in model.graph.params if p not in names])
    return names


def unfreeze(model: Model, patterns: tuple[str, ...]) -> list[str]:
    """Make the frozen parameters matching `patterns` trainable again (Model.unfreeze)."""
    names = match_names(parameter_aliases(model), patterns, "unfreeze")
    set_trainable(model, model.graph.params + [p for p in model.frozen if p in names])
    return names


def set_padding_idx(model: Model, name: str, index: int) -> list[str]:
    """Mark every row lookup of the tables matching `name` with padding_idx `index`
    (Model.set_padding_idx); returns the tables' graph names."""
    graph = model.graph
    tables = match_names(parameter_aliases(model), [name], "padding_idx")
    marked = []
    for table in tables:
        rows = int(graph.initializers[table].shape[0])
        if not isinstance(index, (int, np.integer)) or not -rows <= index < rows:
            raise ConfigError(f"padding_idx for '{name}': {index!r} is not a row of its {rows} embeddings")
        reads = {table} | _identities_of(graph, table)
        lookups = [n for n in graph.nodes if n.op == "Gather" and n.inputs[0] in reads
                   and n.attr("axis", 0) in (0, -len(graph.initializers[table].shape))]
        if not lookups:
            raise ConfigError(f"padding_idx for '{name}': the graph never looks up rows of '{table}' "
                              "(no Gather on axis 0 reads it), so it is not an embedding table")
        for n in lookups:
            n.attrs["padding_idx"] = int(index) % rows
        marked.append(table)
    model._programs.clear()
    return marked


def state_as_imported(model: Model) -> list[str]:
    """state_names in the order they had before any freeze (frozen parameters back in place)."""
    if not model.frozen:
        return model.graph.state_names
    order = {n: i for i, n in enumerate(model._state_order or ())}
    params = sorted(model.graph.params + model.frozen, key=lambda n: order.get(n, len(order)))
    return params + [b for b in model.graph.buffers if b not in model.frozen]


def set_trainable(model: Model, trainable: list[str]) -> None:
    """Train exactly `trainable` (graph names); every other parameter becomes a frozen buffer."""
    g = model.graph
    if model._state_order is None:
        model._state_order = list(g.params)
    order = {n: i for i, n in enumerate(model._state_order)}
    keep = set(trainable)
    frozen = [p for p in g.params + model.frozen if p not in keep]
    g.params = sorted(keep, key=lambda n: order.get(n, len(order)))
    g.buffers = [b for b in g.buffers if b not in keep and b not in frozen] + frozen
    model.frozen = sorted(frozen, key=lambda n: order.get(n, len(order)))
    # Programs bake in which tensors get gradients and optimizer slots. A parameter's slots
    # stay in the backend's state while it is frozen, as torch.optim keeps them.
    model._programs.clear()
    if model.optimizer is not None:
        resolve_groups(model, keep_rates=True)
