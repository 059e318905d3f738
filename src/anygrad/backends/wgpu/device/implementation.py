"""Which WebGPU implementation runs an adapter: wgpu-native (PyPI `wgpu`, naga) or Dawn (PyPI
`wgpudawn`, Google's WebGPU with Tint), and the one place that imports either.

Both packages offer the same wgpu-py 0.32 API, so the backend is written once; what differs is
kept here as data (`Implementation`):
- the module object (`import wgpu` / `import wgpudawn`), loaded on first use;
- the device features anygrad asks for (Dawn spells `subgroups`, wgpu-native `subgroup`);
- Dawn's instance toggles, set before its instance exists: `allow_unsafe_apis` (experimental
  features: subgroup matrices), `vulkan_enable_f16_on_nvidia` (shader-f16 on NVIDIA's Vulkan) and
  `disable_robustness` (no index clamps, as on wgpu-native: dawn_toggles); and one turned off,
  `timestamp_quantization` (DAWN_OFF_TOGGLES);
- wgpu-native's C API (`native_api`), which only wgpu-native objects may be handed to: trusted
  shader modules, the non-blocking poller. Raw mapped ranges and adapter facts go through each
  implementation's own C API (`cffi_api`).
- whether one device may be called from several threads (wgpu-core: yes; Dawn: with the device
  feature implicit-device-synchronization, requested where listed; without it pipelines are
  built on the calling thread).

Dawn delivers a map's callback from whichever thread processes events; `wait_mapped` makes
every mapping follow WebGPU's rule (use the range only once the map has resolved) under both.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from .... import settings
from ....errors import ConfigError, DeviceError

NATIVE, DAWN = "native", "dawn"
IMPLEMENTATIONS = (NATIVE, DAWN)
DAWN_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia")
# Dawn rounds timestamps down to 2^16 ns by default (a browser's guard against timing attacks):
# a profiled ResNet-50 step read every kernel as 0, 65.5 or 131 us, and the autotuner's stamped
# timings carried the same +-65 us (H200, 2026-12-04). anygrad's timestamps are its own.
DAWN_OFF_TOGGLES = ("timestamp_quantization",)
DAWN_THREAD_SAFETY = "implicit-device-synchronization"  # Dawn's device-wide lock: threads may share a device
DAWN_REQUIREMENT = "wgpudawn>=0.32.0.4,<0.33"
DIST = "anygrad-train"  # the distribution (pyproject name) whose `[dawn]` extra installs wgpudawn


@dataclass(frozen=True)
class Implementation:
    """One WebGPU implementation as the backend uses it."""

    key: str                      # "native" | "dawn": as in `--device wgpu:dawn`
    words: str                    # how messages and `anygrad devices` name it
    module: Any                   # the wgpu-py-API module (wgpu or wgpudawn)
    features: tuple[str, ...]     # device features requested where the adapter lists them
    native_api: Any = None        # wgpu-native's cffi module (_api), None on Dawn
    # the device feature without which one device must not be called from several threads at
    # once ("": always safe, as wgpu-core is); pipelines are built on threads where it is safe
    thread_safety: str = ""
    compiler: str = "naga"        # the shader compiler, for error messages

    def threaded(self, device: Any) -> bool:
        """Whether several threads may create pipelines on `device` at once. Dawn: with
        implicit-device-synchronization, which H200 measurements show does not serialise the
        compiles (24 pipelines: 13.8 s on one thread, 1.9 s on 16; Dawn's own asynchronous
        creation took 7.5 s)."""
        return not self.thread_safety or self.thread_safety in device.features

    def process_events(self) -> None:
        """Let the implementation deliver callbacks of finished work (Dawn: ProcessEvents)."""
        if self.key == DAWN:
            from wgpudawn.backends.dawn import _api
            _api.process_events()

    def cffi_api(self) -> Any:
        """The implementation's cffi module (ffi, libf): for adapter facts wgpu-py does not expose."""
        if self.key == DAWN:
            from wgpudawn.backends.dawn import _api
            return _api
        return self.native_api

    def subgroup_sizes(self, adapter: Any) -> tuple[int, int]:
        """(min, max) subgroup size from the adapter's WGPUAdapterInfo ((0, 0): not reported;
        wgpu-py's info dict holds only the spec's defaults)."""
        try:
            api = self.cffi_api()
            c_info = api.ffi.new("WGPUAdapterInfo *")
            api.libf.wgpuAdapterGetInfo(adapter._internal, c_info)
            sizes = (int(c_info.subgroupMinSize), int(c_info.subgroupMaxSize))
            api.libf.wgpuAdapterInfoFreeMembers(c_info[0])
            return sizes
        except Exception:  # noqa: BLE001  (another wgpu-py build: the sizes stay unknown)
            return (0, 0)

    def matrix_configs(self, adapter: Any) -> list[dict]:
        """Dawn's subgroup-matrix configs of the adapter (raw dicts); none elsewhere."""
        if self.key != DAWN or "chromium-experimental-subgroup-matrix" not in adapter.features:
            return []
        try:
            from wgpudawn.backends.dawn import extras
            return list(extras.get_adapter_properties(adapter).get("subgroup_matrix_configs") or [])
        except Exception:  # noqa: BLE001  (a wgpudawn without the query: no matrix units known)
            return []

    def wgsl_enables(self, wgsl: str) -> str:
        """`wgsl` as this implementation's compiler accepts it (see wgsl_for)."""
        return wgsl_for(self.key, wgsl)


_LOADED: dict[str, Implementation] = {}


def missing_dawn_error(why: str = "") -> DeviceError:
    return DeviceError(f"device 'wgpu:dawn' needs the Dawn WebGPU implementation (PyPI wgpudawn), which "
                       f"is not installed{': ' + why if why else ''}. Install it with "
                       f"`pip install '{DIST}[dawn]'` (or `pip install '{DAWN_REQUIREMENT}'`), or use "
                       "--device wgpu:native")


def available(key: str) -> bool:
    """Whether the package of implementation `key` can be imported (imports nothing else)."""
    import importlib.util
    return importlib.util.find_spec("wgpu" if key == NATIVE else "wgpudawn") is not None


def checks_requested() -> bool:
    """ANYGRAD_WGPU_CHECKS=1: shaders keep the implementation's runtime checks (naga's clamps on
    wgpu-native, Tint's robustness on Dawn)."""
    return settings.get("ANYGRAD_WGPU_CHECKS")


def dawn_toggles() -> tuple[str, ...]:
    """DAWN_TOGGLES, `disable_robustness` unless ANYGRAD_WGPU_CHECKS=1, and those
    ANYGRAD_DAWN_TOGGLES adds (load() refuses a name Dawn does not know).

    Without robustness Tint does not clamp every array index, as wgpu-native's trusted modules
    skip naga's clamps (shader_module.py: anygrad guards what needs guarding itself). H200,
    2026-12-04: GEMM 4096^3 178.7 -> 191.2 TFLOP/s, rules-only f16 steps GPT-2 small +17%,
    ResNet-50 +13%, ViT-tiny +23%; zeroing workgroup memory (disable_workgroup_init) cost nothing
    measurable on top."""
    base = DAWN_TOGGLES + (() if checks_requested() else ("disable_robustness",))
    extra = settings.get("ANYGRAD_DAWN_TOGGLES") or ""
    return base + tuple(dict.fromkeys(t.strip() for t in extra.split(",") if t.strip() and t.strip() not in base))


def load(key: str) -> Implementation:
    """The implementation named `key` ('native' or 'dawn'), imported once per process. Dawn's
    instance toggles are set here, before anything creates its instance."""
    if key in _LOADED:
        return _LOADED[key]
    if key == NATIVE:
        import wgpu
        try:
            from wgpu.backends.wgpu_native import _api as native_api
        except ImportError:  # a wgpu-py without the native backend: plain API only
            native_api = None
        impl = Implementation(NATIVE, "wgpu-native", wgpu, ("shader-f16", "subgroup", "timestamp-query"),
                              native_api=native_api)
    elif key == DAWN:
        try:
            import wgpudawn
            from wgpudawn.backends.dawn import extras
        except ImportError as e:
            raise missing_dawn_error() from e
        toggles = dawn_toggles()
        unknown = [t for t in toggles if t not in extras.all_toggles()]
        if unknown:
            raise ConfigError(f"ANYGRAD_DAWN_TOGGLES: Dawn has no toggle {', '.join(unknown)} "
                              "(wgpudawn.backends.dawn.extras.all_toggles() lists them)")
        try:
            extras.set_instance_extras(enable_toggles=list(toggles), disable_toggles=list(DAWN_OFF_TOGGLES))
        except Exception:  # noqa: BLE001, S110  (the instance exists already: someone else set it up)
            pass
        impl = Implementation(DAWN, "Dawn", wgpudawn,
                              ("shader-f16", "subgroups", "timestamp-query",
                               "chromium-experimental-subgroup-matrix", DAWN_THREAD_SAFETY),
                              thread_safety=DAWN_THREAD_SAFETY, compiler="Tint")
    else:
        raise ValueError(f"unknown WebGPU implementation {key!r}; one of {IMPLEMENTATIONS}")
    _LOADED[key] = impl
    return impl


def of(obj: Any) -> Implementation:
    """The implementation a wgpu object (adapter, device, buffer) belongs to, by its class's module."""
    return load(DAWN if type(obj).__module__.startswith("wgpudawn") else NATIVE)


def flags() -> Any:
    """A module holding WebGPU's flag and enum constants (BufferUsage, MapMode, ShaderStage,
    BufferBindingType): their values are the WebGPU spec's, the same in both implementations."""
    return (_LOADED.get(NATIVE) or _LOADED.get(DAWN) or load(NATIVE if available(NATIVE) else DAWN)).module


# subgroup builtin functions and values: what needs `enable subgroups;` under Tint
_SUBGROUP_USE = re.compile(r"\bsubgroup(?:Add|Mul|Max|Min|And|Or|Xor|Ballot|Broadcast\w*|Shuffle\w*|All|Any|"
                           r"Elect|Inclusive\w*|Exclusive\w*)\s*\(|@builtin\(\s*(?:subgroup_|num_subgroups)")


# `bitcast<f32>(0x7f800000u)`: how the kernels write inf and NaN (WGSL has no literals for them)
_BITS_F32 = re.compile(r"bitcast<f32>\(\s*0x([0-9a-fA-F]{1,8})u\s*\)")
_BITS_FN = "anygrad_bits"


def _runtime_nonfinite(m: re.Match) -> str:
    bits = int(m.group(1), 16)
    if (bits >> 23) & 0xFF != 0xFF:
        return m.group(0)
    return f"bitcast<f32>({_BITS_FN}(0x{m.group(1)}u))"


def wgsl_for(key: str, wgsl: str) -> str:
    """The kernels are written for naga; Tint's text differs in two ways:
    - `enable subgroups;` before subgroup builtins (naga in wgpu-native 29 rejects it: wgreduce.py);
    - inf and NaN: Tint evaluates `bitcast<f32>(0xff800000u)` as a constant expression and refuses
      one that is not finite, so the bits go through a function (never a constant expression)."""
    if key != DAWN:
        return wgsl
    if "enable subgroups;" not in wgsl and _SUBGROUP_USE.search(wgsl):
        wgsl = "enable subgroups;\n" + wgsl
    wgsl, n = _BITS_F32.subn(_runtime_nonfinite, wgsl)
    if n and f"{_BITS_FN}(0x" in wgsl:
        wgsl += f"\nfn {_BITS_FN}(x: u32) -> u32 {{ return x; }}\n"
    return wgsl


# one storage binding's declaration, as every kernel writes it (wgsl.py, bindpack.py)
_DECL = re.compile(r"@group\(0\)\s*@binding\((\d+)\)\s*var<storage,\s*(?:read|read_write)>\s*(\w+)\s*:\s*([^;]+);")


def merge_bindings(wgsl: str, pairs: dict[int, int]) -> tuple[str, dict[int, int]]:
    """WebGPU forbids two writable storage bindings of one dispatch that view overlapping bytes
    (Dawn validates it; wgpu-native does not). For each pair k -> j (binding k views the same bytes
    as binding j, an in-place update), binding k's variable becomes binding j's and its declaration
    goes: the shader reads and writes through one binding. Pairs whose element types differ stay.
    Returns the shader and the pairs merged (their bindings k get a placeholder buffer)."""
    decls = {int(m.group(1)): m for m in _DECL.finditer(wgsl)}
    done: dict[int, int] = {}
    for k, j in sorted(pairs.items(), reverse=True):
        mk, mj = decls.get(k), decls.get(j)
        if mk is None or mj is None or mk.group(3).strip() != mj.group(3).strip():
            continue
        done[k] = j
    for k in sorted(done, key=lambda k: -decls[k].start()):  # cut from the end: earlier offsets stay valid
        m = decls[k]
        wgsl = wgsl[:m.start()] + wgsl[m.end():]
    for k, j in done.items():
        # the variable, not a member of the same name (`v.x`)
        wgsl = re.sub(rf"(?<![.\w]){re.escape(decls[k].group(2))}(?!\w)", decls[j].group(2), wgsl)
    return wgsl, done


def wait_mapped(buf: Any, promise: Any, timeout_s: float = 600.0) -> None:
    """Wait for `promise` (buf.map_async(...)), then until the buffer's own state says mapped.
    Dawn can finish a map's future in wgpuInstanceWaitAny while another thread is still running its
    callback, and wgpu-py's sync_wait then returns before the buffer is marked mapped; reading or
    unmapping it then fails ("Can only read from a buffer if its mapped"). Here the caller keeps
    processing events until the callback has run, as WebGPU's rule (the range is valid only after
    the map resolves) asks."""
    promise.sync_wait()
    state = getattr(buf, "map_state", "mapped")
    if state == "mapped":
        return
    impl = of(buf)
    deadline = time.monotonic() + timeout_s
    while getattr(buf, "map_state", "mapped") == "pending":
        impl.process_events()
        promise.sync_wait()  # a callback that ran on another thread left the promise to resolve here
        if time.monotonic() > deadline:
            raise DeviceError(f"a buffer map did not resolve within {timeout_s:.0f} s; the GPU may be hung")
        time.sleep(20e-6)
    if buf.map_state != "mapped":
        # The map was refused (rejected promise already raised) or the buffer destroyed meanwhile.
        raise RuntimeError(f"buffer {getattr(buf, 'label', '')!r} is {buf.map_state} after its map resolved")


def map_now(buf: Any, mode: int) -> None:
    """buf.map_sync(mode), following WebGPU's rule under both implementations (wait_mapped)."""
    wait_mapped(buf, buf.map_async(mode))
