"""Data-parallel scaling: training throughput on N GPUs (N ranks under torchrun, one wgpu device
each, gradients all-reduced through gloo) over one GPU, for ResNet-18 and a GPT-style decoder.

    python benchmarks/dist_scaling.py prepare --out /tmp/models           # ONNX files, once
    python benchmarks/dist_scaling.py run --onnx /tmp/models/resnet18.onnx --batch 512 --json r1.json
    torchrun --nproc-per-node 2 benchmarks/dist_scaling.py run --onnx ... --batch 512 --json r2.json
    python benchmarks/dist_scaling.py run --onnx ... --device wgpu:0,wgpu:1 ...   # one process, 2 devices

--batch is per device (each rank's share); the global batch is batch x devices. Models as in
benchmarks/models.py (torch.manual_seed(0), SGD lr 0.01 momentum 0.9, synthetic data): torchvision
ResNet-18 (32x32 input, 10 classes) and the GPT-style decoder (4 layers, d 256, 4 heads, T 128,
vocab 2048). Throughput is global samples/s over --steps steps after --warmup, timed on rank 0
between two barriers-equivalent syncs (a parameter readback), so every rank's work is counted.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np


def gpt_module(vocab: int = 2048, seq: int = 128, d: int = 256, heads: int = 4, layers: int = 4):
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads, self.dh = heads, d // heads
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            n, t, _ = x.shape
            q, k, v = self.qkv(x).split(d, dim=2)
            q, k, v = (z.view(n, t, self.heads, self.dh).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.dh))
            causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
            att = torch.softmax(att.masked_fill(causal, float("-inf")), dim=-1)
            return self.proj((att @ v).transpose(1, 2).contiguous().view(n, t, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = Attention()
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.Sequential(*(Block() for _ in range(layers)))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens):
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            return self.lm_head(self.ln_f(self.blocks(self.wte(tokens) + self.wpe(pos)))).view(-1, vocab)

    return GPT()


def resnet18_module(classes: int = 10):
    """torchvision's resnet18(num_classes=10), written out for images without torchvision."""
    from torch import nn

    class Basic(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()
            self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            return self.relu(y + (x if self.downsample is None else self.downsample(x)))

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


def hardware_devices(same: bool) -> str:
    """'wgpu:i,wgpu:j' for the first two GPU adapters (not OpenGL, not software); `same`: the first twice."""
    from anygrad.devices import list_adapters
    gpus = [a.index for a in list_adapters() if not a.is_software and a.backend.lower() != "opengl"]
    picks = [gpus[0], gpus[0]] if same else gpus[:2]
    return ",".join(f"wgpu:{i}" for i in picks)


MODELS = {"resnet18": ("image", (3, 32, 32), 10), "resnet18_224": ("image", (3, 224, 224), 10),
          "gpt": ("tokens", (128,), 2048)}


def prepare(out: Path, names: list[str]) -> None:
    import torch

    import anygrad
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        torch.manual_seed(0)
        if name.startswith("resnet18"):
            try:
                import torchvision
                module = torchvision.models.resnet18(num_classes=10)
            except ImportError:
                module = resnet18_module()
            example = torch.randn(2, *MODELS[name][1])
        else:
            module = gpt_module()
            example = torch.randint(0, 2048, (2, 128))
        t0 = time.perf_counter()
        path = out / f"{name}.onnx"
        try:
            anygrad.from_torch(module, example, check=False, path=path)
        except Exception as e:  # noqa: BLE001 - the TorchScript exporter where dynamo's is missing
            print(f"{name}: dynamo export failed ({e}); TorchScript exporter", flush=True)
            anygrad.from_torch(module, example, check=False, path=path, dynamo=False)
        print(f"{name}: exported in {time.perf_counter() - t0:.1f}s", flush=True)


def batches(kind: str, shape: tuple, classes: int, n: int, count: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    if kind == "tokens":
        return [(rng.integers(0, classes, (n, *shape)).astype(np.int64),
                 rng.integers(0, classes, (n, *shape)).astype(np.int64)) for _ in range(count)]
    return [(rng.standard_normal((n, *shape), dtype=np.float32), rng.integers(0, classes, n).astype(np.int64))
            for _ in range(count)]


def run(args: argparse.Namespace) -> None:
    import anygrad
    from anygrad.distributed import DataParallel, ProcessGroup, device_list, rank_device, world_from_env
    from anygrad.optim import SGD
    world = world_from_env()
    group = ProcessGroup(world) if world is not None else None
    rank = group.rank if group else 0
    ranks = group.size if group else 1
    if args.device in ("gpus", "same-gpu"):  # two devices in this one process
        args.device = hardware_devices(args.device == "same-gpu")
    device = rank_device(args.device, world.local_rank if world else 0) if device_list(args.device) is None \
        else args.device
    name = Path(args.onnx).stem
    kind, shape, classes = MODELS[name]
    model = anygrad.load_onnx(args.onnx)
    model.compile(loss="cross_entropy", optimizer=SGD(lr=0.01, momentum=0.9), device=device)
    local_devices = len(model.parallel.replicas) if model.parallel else 1
    if group is not None:
        local = [r.backend for r in model.parallel.replicas[1:]] if model.parallel else []
        model.parallel = DataParallel(model, local, group, check_every=0)
    per_step = args.batch * local_devices  # this process's samples per step
    data = batches(kind, shape, classes, per_step, 4, seed=rank)
    t0 = time.perf_counter()
    model.train_on_batch(*data[0])
    first_s = time.perf_counter() - t0
    for i in range(args.warmup):
        model.train_step(*data[i % 4])
    spent: dict[str, float] = {}

    def timed(owner, attr: str, label: str) -> None:  # host time spent in a method, summed
        inner = getattr(owner, attr)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
        setattr(owner, attr, wrapper)
    if model.parallel is not None:  # the gradient exchange + update, and its parts
        timed(model.parallel, "_reduce_and_update", "exchange")
        for r in model.parallel.replicas:
            timed(r.backend, "export_states", "export")
            timed(r.backend, "import_states", "import")
        if group is not None:
            timed(group, "all_reduce_flat", "all_reduce")
    model.read_metrics(reset=True)  # a readback: the device is idle before the clock starts
    if group is not None:
        group.barrier()
    t0 = time.perf_counter()
    for i in range(args.steps):
        model.train_step(*data[i % 4])
    metrics = model.read_metrics(reset=True)
    if group is not None:
        group.barrier()
    seconds = time.perf_counter() - t0
    if model.parallel is not None:
        model.parallel.check_replicas()
    samples = per_step * ranks * args.steps
    result = {"model": name, "batch_per_device": args.batch, "devices": local_devices * ranks, "ranks": ranks,
              "device": model.parallel.description if model.parallel else model.backend.description,
              "steps": args.steps, "seconds": seconds, "samples_per_s": samples / seconds,
              "step_ms": 1000 * seconds / args.steps,
              **{f"{k}_ms": 1000 * v / args.steps for k, v in spent.items()},
              "first_step_s": first_s, "loss": metrics.get("loss"),
              "params": model.num_parameters()}
    if rank == 0:
        print(json.dumps(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    if group is not None:
        group.close()


def comm(args: argparse.Namespace) -> None:
    """gloo all-reduce throughput of a float32 vector of --mib MiB between the ranks."""
    from anygrad.distributed import ProcessGroup, world_from_env
    group = ProcessGroup(world_from_env())
    flat = np.ones((args.mib << 20) // 4, np.float32)
    group.all_reduce_flat(flat)
    group.barrier()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        group.all_reduce_flat(flat)
    ms = 1000 * (time.perf_counter() - t0) / args.repeats
    if group.rank == 0:
        print(json.dumps({"all_reduce_mib": args.mib, "ranks": group.size, "ms": ms,
                          "gb_per_s": (args.mib << 20) / ms / 1e6}), flush=True)
    group.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--models", default="resnet18,gpt")
    b = sub.add_parser("run")
    b.add_argument("--onnx", required=True)
    b.add_argument("--batch", type=int, required=True)
    b.add_argument("--device", default="wgpu")
    b.add_argument("--steps", type=int, default=20)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--json")
    c = sub.add_parser("comm")
    c.add_argument("--mib", type=int, default=43)
    c.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.out, args.models.split(","))
    elif args.cmd == "comm":
        comm(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
