"""Attention forward + backward on wgpu: the fused kernels (ir/attention.py -> FusedAttention) against
the unfused chain the exporters emit (MatMul, scale, causal mask, Softmax, MatMul and their gradients).

    python benchmarks/attention.py                                  # the benchmark models' shapes
    python benchmarks/attention.py --shapes 2x2x16x8 --repeat 2     # tiny (lavapipe)

Each shape is B x H x T x D (self-attention, S = T). Both graphs compute sum(out * R) and the
gradients of q, k and v; the fused one is the same graph after the attention pass. Times are GPU
timestamps of one step (all kernels in one pass) when the adapter has `timestamp-query`, else
wall time up to a small readback; the gradients of both are compared once.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

import anygrad.ops  # noqa: F401  (op registry)
from anygrad.autodiff import gradients
from anygrad.ir import Builder, Graph, TensorInfo
from anygrad.ir.attention import fuse_attention

# GPT bench (d 256, 4 heads, T 128) at batch 32 and 128; ViT-tiny (d 192, 3 heads, 65 tokens);
# GPT-2 small (d 768, 12 heads, T 256) at batch 8.
DEFAULT_SHAPES = "32x4x128x64c,128x4x128x64c,128x3x65x64,8x12x256x64c"


def parse_shape(text: str) -> tuple[int, int, int, int, bool]:
    causal = text.endswith("c")
    b, h, t, d = (int(x) for x in text.rstrip("c").split("x"))
    return b, h, t, d, causal


def build(b: int, h: int, t: int, d: int, causal: bool, fused: bool) -> Graph:
    g = Graph(name=f"attention-{'fused' if fused else 'unfused'}")
    for name in "qkv":
        g.inputs.append(name)
        g.info[name] = TensorInfo(np.dtype(np.float32), (b, h, t, d))
    bld = Builder(g, prefix="bench")
    kt = bld.op("Transpose", ["k"], perm=[0, 1, 3, 2])
    s = bld.op("Mul", [bld.op("MatMul", ["q", kt]), bld.const(np.float32(1.0 / math.sqrt(d)))])
    if causal:
        mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)
        s = bld.op("Add", [s, bld.const(mask)])
    out = bld.op("MatMul", [bld.op("Softmax", [s], axis=-1), "v"])
    g.outputs = [out]
    if fused:
        assert fuse_attention(g) == 1
    r = bld.const(np.random.default_rng(0).standard_normal((b, h, t, d)).astype(np.float32))
    loss = bld.op("ReduceSum", [bld.op("Mul", [out, r])], keepdims=0)
    grads = gradients(g, loss, ["q", "k", "v"])
    total = bld.add_all([bld.op("ReduceSum", [grads[n]], keepdims=0) for n in "qkv"])
    g.outputs = [total] + [grads[n] for n in "qkv"]
    g.dce()
    return g


def time_step(exe, feeds: dict, repeat: int) -> tuple[float, str]:
    """ms of one step: GPU timestamps when the adapter has them, else wall time."""
    if "timestamp-query" in exe.backend.device.features:
        prof = exe.step_profile(feeds, repeat=repeat)
        return prof.step_ns / 1e6, "gpu"
    small = [exe.graph.outputs[0]]
    exe.run(feeds, small)
    t0 = time.perf_counter()
    for _ in range(repeat):
        exe.run(feeds, small)
    return (time.perf_counter() - t0) * 1e3 / repeat, "wall"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated BxHxTxD, 'c' suffix: causal")
    ap.add_argument("--device", default="wgpu")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from anygrad.devices import get_backend

    rows = []
    for text in args.shapes.split(","):
        b, h, t, d, causal = parse_shape(text)
        rng = np.random.default_rng(1)
        feeds = {n: rng.standard_normal((b, h, t, d)).astype(np.float32) for n in "qkv"}
        row: dict = {"shape": text}
        results = {}
        for fused in (False, True):
            backend = get_backend(args.device)
            graph = build(b, h, t, d, causal, fused)
            exe = backend.compile(graph)
            results[fused] = exe.run(feeds)
            ms, how = time_step(exe, feeds, args.repeat)
            key = "fused" if fused else "unfused"
            row[f"{key}_ms"], row["timing"] = ms, how
            row[f"{key}_kernels"] = len(exe.plan.steps)
        grads = [[np.asarray(a) for a in list(results[f].values())[1:]] for f in (False, True)]
        row["max_grad_diff"] = max(float(np.abs(u - f).max()) for u, f in zip(*grads))
        row["speedup"] = row["unfused_ms"] / row["fused_ms"]
        rows.append(row)
        print(f"{text:>16}  unfused {row['unfused_ms']:8.3f} ms ({row['unfused_kernels']} kernels)  "
              f"fused {row['fused_ms']:8.3f} ms ({row['fused_kernels']} kernels)  x{row['speedup']:.2f}  "
              f"[{row['timing']}]  max |d grad| {row['max_grad_diff']:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
