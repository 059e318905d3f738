"""GEMM TFLOP/s on matrix units through Dawn: anygrad's MatMul lowering at N^3, f16 operands and
result, f32 accumulation, each subgroup-matrix plan (kernels_mma.py) against the ALU kernels of
the same lowering, and cuBLAS (PyTorch) in the same process where CUDA is there.

    python benchmarks/gemm_mma.py --size 4096 --json out.json

Needs wgpudawn and an adapter listing chromium-experimental-subgroup-matrix (the H200 through
Vulkan). Each kernel runs --reps times in one pass, timed by the wall clock around a wait for the
GPU, after two warm-up runs, best of --rounds passes (a pass of a few milliseconds is at the mercy
of the wait's polling: the same kernel read 1.1 and 2.5 ms at 20 reps); the result is checked
against float64 on 64 rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# "p": register prefetch of the next K tile; "pd": that and two workgroup tiles (one barrier a K
# tile). Plans that lost on the H200 (64x64 tiles, K tile 64: 77-96 TFLOP/s) stay in
# benchmarks/results/2026-12-02-matrix-units-pm/gemm4096_dawn.json.
PLANS = {
    "mma rules": {"_gemm_variant": "mma"},
    "mma b4 t256 k32": {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 256, "_gemm_kt": 32, "_gemm_prefetch": 0},
    "mma b4 t256 k32 p": {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 256, "_gemm_kt": 32, "_gemm_prefetch": 1},
    "mma b4 t256 k16 p": {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 256, "_gemm_kt": 16, "_gemm_prefetch": 1},
    "mma b4 t256 k16 pd": {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 256, "_gemm_kt": 16, "_gemm_prefetch": 2},
    "mma b4 t256 k32 pd": {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 256, "_gemm_kt": 32, "_gemm_prefetch": 2},
    "mma b4 t128 k32 p": {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 128, "_gemm_kt": 32, "_gemm_prefetch": 1},
    "mma b4 t128 k32 pd": {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 128, "_gemm_kt": 32, "_gemm_prefetch": 2},
    "mma b4 t64 k32 pd": {"_gemm_variant": "mma", "_gemm_block": 4, "_gemm_threads": 64, "_gemm_kt": 32, "_gemm_prefetch": 2},
    "mma b2 t128 k32 pd": {"_gemm_variant": "mma", "_gemm_block": 2, "_gemm_threads": 128, "_gemm_kt": 32, "_gemm_prefetch": 2},
    "alu shared8 k16 p": {"_gemm_variant": "shared", "_gemm_block": 8, "_gemm_kt": 16, "_gemm_prefetch": 1},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from test_matrix_units_dawn import dawn

    from anygrad.backends.wgpu.kernels.halfstore import stored_half
    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    from anygrad.ir import Graph, Node, TensorInfo, infer_node
    wgpu, dev, caps = dawn()
    n = args.size
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(np.float16)
    b = rng.standard_normal((n, n)).astype(np.float16)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    bufs = {"a": dev.create_buffer_with_data(data=a, usage=usage), "b": dev.create_buffer_with_data(data=b, usage=usage),
            "y": dev.create_buffer(size=n * n * 2, usage=usage)}
    ref = a[:64].astype(np.float64) @ b.astype(np.float64)
    results = {"size": n, "adapter_configs": [c.label for c in caps.adapter_facts.configs], "kernels": []}
    for name, pin in PLANS.items():
        g = Graph()
        for v in "ab":
            g.info[v] = TensorInfo(np.dtype(np.float16), (n, n))
        node = Node("MatMul", ["a", "b"], ["y"], dict(pin), name="gemm")
        g.nodes = [node]
        infer_node(g, node)
        g.info["y"] = TensorInfo(np.dtype(np.float16), (n, n))
        entry = {"plan": name}
        try:
            kernels = stored_half(LOWERINGS["MatMul"](node, g, caps), g)
            ds = []
            for k in kernels:
                for s in k.scratch:
                    bufs.setdefault(s.name, dev.create_buffer(size=4 * s.elements, usage=usage))
                pipe = dev.create_compute_pipeline(layout="auto", compute={
                    "module": dev.create_shader_module(code=k.wgsl), "entry_point": k.entry})
                bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
                    {"binding": i, "resource": {"buffer": bufs[v]}} for i, v in enumerate(k.reads + k.writes)])
                ds.append((pipe, bg, k.workgroups))

            def go(reps: int, ds: list = ds) -> None:
                enc = dev.create_command_encoder()
                p = enc.begin_compute_pass()
                for _ in range(reps):
                    for pipe, bg, grid in ds:
                        p.set_pipeline(pipe)
                        p.set_bind_group(0, bg)
                        p.dispatch_workgroups(*grid)
                p.end()
                dev.queue.submit([enc.finish()])
                dev.queue.read_buffer(bufs["y"], 0, 16)
            go(2)
            times = []
            for _ in range(args.rounds):
                t = time.perf_counter()
                go(args.reps)
                times.append((time.perf_counter() - t) / args.reps)
            s = min(times)
            out = np.frombuffer(dev.queue.read_buffer(bufs["y"]), np.float16).reshape(n, n)[:64].astype(np.float64)
            entry |= {"kernels": [k.name for k in kernels], "ms": s * 1e3, "tflops": 2 * n ** 3 / s / 1e12,
                      "rel_err": float(np.abs(out - ref).max() / np.abs(ref).max())}
        except Exception as e:  # noqa: BLE001  (a plan the adapter refuses: reported, the rest still run)
            entry["error"] = f"{type(e).__name__}: {e}"[:800]
        print(json.dumps(entry), flush=True)
        results["kernels"].append(entry)
    try:
        import torch
        if torch.cuda.is_available():
            x = torch.randn(n, n, device="cuda")
            y = torch.randn(n, n, device="cuda")
            for label, dt, tf32 in (("cuBLAS f32", torch.float32, False), ("cuBLAS tf32", torch.float32, True),
                                    ("cuBLAS f16", torch.float16, False)):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                xa, ya = x.to(dt), y.to(dt)
                for _ in range(3):
                    xa @ ya
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(args.reps):
                    xa @ ya
                torch.cuda.synchronize()
                s = (time.perf_counter() - t) / args.reps
                entry = {"plan": label, "ms": s * 1e3, "tflops": 2 * n ** 3 / s / 1e12}
                print(json.dumps(entry), flush=True)
                results["kernels"].append(entry)
    except ImportError:
        pass
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
