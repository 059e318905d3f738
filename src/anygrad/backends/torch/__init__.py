"""The PyTorch backend (`anygrad-train[torch]`): the compiled training step run with torch tensor ops
on CUDA, Apple's MPS or the CPU.

The graph is anygrad's own (forward, loss, backward from anygrad's autodiff, optimizer update,
metrics), never torch.autograd's, so semantics, dropout masks and checkpoints are those of the
numpy and wgpu backends.

    lowering.py        the contract: Site (node + static infos), LOWERINGS, @lowering
    kernels_*.py       one module per op family: node -> torch kernel
    rng.py             the counter-based RNG in torch ops (identical dropout masks)
    convert.py         numpy <-> torch values and dtypes
    runtime.py         TorchBackend (device, state) and the executable (numpy fallback, torch.compile)

Nothing here imports torch at module level: importing this package is cheap, torch is loaded
when a TorchBackend is made.
"""
from .lowering import LOWERINGS, Site, lowering
from .runtime import TorchBackend, TorchExecutable, best_torch_device

__all__ = ["LOWERINGS", "Site", "TorchBackend", "TorchExecutable", "best_torch_device", "lowering"]
