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
from pathlib import Path

import pytest

_SRC = Path(__file__).resolve().parents[1] / "src"
_FOUND = importlib.util.find_spec("anygrad")
if _FOUND is None or _SRC not in Path(_FOUND.origin).resolve().parents:
    # An install of another checkout (or of the former distribution name `anygrad`, whose
    # editable .pth sorts before `anygrad_train`'s) would make every test below test that code.
    raise pytest.UsageError(
        f"the tests import anygrad from {_FOUND.origin if _FOUND else 'nowhere'}, not from this "
        f"checkout's {_SRC}: run README's test command here, after `pip uninstall anygrad` if an "
        "install under the former distribution name is present")

from anygrad.ir import private_attrs

if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: F401


# The wgpu plan cache (backends/wgpu/device/pipeline_cache.py) writes under ~/.cache/anygrad; tests keep
# it off unless they test it (test_wgpu_pipeline_cache.py turns it on in a temporary folder).
os.environ.setdefault("ANYGRAD_PIPELINE_CACHE", "0")

# The wgpu tests run under WebGPU's guaranteed limits (8 storage buffers per stage, 16 KiB of
# workgroup memory, 256 invocations, 128 MiB bindings), not the adapter's own, so CI checks that
# every model and op they train plans within what any adapter offers (issue 13). Tests of other
# profiles set their own; ANYGRAD_WGPU_LIMITS= (empty) in the environment gives the adapter's limits.
os.environ.setdefault("ANYGRAD_WGPU_LIMITS", "webgpu-default")

# Private node attributes (anygrad/ir/private_attrs.py): in tests, reading an undeclared one fails
# too, not only setting one (fusion.prepare checks what the rewrites set).
private_attrs.checking(True)


@pytest.fixture
def one_torch_thread():
    """For torch:cpu runs of small models: torch's CPU thread pool spin-waits on itself, and on a
    shared 2-core machine (CI, with lavapipe's threads about) a step of the founding CNN took
    0.4-1.6 s on 2 threads against 0.05 s on 1."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
