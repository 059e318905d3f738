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

The GEMM in four modules: gemm_spec.py (what a GEMM is: GemmSpec, Operand, Output, and the
Tiling chosen for it), gemm_wgsl.py (a spec + tiling -> the tiled WGSL), gemm_splitk.py (split K
and its reduce kernel, the dot-product variant for long K), and this one (the kernel list for a
spec, and the MatMul / Gemm lowerings reading a node's layouts, prologues and epilogues).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from .... import settings
from ....errors import ShapeError
from ....ir.graph import Graph, Node
from . import matrix_units
from .gemm_spec import Binding, GemmSpec, Operand, Output, choose_tiling, f, u
from .gemm_splitk import _split_pair, choose_splits, dot_kernels, use_dot
from .gemm_wgsl import F16_MATH_ENV, gemm_wgsl
from .halfstore import with_conversions
from .kernel import AdapterCaps, Kernel, lowering
from .wgsl import literal, vtype


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
        # the rules (prefetch None): register prefetch, and double tiles on the widest plans
        kernels = mma_kernels(spec, caps, operands, allow_split, block, kt, threads, splits,
                              None if prefetch is None else int(prefetch),
                              lane_tiles="rowtiles" not in (layout or "").split(","))
    else:
        before: list[Kernel] = []
        if spec.tap_major is not None and "bytap" in (layout or "").split(","):
            # the ALU kernels read the tap-major form element by element (tests, A/B runs)
            spec, before = spec.tap_major.spec, list(spec.tap_major.before)
        kernels = before + _gemm_kernels(spec, caps, variant, allow_split, block, kt, prefetch, layout, threads,
                                         unroll, tn, splits, half)
    if spec.out.rounds or spec.a.apply_half or spec.b.apply_half:  # f16 values held in registers (_rounded)
        kernels = [replace(k, wgsl=with_conversions(k.wgsl)) if "f16(" in k.wgsl else k for k in kernels]
    flops = 2 * spec.batch * spec.M * spec.N * spec.K
    first = next(i for i, k in enumerate(kernels) if k.name.startswith(spec.name))  # after a tap-major weight copy
    return kernels[:first] + [replace(kernels[first], flops=flops)] + kernels[first + 1:]


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
    per element, "plain" both, for A/B runs; "bytap": a conv's tap-major form, GemmSpec.tap_major, which
    the matrix-unit kernels take by themselves), '_gemm_threads' (invocations
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
        """A strided view (gemm_layout.fold_views) read through `perm`."""
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


# Where fusion.fuse_epilogues puts the values a GEMM's (or a convolution input gradient's)
# epilogue reads, after the operands: one slot each, so that any of them can come together (an
# unused slot is "").
EPILOGUE_INPUTS = {"bias": 2, "residual": 3, "where": 4, "activation_x": 5}


def residual_arg(node: Node, reads: list[Binding], index: str) -> str:
    """The epilogue term of a fused residual (fusion.fuse_epilogues: EPILOGUE_INPUTS["residual"],
    same shape and row-major order as the result, so it is read at the result's own index); binds it."""
    if not node.attr("_residual"):
        return ""
    reads.append(Binding(node.inputs[EPILOGUE_INPUTS["residual"]], "Rs"))
    return f"Rs[{index}]"


def _where_mask(node: Node, graph: Graph, reads: list[Binding], M: int, N: int) -> dict:
    """The Output fields of a fused Where (fusion.fuse_epilogues: EPILOGUE_INPUTS["where"], attr
    `_where` = (fill, fill where the condition is true)): attention's causal masked_fill. The
    condition broadcasts into the result, so it is read at the result's logical (row-major)
    index, whatever the result's stored layout; M, N as the kernel sees them (a batch folded
    into M leaves bt 0)."""
    got = node.attr("_where")
    if got is None:
        return {}
    fill, when = got
    cond = node.inputs[EPILOGUE_INPUTS["where"]]
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


def epilogue_arg(node: Node, reads: list[Binding], index: str) -> str:
    """The x of a fused activation gradient (EPILOGUE_GRADS; EPILOGUE_INPUTS["activation_x"], attr
    `_epilogue_arg`: the result's shape and row-major order, so it is read at the result's own
    index); binds it."""
    if not node.attr("_epilogue_arg"):
        return ""
    reads.append(Binding(node.inputs[EPILOGUE_INPUTS["activation_x"]], "Ex"))
    return f"Ex[{index}]"


def _operand_layout(node: Node, graph: Graph, slot: int) -> tuple[Layout, int]:
    """(layout, element offset) of MatMul operand `slot` as the kernel reads it: the stored
    tensor, or a strided view of it (attr `_viewA`/`_viewB`, gemm_layout.fold_views), through its
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
                 residual=residual_arg(node, reads, y_index), operand=epilogue_arg(node, reads, y_index),
                 **epilogue_of(node), **_where_mask(node, graph, reads, M, N))
    spec = GemmSpec("MatMul", M, N, K, batch, _prologue(node, a, 0), _prologue(node, b, 1), out, tuple(reads),
                    Binding(node.outputs[0], "Y"))
    return gemm_kernels(spec, caps, **variant_of(node, graph, caps))


def _gemm_operand(node: Node, graph: Graph, slot: int) -> Operand:
    """Gemm operand `slot` as multiplied (transposed where transA / transB): the stored matrix,
    or a strided view of the bound tensor (attr `_viewA`/`_viewB`, gemm_layout.fold_views: a
    slice, gather or transpose chain that only this Gemm reads). Operands are matrices, maybe
    with leading 1s (gemm_layout.fold_transposes looks through reshapes)."""
    var = ("A", "B")[slot]
    trans = node.attr(("transA", "transB")[slot], 0)
    view = node.attr(("_viewA", "_viewB")[slot])
    if view is not None:
        shape, strides, offset = view
        lay = Layout.viewed(tuple(shape[-2:]), tuple(strides[-2:]), (1, 0) if trans else None)
        return _operand(var, lay, "0u", base=int(offset))
    rows, cols = static_shape(graph, node.inputs[slot], node)[-2:]
    if trans:
        return Operand(var, cols, rows, f"c * {u(cols)} + r", contig=0)
    return Operand(var, rows, cols, f"r * {u(cols)} + c", contig=1)


@lowering("Gemm", epilogue=True)
def lower_gemm(node: Node, graph: Graph, caps: AdapterCaps) -> list[Kernel]:
    a, b = _gemm_operand(node, graph, 0), _gemm_operand(node, graph, 1)
    M, K, N = a.rows, a.cols, b.cols
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
                 residual=residual_arg(node, reads, f"r * {u(N)} + c"),
                 operand=epilogue_arg(node, reads, f"r * {u(N)} + c"), **epilogue_of(node),
                 **_where_mask(node, graph, reads, M, N))
    spec = GemmSpec("Gemm", M, N, K, 1, _prologue(node, a, 0), _prologue(node, b, 1), out, tuple(reads),
                    Binding(node.outputs[0], "Y"))
    return gemm_kernels(spec, caps, **variant_of(node, graph, caps))
