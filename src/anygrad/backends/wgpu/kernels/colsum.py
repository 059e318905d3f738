"""Column sums in two kernels: sums over rows of entries that sit next to each other in memory
(a bias gradient summing tokens, LayerNorm's dscale / dbias).

The first kernel gives each workgroup a tile of TILE neighbouring entries and a slice of the
rows, `lanes` rows side by side per entry: reads coalesce along the tile, and the lanes (not more
slices) give the GPU its parallelism. Each lane issues UNROLL rows' loads before adding them;
the lanes are combined in workgroup memory, in order, and every slice's partials are written
side by side in one scratch (several sums of one pass too, so a pass binds one scratch however
many sums it makes). The second kernel adds the slices in order, one invocation per entry:
slices stay few, so its serial loop is short (a split of the rows alone needed as many slices as
the GPU has invocations, a third kernel to add them, and one kernel per sum).

Entries are loaded as vec4 where every row's run of them splits into whole vec4s (the caller
says so). Slice counts depend only on the shape, and every sum's order is fixed: the same bits
each run.
"""
from __future__ import annotations

from dataclasses import dataclass

from .wgsl import flat_id, group_id, groups_grid, shader

WG = 256            # invocations per workgroup of the slicing kernel
TILE = 64           # neighbouring entries per workgroup (256 bytes of f32 per row)
GROUPS = 256        # slice the rows until about this many workgroups run (2^16 invocations) ...
LANE_ROWS = 4       # ... but leave each lane at least this many rows of its slice,
MAX_SLICES = 256    # and the finishing loop at most this many slices
UNROLL = 4          # rows whose loads a lane issues before adding them
FINISH_UNROLL = 8   # slices whose loads the finishing loop issues before adding them (its few
                    # invocations are latency-bound: 64 slices are 8 round trips to L2)


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


@dataclass(frozen=True)
class Geometry:
    """`rows` rows of `cols` invocation columns (`width` entries each), summed over the rows."""

    rows: int
    cols: int
    width: int
    tile: int       # columns per workgroup
    lanes: int      # rows side by side per column
    tiles: int
    slices: int
    per: int        # rows per slice

    @property
    def groups(self) -> int:
        return self.tiles * self.slices


def geometry(rows: int, entries: int, width: int = 1) -> Geometry:
    """Tiles of TILE entries (fewer when there are fewer), the rest of the workgroup as lanes."""
    cols = entries // width
    tile = min(TILE // width, _pow2_at_least(cols))
    lanes = WG // tile
    tiles = -(-cols // tile)
    slices = max(1, min(-(-GROUPS // tiles), -(-rows // (lanes * LANE_ROWS)), MAX_SLICES))
    per = -(-rows // slices)
    return Geometry(rows, cols, width, tile, lanes, tiles, -(-rows // per), per)


def vec_type(ty: str, width: int) -> str:
    return f"vec4<{ty}>" if width == 4 else ty


def splat(value: str, ty: str, width: int) -> str:
    return f"vec4<{ty}>({value})" if width == 4 else value


def slice_shader(geo: Geometry, vt: str, decls: str, loads: str, terms: list[str], op: str, init: str,
                 stores: list[str], helpers: str = "", head: str = "") -> str:
    """The slicing kernel. loads: statements loading one row (in `{q}`, the row, `{k}`, a suffix
    for the names they define, `c`, the column, and what `head` defines); terms: per sum, its
    value of the row (in `{k}`); op: "{a} + {b}" style; stores: per sum, statements storing `{v}`
    (in `slice`, `c`), run for the columns that exist. A slice's partial: its lanes in order,
    each lane its rows in order."""
    n, lanes, tile = len(terms), geo.lanes, geo.tile
    step = UNROLL * lanes

    def rows_at(k: int, q: str) -> str:
        load = loads.format(q=q, k=k)
        adds = " ".join(f"a{j} = {op.format(a=f'a{j}', b=t.format(k=k))};" for j, t in enumerate(terms))
        return f"{load} {adds}"
    unrolled = "\n      ".join(rows_at(k, f"q + {k * lanes}u") for k in range(UNROLL))
    combine = "\n".join(
        f"    var t{j} = sh{j}[lid.x];\n"
        f"    for (var l = 1u; l < {lanes}u; l += 1u) {{ t{j} = {op.format(a=f't{j}', b=f'sh{j}[lid.x + l * {tile}u]')}; }}\n"
        f"    {stores[j].format(v=f't{j}')}" for j in range(n))
    body = f"""  {group_id()}
  if (g >= {geo.groups}u) {{ return; }}
  let slice = g / {geo.tiles}u;
  let c = (g % {geo.tiles}u) * {tile}u + lid.x % {tile}u;
  let hi = min((slice + 1u) * {geo.per}u, {geo.rows}u);
{head}
{chr(10).join(f"  var a{j}: {vt} = {init};" for j in range(n))}
  if (c < {geo.cols}u) {{
    var q = slice * {geo.per}u + lid.x / {tile}u;
    for (; q + {step - lanes}u < hi; q += {step}u) {{
      {unrolled}
    }}
    for (; q < hi; q += {lanes}u) {{ {rows_at(0, "q")} }}
  }}
{chr(10).join(f"  sh{j}[lid.x] = a{j};" for j in range(n))}
  workgroupBarrier();
  if (lid.x < {tile}u && c < {geo.cols}u) {{
{combine}
  }}"""
    shared = "\n".join(f"var<workgroup> sh{j}: array<{vt}, {WG}>;" for j in range(n))
    return shader(decls, body, wg=WG, helpers=helpers, shared=shared)


def finish_body(n_sums: int, entries: int, slices: int, ty: str, op: str, init: str, stores: list[str]) -> str:
    """The finishing kernel's body: invocation i adds entry o of sum j over the slices of `P`
    ((slice, sum, entry) order: neighbouring invocations read neighbouring entries), in order,
    FINISH_UNROLL loads ahead of their adds; stores[j] stores `{v}` (in `o`)."""
    total = n_sums * entries
    load = (lambda s: f"P[{s} * {n_sums * entries}u + j * {entries}u + o]") if n_sums > 1 else (
        lambda s: f"P[{s} * {entries}u + o]")
    loads = "\n".join(f"    let v{k}: {ty} = {load(f'(s + {k}u)')};" for k in range(FINISH_UNROLL))
    adds = " ".join(f"acc = {op.format(a='acc', b=f'v{k}')};" for k in range(FINISH_UNROLL))
    if n_sums == 1:
        store = f"  {stores[0].format(v='acc')}"
    else:
        store = "\n".join(f"  {'if' if j == 0 else 'else if'} (j == {j}u) {{ {st.format(v='acc')} }}"
                          for j, st in enumerate(stores))
    return f"""  {flat_id(WG)}
  if (i >= {total}u) {{ return; }}
  let j = i / {entries}u;
  let o = i % {entries}u;
  var acc: {ty} = {init};
  var s = 0u;
  for (; s + {FINISH_UNROLL - 1}u < {slices}u; s += {FINISH_UNROLL}u) {{
{loads}
    {adds}
  }}
  for (; s < {slices}u; s += 1u) {{ acc = {op.format(a='acc', b=load('s'))}; }}
{store}"""


def slice_grid(geo: Geometry) -> tuple[int, int, int]:
    return groups_grid(geo.groups)
