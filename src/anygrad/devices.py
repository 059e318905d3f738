"""Device names -> backends: 'auto', 'cpu', 'wgpu', 'wgpu:N', 'wgpu:vulkan|metal|dx12|gl',
'wgpu:native' / 'wgpu:dawn' (the WebGPU implementation: wgpu-native, or Dawn with `[dawn]`, also
with an API: 'wgpu:dawn:vulkan'), and with PyTorch installed (`anygrad-train[torch]`) 'torch', 'torch:cuda[:N]', 'torch:mps', 'torch:cpu'.

`auto` takes the best real GPU through wgpu (discrete, then integrated), through wgpu-native unless
Dawn offers matrix units for the training precision there (f16: subgroup matrices), which it says
in one line (adapters.auto_adapter); without one, torch's
CUDA or MPS device when torch is installed and has one; else the CPU (numpy), which beats a
software rasteriser (lavapipe). A choice other than a wgpu GPU is printed: never a silent switch.
Where both a wgpu GPU and torch's CUDA/MPS are there (`auto_backends`), a model compiled for
`auto` times its own training step on each before its first step and trains on the faster
(`Model._choose_backend`): which one wins depends on the model (on an H100, the founding CNN
is faster through wgpu, the GPT benchmark through torch).
"""
from __future__ import annotations

import sys
from typing import Any

from .backends.base import Backend
from .backends.numpy import NumpyBackend
from .backends.wgpu.device.adapters import AdapterInfo, auto_adapter, best_adapter, list_adapters
from .errors import ConfigError

__all__ = ["AdapterInfo", "auto_backends", "check_device_settings", "get_backend", "list_adapters",
           "use_torch_compile"]


def check_device_settings(limits: str | None = None, memory_budget: int | str | None = None,
                          flags: bool = False) -> None:
    """A ConfigError for a bad `limits` profile (or ANYGRAD_WGPU_LIMITS without one) or
    `memory_budget` size, whatever the device: the
    CPU and torch use neither, but a typo there is still a typo (and would be recorded in a run's
    config.json). Every way to a backend passes here (get_backend, auto_backends, Model.compile,
    `anygrad train`); `flags`: name them as the command line spells them (--memory-budget)."""
    from .backends.wgpu.planning.limits import get_profile, parse_size
    if limits is not None:
        if not isinstance(limits, str):
            raise ConfigError(f"{'--limits' if flags else 'limits'} names a limits profile (a string such as "
                              f"'uhd630'), got {type(limits).__name__}")
        get_profile(limits)
    else:  # ANYGRAD_WGPU_LIMITS: checked as early, before a run folder is claimed or replaced
        get_profile(None)
    if memory_budget is not None:
        parse_size(memory_budget, "--memory-budget" if flags else "memory_budget")


def get_backend(device: str = "auto", limits: str | None = None, memory_budget: int | str | None = None,
                precision: str = "f32") -> Backend:
    """The backend for a device name. `limits`: a wgpu limits profile (webgpu-default, uhd630,
    m1-8gb; see anygrad.backends.wgpu.planning.limits) to train as on that hardware; None: the
    ANYGRAD_WGPU_LIMITS variable, else the adapter's own limits. `memory_budget` ('1.5GB' or
    bytes): what a compiled wgpu step may hold, instead of the profile's. The CPU has neither.
    `precision` ('f32', 'f16'): what `auto` looks for matrix units for. A bad `limits` or
    `memory_budget` is a ConfigError on every device (check_device_settings)."""
    check_device_settings(limits, memory_budget)
    device = (device or "auto").strip().lower()
    if device in ("cpu", "numpy"):
        return NumpyBackend()
    if device == "auto":
        return _auto_backend(_auto_pick(precision), limits, memory_budget)
    if device == "wgpu" or device.startswith("wgpu:"):
        from .backends.wgpu import WgpuBackend
        return WgpuBackend(device, limits=limits, memory_budget=memory_budget)
    if device == "torch" or device.startswith("torch:"):
        from .backends.torch import TorchBackend
        return TorchBackend(device)
    raise ConfigError(f"unknown device '{device}'; use auto, cpu, wgpu, wgpu:N, wgpu:vulkan|metal|dx12|gl, "
                      "wgpu:native, wgpu:dawn, or with PyTorch installed torch, torch:cuda, torch:mps, torch:cpu")


def _auto_pick(precision: str) -> Any:
    """auto_adapter's pick of a real GPU, its reason printed (one line) when it is not wgpu-native's."""
    pick, why = auto_adapter(precision)
    if why:
        print(why, file=sys.stderr)
    return pick


def auto_backends(limits: str | None = None, memory_budget: int | str | None = None,
                  precision: str = "f32") -> list[Backend]:
    """The backends `auto` chooses between for training: a wgpu GPU and torch's CUDA/MPS device
    when there are both (the faster for a model is measured on its first step), else the one
    get_backend('auto') gives (matrix units for `precision` count: auto_adapter)."""
    check_device_settings(limits, memory_budget)
    pick = _auto_pick(precision)
    torch_device = _torch_gpu() if pick is not None else None
    if torch_device is None:
        return [_auto_backend(pick, limits, memory_budget)]
    from .backends.torch import TorchBackend
    from .backends.wgpu import WgpuBackend
    return [WgpuBackend(f"wgpu:{pick[0].index}", limits=limits, memory_budget=memory_budget),
            TorchBackend(f"torch:{torch_device}")]


def _auto_backend(pick: Any, limits: str | None, memory_budget: int | str | None) -> Backend:
    """`auto`'s one choice, given best_adapter's pick of a real GPU (None: there is none)."""
    if pick is not None:
        from .backends.wgpu import WgpuBackend
        return WgpuBackend(f"wgpu:{pick[0].index}", limits=limits, memory_budget=memory_budget)
    from .backends.wgpu.runtime.backend import warn_cpu_fallback
    torch_device = _torch_gpu()
    if torch_device is not None:
        from .backends.torch import TorchBackend
        backend = TorchBackend(f"torch:{torch_device}")
        print(f"anygrad: no GPU adapter through wgpu; using PyTorch's {backend.description}", file=sys.stderr)
        return backend
    soft = best_adapter()
    warn_cpu_fallback("no GPU adapter found" if soft is None else
                      f"only a software adapter ({soft[0].name}) was found")
    return NumpyBackend()


def _torch_gpu() -> str | None:
    """'cuda' or 'mps' when PyTorch is installed and has that device; None otherwise (torch is
    not imported when it is not installed)."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return None
    from .backends.torch import best_torch_device
    try:
        return best_torch_device()
    except Exception:  # noqa: BLE001  (a broken torch install: not a device to choose)
        return None


def use_torch_compile(backend: Backend, torch_compile: bool | str = True) -> None:
    """Put the backend's training steps through torch.compile (`--compile`; a string names the
    torch.compile backend, default inductor), with CUDA graphs on a CUDA device. Only the torch
    backend has torch.compile: any other backend is a ConfigError naming the device to choose."""
    if not torch_compile:
        return
    if not str(backend.name).startswith("torch"):
        raise ConfigError(f"--compile (torch_compile) puts the step through torch.compile, which only the "
                          f"torch backend has, but the device is {backend.description}; "
                          "choose --device torch, torch:cuda, torch:mps or torch:cpu (pip install "
                          "'anygrad-train[torch]'), or leave --compile out")
    backend.set_torch_compile(torch_compile)  # type: ignore[attr-defined]
    backend.cuda_graph = True  # type: ignore[attr-defined]  (used on CUDA devices only)


def device_list(device: Any) -> list[Any] | None:
    """The devices of a multi-device spec ('wgpu:0,wgpu:1' or a list), or None for one device."""
    if isinstance(device, (list, tuple)):
        return list(device) if len(device) > 1 else None
    if isinstance(device, str) and "," in device:
        items = [d.strip() for d in device.split(",") if d.strip()]
        return items if len(items) > 1 else None
    return None


def open_backends(devices: list[Any], limits: str | None = None, memory_budget: Any = None) -> list[Backend]:
    """Backends for a device list; a wgpu adapter named again opens another device of it (its own
    queue and memory), which is how two devices of one adapter share a batch."""
    out: list[Backend] = []
    seen: dict[str, int] = {}
    for d in devices:
        if isinstance(d, Backend):
            out.append(d)
            continue
        spec = str(d).strip().lower()
        again = seen.get(spec, 0)
        seen[spec] = again + 1
        if again and spec.startswith("wgpu"):
            from .backends.wgpu import WgpuBackend
            out.append(WgpuBackend(spec, limits=limits, replica=again, memory_budget=memory_budget))
        else:
            out.append(get_backend(spec, limits=limits, memory_budget=memory_budget))
    return out
