"""ONNX's own backend conformance suite (onnx.backend.test, node cases) against anygrad.

Every node case runs on the numpy backend (device CPU); the ones anygrad is known to fail are
listed in onnx_expected_failures.txt and marked expected failures, so a case that starts
passing fails the run (unittest's unexpected success) and its line must be deleted: the list
only shrinks. Every case runs on wgpu too when a WebGPU adapter exists (lavapipe in CI; well
under a minute), against its own list, onnx_expected_failures_wgpu.txt;
ANYGRAD_CONFORMANCE_WGPU=0 skips that half. docs/onnx-ops.md is generated from
the same cases by scripts/onnx_ops_report.py.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.backend.test import BackendTest
from onnx.backend.test.loader import load_model_tests

from anygrad.errors import UnsupportedOpError
from anygrad.frontends.onnx_backend import AnygradBackend

XFAIL_FILE = Path(__file__).with_name("onnx_expected_failures.txt")
XFAIL_WGPU_FILE = Path(__file__).with_name("onnx_expected_failures_wgpu.txt")


def _has_adapter() -> bool:
    from anygrad import AnygradError, devices
    try:
        return bool(devices.list_adapters())
    except AnygradError:
        return False


WANT_WGPU = os.environ.get("ANYGRAD_CONFORMANCE_WGPU", "1") != "0"
RUN_WGPU = WANT_WGPU and _has_adapter()
# Edge cases (empty reductions, NaN/inf inputs) warn inside numpy kernels by design.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def expected_failures(path: Path = XFAIL_FILE) -> dict[str, str]:
    """Case name -> why it fails, from the list (lines: `name  # reason`)."""
    out = {}
    for line in (path.read_text().splitlines() if path.exists() else []):
        name, _, why = line.partition("#")
        if name.strip():
            out[name.strip()] = why.strip()
    return out


class NodeConformance(BackendTest):
    """BackendTest over node cases only, on anygrad's devices (BackendTest assumes CPU and CUDA)."""

    devices: tuple[str, ...] = ("CPU",)

    def _add_model_test(self, model_test, kind: str) -> None:
        if kind == "Node":
            super()._add_model_test(model_test, kind)

    def _add_test(self, category, test_name, test_func, report_item, devices=None, **kwargs) -> None:
        super()._add_test(category, test_name, test_func, report_item, devices=self.devices, **kwargs)


class WgpuNodeConformance(NodeConformance):
    devices = ("WGPU",)


def _suite(runner: type[NodeConformance], suffix: str) -> dict[str, type]:
    with warnings.catch_warnings():  # the case generators overflow casts on purpose
        warnings.simplefilter("ignore")
        bt = runner(AnygradBackend, __name__)
    device = runner.devices[0].lower()
    for name in expected_failures(XFAIL_WGPU_FILE if device == "wgpu" else XFAIL_FILE):
        bt.xfail(f"^{re.escape(name)}_{device}$")
    cases = {}
    for key, cls in bt.test_cases.items():
        cls.__name__ = cls.__qualname__ = key + suffix
        cases[key + suffix] = cls
    return cases


globals().update(_suite(NodeConformance, ""))
if RUN_WGPU:
    globals().update(_suite(WgpuNodeConformance, "Wgpu"))


# -- the harness itself ------------------------------------------------------------------------------
def test_expected_failures_name_real_cases():
    """A stale line (a case ONNX renamed or dropped) would silently mark nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = {c.name for c in load_model_tests(kind="node")}
    stale = sorted((set(expected_failures()) | set(expected_failures(XFAIL_WGPU_FILE))) - names)
    assert not stale, f"{XFAIL_FILE.name} lists cases onnx does not have: {stale[:10]}"


def test_max_opset_is_one_whose_changed_ops_pass():
    """load_onnx accepts opsets up to MAX_OPSET: every op anygrad has whose schema changed after
    MIN_OPSET must pass its node cases at the new version, failing only by refusing clearly (value
    types anygrad cannot hold, an unsupported mode) or by a deliberate choice (KNOWN below)."""
    from anygrad.frontends.onnx_import import DEFAULT_DOMAINS, MAX_OPSET, MIN_OPSET
    from anygrad.ir.registry import get_op
    known = ("random: anygrad uses its counter-based RNG", "running_var: anygrad keeps PyTorch's unbiased",
             "align_corners: anygrad divides by the output size", "expected output: its own float32 noise",
             "expected output: float16 arithmetic")
    assert MAX_OPSET <= onnx.defs.onnx_opset_version()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = [c for c in load_model_tests(kind="node") if len(c.model.graph.node) == 1]
    failing = expected_failures()
    problems = []
    for schema in onnx.defs.get_all_schemas_with_history():
        if (schema.domain not in DEFAULT_DOMAINS or not MIN_OPSET < schema.since_version <= MAX_OPSET
                or get_op(schema.name) is None):
            continue
        at_version = [c for c in cases if c.model.graph.node[0].op_type == schema.name
                      and c.model.graph.node[0].domain in DEFAULT_DOMAINS
                      and max(o.version for o in c.model.opset_import if o.domain in DEFAULT_DOMAINS)
                      >= schema.since_version]
        if not at_version:
            problems.append(f"{schema.name}-{schema.since_version}: no node case")
        for c in at_version:
            why = failing.get(c.name, "").partition(": ")[2]
            if why and not why.startswith(("value types not supported", "unsupported: ", *known)):
                problems.append(f"{schema.name}-{schema.since_version}: {c.name} ({why})")
    assert not problems, f"MAX_OPSET {MAX_OPSET} admits ops that fail: {problems[:10]}"


def test_ops_page_is_what_the_expected_failure_lists_say():
    """docs/onnx-ops.md is rendered from the same lists these tests enforce, so it cannot drift."""
    import importlib.util
    script = Path(__file__).resolve().parents[1] / "scripts" / "onnx_ops_report.py"
    spec = importlib.util.spec_from_file_location("onnx_ops_report", script)
    report = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = report  # its dataclasses look their module up there
    spec.loader.exec_module(report)
    page = report.render(report.results_from_xfail())
    assert report.DOC.read_text() == page, ("docs/onnx-ops.md is stale: regenerate it with "
                                            "python scripts/onnx_ops_report.py --from-xfail")


def test_run_node_infers_output_types():
    node = helper.make_node("Relu", ["x"], ["y"])
    x = np.array([[-1.0, 2.0]], np.float32)
    (y,) = AnygradBackend.run_node(node, [x])
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    assert y.dtype == np.float32


def test_rep_recompiles_per_input_shape_and_names_outputs():
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])], "add",
        [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, ["n"])])
    rep = AnygradBackend.prepare(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    for n in (2, 5):
        a, b = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
        out = rep.run({"a": a, "b": b})
        np.testing.assert_array_equal(out.c, a + b)


def test_shape_inputs_are_folded_as_constants():
    """Reshape's shape fed as a graph input (as node tests do) is baked in for that run."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"])], "reshape",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("s", onnx.TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    rep = AnygradBackend.prepare(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = rep.run([x, np.array([3, 2], np.int64)])
    np.testing.assert_array_equal(y, x.reshape(3, 2))
    assert rep.baked == ("s",)


def test_unsupported_op_fails_with_the_importers_error():
    graph = helper.make_graph(
        [helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")], "frob",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedOpError, match="Frobnicate"):
        AnygradBackend.prepare(model)


def test_devices():
    assert AnygradBackend.supports_device("CPU")
    assert not AnygradBackend.supports_device("CUDA")


if WANT_WGPU and not RUN_WGPU:
    def test_the_wgpu_half_has_an_adapter():
        """Without an adapter the wgpu half is skipped, or fails under $ANYGRAD_REQUIRE_WGPU=1 (CI)."""
        from wgpu_util import no_adapter
        no_adapter()
