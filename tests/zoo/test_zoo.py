"""The model zoo trains: every family, exported by both PyTorch exporters in training mode,
reproduces PyTorch's loss over eight SGD steps from the same weights, on cpu and on wgpu; and on
torch:cpu (the PyTorch backend), checked against PyTorch and against the numpy backend's own run
of the same file (one exporter: the backend runs the same graph whichever exporter wrote it)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from zoo_harness import EXPORTERS, STEPS, anygrad_trajectory, torch_predict
from zoo_models import FAMILIES

import anygrad

RTOL = {"cpu": 1e-4, "wgpu": 3e-4, "torch:cpu": 1e-4}
# torch:cpu against the numpy backend: the same graph, float32 kernels that round differently.
TORCH_VS_NUMPY_RTOL = 2e-5
# torch:cpu runs one exporter's file of every family: the numpy run of that file is shared with the
# cpu case, and the backend runs the same graph whichever exporter wrote it. (All eight add ~3 s
# on a 2-core machine, with torch on one thread: see the one_torch_thread fixture.)
TORCH_EXPORTERS = ("torchscript",)

# (family, exporter, device) -> the missing op or kernel that keeps it from passing. The mark is
# strict: once the op lands the case XPASSes, which fails, and its entry must go.
MISSING: dict[tuple[str, str, str], str] = {}
# The same for torch:cpu (a family that cannot pass there yet, and why), as for wgpu.
MISSING_TORCH: dict[tuple[str, str], str] = {}


def _cases():
    for family in FAMILIES:
        for exporter in EXPORTERS:
            for device in RTOL:
                if device == "torch:cpu" and exporter not in TORCH_EXPORTERS:
                    continue
                marks = [pytest.mark.wgpu] if device == "wgpu" else []
                reason = MISSING.get((family, exporter, device)) or (
                    MISSING_TORCH.get((family, exporter)) if device == "torch:cpu" else None)
                if reason:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                yield pytest.param(family, exporter, device, marks=marks, id=f"{family}-{exporter}-{device}")


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,device", list(_cases()))
def test_zoo_trains_like_pytorch(family, exporter, device, zoo_export, zoo_reference, zoo_numpy, request):
    """Eight SGD steps give PyTorch's losses; then predict (inference mode: BatchNorm on the
    updated running statistics) gives the trained PyTorch model's eval() output. On torch:cpu,
    also the numpy backend's losses and predictions, to float32 noise."""
    path, _ = zoo_export(family, exporter)
    backend = request.getfixturevalue("wgpu_device") if device == "wgpu" else device
    if device == "cpu":
        ours = zoo_numpy(family, exporter)
    elif device == "torch:cpu":
        request.getfixturevalue("one_torch_thread")
        ours = anygrad_trajectory(FAMILIES[family], path, backend)
    else:
        ours = anygrad_trajectory(FAMILIES[family], path, backend)
    theirs = zoo_reference(family)
    assert ours.losses.shape == (STEPS,) and np.all(np.isfinite(theirs.losses))
    assert not np.allclose(theirs.losses, theirs.losses[0], rtol=1e-3), "the reference should move"
    np.testing.assert_allclose(ours.losses, theirs.losses, rtol=RTOL[device])
    x = FAMILIES[family].batches(1, seed=7)[0][0]
    want = torch_predict(theirs.model, x)
    got = ours.model.predict(x)
    assert got.shape == want.shape
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err <= 10 * RTOL[device] * scale, f"predict differs by {err:.3g} (output scale {scale:.3g})"
    if device == "torch:cpu":
        oracle = zoo_numpy(family, exporter)
        np.testing.assert_allclose(ours.losses, oracle.losses, rtol=TORCH_VS_NUMPY_RTOL)
        np.testing.assert_allclose(got, oracle.model.predict(x), rtol=1e-4, atol=1e-5 * max(scale, 1.0))


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_zoo_export_is_the_family(family, exporter, zoo_export):
    """The file holds what makes the family (ConvTranspose, LSTM, Trilu, ...) and exactly the
    PyTorch model's parameters: a tied embedding stays one parameter, nothing is folded away."""
    path, net = zoo_export(family, exporter)
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert FAMILIES[family].ops <= ops, f"missing {sorted(FAMILIES[family].ops - ops)}"
    assert anygrad.load_onnx(path).num_parameters() == sum(p.numel() for p in net.parameters())
