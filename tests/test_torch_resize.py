"""Resize / Upsample and ResizeGrad on the torch backend (torch:cpu) against the numpy backend:
every interpolation mode, nearest rounding and coordinate transform, up and down, scales and
sizes, forward and gradient, all on torch kernels (no fallback to the reference)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from test_torch_backend import _agrees_with_numpy, _Const, _train_program, one_torch_thread  # noqa: F401

import anygrad
from anygrad.backends.numpy import NumpyBackend
from anygrad.backends.torch import TorchBackend

X4 = np.random.default_rng(0).standard_normal((2, 3, 5, 6)).astype(np.float32)
X3 = np.random.default_rng(1).standard_normal((2, 4, 7)).astype(np.float32)
UP, DOWN = [1.0, 1.0, 2.0, 1.5], [1.0, 1.0, 0.6, 0.5]
NONE = None  # an absent optional input


def _resize(x, *, roi=None, scales=None, sizes=None, **attrs):
    """Resize-13+ inputs (X, roi, scales, sizes), constants; trailing absent ones dropped."""
    ins = [x, None if roi is None else _Const(np.asarray(roi, np.float32)),
           None if scales is None else _Const(np.asarray(scales, np.float32)),
           None if sizes is None else _Const(np.asarray(sizes, np.int64))]
    while ins[-1] is None:
        ins.pop()
    float_in = np.asarray(x).dtype.kind == "f"
    return _agrees_with_numpy("Resize", ins, attrs, diff=(0,) if float_in else (),
                              lowered=("Resize", "ResizeGrad") if float_in else ("Resize",))


@pytest.mark.parametrize("scales", [UP, DOWN], ids=["up", "down"])
@pytest.mark.parametrize("coordinates", ["half_pixel", "asymmetric", "align_corners", "tf_half_pixel_for_nn"])
@pytest.mark.parametrize("nearest", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
def test_nearest(nearest, coordinates, scales):
    _resize(X4, scales=scales, mode="nearest", nearest_mode=nearest, coordinate_transformation_mode=coordinates)


COORDS = ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel", "half_pixel_symmetric"]


@pytest.mark.parametrize("scales", [UP, DOWN], ids=["up", "down"])
@pytest.mark.parametrize("coordinates", COORDS)
@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_linear_and_cubic(mode, coordinates, scales):
    _resize(X4, scales=scales, mode=mode, coordinate_transformation_mode=coordinates)


@pytest.mark.parametrize("scales", [UP, DOWN], ids=["up", "down"])
def test_cubic_coefficient_and_exclude_outside(scales):
    _resize(X4, scales=scales, mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_antialias_downsampling(mode):
    _resize(X4, sizes=[2, 3, 3, 2], mode=mode, antialias=1)


@pytest.mark.parametrize("sizes", [[2, 3, 9, 4], [2, 3, 3, 11], [1, 2, 5, 6]], ids=["mixed", "mixed2", "batch"])
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_sizes(mode, sizes):
    """Sizes instead of scales, resizing N and C too (any axis, not only the spatial ones)."""
    _resize(X4, sizes=sizes, mode=mode)


@pytest.mark.parametrize("policy", ["not_larger", "not_smaller"])
def test_sizes_keep_aspect_ratio_with_axes(policy):
    _resize(X4, sizes=[8, 9], mode="linear", axes=[2, 3], keep_aspect_ratio_policy=policy)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("box", [[0, 0, 0.2, 0.1, 1, 1, 0.9, 1.3], [0, 0, -0.3, 0.4, 1, 1, 1.2, 0.8]],
                         ids=["inside", "beyond"])
def test_tf_crop_and_resize(mode, box):
    """A roi partly outside the input: those outputs take extrapolation_value (and no gradient)."""
    _resize(X4, roi=box, sizes=[2, 3, 4, 7], mode=mode, coordinate_transformation_mode="tf_crop_and_resize",
            extrapolation_value=-2.5)


def test_tf_crop_and_resize_with_axes_and_scales():
    _resize(X4, roi=[0.1, -0.2, 0.8, 1.1], scales=[1.6, 1.5], axes=[2, 3], mode="linear",
            coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=7.0)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("scales", [[1.0, 2.0, 1.5], [1.0, 0.5, 0.6], [1.0, 1.0, 3.0]], ids=["up", "down", "last"])
def test_three_dimensional(mode, scales):
    _resize(X3, scales=scales, mode=mode)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_float64(mode):
    _resize(X4.astype(np.float64), scales=UP, mode=mode)


def test_unchanged_shape_is_a_copy():
    """Scales of 1 everywhere (every matrix the identity): the input as it is."""
    _agrees_with_numpy("Resize", [X4, None, _Const(np.ones(4, np.float32))], {"mode": "linear"})


def test_resize_10_and_upsample():
    """Opset <= 10 forms: (X, scales) with asymmetric coordinates and the 'simple' nearest rounding;
    Upsample-7 with scales as an attribute and 'bilinear' spelt as such, Upsample-9 as an input."""
    s = _Const(np.array(UP, np.float32))
    _agrees_with_numpy("Resize", [X4, s], {"mode": "nearest"}, lowered=("ResizeGrad",))
    _agrees_with_numpy("Resize", [X4, _Const(np.array(DOWN, np.float32))], {"mode": "linear"})
    _agrees_with_numpy("Upsample", [X4], {"mode": "bilinear", "scales": [1.0, 1.0, 2.0, 2.0]},
                       lowered=("ResizeGrad",))
    _agrees_with_numpy("Upsample", [X4, s], {"mode": "nearest"})


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_])
@pytest.mark.parametrize("coordinates", ["half_pixel", "tf_crop_and_resize"])
def test_nearest_integers_are_a_gather(dtype, coordinates):
    """Integers (and bools) in nearest mode: each output one input element, exactly; outside a
    crop box the extrapolation value cast as numpy casts it (7.9 -> 7)."""
    x = np.random.default_rng(2).integers(0, 200, X4.shape).astype(dtype)
    roi = [0, 0, -0.2, 0.1, 1, 1, 1.1, 1.3] if coordinates == "tf_crop_and_resize" else None
    _resize(x, roi=roi, sizes=[2, 3, 8, 4], mode="nearest", coordinate_transformation_mode=coordinates,
            extrapolation_value=7.9)


def _fallbacks(op: str, inputs: list, attrs: dict) -> list[str]:
    from test_torch_backend import _op_and_grads
    graph, feeds = _op_and_grads(op, inputs, attrs, diff=())
    exe = TorchBackend("torch:cpu").compile(graph)
    ours, ref = exe.run(feeds), NumpyBackend().compile(graph).run(feeds)
    np.testing.assert_array_equal(ours["out0"], ref["out0"])
    return exe.fallback_ops


def test_declines_interpolating_integers_and_runtime_roi():
    """Linear mode on integers (the reference rounds a float64 sum) and a roi fed at run time
    (the matrices are built when the graph is compiled) run on the reference kernel."""
    x = np.arange(2 * 3 * 4 * 5, dtype=np.int32).reshape(2, 3, 4, 5)
    assert _fallbacks("Resize", [x, None, _Const(np.array(UP, np.float32))], {"mode": "linear"}) == ["Resize"]
    roi = np.array([0, 0, 0.1, 0.2, 1, 1, 0.9, 1.1], np.float32)
    assert _fallbacks("Resize", [X4, roi, _Const(np.array(UP, np.float32))],
                      {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}) == ["Resize"]


def test_float16():
    """float16: the matrices rounded to float16, as the reference's; float16 products."""
    _agrees_with_numpy("Resize", [X4.astype(np.float16), None, _Const(np.array(UP, np.float32))],
                       {"mode": "linear"}, diff=(), rtol=2e-3, atol=2e-3)


# -- end to end: an upsampling layer from PyTorch, trained -------------------------------------------
class _UpNet(torch.nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.a = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.up = torch.nn.Upsample(scale_factor=2, mode=mode)
        self.b = torch.nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        return self.b(self.up(torch.tanh(self.a(x))))


def _train_upnet(mode: str, device):
    torch.manual_seed(0)
    example = torch.zeros(2, 2, 5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = anygrad.from_torch(_UpNet(mode), example)
    model.compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.1), device=device)
    data = np.random.default_rng(3)
    losses = []
    for _ in range(3):
        x = data.standard_normal((2, 2, 5, 4)).astype(np.float32)
        y = data.standard_normal((2, 2, 10, 8)).astype(np.float32)
        losses.append(model.train_on_batch(x, y))
    return model, losses


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_torch_upsample_trains_like_numpy(mode):
    _, ref = _train_upnet(mode, "cpu")
    model, losses = _train_upnet(mode, TorchBackend("torch:cpu"))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    exe = _train_program(model)
    # only the RNG counter's uint32 increment (Add) may run on a reference kernel
    assert set(exe.fallback_ops) <= {"Add"}, exe.fallback_ops
    ops = {n.op for n in exe.graph.nodes}
    assert "Resize" in ops and "ResizeGrad" in ops, ops
