"""The inference commands, `anygrad predict` and `anygrad eval` (anygrad.inference): a trained
model loaded and compiled for inference, the dataset read and normalised as its run read it, one
sample's (or image's) classes, or a split's loss, accuracy and confusion matrix."""
from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from ..errors import ConfigError

TOKENS = "tokens"  # anygrad train --dataset tokens: a language model on a token file (anygrad.data.tokens)
TOKEN_EVAL_BATCHES = 64  # eval of a token file reads this many batches of windows at a time


def _inference_model(args: argparse.Namespace) -> tuple[Any, Any, str, str | None]:
    """The model (compiled for inference), where it came from, the dataset and its folder."""
    from ..inference import compile_for_inference, load_model, output_kind
    model, source = load_model(args.model)
    dataset = args.dataset or source.run_config.get("dataset") or "mnist"
    data_dir = args.data_dir
    if data_dir is None and dataset == source.run_config.get("dataset"):
        data_dir = source.run_config.get("data_dir")  # the folder the run was trained from
        if isinstance(data_dir, str) and data_dir and not os.path.exists(data_dir):
            resolved = source.run_config.get("resolved")
            typed = resolved.get("paths_as_typed") if isinstance(resolved, dict) else None
            typed = typed.get("data_dir") if isinstance(typed, dict) else None
            raise ConfigError(f"the data folder {data_dir!r} comes from the run's config.json ({source.description}"
                              + (f"; typed as {typed!r}" if typed else "") + ") and does not exist here; give "
                              "--data-dir DIR")
    compile_for_inference(model, args.device)
    print(f"model: {source.description} (outputs {output_kind(model)}) on {model.backend.description}")
    return model, source, dataset, data_dir


def _run_dataset(dataset: str, data_dir: str | None, run: dict[str, Any]) -> Any:
    """The dataset, read as the run read it when it trained on it: its .npz keys, and its
    held-out validation part (fraction and seed)."""
    from ..data import get_dataset
    from ..inference import run_for_dataset
    own = run_for_dataset(run, dataset)
    options = {k: own[k] for k in ("x_key", "y_key") if isinstance(own.get(k), str)}
    return get_dataset(dataset, data_dir, valid_fraction=own.get("valid_fraction"), seed=int(own.get("seed") or 0),
                       log=print, **options)


def _eval_split(args: argparse.Namespace, dataset: str, data_dir: str | None,
                run: dict[str, Any] | None = None) -> tuple[Any, Any, list[str]]:
    """(host transform, the split's arrays, class names); normalised as the run `run` (its config.json)
    was, when it trained on this dataset."""
    from ..data import BatchTransform
    from ..inference import input_normalisation
    data = _run_dataset(dataset, data_dir, run or {})
    norm = input_normalisation(run or {}, dataset, lambda: data)
    if args.split == "valid" and data.valid is None:
        raise ConfigError(f"{dataset} has no validation split here (the run held none out: valid-fraction 0); "
                          "use --split train")
    x, y = data.train if args.split == "train" else data.valid
    which = "train" if args.split == "train" else f"valid ({data.valid_from})"
    print(f"data: {dataset} {which}, {len(y):,} samples from {data.source}; {norm.for_dtype(x.dtype)}")
    return BatchTransform(norm.mean, norm.std), (x, y), data.classes


def cmd_predict(args: argparse.Namespace) -> int:
    from ..inference import fit_input, input_normalisation, predict_batch, prepare_image, run_class_names
    if args.index < 0:
        raise ConfigError(f"--index counts samples from 0, got {args.index}")
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}")
    model, source, dataset, data_dir = _inference_model(args)
    if dataset == TOKENS and source.run_config.get("dataset") != TOKENS:  # asked for, on another kind of run
        raise ConfigError(f"predict classifies one sample or image; --dataset {TOKENS} is for `anygrad eval "
                          f"{args.model}` (loss and perplexity of a language model)")
    if dataset == TOKENS:
        raise ConfigError("predict classifies one sample or image; it does not predict from a language model "
                          f"trained on tokens ({source.description}). Use `anygrad eval {args.model}` for its "
                          "loss and perplexity, or in Python: anygrad.load_onnx(...).predict(ids) on an int64 "
                          "(batch, block_size) array of token ids gives the next-token logits")
    true_label = None
    if args.image:
        loaded: Any = None  # the dataset, read only when the run did not record what is needed

        def data() -> Any:
            nonlocal loaded
            if loaded is None:
                loaded = _run_dataset(dataset, data_dir, source.run_config)
            return loaded
        prepared = prepare_image(args.image, model, dataset, input_normalisation(source.run_config, dataset, data))
        print(f"image: {args.image}: " + "; ".join(prepared.notes))
        x, names = prepared.x, run_class_names(source.run_config, dataset) or (loaded.classes if loaded is not None else None)
    else:
        transform, (xs, ys), names = _eval_split(args, dataset, data_dir, source.run_config)
        if args.index >= len(xs):
            raise ConfigError(f"--index {args.index} is outside the {len(xs)} samples of the {args.split} split "
                              f"(0 to {len(xs) - 1})")
        i = args.index
        x = fit_input(transform(xs[i:i + 1], np.array([i]), 0), model)
        true_label = int(ys[i])
    probs = predict_batch(model, x)[0]
    label = int(probs.argmax())

    def name(c: int) -> str:
        return f"{c} ({names[c]})" if names and c < len(names) and names[c] != str(c) else str(c)

    print(f"predicted: {name(label)}  probability {probs[label]:.4f}")
    top = np.argsort(-probs)[:max(1, args.top)]
    print("top: " + "  ".join(f"{name(int(c))} {100 * probs[c]:.2f}%" for c in top))
    if true_label is not None:
        print(f"true label: {name(true_label)}  ({'correct' if true_label == label else 'wrong'})")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console as RichConsole
    from rich.table import Table

    from ..inference import evaluate, fit_input
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    model, source, dataset, data_dir = _inference_model(args)
    if dataset == TOKENS:
        return _eval_tokens(args, model, data_dir, source.run_config)
    transform, (x, y), names = _eval_split(args, dataset, data_dir, source.run_config)
    x = fit_input(transform(x, np.arange(len(x)), 0), model)
    task = _eval_task(source.run_config, y)
    if task is not None:  # not one class per sample: the model's own metrics under the run's loss
        model.compile(loss=task[0], device=model.backend, **task[1])
        print(_metrics_line(model.evaluate(x, y, args.batch_size)))
        return 0
    result = evaluate(model, x, y, args.batch_size)
    print(f"loss {result.loss:.4f}  accuracy {100 * result.accuracy:.2f}%  ({result.count:,} samples)")
    table = Table(title="confusion matrix (rows: true class, columns: predicted)", header_style="bold")
    table.add_column("true \\ pred", justify="right", style="bold")
    classes = range(len(result.confusion))
    for c in classes:
        table.add_column(str(c), justify="right")
    table.add_column("recall", justify="right")
    for t in classes:
        row = result.confusion[t]
        cells = [f"[green]{v}[/]" if p == t else (str(v) if v else "[dim]0[/]") for p, v in enumerate(row)]
        label = f"{t} {names[t]}" if names and t < len(names) and names[t] != str(t) else str(t)
        recall = f"{100 * row[t] / row.sum():.1f}%" if row.sum() else "-"
        table.add_row(label, *cells, recall)
    RichConsole(width=max(100, 12 + 7 * len(result.confusion))).print(table)
    return 0


def _eval_tokens(args: argparse.Namespace, model: Any, data_dir: str | None, run: dict[str, Any]) -> int:
    """A language model trained with --dataset tokens: its loss and perplexity over the consecutive
    windows of the split train held out (or of the training part, --split train), split as the run
    split its token file (the same file, block size and valid fraction)."""
    from ..data.tokens import token_eval_blocks
    from ..inference import run_for_dataset
    own = run_for_dataset(run, TOKENS)
    block_size = own.get("block_size")
    if block_size is None:  # not a token run's folder: the model's own sequence length
        length = model.input_shape[1] if len(model.input_shape) > 1 else None
        if not isinstance(length, int):
            raise ConfigError(f"the model's input '{model.input_name}' has no fixed length "
                              f"{tuple(model.input_shape)}; evaluate its run folder (config.json records the "
                              "block size it trained with)")
        block_size = length
    blocks, where = token_eval_blocks(data_dir, block_size, own.get("valid_fraction"), args.split)
    if blocks is None:
        raise ConfigError(f"{where}: the run held no tokens out (valid-fraction 0) and the folder has no "
                          "val.bin; use --split train")
    print(f"data: tokens {args.split}, {len(blocks):,} windows of {block_size} tokens from {where}")
    loss, options = _eval_task(run, blocks.take(np.arange(1))[1]) or ("cross_entropy", {})
    model.compile(loss=loss, device=model.backend, **options)
    # read a bounded number of windows at a time (a token file may be larger than memory); every
    # window holds block_size tokens, none ignored, so the means weighted by count are the file's
    sums: dict[str, float] = {}
    total = 0
    step = args.batch_size * TOKEN_EVAL_BATCHES
    for start in range(0, len(blocks), step):
        x, y = blocks.take(np.arange(start, min(start + step, len(blocks))))
        part = model.evaluate(x, y, args.batch_size)
        for k, v in part.items():
            if k != "count":
                sums[k] = sums.get(k, 0.0) + float(v) * len(x)
        total += len(x)
    metrics = {k: v / total for k, v in sums.items()}
    if loss in ("cross_entropy", "nll") and "loss" in metrics:  # the mean NLL over every token: exp of it
        metrics = {"loss": metrics["loss"], "perplexity": float(np.exp(metrics["loss"])),
                   **{k: v for k, v in metrics.items() if k not in ("loss", "perplexity")}}
    print(_metrics_line({**metrics, "count": total}))
    return 0


def _eval_task(run: dict[str, Any], y: np.ndarray) -> tuple[str, dict[str, Any]] | None:
    """(loss, options) to evaluate a model that is not a per-sample classifier with: the run's own
    loss (config.json) when it is a regression or multi-label one, or class targets of more than
    one axis (tokens, pixels); None for a classifier (the confusion matrix)."""
    resolved = run.get("resolved") if isinstance(run.get("resolved"), dict) else {}
    record = resolved.get("loss") if isinstance(resolved.get("loss"), dict) else {}
    name = record.get("name") or run.get("loss") or ""
    options = {k: v for k, v in record.items() if k != "name"}
    y = np.asarray(y)
    if name in ("mse", "l1", "bce_with_logits"):
        return name, options
    if y.ndim > 1 and y.dtype.kind in "iu":
        return (name if name in ("cross_entropy", "nll") else "cross_entropy"), options
    return None


def _metrics_line(metrics: dict[str, float]) -> str:
    """Model.evaluate's metrics as one line: ratios as percent, the rest as numbers."""
    parts = []
    for name, value in metrics.items():
        if name == "count":
            continue
        ratio = name.endswith("accuracy") or name.rsplit("_", 1)[-1].startswith("top")
        parts.append(f"{name.replace('_', ' ')} " + (f"{100 * value:.2f}%" if ratio else f"{value:.4f}"))
    return "  ".join(parts) + f"  ({int(metrics.get('count', 0)):,} samples)"
