"""Using a trained model: find it (run folder, ONNX file, checkpoint), predict one sample or a user's
image, evaluate a dataset split with a confusion matrix.

What a model outputs is decided from the graph, not guessed per call: a model ending in
LogSoftmax gives log-probabilities (exp), one ending in Softmax probabilities, anything else
logits (softmax). A model whose outputs all happen to be log-probabilities without a LogSoftmax
node (log of a softmax written by hand) is recognised by its values.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError, ModelError
from .model import Model
from .torchfile import check_regular, read_npz_arrays

# Per dataset: normalisation and class names, usable without loading the data (for --image).
KNOWN_DATASETS: dict[str, tuple[tuple[float, ...], tuple[float, ...], list[str] | None]] = {
    "mnist": ((0.1307,), (0.3081,), [str(i) for i in range(10)]),
    "fashion-mnist": ((0.2860,), (0.3530,), None),  # class names filled from anygrad.data.datasets
    "cifar-10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), None),
}
OUTPUT_KINDS = ("logits", "probabilities", "log-probabilities")


# -- finding the model --------------------------------------------------------------------------
@dataclass
class ModelSource:
    onnx: Path  # the graph
    weights: dict[str, np.ndarray] | None = None  # replace the file's initializers (checkpoint, weights.npz)
    description: str = ""
    run_config: dict[str, Any] = field(default_factory=dict)  # the run's config.json, when known


def _read_json(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    return record if isinstance(record, dict) else {}


def _run_model_path(config: dict[str, Any], where: Path) -> Path:
    model = config.get("model") or (config.get("config") or {}).get("model")
    if not model:
        raise ModelError(f"{where} does not say which ONNX model it belongs to; pass the model.onnx instead")
    path = Path(model)
    if not path.is_absolute() and not path.exists():
        path = where.parent / path
    if not path.exists():
        raise ModelError(f"{where} belongs to the model {model}, which no longer exists; pass a model.onnx")
    return path


def _checkpoint_source(path: Path) -> ModelSource:
    from .train import checkpoint  # the Learner's checkpoint format (ckpt-*.json + .npz, best.json)
    ckpt = checkpoint.read(path)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    config = _read_json(run_dir / "config.json") if (run_dir / "config.json").is_file() else {}
    config = {**config, **(ckpt.meta.get("config") or {})}
    epoch = ckpt.meta.get("epoch")
    return ModelSource(_run_model_path(config, path), ckpt.state,
                       f"{path}" + (f" (epoch {epoch})" if epoch is not None else ""), config)


def _checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint records of a run, the preferred (best, then newest) first."""
    found: list[Path] = []
    for folder in (run_dir / "checkpoints", run_dir):
        if (folder / "best.json").is_file():
            found.append(folder / "best.json")
        found += sorted(folder.glob("ckpt-*.json"), key=lambda p: _step(p), reverse=True)
    return found


def _step(path: Path) -> int:
    digits = "".join(c for c in path.stem.split("-")[-1] if c.isdigit())
    return int(digits) if digits else -1


def resolve_model(spec: str | Path) -> ModelSource:
    """MODEL as given on the command line: a run folder, an .onnx, a checkpoint .json, a weights.npz.

    A run folder uses its model.onnx (the weights of the last finished epoch), else its best or
    newest checkpoint, else weights.npz with the model named in config.json.
    """
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(f"{path}: no such model, run folder or checkpoint")
    if path.is_dir():
        config = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
        if (path / "model.onnx").is_file():
            return ModelSource(path / "model.onnx", None, str(path / "model.onnx"), config)
        ckpts = _checkpoints(path)
        if ckpts:
            return _checkpoint_source(ckpts[0])
        if (path / "weights.npz").is_file():
            return _weights_source(path / "weights.npz", config)
        raise ModelError(f"{path} holds no model.onnx, no checkpoints/ and no weights.npz; is it a run folder "
                         "(anygrad train --artifacts DIR)?")
    check_regular(path, ConfigError)  # a FIFO or a device would block or never end
    if path.suffix == ".onnx":
        config_file = path.parent / "config.json"
        return ModelSource(path, None, str(path), _read_json(config_file) if config_file.is_file() else {})
    if path.suffix == ".json":
        return _checkpoint_source(path)
    if path.suffix == ".npz":
        config_file = path.parent / "config.json"
        return _weights_source(path, _read_json(config_file) if config_file.is_file() else {})
    raise ConfigError(f"{path}: not a model (.onnx), a checkpoint (.json), weights (.npz) or a run folder")


def _weights_source(path: Path, config: dict[str, Any]) -> ModelSource:
    weights = read_npz_arrays(path, ModelError)  # bounded: a corrupt archive or a zip bomb is a ModelError
    return ModelSource(_run_model_path(config, path), weights, str(path), config)


def load_model(spec: str | Path) -> tuple[Model, ModelSource]:
    """The model to predict with: the ONNX graph with the source's weights put in."""
    from .frontends.onnx_import import load_onnx
    source = resolve_model(spec)
    model = load_onnx(source.onnx)
    if source.weights is not None:
        g = model.graph
        for name in g.state_names:
            if name in source.weights:
                value = source.weights[name]
                if value.shape != g.initializers[name].shape:
                    raise ModelError(f"{source.description}: '{name}' has shape {value.shape} but the model "
                                     f"{source.onnx} expects {g.initializers[name].shape}; wrong model?")
                g.initializers[name] = value.astype(g.initializers[name].dtype, copy=False)
    return model, source


# -- what the output means ----------------------------------------------------------------------
def output_kind(model: Model) -> str:
    """'log-probabilities' (ends in LogSoftmax), 'probabilities' (Softmax) or 'logits'."""
    producer = model.graph.producers().get(model.graph.outputs[0])
    op = producer.op if producer is not None else ""
    return {"LogSoftmax": "log-probabilities", "Softmax": "probabilities"}.get(op, "logits")


def log_probabilities(output: np.ndarray, kind: str) -> np.ndarray:
    """Class log-probabilities (N, C), float64, from a model output of the given kind."""
    out = np.asarray(output, np.float64).reshape(len(output), -1)
    if kind == "logits" and np.all(out <= 1e-6) and np.allclose(np.exp(out).sum(axis=1), 1.0, atol=1e-3):
        kind = "log-probabilities"  # log-probs without a LogSoftmax node (log(softmax(x)) by hand)
    if kind == "log-probabilities":
        return out
    if kind == "probabilities":
        return np.log(np.clip(out, 1e-300, None))
    shifted = out - out.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def probabilities(output: np.ndarray, kind: str) -> np.ndarray:
    """Class probabilities (N, C) from a model output of the given kind."""
    return np.exp(log_probabilities(output, kind))


def fit_input(x: np.ndarray, model: Model) -> np.ndarray:
    """Samples reshaped to the model's input when only the layout differs ((1,28,28) vs (784,))."""
    want = tuple(model.input_shape[1:])
    if all(isinstance(d, int) for d in want) and tuple(x.shape[1:]) != want:
        if int(np.prod(want)) != int(np.prod(x.shape[1:])):
            raise ConfigError(f"the model's input '{model.input_name}' takes samples of shape {want}, but the data "
                              f"holds {tuple(x.shape[1:])}; choose a model made for this dataset")
        return x.reshape((len(x),) + want)
    return x


def class_names(dataset: str) -> list[str] | None:
    from .data.cifar import CLASSES
    from .data.datasets import FASHION_CLASSES, canonical_name
    name = canonical_name(dataset)
    return {"fashion-mnist": list(FASHION_CLASSES), "cifar-10": list(CLASSES)}.get(name) or \
        (KNOWN_DATASETS[name][2] if name in KNOWN_DATASETS else None)


def dataset_stats(dataset: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    from .data.datasets import canonical_name
    name = canonical_name(dataset)
    if name not in KNOWN_DATASETS:
        raise ConfigError(f"no known normalisation for dataset '{dataset}'; use one of {', '.join(KNOWN_DATASETS)}")
    mean, std, _ = KNOWN_DATASETS[name]
    return mean, std


def run_for_dataset(run: dict[str, Any], dataset: str) -> dict[str, Any]:
    """The run's config.json when it trained on `dataset` (so its normalisation applies), else {}."""
    from .data.datasets import canonical_name
    return run if run and canonical_name(str(run.get("dataset") or "mnist")) == canonical_name(dataset) else {}


@dataclass
class Normalisation:
    """How samples are normalised before the model sees them (uint8 pixels are scaled to [0, 1]
    first); mean/std None: not normalised."""

    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    how: str  # for messages: "like the run (mean 0.4, std 0.2)"
    like: str = ""  # not normalised: whose choice that is ("like the run")

    def for_dtype(self, dtype: Any) -> str:
        """`how` for samples stored as `dtype`: without normalisation, uint8 pixels are scaled to
        [0, 1] and every other dtype is taken as stored (BatchTransform)."""
        if self.mean is not None:
            return self.how
        d = np.dtype(dtype)
        scaled = "uint8 pixels scaled to [0, 1]" if d == np.uint8 else f"{d} values as stored, not scaled"
        return f"not normalised ({scaled})" + (f", {self.like}" if self.like else "")


def _stats_text(mean: Any, std: Any) -> str:
    return f"mean {', '.join(f'{m:g}' for m in mean)}, std {', '.join(f'{s:g}' for s in std)}"


def _like_the_run(stats: dict[str, Any] | None) -> Normalisation:
    """The run's own normalisation: `stats` holds its "mean" and "std"; None: not normalised."""
    if stats is None:
        return Normalisation(None, None, "not normalised (uint8 pixels scaled to [0, 1], other dtypes as stored), "
                             "like the run", "like the run")
    mean, std = stats["mean"], stats["std"]
    return Normalisation(tuple(mean), tuple(std), f"like the run ({_stats_text(mean, std)})")


def input_normalisation(run: dict[str, Any], dataset: str, data: Callable[[], Any] | None = None) -> Normalisation:
    """The normalisation the model was trained with, from the run's config.json `run` when it
    trained on `dataset`: what the run recorded it resolved (normalised on the device or the host,
    or not at all), else its settings (--normalize none, --mean/--std), else the dataset's
    statistics: the known ones, or those of the data `data()` loads (imagefolder, npz)."""
    own = run_for_dataset(run, dataset)
    resolved = own.get("resolved") if isinstance(own.get("resolved"), dict) else {}
    if "normalisation" in resolved:  # what the run used, wherever it normalised
        return _like_the_run(resolved["normalisation"])
    if resolved.get("normalised_on_device"):  # runs written before "normalisation" was recorded
        return _like_the_run(resolved["normalised_on_device"])
    if own.get("normalize") == "none":
        return _like_the_run(None)
    if own.get("mean") and own.get("std"):
        return _like_the_run(own)
    from .data.datasets import canonical_name
    if canonical_name(dataset) in KNOWN_DATASETS:
        mean, std = dataset_stats(dataset)
        return Normalisation(mean, std, f"like {dataset} ({_stats_text(mean, std)})")
    loaded = data() if data is not None else None
    if loaded is None:
        raise ConfigError(f"no known normalisation for dataset '{dataset}'; give the run folder (its config.json "
                          "records it) or --data-dir with the dataset to compute it from")
    if loaded.mean is None:
        return Normalisation(None, None, f"not normalised, like {dataset} (no image statistics)",
                             f"like {dataset} (no image statistics)")
    return Normalisation(tuple(loaded.mean), tuple(loaded.std), f"like {dataset} ({_stats_text(loaded.mean, loaded.std)})")


def run_class_names(run: dict[str, Any], dataset: str) -> list[str] | None:
    """Class names: those the run recorded for its dataset, else the known dataset's."""
    classes = (run_for_dataset(run, dataset).get("resolved") or {}).get("classes")
    return [str(c) for c in classes] if isinstance(classes, list) and classes else class_names(dataset)


# -- a user's own image ------------------------------------------------------------------------
@dataclass
class PreparedImage:
    x: np.ndarray  # (1, C, H, W) float32, normalised
    inverted: bool
    notes: list[str]


def prepare_image(path: str | Path, model: Model, dataset: str = "mnist",
                  normalisation: Normalisation | None = None) -> PreparedImage:
    """Load an image the way the dataset's samples look: the model's HxW, grey when it takes one
    channel, light digits on a dark background (inverted when the image's border is light),
    normalised as `normalisation` says (default: the dataset's known statistics)."""
    from .data.datasets import canonical_name
    from .data.imagefolder import load_image
    from .data.transforms import BatchTransform
    if normalisation is None:
        normalisation = input_normalisation({}, dataset)
    shape = tuple(model.input_shape)
    if len(shape) == 4 and all(isinstance(d, int) for d in shape[1:]):
        channels, size = shape[1], shape[2:]
    else:  # a flat input (N, 784): the dataset's own image size
        known = KNOWN_DATASETS.get(canonical_name(dataset))  # (mean, std, classes): a mean per channel
        channels = len(normalisation.mean) if normalisation.mean else len(known[0]) if known else 1
        size = (28, 28) if channels == 1 else (32, 32)
    if normalisation.mean is not None and len(normalisation.mean) not in (1, channels):
        raise ConfigError(f"the model takes {channels}-channel images but the normalisation has "
                          f"{len(normalisation.mean)} channels ({normalisation.how})")
    img = load_image(path, "L" if channels == 1 else "RGB", size)
    notes = [f"resized to {size[0]}x{size[1]}" + (", greyscale" if channels == 1 else ", RGB")]
    border = np.concatenate([img[:, 0, :].ravel(), img[:, -1, :].ravel(), img[:, :, 0].ravel(), img[:, :, -1].ravel()])
    inverted = channels == 1 and float(border.mean()) > 127
    if inverted:
        img = 255 - img
        notes.append("inverted (white background; the model was trained on light strokes on black)")
    notes.append(normalisation.for_dtype(img.dtype) if normalisation.mean is None else f"normalised {normalisation.how}")
    x = BatchTransform(normalisation.mean, normalisation.std)(img[None], np.zeros(1, np.int64), 0)
    return PreparedImage(fit_input(x, model), inverted, notes)


# -- predicting and evaluating -----------------------------------------------------------------------
@dataclass
class Prediction:
    label: int
    probability: float
    probabilities: np.ndarray  # (C,)
    true_label: int | None = None


def compile_for_inference(model: Model, device: str = "cpu") -> Model:
    loss = "nll" if output_kind(model) == "log-probabilities" else "cross_entropy"
    return model.compile(loss=loss, device=device)


def _first_output(out: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
    """A model of several outputs predicts {name: array}; the classifier tools read the first."""
    return next(iter(out.values())) if isinstance(out, dict) else out


def predict_batch(model: Model, x: np.ndarray, batch_size: int = 500, log: bool = False) -> np.ndarray:
    """Class probabilities (or log-probabilities) (N, C) for prepared samples, in inference mode."""
    kind = output_kind(model)
    out = np.concatenate([log_probabilities(_first_output(model.predict(x[i:i + batch_size])), kind)
                          for i in range(0, len(x), batch_size)])
    return out if log else np.exp(out)


@dataclass
class Evaluation:
    loss: float
    accuracy: float
    confusion: np.ndarray  # (C, C): rows true class, columns predicted class
    count: int


def evaluate(model: Model, x: np.ndarray, y: np.ndarray, batch_size: int = 500) -> Evaluation:
    """Mean negative log-likelihood, accuracy and the confusion matrix of a compiled classifier."""
    logp = predict_batch(model, x, batch_size, log=True)
    y = np.asarray(y, np.int64)
    classes = max(logp.shape[1], int(y.max()) + 1 if len(y) else 0)
    pred = logp.argmax(axis=1)
    loss = float(-np.mean(logp[np.arange(len(y)), y]))
    confusion = np.zeros((classes, classes), np.int64)
    np.add.at(confusion, (y, pred), 1)
    return Evaluation(loss, float(np.mean(pred == y)), confusion, len(y))
