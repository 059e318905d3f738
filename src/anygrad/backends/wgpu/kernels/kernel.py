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
from dataclasses import dataclass, field, replace
from typing import Any

from ....ir.graph import Graph, Node


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
    f16_math: bool = False              # f16 products passed the self-test (selftest.py): kernels_gemm.half_math
    is_cpu: bool = False                # lavapipe / software: prefer register-only variants
    memory_budget: int | None = None    # bytes one step may hold on the device (a limits profile's)
    memory_budget_set: bool = False     # the budget is the user's (--memory-budget), not the profile's
    limits_profile: str = ""            # the limits.PROFILES entry the device was created under
    # adapters.AdapterFacts of the device (implementation, subgroup sizes, subgroup-matrix configs
    # its device enabled): matrix_units.units_of reads it; None: ALU kernels only
    adapter_facts: Any = None


Lowering = Callable[[Node, Graph, AdapterCaps], list[Kernel]]


@dataclass(frozen=True)
class OpLowering:
    """The wgpu backend's entry for one op: its kernels, and how fusion and the planner treat it."""

    fn: Lowering | None = None  # the kernels; None for an alias, which never runs one
    alias: bool = False         # the output is a view of the input's buffer (the planner binds it, no copy)
    epilogue: bool = False      # a bias and an activation after it run in its store (fusion.fuse_epilogues)
    update: bool = False        # an optimizer update (fusion.group_updates packs them into one kernel)


# The backend's one lowering registry; LOWERINGS is its kernels (op -> fn, for ops that have some).
REGISTRY: dict[str, OpLowering] = {}
LOWERINGS: dict[str, Lowering] = {}


def register(op: str, entry: OpLowering) -> None:
    """Add an op's entry; an alias entry declared first takes the op's kernels later (Identity)."""
    old = REGISTRY.get(op)
    if old is not None and (old.fn is not None or entry.fn is None):
        raise ValueError(f"wgpu lowering for {op} registered twice")
    if old is not None:  # an alias that also has a kernel (for when the planner must copy)
        entry = replace(entry, alias=True)
    REGISTRY[op] = entry
    if entry.fn is not None:
        LOWERINGS[op] = entry.fn


def lowering(*ops: str, epilogue: bool = False, update: bool = False) -> Callable[[Lowering], Lowering]:
    """Register a lowering for one or more op types, with its traits (OpLowering)."""
    def deco(fn: Lowering) -> Lowering:
        for op in ops:
            register(op, OpLowering(fn, epilogue=epilogue, update=update))
        return fn
    return deco


def ops_where(trait: str) -> frozenset[str]:
    """The registered ops with an OpLowering flag set: ops_where("alias"), ("epilogue"), ("update")."""
    return frozenset(op for op, entry in REGISTRY.items() if getattr(entry, trait))


for _op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"):
    register(_op, OpLowering(alias=True))
