"""MNIST: read the four IDX files from a folder, or from a cache that is filled by downloading.

Files are found as `<name>` or `<name>.gz`. Downloads try each mirror in turn, verify the
official md5, and are written to a temporary name then renamed, so the cache never holds half a
file. Files a user supplied themselves (`data_dir`) are read as they are, without checksums.
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

import numpy as np

from .. import settings
from ..errors import DataError
from .idx import CACHED_FILE, USERS_FILE, read_idx


@dataclass(frozen=True)
class MnistFile:
    name: str  # standard file name without .gz
    md5: str  # of the official .gz


MNIST_FILES: dict[str, MnistFile] = {
    "x_train": MnistFile("train-images-idx3-ubyte", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    "y_train": MnistFile("train-labels-idx1-ubyte", "d53e105ee54ea40749a09fcbcd1e9432"),
    "x_test": MnistFile("t10k-images-idx3-ubyte", "9fb629c4189551a2d022fa330f9573f3"),
    "y_test": MnistFile("t10k-labels-idx1-ubyte", "ec29112dd5afa0611ce80d1b7f02629c"),
}
MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
MIRRORS_ENV = "ANYGRAD_MNIST_MIRRORS"  # whitespace/comma separated base URLs, replacing MIRRORS
CACHE_ENV = "ANYGRAD_CACHE"  # root of anygrad's cache; MNIST lives in <root>/mnist
MEAN, STD = 0.1307, 0.3081  # the founding example's normalisation (PyTorch's MNIST example)
CHUNK = 1 << 16


@dataclass
class MnistData:
    x_train: np.ndarray  # uint8 (N, 28, 28)
    y_train: np.ndarray  # int64 (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    source: str = ""  # the folder the files came from

    def train(self) -> tuple[np.ndarray, np.ndarray]:
        """Normalised training images (N, 1, 28, 28) float32 and int64 labels."""
        return normalize(self.x_train), self.y_train

    def test(self) -> tuple[np.ndarray, np.ndarray]:
        return normalize(self.x_test), self.y_test


def normalize(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 28, 28) -> float32 (N, 1, 28, 28), (x / 255 - mean) / std."""
    x = np.asarray(images, np.float32) / np.float32(255.0)
    x = (x - np.float32(MEAN)) / np.float32(STD)
    return x.reshape(x.shape[0], 1, *x.shape[1:]).astype(np.float32, copy=False)


def default_cache_dir() -> Path:
    root = settings.get(CACHE_ENV)
    if root:
        return Path(root).expanduser() / "mnist"
    xdg = settings.external("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "anygrad" / "mnist"


def default_mirrors() -> list[str]:
    env = settings.get(MIRRORS_ENV)
    if env:
        return [m for m in env.replace(",", " ").split() if m]
    return list(MIRRORS)


def find_file(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


# -- downloading ---------------------------------------------------------------------------
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


def _download_from_mirrors(file: MnistFile, folder: Path, mirrors: Sequence[str]) -> tuple[Path | None, list[str]]:
    errors = []
    for mirror in mirrors:
        url = mirror.rstrip("/") + f"/{file.name}.gz"
        try:
            return download(url, folder / f"{file.name}.gz", file.md5), errors
        except (OSError, ValueError, urllib.error.URLError) as e:  # HTTPError, timeouts are OSErrors
            reason = getattr(e, "reason", None) or e
            errors.append(f"{url}: {reason}")
    return None, errors


def folder_problem(folder: Path) -> str:
    """Why `folder` is no folder to read from: it is missing, or something else is there."""
    return "is not a directory" if folder.exists() else "does not exist"


def _missing_message(folder: Path, names: Sequence[str], why: str) -> str:
    """One line (the CLI prints errors on one): why, which files to put where, the alternative."""
    files = ", ".join(f"{n}.gz" for n in names)
    return (f"{why}; put these MNIST files (gzip or uncompressed) into {folder}: {files}; "
            f"or put all four into any folder and pass --data-dir FOLDER (data_dir= in Python)")


# -- loading -------------------------------------------------------------------------------
def _read_split(paths: dict[str, Path], remedy: str) -> dict[str, np.ndarray]:
    arrays = {role: read_idx(path, remedy) for role, path in paths.items()}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        xp, yp = paths[f"x_{split}"], paths[f"y_{split}"]
        if x.ndim != 3 or x.shape[1:] != (28, 28) or x.dtype != np.uint8:
            raise DataError(f"{xp}: expected uint8 images of shape (N, 28, 28), found {x.dtype} {x.shape}")
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f"{yp} holds {y.shape} labels but {xp} holds {len(x)} images")
        if len(y) and (y.min() < 0 or y.max() > 9):
            raise DataError(f"{yp}: labels must be digits 0-9, found {int(y.min())}..{int(y.max())}")
        arrays[f"y_{split}"] = y.astype(np.int64)
    return arrays


def load_mnist(data_dir: str | Path | None = None, cache_dir: str | Path | None = None, download: bool = True,
               mirrors: Sequence[str] | None = None, log: Callable[[str], None] | None = None) -> MnistData:
    """Load MNIST as uint8 images and int64 labels.

    With `data_dir`, read the four standard files from it (never downloads). Otherwise use the
    cache (`cache_dir`, default `$ANYGRAD_CACHE/mnist` or `~/.cache/anygrad/mnist`), downloading
    what is missing from `mirrors` when `download` is true.
    """
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise DataError(f"data folder {folder} {folder_problem(folder)}; it should be the folder holding the four MNIST "
                            "IDX files")
        found = {role: find_file(folder, f.name) for role, f in MNIST_FILES.items()}
        missing = [MNIST_FILES[r].name for r, p in found.items() if p is None]
        if missing:
            raise DataError(_missing_message(folder, missing, f"MNIST files missing in {folder}"))
        return MnistData(**_read_split(found, USERS_FILE), source=str(folder))

    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    found = {role: find_file(folder, f.name) for role, f in MNIST_FILES.items()}
    missing = [r for r, p in found.items() if p is None]
    if missing and not download:
        raise DataError(_missing_message(folder, [MNIST_FILES[r].name for r in missing],
                                         f"MNIST is not in the cache {folder} and downloading is off"))
    if missing:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(f"cannot create the cache folder {folder}: {e.strerror or e}; "
                            f"set {CACHE_ENV} or pass --data-dir") from None
        mirror_list = list(mirrors) if mirrors is not None else default_mirrors()
        for i, role in enumerate(missing):
            file = MNIST_FILES[role]
            if log:
                log(f"downloading {file.name}.gz into {folder}")
            found[role], errors = _download_from_mirrors(file, folder, mirror_list)
            if found[role] is None:  # the rest would fail the same way: stop here
                why = (f"could not download {file.name}.gz from any mirror (offline?): "
                       + "; ".join(errors or ["no mirrors given"]))
                raise DataError(_missing_message(folder, [MNIST_FILES[r].name for r in missing[i:]], why))
    return MnistData(**_read_split(found, CACHED_FILE), source=str(folder))
