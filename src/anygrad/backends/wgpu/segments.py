"""Scatter-adds without float atomics, in work that grows with the data: sort the positions by
destination on the GPU, then let every destination sum its own segment.

`sorted_segments` takes q positions j (index elements, index rows) and a WGSL function
`seg_key(j) -> u32` naming each one's destination in [0, n_keys) (n_keys: dropped). It emits
a stable LSD radix sort of the positions by key, 8 bits a pass, every pass three kernels:

- hist: one workgroup per block of 256 positions counts its digits (integer atomics in
  workgroup memory: a count is the same whatever the order),
- scan: one workgroup turns the digit x block counts (digit-major) into exclusive offsets,
- scatter: each position goes to its digit's offset for its block plus its rank among the
  earlier positions of its block with the same digit (counted, not raced for),

then `bounds`: one invocation per key finds where its segment starts (a binary search in the
sorted keys). Positions stay in increasing order within a segment, so a consumer summing its
segment in order adds in the same order as a sequential scatter-add: the same bits every run.
Work: O(q) per pass (at most 4 passes for 32-bit keys) plus O(n_keys log q).
"""
from __future__ import annotations

from dataclasses import dataclass

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
    scratch = (Scratch(hist, (1 << BITS) * nb, "u32"), Scratch(starts, n_keys + 1, "u32"),
               *(Scratch(n, max(1, q), "u32") for n in keys + vals))
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
        kernels.append(_scan_kernel(name, hist, (1 << BITS) * nb, scratch))
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


def _scan_kernel(name: str, buf: str, n: int, scratch: tuple[Scratch, ...]) -> Kernel:
    """Exclusive prefix sum of n u32 in place, by one workgroup: each invocation a contiguous
    range (sum, then the workgroup's running offsets, then its range's prefix)."""
    wg = 256
    per = -(-n // wg)
    body = f"""  let lo = min(lid.x * {per}u, {n}u);
  let hi = min(lo + {per}u, {n}u);
  var s = 0u;
  for (var k = lo; k < hi; k += 1u) {{ s += h[k]; }}
  part[lid.x] = s;
  workgroupBarrier();
  if (lid.x == 0u) {{
    var run = 0u;
    for (var t = 0u; t < {wg}u; t += 1u) {{ let c = part[t]; part[t] = run; run += c; }}
  }}
  workgroupBarrier();
  var run = part[lid.x];
  for (var k = lo; k < hi; k += 1u) {{ let c = h[k]; h[k] = run; run += c; }}"""
    return Kernel(f"{name}:sort.scan", shader(bindings([], [("h", "u32")]), body, wg=wg,
                                                shared=f"var<workgroup> part: array<u32, {wg}>;"),
                  (1, 1, 1), (), (buf,), scratch=scratch)
