"""Data-parallel scaling: training throughput on N GPUs (N ranks under torchrun, one wgpu device
each, gradients all-reduced through gloo) over one GPU, for ResNet-18 and a GPT-style decoder.

    python benchmarks/dist_scaling.py suite --out /tmp/dist     # everything below, then the table
    python benchmarks/dist_scaling.py suite --out /tmp/dist --device cpu --rows gpt:4:3   # mechanics, no GPU
    python benchmarks/dist_scaling.py prepare --out /tmp/models           # ONNX files, once
    python benchmarks/dist_scaling.py run --onnx /tmp/models/resnet18.onnx --batch 512 --json r1.json
    torchrun --nproc-per-node 2 benchmarks/dist_scaling.py run --onnx ... --batch 512 --json r2.json
    python benchmarks/dist_scaling.py run --onnx ... --device wgpu:0,wgpu:1 ...   # one process, 2 devices
    python benchmarks/dist_scaling.py run --onnx ... --precision f16 ...          # mixed precision on each

--batch is per device (each rank's share); the global batch is batch x devices. Models as in
benchmarks/models.py (torch.manual_seed(0), SGD lr 0.01 momentum 0.9, synthetic data): torchvision
ResNet-18 (32x32 input, 10 classes) and the GPT-style decoder (4 layers, d 256, 4 heads, T 128,
vocab 2048). Throughput is global samples/s over --steps steps after --warmup, timed on rank 0
between two barriers-equivalent syncs (a parameter readback), so every rank's work is counted.
Runs on several devices also report where a step's host time goes (DataParallel.breakdown()), and
with --timeline PATH when each phase ran on which thread: ANYGRAD_DP_TIMELINE (anygrad.timeline), a
Chrome trace per process (ranks: PATH.rank<N>.json) of every step, the first and the warm-up ones too
(open it in https://ui.perfetto.dev; `python -m anygrad.timeline all.json PATH.rank*.json` merges ranks).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _specs():
    """benchmarks/models.py's model table (its builders, not copies)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import models
    return models.MODELS


# name: (benchmarks/models.py entry, input shape of one sample where it differs from that entry's)
MODELS = {"resnet18": ("resnet18", None), "resnet18_224": ("resnet18", (3, 224, 224)), "gpt": ("gpt", None)}


def spec_of(name: str) -> tuple[str, tuple, int]:
    """(kind, one sample's input shape, classes or vocabulary) of a benchmark model."""
    key, shape = MODELS[name]
    spec = _specs()[key]
    return spec.kind, tuple(shape or spec.shape), spec.classes


def hardware_devices(same: bool) -> str:
    """'wgpu:i,wgpu:j' for the first two GPU adapters (not OpenGL, not software); `same`: the first twice."""
    from anygrad.devices import list_adapters
    gpus = [a.index for a in list_adapters() if not a.is_software and a.backend.lower() != "opengl"]
    picks = [gpus[0], gpus[0]] if same else gpus[:2]
    return ",".join(f"wgpu:{i}" for i in picks)


def prepare(out: Path, names: list[str]) -> None:
    import torch

    import anygrad
    out.mkdir(parents=True, exist_ok=True)
    specs = _specs()
    for name in names:
        kind, shape, classes = spec_of(name)
        torch.manual_seed(0)
        module = specs[MODELS[name][0]].build()
        example = torch.randint(0, classes, (2, *shape)) if kind == "tokens" else torch.randn(2, *shape)
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
    from anygrad.distributed import (
        DataParallel,
        ProcessGroup,
        data_parallel,
        device_list,
        rank_device,
        world_from_env,
    )
    from anygrad.distributed.launch import BUCKET_BYTES
    from anygrad.optim import SGD
    if args.timeline:  # before the DataParallel objects are made: they read it
        os.environ["ANYGRAD_DP_TIMELINE"] = str(Path(args.timeline).absolute())
    world = world_from_env()
    group = ProcessGroup(world) if world is not None else None
    rank = group.rank if group else 0
    ranks = group.size if group else 1
    if args.device in ("gpus", "same-gpu"):  # two devices in this one process
        args.device = hardware_devices(args.device == "same-gpu")
    device = rank_device(args.device, world.local_rank if world else 0) if device_list(args.device) is None \
        else args.device
    name = Path(args.onnx).stem
    kind, shape, classes = spec_of(name)
    model = anygrad.load_onnx(args.onnx)
    model.compile(loss="cross_entropy", optimizer=SGD(lr=0.01, momentum=0.9), device=device, precision=args.precision)
    local_devices = len(model.devices)
    if group is not None:
        model.strategy = DataParallel(model, model.devices[1:], group, check_every=0,
                                      grad_compression=args.grad_compression)
    parallel = data_parallel(model)
    per_step = args.batch * local_devices  # this process's samples per step
    data = batches(kind, shape, classes, per_step, 4, seed=rank)
    t0 = time.perf_counter()
    model.train_on_batch(*data[0])
    first_s = time.perf_counter() - t0
    for i in range(args.warmup):
        model.train_step(*data[i % 4])
    model.read_metrics(reset=True)  # a readback: the device is idle before the clock starts
    if group is not None:
        group.barrier()
    if parallel is not None:
        parallel.breakdown(reset=True)  # the timed steps only
    t0 = time.perf_counter()
    for i in range(args.steps):
        model.train_step(*data[i % 4])
    metrics = model.read_metrics(reset=True)
    if group is not None:
        group.barrier()
    seconds = time.perf_counter() - t0
    breakdown = parallel.breakdown() if parallel is not None else {}
    if parallel is not None:
        parallel.check_replicas()
        written = parallel.write_timeline()
        if written is not None:
            total = 1 + args.warmup + args.steps
            print(f"rank {rank}: timeline of the first {parallel.timeline.steps} of {total} steps (steps "
                  f"{1 + args.warmup}..{total - 1} timed, numbered from 0) in {written}", flush=True)
    samples = per_step * ranks * args.steps
    result = {"model": name, "precision": model.precision, "batch_per_device": args.batch, "devices": local_devices * ranks, "ranks": ranks,
              "device": parallel.description if parallel else model.backend.description,
              "steps": args.steps, "seconds": seconds, "samples_per_s": samples / seconds,
              "step_ms": 1000 * seconds / args.steps,
              "breakdown_ms": {k: round(v, 3) for k, v in sorted(breakdown.items())},
              "first_step_s": first_s, "loss": metrics.get("loss"),
              "hold_parts": parallel.hold_parts if parallel is not None else None,
              "polls_freely": bool(getattr(getattr(model.backend, "ctx", None), "polls_freely", False)),
              "bucket_mb": (parallel.bucket_bytes if parallel is not None else BUCKET_BYTES) / (1 << 20),
              "grad_compression": parallel.grad_compression if parallel is not None else "none",
              "params": model.num_parameters()}
    if rank == 0:
        print(json.dumps(result), flush=True)
        if breakdown:
            print(f"{name} {result['devices']} devices, per step (ms, host clock; device threads overlap the "
                  "main thread): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(breakdown.items())), flush=True)
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
        from anygrad.distributed.launch import BUCKET_BYTES, fixed_bucket_bytes
        got = {"all_reduce_mib": args.mib, "ranks": group.size, "ms": ms, "gb_per_s": (args.mib << 20) / ms / 1e6,
               "gloo_groups": len(group.lanes),
               "bucket_mb": (fixed_bucket_bytes() or BUCKET_BYTES) / (1 << 20)}
        print(json.dumps(got), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(got, indent=1))
    group.close()


# the GPT at two batches a GPU: the exchange costs about the same at both (BENCHMARKS.md, session 38)
ROWS = (("resnet18", 512, 30), ("gpt", 128, 30), ("gpt", 512, 30))


def suite(args: argparse.Namespace) -> None:
    """The issue's table in one command: export, then per model 1 GPU, 2 GPUs as 2 torchrun ranks, and 2
    GPUs in one process; every result's JSON into --out, the table printed at the end."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [(m, int(b), int(n)) for m, b, n in (r.split(":") for r in args.rows.split(","))] if args.rows else ROWS
    prepare(out, sorted({m for m, _, _ in rows}))
    me = [sys.executable, str(Path(__file__).resolve())]
    results = []
    # gloo alone: one group and DDP's 25 MB buckets, against the defaults (several groups, 8 MB buckets)
    for groups, mib in ((1, 25), (4, 8)):
        env = {**os.environ, "ANYGRAD_GLOO_GROUPS": str(groups), "ANYGRAD_BUCKET_MB": str(mib)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] + me[1:] + \
            ["comm", "--mib", "43", "--json", str(out / f"comm-{groups}x{mib}.json")]
        print("$", f"ANYGRAD_GLOO_GROUPS={groups} ANYGRAD_BUCKET_MB={mib}", " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=False)
    for model, batch, steps in rows:
        onnx = str(out / f"{model}.onnx")
        common = ["run", "--onnx", onnx, "--batch", str(batch), "--steps", str(steps)]
        one, two = ("cpu", "cpu,cpu") if args.device == "cpu" else ("wgpu", "gpus")
        cases = [("1gpu", me + common + ["--device", one]),
                 ("2gpu", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                  + me[1:] + common + ["--device", one]),
                 ("2dev-1proc", me + common + ["--device", two])]
        for label, cmd in cases:
            path = out / f"{model}-{batch}-{label}.json"
            if args.timeline:
                Path(args.timeline).mkdir(parents=True, exist_ok=True)
                cmd = cmd + ["--timeline", str(Path(args.timeline) / f"{model}-{batch}-{label}.trace.json")]
            print("$", " ".join(cmd + ["--json", str(path)]), flush=True)
            proc = subprocess.run(cmd + ["--json", str(path)], check=False)
            if proc.returncode == 0 and path.exists():
                results.append({**json.loads(path.read_text()), "case": label})
            else:
                print(f"{model} {label}: exit {proc.returncode}", flush=True)
    (out / "all.json").write_text(json.dumps(results, indent=1))
    print(table(results), flush=True)


def table(results: list[dict]) -> str:
    """Markdown: per model, 1 GPU vs 2 GPUs (ranks, and one process), speed-up, and the 2-GPU step's parts."""
    lines = ["| model | batch per GPU | case | samples/s | step ms | speed-up over 1 GPU | per step ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    base = {(r["model"], r["batch_per_device"]): r["samples_per_s"] for r in results if r["devices"] == 1}
    for r in results:
        one = base.get((r["model"], r["batch_per_device"]))
        speed = f"{r['samples_per_s'] / one:.2f}x" if one and r["devices"] > 1 else "-"
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r.get("breakdown_ms", {}).items() if k != "step")
        lines.append(f"| {r['model']} | {r['batch_per_device']} | {r.get('case', r['devices'])} | "
                     f"{r['samples_per_s']:,.0f} | {r['step_ms']:.1f} | {speed} | {parts} |")
    return "\n".join(lines)


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
    b.add_argument("--precision", choices=("f32", "f16"), default="f32", help="f16: mixed precision on every device")
    b.add_argument("--grad-compression", choices=("none", "bf16"), default="none",
                   help="ranks: gradients sent as bfloat16 (DataParallel grad_compression)")
    b.add_argument("--steps", type=int, default=20)
    b.add_argument("--warmup", type=int, default=16,
                   help="steps before the clock starts (after the first, 8 updates of several devices time "
                        "their bucket size, and 6 more hold_parts where the device polls blocking)")
    b.add_argument("--json")
    b.add_argument("--timeline", help="write a per-thread timeline of the data-parallel steps here (Chrome "
                                      "trace; ranks insert .rank<N> before the suffix)")
    d = sub.add_parser("suite", help="export, then 1 GPU / 2 ranks / 2 devices of one process per model; the table")
    d.add_argument("--out", required=True)
    d.add_argument("--device", default="wgpu", choices=["wgpu", "cpu"])
    d.add_argument("--rows", default="", help="model:batch:steps,... (default resnet18:512:30,gpt:128:30,gpt:512:30)")
    d.add_argument("--timeline", help="a folder: each several-device case writes its timeline there (run --timeline)")
    t = sub.add_parser("table", help="the table of result JSON files")
    t.add_argument("files", nargs="+")
    c = sub.add_parser("comm")
    c.add_argument("--mib", type=int, default=43)
    c.add_argument("--repeats", type=int, default=10)
    c.add_argument("--json")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.out, args.models.split(","))
    elif args.cmd == "comm":
        comm(args)
    elif args.cmd == "suite":
        suite(args)
    elif args.cmd == "table":
        rows = []
        for f in args.files:
            got = json.loads(Path(f).read_text())
            rows += got if isinstance(got, list) else [{"case": Path(f).stem, **got}]
        print(table(rows))
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
