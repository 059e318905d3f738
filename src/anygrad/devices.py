"""Device names -> backends: 'auto', 'cpu', 'wgpu', 'wgpu:N', 'wgpu:vulkan|metal|dx12|gl'.

`auto` takes the best real GPU (discrete, then integrated); a machine with only a software
adapter (lavapipe) or none trains on the CPU, where numpy is faster than a software rasteriser.
"""
from __future__ import annotations

from .backends.base import Backend
from .backends.numpy import NumpyBackend
from .backends.wgpu.adapters import AdapterInfo, best_adapter, list_adapters
from .errors import ConfigError

__all__ = ["AdapterInfo", "get_backend", "list_adapters"]


def get_backend(device: str = "auto", limits: str | None = None, memory_budget: int | str | None = None) -> Backend:
    """The backend for a device name. `limits`: a wgpu limits profile (webgpu-default, uhd630,
    m1-8gb; see anygrad.backends.wgpu.limits) to train as on that hardware; None: the
    ANYGRAD_WGPU_LIMITS variable, else the adapter's own limits. `memory_budget` ('1.5GB' or
    bytes): what a compiled wgpu step may hold, instead of the profile's. The CPU has neither."""
    device = (device or "auto").strip().lower()
    if device in ("cpu", "numpy"):
        return NumpyBackend()
    if device == "auto":
        pick = best_adapter(include_software=False)
        if pick is None:
            from .backends.wgpu.runtime import warn_cpu_fallback
            soft = best_adapter()
            warn_cpu_fallback("no GPU adapter found" if soft is None else
                              f"only a software adapter ({soft[0].name}) was found")
            return NumpyBackend()
        from .backends.wgpu import WgpuBackend
        return WgpuBackend(f"wgpu:{pick[0].index}", limits=limits, memory_budget=memory_budget)
    if device == "wgpu" or device.startswith("wgpu:"):
        from .backends.wgpu import WgpuBackend
        return WgpuBackend(device, limits=limits, memory_budget=memory_budget)
    raise ConfigError(f"unknown device '{device}'; use auto, cpu, wgpu, wgpu:N or wgpu:vulkan|metal|dx12|gl")
