"""What a model's pipelines cost to build, kernel by kernel, on one WebGPU implementation: each
pipeline's creation timed on the thread that builds it (16 at once on a 16-core host), grouped by
op kind and by whether it runs on matrix units, with the shader's size. Question (issue 43):
ResNet-50's f16 compile on Dawn took 2.1x wgpu-native's (rules: 264 pipelines in 7.2 s on 16
threads, 2026-12-04); which kernels make that?

    __GL_SHADER_DISK_CACHE=0 ANYGRAD_AUTOTUNE=0 python benchmarks/probes/pipeline_costs.py \
        --model resnet50:64 --device wgpu:dawn --precision f16 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50:64")
    ap.add_argument("--device", default="wgpu:dawn")
    ap.add_argument("--precision", default="f16")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--profile", action="store_true", help="also the step's GPU time by op kind (timestamps)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("ANYGRAD_PIPELINE_CACHE", "0")
    from models import compiled_model

    from anygrad.backends.wgpu.runtime.backend import WgpuBackend
    from anygrad.backends.wgpu.tuning.profiling import op_kind
    built: list[tuple[str, float, int, float]] = []   # name, seconds, WGSL lines, thread start (since t0)
    lock = threading.Lock()
    create = WgpuBackend._create_pipeline
    t0 = time.perf_counter()

    def timed(self, key, name):
        start = time.perf_counter()
        pipe = create(self, key, name)
        with lock:
            built.append((name, time.perf_counter() - start, key[0].count("\n"), start - t0))
        return pipe
    WgpuBackend._create_pipeline = timed
    model, x, y = compiled_model(args.model, args.device, args.precision)
    t0 = time.perf_counter()
    model.train_on_batch(x, y)
    wall = time.perf_counter() - t0
    inputs, targets = model._batch(x, y)
    exe = model.train_program(inputs, targets)

    def group(key) -> dict:
        out: dict[str, list[float]] = {}
        for n, s, lines, _ in built:
            k = key(n)
            acc = out.setdefault(k, [0, 0.0, 0])
            acc[0] += 1
            acc[1] += s
            acc[2] += lines
        return {k: {"pipelines": v[0], "seconds": round(v[1], 3), "mean_lines": v[2] // max(v[0], 1)}
                for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}
    out = {"model": args.model, "device": model.backend.description, "precision": model.precision,
           "threads": os.environ.get("ANYGRAD_PIPELINE_THREADS", "default"),
           "first_step_s": wall, "compile_times": exe.compile_times.as_dict(), "pipelines": len(built),
           "thread_seconds": round(sum(s for _, s, _, _ in built), 3),
           "by_units": group(lambda n: "matrix units" if "[mma " in n else "ALU"),
           "by_kind": group(op_kind),
           "slowest": [{"name": n, "s": round(s, 3), "lines": lines}
                       for n, s, lines, _ in sorted(built, key=lambda b: -b[1])[:args.top]]}
    if args.profile:
        prof = exe.step_profile({**inputs, **targets}, repeat=3)
        out["gpu_one_pass_ms"] = prof.step_ns / 1e6
        out["gpu_by_kind_us"] = {k: [n, round(ns / 1e3, 1)] for k, n, ns in prof.by_kind()}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
