"""f32 -> f16 conversions as numpy's astype(float16) does them: round to nearest, ties to even,
inf from 65520 on, NaN kept (halfstore.py's conversion functions, selftest.f16_rounding_problem).

WGSL lets a driver round either way and leaves overflow indeterminate. NVIDIA's Vulkan compiler
(H200, 2026-12-02, wgpu-native and Dawn alike) stores f16 exactly but drops the round trip of a
value rounded in a register, which hid overflowing f16 gradients from GradScaler. The exact
conversion (integer arithmetic on the f32 bits) is checked here against numpy over every f16
value, every tie between neighbours and the f32 values either side of it, forced on for the
adapter under test (lavapipe's own conversion is already IEEE).
"""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import make_graph, run_both, wgpu_backend

from anygrad.backends.wgpu.kernels import halfstore
from anygrad.backends.wgpu.tuning import selftest
from anygrad.ir import Node

pytestmark = pytest.mark.wgpu


def _rtz(x: np.ndarray) -> np.ndarray:
    """float16 rounded toward zero, 65504 for overflow: a conversion WGSL allows a driver."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore"):
        near = x.astype(np.float16)
    back = near.astype(np.float32)
    away = (np.abs(back) > np.abs(x)) & np.isfinite(x)
    step = np.where(near.view(np.uint16) & 0x7fff, 1, 0).astype(np.uint16)
    out = np.where(away, (near.view(np.uint16) - step).view(np.float16), near)
    return np.where(np.isinf(out) & np.isfinite(x), np.copysign(np.float16(65504), x), out).astype(np.float16)


def _exhaustive() -> np.ndarray:
    """Every finite f16 value, each midpoint to the next (a tie) and the f32 values either side
    of it, f32 values past the overflow threshold and random f32 bit patterns; both signs."""
    bits = np.arange(0, 0x7c00, dtype=np.uint32).astype(np.uint16)
    lo = bits.view(np.float16).astype(np.float64)
    hi = (bits + 1).view(np.float16).astype(np.float64)
    hi[-1] = 65536.0  # past 65504: where inf starts, the midpoint is the threshold 65520
    mid = ((lo + hi) / 2).astype(np.float32)
    down, up = np.nextafter(mid, np.float32(-np.inf)), np.nextafter(mid, np.float32(np.inf))
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 2 ** 31, 60_000, dtype=np.uint32).view(np.float32)  # NaNs and infs among them
    tiny = rng.integers(0, 0x3a000000, 20_000, dtype=np.uint32).view(np.float32)  # f32 values below 2^-11
    big = np.float32([65519.0, 65519.996, 65520.0, 65520.004, 65535.0, 65536.0, 1e30, np.inf, np.nan])
    values = np.concatenate([lo.astype(np.float32), mid, down, up, noise, tiny, big, np.float32([0.0, 1e-45, 2.0 ** -25])])
    return np.concatenate([values, -values]).astype(np.float32)


@pytest.fixture(scope="module")
def backend():
    return wgpu_backend()


def _check(b, x, exact, vec4):
    got = selftest.convert_on_device(b, x, exact=exact, vec4=vec4)
    bad = selftest.mismatches(got, x)
    with np.errstate(over="ignore"):
        shown = [(float(x[k]), float(got[k]), float(x[k].astype(np.float16))) for k in bad[:8]]
    assert not len(bad), f"{len(bad)} of {len(x)} conversions differ from numpy (x, got, want): {shown}"


@pytest.mark.parametrize("vec4", [False, True], ids=["scalar", "vec4"])
def test_the_exact_conversion_rounds_every_tie_to_even_like_numpy(backend, vec4):
    _check(backend, _exhaustive(), exact=True, vec4=vec4)


def test_the_probe_table_tells_round_toward_zero_from_ieee():
    """Ties and overflow are in the probe's table: a round-toward-zero driver differs on them."""
    x = selftest.rounding_table()
    assert {65520.0, 65504.0, np.inf}.issubset(set(x.tolist())) and np.isnan(x).any()
    bad = selftest.mismatches(_rtz(x), x)
    assert len(bad) > len(x) // 8  # every tie that rounds up, every value above a midpoint, overflow
    assert 65520.0 in x[bad].tolist()


def test_the_probe_reports_a_driver_that_rounds_toward_zero(backend, monkeypatch):
    monkeypatch.setattr(selftest, "convert_on_device", lambda b, x, exact=False, vec4=False: _rtz(x))
    problem = selftest.f16_rounding_problem(backend)
    assert "f32 -> f16 conversion gives" in problem and "values differ" in problem, problem


def test_the_adapters_own_conversion_passes_the_probe_on_lavapipe(backend):
    """lavapipe converts as IEEE does: its kernels keep the plain (driver) conversion."""
    if "llvmpipe" not in backend.adapter.summary:
        pytest.skip("the driver's own rounding is what this probes; only lavapipe's is known here")
    assert selftest.f16_rounding_problem(backend) == ""
    _check(backend, _exhaustive(), exact=False, vec4=False)
    _check_register(backend, _exhaustive(), exact=False)


def _check_register(b, x, exact):
    got = selftest.round_on_device(b, x, exact=exact)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)
    assert not len(bad), f"{len(bad)} of {len(x)} differ (x, got, want): {[(x[k], got[k], want[k]) for k in bad[:8]]}"


@pytest.mark.parametrize("mode", ["device", "exact"])
def test_a_value_rounded_in_a_register_is_numpys_float16(backend, mode):
    """halfstore.round_half (a GEMM epilogue's f16 rounding, kept in f32): every tie to even, inf
    from 65520 on, with the definition this device's kernels get (the plain one where the probe
    passed; NVIDIA's compiler drops its round trip, so there the exact one) and the exact one."""
    _check_register(backend, _exhaustive(), exact=mode == "exact" or bool(selftest.f16_register_problem(backend)))


def test_the_register_probe_runs_the_drivers_own_rounding_while_the_backend_probes(backend, monkeypatch):
    """While it probes, the backend swaps any shader's conversion functions for the exact ones
    (ctx.f16_rounding is then '(being probed)'): the plain probe must not go through them, or it
    tests the exact rounding and passes on the H200 driver that drops the plain one."""
    monkeypatch.setattr(backend.ctx, "f16_rounding", "(being probed)")
    shaders = []
    real = selftest._dispatch
    monkeypatch.setattr(selftest, "_dispatch", lambda b, wgsl, *a: shaders.append(b.device_wgsl(wgsl)) or real(b, wgsl, *a))
    selftest.round_on_device(backend, np.float32([1.0, 70000.0]))
    (wgsl,) = shaders
    assert halfstore.plain_round("src[gid.x]") in wgsl and halfstore.ROUND_HALF not in wgsl


def test_the_probe_reports_a_driver_that_drops_the_register_round_trip(backend, monkeypatch):
    """What the H200's Vulkan compiler did with f32(f16(x)): the value came back unrounded."""
    monkeypatch.setattr(selftest, "round_on_device", lambda b, x, exact=False: np.asarray(x, np.float32))
    problem = selftest.f16_register_problem(backend)
    assert "held in a register gives" in problem and "values differ" in problem, problem
    monkeypatch.setattr(backend.ctx, "f16_rounding", None)  # probed again: only the register functions change
    monkeypatch.setattr(backend.ctx, "f16_register", None)
    plain = halfstore.with_conversions("fn main() { let y = anygrad_to_f16(1.0); let z = anygrad_round_f16(1.0); }\n")
    got = backend.device_wgsl(plain)
    assert got == halfstore.exact_conversions(plain, stores=bool(backend.ctx.f16_rounding), registers=True)
    if backend.ctx.f16_rounding == "":  # lavapipe: its stores keep the driver's conversion
        assert "return f16(anygrad_x);" in got and "fn anygrad_round_f16(anygrad_x: f32) -> f32 {\n" in got


def test_the_exact_functions_replace_the_plain_ones_in_every_kernel():
    wgsl = halfstore.with_conversions("fn main() { let y = anygrad_to_f16(1.0); }\n")
    assert halfstore.plain_conversions(wgsl) and wgsl.startswith("enable f16;")
    exact = halfstore.exact_conversions(wgsl)
    assert not halfstore.plain_conversions(exact) and "unpack2x16float" in exact
    assert exact.count("fn anygrad_to_f16(") == 1 and exact.count("fn anygrad_to_f16x4(") == 1
    assert exact.count(f"fn {halfstore.ROUND_HALF}(") == 1
    stores = halfstore.exact_conversions(wgsl, registers=False)  # each block on its own
    registers = halfstore.exact_conversions(wgsl, stores=False)
    assert "return f16(anygrad_x);" not in stores and halfstore.plain_round("anygrad_x") in stores
    assert "return f16(anygrad_x);" in registers and halfstore.plain_round("anygrad_x") not in registers
    assert halfstore.exact_conversions(exact) == exact


def _cast_graph(n: int):
    """f32 x -> f16 (Cast, stored as f16) -> * 2 (in f16) -> f32: stores of ties and overflows."""
    nodes = [Node("Cast", ["x"], ["h"], {"to": 10}), Node("Add", ["h", "h"], ["h2"]),
             Node("Cast", ["h2"], ["y"], {"to": 1}), Node("Cast", ["h"], ["z"], {"to": 1})]
    info = {"x": (np.float32, (n,)), "h": (np.float16, (n,)), "h2": (np.float16, (n,)),
            "y": (np.float32, (n,)), "z": (np.float32, (n,))}
    return make_graph(nodes, ["x"], ["y", "z"], info)


@pytest.mark.parametrize("mode", ["driver", "exact"])
def test_f16_kernels_round_and_overflow_like_numpy(backend, monkeypatch, mode):
    """Kernels storing f16 values (halfstore's rewritten stores), with the device's conversion as
    probed and with the exact one forced: bit for bit numpy's, inf where |x| >= 65520 (what
    GradScaler's found-inf check needs), both for the stored cast and for a sum that overflows.
    Unfused: a fused elementwise chain keeps its float16 values in between in f32 registers
    (tests/test_wgpu_ew_vec.py), rounding only what it stores."""
    if mode == "exact":
        monkeypatch.setattr(backend.ctx, "f16_rounding", "(forced by the test)")
    x = selftest.rounding_table()
    x = x[np.isfinite(x) & (np.abs(x) < 1e5)]
    x = np.concatenate([x, np.float32([40000.0, -40000.0, 32000.0, 70000.0])])
    want, got, _ = run_both(_cast_graph(len(x)), {"x": x}, fuse=False)
    for name in ("y", "z"):
        w, g = np.asarray(want[name]), np.asarray(got[name])
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32), err_msg=name)
    assert np.isinf(np.asarray(got["y"])[-4:]).tolist() == [True, True, False, True]
    exact = [k[0] for k in backend.ctx.pipelines if halfstore.TO_HALF in k[0] and "unpack2x16float" in k[0]]
    if mode == "exact":  # the forced flag reached the shaders the device built
        assert exact
    elif backend.ctx.f16_rounding == "":  # the driver's conversion passed the probe: plain functions
        assert any(halfstore.plain_conversions(k[0]) for k in backend.ctx.pipelines)


def test_a_driver_found_rounding_toward_zero_gets_the_exact_conversion(backend, monkeypatch):
    """The probe runs once per device, on the first shader with conversion functions; where it
    finds the driver's rounding wrong, every such shader gets the exact functions."""
    monkeypatch.setattr(backend.ctx, "f16_rounding", None)
    monkeypatch.setattr(backend.ctx, "f16_register", None)
    monkeypatch.setattr(selftest, "convert_on_device", lambda b, x, exact=False, vec4=False: _rtz(x))
    plain = halfstore.with_conversions("fn main() { let y = anygrad_to_f16(1.0); }\n")
    assert backend.device_wgsl("fn main() {}\n") == "fn main() {}\n" and backend.ctx.f16_rounding is None
    got = backend.device_wgsl(plain)
    # the register probe runs with the store probe, on the real driver (NVIDIA's drops it)
    want = halfstore.exact_conversions(plain, stores=True, registers=bool(backend.ctx.f16_register))
    assert got == want
    assert "conversion gives" in backend.ctx.f16_rounding
    monkeypatch.setattr(selftest, "convert_on_device", lambda *a, **k: pytest.fail("probed twice"))
    assert backend.device_wgsl(plain) == want
