"""Training throughput of the founding MNIST CNN: anygrad on each device vs PyTorch, same run.

    python benchmarks/seed_cnn.py --devices cpu wgpu --batch-sizes 1000 64 --samples 60000 --json out.json

Synthetic 28x28 data (throughput does not depend on the pixels). The founding settings: AdaGrad,
lr 1.0, NLL loss on log_softmax outputs. For each device and batch size it reports samples/s
over the timed steps (after warm-up steps that compile and fill caches), the host-side time of
one step call (for wgpu: write the batch + encode + submit, the Python cost), and the ratio to
PyTorch on the CPU and, where present, CUDA eager in the same run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def synthetic(samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype(np.int64)
    return x, y


def steps_for(samples: int, batch: int) -> int:
    return max(1, samples // batch)


def bench_anygrad(device: str, batch: int, x: np.ndarray, y: np.ndarray, warmup: int) -> dict:
    import anygrad
    from anygrad.examples import FOUNDING_MODEL
    from anygrad.optim import AdaGrad

    model = anygrad.load_onnx(FOUNDING_MODEL, init="fresh")
    model.compile(loss="nll", optimizer=AdaGrad(lr=1.0), device=device)
    steps = steps_for(len(x), batch)
    for i in range(warmup):
        model.train_step(x[:batch], y[:batch])
    model.read_metrics(reset=True)  # waits for the device
    host = 0.0
    t0 = time.perf_counter()
    for i in range(steps):
        xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
        h0 = time.perf_counter()
        model.train_step(xb, yb)
        host += time.perf_counter() - h0
    metrics = model.read_metrics(reset=True)  # the readback waits for the last step
    seconds = time.perf_counter() - t0
    return {"framework": "anygrad", "device": model.backend.description, "batch": batch, "steps": steps,
            "samples_per_s": steps * batch / seconds, "host_us_per_step": 1e6 * host / steps,
            "loss": metrics.get("loss")}


def bench_torch(device: str, batch: int, x: np.ndarray, y: np.ndarray, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F

    spec = importlib.util.spec_from_file_location("mnist_model", ROOT / "examples/mnist/model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.Net().to(device).train()
    opt = torch.optim.Adagrad(model.parameters(), lr=1.0)
    xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step(i: int) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.nll_loss(model(xt[i * batch:(i + 1) * batch]), yt[i * batch:(i + 1) * batch])
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step(0)
    sync()
    steps = steps_for(len(x), batch)
    host = 0.0
    t0 = time.perf_counter()
    for i in range(steps):
        h0 = time.perf_counter()
        loss = step(i)
        host += time.perf_counter() - h0
    final = float(loss)  # waits for the device
    seconds = time.perf_counter() - t0
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"
    return {"framework": "pytorch", "device": name, "batch": batch, "steps": steps,
            "samples_per_s": steps * batch / seconds, "host_us_per_step": 1e6 * host / steps, "loss": final}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", nargs="+", default=["cpu"], help="anygrad devices (cpu, wgpu, wgpu:N, ...)")
    p.add_argument("--torch-devices", nargs="*", default=None,
                   help="PyTorch devices (default: cpu, plus cuda when available)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1000, 64])
    p.add_argument("--samples", type=int, default=60000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)

    try:
        import torch
        torch_devices = args.torch_devices
        if torch_devices is None:
            torch_devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    except ImportError:
        torch_devices = []
        print("PyTorch is not installed: no reference numbers", file=sys.stderr)

    x, y = synthetic(args.samples)
    rows = []
    for batch in args.batch_sizes:
        for dev in torch_devices:
            rows.append(bench_torch(dev, batch, x, y, args.warmup))
            print(rows[-1], file=sys.stderr)
        for dev in args.devices:
            rows.append(bench_anygrad(dev, batch, x, y, args.warmup))
            print(rows[-1], file=sys.stderr)
    # Ratios against each PyTorch device at the same batch size, from this same run.
    for r in rows:
        if r["framework"] == "anygrad":
            for t in rows:
                if t["framework"] == "pytorch" and t["batch"] == r["batch"]:
                    r[f"ratio_vs_torch_{t['device']}"] = r["samples_per_s"] / t["samples_per_s"]

    print(f"\nfounding MNIST CNN training, {args.samples} synthetic samples, AdaGrad lr 1.0")
    print(f"{'framework':9} {'device':42} {'batch':>5} {'samples/s':>11} {'host us/step':>12}  ratios")
    for r in rows:
        ratios = " ".join(f"{k[len('ratio_vs_torch_'):]}={v:.2f}" for k, v in r.items() if k.startswith("ratio_"))
        print(f"{r['framework']:9} {r['device'][:42]:42} {r['batch']:>5} {r['samples_per_s']:>11.0f} "
              f"{r['host_us_per_step']:>12.0f}  {ratios}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "processor": platform.processor(),
                "python": platform.python_version(), "samples": args.samples}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
