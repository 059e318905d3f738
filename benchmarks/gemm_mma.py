"""GEMM TFLOP/s on matrix units through Dawn: anygrad's MatMul lowering, f16 operands and
result, f32 accumulation, each subgroup-matrix plan (kernels_mma.py) against the ALU kernels of
the same lowering, and cuBLAS (PyTorch) in the same process where CUDA is there.

    python benchmarks/gemm_mma.py --size 4096 --json out.json
    python benchmarks/gemm_mma.py --shapes 256x3136x64x64 1024x196x256x64 --plans "mma rules,alu shared8 k16 p"
    python benchmarks/gemm_mma.py --layout nt --shapes 2048x768x3072 --plans "mma rules,mma rules rowtiles"
    python benchmarks/gemm_mma.py --layout tn --shapes 768x3072x2048 --plans "mma rules" --splits 1,2,4

A shape is MxNxK, or MxNxKxB: a (M, K) matrix times B stacked (K, N) ones, as a 1x1 convolution
multiplies its weights into each image of a batch (ResNet-50's at 64 images: 256x3136x64x64 is a
bottleneck's expansion at 56 px). Needs wgpudawn and an adapter listing
chromium-experimental-subgroup-matrix (the H200 through Vulkan). Each kernel runs --reps times in
one pass, timed by the wall clock around a wait for the GPU, after two warm-up runs, best of
--rounds passes (a pass of a few milliseconds is at the mercy of the wait's polling: the same
kernel read 1.1 and 2.5 ms at 20 reps), or by GPU timestamps around the pass where the device
has them; the result is checked against float64 on 64 rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from anygrad.backends.wgpu.tuning.profiling import FEATURE

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
# "... rowtiles": both workgroup tiles row-major, whichever axis their copies walk (the layout
# before kernels_mma.tile_majors; A/B runs of --layout nt / tn)
PLANS.update({f"{name} rowtiles": {**pin, "_gemm_layout": "rowtiles"} for name, pin in list(PLANS.items())
              if pin["_gemm_variant"] == "mma"})
# --layout: how A and B are stored (n: as multiplied, t: transposed), e.g. nt = x @ W.T (a
# Linear's forward), tn = x.T @ dy (its weight gradient)
LAYOUTS = ("nn", "nt", "tn")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """(M, N, K, batch) of 'MxNxK' or 'MxNxKxB'."""
    dims = [int(d) for d in text.lower().split("x")]
    if len(dims) not in (3, 4) or min(dims) < 1:
        raise SystemExit(f"--shapes: {text!r} is not MxNxK or MxNxKxB")
    return (*dims, 1)[:4] if len(dims) == 3 else tuple(dims)


def shape_label(shape: tuple[int, int, int, int]) -> str:
    """'MxNxK', or 'MxNxKxB' for a batch."""
    return "x".join(map(str, shape if shape[3] > 1 else shape[:3]))


class Bench:
    """One shape's operands on the Dawn device, float64 reference rows, and the MatMul node each
    plan pins: `build` gives a plan's dispatches, `run` one pass of them."""

    def __init__(self, shape: tuple[int, int, int, int], layout: str = "nn"):
        from test_matrix_units_dawn import dawn
        self.wgpu, self.dev, self.caps = dawn()
        m, n, k, batch = self.shape = shape
        if layout != "nn" and batch > 1:
            raise SystemExit(f"--layout {layout}: batched shapes are nn only")
        rng = np.random.default_rng(0)
        a = rng.standard_normal((m, k)).astype(np.float16)
        b = rng.standard_normal((batch, k, n) if batch > 1 else (k, n)).astype(np.float16)
        self.perms = {"_permA": [1, 0]} if layout[0] == "t" else {}
        self.perms |= {"_permB": [1, 0]} if layout[1] == "t" else {}
        self.stored_a = np.ascontiguousarray(a.T) if layout[0] == "t" else a
        self.stored_b = np.ascontiguousarray(b.T) if layout[1] == "t" else b
        self.y_shape = (batch, m, n) if batch > 1 else (m, n)
        self.usage = self.wgpu.BufferUsage.STORAGE | self.wgpu.BufferUsage.COPY_SRC | self.wgpu.BufferUsage.COPY_DST
        self.bufs = {"a": self.dev.create_buffer_with_data(data=self.stored_a, usage=self.usage),
                     "b": self.dev.create_buffer_with_data(data=self.stored_b, usage=self.usage),
                     "y": self.dev.create_buffer(size=int(np.prod(self.y_shape)) * 2, usage=self.usage)}
        self.rows = min(m, 64)
        self.ref = a[:self.rows].astype(np.float64) @ b.reshape(-1, k, n)[0].astype(np.float64)
        self.flops = 2 * m * n * k * batch
        self.label = shape_label(shape) + ("" if layout == "nn" else f" {layout}")

    def build(self, pin: dict) -> tuple[list, list]:
        """(kernels, dispatches) of the MatMul lowered under `pin`."""
        from anygrad.backends.wgpu.kernels.halfstore import stored_half
        from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
        from anygrad.ir import Graph, Node, TensorInfo
        g = Graph()
        g.info["a"] = TensorInfo(np.dtype(np.float16), self.stored_a.shape)
        g.info["b"] = TensorInfo(np.dtype(np.float16), self.stored_b.shape)
        node = Node("MatMul", ["a", "b"], ["y"], dict(pin) | self.perms, name="gemm")
        g.nodes = [node]
        g.info["y"] = TensorInfo(np.dtype(np.float16), self.y_shape)
        kernels = stored_half(LOWERINGS["MatMul"](node, g, self.caps), g)
        dev, bufs, ds = self.dev, self.bufs, []
        for kern in kernels:
            for s in kern.scratch:
                if s.name in bufs and bufs[s.name].size < 4 * s.elements:
                    bufs.pop(s.name).destroy()
                bufs.setdefault(s.name, dev.create_buffer(size=4 * s.elements, usage=self.usage))
            pipe = dev.create_compute_pipeline(layout="auto", compute={
                "module": dev.create_shader_module(code=kern.wgsl), "entry_point": kern.entry})
            bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
                {"binding": i, "resource": {"buffer": bufs[v]}} for i, v in enumerate(kern.reads + kern.writes)])
            ds.append((pipe, bg, kern.workgroups))
        return kernels, ds

    def run(self, ds: list, times: int) -> None:
        """`times` runs of the dispatches in one pass, then a wait for the GPU."""
        from anygrad.backends.wgpu.tuning.profiling import encode_pass
        enc = self.dev.create_command_encoder()
        encode_pass(enc, ds, times)
        self.dev.queue.submit([enc.finish()])
        self.dev.queue.read_buffer(self.bufs["y"], 0, 16)

    def seconds(self, ds: list, reps: int, rounds: int, spun: bool = True) -> float:
        """Best of `rounds` passes of `reps` runs, a run's seconds (GPU timestamps where there are);
        `spun`: after profiling.SPIN_MS of untimed runs, which raise an idle GPU's clock."""
        from anygrad.backends.wgpu.tuning.profiling import spin
        if spun:  # one run's time from timestamps: a wall-clock read of it is mostly the wait's latency
            one = stamped(self.dev, ds, 1) if FEATURE in self.dev.features else walled(lambda t: self.run(ds, t), 1)
            spin(self.dev, ds, one * 1e3, self.bufs["y"])
        if FEATURE in self.dev.features:
            return min(stamped(self.dev, ds, reps) for _ in range(rounds))
        return min(walled(lambda t: self.run(ds, t), reps) for _ in range(rounds))

    def rel_err(self) -> float:
        m, n = self.shape[:2]
        got = np.frombuffer(self.dev.queue.read_buffer(self.bufs["y"]), np.float16).reshape(-1, m, n)[0, :self.rows]
        return float(np.abs(got.astype(np.float64) - self.ref).max() / np.abs(self.ref).max())


def time_plans(shape: tuple[int, int, int, int], plans: dict, reps: int, rounds: int,
               layout: str = "nn") -> list[dict]:
    """One entry a plan: its kernels, ms, TFLOP/s and error against float64 on 64 rows."""
    bench = Bench(shape, layout)
    out = []
    for name, pin in plans.items():
        entry = {"shape": bench.label, "plan": name}
        try:
            kernels, ds = bench.build(pin)
            bench.run(ds, 2)
            s = bench.seconds(ds, reps, rounds)
            entry |= {"kernels": [kern.name for kern in kernels], "ms": s * 1e3,
                      "tflops": bench.flops / s / 1e12, "rel_err": bench.rel_err()}
        except Exception as e:  # noqa: BLE001  (a plan the adapter refuses: reported, the rest still run)
            entry["error"] = f"{type(e).__name__}: {e}"[:800]
        print(json.dumps(entry), flush=True)
        out.append(entry)
    return out


def stamped(dev, ds: list, reps: int) -> float:
    """Seconds a run: GPU timestamps around one pass of `reps` runs (the wall clock around a wait
    misread small kernels on Dawn: the same 0.15 ms kernel read 0.15 and 0.61 ms in one process)."""
    from anygrad.backends.wgpu.tuning.profiling import TimestampProfiler
    prof = TimestampProfiler(dev, ["run"])
    enc = dev.create_command_encoder()
    prof.encode_runs(enc, [ds * reps])
    dev.queue.submit([enc.finish()])
    return float(prof.collect_ns()[0]) / 1e9 / reps


def walled(go, reps: int) -> float:
    t = time.perf_counter()
    go(reps)
    return (time.perf_counter() - t) / reps


def cublas(torch, shape: tuple[int, int, int, int], reps: int) -> list[dict]:
    """PyTorch's matmul of the same shape: f32, TF32 and f16 (with f32 accumulation)."""
    m, n, k, batch = shape
    x = torch.randn(m, k, device="cuda")
    y = torch.randn(*((batch,) if batch > 1 else ()), k, n, device="cuda")
    label = shape_label(shape)
    out = []
    for name, dt, tf32 in (("cuBLAS f32", torch.float32, False), ("cuBLAS tf32", torch.float32, True),
                           ("cuBLAS f16", torch.float16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        xa, ya = x.to(dt), y.to(dt)
        for _ in range(3):
            xa @ ya
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            xa @ ya
        torch.cuda.synchronize()
        s = (time.perf_counter() - t) / reps
        entry = {"shape": label, "plan": name, "ms": s * 1e3, "tflops": 2 * m * n * k * batch / s / 1e12}
        print(json.dumps(entry), flush=True)
        out.append(entry)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096, help="N of an N^3 GEMM, where --shapes is not given")
    ap.add_argument("--shapes", nargs="*", default=None, help="MxNxK or MxNxKxB (see above)")
    ap.add_argument("--plans", default="", help="comma list of plan names (default: all)")
    ap.add_argument("--layout", default="nn", choices=LAYOUTS, help="A and B as multiplied (n) or stored transposed (t)")
    ap.add_argument("--splits", default="", help="comma list of K split counts each plan is also timed at "
                    "(a _gemm_splits pin; 1: none); default: the rules' count only")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from test_matrix_units_dawn import dawn
    shapes = [parse_shape(t) for t in args.shapes] if args.shapes else [(args.size,) * 3 + (1,)]
    wanted = [p.strip() for p in args.plans.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PLANS]
    if unknown:
        raise SystemExit(f"--plans: unknown {unknown}; known: {list(PLANS)}")
    plans = {p: PLANS[p] for p in wanted} if wanted else PLANS
    if args.splits:
        counts = [int(c) for c in args.splits.split(",")]
        plans = {f"{name} s{c}": {**pin, "_gemm_splits": c} for name, pin in plans.items() for c in counts}
    _, _, caps = dawn()
    results = {"size": args.size, "shapes": [shape_label(s) for s in shapes], "layout": args.layout,
               "adapter_configs": [c.label for c in caps.adapter_facts.configs], "kernels": []}
    for shape in shapes:
        results["kernels"] += time_plans(shape, plans, args.reps, args.rounds, args.layout)
    try:
        import torch
        if torch.cuda.is_available():
            for shape in shapes:
                results["kernels"] += cublas(torch, shape, args.reps)
    except ImportError:
        pass
    if args.json:
        args.json.write_text(json.dumps(results, separators=(",", ":")))


if __name__ == "__main__":
    main()
