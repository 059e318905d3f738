"""Planned device memory of a training step, by category, against the liveness lower bound.

No GPU time: the step is planned (wgpu planner) for an adapter's limits, nothing runs. The lower
bound is the peak over the kernel sequence of the bytes of the temporaries live at once, i.e.
what a placement with no fragmentation would need (planner.liveness_bound).

    PYTHONPATH=src python benchmarks/plan_memory.py gpt:8 gpt:128 vit:128 resnet18:128
    PYTHONPATH=src python benchmarks/plan_memory.py --binding lavapipe gpt:8
    PYTHONPATH=src python benchmarks/plan_memory.py --phase apply resnet18:512   # accumulating 2 batches

--binding h100 (default) plans for a 2 GiB - 4 storage binding (an H100 under Vulkan), f16
available; `lavapipe` uses this machine's adapter limits as they are.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 2 ** 20


def plan_step(name: str, batch: int, precision: str, binding: str, phase: str = "step"):
    import torch
    from models import MODELS

    import anygrad
    from anygrad.backends.wgpu.planning.planner import fit_plan
    from anygrad.backends.wgpu.runtime.backend import WgpuBackend
    from anygrad.losses import get_loss
    from anygrad.optim import SGD
    from anygrad.program import build_train_step

    spec = MODELS[name]
    torch.manual_seed(0)
    x, _ = spec.batch(2, np.random.default_rng(0))
    model = anygrad.from_torch(spec.build(), torch.from_numpy(x), check=False)
    backend = WgpuBackend()
    if binding == "h100":
        backend.caps = replace(backend.caps, max_storage_binding_size=(2 << 30) - 4, has_f16=True, is_cpu=False)
    g = model.graph
    shape = (batch,) + tuple(spec.shape)
    target = (batch * spec.shape[0],) if spec.kind == "tokens" else (batch,)
    step = build_train_step(g, {g.inputs[0]: shape}, target, get_loss("cross_entropy"),
                            SGD(lr=0.01, momentum=0.9), precision=precision,
                            accumulate=1 if phase == "step" else 2, phase=phase)
    _, plan, _ = fit_plan(step, backend.caps, set(step.state_names),
                          lambda gr: backend.prepared(gr, True, measure=False))
    return plan


def main(argv: list[str] | None = None) -> int:
    from anygrad.backends.wgpu.planning.planner import _assign_slots, liveness_bound, memory_report
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", help="MODEL:BATCH (models from benchmarks/models.py)")
    ap.add_argument("--precision", default="f32,f16")
    ap.add_argument("--binding", choices=("h100", "lavapipe"), default="h100")
    ap.add_argument("--phase", choices=("step", "accumulate", "apply"), default="step",
                    help="with gradient accumulation: a micro-batch that only adds its gradients, or the last one")
    args = ap.parse_args(argv)
    print("| model | batch | precision | parameters | optimizer | activations: slots by first use (before) | "
          "offsets into shared buffers (after) | lower bound | after over bound | buffers before/after | total after |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in args.cases:
        name, batch = case.split(":")
        for prec in args.precision.split(","):
            plan = plan_step(name, int(batch), prec, args.binding, args.phase)
            rep = memory_report(plan)
            temps = sum(plan.slot_bytes)
            bound = liveness_bound(plan)
            other = rep.activations - temps  # gradient arenas of fused updates
            first = {r: f for r, (f, _) in plan.live.items()}
            last = {r: la for r, (_, la) in plan.live.items()}
            old = min((_assign_slots(plan.steps, first, last, plan.nbytes, set(), grow)[1] for grow in (True, False)),
                      key=sum)
            print(f"| {name} | {batch} | {prec} | {rep.parameters / MIB:.1f} | {rep.optimizer_state / MIB:.1f} | "
                  f"{(other + sum(old)) / MIB:.1f} | {rep.activations / MIB:.1f} | {(other + bound) / MIB:.1f} | "
                  f"{100 * (temps / bound - 1) if bound else 0:.1f}% | {len(old)}/{len(plan.slot_bytes)} | "
                  f"{rep.total / MIB:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
