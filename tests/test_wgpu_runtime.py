"""The wgpu runtime: adapters and device names, state buffers, planning (fusion, aliasing, in-place
state updates, slot reuse), repeated runs, fetches and errors."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wgpu_util import assert_close, make_graph, run_both, wgpu_backend

from anygrad.backends import NumpyBackend
from anygrad.devices import get_backend, list_adapters
from anygrad.errors import AnygradError, ConfigError, DeviceError, ShapeError
from anygrad.ir import Graph, Node, TensorInfo, specialize

pytestmark = pytest.mark.wgpu
F32 = np.dtype(np.float32)


@pytest.fixture(scope="module")
def wb():
    return wgpu_backend()


# -- adapters and device names ------------------------------------------------------------------
def test_list_adapters_describes_each(wb):
    adapters = list_adapters()
    assert adapters and [a.index for a in adapters] == list(range(len(adapters)))
    _check_adapter_list(adapters)


def _check_adapter_list(adapters) -> None:
    for a in adapters:
        line = a.describe()
        assert line.startswith(f"wgpu:{a.index}") and a.name in line and a.backend in line
        assert a.type in ("discrete", "integrated", "virtual", "cpu", "unknown")
        assert a.limits.get("max-storage-buffer-binding-size", 0) > 0
    # CI: Mesa's lavapipe (llvmpipe under Vulkan) is a software adapter. Mesa's OpenGL llvmpipe may
    # be the only adapter elsewhere, and GL does not always report a device type: no claim there.
    if any("llvmpipe" in a.name and a.backend == "Vulkan" for a in adapters):
        assert any(a.is_software and a.backend == "Vulkan" for a in adapters)


def test_adapter_list_check_holds_for_an_opengl_only_machine():
    """What test_list_adapters_describes_each asserts, on the adapters of a machine whose only
    driver is Mesa's OpenGL llvmpipe (issue 12, item 16)."""
    from anygrad.backends.wgpu.device.adapters import AdapterInfo
    gl = AdapterInfo(0, "llvmpipe (LLVM 15.0.6, 256 bits)", "OpenGL", "unknown", "Mesa", "",
                     {"max-storage-buffer-binding-size": 1 << 27})
    _check_adapter_list([gl])


def test_device_names(wb, capsys):
    assert isinstance(get_backend("cpu"), NumpyBackend)
    assert get_backend("wgpu").name == "wgpu"
    assert get_backend("WGPU:0").adapter.index == 0
    with pytest.raises(DeviceError, match="no adapter 99"):
        get_backend("wgpu:99")
    with pytest.raises(ConfigError, match="not understood"):
        get_backend("wgpu:tpu")
    with pytest.raises(ConfigError, match="unknown device"):
        get_backend("cuda")
    apis = {a.backend for a in list_adapters()}
    if "Vulkan" in apis:
        assert get_backend("wgpu:vulkan").adapter.backend == "Vulkan"
    missing = {"Metal": "metal", "D3D12": "dx12", "Vulkan": "vulkan", "OpenGL": "gl"}
    for api, word in missing.items():
        if api not in apis:
            with pytest.raises(DeviceError, match=f"no {api} adapter"):
                get_backend(f"wgpu:{word}")
            break
    backend = get_backend("auto")
    if all(a.is_software for a in list_adapters()):
        assert isinstance(backend, NumpyBackend)
        assert "using the CPU" in capsys.readouterr().err
    else:
        assert backend.name == "wgpu" and not backend.adapter.is_software


# -- state ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [np.arange(7, dtype=np.float32) / 3, np.array(2.5, np.float32),
                                   np.array([[1, -2], [3, 2 ** 31 - 1]], np.int64),
                                   np.array([True, False, True]), np.array([5, 2 ** 32 - 1], np.uint32),
                                   np.zeros((0, 3), np.float32)])
def test_state_roundtrip(wb, value):
    wb.set_state("t", value)
    for placed in (False, True):  # held on the host until placed, then read back from the device
        if placed:
            assert wb.placed_state("t").buffer is not None
        got = wb.get_state("t")
        assert got.dtype == value.dtype and got.shape == value.shape
        np.testing.assert_array_equal(got, value)
    assert wb.has_state("t") and not wb.has_state("nope")


def test_state_uploads_flush_and_zeros_skip_the_upload(wb, monkeypatch):
    """Uploads past UPLOAD_FLUSH bytes are submitted (wgpu's staging memory recycled) and every
    value still arrives; a fresh all-zero state is not uploaded (new buffers start zeroed), a zero
    value written over an existing buffer is."""
    from anygrad.backends.wgpu.runtime import backend as runtime
    monkeypatch.setattr(runtime, "UPLOAD_FLUSH", 1024)
    rng = np.random.default_rng(3)
    values = {f"u{i}": rng.standard_normal(300 + i).astype(np.float32) for i in range(8)}  # 1.2 KB each
    for n, v in values.items():
        wb.set_state(n, v)
        wb.placed_state(n)
        assert wb._unflushed < 1024       # each write past the threshold was flushed
    assert all(np.array_equal(wb.get_state(n), v) for n, v in values.items())
    submitted = []
    monkeypatch.setattr(wb, "upload", lambda b, o, d: submitted.append(d.nbytes))
    wb.set_state("zeros_new", np.zeros(1000, np.float32))
    wb.placed_state("zeros_new")
    assert submitted == []
    wb.set_state("u0", np.zeros(300, np.float32))        # same size: written over the old values
    assert submitted == [1200]


# -- running graphs ---------------------------------------------------------------------------------
def _counter_graph() -> Graph:
    """state c <- c + x; output y = c * 2 (reads the old value)."""
    return make_graph([Node("Add", ["c", "x"], ["c2"]), Node("Mul", ["c", "two"], ["y"])], ["x"], ["y"],
                  {"x": (F32, (5,))}, {"c": np.zeros(5, np.float32), "two": np.array(2.0, np.float32)},
                  buffers=["c"], updates={"c2": "c"})


def test_run_twice_and_state_updates(wb):
    g = _counter_graph()
    exe = wb.compile(g)
    x = np.arange(5, dtype=np.float32)
    wb.set_state("c", np.zeros(5, np.float32))
    for k in range(3):  # a new command buffer every run (resubmitting one would abort)
        out = exe.run({"x": x})
        np.testing.assert_allclose(out["y"], 2 * k * x)
    np.testing.assert_allclose(wb.get_state("c"), 3 * x)
    assert exe.run({"x": x}, fetch=[]) == {}
    np.testing.assert_allclose(wb.get_state("c"), 4 * x)


@pytest.mark.parametrize("threads", [True, False])
def test_big_inputs_go_up_through_a_ring_of_mapped_buffers(wb, monkeypatch, threads):
    """A big input (here any: the threshold is 0) is written into the next of UPLOAD_RING mapped
    buffers of its own and copied by its step: runs submitted back to back without a wait, each
    with new values (float64: the cast in the same pass), all arrive, in order; with the setting
    off, queue writes and no upload buffers. threads=False: without a writable view of the
    mapping (write_mapped)."""
    from anygrad.backends.wgpu.runtime import executable
    monkeypatch.setattr(executable, "STAGED_INPUT_BYTES", 0)
    if not threads:
        monkeypatch.setattr(executable, "_mapped_view", lambda buf, nbytes: None)
    for staged in (True, False):
        monkeypatch.setenv("ANYGRAD_WGPU_STAGED_UPLOAD", str(int(staged)))
        exe = wb.compile(_counter_graph())
        wb.set_state("c", np.zeros(5, np.float32))
        xs = [np.arange(5, dtype=np.float64) * (k + 1) + k for k in range(5)]
        for x in xs:
            assert exe.run({"x": x}, fetch=[]) == {}
        np.testing.assert_allclose(wb.get_state("c"), np.sum(xs, axis=0), rtol=1e-6)
        ring = exe._upload_bufs.get("x", [])
        assert len(ring) == (executable.UPLOAD_RING if staged else 0)
        assert all(b.map_state == "unmapped" for b in ring)


def test_in_place_only_when_safe(wb):
    # Unfused, y = c * 2 runs after c2 = c + x: c2 cannot be written into c's buffer.
    g = _counter_graph()
    x = np.full(5, 3.0, np.float32)
    for fuse in (False, True):
        want, got, exe = run_both(g, {"x": x}, state={"c": np.ones(5, np.float32)}, backend=wb, fuse=fuse)
        assert_close(want, got)
        np.testing.assert_allclose(wb.get_state("c"), np.full(5, 4.0))
        if fuse:  # one kernel reads c and writes c2 element by element: in place is safe
            assert exe.n_kernels == 1 and exe.plan.inplace and not exe.plan.state_copies
        else:
            assert exe.plan.inplace == {} and len(exe.plan.state_copies) == 1
    # Without the late reader the update is planned in place even unfused.
    g2 = make_graph([Node("Mul", ["c", "two"], ["y"]), Node("Add", ["c", "x"], ["c2"])], ["x"], ["y"],
                {"x": (F32, (5,))}, {"c": np.ones(5, np.float32), "two": np.array(2.0, np.float32)},
                buffers=["c"], updates={"c2": "c"})
    want, got, exe2 = run_both(g2, {"x": x}, state={"c": np.ones(5, np.float32)}, backend=wb, fuse=False)
    assert exe2.plan.inplace and not exe2.plan.state_copies
    assert_close(want, got)
    np.testing.assert_allclose(wb.get_state("c"), np.full(5, 4.0))


def test_set_state_with_new_shape_rebinds(wb):
    g = make_graph([Node("Mul", ["c", "x"], ["y"])], ["x"], ["y"], {"x": (F32, (3,))},
               {"c": np.ones(3, np.float32)}, buffers=["c"])
    exe = wb.compile(g)
    wb.set_state("c", np.ones(3, np.float32))
    np.testing.assert_allclose(exe.run({"x": np.ones(3, np.float32)})["y"], 1)
    wb.set_state("c", np.full(1, 5.0, np.float32))   # a different size: a new buffer
    wb.set_state("c", np.full(3, 7.0, np.float32))
    np.testing.assert_allclose(exe.run({"x": np.ones(3, np.float32)})["y"], 7)


def test_fusion_merges_elementwise_chains(wb):
    nodes = [Node("Mul", ["x", "x"], ["a"]), Node("Add", ["a", "b"], ["c"]), Node("Relu", ["c"], ["d"]),
             Node("Sigmoid", ["d"], ["e"]), Node("Sub", ["e", "a"], ["y"])]
    g = make_graph(nodes, ["x"], ["y"], {"x": (F32, (4, 6))}, {"b": np.linspace(-1, 1, 6).astype(np.float32)})
    want, got, exe = run_both(g, {"x": np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)},
                              backend=wb)
    assert_close(want, got)
    assert exe.n_kernels == 1 < len(g.nodes)
    unfused = wb.compile(g, fuse=False)
    assert unfused.n_kernels == len(g.nodes)


def test_reshape_is_an_alias_and_slots_are_reused(wb):
    nodes = [Node("Exp", ["x"], ["a"]), Node("Reshape", ["a", "shape"], ["b"]),
             Node("ReduceSum", ["b", "axes"], ["c"], {"keepdims": 0}), Node("Neg", ["c"], ["d"]),
             Node("ReduceSum", ["d", "axes0"], ["e"], {"keepdims": 0}), Node("Abs", ["e"], ["y"])]
    g = make_graph(nodes, ["x"], ["y"], {"x": (F32, (6, 5))},
               {"shape": np.array([3, 10], np.int64), "axes": np.array([1], np.int64),
                "axes0": np.array([0], np.int64)})
    want, got, exe = run_both(g, {"x": np.zeros((6, 5), np.float32) - 2}, backend=wb)
    assert_close(want, got)
    assert exe.plan.root_of["b"] == exe.plan.root_of["a"]
    assert len(exe.plan.slot_bytes) < len([n for n in g.nodes if n.op != "Reshape"])


def test_fetch_inputs_state_and_outputs(wb):
    g = _counter_graph()
    exe = wb.compile(g)
    wb.set_state("c", np.ones(5, np.float32))
    out = exe.run({"x": np.ones(5, np.float32)}, fetch=["c", "x", "y"])
    np.testing.assert_allclose(out["c"], 1)   # as before the step, like the numpy backend
    np.testing.assert_allclose(out["y"], 2)
    with pytest.raises(KeyError):
        exe.run({"x": np.ones(5, np.float32)}, fetch=["nothing"])


def test_integer_inputs_and_outputs(wb):
    g = make_graph([Node("Gather", ["w", "i"], ["y"], {"axis": 0}), Node("Cast", ["i"], ["j"], {"to": 7})],
               ["i"], ["y", "j"], {"i": (np.int64, (4,))}, {"w": np.arange(12, dtype=np.float32).reshape(6, 2)})
    want, got, _ = run_both(g, {"i": np.array([5, 0, -1, 2], np.int64)}, backend=wb)
    assert got["j"].dtype == np.int64
    assert_close(want, got)


def test_bad_feeds(wb):
    exe = wb.compile(_counter_graph())
    with pytest.raises(ShapeError, match="compiled for"):
        exe.run({"x": np.ones(4, np.float32)})
    with pytest.raises(ShapeError, match="not given"):
        exe.run({})


def test_op_without_kernel_is_a_device_error_at_compile(wb, monkeypatch):
    from anygrad.backends.wgpu import LOWERINGS
    monkeypatch.delitem(LOWERINGS, "Softmax")  # as if Softmax had no wgpu kernel
    g = make_graph([Node("Softmax", ["x"], ["y"])], ["x"], ["y"], {"x": (F32, (3,))})
    with pytest.raises(DeviceError, match="no kernel for op.*Softmax"):
        wb.compile(g)


def test_one_lowering_registry_holds_aliases_epilogues_and_updates(wb):
    """The planner's aliases, fusion's epilogue GEMMs and optimizer updates are traits of the
    backend's one registry (kernel.REGISTRY), not lists beside it: every optimizer's update op is
    an update there, the aliases run no kernel of their own, and `supports` answers for all."""
    from anygrad import optim
    from anygrad.backends.wgpu.kernels.kernel import REGISTRY, ops_where
    updates = {cls.op for cls in vars(optim).values() if isinstance(cls, type) and getattr(cls, "op", None)}
    assert updates and updates == ops_where("update")
    assert ops_where("epilogue") == {"MatMul", "Gemm", "Conv", "ConvGradInput"}
    assert {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"} == ops_where("alias")
    assert all(wb.supports(op) for op in ops_where("alias"))      # Reshape: no kernel, but it runs
    assert REGISTRY["Reshape"].fn is None and REGISTRY["Identity"].fn is not None
    assert not wb.supports("NoSuchOp")


def test_errors_are_anygrad_errors():
    assert issubclass(DeviceError, AnygradError)


def test_node_a_kernel_cannot_take_is_a_device_error(wb):
    g = make_graph([Node("Det", ["x"], ["y"])], ["x"], ["y"], {"x": (F32, (40, 40))})  # Det: 32x32 at most
    with pytest.raises(DeviceError, match="Det node"):
        wb.compile(g)


def test_profile_times_every_kernel(wb):
    g = _counter_graph()
    b2 = wgpu_backend()
    b2.set_state("c", np.zeros(5, np.float32))
    exe = b2.compile(g, fuse=False)
    prof = exe.profile({"x": np.ones(5, np.float32)}, repeat=1)
    assert [name for name, _ in prof] == [step.kernel.name for step in exe.plan.steps]
    assert all(ms >= 0 for _, ms in prof)


# -- random graphs: fusion, aliasing, slot reuse and in-place updates against numpy ----------------
_UNARY = ["Neg", "Tanh", "Relu", "Sigmoid", "Abs"]
_BINARY = ["Add", "Sub", "Mul", "Max"]


@st.composite
def random_graph(draw):
    """A DAG over shapes (4, 5), (4, 1), (1, 5), (20,) with state tensors S and T (4, 5) read
    anywhere and replaced by computed values (or by each other: a swap)."""
    values = {"x": (4, 5), "S": (4, 5), "T": (4, 5)}
    nodes = []
    for k in range(draw(st.integers(3, 12))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "reduce", "reshape", "identity", "softmax"]))
        out = f"v{k}"
        names = sorted(values)
        a = draw(st.sampled_from(names))
        if kind == "unary":
            nodes.append(Node(draw(st.sampled_from(_UNARY)), [a], [out]))
            values[out] = values[a]
        elif kind == "binary":
            ok = [n for n in names if values[n] != (20,) and values[a] != (20,)] or [a]
            b = draw(st.sampled_from(ok))
            if (values[a] == (20,)) != (values[b] == (20,)):
                b = a
            nodes.append(Node(draw(st.sampled_from(_BINARY)), [a, b], [out]))
            values[out] = tuple(np.broadcast_shapes(values[a], values[b]))
        elif kind == "reduce" and values[a] == (4, 5):
            axis = draw(st.integers(0, 1))
            nodes.append(Node("ReduceSum", [a, f"axis{axis}"], [out], {"keepdims": 1}))
            values[out] = (4, 1) if axis else (1, 5)
        elif kind == "reshape" and values[a] in ((4, 5), (20,)):
            target = (20,) if values[a] == (4, 5) else (4, 5)
            nodes.append(Node("Reshape", [a, f"shape{len(target)}"], [out]))
            values[out] = target
        elif kind == "identity":
            nodes.append(Node("Identity", [a], [out]))
            values[out] = values[a]
        elif kind == "softmax" and len(values[a]) == 2:
            nodes.append(Node("Softmax", [a], [out], {"axis": draw(st.sampled_from([0, 1]))}))
            values[out] = values[a]
        else:
            nodes.append(Node("Neg", [a], [out]))
            values[out] = values[a]
    computed = [f"v{k}" for k in range(len(nodes))]
    full = [v for v in computed if values[v] == (4, 5)] + ["S", "T"]
    outputs = draw(st.lists(st.sampled_from(computed), min_size=1, max_size=3, unique=True))
    updates = {}
    for state in ("S", "T"):
        v = draw(st.sampled_from(full + [None]))
        if v is not None and v != state and v not in updates:
            updates[v] = state
    return nodes, outputs, updates, values


@settings(max_examples=int(os.environ.get("ANYGRAD_FUZZ_EXAMPLES", "25")), deadline=None)
@given(spec=random_graph(), seed=st.integers(0, 100))
def test_random_elementwise_graphs_match_numpy(wb, spec, seed):
    nodes, outputs, updates, _ = spec
    consts = {"axis0": np.array([0], np.int64), "axis1": np.array([1], np.int64),
              "shape1": np.array([20], np.int64), "shape2": np.array([4, 5], np.int64)}
    g = Graph(inputs=["x"], outputs=list(outputs), nodes=nodes)
    g.info["x"] = TensorInfo(F32, (4, 5))
    g.initializers = {**consts, "S": np.zeros((4, 5), np.float32), "T": np.zeros((4, 5), np.float32)}
    g.buffers = ["S", "T"]
    g.state_updates = dict(updates)
    g = specialize(g, {})
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    init = {k: rng.standard_normal((4, 5)).astype(np.float32) for k in ("S", "T")}
    nb = NumpyBackend()
    for k, v in init.items():
        nb.set_state(k, v)
    want = nb.compile(g).run({"x": x})
    for fuse in (True, False):
        for k, v in init.items():
            wb.set_state(k, v)
        got = wb.compile(g, fuse=fuse).run({"x": x})
        assert_close(want, got, rtol=1e-5, atol=1e-6, what=f"fuse={fuse}")
        for k in init:
            np.testing.assert_allclose(wb.get_state(k), nb.get_state(k), rtol=1e-5, atol=1e-6, err_msg=k)


# -- trusted shader modules (shader_module.py) ---------------------------------------------------
_REVERSE_WGSL = """
@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
var<workgroup> tile: array<f32, 64>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let base = wid.x * 64u;
    tile[lid.x] = src[base + lid.x];
    workgroupBarrier();
    var acc = 0.0;
    for (var k = 0u; k <= lid.x; k++) { acc += tile[63u - k]; }   // dynamic workgroup indices
    dst[base + lid.x] = acc;
}
"""


def _run_reverse_cumsum(dev, module, x: np.ndarray) -> np.ndarray:
    import wgpu
    src = dev.create_buffer_with_data(data=x, usage=wgpu.BufferUsage.STORAGE)
    dst = dev.create_buffer(size=x.nbytes, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": src}}, {"binding": 1, "resource": {"buffer": dst}}])
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    cp.set_bind_group(0, bg)
    cp.dispatch_workgroups(x.size // 64)
    cp.end()
    dev.queue.submit([enc.finish()])
    return np.frombuffer(dev.queue.read_buffer(dst), np.float32)


def test_trusted_shader_modules_compute_what_checked_ones_do(wb, monkeypatch):
    from anygrad.backends.wgpu.device import shader_module
    assert shader_module._native() is not None, "the pinned wgpu-native lost wgpuDeviceCreateShaderModuleTrusted"
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    want = np.cumsum(x.reshape(4, 64)[:, ::-1].astype(np.float64), axis=1).ravel()
    dev = wb.device
    trusted = _run_reverse_cumsum(dev, shader_module.create_shader_module(dev, _REVERSE_WGSL, "t"), x)
    monkeypatch.setenv("ANYGRAD_WGPU_CHECKS", "1")
    checked = _run_reverse_cumsum(dev, shader_module.create_shader_module(dev, _REVERSE_WGSL, "c"), x)
    np.testing.assert_allclose(trusted, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(trusted, checked)


def test_trusted_module_still_validates_wgsl(wb):
    from anygrad.backends.wgpu.device import shader_module
    with pytest.raises(Exception, match="(?i)unknown|parse|error"):
        shader_module.create_shader_module(wb.device, "@compute @workgroup_size(1) fn main() { nope(); }", "bad")


def test_pack_arena_moves_placed_and_pending_state(wb, monkeypatch):
    """An arena gathers states of both kinds: one already on the device (copied there, its own
    buffer destroyed) and ones only recorded on the host (written straight in), zeros included."""
    from anygrad.backends.wgpu.fusion.arenas import ArenaSpec
    a, b = np.arange(5, dtype=np.float32), np.linspace(-1, 1, 7).astype(np.float32)
    for name, v in (("a", a), ("b", b), ("z", np.zeros(3, np.float32))):
        wb.set_state(name, v)
    own = wb.placed_state("a").buffer
    destroyed = []
    monkeypatch.setattr(type(own), "destroy", lambda buf: destroyed.append(buf))
    wb.pack_arena(ArenaSpec("@arena", ("a", "b", "z"), (0, 64, 128), 192))
    assert destroyed == [own]
    assert len({id(wb.state[n].buffer) for n in "abz"}) == 1 and wb.state["b"].offset == 256
    raw = np.frombuffer(wb.read(wb.state["a"].buffer, 192 * 4), np.float32)
    np.testing.assert_array_equal(raw[:5], a)
    np.testing.assert_array_equal(raw[64:71], b)
    np.testing.assert_array_equal(raw[128:131], 0)
    np.testing.assert_array_equal(wb.get_state("b"), b)


def test_export_and_import_states_merge_neighbours_in_one_buffer(wb):
    """States lying back to back in one arena move as one span (one copy, one upload); the flat
    vector still holds each state at its place, and a state elsewhere joins it."""
    from anygrad.backends.wgpu.fusion.arenas import ArenaSpec
    rng = np.random.default_rng(5)
    vals = {n: rng.standard_normal(k).astype(np.float32) for n, k in (("a", 5), ("b", 7), ("c", 3))}
    for n, v in vals.items():
        wb.set_state(n, v)
    wb.pack_arena(ArenaSpec("@ab", ("a", "b"), (0, 5), 12))
    spans = wb._float32_spans(["a", "b", "c"])
    assert [(nbytes, off) for _, _, nbytes, off in spans] == [(48, 0), (12, 48)]
    flat = np.empty(15, np.float32)
    wb.export_states(["a", "b", "c"], flat)
    np.testing.assert_array_equal(flat, np.concatenate(list(vals.values())))
    wb.import_states(["a", "b", "c"], -2 * flat)
    for n, v in vals.items():
        np.testing.assert_array_equal(wb.get_state(n), -2 * v)


_LEFT_MAPPED = """
import time
import numpy as np
from anygrad.devices import get_backend
wb = get_backend("wgpu:0")
v = np.arange(8, dtype=np.float32)
out = np.zeros(8, np.float32)
for k, settle in enumerate((0.0, 0.3)):  # the failed step's map still pending, then resolved
    wb.set_state("g", v + k)
    enc = wb.device.create_command_encoder()
    wb.export_states_async(["g"], out, encoder=enc)  # a tap: the map is asked for at submit
    wb.submit(enc.finish(), wb.take_hooks())  # ... and the step then failed: never read
    time.sleep(settle)
    wb.set_state("g", 10 * v + k)
    wb.export_states_async(["g"], out)()  # the next step's read of the same bucket
    assert (out == 10 * v + k).all(), out
    view, commit = wb.import_view(["g"])  # a write-back that failed before its commit
    view[:] = -1
    view, commit = wb.import_view(["g"])
    view[:] = 3 * v + k
    commit()
    assert (wb.get_state("g") == 3 * v + k).all(), wb.get_state("g")
print("ok")
"""


def test_buffers_a_failed_step_left_mapped_are_reused_without_aborting(wb):
    """A step that fails after a gradient bucket's map was asked for (a lost device, a failed
    submit) leaves that kept buffer mapped or its map pending, and the write-back's upload view
    mapped; wgpu-native aborts the whole process on a submit copying into a mapped buffer (CI
    died of it). The next step unmaps them first and reads and writes the right values. In a
    child process, so that a regression fails this test instead of killing the run."""
    import subprocess
    import sys
    if not wb.ctx.polls_freely:
        pytest.skip("import_view needs the non-blocking poll (ANYGRAD_WGPU_POLL=block is set)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _LEFT_MAPPED], check=False, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_parallel_copy_and_large_read(wb, monkeypatch):
    """A copy split over threads (small pieces forced) equals np.copyto; a read that takes that
    path returns the buffer's bytes."""
    from anygrad import _parallel
    monkeypatch.setattr(_parallel, "COPY_CHUNK", 1024)
    src = np.random.default_rng(1).standard_normal(10_001).astype(np.float32)
    dst = np.zeros_like(src)
    _parallel.copy(dst, src)
    np.testing.assert_array_equal(dst, src)
    wb.set_state("big", src)
    st = wb.placed_state("big")
    np.testing.assert_array_equal(np.frombuffer(wb.read(st.buffer, 4 * 9_999, 8), np.float32), src[2:10_001])


def test_state_packed_into_arenas_before_the_slots_without_buffers_of_its_own(wb, monkeypatch):
    """Parameters and optimizer state go into their arenas when the step is built, before its
    activation slots exist, written there straight from the host: no per-tensor buffer is ever
    made for them (freed, those left the allocator's blocks pinned); a state placed before the
    step is built is copied into the arena and its buffer destroyed. Training still matches the
    numpy backend."""
    import anygrad
    from anygrad import nn
    from anygrad.backends.wgpu.runtime import backend as runtime
    events = []
    create, destroy = runtime.WgpuBackend.create_buffer, type(wb.device.create_buffer(size=16, usage=8)).destroy

    def tracking_create(self, nbytes, usage, label=""):
        buf = create(self, nbytes, usage, label)
        events.append(("create", label, buf))
        return buf

    def tracking_destroy(buf):
        events.append(("destroy", "", buf))
        return destroy(buf)
    monkeypatch.setattr(runtime.WgpuBackend, "create_buffer", tracking_create)
    monkeypatch.setattr(type(wb.device.create_buffer(size=16, usage=8)), "destroy", tracking_destroy)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 8)).astype(np.float32), rng.standard_normal((32, 3)).astype(np.float32)
    losses = {}
    for device in ("cpu", "wgpu"):
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        net.load_state_dict({k: np.full(v.shape, 0.1, np.float32) * (1 + np.arange(v.size).reshape(v.shape) % 5)
                             for k, v in net.state_dict().items()})
        model = net.to_model(input_shape=(None, 8)).compile(
            loss="mse", optimizer=anygrad.optim.SGD(lr=0.05, momentum=0.9), device=device)
        losses[device] = [model.train_on_batch(x, y) for _ in range(3)]
    np.testing.assert_allclose(losses["wgpu"], losses["cpu"], rtol=1e-5)
    exe = next(e for key, e in model._programs.items() if key[0] == "train")
    members = {m for spec in exe.plan.arenas for m in spec.members}
    assert members, "the SGD update should read its parameters from arenas"
    first_slot = next(k for k, e in enumerate(events) if e[1].startswith("slot"))
    assert all(k < first_slot for k, e in enumerate(events) if e[1].startswith("arena"))
    for m in members:
        assert not [b for kind, label, b in events if kind == "create" and label == f"state {m}"], m
        assert model.backend.state[m].arena


def test_a_shader_over_the_workgroup_memory_limit_is_refused_before_it_runs(wb):
    """wgpu-native creates such a pipeline without an error and fails only when it is dispatched,
    unseen (an autotuner candidate on an H200 left a compile waiting forever): anygrad sizes the
    shader's workgroup variables and refuses it, naming the kernel; the GEMM tiles are sized as
    WGSL lays them out."""
    from anygrad.backends.wgpu.kernels import kernels_gemm as kg
    from anygrad.backends.wgpu.kernels.wgsl import workgroup_bytes
    limit = wb.caps.max_workgroup_storage
    n = limit // 16 + 1
    wgsl = (f"var<workgroup> big: array<vec4<f32>, {n}>;\n"
            "@group(0) @binding(0) var<storage, read_write> y: array<f32>;\n"
            "@compute @workgroup_size(64) fn main(@builtin(local_invocation_index) i: u32) "
            "{ big[i] = vec4<f32>(f32(i)); workgroupBarrier(); y[i] = big[63u - i].x; }")
    assert workgroup_bytes(wgsl) == 16 * n > limit
    with pytest.raises(RuntimeError, match=f"oversized needs {16 * n} bytes of workgroup memory"):
        wb.pipeline(wgsl, "main", (False,), "oversized")
    spec = kg.GemmSpec("Gemm", 64, 64, 64, 1, kg.Operand("A", 64, 64, "r * 64u + c", contig=1),
                       kg.Operand("B", 64, 64, "r * 64u + c", contig=1), kg.Output("Y", "r * 64u + c"),
                       (kg.Binding("a", "A"), kg.Binding("b", "B")), kg.Binding("y", "Y"))
    (gemm,) = kg.gemm_kernels(spec, wb.caps, variant="shared", block=4, kt=16, prefetch=2, allow_split=False)
    # two 64-row tiles of 16 k for each operand, f32
    assert workgroup_bytes(gemm.wgsl) == 2 * 2 * 64 * 16 * 4 <= limit
