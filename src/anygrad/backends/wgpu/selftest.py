"""A float16 self-test, run once per device before the first f16 program (mixed precision).

Some drivers get f16 storage or arithmetic wrong in ways that validation never sees
(llama.cpp #25748: f16 tiling corruption on Intel Xe-LPG). Before training in f16, a small
matmul and a small convolution with float16 operands run on the device and on the numpy
backend, which computes each op in float32 and rounds (the same semantics); an adapter whose
results disagree (or that fails to build the kernels) trains in float32 instead, and says so.
"""
from __future__ import annotations

import numpy as np

from ...ir.builder import Builder
from ...ir.graph import Graph, TensorInfo

_F16, _F32 = 10, 1  # ONNX Cast codes
RTOL = 1e-2  # f16 results differ by an ulp or two (summation order); broken kernels by far more


def _graph() -> tuple[Graph, dict[str, np.ndarray]]:
    """x -> f16 -> MatMul(w) and Conv(k) -> f32: shapes that take the tiled GEMM and conv paths."""
    rng = np.random.default_rng(0)
    g = Graph(name="f16-selftest")
    feeds = {"a": rng.standard_normal((70, 64)).astype(np.float32),
             "img": rng.standard_normal((2, 8, 10, 10)).astype(np.float32)}
    for name, value in feeds.items():
        g.inputs.append(name)
        g.info[name] = TensorInfo(np.dtype(np.float32), value.shape)
    b = Builder(g, prefix="selftest")
    w = b.const(rng.standard_normal((64, 36)).astype(np.float16), np.float16, "w")
    k = b.const((rng.standard_normal((16, 8, 3, 3)) * 0.3).astype(np.float16), np.float16, "k")
    mm = b.op("MatMul", [b.op("Cast", ["a"], to=_F16), w])
    conv = b.op("Conv", [b.op("Cast", ["img"], to=_F16), k], pads=[1, 1, 1, 1], strides=[1, 1],
                dilations=[1, 1], group=1, kernel_shape=[3, 3])
    g.outputs = [b.op("Cast", [mm], to=_F32), b.op("Cast", [conv], to=_F32)]
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


__all__ = ["f16_problem"]
