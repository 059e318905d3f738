"""float16 values on the device: any kernel, stored as f16, computed in f32 (mixed precision).

Kernels are generated for f32 (`wgsl_type` maps every float dtype to f32), so a float16 value
needs no lowering of its own. After lowering, each binding that holds a float16 value (its graph
dtype) is rewritten in the shader text, the way bindpack.py rewrites packed reads:

- its declaration becomes `array<f16>` (or `array<vec4<f16>>` for a vec4-bound GEMM operand)
  and `enable f16;` goes on top;
- every read `var[e]` becomes `f32(var[e])` (`vec4<f32>(var[e])`): arithmetic and accumulation
  stay f32;
- every store `var[e] = x;` becomes `var[e] = to_f16(x);`, a compound `var[e] += x;` becomes
  `var[e] = to_f16(f32(var[e]) + (x));`, and a store into a component of a vec4 element
  `var[e][c] = x;` rounds x to f16.

Every f32 -> f16 conversion a kernel emits goes through `to_half` (functions TO_HALF, TO_HALF4,
defined once per shader by `with_conversions`). WGSL leaves the rounding of that conversion to
the implementation ("correctly rounded" allows either neighbour) and an out-of-range value
indeterminate, where PyTorch and numpy round to nearest even and overflow to inf (which
GradScaler's found-inf relies on). A float16 value held in a register (a GEMM epilogue's) is
rounded by `round_half` through packed bits, never as f32(f16(x)), which NVIDIA's compiler drops.
The plain definitions (the driver's conversion, free) are swapped for exact ones (IEEE
round-to-nearest-even in integer arithmetic on the f32 bits, ~20 ALU operations an element, no
branches) on a device whose conversions a probe found wrong (`exact_conversions`,
selftest.f16_rounding_problem).

So a matmul reads f16 operands and accumulates in f32, an elementwise chain reads and writes
f16, and the value takes half the bytes (planner.value_bytes). A binding used otherwise (a
pointer `&var[e]`, `arrayLength(&var)`, another element type) cannot be rewritten; the kernel then
reads (writes) an f32 scratch copy instead, made (stored back) by a conversion kernel beside it:
correct and general, at the cost of that copy.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ....ir.graph import Graph
from .kernel import Kernel, Scratch
from .wgsl import grid, shape_of

_DECL = re.compile(r"@group\(0\)\s*@binding\((\d+)\)\s*var<storage,\s*(read|read_write)>\s*(\w+)\s*:\s*array<([\w<>]+)>\s*;")
# device element type of an f32 binding -> (its f16 storage type, the f32 type a read converts to)
_HALF_OF = {"f32": ("f16", "f32"), "vec4<f32>": ("vec4<f16>", "vec4<f32>")}
_ASSIGN = re.compile(r"\s*([-+*/%&|^]|<<|>>)?=(?!=)")
ENABLE = "enable f16;\n"


def _bracket_end(text: str, start: int) -> int:
    """Index just past the `]` closing the `[` at text[start - 1]."""
    depth, k = 1, start
    while depth:
        c = text[k]
        depth += (c == "[") - (c == "]")
        k += 1
    return k


def _statement_end(text: str, start: int) -> int:
    """Index of the `;` ending the expression that starts at `start` (outside any brackets)."""
    depth, k = 0, start
    while True:
        c = text[k]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == ";" and depth == 0:
            return k
        k += 1


def _rewrite_accesses(text: str, var: str, store_t: str, load_t: str) -> str:
    pat = re.compile(rf"(?<![.\w]){var}\s*\[")
    out, pos = [], 0
    while True:
        m = pat.search(text, pos)
        if m is None:
            out.append(text[pos:])
            return "".join(out)
        end = _bracket_end(text, m.end())
        first = _rewrite_accesses(text[m.end():end - 1], var, store_t, load_t)
        chain = []  # further [c] after the element: a component of a vec4 element
        k = end
        while True:
            j = k
            while j < len(text) and text[j].isspace():
                j += 1
            if j < len(text) and text[j] == "[":
                e = _bracket_end(text, j + 1)
                chain.append(_rewrite_accesses(text[j + 1:e - 1], var, store_t, load_t))
                k = e
            else:
                break
        rest = "".join(f"[{c}]" for c in chain)
        out.append(text[pos:m.start()])
        assign = _ASSIGN.match(text, k)
        if assign is None:  # a read
            out.append(f"{load_t}({var}[{first}]){rest}")
            pos = k
            continue
        stop = _statement_end(text, assign.end())
        rhs = _rewrite_accesses(text[assign.end():stop], var, store_t, load_t).strip()
        target, cast_t = f"{var}[{first}]{rest}", ("f16" if chain else store_t)
        if assign.group(1):
            old = f"f32({target})" if chain else f"{load_t}({var}[{first}])"
            rhs = f"{old} {assign.group(1)} ({rhs})"
        out.append(f"{target} = {to_half(rhs, cast_t != 'f16')}")
        pos = stop


@functools.lru_cache(maxsize=512)
def rewrite_binding(wgsl: str, var: str, elem: str) -> str | None:
    """The shader with storage binding `var` (declared `array<elem>`) holding f16; None when it
    cannot be rewritten (see the module docstring). Cached: the planner lowers most nodes twice
    (fit_plan: with and without the recomputed per-element values), and this scan was 0.9 s of
    ResNet-50's 4.3 s of planning."""
    if elem not in _HALF_OF:
        return None
    uses = len(re.findall(rf"(?<![.\w]){var}\b", wgsl))
    indexed = re.findall(rf"(?<![.\w&]){var}\s*\[", wgsl)
    if uses != len(indexed) + 1 or re.search(rf"&\s*{var}\b", wgsl):
        return None
    store_t, load_t = _HALF_OF[elem]
    decl = next((m for m in _DECL.finditer(wgsl) if m.group(3) == var), None)
    if decl is None:
        return None
    body = wgsl[:decl.start()] + "\0" + wgsl[decl.end():]  # the declaration itself is no access
    body = _rewrite_accesses(body, var, store_t, load_t)
    new_decl = decl.group(0).replace(f"array<{elem}>", f"array<{store_t}>")
    return with_conversions(body.replace("\0", new_decl, 1))


def with_enable(wgsl: str) -> str:
    return wgsl if re.search(r"^\s*enable\s+f16\s*;", wgsl, re.MULTILINE) else ENABLE + wgsl


# -- f32 -> f16 conversions -------------------------------------------------------------------
TO_HALF, TO_HALF4 = "anygrad_to_f16", "anygrad_to_f16x4"
# f32 -> the nearest f16 value, kept in an f32 register (a float16 value of the graph that no
# binding stores: a GEMM epilogue's rounding). NVIDIA's Vulkan compiler drops the round trip
# f32(f16(x)), and unpack2x16float(pack2x16float(x)) as well (an H200 through wgpu-native and Dawn,
# 2026-12-02: every value came back unrounded, 131072 stayed finite, so GradScaler never saw the
# overflow). One function for it lets the probe find that and the exact definition replace it.
ROUND_HALF = "anygrad_round_f16"


def plain_round(expr: str) -> str:
    """The driver's own rounding of f32 `expr` to f16, as an f32: ROUND_HALF's plain body. NVIDIA's
    compiler drops this round trip too (H200, 2026-12-02), so the probe finds it and such a device
    gets the exact definitions."""
    return f"unpack2x16float(pack2x16float(vec2<f32>({expr}, 0.0))).x"


# parameter names no kernel uses: passes that rename a kernel's variables (merge_bindings) leave them
# Two blocks, each swapped for its exact form on its own (exact_conversions): the stores' and the
# register's. A driver may get one right and not the other, as the H200's stores and registers.
_PLAIN_STORE = (f"fn {TO_HALF}(anygrad_x: f32) -> f16 {{ return f16(anygrad_x); }}\n"
                f"fn {TO_HALF4}(anygrad_x: vec4<f32>) -> vec4<f16> {{ return vec4<f16>(anygrad_x); }}\n")
_PLAIN_ROUND = f"fn {ROUND_HALF}(anygrad_x: f32) -> f32 {{ return {plain_round('anygrad_x')}; }}\n"
_PLAIN = _PLAIN_STORE + _PLAIN_ROUND
_USES = re.compile(rf"\b({TO_HALF}|{TO_HALF4}|{ROUND_HALF})\(")


def to_half(expr: str, vec4: bool = False) -> str:
    """WGSL converting the f32 (vec4<f32>) `expr` to f16 (vec4<f16>); the shader needs
    with_conversions for the function's definition."""
    return f"{TO_HALF4 if vec4 else TO_HALF}({expr})"


def round_half(expr: str) -> str:
    """WGSL rounding the f32 `expr` to the nearest f16 value, as an f32 (ROUND_HALF); the shader
    needs with_conversions for the function's definition."""
    return f"{ROUND_HALF}({expr})"


def with_conversions(wgsl: str) -> str:
    """`enable f16;` and the (plain) conversion functions, where the shader calls them."""
    if _USES.search(wgsl) and f"fn {TO_HALF}(" not in wgsl:
        wgsl = wgsl + "\n" + _PLAIN
    return with_enable(wgsl)


def _exact_bits(t: str) -> str:
    """Statements turning `a` (|x|'s f32 bits, of u32 type t: u32 or vec4<u32>) into `h`, the bits
    of the f16 nearest to |x| (ties to even): 0x7c00 from 65520 on, NaN kept a quiet NaN.
    The bits become the f16 through unpack2x16float and an f32 -> f16 conversion of a value that
    f16 holds exactly (inf and NaN included), which no rounding mode changes (naga has no
    bitcast from u32 to vec2<f16>)."""
    def k(v: str) -> str:
        return v if t == "u32" else f"{t}({v})"
    return f"""  let e = a >> {k('23u')};
  // f16 normals (|x| >= 2^-14): the exponent rebiased (127 -> 15), 13 bits dropped, to nearest even
  let n = (a - {k('0x38000000u')} + {k('0xfffu')} + ((a >> {k('13u')}) & {k('1u')})) >> {k('13u')};
  // f16 subnormals: the 24-bit significand shifted right by 126 - exponent (at most 25: zero)
  let sh = min({k('126u')} - min(e, {k('125u')}), {k('25u')});
  let m = (a & {k('0x7fffffu')}) | {k('0x800000u')};
  let q = m >> sh;
  let rem = m & ((({k('1u')}) << sh) - {k('1u')});
  let halfway = {k('1u')} << (sh - {k('1u')});
  let up = (rem > halfway) | ((rem == halfway) & ((q & {k('1u')}) == {k('1u')}));
  var h = select(q, q + {k('1u')}, up);
  h = select(h, n, a >= {k('0x38800000u')});
  h = select(h, {k('0x7c00u')}, a >= {k('0x477ff000u')});
  h = select(h, {k('0x7e00u')} | ((a >> {k('13u')}) & {k('0x3ffu')}), a > {k('0x7f800000u')});"""


_EXACT_STORE = (f"fn {TO_HALF}(anygrad_x: f32) -> f16 {{\n  let b = bitcast<u32>(anygrad_x);\n  let a = b & 0x7fffffffu;\n"
          f"{_exact_bits('u32')}\n  return f16(unpack2x16float(h | ((b >> 16u) & 0x8000u)).x);\n}}\n"
          f"fn {TO_HALF4}(anygrad_x: vec4<f32>) -> vec4<f16> {{\n  let b = bitcast<vec4<u32>>(anygrad_x);\n"
          f"  let a = b & vec4<u32>(0x7fffffffu);\n{_exact_bits('vec4<u32>')}\n"
          "  let w = h | ((b >> vec4<u32>(16u)) & vec4<u32>(0x8000u));\n"
          "  return vec4<f16>(vec4<f32>(unpack2x16float(w.x | (w.y << 16u)), unpack2x16float(w.z | (w.w << 16u))));\n}\n")
_EXACT_ROUND = (f"fn {ROUND_HALF}(anygrad_x: f32) -> f32 {{\n  let b = bitcast<u32>(anygrad_x);\n  let a = b & 0x7fffffffu;\n"
                f"{_exact_bits('u32')}\n  return unpack2x16float(h | ((b >> 16u) & 0x8000u)).x;\n}}\n")


def plain_conversions(wgsl: str) -> bool:
    """Whether the shader has plain conversion functions (which exact_conversions replaces)."""
    return _PLAIN_STORE in wgsl or _PLAIN_ROUND in wgsl


def exact_conversions(wgsl: str, stores: bool = True, registers: bool = True) -> str:
    """The shader with its conversion functions (with_conversions) rounding to nearest even in
    integer arithmetic, whatever the driver's own f32 -> f16 conversion does: those of `stores`
    (to_half) and of `registers` (round_half)."""
    if stores:
        wgsl = wgsl.replace(_PLAIN_STORE, _EXACT_STORE)
    if registers:
        wgsl = wgsl.replace(_PLAIN_ROUND, _EXACT_ROUND)
    return wgsl


def _convert_kernel(name: str, src: str, dst: str, n: int, to_f16: bool) -> Kernel:
    src_t, dst_t = ("f32", "f16") if to_f16 else ("f16", "f32")
    wgsl = with_conversions(f"@group(0) @binding(0) var<storage, read> src: array<{src_t}>;\n"
            f"@group(0) @binding(1) var<storage, read_write> dst: array<{dst_t}>;\n"
            "@compute @workgroup_size(256)\n"
            "fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {\n"
            "  let i = gid.x + gid.y * (nwg.x * 256u);\n"
            f"  if (i >= {n}u) {{ return; }}\n"
            f"  dst[i] = {to_half('src[i]') if to_f16 else 'f32(src[i])'};\n}}\n")
    return Kernel(f"{name}:{'to_f16' if to_f16 else 'to_f32'}", wgsl, grid(n), (src,), (dst,))


def is_half(graph: Graph, name: str) -> bool:
    """A float16 graph value (stored as f16 on the device)."""
    info = graph.info.get(name)
    return info is not None and np.dtype(info.dtype) == np.float16


def stored_half(kernels: list[Kernel], graph: Graph, elements: Callable[[str], int | None] | None = None
                ) -> list[Kernel]:
    """A node's kernels as the device runs them: every binding of a float16 value of `graph`
    rewritten to f16 storage (half_kernels). The planner lowers a step through this, and the
    autotuner must time its candidates through it too: the f32 shaders it would otherwise time
    read f16-sized buffers as f32, not the kernels the step runs. `elements`: the element count of
    a value a conversion copy needs (default: its graph shape)."""
    count = elements or (lambda v: math.prod(shape_of(graph, v)))
    return [part for kern in kernels for part in half_kernels(kern, lambda v: is_half(graph, v), count)]


def half_kernels(kern: Kernel, is_half: Callable[[str], bool], elements: Callable[[str], int]) -> list[Kernel]:
    """[kern] with every float16 binding rewritten to f16 storage; a binding that cannot be is
    bound to an f32 scratch copy with a conversion kernel before (reads) or after (writes)."""
    bound = list(kern.reads) + list(kern.writes)
    halves = [k for k, v in enumerate(bound) if is_half(v)]
    if not halves:
        return [kern]
    decls = {int(m.group(1)): m for m in _DECL.finditer(kern.wgsl)}
    wgsl, before, after, scratch = kern.wgsl, [], [], list(kern.scratch)
    reads, writes = list(kern.reads), list(kern.writes)
    for k in halves:
        m, value = decls.get(k), bound[k]
        windowed = bool(kern.windows) and kern.windows[k] is not None
        rewritten = None if m is None or windowed else rewrite_binding(wgsl, m.group(3), m.group(4))
        if rewritten is not None:
            wgsl = rewritten
            continue
        n = elements(value)
        copy = f"@f32:{value}:{k}"
        scratch.append(Scratch(copy, n, "f32"))
        if k < len(reads):
            before.append(_convert_kernel(kern.name, value, copy, n, to_f16=False))
            reads[k] = copy
        else:
            after.append(_convert_kernel(kern.name, copy, value, n, to_f16=True))
            writes[k - len(reads)] = copy
    fitted = replace(kern, wgsl=wgsl, reads=tuple(reads), writes=tuple(writes), scratch=tuple(scratch),
                     inplace=tuple(v for v in kern.inplace if v in reads))
    return before + [fitted] + after


__all__ = ["TO_HALF", "TO_HALF4", "exact_conversions", "half_kernels", "plain_conversions", "rewrite_binding",
           "to_half", "with_conversions", "with_enable"]
