"""anygrad's version, in a leaf module: every layer may name it (plan caches, ONNX producer, --version)
without importing the package's __init__, which imports every layer. pyproject.toml reads it from here."""
__version__ = "0.1.0"
