"""Scatter-adds without float atomics, in work that grows with the data: sort the positions by
destination on the GPU, then let every destination sum its own segment.

`sorted_segments` takes q positions j (index elements, index rows) and a WGSL function
`seg_key(j) -> u32` naming each one's destination in [0, n_keys) (n_keys: dropped). It emits
a stable LSD radix sort of the positions by key, 8 bits a pass, every pass three kernels:

- hist: one workgroup per block of 256 positions counts its digits (integer atomics in
  workgroup memory: a count is the same whatever the order),
- scan: the digit x block counts (digit-major) become exclusive offsets (one workgroup up to
  q = 16K, a workgroup per 4096 counts past it: `_scan_kernels`),
- scatter: each position goes to its digit's offset for its block plus its rank among the
  earlier positions of its block with the same digit (counted, not raced for),

then `bounds`: one invocation per key finds where its segment starts (a binary search in the
sorted keys). Positions stay in increasing order within a segment, so a consumer summing its
segment in order adds in the same order as a sequential scatter-add: the same bits every run.
Work: O(q) per pass (at most 4 passes for 32-bit keys) plus O(n_keys log q).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .kernel import Kernel, Scratch
from .wgsl import bindings, flat_id, grid, group_id, groups_grid, shader

BLOCK = 256   # positions per workgroup of the hist / scatter kernels (= their workgroup size)
BITS = 8      # key bits per pass: 256 digits (2**BITS <= BLOCK)


@dataclass(frozen=True)
class Segments:
    kernels: list[Kernel]
    order: str                 # scratch: positions j sorted by key (stable), q entries
    starts: str                # scratch: segment of key r is order[starts[r] .. starts[r + 1]), n_keys + 1 entries
    scratch: tuple[Scratch, ...]


def sorted_segments(name: str, q: int, n_keys: int, key_fn: str,
                    reads: list[tuple[str, str, str]]) -> Segments:
    """Kernels sorting positions 0..q-1 by `seg_key(j)` (key_fn defines it, reading the bindings
    `reads`: (WGSL var, type, value)). Keys outside [0, n_keys) must be returned as n_keys."""
    nb = max(1, -(-q // BLOCK))
    passes = max(1, -(-int(n_keys).bit_length() // BITS))
    hist, starts = f"seg.hist.{name}", f"seg.starts.{name}"
    keys = (f"seg.k0.{name}", f"seg.k1.{name}")
    vals = (f"seg.v0.{name}", f"seg.v1.{name}")
    n_hist = -(-((1 << BITS) * nb) // 4) * 4   # the scan reads vec4s: a pad past the counts, scanned last
    scan, scan_scratch = _scan_kernels(name, hist, n_hist)
    scratch = (Scratch(hist, n_hist, "u32"), Scratch(starts, n_keys + 1, "u32"),
               *(Scratch(n, max(1, q), "u32") for n in keys + vals), *scan_scratch)
    scan = [replace(k, scratch=scratch) for k in scan]
    user = [(v, t) for v, t, _ in reads]
    user_values = tuple(x for _, _, x in reads)
    kernels: list[Kernel] = []
    for p in range(passes):
        out = p % 2
        shift = p * BITS
        if p == 0:  # keys straight from the index data, positions are j itself
            src, src_values, load = user, user_values, "key = seg_key(j); val = j;"
            helpers = key_fn
        else:
            src = [("kin", "u32"), ("vin", "u32")]
            src_values = (keys[1 - out], vals[1 - out])
            load = "key = kin[j]; val = vin[j];"
            helpers = ""
        head = f"""  {group_id()}
  let j = g * {BLOCK}u + lid.x;
  let live = j < {q}u;
  var key = 0u; var val = 0u;
  if (live) {{ {load} }}
  let digit = select({1 << BITS}u, (key >> {shift}u) & {(1 << BITS) - 1}u, live);"""
        body = f"""{head}
  atomicStore(&cnt[lid.x], 0u);
  workgroupBarrier();
  if (live) {{ atomicAdd(&cnt[digit], 1u); }}
  workgroupBarrier();
  if (lid.x < {1 << BITS}u) {{ hist[lid.x * {nb}u + g] = atomicLoad(&cnt[lid.x]); }}"""
        kernels.append(Kernel(f"{name}:sort.hist", shader(
            bindings(src, [("hist", "u32")]), body, wg=BLOCK, helpers=helpers,
            shared=f"var<workgroup> cnt: array<atomic<u32>, {BLOCK}>;"),
            groups_grid(nb), src_values, (hist,), scratch=scratch))
        kernels += scan
        body = f"""{head}
  dig[lid.x] = digit;
  workgroupBarrier();
  if (!live) {{ return; }}
  var rank = 0u;
  for (var t = 0u; t < lid.x; t += 1u) {{ rank += select(0u, 1u, dig[t] == digit); }}
  let dest = hist[digit * {nb}u + g] + rank;
  kout[dest] = key;
  vout[dest] = val;"""
        kernels.append(Kernel(f"{name}:sort.scatter", shader(
            bindings(src + [("hist", "u32")], [("kout", "u32"), ("vout", "u32")]), body, wg=BLOCK,
            helpers=helpers, shared=f"var<workgroup> dig: array<u32, {BLOCK}>;"),
            groups_grid(nb), src_values + (hist,), (keys[out], vals[out]), scratch=scratch))
    last = (passes - 1) % 2
    body = f"""  {flat_id()}
  if (i > {n_keys}u) {{ return; }}
  var lo = 0u;
  var hi = {q}u;
  loop {{
    if (lo >= hi) {{ break; }}
    let mid = (lo + hi) / 2u;
    if (keys[mid] < i) {{ lo = mid + 1u; }} else {{ hi = mid; }}
  }}
  starts[i] = lo;"""
    kernels.append(Kernel(f"{name}:sort.bounds", shader(bindings([("keys", "u32")], [("starts", "u32")]), body),
                          grid(n_keys + 1), (keys[last],), (starts,), scratch=scratch))
    return Segments(kernels, vals[last], starts, scratch)


# The scan (sort.scan) runs once per pass over 256 x nb counts (about q of them). It used to give
# each invocation a contiguous range and walk it twice, then offset the ranges by a 256-step loop
# in one invocation: latency-bound, 43 us at q = 16K on an H200 (hist and scatter: 5-8 us). Now
# the counts are read as vec4 rows, invocation t holding vec4 t of each of ROWS rows of a tile
# (neighbours read neighbouring 16 bytes; all of a tile's loads in flight at once, the next
# tile's issued before this one is scanned); the ROWS row sums of every invocation are scanned
# together, as one vec4, in 8 log steps (Hillis-Steele) in workgroup memory; a carry takes each
# tile's total on to the next. Measured on an H200 (GPU time per pass, one pass each), one
# workgroup costs about 2.5 us + 1.5 us a tile: 10 us at q = 16K (4 tiles), 100 us at 256K. Past
# ONE_GROUP_TILES a tile per workgroup wins despite two more launches (11-13 us from 32K to 1M
# counts): per-tile totals, their exclusive scan (the same kernels, recursively), then every tile
# scanned again from its total's offset. Contiguous ranges per invocation (4 to 16 vec4s each)
# measured 10-20% slower than these rows. Integer sums: the same bits in any order.
SCAN_WG = 256          # invocations of a scan workgroup: a tile is SCAN_WG x ROWS vec4s (4096 counts)
ROWS = 4               # vec4 rows per invocation per tile: their sums are scanned as one vec4 (fixed)
ONE_GROUP_TILES = 4    # one workgroup up to this many tiles (q <= 16K at 8 bits a pass)


def _scan_kernels(name: str, buf: str, n: int, level: int = 0) -> tuple[list[Kernel], tuple[Scratch, ...]]:
    """Kernels for an exclusive prefix sum of n u32 (n a multiple of 4) in place, and the scratch
    they need beyond buf: one workgroup for up to ONE_GROUP_TILES tiles, else three levels."""
    assert n % 4 == 0, n
    n4, tile4 = n // 4, SCAN_WG * ROWS
    tiles = max(1, -(-n4 // tile4))
    if tiles <= ONE_GROUP_TILES:
        return [_scan_one_group(name, buf, n4, tiles)], ()
    part = f"seg.part{level}.{name}"
    p = -(-tiles // 4) * 4     # the totals padded to vec4s: the pad is zeroed and scanned last
    sub, sub_scratch = _scan_kernels(name, part, p, level + 1)
    return [_scan_totals(name, buf, part, n4, tiles, p), *sub, _scan_tiles(name, buf, part, n4, tiles)], \
        (Scratch(part, p, "u32"), *sub_scratch)


def _scan_helpers(n4: int, store: bool = True) -> str:
    text = f"""fn hsum(a: vec4<u32>) -> u32 {{ return a.x + a.y + a.z + a.w; }}
fn ld(i: u32) -> vec4<u32> {{
  if (i < {n4}u) {{ return h[i]; }}
  return vec4<u32>();
}}"""
    if store:
        text += f"""
fn st(i: u32, a: vec4<u32>, p: u32) {{
  if (i < {n4}u) {{ h[i] = vec4<u32>(p, p + a.x, p + a.x + a.y, p + a.x + a.y + a.z); }}
}}"""
    return text


def _loads(prefix: str, base: str, decl: str = "var") -> str:
    return "\n".join(f"  {decl} {prefix}{k} = ld({base} + {k * SCAN_WG}u + t);" for k in range(ROWS))


def _tile_scan(base: str) -> str:
    """Statements scanning the tile at vec4 `base` held in a0..a{ROWS-1}, from offset `carry`
    (then advanced by the tile's total)."""
    assert ROWS == 4  # the row sums travel as one vec4
    steps, src = [], 0
    d = 1
    while d < SCAN_WG:
        steps.append(f"  if (t >= {d}u) {{ v += sc[{src}][t - {d}u]; }}\n  sc[{1 - src}][t] = v;\n"
                     "  workgroupBarrier();")
        src, d = 1 - src, d * 2
    stores = "\n".join(f"  st({base} + {k * SCAN_WG}u + t, a{k}, ex.{'xyzw'[k]});" for k in range(ROWS))
    return f"""  let s = vec4<u32>(hsum(a0), hsum(a1), hsum(a2), hsum(a3));
  var v = s;
  sc[0][t] = v;
  workgroupBarrier();
{chr(10).join(steps)}
  let tot = sc[{src}][{SCAN_WG - 1}u];
  let ex = v - s + carry + vec4<u32>(0u, tot.x, tot.x + tot.y, tot.x + tot.y + tot.z);
{stores}
  carry += hsum(tot);"""


def _scan_shared() -> str:
    return f"var<workgroup> sc: array<array<vec4<u32>, {SCAN_WG}>, 2>;"


def _scan_one_group(name: str, buf: str, n4: int, tiles: int) -> Kernel:
    tile4 = SCAN_WG * ROWS
    if tiles == 1:
        body = f"""  let t = lid.x;
  var carry = 0u;
{_loads("a", "0u", "let")}
{_tile_scan("0u")}"""
    else:
        body = f"""  let t = lid.x;
  var carry = 0u;
{_loads("a", "0u")}
  for (var base = 0u; base < {n4}u; base += {tile4}u) {{
{_loads("b", f"base + {tile4}u", "let")}
{_tile_scan("base")}
{chr(10).join(f"  a{k} = b{k};" for k in range(ROWS))}
  workgroupBarrier();  // tot read before the next tile's first write to sc[0]
  }}"""
    return Kernel(f"{name}:sort.scan", shader(bindings([], [("h", "vec4<u32>")]), body, wg=SCAN_WG,
                                                helpers=_scan_helpers(n4), shared=_scan_shared()),
                  (1, 1, 1), (), (buf,))


def _scan_totals(name: str, buf: str, part: str, n4: int, tiles: int, p: int) -> Kernel:
    """part[g] = the total of tile g (a workgroup each), and the pad of part zeroed."""
    tile4 = SCAN_WG * ROWS
    halves = []
    d = SCAN_WG // 2
    while d:
        halves.append(f"  if (t < {d}u) {{ red[t] += red[t + {d}u]; }}\n  workgroupBarrier();")
        d //= 2
    body = f"""  {group_id()}
  if (g >= {tiles}u) {{ return; }}
  let t = lid.x;
{_loads("a", f"g * {tile4}u", "let")}
  red[t] = hsum(a0 + a1 + a2 + a3);
  workgroupBarrier();
{chr(10).join(halves)}
  if (t == 0u) {{ part[g] = red[0]; }}
  if (g == {tiles - 1}u && t < {p - tiles}u) {{ part[{tiles}u + t] = 0u; }}"""
    return Kernel(f"{name}:sort.scan.totals", shader(
        bindings([("h", "vec4<u32>")], [("part", "u32")]), body, wg=SCAN_WG, helpers=_scan_helpers(n4, store=False),
        shared=f"var<workgroup> red: array<u32, {SCAN_WG}>;"), groups_grid(tiles), (buf,), (part,))


def _scan_tiles(name: str, buf: str, part: str, n4: int, tiles: int) -> Kernel:
    """Every tile scanned from the exclusive offset of its total (a workgroup each)."""
    tile4 = SCAN_WG * ROWS
    body = f"""  {group_id()}
  if (g >= {tiles}u) {{ return; }}
  let t = lid.x;
  var carry = part[g];
{_loads("a", f"g * {tile4}u", "let")}
{_tile_scan(f"g * {tile4}u")}"""
    return Kernel(f"{name}:sort.scan.tiles", shader(bindings([("part", "u32")], [("h", "vec4<u32>")]), body,
                                                      wg=SCAN_WG, helpers=_scan_helpers(n4), shared=_scan_shared()),
                  groups_grid(tiles), (part,), (buf,))
