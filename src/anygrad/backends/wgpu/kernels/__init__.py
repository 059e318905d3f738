"""Lowering: the Kernel contract and the one lowering registry (kernel.py), WGSL helpers (wgsl.py),
one kernels_*.py per op family (node -> WGSL kernels with shapes baked in; the GEMM's also in
gemm_spec/gemm_wgsl/gemm_splitk.py), and the shared kernel builders they use (row/column
reductions, segments, f16 storage, matrix units).
Imports nothing of the later stages: fusion, planning and the runtime build on it.
"""
