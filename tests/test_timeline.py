"""anygrad.timeline (per-thread spans as a Chrome trace) and DataParallel's ANYGRAD_DP_TIMELINE."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_distributed import _mlp

import anygrad
from anygrad import timeline
from anygrad.optim import Adam

SLACK_US = 50.0  # perf_counter read twice around the same instant (a span's end, the step's end)


def _spans(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _thread_names(trace: dict) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_spans_become_a_chrome_trace_with_named_threads(tmp_path):
    tl = timeline.Timeline(tmp_path / "t.json", pid=3, process="rank 3")

    def worker() -> None:
        with tl.span("work", {"bucket": 1}):
            time.sleep(0.002)
    with tl.span("step"):
        t = threading.Thread(target=worker, name="helper")
        t.start()
        t.join()
    tl.end_step()
    trace = json.loads(tl.write().read_text())
    spans = _spans(trace)
    assert [s["name"] for s in spans] == ["step", "work"]  # ordered by start
    names = _thread_names(trace)
    assert {names[(3, s["tid"])] for s in spans} == {threading.current_thread().name, "helper"}
    assert all(s["pid"] == 3 and s["dur"] >= 0 and s["args"]["step"] == 0 for s in spans)
    step, work = spans
    assert work["dur"] >= 2000 and step["ts"] <= work["ts"] and work["ts"] + work["dur"] <= step["ts"] + step["dur"]
    assert work["args"]["bucket"] == 1
    assert {"ph": "M", "name": "process_name", "pid": 3, "tid": 0, "args": {"name": "rank 3"}} in trace["traceEvents"]


def test_only_the_first_steps_are_kept_and_unset_means_no_timeline(tmp_path, monkeypatch):
    tl = timeline.Timeline(tmp_path / "t.json", max_steps=2)
    ends = []
    for _ in range(4):
        tl.record("step", time.perf_counter(), time.perf_counter())
        ends.append(tl.end_step())
    assert ends == [False, True, False, False]  # True once: when the file is to be written
    assert len(tl.events) == 2
    monkeypatch.delenv("ANYGRAD_DP_TIMELINE", raising=False)
    assert timeline.from_env("ANYGRAD_DP_TIMELINE") is None
    assert timeline.rank_path("out/trace.json", 1) == Path("out/trace.rank1.json")
    assert timeline.rank_path("out/trace.json", None) == Path("out/trace.json")


def test_merge_keeps_each_rank_as_a_process(tmp_path):
    paths = []
    for rank in (0, 1):
        tl = timeline.Timeline(tmp_path / f"t.rank{rank}.json", pid=rank)
        tl.record("step", time.perf_counter(), time.perf_counter())
        paths.append(tl.write())
    assert timeline.main([str(tmp_path / "all.json"), *map(str, paths)]) == 0
    merged = json.loads((tmp_path / "all.json").read_text())
    assert sorted(s["pid"] for s in _spans(merged)) == [0, 1]


def test_data_parallel_writes_a_timeline_of_its_steps(tmp_path, monkeypatch):
    """Two cpu devices: the main thread's step spans, and the device threads' spans inside them."""
    monkeypatch.setenv("ANYGRAD_DP_TIMELINE", str(tmp_path / "trace.json"))
    monkeypatch.setenv("ANYGRAD_DP_TIMELINE_STEPS", "3")
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 20)).astype(np.float32), rng.integers(0, 4, 16)
    m = anygrad.load_onnx(str(_mlp(tmp_path / "mlp.onnx"))).compile(optimizer=Adam(lr=0.01), device="cpu,cpu")
    for _ in range(4):  # the file is written after the third; the fourth is not kept
        m.train_step(x, y)
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = _spans(trace)
    names = _thread_names(trace)
    steps = sorted((s for s in spans if s["name"] == "step"), key=lambda s: s["ts"])
    assert [s["args"]["step"] for s in steps] == [0, 1, 2]
    assert {names[(s["pid"], s["tid"])] for s in steps} == {"MainThread"}
    device = [s for s in spans if s["name"].startswith(("run", "readback", "compute_wait", "update"))
              and s["name"] != "update"]
    assert {s["name"] for s in device} >= {"run0", "run1", "update0", "update1"}
    # the devices' parts on the pool's threads (which one takes which device varies), beside the main thread's
    assert "MainThread" not in {names[(s["pid"], s["tid"])] for s in device}
    assert len({names[(s["pid"], s["tid"])] for s in spans}) > 1
    assert {"submit", "write_back", "update"} <= {s["name"] for s in spans}
    for s in spans:  # every span inside its step
        step = steps[s["args"]["step"]]
        assert s["dur"] >= 0
        assert step["ts"] - SLACK_US <= s["ts"] and s["ts"] + s["dur"] <= step["ts"] + step["dur"] + SLACK_US, s
    # nothing more is kept, nor written at exit
    assert len(m.strategy.timeline.events) == len(spans) == m.strategy.timeline.written


def test_data_parallel_without_the_variable_records_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("ANYGRAD_DP_TIMELINE", raising=False)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 20)).astype(np.float32), rng.integers(0, 4, 16)
    m = anygrad.load_onnx(str(_mlp(tmp_path / "mlp.onnx"))).compile(optimizer=Adam(lr=0.01), device="cpu,cpu")
    m.train_step(x, y)
    assert m.strategy.timeline is None and m.strategy.write_timeline() is None
    assert not list(tmp_path.glob("*.json"))


def test_merge_refuses_what_is_not_a_trace_with_the_file_named(tmp_path, capsys):
    """`python -m anygrad.timeline` reads files a user names: a missing, truncated, foreign, deeply
    nested or huge one is a DataError naming it (the command prints it and exits 1), and random
    bytes never escape as another exception."""
    from anygrad.errors import DataError
    good = tmp_path / "good.json"
    tl = timeline.Timeline(good)
    tl.record("step", 0.0, 1e-3)
    tl.write()
    text = good.read_text()
    cases = {"missing.json": None, "truncated.json": text[: len(text) // 2], "list.json": "[1, 2, 3]",
             "no_ts.json": json.dumps({"traceEvents": [{"ph": "X", "name": "a"}]}),
             "nested.json": "[" * 100_000 + "]" * 100_000, "binary.json": bytes(range(256)) * 4}
    for name, content in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        with pytest.raises(DataError, match=name):
            timeline.merge([good, path])
    rng = np.random.default_rng(0)
    for k in range(200):  # mutations of a real trace: DataError or a valid merge, nothing else
        raw = bytearray(text.encode())
        for at in rng.integers(0, len(raw), rng.integers(1, 8)):
            raw[at] = int(rng.integers(0, 256))
        path = tmp_path / f"fuzz{k}.json"
        path.write_bytes(bytes(raw))
        try:
            merged = timeline.merge([path])
        except DataError as e:
            assert path.name in str(e)
        else:
            assert isinstance(merged["traceEvents"], list)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(timeline.MAX_TRACE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(DataError, match="larger than"):
        timeline.merge([big])
    assert timeline.main([str(tmp_path / "out.json"), str(tmp_path / "list.json")]) == 1
    assert "list.json" in capsys.readouterr().err and not (tmp_path / "out.json").exists()
    assert timeline.main([str(tmp_path / "out.json"), str(good)]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["traceEvents"]
