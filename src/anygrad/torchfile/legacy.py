"""The legacy checkpoint format (torch.save(..., _use_new_zipfile_serialization=False)).

One stream of five pickles and the raw storages:

    magic number | protocol version | sys_info {little_endian, ...} | the object | list of storage keys
    then per key: int64 element count, then count * element_size raw bytes
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .allowlist import ALLOWED, StorageType
from .pickle_reader import Unpickler
from .tensors import RAW_DTYPES, FormatError, Storage, resolve, short_repr

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001


def _no_persistent(pid: Any) -> Any:
    raise FormatError("unexpected persistent id in a header pickle")


def _plain_pickle(data: bytes, pos: int) -> tuple[Any, int]:
    """One pickle of plain values (no globals at all) starting at `pos`, and where it ends."""
    u = Unpickler(data, {}, _no_persistent, pos=pos)
    return u.load(), u.pos


def read_legacy(data: bytes | bytearray) -> Any:
    if data[257:262] == b"ustar":
        raise FormatError("this is a tar-format checkpoint (PyTorch < 0.4); load and re-save it with a "
                          "recent PyTorch")
    magic, pos = _plain_pickle(data, 0)
    if magic != MAGIC_NUMBER:
        raise FormatError("not a PyTorch checkpoint (no zip archive and no legacy magic number)")
    protocol, pos = _plain_pickle(data, pos)
    if protocol != PROTOCOL_VERSION:
        raise FormatError(f"unsupported legacy protocol version {short_repr(protocol)}")
    sys_info, pos = _plain_pickle(data, pos)
    if not isinstance(sys_info, dict):
        raise FormatError("legacy sys_info header is malformed")
    byteorder = "<" if sys_info.get("little_endian", True) else ">"
    storages: dict[str, Storage] = {}

    def persistent_load(pid: Any) -> Any:
        if isinstance(pid, tuple) and pid[:1] == ("module",):
            raise FormatError("the checkpoint holds a whole pickled nn.Module; save model.state_dict() "
                              "with torch.save instead")
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
            raise FormatError(f"malformed storage id {short_repr(pid)}")
        _, stype, key, location, numel = pid[:5]
        view = pid[5] if len(pid) == 6 else None
        if not isinstance(stype, StorageType) or not isinstance(key, str) or type(numel) is not int \
                or numel < 0 or not isinstance(location, str):
            raise FormatError(f"malformed storage id {short_repr(pid)}")
        root = storages.setdefault(key, Storage(stype.dtype, numel, key))
        if view is None:
            return root
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)
                and all(type(v) is int and v >= 0 for v in view[1:])):
            raise FormatError(f"malformed storage view {short_repr(view)}")
        view_key, offset, size = view
        return storages.setdefault(view_key, Storage(stype.dtype, size, view_key, base=root, offset=offset))

    main = Unpickler(data, ALLOWED, persistent_load, pos=pos)
    obj = main.load()
    keys, pos = _plain_pickle(data, main.pos)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise FormatError("legacy storage key list is malformed")
    unknown = [k for k in keys if k not in storages]
    if unknown:
        raise FormatError(f"storage data for {short_repr(unknown)}, which no tensor uses")
    for key in keys:
        storage = storages[key]
        if storage.base is not None:
            raise FormatError(f"storage {key} is both a view and a root")
        if pos + 8 > len(data):
            raise FormatError(f"file ends before storage {key}")
        (count,) = struct.unpack(byteorder + "q", data[pos:pos + 8])
        nbytes = count * np.dtype(RAW_DTYPES[storage.dtype]).itemsize
        if count < 0 or pos + 8 + nbytes > len(data):
            raise FormatError(f"storage {key} claims {count} elements, more than the file holds")
        storage.data = memoryview(data)[pos + 8:pos + 8 + nbytes]
        pos += 8 + nbytes
    return resolve(obj, byteorder, sum(len(s.data) for s in storages.values() if s.data is not None))
