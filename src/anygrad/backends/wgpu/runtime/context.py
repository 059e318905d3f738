"""The one wgpu device per adapter per process (its context: device, caps, pipelines), shared by
every WgpuBackend and executable on that adapter; opened with the adapter's limits profile."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ....errors import DeviceError
from ..device import implementation
from ..device.adapters import AdapterInfo, enabled_facts
from ..device.poller import poll_freely
from ..kernels.kernel import AdapterCaps
from ..planning.limits import LimitsProfile


@dataclass
class _Context:
    """One device per adapter per process, shared by every WgpuBackend on it (pipelines too)."""

    info: AdapterInfo
    device: Any
    caps: AdapterCaps
    pipelines: dict
    layouts: dict
    pending: dict = field(default_factory=dict)  # pipeline key -> Future of a build in the background
    f16_problem: str | None = None  # the f16 self-test's finding: None not run yet, "" passed
    f16_math_problem: str | None = None  # the same for f16 products (selftest.f16_math_problem)
    # the driver's f32 -> f16 conversion against IEEE's (selftest.f16_rounding_problem): None not
    # probed yet, "" it matches (kernels use it), else why kernels get halfstore.exact_conversions;
    # for stores into f16 arrays, and (f16_register) for a value rounded in a register
    f16_rounding: str | None = None
    f16_register: str | None = None
    polls_freely: bool = False  # its poll thread does not block (poller.py): maps resolve mid-step


_CONTEXTS: dict[tuple[int, str], _Context] = {}


def _context(info: AdapterInfo, adapter: Any, profile: LimitsProfile | None = None, replica: int = 0) -> _Context:
    key = (info.index, profile.name if profile else "") + ((replica,) if replica else ())
    if key in _CONTEXTS:
        return _CONTEXTS[key]
    feats = [f for f in implementation.of(adapter).features if f in adapter.features]
    limits = profile.required_limits(dict(adapter.limits)) if profile else None
    try:
        device = adapter.request_device_sync(required_features=feats, required_limits=limits)
    except Exception as e:  # driver refuses: report, do not crash
        raise DeviceError(f"could not open adapter {info.summary}: {e}. Try another device "
                          "(`anygrad devices`) or device='cpu'.") from e
    lim = device.limits
    caps = AdapterCaps(
        max_storage_buffers_per_stage=int(lim["max-storage-buffers-per-shader-stage"]),
        max_storage_binding_size=int(lim["max-storage-buffer-binding-size"]),
        max_workgroup_storage=int(lim["max-compute-workgroup-storage-size"]),
        max_invocations_per_workgroup=int(lim["max-compute-invocations-per-workgroup"]),
        max_workgroups_per_dim=int(lim["max-compute-workgroups-per-dimension"]),
        has_subgroups="subgroup" in device.features, has_f16="shader-f16" in device.features,
        is_cpu=info.is_software, memory_budget=profile.memory_budget if profile else None,
        limits_profile=profile.name if profile else "",
        adapter_facts=enabled_facts(info.facts, device.features))
    ctx = _Context(info, device, caps, {}, {}, polls_freely=poll_freely(device))
    _CONTEXTS[key] = ctx
    return ctx
