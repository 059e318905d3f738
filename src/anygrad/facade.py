"""Facade operations: Model methods whose work lives in a layer above the Model.

`Model.fit` trains (anygrad.train), `Model.evaluate` and `Model.predict` read the data sources fit
takes (anygrad.data), and `Model.load_state_dict` and its kin read and write PyTorch weights
(anygrad.frontends). Those packages import the Model, so the Model must not import them
(not even lazily: that ties model/ into one import circle with everything above it). Instead each
package registers its functions here when it is imported (`import anygrad` imports both), and the
Model's methods call them through `operation(name)`. The table below is the whole contract: an
operation the Model may call, the package that provides it, and the call it makes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class FacadeOperation:
    """One function a Model method calls without importing it."""

    name: str      # the key the Model asks for
    package: str   # the package that registers it (named in the error when it is missing)
    call: str      # how the Model calls it


OPERATIONS: dict[str, FacadeOperation] = {op.name: op for op in [
    FacadeOperation("fit", "anygrad.train", "fit(model, train, valid, overwrite=, **settings) -> FitResult"),
    FacadeOperation("one_pass", "anygrad.data",
                    "one_pass(data, batch_size=, loss_in_graph=, with_targets=, role=) -> iterator of (inputs, targets)"),
    FacadeOperation("load_state_dict", "anygrad.frontends",
                    "load_state_dict(model, source, strict=, key=) -> LoadResult"),
    FacadeOperation("to_torch_state_dict", "anygrad.frontends",
                    "to_torch_state_dict(model) -> {PyTorch name: numpy array}"),
    FacadeOperation("to_torch_tensors", "anygrad.frontends",
                    "to_torch_tensors({name: numpy array}) -> {name: torch tensor}"),
    FacadeOperation("save_safetensors", "anygrad.frontends", "save_safetensors(model, path) -> Path"),
    FacadeOperation("save_adapters", "anygrad.frontends",
                    "save_adapters(model, folder, overwrite=) -> Path"),
]}

_registered: dict[str, Callable[..., Any]] = {}


def register(name: str, function: Callable[..., Any]) -> None:
    """Provide the operation `name` of OPERATIONS (the package that owns it does, when imported)."""
    if name not in OPERATIONS:
        raise KeyError(f"'{name}' is not a facade operation; declare it in anygrad.facade.OPERATIONS")
    _registered[name] = function


def operation(name: str) -> Callable[..., Any]:
    """The function registered for `name`; a ConfigError naming the package to import if none is."""
    function = _registered.get(name)
    if function is None:
        package = OPERATIONS[name].package
        raise ConfigError(f"'{name}' needs {package}: import it first (import anygrad does)")
    return function
