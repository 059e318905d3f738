"""Device names -> backends: 'auto', 'cpu', and (with the wgpu backend) 'wgpu', 'wgpu:N', 'wgpu:vulkan'."""
from __future__ import annotations

from .backends.base import Backend
from .backends.numpy import NumpyBackend
from .errors import ConfigError


def get_backend(device: str = "auto") -> Backend:
    device = (device or "auto").strip().lower()
    if device in ("cpu", "numpy"):
        return NumpyBackend()
    if device == "auto":
        return NumpyBackend()
    raise ConfigError(f"unknown device '{device}'; use auto, cpu, wgpu, wgpu:N or wgpu:vulkan|metal|dx12|gl")
