"""Opening files that may be hostile: regular files only, read with a bound.

A FIFO given as a model blocks `open()` forever (until something writes to it), and /dev/zero or
/dev/urandom read until memory runs out. Every reader of model, weight and data files opens
through `open_regular`, which refuses anything but a regular file before reading a byte (and
opens non-blocking, so that a FIFO swapped in after the check cannot block either).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from ..errors import AnygradError, ModelError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


_CHUNK = 16 << 20


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(path: Path, mode: int, error: type[AnygradError]) -> AnygradError:
    return error(f"{path} is {_kind(mode)}, not a regular file; give the path of a file on disk")


def check_regular(path: str | os.PathLike, error: type[AnygradError] = ModelError) -> int:
    """The size of `path` if it is a regular file (symlinks followed); `error` otherwise."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except (OSError, ValueError) as e:  # permissions, a name too long, a NUL in the name
        raise error(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st.st_mode, error)
    return st.st_size


def open_regular(path: str | os.PathLike, error: type[AnygradError] = ModelError) -> BinaryIO:
    """`path` opened for binary reading, if it is a regular file; `error` naming it otherwise."""
    path = Path(path)
    check_regular(path, error)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise error(f"{path}: cannot open ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the check and the open
        os.close(fd)
        raise _refuse(path, st.st_mode, error)
    return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike, error: type[AnygradError] = ModelError,
                 limit: int | None = None) -> bytearray:
    """The whole of a regular file, as a writable buffer (at most `limit` bytes, else `error`)."""
    path = Path(path)
    with open_regular(path, error) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise error(f"{path} holds {size} bytes, more than the {limit} this reader accepts")
        return read_into(f, size)


def read_into(f: BinaryIO, size: int) -> bytearray:
    """Up to `size` bytes from `f` into one writable buffer (no intermediate copy)."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = f.readinto(view[got:got + _CHUNK])  # (a zip member's readinto reads into a temporary first)
        if not n:
            break
        got += n
    view.release()
    del buf[got:]  # the file was shorter (it shrank while being read)
    return buf
