"""anygrad: train PyTorch-written models on any GPU (WebGPU through wgpu), or the CPU."""
from . import ops  # noqa: F401  (registers every op)
from .errors import AnygradError
from .model import Model
from .frontends import load_onnx, save_onnx
from .frontends.from_torch import from_torch
from . import nn  # the Python model API (anygrad.nn.Module); after the frontends it traces into
from . import distributed  # noqa: F401  (registers DataParallel: the strategy for several devices)
from . import train  # noqa: F401  (registers Model.fit's loop: anygrad.facade)

from .version import __version__
__all__ = ["AnygradError", "Model", "__version__", "from_torch", "load_onnx", "nn", "save_onnx"]
