"""The model zoo trains: every family, exported by both PyTorch exporters in training mode,
reproduces PyTorch's loss over eight SGD steps from the same weights, on cpu and on wgpu."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from zoo_harness import EXPORTERS, STEPS, anygrad_trajectory, torch_predict
from zoo_models import FAMILIES

import anygrad

RTOL = {"cpu": 1e-4, "wgpu": 3e-4}

# (family, exporter, device) -> the missing op or kernel that keeps it from passing. The mark is
# strict: once the op lands the case XPASSes, which fails, and its entry must go.
MISSING: dict[tuple[str, str, str], str] = {}


def _cases():
    for family in FAMILIES:
        for exporter in EXPORTERS:
            for device in RTOL:
                marks = [pytest.mark.wgpu] if device == "wgpu" else []
                reason = MISSING.get((family, exporter, device))
                if reason:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                yield pytest.param(family, exporter, device, marks=marks, id=f"{family}-{exporter}-{device}")


@pytest.mark.slow
@pytest.mark.parametrize("family,exporter,device", list(_cases()))
def test_zoo_trains_like_pytorch(family, exporter, device, zoo_export, zoo_reference, request):
    """Eight SGD steps give PyTorch's losses; then predict (inference mode: BatchNorm on the
    updated running statistics) gives the trained PyTorch model's eval() output."""
    path, _ = zoo_export(family, exporter)
    backend = request.getfixturevalue("wgpu_device") if device == "wgpu" else device
    ours, theirs = anygrad_trajectory(FAMILIES[family], path, backend), zoo_reference(family)
    assert ours.losses.shape == (STEPS,) and np.all(np.isfinite(theirs.losses))
    assert not np.allclose(theirs.losses, theirs.losses[0], rtol=1e-3), "the reference should move"
    np.testing.assert_allclose(ours.losses, theirs.losses, rtol=RTOL[device])
    x = FAMILIES[family].batches(1, seed=7)[0][0]
    want = torch_predict(theirs.model, x)
    got = ours.model.predict(x)
    assert got.shape == want.shape
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err <= 10 * RTOL[device] * scale, f"predict differs by {err:.3g} (output scale {scale:.3g})"


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_zoo_export_is_the_family(family, exporter, zoo_export):
    """The file holds what makes the family (ConvTranspose, LSTM, Trilu, ...) and exactly the
    PyTorch model's parameters: a tied embedding stays one parameter, nothing is folded away."""
    path, net = zoo_export(family, exporter)
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert FAMILIES[family].ops <= ops, f"missing {sorted(FAMILIES[family].ops - ops)}"
    assert anygrad.load_onnx(path).num_parameters() == sum(p.numel() for p in net.parameters())
