"""Which ops of a model's training step run on a numpy reference kernel on a torch device (a host
round trip per step on a GPU), and whether the embedding gradient (GatherGrad) is bit-for-bit
repeatable there.

    python benchmarks/torch_fallbacks.py --device torch:cuda
    python benchmarks/torch_fallbacks.py --device torch:cpu --models cnn,gpt

Models: the founding CNN, and benchmarks/models.py's GPT-style decoder and ViT builders at small
sizes (2 layers; batch 2). The RNG counter's uint32 increment (Add) always runs on the host: torch
holds no uint32.
"""
from __future__ import annotations

import argparse
import io
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _model(name: str, rng: np.random.Generator):
    import torch

    import anygrad
    from anygrad.examples import FOUNDING_MODEL
    if name == "cnn":
        x = rng.standard_normal((2, 1, 28, 28)).astype(np.float32)
        return anygrad.load_onnx(FOUNDING_MODEL), "nll", x, rng.integers(0, 10, 2)
    torch.manual_seed(0)
    if name == "gpt":
        from models import _gpt_module
        net, x, y = _gpt_module(64, 16, 32, 4, 2), rng.integers(0, 64, (2, 16)), rng.integers(0, 64, 32)
    else:
        from torchvision.models.vision_transformer import VisionTransformer
        net = VisionTransformer(image_size=32, patch_size=4, num_layers=2, num_heads=3, hidden_dim=48, mlp_dim=96,
                                num_classes=10, dropout=0.0, attention_dropout=0.0)
        x, y = rng.standard_normal((2, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 2)
    with warnings.catch_warnings(), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return anygrad.from_torch(net, torch.from_numpy(x), dynamo=False), "cross_entropy", x, y


def gather_grad_repeatable(device: str, runs: int = 5) -> bool:
    """Many contributions to few rows: the same bits on every run, and numpy's values."""
    from anygrad.autodiff import gradients
    from anygrad.backends.numpy import NumpyBackend
    from anygrad.backends.torch import TorchBackend
    from anygrad.ir.builder import Builder
    from anygrad.ir.graph import Graph, Node, TensorInfo
    from anygrad.ir.passes import specialize
    rng = np.random.default_rng(0)
    table, ids = rng.standard_normal((8, 64)).astype(np.float32), rng.integers(0, 8, (512, 64))
    g = Graph()
    g.inputs = ["table"]
    g.info["table"] = TensorInfo(np.dtype(np.float32), table.shape)
    g.initializers["ids"] = ids
    g.nodes = [Node("Gather", ["table", "ids"], ["out"], {"axis": 0}, name="gather")]
    g.outputs = ["out"]
    g = specialize(g, {})
    b = Builder(g, prefix="check")
    r = rng.standard_normal(b.shape("out")).astype(np.float32)
    loss = b.op("ReduceSum", [b.op("Mul", ["out", b.const(r)])], keepdims=0)
    grad = gradients(g, loss, ["table"])["table"]
    g.outputs = [grad]
    exe = TorchBackend(device).compile(g)
    assert "GatherGrad" not in exe.fallback_ops
    first = exe.run({"table": table})[grad]
    same = all(np.array_equal(exe.run({"table": table})[grad], first) for _ in range(runs))
    ref = NumpyBackend().compile(g).run({"table": table})[grad]
    return same and np.allclose(first, ref, rtol=1e-4, atol=1e-4)


def main(argv: list[str] | None = None) -> int:
    import anygrad
    from anygrad.backends.torch import TorchBackend
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="torch")
    p.add_argument("--models", default="cnn,gpt,vit")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        model, loss, x, y = _model(name, rng)
        model.compile(loss=loss, optimizer=anygrad.optim.SGD(lr=0.01, momentum=0.9), device=TorchBackend(args.device))
        model.train_on_batch(x, y)
        for (kind, *_), exe in model._programs.items():
            print(f"{name:4s} {kind}: numpy fallbacks {exe.fallback_ops}")
    print(f"GatherGrad bit-for-bit repeatable and numpy's on {args.device}: {gather_grad_repeatable(args.device)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
