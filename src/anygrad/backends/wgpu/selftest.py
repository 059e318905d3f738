"""A float16 self-test, run once per device before the first f16 program (mixed precision).

Some drivers get f16 storage or arithmetic wrong in ways that validation never sees
(llama.cpp #25748: f16 tiling corruption on Intel Xe-LPG). Before training in f16, a small
matmul and a small convolution with float16 operands run on the device and on the numpy
backend, which computes each op in float32 and rounds (the same semantics); an adapter whose
results disagree (or that fails to build the kernels) trains in float32 instead, and says so.

Then the same ops with f16 products (kernels_gemm.half_math: each K tile's products summed in
f16): these differ from float32 math by f16 rounding of the partial sums, so they are held to the
error bound of that summation, KT * 2**-11 * sum(|a_i * b_i|) per output (plus the f16 rounding
of the stored result), computed by the numpy backend on the operands' absolute values. An adapter
whose f16 arithmetic breaks it keeps f16 storage with f32 products.
"""
from __future__ import annotations

import numpy as np

from ...ir.builder import Builder
from ...ir.graph import Graph, TensorInfo

_F16, _F32 = 10, 1  # ONNX Cast codes
RTOL = 1e-2  # f16 results differ by an ulp or two (summation order); broken kernels by far more


HALF_KT = 16  # the deepest K tile the tilings sum in f16 before adding into f32
HALF_PINS = {"_gemm_variant": "shared", "_gemm_half": 1, "_gemm_kt": HALF_KT}


def _graph(absolute: bool = False, pins: dict | None = None) -> tuple[Graph, dict[str, np.ndarray]]:
    """x -> f16 -> MatMul(w) and Conv(k) -> f32: shapes that take the tiled GEMM and conv paths.
    absolute: every operand's absolute value (for the summation bound); pins: on both GEMM nodes."""
    rng = np.random.default_rng(0)
    g = Graph(name="f16-selftest")
    feeds = {"a": rng.standard_normal((70, 64)).astype(np.float32),
             "img": rng.standard_normal((2, 8, 10, 10)).astype(np.float32)}
    if absolute:
        feeds = {k: np.abs(v) for k, v in feeds.items()}
    for name, value in feeds.items():
        g.inputs.append(name)
        g.info[name] = TensorInfo(np.dtype(np.float32), value.shape)
    b = Builder(g, prefix="selftest")
    w = rng.standard_normal((64, 36)).astype(np.float16)
    k = (rng.standard_normal((16, 8, 3, 3)) * 0.3).astype(np.float16)
    w, k = (np.abs(w), np.abs(k)) if absolute else (w, k)
    w, k = b.const(w, np.float16, "w"), b.const(k, np.float16, "k")
    mm = b.op("MatMul", [b.op("Cast", ["a"], to=_F16), w])
    conv = b.op("Conv", [b.op("Cast", ["img"], to=_F16), k], pads=[1, 1, 1, 1], strides=[1, 1],
                dilations=[1, 1], group=1, kernel_shape=[3, 3])
    g.outputs = [b.op("Cast", [mm], to=_F32), b.op("Cast", [conv], to=_F32)]
    for node in g.nodes:
        if node.op in ("MatMul", "Conv"):
            node.attrs.update(pins or {})
    return g, feeds


def f16_problem(backend) -> str | None:
    """None when the device's float16 matmul and conv agree with the numpy backend's; else what
    went wrong, in words."""
    from ..numpy import NumpyBackend
    g, feeds = _graph()
    want = NumpyBackend().compile(g).run(feeds)
    try:
        got = backend.compile(g).run(feeds)
    except Exception as e:  # noqa: BLE001  (any failure to build or run them: f16 is not usable)
        return f"its float16 kernels fail ({str(e).strip().splitlines()[0][:200]})"
    for name, what in zip(g.outputs, ("matmul", "convolution")):
        err = np.abs(got[name] - want[name]) / (np.abs(want[name]) + 1.0)
        if not np.all(np.isfinite(got[name])) or float(err.max()) > RTOL:
            return f"its float16 {what} is wrong (relative error {float(np.nanmax(err)):.3g})"
    return None


def f16_math_problem(backend) -> str | None:
    """None when the device's matmul and conv with f16 products (HALF_PINS, on a backend whose caps
    allow them) stay within the f16 summation bound of the float64 result; else what went wrong."""
    from ..numpy import NumpyBackend
    g, feeds = _graph(pins=HALF_PINS)
    g_abs, feeds_abs = _graph(absolute=True)
    want = NumpyBackend().compile(g).run(feeds)
    mass = NumpyBackend().compile(g_abs).run(feeds_abs)
    try:
        exe = backend.compile(g)
        got = exe.run(feeds)
    except Exception as e:  # noqa: BLE001  (any failure to build or run them: f16 products are not usable)
        return f"its float16-product kernels fail ({str(e).strip().splitlines()[0][:200]})"
    from .kernels_gemm import has_half_tiles
    if not any(has_half_tiles(st.kernel.name) for st in exe.plan.steps):
        return "no kernel took the f16-product tiling"
    for name, what in zip(g.outputs, ("matmul", "convolution")):
        bound = HALF_KT * 2.0 ** -11 * mass[name] + 2.0 ** -10 * np.abs(want[name]) + 1e-3
        err = np.abs(got[name] - want[name])
        if not np.all(np.isfinite(got[name])) or not np.all(err <= bound):
            return f"its float16-product {what} is wrong (error {float(np.nanmax(err / bound)):.3g}x the f16 bound)"
    return None


__all__ = ["f16_math_problem", "f16_problem"]
