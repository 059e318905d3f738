"""Host <-> device copies of float32 state, as a data-parallel step's gradient exchange does them:
each way, host milliseconds and GB/s, median of --repeats, at a few sizes.

    python benchmarks/probes/host_transfers.py --mb 8,45 --json out.json

Rows: host -> host (one thread, and _parallel.copy over the threads: the host's own bandwidth);
device -> host (export_states_async: a copy into a kept MAP_READ buffer, the map, the copy out);
host -> device through queue.write_buffer (Backend.upload), and through a kept mapped upload
buffer (import_view) filled by one thread or over the threads, each waited for on the GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _measure(backend, mb: float, repeats: int) -> list[dict]:
    from anygrad import _parallel
    n = int(mb * (1 << 20)) // 4
    name = f"transfer.{n}"
    src = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    dst = np.empty_like(src)
    backend.set_state(name, src)
    st = backend.placed_state(name)

    def gpu_done() -> None:  # a 4-byte readback: everything submitted before it has run
        backend.device.queue.read_buffer(st.buffer, st.offset, 4)

    def write_buffer() -> None:
        backend.upload(st.buffer, st.offset, src)
        gpu_done()

    def mapped(threads: bool):
        def go() -> None:
            view, commit = backend.import_view([name])
            try:
                _parallel.copy(view, src) if threads else np.copyto(view, src)
            finally:
                commit()
            gpu_done()
        return go

    cases = {"host -> host, 1 thread": lambda: np.copyto(dst, src),
             "host -> host, threads": lambda: _parallel.copy(dst, src),
             "device -> host (export_states_async)": lambda: backend.export_states_async([name], dst)(),
             "host -> device, write_buffer": write_buffer}
    got = backend.import_view([name])
    if got is not None:
        got[1]()
        cases |= {"host -> device, mapped, 1 thread": mapped(False),
                  "host -> device, mapped, threads": mapped(True)}
    rows = []
    for label, fn in cases.items():
        ms = _median_ms(fn, repeats)
        rows.append({"case": label, "mb": mb, "ms": ms, "gb_per_s": n * 4 / ms / 1e6})
        print(f"{mb:6.1f} MB  {label:40s} {ms:8.3f} ms  {n * 4 / ms / 1e6:6.1f} GB/s", flush=True)
    backend.export_states([name], dst)
    np.testing.assert_array_equal(dst, src)  # the last write landed
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="wgpu:0")
    ap.add_argument("--mb", default="8,45", help="sizes in MB (comma list)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from anygrad import _parallel
    from anygrad.backends.wgpu import WgpuBackend
    backend = WgpuBackend(args.device)
    print(f"{backend.description}; polls freely: {backend.ctx.polls_freely}; threads: {_parallel.workers()}")
    rows = []
    for mb in (float(v) for v in args.mb.split(",") if v):
        rows += _measure(backend, mb, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": backend.description, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
