"""Fixtures of the zoo: each family is exported once per exporter and its PyTorch trajectory
computed once, shared by the cpu and wgpu tests. (The model-family zoo, test_model_families.py,
keeps its own caches.)"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The model-family zoo builds timm and transformers models from code; nothing may reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # zoo_models, zoo_harness, model_families
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # wgpu_util

from wgpu_util import has_adapter, no_adapter
from zoo_harness import anygrad_trajectory, export, torch_trajectory
from zoo_models import FAMILIES

_exports: dict = {}
_references: dict = {}
_numpy_runs: dict = {}


@pytest.fixture
def zoo_export(tmp_path_factory):
    """(family, exporter) -> (path of the ONNX file, PyTorch model with the file's weights)."""
    def get(family: str, exporter: str):
        key = (family, exporter)
        if key not in _exports:
            path = tmp_path_factory.mktemp(f"zoo_{family}_{exporter}") / f"{family}.onnx"
            _exports[key] = (path, export(FAMILIES[family], path, exporter))
        return _exports[key]
    return get


@pytest.fixture
def zoo_reference(zoo_export):
    """family -> PyTorch's Trajectory over the zoo's SGD steps (both exporters write the same state)."""
    def get(family: str):
        if family not in _references:
            _, model = zoo_export(family, "torchscript")
            _references[family] = torch_trajectory(FAMILIES[family], model)
        return _references[family]
    return get


@pytest.fixture
def zoo_numpy(zoo_export):
    """(family, exporter) -> anygrad's Trajectory on the numpy backend, computed once: the cpu
    case makes it, and the torch:cpu case is checked against the same run."""
    def get(family: str, exporter: str):
        key = (family, exporter)
        if key not in _numpy_runs:
            path, _ = zoo_export(family, exporter)
            _numpy_runs[key] = anygrad_trajectory(FAMILIES[family], path, "cpu")
        return _numpy_runs[key]
    return get


@pytest.fixture(scope="session")
def wgpu_device():
    if not has_adapter():  # skips, or fails under $ANYGRAD_REQUIRE_WGPU=1 (CI)
        no_adapter()
    return "wgpu"
