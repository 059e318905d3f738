"""2-D max pools four elements along a row per invocation (kernels_pool._lanes_fit), against numpy.

MaxPool and MaxPoolGrad's argmax take four outputs an invocation when the output width is a
multiple of 4, MaxPoolGrad's gather four inputs when the input width is; other shapes keep one
element per invocation. The maximum, the first
maximum (ties keep the earlier tap, row-major) and each element's fixed-order sum of dy are exact,
so every comparison is for equality: a different tie-break or summation order would show.
"""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import check_wgpu, wgpu_backend

pytestmark = pytest.mark.wgpu
F32 = np.float32
RNG = np.random.default_rng(11)


@pytest.fixture(scope="module")
def wb():
    return wgpu_backend()


def _ties(shape: tuple[int, ...]) -> np.ndarray:
    """Small integers as floats: most windows hold their maximum more than once."""
    return RNG.integers(-2, 3, shape).astype(F32)


def _sources(exe) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for st in exe.plan.steps:
        if st.kernel.name.startswith("MaxPool"):
            out.setdefault(st.kernel.name, []).append(st.kernel.wgsl)
    return out


def _vec(wgsl: str) -> bool:
    return "array<vec4<" in wgsl


STEM = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
CASES = [
    # (input shape, attributes, forward and argmax four-wide?, gather four-wide?)
    ((2, 3, 12, 16), STEM, True, True),                                              # ResNet stem
    ((2, 3, 11, 15), STEM, True, False),                                             # OW 8, W 15
    ((1, 2, 7, 10), STEM, False, False),                                             # OW 5, W 10
    ((2, 2, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}, True, True),
    ((1, 2, 8, 12), {"kernel_shape": [2, 2], "strides": [2, 2]}, False, True),       # OW 6
    ((1, 2, 5, 12), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, True, True),   # stride 1
    ((1, 2, 9, 16), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, True, True),
    ((1, 2, 9, 15), {**STEM, "ceil_mode": 1}, True, False),                          # OW 8
    ((1, 2, 9, 12), {"kernel_shape": [3, 3], "dilations": [2, 2], "pads": [2, 2, 2, 2]}, True, True),
    ((1, 2, 10, 16), {"kernel_shape": [2, 3], "strides": [1, 2], "dilations": [2, 1], "pads": [0, 1, 1, 1]},
     True, True),
    ((2, 3, 16), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, True, True),  # 1-D: height 1
]


@pytest.mark.parametrize("shape, attrs, fwd_vec, grad_vec", CASES)
@pytest.mark.parametrize("data", ["ties", "normal"])
def test_max_pool_and_gradient_match_numpy_exactly(wb, shape, attrs, fwd_vec, grad_vec, data):
    x = _ties(shape) if data == "ties" else RNG.standard_normal(shape).astype(F32)
    src = _sources(check_wgpu("MaxPool", [x], attrs, rtol=0, atol=0))
    assert set(src) == {"MaxPool", "MaxPoolGrad:argmax", "MaxPoolGrad:gather"}, src
    assert _vec(src["MaxPool"][0]) == fwd_vec
    assert _vec(src["MaxPoolGrad:argmax"][0]) == fwd_vec
    assert _vec(src["MaxPoolGrad:gather"][0]) == grad_vec


def test_integer_max_pool_four_wide(wb):
    """Integer pools store vec4<i32> / vec4<u32> and compare as integers."""
    x = RNG.integers(-2**31, 2**31 - 1, (2, 3, 9, 16), dtype=np.int64).astype(np.int32)
    src = _sources(check_wgpu("MaxPool", [x], STEM, feed=[0], grad=False))
    assert "array<vec4<i32>>" in src["MaxPool"][0]
    u8 = RNG.integers(0, 4, (1, 2, 6, 8)).astype(np.uint8)
    src = _sources(check_wgpu("MaxPool", [u8], {"kernel_shape": [2, 2], "strides": [1, 2]}, feed=[0],
                              grad=False))
    assert "array<vec4<u32>>" in src["MaxPool"][0]


def test_float16_values_match_numpy(wb):
    """float16 storage (halfstore.py rewrites the f32 and vec4<f32> bindings): small integers are
    exact in float16, so the four-wide kernels give numpy's maximum and gradient bit for bit."""
    x = _ties((1, 3, 12, 16)).astype(np.float16)
    exe = check_wgpu("MaxPool", [x], STEM, rtol=0, atol=0)
    assert any("vec4<f16>" in s for srcs in _sources(exe).values() for s in srcs)
