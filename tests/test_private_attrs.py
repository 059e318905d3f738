"""anygrad.ir.private_attrs: the `_`-prefixed node attributes passes and lowerings use are declared
once; an undeclared one (a typo) fails, where it is set (fusion.prepare) and, in tests, where it is
read (Node.attr)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from anygrad.ir import private_attrs
from anygrad.ir.graph import Graph, Node, TensorInfo
from anygrad.ir.private_attrs import PRIVATE_ATTRS, UndeclaredAttribute, check_attrs

SRC = Path(__file__).resolve().parents[1] / "src" / "anygrad"


def test_tests_run_with_the_read_check_on():
    assert private_attrs.is_checking()  # (tests/conftest.py)


def test_a_misspelt_read_fails_and_a_declared_one_reads():
    n = Node("MatMul", ["a", "b"], ["y"], {"_gemm_variant": "shared"}, name="mm")
    assert n.attr("_gemm_variant") == "shared" and n.attr("_gemm_block") is None
    assert n.attr("transA", 0) == 0  # public attributes are not checked
    says = "MatMul node 'mm': private attribute '_gemm_varaint' is not declared; declare it"
    with pytest.raises(UndeclaredAttribute, match=says):
        n.attr("_gemm_varaint")
    was = private_attrs.checking(False)
    try:
        assert n.attr("_gemm_varaint") is None  # outside tests a read stays a plain lookup
    finally:
        private_attrs.checking(was)


def test_a_misspelt_or_mistyped_setting_fails():
    check_attrs({"_residual": True, "_alpha": 0.5, "_permY": [0, 2, 1], "_round": None, "axis": 1})
    with pytest.raises(UndeclaredAttribute, match="'_resdiual' is not declared"):
        check_attrs({"_resdiual": True})
    with pytest.raises(UndeclaredAttribute, match="'_epilogue' holds a int \\(3\\); it is declared as str"):
        check_attrs({"_epilogue": 3}, "Gemm node 'g'")


def _matmul_graph(attrs: dict) -> Graph:
    g = Graph(name="g", nodes=[Node("MatMul", ["a", "b"], ["y"], dict(attrs), name="mm")],
              inputs=["a", "b"], outputs=["y"])
    f32 = np.dtype(np.float32)
    g.info.update({"a": TensorInfo(f32, (2, 3)), "b": TensorInfo(f32, (3, 4)), "y": TensorInfo(f32, (2, 4))})
    return g


def test_prepare_refuses_a_graph_carrying_an_undeclared_private_attribute():
    """The wgpu rewrites end in the check: a pin spelt wrong by a test, a benchmark or a pass is an
    error, not a tiling silently left to the rules."""
    from anygrad.backends.wgpu.fusion.passes import prepare
    from anygrad.backends.wgpu.kernels.kernel import AdapterCaps
    caps = AdapterCaps()
    prepared = prepare(_matmul_graph({"_gemm_variant": "register", "_gemm_block": 4}), caps, set())
    assert [n.attr("_gemm_block") for n in prepared.nodes] == [4]
    with pytest.raises(UndeclaredAttribute, match="'_gemm_blocks' is not declared"):
        prepare(_matmul_graph({"_gemm_blocks": 4}), caps, set())


def test_the_autotuner_pins_only_declared_attributes():
    from anygrad.backends.wgpu.tuning import autotune
    for pin in autotune.CANDIDATES:
        check_attrs(pin, f"autotune candidate {pin}")


def test_every_private_attribute_named_in_the_wgpu_backend_is_declared():
    """The names as string literals in the code that sets and reads them (attr reads, attrs writes,
    pin dicts, key tuples), so a typo on a path no test runs fails too."""
    named: dict[str, str] = {}
    key = re.compile(r"\"(_(?:gemm|perm|view|into|alpha|epilogue|residual|where|round|prologue|colsum|origin)"
                     r"[A-Za-z0-9_]*)\"")
    for path in sorted((SRC / "backends").rglob("*.py")):
        for name in key.findall(path.read_text()):
            named.setdefault(name, str(path.relative_to(SRC)))
    assert len(named) > 20
    assert {k: v for k, v in named.items() if k not in PRIVATE_ATTRS} == {}


def test_every_declaration_has_a_meaning_and_a_type():
    for name, a in PRIVATE_ATTRS.items():
        assert name == a.name and name.startswith("_") and a.meaning, a
        assert all(isinstance(t, type) for t in (a.type if isinstance(a.type, tuple) else (a.type,))), a
