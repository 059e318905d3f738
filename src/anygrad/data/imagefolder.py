"""An image folder: one subfolder per class (sorted names = class indices), PNG/JPEG inside.

Pillow is optional (`pip install 'anygrad-train[image]'`). Every image is converted to the mode and size
of the first one (or the given ones), so the set is one uint8 NCHW array.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import DataError
from .remote import folder_problem

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def pillow():
    """The PIL.Image module, or an AnygradError saying how to install it."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading images needs Pillow: pip install 'anygrad-train[image]'") from None
    return Image


def load_image(path: str | Path, mode: str | None = None, size: tuple[int, int] | None = None) -> np.ndarray:
    """One image as uint8 CHW; mode 'L' (grey) or 'RGB'; size (height, width)."""
    image_mod = pillow()
    try:
        with image_mod.open(path) as im:
            im.load()
            if mode is None:
                mode = "L" if im.mode in ("1", "L", "LA", "I", "I;16", "F") else "RGB"
            im = im.convert(mode)
            if size is not None and im.size != (size[1], size[0]):
                im = im.resize((size[1], size[0]), image_mod.BILINEAR)
            a = np.asarray(im, np.uint8)
    except (OSError, ValueError) as e:  # PIL.UnidentifiedImageError is an OSError
        raise DataError(f"{path}: not a readable image ({e})") from None
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def read_image_folder(folder: str | Path, mode: str | None = None,
                      size: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(images uint8 NCHW, labels int64, class names)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DataError(f"image folder {folder} {folder_problem(folder)}; give the folder with one subfolder of images per class")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{folder} has no class subfolders; put the images of each class into "
                        f"{folder}/<class name>/")
    images, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((folder / name).iterdir()):
            if path.suffix.lower() in EXTENSIONS:
                img = load_image(path, mode, size)
                if mode is None:
                    mode = "L" if img.shape[0] == 1 else "RGB"
                    size = size or img.shape[1:]
                images.append(img)
                labels.append(label)
    if not images:
        raise DataError(f"{folder} holds no images ({', '.join(EXTENSIONS)}) in its class subfolders")
    return np.stack(images), np.asarray(labels, np.int64), classes
