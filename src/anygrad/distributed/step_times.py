"""Where a data-parallel step's host time goes: the per-phase totals that breakdown() reports
and, with ANYGRAD_DP_TIMELINE=<path>, a timeline of when each phase ran on which thread
(anygrad.timeline: a Chrome trace, the first ANYGRAD_DP_TIMELINE_STEPS steps, default 50).
StepTimes is DataParallel's half that records them; every other part of the step calls
_spent and _mark. Separate because it only observes: nothing it records changes a step.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

TIMELINE_ENV = "ANYGRAD_DP_TIMELINE"


class StepTimes:
    """The phase totals and the timeline, for DataParallel (which owns timings, steps, timeline)."""

    def _spent(self, what: str, since: float, args: dict | None = None) -> None:
        """Phase `what`, begun at `since` on this thread, into the totals (breakdown) and the timeline."""
        now = time.perf_counter()
        self.timings[what] = self.timings.get(what, 0.0) + now - since
        if self.timeline is not None:
            self.timeline.record(what, since, now, args)

    def _mark(self, what: str, since: float, args: dict | None = None) -> None:
        """A span for the timeline only (a wait or a part of a phase that breakdown does not total)."""
        if self.timeline is not None:
            self.timeline.record(what, since, time.perf_counter(), args)

    def write_timeline(self) -> Path | None:
        """Save the timeline now (it is also written after its last kept step and at exit); None
        without ANYGRAD_DP_TIMELINE. A failed write is reported, not raised: training goes on."""
        if self.timeline is None:
            return None
        try:
            return self.timeline.write()
        except OSError as e:
            print(f"anygrad: timeline not written to {self.timeline.path}: {e}", file=sys.stderr)
            return None

    def breakdown(self, reset: bool = True) -> dict[str, float]:
        """Host milliseconds per step in each part of the data-parallel step, since the last reset:
        submit (the main thread handing each device its shard), run<i> (device i's thread
        uploading its shard (upload<i> of it, on a GPU), encoding and submitting its gradient phase: on a GPU the host's part,
        on a CPU device the whole computation; with --sync-batchnorm also the waits for the other
        replicas), compute_wait<i> (device i finishing the step up to its first bucket and that
        bucket's readback), readback<i> (waiting for its other buckets), sum (with ranks: host sum
        of this process's devices' parts), all_reduce_wait (gloo beyond what overlapped),
        write_back (the reduced gradient into the devices' upload memory; without ranks, summed
        on the way), update (the update programs), hash, and step (the whole). The device
        threads' parts overlap the main thread's."""
        steps = max(1, self.steps)
        out = {k: 1000.0 * v / steps for k, v in self.timings.items()}
        if reset:
            self.timings, self.steps = {}, 0
        return out
