"""Which WebGPU adapters this machine has, described, ranked and chosen by device name.

Enumerating adapters costs most of a second (every driver is probed), so the list is made once
per process. Nothing here creates a device.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError, DeviceError

# Mesa's software drivers warn about XDG_RUNTIME_DIR on every probe; any directory quiets them.
os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())

# wgpu's adapter_type -> our words, and how much we prefer each (higher is better).
_TYPES = {"DiscreteGPU": ("discrete", 4), "IntegratedGPU": ("integrated", 3),
          "VirtualGPU": ("virtual", 2), "CPU": ("cpu", 1), "Unknown": ("unknown", 0)}
# Native APIs beat the OpenGL fallback when one GPU is reachable through several.
_API_RANK = {"Vulkan": 3, "Metal": 3, "D3D12": 3, "OpenGL": 1}
# Device-name spellings -> wgpu backend_type.
API_NAMES = {"vulkan": "Vulkan", "metal": "Metal", "dx12": "D3D12", "d3d12": "D3D12",
             "gl": "OpenGL", "opengl": "OpenGL"}
# Limits worth showing and planning with, and how `anygrad devices` words them: byte sizes as
# "<words> <size>", counts as "<count> <words>".
_KEY_LIMITS = {"max-storage-buffer-binding-size": ("storage binding", True), "max-buffer-size": ("buffer", True),
               "max-storage-buffers-per-shader-stage": ("storage buffers/stage", False),
               "max-compute-workgroup-storage-size": ("workgroup storage", True),
               "max-compute-invocations-per-workgroup": ("invocations/workgroup", False),
               "max-compute-workgroups-per-dimension": ("workgroups/dim", False)}
_KEY_FEATURES = ("shader-f16", "subgroup", "timestamp-query")


def _bytes(n: int) -> str:
    """A byte limit in the largest unit it is a whole number of, give or take a few bytes
    (drivers report 2**31 - 1 or 2**31 - 4): '2 GiB - 4 bytes', '128 MiB', '1000 bytes'."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        whole = round(n / unit)
        off = n - whole * unit
        if whole >= 1 and abs(off) < 16:
            tail = f" {'-' if off < 0 else '+'} {abs(off)} byte{'s' * (abs(off) != 1)}" if off else ""
            return f"{whole} {name}{tail}"
    return f"{n} bytes"


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter as the user sees it in `anygrad devices`."""

    index: int
    name: str
    backend: str                 # Vulkan | Metal | D3D12 | OpenGL
    type: str                    # discrete | integrated | virtual | cpu | unknown
    vendor: str = ""
    driver: str = ""
    limits: dict[str, int] = field(default_factory=dict)
    features: tuple[str, ...] = ()

    @property
    def is_software(self) -> bool:
        return self.type == "cpu"

    @property
    def device_name(self) -> str:
        """What to pass as `device=` to pick exactly this adapter."""
        return f"wgpu:{self.index}"

    @property
    def rank(self) -> tuple[int, int, int]:
        return (_TYPES.get(_type_key(self.type), ("", 0))[1], _API_RANK.get(self.backend, 0), -self.index)

    @property
    def summary(self) -> str:
        """One line: the device name to pass, the adapter, its API and kind (for error messages)."""
        return (f"wgpu:{self.index}  {self.name} ({self.backend}, {self.type}"
                f"{', software' if self.is_software else ''})")

    def describe(self) -> str:
        """The summary, then the limits the planner and kernels work within and the optional
        features anygrad uses, as `anygrad devices` prints them (a too-large batch or model names
        one of these limits)."""
        lim = self.limits
        shown = [f"{words} {_bytes(lim[k])}" if size else f"{lim[k]} {words}"
                 for k, (words, size) in _KEY_LIMITS.items() if k in lim]
        ours = [f for f in _KEY_FEATURES if f in self.features]
        others = len(self.features) - len(ours)
        feats = (", ".join(ours) or "none of " + "/".join(_KEY_FEATURES)) + (f" (+{others} more)" if others else "")
        pad = " " * (len(self.device_name) + 2)
        return (f"{self.summary}\n{pad}limits: {', '.join(shown) or 'unknown'}\n{pad}features: {feats}")

    def __str__(self) -> str:
        return self.describe()


def _type_key(word: str) -> str:
    for key, (ours, _) in _TYPES.items():
        if ours == word:
            return key
    return "Unknown"


_ADAPTERS: list[tuple[AdapterInfo, Any]] | None = None


def _enumerate() -> list[tuple[AdapterInfo, Any]]:
    global _ADAPTERS
    if _ADAPTERS is None:
        try:
            import wgpu
            raw = wgpu.gpu.enumerate_adapters_sync()
        except Exception:  # noqa: BLE001  (no wgpu-native library or no driver: simply no adapters)
            raw = []
        found = []
        for i, a in enumerate(raw):
            info = a.info
            name = info.get("device") or info.get("description") or "unknown adapter"
            limits = {k: int(a.limits[k]) for k in _KEY_LIMITS if k in a.limits}
            found.append((AdapterInfo(
                index=i, name=str(name), backend=str(info.get("backend_type", "?")),
                type=_TYPES.get(str(info.get("adapter_type", "Unknown")), ("unknown", 0))[0],
                vendor=str(info.get("vendor", "")), driver=str(info.get("description", "")),
                limits=limits, features=tuple(sorted(a.features))), a))
        _ADAPTERS = found
    return _ADAPTERS


def list_adapters() -> list[AdapterInfo]:
    """Every adapter wgpu can reach, in wgpu's order (the index is what `wgpu:N` means)."""
    return [info for info, _ in _enumerate()]


def best_adapter(include_software: bool = True, api: str | None = None) -> tuple[AdapterInfo, Any] | None:
    """The most capable adapter: discrete > integrated > virtual > software, native API > OpenGL."""
    pool = [(i, a) for i, a in _enumerate()
            if (include_software or not i.is_software) and (api is None or i.backend == api)]
    return max(pool, key=lambda p: p[0].rank, default=None)


def select_adapter(spec: str) -> tuple[AdapterInfo, Any]:
    """Resolve 'wgpu', 'wgpu:N' or 'wgpu:<api>' to an adapter, or raise DeviceError saying what exists."""
    found = _enumerate()
    listing = "; ".join(i.summary for i, _ in found) or "none"
    if not found:
        raise DeviceError("no WebGPU adapter found. Install a GPU driver with Vulkan, Metal or DX12 "
                          "support (on Linux without a GPU: Mesa's lavapipe, package mesa-vulkan-drivers), "
                          "or use device='cpu'.")
    _, _, rest = spec.partition(":")
    rest = rest.strip().lower()
    if not rest:
        return best_adapter()  # type: ignore[return-value]
    if rest.isdigit():
        idx = int(rest)
        if idx >= len(found):
            raise DeviceError(f"device '{spec}': there is no adapter {idx}; adapters: {listing}. "
                              "Run `anygrad devices` to list them.")
        return found[idx]
    if rest in API_NAMES:
        pick = best_adapter(api=API_NAMES[rest])
        if pick is None:
            raise DeviceError(f"device '{spec}': no {API_NAMES[rest]} adapter on this machine; adapters: "
                              f"{listing}. Use device='wgpu' for the best one.")
        return pick
    raise ConfigError(f"device '{spec}' not understood; use wgpu, wgpu:N (N from `anygrad devices`) or "
                      f"wgpu:vulkan|metal|dx12|gl")
