"""The WebGPU backend (wgpu-py): WGSL kernels generated per op, fused, planned and run in one pass.

By stage, data flowing one way (kernels <- fusion <- planning <- tuning <- runtime; device/ under all):
    device/    the WebGPU implementation (wgpu-native or Dawn), adapters, shader modules, the
               poll thread, the on-disk pipeline and plan cache
    kernels/   the contract (kernel.py: Kernel, Scratch, AdapterCaps, REGISTRY, @lowering), WGSL
               helpers, one kernels_*.py per op family (node -> WGSL kernels, shapes baked in)
    fusion/    graph rewrites before lowering (passes.prepare): elementwise fusion, GEMM epilogues
               and layouts, fused optimizer updates over parameter arenas
    planning/  kernel list + where every value lives (aliases, slots by liveness, in place),
               binding packing/splitting, grid folding, limits profiles
    tuning/    the GEMM autotuner, GPU profiling, f16 self-tests
    runtime/   WgpuBackend (device context, state buffers, pipelines) and WgpuExecutable
               (encode.py builds and encodes the dispatches; executable.py runs a step)

Importing this package registers every lowering in `kernel.REGISTRY` (kernels in `kernel.LOWERINGS`).
"""
from .kernels import (  # noqa: F401  (each registers its lowerings)
    kernels_activation,
    kernels_collective,
    kernels_attention,
    kernels_conv,
    kernels_pool,
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
from .device.adapters import AdapterInfo, list_adapters
from .kernels.kernel import LOWERINGS, AdapterCaps, Kernel, Scratch, lowering
from .runtime.backend import WgpuBackend
from .runtime.executable import WgpuExecutable

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
