"""What a data-parallel write-back costs the host: a summed gradient bucket written into a device's
mapped upload memory, on one thread or spread over several.

    python benchmarks/probes/probe_writeback.py                # the first GPU adapter
    python benchmarks/probes/probe_writeback.py --mb 2 --repeats 5

At the end of a data-parallel step the last buckets come back from gloo and are written into each
device's upload memory (DataParallel._write_back, Backend.import_view), then copied on the GPU into
the gradients. That write is on the step's critical path. This probe times it as a step does it,
from a bucket in mapped readback memory (where the device put it, and gloo summed it) into mapped
upload memory:

- rank:    one part times 1/ranks into one device's upload memory (a rank's one device);
- devices: two devices' parts summed, halved, into both devices' upload memory (one process).

Each at 1, 2, 4 and 8 threads (chunks of the bucket over the host's thread pool, as
DataParallel._combine cuts them), the median of `--repeats` runs; also the map and the commit
(unmap and the copy's submission). On 2 H200s (session 40) one thread wrote 2 MB in 0.17 ms and
eight took 0.52 ms: hence DataParallel.MAPPED_COPY_WRITERS and MAPPED_SUM_WRITERS.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

THREADS = (1, 2, 4, 8)
MIN_CHUNK = 1 << 15  # floats, as DataParallel.MIN_SUM_CHUNK
MAX_CHUNK = 1 << 18  # as DataParallel.SUM_CHUNK


def spans(n: int, threads: int) -> list[tuple[int, int]]:
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, -(-n // threads)))
    return [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]


def probe(device_name: str, mb: float, repeats: int) -> dict:
    import wgpu

    from anygrad import _parallel
    from anygrad.backends.wgpu import WgpuBackend
    from anygrad.backends.wgpu.runtime.buffers import _mapped_view
    backend = WgpuBackend(device_name)
    dev, U = backend.device, wgpu.BufferUsage
    nbytes = int(mb * (1 << 20)) // 4 * 4
    n = nbytes // 4
    values = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    source = dev.create_buffer(size=nbytes, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
    dev.queue.write_buffer(source, 0, values)
    readback = [dev.create_buffer(size=nbytes, usage=U.MAP_READ | U.COPY_DST) for _ in range(2)]
    upload = [dev.create_buffer(size=nbytes, usage=U.MAP_WRITE | U.COPY_SRC) for _ in range(2)]
    scratch = threading.local()

    def once(case: str, threads: int) -> tuple[float, float, float]:
        """(map, write, commit) seconds of one write-back."""
        parts = readback[:1] if case == "rank" else readback
        into = upload[:1] if case == "rank" else upload
        enc = dev.create_command_encoder()
        for buf in parts:
            enc.copy_buffer_to_buffer(source, 0, buf, 0, nbytes)
        dev.queue.submit([enc.finish()])
        for buf in parts:
            buf.map_sync(wgpu.MapMode.READ)
        got = [_mapped_view(buf, nbytes).view(np.float32) for buf in parts]
        t0 = time.perf_counter()
        for buf in into:
            buf.map_sync(wgpu.MapMode.WRITE)
        t1 = time.perf_counter()
        dst = [_mapped_view(buf, nbytes).view(np.float32) for buf in into]

        def work(share: list[tuple[int, int]]) -> list[None]:
            if getattr(scratch, "buf", None) is None:
                scratch.buf = np.empty(MAX_CHUNK, np.float32)
            for lo, hi in share:
                if len(got) == 1:
                    np.multiply(got[0][lo:hi], np.float32(0.5), out=dst[0][lo:hi])
                    continue
                out = scratch.buf[:hi - lo]
                np.add(got[0][lo:hi], got[1][lo:hi], out=out)
                np.multiply(out, np.float32(0.5), out=out)
                for d in dst:
                    np.copyto(d[lo:hi], out)
            return [None] * len(share)
        cut = spans(n, threads)
        _parallel.map_shares(work, cut, min(len(cut), threads), blas=False)
        t2 = time.perf_counter()
        enc = dev.create_command_encoder()
        for buf in into:
            buf.unmap()
            enc.copy_buffer_to_buffer(buf, 0, source, 0, nbytes)
        dev.queue.submit([enc.finish()])
        t3 = time.perf_counter()
        for buf in parts:
            buf.unmap()
        return t1 - t0, t2 - t1, t3 - t2

    cases = [(case, threads) for case in ("rank", "devices") for threads in THREADS]
    for case, threads in cases:  # first maps of each buffer (page faults) out of the timing
        once(case, threads)
    times: dict[tuple[str, int], list[tuple[float, float, float]]] = {c: [] for c in cases}
    for _ in range(repeats):  # interleaved, so that drifts of the host hit every case alike
        for c in cases:
            times[c].append(once(*c))
    rows = [{"case": case, "threads": threads,
             **{what: 1000 * statistics.median(t[j] for t in times[(case, threads)])
                for j, what in enumerate(("map_ms", "write_ms", "commit_ms"))}}
            for case, threads in cases]
    return {"adapter": backend.adapter.summary, "mb": mb, "repeats": repeats, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="wgpu")
    p.add_argument("--mb", type=float, default=2.0, help="the bucket's size")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json")
    args = p.parse_args(argv)
    got = probe(args.device, args.mb, args.repeats)
    print(f"{got['adapter']}: a {args.mb:g} MB bucket into mapped upload memory")
    for r in got["rows"]:
        print(f"  {r['case']:8s} {r['threads']} threads: map {r['map_ms']:.3f}  write {r['write_ms']:.3f}  "
              f"commit {r['commit_ms']:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
