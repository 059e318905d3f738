"""The wgpu compile cache: compiled plans on disk (reused, bit-identical, robust to corrupt files,
switched off by ANYGRAD_PIPELINE_CACHE=0) and pipelines created on a thread pool."""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import assert_close, make_graph, wgpu_backend

from anygrad.backends import NumpyBackend
from anygrad.backends.wgpu.device import pipeline_cache
from anygrad.ir import Node

pytestmark = pytest.mark.wgpu


@pytest.fixture(scope="module")
def wb():
    return wgpu_backend()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ANYGRAD_CACHE", str(tmp_path))
    monkeypatch.setenv("ANYGRAD_PIPELINE_CACHE", "1")
    for k in pipeline_cache.stats:
        monkeypatch.setitem(pipeline_cache.stats, k, 0)
    return tmp_path / "wgpu-plans"


def _graph(scale: float = 0.5):
    # MatMul + bias + Relu + a constant: fused kernels, a constant buffer, a planned temp
    nodes = [Node("MatMul", ["x", "w"], ["h"], {}), Node("Add", ["h", "b"], ["hb"], {}),
             Node("Relu", ["hb"], ["r"], {}), Node("Mul", ["r", "s"], ["y"], {}),
             Node("ReduceSum", ["y"], ["t"], {"keepdims": 0})]
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((6, 5)).astype(np.float32),
             "b": rng.standard_normal(5).astype(np.float32), "s": np.float32(scale)}
    return make_graph(nodes, ["x"], ["y", "t"], {"x": (np.float32, (3, 6))}, inits)


def _feeds():
    return {"x": np.random.default_rng(1).standard_normal((3, 6)).astype(np.float32)}


def test_warm_compile_reuses_the_plan_bit_identically(wb, cache):
    cold = wb.compile(_graph())
    assert pipeline_cache.stats["writes"] == 1 and len(list(cache.glob("*.plan"))) == 1
    warm = wb.compile(_graph())
    assert pipeline_cache.stats["hits"] == 1
    assert [st.kernel.wgsl for st in warm.plan.steps] == [st.kernel.wgsl for st in cold.plan.steps]
    a, b = cold.run(_feeds()), warm.run(_feeds())
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k
    assert_close(NumpyBackend().compile(_graph()).run(_feeds()), b)


def test_a_different_constant_is_a_different_plan(wb, cache):
    wb.compile(_graph(0.5))
    exe = wb.compile(_graph(2.0))
    assert pipeline_cache.stats["hits"] == 0 and pipeline_cache.stats["writes"] == 2
    assert_close(NumpyBackend().compile(_graph(2.0)).run(_feeds()), exe.run(_feeds()))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped", "empty"])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(wb, cache, damage):
    wb.compile(_graph())
    (path,) = cache.glob("*.plan")
    raw = path.read_bytes()
    path.write_bytes({"garbage": b"\x00not a plan" * 50, "truncated": raw[:len(raw) // 2],
                      "flipped": raw[:-10] + bytes([raw[-10] ^ 0xFF]) + raw[-9:], "empty": b""}[damage])
    exe = wb.compile(_graph())
    assert pipeline_cache.stats["corrupt"] == 1 and pipeline_cache.stats["hits"] == 0
    assert_close(NumpyBackend().compile(_graph()).run(_feeds()), exe.run(_feeds()))
    assert path.read_bytes() == raw  # rewritten whole
    wb.compile(_graph())
    assert pipeline_cache.stats["hits"] == 1


def test_switch_off_and_unwritable_folder(wb, cache, monkeypatch, tmp_path):
    monkeypatch.setenv("ANYGRAD_PIPELINE_CACHE", "0")
    wb.compile(_graph())
    assert not cache.exists() and pipeline_cache.stats == dict.fromkeys(pipeline_cache.stats, 0)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("ANYGRAD_PIPELINE_CACHE", "1")
    monkeypatch.setenv("ANYGRAD_CACHE", str(blocker))  # the cache folder cannot be created
    exe = wb.compile(_graph())
    assert_close(NumpyBackend().compile(_graph()).run(_feeds()), exe.run(_feeds()))


def test_build_parallel_creates_each_key_once_and_raises_on_the_caller(monkeypatch):
    monkeypatch.setenv("ANYGRAD_PIPELINE_THREADS", "3")
    calls = []

    def create(k):
        calls.append(k)
        if k == "bad":
            raise RuntimeError("cannot compile bad")
        return k * 2

    assert pipeline_cache.build_parallel(create, ["a", "b", "a", "c"]) == {"a": "aa", "b": "bb", "c": "cc"}
    assert sorted(calls) == ["a", "b", "c"]
    with pytest.raises(RuntimeError, match="cannot compile bad"):
        pipeline_cache.build_parallel(create, ["a", "bad"])


def test_the_plan_key_covers_the_code_of_every_lowering_folder(monkeypatch, tmp_path):
    """A plan cached by other code is never reused: the source hash reads every file of the wgpu
    backend (its fusion/, kernels/, planning/, ... subfolders too), the IR and the ops, and a
    changed file changes the plan key."""
    files = pipeline_cache.source_files()
    for must in ("backends/wgpu/kernels/kernels_gemm.py", "backends/wgpu/fusion/passes.py",
                 "backends/wgpu/planning/planner.py", "backends/wgpu/device/pipeline_cache.py",
                 "ir/graph.py", "ops/nn.py"):
        assert must in files and files[must].is_file(), must
    code = tmp_path / "lowering.py"
    code.write_text("x = 1\n")
    monkeypatch.setattr(pipeline_cache, "source_files", lambda: {"lowering.py": code})
    keys = []
    for text in ("x = 1\n", "x = 2\n"):
        code.write_text(text)
        monkeypatch.setattr(pipeline_cache, "_SOURCE_HASH", None)
        keys.append(pipeline_cache.plan_key(_graph(), ("ctx",)))
    assert keys[0] != keys[1]
