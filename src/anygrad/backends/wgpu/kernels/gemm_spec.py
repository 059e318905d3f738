"""What a GEMM is, for kernels_gemm.py: a `GemmSpec` (sizes, the bound buffers, how to fetch an
element of A and B: `Operand`, where results go: `Output`), the epilogues a GEMM may apply, and
the `Tiling` chosen for a spec on an adapter (choose_tiling), with the workgroup grid it spans.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ....errors import ShapeError
from .kernel import AdapterCaps, Kernel

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
class TapGather:
    """An implicit-GEMM B operand one of whose axes runs (tap, channel): index tap * channels +
    channel. axis 0: K does (a conv's forward and input gradient, whose K is taps x channels);
    axis 1: N does (the weight gradient, whose columns are the weight's).

    Element (tap, channel) at the other coordinate x lies at `base + channel * stride` where `ok`
    holds, and both depend only on the tap and x. So the matrix-unit copies decode a tap once for
    many channels: a K tile that stays within one tap (axis 0, channels a multiple of the tile
    depth) once per invocation and tile; four neighbouring columns (axis 1) once per four. The
    plain (channel, tap) order decodes both for every element, which held ResNet-50's
    convolutions on matrix units to 12-28 TFLOP/s (H200) against 178 for a GEMM."""

    channels: int
    stride: int
    prelude: str     # WGSL of bt, tap and x (c for axis 0, r for axis 1) defining what base and ok use
    base: str        # u32 index of channel 0 at (tap, x)
    ok: str = ""     # (tap, x) reads inside the input ("" always)
    axis: int = 0

    def operand(self, var: str, rows: int, cols: int) -> Operand:
        """The same operand element by element (any kernel's loaders)."""
        t = "r" if self.axis == 0 else "c"
        return Operand(var, rows, cols, f"({self.base}) + ch * {u(self.stride)}",
                       prelude=f"let tap = {t} / {u(self.channels)}; let ch = {t} % {u(self.channels)}; {self.prelude}",
                       valid=self.ok, taps=self)


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
    taps: TapGather | None = None     # the same elements by tap (a B operand of a tap-major GemmSpec)

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
    # the same product with K ordered (tap, channel) for kernels that stage whole K tiles (matrix
    # units), and the kernels that must run before it (a weight copy in that order)
    tap_major: TapMajor | None = None


@dataclass(frozen=True)
class TapMajor:
    spec: GemmSpec                  # B is a TapGather operand; A may read `before`'s output
    before: tuple[Kernel, ...] = ()  # a weight permutation, with the Scratch it writes


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


def _target_invocations(caps: AdapterCaps) -> int:
    """Invocations that keep the adapter busy: a few workgroups per core on a CPU adapter; on a
    GPU about half of what its multiprocessors hold (e.g. 132 SMs x 2048 on an H200)."""
    return 2048 if caps.is_cpu else 128 * 1024
