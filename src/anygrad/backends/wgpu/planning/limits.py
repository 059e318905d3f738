"""Limits profiles: the limits of weaker adapters, asked of any adapter so that it enforces them.

A profile lowers what the wgpu device is created with (`required_limits`), so validation refuses
what that hardware would refuse, and gives the planner a memory budget for one training step.
CI trains on lavapipe under `webgpu-default`; a user picks `--limits uhd630` to see whether a
model fits a laptop before buying time on one. A profile never raises a limit above the adapter's.

Each number says where it comes from. Where a vendor reports several values (drivers, OSes), the
profile takes the lowest that users meet.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

from .... import settings
from ....errors import ConfigError

ENV = "ANYGRAD_WGPU_LIMITS"
GiB, MiB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class LimitsProfile:
    name: str
    description: str
    # WebGPU limit names, as wgpu-py spells them with '-' (see WEBGPU_NAMES)
    max_storage_buffer_binding_size: int
    max_buffer_size: int
    max_storage_buffers_per_shader_stage: int
    max_compute_workgroup_storage_size: int
    max_compute_invocations_per_workgroup: int
    max_compute_workgroups_per_dimension: int
    memory_budget: int | None = None  # bytes one compiled step may hold on the device (None: no budget)

    def device_limits(self) -> dict[str, int]:
        """The profile as wgpu-py's `required_limits` keys."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)
                if f.name.startswith("max_")}

    def required_limits(self, adapter_limits: dict[str, int]) -> dict[str, int]:
        """What to ask the device for: the adapter's limits, lowered to the profile's (never raised)."""
        out = {k: int(v) for k, v in adapter_limits.items() if isinstance(v, int)}
        for key, value in self.device_limits().items():
            if key in out:
                out[key] = min(out[key], value)
        return out


PROFILES: dict[str, LimitsProfile] = {p.name: p for p in (
    # The WebGPU spec's default limits (W3C WebGPU, "Limits" table: maxStorageBufferBindingSize
    # 134217728, maxBufferSize 268435456, maxStorageBuffersPerShaderStage 8,
    # maxComputeWorkgroupStorageSize 16384, maxComputeInvocationsPerWorkgroup 256,
    # maxComputeWorkgroupsPerDimension 65535): what every WebGPU adapter guarantees, and what a
    # browser hands out unless more is asked for. No memory statement: no budget.
    LimitsProfile("webgpu-default", "WebGPU's guaranteed minimum (every adapter has at least this)",
                  128 * MiB, 256 * MiB, 8, 16384, 256, 65535),
    # Intel UHD Graphics 630 (Gen9.5 GT2, 2017-2020 laptops and desktops), Vulkan on Windows:
    # - storage binding 1 GiB: the driver's maxStorageBufferRange (2^30), measured with vulkaninfo
    #   and recorded in issue 13; the buffer size is kept at the same 1 GiB, as one allocation on
    #   that driver is not allowed to be larger than one binding in practice;
    # - 32 KiB workgroup storage and 1024 invocations: Gen9's shared local memory per workgroup
    #   and maximum workgroup size (maxComputeSharedMemorySize 32768,
    #   maxComputeWorkGroupInvocations 1024);
    # - 8 storage buffers per stage: WebGPU's floor, which wgpu reports on adapters whose
    #   descriptor limits it cannot map (the tinygrad #1461 crashes were at this limit);
    # - memory budget 3 GiB: the iGPU shares system RAM and Windows caps shared GPU memory at half
    #   of it; an 8 GB laptop then has 4 GiB, less about 1 GiB the desktop keeps.
    LimitsProfile("uhd630", "Intel UHD Graphics 630, Vulkan, 8 GB laptop",
                  1 * GiB, 1 * GiB, 8, 32768, 1024, 65535, memory_budget=3 * GiB),
    # Apple M1 with 8 GB under Metal:
    # - 32 KiB threadgroup memory and 1024 threads per threadgroup: Metal feature set tables
    #   (Apple7 family);
    # - 31 buffer slots in a Metal argument table; wgpu reports that as storage buffers per stage;
    # - binding and buffer 2 GiB - 1: wgpu's cap for any adapter (bindings are u32 offsets);
    # - memory budget 5.3 GiB: the recommendedMaxWorkingSetSize Metal reports on 8 GB M1
    #   machines (5,461 MiB, as llama.cpp prints at start-up); Metal has already left the OS
    #   its share.
    LimitsProfile("m1-8gb", "Apple M1, 8 GB, Metal",
                  2 * GiB - 1, 2 * GiB - 1, 31, 32768, 1024, 65535, memory_budget=5461 * MiB),
)}


def get_profile(name: str | None) -> LimitsProfile | None:
    """The profile called `name` (None or '' or 'adapter': none, the adapter's own limits);
    without a name, the one ANYGRAD_WGPU_LIMITS names (tests and CI set it).

    A profile may be lowered further for a test, limit by limit, in WebGPU's names:
    'webgpu-default:max-storage-buffers-per-shader-stage=4,max-storage-buffer-binding-size=64KiB'."""
    if name is not None:
        return _profile(name)
    name = settings.get(ENV) or ""
    try:
        return _profile(name)
    except ConfigError as e:  # set in the environment: say where the name came from
        raise ConfigError(f"{ENV}={name}: {e}; unset it for the adapter's own limits") from None


def _profile(name: str) -> LimitsProfile | None:
    name, _, overrides = name.strip().lower().partition(":")
    if name in ("", "adapter", "none"):
        return None
    if name not in PROFILES:
        raise ConfigError(f"unknown limits profile '{name}'; choose one of {', '.join(PROFILES)} "
                          "(or 'adapter' for the adapter's own limits)")
    profile = PROFILES[name]
    if not overrides:
        return profile
    changes: dict[str, int] = {}
    known = {f.name.replace("_", "-"): f.name for f in fields(LimitsProfile) if f.name.startswith("max_")}
    known["memory-budget"] = "memory_budget"
    for item in overrides.split(","):
        key, eq, value = item.partition("=")
        if key.strip() not in known or not eq:
            raise ConfigError(f"limits profile override '{item}': write LIMIT=VALUE with LIMIT one of "
                              f"{', '.join(known)}")
        changes[known[key.strip()]] = parse_size(value, f"limits profile override {key.strip()}")
    return replace(profile, name=f"{name}:{overrides}", **changes)


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: float | str, what: str = "--memory-budget") -> int:
    """Bytes from 1500000000, '1.5GB' (10^9), '1.5GiB' or '1.5G' (2^30), '800MB', '512MiB'."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{what} '{text}' is not a size: write bytes or a number with a unit, e.g. "
                              "1.5GB, 1536MiB, 800MB")
        value, unit = float(m.group(1)), m.group(2).lower()
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"{what} '{text}' must be more than 0 bytes")
    return n


# The planner packs a step's temporaries at offsets into shared buffers as large as one binding,
# unless ANYGRAD_WGPU_SHARED_BUFFER caps them. Measured on an H100 (NVIDIA's Vulkan driver):
# session 31 found GPT-2 small's GEMMs 15-25% slower on operands inside 2 GiB shared buffers than
# in buffers of at most 128 MiB, and made 128 MiB the default. The cause was a kernel reading a
# buffer it also writes: such a read is declared writable (WebGPU's usage scopes), off the GPU's
# read-only path; planner._read_while_written keeps those tensors in different buffers. With that
# rule (session 32) one binding and 128 MiB train at the same speed (GPT 8,933 vs 8,947 samples/s,
# GPT-2 small 143.6 vs 143.9, ResNet-50 901.2 vs 900.3) and one binding holds 820 MiB less
# process memory on ResNet-50 at 224 px (6,854 vs 7,674 MiB: the driver's allocator, per buffer),
# so one binding is the default again. Parameter arenas always keep one binding.
SHARED_BUFFER_ENV = "ANYGRAD_WGPU_SHARED_BUFFER"


def shared_buffer_bytes(binding_limit: int) -> int:
    """How large a buffer holding many temporaries may grow: the adapter's `binding_limit`, or
    what ANYGRAD_WGPU_SHARED_BUFFER says ('128MiB'; 'binding': the default), never above that
    limit. A single tensor larger than a smaller cap still gets a buffer of its own size."""
    text = (settings.get(SHARED_BUFFER_ENV) or "").lower()
    if text in ("", "binding"):
        return binding_limit
    return min(parse_size(text, SHARED_BUFFER_ENV), binding_limit)


__all__ = ["ENV", "PROFILES", "SHARED_BUFFER_ENV", "LimitsProfile", "get_profile", "parse_size",
           "shared_buffer_bytes"]
