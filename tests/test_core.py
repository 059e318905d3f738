"""The core machinery on the ops the core defines: Gemm/MatMul/elementwise gradients vs PyTorch."""
import numpy as np
import torch
from opcheck import check_op


def test_gemm_all_transposes():
    rng = np.random.default_rng(0)
    for ta in (0, 1):
        for tb in (0, 1):
            a = rng.standard_normal((4, 3) if ta else (3, 4)).astype(np.float32)
            b = rng.standard_normal((5, 4) if tb else (4, 5)).astype(np.float32)
            c = rng.standard_normal((5,)).astype(np.float32)
            check_op("Gemm", [a, b, c], {"transA": ta, "transB": tb, "alpha": 0.5, "beta": 2.0},
                     lambda a, b, c, ta=ta, tb=tb: 0.5 * ((a.T if ta else a) @ (b.T if tb else b)) + 2.0 * c)


def test_matmul_broadcast():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
    b = rng.standard_normal((5, 4, 6)).astype(np.float32)
    check_op("MatMul", [a, b], {}, torch.matmul)
    check_op("MatMul", [rng.standard_normal(4).astype(np.float32), b], {}, torch.matmul)
