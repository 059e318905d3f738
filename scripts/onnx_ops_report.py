"""Run ONNX's node conformance cases against anygrad and write docs/onnx-ops.md.

    python scripts/onnx_ops_report.py                      # numpy; writes docs/onnx-ops.md
    python scripts/onnx_ops_report.py --wgpu               # numpy and wgpu
    python scripts/onnx_ops_report.py --json results.json  # also keep the raw per-case results
    python scripts/onnx_ops_report.py --from-json results.json   # regenerate the page only
    python scripts/onnx_ops_report.py --failures           # print failing cases (for the xfail list)
    python scripts/onnx_ops_report.py --from-xfail         # the page from the expected-failure lists

Each case runs exactly as `onnx.backend.test.BackendTest` runs it (prepare, run each data set,
`Runner.assert_similar_outputs`), so these numbers match tests/test_onnx_conformance.py.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "onnx-ops.md"


@dataclass
class CaseResult:
    name: str       # e.g. test_abs
    op: str         # the ONNX op under test (for *_expanded cases: the function op they expand)
    expanded: bool  # the case runs the op's function body (primitive ops), not the op itself
    device: str     # "cpu" or "wgpu"
    passed: bool
    reason: str     # "" when passed; else one line: why it failed
    seconds: float


def case_op(case, by_name: dict) -> tuple[str, bool]:
    """The op a node case tests. *_expanded cases hold the function body of their base case's op."""
    nodes = case.model.graph.node
    expanded = len(nodes) != 1
    node = by_name[re.sub(r"_expanded.*$", "", case.name)].model.graph.node[0] if expanded else nodes[0]
    return (f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type), expanded


def _reason(e: BaseException) -> str:
    """One line naming the kind of failure, stable enough to group cases by."""
    from anygrad.errors import UnsupportedOpError
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(e, UnsupportedOpError) and "anygrad does not support:" in first:  # the importer's
        ops = re.findall(r"([A-Za-z0-9_.]+) \(", first.split("support:", 1)[-1])
        return f"unsupported op: {', '.join(ops)}"
    if isinstance(e, UnsupportedOpError):  # the op's own rule refusing an attribute or mode
        return f"unsupported: {re.sub(r'^[A-Za-z]+ node .[^ ]*.: ', '', first)[:160]}"
    if isinstance(e, AssertionError):
        msg = " ".join(t.strip() for t in text if t.strip())
        if "incorrect shape" in msg:
            return "wrong output shape"
        if "ACTUAL: dtype" in msg or "dtype(" in msg and "DESIRED" in msg:
            m = re.search(r"ACTUAL: (dtype\('[^']+'\)).*DESIRED: (dtype\('[^']+'\))", msg)
            return f"wrong dtype: got {m.group(1)}, expected {m.group(2)}" if m else "wrong dtype"
        if "Not equal to tolerance" in msg or "Arrays are not equal" in msg:
            return "wrong values"
        return f"assertion: {first[:120]}"
    first = re.sub(r"^'[^']*':? ", "", first)  # the importer names the model: the case name, here
    first = re.sub(r" \(graph '[^']*'\)", "", first)  # ... and so do backends
    first = re.sub(r"(\w+) node '[^']*'", r"\1 node", first)
    return f"{type(e).__name__}: {first[:160]}"


def _value_types(model) -> str:
    """The element/value types of a model's inputs and outputs that anygrad cannot hold."""
    from onnx import TensorProto

    from anygrad.frontends.onnx_import import ELEM_TYPES

    kinds = set()
    for vi in list(model.graph.input) + list(model.graph.output):
        t = vi.type
        if t.HasField("tensor_type"):
            if t.tensor_type.elem_type not in ELEM_TYPES:
                kinds.add(TensorProto.DataType.Name(t.tensor_type.elem_type).lower())
        else:
            kinds.add(t.WhichOneof("value").replace("_type", ""))
    return ", ".join(sorted(kinds))


def run_suite(devices: tuple[str, ...] = ("cpu",), pattern: str | None = None) -> list[CaseResult]:
    import numpy as np
    with warnings.catch_warnings():  # the case generators overflow casts on purpose
        warnings.simplefilter("ignore")
        from onnx.backend.test.loader import load_model_tests
        cases = load_model_tests(kind="node")
    from onnx.backend.test.runner import Runner, _normalize_tensor

    from anygrad.frontends.onnx_backend import AnygradBackend

    by_name = {c.name: c for c in cases}
    out = []
    for device in devices:
        for case in cases:
            if pattern and not re.search(pattern, case.name):
                continue
            op, expanded = case_op(case, by_name)
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings(), np.errstate(all="ignore"):
                    warnings.simplefilter("ignore")
                    rep = AnygradBackend.prepare(case.model, device.upper())
                    for inputs, refs in case.data_sets:
                        got = rep.run([_normalize_tensor(t) for t in inputs])
                        Runner.assert_similar_outputs([_normalize_tensor(t) for t in refs], got,
                                                      rtol=case.rtol, atol=case.atol)
                passed, reason = True, ""
            except Exception as e:  # noqa: BLE001  (every failure is a result to record)
                passed, reason = False, _reason(e)
                if "not a tensor of a supported element type" in reason:
                    reason = f"value types not supported: {_value_types(case.model)}"
            out.append(CaseResult(case.name, op, expanded, device, passed, reason, time.perf_counter() - t0))
    return out


# -- the page ------------------------------------------------------------------------------------
def _default_domain_ops() -> list[str]:
    import onnx
    return sorted({s.name for s in onnx.defs.get_all_schemas() if s.domain in ("", "ai.onnx")})


def results_from_xfail() -> list[CaseResult]:
    """The per-case results the expected-failure lists record: a listed case failed for the
    reason given, every other node case passed (wgpu only when its list exists). This is what
    the conformance tests enforce, so the page rendered from it cannot drift from the suite."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.loader import load_model_tests
        cases = load_model_tests(kind="node")
    by_name = {c.name: c for c in cases}
    ops = {c.name: case_op(c, by_name) for c in cases}
    out = []
    for device, path in (("cpu", XFAIL), ("wgpu", XFAIL_WGPU)):
        if not path.exists():
            continue
        failing = {}
        for line in path.read_text().splitlines():
            name, _, why = line.partition("#")
            if name.strip():
                failing[name.strip()] = why.strip().partition(": ")[2]  # "Op: reason"
        for case in cases:
            op, expanded = ops[case.name]
            out.append(CaseResult(case.name, op, expanded, device, case.name not in failing,
                                  failing.get(case.name, ""), 0.0))
    return out


FLOAT_TYPES = {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}


def _may_be_float(schema, params) -> bool:
    constraints = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return any(constraints.get(p.type_str, {p.type_str}) & FLOAT_TYPES for p in params)


def grad_cell(op: str) -> str:
    """yes: a gradient rule; yes (expansion): trains through the primitive ops it expands to;
    n/a: no gradient flows through it (no float input or output in ONNX's type constraints:
    comparisons, shape ops, indices; or anygrad marks every input non-differentiable: rounding,
    Sign, Range); no: differentiable in principle, no rule yet; -: not implemented."""
    import onnx

    from anygrad.ir.registry import get_op
    d = get_op(op)
    if d is None:
        return "-"
    if d.grad is not None:
        return "yes"
    if d.expand is not None:
        return "yes (expansion)"
    domain, _, name = op.rpartition(".")
    try:
        schema = onnx.defs.get_schema(name, domain=domain)
    except onnx.defs.SchemaError:
        schema = None
    if schema is not None and not (_may_be_float(schema, schema.inputs) and _may_be_float(schema, schema.outputs)):
        return "n/a"
    slots = len(schema.inputs) if schema is not None else 0
    return "n/a" if slots and all(i in d.nondiff for i in range(slots)) else "no"


def _cell(rs: list[CaseResult]) -> str:
    if not rs:
        return "-"
    return f"{sum(r.passed for r in rs)}/{len(rs)}"


def short_reason(r: CaseResult) -> str:
    """A failure reason as the page's notes show it (grouping cases that fail the same way)."""
    reason = xfail_reason(r)
    if reason.startswith("value types not supported"):
        return "value types not supported (" + reason.split(": ", 1)[1] + ")"
    if reason.startswith("unsupported op: "):
        return "needs " + reason[len("unsupported op: "):]
    if m := re.search(r"has no kernel for op\(s\) ([\w, .]+)", reason):
        return f"no wgpu kernel for {m.group(1)}"
    return reason.split(" (")[0][:100]


def _notes(direct: list[CaseResult], expanded: list[CaseResult], known: bool) -> str:
    if not known and not direct and not expanded:
        return "not implemented; no node cases"
    reasons: dict[str, int] = defaultdict(int)
    types: set[str] = set()
    for r in direct:
        if r.passed:
            continue
        reason = short_reason(r)
        if reason.startswith("value types not supported ("):  # one note for all exotic types
            types.update(reason[len("value types not supported ("):-1].split(", "))
            reason = "value types not supported"
        reasons[reason] += 1
    if types:
        reasons[f"value types not supported: {', '.join(sorted(types))}"] = reasons.pop("value types not supported")
    if not known:
        reasons.pop(f"needs {direct[0].op}" if direct else "", None)
    text = "; ".join(f"{why} ({n})" for why, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
    if not known:
        text = "not implemented" + (f"; also {text}" if text else "")
    return text


def render(results: list[CaseResult]) -> str:
    from anygrad.ir.registry import get_op
    devices = sorted({r.device for r in results})
    by = defaultdict(list)  # (op, device, expanded) -> results
    for r in results:
        by[r.op, r.device, r.expanded].append(r)
    default_ops = _default_domain_ops()
    other_ops = sorted({r.op for r in results} - set(default_ops))

    def total(device: str, rs: list[CaseResult] = results) -> tuple[int, int]:
        rs = [r for r in rs if r.device == device]
        return sum(r.passed for r in rs), len(rs)

    import onnx

    from anygrad.frontends.onnx_import import MAX_OPSET, MIN_OPSET
    lines = [
        "# ONNX op support",
        "",
        "Generated by `scripts/onnx_ops_report.py` from ONNX's own backend conformance suite",
        "(`onnx.backend.test`, node cases); do not edit by hand. tests/test_onnx_conformance.py runs",
        "the same cases, with the failures listed in tests/onnx_expected_failures.txt.",
        "",
        f"onnx {onnx.__version__}: " + ", ".join(
            f"{'numpy' if d == 'cpu' else d}: **{p}/{n}** node cases pass" for d, (p, n) in
            ((d, total(d)) for d in devices)) + ".",
        "",
        "Why the numpy failures fail:",
        "",
    ]
    why: dict[str, list[CaseResult]] = defaultdict(list)
    for r in results:
        if r.device == "cpu" and not r.passed:
            reason = short_reason(r)
            why["an op anygrad lacks" if reason.startswith("needs ") else
                "value types anygrad cannot hold (strings, sequences, 8/4-bit floats...)"
                if reason.startswith("value types") else reason].append(r)
    for reason, rs in sorted(why.items(), key=lambda kv: -len(kv[1])):
        ops = sorted({r.op for r in rs})
        lines.append(f"- {len(rs)}: {reason}" + (f" ({', '.join(ops)})" if len(ops) <= 4 else ""))
    lines += [
        "",
        "Columns: *numpy* / *wgpu*: cases of the op itself passed/total; *expanded*: cases that run",
        "the op's ONNX function body instead (they test the primitive ops it expands to), on numpy;",
        "*grad*: *yes*, a gradient rule; *yes (expansion)*, the op trains through the primitive ops",
        "anygrad expands it into; *n/a*, no gradient flows through the op (comparisons, shape and index",
        "ops, rounding); *no*, no gradient rule yet. *notes*: why cases fail (count).",
        f"The conformance backend accepts every opset; `load_onnx` accepts files of opsets {MIN_OPSET}-{MAX_OPSET}.",
        "Node tests feed shape-like operands (Reshape's shape, Slice's starts...) as graph inputs;",
        "the backend folds them in as constants, as they are in exported models.",
        "",
    ]

    def table(ops: list[str]) -> list[str]:
        rows = ["| op | numpy | wgpu | expanded | grad | notes |", "|---|---|---|---|---|---|"]
        for op in ops:
            d = get_op(op)
            cpu, gpu, exp = by[op, "cpu", False], by[op, "wgpu", False], by[op, "cpu", True]
            wgpu = _cell(gpu) if "wgpu" in devices else "not run"
            grad = grad_cell(op)
            notes = _notes(cpu, exp, d is not None)
            passed_cpu = {r.name for r in cpu if r.passed}
            wgpu_only = defaultdict(int)  # failures of cases numpy passes: the wgpu backend's own
            for r in gpu:
                if not r.passed and r.name in passed_cpu:
                    wgpu_only[short_reason(r)] += 1
            if wgpu_only:
                notes += ("; " if notes else "") + "wgpu: " + "; ".join(
                    f"{why} ({n})" for why, n in sorted(wgpu_only.items(), key=lambda kv: (-kv[1], kv[0])))
            rows.append(f"| {op} | {_cell(cpu)} | {wgpu} | {_cell(exp)} | {grad} | {notes} |")
        return rows

    lines += ["## Default domain (ai.onnx)", ""] + table(default_ops)
    lines += ["", "## Other domains (ai.onnx.ml, ai.onnx.preview...)", ""] + table(other_ops)
    return "\n".join(lines) + "\n"


XFAIL = ROOT / "tests" / "onnx_expected_failures.txt"
XFAIL_HEADER = """\
# ONNX node conformance cases anygrad is known to fail on the numpy backend (device CPU).
# tests/test_onnx_conformance.py marks them expected failures; one that passes fails the suite,
# so delete its line when an op lands. Format: case name, then '#' and why.
# Regenerate: python scripts/onnx_ops_report.py --write-xfail
"""
# Failures whose cause is a deliberate anygrad choice, not a missing feature: say so in the list.
KNOWN_REASONS = {
    r"^test_training_dropout": "random: anygrad uses its counter-based RNG",
    r"^test_batchnorm_.*training_mode": "running_var: anygrad keeps PyTorch's unbiased batch variance",
    # scale 0.6 of length 4: the reference divides by (2.4 - 1), onnxruntime and PyTorch by (2 - 1)
    r"^test_resize_downsample_scales_(linear|cubic)_align_corners$":
        "align_corners: anygrad divides by the output size - 1, as onnxruntime and PyTorch do; the reference "
        "by the unrounded scaled length - 1",
    r"^test_dft_inverse(_opset19)?$": "expected output: its own float32 noise (1.9e-7 where the exact inverse "
                                      "is 0) exceeds the case's atol 1e-7; anygrad is within 1e-14 there",
}


def xfail_reason(r: CaseResult) -> str:
    return next((why for pat, why in KNOWN_REASONS.items() if re.search(pat, r.name)), r.reason)


XFAIL_WGPU = ROOT / "tests" / "onnx_expected_failures_wgpu.txt"
XFAIL_WGPU_HEADER = """\
# ONNX node conformance cases anygrad is known to fail on the wgpu backend (device WGPU; run
# whenever an adapter exists). Same format and rules as onnx_expected_failures.txt.
# Regenerate: python scripts/onnx_ops_report.py --wgpu --write-xfail
"""


def _xfail_lines(failing: list[CaseResult]) -> str:
    failing = sorted(failing, key=lambda r: (r.op, r.name))
    width = min(max((len(r.name) for r in failing), default=0), 60)
    return "".join(f"{r.name:<{width}}  # {r.op}: {xfail_reason(r)}\n" for r in failing)


def write_xfail(results: list[CaseResult]) -> None:
    """The expected-failure lists: numpy's, and wgpu's when wgpu ran."""
    for device, path, header in (("cpu", XFAIL, XFAIL_HEADER), ("wgpu", XFAIL_WGPU, XFAIL_WGPU_HEADER)):
        if any(r.device == device for r in results):
            path.write_text(header + _xfail_lines([r for r in results if r.device == device and not r.passed]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wgpu", action="store_true", help="also run the cases on the wgpu backend")
    ap.add_argument("--json", type=Path, help="write the per-case results here")
    ap.add_argument("--from-json", type=Path, help="read per-case results instead of running the suite")
    ap.add_argument("--from-xfail", action="store_true",
                    help="take the results from the expected-failure lists instead of running the suite")
    ap.add_argument("--out", type=Path, default=DOC, help=f"page to write (default {DOC.relative_to(ROOT)})")
    ap.add_argument("--pattern", help="only cases whose name matches this regex")
    ap.add_argument("--failures", action="store_true", help="print each failing case and why")
    ap.add_argument("--write-xfail", action="store_true",
                    help=f"rewrite {XFAIL.relative_to(ROOT)} from the numpy results")
    args = ap.parse_args(argv)
    if args.from_json:
        results = [CaseResult(**r) for r in json.loads(args.from_json.read_text())]
    elif args.from_xfail:
        results = results_from_xfail()
    else:
        t0 = time.perf_counter()
        results = run_suite(("cpu", "wgpu") if args.wgpu else ("cpu",), args.pattern)
        print(f"ran {len(results)} cases in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=0))
    if args.failures:
        for r in results:
            if not r.passed:
                print(f"{r.device}\t{r.name}\t{r.op}\t{r.reason}")
    for device in sorted({r.device for r in results}):
        rs = [r for r in results if r.device == device]
        print(f"{device}: {sum(r.passed for r in rs)}/{len(rs)} pass", file=sys.stderr)
    if args.write_xfail and not args.pattern:
        write_xfail(results)
    if not args.pattern:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
