"""Process-wide test setup.

torch's x86-64 wheels that ship CUDA (the torch 2.14.1 the test command installs, for torchvision)
bring triton, whose bundled LLVM crashes the process (SIGSEGV in its module init) when it loads
after lavapipe's LLVM, which the wgpu tests load first. torch imports triton lazily, the first
time the dynamo ONNX exporter runs, which is after some wgpu test in a full run. Loading it here,
before any adapter exists, is the order that works.
"""
from __future__ import annotations

import importlib.util

if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: F401
