"""Statistics of rows along one axis, split across workgroups when rows are long and few: the
step softmax, log-softmax, cross-entropy and the accuracy counts share.

A row (outer x length x inner: element k of row r at base(r) + k * inner) is cut into `parts`
contiguous chunks. One workgroup per (row, part) reads its chunk once and keeps, per invocation,
an online max and sum of exp(v - max) (rescaled when the max grows), the first index of the
max, a count of elements above a per-row value, and plain sums; workgroup reductions (max,
then the rescaled sums) combine them, and the workgroup writes one record. A second pass
combines the `parts` records of a row in order. Short rows take one invocation each and no
workgroup reduction; rows taken whole otherwise go several to a workgroup, a run of lanes each
(`row_lanes`, `lane_kernel`: the softmax rows; kernels_norm.py's rows use the same walk and
combine). Every combine runs in a fixed order: the same bits on every run, no atomics.

Rows are split only as far as the GPU needs: about TARGET_GROUPS workgroups in all, and never
into chunks shorter than SPLIT_MIN (tests lower both to reach the split path on small shapes).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .kernel import Kernel, Scratch
from .wgreduce import Part, reduce_code, shared_decl
from .wgsl import bindings, flat_id, grid, group_id, groups_grid, shader

SERIAL_MAX = 64        # rows up to this long: one invocation per row, no workgroup reduction
SPLIT_MIN = 4096       # a row is split only into chunks of at least this many elements
TARGET_GROUPS = 2048   # split rows until about this many workgroups run
NEG = "-3.4028234663852886e38"  # the lowest finite f32 (masks use it): the max's starting value
NONE = "0xffffffffu"   # no index yet


@dataclass(frozen=True)
class Rows:
    """`rows` rows of `length` elements, element k of row r at base(r) + k * inner."""

    rows: int
    length: int
    inner: int = 1

    def base(self, row: str) -> str:
        if self.inner == 1:
            return f"{row} * {self.length}u"
        return f"({row} / {self.inner}u) * {self.length * self.inner}u + {row} % {self.inner}u"

    def row_of(self, e: str) -> str:
        """The row of flat element index e (an expression)."""
        if self.inner == 1:
            return f"{e} / {self.length}u"
        return f"({e} / {self.length * self.inner}u) * {self.inner}u + {e} % {self.inner}u"

    def index_of(self, e: str) -> str:
        """The position along the row of flat element index e."""
        return f"{e} % {self.length}u" if self.inner == 1 else f"({e} / {self.inner}u) % {self.length}u"


@dataclass(frozen=True)
class Stats:
    """What a pass over a row computes; the results are `let`s named r_m, r_s, r_arg, r_cnt, r_sum{j}.

    softmax: r_m = max and r_s = sum of exp(v - r_m); argmax: r_arg = first index of the max;
    greater: a per-row WGSL value, r_cnt = elements strictly above it; sums: WGSL terms (in v,
    the element, k, its index, e, its flat index) summed into r_sum{j}."""

    softmax: bool = False
    argmax: bool = False
    greater: str = ""
    sums: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        """f32 slots of one (row, part) record: m, s, arg, cnt, sums."""
        return 4 + len(self.sums)


def parts(r: Rows) -> int:
    """How many chunks each row is cut into (1: not split)."""
    if r.length <= SERIAL_MAX:
        return 1
    want = min(-(-r.length // SPLIT_MIN), -(-TARGET_GROUPS // r.rows))
    if want <= 1:
        return 1
    return -(-r.length // -(-r.length // want))  # no empty chunk


def lanes(r: Rows, p: int) -> int:
    """Invocations per (row, part): 1 for short rows, else a workgroup sized to the chunk."""
    if r.length <= SERIAL_MAX:
        return 1
    return 256 if -(-r.length // p) >= 2048 else 64


def _acc_init(st: Stats) -> list[str]:
    lines = [f"  var a_m = {NEG};", "  var a_s = 0.0;", f"  var a_arg = {NONE};", "  var a_cnt = 0u;"]
    return lines + [f"  var a_sum{j} = 0.0;" for j in range(len(st.sums))]


def _acc_update(st: Stats) -> list[str]:
    """Statements folding element v (index k, flat index e) into the a_* accumulators."""
    body = []
    # The first element always starts the max (a row may hold only the lowest f32, or -inf);
    # an element equal to the max adds exp(0) even when both are -inf (masked leading elements).
    if st.softmax:  # online softmax: rescale the sum when the max grows
        body.append(f"if (v > a_m || a_arg == {NONE}) {{ a_s = select(0.0, a_s * exp(a_m - v), a_arg != {NONE}) "
                    "+ 1.0; a_m = v; a_arg = k; } else { a_s += select(exp(v - a_m), 1.0, v == a_m); }")
    elif st.argmax:
        body.append(f"if (v > a_m || a_arg == {NONE}) {{ a_m = v; a_arg = k; }}")
    if st.greater:
        body.append(f"a_cnt += select(0u, 1u, v > {st.greater});")
    return body + [f"a_sum{j} += {term};" for j, term in enumerate(st.sums)]


def _accumulate(r: Rows, st: Stats, src: str, lo: str, hi: str, step: str) -> str:
    body = [f"let e = base + k * {r.inner}u;", f"let v = {src}[e];"] + _acc_update(st)
    loop = f"  for (var k = {lo}; k < {hi}; k += {step}) {{ {' '.join(body)} }}"
    return "\n".join(_acc_init(st) + [loop])


def _results(st: Stats, prefix: str) -> str:
    out = [f"  let r_m = {prefix}_m;", f"  let r_s = {prefix}_s;", f"  let r_arg = {prefix}_arg;",
           f"  let r_cnt = {prefix}_cnt;"]
    out += [f"  let r_sum{j} = {prefix}_sum{j};" for j in range(len(st.sums))]
    return "\n".join(out)


def _group_parts(st: Stats) -> tuple[list[Part], list[Part]]:
    """(the max, the rest) combined over a workgroup; the rest is taken after the max is known."""
    first = [Part("a_m", "r_m", "max({a}, {b})", NEG)] if st.softmax or st.argmax else []
    rest = []
    if st.softmax:
        rest.append(Part(f"select(0.0, a_s * exp(a_m - r_m), a_arg != {NONE})", "r_s"))  # idle lanes add 0
    if st.argmax:
        rest.append(Part(f"select({NONE}, a_arg, a_m == r_m)", "r_arg", "min({a}, {b})", NONE, "u32"))
    if st.greater:
        rest.append(Part("a_cnt", "r_cnt", init="0u", ty="u32"))
    rest += [Part(f"a_sum{j}", f"r_sum{j}") for j in range(len(st.sums))]
    return first, rest


def _combine_stats(st: Stats, wg: int, sg: bool, seg: int = 0) -> tuple[list[str], str]:
    """(statements combining the a_* of each invocation into the r_* lets over the workgroup, or
    over each `seg` invocations, workgroup declarations)."""
    code = []
    first, rest = _group_parts(st)
    if first:
        code.append(reduce_code(first, wg, sg, sh="shm", seg=seg))
    if rest:
        code.append(reduce_code(rest, wg, sg, sh="shs", seg=seg))
    names = {p.result for p in first + rest}
    defaults = {"r_m": NEG, "r_s": "0.0", "r_arg": NONE, "r_cnt": "0u"}
    code += [f"  let {k} = {v};" for k, v in defaults.items() if k not in names]
    return code, shared_decl(first, wg, "shm") + "\n" + shared_decl(rest, wg, "shs")


def stats_code(r: Rows, st: Stats, src: str, n_lanes: int, lo: str, hi: str, sg: bool) -> tuple[str, str]:
    """(statements computing the r_* lets over elements [lo, hi) of the row at `base`, workgroup
    declarations). n_lanes 1: one invocation walks the range; else the workgroup strides it."""
    if n_lanes == 1:
        return _accumulate(r, st, src, lo, hi, "1u") + "\n" + _results(st, "a"), ""
    code, shared = _combine_stats(st, n_lanes, sg)
    return "\n".join([_accumulate(r, st, src, f"{lo} + lid.x", hi, f"{n_lanes}u")] + code), shared


def partial_kernel(name: str, r: Rows, st: Stats, src: str, reads: list[tuple[str, str, str]], prelude: str,
                   record: str, sg: bool) -> Kernel:
    """One record of `st.width` f32 per (row, part) into scratch `record`; reads: (var, type,
    value) with `src` among them; prelude: per-row lets (row, base in scope) the terms use."""
    p = parts(r)
    n_lanes = lanes(r, p)
    chunk = -(-r.length // p)
    w = st.width
    if n_lanes == 1:
        head = [f"  {flat_id(64)}", f"  if (i >= {r.rows}u) {{ return; }}", "  let row = i;", "  let slot = i;"]
        lo, hi = "0u", f"{r.length}u"
    else:
        head = [f"  {group_id()}", f"  if (g >= {r.rows * p}u) {{ return; }}", f"  let row = g / {p}u;",
                "  let slot = g;", f"  let lo = (g % {p}u) * {chunk}u;", f"  let hi = min(lo + {chunk}u, {r.length}u);"]
        lo, hi = "lo", "hi"
    code, shared = stats_code(r, st, src, n_lanes, lo, hi, sg)
    store = [f"rec[slot * {w}u] = r_m;", f"rec[slot * {w}u + 1u] = r_s;", f"rec[slot * {w}u + 2u] = f32(r_arg);",
             f"rec[slot * {w}u + 3u] = f32(r_cnt);"]
    store += [f"rec[slot * {w}u + {4 + j}u] = r_sum{j};" for j in range(len(st.sums))]
    guard = "if (lid.x == 0u) " if n_lanes > 1 else ""
    body = "\n".join(head + [f"  let base = {r.base('row')};", prelude, code, f"  {guard}{{ {' '.join(store)} }}"])
    decls = bindings([(v, ty) for v, ty, _ in reads], [("rec", "f32")])
    src_text = shader(decls, body, wg=64 if n_lanes == 1 else n_lanes, shared=shared, subgroups=sg and n_lanes > 1)
    dims = grid(r.rows, 64) if n_lanes == 1 else groups_grid(r.rows * p)
    return Kernel(f"{name}:{'partial' if p > 1 else 'stats'}", src_text, dims, tuple(v for _, _, v in reads), (record,),
                  scratch=(Scratch(record, r.rows * p * w),))


def combine_code(r: Rows, st: Stats, rec: str = "rec") -> str:
    """Statements giving the r_* lets of row `row` from its records, the parts in order."""
    p, w = parts(r), st.width
    if p == 1:
        out = [f"  let rb = row * {w}u;", f"  let r_m = {rec}[rb];", f"  let r_s = {rec}[rb + 1u];",
               f"  let r_arg = u32({rec}[rb + 2u]);", f"  let r_cnt = u32({rec}[rb + 3u]);"]
        return "\n".join(out + [f"  let r_sum{j} = {rec}[rb + {4 + j}u];" for j in range(len(st.sums))])
    lines = [f"  let rb = row * {p * w}u;", f"  var c_m = {rec}[rb];",
             f"  for (var q = 1u; q < {p}u; q += 1u) {{ c_m = max(c_m, {rec}[rb + q * {w}u]); }}",
             "  var c_s = 0.0;", f"  var c_arg = {NONE};", "  var c_cnt = 0u;"]
    lines += [f"  var c_sum{j} = 0.0;" for j in range(len(st.sums))]
    step = [f"let o = rb + q * {w}u;", f"let mq = {rec}[o];", f"c_s += {rec}[o + 1u] * exp(mq - c_m);",
            f"if (c_arg == {NONE} && mq == c_m) {{ c_arg = u32({rec}[o + 2u]); }}",
            f"c_cnt += u32({rec}[o + 3u]);"]
    step += [f"c_sum{j} += {rec}[o + {4 + j}u];" for j in range(len(st.sums))]
    lines.append(f"  for (var q = 0u; q < {p}u; q += 1u) {{ {' '.join(step)} }}")
    return "\n".join(lines) + "\n" + _results(st, "c")


# -- several rows a workgroup ---------------------------------------------------------------------
# Many short rows (attention probabilities, 128 long; LayerNorm's, 256-1024) are too short for a
# workgroup each: its invocations hold an element or two, load one f32 at a time, then combine
# over the whole workgroup. Instead a workgroup of GROUP_WG invocations takes GROUP_WG / lanes
# rows side by side, `lanes` consecutive invocations a row (reads coalesce: a row's lanes read
# neighbouring elements). A lane loads LANE_LOADS elements at once, every load ahead of its use
# (bytes in flight), and each row's lanes combine their values in their own slice of workgroup
# memory (wgreduce's segmented tree: fixed order, any subgroup size).
GROUP_WG = 256
LANE_LOADS = 4          # elements a lane loads at once
SHORT_LANES = 32        # a row takes at most this many lanes while one step of loads covers it ...
LANE_STEPS = 8          # ... and more only past this many steps a lane,
TARGET_INVOCATIONS = 65536  # or while the rows hold fewer invocations than this (few rows)
def row_path(length: int) -> str:
    """How rows taken whole run: 'row' (an invocation a row: rows up to SERIAL_MAX) or 'lanes'
    (several rows a workgroup)."""
    return "row" if length <= SERIAL_MAX else "lanes"


def row_lanes(rows: int, length: int) -> int:
    """Invocations a row (a power of two dividing GROUP_WG): enough that one step of LANE_LOADS
    loads a lane covers a short row (up to SHORT_LANES), doubled while a lane would take more
    than LANE_STEPS steps, or while few rows leave the GPU idle and a lane has more than a step."""
    lanes = 1
    while lanes < SHORT_LANES and lanes * LANE_LOADS < length:
        lanes *= 2

    def wider() -> bool:
        covered = lanes * LANE_LOADS
        return length > covered * LANE_STEPS or (rows * lanes < TARGET_INVOCATIONS and length > covered)

    while lanes < GROUP_WG and wider():
        lanes *= 2
    return lanes


def group_head(rows: int, lanes: int) -> list[str]:
    """Statements giving `row` (may be past the last: see live()) and `ln`, the lane in the row."""
    return [f"  {group_id()}", f"  let row = g * {GROUP_WG // lanes}u + lid.x / {lanes}u;",
            f"  let ln = lid.x % {lanes}u;"]


def group_grid(rows: int, lanes: int) -> tuple[int, int, int]:
    return groups_grid(-(-rows // (GROUP_WG // lanes)))


def live(code: str, rows: int, lanes: int) -> str:
    """`code` for rows that exist only: the last workgroup's spare rows still reach the barriers."""
    if rows % (GROUP_WG // lanes) == 0:
        return code
    return f"  if (row < {rows}u) {{\n{code}\n  }}"


def lane_loop(length: int, lanes: int, body: str, loads: Sequence[tuple[str, str]] = ()) -> str:
    """Lane `ln`'s walk over k = ln, ln + lanes, ... < length, LANE_LOADS elements a step: the
    `loads` ((name, WGSL with {k})) of all of them first, then `body` (k and the loads' names in
    scope) for each in order. Whole steps run unguarded (straight-line, so the driver issues their
    loads together); one guarded step ends the row when length is not a multiple of a step."""
    u, span = LANE_LOADS, lanes * LANE_LOADS
    lines = ["  {", "  var k0 = ln;"]
    if (u - 1) * lanes < length:  # some lane has a whole step
        fetch = [f"let k_{j} = k0 + {j * lanes}u;" for j in range(u)]
        fetch += [f"let {n}_{j} = {t.format(k=f'k_{j}')};" for j in range(u) for n, t in loads]
        uses = [" ".join([f"{{ let k = k_{j};"] + [f"let {n} = {n}_{j};" for n, _ in loads] + [body, "}"])
                for j in range(u)]
        lines += [f"  for (; k0 + {(u - 1) * lanes}u < {length}u; k0 += {span}u) {{",
                  "    " + " ".join(fetch)] + [f"    {x}" for x in uses] + ["  }"]
    if length % span:
        for j in range(u):
            got = " ".join(f"let {n} = {t.format(k='k')};" for n, t in loads)
            lines.append(f"  {{ let k = k0 + {j * lanes}u; if (k < {length}u) {{ {got} {body} }} }}")
    lines.append("  }")
    return "\n".join(lines)


def lane_stats(r: Rows, st: Stats, src: str, lanes: int) -> tuple[str, str]:
    """(statements computing the r_* lets of each row of a grouped workgroup, every lane holding
    them; workgroup declarations). `row`, `ln` and `base` in scope."""
    elem = " ".join([f"let e = base + k * {r.inner}u;"] + _acc_update(st))
    walk = lane_loop(r.length, lanes, elem, [("v", f"{src}[base + {{k}} * {r.inner}u]")])
    code, shared = _combine_stats(st, GROUP_WG, False, seg=lanes)
    return "\n".join(_acc_init(st) + [live(walk, r.rows, lanes)] + code), shared


def lane_kernel(name: str, r: Rows, st: Stats, reads: list[tuple[str, str, str]], store: str,
                out: str) -> Kernel:
    """Statistics of each row, then out[e] = `store` (in e and the r_* lets) for its elements,
    several rows a workgroup; reads: (var, type, value), the statistics over reads[0]'s."""
    lanes = row_lanes(r.rows, r.length)
    code, shared = lane_stats(r, st, reads[0][0], lanes)
    write = lane_loop(r.length, lanes, f"let e = base + k * {r.inner}u; y0[e] = {store};")
    body = "\n".join(group_head(r.rows, lanes) + [f"  let base = {r.base('row')};", code,
                                                   live(write, r.rows, lanes)])
    decls = bindings([(v, ty) for v, ty, _ in reads], [("y0", "f32")])
    return Kernel(f"{name}:rows{GROUP_WG // lanes}x{lanes}", shader(decls, body, wg=GROUP_WG, shared=shared),
                  group_grid(r.rows, lanes), tuple(v for _, _, v in reads), (out,))


# -- sums over rows ---------------------------------------------------------------------------------
ROWS_WG = 256
ROW_VARS = 2  # s0, s1 always exist for per_row (a pass with no sums may still use them)


def row_pass(name: str, rows: int, reads: list[tuple[str, str, str]], writes: list[tuple[str, str, str]],
             per_row: str, sums: list[str], final: str, final_reads: list[tuple[str, str, str]],
             final_writes: list[tuple[str, str, str]], scratch: tuple[Scratch, ...], sg: bool) -> list[Kernel]:
    """One invocation per row runs `per_row` (with `row` in scope; it assigns the f32 vars s0..
    that `sums` names, s0 and s1 at least, and may write per-row outputs), each workgroup adds up its rows' s0.., and a
    single workgroup then adds the workgroups' sums in order and runs `final` with the totals
    t0... reads / writes: (var, type, value). With no sums there is no second kernel."""
    blocks = -(-rows // ROWS_WG)
    m = len(sums)
    blk = f"{name}.blocks"
    sc = tuple(scratch) + ((Scratch(blk, blocks * m),) if m else ())
    lines = [f"  {flat_id(ROWS_WG)}", "  let row = i;"] + [f"  var s{j} = 0.0;" for j in range(max(m, ROW_VARS))]
    lines.append(f"  if (row < {rows}u) {{\n{per_row}\n  }}")
    totals = [Part(f"s{j}", f"t{j}") for j in range(m)]
    all_writes = list(writes)
    if m:  # every invocation reaches the reduction: no early return above
        lines.append(reduce_code(totals, ROWS_WG, sg))
        g = "(wid.x + wid.y * nwg.x)"
        lines.append(f"  if (lid.x == 0u) {{ {' '.join(f'blk[{g} * {m}u + {j}u] = t{j};' for j in range(m))} }}")
        all_writes.append(("blk", "f32", blk))
    decls = bindings([(v, ty) for v, ty, _ in reads], [(v, ty) for v, ty, _ in all_writes])
    k1 = Kernel(f"{name}:rows", shader(decls, "\n".join(lines), wg=ROWS_WG, shared=shared_decl(totals, ROWS_WG) if m
                                       else "", subgroups=sg and bool(m)),
                grid(rows, ROWS_WG), tuple(v for _, _, v in reads), tuple(v for _, _, v in all_writes), scratch=sc)
    if not m:
        return [k1]
    body = [f"  var s{j} = 0.0;" for j in range(m)]
    body.append(f"  for (var b = lid.x; b < {blocks}u; b += {ROWS_WG}u) {{ "
                + " ".join(f"s{j} += blk[b * {m}u + {j}u];" for j in range(m)) + " }")
    body += [reduce_code(totals, ROWS_WG, sg), f"  if (lid.x == 0u) {{\n{final}\n  }}"]
    reads2 = list(final_reads) + [("blk", "f32", blk)]
    decls2 = bindings([(v, ty) for v, ty, _ in reads2], [(v, ty) for v, ty, _ in final_writes])
    k2 = Kernel(f"{name}:sum", shader(decls2, "\n".join(body), wg=ROWS_WG, shared=shared_decl(totals, ROWS_WG),
                                      subgroups=sg),
                (1, 1, 1), tuple(v for _, _, v in reads2), tuple(v for _, _, v in final_writes), scratch=sc)
    return [k1, k2]
