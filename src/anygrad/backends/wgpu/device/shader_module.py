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
`ANYGRAD_WGPU_CHECKS=1` keeps naga's checks (to tell a kernel bug from a driver bug). Dawn gets
the same policy through its `disable_robustness` toggle (implementation.dawn_toggles), which the
same setting turns off.
"""
from __future__ import annotations

import re
from typing import Any

from ....errors import DeviceError


def _native() -> Any | None:
    from .implementation import NATIVE, load
    try:
        _api = load(NATIVE).native_api
        _api.lib.wgpuDeviceCreateShaderModuleTrusted  # noqa: B018 (present in this build?)
        return _api
    except (ImportError, AttributeError):
        return None


def create_shader_module(device: Any, wgsl: str, label: str) -> Any:
    """A compute shader module from WGSL: trusted (no runtime checks) where wgpu-native offers
    it, else wgpu's ordinary checked module (always on Dawn: its C API is not wgpu-native's, and
    Tint's text gets the directives it needs, implementation.wgsl_for)."""
    from .implementation import NATIVE, checks_requested, of
    impl = of(device)
    if impl.key != NATIVE:
        return device.create_shader_module(code=impl.wgsl_enables(wgsl), label=label)
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


class ShaderRejectedError(DeviceError):
    """A generated kernel that the implementation's shader compiler (naga, Tint) refused. An anygrad
    bug, not the user's: the message names the kernel and the compiler's first error line; `wgsl`
    and `details` keep the source and the compiler's full text for the report."""

    def __init__(self, message: str, kernel: str, wgsl: str, details: str):
        super().__init__(message)
        self.kernel, self.wgsl, self.details = kernel, wgsl, details


# A line saying "error: <something>": naga's "Shader 'x' parsing error: ...", Tint's ":3:5 error: ..."
# (wgpu's wrappers, "Validation Error" and "Caused by:", say nothing after their colon)
_ERROR_LINE = re.compile(r"\berror\b\s*:\s*\S", re.IGNORECASE)


def first_error_line(text: str) -> str:
    """The compiler's first line that says `error: ...`; else the first non-empty line."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return next((ln for ln in lines if _ERROR_LINE.search(ln)), lines[0] if lines else "(no message)")


def shader_rejected(kernel: str, error: Exception, wgsl: str, impl: Any) -> ShaderRejectedError:
    """The error to raise for kernel `kernel`, whose shader `impl`'s compiler refused."""
    other = "--device wgpu:native" if impl.key != "native" else "another adapter (`anygrad devices`)"
    return ShaderRejectedError(
        f"wgpu kernel '{kernel}' was rejected by {impl.compiler} ({impl.words}'s shader compiler): "
        f"{first_error_line(str(error))}. This is an anygrad bug: please report it with this line; "
        f"meanwhile train with {other} or --device cpu", kernel, wgsl, str(error))
