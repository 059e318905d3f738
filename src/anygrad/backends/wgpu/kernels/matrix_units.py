"""Matrix units (subgroup matrices): what an adapter offers, and the tiles a GEMM uses on them.

An adapter that has matrix units lists configs: the shapes M x N x K one subgroup multiplies in
one instruction, with their operand and result types (Dawn's `subgroup_matrix_configs`: an H200
through Vulkan lists f16 -> f32 16x16x16, 16x8x16 and 16x8x8; Apple M1+ 8x8x8 f16 and f32; AMD
RDNA3 16x16x16 f16; Intel Xe2 8x16x16 f16). This module turns those facts and a GEMM's sizes into
an `MmaPlan`: which config, how many subgroups a workgroup, how many fragments each subgroup
accumulates and how deep the workgroup's K tile is. kernels_mma.py renders the plan as WGSL.

Nothing here depends on one vendor's shapes: the workgroup tile is
(subgroup rows x fragment rows x config M) by (subgroup columns x fragment columns x config N), so
an 8x8 config simply gets twice the fragments of a 16x16 one for the same tile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .kernel import AdapterCaps

# WGSL operand types by numpy dtype name; results are accumulated in f32 in every plan
OPERAND_TYPES = {"float16": "f16", "float32": "f32"}
_BYTES = {"f16": 2, "f32": 4}
# Workgroup tile rows are padded by 16 bytes: rows a power of two apart fall on one bank, and
# Vulkan's cooperative-matrix loads want 16-byte aligned rows (the staged probe's +8 halves)
PAD_BYTES = 16
MIN_FLOPS_BY_DEFAULT = 1 << 22   # the rules pick matrix units from this much work on (else ALUs)


@dataclass(frozen=True)
class MatrixConfig:
    """One shape the adapter's subgroups multiply: (m x k) times (k x n) into (m x n)."""

    m: int
    n: int
    k: int
    operand: str = "f16"   # WGSL type of the left and right matrices
    result: str = "f32"    # WGSL type of the accumulator

    @property
    def label(self) -> str:
        return f"{self.m}x{self.n}x{self.k} {self.operand}->{self.result}"


@dataclass(frozen=True)
class MatrixUnits:
    """What the kernels need to know of an adapter's matrix units."""

    configs: tuple[MatrixConfig, ...]
    subgroup_size: int = 32      # the adapter's largest subgroup: pipelines with matrices run at it
    subgroup_id: bool = True     # @builtin(subgroup_id) offered: several subgroups per workgroup
    has_f16: bool = True


def _config_of(c: Any) -> MatrixConfig | None:
    """A MatrixConfig from adapters.MatrixConfig (M, N, K, operand_dtype, result_dtype), Dawn's
    raw dict (m, n, k, component_type, result_component_type) or a MatrixConfig."""
    if isinstance(c, MatrixConfig):
        return c

    def get(*names: str) -> Any:
        for name in names:
            if isinstance(c, dict) and name in c:
                return c[name]
            if not isinstance(c, dict) and hasattr(c, name):
                return getattr(c, name)
        return None
    m, n, k = get("M", "m"), get("N", "n"), get("K", "k")
    operand = str(get("operand_dtype", "component_type") or "").lower().split(".")[-1]
    result = str(get("result_dtype", "result_component_type") or "").lower().split(".")[-1]
    if m is None or n is None or k is None:
        return None
    return MatrixConfig(int(m), int(n), int(k), operand, result)


def units_of(caps: AdapterCaps) -> MatrixUnits | None:
    """The matrix units of the adapter a lowering compiles for (caps.adapter_facts: an
    adapters.AdapterFacts, or a MatrixUnits in tests), None where it has none."""
    got = getattr(caps, "adapter_facts", None)
    if got is None:
        return None
    if isinstance(got, MatrixUnits):
        return got if got.configs else None
    configs = tuple(c for c in map(_config_of, getattr(got, "matrix_configs", ()) or ()) if c is not None)
    if not configs:
        return None
    # pipelines that use subgroup matrices run at the adapter's largest subgroup size
    size = max(tuple(getattr(got, "subgroup_sizes", ()) or ()) + (0,))
    size = size or max((int(getattr(c, "max_subgroup_size", 0) or 0) for c in got.matrix_configs), default=0) or 32
    return MatrixUnits(configs, int(size), bool(getattr(got, "has_subgroups", False)),
                       bool(getattr(got, "has_f16", False)))


def usable_configs(units: MatrixUnits, operand: str) -> list[MatrixConfig]:
    """The configs for `operand` (f16 | f32) operands with f32 results, most work per instruction
    first (16x16x16 before 16x8x16 before 16x8x8), f16 ones only where the adapter has f16."""
    if operand == "f16" and not units.has_f16:
        return []
    ok = [c for c in units.configs if c.operand == operand and c.result == "f32"]
    return sorted(ok, key=lambda c: (-c.m * c.n * c.k, -c.k, -c.n))


@dataclass(frozen=True)
class MmaPlan:
    """One workgroup's tiles for a subgroup-matrix GEMM."""

    config: MatrixConfig
    sg_rows: int          # subgroups along M
    sg_cols: int          # subgroups along N
    frag_rows: int        # result fragments per subgroup along M
    frag_cols: int        # ... along N
    bk: int               # K tile staged in workgroup memory (a multiple of config.k)
    subgroup_size: int
    by_subgroup_id: bool  # subgroups told apart by @builtin(subgroup_id) (else one per workgroup)
    prefetch: bool = False  # the next K tile read into registers while this one is multiplied
    # two workgroup tiles: the next K tile is stored into one while the other is multiplied, so a
    # K tile needs one barrier instead of two (twice the staged bytes)
    double: bool = False
    # each workgroup tile laid out along the axis its copy's neighbouring invocations walk, so
    # those invocations store to neighbouring addresses: A as (k, m) where they walk M (A stored
    # transposed: a weight gradient's x.T), B as (n, k) where they walk K (x @ W.T's W, a weight
    # gradient's im2col by tap); the matrix loads then read the tile column-major
    a_kmajor: bool = False
    b_nmajor: bool = False

    @property
    def subgroups(self) -> int:
        return self.sg_rows * self.sg_cols

    @property
    def threads(self) -> int:
        return self.subgroups * self.subgroup_size

    @property
    def sub_m(self) -> int:   # rows of one subgroup's block
        return self.frag_rows * self.config.m

    @property
    def sub_n(self) -> int:
        return self.frag_cols * self.config.n

    @property
    def bm(self) -> int:
        return self.sg_rows * self.sub_m

    @property
    def bn(self) -> int:
        return self.sg_cols * self.sub_n

    @property
    def elem_bytes(self) -> int:
        return _BYTES[self.config.operand]

    @property
    def pad(self) -> int:     # elements appended to each staged row
        return PAD_BYTES // self.elem_bytes

    @property
    def stride_a(self) -> int:   # A's tile: bm rows of bk (+ pad), or bk rows of bm (a_kmajor)
        return (self.bm if self.a_kmajor else self.bk) + self.pad

    @property
    def stride_b(self) -> int:   # B's tile: bk rows of bn (+ pad), or bn rows of bk (b_nmajor)
        return (self.bk if self.b_nmajor else self.bn) + self.pad

    def a_at(self, m: str, k: str) -> str:
        """Index of A's element (m, k) in its workgroup tile (WGSL expressions in, out)."""
        return f"({k}) * {self.stride_a}u + {m}" if self.a_kmajor else f"({m}) * {self.stride_a}u + {k}"

    def b_at(self, k: str, n: str) -> str:
        return f"({n}) * {self.stride_b}u + {k}" if self.b_nmajor else f"({k}) * {self.stride_b}u + {n}"

    @property
    def stride_c(self) -> int:   # one subgroup's result fragment, f32 rows (+ 16 bytes)
        return self.config.n + PAD_BYTES // 4

    @property
    def tile_a(self) -> int:     # elements of one staged A tile
        return (self.bk if self.a_kmajor else self.bm) * self.stride_a

    @property
    def tile_b(self) -> int:
        return (self.bn if self.b_nmajor else self.bk) * self.stride_b

    @property
    def buffers(self) -> int:
        return 2 if self.double else 1

    def workgroup_bytes(self) -> int:
        staged = self.buffers * (self.tile_a + self.tile_b) * self.elem_bytes
        return staged + self.subgroups * self.config.m * self.stride_c * 4

    @property
    def tag(self) -> str:
        """The kernel-name tag: tile, K tile, subgroups and config."""
        c = self.config
        return (f"mma {self.bm}x{self.bn}k{self.bk}{'p' if self.prefetch else ''}{'d' if self.double else ''}"
                f" sg{self.subgroups} {c.m}x{c.n}x{c.k}"
                + ("" if c.operand == "f16" else f" {c.operand}"))


# The rules' double tiles (MmaPlan.double): for plans of this many subgroups, two K tiles this
# deep. H200, 4096^3 f16 on 128 x 256 tiles: 178 TFLOP/s, against 165 with one 16-deep tile and
# 147 with one 32-deep; on 4 subgroups (128 x 128) double tiles were slower (71 against 118)
RULE_DOUBLE_SUBGROUPS, RULE_DOUBLE_BK = 8, 16

# subgroups a workgroup -> (along M, along N)
_GRIDS = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (2, 4)}


def plan_mma(M: int, N: int, K: int, caps: AdapterCaps, operand: str, units: MatrixUnits | None = None,
             block: int | None = None, bk: int | None = None, threads: int | None = None,
             config: MatrixConfig | None = None, prefetch: bool = False, double: bool | None = False) -> MmaPlan:
    """The tiles for an M x N x K GEMM with `operand` (f16 | f32) operands on these matrix
    units (default: the adapter's). ValueError where there are none for that operand type, or
    the tiles cannot fit the workgroup (the autotuner then skips the candidate, the rules take
    the ALU kernels).

    block: the larger side of each subgroup's fragment grid (default 4 for large GEMMs: 64 x 64
    outputs a subgroup on 16x16 configs, 8 of them on 8x8 ones); threads: invocations a
    workgroup (default 4 subgroups); bk: the K tile (default 32 elements, two 16-deep steps);
    prefetch: the next K tile read into registers during this one's multiplies; double: two
    workgroup tiles (MmaPlan.double), where they fit without a shallower K tile; None: the rule
    (RULE_DOUBLE_SUBGROUPS)."""
    units = units or units_of(caps)
    if units is None:
        raise ValueError("this adapter has no matrix units")
    configs = [config] if config is not None else usable_configs(units, operand)
    if not configs:
        raise ValueError(f"this adapter's matrix units take no {operand} operands with f32 results")
    cfg = configs[0]
    size = units.subgroup_size
    # 8 subgroups (128 x 256 tiles of 16x16 fragments) where the GEMM is large: H200, 4096^3 f16
    # 125 TFLOP/s against 103 on 4 (128 x 128)
    default = 8 if M >= 256 and N >= 256 and 8 * size <= caps.max_invocations_per_workgroup else 4
    want_sg = max(1, (threads or default * size) // size) if units.subgroup_id else 1
    if want_sg not in _GRIDS or (threads is not None and threads % size):
        raise ValueError(f"{threads} invocations are not 1, 2, 4 or 8 subgroups of {size}")
    sg_rows, sg_cols = _GRIDS[want_sg]
    # fragments: about 64 outputs a subgroup side (16x16: 4 fragments; 8x8: 8), fewer for a
    # small M or N, where a big tile would be mostly padding
    side = block or 4
    fr = max(1, side * 16 // cfg.m) if block is None else side
    fc = max(1, side * 16 // cfg.n) if block is None else side
    while fr > 1 and sg_rows * (fr // 2) * cfg.m >= M:
        fr //= 2
    while fc > 1 and sg_cols * (fc // 2) * cfg.n >= N:
        fc //= 2
    while sg_rows > 1 and (sg_rows // 2) * fr * cfg.m >= M:
        sg_rows //= 2
    while sg_cols > 1 and (sg_cols // 2) * fc * cfg.n >= N:
        sg_cols //= 2
    depth = bk or max(32, cfg.k)
    if depth % cfg.k:
        raise ValueError(f"K tile {depth} is no multiple of the config's K ({cfg.k})")
    def fitted(sg_rows: int, sg_cols: int, fr: int, fc: int) -> MmaPlan:
        plan = MmaPlan(cfg, sg_rows, sg_cols, fr, fc, depth, size, units.subgroup_id and sg_rows * sg_cols > 1,
                       prefetch)
        while plan.workgroup_bytes() > caps.max_workgroup_storage and plan.bk > cfg.k and bk is None:
            plan = replace(plan, bk=plan.bk // 2)
        return plan
    plan = fitted(sg_rows, sg_cols, fr, fc)
    # over the workgroup storage (16 KiB adapters): fewer subgroups, then fewer fragments, unpinned
    while plan.workgroup_bytes() > caps.max_workgroup_storage:
        if threads is None and sg_rows * sg_cols > 1:
            sg_rows, sg_cols = (sg_rows, sg_cols // 2) if sg_cols >= sg_rows else (sg_rows // 2, sg_cols)
        elif block is None and max(fr, fc) > 1:
            fr, fc = (fr, fc // 2) if fc >= fr else (fr // 2, fc)
        else:
            break
        plan = fitted(sg_rows, sg_cols, fr, fc)
    if plan.workgroup_bytes() > caps.max_workgroup_storage:
        raise ValueError(f"{plan.tag}: {plan.workgroup_bytes()} bytes of tiles exceed the adapter's "
                         f"{caps.max_workgroup_storage} of workgroup storage")
    if plan.threads > caps.max_invocations_per_workgroup:
        raise ValueError(f"{plan.tag}: {plan.threads} invocations exceed the adapter's workgroup size")
    if double is None:  # the rule: the widest tiles, with prefetch, get two shallow tiles where they fit
        shallow = replace(plan, bk=max(RULE_DOUBLE_BK, cfg.k), double=True)
        use = (prefetch and bk is None and plan.subgroups == RULE_DOUBLE_SUBGROUPS
               and shallow.workgroup_bytes() <= caps.max_workgroup_storage)
        return shallow if use else plan
    if double:  # the same tiles twice, or not at all (a smaller tile is another candidate's plan)
        plan = replace(plan, double=True)
        if plan.workgroup_bytes() > caps.max_workgroup_storage:
            raise ValueError(f"{plan.tag}: two tiles take {plan.workgroup_bytes()} bytes, over the adapter's "
                             f"{caps.max_workgroup_storage} of workgroup storage")
    return plan


def by_default(M: int, N: int, K: int, batch: int, caps: AdapterCaps, operand: str | None) -> bool:
    """Whether the rules (no autotuning, no pin) put this GEMM on matrix units: operands of a
    type a config takes, and enough work that the tiles are not mostly padding."""
    units = units_of(caps)
    if units is None or operand is None or not usable_configs(units, operand):
        return False
    cfg = usable_configs(units, operand)[0]
    return (M >= cfg.m and N >= cfg.n and K >= 2 * cfg.k
            and 2 * M * N * K * batch >= MIN_FLOPS_BY_DEFAULT and math.ceil(K / cfg.k) >= 2)


__all__ = ["MatrixConfig", "MatrixUnits", "MmaPlan", "by_default", "plan_mma", "units_of", "usable_configs"]
