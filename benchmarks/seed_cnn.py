"""Training throughput of the founding MNIST CNN: anygrad on each device vs PyTorch, same run.

    python benchmarks/seed_cnn.py --devices cpu,wgpu --batch-sizes 1000,64 --json out.json
    python benchmarks/seed_cnn.py --devices cpu --batch-sizes 1000 --samples 6000 --repeats 15  # CPU
    python benchmarks/seed_cnn.py --devices cpu --batch-sizes 1000 --threads 1 ...   # one thread each

Synthetic 28x28 data (throughput does not depend on the pixels). The founding settings: Adagrad,
lr 1.0, NLL loss on log_softmax outputs, dropout and BatchNorm in training mode. For each batch
size, every case (each PyTorch device, each anygrad device) is compiled and warmed up, then the
cases take turns: pass 1 of each, pass 2 of each, ... (A B A B ...), so that load from other jobs
on a shared machine falls on all of them alike rather than on whichever ran last. Reported per
case: the median samples/s over --repeats passes with the spread (min-max), and

- host us/step: the mean time of one `train_step` call (anygrad: write the batch + encode +
  submit, no readback; PyTorch: the eager Python dispatch, which waits when the GPU falls behind);
- write us: of that, writing the batch alone (anygrad wgpu);
- ratios anygrad/PyTorch at the same batch size against each PyTorch device of this same run: the
  ratio of the medians, and the median and min-max of the per-pass ratios (pass k of anygrad over
  pass k of PyTorch, taken back to back).

PyTorch gets the same model (examples/mnist/model.py), its default init, torch.optim.Adagrad, eager
mode with its defaults (cudnn.benchmark=False) and the whole data set already on its device;
anygrad uploads each batch from host memory, as a training loop does. `--threads N` gives both
frameworks N CPU threads: torch.set_num_threads(N), OMP/OpenBLAS/MKL_NUM_THREADS=N, which BLAS
reads only when numpy loads, so the script re-executes itself with them set, and
ANYGRAD_NUMPY_THREADS=N (the numpy backend's worker threads). `--profile` adds a
timestamp-query GPU profile of one wgpu step per batch size.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def synthetic(samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype(np.int64)
    return x, y


# ANYGRAD_NUMPY_THREADS: the numpy backend's own worker threads (anygrad._parallel), which
# would otherwise use every CPU whatever BLAS is told.
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "ANYGRAD_NUMPY_THREADS")


@dataclass
class Case:
    """One framework on one device at one batch size, compiled and warmed up, timed pass by pass."""

    framework: str
    device: str                       # what it ran on, in words
    label: str
    batch: int
    steps: int
    step: Callable[[int], None]
    wait: Callable[[], None]          # returns when the device has finished the submitted work
    extra: dict = field(default_factory=dict)
    finish: Callable[[], dict] = dict  # after the timed passes: loss, write cost, profile
    epochs: list[float] = field(default_factory=list)
    host: float = 0.0                 # seconds inside step() over all timed passes

    def timed_pass(self) -> None:
        t0 = time.perf_counter()
        for i in range(self.steps):
            h0 = time.perf_counter()
            self.step(i)
            self.host += time.perf_counter() - h0
        self.wait()
        self.epochs.append(time.perf_counter() - t0)

    def row(self) -> dict:
        rates = [self.steps * self.batch / s for s in self.epochs]
        return {"framework": self.framework, "device": self.device, "label": self.label, "batch": self.batch,
                "steps": self.steps, "samples_per_s": statistics.median(rates), "samples_per_s_min": min(rates),
                "samples_per_s_max": max(rates), "samples_per_s_all": rates,
                "ms_per_step": 1e3 * statistics.median(self.epochs) / self.steps,
                "host_us_per_step": 1e6 * self.host / (self.steps * len(self.epochs)), **self.extra,
                **self.finish()}


def parse_pins(text: str) -> dict[str, dict]:
    """'ConvGradInput:8=register8,Conv=shared' -> node attrs pinning the GEMM tiling of each op
    (kernels_gemm.variant_of: variant register|shared|dot, then optionally the block size); ':C'
    limits a pin to nodes whose output has C channels (dim 1)."""
    pins = {}
    for item in _list(text):
        op, _, spec = item.partition("=")
        variant = spec.rstrip("0123456789")
        block = spec[len(variant):]
        pins[op] = {"_gemm_variant": variant} | ({"_gemm_block": int(block)} if block else {})
    return pins


def _pin(backend, pins: dict[str, dict]) -> None:
    """Benchmark-only experiment: set the tiling attrs on matching nodes of every graph compiled."""
    compile_ = backend.compile

    def compile(graph, *args, **kwargs):
        for node in graph.nodes:
            shape = graph.info[node.outputs[0]].shape if node.outputs[0] in graph.info else ()
            channels = f"{node.op}:{shape[1]}" if len(shape) > 1 else node.op
            node.attrs.update(pins.get(channels, pins.get(node.op, {})))
        return compile_(graph, *args, **kwargs)
    backend.compile = compile


def bench_anygrad(device: str, batch: int, x: np.ndarray, y: np.ndarray, warmup: int, profile: bool,
                  pins: dict[str, dict] | None = None) -> Case:
    import anygrad
    from anygrad.examples import FOUNDING_MODEL
    from anygrad.optim import Adagrad

    model = anygrad.load_onnx(FOUNDING_MODEL, init="fresh")
    model.compile(loss="nll", optimizer=Adagrad(lr=1.0), device=torch_backend(device) or device)
    if pins:
        _pin(model.backend, pins)
    steps = max(1, len(x) // batch)
    batches = [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(steps)]
    t0 = time.perf_counter()
    model.train_step(*batches[0])
    model.read_metrics(reset=True)           # waits for the device
    compile_s = time.perf_counter() - t0
    for i in range(warmup):
        model.train_step(*batches[i % steps])
    model.read_metrics(reset=True)

    def finish() -> dict:
        extra = {"loss": model.read_metrics(reset=True).get("loss")}
        if model.backend.name == "wgpu":
            exe = model.train_program(*batches[0], flush=False)
            feeds = model._feeds(*batches[0])
            n = 50
            h0 = time.perf_counter()
            for _ in range(n):
                exe._write_inputs(feeds)
            extra["write_us"] = 1e6 * (time.perf_counter() - h0) / n
            extra["kernels"] = exe.n_kernels
            if profile and "timestamp-query" in model.backend.device.features:
                extra["profile"] = exe.step_profile(feeds, repeat=5).as_dict()
        return extra

    label = model.backend.name if model.backend.name != "wgpu" else f"wgpu:{model.backend.adapter.backend.lower()}"
    if "+" in device:
        label += device[device.index("+"):]
    extra: dict = {"compile_s": compile_s}
    if pins:
        label += "+pin"
        extra["pins"] = pins
    return Case("anygrad", model.backend.description, label, batch, steps,
                lambda i: model.train_step(*batches[i]), lambda: model.read_metrics(), extra, finish)


def torch_backend(device: str):
    """'torch:cuda+eager' (no CUDA graph), 'torch:cuda+compile' (as --compile: torch.compile and
    CUDA graphs), 'torch:cuda+inductor' (torch.compile alone): the torch backend so configured
    (None for a plain device name: its defaults, CUDA graphs on CUDA)."""
    name, plus, options = device.partition("+")
    if not plus:
        return None
    from anygrad.backends.torch import TorchBackend
    opts = set(options.split("+"))
    return TorchBackend(name, cuda_graph="eager" not in opts, torch_compile=bool(opts & {"compile", "inductor"}))


def bench_torch(device: str, batch: int, x: np.ndarray, y: np.ndarray, warmup: int,
                threads: int | None = None) -> Case:
    import torch
    import torch.nn.functional as F

    if threads:
        torch.set_num_threads(threads)
    spec = importlib.util.spec_from_file_location("mnist_model", ROOT / "examples/mnist/model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    label = device
    device, _, mode = device.partition("-")
    torch.backends.cudnn.benchmark = False  # eager defaults, said out loud (no algorithm search)
    if device.startswith("cuda"):
        # PyTorch's defaults run convolutions in TF32 on tensor cores; "-fp32" turns that off, as
        # anygrad's kernels compute in plain FP32
        torch.backends.cudnn.allow_tf32 = mode != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = mod.Net().to(device).train()
    opt = torch.optim.Adagrad(model.parameters(), lr=1.0)
    xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    cuda = device.startswith("cuda")
    steps = max(1, len(x) // batch)
    last = {}

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.nll_loss(model(xt[i * batch:(i + 1) * batch]), yt[i * batch:(i + 1) * batch])
        loss.backward()
        opt.step()
        last["loss"] = loss.detach()

    def wait() -> None:
        if cuda:
            torch.cuda.synchronize()

    for i in range(warmup):
        step(i % steps)
    wait()
    name = (torch.cuda.get_device_name() if cuda else f"{platform.processor() or 'cpu'}") \
        + f" (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    return Case("pytorch", name, label, batch, steps, step, wait, {"cudnn_benchmark": False},
                lambda: {"loss": float(last["loss"])})


def pin_threads(n: int, argv: list[str]) -> None:
    """Re-execute this script with every BLAS/OpenMP pool sized to n: numpy's OpenBLAS reads its
    thread count once, when numpy is first imported (already done here), so setting it now would
    be too late for this process."""
    want = str(n)
    if all(os.environ.get(k) == want for k in THREAD_ENV):
        return
    env = os.environ | {k: want for k in THREAD_ENV}
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)


def machine() -> dict:
    info = {"date": time.strftime("%Y-%m-%d"), "node": platform.node(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "numpy": np.__version__}
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        info["cpu"] = platform.processor()
    try:
        import wgpu
        info["wgpu"] = wgpu.__version__
    except ImportError:
        pass
    return info


def _list(text: str) -> list[str]:
    return [t for t in text.replace(",", " ").split() if t]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="cpu", help="anygrad devices, comma list (cpu, wgpu, wgpu:N, torch:cuda, "
                   "...; torch:cuda: CUDA graphs (the default), torch:cuda+eager: none, torch:cuda+compile: as "
                   "--compile (torch.compile and CUDA graphs), torch:cuda+inductor: torch.compile alone; or "
                   "ANYGRAD_TORCH_COMPILE=1 / ANYGRAD_TORCH_CUDA_GRAPH=0 for every torch device)")
    p.add_argument("--torch-devices", default=None,
                   help="PyTorch devices, comma list (default: cpu, plus cuda when available; 'none': "
                   "skip; cuda-fp32: cuDNN TF32 off)")
    p.add_argument("--batch-sizes", default="1000,64", help="comma list")
    p.add_argument("--samples", type=int, default=60000, help="samples per timed pass")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed passes per case, interleaved across cases (median and min-max reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after compiling")
    p.add_argument("--pin", default="", help="experiment: pin GEMM tilings per op for anygrad "
                   "(register|shared[block]|dot), e.g. ConvGradInput=register (rows labelled +pin)")
    p.add_argument("--profile", action="store_true", help="GPU profile of one wgpu step (timestamp queries)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for both frameworks (torch.set_num_threads, OMP/OpenBLAS/MKL_NUM_THREADS and "
                   "ANYGRAD_NUMPY_THREADS; the script re-executes itself to set them before numpy loads)")
    args = p.parse_args(argv)
    if args.threads:
        pin_threads(args.threads, sys.argv[1:] if argv is None else argv)

    torch_devices: list[str] = []
    if args.torch_devices != "none":
        try:
            import torch
            torch_devices = _list(args.torch_devices) if args.torch_devices else \
                ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        except ImportError:
            print("PyTorch is not installed: no reference numbers", file=sys.stderr)

    x, y = synthetic(args.samples)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None  # other jobs on a shared machine
    rows = []
    for batch in (int(b) for b in _list(args.batch_sizes)):
        cases = [bench_torch(dev, batch, x, y, args.warmup, args.threads) for dev in torch_devices]
        cases += [bench_anygrad(dev, batch, x, y, args.warmup, args.profile, parse_pins(args.pin))
                  for dev in _list(args.devices)]
        for k in range(args.repeats):  # A B A B ...: each pass of each case, in turn
            for case in cases:
                case.timed_pass()
            print(f"batch {batch} pass {k + 1}/{args.repeats}: " + ", ".join(
                f"{c.framework} {c.label} {c.steps * batch / c.epochs[-1]:.0f}/s" for c in cases),
                file=sys.stderr, flush=True)
        batch_rows = [c.row() for c in cases]
        # Ratios against each PyTorch device at the same batch size, from this same run: of the
        # medians, and pass by pass (each anygrad pass against the PyTorch pass just before it).
        for r in batch_rows:
            if r["framework"] != "anygrad":
                continue
            for t in batch_rows:
                if t["framework"] == "pytorch":
                    paired = [a / b for a, b in zip(r["samples_per_s_all"], t["samples_per_s_all"])]
                    r[f"ratio_vs_torch_{t['label']}"] = r["samples_per_s"] / t["samples_per_s"]
                    r[f"paired_ratio_vs_torch_{t['label']}"] = {
                        "median": statistics.median(paired), "min": min(paired), "max": max(paired), "all": paired}
        rows += batch_rows

    meta = machine() | {"samples": args.samples, "repeats": args.repeats, "warmup": args.warmup,
                        "order": "interleaved by pass", "threads": args.threads,
                        "thread_env": {k: os.environ.get(k) for k in THREAD_ENV}}
    if load_start is not None:
        meta["loadavg_start"], meta["loadavg_end"] = load_start, os.getloadavg()
    for r in rows:
        if "profile" in r:
            from anygrad.backends.wgpu.tuning.profiling import StepProfile
            d = r["profile"]
            prof = StepProfile([tuple(k) for k in d["kernels"]], d["runs"], d["step_ns"], d["wall_ms"])
            print("\n" + prof.format(f"{r['label']} training step, batch {r['batch']}"))
    print(f"\nfounding MNIST CNN training, {args.samples} synthetic samples/pass, median (min-max) of "
          f"{args.repeats} interleaved passes, Adagrad lr 1.0 ({meta['cpus']} CPUs: {meta.get('cpu', '')}"
          f"{f', {args.threads} thread(s) each' if args.threads else ''})")
    print(f"{'framework':9} {'device':16} {'batch':>5} {'samples/s (min-max)':>22} {'ms/step':>8} {'host us':>8} "
          f"{'write us':>8}  ratios anygrad/pytorch: of medians; per pass median (min-max)")
    for r in rows:
        ratios = " ".join(f"{k[len('ratio_vs_torch_'):]}={v:.2f}; "
                          f"{r['paired_' + k]['median']:.2f} ({r['paired_' + k]['min']:.2f}-{r['paired_' + k]['max']:.2f})"
                          for k, v in r.items() if k.startswith("ratio_"))
        write = f"{r['write_us']:8.0f}" if "write_us" in r else f"{'-':>8}"
        spread = f"{r['samples_per_s']:.0f} ({r['samples_per_s_min']:.0f}-{r['samples_per_s_max']:.0f})"
        print(f"{r['framework']:9} {r['label']:16} {r['batch']:>5} {spread:>22} "
              f"{r['ms_per_step']:>8.2f} {r['host_us_per_step']:>8.0f} {write}  {ratios}")
    for r in rows:
        print(f"  {r['framework']} {r['label']}: {r['device']}")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
