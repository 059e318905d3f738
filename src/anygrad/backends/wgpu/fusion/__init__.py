"""Graph rewrites before lowering (passes.prepare runs them in order): elementwise fusion
(elementwise.py), GEMM epilogues and prologues (gemm_epilogues.py) and layouts (gemm_layout.py),
float casts folded into row kernels (casts.py), fused optimizer updates over parameter arenas
(arenas.py). Reads the kernels' traits (kernels/); knows nothing of plans or devices.
"""
