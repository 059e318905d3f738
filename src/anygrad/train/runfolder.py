"""A run's --artifacts folder: one run per folder, one process at a time.

- A folder that holds another run (its config.json, metrics or checkpoints) is refused unless the
  caller resumes that run or asks to overwrite it: a new run written over an old one would mix
  the two (the old run's later checkpoints would outrank the new run's on resume).
- While a run lives it holds `.anygrad.lock` (an advisory flock, released by the kernel when the
  process dies, even by SIGKILL; the file names the pid for the message). A second run in the
  same folder is refused. A lock file left by a dead process is taken over, and said so.
- On entry, what a killed run left (temp files, uncommitted checkpoint arrays) is removed.
- Nothing the user owns is written over or removed: a folder holding files of the names a run
  writes (a user's own weights.safetensors, a Hugging Face config.json, a `checkpoints` folder of
  .pt files) that are not an anygrad run's is refused, --overwrite or not; so is a run whose own
  inputs (the model file, its --weights, its data) are among the files the run writes or removes
  (`anygrad train proj/model.onnx --artifacts proj`). Refusing before anything is written keeps
  every started run resumable: its input model stays the file its checkpoints were made from.
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ..errors import ConfigError
from ..fsutil import remove_stray_temps
from ..plot import PLOTS_RECORD, plotted_files
from . import checkpoint as ckpt

LOCK = ".anygrad.lock"
# What a run writes; --overwrite removes these, the plots `anygrad plot` recorded it wrote there
# (plot.plotted_files: loss.png, perplexity.png, ..., as written) and nothing else the user keeps there.
RUN_FILES = ("config.json", "metrics.jsonl", "metrics.csv", "metrics_steps.csv", "weights.npz",
             "weights.safetensors", "model.onnx", "model.onnx.data", "export.json")
RUN_DIRS = ("checkpoints",)


@dataclass(frozen=True)
class Wording:
    """How messages name the folder and the ways out: the CLI's flags or Model.fit's keywords."""

    folder: str = "--artifacts"
    resume: str = "--resume {folder}"
    overwrite: str = "--overwrite"


CLI = Wording()
PYTHON = Wording("artifacts_dir", "resume=True", "overwrite=True")


class RunFolderError(ConfigError):
    """The run folder holds another run, is used by a live run, or stopped taking files."""


def is_run_config(path: Path) -> bool:
    """Whether `path` is the config.json an anygrad run wrote (its settings plus a "resolved"
    record), not a file of the same name the user keeps there (a Hugging Face model's config)."""
    try:
        record = json.loads(path.read_bytes()[:16 << 20])
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(record, dict) and (isinstance(record.get("resolved"), dict)
                                         or {"epochs", "batch_size", "optimizer"} <= set(record))


def _is_checkpoint_file(name: str) -> bool:
    """A file an anygrad run keeps in checkpoints/ (records, arrays, or a killed writer's temp)."""
    if name.startswith(".") and name.endswith(".tmp"):
        return True
    return name.startswith((ckpt.PREFIX, ckpt.BEST)) and name.endswith((".json", ".npz"))


def describe_run(folder: Path) -> str | None:
    """What run `folder` holds, in words ("config.json, 3 checkpoints, 8 epochs of metrics"), or None."""
    parts = []
    if is_run_config(folder / "config.json"):
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


def users_files(folder: Path) -> list[str]:
    """Files in `folder` of the names a run writes that no anygrad run wrote: those of RUN_FILES
    when the folder holds no run, a config.json that is not a run's, and what checkpoints/ holds
    besides anygrad's own checkpoint files."""
    found = []
    run = describe_run(folder) is not None
    for name in RUN_FILES:
        if os.path.lexists(folder / name) and (not run or name == "config.json"
                                               and not is_run_config(folder / name)):
            found.append(name)
    for name in RUN_DIRS:
        where = folder / name
        if where.is_dir():
            found += [f"{name}/{p.name}" for p in sorted(where.iterdir()) if not _is_checkpoint_file(p.name)]
        elif os.path.lexists(where):
            found.append(name)
    return found


def run_paths(folder: Path) -> list[Path]:
    """The paths a run in `folder` writes or, with --overwrite, removes."""
    return [folder / name for name in RUN_FILES + RUN_DIRS]


def _written_input(folder: Path, inputs: Iterable[str | os.PathLike | None]) -> Path | None:
    """The first of `inputs` (the run's model, weights, data) that is, or lies inside, a path the
    run writes in `folder`; None when the run leaves them all alone."""
    targets = []
    for path in run_paths(folder):
        try:
            targets.append(path.resolve())
        except (OSError, RuntimeError):
            continue
    for given in inputs:
        if not given:
            continue
        try:
            where = Path(given).resolve()
        except (OSError, RuntimeError, TypeError, ValueError):
            continue
        if any(where == t or where.is_relative_to(t) for t in targets):
            return Path(given)
    return None


def make_folder(path: Path, option: str = "--artifacts") -> list[Path]:
    """Create the run's folder (and missing parents) before anything slow happens, and check it
    takes files: a bad folder fails at once, not after loading data and model. Returns the folders
    it created, outermost first, for `remove_empty` if the run fails before it starts."""
    missing, existing = [], path
    while not os.path.lexists(existing) and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise RunFolderError(f"{option} {path}: {existing} is a file, not a folder; choose another {option} folder")
    created: list[Path] = []
    where = path
    try:
        for where in reversed(missing):
            where.mkdir()
            created.append(where)
        probe = path / f".anygrad-write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        remove_empty(created)
        raise RunFolderError(f"{option} {path}: cannot {'write into' if where == path and not missing else 'create'} "
                             f"{where} ({e.strerror or e}); choose a folder you can write to") from None
    return created


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders `make_folder` created (innermost first) while they are empty: a run that
    never started leaves nothing behind (a started one keeps its files)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


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
                 log: Callable[[str], None] = print, inputs: Iterable[str | os.PathLike | None] = (),
                 wording: Wording = CLI):
        self.folder, self.resume, self.overwrite, self.log = Path(folder), resume, overwrite, log
        self.inputs, self.wording = tuple(inputs), wording
        self._fd: int | None = None

    def __enter__(self) -> RunFolder:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        self._check_inputs()  # before anything is created or locked there
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            held = describe_run(self.folder)
            if not self.resume:
                self._check_users_files()
            if held and not self.resume:
                w = self.wording
                if not self.overwrite and ckpt.latest(self.folder / "checkpoints") is None:
                    raise RunFolderError(
                        f"{w.folder} {self.folder} holds another run ({held}) that stopped before its first "
                        f"checkpoint, so it cannot be resumed; replace it with {w.overwrite}, or choose another "
                        "folder")
                if not self.overwrite:
                    raise RunFolderError(
                        f"{w.folder} {self.folder} holds another run ({held}); choose another folder, continue "
                        f"that run with {w.resume.format(folder=self.folder)}, or replace it with {w.overwrite}")
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
    def _check_inputs(self) -> None:
        """A run never writes over (or, with --overwrite, removes) its own model, weights or data."""
        hit = _written_input(self.folder, self.inputs)
        if hit is not None:
            raise RunFolderError(
                f"{self.wording.folder} {self.folder}: the run would write its own {_run_name(self.folder, hit)} "
                f"there, over {hit}, which it trains from; keep the run's outputs apart from your files, e.g. "
                f"{self.wording.folder} {self.folder / 'run'}")

    def _check_users_files(self) -> None:
        theirs = users_files(self.folder)
        if theirs:
            shown = ", ".join(theirs[:6]) + (f" and {len(theirs) - 6} more" if len(theirs) > 6 else "")
            raise RunFolderError(
                f"{self.wording.folder} {self.folder} holds files of the names a run writes that are not an "
                f"anygrad run's ({shown}); the run will not replace them: choose another folder (a new or empty "
                f"one, e.g. {self.wording.folder} {self.folder / 'run'}), or move those files")

    def _remove_old_run(self, held: str) -> None:
        for path in plotted_files(self.folder):  # before RUN_FILES: a plot's name may be no run file's
            path.unlink(missing_ok=True)
        (self.folder / PLOTS_RECORD).unlink(missing_ok=True)
        for name in RUN_FILES:
            (self.folder / name).unlink(missing_ok=True)
        for name in RUN_DIRS:  # anygrad's checkpoint files only (users_files refused anything else)
            where = self.folder / name
            if where.is_dir():
                for p in where.iterdir():
                    if _is_checkpoint_file(p.name) and p.is_file():
                        p.unlink(missing_ok=True)
                try:
                    where.rmdir()
                except OSError:  # something else is there: it stays
                    pass
        self.log(f"{self.wording.overwrite}: removed the earlier run in {self.folder} ({held})")

    def _clean(self) -> None:
        removed = remove_stray_temps(self.folder) + ckpt.clean(self.folder / "checkpoints")
        if removed:
            self.log(f"removed {len(removed)} file{'s' * (len(removed) != 1)} a stopped run left unfinished: "
                     + ", ".join(p.name for p in removed[:4]) + (" ..." if len(removed) > 4 else ""))


def _run_name(folder: Path, hit: Path) -> str:
    """The run file (model.onnx, checkpoints) that `hit` is, or lies in."""
    try:
        return Path(hit).resolve().relative_to(folder.resolve()).parts[0]
    except (ValueError, OSError, IndexError):
        return Path(hit).name
