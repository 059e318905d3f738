"""Frontends: model files in (ONNX), model files out."""
from .onnx_export import save_onnx
from .onnx_import import ModelSummary, OnnxOrigin, TorchName, load_onnx, summarize

__all__ = ["ModelSummary", "OnnxOrigin", "TorchName", "load_onnx", "save_onnx", "summarize"]
