"""The private node attributes: `_`-prefixed keys that passes and lowerings put on `node.attrs`.

Model files never hold them. A backend's rewrites (the wgpu fusion passes, the autotuner's
pins, tests and benchmarks pinning a tiling) set them on a copy of the graph, and the lowerings
read them. They are declared here, once, with their type and meaning: a misspelt key would
otherwise turn a fusion off without a word.

Two checks use the table:
- `check_graph` runs where the rewrites end (wgpu's fusion.prepare, after the autotuner's pins):
  an undeclared key, or a value of another type, raises UndeclaredAttribute.
- With `checking(True)` (tests/conftest.py turns it on for every test), `Node.attr` also refuses
  an undeclared private key, so a misspelt read fails too.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class UndeclaredAttribute(KeyError):
    """A private attribute missing from PRIVATE_ATTRS, or one holding a value of another type:
    a bug in a pass or a lowering (never the user's doing), so not an AnygradError."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class PrivateAttr:
    name: str
    type: type | tuple[type, ...]   # of the value; None is always allowed (unset)
    meaning: str


_INT = (int,)           # bool is an int too (pins written as True/False)
_NUMBER = (int, float)
_SEQ = (list, tuple)


def _a(name: str, type_: type | tuple[type, ...], meaning: str) -> PrivateAttr:
    return PrivateAttr(name, type_, meaning)


PRIVATE_ATTRS: dict[str, PrivateAttr] = {a.name: a for a in (
    # GEMM tilings pinned by the autotuner, benchmarks and tests (kernels_gemm.variant_of)
    _a("_gemm_variant", str, "GEMM kernel family: register | shared | dot | mma"),
    _a("_gemm_block", _INT, "outputs per invocation along M and N (4 | 8; mma: subgroup tiles)"),
    _a("_gemm_kt", _INT, "K tile of the shared variant"),
    _a("_gemm_prefetch", _INT, "0: none | 1: register prefetch of the next K tile | 2: and two tiles"),
    _a("_gemm_threads", _INT, "invocations per workgroup of the shared (or mma) variant"),
    _a("_gemm_unroll", _INT, "K steps per pass of a rolled K-tile loop (Tiling.unroll)"),
    _a("_gemm_tn", _INT, "outputs per invocation along N of the shared variant, when not _gemm_block"),
    _a("_gemm_splits", _INT, "K splits (1: none), each at least 128 of K"),
    _a("_gemm_half", _INT, "0 | 1: f16 products summed in f16 within a K tile (kernels_gemm.half_math)"),
    _a("_gemm_layout", str, "comma list for A/B runs: noswizzle, nohoist, plain (both), bytap; rowtiles: "
                             "matrix-unit tiles row-major whatever their copies walk"),
    # operand and result layouts (gemm_layout.py)
    _a("_permA", _SEQ, "MatMul operand A read through this axis permutation (fold_transposes)"),
    _a("_permB", _SEQ, "MatMul operand B read through this axis permutation (fold_transposes)"),
    _a("_permY", _SEQ, "the result stored through this axis permutation (fold_transposes)"),
    _a("_viewA", tuple, "operand A as a strided view (shape, strides, offset) of the bound value (fold_views)"),
    _a("_viewB", tuple, "operand B as a strided view (shape, strides, offset) of the bound value (fold_views)"),
    _a("_intoY", tuple, "the result stored at (shape, strides, offset) within the bound output (a Concat's, "
                        "fold_result_layouts)"),
    _a("_views", dict, "fused elementwise inputs read through strided views: position -> (name, view)"),
    _a("_stores", dict, "fused elementwise results stored through strided views: position -> (name, view)"),
    _a("_alpha", _NUMBER, "constant scale the GEMM multiplies its products by (fold_scales)"),
    # epilogues and prologues (backends/wgpu/fusion/gemm_epilogues.py)
    _a("_epilogue", str, "activation (or activation gradient) applied in the GEMM's or conv's store"),
    _a("_epilogue_attrs", dict, "the attributes of the node the epilogue replaced"),
    _a("_epilogue_arg", bool, "the epilogue reads a fourth input at the result's own index (a gradient's x)"),
    _a("_residual", bool, "a residual Add of the last input runs in the kernel's store"),
    _a("_where", tuple, "(fill, fill where true): a masked_fill of the result runs in the store"),
    _a("_round", tuple, "the fused steps whose float16 results round to f16 (gemm_spec.Output.rounds)"),
    _a("_prologueA", tuple, "(op, attrs, result float16) of an activation applied in operand A's loads"),
    _a("_prologueB", tuple, "(op, attrs, result float16) of an activation applied in operand B's loads"),
    # provenance
    _a("_origin", str, "label of the model's node a rewritten node came from (for error messages)"),
)}

_checking = False


def checking(on: bool) -> bool:
    """Turn the read check in Node.attr on or off; returns the previous state."""
    global _checking
    was, _checking = _checking, bool(on)
    return was


def is_checking() -> bool:
    return _checking


def _undeclared(key: str, where: str) -> UndeclaredAttribute:
    return UndeclaredAttribute(f"{where}: private attribute '{key}' is not declared; declare it (name, "
                               "type, meaning) in anygrad/ir/private_attrs.py, or fix the spelling")


def check_key(key: str, where: str = "node") -> None:
    if key[:1] == "_" and key not in PRIVATE_ATTRS:
        raise _undeclared(key, where)


def check_attrs(attrs: Mapping[str, Any], where: str = "node") -> None:
    """Every private key of `attrs` declared, with a value of its declared type (or None)."""
    for key, value in attrs.items():
        if key[:1] != "_":
            continue
        spec = PRIVATE_ATTRS.get(key)
        if spec is None:
            raise _undeclared(key, where)
        if value is not None and not isinstance(value, spec.type):
            raise UndeclaredAttribute(f"{where}: private attribute '{key}' holds a {type(value).__name__} "
                                      f"({value!r}); it is declared as {_type_name(spec.type)}")


def check_graph(nodes: Iterable[Any]) -> None:
    """check_attrs for every node (anything with .attrs and .label)."""
    for n in nodes:
        check_attrs(n.attrs, n.label)


def _type_name(t: type | tuple[type, ...]) -> str:
    return " or ".join(x.__name__ for x in (t if isinstance(t, tuple) else (t,)))


__all__ = ["PRIVATE_ATTRS", "PrivateAttr", "UndeclaredAttribute", "check_attrs", "check_graph", "check_key",
           "checking", "is_checking"]
