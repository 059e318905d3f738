"""Data-parallel training: several devices of one process, and processes joined by torch.distributed.

Each replica runs the gradient phase of the compiled step on its shard of the batch; the
gradients are summed (on the host inside a process, through gloo across processes) into the
global-batch mean; every replica then runs the same update program, so parameters stay equal.
DataParallel is a training strategy (anygrad.strategy): the model holds it as `model.strategy`
and never knows it is data-parallel; `data_parallel(model)` gives it back, or None.
torch is imported only when a process group is used (the `anygrad-train[distributed]` extra).
"""
from __future__ import annotations

from .. import strategy
from ..devices import device_list, open_backends
from .launch import ProcessGroup, WorldInfo, rank_device, world_from_env
from .parallel import DataParallel, data_parallel
from .sampler import ShardedLoader, shard_indices

# compile(device="wgpu:0,wgpu:1"): the model's strategy (anygrad.strategy.for_devices)
strategy.register_several_devices(lambda model, backends: DataParallel(model, backends[1:]))

__all__ = ["DataParallel", "ProcessGroup", "ShardedLoader", "WorldInfo", "data_parallel", "device_list", "open_backends", "rank_device",
           "shard_indices", "world_from_env"]
