"""What `--device auto` picks per model where wgpu and PyTorch both have the GPU.

    python benchmarks/auto_device.py --models "cnn:1000 gpt:128"

Each model (built by benchmarks/models.py) is compiled with device="auto" and trained a step;
auto times the step on the wgpu GPU and on torch's CUDA/MPS (devices.auto_backends) and prints
its choice. Printed here: each backend's ms per step (model.backend_trial) and the pick.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn:1000 gpt:128", help="MODEL:BATCH, space separated (models.py names)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    spec = importlib.util.spec_from_file_location("bench_models", ROOT / "benchmarks/models.py")
    models = importlib.util.module_from_spec(spec)
    sys.modules["bench_models"] = models
    spec.loader.exec_module(models)
    import torch

    import anygrad
    from anygrad.optim import SGD
    results = []
    for item in args.models.split():
        name, _, b = item.partition(":")
        m = models.MODELS[name]
        x, y = m.batch(int(b), np.random.default_rng(0))
        torch.manual_seed(0)
        model = anygrad.from_torch(m.build().train(), torch.from_numpy(x[:2]), check=False)
        model.compile(loss="cross_entropy", optimizer=SGD(lr=0.01, momentum=0.9), device="auto")
        model.train_on_batch(x, y)
        results.append({"model": name, "batch": int(b), "ms_per_step": model.backend_trial,
                        "chosen": model.backend.description})
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
