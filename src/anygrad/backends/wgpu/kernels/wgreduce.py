"""Combining one value per invocation over a whole workgroup: the step every workgroup
reduction shares (ReduceSum & co., softmax rows, BatchNorm statistics, norm rows, loss sums).

With the adapter's `subgroup` feature each subgroup combines its values with one subgroup op
(subgroupAdd/Max/Min/Mul), its first lane writes the result to workgroup memory, and every
subgroup then combines those few slots the same way: one barrier between the stages instead
of one per tree level (log2(wg)). Subgroup sizes differ (8 on lavapipe, 32 on NVIDIA, 64 on AMD, varying on Intel), so
nothing assumes one: slots are indexed by the `subgroup_id` builtin and the second stage strides
by `subgroup_size`. Without the feature (or for a combine with no subgroup op) it is a tree in
workgroup memory. Either way every invocation holds the results afterwards and the workgroup
arrays may be reused. Call it in workgroup-uniform control flow (barriers and subgroup ops).

naga in wgpu-native 29 rejects `enable subgroups;` (gfx-rs/wgpu#7474, #8202): the builtins work
without the directive once the device has the feature, so none is emitted.

A segmented combine (`seg`: each run of `seg` consecutive invocations combines only its own
values, several rows a workgroup) is always the tree: a subgroup op would mix segments whenever
the subgroup is wider than one, and the subgroup size is known only when the shader runs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .... import settings
from .kernel import AdapterCaps

# combine ("{a} op {b}", as the kernels write it) -> the subgroup op computing it
SUBGROUP_OPS = {
    "{a} + {b}": "subgroupAdd",
    "max({a}, {b})": "subgroupMax",
    "min({a}, {b})": "subgroupMin",
    "{a} * {b}": "subgroupMul",
}


@dataclass(frozen=True)
class Part:
    """One value to combine: `value` (a WGSL expression per invocation) becomes `let result`."""

    value: str
    result: str
    op: str = "{a} + {b}"
    init: str = "0.0"
    ty: str = "f32"


def use_subgroups(caps: AdapterCaps) -> bool:
    """Subgroup ops for this adapter; ANYGRAD_WGPU_SUBGROUPS=0 turns them off (a driver whose
    subgroup ops misbehave, or comparing both paths)."""
    return caps.has_subgroups and settings.get("ANYGRAD_WGPU_SUBGROUPS")


def shared_decl(parts: Sequence[Part], wg: int, sh: str = "sh") -> str:
    """Module-scope workgroup arrays for `reduce_code(parts, wg, ..., sh)`: `{sh}{j}` per part."""
    return "\n".join(f"var<workgroup> {sh}{j}: array<{p.ty}, {wg}>;" for j, p in enumerate(parts))


def reduce_code(parts: Sequence[Part], wg: int, subgroups: bool, sh: str = "sh", seg: int = 0) -> str:
    """Statements combining each part over the workgroup of `wg` invocations (lid.x < wg), or,
    with `seg` (a power of two dividing wg), over each run of `seg` consecutive invocations.
    `subgroups`: the shader is built with the subgroup builtins (shader(..., subgroups=True))."""
    if seg and seg < wg:
        return _tree_code(parts, wg, sh, seg)
    if subgroups and all(p.op in SUBGROUP_OPS for p in parts):
        return _subgroup_code(parts, sh)
    return _tree_code(parts, wg, sh)


def _combine(p: Part, a: str, b: str) -> str:
    return p.op.format(a=a, b=b)


def _tree_code(parts: Sequence[Part], wg: int, sh: str, seg: int = 0) -> str:
    """Halving steps, each a barrier: invocation j adds j + wr_t's slot while j < wr_t (within
    its segment when seg), a fixed order; the total is in the (segment's) first slot."""
    seg = seg or wg
    arr = [f"{sh}{j}" for j in range(len(parts))]
    step = " ".join(f"{s}[lid.x] = {_combine(p, f'{s}[lid.x]', f'{s}[lid.x + wr_t]')};"
                    for p, s in zip(parts, arr))
    active, first = ("lid.x", "0") if seg == wg else (f"lid.x % {seg}u", f"lid.x - lid.x % {seg}u")
    lines = [f"  {s}[lid.x] = {p.value};" for p, s in zip(parts, arr)]
    lines += ["  workgroupBarrier();",
              f"  for (var wr_t = {seg // 2}u; wr_t > 0u; wr_t = wr_t >> 1u) {{",
              f"    if ({active} < wr_t) {{ {step} }}",
              "    workgroupBarrier();", "  }"]
    lines += [f"  let {p.result} = {s}[{first}];" for p, s in zip(parts, arr)]
    lines.append("  workgroupBarrier();")  # everyone has read: the arrays may be reused
    return "\n".join(lines)


def _subgroup_code(parts: Sequence[Part], sh: str) -> str:
    arr = [f"{sh}{j}" for j in range(len(parts))]
    lines = [f"  let {p.result}_sg = {SUBGROUP_OPS[p.op]}({p.value});" for p in parts]
    put = " ".join(f"{s}[sg_id] = {p.result}_sg;" for p, s in zip(parts, arr))
    lines.append(f"  if (sg_lane == 0u) {{ {put} }}")
    lines.append("  workgroupBarrier();")
    # Every subgroup combines the sg_n slots (few: wg / subgroup size) itself, so every
    # invocation ends with the totals without a broadcast; the loop bound is uniform.
    add = " ".join(f"{p.result}_acc = {_combine(p, f'{p.result}_acc', f'{s}[wr_j]')};"
                   for p, s in zip(parts, arr))
    lines += [f"  var {p.result}_acc: {p.ty} = {p.init};" for p in parts]
    lines += ["  for (var wr_t = 0u; wr_t < sg_n; wr_t += sg_size) {",
              "    let wr_j = wr_t + sg_lane;",
              f"    if (wr_j < sg_n) {{ {add} }}",
              "  }"]
    lines += [f"  let {p.result} = {SUBGROUP_OPS[p.op]}({p.result}_acc);" for p in parts]
    lines.append("  workgroupBarrier();")  # everyone has read: the arrays may be reused
    return "\n".join(lines)
