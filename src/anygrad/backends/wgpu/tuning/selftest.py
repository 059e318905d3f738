"""A float16 self-test, run once per device before the first f16 program (mixed precision).

Some drivers get f16 storage or arithmetic wrong in ways that validation never sees
(llama.cpp #25748: f16 tiling corruption on Intel Xe-LPG). Before training in f16, a small
matmul and a small convolution with float16 operands run on the device and on the numpy
backend, which computes each op in float32 and rounds (the same semantics); an adapter whose
results disagree (or that fails to build the kernels) trains in float32 instead, and says so.

Then the same ops with f16 products (kernels_gemm.half_math: each K tile's products summed in
f16): these differ from float32 math by f16 rounding of the products and partial sums, so they
are held to the error bound of that summation, (KT + 1) * u * sum(|a_i * b_i|) per output (plus
the f16 rounding of the stored result), computed by the numpy backend on the operands' absolute
values. u is 2**-10, a whole f16 ulp, not round-to-nearest's half: WGSL's "correctly rounded"
f16 arithmetic may return either neighbour (NVIDIA's Vulkan driver rounds toward zero), and the
kernels need the bound, not one rounding mode. An adapter whose f16 arithmetic breaks it keeps
f16 storage with f32 products.

First of all, the driver's own f32 -> f16 conversion is probed (f16_rounding_problem): one
dispatch converts a table of ties, near-ties, overflows, subnormals and specials, compared bit for
bit with numpy's astype(float16) (IEEE round-to-nearest-even, inf from 65520 on), both as stored
into an f16 array and as rounded in a register (halfstore.round_half, a GEMM epilogue's rounding).
WGSL allows either neighbour and leaves overflow indeterminate. On an H200 (2026-12-02) NVIDIA's
Vulkan compiler, through wgpu-native and Dawn alike, stored f16 exactly but dropped a register
round trip f32(f16(x)): epilogues did not round, and a gradient of 131072 stayed finite, so
GradScaler skipped no step. Stores and registers are probed apart (f16_rounding_problem,
f16_register_problem); where one differs, its conversion functions become the exact ones
(halfstore.exact_conversions), so every kernel rounds as numpy and PyTorch do, and the other keeps
the driver's own, which costs nothing.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ....errors import first_line
from ....ir.builder import Builder
from ....ir.graph import Graph, TensorInfo
from ..kernels.halfstore import exact_conversions, plain_round, round_half, with_conversions

_F16, _F32 = 10, 1  # ONNX Cast codes
RTOL = 1e-2  # f16 results differ by an ulp or two (summation order); broken kernels by far more


HALF_KT = 16  # the deepest K tile the tilings sum in f16 before adding into f32
ULP = 2.0 ** -10  # an f16 operation's relative error where it may round either way (WGSL's rule)
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
    from ...numpy import NumpyBackend
    g, feeds = _graph()
    want = NumpyBackend().compile(g).run(feeds)
    try:
        got = backend.compile(g).run(feeds)
    except Exception as e:  # noqa: BLE001  (any failure to build or run them: f16 is not usable)
        return f"its float16 kernels fail ({first_line(e)})"
    for name, what in zip(g.outputs, ("matmul", "convolution")):
        err = np.abs(got[name] - want[name]) / (np.abs(want[name]) + 1.0)
        if not np.all(np.isfinite(got[name])) or float(err.max()) > RTOL:
            return f"its float16 {what} is wrong (relative error {float(np.nanmax(err)):.3g})"
    return None


def f16_math_problem(backend) -> str | None:
    """None when the device's matmul and conv with f16 products (HALF_PINS, on a backend whose caps
    allow them) stay within the f16 summation bound of the float64 result; else what went wrong."""
    from ...numpy import NumpyBackend
    g, feeds = _graph(pins=HALF_PINS)
    g_abs, feeds_abs = _graph(absolute=True)
    want = NumpyBackend().compile(g).run(feeds)
    mass = NumpyBackend().compile(g_abs).run(feeds_abs)
    try:
        exe = backend.compile(g)
        got = exe.run(feeds)
    except Exception as e:  # noqa: BLE001  (any failure to build or run them: f16 products are not usable)
        return f"its float16-product kernels fail ({first_line(e)})"
    from ..kernels.kernels_gemm import has_half_tiles
    if not any(has_half_tiles(st.kernel.name) for st in exe.plan.steps):
        return "no kernel took the f16-product tiling"
    for name, what in zip(g.outputs, ("matmul", "convolution")):
        bound = (HALF_KT + 1) * ULP * mass[name] + ULP * np.abs(want[name]) + 1e-3
        err = np.abs(got[name] - want[name])
        if not np.all(np.isfinite(got[name])) or not np.all(err <= bound):
            return f"its float16-product {what} is wrong (error {float(np.nanmax(err / bound)):.3g}x the f16 bound)"
    return None


def rounding_table() -> np.ndarray:
    """f32 values whose f16 rounding tells a driver's conversion apart: around chosen f16 values
    (subnormal, the subnormal/normal boundary, 1, the largest finite), each value, the midpoint to
    the next (a tie: exact in f32) and the f32 values either side of it; overflow to inf from
    65520 on; zeros, f32 subnormals, inf, NaN; each with both signs."""
    chosen = np.concatenate([np.arange(0, 40), np.arange(0x3fc, 0x404), np.arange(0x3bf8, 0x3c10),
                             np.arange(0x5bf0, 0x5c08), np.arange(0x7bf0, 0x7c00)]).astype(np.uint16)
    lo = chosen.view(np.float16).astype(np.float32)
    hi = (chosen + 1).view(np.float16).astype(np.float32)  # 0x7c00 past 0x7bff: inf, the next step
    hi = np.where(np.isinf(hi), np.float32(65536.0), hi)  # the midpoint to it: 65520, the threshold
    mid = ((lo.astype(np.float64) + hi) / 2).astype(np.float32)  # exact: f16 has 11 significant bits
    near = [np.nextafter(mid, np.float32(-np.inf)), np.nextafter(mid, np.float32(np.inf))]
    special = np.array([0.0, 1e-40, 2.0 ** -25, 2.0 ** -26, 3 * 2.0 ** -26, 65504.0, 65519.996, 65520.0,
                        65536.0, 1e10, 3e38, np.inf, np.nan], np.float32)
    values = np.concatenate([lo, mid, *near, special])
    return np.concatenate([values, -values]).astype(np.float32)


def _probe_shader(n: int, vec4: bool) -> str:
    """dst[i] = the driver's f16(src[i]) (vec4: four at once, vec4<f16>(...))."""
    e, f = ("vec4<f32>", "vec4<f16>") if vec4 else ("f32", "f16")
    return ("enable f16;\n"
            f"@group(0) @binding(0) var<storage, read> src: array<{e}>;\n"
            f"@group(0) @binding(1) var<storage, read_write> dst: array<{f}>;\n"
            "@compute @workgroup_size(64)\n"
            "fn main(@builtin(global_invocation_id) gid: vec3<u32>) {\n"
            f"  if (gid.x >= {n}u) {{ return; }}\n  dst[gid.x] = {f}(src[gid.x]);\n}}\n")


def convert_on_device(backend, x: np.ndarray, exact: bool = False, vec4: bool = False) -> np.ndarray:
    """x (float32) converted to float16 by one dispatch on the backend's device: the driver's own
    conversion, or (exact) the exact conversion functions of halfstore; vec4: four at a time."""
    x = np.asarray(x, np.float32).ravel()
    n = len(x)
    x = np.concatenate([x, np.zeros((-n) % 4, np.float32)])  # whole vec4s (and 4-byte f16 pairs)
    count = len(x) // 4 if vec4 else len(x)
    wgsl = _probe_shader(count, vec4)
    if exact:  # through the conversion functions, with their exact definitions
        wgsl = wgsl.replace(f"dst[gid.x] = {'vec4<f16>' if vec4 else 'f16'}(src[gid.x]);",
                            f"dst[gid.x] = {'anygrad_to_f16x4' if vec4 else 'anygrad_to_f16'}(src[gid.x]);")
        wgsl = exact_conversions(with_conversions(wgsl))
    return _dispatch(backend, wgsl, x, len(x) * 2, count).view(np.float16)[:n].copy()


def round_on_device(backend, x: np.ndarray, exact: bool = False) -> np.ndarray:
    """x (float32) rounded to the nearest float16 value and kept as float32 in a register, as a
    GEMM epilogue does (halfstore.round_half), by one dispatch: the plain or (exact) the exact
    definition. A driver that drops a conversion's round trip returns x unchanged."""
    x = np.asarray(x, np.float32).ravel()
    # the plain rounding written out, not through the conversion functions: the backend would swap
    # those for the exact ones while it probes (Backend.device_wgsl)
    wgsl = ("@group(0) @binding(0) var<storage, read> src: array<f32>;\n"
            "@group(0) @binding(1) var<storage, read_write> dst: array<f32>;\n"
            "@compute @workgroup_size(64)\n"
            "fn main(@builtin(global_invocation_id) gid: vec3<u32>) {\n"
            f"  if (gid.x >= {len(x)}u) {{ return; }}\n"
            f"  dst[gid.x] = {round_half('src[gid.x]') if exact else plain_round('src[gid.x]')};\n}}\n")
    if exact:
        wgsl = exact_conversions(with_conversions(wgsl))
    return _dispatch(backend, wgsl, x, x.nbytes, len(x)).view(np.float32).copy()


def _dispatch(backend, wgsl: str, x: np.ndarray, out_bytes: int, count: int) -> np.ndarray:
    """The bytes `dst` holds after one dispatch of the probe shader `wgsl` (src: x, count threads)."""
    usage = backend.storage_usage
    src, dst = (backend.create_buffer(x.nbytes, usage, "f16-probe:src"),
                backend.create_buffer(out_bytes, usage, "f16-probe:dst"))
    try:
        backend.upload(src, 0, x)
        pipe = backend.pipeline(wgsl, "main", (True, False), "f16-rounding-probe")
        bgl, _ = backend.layout((True, False))
        group = backend.device.create_bind_group(layout=bgl, entries=[
            {"binding": 0, "resource": {"buffer": src, "offset": 0, "size": x.nbytes}},
            {"binding": 1, "resource": {"buffer": dst, "offset": 0, "size": out_bytes}}])
        enc = backend.device.create_command_encoder()
        cpass = enc.begin_compute_pass()
        cpass.set_pipeline(pipe)
        cpass.set_bind_group(0, group)
        cpass.dispatch_workgroups(-(-count // 64), 1, 1)
        cpass.end()
        backend.device.queue.submit([enc.finish()])
        return backend.read(dst, out_bytes)
    finally:
        src.destroy()
        dst.destroy()


def mismatches(got: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Indices where got (float16) is not numpy's x.astype(float16) bit for bit (any NaN for NaN)."""
    with np.errstate(over="ignore"):  # overflow to inf is the point
        want = np.asarray(x, np.float32).astype(np.float16)
    same = (got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(got) & np.isnan(want))
    return np.flatnonzero(~same)


def f16_rounding_problem(backend) -> str:
    """'' when the device's own f32 -> f16 conversion into an f16 array (scalar and vec4) gives
    numpy's float16 for every value of rounding_table(); else the first value it gets wrong."""
    x = rounding_table()
    return _first_wrong(x, [("", lambda: convert_on_device(backend, x)),
                            (" (vec4)", lambda: convert_on_device(backend, x, vec4=True))],
                        lambda got: mismatches(got, x))


def f16_register_problem(backend) -> str:
    """'' when the device's own rounding of a value to f16 in a register (halfstore.round_half's
    plain form) gives numpy's float16, as f32, for every value of rounding_table(); else the first
    value it gets wrong (NVIDIA's compiler drops the round trip: the value comes back as it was)."""
    x = rounding_table()
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    return _first_wrong(x, [(" held in a register", lambda: round_on_device(backend, x))],
                        lambda got: np.flatnonzero((got.view(np.uint32) != want.view(np.uint32))
                                                   & ~(np.isnan(got) & np.isnan(want))))


def _first_wrong(x: np.ndarray, probes: list, wrong: Callable[[np.ndarray], np.ndarray]) -> str:
    for what, probe in probes:
        try:
            got = probe()
        except Exception as e:  # noqa: BLE001  (no usable probe: the exact conversion is the safe side)
            return f"its f16 conversion probe fails ({first_line(e)})"
        bad = wrong(got)
        if len(bad):
            k = bad[0]
            with np.errstate(over="ignore"):
                want = float(x[k].astype(np.float16))
            return (f"its f32 -> f16 conversion{what} gives {float(got[k])!r} for "
                    f"{float(x[k])!r}, not {want!r} ({len(bad)} of {len(x)} values differ)")
    return ""


__all__ = ["convert_on_device", "f16_math_problem", "f16_problem", "f16_register_problem", "f16_rounding_problem",
           "mismatches", "round_on_device", "rounding_table"]
