"""Shader modules without naga's runtime checks.

By default wgpu makes naga wrap every array index of a shader in a clamp (`min(i, len - 1)`)
and give every loop a hidden iteration counter. In a GEMM's inner loop that is an extra
instruction for each shared-memory read and a counter per k-step. anygrad generates all of its
shaders, guards every access it needs guarded explicitly (a clamped read would be a wrong
value anyway), and bounds every loop, so it asks wgpu-native for *trusted* modules
(`wgpuDeviceCreateShaderModuleTrusted` with no runtime checks). Storage-buffer accesses stay
protected by the driver's robust buffer access, which wgpu enables where the adapter has it.

wgpu-py does not wrap this entry point, so the module is built here through its cffi handles
(pinned: wgpu>=0.32,<0.33 in pyproject). Anything missing falls back to the checked module.
`ANYGRAD_WGPU_CHECKS=1` keeps naga's checks (to tell a kernel bug from a driver bug).
"""
from __future__ import annotations

import os
from typing import Any


def checks_requested() -> bool:
    return os.environ.get("ANYGRAD_WGPU_CHECKS", "0") not in ("", "0")


def _native() -> Any | None:
    try:
        from wgpu.backends.wgpu_native import _api
        _api.lib.wgpuDeviceCreateShaderModuleTrusted  # noqa: B018 (present in this build?)
        return _api
    except (ImportError, AttributeError):
        return None


def create_shader_module(device: Any, wgsl: str, label: str) -> Any:
    """A compute shader module from WGSL: trusted (no runtime checks) where wgpu-native offers
    it, else wgpu's ordinary checked module."""
    api = None if checks_requested() else _native()
    if api is None or not hasattr(device, "_internal"):
        return device.create_shader_module(code=wgsl, label=label)
    ffi, lib = api.ffi, api.lib
    source = api.new_struct_p("WGPUShaderSourceWGSL *", code=api.to_c_string_view(wgsl))
    source[0].chain.next = ffi.NULL
    source[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
    chained = ffi.cast("WGPUChainedStruct *", source)  # `source` stays referenced until the call returns
    desc = api.new_struct_p("WGPUShaderModuleDescriptor *", nextInChain=chained,
                            label=api.to_c_string_view(label))
    handle = api.libf.wgpuDeviceCreateShaderModuleTrusted(device._internal, desc, 0)
    if handle == ffi.NULL:
        raise RuntimeError(f"shader module {label!r} creation failed")
    return api.GPUShaderModule(label, handle, device)
