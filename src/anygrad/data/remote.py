"""Dataset files that live on the web: found in a folder, or in a cache filled by downloading.

One `RemoteSet` per dataset names its files (with the official md5 of each) and its mirrors.
Downloads go through `anygrad.data.mnist.download` (temporary name, md5 check, rename), so the
cache never holds half a file. Files in a user's own folder (`data_dir`) are read as they are.
"""
from __future__ import annotations

import urllib.error
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import settings
from ..errors import DataError
from .mnist import CACHE_ENV, default_cache_dir, download, folder_problem


@dataclass(frozen=True)
class RemoteFile:
    name: str  # the name on the mirrors and in the folder
    md5: str
    alternatives: tuple[str, ...] = ()  # other names accepted in a folder (uncompressed, extracted)


@dataclass(frozen=True)
class RemoteSet:
    key: str  # cache subfolder and the name in messages
    files: dict[str, RemoteFile]  # role -> file
    mirrors: tuple[str, ...]

    @property
    def mirrors_env(self) -> str:
        return f"ANYGRAD_{self.key.upper().replace('-', '_')}_MIRRORS"

    def default_mirrors(self) -> list[str]:
        env = settings.get(self.mirrors_env)
        return [m for m in env.replace(",", " ").split() if m] if env else list(self.mirrors)

    def cache_dir(self) -> Path:
        return default_cache_dir().parent / self.key


def _find(folder: Path, file: RemoteFile) -> Path | None:
    for name in (file.name, *file.alternatives):
        if (folder / name).exists():
            return folder / name
    return None


def _missing(spec: RemoteSet, folder: Path, roles: Sequence[str], why: str) -> str:
    """One line (the CLI prints errors on one): why, which files to put where, the alternatives."""
    files = ", ".join(spec.files[r].name for r in roles)
    return (f"{why}; put these {spec.key} files into {folder}: {files}; or put them into any folder and pass "
            f"--data-dir FOLDER (data_dir= in Python); mirrors can be set with {spec.mirrors_env}")


def locate(spec: RemoteSet, data_dir: str | Path | None = None, cache_dir: str | Path | None = None,
           download_missing: bool = True, mirrors: Sequence[str] | None = None,
           log: Callable[[str], None] | None = None) -> tuple[dict[str, Path], Path]:
    """Paths of every file of `spec` (role -> path) and the folder they are in."""
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise DataError(f"data folder {folder} {folder_problem(folder)}; it should be the folder holding the "
                            f"{spec.key} files")
        found = {role: _find(folder, f) for role, f in spec.files.items()}
        missing = [r for r, p in found.items() if p is None]
        if missing:
            raise DataError(_missing(spec, folder, missing, f"{spec.key} files missing in {folder}"))
        return found, folder  # type: ignore[return-value]

    folder = Path(cache_dir).expanduser() if cache_dir is not None else spec.cache_dir()
    found = {role: _find(folder, f) for role, f in spec.files.items()}
    missing = [r for r, p in found.items() if p is None]
    if missing and not download_missing:
        raise DataError(_missing(spec, folder, missing, f"{spec.key} is not in the cache {folder} and "
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
