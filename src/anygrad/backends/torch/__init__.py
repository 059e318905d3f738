"""The PyTorch backend (`anygrad-train[torch]`): the compiled training step run with torch tensor ops
on CUDA, Apple's MPS or the CPU.

The graph is anygrad's own (forward, loss, backward from anygrad's autodiff, optimizer update,
metrics), never torch.autograd's, so semantics, dropout masks and checkpoints are those of the
numpy and wgpu backends.

    lowering.py        the contract: Site (node + static infos), LOWERINGS, @lowering
    kernels_*.py       one module per op family: node -> torch kernel
    rng.py             the counter-based RNG in torch ops (identical dropout masks)
    convert.py         numpy <-> torch values and dtypes
    device.py          loading torch, and the torch device a device string names
    backend.py         TorchBackend: the device, the state store, uploads; compiles executables
    runtime.py         TorchExecutable: the graph as a flat plan of kernels (numpy fallbacks), run eagerly
    sites.py           per node: the Site its lowering sees, whether it lowers; fed-target checks
    steps.py           the plan's units before flattening (_Step), MatMul + bias fused into addmm
    actions.py         the plan's actions and the loops that run them
    compiled.py        torch.compile over runs of lowered actions
    cuda_graph.py      capturing the step's device work as a CUDA graph, and replaying it

Nothing here imports torch at module level: importing this package is cheap, torch is loaded
when a TorchBackend is made.
"""
from .lowering import LOWERINGS, Site, lowering
from .backend import TorchBackend
from .device import best_torch_device
from .runtime import TorchExecutable

__all__ = ["LOWERINGS", "Site", "TorchBackend", "TorchExecutable", "best_torch_device", "lowering"]
