"""Split K (kernels_gemm.py): how many K slices fill the adapter, their partial sums into a Scratch
buffer and the reduce kernel that adds them and applies the epilogue; and the dot-product variant
(one workgroup's invocations along K per output block) for thin GEMMs with a long K.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from .gemm_spec import Binding, GemmSpec, Output, Tiling, _target_invocations, fold_grid, linear_id, u
from .gemm_wgsl import _decl, _epi_fn, _loader, _store_fn
from .kernel import AdapterCaps, Kernel, Scratch


# -- split K ------------------------------------------------------------------------------------
def choose_splits(spec: GemmSpec, t: Tiling, caps: AdapterCaps, want: int | None = None) -> tuple[int, int]:
    """(splits, K per split). Split only when the output grid is small and K is long; `want`
    (a `_gemm_splits` pin) asks for that many, 1 for none."""
    tiles = math.ceil(spec.N / t.bn) * math.ceil(spec.M / t.bm) * spec.batch
    invocations = tiles * t.wx * t.wy
    step = t.kt if t.variant == "shared" else 4
    min_k = 256
    target = _target_invocations(caps)
    if want is not None:
        splits = max(1, min(int(want), spec.K // 128, 4096))  # at least 128 of K a split
    elif invocations >= target // 2 or spec.K < 2 * min_k:
        return 1, 0
    else:
        splits = min(math.ceil(target / invocations), spec.K // min_k, 4096)
    if splits <= 1:
        return 1, 0
    ksplit = math.ceil(math.ceil(spec.K / splits) / step) * step
    splits = math.ceil(spec.K / ksplit)
    # keep the scratch within one storage binding
    while splits > 1 and splits * spec.batch * spec.M * spec.N * 4 > caps.max_storage_binding_size:
        splits = max(1, splits // 2)
        ksplit = math.ceil(math.ceil(spec.K / splits) / step) * step
        splits = math.ceil(spec.K / ksplit)
    return (splits, ksplit) if splits > 1 else (1, 0)


def _reduce_wgsl(spec: GemmSpec, scratch: Binding, splits: int, caps: AdapterCaps) -> tuple[str, tuple]:
    """Sum the K-split partials and apply alpha, bias and the epilogue.

    One invocation per output sums them serially, neighbours reading neighbouring partials.
    Many splits of too few outputs to fill the GPU (tiny outputs reduced over a long K): one
    workgroup per output, a strided sum per invocation, then a tree. Its workgroup's reads are a
    partial apart, so a large output must not take it: GPT b128's head weight gradient (2048 x 256
    outputs, 64 splits) spent 5.3 ms of a 14.8 ms step there on an H200, about 0.1 ms serially."""
    M, N, B = spec.M, spec.N, spec.batch
    total = B * M * N
    wg = 64
    tree = splits >= 64 and total < _target_invocations(caps) and not caps.is_cpu
    grid = fold_grid(total if tree else math.ceil(total / wg), caps)
    reads = [scratch] + list(spec.reads[2:])
    out = spec.out
    decls = [_decl(i, b, "read") for i, b in enumerate(reads)]
    decls.append(_decl(len(reads), replace(spec.write, vec4=False), "read_write"))
    if tree:
        head = [f"var<workgroup> part: array<f32, {wg}>;",
                f"@compute @workgroup_size({wg}, 1, 1)",
                "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {",
                f"  let i = {linear_id(grid)};",
                f"  if (i >= {u(total)}) {{ return; }}",
                "  var acc = 0.0;",
                f"  for (var p = li; p < {u(splits)}; p = p + {u(wg)}) {{ acc = acc + {scratch.var}[p * {u(total)} + i]; }}",
                "  part[li] = acc;",
                "  workgroupBarrier();",
                f"  for (var h = {u(wg // 2)}; h > 0u; h = h >> 1u) {{",
                "    if (li < h) { part[li] = part[li] + part[li + h]; }",
                "    workgroupBarrier();",
                "  }",
                "  if (li != 0u) { return; }",
                "  acc = part[0];"]
    else:
        head = [f"@compute @workgroup_size({wg}, 1, 1)",
                "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {",
                f"  let i = ({linear_id(grid)}) * {u(wg)} + li;",
                f"  if (i >= {u(total)}) {{ return; }}",
                "  var acc = 0.0;",
                # in order, four loads issued before their adds (the same bits as one at a time)
                "  var p = 0u;",
                f"  for (; p + 3u < {u(splits)}; p = p + 4u) {{",
                *(f"    let v{k} = {scratch.var}[(p + {k}u) * {u(total)} + i];" for k in range(4)),
                "    acc = acc + v0; acc = acc + v1; acc = acc + v2; acc = acc + v3;",
                "  }",
                f"  for (; p < {u(splits)}; p = p + 1u) {{ acc = acc + {scratch.var}[p * {u(total)} + i]; }}"]
    lines = decls + [_epi_fn(out, True)] + head + [
        f"  let c = i % {u(N)};", f"  let r = (i / {u(N)}) % {u(M)};", f"  let bt = i / {u(M * N)};",
        "  let s = 0u;",
        f"  {out.prelude}",
        f"  {spec.write.var}[{out.index}] = epi(bt, r, c, acc);",
        "}"]
    return "\n".join(lines) + "\n", grid, tuple(b.value for b in reads)


# -- tiny outputs over a long K: dot products spread along K -------------------------------------
DOT_WG = 64           # invocations along K per workgroup
DOT_MAX_OUTPUTS = 63  # outputs per invocation (registers; 8x9 blocks were slower than 4x9 on an H200)


@dataclass(frozen=True)
class DotTiling:
    """Each workgroup owns an rb x cb block of outputs and a K range; its DOT_WG invocations
    walk that range with stride DOT_WG, each keeping the whole block in scalar registers, then
    sum through workgroup memory. Suits outputs too small to fill the GPU with output tiles
    (a conv weight gradient with one input channel: 8 x 9 outputs over K = batch x pixels)."""

    rb: int
    cb: int

    @property
    def outputs(self) -> int:
        return self.rb * self.cb


def dot_tiling(M: int, N: int, caps: AdapterCaps) -> DotTiling:
    # the reduce buffer holds DOT_WG rows of (outputs | 1) floats
    most = min(DOT_MAX_OUTPUTS, (min(caps.max_workgroup_storage, 32768) // (4 * DOT_WG) - 1) | 1)
    ncb = math.ceil(N / most)
    cb = math.ceil(N / ncb)
    rmax = max(1, most // cb)
    rb = math.ceil(M / math.ceil(M / rmax))
    return DotTiling(rb, cb)


def use_dot(spec: GemmSpec, caps: AdapterCaps) -> bool:
    """Default choice: a GPU, a tiny output (a few workgroups' worth) and a K long enough to
    spread. H200, MNIST at batch 1000: conv1's weight gradient (8x9, K = 676,000) took 170 us as
    a split-K tiled GEMM, fc2's (10x32, K = 1000) 75 us, both latency-bound chains."""
    return not caps.is_cpu and spec.M * spec.N * spec.batch <= 1024 and spec.K >= 64


def dot_splits(spec: GemmSpec, d: DotTiling, caps: AdapterCaps, want: int | None = None) -> tuple[int, int]:
    """(splits, K per split): enough workgroups to fill the adapter, 8 k or more per invocation,
    and 2 or more for a K of a few thousand (fc2's weight gradient at batch 1000: 10 blocks of 64
    invocations, 16 k each, took 25 us as one latency-bound pass); `want` (a `_gemm_splits` pin)
    asks for that many, each at least one k per invocation."""
    blocks = math.ceil(spec.M / d.rb) * math.ceil(spec.N / d.cb) * spec.batch
    per = 8 if spec.K >= 64 * DOT_WG * 8 else 2
    if want is not None:
        want = min(int(want), spec.K // DOT_WG, 4096)
    else:
        want = min(math.ceil(_target_invocations(caps) / (blocks * DOT_WG)), spec.K // (per * DOT_WG), 4096)
    splits = max(1, want)
    while splits > 1 and splits * spec.batch * spec.M * spec.N * 4 > caps.max_storage_binding_size:
        splits //= 2
    ksplit = math.ceil(spec.K / splits)
    return math.ceil(spec.K / ksplit), ksplit


def dot_wgsl(spec: GemmSpec, d: DotTiling, caps: AdapterCaps, splits: int, ksplit: int,
             out: Output | None = None, write: Binding | None = None, with_bias: bool = True) -> tuple[str, tuple, tuple]:
    out = replace(out or spec.out, contig=False)
    write = replace(write or spec.write, vec4=False)
    M, N, K = spec.M, spec.N, spec.K
    nR, nC = math.ceil(M / d.rb), math.ceil(N / d.cb)
    total = nC * nR * spec.batch * splits
    grid = fold_grid(total, caps)
    reads = [replace(spec.reads[0], vec4=False), replace(spec.reads[1], vec4=False)]
    reads += list(spec.reads[2:]) if with_bias else []
    decls = [_decl(i, b, "read") for i, b in enumerate(reads)]
    decls.append(_decl(len(reads), write, "read_write"))
    stride = d.outputs | 1              # odd: the row-wise stores hit distinct banks
    wg = DOT_WG
    # block origins as literals when there is one block along an axis (lets the compiler fold
    # the im2col arithmetic of each fixed column)
    r0 = f"(lin / {u(nC)}) % {u(nR)} * {u(d.rb)}" if nR > 1 else "0u"
    c0 = f"lin % {u(nC)} * {u(d.cb)}" if nC > 1 else "0u"
    outs = [(i, j) for i in range(d.rb) for j in range(d.cb)]
    body = [
        f"var<workgroup> red: array<f32, {wg * stride}>;",
        f"@compute @workgroup_size({wg}, 1, 1)",
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {",
        f"  let lin = {linear_id(grid)};",
        f"  if (lin >= {u(total)}) {{ return; }}",
        f"  let r0 = {r0};",
        f"  let c0 = {c0};",
        f"  let bt = (lin / {u(nC * nR)}) % {u(spec.batch)};",
        f"  let s = lin / {u(nC * nR * spec.batch)};",
        f"  let kb = s * {u(ksplit)};",
        f"  let ke = min(kb + {u(ksplit)}, {u(K)});",
    ] + [f"  var acc{i}_{j} = 0.0;" for i, j in outs] + [
        f"  for (var k = kb + li; k < ke; k = k + {u(wg)}) {{"
    ] + [f"    let a{i} = a_el(bt, r0 + {i}u, k);" for i in range(d.rb)] + [
        f"    let b{j} = b_el(bt, k, c0 + {j}u);" for j in range(d.cb)] + [
        f"    acc{i}_{j} = fma(a{i}, b{j}, acc{i}_{j});" for i, j in outs] + ["  }"] + [
        f"  red[li * {u(stride)} + {u(i * d.cb + j)}] = acc{i}_{j};" for i, j in outs] + [
        "  workgroupBarrier();",
        f"  if (li >= {u(d.outputs)}) {{ return; }}",
        "  var sum = 0.0;",
        f"  for (var t = 0u; t < {u(wg)}; t = t + 1u) {{ sum = sum + red[t * {u(stride)} + li]; }}",
        f"  st1(bt, s, r0 + li / {u(d.cb)}, c0 + li % {u(d.cb)}, sum);",
        "}"]
    helpers: dict[str, str] = {}
    loaders = [_loader("a", spec.a, False, helpers), _loader("b", spec.b, False, helpers), _epi_fn(out, with_bias, helpers)]
    wgsl = "\n".join(decls + list(helpers.values()) + loaders + [_store_fn(out, M, N)] + body) + "\n"
    return wgsl, grid, tuple(b.value for b in reads)


def dot_kernels(spec: GemmSpec, caps: AdapterCaps, want_splits: int | None = None) -> list[Kernel]:
    d = dot_tiling(spec.M, spec.N, caps)
    splits, ksplit = dot_splits(spec, d, caps, want_splits)
    tile = f"dot {d.rb}x{d.cb}"
    if splits == 1:
        wgsl, grid, reads = dot_wgsl(spec, d, caps, 1, ksplit)
        return [Kernel(f"{spec.name}[{tile}]", wgsl, grid, reads, (spec.write.value,))]
    return _split_pair(spec, caps, splits, tile,
                       lambda part, sb: dot_wgsl(spec, d, caps, splits, ksplit, out=part, write=sb,
                                                 with_bias=False))


def _split_pair(spec: GemmSpec, caps: AdapterCaps, splits: int, tile: str, partial) -> list[Kernel]:
    """A K-split kernel writing partial sums into a Scratch, and the reduce that finishes them."""
    sname = f"{spec.write.value}__splitk"
    scratch = (Scratch(sname, splits * spec.batch * spec.M * spec.N),)
    part = Output("P", f"((s * {u(spec.batch)} + bt) * {u(spec.M)} + r) * {u(spec.N)} + c",
                  contig=spec.N % 4 == 0)
    wgsl, grid, reads = partial(part, Binding(sname, "P"))
    red, rgrid, rreads = _reduce_wgsl(spec, Binding(sname, "P"), splits, caps)
    return [Kernel(f"{spec.name}[{tile} splitK {splits}]", wgsl, grid, reads, (sname,), scratch=scratch),
            Kernel(f"{spec.name}[splitK reduce]", red, rgrid, rreads, (spec.write.value,))]


_SPLIT_NAME = re.compile(r" splitK (\d+)\]$")


def split_count(kernels: list[Kernel]) -> int:
    """The K splits of a GEMM lowering (1: none), read from the name _split_pair gives its kernel."""
    for kern in kernels:
        m = _SPLIT_NAME.search(kern.name)
        if m:
            return int(m.group(1))
    return 1
