"""Dataset files that live on the web: found in a folder, or in a cache filled by downloading.

One `RemoteSet` per dataset (MNIST, Fashion-MNIST, CIFAR-10) names its files, with the official
md5 of each, and its mirrors; `locate` finds them or downloads what is missing. A download tries
each mirror in turn, checks the md5, and is written to a temporary name then renamed, so the
cache never holds half a file. Files in a user's own folder (`data_dir`) are read as they are.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import settings
from ..errors import DataError

CACHE_ENV = "ANYGRAD_CACHE"  # root of anygrad's cache; a dataset lives in <root>/<its key>
CHUNK = 1 << 16


def cache_root() -> Path:
    """$ANYGRAD_CACHE, else $XDG_CACHE_HOME/anygrad, else ~/.cache/anygrad."""
    root = settings.get(CACHE_ENV)
    if root:
        return Path(root).expanduser()
    xdg = settings.external("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "anygrad"


class _Progress:
    """A download progress line on stderr: redrawn in place on a terminal, start/end lines otherwise."""

    MIN_BYTES = 1 << 20  # smaller downloads finish too fast to need a progress line

    def __init__(self, name: str, total: int | None, stream=None):
        self.name, self.total, self.stream = name, total, stream or sys.stderr
        self.shown = total is None or total >= self.MIN_BYTES
        self.tty = self.shown and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last = 0.0
        if self.shown and not self.tty:
            size = f" ({total / 1e6:.1f} MB)" if total else ""
            print(f"downloading {name}{size} ...", file=self.stream, flush=True)

    def update(self, done: int) -> None:
        now = time.monotonic()
        if not self.tty or now - self.last < 0.1:
            return
        self.last = now
        pct = f"{100 * done / self.total:3.0f}% " if self.total else ""
        print(f"\rdownloading {self.name} {pct}({done / 1e6:.1f} MB)", end="", file=self.stream, flush=True)

    def finish(self, done: int) -> None:
        if self.tty:
            print(f"\rdownloading {self.name} done ({done / 1e6:.1f} MB)   ", file=self.stream, flush=True)


def download(url: str, dest: Path, md5: str | None = None, timeout: float = 30.0) -> Path:
    """Fetch url to dest via a temporary name; raise OSError/ValueError on failure or bad md5."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    digest = hashlib.md5()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
            length = response.headers.get("Content-Length")
            progress = _Progress(dest.name, int(length) if length and length.isdigit() else None)
            done = 0
            while chunk := response.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                progress.update(done)
            progress.finish(done)
        if md5 and digest.hexdigest() != md5:
            raise ValueError(f"checksum mismatch (md5 {digest.hexdigest()}, expected {md5})")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def folder_problem(folder: Path) -> str:
    """Why `folder` is no folder to read from: it is missing, or something else is there."""
    return "is not a directory" if folder.exists() else "does not exist"


@dataclass(frozen=True)
class RemoteFile:
    name: str  # the name on the mirrors and in the folder
    md5: str
    alternatives: tuple[str, ...] = ()  # other names accepted in a folder (uncompressed, extracted)


@dataclass(frozen=True)
class RemoteSet:
    key: str  # cache subfolder (and the mirrors' setting, ANYGRAD_<KEY>_MIRRORS)
    files: dict[str, RemoteFile]  # role -> file
    mirrors: tuple[str, ...]
    title: str = ""  # the name in messages (default: key)

    @property
    def name(self) -> str:
        return self.title or self.key

    @property
    def mirrors_env(self) -> str:
        return f"ANYGRAD_{self.key.upper().replace('-', '_')}_MIRRORS"

    def default_mirrors(self) -> list[str]:
        env = settings.get(self.mirrors_env)
        return [m for m in env.replace(",", " ").split() if m] if env else list(self.mirrors)

    def cache_dir(self) -> Path:
        return cache_root() / self.key


def _find(folder: Path, file: RemoteFile) -> Path | None:
    for name in (file.name, *file.alternatives):
        if (folder / name).exists():
            return folder / name
    return None


def _missing(spec: RemoteSet, folder: Path, roles: Sequence[str], why: str) -> str:
    """One line (the CLI prints errors on one): why, which files to put where, the alternatives."""
    files = ", ".join(spec.files[r].name for r in roles)
    return (f"{why}; put these {spec.name} files into {folder}: {files}; or put them into any folder and pass "
            f"--data-dir FOLDER (data_dir= in Python); mirrors can be set with {spec.mirrors_env}")


def locate(spec: RemoteSet, data_dir: str | Path | None = None, cache_dir: str | Path | None = None,
           download_missing: bool = True, mirrors: Sequence[str] | None = None,
           log: Callable[[str], None] | None = None) -> tuple[dict[str, Path], Path]:
    """Paths of every file of `spec` (role -> path) and the folder they are in."""
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise DataError(f"data folder {folder} {folder_problem(folder)}; it should be the folder holding the "
                            f"{spec.name} files")
        found = {role: _find(folder, f) for role, f in spec.files.items()}
        missing = [r for r, p in found.items() if p is None]
        if missing:
            raise DataError(_missing(spec, folder, missing, f"{spec.name} files missing in {folder}"))
        return found, folder  # type: ignore[return-value]

    folder = Path(cache_dir).expanduser() if cache_dir is not None else spec.cache_dir()
    found = {role: _find(folder, f) for role, f in spec.files.items()}
    missing = [r for r, p in found.items() if p is None]
    if missing and not download_missing:
        raise DataError(_missing(spec, folder, missing, f"{spec.name} is not in the cache {folder} and "
                                                        "downloading is off"))
    if missing:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(f"cannot create the cache folder {folder}: {e.strerror or e}; "
                            f"set {CACHE_ENV} or pass --data-dir") from None
        mirror_list = list(mirrors) if mirrors is not None else spec.default_mirrors()
        for i, role in enumerate(missing):
            file = spec.files[role]
            if log:
                log(f"downloading {file.name} into {folder}")
            errors = []
            for mirror in mirror_list:
                url = mirror.rstrip("/") + "/" + file.name
                try:
                    found[role] = download(url, folder / file.name, file.md5)
                    break
                except (OSError, ValueError, urllib.error.URLError) as e:
                    errors.append(f"{url}: {getattr(e, 'reason', None) or e}")
            if found[role] is None:  # the rest would fail the same way: stop here
                why = (f"could not download {file.name} from any mirror (offline?): "
                       + "; ".join(errors or ["no mirrors given"]))
                raise DataError(_missing(spec, folder, missing[i:], why))
    return found, folder  # type: ignore[return-value]
