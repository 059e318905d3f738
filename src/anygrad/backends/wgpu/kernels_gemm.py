"""Register-blocked GEMM kernels (WGSL) and the MatMul / Gemm lowerings.

Every GEMM-shaped op (MatMul, Gemm, and the convolutions as implicit GEMM in kernels_conv.py) is
described by a `GemmSpec`: the sizes M x N x K over `batch` independent problems, how to fetch an
element of A (M x K) and of B (K x N) from the bound buffers (`Operand`: a WGSL index expression, so
im2col indexing lives inside the tile loads), and where each result goes (`Output`: index, bias,
alpha, epilogue). `gemm_kernels` turns a spec into shaders in one of two variants:

- "register": no workgroup memory, no barriers. Each invocation computes a TM x TN block of outputs
  in vec4 registers straight from global memory, four k at a time, with vec4 loads where the operand
  is contiguous along the loaded axis. Best on CPU adapters (lavapipe), where barriers are expensive.
- "shared":  the workgroup stages a BM x KT tile of A and a KT x BN tile of B in workgroup memory
  (coalesced loads), then every invocation does the same register-blocked update from there. Best
  on real GPUs.

When the output grid is too small to fill the device and K is long (the weight gradient of a conv,
reduced over batch x pixels), K is split: the GEMM writes partial sums into a Scratch buffer and a
small reduce kernel adds them and applies the epilogue.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from ... import settings
from ...errors import ShapeError
from ...ir.graph import Graph, Node
from . import matrix_units
from .halfstore import to_half, with_conversions
from .kernel import AdapterCaps, Kernel, Scratch, lowering
from .kernels_elementwise import EW, Emit, Val
from .wgsl import literal, vtype

EPILOGUES = {None: "y", "relu": "max(y, 0.0)"}
# Activations a MatMul/Gemm applies in its epilogue (attrs `_epilogue` = the op, `_epilogue_attrs`),
# evaluated by the op's elementwise table row; Relu keeps the short `"relu"` key the convs share.
EPILOGUE_ACTIVATIONS = frozenset({"Gelu", "Sigmoid", "Tanh", "LeakyRelu", "Elu", "Selu", "Celu", "Softplus",
                                  "Softsign", "HardSigmoid", "HardSwish", "Mish"})
# Activation gradients (dy, x) -> dx that a GEMM computing dy applies in its epilogue, reading x at
# the result's own index (attr `_epilogue_arg`, input 3): an MLP's input gradient through its
# activation, without storing dy and reading it back (fusion.fuse_epilogues).
EPILOGUE_GRADS = frozenset({"GeluGrad", "ReluGrad", "LeakyReluGrad", "EluGrad"})


# -- WGSL literal helpers -------------------------------------------------------------------------
def u(x: int) -> str:
    return f"{int(x)}u"


def f(x: float) -> str:
    s = format(float(x), ".9g")
    return s if any(ch in s for ch in ".en") else s + ".0"


# -- the spec ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Binding:
    value: str          # graph value (or Scratch) name
    var: str            # WGSL variable name
    vec4: bool = False  # bound as array<vec4<f32>> (operand loaded four elements at a time)
    elem: str = "f32"   # WGSL element type otherwise (a fused Where's condition: u32)


@dataclass(frozen=True)
class Operand:
    """Element (r, c) of problem `bt` of a logical rows x cols matrix.

    prelude: WGSL statements (may use bt, r, c) that define helpers for `valid` and `index`;
    valid:   extra condition (implicit-GEMM padding), "" when every in-range element exists;
    index:   flat element index into `var`;
    contig:  0 or 1 when four consecutive elements along that axis are consecutive in memory and
             the start is 4-aligned whenever that coordinate is (the extent along it is a multiple
             of 4): then they load as one vec4. None otherwise.
    fast:    0 or 1: the axis along which neighbouring elements mostly lie next to each other in
             memory (an im2col gather along pixels), so scalar tile loads walk it first; None:
             contig's axis, else the operand's own default (see _shared_body).
    hoist:   the part of the prelude that depends on c alone (an im2col column's pixel decode).
             Where a B tile copy keeps each invocation on one column for the whole K loop, it
             runs once before the loop instead of for every element (_stages).
    """

    var: str
    rows: int
    cols: int
    index: str
    prelude: str = ""
    valid: str = ""
    contig: int | None = None
    fast: int | None = None
    hoist: str = ""                   # statements of the prelude that use only c (they run first)
    hoisted: tuple[str, ...] = ()     # the u32 names those statements define
    apply: tuple = ()                 # (op, sorted attrs) of an activation applied to each element loaded
    apply_half: bool = False          # that activation's result rounded to f16 (the graph holds it in float16)

    @property
    def full_prelude(self) -> str:
        return f"{self.hoist} {self.prelude}".strip()


@dataclass(frozen=True)
class Output:
    """Where result (r, c) of problem `bt` goes (index may also use `s`, the K-split number)."""

    var: str
    index: str
    prelude: str = ""
    contig: bool = False     # c..c+3 consecutive for c % 4 == 0 (requires N % 4 == 0)
    alpha: float = 1.0
    bias: str = ""           # WGSL f32 expression of (bt, r, c) added after alpha
    residual: str = ""       # WGSL f32 expression of (bt, r, c) added after the bias (a skip connection)
    epilogue: str | None = None   # a key of EPILOGUES, or an op of EPILOGUE_ACTIVATIONS or EPILOGUE_GRADS
    epilogue_attrs: tuple = ()    # that op's attributes, as sorted (name, value) pairs
    operand: str = ""             # an EPILOGUE_GRADS op's second input x, a WGSL f32 expression of (bt, r, c)
    mask: str = ""                # a fused Where (masked_fill), last: where this WGSL bool of (bt, r, c)
    fill: str = ""                # holds, the result is this f32 expression instead
    # Steps of the epilogue ("gemm", "bias", "residual", "epilogue") whose result the graph holds in
    # float16: rounded to f16 there, as the separate kernels would store it (fusion.fuse_epilogues)
    rounds: frozenset = frozenset()


@dataclass(frozen=True)
class GemmSpec:
    name: str
    M: int
    N: int
    K: int
    batch: int
    a: Operand
    b: Operand
    out: Output
    reads: tuple[Binding, ...]      # A, B, bias buffers..., in binding order
    write: Binding


@dataclass(frozen=True)
class Tiling:
    variant: str   # "register" | "shared"
    wx: int        # invocations along N
    wy: int        # invocations along M
    tm: int        # outputs per invocation along M
    tn: int        # outputs per invocation along N (multiple of 4)
    kt: int = 4    # K tile staged in workgroup memory (shared variant); multiple of 4
    prefetch: bool = False  # shared variant: next K tile loaded into registers during this one's FMAs
    # shared variant: a scalar copy that walks K fastest stores into rows of the tile a whole row
    # apart, which fall on one bank; XOR-permuting each row's vec4s spreads them (_sw)
    swizzle: bool = True
    hoist: bool = True      # shared variant: an operand's hoistable prelude runs before the K loop
    # shared variant, K-tile loop kept rolled (prefetched, unsplit): K steps per pass of that loop.
    # 2 sped up some GPT-2 GEMMs and slowed others (H200: fc forward 0.373 -> 0.285 ms, LM head
    # forward 4.78 -> 5.63 ms): a choice for the autotuner, not a rule
    unroll: int = 1
    # shared variant, prefetched: two workgroup tiles, the next K tile stored into one while the
    # other is multiplied, so one barrier a K tile instead of two (twice the workgroup memory)
    double: bool = False
    # shared variant, float16 operands: tiles held as f16 and each K tile's products summed in f16,
    # then added into the f32 accumulators (half_math)
    half: bool = False

    @property
    def bm(self) -> int:
        return self.wy * self.tm

    @property
    def bn(self) -> int:
        return self.wx * self.tn


def _thin_and_wide(M: int, N: int, K: int, caps: AdapterCaps) -> bool:
    """A few rows (<= 8) over very many columns, e.g. the input gradient of a conv with 8 input
    channels at batch 1000: 8x8 register blocks with no workgroup memory beat staged 8x128 tiles
    (H200, MNIST conv2 dX: 311 vs 563 us), but only once the 8-wide blocks alone fill the GPU
    (at batch 64 the same tiling is 1.7x slower: too few invocations)."""
    return (not caps.is_cpu and M <= 8 and K > 32
            and math.ceil(N / 8) >= _target_invocations(caps) // 4)


def _fit(blocks: int, width: int) -> int:
    """Invocations per workgroup along an axis of `blocks` blocks: at most `width`, as many tiles."""
    return math.ceil(blocks / math.ceil(blocks / width))


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


LONG_K = 4096  # from this K on, 128x128 tiles for any M, N >= 128 (split-K fills the GPU)


def choose_tiling(M: int, N: int, K: int, caps: AdapterCaps, variant: str | None = None,
                  block: int | None = None, kt: int | None = None, batch: int = 1,
                  split: bool = True, threads: int | None = None, block_n: int | None = None) -> Tiling:
    """Tile shapes by adapter kind and problem size (small M, e.g. 16 conv channels, gets short tiles).

    block: outputs per invocation along each axis (4 or 8); by default 8 only for big shared GEMMs."""
    # Workgroup tiles pay off on GPUs, except for very short K or a sliver of M, where staging
    # mostly zero padding costs more than it saves (H200: first MNIST conv 3.5 vs 1.2 TFLOP/s)
    if variant is None and block is None and _thin_and_wide(M, N, K, caps):
        variant, block = "register", 8
    variant = variant or ("register" if caps.is_cpu or K <= 32 or M <= 4 else "shared")
    if variant == "register":
        tm = tn = block or 4
        threads = 64
    else:
        # 8x8 blocks (128x128 tiles) halve the bytes staged per FLOP; a long K (a weight
        # gradient over many tokens or pixels, 256 x 1024 at K = 16384) fills the GPU with
        # split-K partials of them instead of more, smaller tiles (H200: 397 -> 304 us for
        # GPT's MLP weight gradients, 352 -> 251 us for ResNet-50's), as long as the 128x128
        # grid is small enough that split-K runs ('few')
        # tiles, no fewer: a conv over 4 x 4 pixels at K = 4608 on 256 128x128 tiles ran at half
        # the speed of 1024 64x64 ones (H200, ResNet-18 at batch 512)
        # the grid after that: whole 128x128 tiles only (ViT-tiny's 192-wide weight gradients on
        # 96x128 or 120x96 tiles were 1.3-1.7x slower than on 64x64 ones)
        few = math.ceil(M / 128) * math.ceil(N / 128) * batch * 256 < _target_invocations(caps) // 2
        long_k = K >= LONG_K and few and split and M % 128 == 0 and N % 128 == 0
        big = (M * N >= 1024 * 1024 or long_k) and M >= 128 and N >= 128
        tm = tn = block or (8 if big else 4)
        tn = block_n or tn
        threads = min(threads or 256, caps.max_invocations_per_workgroup)
    wy = min(_pow2_at_least(math.ceil(M / tm)), 16, threads)
    # wide-and-short tiles (small M) stay within 32 invocations along N: workgroup memory and
    # the waste of a half-empty last tile both grow with the tile width
    wx = min(_pow2_at_least(math.ceil(N / tn)), threads // wy, 64 if variant == "register" else 32)
    wy = min(wy, threads // wx)
    if variant == "shared":
        # a few tiles along an axis: the fewest invocations that cover it in the same number of
        # tiles, not the next power of two (a conv weight gradient, 24 x 144: 32 x 128 tiles were
        # 42% padding). Invocation counts need not be powers of two.
        wx = _fit(math.ceil(N / tn), wx)
        wy = _fit(math.ceil(M / tm), wy)
        # two f32 tiles (BM + BN) x KT within workgroup storage, 16 deep when that leaves room for
        # a second resident workgroup (measured best on an H200 for 128x128 tiles; 32 was 35% slower)
        per_k = (wy * tm + wx * tn) * 4
        # thin tiles over a wide N (implicit-GEMM convs with <= 16 channels on the M side) stage 8
        # deep: H200, MNIST at batch 1000, conv3 dX 512 -> 416 us, conv2 fwd 176 -> 137 us; the
        # weight gradients (narrow N) were slower with 8 at batch 64
        thin = M <= 16 and N >= 16384
        kt = kt or (16 if not thin and per_k * 16 <= min(caps.max_workgroup_storage, 32768) // 2 else 8)
        kt = kt if per_k * kt <= caps.max_workgroup_storage else 4
    return Tiling(variant, wx, wy, tm, tn, kt or 4)


# -- grid folding ---------------------------------------------------------------------------------
def fold_grid(total: int, caps: AdapterCaps) -> tuple[int, int, int]:
    """Spread `total` workgroups over up to three dims, each within the adapter's limit."""
    lim = caps.max_workgroups_per_dim
    gx = min(total, lim)
    rest = math.ceil(total / gx)
    gy = min(rest, lim)
    gz = math.ceil(rest / gy)
    if gz > lim:
        raise ShapeError(f"a kernel needs {total} workgroups, more than this adapter can dispatch")
    return gx, gy, gz


def linear_id(grid: tuple[int, int, int]) -> str:
    gx, gy, _ = grid
    return f"wid.x + wid.y * {u(gx)} + wid.z * {u(gx * gy)}"


# -- WGSL generation ----------------------------------------------------------------------------
def _decl(i: int, b: Binding, access: str) -> str:
    elem = "vec4<f32>" if b.vec4 else b.elem
    return f"@group(0) @binding({i}) var<storage, {access}> {b.var}: array<{elem}>;"


def _scalar_read(var: str, vec4: bool, idx: str) -> str:
    return f"{var}[({idx}) >> 2u][({idx}) & 3u]" if vec4 else f"{var}[{idx}]"


def _loader(fn: str, op: Operand, vec4: bool, helpers: dict[str, str] | None = None) -> str:
    """fn_el(bt, r, c) -> f32 (0 outside), and fn_v(bt, r, c) -> vec4 along op.contig when vec4-bound;
    with a hoisted prelude also fn_elh(bt, r, c, <hoisted names>): fn_el given those values.
    With op.apply, each element read goes through that activation (fn_act; its helper functions
    into `helpers`, shared with the epilogue's); outside the operand it stays 0, as the operand
    the activation's output would be."""
    guard = f"if (r >= {u(op.rows)} || c >= {u(op.cols)}) {{ return {{zero}}; }}"
    valid = f"if (!({op.valid})) {{ return {{zero}}; }}" if op.valid else ""
    act = (lambda e: f"{fn}_act({e})") if op.apply else (lambda e: e)

    def scalar(name: str, params: str, pre: str) -> list[str]:
        return [f"fn {name}(bt: u32, r: u32, c: u32{params}) -> f32 {{",
                "  " + guard.replace("{zero}", "0.0"), f"  {pre}", "  " + valid.replace("{zero}", "0.0"),
                f"  let idx = {op.index};", f"  return {act(_scalar_read(op.var, vec4, 'idx'))};", "}"]

    out = _act_fn(f"{fn}_act", op.apply, helpers, op.apply_half) if op.apply else []
    out += scalar(f"{fn}_el", "", op.full_prelude)
    if op.hoist:
        out += scalar(f"{fn}_elh", "".join(f", {h}: u32" for h in op.hoisted), op.prelude)
    if vec4:
        read = f"{op.var}[({op.index}) >> 2u]"
        if op.apply:
            read = f"vec4<f32>({', '.join(act(f'w[{q}]') for q in range(4))})"
        out += [f"fn {fn}_v(bt: u32, r: u32, c: u32) -> vec4<f32> {{",
                "  " + guard.replace("{zero}", "vec4<f32>(0.0)"), f"  {op.full_prelude}",
                "  " + valid.replace("{zero}", "vec4<f32>(0.0)")]
        out += ([f"  let w = {op.var}[({op.index}) >> 2u];"] if op.apply else []) + [f"  return {read};", "}"]
    return "\n".join(out)


def _act_fn(name: str, apply: tuple, helpers: dict[str, str] | None, half: bool = False) -> list[str]:
    """`fn name(x: f32) -> f32`: the activation apply = (op, sorted attrs), by its elementwise
    table row; the functions it calls go into `helpers` (or before it, without); `half`: its
    result rounded to f16, as the activation's own kernel would store it."""
    c = Emit()
    op, attrs = apply
    (v,) = EW[op].emit(c, Node(op, ["x"], ["y"], dict(attrs)), [Val("x", "f32")], ["f32"])
    own = [] if helpers is not None else list(c.helpers.values())
    if helpers is not None:
        helpers.update(c.helpers)
    return own + [f"fn {name}(x: f32) -> f32 {{"] + c.lines + [f"  return {_rounded(v.expr, half)};", "}"]


def _rounded(expr: str, half: bool) -> str:
    """expr (f32) rounded to float16 and back when `half`: a float16 value of the graph, held in a
    register instead of stored (the shader enables f16: halfstore.py does for its f16 bindings)."""
    return f"f32({to_half(expr)})" if half else expr


def _activation(out: Output, helpers: dict[str, str] | None = None) -> tuple[str, str, str]:
    """(helper functions, statements, result expression) applying out.epilogue to `y`; with
    `helpers`, the helper functions go there instead (shared with the operands' prologues)."""
    if out.epilogue in EPILOGUES:
        return "", "", EPILOGUES[out.epilogue]
    c = Emit()
    pre = ""
    if out.operand:  # read once: the gradient's formula may use x several times
        node = Node(out.epilogue, ["y", "x"], ["z"], dict(out.epilogue_attrs))
        (v,) = EW[out.epilogue].emit(c, node, [Val("y", "f32"), Val("ex", "f32")], ["f32"])
        pre = f"  let ex = {out.operand};\n"
    else:
        node = Node(out.epilogue, ["y"], ["z"], dict(out.epilogue_attrs))
        (v,) = EW[out.epilogue].emit(c, node, [Val("y", "f32")], ["f32"])
    if helpers is not None:
        helpers.update(c.helpers)
        return "", pre + "\n".join(c.lines) + "\n", v.expr
    return "\n".join(c.helpers.values()), pre + "\n".join(c.lines) + "\n", v.expr


def _epi_fn(out: Output, with_bias: bool, helpers: dict[str, str] | None = None) -> str:
    def step(name: str, line: str) -> str:
        return line + (f"  y = {_rounded('y', True)};\n" if name in out.rounds else "")
    bias = step("bias", f"  y = y + {out.bias};\n") if (with_bias and out.bias) else ""
    bias += step("residual", f"  y = y + {out.residual};\n") if (with_bias and out.residual) else ""
    alpha = f" * {f(out.alpha)}" if out.alpha != 1.0 else ""
    own, lines, result = _activation(out, helpers)
    result = _rounded(result, "epilogue" in out.rounds and out.epilogue is not None)
    if with_bias and out.mask:
        lines += f"  let z = {result};\n"
        result = f"select(z, {out.fill}, {out.mask})"
    return (f"{own}\nfn epi(bt: u32, r: u32, c: u32, v: f32) -> f32 {{\n  var y = v{alpha};\n"
            f"{step('gemm', '')}{bias}{lines}  return {result};\n}}")


def _store_fn(out: Output, M: int, N: int) -> str:
    """st4(bt, s, r, c, v): store four results c..c+3 (c % 4 == 0) of row r, through epi."""
    vals = ", ".join(f"epi(bt, r, c + {q}u, v[{q}])" for q in range(4))
    if out.contig:
        return (f"fn st4(bt: u32, s: u32, r: u32, c: u32, v: vec4<f32>) {{\n"
                f"  if (r >= {u(M)} || c >= {u(N)}) {{ return; }}\n  {out.prelude}\n"
                f"  {out.var}[({out.index}) >> 2u] = vec4<f32>({vals});\n}}")
    return (f"fn st1(bt: u32, s: u32, r: u32, c: u32, v: f32) {{\n"
            f"  if (r >= {u(M)} || c >= {u(N)}) {{ return; }}\n  {out.prelude}\n"
            f"  {out.var}[{out.index}] = epi(bt, r, c, v);\n}}\n"
            f"fn st4(bt: u32, s: u32, r: u32, c: u32, v: vec4<f32>) {{\n"
            + "".join(f"  st1(bt, s, r, c + {q}u, v[{q}]);\n" for q in range(4)) + "}")


def _a_block(t: Tiling, vec: bool, contig: int | None) -> list[str]:
    """Statements defining a{i}: vec4 of A[m0+i, k..k+3] for i < TM."""
    lines = []
    if vec and contig == 1:
        lines += [f"let a{i} = a_v(bt, m0 + {i}u, k);" for i in range(t.tm)]
    elif vec and contig == 0:
        for ib in range(t.tm // 4):
            lines += [f"let ta{kk}_{ib} = a_v(bt, m0 + {4 * ib}u, k + {kk}u);" for kk in range(4)]
            lines += [f"let a{4 * ib + q} = vec4<f32>(" + ", ".join(f"ta{kk}_{ib}[{q}]" for kk in range(4)) + ");"
                      for q in range(4)]
    else:
        lines += [f"let a{i} = vec4<f32>(" + ", ".join(f"a_el(bt, m0 + {i}u, k + {kk}u)" for kk in range(4)) + ");"
                  for i in range(t.tm)]
    return lines


def _b_block(t: Tiling, vec: bool, contig: int | None) -> list[str]:
    """Statements defining b{kk}_{j}: vec4 of B[k+kk, n0+4j..n0+4j+3]."""
    lines = []
    nj = t.tn // 4
    if vec and contig == 1:
        lines += [f"let b{kk}_{j} = b_v(bt, k + {kk}u, n0 + {4 * j}u);" for kk in range(4) for j in range(nj)]
    elif vec and contig == 0:
        lines += [f"let tb{c} = b_v(bt, k, n0 + {c}u);" for c in range(t.tn)]
        lines += [f"let b{kk}_{j} = vec4<f32>(" + ", ".join(f"tb{4 * j + q}[{kk}]" for q in range(4)) + ");"
                  for kk in range(4) for j in range(nj)]
    else:
        lines += [f"let b{kk}_{j} = vec4<f32>(" + ", ".join(f"b_el(bt, k + {kk}u, n0 + {4 * j + q}u)"
                                                         for q in range(4)) + ");"
                  for kk in range(4) for j in range(nj)]
    return lines


def _fma_block(t: Tiling, a: str, b: str) -> list[str]:
    """acc{i}_{j} += a(i)[kk] * b(kk, j) for one k step; a/b are format strings."""
    return [f"acc{i}_{j} = fma(vec4<f32>({a.format(i=i, kk=kk)}), {b.format(kk=kk, j=j)}, acc{i}_{j});"
            for kk in range(4) for i in range(t.tm) for j in range(t.tn // 4)]


def _vec_ok(op: Operand) -> bool:
    """A vec4 load along op.contig is valid when that extent is a multiple of 4."""
    if op.contig is None:
        return False
    return (op.rows if op.contig == 0 else op.cols) % 4 == 0


@dataclass(frozen=True)
class _Stage:
    """Copying one operand's tile into workgroup memory: element l (of `count`, spread over the
    invocations) has index statements, a global load of type `vtype` and statements storing
    that value `v` into the tile."""
    count: int
    index: tuple[str, ...]
    load: str
    vtype: str
    store: tuple[str, ...]
    swizzled: bool = False  # the tile's rows are permuted (_sw): reads must apply the same XOR
    hoist: tuple[str, ...] = ()  # statements run once before the K loop (the copy's fixed column)


def _sw(on: bool, k: str) -> str:
    """XOR applied to a tile row's vec4 index at K offset `k`. A scalar copy with K fastest has
    the 32 invocations of a warp store into 16 rows at once; unpermuted, rows 128 floats apart
    all fall on one bank (16-way conflicts: H100, the LM head's input gradient over an odd K ran
    at 14-22 TFLOP/s, 23-31 swizzled). ((k >> 2) ^ k) & 7 gives any 8 consecutive rows distinct
    groups of banks; it permutes vec4s within aligned groups of 8, so the tile's rows must be
    whole groups (a multiple of 32 floats)."""
    return f" ^ (((({k}) >> 2u) ^ ({k})) & 7u)" if on else ""


def _swizzled(index: str, on: bool, k: str) -> str:
    """`index` XOR-permuted at K offset `k` (_sw), parenthesised whole: WGSL's grammar takes only
    unary operands beside `^` (Tint refuses `a / 4u ^ b` and `a + b ^ c`, which naga accepts)."""
    return f"(({index}){_sw(on, k)})" if on else f"({index})"


# Workgroup tiles as arrays of rows (As[k][m]) rather than one flat array (As[k * BM4 + m]): naga
# clamps every dynamic index into a workgroup array (wgpu's Vulkan backend lowers WGSL with the
# Restrict bounds-check policy), and a flat index is clamped whole at every load, where a row's
# constant index needs no clamp and the clamped column (lid + a constant) is the same in every
# K step. ANYGRAD_WGPU_GEMM_2D=0 keeps the flat arrays (read when a kernel is generated).
def _tile_2d() -> bool:
    return settings.get("ANYGRAD_WGPU_GEMM_2D")


F16_MATH_ENV = "ANYGRAD_F16_MATH"  # auto | 1 | 0: half_math


def _at(arr: str, row: str, width: int, col: str) -> str:
    """Element (row, col) of a workgroup tile of rows `width` vec4s long."""
    return f"{arr}[{row}][{col}]" if _tile_2d() else f"{arr}[({row}) * {u(width)} + {col}]"


def _tile_decl(arr: str, rows: int, width: int, halves: int = 1, elem: str = "f32") -> str:
    if not _tile_2d():
        return f"var<workgroup> {arr}: array<vec4<{elem}>, {halves * rows * width}>;"
    t = f"array<array<vec4<{elem}>, {width}>, {rows}>"
    return f"var<workgroup> {arr}: {t if halves == 1 else f'array<{t}, {halves}>'};"


def _stages(spec: GemmSpec, t: Tiling, va: bool, vb: bool) -> tuple[_Stage, _Stage]:
    """How A (KT x BM) and B (KT x BN) are staged, as vec4 rows along M / N: vec4 global loads
    where the operand is contiguous (coalesced along its contiguous axis), else scalars."""
    bm, bn, kt = t.bm, t.bn, t.kt
    bm4, bn4, kt4 = bm // 4, bn // 4, kt // 4

    def scatter(arr: str, width4: int, k: str, x: str) -> tuple[str, ...]:
        """Write vec4 v (four consecutive k at column x) into the k-major tile."""
        return tuple(f"{_at(arr, f'{k} + {c}u', width4, f'{x} / 4u')}[{x} % 4u] = v[{c}];" for c in range(4))

    if va and spec.a.contig == 1:       # vec4 along k
        a = _Stage(bm * kt4, (f"let kq = (l % {u(kt4)}) * 4u; let mm = l / {u(kt4)};",),
                   f"a_v(bt, mb * {u(bm)} + mm, k0 + kq)", "vec4<f32>", scatter("As", bm4, "kq", "mm"))
    elif va and spec.a.contig == 0:     # vec4 along m
        a = _Stage(bm4 * kt, (f"let mq = l % {u(bm4)}; let kk = l / {u(bm4)};",),
                   f"a_v(bt, mb * {u(bm)} + mq * 4u, k0 + kk)", "vec4<f32>",
                   (f"{_at('As', 'kk', bm4, 'mq')} = v;",))
    else:
        a_fast = spec.a.fast if spec.a.fast is not None else spec.a.contig
        a_map = (f"let kk = l % {u(kt)}; let mm = l / {u(kt)};" if a_fast == 1
                 else f"let mm = l % {u(bm)}; let kk = l / {u(bm)};")
        sw = t.swizzle and a_fast == 1 and bm % 32 == 0
        a = _Stage(bm * kt, (a_map,), f"a_el(bt, mb * {u(bm)} + mm, k0 + kk)", "f32",
                   (f"{_at('As', 'kk', bm4, _swizzled('mm / 4u', sw, 'kk'))}[mm % 4u] = v;",), sw)
    if vb and spec.b.contig == 1:       # vec4 along n
        b = _Stage(bn4 * kt, (f"let nq = l % {u(bn4)}; let kk = l / {u(bn4)};",),
                   f"b_v(bt, k0 + kk, nb * {u(bn)} + nq * 4u)", "vec4<f32>",
                   (f"{_at('Bs', 'kk', bn4, 'nq')} = v;",))
    elif vb and spec.b.contig == 0:     # vec4 along k
        b = _Stage(bn * kt4, (f"let kq = (l % {u(kt4)}) * 4u; let nn = l / {u(kt4)};",),
                   f"b_v(bt, k0 + kq, nb * {u(bn)} + nn)", "vec4<f32>", scatter("Bs", bn4, "kq", "nn"))
    else:
        b_fast = spec.b.fast if spec.b.fast is not None else spec.b.contig
        b_map = (f"let kk = l % {u(kt)}; let nn = l / {u(kt)};" if b_fast == 0
                 else f"let nn = l % {u(bn)}; let kk = l / {u(bn)};")
        sw = t.swizzle and b_fast == 0 and bn % 32 == 0
        load, hoist = f"b_el(bt, k0 + kk, nb * {u(bn)} + nn)", ()
        if t.hoist and spec.b.hoist and b_fast != 0 and (t.wx * t.wy) % bn == 0:
            # every copy of this invocation reads column tid % BN, in every K tile: its decode
            # (an im2col pixel: two divisions and two remainders) runs once, before the K loop
            load = f"b_elh(bt, k0 + kk, nb * {u(bn)} + nn, {', '.join(spec.b.hoisted)})"
            hoist = (f"let c = nb * {u(bn)} + tid % {u(bn)};", spec.b.hoist)
        b = _Stage(bn * kt, (b_map,), load, "f32",
                   (f"{_at('Bs', 'kk', bn4, _swizzled('nn / 4u', sw, 'kk'))}[nn % 4u] = v;",), sw, hoist)
    return a, b


def _unrolls(st: _Stage, nt: int) -> bool:
    return st.count % nt == 0 and st.count // nt <= 16


def _shared_body(spec: GemmSpec, t: Tiling, va: bool, vb: bool, unroll: bool) -> tuple[str, list[str]]:
    """Workgroup-memory variant: each K tile of A and B is staged in workgroup memory, then every
    invocation multiplies its TM x TN block out of it.

    Two things keep the multiply fed. An invocation's block is TM/4 x TN/4 sub-blocks of 4 x 4,
    WY (WX) vec4s apart, so that neighbouring invocations read neighbouring vec4s of the tile (no
    bank conflicts; the stores coalesce too). And where the copies unroll, the next K tile's global
    loads are issued into registers before the multiply of this one and written to workgroup
    memory after it, so their latency hides behind the FMAs (register prefetch)."""
    bm4, bn4, kt = t.bm // 4, t.bn // 4, t.kt
    nt = t.wx * t.wy
    elem = "f16" if t.half else "f32"
    decl = _tile_decl("As", kt, bm4, elem=elem) + "\n" + _tile_decl("Bs", kt, bn4, elem=elem)
    stages = _stages(spec, t, va, vb)
    if t.half:  # each element rounded to f16 once, as it is staged (the operands are f16: exact)
        stages = tuple(replace(st, load=f"{st.vtype.replace('f32', 'f16')}({st.load})",
                               vtype=st.vtype.replace("f32", "f16")) for st in stages)
    sa, sb = (st.swizzled for st in stages)
    acc = "h" if t.half else "acc"
    blocks = [(4 * ib + q, j) for ib in range(t.tm // 4) for q in range(4) for j in range(t.tn // 4)]
    fmas = [f"  {acc}{i}_{j} = fma(vec4<{elem}>(av{i // 4}[{i % 4}]), bv{j}, {acc}{i}_{j});" for i, j in blocks]
    # half: the K tile's f16 partial sums go into the f32 accumulators once per tile
    flush = [f"acc{i}_{j} = acc{i}_{j} + vec4<f32>(h{i}_{j}); h{i}_{j} = vec4<f16>(0.0h);"
             for i, j in blocks] if t.half else []
    if unroll:   # constant tile offsets, loads scheduled ahead of the FMAs
        compute = []
        for kk in range(kt):
            compute += (["{"] + [f"  let av{ib} = {_at('As', u(kk), bm4, _swizzled(f'{u(ib * t.wy)} + lid.y', sa, u(kk)))};"
                                 for ib in range(t.tm // 4)]
                        + [f"  let bv{j} = {_at('Bs', u(kk), bn4, _swizzled(f'{u(j * t.wx)} + lid.x', sb, u(kk)))};"
                           for j in range(t.tn // 4)]
                        + fmas + ["}"])
        compute += flush
    else:
        step = t.unroll if kt % t.unroll == 0 else 1

        def k_step(kk: str) -> list[str]:
            return ([f"  let av{ib} = {_at('As', kk, bm4, _swizzled(f'{u(ib * t.wy)} + lid.y', sa, kk))};"
                     for ib in range(t.tm // 4)]
                    + [f"  let bv{j} = {_at('Bs', kk, bn4, _swizzled(f'{u(j * t.wx)} + lid.x', sb, kk))};"
                       for j in range(t.tn // 4)] + fmas)
        if step == 1:
            compute = [f"for (var kk = 0u; kk < {u(kt)}; kk = kk + 1u) {{"] + k_step("kk") + ["}"]
        else:
            compute = [f"for (var k0s = 0u; k0s < {u(kt)}; k0s = k0s + {u(step)}) {{"]
            for d in range(step):
                compute += ["{"] + k_step(f"(k0s + {u(d)})") + ["}"]
            compute += ["}"]
        compute += flush
    head = [f"  let tid = lid.x + lid.y * {u(t.wx)};"] + [f"  {ln}" for st in stages for ln in st.hoist]
    head += [f"  var h{i}_{j} = vec4<f16>(0.0h);" for i, j in blocks] if t.half else []
    unrolled = all(_unrolls(st, nt) for st in stages)
    if not (t.prefetch and unrolled):
        copy = []
        for st in stages:
            # unrolled into straight code where the invocations divide the tile, so index
            # arithmetic shared by the copies (the pixel decode of one k) is computed once
            copies = ([[f"let l = tid + {u(i * nt)};"] for i in range(st.count // nt)] if unrolled
                      else [[]])
            for pre in copies:
                inner = pre + list(st.index) + [f"let v = {st.load};"] + list(st.store)
                copy += (["{"] + [f"  {ln}" for ln in inner] + ["}"] if unrolled else
                         [f"for (var l = tid; l < {u(st.count)}; l = l + {u(nt)}) {{"]
                         + [f"  {ln}" for ln in inner] + ["}"])
        body = (head + [f"  for (var k0 = kb; k0 < ke; k0 = k0 + {u(kt)}) {{"]
                + ["    " + ln for ln in copy] + ["    workgroupBarrier();"]
                + ["    " + ln for ln in compute] + ["    workgroupBarrier();", "  }"])
        return decl, body
    if t.double:
        decl = _tile_decl("As", kt, bm4, 2, elem) + "\n" + _tile_decl("Bs", kt, bn4, 2, elem)
    regs, fetch, put = [], [], []
    for name, st in zip("ab", stages):
        for i in range(st.count // nt):
            r = f"p{name}{i}"
            regs.append(f"  var {r}: {st.vtype};")
            # the index arithmetic is repeated at the store: registers hold values only
            fetch += ["{", f"  let l = tid + {u(i * nt)};"] + [f"  {ln}" for ln in st.index] + [f"  {r} = {st.load};", "}"]
            put += ["{", f"  let l = tid + {u(i * nt)};"] + [f"  {ln}" for ln in st.index] + [f"  let v = {r};"]
            put += [f"  {ln}" for ln in st.store] + ["}"]
    if t.double:
        # tile i is multiplied out of half i % 2 while tile i + 1 is stored into the other half:
        # the barrier ending step i - 1 (everyone done reading that half) comes before the store
        def half(lines: list[str], which: str) -> list[str]:
            if _tile_2d():
                return [ln.replace("As[", f"As[{which}][").replace("Bs[", f"Bs[{which}][") for ln in lines]
            return [ln.replace("As[", f"As[{which} * {u(kt * bm4)} + ").replace("Bs[", f"Bs[{which} * {u(kt * bn4)} + ")
                    for ln in lines]
        body = (head + regs + ["  {", "    let k0 = kb;"] + ["    " + ln for ln in fetch]
                + ["    let cur = 0u;"] + ["    " + ln for ln in half(put, "cur")] + ["  }", "  workgroupBarrier();",
                                                                                        "  var cur = 0u;"]
                + [f"  for (var k0 = kb; k0 < ke; k0 = k0 + {u(kt)}) {{",
                   f"    let more = k0 + {u(kt)} < ke;",
                   "    if (more) {", f"      let k0 = k0 + {u(kt)};"] + ["      " + ln for ln in fetch] + ["    }"]
                + ["    " + ln for ln in half(compute, "cur")]
                + ["    if (more) {", "      let cur = 1u - cur;"] + ["      " + ln for ln in half(put, "cur")] + ["    }"]
                + ["    workgroupBarrier();", "    cur = 1u - cur;", "  }"])
        return decl, body
    body = (head + regs + ["  {", "    let k0 = kb;"] + ["    " + ln for ln in fetch] + ["  }"]
            + [f"  for (var k0 = kb; k0 < ke; k0 = k0 + {u(kt)}) {{"]
            + ["    " + ln for ln in put] + ["    workgroupBarrier();",
                                              f"    if (k0 + {u(kt)} < ke) {{",
                                              f"      let k0 = k0 + {u(kt)};"]
            + ["      " + ln for ln in fetch] + ["    }"]
            + ["    " + ln for ln in compute] + ["    workgroupBarrier();", "  }"])
    return decl, body


GROUP_M = 8  # rows of tiles walked together (tile order, _tile_order)


def _tile_order(nN: int, nM: int) -> list[str]:
    """(mb, nb) of workgroup `lin` within its problem: GROUP_M rows of tiles at a time, down the
    rows first, so the workgroups running at once share B's column panels and A's row panels in
    L2, instead of each row of tiles streaming all of B (Triton's grouped ordering). With
    nM <= GROUP_M that is simply: every row of tiles of a column panel, one after the other."""
    t = f"(lin % {u(nN * nM)})"
    if nM == 1:
        return [f"  let nb = {t};", "  let mb = 0u;"]
    return [f"  let tg = {t} / {u(GROUP_M * nN)};",
            f"  let first_m = tg * {u(GROUP_M)};",
            f"  let gm = min({u(nM)} - first_m, {u(GROUP_M)});",
            f"  let tr = {t} - tg * {u(GROUP_M * nN)};",
            "  let mb = first_m + tr % gm;",
            "  let nb = tr / gm;"]


def gemm_wgsl(spec: GemmSpec, t: Tiling, caps: AdapterCaps, splits: int = 1, ksplit: int = 0,
              out: Output | None = None, write: Binding | None = None, with_bias: bool = True) -> tuple[str, tuple]:
    """(shader, grid, read values) of one GEMM kernel; with splits > 1, problem `s` of the grid
    covers K range [s * ksplit, (s + 1) * ksplit) and `out` is the Scratch of partial sums."""
    out = out or spec.out
    write = write or spec.write
    M, N, K = spec.M, spec.N, spec.K
    nN, nM = math.ceil(N / t.bn), math.ceil(M / t.bm)
    total = nN * nM * spec.batch * splits
    grid = fold_grid(total, caps)
    va, vb = _vec_ok(spec.a), _vec_ok(spec.b)
    if spec.a.contig == 0 and t.tm % 4:
        va = False
    reads = [replace(spec.reads[0], vec4=va), replace(spec.reads[1], vec4=vb)]
    reads += list(spec.reads[2:]) if with_bias else []
    if splits == 1:
        kstep = t.kt if t.variant == "shared" else 4
        ksplit = math.ceil(K / kstep) * kstep
    decls = [_decl(i, b, "read") for i, b in enumerate(reads)]
    decls.append(_decl(len(reads), replace(write, vec4=out.contig), "read_write"))
    nj = t.tn // 4
    accs = [f"  var acc{i}_{j} = vec4<f32>(0.0);" for i in range(t.tm) for j in range(nj)]
    head = [
        f"@compute @workgroup_size({t.wx}, {t.wy}, 1)",
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {",
        f"  let lin = {linear_id(grid)};",
        f"  if (lin >= {u(total)}) {{ return; }}",
    ] + _tile_order(nN, nM) + [
        f"  let bt = (lin / {u(nN * nM)}) % {u(spec.batch)};",
        f"  let s = lin / {u(nN * nM * spec.batch)};",
        f"  let m0 = mb * {u(t.bm)} + lid.y * {u(t.tm)};",
        f"  let n0 = nb * {u(t.bn)} + lid.x * {u(t.tn)};",
        f"  let kb = s * {u(ksplit)};",
        f"  let ke = min(kb + {u(ksplit)}, {u(K)});",
    ] + accs
    body: list[str] = []
    shared_decl = ""
    if t.variant == "register":
        body += ["  for (var k = kb; k < ke; k = k + 4u) {"]
        body += ["    " + ln for ln in _a_block(t, va, spec.a.contig) + _b_block(t, vb, spec.b.contig)]
        body += ["    " + ln for ln in _fma_block(t, "a{i}[{kk}]", "b{kk}_{j}")]
        body += ["  }"]
    else:
        # the K-tile loop unrolled: H100, split-K GEMMs (short K ranges) and convs +2-29%, but
        # prefetched GEMMs over the whole K 0-17% slower (4096^3: 35.4 -> 29.5 TFLOP/s)
        shared_decl, body = _shared_body(spec, t, va, vb, unroll=not (t.prefetch and splits == 1))
    if t.variant == "shared":   # sub-blocks WY (WX) vec4s apart (_shared_body)
        stores = [f"  st4(bt, s, mb * {u(t.bm)} + lid.y * 4u + {u(ib * t.wy * 4 + q)}, "
                  f"nb * {u(t.bn)} + lid.x * 4u + {u(j * t.wx * 4)}, acc{4 * ib + q}_{j});"
                  for ib in range(t.tm // 4) for q in range(4) for j in range(nj)]
    else:
        stores = [f"  st4(bt, s, m0 + {i}u, n0 + {4 * j}u, acc{i}_{j});" for i in range(t.tm) for j in range(nj)]
    helpers: dict[str, str] = {}
    loaders = [_loader("a", spec.a, reads[0].vec4, helpers), _loader("b", spec.b, reads[1].vec4, helpers),
               _epi_fn(out, with_bias, helpers)]
    wgsl = "\n".join((["enable f16;"] if t.half and t.variant == "shared" else []) + decls + [shared_decl]
                     + list(helpers.values()) + loaders + [_store_fn(out, M, N)]
                     + head + body + stores + ["}"]) + "\n"
    return wgsl, grid, tuple(b.value for b in reads)


# -- split K ------------------------------------------------------------------------------------
def _target_invocations(caps: AdapterCaps) -> int:
    """Invocations that keep the adapter busy: a few workgroups per core on a CPU adapter; on a
    GPU about half of what its multiprocessors hold (e.g. 132 SMs x 2048 on an H200)."""
    return 2048 if caps.is_cpu else 128 * 1024


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

    Few splits: one invocation per output sums them serially. Many splits (tiny outputs reduced
    over a long K): one workgroup per output, a strided sum per invocation, then a tree."""
    M, N, B = spec.M, spec.N, spec.batch
    total = B * M * N
    wg = 64
    tree = splits >= 64 and not caps.is_cpu
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


def gemm_kernels(spec: GemmSpec, caps: AdapterCaps, variant: str | None = None,
                 allow_split: bool = True, block: int | None = None, kt: int | None = None,
                 prefetch: int | None = None, layout: str | None = None,
                 threads: int | None = None, unroll: int | None = None, tn: int | None = None,
                 splits: int | None = None, half: bool = False, operands: str | None = None) -> list[Kernel]:
    """The kernel list for one GEMM-shaped op: one GEMM, or a split-K GEMM + reduce. The first
    kernel carries the GEMM's FLOPs (profiles report rates, the autotuner skips small GEMMs).
    half: f16 products summed in f16 within each K tile (Tiling.half; only with float16 operands,
    shared variant: half_math decides). operands: the WGSL type both operands hold (f16 | f32,
    None when they differ): variant "mma" (matrix units, kernels_mma.py) needs a config for it."""
    if variant == "mma" or (variant is None and block is None and not (allow_split and use_dot(spec, caps))
                            and matrix_units.by_default(spec.M, spec.N, spec.K, spec.batch, caps, operands)):
        if operands is None:
            raise ValueError(f"{spec.name}: matrix units need both operands of one type")
        from .kernels_mma import mma_kernels  # it builds on this module's loaders and stores
        kernels = mma_kernels(spec, caps, operands, allow_split, block, kt, threads, splits)
    else:
        kernels = _gemm_kernels(spec, caps, variant, allow_split, block, kt, prefetch, layout, threads, unroll, tn,
                                splits, half)
    if spec.out.rounds or spec.a.apply_half or spec.b.apply_half:  # f16 values held in registers (_rounded)
        kernels = [replace(k, wgsl=with_conversions(k.wgsl)) if "f16(" in k.wgsl else k for k in kernels]
    flops = 2 * spec.batch * spec.M * spec.N * spec.K
    return [replace(kernels[0], flops=flops)] + kernels[1:]


def _plain(op: Operand) -> bool:
    """Elements read straight from memory (no implicit-GEMM gather computing pixel positions)."""
    return not op.full_prelude and not op.valid


def _gemm_kernels(spec: GemmSpec, caps: AdapterCaps, variant: str | None, allow_split: bool,
                  block: int | None, kt: int | None, prefetch: int | None,
                  layout: str | None = None, threads: int | None = None, unroll: int | None = None,
                  tn: int | None = None, want_splits: int | None = None, half: bool = False) -> list[Kernel]:
    if variant == "dot" or (variant is None and block is None and allow_split and use_dot(spec, caps)):
        return dot_kernels(spec, caps, want_splits)
    lay = set((layout or "").split(","))
    t = choose_tiling(spec.M, spec.N, spec.K, caps, variant, block, kt, spec.batch, allow_split, threads, tn)
    if t.variant == "shared":
        # prefetching sped up every plain GEMM measured (H100: +3-21%) but half the implicit-GEMM
        # convs lost up to 40% (their gathers): there the autotuner decides
        t = replace(t, prefetch=bool(prefetch) if prefetch is not None else _plain(spec.a) and _plain(spec.b),
                    double=prefetch == 2)
        if t.double and 2 * (t.bm + t.bn) * t.kt * 4 > caps.max_workgroup_storage:
            raise ValueError(f"two {t.bm}x{t.bn}x{t.kt} tiles do not fit {caps.max_workgroup_storage} bytes of "
                             "workgroup storage")
        t = replace(t, swizzle=not {"plain", "noswizzle"} & lay, hoist=not {"plain", "nohoist"} & lay,
                    unroll=unroll or 1, half=half)
    splits, ksplit = choose_splits(spec, t, caps, want_splits) if allow_split else (1, 0)
    tile = f"{t.variant} {t.bm}x{t.bn}" + (f"k{t.kt}" + ("p" if t.prefetch else "") + ("d" if t.double else "")
                                           + (f"u{t.unroll}" if t.unroll > 1 else "") + ("h" if t.half else "")
                                           if t.variant == "shared" else "")
    if splits == 1:
        wgsl, grid, reads = gemm_wgsl(spec, t, caps)
        return [Kernel(f"{spec.name}[{tile}]", wgsl, grid, reads, (spec.write.value,))]
    return _split_pair(spec, caps, splits, tile,
                       lambda part, sb: gemm_wgsl(spec, t, caps, splits, ksplit, out=part, write=sb,
                                                  with_bias=False))


# -- lowerings ----------------------------------------------------------------------------------
def static_shape(graph: Graph, value: str, node: Node) -> tuple[int, ...]:
    info = graph.info.get(value)
    if info is None or not info.is_static:
        raise ShapeError(f"{node.label}: value '{value}' has no static shape; specialize the graph first")
    return tuple(int(d) for d in info.shape)


def half_math(node: Node, graph: Graph, caps: AdapterCaps) -> bool:
    """Whether this GEMM-shaped node's products are summed in float16 within each K tile (into
    float32 accumulators across tiles: Tiling.half). f16 FMAs run at twice the f32 rate on most
    GPUs and the f16 tiles take half the workgroup memory traffic, which f16 storage alone does not
    give (its products are f32). Only where both operands are float16, on a device whose self-test
    passed them (caps.f16_math), and then per ANYGRAD_F16_MATH: "auto" (default) leaves it to the
    autotuner (pin `_gemm_half`), "1" uses it wherever it can, "0" never. Like PyTorch's default
    `allow_fp16_reduced_precision_reduction`: partial sums of a few products may round to f16."""
    mode = settings.get(F16_MATH_ENV)  # None: auto
    if mode is False or not caps.f16_math:
        return False
    if any(graph.info.get(v) is None or graph.info[v].dtype != np.float16 for v in node.inputs[:2]):
        return False
    pin = node.attr("_gemm_half")
    return bool(pin) if pin is not None else mode is True


def has_half_tiles(kernel_name: str) -> bool:
    """Whether a GEMM kernel's name says f16 products (the tile tag _gemm_kernels gives it)."""
    return re.search(r"\bshared \d+x\d+k\d+[pdu\d]*h\b", kernel_name) is not None


def variant_of(node: Node, graph: Graph, caps: AdapterCaps) -> dict:
    """Tiling pinned by the node (benchmarks, tests, the autotuner): attrs '_gemm_variant' (register |
    shared | dot), '_gemm_block' (4 | 8 outputs per invocation along M and N), '_gemm_kt' (K tile of
    the shared variant), '_gemm_prefetch' (0 | 1: register prefetch of the next K tile | 2: that and two
    workgroup tiles, Tiling.double), '_gemm_layout'
    (comma list: "noswizzle" keeps the shared tiles' rows unpermuted, "nohoist" decodes im2col columns
    per element, "plain" both, for A/B runs), '_gemm_threads' (invocations
    per workgroup of the shared variant, 256 by default: 128 makes 128x64 tiles of the 8x8 blocks),
    '_gemm_unroll' (K steps per pass of a rolled K-tile loop: Tiling.unroll), '_gemm_tn' (outputs per
    invocation along N of the shared variant, when not _gemm_block), '_gemm_splits' (K splits, 1 for none,
    each at least 128 of K; bench_kernels' `+splits=N`), '_gemm_half' (0 | 1: f16 products, half_math)."""
    pf = node.attr("_gemm_prefetch")
    return {"variant": node.attr("_gemm_variant"), "block": node.attr("_gemm_block"), "kt": node.attr("_gemm_kt"),
            "prefetch": None if pf is None else int(pf), "layout": node.attr("_gemm_layout"),
            "threads": node.attr("_gemm_threads"), "unroll": node.attr("_gemm_unroll"), "tn": node.attr("_gemm_tn"),
            "splits": node.attr("_gemm_splits"),
            "half": half_math(node, graph, caps), "operands": operand_type(node, graph)}


def operand_type(node: Node, graph: Graph) -> str | None:
    """The WGSL type both GEMM operands hold on the device (f16 | f32), None when they differ."""
    kinds = {matrix_units.OPERAND_TYPES.get(str(np.dtype(graph.info[v].dtype)))
             if graph.info.get(v) is not None else None for v in node.inputs[:2]}
    return kinds.pop() if len(kinds) == 1 else None


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


@dataclass(frozen=True)
class Layout:
    """A logical tensor (the MatMul's view of an operand or its result) over stored memory: the
    logical shape and, per logical dim, its element stride in the stored buffer. A stored tensor
    read through `perm` (logical = transpose(stored, perm)) has stride stored_stride[perm[i]]."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @staticmethod
    def of(stored: tuple[int, ...], perm=None) -> Layout:
        """A row-major stored tensor read through `perm`."""
        return Layout.viewed(stored, _strides(stored), perm)

    @staticmethod
    def viewed(shape: tuple[int, ...], strides: tuple[int, ...], perm=None) -> Layout:
        """A strided view (gemm_layout.fold_slices) read through `perm`."""
        perm = list(perm) if perm is not None else list(range(len(shape)))
        return Layout(tuple(shape[p] for p in perm), tuple(strides[p] for p in perm))

    @staticmethod
    def stored_as(logical: tuple[int, ...], perm, stored_strides: tuple[int, ...] | None = None) -> Layout:
        """A logical result stored as transpose(logical, perm), in row-major order or, given
        `stored_strides`, at those strides (a view into a larger buffer: gemm_layout.fold_concats)."""
        if perm is None:
            return Layout(tuple(logical), stored_strides) if stored_strides else Layout.of(logical)
        st = stored_strides or _strides(tuple(logical[p] for p in perm))
        where = np.argsort(perm)
        return Layout(tuple(logical), tuple(st[where[j]] for j in range(len(logical))))

    def padded(self, rank: int) -> Layout:
        """The same tensor with leading 1s added or (size-1 ones only) dropped to `rank` dims."""
        k = rank - len(self.shape)
        if k < 0:
            assert all(d == 1 for d in self.shape[:-k])
            return Layout(self.shape[-k:], self.strides[-k:])
        return Layout((1,) * k + self.shape, (0,) * k + self.strides)

    def rows_collapse(self) -> bool:
        """Whether the batch dims and the rows are one run of rows (they fold into M)."""
        dims = [(d, st) for d, st in zip(self.shape[:-1], self.strides[:-1]) if d != 1]
        return all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))

    def row_stride(self) -> int:
        dims = [st for d, st in zip(self.shape[:-1], self.strides[:-1]) if d != 1]
        return dims[-1] if dims else 0


def _batch_offset(out_batch: tuple[int, ...], own: Layout) -> str:
    """WGSL offset of this operand's matrix for flat output batch index bt (broadcast dims stride 0)."""
    own = own.padded(len(out_batch))
    terms = []
    inner = 1
    for d in reversed(range(len(out_batch))):
        if own.shape[d] != 1:
            terms.append(f"((bt / {u(inner)}) % {u(out_batch[d])}) * {u(own.strides[d])}")
        inner *= out_batch[d]
    return " + ".join(terms) if terms else "0u"


def _operand(var: str, lay: Layout, off: str, rows: int | None = None, row_stride: int | None = None,
             base: int = 0) -> Operand:
    """Element (r, c) of a logical matrix (the last two dims of lay) at `off` (+ `base` elements:
    a view's offset); vec4 loads along whichever logical axis is contiguous in memory, where
    every other stride and the offset keep four-element groups aligned."""
    rs = lay.strides[-2] if row_stride is None else row_stride
    cs = lay.strides[-1]
    contig = 1 if cs == 1 else 0 if rs == 1 else None
    if base:
        off = f"{off} + {u(base)}"
    if contig is not None and any(st % 4 for st in (base, *lay.strides[:-2], cs if contig == 0 else rs)):
        contig = None
    return Operand(var, rows or lay.shape[-2], lay.shape[-1], f"{off} + r * {u(rs)} + c * {u(cs)}", contig=contig)


def epilogue_of(node: Node) -> dict:
    """The Output fields of a node's fused activation and of the float16 rounding between its
    fused steps (attrs set by fusion.fuse_epilogues: `_epilogue`, `_epilogue_attrs`, `_round`)."""
    return {"epilogue": node.attr("_epilogue"),
            "epilogue_attrs": tuple(sorted((node.attr("_epilogue_attrs") or {}).items())),
            "rounds": frozenset(node.attr("_round") or ())}


def _residual(node: Node, reads: list[Binding], index: str) -> str:
    """The epilogue term of a fused residual (fusion.fuse_epilogues: input 3, same shape and
    row-major order as the result, so it is read at the result's own index); binds it."""
    if not node.attr("_residual"):
        return ""
    reads.append(Binding(node.inputs[3], "Rs"))
    return f"Rs[{index}]"


def _where_mask(node: Node, graph: Graph, reads: list[Binding], M: int, N: int) -> dict:
    """The Output fields of a fused Where (fusion.fuse_epilogues: input 4 the condition, attr
    `_where` = (fill, fill where the condition is true)): attention's causal masked_fill. The
    condition broadcasts into the result, so it is read at the result's logical (row-major)
    index, whatever the result's stored layout; M, N as the kernel sees them (a batch folded
    into M leaves bt 0)."""
    got = node.attr("_where")
    if got is None:
        return {}
    fill, when = got
    cond = node.inputs[4]
    reads.append(Binding(cond, "Wc", elem=vtype(graph, cond)))
    out_shape = static_shape(graph, node.outputs[0], node)
    cs = static_shape(graph, cond, node)
    cs = (1,) * (len(out_shape) - len(cs)) + tuple(cs)
    e = f"((bt * {u(M)} + r) * {u(N)} + c)"
    used = [d for d, n in enumerate(cs) if n != 1]
    if not used:
        index = "0u"
    elif used == list(range(used[0], len(cs))) and cs[used[0]:] == tuple(out_shape[used[0]:]):
        index = f"{e} % {u(math.prod(cs))}"   # a trailing block of the result, repeated (T x T over B x H)
    else:
        ostr = [math.prod(out_shape[d + 1:]) for d in range(len(out_shape))]
        cstr = [math.prod(cs[d + 1:]) for d in range(len(cs))]
        index = " + ".join(f"(({e} / {u(ostr[d])}) % {u(out_shape[d])}) * {u(cstr[d])}" for d in used)
    test = f"(Wc[{index}] != {literal(0, vtype(graph, cond))})"
    return {"mask": test if when else f"!{test}", "fill": literal(fill, "f32")}


PROLOGUE_ATTRS = ("_prologueA", "_prologueB")


def _prologue(node: Node, op: Operand, slot: int) -> Operand:
    """The operand with the activation fusion.fuse_prologues moved into its loads (attr
    `_prologueA` / `_prologueB`: (op, attrs, its result float16)), if any."""
    got = node.attr(PROLOGUE_ATTRS[slot])
    if got is None:
        return op
    name, attrs, half = got
    return replace(op, apply=(name, tuple(sorted(dict(attrs).items()))), apply_half=bool(half))


def _epilogue_arg(node: Node, reads: list[Binding], index: str) -> str:
    """The x of a fused activation gradient (EPILOGUE_GRADS; input 3, attr `_epilogue_arg`: the
    result's shape and row-major order, so it is read at the result's own index); binds it."""
    if not node.attr("_epilogue_arg"):
        return ""
    reads.append(Binding(node.inputs[3], "Ex"))
    return f"Ex[{index}]"


def _operand_layout(node: Node, graph: Graph, slot: int) -> tuple[Layout, int]:
    """(layout, element offset) of MatMul operand `slot` as the kernel reads it: the stored
    tensor, or a strided view of it (attr `_viewA`/`_viewB`, gemm_layout.fold_slices), through its
    perm (`_permA`/`_permB`); a vector is a row of A or a column of B."""
    view = node.attr(("_viewA", "_viewB")[slot])
    perm = node.attr(("_permA", "_permB")[slot])
    if view is not None:
        shape, strides, offset = view
        return Layout.viewed(tuple(shape), tuple(strides), perm), int(offset)
    s = static_shape(graph, node.inputs[slot], node)
    if len(s) > 1:
        return Layout.of(s, perm), 0
    return (Layout((1,) + s, (0, 1)) if slot == 0 else Layout(s + (1,), (1, 0))), 0


@lowering("MatMul", epilogue=True)
def lower_matmul(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    """Batched, broadcasting MatMul over operands and a result in any layout.

    The layouts come from gemm_layout.py:
    - `_permA` / `_permB`: the operand is stored untransposed and the MatMul reads
      transpose(stored, perm), so a Transpose feeding it costs no kernel (x @ W.T, attention's K^T
      and its head split); `_permY`: the result is stored as transpose(result, perm) (attention's
      head merge);
    - `_viewA` / `_viewB`: the operand is a strided view (shape, strides, offset) of the bound
      tensor; `_intoY`: the stored result lies at such a view inside the bound output, a Concat's;
    - `_alpha`: scales the product, before the bias.
    An optional third input (fusion.fuse_epilogues) is a bias along the result's last axis."""
    la, base_a = _operand_layout(node, graph, 0)
    lb, base_b = _operand_layout(node, graph, 1)
    M, K, N = la.shape[-2], la.shape[-1], lb.shape[-1]
    out_batch = tuple(np.broadcast_shapes(la.shape[:-2], lb.shape[:-2]))
    perm_y = node.attr("_permY")
    if perm_y is not None:  # the batch rank the perm was written for (operands seen through reshapes
        # of single matrices may have gained or lost leading 1s since)
        out_batch = Layout(out_batch, (0,) * len(out_batch)).padded(len(perm_y) - 2).shape
    into = node.attr("_intoY")   # (shape, strides, offset) of the stored result in the buffer it joins
    if into is not None:
        out_batch = Layout(out_batch, (0,) * len(out_batch)).padded(len(into[0]) - 2).shape
    ly = Layout.stored_as(out_batch + (M, N), perm_y, tuple(into[1]) if into is not None else None)
    y_base = int(into[2]) if into is not None else 0
    if (int(np.prod(lb.shape[:-2], dtype=np.int64)) == 1 and la.rows_collapse() and ly.rows_collapse()
            and M * int(np.prod(out_batch, dtype=np.int64)) > M):
        # B is one matrix and A's and Y's rows run on across the batch: the batch folds into M
        rows = M * int(np.prod(out_batch, dtype=np.int64))
        a = _operand("A", la, "0u", rows, la.row_stride(), base=base_a)
        ly_rs, y_off = ly.row_stride(), "0u"
        out_batch = ()
        M = rows
    else:
        a = _operand("A", la, _batch_offset(out_batch, Layout(la.shape[:-2], la.strides[:-2])), base=base_a)
        ly_rs, y_off = ly.strides[-2], _batch_offset(out_batch, Layout(ly.shape[:-2], ly.strides[:-2]))
    b = _operand("B", lb, _batch_offset(out_batch, Layout(lb.shape[:-2], lb.strides[:-2])), base=base_b)
    batch = int(np.prod(out_batch, dtype=np.int64))
    reads = [Binding(node.inputs[0], "A"), Binding(node.inputs[1], "B")]
    bias = ""
    if node.input(2):
        sc = static_shape(graph, node.inputs[2], node)
        bias = f"Cb[c * {u(1 if sc and sc[-1] != 1 else 0)}]"
        reads.append(Binding(node.inputs[2], "Cb"))
    y_index = f"{y_off} + r * {u(ly_rs)} + c * {u(ly.strides[-1])}" + (f" + {u(y_base)}" if y_base else "")
    # vec4 stores where four consecutive results are four aligned elements
    vec_y = N % 4 == 0 and ly.strides[-1] == 1 and not any(st % 4 for st in (y_base, ly_rs, *ly.strides[:-2]))
    out = Output("Y", y_index, contig=vec_y, alpha=float(node.attr("_alpha", 1.0)), bias=bias,
                 residual=_residual(node, reads, y_index), operand=_epilogue_arg(node, reads, y_index),
                 **epilogue_of(node), **_where_mask(node, graph, reads, M, N))
    spec = GemmSpec("MatMul", M, N, K, batch, _prologue(node, a, 0), _prologue(node, b, 1), out, tuple(reads),
                    Binding(node.outputs[0], "Y"))
    return gemm_kernels(spec, caps, **variant_of(node, graph, caps))


@lowering("Gemm", epilogue=True)
def lower_gemm(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    # operands are matrices, maybe with leading 1s (gemm_layout.fold_transposes looks through reshapes)
    sa = static_shape(graph, node.inputs[0], node)[-2:]
    sb = static_shape(graph, node.inputs[1], node)[-2:]
    ta, tb = node.attr("transA", 0), node.attr("transB", 0)
    M, K = (sa[1], sa[0]) if ta else sa
    N = sb[0] if tb else sb[1]
    a = (Operand("A", M, K, f"c * {u(M)} + r", contig=0) if ta
         else Operand("A", M, K, f"r * {u(K)} + c", contig=1))
    b = (Operand("B", K, N, f"c * {u(K)} + r", contig=0) if tb
         else Operand("B", K, N, f"r * {u(N)} + c", contig=1))
    reads = [Binding(node.inputs[0], "A"), Binding(node.inputs[1], "B")]
    bias = ""
    if node.input(2):
        sc = static_shape(graph, node.inputs[2], node)
        sc = (1,) * (2 - len(sc)) + sc
        sr = sc[1] if sc[0] != 1 else 0
        scc = 1 if sc[1] != 1 else 0
        beta = node.attr("beta", 1.0)
        bias = f"Cb[r * {u(sr)} + c * {u(scc)}]" + (f" * {f(beta)}" if beta != 1.0 else "")
        reads.append(Binding(node.inputs[2], "Cb"))
    out = Output("Y", f"r * {u(N)} + c", contig=N % 4 == 0, alpha=node.attr("alpha", 1.0), bias=bias,
                 residual=_residual(node, reads, f"r * {u(N)} + c"),
                 operand=_epilogue_arg(node, reads, f"r * {u(N)} + c"), **epilogue_of(node),
                 **_where_mask(node, graph, reads, M, N))
    spec = GemmSpec("Gemm", M, N, K, 1, _prologue(node, a, 0), _prologue(node, b, 1), out, tuple(reads),
                    Binding(node.outputs[0], "Y"))
    return gemm_kernels(spec, caps, **variant_of(node, graph, caps))
