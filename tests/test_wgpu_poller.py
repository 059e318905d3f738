"""The device's poll thread polls without blocking (backends/wgpu/device/poller.py), mappings still resolve,
and states written back through a kept mapped upload buffer land (lavapipe)."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def backend():
    from anygrad.backends.wgpu import WgpuBackend
    from anygrad.devices import list_adapters
    if not list_adapters():
        pytest.fail("no wgpu adapter: install mesa-vulkan-drivers (lavapipe)")
    return WgpuBackend("wgpu:0")


class _Recorder:
    """Stands in for wgpu-native's function table: records wgpuDevicePoll's arguments."""

    def __init__(self):
        self.calls: list[tuple] = []

    def wgpuDevicePoll(self, device, wait, index):
        self.calls.append((device, wait, index))
        return True


def test_the_poll_thread_never_waits(monkeypatch):
    """The poll function the device's thread calls (with block=True while a mapping is pending)
    polls without waiting and sleeps briefly instead; ANYGRAD_WGPU_POLL=block leaves wgpu-py's own.
    (lavapipe runs a submission inside queue.submit, so the overlap itself shows only on a GPU:
    the data-parallel breakdown's compute_wait.)"""
    from types import SimpleNamespace

    from anygrad.backends.wgpu.device import poller
    ffi, _ = poller._native()
    recorder = _Recorder()
    monkeypatch.setattr(poller, "_native", lambda: (ffi, recorder))
    own = object()
    device = SimpleNamespace(_internal=1234, _poller=SimpleNamespace(_poll_func=own))
    monkeypatch.setenv("ANYGRAD_WGPU_POLL", "block")
    assert not poller.poll_freely(device) and device._poller._poll_func is own
    monkeypatch.delenv("ANYGRAD_WGPU_POLL")
    slept = []
    assert poller.poll_freely(device, sleep=slept.append)
    device._poller._poll_func(True)
    device._poller._poll_func(False)
    assert recorder.calls == [(1234, False, ffi.NULL)] * 2
    assert slept == [poller.POLL_INTERVAL_S]
    assert not poller.poll_freely(SimpleNamespace())  # a wgpu-py without these internals: left as it is


def test_mappings_resolve_on_the_device(backend):
    """A copy submitted, then mapped: the poll thread (polling without waiting) resolves it."""
    import wgpu
    assert backend.ctx.polls_freely
    device, U = backend.device, wgpu.BufferUsage
    src = device.create_buffer_with_data(data=np.arange(8, dtype=np.float32), usage=U.COPY_SRC)
    dst = device.create_buffer(size=32, usage=U.MAP_READ | U.COPY_DST)
    for _ in range(3):
        enc = device.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, dst, 0, 32)
        device.queue.submit([enc.finish()])
        dst.map_async(wgpu.MapMode.READ).sync_wait()
        np.testing.assert_array_equal(np.frombuffer(dst.read_mapped(), np.float32), np.arange(8))
        dst.unmap()


def test_states_written_back_through_a_mapped_buffer(backend):
    """import_states through its kept upload buffer, twice (mapped again the second time), equals the
    values written, also where the states are not neighbours in one buffer."""
    rng = np.random.default_rng(0)
    names = ["poll.a", "poll.b", "poll.c"]
    shapes = [(3, 5), (7,), (2, 2, 2)]
    for n, s in zip(names, shapes):
        backend.set_state(n, np.zeros(s, np.float32))
    for _ in range(2):
        flat = rng.standard_normal(sum(int(np.prod(s)) for s in shapes)).astype(np.float32)
        backend.import_states(names, flat)
        got = np.concatenate([backend.get_state(n).reshape(-1) for n in names])
        np.testing.assert_array_equal(got, flat)
    assert tuple(names) in backend._import_bufs
