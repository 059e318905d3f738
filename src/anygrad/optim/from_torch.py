"""`anygrad.optim.from_torch(obj, module)`: a torch.optim optimizer (or LR scheduler) as anygrad's.

The optimizer must have been built for `module`, the nn.Module given to `anygrad.from_torch`:
its parameter objects are named through `module.named_parameters()`, so every torch group
becomes a group over those PyTorch names (which the imported Model knows) with all its
hyperparameters. One table row per torch class says which settings carry over, which must keep
their default (a setting anygrad does not implement is an error naming it), and which are
execution hints to ignore (`foreach`, `fused`). LR schedulers go to the scheduler table of
optim/torch_schedulers.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .adadelta import Adadelta
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .base import Optimizer
from .groups import exact
from .rmsprop import RMSprop
from .sgd import SGD

# Keys of a torch group that describe how it runs, not what it computes.
IGNORED = ("foreach", "fused", "param_names")


@dataclass(frozen=True)
class TorchOptimizerRow:
    """How one torch.optim class becomes anygrad's."""

    optimizer: type[Optimizer]
    settings: tuple[str, ...]                    # torch group keys anygrad takes under the same name
    defaults_only: dict[str, Any] = field(default_factory=dict)  # keys anygrad supports at this value only
    # a flag that picks the anygrad class (torch.optim.Adam(decoupled_weight_decay=True) is AdamW)
    flag: tuple[str, dict[Any, type[Optimizer]]] | None = None
    # settings torch reads from the constructor only, whatever a group says (Adagrad fills every
    # parameter's sum with the constructor's initial_accumulator_value)
    from_defaults: tuple[str, ...] = ()


_ADAM = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
_DECOUPLED = ("decoupled_weight_decay", {False: Adam, True: AdamW})
OPTIMIZER_TABLE: dict[str, TorchOptimizerRow] = {
    "SGD": TorchOptimizerRow(SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
                             {"differentiable": False}),
    "Adam": TorchOptimizerRow(Adam, _ADAM, {"capturable": False, "differentiable": False}, _DECOUPLED),
    "AdamW": TorchOptimizerRow(AdamW, _ADAM, {"capturable": False, "differentiable": False}, _DECOUPLED),
    "Adagrad": TorchOptimizerRow(Adagrad, ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps",
                                           "maximize"), {"differentiable": False},
                                 from_defaults=("initial_accumulator_value",)),
    "RMSprop": TorchOptimizerRow(RMSprop, ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
                                 {"capturable": False, "differentiable": False}),
    "Adadelta": TorchOptimizerRow(Adadelta, ("lr", "rho", "eps", "weight_decay", "maximize"),
                                  {"capturable": False, "differentiable": False}),
}


def from_torch(obj: Any, module: Any) -> Any:
    """anygrad's equivalent of a torch optimizer or LR scheduler built for `module`.

    An optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adadelta) becomes the anygrad optimizer of
    the same class and defaults, with one parameter group per torch group, in torch's order,
    selecting its parameters by their names in `module`; pass it to `Model.compile(optimizer=...)`
    of the Model `anygrad.from_torch(module, ...)` made. A group's rate is its `initial_lr` when
    a scheduler was already built on the optimizer (convert that scheduler too), else its `lr`.
    Every trainable parameter of `module` must be in some group (torch would leave the others
    unchanged: set requires_grad_(False) on those). Unsupported settings (capturable,
    differentiable, a tensor lr, a subclass of a torch optimizer) are a ConfigError naming them.
    """
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"optim.from_torch needs the torch.nn.Module the optimizer was built for, "
                          f"not {type(module).__name__}")
    if isinstance(obj, torch.optim.Optimizer):
        return optimizer_from_torch(obj, module)
    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if isinstance(obj, schedulers):
        from .torch_schedulers import scheduler_from_torch
        return scheduler_from_torch(obj, module)
    raise ConfigError(f"optim.from_torch takes a torch.optim optimizer or LR scheduler, not {type(obj).__name__}")


def optimizer_from_torch(opt: Any, module: Any) -> Optimizer:
    """See from_torch: the optimizer half."""
    torch = _torch()
    cls = type(opt).__name__
    row = OPTIMIZER_TABLE.get(cls)
    if row is None or type(opt) is not getattr(torch.optim, cls, None):
        raise ConfigError(f"optim.from_torch: {type(opt).__module__}.{cls} is not supported; anygrad converts "
                          f"torch.optim's {', '.join(OPTIMIZER_TABLE)} (not subclasses: their step may differ)")
    if any(float(st.get("step", 1)) > 0 for st in opt.state.values() if st):  # Adagrad's starts at step 0
        raise ConfigError(f"optim.from_torch: this {cls} has already taken steps (it holds state); convert it "
                          "before training with it, so that anygrad starts from the same state")
    names = {id(p): n for n, p in module.named_parameters()}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    kind = _kind(row, opt.defaults, cls, "defaults")
    defaults = _settings(row, opt.defaults, cls, "defaults")
    groups, listed = [], set()
    for i, group in enumerate(opt.param_groups):
        where = f"param_groups[{i}]"
        if _kind(row, group, cls, where) is not kind:
            raise ConfigError(f"optim.from_torch: {cls} {where} sets {row.flag[0]}={group[row.flag[0]]!r}, "
                              "unlike the other groups; anygrad's groups share one update rule")
        params = []
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigError(f"optim.from_torch: {cls} {where} holds a parameter of shape {list(p.shape)} "
                                  f"that is not a parameter of the given {type(module).__name__}; pass the module "
                                  "the optimizer was built for")
            listed.add(names[id(p)])
            if p.requires_grad:  # torch skips a parameter without a gradient; anygrad's come in frozen
                params.append(exact(names[id(p)]))
        settings = {**_settings(row, group, cls, where), **{k: defaults[k] for k in row.from_defaults if k in defaults}}
        if "initial_lr" in group:  # a scheduler was built on it: the group's base rate
            settings["lr"] = _number(group["initial_lr"], cls, where, "initial_lr")
        groups.append({"params": params, **settings})
    missing = sorted(trainable - listed)
    if missing:
        raise ConfigError(f"optim.from_torch: {cls} does not update {', '.join(missing[:5])}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                          + " (in no param group), which anygrad would train; call requires_grad_(False) on "
                          "them before anygrad.from_torch, or add them to a group")
    try:
        return kind(**defaults, param_groups=groups)
    except ConfigError as e:
        raise ConfigError(f"optim.from_torch: {e}") from None


def _kind(row: TorchOptimizerRow, group: dict, cls: str, where: str) -> type[Optimizer]:
    if row.flag is None:
        return row.optimizer
    key, classes = row.flag
    value = group.get(key, row.optimizer is AdamW)
    if value not in classes:
        raise ConfigError(f"optim.from_torch: {cls} {where}: {key}={value!r} is not supported")
    return classes[value]


def _settings(row: TorchOptimizerRow, group: dict, cls: str, where: str) -> dict[str, Any]:
    """The anygrad settings of a torch group (or its defaults); refuses what anygrad lacks."""
    known = set(row.settings) | set(row.defaults_only) | set(IGNORED) | {"params", "initial_lr"}
    known |= {row.flag[0]} if row.flag else set()
    for key, value in group.items():
        if key not in known:
            raise ConfigError(f"optim.from_torch: {cls} {where} has the setting '{key}', which anygrad does not "
                              "implement")
        if key in row.defaults_only and value != row.defaults_only[key]:
            raise ConfigError(f"optim.from_torch: {cls} {where} sets {key}={value!r}, which anygrad does not "
                              f"implement; build the optimizer with {key}={row.defaults_only[key]!r}")
    out: dict[str, Any] = {}
    for key in row.settings:
        if key in group:
            value = group[key]
            out[key] = (tuple(_number(v, cls, where, key) for v in value) if isinstance(value, (tuple, list))
                        else value if isinstance(value, bool) else _number(value, cls, where, key))
    return out


def _number(value: Any, cls: str, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        what = "a tensor" if type(value).__name__ == "Tensor" else type(value).__name__
        raise ConfigError(f"optim.from_torch: {cls} {where}: {key} is {what}, which anygrad does not implement; "
                          f"build the optimizer with a Python float {key}")
    return float(value)


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ConfigError("optim.from_torch needs PyTorch (pip install torch)") from None
    return torch


__all__ = ["OPTIMIZER_TABLE", "TorchOptimizerRow", "from_torch", "optimizer_from_torch"]
