"""The source as a whole: the layering of DESIGN.md (no module imports a layer above its own), and lint.

Frontends produce Models, so in the code the layers run (bottom to top): leaf utilities, the IR,
the training-graph builders, backends, the Model, the frontends and model builders, the product.
There is no exception, not even a lazy import inside a function: the Model's convenience methods
whose work lives above it (fit, PyTorch weights) call what anygrad.train and anygrad.frontends
register in anygrad.facade, as the strategy for several devices is registered in anygrad.strategy.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "anygrad"

LAYERS = [
    {"errors", "settings", "rng", "coerce", "_parallel", "fsutil", "torchfile", "timeline", "version"},  # leaf utilities
    {"ir"},
    {"ops", "autodiff", "losses", "optim", "program", "batch"},
    {"backends", "devices", "strategy"},  # (strategy: how a Model's steps reach its devices)
    {"model", "facade"},  # (facade: Model methods whose work the layers above register)
    {"frontends", "nn", "data", "codegen"},                      # build Models from files and code
    {"train", "inference", "plot", "distributed"},
    {"cli", "examples", "__init__", "__main__"},
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _unit(path: Path) -> str:
    """The layer unit of a source file: its first component under anygrad/ (package or module)."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported unit, line) for each anygrad import of the file, at its top or inside a function."""
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(PACKAGE).parts) - 1  # packages between anygrad/ and the file
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("anygrad")):
            if node.level:  # relative: climb to anygrad/, then the module path names the unit
                if node.level - 1 < depth:
                    continue  # within the file's own package
                parts = (node.module or "").split(".") if node.module else []
            else:
                parts = node.module.split(".")[1:]
            # `from .. import name`: a unit, or else a name of the package's __init__ (the top layer)
            units = [parts[0]] if parts and parts[0] else [a.name if a.name in LEVEL else "__init__"
                                                            for a in node.names]
            found += [(u, node.lineno) for u in units]
    return found


def test_no_module_imports_a_layer_above_its_own():
    assert {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()} <= \
        set(LEVEL), "a new top-level module: add it to LAYERS"
    upward = []
    for path in PACKAGE.rglob("*.py"):
        unit = _unit(path)
        for target, line in _imports(path):
            if target not in LEVEL or LEVEL[target] <= LEVEL[unit]:
                continue
            upward.append(f"{path.relative_to(PACKAGE)}:{line} ({unit}) imports {target}")
    assert not upward, "\n".join(upward)


# (importer, imported) pairs never allowed, though downward: data feeds models without knowing the
# Model class (its graph rewriting is the IR pass ir/input_norm.py).
APART = {("data", "model")}


def test_data_does_not_import_the_model():
    apart = [f"{path.relative_to(PACKAGE)}:{line} ({unit}) imports {target}"
             for path in PACKAGE.rglob("*.py") for unit in [_unit(path)]
             for target, line in _imports(path) if (unit, target) in APART]
    assert not apart, "\n".join(apart)


def test_the_source_is_lint_clean():
    """`ruff check` (the rules of pyproject.toml) over everything the project ships or runs."""
    import shutil
    import subprocess

    import pytest
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the test extras)")
    root = PACKAGE.parents[1]
    r = subprocess.run([ruff, "check", "src", "tests", "benchmarks", "scripts", "examples"], cwd=root,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout[-3000:]


# Backends read node attributes and shapes, not ops/ internals (DESIGN.md: "Backends read the
# graph, not the op library"). What a backend needs of an op's semantics is a public function of
# ops/ (an interpolation matrix, a pad index map, a reduction's checked name); nothing private.
def _ops_imports(path: Path) -> set[str]:
    """'ops.<module>.<name>' for each name the file imports from ops/."""
    depth = len(path.relative_to(PACKAGE).parts) - 1
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if node.level - 1 != depth:  # not relative to anygrad/
                continue
            parts = (node.module or "").split(".")
        elif (node.module or "").startswith("anygrad."):
            parts = node.module.split(".")[1:]
        else:
            continue
        if parts and parts[0] == "ops":
            found.update(".".join(parts + [alias.name]) for alias in node.names)
    return found


def _backend_ops_imports() -> list[tuple[str, str]]:
    return sorted((str(p.relative_to(PACKAGE)), name) for p in (PACKAGE / "backends").rglob("*.py")
                  for name in _ops_imports(p))


def test_no_backend_imports_a_private_name_from_ops():
    found = [(f, name) for f, name in _backend_ops_imports() if any(p.startswith("_") for p in name.split(".")[1:])]
    assert not found, f"backends import private ops/ names (make a public helper in ops/ instead): {found}"


# The helpers that interpret an ONNX attribute (auto_pad, negative or input-given axes, opset
# defaults, constant inputs): `resolve_attributes` (ir/passes.py, rules in ops/resolve.py) has
# applied them to every node before a backend lowers it, so a backend reads node.attrs instead.
ATTRIBUTE_HELPERS = {
    "ops.nn.window", "ops.nn.dropout_ratio", "ops.reduce.reduce_axes", "ops._util.axes_of",
    "ops._util.norm_axis", "ops._util.ints_of", "ops._util.const_ints", "ops.shape.pad_amounts",
    "ops.shape.pad_mode", "ops.shape.slice_bounds", "ops.shape.split_sizes", "ops.loss.loss_reduction",
    "ops.resize.interp_of", "ops.resize.resize_plan",
}


def test_no_backend_interprets_attributes_with_ops_helpers():
    found = [(f, name) for f, name in _backend_ops_imports() if name in ATTRIBUTE_HELPERS]
    assert not found, f"backends re-derive attributes with ops/ helpers (read the resolved node.attrs): {found}"


# The wgpu backend by stage, each importing only stages before it (device/ underneath them all):
# lowering, fusion, planning, tuning (which measures plans on the device), the runtime.
WGPU = PACKAGE / "backends" / "wgpu"
WGPU_STAGES = ["device", "kernels", "fusion", "planning", "tuning", "runtime"]


def test_wgpu_stages_import_only_earlier_stages():
    assert {p.name for p in WGPU.iterdir() if (p / "__init__.py").exists()} == set(WGPU_STAGES), \
        "a new wgpu subpackage: add it to WGPU_STAGES"
    assert not [p.name for p in WGPU.glob("*.py") if p.name != "__init__.py"], "wgpu modules live in a stage"
    later = []
    for path in WGPU.rglob("*.py"):
        rel = path.relative_to(WGPU).parts
        if len(rel) < 2:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                target = node.module.split(".")[0]
                if target in WGPU_STAGES and WGPU_STAGES.index(target) > WGPU_STAGES.index(rel[0]):
                    later.append(f"{'/'.join(rel)}:{node.lineno} ({rel[0]}) imports {target}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("anygrad.backends.wgpu"):
                later.append(f"{'/'.join(rel)}:{node.lineno} imports its own backend absolutely")
    assert not later, "\n".join(later)


# A module past this has grown more than one job: make it a package whose __init__ says what each
# module owns (docs/development.md lists the ones that were split).
MAX_MODULE_LINES = 800


def test_no_module_is_above_the_size_of_one_job():
    big = [f"{p.relative_to(PACKAGE)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, "\n".join(big)
