"""The model-family zoo: torchvision, timm and Hugging Face architectures in tiny random-init
configs, each through `from_torch` (both exporters) and through `load_onnx` + `load_state_dict`
by PyTorch names, matching PyTorch in eval output, the whole state_dict after one SGD step with
lr 1 (the gradients), and five more steps' losses. See model_families.py and family_harness.py."""
from __future__ import annotations

import pytest
from family_harness import check_route, export_file, load_by_names, torch_reference
from model_families import FAMILIES

import anygrad

ROUTES = ("dynamo", "torchscript", "load_state_dict")

_references: dict = {}
_files: dict = {}


@pytest.fixture
def reference():
    def get(name: str):
        if name not in _references:
            _references[name] = torch_reference(FAMILIES[name])
        return _references[name]
    return get


@pytest.fixture
def exported(tmp_path_factory):
    """(family, exporter) -> (the from_torch model, the path of its ONNX file); one export each."""
    def get(name: str, exporter: str):
        if (name, exporter) not in _files:
            path = tmp_path_factory.mktemp(f"{name}-{exporter}") / "model.onnx"
            _files[name, exporter] = (export_file(FAMILIES[name], exporter, path), path)
        return _files[name, exporter]
    return get


def _cases():
    for name, family in FAMILIES.items():
        for route in ROUTES:
            if route != "load_state_dict" and route not in family.exporters:
                continue
            marks = [pytest.mark.slow] if family.slow else []
            if route in family.xfail:
                marks.append(pytest.mark.xfail(strict=True, reason=family.xfail[route]))
            yield pytest.param(name, route, marks=marks, id=f"{name}-{route}")


@pytest.mark.parametrize("name,route", list(_cases()))
def test_family_matches_pytorch(name, route, reference, exported, tmp_path):
    family = FAMILIES[name]
    extra = set()
    if route == "load_state_dict":
        _, path = exported(name, family.file_exporter)
        model, extra = load_by_names(family, path, tmp_path)
    else:
        model, _ = exported(name, route)
    check_route(model, family, reference(name), "cpu", extra)


WGPU_FAMILIES = ("torchvision-mobilenet_v3", "timm-vit", "hf-llama")  # conv + BatchNorm, attention, rotary


@pytest.mark.wgpu
@pytest.mark.parametrize("name", WGPU_FAMILIES)
def test_family_trains_on_wgpu(name, reference, exported, tmp_path, wgpu_device):
    """The same run on wgpu (lavapipe in CI), through load_state_dict by PyTorch names."""
    family = FAMILIES[name]
    _, path = exported(name, family.file_exporter)
    model, extra = load_by_names(family, path, tmp_path)
    check_route(model, family, reference(name), wgpu_device, extra)


def test_integer_buffer_the_graph_folded_must_match(exported):
    """Swin's relative_position_index is an int64 buffer import folds into the graph's constants:
    a checkpoint holding it loads (and exports it back), one holding another value is refused."""
    import numpy as np
    from family_harness import build

    from anygrad.errors import ModelError
    family = FAMILIES["torchvision-swin"]
    _, path = exported("torchvision-swin", family.file_exporter)
    state = {k: v.numpy() for k, v in build(family).state_dict().items()}
    key = "features.1.0.attn.relative_position_index"
    model = anygrad.load_onnx(path)
    model.load_state_dict(state)
    np.testing.assert_array_equal(model.to_torch_state_dict(as_numpy=True)[key], state[key])
    state[key] = state[key][::-1].copy()
    with pytest.raises(ModelError, match=rf"{key}: the graph computes with the file's int64 constant \(16\)"):
        anygrad.load_onnx(path).load_state_dict(state)
