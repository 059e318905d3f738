"""Why a GEMM plan timed after others in one process reads 2-7x slow on Dawn (session 55's
open question): one plan P timed again and again, between and after other plans, with the GPU's
clocks, power and throttle reasons sampled by nvidia-smi every 20 ms beside each measurement.

    python benchmarks/probes/dawn_order_effect.py --shape 768x3072x2048 --layout tn --json out.json

Measurements, in order: P repeated; P in one long pass; P after the other plans' pipelines are
built but not run; P after each other plan has run; P after 3 s idle; P after the others are
dropped; P rebuilt; P after 3 s idle and a spin (profiling.SPIN_MS of untimed runs), which the
timers now run first. If P's time follows the SM clock, it is the clocks; if it follows what ran
before at the same clock, it is state the others leave (caches, the driver's carve-out).
Answer (H200, 2026-12-04): the clocks. Idle for a few seconds, the SM clock is at 345 MHz and P reads
0.458 ms; in a burst it is at 1,980 MHz and P reads 0.094 ms, whatever ran before.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemm_mma import PLANS, Bench, parse_shape

QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


class Clocks:
    """nvidia-smi sampled every 20 ms in a thread: (perf_counter, sm MHz, mem MHz, W, C, reasons)."""

    def __init__(self):
        self.samples: list[tuple] = []
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                          "-lms", "20"], stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.perf_counter(), float(parts[0]), float(parts[1]), float(parts[2]),
                                     float(parts[3]), parts[4]))
            except (ValueError, IndexError):
                continue

    def window(self, t0: float, t1: float) -> dict:
        got = [s for s in self.samples if t0 <= s[0] <= t1 + 0.02]
        if not got:
            return {}
        return {"sm_mhz": [min(s[1] for s in got), max(s[1] for s in got)], "mem_mhz": max(s[2] for s in got),
                "watts": max(s[3] for s in got), "celsius": max(s[4] for s in got),
                "reasons": sorted({s[5] for s in got})}

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="768x3072x2048")
    ap.add_argument("--layout", default="tn")
    ap.add_argument("--plan", default="mma rules")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bench = Bench(parse_shape(args.shape), args.layout)
    clocks = Clocks()
    time.sleep(0.5)
    out: list[dict] = []

    def measure(label: str, ds: list, reps: int = args.reps, spun: bool = False) -> None:
        t0 = time.perf_counter()
        s = bench.seconds(ds, reps, 1, spun=spun)
        t1 = time.perf_counter()
        entry = {"label": label, "ms": round(s * 1e3, 4), "tflops": round(bench.flops / s / 1e12, 1),
                 "wall_s": round(t1 - t0, 3)} | clocks.window(t0, t1)
        print(json.dumps(entry), flush=True)
        out.append(entry)

    pin = {**PLANS[args.plan], "_gemm_splits": 1}
    _, p = bench.build(pin)
    bench.run(p, 2)
    for i in range(6):
        measure(f"P repeat {i}", p)
    measure("P long pass (20x reps)", p, 20 * args.reps)
    others = {}
    for name, pin_o in PLANS.items():
        if name != args.plan and "rowtiles" not in name and pin_o["_gemm_variant"] == "mma":
            try:
                others[name] = bench.build({**pin_o, "_gemm_splits": 1})[1]
            except ValueError as e:  # a tiling the adapter's workgroup storage cannot hold
                print(json.dumps({"label": f"other: {name}", "error": str(e)}), flush=True)
    for i in range(3):
        measure(f"P after {len(others)} others built, not run, {i}", p)
    for name, ds in others.items():
        bench.run(ds, 2)
        measure(f"other: {name}", ds)
        measure(f"P after {name}", p)
    time.sleep(3)
    for i in range(3):
        measure(f"P after 3 s idle {i}", p)
    for i in range(2):
        time.sleep(3)
        measure(f"P after 3 s idle, after a spin of SPIN_MS {i}", p, spun=True)
    for idle in (0.1, 0.25, 0.5, 1.0, 2.0):  # how soon the clock drops: from a burst, idle, then P
        bench.run(p, 2000)
        time.sleep(idle)
        measure(f"P after a burst and {idle} s idle", p)
    others.clear()
    gc.collect()
    for i in range(3):
        measure(f"P after the others are dropped {i}", p)
    _, p2 = bench.build(pin)
    bench.run(p2, 2)
    for i in range(3):
        measure(f"P rebuilt {i}", p2)
    clocks.stop()
    if args.json:
        args.json.write_text(json.dumps({"shape": bench.label, "plan": args.plan, "measurements": out}, indent=1))


if __name__ == "__main__":
    main()
