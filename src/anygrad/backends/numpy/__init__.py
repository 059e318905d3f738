"""The numpy backend: the reference every other backend is tested against, and a real CPU device.

runtime.py runs a compiled graph (one loop over the plan, temporaries freed as they die);
lowering.py is its lowering registry: the in-place kernels and the ops it runs in batch blocks
with an epilogue.
"""
from .lowering import BLOCKED, INPLACE, InplaceKernel
from .runtime import NumpyBackend, NumpyExecutable, keep_freed_memory

__all__ = ["BLOCKED", "INPLACE", "InplaceKernel", "NumpyBackend", "NumpyExecutable", "keep_freed_memory"]
