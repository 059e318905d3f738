"""What the fusion-pass tests share: training a model and the PyTorch module it was exported from
side by side, step by step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import anygrad


def trains_like_pytorch(model, module, device: str, steps: int = 3, rtol: float = 1e-5) -> None:
    """SGD steps on the same random batches: each loss equals PyTorch's, then every parameter."""
    model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.1), device=device)
    rng = np.random.default_rng(0)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(steps):
        x = rng.standard_normal((4, 6)).astype(np.float32) * 2
        y = rng.integers(0, 3, 4)
        opt.zero_grad()
        ref = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        ref.backward()
        opt.step()
        assert model.train_on_batch(x, y) == pytest.approx(ref.item(), rel=rtol)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(model.state_dict()[name], p.detach().numpy(), rtol=10 * rtol, atol=1e-6)
