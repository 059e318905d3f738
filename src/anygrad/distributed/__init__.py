"""Data-parallel training: several devices of one process, and processes joined by torch.distributed.

Each replica runs the gradient phase of the compiled step on its shard of the batch; the
gradients are summed (on the host inside a process, through gloo across processes) into the
global-batch mean; every replica then runs the same update program, so parameters stay equal.
torch is imported only when a process group is used (the `anygrad[distributed]` extra).
"""
from __future__ import annotations

from .launch import ProcessGroup, WorldInfo, rank_device, world_from_env
from .parallel import DataParallel, device_list, open_backends
from .sampler import ShardedLoader, shard_indices

__all__ = ["DataParallel", "ProcessGroup", "ShardedLoader", "WorldInfo", "device_list", "open_backends", "rank_device",
           "shard_indices", "world_from_env"]
