"""Where a training step's wall time goes beyond its GPU time, one model on one device: the
trainer's train_step loop (inputs uploaded each step: through mapped buffers, the default, and
through queue.write_buffer, ANYGRAD_WGPU_STAGED_UPLOAD=0), the same executable's dispatch list
submitted alone in one pass a step (no uploads, no copies), the input uploads alone, and the
profile's one-pass GPU time (timestamps). ResNet-50 f16 on Dawn read 32.8 ms a step wall against
29.8 ms of GPU (2026-12-04); its input is 38.5 MB of float32 a step.

    python benchmarks/probes/step_gap.py --model resnet50:64 --device wgpu:dawn --precision f16 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_step(go, wait, seconds: float = 1.0) -> float:
    """ms a step of `go()` pipelined for about `seconds`, after 0.5 s of the same (the clock)."""
    def loop(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            go()
        wait()
        return time.perf_counter() - t0
    n, spent = 1, loop(1)
    while spent < 0.5:
        n *= 2
        spent = loop(n)
    n = max(2, int(n * seconds / spent))
    return 1e3 * min(loop(n) for _ in range(2)) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50:64")
    ap.add_argument("--device", default="wgpu:dawn")
    ap.add_argument("--precision", default="f16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from models import compiled_model

    from anygrad.backends.wgpu.tuning.profiling import encode_pass
    model, x, y = compiled_model(args.model, args.device, args.precision)
    model.train_on_batch(x, y)
    inputs, targets = model._batch(x, y)
    exe = model.train_program(inputs, targets)
    feeds = {**inputs, **targets}
    dev = exe.backend.device

    def wait() -> None:
        enc = dev.create_command_encoder()
        dev.queue.submit([enc.finish()])
        model.read_metrics(reset=True)

    def dispatch_only() -> None:
        enc = dev.create_command_encoder()
        encode_pass(enc, exe._dispatches)
        dev.queue.submit([enc.finish()])

    def upload_only() -> None:
        exe._write_inputs(feeds)
        dev.queue.submit([dev.create_command_encoder().finish()])

    out = {"model": args.model, "device": model.backend.description, "precision": model.precision,
           "input_mb": sum(np.asarray(v).nbytes for v in feeds.values()) / 1e6}
    for mode, flag in (("write_buffer", "0"), ("staged", "1")):
        os.environ["ANYGRAD_WGPU_STAGED_UPLOAD"] = flag
        out[f"train_step_ms_{mode}"] = per_step(lambda: model.train_step(x, y), wait)
        t0 = time.perf_counter()
        for _ in range(20):
            exe._write_inputs(feeds, staged=flag == "1")
        wait()
        out[f"upload_host_ms_{mode}"] = 1e3 * (time.perf_counter() - t0) / 20
    out["dispatches_only_ms"] = per_step(dispatch_only, wait)
    out["upload_only_ms_write_buffer"] = per_step(upload_only, wait)
    wait()
    prof = exe.step_profile(feeds, repeat=3)
    out["gpu_one_pass_ms"] = prof.step_ns / 1e6
    out["gpu_kernel_sum_ms"] = prof.kernel_ns / 1e6
    out["profile_wall_ms"] = prof.wall_ms
    out["kernels"] = len(exe._dispatches)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
