"""GFLOP/s of the wgpu GEMM-family kernels (MatMul, the MNIST Gemm and Conv layers) per variant.

    python benchmarks/bench_kernels.py                          # squares 256..4096 + MNIST shapes
    python benchmarks/bench_kernels.py --sizes 64,128 --batches 8 --json out.json   # tiny (lavapipe)

Each case is lowered exactly as the backend lowers it (shapes baked in), run once to warm up, then
timed over N back-to-back repetitions in one compute pass and one submit: with GPU timestamps when
the adapter has `timestamp-query`, otherwise wall time up to a final readback. The fraction of FP32
peak is printed where the peak is known (table below, or --peak-gflops).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

import anygrad.ops  # noqa: F401  (op registry: shape rules)
from anygrad.backends.wgpu.device.shader_module import create_shader_module
from anygrad.backends.wgpu.kernels import kernels_conv, kernels_gemm  # noqa: F401  (lowerings)
from anygrad.backends.wgpu.kernels.kernel import LOWERINGS, AdapterCaps, Kernel
from anygrad.backends.wgpu.runtime.encode import writable_reads
from anygrad.backends.wgpu.tuning.profiling import SPIN_DISPATCHES, SPIN_MS
from anygrad.ir import Graph, Node, TensorInfo, infer_node
from anygrad.ir.passes import resolve_attributes

# FP32 (non-tensor-core) peak GFLOP/s by adapter name fragment.
PEAKS = {"H200": 67_000.0, "H100": 67_000.0, "A100": 19_500.0, "RTX 4090": 82_600.0, "RTX 3090": 35_600.0,
         "L40S": 91_600.0, "L4": 30_300.0, "T4": 8_100.0, "M1": 2_600.0, "M2": 3_600.0}

F32 = np.dtype("float32")


@dataclass
class Result:
    case: str
    variant: str
    kernels: str
    gflop: float
    ms: float
    gflops: float
    timing: str
    peak_fraction: float | None


# -- cases --------------------------------------------------------------------------------------
def matmul_case(m: int, k: int, n: int):
    return "MatMul", [(m, k), (k, n)], {}, 2.0 * m * n * k


def gemm_case(m: int, k: int, n: int, ta: int = 0, tb: int = 0, bias: bool = True):
    a = (k, m) if ta else (m, k)
    b = (n, k) if tb else (k, n)
    return "Gemm", [a, b] + ([(n,)] if bias else []), {"transA": ta, "transB": tb}, 2.0 * m * n * k


def conv_cases(batch: int, cin: int, cout: int, hw: int, k: int = 3):
    """Forward, input gradient, weight gradient of one unpadded stride-1 conv layer."""
    out = hw - k + 1
    flop = 2.0 * batch * cout * out * out * cin * k * k
    win = {"kernel_shape": [k, k], "strides": [1, 1], "dilations": [1, 1], "pads": [0, 0, 0, 0], "group": 1}
    x, w, y = (batch, cin, hw, hw), (cout, cin, k, k), (batch, cout, out, out)
    return [("Conv", [x, w, (cout,)], {}, flop),
            ("ConvGradInput", [y, w], {**win, "input_shape": list(x)}, flop),
            ("ConvGradWeight", [y, x], {**win, "weight_shape": list(w)}, flop)]


def generic_conv_cases(spec: str):
    """'BxCINxCOUTxHW' (3x3, stride 1, unpadded) -> forward, input-gradient, weight-gradient cases."""
    b, cin, cout, hw = (int(v) for v in spec.lower().split("x"))
    return [(f"conv b{b} {op} {cin}->{cout} @{hw}", op, shapes, attrs, flop)
            for op, shapes, attrs, flop in conv_cases(b, cin, cout, hw)]


# Linear layers of transformers people fine-tune: (name, tokens M, d_in, d_out). Each is timed as
# its forward, input gradient (dY @ W^T) and weight gradient (X^T @ dY), as training runs them.
TRANSFORMER_LINEARS = {
    "gpt2s": [("qkv", 2048, 768, 2304), ("proj", 2048, 768, 768), ("fc", 2048, 768, 3072),
              ("fc2", 2048, 3072, 768), ("head", 2048, 768, 50257)],          # batch 8 x T 256
    "bert": [("qkv", 4096, 768, 2304), ("proj", 4096, 768, 768), ("fc", 4096, 768, 3072),
             ("fc2", 4096, 3072, 768), ("mlm-head", 4096, 768, 30522)],      # batch 32 x T 128
}


# The LM heads: nn.Linear in Hugging Face's GPT-2 too (tied to the token embedding), whose other
# Linears are Conv1D
HEADS = ("head", "mlm-head")


def transformer_cases(model: str) -> list[tuple]:
    """(label, op, shapes, attrs, flop, torch spec) for forward, dX and dW of each Linear. `model`
    alone: weights stored (d_in, d_out), as Hugging Face GPT-2's Conv1D; `model:linear`: stored
    (d_out, d_in), as nn.Linear (benchmarks/models.py's GPT-2 small, BERT, the LM heads), so the
    forward reads W transposed, dX = dY @ W reads both plain and dW = dY^T @ X is (d_out, d_in);
    `model:hf`: as Hugging Face's GPT-2 stores them, Conv1D but the LM head nn.Linear."""
    model, _, layout = model.partition(":")
    if layout not in ("", "linear", "hf"):
        raise SystemExit(f"--transformer {model}:{layout}: the layout is ':linear', ':hf' or nothing")
    out = []
    for name, m, k, n in TRANSFORMER_LINEARS[model]:
        flop = 2.0 * m * k * n
        if layout == "linear" or (layout == "hf" and name in HEADS):
            tag = f"{model}:{layout} {name}"
            out += [(f"{tag} fwd {m}x{k}x{n}",) + gemm_case(m, k, n, tb=1, bias=False) + ((m, k, n, 0, 1),),
                    (f"{tag} dX {m}x{n}x{k}",) + gemm_case(m, n, k, bias=False) + ((m, n, k, 0, 0),),
                    (f"{tag} dW {n}x{m}x{k}",) + gemm_case(n, m, k, ta=1, bias=False) + ((n, m, k, 1, 0),)]
        else:
            tag = f"{model}:{layout} {name}" if layout else f"{model} {name}"
            out += [(f"{tag} fwd {m}x{k}x{n}",) + gemm_case(m, k, n, bias=False) + ((m, k, n, 0, 0),),
                    (f"{tag} dX {m}x{n}x{k}",) + gemm_case(m, n, k, tb=1, bias=False) + ((m, n, k, 0, 1),),
                    (f"{tag} dW {k}x{m}x{n}",) + gemm_case(k, m, n, ta=1, bias=False) + ((k, m, n, 1, 0),)]
        assert all(c[4] == flop for c in out[-3:])
    return out


def torch_matmul(sizes: list[int], seconds: float, shapes: list[tuple] = ()) -> list[dict]:
    """PyTorch CUDA FP32 matmul GFLOP/s at the same sizes (TF32 off, then on), for reference.
    shapes: (label, (m, k, n, transA, transB)) cases too, operands stored transposed as anygrad's."""
    import torch
    if not torch.cuda.is_available():
        return []
    out = []
    cases = [(f"matmul {s}^3", (s, s, s, 0, 0)) for s in sizes] + list(shapes)
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for label, (m, k, n, ta, tb) in cases:
            a = torch.randn(k, m, device="cuda").t() if ta else torch.randn(m, k, device="cuda")
            b = torch.randn(n, k, device="cuda").t() if tb else torch.randn(k, n, device="cuda")
            for _ in range(3):
                a @ b
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            a @ b
            e1.record()
            torch.cuda.synchronize()
            reps = max(1, min(500, int(seconds * 1e3 / max(e0.elapsed_time(e1), 1e-3))))
            e0.record()
            for _ in range(reps):
                a @ b
            e1.record()
            torch.cuda.synchronize()
            ms = e0.elapsed_time(e1) / reps
            out.append({"case": label, "tf32": tf32, "ms": ms, "gflops": 2.0 * m * k * n / ms * 1e-6,
                        "device": torch.cuda.get_device_name(), "torch": torch.__version__})
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def mnist_cases(batch: int):
    """The MNIST example's conv and fc layers (src/anygrad/examples/mnist.onnx), forward + backward."""
    cases = []
    for cin, cout, hw in ((1, 8, 28), (8, 16, 26), (16, 24, 24)):
        for op, shapes, attrs, flop in conv_cases(batch, cin, cout, hw):
            cases.append((f"mnist b{batch} {op} {cin}->{cout} @{hw}", op, shapes, attrs, flop))
    for label, case in (("fc1", gemm_case(batch, 11616, 32, tb=1)), ("fc1 dX", gemm_case(batch, 32, 11616, bias=False)),
                        ("fc1 dW", gemm_case(32, batch, 11616, ta=1, bias=False)),
                        ("fc2 dW", gemm_case(10, batch, 32, ta=1, bias=False))):
        cases.append((f"mnist b{batch} {label}",) + case)
    return cases


# -- device ---------------------------------------------------------------------------------------
def open_device(index: int | None):
    import wgpu
    if index is None:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    else:
        adapters = wgpu.gpu.enumerate_adapters_sync()
        if not 0 <= index < len(adapters):
            sys.exit(f"--device-index {index}: {len(adapters)} adapter(s): "
                     + "; ".join(f"{i}: {a.info['device']}" for i, a in enumerate(adapters)))
        adapter = adapters[index]
    if adapter is None:
        sys.exit("no wgpu adapter")
    feats = [f for f in ("timestamp-query",) if f in adapter.features]
    device = adapter.request_device_sync(required_features=feats)
    lim = device.limits
    caps = AdapterCaps(
        max_storage_buffers_per_stage=int(lim["max-storage-buffers-per-shader-stage"]),
        max_storage_binding_size=int(lim["max-storage-buffer-binding-size"]),
        max_workgroup_storage=int(lim["max-compute-workgroup-storage-size"]),
        max_invocations_per_workgroup=int(lim["max-compute-invocations-per-workgroup"]),
        max_workgroups_per_dim=int(lim["max-compute-workgroups-per-dimension"]),
        is_cpu=adapter.info["adapter_type"] == "CPU")
    return adapter, device, caps, bool(feats)


FLUSH_REPS = 256  # repetitions a --flush timing takes at most (two timestamps each)


class Runner:
    """Buffers, pipelines and bind groups of one lowered case, timed over many repetitions."""

    def __init__(self, device, kernels: list[Kernel], values: dict[str, int], timestamps: bool, zeros: bool = False,
                 flush_mb: float = 0.0, shared_mb: float = 0.0):
        import wgpu
        self.wgpu, self.device, self.kernels = wgpu, device, kernels
        self.flush = self._flusher(device, flush_mb) if flush_mb and timestamps else None
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        rng = np.random.default_rng(0)
        self.bufs = {}
        sizes = dict(values)
        for k in kernels:
            sizes.update({s.name: s.elements for s in k.scratch})
        datas = {name: (np.zeros if zeros else rng.standard_normal)(n + (-n) % 4).astype(np.float32)
                 for name, n in sizes.items()}
        if shared_mb:
            # --shared-buffer: every value at a 256-byte aligned offset into one buffer at least
            # shared_mb large, as the planner packs a step's temporaries (the views: buffer, offset, size)
            offsets, end = {}, 0
            for name, data in datas.items():
                offsets[name], end = end, end + -(-data.nbytes // 256) * 256
            shared = device.create_buffer(size=max(end, int(shared_mb * (1 << 20)) // 256 * 256), usage=usage)
            for name, data in datas.items():
                device.queue.write_buffer(shared, offsets[name], data.tobytes())
                self.bufs[name] = (shared, offsets[name], data.nbytes)
        else:
            for name, data in datas.items():
                buf = device.create_buffer_with_data(data=data.tobytes(), usage=usage)
                self.bufs[name] = (buf, 0, buf.size)
        self.steps = []
        for k in kernels:
            # in one shared buffer a kernel's reads share it with its writes: the runtime then
            # declares them read_write (one usage scope may not mix read-only and writable views)
            wgsl = writable_reads(k.wgsl, range(len(k.reads))) if shared_mb and k.reads else k.wgsl
            module = create_shader_module(device, wgsl, k.name)  # as the runtime builds it
            pipe = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": k.entry})
            bg = device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
                {"binding": i, "resource": dict(zip(("buffer", "offset", "size"), self.bufs[v]))}
                for i, v in enumerate(list(k.reads) + list(k.writes))])
            self.steps.append((pipe, bg, k.workgroups))
        self.out = kernels[-1].writes[0]
        self.query = None
        if timestamps:
            self.query = device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
            self.resolve = device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE
                                                | wgpu.BufferUsage.COPY_SRC)

    def _wait(self) -> None:
        """A readback of the last output's first bytes: returns once the submitted work is done."""
        buf, offset, _ = self.bufs[self.out]
        self.device.queue.read_buffer(buf, offset, 16)

    @staticmethod
    def _flusher(device, mb: float):
        """A kernel writing `mb` MB, run between repetitions (--flush): the timed kernels then
        start with caches holding other data, as in a training step, not their own operands."""
        import wgpu
        n = max(64, int(mb * (1 << 20)) // 4)
        buf = device.create_buffer(size=4 * n, usage=wgpu.BufferUsage.STORAGE)
        code = ("@group(0) @binding(0) var<storage, read_write> y: array<f32>;\n"
                "@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) g: vec3<u32>) {\n"
                f"  let i = g.x + g.y * 65535u * 256u;\n  if (i < {n}u) {{ y[i] = f32(i); }}\n}}\n")
        pipe = device.create_compute_pipeline(layout="auto", compute={
            "module": device.create_shader_module(code=code), "entry_point": "main"})
        bg = device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
            {"binding": 0, "resource": {"buffer": buf, "offset": 0, "size": buf.size}}])
        groups = -(-n // 256)
        grid = (min(groups, 65535), -(-groups // 65535), 1)
        return pipe, bg, grid, device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * FLUSH_REPS)

    def run_flushed(self, reps: int) -> tuple[float, float | None]:
        """(wall seconds, GPU seconds of the timed kernels only) for `reps` (<= FLUSH_REPS)
        repetitions, each in a pass of its own after the flushing kernel's pass."""
        pipe_f, bg_f, grid_f, query = self.flush
        enc = self.device.create_command_encoder()
        for r in range(reps):
            cp = enc.begin_compute_pass()
            cp.set_pipeline(pipe_f)
            cp.set_bind_group(0, bg_f)
            cp.dispatch_workgroups(*grid_f)
            cp.end()
            cp = enc.begin_compute_pass(timestamp_writes={"query_set": query, "beginning_of_pass_write_index": 2 * r,
                                                          "end_of_pass_write_index": 2 * r + 1})
            for pipe, bg, grid in self.steps:
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(*grid)
            cp.end()
        resolve = self.device.create_buffer(size=16 * reps, usage=self.wgpu.BufferUsage.QUERY_RESOLVE
                                            | self.wgpu.BufferUsage.COPY_SRC)
        enc.resolve_query_set(query, 0, 2 * reps, resolve, 0)
        t0 = time.perf_counter()
        self.device.queue.submit([enc.finish()])
        self._wait()
        wall = time.perf_counter() - t0
        t = np.frombuffer(self.device.queue.read_buffer(resolve), np.uint64).astype(np.int64).reshape(reps, 2)
        spans = t[:, 1] - t[:, 0]
        gpu = float(spans.sum()) * 1e-9 if (spans > 0).all() else None
        return wall, gpu if gpu is None or gpu <= wall * 1.05 else None

    def run(self, reps: int) -> tuple[float, float | None]:
        """(wall seconds, GPU seconds or None) for `reps` repetitions in one pass and one submit;
        with a flusher, each repetition after it, in passes of their own (run_flushed)."""
        if self.flush is not None:
            return self.run_flushed(reps)
        enc = self.device.create_command_encoder()
        ts = ({"query_set": self.query, "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1}
              if self.query else None)
        cp = enc.begin_compute_pass(timestamp_writes=ts) if ts else enc.begin_compute_pass()
        for _ in range(reps):
            for pipe, bg, grid in self.steps:
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(*grid)
        cp.end()
        if self.query:
            enc.resolve_query_set(self.query, 0, 2, self.resolve, 0)
        t0 = time.perf_counter()
        self.device.queue.submit([enc.finish()])
        self._wait()
        wall = time.perf_counter() - t0
        gpu = None
        if self.query:
            t = np.frombuffer(self.device.queue.read_buffer(self.resolve), np.uint64)
            gpu = float(t[1] - t[0]) * 1e-9 if t[1] > t[0] else None
            if gpu is not None and not (0 < gpu <= wall * 1.05):
                gpu = None  # timestamps in unexpected units: trust the wall clock
        return wall, gpu


def lower(op: str, shapes: list[tuple[int, ...]], attrs: dict, caps: AdapterCaps) -> tuple[list[Kernel], dict]:
    g = Graph()
    names = [f"x{i}" for i in range(len(shapes))]
    for n, s in zip(names, shapes):
        g.info[n] = TensorInfo(F32, tuple(s))
    node = Node(op, names, ["y"], dict(attrs))
    infer_node(g, node)
    values = {n: math.prod(g.info[n].shape) for n in names + ["y"]}
    return LOWERINGS[op](node, resolve_attributes(g), caps), values


def parse_variant(variant: str) -> dict:
    """The `_gemm_*` pins of a variant string: register | shared | dot, then optionally the block and
    the K tile: shared8k16; then optionally @ and a _gemm_layout (noswizzle, nohoist, plain), then %
    and invocations per workgroup: auto@nohoist, shared8k16%128; then +name=value pins
    (_gemm_<name>): shared8k16+tn=16+unroll=2."""
    variant, *extra = variant.split("+")
    variant_, _, threads = variant.partition("%")
    tiling, _, layout = variant_.partition("@")
    name, _, kt = tiling.partition("k")
    base = name.rstrip("0123456789")
    block = name[len(base):]
    pin = {} if base == "auto" else ({"_gemm_variant": base} | ({"_gemm_block": int(block)} if block else {})
                                     | ({"_gemm_kt": int(kt)} if kt else {}))
    if layout:
        pin["_gemm_layout"] = layout
    if threads:
        pin["_gemm_threads"] = int(threads)
    return pin | {f"_gemm_{k}": int(v) for k, v in (e.split("=") for e in extra)}


def bench(device, caps: AdapterCaps, timestamps: bool, label: str, op: str, shapes, attrs, flop: float,
          variant: str, peak: float | None, budget_s: float, zeros: bool = False, flush_mb: float = 0.0,
          shared_mb: float = 0.0) -> Result:
    """One case in one variant (parse_variant), or with variant 'tuned' the fastest of the
    autotuner's candidates (autotune.CANDIDATES), as a tuned compile would pick it."""
    if variant == "tuned":
        from anygrad.backends.wgpu.tuning.autotune import CANDIDATES, split_pins, tunes_splits
        best, best_pin = None, None

        def consider(pins) -> None:
            nonlocal best, best_pin
            for pin in pins:
                try:
                    r = _bench_pin(device, caps, timestamps, label, op, shapes, attrs, flop, pin, peak, budget_s,
                                   zeros, flush_mb, shared_mb)
                except Exception:  # noqa: BLE001, S112  a candidate this shape cannot take, as in autotune._candidates
                    continue
                if best is None or r.ms < best.ms:
                    best, best_pin = r, pin
        consider(CANDIDATES)
        if best is None:
            raise ValueError("no autotuner candidate lowers this case")
        if tunes_splits():  # the winner at other K splits, as the autotuner times it (autotune.split_pins)
            consider(split_pins(best_pin, lower(op, shapes, {**attrs, **best_pin}, caps)[0]))
        best.variant = "tuned"
        return best
    r = _bench_pin(device, caps, timestamps, label, op, shapes, attrs, flop, parse_variant(variant), peak,
                   budget_s, zeros, flush_mb, shared_mb)
    r.variant = variant
    return r


def _bench_pin(device, caps: AdapterCaps, timestamps: bool, label: str, op: str, shapes, attrs, flop: float,
               pin: dict, peak: float | None, budget_s: float, zeros: bool, flush_mb: float,
               shared_mb: float) -> Result:
    kernels, values = lower(op, shapes, {**attrs, **pin}, caps)
    runner = Runner(device, kernels, values, timestamps, zeros, flush_mb, shared_mb)
    runner.run(1)                                   # warm-up (first dispatch pays for driver setup)
    wall, gpu = runner.run(1)
    reps = max(1, min(200 if runner.flush is None else FLUSH_REPS, int(budget_s / max(gpu or wall, 1e-6))))
    # settle caches at this kernel, and raise an idle GPU's clock (tuning/profiling.SPIN_MS of runs)
    spin = min(SPIN_DISPATCHES // max(1, len(runner.steps)), math.ceil(SPIN_MS / 1e3 / max(gpu or wall, 1e-6)))
    runner.run(max(1, reps // 4, spin))
    # best of two timed runs: a single run was seen 1.5-3x slow now and then on an H200
    secs = min((gpu if gpu is not None else wall) for wall, gpu in (runner.run(reps), runner.run(reps))) / reps
    gflops = flop / secs * 1e-9
    return Result(label, "", " + ".join(k.name for k in kernels), flop * 1e-9, secs * 1e3, gflops,
                  "timestamp" if gpu is not None else "wall", gflops / peak if peak else None)


def known_peak(name: str) -> float | None:
    return next((v for k, v in PEAKS.items() if k.lower() in name.lower()), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device-index", type=int, default=None, help="index in wgpu's adapter list")
    ap.add_argument("--sizes", default="256,512,1024,2048,4096", help="square matmul sizes (comma list)")
    ap.add_argument("--batches", default="64,1000", help="MNIST batch sizes (comma list; empty: none)")
    ap.add_argument("--convs", default="", help="extra 3x3 conv layers BxCINxCOUTxHW, comma list "
                    "(e.g. 32x64x64x56)")
    ap.add_argument("--transformer", default="", help="comma list of " + ", ".join(TRANSFORMER_LINEARS)
                    + " (weights (d_in, d_out), as HF GPT-2's Conv1D; with ':linear', (d_out, d_in) as nn.Linear; "
                    "with ':hf', as HF GPT-2: Conv1D but the LM head nn.Linear): "
                    "their Linear layers' forward, dX and dW GEMMs")
    ap.add_argument("--torch", action="store_true", help="also time PyTorch CUDA FP32 matmul at --sizes "
                    "and --transformer shapes")
    ap.add_argument("--variants", default="auto,register,shared",  # 'tuned': the autotuner's best
                    help="comma list of auto (what the backend picks) | register | shared | dot, register and shared "
                         "optionally with the block size and K tile: shared8k16")
    ap.add_argument("--only", default="", help="only the cases whose label contains this text")
    ap.add_argument("--zeros", action="store_true", help="operands of zeros (as the autotuner times with), not "
                    "random numbers: a GPU may draw less power and clock higher on zeros")
    ap.add_argument("--flush", type=float, default=0.0, metavar="MB",
                    help="run a kernel writing MB megabytes before each repetition and time the case's kernels "
                         "alone, each repetition in its own pass (as a step's profile does; needs timestamp queries)")
    ap.add_argument("--shared-buffer", type=float, default=0.0, metavar="MB",
                    help="place the case's values at offsets into one buffer of at least MB megabytes, reads "
                         "declared read_write as the runtime must then (how GEMMs ran in steps before session 31's "
                         "planner kept a kernel's reads and writes apart), instead of a buffer each")
    ap.add_argument("--peak-gflops", type=float, default=None, help="FP32 peak of the adapter")
    ap.add_argument("--seconds", type=float, default=0.2, help="timed work per case")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    adapter, device, caps, timestamps = open_device(args.device_index)
    name = adapter.info["device"]
    peak = args.peak_gflops or known_peak(name)
    print(f"adapter: {name} ({adapter.info['backend_type']}, {adapter.info['adapter_type']}); "
          f"timing: {'timestamp-query' if timestamps else 'wall clock'}; "
          f"FP32 peak: {f'{peak:.0f} GFLOP/s' if peak else 'unknown'}")
    cases = [(f"matmul {s}^3",) + matmul_case(s, s, s) for s in (int(v) for v in args.sizes.split(",") if v)]
    for b in (int(v) for v in args.batches.split(",") if v):
        cases += mnist_cases(b)
    for spec in (v for v in args.convs.split(",") if v):
        cases += generic_conv_cases(spec)
    torch_shapes = []
    for model in (v for v in args.transformer.split(",") if v):
        for label, op, shapes, attrs, flop, spec in transformer_cases(model):
            cases.append((label, op, shapes, attrs, flop))
            torch_shapes.append((label, spec))
    # PyTorch's reference first: it takes seconds where tuning every case takes minutes, so a run
    # cut short by a time limit still has it; the JSON is rewritten after every case for the same reason
    reference = (torch_matmul([int(v) for v in args.sizes.split(",") if v], args.seconds,
                              [t for t in torch_shapes if args.only in t[0]])
                 if args.torch else [])
    for r in reference:
        frac = f"{100 * r['gflops'] / peak:5.1f}%" if peak else "     -"
        print(f"{r['case']:42s} {'torch' + (' tf32' if r['tf32'] else ''):9s} {'':8s} {r['ms']:9.3f} "
              f"{r['gflops']:9.1f} {frac}  PyTorch CUDA {r['torch']}", flush=True)
    results: list[Result] = []

    def dump() -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"adapter": dict(adapter.info), "peak_gflops": peak, "timestamps": timestamps,
                           "results": [asdict(r) for r in results], "torch_reference": reference}, fh,
                          indent=1)

    dump()
    print(f"{'case':42s} {'variant':9s} {'GFLOP':>8s} {'ms':>9s} {'GFLOP/s':>9s} {'peak':>6s}  kernels")
    for label, op, shapes, attrs, flop in (c for c in cases if args.only in c[0]):
        for variant in args.variants.split(","):
            try:
                r = bench(device, caps, timestamps, label, op, shapes, attrs, flop, variant, peak, args.seconds,
                          args.zeros, args.flush, args.shared_buffer)
            except Exception as e:  # noqa: BLE001  one failing case (e.g. too large for this adapter) must not end the run
                print(f"{label:42s} {variant:9s} failed: {str(e).splitlines()[0][:100]}")
                continue
            results.append(r)
            frac = f"{100 * r.peak_fraction:5.1f}%" if r.peak_fraction is not None else "     -"
            print(f"{label:42s} {variant:9s} {r.gflop:8.3f} {r.ms:9.3f} {r.gflops:9.1f} {frac}  {r.kernels}",
                  flush=True)
            dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
