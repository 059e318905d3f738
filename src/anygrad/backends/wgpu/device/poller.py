"""The device's poll thread, polling without blocking.

wgpu-py gives each device a thread that polls it while a mapping (or an async pipeline build) is
pending, and it polls *blocking*: `wgpuDevicePoll(wait=True)` returns once the newest submission has
finished, and while it waits a `queue.submit` from another thread waits too (docs/wgpu-facts.md).
So a gradient bucket copied mid-step was mapped only at the step's end, and a data-parallel step had
to hold its later parts back and submit them one by one (each hold a drain of the GPU).

Here the same thread polls without waiting, POLL_INTERVAL_S apart, while something is pending: a
mapping resolves within about that long of its copy finishing, whatever was submitted after it,
and submits never wait. It changes one function of wgpu-py's poller (a private attribute, hence
the fallback: where this wgpu-py lacks it, the device keeps blocking polls and the executables
keep holding parts back, `polls_freely` False). `ANYGRAD_WGPU_POLL=block` keeps wgpu-py's own.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .... import settings

POLL_INTERVAL_S = 50e-6  # the host's sleep between polls while a mapping is pending (~0.1 ms latency)


def _native() -> tuple[Any, Any]:
    """wgpu-py's cffi module and wgpu-native's function table (AttributeError: this wgpu-py has none)."""
    from .implementation import NATIVE, load
    api = load(NATIVE).native_api
    return api.ffi, api.libf


def poll_freely(device: Any, sleep: Callable[[float], Any] = time.sleep) -> bool:
    """Make `device`'s poll thread poll without blocking, `sleep`ing between polls while something
    is pending; True if it now does."""
    if settings.get("ANYGRAD_WGPU_POLL") == "block":
        return False
    from .implementation import NATIVE, of
    if of(device).key != NATIVE:  # Dawn has no poll thread; its maps resolve in wgpuInstanceWaitAny
        return False
    try:
        ffi, libf = _native()
        poller = device._poller
        internal = device._internal
        poller._poll_func  # noqa: B018 - the attribute the thread calls must exist to be replaced
    except (ImportError, AttributeError):
        return False
    null = ffi.NULL

    def poll(block: bool) -> None:
        # Refers to the device's handle, not the device (as wgpu-py's own: no reference cycle).
        libf.wgpuDevicePoll(internal, False, null)
        if block:
            sleep(POLL_INTERVAL_S)

    poller._poll_func = poll
    return True
