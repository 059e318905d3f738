"""Kernels that bind more storage buffers than the adapter allows, made to fit by packing reads.

WebGPU guarantees only 8 storage buffers per shader stage, and some adapters (Intel under Vulkan,
wgpu's fallback when it cannot map descriptor limits) give no more: a variadic Sum over many
tensors, an Einsum of many operands, a quantized GEMM with its scales and zero points, or an
unfused optimizer update with several slots would fail validation there (tinygrad #1461).

Any kernel, whatever its op, is fitted here the same way, so no lowering needs to know the limit:
the smallest read-only bindings are copied, one small copy kernel each, into one packed u32
buffer (a scratch value), and the kernel's shader is rewritten to read them from there: the
declaration of each packed binding goes, every `name[expr]` becomes
`bitcast<T>(pack[offset + (expr)])`, and the remaining bindings are renumbered. Only bindings
of 4-byte scalar elements (f32/i32/u32) that the shader uses only by indexing are packed. A
kernel whose writes alone pass the limit, or whose packed reads would pass one binding, is left
as it is: the planner's limit check then names it.

The copies cost one pass over the packed inputs, so the smallest are chosen; kernels within the
limit (every kernel on most adapters) are untouched.
"""
from __future__ import annotations

import re
from dataclasses import replace

from ..kernels.kernel import Kernel, Scratch
from ..kernels.wgsl import grid

_DECL = re.compile(r"@group\(0\)\s*@binding\((\d+)\)\s*var<storage,\s*(read|read_write)>\s*(\w+)\s*:\s*array<([\w<>]+)>\s*;")
PACK_VAR = "bp_pack"


def _uses_only_indexed(wgsl: str, var: str) -> bool:
    """Whether every use of var (besides its declaration) is `var[...]`."""
    uses = len(re.findall(rf"(?<![.\w]){var}\b", wgsl))  # not a member (`wid.y` is no use of `y`)
    indexed = len(re.findall(rf"(?<![.\w]){var}\s*\[", wgsl))
    return uses == indexed + 1


def index_rewrite(wgsl: str, var: str, load) -> str:
    """Every `var[expr]` (brackets nested in expr included) replaced by load(expr)."""
    out, pos = [], 0
    pat = re.compile(rf"(?<![.\w]){var}\s*\[")
    while True:
        m = pat.search(wgsl, pos)
        if m is None:
            out.append(wgsl[pos:])
            return "".join(out)
        depth, k = 1, m.end()
        while depth:
            c = wgsl[k]
            depth += (c == "[") - (c == "]")
            k += 1
        out.append(wgsl[pos:m.start()])
        out.append(load(wgsl[m.end():k - 1]))
        pos = k


def _rewrite_index(wgsl: str, var: str, ty: str, offset: int) -> str:
    """Every `var[expr]` -> a read of the packed buffer."""
    def load(expr: str) -> str:
        word = f"{PACK_VAR}[{offset}u + ({expr})]"
        return word if ty == "u32" else f"bitcast<{ty}>({word})"
    return index_rewrite(wgsl, var, load)


_DIRECTIVES = re.compile(r"\A(?:\s*(?:enable|requires|diagnostic)\b[^;]*;[ \t]*\n)*")


def _after_directives(wgsl: str, decl: str) -> str:
    """decl inserted after the shader's leading directives (`enable f16;`): WGSL allows no
    directive after a declaration."""
    head = _DIRECTIVES.match(wgsl).group(0)
    return head + decl + wgsl[len(head):]


def _copy_kernel(name: str, src: str, ty: str, n: int, offset: int, pack: str) -> Kernel:
    val = "src[i]" if ty == "u32" else "bitcast<u32>(src[i])"
    wgsl = (f"@group(0) @binding(0) var<storage, read> src: array<{ty}>;\n"
            f"@group(0) @binding(1) var<storage, read_write> dst: array<u32>;\n"
            "@compute @workgroup_size(256)\n"
            "fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {\n"
            "  let i = gid.x + gid.y * (nwg.x * 256u);\n"
            f"  if (i >= {n}u) {{ return; }}\n"
            f"  dst[{offset}u + i] = {val};\n}}\n")
    return Kernel(f"{name}:pack", wgsl, grid(n), (src,), (pack,))


def pack_reads(kern: Kernel, limit: int, elements, max_binding: int, tag: str) -> list[Kernel]:
    """[kern] when it binds at most `limit` buffers; else copy kernels and kern reading a packed
    buffer (scratch '@pack:<tag>'), or [kern] unchanged when packing cannot make it fit.
    elements(value) -> element count of a bound value, or None when unknown (never packed)."""
    n_bound = len(kern.reads) + len(kern.writes)
    if n_bound <= limit or len(kern.writes) >= limit:
        return [kern]
    decls = {int(m.group(1)): m for m in _DECL.finditer(kern.wgsl)}
    candidates = []
    for k, value in enumerate(kern.reads):
        m = decls.get(k)
        if (m is None or m.group(2) != "read" or m.group(4) not in ("f32", "i32", "u32")
                or value in kern.writes or (kern.windows and kern.windows[k] is not None)
                or not _uses_only_indexed(kern.wgsl, m.group(3))):
            continue
        n = elements(value)
        if n is not None:
            candidates.append((n, k))
    need = n_bound - limit + 1  # packing j reads frees j - 1 bindings
    if len(candidates) < need:
        return [kern]
    chosen = sorted(sorted(candidates)[:need], key=lambda t: t[1])
    total = sum(max(1, n) for n, _ in chosen)
    if total * 4 > max_binding:
        return [kern]
    pack = f"@pack:{tag}"
    wgsl, copies, offset = kern.wgsl, [], 0
    for n, k in chosen:
        m = decls[k]
        var, ty = m.group(3), m.group(4)
        wgsl = wgsl.replace(m.group(0), "", 1)
        wgsl = _rewrite_index(wgsl, var, ty, offset)
        if n:
            copies.append(_copy_kernel(kern.name, kern.reads[k], ty, n, offset, pack))
        offset += max(1, n)
    packed_idx = {k for _, k in chosen}
    reads = [v for k, v in enumerate(kern.reads) if k not in packed_idx] + [pack]
    # Renumber: the kept reads in order, the pack after them, then the writes.
    old_order = [k for k in range(len(kern.reads)) if k not in packed_idx]
    new_of = {old: new for new, old in enumerate(old_order)}
    n_reads = len(reads)
    for j in range(len(kern.writes)):
        new_of[len(kern.reads) + j] = n_reads + j

    def renumber(m: re.Match) -> str:
        return m.group(0).replace(f"@binding({m.group(1)})", f"@binding(@{new_of[int(m.group(1))]}@)", 1)

    wgsl = _DECL.sub(renumber, wgsl)
    wgsl = re.sub(r"@binding\(@(\d+)@\)", r"@binding(\1)", wgsl)
    pack_decl = f"@group(0) @binding({n_reads - 1}) var<storage, read> {PACK_VAR}: array<u32>;\n"
    wgsl = _after_directives(wgsl, pack_decl)
    # A packed read is a copy taken before the kernel, so it no longer shares memory with a write.
    packed_values = {kern.reads[k] for k in packed_idx}
    windows = ()
    if kern.windows:
        windows = tuple(kern.windows[k] for k in old_order) + (None,) + tuple(kern.windows[len(kern.reads):])
    fitted = replace(kern, wgsl=wgsl, reads=tuple(reads), windows=windows,
                     inplace=tuple(v for v in kern.inplace if v not in packed_values),
                     scratch=tuple(kern.scratch) + (Scratch(pack, total, "u32"),))
    return copies + [fitted]


__all__ = ["index_rewrite", "pack_reads"]
