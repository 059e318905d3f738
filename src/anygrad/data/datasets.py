"""Named datasets behind one call: `get_dataset(name, data_dir=None, ...)`.

Every dataset comes back as stored images (uint8 NCHW when they are pictures) plus int64 labels,
a validation split (the set's test split, or a seeded hold-out of the training data), class
names, and the per-channel mean/std it is normalised with. How batches are made from it
(normalisation, augmentation, prefetching) is declared in a `DataConfig`, plain data that a run
can store in its config.json and rebuild exactly on resume.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, DataError
from ..rng import key, mix32
from .idx import CACHED_FILE, USERS_FILE
from .loader import DataLoader
from .mnist import MEAN, STD, MnistFile, idx_set, load_mnist, read_split
from .remote import locate
from .transforms import BatchTransform

Log = Callable[[str], None]
Arrays = tuple[np.ndarray, np.ndarray]
SPLIT_SALT = 0x5350
DEFAULT_VALID_FRACTION = 0.1  # held out when a set has no validation split of its own


@dataclass
class Dataset:
    name: str
    train: Arrays  # stored form: uint8 NCHW images (or the .npz's own arrays), int64 labels
    valid: Arrays | None
    classes: list[str]
    mean: tuple[float, ...] | None  # per channel, in [0, 1] pixel units for uint8 images
    std: tuple[float, ...] | None
    source: str = ""
    valid_from: str = "test split"

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.train[0].shape[1:])


@dataclass
class DataConfig:
    """How a run reads its data; stored in config.json (`asdict`) and rebuilt with `from_dict`."""

    dataset: str = "mnist"
    data_dir: str | None = None
    valid_fraction: float | None = None  # None: the set's own split, else 0.1 of train; 0: no validation
    normalize: bool = True
    mean: list[float] | None = None  # None: the dataset's own statistics
    std: list[float] | None = None
    crop_padding: int = 0  # random crop after this much zero padding (training batches only)
    hflip: bool = False  # random horizontal flip (training batches only)
    prefetch: bool = False  # prepare the next batch in a background thread
    x_key: str = "x"  # .npz keys
    y_key: str = "y"
    options: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if self.valid_fraction is not None and not 0 <= self.valid_fraction < 1:
            raise ConfigError(f"valid-fraction must be in [0, 1), got {self.valid_fraction}")
        if self.crop_padding < 0:
            raise ConfigError(f"crop-padding must be 0 or positive, got {self.crop_padding}")
        if (self.mean is None) != (self.std is None) or (self.mean is not None and len(self.mean) != len(self.std)):
            raise ConfigError(f"give --mean and --std together, one value per channel each (got mean {self.mean}, "
                              f"std {self.std})")
        if self.std is not None and any(not s > 0 for s in self.std):
            raise ConfigError(f"std must be positive per channel, got {self.std}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> DataConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(record) - known
        if unknown:
            raise ConfigError(f"unknown data setting(s) {sorted(unknown)}")
        return cls(**record)

    def load(self, seed: int = 0, log: Log | None = None, **kwargs: Any) -> Dataset:
        self.check()
        return get_dataset(self.dataset, self.data_dir, valid_fraction=self.valid_fraction, seed=seed, log=log,
                           x_key=self.x_key, y_key=self.y_key, **{**self.options, **kwargs})

    def stats(self, data: Dataset) -> tuple[tuple[float, ...], tuple[float, ...]] | tuple[None, None]:
        """The per-channel mean/std batches are normalised with: this config's own, else the
        dataset's; (None, None) when normalisation is off or the data has no statistics."""
        mean = tuple(self.mean) if self.mean is not None else data.mean
        std = tuple(self.std) if self.std is not None else data.std
        if not self.normalize or mean is None or std is None:
            return None, None
        shape = data.sample_shape
        if self.mean is not None and len(mean) != 1 and len(shape) == 3 and shape[0] != len(mean):
            raise ConfigError(f"--mean/--std give {len(mean)} channels but the {data.name} images have {shape[0]} "
                              f"(shape {shape}); give one value per channel, or one for all")
        return mean, std

    def transform(self, data: Dataset, seed: int = 0, train: bool = True, on_device: bool = False) -> BatchTransform:
        """Augmentation (training batches only) then normalisation. `on_device`: the model normalises
        in its graph (anygrad.data.graph_input), so batches keep their stored dtype (uint8)."""
        if (self.crop_padding or self.hflip) and len(data.sample_shape) != 3:
            raise ConfigError(f"augmentation (crop, hflip) works on images (C, H, W); {data.name} samples have "
                              f"shape {data.sample_shape}")
        mean, std = (None, None) if on_device else self.stats(data)
        return BatchTransform(mean, std, self.crop_padding if train else 0, self.hflip and train, seed,
                              to_float=not on_device)

    def loader(self, data: Dataset, batch_size: int, train: bool = True, seed: int = 0, shuffle: bool | None = None,
               drop_last: bool = False, on_device: bool = False) -> DataLoader:
        """A DataLoader over the training (or validation) split with this config's transform
        (`on_device`: uint8 batches for a model given anygrad.data.graph_input.add_input_normalisation)."""
        arrays = data.train if train else data.valid
        if arrays is None:
            raise ConfigError(f"{data.name} has no validation split (valid-fraction is 0)")
        return DataLoader(*arrays, batch_size=batch_size, shuffle=train if shuffle is None else shuffle, seed=seed,
                          drop_last=drop_last, transform=self.transform(data, seed, train, on_device),
                          prefetch=self.prefetch)


def split(arrays: Arrays, fraction: float, seed: int) -> tuple[Arrays, Arrays]:
    """A seeded hold-out: (train, valid), valid being `fraction` of the samples."""
    x, y = arrays
    n_valid = round(len(x) * fraction)
    if fraction > 0 and (n_valid == 0 or n_valid == len(x)):
        raise ConfigError(f"valid-fraction {fraction} of {len(x)} samples leaves an empty split")
    order = np.argsort(mix32(np.arange(len(x), dtype=np.uint32) ^ key(seed, 0, SPLIT_SALT)), kind="stable")
    valid, train = np.sort(order[:n_valid]), np.sort(order[n_valid:])
    return (x[train], y[train]), (x[valid], y[valid])


# -- the datasets ---------------------------------------------------------------------------------
def _mnist(data_dir: str | None, log: Log | None, **kw: Any) -> Dataset:
    d = load_mnist(data_dir=data_dir, log=log, **_pick(kw, "cache_dir", "download", "mirrors"))
    return Dataset("mnist", (d.x_train[:, None], d.y_train), (d.x_test[:, None], d.y_test),
                   [str(i) for i in range(10)], (MEAN,), (STD,), d.source)


FASHION_MNIST = idx_set("fashion-mnist", {
    "x_train": MnistFile("train-images-idx3-ubyte", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
    "y_train": MnistFile("train-labels-idx1-ubyte", "25c81989df183df01b3e8a0aad5dffbe"),
    "x_test": MnistFile("t10k-images-idx3-ubyte", "bef4ecab320f06d8554ea6380940ec79"),
    "y_test": MnistFile("t10k-labels-idx1-ubyte", "bb300cfdad3c16e7a12a480ee83cd310")},
    ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
     "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"), "Fashion-MNIST")
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]


def _remote_kw(kw: dict[str, Any]) -> dict[str, Any]:
    out = _pick(kw, "cache_dir", "mirrors")
    if "download" in kw:
        out["download_missing"] = kw["download"]
    return out


def _remedy(data_dir: str | None) -> str:
    """What to do about a damaged file: the user's own (data_dir) is replaced, the cache's deleted."""
    return USERS_FILE if data_dir is not None else CACHED_FILE


def _fashion(data_dir: str | None, log: Log | None, **kw: Any) -> Dataset:
    paths, folder = locate(FASHION_MNIST, data_dir, log=log, **_remote_kw(kw))
    arrays = read_split(paths, _remedy(data_dir))
    return Dataset("fashion-mnist", (arrays["x_train"][:, None], arrays["y_train"]),
                   (arrays["x_test"][:, None], arrays["y_test"]), list(FASHION_CLASSES),
                   (0.2860,), (0.3530,), str(folder))


def _cifar10(data_dir: str | None, log: Log | None, **kw: Any) -> Dataset:
    from .cifar import CIFAR10, CLASSES, MEAN, STD, read_cifar10
    paths, folder = locate(CIFAR10, data_dir, log=log, **_remote_kw(kw))
    train, test = read_cifar10(paths["archive"], _remedy(data_dir))
    return Dataset("cifar-10", train, test, list(CLASSES), MEAN, STD, str(folder))


def _image_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]] | tuple[None, None]:
    """Per-channel mean/std of uint8 NCHW images in [0, 1] units (None for other data)."""
    if x.dtype != np.uint8 or x.ndim != 4:
        return None, None
    f = x.astype(np.float64) / 255.0
    return tuple(float(v) for v in f.mean(axis=(0, 2, 3))), \
        tuple(float(max(v, 1e-6)) for v in f.std(axis=(0, 2, 3)))


IMAGE_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA


def _as_nchw(pair: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images as the models take them, (N, C, H, W): saved as (N, H, W), as
    keras.datasets.mnist gives them, with one channel; saved channels-last (N, H, W, C), as
    keras.datasets.cifar10 and PIL give them, transposed."""
    x, y = pair
    if x.dtype != np.uint8:
        return x, y
    if x.ndim == 3:
        return x[:, None], y
    if x.ndim == 4 and x.shape[3] in IMAGE_CHANNELS and x.shape[1] not in IMAGE_CHANNELS:
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2)), y
    return x, y


def _npz(data_dir: str | None, log: Log | None, path: str | None = None, x_key: str = "x", y_key: str = "y",
         **kw: Any) -> Dataset:
    from .npz import read_npz
    path = path or data_dir
    if path is None:
        raise ConfigError("the npz dataset needs a file: --data-dir FILE.npz (data_dir= or path= in Python)")
    train, valid = read_npz(path, x_key, y_key, x_valid_key=f"{x_key}_valid", y_valid_key=f"{y_key}_valid")
    train, valid = _as_nchw(train), None if valid is None else _as_nchw(valid)
    mean, std = _image_stats(train[0])
    labels = train[1]
    classes = [str(i) for i in range(int(labels.max()) + 1)] if np.issubdtype(labels.dtype, np.integer) \
        and len(labels) else []
    return Dataset("npz", train, valid, classes, mean, std, str(path))


def _image_folder(data_dir: str | None, log: Log | None, **kw: Any) -> Dataset:
    from .imagefolder import read_image_folder
    if data_dir is None:
        raise ConfigError("the imagefolder dataset needs --data-dir DIR (one subfolder per class)")
    root = Path(data_dir).expanduser()
    valid = None
    if (root / "train").is_dir():  # DIR/train/<class>/..., optional DIR/valid or DIR/test
        x, y, classes = read_image_folder(root / "train", **_pick(kw, "mode", "size"))
        for name in ("valid", "val", "test"):
            if (root / name).is_dir():
                mode = "L" if x.shape[1] == 1 else "RGB"
                xv, yv, cv = read_image_folder(root / name, mode, x.shape[2:])
                if cv != classes:
                    raise DataError(f"{root / name} has classes {cv} but {root / 'train'} has {classes}")
                valid = (xv, yv)
                break
    else:
        x, y, classes = read_image_folder(root, **_pick(kw, "mode", "size"))
    mean, std = _image_stats(x)
    return Dataset("imagefolder", (x, y), valid, classes, mean, std, str(root))


def _pick(kw: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: kw[k] for k in names if k in kw}


DATASETS: dict[str, Callable[..., Dataset]] = {
    "mnist": _mnist,
    "fashion-mnist": _fashion,
    "cifar-10": _cifar10,
    "npz": _npz,
    "imagefolder": _image_folder,
}
ALIASES = {"fashion_mnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "cifar10": "cifar-10",
           "cifar": "cifar-10", "image-folder": "imagefolder", "folder": "imagefolder"}


def canonical_name(name: str) -> str:
    """A dataset's name as DATASETS and KNOWN_DATASETS spell it (lower case, aliases resolved)."""
    return ALIASES.get(name.lower(), name.lower())


def dataset_names() -> list[str]:
    return list(DATASETS)


def get_dataset(name: str, data_dir: str | Path | None = None, *, valid_fraction: float | None = None, seed: int = 0,
                log: Log | None = None, **options: Any) -> Dataset:
    """Load a dataset by name: mnist, fashion-mnist, cifar-10, npz (data_dir = the .npz file; x_key/y_key),
    imagefolder (data_dir = a folder of class subfolders, or with train/ and valid/ inside).

    `valid_fraction`: None keeps the set's own validation split (or holds out 0.1 of the training
    data when it has none); a number always holds out that part of the training data (seeded by
    `seed`); 0 means no validation. Other options: cache_dir, download, mirrors (remote sets).
    """
    key_name = canonical_name(name)
    if key_name not in DATASETS:
        raise ConfigError(f"unknown dataset '{name}'; choose one of {', '.join(DATASETS)}")
    data = DATASETS[key_name](str(data_dir) if data_dir is not None else None, log, **options)
    if valid_fraction is None and data.valid is None:
        valid_fraction = DEFAULT_VALID_FRACTION
    if valid_fraction is not None:
        if valid_fraction == 0:
            data.valid, data.valid_from = None, "none"
        else:
            if not 0 < valid_fraction < 1:
                raise ConfigError(f"valid-fraction must be in [0, 1), got {valid_fraction}")
            data.train, data.valid = split(data.train, valid_fraction, seed)
            data.valid_from = f"{valid_fraction:g} of train (seed {seed})"
    return data
