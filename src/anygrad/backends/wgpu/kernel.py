"""The contract between op lowerings and the wgpu executor.

A lowering turns one IR node (shapes static) into one or more Kernels. A Kernel is a complete
WGSL compute shader with every shape baked in as a constant, the workgroup grid to dispatch, and
the graph values it binds: `reads` as read-only storage at bindings 0..R-1 of group 0, then
`writes` as read_write storage at bindings R..R+W-1. Buffers hold the value's elements densely in
row-major order: f32 for float tensors, i32 for int64/int32 tensors (indices, targets), u32 for
bool and uint32 tensors. Scratch buffers a kernel sequence needs between its kernels are
named values too (`Scratch`), allocated by the executor like any temporary.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...ir.graph import Graph, Node


@dataclass(frozen=True)
class Scratch:
    """A temporary buffer a lowering needs between its own kernels (not a graph value)."""

    name: str
    elements: int
    dtype: str = "f32"  # "f32" | "i32" | "u32"


@dataclass(frozen=True)
class Kernel:
    name: str                       # for profiles: op type and variant
    wgsl: str                       # complete shader source
    workgroups: tuple[int, int, int]
    reads: tuple[str, ...]          # bound read-only, in order, from binding 0
    writes: tuple[str, ...]         # bound read_write, after the reads
    entry: str = "main"
    scratch: tuple[Scratch, ...] = field(default_factory=tuple)
    # Reads that may share memory with the writes: every invocation reads them only at the very
    # elements it writes (elementwise kernels), so the executor may update state in place.
    inplace: tuple[str, ...] = ()
    # Per binding (reads, then writes): (byte offset, byte size) of the value bound, or None for all
    # of it. Set by the planner's binding split (bindsplit.py) for values larger than one binding.
    windows: tuple[tuple[int, int] | None, ...] = ()
    flops: int = 0                  # floating-point operations, where known (GEMMs): for rates and tuning

    @property
    def cache_key(self) -> tuple[str, str]:
        """Pipelines are cached by shader text: identical kernels share one pipeline."""
        return (self.wgsl, self.entry)


@dataclass(frozen=True)
class AdapterCaps:
    """What a lowering may rely on from the adapter it compiles for."""

    max_storage_buffers_per_stage: int = 8
    max_storage_binding_size: int = 128 << 20
    max_workgroup_storage: int = 16384
    max_invocations_per_workgroup: int = 256
    max_workgroups_per_dim: int = 65535
    has_subgroups: bool = False
    has_f16: bool = False
    is_cpu: bool = False                # lavapipe / software: prefer register-only variants
    memory_budget: int | None = None    # bytes one step may hold on the device (a limits profile's)
    memory_budget_set: bool = False     # the budget is the user's (--memory-budget), not the profile's
    limits_profile: str = ""            # the limits.PROFILES entry the device was created under


Lowering = Callable[[Node, Graph, AdapterCaps], list[Kernel]]
LOWERINGS: dict[str, Lowering] = {}


def lowering(*ops: str) -> Callable[[Lowering], Lowering]:
    """Register a lowering for one or more op types."""
    def deco(fn: Lowering) -> Lowering:
        for op in ops:
            if op in LOWERINGS:
                raise ValueError(f"wgpu lowering for {op} registered twice")
            LOWERINGS[op] = fn
        return fn
    return deco
