"""Backends execute compiled Graphs: numpy (reference + CPU) and wgpu (any GPU)."""
from .base import Backend, Executable
from .numpy import NumpyBackend

__all__ = ["Backend", "Executable", "NumpyBackend"]
