"""The WebGPU backend (wgpu-py): WGSL kernels generated per op, fused, planned and run in one pass.

Importing this package registers every lowering in `kernel.LOWERINGS`.
"""
from pathlib import Path

from . import (  # noqa: F401
    kernels_activation,
    kernels_elementwise,
    kernels_loss,
    kernels_nn,
    kernels_optim,
    kernels_reduce,
    kernels_shape,
)
from .adapters import AdapterInfo, list_adapters
from .kernel import LOWERINGS, AdapterCaps, Kernel, Scratch, lowering
from .runtime import WgpuBackend, WgpuExecutable

# The GEMM family is written separately; until both modules exist, import whichever is there.
_HERE = Path(__file__).parent
if (_HERE / "kernels_gemm.py").exists():
    from . import kernels_gemm  # noqa: F401
if (_HERE / "kernels_conv.py").exists():
    from . import kernels_conv  # noqa: F401

__all__ = [
    "LOWERINGS",
    "AdapterCaps",
    "AdapterInfo",
    "Kernel",
    "Scratch",
    "WgpuBackend",
    "WgpuExecutable",
    "list_adapters",
    "lowering",
]
