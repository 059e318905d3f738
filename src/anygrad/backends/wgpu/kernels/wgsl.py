"""WGSL text helpers the kernel generators share: element types, literals, index maths, grids.

Shapes are baked into the shader text as constants, so index arithmetic is integer division and
modulo by literals, which shader compilers strength-reduce.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from ....ir.graph import Graph

WG = 256  # default workgroup size for one-thread-per-element kernels
MAX_GROUPS = 65535


def wgsl_type(dtype: np.dtype) -> str:
    """Device element type of a graph dtype: floats -> f32, signed ints -> i32, bool/unsigned -> u32."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return "f32"
    if dtype.kind == "i":
        return "i32"
    if dtype.kind in "ub":
        return "u32"
    raise TypeError(f"dtype {dtype} has no device representation")


def np_device_dtype(dtype: np.dtype) -> np.dtype:
    """Host dtype of a value's device elements: float16 stays float16 (stored as f16, halfstore.py)."""
    if np.dtype(dtype) == np.float16:
        return np.dtype(np.float16)
    return {"f32": np.dtype(np.float32), "i32": np.dtype(np.int32), "u32": np.dtype(np.uint32)}[wgsl_type(dtype)]


def vtype(graph: Graph, value: str) -> str:
    return wgsl_type(graph.info[value].dtype)


def shape_of(graph: Graph, value: str) -> tuple[int, ...]:
    return tuple(int(d) for d in graph.info[value].shape)


def size_of(graph: Graph, value: str) -> int:
    return math.prod(shape_of(graph, value))


def literal(value, ty: str) -> str:
    """A WGSL literal of type ty (inf/nan through bit patterns: WGSL has no literals for them)."""
    if ty == "f32":
        v = float(np.float32(value))
        if math.isnan(v):
            return "bitcast<f32>(0x7fc00000u)"
        if math.isinf(v):
            return "bitcast<f32>(0x7f800000u)" if v > 0 else "bitcast<f32>(0xff800000u)"
        return f"f32({_float_text(v)})"
    if ty == "i32":
        v = int(value)
        v = max(-(2 ** 31) + 1, min(2 ** 31 - 1, v))  # -2^31 is not writable as a literal
        return f"i32({v})"
    if ty == "u32":
        return f"{int(value) & 0xFFFFFFFF}u"
    raise TypeError(ty)


def _float_text(v: float) -> str:
    text = repr(float(np.float32(v)))  # shortest text that round-trips the f32 through f64
    if "e" not in text and "." not in text:
        text += ".0"
    return text


def cast(expr: str, src: str, dst: str) -> str:
    if src == dst:
        return expr
    if dst == "u32" and src == "f32":
        return f"u32(max({expr}, 0.0))"
    return f"{dst}({expr})"


def strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return out[::-1]


def broadcast_index(out_shape: Sequence[int], in_shape: Sequence[int], var: str = "i") -> str:
    """Expression for the flat index into an input broadcast (numpy rules) to out_shape: the
    input as a view of stride 0 along the axes it broadcasts."""
    in_shape = [1] * (len(out_shape) - len(in_shape)) + [int(d) for d in in_shape]
    own = strides(in_shape)
    return strided_index(out_shape, [st if d == o else 0 for d, o, st in zip(in_shape, out_shape, own)], var=var)


def strided_index(shape: Sequence[int], view_strides: Sequence[int], offset: int = 0, var: str = "i") -> str:
    """Expression for where element `var` (row-major over `shape`) lies in a strided view of a
    buffer (its strides per axis, 0 along a broadcast one; an element offset): runs of axes that
    stay evenly spaced in the view merge first, for fewer div/mod pairs."""
    dims: list[list[int]] = []   # [extent, stride], outermost first
    for d, st in zip((int(x) for x in shape), (int(x) for x in view_strides)):
        if d == 1:
            continue
        if dims and dims[-1][1] == st * d:
            dims[-1] = [dims[-1][0] * d, st]
        else:
            dims.append([d, st])
    ost = strides([e for e, _ in dims])
    terms = [f"{int(offset)}u"] if offset else []
    for j, (e, st) in enumerate(dims):
        if st == 0:
            continue
        coord = var if ost[j] == 1 else f"({var} / {ost[j]}u)"
        if j > 0:
            coord = f"({coord} % {e}u)"
        terms.append(coord if st == 1 else f"{coord} * {st}u")
    return " + ".join(terms) if terms else "0u"


def grid(threads: int, wg: int = WG) -> tuple[int, int, int]:
    """Workgroups for `threads` invocations, folded into y when x would pass the 65535 limit."""
    groups = max(1, -(-int(threads) // wg))
    if groups <= MAX_GROUPS:
        return (groups, 1, 1)
    return (MAX_GROUPS, -(-groups // MAX_GROUPS), 1)


def groups_grid(groups: int) -> tuple[int, int, int]:
    groups = max(1, int(groups))
    if groups <= MAX_GROUPS:
        return (groups, 1, 1)
    return (MAX_GROUPS, -(-groups // MAX_GROUPS), 1)


def flat_id(wg: int = WG) -> str:
    """Statement computing `i`, the flat invocation index over a (possibly 2-D) grid."""
    return f"let i = gid.x + gid.y * (nwg.x * {wg}u);"


def group_id() -> str:
    """Statement computing `g`, the flat workgroup index over a (possibly 2-D) grid."""
    return "let g = wid.x + wid.y * nwg.x;"


ENTRY_ARGS = ("@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, "
              "@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>")
# Only for devices with the `subgroup` feature (wgreduce.py): sg_id / sg_n are naga's
# subgroup_id / num_subgroups builtins (1-D workgroups only on DX12, which ours are).
SUBGROUP_ARGS = (", @builtin(subgroup_size) sg_size: u32, @builtin(subgroup_invocation_id) sg_lane: u32, "
                 "@builtin(subgroup_id) sg_id: u32, @builtin(num_subgroups) sg_n: u32")


def bindings(reads: Sequence[tuple[str, str]], writes: Sequence[tuple[str, str]]) -> str:
    """Declarations: reads (name, type) read-only from binding 0, then writes read_write."""
    lines = []
    for k, (name, ty) in enumerate(reads):
        lines.append(f"@group(0) @binding({k}) var<storage, read> {name}: array<{ty}>;")
    for k, (name, ty) in enumerate(writes):
        lines.append(f"@group(0) @binding({len(reads) + k}) var<storage, read_write> {name}: array<{ty}>;")
    return "\n".join(lines)


def shader(decls: str, body: str, wg: int = WG, helpers: str = "", shared: str = "",
           subgroups: bool = False) -> str:
    args = ENTRY_ARGS + (SUBGROUP_ARGS if subgroups else "")
    return (f"{decls}\n{shared}\n{helpers}\n@compute @workgroup_size({wg})\n"
            f"fn main({args}) {{\n{body}\n}}\n")


_WORKGROUP_VAR = re.compile(r"var<workgroup>\s*\w+\s*:\s*(.+?);")
_SCALAR_BYTES = {"f32": 4, "u32": 4, "i32": 4, "f16": 2, "bool": 4}


def _type_bytes(ty: str) -> int:
    """Bytes of a WGSL workgroup variable's type: scalars, vec2/vec4, atomics and (nested) fixed arrays."""
    ty = ty.strip()
    m = re.fullmatch(r"array<(.+),\s*(\d+)u?>", ty)
    if m:
        return _type_bytes(m.group(1)) * int(m.group(2))
    m = re.fullmatch(r"vec([24])<(\w+)>", ty)
    if m:
        return int(m.group(1)) * _SCALAR_BYTES[m.group(2)]
    m = re.fullmatch(r"atomic<(\w+)>", ty)
    return _SCALAR_BYTES[m.group(1) if m else ty]


def workgroup_bytes(wgsl: str) -> int:
    """Workgroup memory a shader declares (the sum of its `var<workgroup>` sizes). A pipeline over
    the device's limit is created without an error by wgpu-native and fails only when dispatched,
    where nothing reports it (an H200 compile waited forever), so callers check this first."""
    return sum(_type_bytes(t) for t in _WORKGROUP_VAR.findall(wgsl))
