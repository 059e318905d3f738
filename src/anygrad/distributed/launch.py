"""Joining a torch.distributed job: what torchrun (or Slurm, Ray, ...) set in the environment, the
gloo process group, and the device each rank trains on.

torch is imported here only when a process group is started.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from .. import settings
from ..errors import ConfigError, DeviceError

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# Gradients travel in buckets of this size (ANYGRAD_BUCKET_MB fixes another: fixed_bucket_bytes):
# smaller than DDP's 25 MB because a bucket is read back, summed and all-reduced while the next one
# is still on its way.
BUCKET_BYTES = 8 << 20
# gloo process groups the buckets take turns on (ANYGRAD_GLOO_GROUPS, default 4): one group moves
# one bucket at a time over its own TCP connections, so several groups reduce several buckets at once.
# A sum of at least twice this size and less than PIECES_BELOW is cut into pieces of at least
# this size, one a group at most, each started on the next group in turn (ANYGRAD_GLOO_PIECE_MB):
# the GPT's last two buckets, 2 MB each, otherwise took 1.1-1.5 ms on two of the four groups while
# the GPUs waited (2 H200s: 1.81-1.83x with pieces, 1.80-1.81x without; session 41, cmd51).
# Larger sums fill the groups between them already, and cut they were slower (ResNet-18 at 32 px,
# 16 MB buckets: 43,193 samples/s against 48,770, cmd52).
PIECE_BYTES = 1 << 20
PIECES_BELOW = 8 << 20


def _megabytes(name: str, default: int, least: int) -> int:
    mb = settings.get(name)
    return default if mb is None else max(least, int(mb * (1 << 20)))


def fixed_bucket_bytes() -> int | None:
    """The bucket size ANYGRAD_BUCKET_MB fixes, None when unset (DataParallel then times sizes).
    Also checks the other exchange settings, so that a bad one is named when data parallelism starts."""
    settings.get("ANYGRAD_GLOO_GROUPS")
    settings.get("ANYGRAD_GLOO_PIECE_MB")
    if not settings.is_set("ANYGRAD_BUCKET_MB"):
        return None
    return _megabytes("ANYGRAD_BUCKET_MB", BUCKET_BYTES, 4)


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int


def world_from_env(env: dict[str, str] | None = None) -> WorldInfo | None:
    """The job this process belongs to, from torchrun's variables; None when WORLD_SIZE is unset
    (a plain run). A partial set is an error that names what is missing."""
    env = settings.environment() if env is None else env
    if "WORLD_SIZE" not in env:
        return None
    missing = [k for k in REQUIRED if not env.get(k)]
    if missing:
        raise ConfigError(f"WORLD_SIZE is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                          "launch with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), "
                          "or set them all")
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK {rank} is not within WORLD_SIZE {world}")
    return WorldInfo(rank, world, local)


def rank_device(device: str | None, local_rank: int) -> str:
    """The device of the rank with this LOCAL_RANK: 'wgpu' or 'auto' take the local_rank-th GPU
    adapter (software ones last), a list 'a,b,...' its local_rank-th entry (cycled), anything
    else as given (every rank on 'cpu')."""
    device = (device or "auto").strip().lower()
    if "," in device:
        items = [d.strip() for d in device.split(",") if d.strip()]
        return items[local_rank % len(items)]
    if device in ("wgpu", "auto"):
        from ..devices import list_adapters
        adapters = [a for a in list_adapters() if a.backend.lower() != "opengl"]
        hardware = [a for a in adapters if not a.is_software]
        pool = hardware or ([] if device == "auto" else adapters)
        if not pool:
            return "cpu"
        return f"wgpu:{pool[local_rank % len(pool)].index}"
    return device


def _store(world: WorldInfo, timeout_s: float) -> Any:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT (torchrun's agent hosts it, else rank 0),
    with this attempt's prefix: torchrun keeps its store across --max-restarts, and gloo's keys
    are the same in every attempt, so without it a restarted rank may read a dead peer's address."""
    import torch.distributed as dist
    agent = settings.external("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    address, port = settings.external("MASTER_ADDR"), settings.external("MASTER_PORT")
    store = dist.TCPStore(address, int(port or 0), world.world_size,
                          is_master=world.rank == 0 and not agent, timeout=timedelta(seconds=timeout_s))
    attempt = settings.external("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"anygrad/attempt_{attempt}", store)


class ProcessGroup:
    """The gloo group of this job: bucketed all-reduce of host arrays (zero-copy through
    torch.from_numpy), hashes gathered to compare replicas, barrier."""

    def __init__(self, world: WorldInfo, timeout_s: float = 1800.0):
        try:
            import torch.distributed as dist
        except ImportError:
            raise ConfigError("distributed training needs torch: pip install 'anygrad-train[distributed]'") from None
        self.dist, self.world = dist, world
        self.rank, self.size = world.rank, world.world_size
        self.owned = not dist.is_initialized()
        if self.owned:
            try:
                dist.init_process_group("gloo", store=_store(world, timeout_s), rank=world.rank,
                                        world_size=world.world_size, timeout=timedelta(seconds=timeout_s))
            except Exception as e:
                raise DeviceError(f"could not join the process group at {settings.external('MASTER_ADDR')}:"
                                  f"{settings.external('MASTER_PORT')} as rank {world.rank} of {world.world_size}: "
                                  f"{e}") from e
        # Every rank creates the same groups in the same order (new_group is collective).
        groups = settings.get("ANYGRAD_GLOO_GROUPS") if self.size > 1 else 1
        self.lanes: list[Any] = [None] + [dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                                          for _ in range(groups - 1)]
        self.piece_bytes = _megabytes("ANYGRAD_GLOO_PIECE_MB", PIECE_BYTES, 1)
        self._turn = 0  # the lane the next piece goes to: every rank starts the same sums in the same order

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def all_reduce_start(self, view: np.ndarray) -> Any:
        """Start summing the float32 vector `view` over the ranks in place (a zero-copy torch view),
        in pieces over the gloo groups (_start); returns the work to wait() for."""
        import torch
        return self._start(torch.from_numpy(view))

    def all_reduce_start_bf16(self, view: np.ndarray, scale: float) -> Any:
        """all_reduce_start of the float32 vector `view` times `scale`, sent as bfloat16 (half the
        bytes; rounded to nearest even by torch, summed in bfloat16 by gloo, as DDP's
        bf16_compress_hook does); the returned work's wait() puts the sum back into `view` as
        float32 (exactly: bfloat16 widens without rounding)."""
        import torch
        packed = torch.mul(torch.from_numpy(view), scale).to(torch.bfloat16)
        return _Widened(self._start(packed), packed, view)

    def _start(self, t: Any) -> Any:
        """gloo's in-place all-reduce of the 1-D tensor `t`, started: one piece per PIECE_BYTES (at
        most one per group; whole from PIECES_BELOW up), each on the next group in turn, so that
        the last few sums of a step move over several TCP connections at once. Elementwise, so
        the cut changes no value."""
        import torch
        nbytes = t.numel() * t.element_size()
        pieces = max(1, min(len(self.lanes), nbytes // self.piece_bytes)) if nbytes < PIECES_BELOW else 1
        works = []
        for piece in torch.tensor_split(t, pieces):
            works.append(self.dist.all_reduce(piece, group=self.lanes[self._turn % len(self.lanes)], async_op=True))
            self._turn += 1
        return works[0] if pieces == 1 else _Pieces(works)

    def all_reduce_flat(self, flat: np.ndarray, scale: float = 1.0) -> None:
        """Sum the float32 vector `flat` over the ranks in place (times `scale`): buckets of
        BUCKET_BYTES, reduced asynchronously, so that gloo moves several at once."""
        step = max(1, (fixed_bucket_bytes() or BUCKET_BYTES) // flat.itemsize)
        works = [self.all_reduce_start(flat[i:i + step]) for i in range(0, flat.size, step)]
        for work in works:
            work.wait()
        if scale != 1.0:
            flat *= np.float32(scale)

    def all_reduce_f64(self, values: np.ndarray) -> np.ndarray:
        """Sums over the ranks of a small float64 vector (metric sums, losses)."""
        import torch
        t = torch.from_numpy(np.array(values, np.float64).reshape(-1))
        self.dist.all_reduce(t)
        return t.numpy()

    def gather_strings(self, text: str) -> list[str]:
        got: list[Any] = [None] * self.size
        self.dist.all_gather_object(got, text)
        return [str(t) for t in got]

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        if self.owned and self.dist.is_initialized():
            self.dist.destroy_process_group()


class _Pieces:
    """The works of one sum's pieces (ProcessGroup._start): done when all are; wait() waits for
    every one, also past a failed one (gloo must be done with the memory before it is reused)."""

    def __init__(self, works: list[Any]):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        failed = None
        for w in self.works:
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001 - raised once the others are done
                failed = failed or e
        if failed is not None:
            raise failed


class _Widened:
    """gloo's work on a bfloat16 copy of a float32 vector: once done, the sum is widened back into it."""

    def __init__(self, work: Any, packed: Any, view: np.ndarray):
        self.work, self.packed, self.view = work, packed, view

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        import torch
        self.work.wait()
        torch.from_numpy(self.view).copy_(self.packed)
