"""Loading torch, and the torch device a device string names ('torch', 'torch:cuda[:N]',
'torch:mps', 'torch:cpu'), checked against what this torch build sees.

Separate from the backend because it is the one place torch is imported for the runtime (lazily:
importing anygrad.backends.torch stays cheap), and devices.py asks for the best torch device
without making a backend.
"""
from __future__ import annotations

from typing import Any

from ...errors import ConfigError, DeviceError


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ConfigError("the torch backend needs PyTorch: pip install 'anygrad-train[torch]' "
                          "(or choose device='cpu' or 'wgpu')") from e
    return torch


def resolve_device(device: str) -> str:
    """'torch' / 'torch:cuda[:N]' / 'torch:mps' / 'torch:cpu' -> a torch device string, checked."""
    torch = _torch()
    want = device.partition(":")[2] or "best"
    if want == "best":
        return best_torch_device() or "cpu"
    kind = want.split(":")[0]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device '{device}': torch sees no CUDA GPU (torch {torch.__version__}, "
                              f"CUDA build {torch.version.cuda}); use torch:cpu, wgpu or cpu")
        index = want.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise DeviceError(f"device '{device}': there are {torch.cuda.device_count()} CUDA devices "
                              f"(torch:cuda:0 to :{torch.cuda.device_count() - 1})")
        return want
    if kind == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError(f"device '{device}': torch's MPS (Apple GPU) is not available here; "
                              "use torch:cpu, wgpu or cpu")
        return "mps"
    if want == "cpu":
        return "cpu"
    raise ConfigError(f"unknown torch device '{device}'; use torch, torch:cuda, torch:cuda:N, torch:mps "
                      "or torch:cpu")


def best_torch_device() -> str | None:
    """'cuda' or 'mps' when torch has that GPU, else None (the caller decides about the CPU)."""
    torch = _torch()
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return None
