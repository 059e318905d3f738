"""Read PyTorch checkpoints without PyTorch, and read/write safetensors.

`load` returns a flat state_dict (name -> numpy array) from a .pt/.pth file written by torch.save,
in the zip format or the legacy one. Reading is safe by construction: the pickle inside is run by
anygrad's own restricted machine (`pickle_reader`), which can only build containers, numbers,
strings and tensors from the allowlist in `allowlist`; a file naming anything else (os.system, eval,
a pickled nn.Module class, ...) is refused with a ModelError, and nothing from the file is executed.
Every failure while reading comes out as a ModelError naming the file.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AnygradError, ModelError
from .legacy import read_legacy
from .npzfile import read_npz_arrays
from .safe_io import check_regular, open_regular, read_into
from .safetensors_io import load_safetensors, save_safetensors
from .tensors import FormatError
from .zipformat import read_zip

__all__ = ["check_regular", "find_state_dict", "is_safetensors", "load", "load_raw", "load_safetensors",
           "open_regular", "read_npz_arrays", "save_safetensors"]

# Where training scripts usually keep the weights inside a checkpoint dict, most likely first.
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "network", "weights",
                   "params")
_ZIP_MAGIC = b"PK\x03\x04"


def _guarded(path: Path, read: Callable[[], Any]) -> Any:
    """Run `read`; whatever goes wrong becomes a ModelError naming the file."""
    try:
        return read()
    except FormatError as e:
        raise ModelError(f"{path}: {e}") from None
    except AnygradError:
        raise
    except FileNotFoundError:
        raise ModelError(f"{path}: file not found") from None
    except Exception as e:  # corrupt input surfaces as anything: zipfile, struct, EOF, unicode, memory
        detail = str(e) if len(str(e)) <= 200 else str(e)[:200] + "..."
        raise ModelError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {detail})") from e


_PICKLE_PROTO = b"\x80"  # the legacy format starts with a pickle PROTO opcode
_ONNX_START = b"\x08"  # an ONNX ModelProto starts with field 1 (ir_version), a varint


def _read(path: Path) -> Any:
    with open_regular(path) as f:  # never a FIFO or a device (which block or never end)
        magic = f.read(4)
        f.seek(0)
        if magic == _ZIP_MAGIC:
            return read_zip(f)
        data = read_into(f, os.fstat(f.fileno()).st_size)  # writable: arrays share the storages' bytes
    if data[:1] != _PICKLE_PROTO and data[257:262] != b"ustar":  # (read_legacy names the tar format)
        raise FormatError(_not_a_checkpoint(path, bytes(data[:300])))
    return read_legacy(data)


def _not_a_checkpoint(path: Path, data: bytes) -> str:
    """What a file that starts like no checkpoint is (an ONNX model, a text file), before the
    unpickler tries it and reports a pickle detail."""
    if data[8:10] == b'{"':
        return "a safetensors file, not a torch.save one: read it with load or load_safetensors"
    onnx_hint = ("; it looks like an ONNX model: load it with anygrad.load_onnx (on the command line, "
                 "give it as MODEL: anygrad train FILE.onnx)") \
        if path.suffix == ".onnx" or data[:1] == _ONNX_START else ""
    return f"not a PyTorch checkpoint (.pt/.pth written by torch.save), a .safetensors or an .npz file{onnx_hint}"


def is_safetensors(path: Path) -> bool:
    """By suffix, or by content: an 8-byte header length followed by a JSON object."""
    if path.suffix == ".safetensors":
        return True
    try:
        with open_regular(path) as f:
            return f.read(10)[8:] == b'{"'
    except (OSError, AnygradError):
        return False


def load_raw(path: str | os.PathLike) -> Any:
    """The whole object saved by torch.save: tensors as numpy arrays, everything else plain Python."""
    path = Path(path)
    return _guarded(path, lambda: _read(path))


def _is_state_dict(obj: Any) -> bool:
    return (isinstance(obj, dict) and len(obj) > 0
            and all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()))


# An untrusted pickle can nest dicts deeply, put a dict inside itself, or share one dict under many
# keys (a few hundred bytes then flatten to millions of names); the search below looks at each
# container once and gives up on such shapes instead of following them.
MAX_TENSORS = 1 << 20  # far above any real state_dict (a large MoE model has ~1e5 tensors)
MAX_NESTING = 32


def _flatten(obj: dict, prefix: str = "", seen: set[int] | None = None,
             depth: int = 0) -> dict[str, np.ndarray] | None:
    """Nested dicts whose leaves are all arrays -> one flat dict with dotted names (None otherwise,
    and for nesting that is too deep, cyclic, or visits one dict twice)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > MAX_NESTING:
        return None
    seen.add(id(obj))
    out: dict[str, np.ndarray] = {}
    for k, v in obj.items():
        if not isinstance(k, str):
            return None
        if isinstance(v, np.ndarray):
            out[prefix + k] = v
        elif isinstance(v, dict) and v:
            inner = _flatten(v, f"{prefix}{k}.", seen, depth + 1)
            if inner is None:
                return None
            out.update(inner)
        else:
            return None
        if len(out) > MAX_TENSORS:
            raise FormatError(f"the checkpoint names more than {MAX_TENSORS} tensors; refusing to read it "
                              "as a state_dict (pass key=... (--weights-key KEY) for the entry that holds it)")
    return out


def find_state_dict(obj: Any, key: str | None = None, depth: int = 3) -> dict[str, np.ndarray] | None:
    """The state_dict inside a loaded checkpoint: `obj[key]` if given, else searched for.

    Search order at each level: `obj` itself if it maps names to arrays; its entries under
    STATE_DICT_KEYS; `obj` flattened to dotted names if all its leaves are arrays ({"encoder": sd1,
    "decoder": sd2}); then its other dict entries in order, up to `depth` levels down. Each dict is
    searched once, so self-references and shared entries cost nothing."""
    if key is not None:
        if not isinstance(obj, dict) or key not in obj:
            return None
        return find_state_dict(obj[key], depth=0)
    return _search(obj, depth, set())


def _search(obj: Any, depth: int, visited: set[int]) -> dict[str, np.ndarray] | None:
    if not isinstance(obj, dict) or id(obj) in visited:
        return None
    visited.add(id(obj))
    if _is_state_dict(obj):
        return dict(obj)
    preferred = [obj[k] for k in STATE_DICT_KEYS if k in obj]
    others = [v for k, v in obj.items() if k not in STATE_DICT_KEYS]
    for i, candidate in enumerate(preferred + [None] + others):
        if i == len(preferred):
            flat = _flatten(obj) if obj else None
            if flat is not None:
                return flat
        elif depth > 0 and isinstance(candidate, dict):
            found = _search(candidate, depth - 1, visited)
            if found is not None:
                return found
    return None


def load(path: str | os.PathLike, key: str | None = None) -> dict[str, np.ndarray]:
    """A flat state_dict (name -> numpy array) from a torch.save file (or a safetensors file).

    The file may hold the state_dict itself or a checkpoint dict around it ({"model": sd, "optimizer":
    ...}); `key` names the entry to use, otherwise it is found (see `find_state_dict`). bfloat16
    tensors come back as float32, every other dtype as itself. One tensor saved under several names
    (tied weights: the same view of one storage) comes back as one array under each name; other
    views contiguous in a shared storage share its memory (as torch's views do), and strided views
    are copied into contiguous arrays, within a budget of a few times the file's storages (a small
    file of overlapping or stride-0 views is refused instead of taking gigabytes)."""
    path = Path(path)
    if is_safetensors(path):
        return load_safetensors(path)
    obj = load_raw(path)
    sd = _guarded(path, lambda: find_state_dict(obj, key))
    if sd is None:
        what = f"keys {list(obj)[:10]}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
        where = f"entry {key!r}" if key is not None else "a dict of name -> tensor"
        # A key names an entry of a dict: for anything else only reading the object yourself helps.
        remedy = ("pass key=... (--weights-key KEY) naming the entry that holds it, or read it with "
                  "anygrad.torchfile.load_raw" if isinstance(obj, dict) else
                  "it is no dict, so no key can name a state_dict in it: read it with anygrad.torchfile.load_raw "
                  "and pass the dict of name -> tensor to load_state_dict")
        raise ModelError(f"{path}: no state_dict found (looked for {where}; the file holds {what}); {remedy}")
    return sd
