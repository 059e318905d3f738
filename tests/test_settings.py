"""anygrad.settings: every environment variable declared once, read at call time, checked, and
overridable in tests; the docs page's table is the module's; no other module reads os.environ."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from anygrad import settings
from anygrad.errors import AnygradError, ConfigError
from anygrad.ir.graph import Graph, Node, TensorInfo

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "anygrad"


def test_a_setting_is_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.delenv("ANYGRAD_GLOO_GROUPS", raising=False)
    assert settings.get("ANYGRAD_GLOO_GROUPS") == 4
    monkeypatch.setenv("ANYGRAD_GLOO_GROUPS", "7")
    assert settings.get("ANYGRAD_GLOO_GROUPS") == 7
    monkeypatch.setenv("ANYGRAD_GLOO_GROUPS", " 2 ")
    assert settings.get("ANYGRAD_GLOO_GROUPS") == 2
    monkeypatch.setenv("ANYGRAD_GLOO_GROUPS", "")  # empty: unset
    assert settings.get("ANYGRAD_GLOO_GROUPS") == 4 and not settings.is_set("ANYGRAD_GLOO_GROUPS")


@pytest.mark.parametrize("text,value", [("1", True), ("0", False), ("true", True), ("OFF", False),
                                        ("yes", True), ("no", False)])
def test_switches_take_the_usual_spellings(monkeypatch, text, value):
    monkeypatch.setenv("ANYGRAD_WGPU_RESIDUAL", text)
    assert settings.get("ANYGRAD_WGPU_RESIDUAL") is value


def test_auto_is_a_third_state_only_where_the_default_is_unset(monkeypatch):
    monkeypatch.setenv("ANYGRAD_F16_MATH", "auto")
    assert settings.get("ANYGRAD_F16_MATH") is None
    monkeypatch.setenv("ANYGRAD_WGPU_RESIDUAL", "auto")
    with pytest.raises(ConfigError, match="ANYGRAD_WGPU_RESIDUAL='auto': give 0 \\| 1, or unset it"):
        settings.get("ANYGRAD_WGPU_RESIDUAL")


@pytest.mark.parametrize("name,text,allowed", [
    ("ANYGRAD_GLOO_GROUPS", "2.5", "a whole number >= 1"),
    ("ANYGRAD_GLOO_GROUPS", "0", "a whole number >= 1"),
    ("ANYGRAD_BUCKET_MB", "abc", "a number > 0"),
    ("ANYGRAD_BUCKET_MB", "nan", "a number > 0"),
    ("ANYGRAD_GLOO_PIECE_MB", "-1", "a number > 0"),
    ("ANYGRAD_WGPU_POLL", "spin", "free | block"),
    ("ANYGRAD_WGPU_CHECKS", "2", "0 | 1"),
    ("ANYGRAD_AUTOTUNE", "sometimes", "0 | 1 | auto"),
])
def test_a_bad_value_is_an_error_naming_the_variable_and_what_it_takes(monkeypatch, name, text, allowed):
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigError) as e:
        settings.get(name)
    assert isinstance(e.value, AnygradError)
    assert str(e.value).startswith(f"{name}={text!r}: give {allowed}, or unset it (default ")


def test_an_override_wins_over_the_environment_and_is_undone(monkeypatch):
    monkeypatch.setenv("ANYGRAD_WGPU_SHARED_BUFFER", "64MiB")
    size = settings.by_name("ANYGRAD_WGPU_SHARED_BUFFER")
    with settings.override(ANYGRAD_WGPU_SHARED_BUFFER="128MiB"):
        assert size.get() == "128MiB"
        with settings.override({size: None, "ANYGRAD_GLOO_GROUPS": 3}):  # None: as if unset
            assert size.get() is None and settings.get("ANYGRAD_GLOO_GROUPS") == 3
        assert size.get() == "128MiB" and settings.get("ANYGRAD_GLOO_GROUPS") == 4
        monkeypatch.setenv("ANYGRAD_WGPU_SHARED_BUFFER", "32MiB")
        assert size.get() == "128MiB"
    assert size.get() == "32MiB"


def test_an_override_is_checked_and_names_only_declared_settings():
    with pytest.raises(ConfigError, match="ANYGRAD_GLOO_GROUPS='many'"), \
            settings.override(ANYGRAD_GLOO_GROUPS="many"):
        pass
    with pytest.raises(KeyError, match="ANYGRAD_NO_SUCH_THING is not declared"), \
            settings.override(ANYGRAD_NO_SUCH_THING=1):
        pass
    with pytest.raises(KeyError, match="declare ANYGRAD_ variables"):
        settings.external("ANYGRAD_CACHE")


def test_an_override_is_seen_by_other_threads():
    import threading
    seen = []
    with settings.override(ANYGRAD_WGPU_POLL="block"):
        t = threading.Thread(target=lambda: seen.append(settings.get("ANYGRAD_WGPU_POLL")))
        t.start()
        t.join()
    assert seen == ["block"]


def test_every_declaration_is_well_formed():
    for s in settings.all_settings():
        assert s.kind in settings.KINDS and s.doc and "\n" not in s.doc, s
        assert s.default is None or isinstance(s.default, s.type), s
        if s.default is not None:
            assert s.parse(settings._text(s.default)) == s.default, s  # the default is a value it takes


def test_the_docs_page_holds_the_generated_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert settings.with_table(page) == page, \
        "docs/settings.md is out of date: run anygrad settings --update docs/settings.md"
    assert page.count("| `ANYGRAD_") == len(settings.all_settings())


def test_the_markdown_command_prints_the_table(capsys):
    assert settings.main(["--markdown"]) == 0
    assert capsys.readouterr().out == settings.markdown_table()


def _python_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_anygrad_variable_named_in_the_source_is_declared():
    """A typo in a name (or a new variable not declared) fails here, not silently at run time."""
    declared = {s.name for s in settings.all_settings()}
    named = {}
    for path in _python_files():
        for name in re.findall(r"\bANYGRAD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            named.setdefault(name, path.relative_to(SRC))
    assert {k: v for k, v in named.items() if k not in declared} == {}


def test_the_dataset_mirrors_are_declared():
    from anygrad.data import cifar, datasets
    for spec in (datasets.FASHION_MNIST, cifar.CIFAR10):
        assert settings.by_name(spec.mirrors_env).kind == "user"


def test_only_the_settings_module_reads_the_environment():
    """Elsewhere os.environ may only be set (for child processes and native libraries)."""
    sets = re.compile(r"os\.environ(\.setdefault\(|\[[^\]]+\]\s*=[^=]|\.update\()")
    reads = []
    for path in _python_files():
        if path == SRC / "settings.py":
            continue
        for k, line in enumerate(path.read_text().splitlines(), 1):
            if ("os.environ" in line or "getenv" in line) and not sets.search(line):
                reads.append(f"{path.relative_to(SRC)}:{k}: {line.strip()}")
    assert reads == []


def _tiny_graph() -> Graph:
    g = Graph(name="g", nodes=[Node("Relu", ["x"], ["y"], name="r")], inputs=["x"], outputs=["y"])
    f32 = np.dtype(np.float32)
    g.info.update({"x": TensorInfo(f32, (2, 3)), "y": TensorInfo(f32, (2, 3))})
    return g


def test_the_plan_cache_key_holds_the_tuning_settings_and_not_the_debug_ones():
    from anygrad.backends.wgpu.device import pipeline_cache
    g = _tiny_graph()
    key = pipeline_cache.plan_key(g, ("ctx",))
    assert pipeline_cache.plan_key(g, ("ctx",)) == key
    tuning = [s for s in settings.all_settings() if s.kind == "tuning"]
    assert {"ANYGRAD_WGPU_RESIDUAL", "ANYGRAD_F16_MATH", "ANYGRAD_WGPU_SHARED_BUFFER"} <= {s.name for s in tuning}
    with settings.override(ANYGRAD_WGPU_RESIDUAL=False):
        assert pipeline_cache.plan_key(g, ("ctx",)) != key
    with settings.override(ANYGRAD_WGPU_SHARED_BUFFER="64MiB"):
        assert pipeline_cache.plan_key(g, ("ctx",)) != key
    with settings.override(ANYGRAD_WGPU_PROFILE=True, ANYGRAD_DP_TIMELINE="t.json"):
        assert pipeline_cache.plan_key(g, ("ctx",)) == key


def test_the_settings_command_lists_every_setting_and_prints_the_table(capsys, monkeypatch):
    from anygrad import cli
    monkeypatch.setenv("ANYGRAD_NUMPY_THREADS", "3")
    assert cli.main(["settings"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(settings.all_settings()) and "ANYGRAD_NUMPY_THREADS=3  (user)" in out
    assert cli.main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == settings.markdown_table()

    monkeypatch.setenv("ANYGRAD_NUMPY_THREADS", "lots")   # a bad value: flagged in its row, the rest listed
    assert cli.main(["settings"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(settings.all_settings())
    assert any(line.startswith("ANYGRAD_NUMPY_THREADS=lots  (user)  error:") for line in out), out
