"""Example models shipped with anygrad (package data)."""
from pathlib import Path

# The founding example: a small MNIST convnet (examples/mnist/model.py in the repository),
# exported by examples/mnist/export.py in training mode so BatchNorm and Dropout are kept.
FOUNDING_MODEL = Path(__file__).resolve().parent / "mnist.onnx"

__all__ = ["FOUNDING_MODEL"]
