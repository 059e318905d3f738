"""A per-thread timeline of named spans, written as Chrome trace-event JSON (Perfetto, chrome://tracing).

Totals per phase (DataParallel.breakdown) say how long each part of a step took, not when it ran
nor which thread waited on which; a timeline of (thread, phase, start, end) does. Spans are
recorded with time.perf_counter, which on Linux is CLOCK_MONOTONIC, one clock for every process
of a machine: the files of several ranks of one host line up when merged (`merge`, or
`python -m anygrad.timeline merged.json trace.rank*.json`).

Recording is an append of a tuple to a list: list.append is atomic under the GIL (and under the
free-threaded build's per-object locks), so threads record without a lock. What is kept is
bounded: the first `max_steps` steps (the caller says where a step ends, `end_step`) and at most
`max_events` spans in all, so a long run neither grows without end nor writes a huge file. A
disabled timeline is no object at all (`from_env` returns None): callers test for None, which
costs nothing measurable.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import settings
from .errors import DataError
from .fsutil import atomic_write

MAX_STEPS = 50  # steps kept by default: a compiling first step, warm-up, and a few dozen timed ones
MAX_EVENTS = 200_000  # a hard cap whatever a step records (a few tens of MB of JSON)


class Timeline:
    """Spans of named phases per thread, for the first `max_steps` steps; `write` saves them as a
    Chrome trace whose process is `pid` (the rank) named `process`."""

    def __init__(self, path: str | os.PathLike | None = None, pid: int = 0, process: str = "anygrad",
                 max_steps: int = MAX_STEPS, max_events: int = MAX_EVENTS):
        self.path = Path(path) if path is not None else None
        self.pid, self.process = int(pid), process
        self.max_steps, self.max_events = max(1, int(max_steps)), max(1, int(max_events))
        self.steps = 0  # steps ended so far: the step number a span is tagged with
        self.events: list[tuple[str, float, float, str, int, int, dict | None]] = []
        self.written = 0  # len(events) at the last write: the exit hook writes only what is new
        self._ended = False

    @property
    def full(self) -> bool:
        return self.steps >= self.max_steps or len(self.events) >= self.max_events

    def record(self, name: str, start: float, end: float, args: dict | None = None) -> None:
        """Span `name` from `start` to `end` (perf_counter seconds) on the calling thread."""
        if self.full:  # racy by a few spans at most under max_events: harmless, and no lock
            return
        t = threading.current_thread()
        self.events.append((name, start, end, t.name, threading.get_native_id(), self.steps, args))

    @contextmanager
    def span(self, name: str, args: dict | None = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, start, time.perf_counter(), args)

    def end_step(self) -> bool:
        """A step ended (call it on the thread that runs the steps, after its last span); True once,
        at the step after which nothing more is kept (max_steps, or max_events reached): the moment
        to write."""
        if self._ended:
            return False
        self.steps += 1
        self._ended = self.full
        return self._ended

    def trace(self) -> dict[str, Any]:
        """The Chrome trace-event document: an "X" (complete) event per span, in microseconds, and
        "M" events naming the process and the threads. Threads of one name share a track (tid), so a
        thread started anew every step (DataParallel's bucket reader) stays on one line; the OS
        thread id is in each span's args."""
        events = list(self.events)  # a snapshot: other threads may still append
        tids: dict[str, int] = {}
        out: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0,
                                      "args": {"name": self.process}}]
        spans = []
        for name, start, end, thread, native, step, args in events:
            tid = tids.setdefault(thread, len(tids) + 1)
            spans.append({"ph": "X", "name": name, "cat": "step" if name == "step" else "phase",
                          "pid": self.pid, "tid": tid, "ts": round(start * 1e6, 3),
                          "dur": round(max(0.0, end - start) * 1e6, 3),
                          "args": {"step": step, "os_tid": native, **(args or {})}})
        for thread, tid in tids.items():
            out.append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid, "args": {"name": thread}})
            # MainThread first, then the threads in the order they first recorded
            out.append({"ph": "M", "name": "thread_sort_index", "pid": self.pid, "tid": tid,
                        "args": {"sort_index": tid}})
        spans.sort(key=lambda e: e["ts"])
        return {"traceEvents": out + spans, "displayTimeUnit": "ms",
                "otherData": {"clock": "time.perf_counter (microseconds)", "steps": self.steps,
                              "max_steps": self.max_steps, "spans": len(spans)}}

    def write(self, path: str | os.PathLike | None = None) -> Path:
        """Save the trace (atomically: a reader never sees half a file) at `path` or self.path."""
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("Timeline.write: no path given and the timeline has none")
        n = len(self.events)
        atomic_write(target, json.dumps(self.trace()), fsync=False)
        self.written = n
        return target

    def write_at_exit(self) -> None:
        """Register a write at interpreter exit of whatever was recorded after the last write (a run
        shorter than max_steps). An error there is reported, not raised: the run's result stands."""
        def flush() -> None:
            if self.path is not None and len(self.events) > self.written:
                try:
                    self.write()
                except OSError as e:
                    print(f"anygrad: timeline not written to {self.path}: {e}", file=sys.stderr)
        atexit.register(flush)


def rank_path(path: str | os.PathLike, rank: int | None) -> Path:
    """`path` with `.rank<N>` before its suffix (trace.json -> trace.rank1.json); unchanged for None."""
    path = Path(path)
    return path if rank is None else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def from_env(var: str, rank: int | None = None, process: str = "anygrad") -> Timeline | None:
    """A timeline writing to the path in the declared setting `var` (with the rank inserted, rank_path),
    keeping `<var>_STEPS` steps and written at exit; None where `var` is unset or empty."""
    path = settings.get(var)
    if not path:
        return None
    steps = settings.get(f"{var}_STEPS")
    tl = Timeline(rank_path(path, rank), pid=rank or 0, process=process, max_steps=steps)
    tl.write_at_exit()
    return tl


MAX_TRACE_BYTES = 512 << 20  # a trace file larger than this is not one of ours (MAX_EVENTS spans are far less)


def read_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of a Chrome trace file; DataError naming the file for anything else (a missing,
    huge, truncated or foreign file), in bounded time and memory."""
    path = Path(path)
    hint = "give the files that ANYGRAD_DP_TIMELINE wrote"
    try:
        if path.stat().st_size > MAX_TRACE_BYTES:
            raise DataError(f"timeline {path}: larger than {MAX_TRACE_BYTES >> 20} MiB, not a trace anygrad wrote; {hint}")
        doc = json.loads(path.read_bytes())
    except OSError as e:
        raise DataError(f"timeline {path}: cannot read it ({e.strerror or e}); {hint}") from e
    except (ValueError, RecursionError) as e:  # JSON or UTF-8 errors, absurd nesting
        raise DataError(f"timeline {path}: not JSON ({str(e)[:120]}); {hint}") from e
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list) or not all(
            isinstance(e, dict) and (e.get("ph") == "M" or isinstance(e.get("ts"), (int, float))) for e in events):
        raise DataError(f"timeline {path}: not a Chrome trace (a 'traceEvents' list of events with times); {hint}")
    return events


def merge(paths: list[str | os.PathLike]) -> dict[str, Any]:
    """One trace of several files (the ranks of one job: pid = rank), to see them side by side."""
    events: list[dict[str, Any]] = []
    for p in paths:
        events += read_trace(p)
    meta = [e for e in events if e.get("ph") == "M"]
    spans = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: e["ts"])
    return {"traceEvents": meta + spans, "displayTimeUnit": "ms"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python -m anygrad.timeline MERGED.json TRACE.json [TRACE.json ...]", file=sys.stderr)
        return 2
    try:
        atomic_write(argv[0], json.dumps(merge(argv[1:])), fsync=False)
    except (DataError, OSError) as e:
        print(f"anygrad: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
