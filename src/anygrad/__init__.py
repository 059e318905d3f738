"""anygrad: train PyTorch-written models on any GPU (WebGPU through wgpu), or the CPU."""
from . import ops  # noqa: F401  (registers every op)
from .errors import AnygradError
from .model import Model
from .frontends import load_onnx, save_onnx
from .frontends.from_torch import from_torch

__version__ = "0.1.0"
__all__ = ["AnygradError", "Model", "from_torch", "load_onnx", "save_onnx", "__version__"]
