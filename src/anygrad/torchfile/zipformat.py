"""The zip checkpoint format of torch.save (PyTorch >= 1.6).

    <top>/data.pkl       the object, tensors pointing at storages by persistent id
    <top>/data/<key>     raw bytes of each storage
    <top>/byteorder      "little" or "big" (absent in old files: little)

The top folder's name is whatever the file was first saved as, so it is found, not assumed.
torch.save stores every member uncompressed; a compressed member is refused, since a few hundred
bytes of deflate can claim gigabytes (a zip bomb), while a stored member is never larger than the file.
"""
from __future__ import annotations

import os
import re
import zipfile
from typing import Any, BinaryIO

import numpy as np

from .allowlist import ALLOWED, StorageType
from .pickle_reader import Unpickler
from .safe_io import read_into
from .tensors import RAW_DTYPES, FormatError, Storage, resolve, short_repr

_PICKLE = re.compile(r"([^/]+)/data\.pkl")
_BYTEORDER = {"little": "<", "big": ">"}


def _top_folder(names: list[str]) -> str:
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        raise FormatError("this is a TorchScript archive (torch.jit.save); save model.state_dict() "
                          "with torch.save, or export the model to ONNX")
    tops = [m.group(1) for m in map(_PICKLE.fullmatch, names) if m]
    if len(tops) != 1:
        raise FormatError(f"expected exactly one <folder>/data.pkl in the zip archive, found {len(tops)}")
    return tops[0]


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, file_size: int) -> bytearray:
    """A stored member's bytes, in a writable buffer (arrays share the storages' bytes)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise FormatError(f"{info.filename} is compressed; torch.save writes checkpoints uncompressed and "
                          "anygrad refuses compressed ones (they can inflate without bound): load it with "
                          "torch and save it again with torch.save, or re-zip it without compression (zip -0)")
    if info.file_size != info.compress_size or info.file_size > file_size:
        raise FormatError(f"{info.filename} claims {info.file_size} bytes, more than the archive holds")
    with zf.open(info) as member:
        data = read_into(member, info.file_size)
        if len(data) != info.file_size or member.read(1):
            raise FormatError(f"{info.filename} does not hold the {info.file_size} bytes its header claims")
    return data


def read_zip(f: BinaryIO) -> Any:
    """The object of a zip checkpoint, from its file opened for reading."""
    file_size = os.fstat(f.fileno()).st_size
    with zipfile.ZipFile(f) as zf:
        names = zf.namelist()
        top = _top_folder(names)
        byteorder = "<"
        if f"{top}/byteorder" in names:
            text = bytes(_read_member(zf, zf.getinfo(f"{top}/byteorder"), file_size)).decode("ascii").strip()
            if text not in _BYTEORDER:
                raise FormatError(f"unknown byteorder {text!r:.20}")
            byteorder = _BYTEORDER[text]
        storages: dict[str, Storage] = {}

        def persistent_load(pid: Any) -> Storage:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                raise FormatError(f"malformed storage id {short_repr(pid)}")
            _, stype, key, location, numel = pid
            if not isinstance(stype, StorageType) or not isinstance(key, str) or type(numel) is not int \
                    or numel < 0 or not isinstance(location, str):
                raise FormatError(f"malformed storage id {short_repr(pid)}")
            if key not in storages:
                nbytes = numel * np.dtype(RAW_DTYPES[stype.dtype]).itemsize
                try:
                    info = zf.getinfo(f"{top}/data/{key}")
                except KeyError:
                    raise FormatError(f"storage file {top}/data/{key} is missing from the archive") from None
                if info.file_size < nbytes:
                    raise FormatError(f"storage {key} holds {info.file_size} bytes, {nbytes} expected")
                storages[key] = Storage(stype.dtype, numel, key, _read_member(zf, info, file_size))
            return storages[key]

        pickled = bytes(_read_member(zf, zf.getinfo(f"{top}/data.pkl"), file_size))
        obj = Unpickler(pickled, ALLOWED, persistent_load).load()
        return resolve(obj, byteorder, sum(len(s.data or b"") for s in storages.values()))
