"""A language model's data: a flat file of token ids, cut into windows of block_size + 1 tokens.

As nanoGPT trains: a window w of T + 1 consecutive tokens starting anywhere in the file gives
the inputs x = w[:-1] and the next-token targets y = w[1:], both (T,) int64. The file is mapped,
not read, so a token file larger than RAM trains.

Files:
- `.bin`: raw uint16 token ids, native byte order, no header: what nanoGPT's prepare.py scripts
  write (`np.array(ids, dtype=np.uint16).tofile(...)`), for vocabularies up to 65,536;
- `.npy`: an array saved with np.save, read with its own integer dtype (uint8, uint16, uint32,
  int16, int32, int64, ...); it must be one-dimensional.
Anything else is refused.

Training windows (TokenWindows) start at random offsets drawn from (seed, epoch, step) with
anygrad's counter-based generator, so a run is reproducible and resumes mid-epoch on the same
windows. An "epoch" is (n_tokens - 1) // T windows, rounded down to whole batches: about one pass
over the file's tokens (at least one batch). Validation windows (TokenBlocks) are the
consecutive non-overlapping windows of the held-out part, always the same ones.
"""
from __future__ import annotations

from collections.abc import Iterator
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, DataError
from ..rng import key, mix32
from ..torchfile.npzfile import map_npy
from ..torchfile.safe_io import check_regular
from .loader import BatchSource, Samples

WINDOW_SALT = 0x544F  # keeps window offsets independent of shuffles and dropout of the same seed
BIN_DTYPE = np.dtype(np.uint16)


def read_tokens(path: str | PathLike) -> np.ndarray:
    """The token ids of a .bin (uint16) or .npy (its own integer dtype) file, memory-mapped."""
    p = Path(path).expanduser()
    suffix = p.suffix.lower()
    if suffix not in (".bin", ".npy"):
        raise DataError(f"{p}: a token file is .bin (raw uint16 ids, as nanoGPT writes them) or .npy (np.save of "
                        "a 1-D integer array); convert it to one of these")
    if not p.exists():
        raise DataError(f"{p}: no such token file")
    if suffix == ".npy":
        tokens = map_npy(p, DataError)
    else:
        size = check_regular(p, DataError)
        if size % BIN_DTYPE.itemsize or size == 0:
            raise DataError(f"{p}: {size} bytes is not a whole, nonzero number of uint16 tokens; a .bin "
                            "token file holds uint16 ids")
        tokens = np.memmap(p, dtype=BIN_DTYPE, mode="r")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(f"{p}: holds {tokens.dtype} of shape {tokens.shape}; a token file is one flat array of "
                        "integer ids (reshape(-1) and an integer dtype before np.save)")
    return tokens


def _tokens(source: Any) -> tuple[np.ndarray, str]:
    if isinstance(source, (str, PathLike)):
        return read_tokens(source), str(source)
    tokens = np.asarray(source) if not isinstance(source, np.ndarray) else source
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(f"tokens: {tokens.dtype} of shape {tokens.shape}; give one flat array of integer ids")
    return tokens, f"{len(tokens):,} tokens"


def _check_block(block_size: Any, n: int, where: str) -> int:
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"block-size must be a whole number of tokens >= 1, got {block_size!r}")
    if n < block_size + 1:
        raise DataError(f"{where}: {n:,} tokens, fewer than one window of block-size + 1 = {block_size + 1}; "
                        "use a smaller --block-size or more data")
    return int(block_size)


def _windows(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """Rows tokens[s:s + length] for each start, read from the (mapped) file in file order."""
    order = np.argsort(starts, kind="stable")
    out = np.empty((len(starts), length), np.int64)
    for row, s in zip(order, starts[order]):
        out[row] = tokens[int(s):int(s) + length]
    return out


class TokenWindows(BatchSource):
    """Random (x, y) windows of `block_size` tokens from a token file or a 1-D integer array:
    batch `step` of `epoch` holds the windows starting at offsets drawn from (seed, epoch, step).
    Pass it to `fit` as training data; `batch_size` and `seed` come from the run unless given."""

    def __init__(self, tokens: str | PathLike | np.ndarray, block_size: int, batch_size: int | None = None,
                 seed: int | None = None, prefetch: bool = False):
        self.tokens, self.source = _tokens(tokens)
        self.block_size = _check_block(block_size, len(self.tokens), self.source)
        self.batch_size, self.seed, self.prefetch = batch_size, seed, prefetch
        self.what = f"the token windows of {self.source}"
        self.epoch = 0

    def bind(self, batch_size: int, seed: int) -> TokenWindows:
        """Take the run's batch size and seed where none were given."""
        if self.batch_size is None:
            self.batch_size = batch_size
        if self.seed is None:
            self.seed = seed
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be at least 1, got {self.batch_size}")
        return self

    @property
    def n_windows(self) -> int:
        """Windows per epoch: as many as it takes to cover the file's tokens once."""
        return (len(self.tokens) - 1) // self.block_size

    @property
    def n_samples(self) -> int:
        return len(self) * (self.batch_size or 1)

    @property
    def sample_shape(self) -> tuple:
        return (self.block_size,)

    def __len__(self) -> int:
        return max(1, self.n_windows // (self.batch_size or 1))

    def offsets(self, epoch: int, step: int) -> np.ndarray:
        """The window starts of batch `step` of `epoch`: uniform over [0, n_tokens - block_size - 1]."""
        b, starts = self.batch_size or 1, len(self.tokens) - self.block_size
        idx = np.arange(step * b, (step + 1) * b, dtype=np.uint64)
        k = key(self.seed or 0, epoch, WINDOW_SALT)
        lo = mix32((idx & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ k).astype(np.uint64)
        hi = mix32(lo.astype(np.uint32) ^ np.uint32(k ^ 0x9E3779B9)).astype(np.uint64)
        return ((hi << np.uint64(32)) | lo) % np.uint64(starts)

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        t = self.block_size
        for step in range(start, len(self)):
            w = _windows(self.tokens, self.offsets(epoch, step), t + 1)
            yield w[:, :-1], w[:, 1:]


class TokenBlocks(Samples):
    """The consecutive non-overlapping windows of a token array: sample i is x = tokens[iT:iT + T],
    y = tokens[iT + 1:iT + T + 1]. For validation: the same windows every time."""

    def __init__(self, tokens: str | PathLike | np.ndarray, block_size: int):
        self.tokens, self.source = _tokens(tokens)
        self.block_size = _check_block(block_size, len(self.tokens), self.source)
        self.what = f"the token blocks of {self.source}"

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    @property
    def sample_shape(self) -> tuple:
        return (self.block_size,)

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = _windows(self.tokens, np.asarray(indices, np.int64) * self.block_size, self.block_size + 1)
        return w[:, :-1], w[:, 1:]


def token_split(path: str | PathLike, block_size: int, valid_fraction: float | None = None
                ) -> tuple[TokenWindows, TokenBlocks | None, str]:
    """Training windows and validation blocks from one token file (the last `valid_fraction` of
    its tokens held out; default 0.1, 0 for none) or from a folder holding nanoGPT's train.bin and
    val.bin (or train.npy and val.npy). Returns (train, valid, a description of the source)."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = {name: next((p / f"{name}{ext}" for ext in (".bin", ".npy") if (p / f"{name}{ext}").is_file()), None)
                 for name in ("train", "val")}
        if files["train"] is None:
            raise DataError(f"{p}: no train.bin or train.npy in this folder; give --data-dir the token file, or a "
                            "folder holding train.bin and val.bin (as nanoGPT's prepare.py writes)")
        if valid_fraction is not None:
            raise ConfigError(f"{p} has its own split (train and val files); leave out --valid-fraction")
        valid = TokenBlocks(files["val"], block_size) if files["val"] is not None else None
        return TokenWindows(files["train"], block_size), valid, str(p)
    tokens = read_tokens(p)
    fraction = 0.1 if valid_fraction is None else float(valid_fraction)
    if not 0 <= fraction < 1:
        raise ConfigError(f"valid-fraction must be in [0, 1), got {fraction}")
    cut = len(tokens) - round(len(tokens) * fraction)
    if fraction and len(tokens) - cut < block_size + 1:
        raise DataError(f"{p}: the held-out {fraction:g} of {len(tokens):,} tokens is shorter than one window of "
                        f"{block_size + 1}; use a larger --valid-fraction, a smaller --block-size, or 0")
    valid = TokenBlocks(tokens[cut:], block_size) if fraction else None
    train = TokenWindows(tokens[:cut], block_size)
    train.source = f"{p} (first {cut:,} of {len(tokens):,} tokens)"
    train.what = f"the token windows of {train.source}"
    return train, valid, str(p)


def token_run_data(data_dir: str | None, block_size: int | None, valid_fraction: float | None
                   ) -> tuple[TokenWindows, TokenBlocks | None, str, dict[str, Any]]:
    """What `anygrad train --dataset tokens` trains on: (train windows, valid blocks, source,
    the record config.json keeps under "resolved")."""
    if not data_dir:
        raise ConfigError("the tokens dataset needs a token file: --data-dir FILE.bin|FILE.npy (or a folder "
                          "holding train.bin and val.bin)")
    if block_size is None:
        raise ConfigError("the tokens dataset needs --block-size T: the tokens of context per window (the "
                          "sequence length the model takes)")
    train, valid, source = token_split(data_dir, block_size, valid_fraction)
    record = {"tokens": {"file": str(source), "dtype": str(train.tokens.dtype), "block_size": int(block_size),
                         "train_tokens": len(train.tokens),
                         "valid_tokens": len(valid.tokens) if valid is not None else 0}}
    return train, valid, source, record


def token_eval_blocks(data_dir: str | None, block_size: int | None, valid_fraction: float | None,
                      split: str = "valid") -> tuple[TokenBlocks | None, str]:
    """What `anygrad eval` reads of a token run: the consecutive windows of one part of its token
    file, split exactly as token_run_data splits it for training (the same file, block size and
    valid fraction give the same held-out tokens). split "valid": the held-out blocks (None when
    the run held none out); "train": the training part cut into consecutive blocks. Returns
    (blocks, where they come from, for messages)."""
    train, valid, source, _ = token_run_data(data_dir, block_size, valid_fraction)
    if split == "train":
        blocks = TokenBlocks(train.tokens, int(block_size or 0))
        return blocks, train.source
    if valid is None:
        return None, source
    if Path(source).is_dir():
        return valid, valid.source
    return valid, f"{source} (last {len(valid.tokens):,} of {len(train.tokens) + len(valid.tokens):,} tokens)"
