"""The WebGPU backend (wgpu-py): WGSL kernels generated per op, fused, planned and run in one pass.

    adapters.py   which adapters exist, ranked; device names -> adapter
    kernel.py     the contract: Kernel, Scratch, AdapterCaps, and the backend's one lowering registry
                  (REGISTRY: per op its kernels and traits, alias / epilogue / update; @lowering)
    kernels_*.py  one module per op family: node -> WGSL kernels with shapes baked in
                  (kernels_collective: AllReduceSum, a host step inside the step)
    fusion.py     graph rewrites before lowering: elementwise fusion, GEMM epilogues, fused
                  optimizer updates over parameter arenas
    planner.py    kernel list + where every value lives (aliases, slots by liveness, in place)
    runtime.py    WgpuBackend (device, state buffers, pipelines) and the executor

Importing this package registers every lowering in `kernel.REGISTRY` (kernels in `kernel.LOWERINGS`).
"""
from . import (  # noqa: F401  (each registers its lowerings)
    kernels_activation,
    kernels_collective,
    kernels_attention,
    kernels_conv,
    kernels_einsum,
    kernels_elementwise,
    kernels_gemm,
    kernels_image,
    kernels_index,
    kernels_loss,
    kernels_math,
    kernels_nn,
    kernels_norm,
    kernels_optim,
    kernels_preview_training,
    kernels_quant,
    kernels_reduce,
    kernels_resize,
    kernels_shape,
)
from .adapters import AdapterInfo, list_adapters
from .kernel import LOWERINGS, AdapterCaps, Kernel, Scratch, lowering
from .runtime import WgpuBackend, WgpuExecutable

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
