"""The torch backend's op contract: one lowering per op, node -> torch kernel.

A lowering runs once, when a graph is compiled. It reads the node's attributes and the static
shapes and dtypes of its inputs and outputs (a `Site`), and returns the kernel that runs the
node every step: a function from a list of torch tensors (None for an absent optional input)
to a list of torch tensors, one per output. It returns None when it cannot run this node
(a mode, a dtype or an attribute it does not cover); the node then runs on the op's numpy
reference kernel (`runtime.py`), so a lowering only ever has to be right, never complete.

Lowerings must compute what the op's reference kernel in `anygrad.ops` computes, up to float
rounding; tests/test_torch_backend.py checks them against the numpy backend.

Kernels run in torch's inference mode and should take as few torch calls as they can: on a GPU
each is a launch and several microseconds of host time, which bound the step at small batches.
A kernel may carry `kernel.host_inputs = {slot: fn}`: where the host holds input `slot` (a dtype
torch lacks, e.g. the uint32 RNG state), the runtime uploads fn(host value) instead of the value
(Dropout's key: three chained hashes of the state, a few host microseconds instead of ~35
launches); the kernel must accept either form. Under torch.compile `Site.memo` is None: a
kernel then keeps no tensors between calls (dynamo guards on them).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...ir.graph import Node, TensorInfo
from ...ir.passes import resolved

TorchKernel = Callable[[list[Any]], Sequence[Any]]


@dataclass(frozen=True)
class Site:
    """What a lowering may read: the node and the static infos of its inputs and outputs."""

    node: Node
    ins: list[TensorInfo | None]   # None for an absent optional input
    outs: list[TensorInfo | None]  # None for an output the graph does not use
    host_checked: frozenset[int] = frozenset()  # input slots the runtime validates on the host
    # Shared by the lowerings of one executable (None: nothing shared, e.g. under torch.compile):
    # a kernel may leave a value there for a later node's kernel, which must check by identity
    # that it was computed from the same tensor (BatchNormGrad reuses the forward's batch statistics).
    memo: dict | None = field(default=None, compare=False, repr=False)

    def attr(self, key: str, default: Any = None) -> Any:
        value = self.node.attrs.get(key, default)
        return value.decode() if isinstance(value, bytes) else value

    def resolved(self, key: str) -> Any:
        """An attribute `resolve_attributes` made explicit (ir/passes.py); a ShapeError naming the
        node when it could not (an input only known when the step runs)."""
        return resolved(self.node, key)

    def const(self, slot: int) -> np.ndarray | None:
        """The compile-time value of input `slot` (None when absent or not constant)."""
        info = self.ins[slot] if slot < len(self.ins) else None
        return None if info is None or info.const is None else np.asarray(info.const)

    def has(self, slot: int) -> bool:
        return slot < len(self.ins) and self.ins[slot] is not None

    def shape(self, slot: int) -> tuple[int, ...]:
        return tuple(int(d) for d in self.ins[slot].shape)

    def out_shape(self, slot: int = 0) -> tuple[int, ...]:
        return tuple(int(d) for d in self.outs[slot].shape)

    def dtype(self, slot: int) -> np.dtype:
        return np.dtype(self.ins[slot].dtype)


Lowering = Callable[[Site], TorchKernel | None]
LOWERINGS: dict[str, Lowering] = {}


def lowering(*ops: str) -> Callable[[Lowering], Lowering]:
    """Register a lowering for one or more ops (one registry entry per op name)."""
    def register(fn: Lowering) -> Lowering:
        for op in ops:
            if op in LOWERINGS:
                raise ValueError(f"torch lowering for {op} registered twice")
            LOWERINGS[op] = fn
        return fn
    return register


# Grouped lowerings: several nodes of one op with the same attributes and the same shared inputs
# (an optimizer's update of each parameter, all reading one learning rate and one step) run as
# one kernel over lists of tensors (torch._foreach_*: one fused launch per arithmetic op on a GPU,
# where per-node kernels cost a launch per parameter per op). The kernel takes each node's input
# list and returns each node's output list, and must compute what the per-node kernels compute.
GroupKernel = Callable[[list[list[Any]]], list[list[Any]]]
GroupLowering = Callable[[list[Site]], GroupKernel | None]
GROUP_LOWERINGS: dict[str, tuple[GroupLowering, tuple[int, ...]]] = {}


def group_lowering(*ops: str, shared: tuple[int, ...]) -> Callable[[GroupLowering], GroupLowering]:
    """Register a grouped lowering; `shared`: input slots (negative: from the end) that every node
    of a group must read from the same value (the learning rate, the step)."""
    def register(fn: GroupLowering) -> GroupLowering:
        for op in ops:
            if op in GROUP_LOWERINGS:
                raise ValueError(f"torch group lowering for {op} registered twice")
            GROUP_LOWERINGS[op] = (fn, shared)
        return fn
    return register


def norm_axis(axis: int, rank: int) -> int:
    return int(axis) + rank if int(axis) < 0 else int(axis)


def is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind == "f"


def device_constants(site: Site, arrays: Sequence[np.ndarray], floats: bool = False) -> Callable[..., list]:
    """fn(device, dtype=None) -> compile-time arrays as tensors on a kernel's device: int64 index
    arrays, or (floats) float64 values cast to `dtype`, rounded once as the reference's
    `astype(x.dtype)`. Made on first use per (device, dtype) and kept, in an eager executable;
    made in the traced function under torch.compile (Site.memo is None), which folds them into
    the graph (a tensor kept in a closure fails dynamo's guards in inference mode)."""
    import torch
    values = [np.asarray(a).tolist() for a in arrays]

    def make(device: Any, dtype: Any = None) -> list:
        if not floats:
            return [torch.tensor(v, dtype=torch.int64, device=device) for v in values]
        return [torch.tensor(v, dtype=torch.float64, device=device).to(dtype) for v in values]
    if site.memo is None:
        return make
    made: dict = {}

    def get(device: Any, dtype: Any = None) -> list:
        key = (device, dtype)
        if key not in made:
            made[key] = make(device, dtype)
        return made[key]
    return get


def add_rows(acc: Any, index: Any, rows: Any) -> Any:
    """acc[index[i]] += rows[i] (along dim 0), in place, the same bits on every run: never float
    atomics. On CUDA (and MPS) index_put_ with accumulate=True, whose kernel sorts the indices (a
    stable radix sort) and sums each row's contributions in that order -- PyTorch lists it among
    the ops deterministic without use_deterministic_algorithms, unlike index_add_ and
    scatter_add_ (atomicAdd). On the CPU the opposite holds: index_put_'s accumulation runs in
    parallel with atomics unless deterministic mode is on, while index_add_ walks the indices in
    order."""
    if acc.device.type == "cpu":
        return acc.index_add_(0, index, rows)
    return acc.index_put_((index,), rows, accumulate=True)
