"""The model-family zoo: torchvision, timm and Hugging Face architectures in tiny random-init
configs, each through `from_torch` (both exporters) and through `load_onnx` + `load_state_dict`
by PyTorch names, matching PyTorch in eval output, the whole state_dict after one SGD step with
lr 1 (the gradients), and five more steps' losses. See model_families.py and family_harness.py.
A few families run the same on wgpu and on torch:cpu (the PyTorch backend); torch:cpu is also
checked against the numpy backend's run, to float32 noise."""
from __future__ import annotations

import numpy as np
import pytest
from family_harness import check_route, export_file, load_by_names, torch_reference
from model_families import FAMILIES

import anygrad

ROUTES = ("dynamo", "torchscript", "load_state_dict")

_references: dict = {}
_files: dict = {}
_numpy_runs: dict = {}  # family -> anygrad's Run on the numpy backend, load_state_dict route


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
        # the exporter that wrote the graph: the one asked for, or the other where it cannot
        other = next(e for e in ("dynamo", "torchscript") if e != route)
        assert model.torch_binding.exporter == (other if route in family.falls_back else route)
    run = check_route(model, family, reference(name), "cpu", extra)
    if route == "load_state_dict":
        _numpy_runs[name] = run


WGPU_FAMILIES = ("torchvision-mobilenet_v3", "timm-vit", "hf-llama")  # conv + BatchNorm, attention, rotary


@pytest.mark.wgpu
@pytest.mark.parametrize("name", WGPU_FAMILIES)
def test_family_trains_on_wgpu(name, reference, exported, tmp_path, wgpu_device):
    """The same run on wgpu (lavapipe in CI), through load_state_dict by PyTorch names."""
    family = FAMILIES[name]
    _, path = exported(name, family.file_exporter)
    model, extra = load_by_names(family, path, tmp_path)
    check_route(model, family, reference(name), wgpu_device, extra)


# The torch:cpu backend on the wgpu subset's kinds of model; its expected failures, with reasons
# (strict, as for wgpu: an entry whose case passes must go).
TORCH_FAMILIES = ("torchvision-mobilenet_v3", "timm-vit", "hf-llama")
TORCH_XFAIL: dict[str, str] = {}


@pytest.fixture
def numpy_run(reference, exported, tmp_path_factory):
    """family -> anygrad's Run on the numpy backend through load_state_dict; in a full run the
    cpu case above has made it already."""
    def get(name: str):
        if name not in _numpy_runs:
            family = FAMILIES[name]
            _, path = exported(name, family.file_exporter)
            model, extra = load_by_names(family, path, tmp_path_factory.mktemp(f"{name}-numpy"))
            _numpy_runs[name] = check_route(model, family, reference(name), "cpu", extra)
        return _numpy_runs[name]
    return get


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=TORCH_XFAIL[n])]
                                               if n in TORCH_XFAIL else []) for n in TORCH_FAMILIES])
def test_family_trains_on_torch_cpu(name, reference, exported, numpy_run, tmp_path, one_torch_thread):
    """The same run on torch:cpu, against PyTorch (as every route) and against numpy's run."""
    family = FAMILIES[name]
    _, path = exported(name, family.file_exporter)
    model, extra = load_by_names(family, path, tmp_path)
    ours, oracle = check_route(model, family, reference(name), "torch:cpu", extra), numpy_run(name)
    scale = max(1.0, float(np.abs(oracle.output).max()))
    np.testing.assert_allclose(ours.output, oracle.output, rtol=1e-4, atol=1e-5 * scale, err_msg="eval output")
    for key, want in oracle.stepped.items():
        if want.dtype.kind in "biu":
            np.testing.assert_array_equal(ours.stepped[key], want, err_msg=key)
        else:
            tol = 1e-5 * max(1.0, float(np.abs(want).max(initial=0.0)))
            np.testing.assert_allclose(ours.stepped[key], want, rtol=1e-4, atol=tol, err_msg=f"{key} after one step")
    np.testing.assert_allclose(ours.losses, oracle.losses, rtol=2e-5, err_msg="losses")


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
