"""Frontends: model files in (ONNX), model files out."""
from .. import facade
from .onnx_export import save_onnx
from .onnx_import import ModelSummary, OnnxOrigin, TorchName, load_onnx, summarize
from . import torch_weights
from .from_torch import to_torch_tensors

# Model.load_state_dict and its kin call these through anygrad.facade (the Model does not import
# the layer above it)
facade.register("load_state_dict", torch_weights.load_state_dict)
facade.register("to_torch_state_dict", torch_weights.to_torch_state_dict)
facade.register("save_safetensors", torch_weights.save_safetensors)
facade.register("save_adapters", torch_weights.save_adapters)
facade.register("to_torch_tensors", to_torch_tensors)

__all__ = ["ModelSummary", "OnnxOrigin", "TorchName", "load_onnx", "save_onnx", "summarize"]
