"""What Model.compile sets up: precision, the devices (one, several, or device='auto''s
candidates), the heads from `loss=`, the optimizer and its parameter groups, the initial state on
the backend (weights, RNG seed, rates), the step settings (clipping, accumulation) and the
schedule.

Separate from the Model class because it is the one place that reads compile's arguments and
puts a Model into its compiled state; the Model keeps the signature users call.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..backends.base import Backend
from ..errors import ConfigError
from ..ir.passes import RNG_STATE
from ..losses import Loss
from ..optim.base import Optimizer
from ..strategy import for_devices
from .heads import build_heads
from .placement import claim
from .rates import resolve_groups, set_scheduler
from .state import state_dict

if TYPE_CHECKING:
    from .core import Model


def compile_model(model: Model, loss: str | Loss | Mapping[str, str | Loss], optimizer: Optimizer | None,
                  device: str | Backend | list, seed: int, *, loss_weights: Mapping[str, float] | None,
                  clip_norm: float | None, accumulate: int, limits: str | None, memory_budget: int | str | None,
                  torch_compile: bool | str, precision: str, scheduler: Any, scheduler_interval: str | None,
                  loss_output: str | None, loss_options: dict[str, Any]) -> Model:
    """Model.compile's work (its docstring says what each argument means)."""
    from ..devices import auto_backends, check_device_settings, get_backend, use_torch_compile
    from ..program import check_precision
    refuse_torch(optimizer, "optimizer")
    refuse_torch(scheduler, "scheduler")
    check_device_settings(limits, memory_budget)  # on every device, a Backend given too
    model.precision = check_precision(precision)
    devices = None
    model.auto_candidates = []
    if isinstance(device, str) and device.strip().lower() == "auto" and not torch_compile:
        candidates = auto_backends(limits=limits, memory_budget=memory_budget, precision=model.precision)
        device = candidates[0]
        model.auto_candidates = candidates if len(candidates) > 1 else []
    if isinstance(device, (list, tuple)) or (isinstance(device, str) and "," in device):
        from ..devices import device_list, open_backends
        devices = open_backends(device_list(device) or list(device if isinstance(device, (list, tuple))
                                                            else [device]), limits, memory_budget)
        device = devices[0]
    model.heads = build_heads(model.graph, loss, loss_weights, loss_options, loss_output)
    model.loss = model.heads[0].loss
    model._metric_specs = {}
    if optimizer is None:
        from ..optim import SGD
        optimizer = SGD(lr=0.01)
    optimizer = resolve_optimizer(optimizer)
    model.optimizer = optimizer
    resolve_groups(model, keep_rates=False)
    state = state_dict(model) if model.backend is not None else None
    backend = (device if isinstance(device, Backend)
               else get_backend(device, limits=limits, memory_budget=memory_budget,
                                precision=model.precision))
    for each in devices or [backend]:
        claim(each, model)
        use_torch_compile(each, torch_compile)
    model.backend = backend
    for each in devices or [backend]:  # every device runs f16, or (one lacks it) every device f32
        if model.precision == "f16":
            model.precision = each.check_precision(model.precision)
    model.seed = seed
    model._programs.clear()
    for name in model.graph.state_names:
        value = state[name] if state and name in state else model.graph.initializers[name]
        model.backend.set_state(name, value)
    model.backend.set_state(RNG_STATE, np.array([seed & 0xFFFFFFFF, 0], np.uint32))
    for group, lr in zip(model.param_groups, model._group_lrs):  # this optimizer's rates, not a former one's
        model.backend.set_state(group.lr_state, np.array(lr, np.float32))
    configure_step(model, clip_norm=clip_norm, accumulate=accumulate)
    model.scheduler = None
    if scheduler is not None:
        set_scheduler(model, scheduler, scheduler_interval)
    elif scheduler_interval is not None:
        raise ConfigError(f"scheduler_interval={scheduler_interval!r} without a scheduler; "
                          "pass scheduler= too")
    model.devices = list(devices or [backend])
    model.strategy = for_devices(model, model.devices)  # several: DataParallel (anygrad.distributed)
    return model


def torch_class(obj: Any) -> str | None:
    """'torch.optim.SGD' (or 'torch.optim.lr_scheduler.StepLR') when `obj` is a torch.optim
    optimizer or LR scheduler, a subclass of one too; None otherwise. Duck-typed by the classes'
    modules, so that torch is not imported (it may not be installed)."""
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module == "torch.optim" or module.startswith("torch.optim."):
            where = "torch.optim.lr_scheduler" if module.startswith("torch.optim.lr_scheduler") else "torch.optim"
            return f"{where}.{cls.__name__}"
    return None


def refuse_torch(obj: Any, what: str) -> None:
    """A ConfigError for a torch optimizer or LR scheduler given as compile's `what`, naming the
    conversion (anygrad.optim.from_torch), instead of a failure deep in its parameter groups."""
    name = torch_class(obj)
    if name is not None:
        raise ConfigError(f"{what}= is a {name}; convert it with anygrad.optim.from_torch({what}, module), "
                          "module being the nn.Module it was built for (the one given to anygrad.from_torch)")


def resolve_optimizer(optimizer: Any) -> Optimizer:
    """compile's optimizer=: an Optimizer, or its name ("adam", as Keras users write it) looked up
    with anygrad.optim.get_optimizer at its defaults; anything else is a ConfigError."""
    if isinstance(optimizer, str):
        from ..optim import get_optimizer
        return get_optimizer(optimizer)  # an unknown name: a ConfigError listing the names
    if not isinstance(optimizer, Optimizer):
        raise ConfigError(f"optimizer= must be an anygrad optimizer (anygrad.optim.Adam(lr=...)) or its name "
                          f"('adam', 'sgd', ...), got {type(optimizer).__name__}")
    return optimizer


def configure_step(model: Model, clip_norm: float | None = None, accumulate: int = 1) -> Model:
    """Model.configure_step: check and set clipping and accumulation; drop the training programs."""
    if clip_norm is not None and not (float(clip_norm) > 0 and np.isfinite(clip_norm)):
        raise ConfigError(f"clip-grad-norm must be a positive number, got {clip_norm}")
    if int(accumulate) != accumulate or accumulate < 1:
        raise ConfigError(f"accumulate must be a whole number of batches >= 1, got {accumulate}")
    model.clip_norm = None if clip_norm is None else float(clip_norm)
    model.accumulate = int(accumulate)
    model.micro_step = 0
    model._programs = {k: v for k, v in model._programs.items() if k[0] != "train"}
    return model
