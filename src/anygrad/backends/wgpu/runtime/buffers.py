"""Host <-> device bytes for the wgpu runtime (its allocator's side): WebGPU's flag constants,
device errors a user can meet, state buffers, conversions to and from the device's dtypes, and
reading mapped buffers (over the host's threads where it pays).
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .... import _parallel
from ....errors import DeviceError, first_line
from ..device import implementation
from ..kernels.wgsl import np_device_dtype


def _wgpu():
    """WebGPU's flag and enum constants (the same values in wgpu-native and Dawn: implementation.py)."""
    return implementation.flags()

def _gpu_error(e: Exception, what: str) -> Exception:
    """Device-side failures a user can cause or meet become DeviceErrors; bugs stay bugs."""
    wgpu = _wgpu()
    text = str(e)
    if isinstance(e, getattr(wgpu, "GPUOutOfMemoryError", ())) or "out of memory" in text.lower():
        return DeviceError(f"out of device memory while {what}. Use a smaller batch or a smaller model.")
    if "lost" in text.lower():
        return DeviceError(f"the GPU device was lost while {what} ({first_line(e)}). "
                           "Restart the program; if it repeats, update the driver or use device='cpu'.")
    return e


@dataclass
class _StateBuf:
    buffer: Any
    dtype: np.dtype      # host dtype, restored by get_state
    shape: tuple
    nbytes: int
    offset: int = 0      # bytes; nonzero inside an arena
    arena: str = ""      # the arena holding it, if any
    pending: np.ndarray | None = None  # device bytes not yet uploaded (buffer is None until placed)


def to_device(value: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """Host array -> contiguous device representation (f32 / i32 / u32)."""
    value = np.asarray(value)
    dev = np_device_dtype(dtype if dtype is not None else value.dtype)
    data = np.ascontiguousarray(value.astype(dev, copy=False))
    if data.itemsize == 2 and data.size % 2:  # f16: whole 4-byte words, as buffer writes need
        data = np.concatenate([data.reshape(-1), np.zeros(1, data.dtype)])
    return data


def _owned(data: np.ndarray, value: np.ndarray) -> np.ndarray:
    """`data`, copied if it shares memory with the caller's array (held until it is uploaded)."""
    return data.copy() if np.may_share_memory(data, value) else data


def _cancel(hooks: Sequence[Callable[[], None]]) -> None:
    """Map requests whose copies were never submitted: their readers stop waiting (and raise)."""
    for hook in hooks:
        getattr(hook, "cancel", lambda: None)()


def _copy_mapped(buf: Any, mapping: Any, out: np.ndarray) -> None:
    """Wait for `mapping` (buf.map_async(READ); an event wait: the GIL is free), copy the first
    out.nbytes bytes of the mapped buffer into `out` over the threads, unmap."""
    implementation.wait_mapped(buf, mapping)
    try:
        _parallel.copy(out, np.frombuffer(buf.read_mapped(0, out.nbytes, copy=False), out.dtype))
    finally:
        buf.unmap()


def _unmapped(buf: Any, mapping: Any = None) -> Any:
    """A kept staging buffer, back to unmapped before new copies go into it. A step that failed
    mid-way may have left its map asked for and never read (pending or mapped, `mapping` its
    promise), and wgpu-native aborts the process on a submit that copies into a mapped buffer
    (docs/wgpu-facts.md); wgpu-py cannot unmap a pending map, so that one is waited for first."""
    state = getattr(buf, "map_state", "unmapped")
    if state == "pending" and mapping is not None:
        with contextlib.suppress(Exception):  # an aborted map leaves the buffer unmapped, as wanted
            mapping.sync_wait()
        state = buf.map_state
    if state == "mapped":
        buf.unmap()
    return buf


def _mapped_view(buf: Any, nbytes: int) -> np.ndarray | None:
    """The first nbytes of a mapped buffer as a writable uint8 array (wgpu-py's write_mapped copies
    on one thread, and its read_mapped views are read-only), or None where this wgpu-py has no
    such internals or the implementation gives no writable range (Dawn, for a read mapping).
    Valid until the buffer is unmapped; on wgpu-native writes into a read mapping are dropped
    then (WebGPU's semantics), so it may serve as scratch."""
    _api = implementation.of(buf).cffi_api()  # each implementation's C API takes its own buffers only
    if _api is None:
        return None
    try:
        ptr = _api.libf.wgpuBufferGetMappedRange(buf._internal, 0, nbytes)
        address = int(_api.ffi.cast("intptr_t", ptr))
    except (ImportError, AttributeError):
        return None
    if not address:
        return None
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def to_device_packed(value: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """A 1-byte array as stored, for a packed input (fusion.pack_byte_inputs): its whole 4-byte
    words as a view of its bytes (no copy, no per-element work), and the last partial word
    zero-padded, if any. Bytes in memory order are what WGSL reads as little-endian u32 words,
    so the host's byte order does not matter."""
    raw = np.ascontiguousarray(value, dtype=dtype).reshape(-1).view(np.uint8)
    whole = raw.size & ~3
    if whole == raw.size:
        return raw, None
    tail = np.zeros(4, np.uint8)
    tail[:raw.size - whole] = raw[whole:]
    return raw[:whole], tail


def from_device(raw: bytes, dtype: np.dtype, shape: tuple) -> np.ndarray:
    dev = np_device_dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    arr = np.frombuffer(raw, dtype=dev, count=n)
    if np.dtype(dtype) == np.bool_:
        return (arr != 0).reshape(shape)
    return arr.astype(dtype).reshape(shape)


