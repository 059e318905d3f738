"""Compile-time savings for the wgpu backend: pipelines built in parallel, compiled plans on disk.

What a compile costs (lavapipe, measured): ~95% creating compute pipelines (naga + the driver's
shader compiler), the rest fusing and planning the step in Python. Two savings follow:

- Pipelines are created from a thread pool. wgpu-py calls wgpu-native through cffi, which
  releases the GIL, and wgpu-core allows concurrent pipeline creation on one device, so the
  driver compiles several shaders at once. (`create_compute_pipeline_async` exists in wgpu-py
  0.32 but is not implemented by its wgpu-native backend: it creates the pipeline synchronously.)
  Dawn's devices are opened with implicit-device-synchronization for the same reason: its lock
  does not serialise the compiles (H200, 24 pipelines: 13.8 s on one thread, 1.9 s on 16, 7.5 s
  through Dawn's own create_compute_pipeline_async).
- Compiled plans (the fused graph and its kernel/buffer plan, WGSL included) are pickled on disk,
  keyed by a hash of the graph, the adapter, its driver, the device limits and anygrad's backend
  source. A warm compile skips fusion, lowering and planning.

The pipelines themselves are not stored: wgpu's `pipeline-cache` feature (listed by most Vulkan
adapters, lavapipe included) has no entry point in wgpu-native 29's C API
(`wgpuDeviceCreatePipelineCache` is not exported), so wgpu-py 0.32 cannot reach it. Drivers keep
their own shader caches (NVIDIA's on-disk cache, Mesa's for its hardware drivers).

Cache files live in `$ANYGRAD_CACHE/wgpu-plans` (default `~/.cache/anygrad/wgpu-plans`).
`ANYGRAD_PIPELINE_CACHE=0` turns the disk cache off; `ANYGRAD_PIPELINE_THREADS=N` sets the
threads (1: serial). A file that is unreadable, truncated or altered is ignored and rewritten:
the cache can never make a compile fail. Files are read only from the user's own cache folder;
do not point ANYGRAD_CACHE at a folder other people can write to (plans are pickles).
"""
from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .... import settings
from ....fsutil import atomic_write
from ....ir.graph import Graph

CACHE_ENV = "ANYGRAD_CACHE"              # anygrad's cache root (as data/ uses it)
SWITCH_ENV = "ANYGRAD_PIPELINE_CACHE"    # "0": no disk cache
THREADS_ENV = "ANYGRAD_PIPELINE_THREADS"
_MAGIC = b"anygrad-wgpu-plan-v1\n"
_DIGEST = 32                             # sha256 of the pickled payload, after the magic
_MAX_FILES = 256                         # the least recently used plans beyond this are deleted

# Counters for tests and `compile` timings: hits/misses/writes/corrupt of the plan cache.
stats = {"hits": 0, "misses": 0, "writes": 0, "corrupt": 0}


def enabled() -> bool:
    return settings.get(SWITCH_ENV)


def cache_dir() -> Path:
    root = settings.get(CACHE_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "anygrad"
    return base / "wgpu-plans"


def threads() -> int:
    n = settings.get(THREADS_ENV)
    return n if n > 0 else max(1, min(16, os.cpu_count() or 1))


# -- parallel pipeline creation -------------------------------------------------------------------
def build_parallel(create: Callable[[Any], Any], keys: Sequence[Any], threaded: bool = True) -> dict[Any, Any]:
    """create(key) for each distinct key, on a thread pool. A key whose creation fails in a thread
    is created again on the calling thread, so its error is raised there with its own message.
    threaded=False: all on the calling thread (a Dawn device without implicit-device-
    synchronization is not safe to call from several threads at once)."""
    todo = list(dict.fromkeys(keys))
    n = min(threads(), len(todo)) if threaded else 1
    if n <= 1:
        return {k: create(k) for k in todo}
    out: dict[Any, Any] = {}
    with ThreadPoolExecutor(n, thread_name_prefix="anygrad-pipeline") as pool:
        futures = {k: pool.submit(create, k) for k in todo}
    for k, f in futures.items():
        try:
            out[k] = f.result()
        except Exception:  # noqa: BLE001  (whatever it was, the retry below raises it here)
            out[k] = create(k)
    return out


def build_background(create: Callable[[Any], Any], keys: Sequence[Any]) -> dict[Any, Future]:
    """create(key) for each distinct key on a thread pool, in order, without waiting: the caller
    collects each Future when it needs that key (the autotuner times one shape's candidates while
    the next shapes' shaders compile)."""
    todo = list(dict.fromkeys(keys))
    if not todo:
        return {}
    pool = ThreadPoolExecutor(min(threads(), len(todo)), thread_name_prefix="anygrad-pipeline")
    futures = {k: pool.submit(create, k) for k in todo}
    pool.shutdown(wait=False)  # the queued builds run on; the pool's threads end after them
    return futures


# -- the plan cache ---------------------------------------------------------------------------------
_SOURCE_HASH: str | None = None


def source_files() -> dict[str, Path]:
    """The code a plan comes from, by path inside the package: the wgpu backend, the IR and the
    ops, every subfolder included (the backend's fusion/, kernels/, planning/... once went
    unhashed, and a source checkout then reused plans its own changes had made stale)."""
    pkg = Path(__file__).resolve().parents[3]  # src/anygrad
    return {f.relative_to(pkg).as_posix(): f for folder in (pkg / "backends" / "wgpu", pkg / "ir", pkg / "ops")
            for f in sorted(folder.rglob("*.py"))}


def _source_hash() -> str:
    """anygrad's lowering code: a plan cached by other code is never reused."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        h = hashlib.sha256()
        for name, f in sorted(source_files().items()):
            h.update(name.encode() + b"\0" + f.read_bytes())
        _SOURCE_HASH = h.hexdigest()
    return _SOURCE_HASH


def _feed(h: Any, x: Any) -> None:
    """A canonical, type-tagged encoding of attribute values (arrays by dtype, shape and bytes)."""
    if isinstance(x, np.ndarray):
        h.update(b"A" + str(x.dtype).encode() + repr(x.shape).encode())
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, dict):
        h.update(b"D%d" % len(x))
        for k in sorted(x, key=repr):
            _feed(h, k)
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(b"L%d" % len(x))
        for v in x:
            _feed(h, v)
    else:
        h.update(b"S" + type(x).__name__.encode() + b":" + repr(x).encode() + b"\0")


def plan_key(graph: Graph, context: Sequence[Any]) -> str:
    """Hash of everything a compiled plan depends on: the graph (constant values included,
    trainable state by name, dtype and shape only) and `context` (adapter, driver, limits...)."""
    h = hashlib.sha256()
    _feed(h, [_source_hash(), list(context)])
    state = set(graph.state_names)
    _feed(h, [graph.name, list(graph.inputs), list(graph.outputs), dict(graph.state_updates)])
    for n in graph.nodes:
        _feed(h, [n.op, list(n.inputs), list(n.outputs), n.attrs, n.name])
    for name in sorted(graph.info):
        inf = graph.info[name]
        _feed(h, [name, str(inf.dtype), tuple(inf.shape) if inf.shape is not None else None])
    for name in sorted(graph.initializers):
        arr = np.asarray(graph.initializers[name])
        _feed(h, [name, str(arr.dtype), arr.shape])
        if name not in state:
            _feed(h, arr)
    _feed(h, settings.tuning_values())  # the switches lowering and planning read (declared kind "tuning")
    return h.hexdigest()


class _Same:
    """Stands for an initializer array that the source graph holds: not written to disk."""

    def __init__(self, name: str):
        self.name = name


def _graphs(payload: Any) -> list[Graph]:
    """The graphs in a payload (the fused graph, the plan's graph, ...), where weights may sit."""
    return [g for item in payload for g in (item, getattr(item, "graph", None)) if isinstance(g, Graph)]


def load(key: str, source: Graph) -> Any | None:
    """The cached payload for key with the source graph's arrays put back, or None."""
    if not enabled():
        return None
    path = cache_dir() / f"{key}.plan"
    try:
        raw = path.read_bytes()
    except OSError:
        stats["misses"] += 1
        return None
    try:
        if not raw.startswith(_MAGIC):
            raise ValueError("bad header")
        digest, body = raw[len(_MAGIC):len(_MAGIC) + _DIGEST], raw[len(_MAGIC) + _DIGEST:]
        if hashlib.sha256(body).digest() != digest:
            raise ValueError("checksum mismatch")
        payload = pickle.loads(body)
        for g in _graphs(payload):
            for name, arr in list(g.initializers.items()):
                if isinstance(arr, _Same):
                    g.initializers[name] = source.initializers[arr.name]
    except Exception:  # noqa: BLE001  (corrupt, truncated, incompatible version: compile afresh)
        stats["corrupt"] += 1
        stats["misses"] += 1
        return None
    stats["hits"] += 1
    try:
        os.utime(path)  # recently used: kept by _evict
    except OSError:
        pass
    return payload


def save(key: str, source: Graph, payload: Any) -> None:
    """Write the payload (arrays shared with the source graph left out). Never raises: a cache
    that cannot be written (read-only home, full disk) only costs the next compile its time."""
    if not enabled():
        return
    try:
        swapped: list[tuple[dict, str, Any]] = []
        for g in _graphs(payload):
            for name, arr in g.initializers.items():
                if source.initializers.get(name) is arr:
                    swapped.append((g.initializers, name, arr))
        for d, name, _ in swapped:
            d[name] = _Same(name)
        try:
            body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        finally:
            for d, name, arr in swapped:
                d[name] = arr
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / f"{key}.plan", _MAGIC + hashlib.sha256(body).digest() + body, fsync=False)
        stats["writes"] += 1
        _evict(folder)
    except Exception:  # noqa: BLE001, S110  (a cache that cannot be written is no error)
        pass


def _evict(folder: Path) -> None:
    files = sorted(folder.glob("*.plan"), key=lambda f: f.stat().st_mtime)
    for f in files[:max(0, len(files) - _MAX_FILES)]:
        f.unlink(missing_ok=True)
