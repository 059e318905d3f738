"""Grids past the adapter's per-dimension workgroup limit, folded into 2-D/3-D dispatches.

A lowering states the grid it means, (X, Y, Z) workgroups, whatever its size. When a dimension
passes `max-compute-workgroups-per-dimension` (65,535 on most adapters), the planner dispatches
the same X*Y*Z workgroups as a grid that fits and re-derives, per workgroup, the ids the kernel
was written for: its entry point becomes a plain function called by a new entry point that
computes the linear workgroup id, returns for the few padding workgroups of the folded grid, and
passes on `workgroup_id`, `num_workgroups` and `global_invocation_id` as the intended grid would
have them. Every kernel gets this, whatever it names its builtins; the early return is uniform
per workgroup, so kernels with barriers keep working.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

from ..kernels.kernel import Kernel

# The builtins whose values depend on the grid shape, and what the wrapper passes for them.
_DERIVED = {"workgroup_id": "fold_wid", "num_workgroups": "fold_nwg", "global_invocation_id": "fold_gid",
            "local_invocation_id": "fold_lid"}
_PARAM = re.compile(r"@builtin\(\s*(\w+)\s*\)\s*(\w+)\s*:\s*([\w<>]+)")


def folded_grid(groups: tuple[int, int, int], max_wg: int) -> tuple[int, int, int] | None:
    """A grid of <= max_wg per dimension holding X*Y*Z workgroups (padding included), or None."""
    total = math.prod(groups)
    x = min(total, max_wg)
    rest = -(-total // x)
    y = min(rest, max_wg)
    z = -(-rest // y)
    return (x, y, z) if z <= max_wg else None


def fold_kernel(kern: Kernel, max_wg: int) -> Kernel:
    """`kern` dispatched within max_wg workgroups per dimension (unchanged when it already is, or
    when even a 3-D grid cannot hold it: the planner's limit check then reports it)."""
    if max(kern.workgroups) <= max_wg:
        return kern
    grid = folded_grid(kern.workgroups, max_wg)
    if grid is None:
        return kern
    return replace(kern, wgsl=_wrap_entry(kern.wgsl, kern.entry, kern.workgroups), workgroups=grid)


def _wrap_entry(wgsl: str, entry: str, groups: tuple[int, int, int]) -> str:
    head = re.search(r"@compute\s*@workgroup_size\(([^)]*)\)\s*fn\s+" + re.escape(entry) + r"\s*\(", wgsl)
    if head is None:
        raise ValueError(f"cannot find compute entry point '{entry}' to fold its grid")
    close = wgsl.index(")", head.end())
    while wgsl.count("(", head.end(), close) > wgsl.count(")", head.end(), close):  # @builtin(...) parens
        close = wgsl.index(")", close + 1)
    params = _PARAM.findall(wgsl[head.end():close])
    size = [s.strip() for s in head.group(1).split(",") if s.strip()]
    size += ["1"] * (3 - len(size))
    X, Y, Z = (int(g) for g in groups)
    outer = ["@builtin(workgroup_id) fold_hw_wid: vec3<u32>", "@builtin(num_workgroups) fold_hw_nwg: vec3<u32>",
             "@builtin(local_invocation_id) fold_lid: vec3<u32>"]
    args = []
    for builtin, name, ty in params:
        if builtin in _DERIVED:
            args.append(_DERIVED[builtin])
        else:  # grid-independent builtins (local index, subgroup ids) pass straight through
            outer.append(f"@builtin({builtin}) fold_{name}: {ty}")
            args.append(f"fold_{name}")
    inner_sig = ", ".join(f"{name}: {ty}" for _, name, ty in params)
    body_start = wgsl.index("{", close)
    wrapper = f"""
@compute @workgroup_size({head.group(1)})
fn {entry}({', '.join(outer)}) {{
  let fold_g = fold_hw_wid.x + fold_hw_nwg.x * (fold_hw_wid.y + fold_hw_nwg.y * fold_hw_wid.z);
  if (fold_g >= {X * Y * Z}u) {{ return; }}
  let fold_wid = vec3<u32>(fold_g % {X}u, (fold_g / {X}u) % {Y}u, fold_g / {X * Y}u);
  let fold_nwg = vec3<u32>({X}u, {Y}u, {Z}u);
  let fold_gid = fold_wid * vec3<u32>(u32({size[0]}), u32({size[1]}), u32({size[2]})) + fold_lid;
  {entry}_unfolded({', '.join(args)});
}}
"""
    return (wgsl[:head.start()] + f"fn {entry}_unfolded({inner_sig}) " + wgsl[body_start:] + wrapper)
