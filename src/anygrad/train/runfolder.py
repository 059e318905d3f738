"""A run's --artifacts folder: one run per folder, one process at a time.

- A folder that holds another run (its config.json, metrics or checkpoints) is refused unless the
  caller resumes that run or asks to overwrite it: a new run written over an old one would mix
  the two (the old run's later checkpoints would outrank the new run's on resume).
- While a run lives it holds `.anygrad.lock` (an advisory flock, released by the kernel when the
  process dies, even by SIGKILL; the file names the pid for the message). A second run in the
  same folder is refused. A lock file left by a dead process is taken over, and said so.
- On entry, what a killed run left (temp files, uncommitted checkpoint arrays) is removed.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from ..errors import ConfigError
from ..fsutil import remove_stray_temps
from . import checkpoint as ckpt

LOCK = ".anygrad.lock"
# What a run writes; --overwrite removes these (and nothing else the user keeps there).
RUN_FILES = ("config.json", "metrics.jsonl", "metrics.csv", "metrics_steps.csv", "weights.npz",
             "weights.safetensors", "model.onnx", "model.onnx.data", "export.json", "loss.png", "accuracy.png")
RUN_DIRS = ("checkpoints",)


class RunFolderError(ConfigError):
    """The run folder holds another run, is used by a live run, or stopped taking files."""


def describe_run(folder: Path) -> str | None:
    """What run `folder` holds, in words ("config.json, 3 checkpoints, 8 epochs of metrics"), or None."""
    parts = []
    if (folder / "config.json").is_file():
        parts.append("config.json")
    n = len(ckpt.numbered(folder / "checkpoints"))
    if n:
        parts.append(f"{n} checkpoint{'s' * (n != 1)}")
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        try:
            rows = len(metrics.read_text().splitlines())
        except (OSError, UnicodeDecodeError):
            rows = 0
        parts.append(f"{rows} epoch{'s' * (rows != 1)} of metrics")
    return ", ".join(parts) or None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


class RunFolder:
    """Context manager: claim `folder` for one run (see the module's doc); release on exit."""

    def __init__(self, folder: Path, *, resume: bool = False, overwrite: bool = False,
                 log: Callable[[str], None] = print):
        self.folder, self.resume, self.overwrite, self.log = Path(folder), resume, overwrite, log
        self._fd: int | None = None

    def __enter__(self) -> RunFolder:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            held = describe_run(self.folder)
            if held and not self.resume:
                if not self.overwrite:
                    raise RunFolderError(
                        f"--artifacts {self.folder} holds another run ({held}); choose another folder, continue "
                        f"that run with --resume {self.folder}, or replace it with --overwrite")
                self._remove_old_run(held)
            self._clean()
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._unlock()

    # -- the lock ---------------------------------------------------------------------------------
    def _lock(self) -> None:
        for _ in range(5):  # again when the file we locked was unlinked meanwhile by a run that ended
            self._lock_once()
            try:
                if os.fstat(self._fd).st_ino == os.stat(self.folder / LOCK).st_ino:
                    return
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
        raise RunFolderError(f"--artifacts {self.folder}: cannot take its lock file {LOCK}; try again")

    def _lock_once(self) -> None:
        path = self.folder / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunFolderError(f"--artifacts {self.folder}: cannot create its lock file ({e.strerror or e}); "
                                 "choose a folder you can write to") from None
        holder = self._holder(fd)
        try:
            import fcntl
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                taken = True
            except BlockingIOError:
                taken = False
        except ImportError:  # no flock (Windows): the pid in the file decides
            taken = not (holder.get("pid") and holder.get("host") == socket.gethostname()
                         and _pid_alive(int(holder["pid"])) and int(holder["pid"]) != os.getpid())
        if not taken:
            os.close(fd)
            who = f"pid {holder.get('pid')}" + (f", started {holder['started']}" if holder.get("started") else "")
            raise RunFolderError(f"--artifacts {self.folder} is in use by another anygrad run ({who}); wait for it "
                                 "to end or choose another folder")
        if holder.get("pid") and holder.get("pid") != os.getpid():
            self.log(f"note: took over the lock of a run that is no longer alive (pid {holder['pid']}) in "
                     f"{self.folder}")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd

    @staticmethod
    def _holder(fd: int) -> dict:
        try:
            record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) and isinstance(record.get("pid", 0), int) else {}

    def _unlock(self) -> None:
        if self._fd is None:
            return
        try:
            (self.folder / LOCK).unlink(missing_ok=True)  # while still holding it: no one else has it open-locked
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    # -- contents ---------------------------------------------------------------------------------
    def _remove_old_run(self, held: str) -> None:
        for name in RUN_FILES:
            (self.folder / name).unlink(missing_ok=True)
        for name in RUN_DIRS:
            shutil.rmtree(self.folder / name, ignore_errors=True)
        self.log(f"--overwrite: removed the earlier run in {self.folder} ({held})")

    def _clean(self) -> None:
        removed = remove_stray_temps(self.folder) + ckpt.clean(self.folder / "checkpoints")
        if removed:
            self.log(f"removed {len(removed)} file{'s' * (len(removed) != 1)} a stopped run left unfinished: "
                     + ", ".join(p.name for p in removed[:4]) + (" ..." if len(removed) > 4 else ""))
