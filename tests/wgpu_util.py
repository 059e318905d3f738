"""Helpers for wgpu tests: one shared backend, and running a graph on wgpu and numpy side by side.

    check_wgpu("Softmax", [x], {"axis": 1})   # forward and gradient, wgpu vs numpy

Graphs are built as in tests/opcheck.py: float inputs become graph inputs (their gradients of
sum(out0 * R) are compared too), everything else becomes a constant initializer.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import NoReturn

import numpy as np
import pytest

from anygrad.autodiff import gradients
from anygrad.backends import NumpyBackend
from anygrad.ir import Builder, Graph, Node, TensorInfo, specialize

# CI (.ci/run) sets this: a missing adapter then fails the wgpu tests instead of skipping them,
# so a broken driver install cannot pass CI with every wgpu test skipped.
REQUIRE_ENV = "ANYGRAD_REQUIRE_WGPU"


def adapter_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip() not in ("", "0")


def no_adapter(what: str = "no WebGPU adapter on this machine") -> NoReturn:
    """Skip the calling test, or fail it when $ANYGRAD_REQUIRE_WGPU=1."""
    if adapter_required():
        pytest.fail(f"{what}, and {REQUIRE_ENV}=1 requires one: install a Vulkan driver (Mesa's lavapipe: "
                    f"mesa-vulkan-drivers) or unset {REQUIRE_ENV}", pytrace=False)
    pytest.skip(f"{what} (install mesa-vulkan-drivers for lavapipe)")


def has_adapter() -> bool:
    """Whether wgpu reaches any adapter. False means: skip. With $ANYGRAD_REQUIRE_WGPU=1 a missing
    adapter fails the calling test here instead, so every `if not has_adapter(): skip` fails in CI."""
    from anygrad import AnygradError
    from anygrad.devices import list_adapters
    try:
        found = bool(list_adapters())
    except AnygradError:  # no driver at all
        found = False
    if not found and adapter_required():
        no_adapter()
    return found


# The device the wgpu tests run on: e.g. wgpu:gl, or wgpu:dawn to run the numpy-oracle tests on Dawn
# (the device machine: `ANYGRAD_TEST_DEVICE=wgpu:dawn python -m pytest tests/test_wgpu_ops.py ...`).
TEST_DEVICE_ENV = "ANYGRAD_TEST_DEVICE"


def device_under_test() -> str:
    return os.environ.get(TEST_DEVICE_ENV, "").strip().lower() or "wgpu"


def has_dawn_adapter() -> bool:
    """Whether Dawn (wgpudawn) is installed and reaches an adapter: it refuses lavapipe, so not in CI."""
    from anygrad.backends.wgpu.device.adapters import list_adapters
    from anygrad.backends.wgpu.device.implementation import DAWN, available
    return available(DAWN) and bool(list_adapters((DAWN,)))


def no_dawn() -> NoReturn:
    pytest.skip("no Dawn adapter: wgpudawn is not installed, or it found no GPU (Dawn refuses software "
                "adapters such as lavapipe; these tests run on a machine with a GPU)")


def wgpu_backend():
    """A fresh WgpuBackend on the best adapter (lavapipe in CI), or on $ANYGRAD_TEST_DEVICE
    (e.g. wgpu:gl, wgpu:dawn); skips when no adapter exists (fails with $ANYGRAD_REQUIRE_WGPU=1),
    and when Dawn is asked for but has no adapter here."""
    if not has_adapter():
        no_adapter()
    device = device_under_test()
    if "dawn" in device.split(":") and not has_dawn_adapter():
        no_dawn()
    from anygrad.backends.wgpu import WgpuBackend
    return WgpuBackend(device)


def dawn_backend():
    """A fresh WgpuBackend on Dawn's best adapter; skips (with the reason) where there is none."""
    if not has_dawn_adapter():
        no_dawn()
    from anygrad.backends.wgpu import WgpuBackend
    return WgpuBackend("wgpu:dawn")


def op_graph(op: str, inputs: Sequence[np.ndarray | None], attrs: dict | None = None, *,
             const: Sequence[int] = (), n_outputs: int = 1, grad: bool = True, seed: int = 0,
             state: dict[int, str] | None = None, feed: Sequence[int] = ()):
    """A specialized graph computing one op (and gradients of sum(out0 * R)), plus its feeds.

    state: input index -> state name, for inputs that are backend state (RNG, running stats).
    feed: inputs fed at run time without a gradient (so an all-constant node is not folded away)."""
    g = Graph(name=op)
    names, diff, feeds = [], [], {}
    state = state or {}
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        a = np.asarray(a)
        name = state.get(i, f"in{i}")
        names.append(name)
        if i in state:
            g.initializers[name] = a
            g.buffers.append(name)
        elif i in feed:
            g.inputs.append(name)
            g.info[name] = TensorInfo(a.dtype, a.shape)
            feeds[name] = a
        elif np.issubdtype(a.dtype, np.floating) and i not in const:
            g.inputs.append(name)
            g.info[name] = TensorInfo(a.dtype, a.shape)
            diff.append(i)
            feeds[name] = a
        else:
            g.initializers[name] = a
    outs = [f"out{k}" for k in range(n_outputs)]
    g.nodes = [Node(op, names, outs, dict(attrs or {}), name="op")]
    g.outputs = list(outs)
    s = specialize(g, {})
    if grad and diff:
        b = Builder(s, prefix="check")
        r = np.random.default_rng(seed).standard_normal(b.shape("out0")).astype(np.float32)
        loss = b.op("ReduceSum", [b.op("Mul", ["out0", b.const(r)])], keepdims=0)
        gr = gradients(s, loss, [f"in{i}" for i in diff])
        s.outputs = outs + [gr[f"in{i}"] for i in diff]
    return s, feeds


def run_both(graph: Graph, feeds: dict, fetch: Sequence[str] | None = None, *, fuse: bool = True,
             backend=None, state: dict[str, np.ndarray] | None = None):
    """Run graph on numpy and on wgpu from the same state; return (numpy results, wgpu results, wgpu exe)."""
    nb = NumpyBackend()
    wb = backend or wgpu_backend()
    for name, value in (state or {}).items():
        nb.set_state(name, value)
        wb.set_state(name, value)
    want = nb.compile(graph).run(feeds, fetch)
    exe = wb.compile(graph, fuse=fuse)
    got = exe.run(feeds, fetch)
    return want, got, exe


def assert_close(want: dict, got: dict, rtol: float = 1e-4, atol: float = 1e-5, what: str = "") -> None:
    assert set(want) == set(got)
    for k, value in want.items():
        w, g = np.asarray(value), np.asarray(got[k])
        assert w.shape == g.shape, f"{what} {k}: shape {g.shape} != {w.shape}"
        if w.dtype.kind in "biu" and atol >= 1:  # quantized outputs: a rounding tie may land one step apart
            assert np.abs(g.astype(np.int64) - w.astype(np.int64)).max(initial=0) <= atol, f"{what} {k}: {g} != {w}"
        elif w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w, err_msg=f"{what} {k}")
        else:
            scale = max(1.0, float(np.abs(w).max(initial=0)))
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale, err_msg=f"{what} {k}")


def check_wgpu(op: str, inputs: Sequence[np.ndarray | None], attrs: dict | None = None, *,
               const: Sequence[int] = (), n_outputs: int = 1, grad: bool = True, rtol: float = 1e-4,
               atol: float = 1e-5, fuse: bool = True, state: dict[int, str] | None = None, seed: int = 0,
               feed: Sequence[int] = ()):
    """Assert one op's outputs (and input gradients) on wgpu match the numpy backend."""
    graph, feeds = op_graph(op, inputs, attrs, const=const, n_outputs=n_outputs, grad=grad, seed=seed,
                           state=state, feed=feed)
    assert graph.nodes, f"{op}: the graph folded to constants; feed an input"
    init = {name: np.asarray(graph.initializers[name]) for name in graph.buffers}
    want, got, exe = run_both(graph, feeds, fuse=fuse, state=init)
    assert_close(want, got, rtol, atol, what=op)
    return exe


def make_graph(nodes, inputs, outputs, info, inits=None, buffers=(), updates=None) -> Graph:
    """A specialized Graph from nodes and {name: (dtype, shape)} (constants in `inits`)."""
    g = Graph(inputs=list(inputs), outputs=list(outputs))
    g.nodes = nodes
    for k, v in info.items():
        g.info[k] = TensorInfo(np.dtype(v[0]), v[1])
    g.initializers = dict(inits or {})
    g.buffers = list(buffers)
    g.state_updates = dict(updates or {})
    return specialize(g, {})


@functools.cache
def tint_device():
    """A device of Dawn's Null backend: Tint (Dawn's WGSL compiler) and Dawn's validation without a
    GPU, so CI checks that a kernel compiles under Tint as well as naga (create_shader_module runs
    Tint's parser, resolver and uniformity analysis; nothing is dispatched: a Null device has no
    memory to run in). Skips where wgpudawn is not installed or its build has no Null backend."""
    from anygrad.backends.wgpu.device.implementation import DAWN, available, load
    from anygrad.backends.wgpu.kernels.kernels_mma import FEATURES
    if not available(DAWN):
        pytest.skip("wgpudawn is not installed (pip install 'anygrad-train[dawn]')")
    impl = load(DAWN)
    before = os.environ.get("WGPU_BACKEND_TYPE")
    os.environ["WGPU_BACKEND_TYPE"] = "Null"   # wgpu-py's way to force a backend: read by request_adapter
    try:
        adapter = impl.module.gpu.request_adapter_sync()
    except RuntimeError as e:
        pytest.skip(f"Dawn has no Null backend in this build ({e})")
    finally:
        if before is None:
            del os.environ["WGPU_BACKEND_TYPE"]
        else:
            os.environ["WGPU_BACKEND_TYPE"] = before
    if adapter.info.get("backend_type") != "Null":
        pytest.skip(f"Dawn gave a {adapter.info.get('backend_type')} adapter, not its Null backend")
    from wgpudawn.backends.dawn import extras
    return extras.request_device_sync(adapter, required_features=[f for f in FEATURES if f in adapter.features])


def tint_rejects(wgsl: str) -> str:
    """Tint's first error line for `wgsl` as Dawn gets it (implementation.wgsl_for), "" if accepted."""
    from anygrad.backends.wgpu.device.implementation import DAWN, load, wgsl_for
    try:
        tint_device().create_shader_module(code=wgsl_for(DAWN, wgsl))
    except load(DAWN).module.GPUError as e:   # GPUValidationError, with Tint's message
        lines = [ln for ln in str(e).splitlines() if "error" in ln] or str(e).splitlines() or [repr(e)]
        return lines[0]
    return ""
