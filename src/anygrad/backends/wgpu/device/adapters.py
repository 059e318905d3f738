"""Which WebGPU adapters this machine has, described, ranked and chosen by device name.

Enumerating adapters costs most of a second (every driver is probed), so the list is made once
per process. Nothing here creates a device.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

from ....errors import ConfigError, DeviceError

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
    facts: AdapterFacts = field(default_factory=lambda: AdapterFacts("native"))

    @property
    def implementation(self) -> str:
        """'native' (wgpu-native) or 'dawn': which WebGPU implementation reaches this adapter."""
        return self.facts.implementation

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
                f"{', software' if self.is_software else ''}"
                f"{', Dawn' if self.implementation == 'dawn' else ''})")

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
        return (f"{self.summary}\n{pad}limits: {', '.join(shown) or 'unknown'}\n{pad}features: {feats}"
                f"\n{pad}{self.facts.describe()}")

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class MatrixConfig:
    """One subgroup-matrix shape an adapter offers (Dawn's `chromium-experimental-subgroup-matrix`):
    a subgroup multiplies an M x K `operand_dtype` matrix by a K x N one into an M x N
    `result_dtype` accumulator. Dtypes are WGSL's words: f16, f32, i8, u8, i32, u32."""

    M: int
    N: int
    K: int
    operand_dtype: str
    result_dtype: str
    min_subgroup_size: int = 0   # the subgroup sizes this config holds for (0: not reported)
    max_subgroup_size: int = 0

    @property
    def shape(self) -> str:
        return f"{self.M}x{self.N}x{self.K}"

    def __str__(self) -> str:
        return f"{self.shape} {self.operand_dtype}->{self.result_dtype}"


_OPERANDS = {"f16": "f16", "mixed": "f16", "f32": "f32"}   # a precision's GEMM operand type


@dataclass(frozen=True)
class AdapterFacts:
    """What kernel planners need to know about an adapter beyond its limits: which WebGPU
    implementation reaches it, its subgroup sizes, its matrix units and whether it runs f16.
    The subgroup-matrix planner chooses from `matrix_configs`; an empty tuple means ALU kernels."""

    implementation: str                          # "wgpu-native" | "dawn" (IMPLEMENTATIONS)
    subgroup_sizes: tuple[int, int] = (0, 0)     # (min, max); (0, 0): not reported
    matrix_configs: tuple[MatrixConfig, ...] = ()
    has_f16: bool = False
    has_subgroups: bool = False

    def configs_for(self, operand_dtype: str, result_dtype: str = "f32") -> tuple[MatrixConfig, ...]:
        """The matrix configs with these operand and accumulator dtypes (largest K*M*N first)."""
        picked = [c for c in self.matrix_configs
                  if c.operand_dtype == operand_dtype and c.result_dtype == result_dtype]
        return tuple(sorted(picked, key=lambda c: -c.M * c.N * c.K))

    def matrix_units_for(self, precision: str) -> bool:
        """True when the adapter can run this precision's GEMMs on matrix units
        ('f16': f16 operands with f32 accumulation, which needs shader-f16 too)."""
        operand = _OPERANDS.get(precision, precision)
        return bool(self.configs_for(operand)) and (operand != "f16" or self.has_f16)

    def describe(self) -> str:
        """'Dawn; subgroups 32; matrix units: 16x16x16 f16->f32, ...' for `anygrad devices`."""
        lo, hi = self.subgroup_sizes
        sizes = "unknown" if not hi else (str(lo) if lo == hi else f"{lo}-{hi}")
        mats = ", ".join(str(c) for c in self.matrix_configs) or "none"
        return (f"implementation {IMPLEMENTATION_WORDS.get(self.implementation, self.implementation)}; "
                f"subgroup size {sizes}; matrix units: {mats}")


def enabled_facts(facts: AdapterFacts, device_features: Any) -> AdapterFacts:
    """`facts` as far as a device opened with `device_features` can use them: matrix configs only
    where it enabled subgroup matrices (and f16 configs only with shader-f16), f16 and subgroups
    only where enabled. This is what kernels see (AdapterCaps.adapter_facts)."""
    feats = set(device_features)
    f16 = facts.has_f16 and "shader-f16" in feats
    configs = tuple(c for c in facts.matrix_configs if c.operand_dtype != "f16" or f16)
    return replace(facts, has_f16=f16, has_subgroups=facts.has_subgroups and bool(feats & {"subgroup", "subgroups"}),
                   matrix_configs=configs if "chromium-experimental-subgroup-matrix" in feats else ())


def matrix_units_fallback(facts: AdapterFacts, precision: str) -> str:
    """Why GEMMs and convolutions of `precision` run on ALU kernels on an adapter where matrix units
    are sought (Dawn), in words; '' when its matrix units serve that precision."""
    if facts.matrix_units_for(precision):
        return ""
    if not facts.matrix_configs:
        return "the adapter lists no subgroup-matrix configs (Dawn feature chromium-experimental-subgroup-matrix)"
    if precision == "f16" and not facts.has_f16:
        return "it has no shader-f16 (on NVIDIA Dawn needs the toggle vulkan_enable_f16_on_nvidia, which anygrad sets)"
    listed = ", ".join(str(c) for c in facts.matrix_configs)
    return f"none of its subgroup-matrix configs ({listed}) takes {precision} operands with f32 results"


_SAID: set[tuple[int, str]] = set()


def say_matrix_fallback(info: AdapterInfo, facts: AdapterFacts, precision: str) -> str:
    """Print, once per adapter and precision, that a Dawn adapter falls back to ALU kernels and
    why; returns the reason ('' when matrix units serve `precision`, or the adapter is not Dawn's,
    where ALU kernels are simply what there is)."""
    why = matrix_units_fallback(facts, precision) if facts.implementation == "dawn" else ""
    if why and (info.index, precision) not in _SAID:
        _SAID.add((info.index, precision))
        import sys
        print(f"anygrad: {info.summary}: no matrix units for {precision} ({why}); GEMMs and convolutions "
              "use the ALU kernels", file=sys.stderr)
    return why


# Implementation keys (as in `wgpu:dawn`) -> how `anygrad devices` names them.
IMPLEMENTATION_WORDS = {"native": "wgpu-native", "wgpu-native": "wgpu-native", "dawn": "Dawn"}


def matrix_configs_from(raw: list[dict[str, Any]] | None) -> tuple[MatrixConfig, ...]:
    """Dawn's `get_adapter_properties(adapter)["subgroup_matrix_configs"]` entries as MatrixConfigs."""
    return tuple(MatrixConfig(M=int(c["m"]), N=int(c["n"]), K=int(c["k"]),
                              operand_dtype=str(c["component_type"]).lower(),
                              result_dtype=str(c["result_component_type"]).lower(),
                              min_subgroup_size=int(c.get("min_subgroup_size", 0) or 0),
                              max_subgroup_size=int(c.get("max_subgroup_size", 0) or 0))
                 for c in raw or ())


def _type_key(word: str) -> str:
    for key, (ours, _) in _TYPES.items():
        if ours == word:
            return key
    return "Unknown"


_ADAPTERS: dict[str, list[tuple[AdapterInfo, Any]]] = {}  # implementation -> its adapters, listed once


def _facts(impl: Any, adapter: Any) -> AdapterFacts:
    configs = matrix_configs_from(impl.matrix_configs(adapter))
    lo, hi = impl.subgroup_sizes(adapter)
    if not hi and configs:  # Dawn reports the subgroup sizes its matrix configs hold for
        lo, hi = min(c.min_subgroup_size for c in configs), max(c.max_subgroup_size for c in configs)
    feats = set(adapter.features)
    return AdapterFacts(implementation=impl.key, subgroup_sizes=(lo, hi), matrix_configs=configs,
                        has_f16="shader-f16" in feats, has_subgroups=bool(feats & {"subgroup", "subgroups"}))


def _enumerate_one(key: str, start: int) -> list[tuple[AdapterInfo, Any]]:
    """The adapters implementation `key` reaches, numbered from `start` (none where it is not
    installed or finds no driver)."""
    if key not in _ADAPTERS:
        from .implementation import available, load
        raw: list[Any] = []
        impl = None
        if available(key):
            try:
                impl = load(key)
                raw = impl.module.gpu.enumerate_adapters_sync()
            except Exception:  # noqa: BLE001  (no library or no driver: simply no adapters)
                raw = []
        found = []
        for i, a in enumerate(raw, start):
            info = a.info
            name = info.get("device") or info.get("description") or "unknown adapter"
            limits = {k: int(a.limits[k]) for k in _KEY_LIMITS if k in a.limits}
            found.append((AdapterInfo(
                index=i, name=str(name), backend=str(info.get("backend_type", "?")),
                type=_TYPES.get(str(info.get("adapter_type", "Unknown")), ("unknown", 0))[0],
                vendor=str(info.get("vendor", "")), driver=str(info.get("description", "")),
                limits=limits, features=tuple(sorted(a.features)), facts=_facts(impl, a)), a))
        _ADAPTERS[key] = found
    return _ADAPTERS[key]


def _enumerate(implementations: tuple[str, ...] | None = None) -> list[tuple[AdapterInfo, Any]]:
    """Adapters of the given implementations (default: every installed one). wgpu-native's come
    first, so `wgpu:N` means what it meant before Dawn was there; Dawn's are numbered after them."""
    from .implementation import IMPLEMENTATIONS, NATIVE
    wanted = IMPLEMENTATIONS if implementations is None else implementations
    native = _enumerate_one(NATIVE, 0)
    out = list(native) if NATIVE in wanted else []
    start = len(native)
    for key in IMPLEMENTATIONS[1:]:
        if key in wanted:
            out += _enumerate_one(key, start)
        if key in _ADAPTERS:
            start += len(_ADAPTERS[key])
    return out


def list_adapters(implementations: tuple[str, ...] | None = None) -> list[AdapterInfo]:
    """Every adapter wgpu-native and (where installed) Dawn reach, in wgpu's order (the index is
    what `wgpu:N` means)."""
    return [info for info, _ in _enumerate(implementations)]


def best_adapter(include_software: bool = True, api: str | None = None,
                 implementations: tuple[str, ...] = ("native",)) -> tuple[AdapterInfo, Any] | None:
    """The most capable adapter: discrete > integrated > virtual > software, native API > OpenGL,
    among those of `implementations` (wgpu-native's by default: Dawn is asked for by name, or by
    `auto` for matrix units, auto_adapter)."""
    pool = [(i, a) for i, a in _enumerate(implementations)
            if (include_software or not i.is_software) and (api is None or i.backend == api)]
    return max(pool, key=lambda p: p[0].rank, default=None)


# The matrix units `auto` may pick Dawn for: (vendor, config) pairs whose kernels ran against
# float64 and trained against torch.autocast on that vendor's hardware
# (tests/test_matrix_units_dawn.py on an H200). There, f16 on Dawn's matrix units (autotuned,
# 2026-12-03, BENCHMARKS.md) trained ResNet-50 at 1.65x, GPT-2 small at 1.45x and ResNet-18 b512
# at 1.0x of wgpu-native's f16, GPT b128 at 0.87x (rules). Other vendors' configs run the same
# generic code, untested on their hardware: `--device wgpu:dawn` chooses them by name.
VERIFIED_MATRIX_UNITS = frozenset({("nvidia", "16x16x16", "f16", "f32")})   # (vendor, M x N x K, operand, result)


def _verified_rows(info: AdapterInfo, precision: str) -> list[tuple[str, str, str, str]]:
    """The VERIFIED_MATRIX_UNITS rows of this adapter's vendor (read from its vendor or its name:
    Dawn reports either) for `precision`'s operand type."""
    who = f"{info.vendor} {info.name}".lower()
    return [row for row in VERIFIED_MATRIX_UNITS if row[0] in who and row[2] == _OPERANDS.get(precision)]


def verified_matrix_units(info: AdapterInfo, precision: str) -> bool:
    """Whether this adapter's matrix units for `precision` are among VERIFIED_MATRIX_UNITS."""
    return info.facts.matrix_units_for(precision) and any(
        c.shape == shape for _, shape, operand, result in _verified_rows(info, precision)
        for c in info.facts.configs_for(operand, result))


def auto_adapter(precision: str = "f32") -> tuple[tuple[AdapterInfo, Any] | None, str]:
    """`auto`'s real GPU: wgpu-native's best, unless an adapter of another implementation (Dawn) is
    as capable and offers verified matrix units for `precision` (VERIFIED_MATRIX_UNITS) that
    wgpu-native's lacks. Returns the pick
    (None: no real GPU) and a one-line reason when the pick is not wgpu-native's, else ''."""
    from .implementation import available
    native = best_adapter(include_software=False)
    # Dawn's adapters are listed only where they could win: a real GPU of a verified vendor and a
    # precision a verified config takes (f32 training, a CPU-only machine never ask Dawn, whose
    # listing warns about every adapter it refuses, lavapipe among them)
    if not available("dawn") or native is None or not _verified_rows(native[0], precision):
        return native, ""
    dawn = [(i, a) for i, a in _enumerate(("dawn",)) if not i.is_software and verified_matrix_units(i, precision)]
    pick = max(dawn, key=lambda p: p[0].rank, default=None)
    if pick is None or (native is not None and (native[0].facts.matrix_units_for(precision)
                                                or native[0].rank[:2] > pick[0].rank[:2])):
        return native, ""
    mats = ", ".join(c.shape for c in pick[0].facts.configs_for("f16" if precision == "f16" else precision))
    return pick, (f"anygrad: auto chose {pick[0].device_name} ({pick[0].name} through Dawn): matrix units "
                  f"for {precision} ({mats}); --device wgpu:native keeps wgpu-native")


def select_adapter(spec: str) -> tuple[AdapterInfo, Any]:
    """Resolve 'wgpu', 'wgpu:N', 'wgpu:<api>', 'wgpu:<implementation>' or 'wgpu:<implementation>:<api>'
    (implementation: native | dawn) to an adapter, or raise DeviceError saying what exists."""
    from .implementation import DAWN, IMPLEMENTATIONS, NATIVE, available, missing_dawn_error
    parts = [p.strip().lower() for p in spec.split(":")[1:]]
    impl = parts.pop(0) if parts and parts[0] in IMPLEMENTATIONS else None
    rest = parts.pop(0) if parts else ""
    if parts or (rest and not rest.isdigit() and rest not in API_NAMES) or (impl and rest.isdigit()):
        raise ConfigError(f"device '{spec}' not understood; use wgpu, wgpu:N (N from `anygrad devices`), "
                          "wgpu:vulkan|metal|dx12|gl, wgpu:native or wgpu:dawn (optionally with an API: "
                          "wgpu:dawn:vulkan)")
    if impl == DAWN and not available(DAWN):
        raise missing_dawn_error()
    found = _enumerate()
    listing = "; ".join(i.summary for i, _ in found) or "none"
    if not found:
        raise DeviceError("no WebGPU adapter found. Install a GPU driver with Vulkan, Metal or DX12 "
                          "support (on Linux without a GPU: Mesa's lavapipe, package mesa-vulkan-drivers), "
                          "or use device='cpu'.")
    if rest.isdigit():
        idx = int(rest)
        if idx >= len(found):
            raise DeviceError(f"device '{spec}': there is no adapter {idx}; adapters: {listing}. "
                              "Run `anygrad devices` to list them.")
        return found[idx]
    api = API_NAMES.get(rest)
    # plain `wgpu` and `wgpu:<api>`: wgpu-native's adapter where it has one, else Dawn's
    for pool in ((impl,) if impl else IMPLEMENTATIONS):
        pick = best_adapter(api=api, implementations=(pool,))
        if pick is not None:
            return pick
    words = {NATIVE: "wgpu-native", DAWN: "Dawn"}.get(impl or "", "")
    what = " ".join(w for w in (words, api) if w)
    hint = (" Dawn needs a GPU driver with Vulkan, Metal or D3D12 and refuses software adapters "
            "(lavapipe)." if impl == DAWN else "")
    raise DeviceError(f"device '{spec}': no {what} adapter on this machine;{hint} adapters: "
                      f"{listing}. Use device='wgpu' for the best one.")
