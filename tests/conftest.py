"""Process-wide test setup.

torch's x86-64 wheels that ship CUDA (the torch 2.14.1 the test command installs, for torchvision)
bring triton, whose bundled LLVM crashes the process (SIGSEGV in its module init) when it loads
after lavapipe's LLVM, which the wgpu tests load first. torch imports triton lazily, the first
time the dynamo ONNX exporter runs, which is after some wgpu test in a full run. Loading it here,
before any adapter exists, is the order that works.
"""
from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: F401


# The wgpu plan cache (backends/wgpu/pipeline_cache.py) writes under ~/.cache/anygrad; tests keep
# it off unless they test it (test_wgpu_pipeline_cache.py turns it on in a temporary folder).
os.environ.setdefault("ANYGRAD_PIPELINE_CACHE", "0")
