"""Writing files so that a crash, a kill or a full disk never leaves a half-written one.

Every artifact anygrad writes goes through `atomic_write`: the content goes to a sibling temp
file (same folder, so the rename cannot cross file systems), is flushed to the disk, and is
renamed over the target in one step. A reader sees the old file or the new one, never a mix.
Temp names start with '.' and end with TMP_SUFFIX, so `remove_stray_temps` can clear what a
killed process left behind.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

TMP_SUFFIX = ".tmp"


def temp_name(path: Path) -> Path:
    """The sibling temp file `path` is written to before its rename (unique per process)."""
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write(path: str | os.PathLike, content: bytes | str | Callable[[IO[Any]], Any], *,
                 fsync: bool = True) -> Path:
    """Write `content` (bytes, text, or a function that writes to the open binary file) to
    `path` atomically. The file gets the mode a plain open() gives (0666 less the umask, so
    0644 usually; mkstemp's 0600 would stick). An error (a full disk: OSError ENOSPC) leaves
    `path` as it was and no temp file behind, and propagates."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def remove_stray_temps(folder: Path) -> list[Path]:
    """Delete the temp files (`.NAME.PID.tmp`) that killed writers left in `folder`; returns them.
    Only call this while holding the folder (a live writer's temp file would go too)."""
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if p.name.startswith(".") and p.name.endswith(TMP_SUFFIX) and p.is_file():
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    return removed
