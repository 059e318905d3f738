""".npz files (numpy.savez / savez_compressed) read with bounds: the one reader of every .npz input.

`numpy.load` trusts the archive: a 2 MB deflate bomb inflates to a 1 GiB array, and a corrupt file
fails with whatever zipfile, zlib or numpy raise. Here the zip directory is checked first -- every
member's declared size, their total against the file's size (deflate can claim ~1000x, real arrays
compress a few times), stored members no larger than the file -- then each array's .npy header, and
only then is memory allocated, for exactly what the header says, and filled with a bounded read.
Arrays holding Python objects (which need pickle) are refused. Every failure is one `error` naming
the file.
"""
from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import IO

import numpy as np

from ..errors import AnygradError, ModelError
from .safe_io import open_regular, read_into

# Uncompressed bytes an .npz may hold: this many times its own size, or the floor, whichever is more.
MAX_INFLATION, INFLATION_FLOOR = 64, 256 << 20
_NPY_HEADER_MAX = 10_000  # numpy's own limit for .npy headers


def read_npz_arrays(path: str | os.PathLike, error: type[AnygradError] = ModelError,
                    max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """Every array of the .npz at `path` (name -> array, writable). `max_bytes` bounds the arrays'
    total size (default: MAX_INFLATION times the file's size, at least INFLATION_FLOOR)."""
    path = Path(path)
    with open_regular(path, error) as f:
        size = os.fstat(f.fileno()).st_size
        return _read(f, size, str(path), error, max_bytes)


def read_npz_bytes(data: bytes, name: str, error: type[AnygradError] = ModelError,
                   max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """`read_npz_arrays` for an .npz already in memory; `name` names it in errors."""
    return _read(io.BytesIO(data), len(data), name, error, max_bytes)


def map_npy(path: str | os.PathLike, error: type[AnygradError] = ModelError) -> np.ndarray:
    """A .npy file mapped read-only (read lazily), after its header is checked: a format numpy
    writes, no Python objects, and exactly the bytes its shape and dtype declare. `np.load`
    would map whatever the header claims and raise anything from EOFError to SyntaxError."""
    path = Path(path)
    name = str(path)
    with open_regular(path, error) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            shape, fortran, dtype = _npy_header(f, name, error)
            offset = f.tell()
        except AnygradError:
            raise
        except Exception as e:  # noqa: BLE001  (numpy's header parser: ValueError, EOFError, SyntaxError...)
            raise error(f"{name}: not a readable .npy array ({type(e).__name__}: {str(e)[:200]})") from None
    if dtype.hasobject:
        raise error(f"{name} holds Python objects (stored with pickle), which anygrad never loads; "
                    "np.save a plain numeric array")
    count = 1
    for n in shape:
        count *= n
    if count * dtype.itemsize != size - offset:
        raise error(f"{name} declares shape {shape} of {dtype} ({count * dtype.itemsize} bytes), but holds "
                    f"{size - offset} bytes of data (truncated or corrupt?)")
    if count == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def _npy_header(f: IO[bytes], where: str, error: type[AnygradError]) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f, max_header_size=_NPY_HEADER_MAX)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f, max_header_size=_NPY_HEADER_MAX)
    raise error(f"{where} uses .npy format version {version}, which anygrad does not read")


def _read(f: IO[bytes], size: int, name: str, error: type[AnygradError],
          max_bytes: int | None) -> dict[str, np.ndarray]:
    if size == 0:
        raise error(f"{name} is empty; an .npz file is written by numpy.savez")
    limit = max_bytes if max_bytes is not None else max(MAX_INFLATION * size, INFLATION_FLOOR)
    try:
        with zipfile.ZipFile(f) as zf:
            infos = _checked_directory(zf, size, name, limit, error)
            return {key: _array(zf, info, name, error) for key, info in infos.items()}
    except AnygradError:
        raise
    except Exception as e:  # noqa: BLE001  (zipfile, zlib, numpy and struct errors, MemoryError...)
        detail = str(e) if len(str(e)) <= 200 else str(e)[:200] + "..."
        raise error(f"{name}: not a readable .npz file of plain arrays ({type(e).__name__}: {detail})") from None


def _checked_directory(zf: zipfile.ZipFile, size: int, name: str, limit: int,
                       error: type[AnygradError]) -> dict[str, zipfile.ZipInfo]:
    """Array name -> member, after checking every declared size against the file and `limit`."""
    infos: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in zf.infolist():
        if info.is_dir() or not info.filename.endswith(".npy"):
            continue  # numpy.savez writes only .npy members; others are not arrays
        key = info.filename[:-len(".npy")]
        if key in infos:
            raise error(f"{name}: holds the array '{key}' twice (a corrupt or hand-made archive)")
        if info.compress_type == zipfile.ZIP_STORED and (info.file_size != info.compress_size or info.file_size > size):
            raise error(f"{name}: member {info.filename} claims {info.file_size} bytes, more than the file holds")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise error(f"{name}: member {info.filename} uses zip compression method {info.compress_type}; "
                        "save it with numpy.savez or numpy.savez_compressed")
        total += info.file_size
        if total > limit:
            raise error(f"{name}: its arrays would take more than {limit >> 20} MiB once decompressed, from a "
                        f"{size}-byte file (a zip bomb?); if it is genuine, save it uncompressed with numpy.savez")
        infos[key] = info
    return infos


def _array(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, error: type[AnygradError]) -> np.ndarray:
    where = f"{name}: array '{info.filename[:-4]}'"
    with zf.open(info) as member:
        shape, fortran, dtype = _npy_header(member, where, error)
        if dtype.hasobject:
            raise error(f"{name}: not a readable .npz file of plain arrays: '{info.filename[:-4]}' holds Python "
                        "objects (stored with pickle), which anygrad never loads; save plain numeric arrays")
        count = 1
        for n in shape:
            count *= n
        nbytes = count * dtype.itemsize
        left = info.file_size - member.tell()
        if nbytes != left:
            raise error(f"{where} declares shape {shape} of {dtype} ({nbytes} bytes), but the archive holds "
                        f"{left} bytes for it (truncated or corrupt?)")
        data = read_into(member, nbytes)
        if len(data) != nbytes or member.read(1):
            raise error(f"{where} does not hold the {nbytes} bytes its header declares")
    if dtype.itemsize == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(data, dtype=dtype, count=count).reshape(shape, order="F" if fortran else "C")
