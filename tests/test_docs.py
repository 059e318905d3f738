"""The docs build, their code runs, and what they name exists.

- `mkdocs build --strict` passes (broken links, pages missing from the nav fail it).
- Every ```python block of README.md and docs/*.md runs, in order, one namespace per page, in a
  scratch folder; a block that cannot run here (it needs a GPU, the network, or files that stand
  for the reader's own) says so visibly on its first line: `# not run: REASON`.
- Install hints name the distribution that pyproject declares, with extras it has.
- The `ANYGRAD_*` variables the docs name are declared in `anygrad.settings`.
- README stays at most 300 lines; `benchmarks/results/` holds only the JSON (and one summary a
  session) that BENCHMARKS.md cites, under 2 MB.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
NOT_RUN = re.compile(r"^# not run: \S")  # the visible marker, with its reason
# pages generated from code, or recording history: they may name what no longer exists
GENERATED = {"settings.md", "onnx-ops.md"}
HISTORY = {"benchmark-history.md"}
TEST_ONLY_VARIABLES = {"ANYGRAD_REQUIRE_WGPU", "ANYGRAD_CONFORMANCE_WGPU"}  # read by tests/, not src/


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.DOTALL | re.MULTILINE)


def runnable(block: str) -> bool:
    first = block.splitlines()[0] if block.strip() else ""
    if "not run" in first:
        assert NOT_RUN.match(first), f"write the marker as '# not run: REASON', not {first!r}"
        return False
    return True


# -- the site -------------------------------------------------------------------------------------------
def test_mkdocs_build_strict(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site/index.html").is_file() and (tmp_path / "site/cli/index.html").is_file()


def _nav_files(entries) -> list[str]:
    files = []
    for entry in entries:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            files += _nav_files(value) if isinstance(value, list) else [value]
    return files


def test_every_page_is_in_the_nav_once():
    nav = _nav_files(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    assert sorted(nav) == sorted(p.name for p in DOCS.glob("*.md"))


# -- code blocks ----------------------------------------------------------------------------------------
RUNNABLE = [p for p in pages() if any(runnable(b) for b in python_blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "__docs__"}
    for i, block in enumerate(python_blocks(page)):
        if runnable(block):
            exec(compile(block, f"{page.name}, python block {i + 1}", "exec"), scope)  # noqa: S102 -- the docs' own code


def test_enough_blocks_run_and_each_other_says_why():
    blocks = [b for p in pages() for b in python_blocks(p)]
    run = [b for b in blocks if runnable(b)]  # runnable() also checks every marker's form
    assert len(run) >= 6, "the docs' examples should mostly run"


# -- names the docs use ---------------------------------------------------------------------------------
def _shipped_text() -> list[tuple[str, str]]:
    files = [REPO / "README.md", *DOCS.glob("*.md"), *REPO.glob("src/anygrad/**/*.py"),
             *REPO.glob("examples/**/*.py"), *REPO.glob("scripts/*.py"), REPO / "src/anygrad_cli.py"]
    return [(str(f.relative_to(REPO)), f.read_text()) for f in files]


def test_install_hints_name_the_published_distribution():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name, extras = project["name"], set(project["optional-dependencies"])
    assert name != "anygrad", "PyPI's anygrad is another project"
    hints = 0
    for path, text in _shipped_text():
        for dist, extra in re.findall(r"\b(anygrad[\w-]*)\[([\w,]+)\]", text):
            hints += 1
            assert dist == name, f"{path}: install hint {dist}[{extra}] should name {name}"
            assert set(extra.split(",")) <= extras, f"{path}: {dist}[{extra}] is not an extra of pyproject"
    assert hints >= 5


def test_docs_name_only_declared_settings():
    from anygrad.settings import all_settings
    declared = {s.name for s in all_settings()} | TEST_ONLY_VARIABLES
    for page in pages():
        if page.name in GENERATED | HISTORY:
            continue
        named = set(re.findall(r"\bANYGRAD_[A-Z0-9_]*[A-Z0-9]\b", page.read_text()))
        assert named <= declared, f"{page.name} names undeclared settings: {sorted(named - declared)}"


# -- sizes the issue fixed ------------------------------------------------------------------------------
def test_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 300, "README is the five-minute read: move detail to docs/"


def test_benchmark_results_hold_only_what_benchmarks_cites():
    """JSON and at most one summary.txt per session folder, under 2 MB, each folder cited by BENCHMARKS.md."""
    results = REPO / "benchmarks/results"
    files = [f for f in results.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 2 * 2**20
    cited = (REPO / "BENCHMARKS.md").read_text()
    for f in files:
        assert f.suffix == ".json" or f.name == "summary.txt", f"{f.relative_to(REPO)}: only JSON and a summary"
        session = f.relative_to(results).parts[0]
        assert session in cited, f"BENCHMARKS.md cites nothing in {session}/"
    for session in results.iterdir():
        assert len(list(session.rglob("summary.txt"))) <= 1, f"{session.name}: one summary per session"
