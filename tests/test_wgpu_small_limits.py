"""Planning within lowered limits (issue 13 item 2) on lavapipe, against numpy: kernels past the
storage-buffer count get their reads packed (bindpack.py). Profiles here lower a limit far below
any real adapter's, so tiny shapes reach each path."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from wgpu_util import assert_close, has_adapter, no_adapter, op_graph, run_both

pytestmark = pytest.mark.wgpu


@pytest.fixture(autouse=True)
def _adapter():
    if not has_adapter():
        no_adapter()


@pytest.fixture
def profile(monkeypatch):
    """make(name, **limits): a test profile, webgpu-default with these limits lowered."""
    from anygrad.backends.wgpu.planning import limits as L

    def make(name: str, **lowered):
        prof = dataclasses.replace(L.PROFILES["webgpu-default"], name=name, **lowered)
        monkeypatch.setitem(L.PROFILES, name, prof)
        from anygrad.backends.wgpu import WgpuBackend
        return WgpuBackend("wgpu", limits=name)
    return make


def test_a_sum_of_many_inputs_packs_its_reads_under_four_buffers(profile):
    backend = profile("test-4-buffers", max_storage_buffers_per_shader_stage=4)
    assert backend.device.limits["max-storage-buffers-per-shader-stage"] == 4
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(6)]
    graph, feeds = op_graph("Sum", xs, grad=True)
    want, got, exe = run_both(graph, feeds, backend=backend)
    assert_close(want, got, what="Sum of 6")
    assert all(len(st.kernel.reads) + len(st.kernel.writes) <= 4 for st in exe.plan.steps)
    assert any(st.kernel.name.endswith(":pack") for st in exe.plan.steps)


def test_max_and_mixed_dtype_reads_pack_with_bitcasts(profile):
    backend = profile("test-3-buffers", max_storage_buffers_per_shader_stage=3)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((4, 7)).astype(np.float32) for _ in range(5)]
    graph, feeds = op_graph("Max", xs, grad=False)
    want, got, exe = run_both(graph, feeds, backend=backend, fuse=False)
    assert_close(want, got, what="Max of 5")
    # an int condition and two float branches plus more: Where under 3 buffers packs the int too
    cond = rng.integers(0, 2, (4, 7)).astype(bool)
    graph, feeds = op_graph("Where", [cond, xs[0], xs[1]], grad=False, feed=(0,))
    want, got, exe = run_both(graph, feeds, backend=backend, fuse=False)
    assert_close(want, got, what="Where")
    assert max(len(st.kernel.reads) + len(st.kernel.writes) for st in exe.plan.steps) <= 3


def test_einsum_of_four_operands_under_four_buffers(profile):
    backend = profile("test-4-buffers", max_storage_buffers_per_shader_stage=4)
    rng = np.random.default_rng(2)
    ops = [rng.standard_normal(s).astype(np.float32) for s in ((2, 3), (3, 4), (4, 2), (2,))]
    graph, feeds = op_graph("Einsum", ops, {"equation": "ij,jk,kl,l->i"}, grad=False)
    want, got, _ = run_both(graph, feeds, backend=backend)
    assert_close(want, got, what="Einsum")


def test_adam_training_step_under_five_buffers_matches_numpy(profile):
    """Every kernel of a training step (conv, GEMM, loss, the Adam update with its two slots)
    within 5 bindings (BatchNorm statistics write 4), trained against the numpy backend."""
    from pathlib import Path

    import anygrad
    from anygrad.optim import get_optimizer
    profile("test-5-buffers", max_storage_buffers_per_shader_stage=5)
    mnist = Path(anygrad.__file__).parent / "examples" / "mnist.onnx"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 4)
    losses = {}
    for device, limits in (("cpu", None), ("wgpu", "adapter"), ("wgpu-5", "test-5-buffers")):
        model = anygrad.load_onnx(mnist)
        model.compile(loss="nll", optimizer=get_optimizer("adam", lr=1e-3, amsgrad=True),
                      device=device.split("-")[0], limits=limits)
        losses[device] = [model.train_on_batch(x, y) for _ in range(2)]
    # Packing moves bytes only: the same losses as the unpacked plan, to the bit.
    np.testing.assert_array_equal(losses["wgpu-5"], losses["wgpu"])
    # Adam's first steps move every weight by about lr whatever the gradient's size, so f32 rounding
    # of near-zero gradients shows in the second loss on any wgpu plan (0.5% here): compared loosely.
    np.testing.assert_allclose(losses["wgpu-5"], losses["cpu"], rtol=1e-2)


def test_an_elementwise_chain_larger_than_one_binding_splits_by_rows(profile):
    """(100, 300) f32 values (117 KiB) under a 64 KiB binding: the fused Add/Relu/Mul chain runs
    as dispatches over blocks of rows, each binding a window; the bias is bound whole."""
    from wgpu_util import make_graph

    from anygrad.ir import Node
    backend = profile("test-64k", max_storage_buffer_binding_size=64 << 10)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((100, 300)).astype(np.float32)
    b = rng.standard_normal((300,)).astype(np.float32)
    s = rng.standard_normal((100, 300)).astype(np.float32)
    graph = make_graph([Node("Add", ["x", "b"], ["h"]), Node("Relu", ["h"], ["r"]), Node("Mul", ["r", "s"], ["y"])],
                       ["x", "b", "s"], ["y"], {"x": (np.float32, (100, 300)), "b": (np.float32, (300,)),
                                                "s": (np.float32, (100, 300))})
    want, got, exe = run_both(graph, {"x": x, "b": b, "s": s}, backend=backend)
    assert_close(want, got, what="rows")
    np.testing.assert_allclose(got["y"], np.maximum(x.astype(np.float64) + b, 0) * s, rtol=1e-6)
    windows = [w for st in exe.plan.steps for w in st.kernel.windows if w is not None]
    assert len(exe.plan.steps) >= 2 and windows and max(size for _, size in windows) <= 64 << 10


def test_an_op_that_cannot_split_names_itself_and_the_batch_that_fits(profile):
    from anygrad.errors import DeviceError
    backend = profile("test-64k", max_storage_buffer_binding_size=64 << 10)
    x = np.ones((64, 512), np.float32)  # 128 KiB; a transpose's rows are not the input's rows
    graph, feeds = op_graph("Transpose", [x], {"perm": [1, 0]}, grad=False)
    with pytest.raises(DeviceError, match=r"'in0'.*bound whole by the Transpose kernel.*needs 128 KiB at batch 64.*"
                                          r"64 KiB\. The largest batch that fits is about 32"):
        run_both(graph, feeds, backend=backend)


@pytest.mark.parametrize("op,inputs,attrs,const", [
    ("MatMul", [(100, 40), (40, 300)], {}, (1,)),
    ("MatMul", [(4, 30, 20), (4, 20, 200)], {}, ()),          # batches of both split together
    ("Gemm", [(100, 40), (300, 40), (300,)], {"transB": 1}, (1, 2)),
    ("ReduceSum", [(100, 300)], {"axes": [1], "keepdims": 1}, ()),
    ("Softmax", [(100, 300)], {"axis": 1}, ()),
    ("LayerNormalization", [(100, 300), (300,), (300,)], {"axis": -1}, (1, 2)),
    ("Conv", [(8, 3, 24, 24), (4, 3, 3, 3), (4,)], {"pads": [1, 1, 1, 1]}, (1, 2)),  # batch blocks
    ("MaxPool", [(8, 4, 32, 32)], {"kernel_shape": [2, 2], "strides": [2, 2]}, ()),
])
def test_ops_larger_than_one_binding_split_by_rows(profile, op, inputs, attrs, const):
    """Each op's values (about 117 KiB) under a 64 KiB binding, by blocks of leading rows, vs numpy."""
    backend = profile("test-64k", max_storage_buffer_binding_size=64 << 10)
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(s).astype(np.float32) for s in inputs]
    graph, feeds = op_graph(op, xs, attrs, const=const, grad=False)
    want, got, exe = run_both(graph, feeds, backend=backend, fuse=False)
    assert_close(want, got, rtol=1e-4, atol=1e-5, what=op)
    assert any(w is not None for st in exe.plan.steps for w in st.kernel.windows)


def test_embedding_lookup_larger_than_one_binding_splits_index_rows(profile):
    backend = profile("test-64k", max_storage_buffer_binding_size=64 << 10)
    rng = np.random.default_rng(5)
    table = rng.standard_normal((50, 300)).astype(np.float32)   # 58.6 KiB: fits whole
    ids = rng.integers(0, 50, (100,)).astype(np.int64)          # the output, 117 KiB, does not
    graph, feeds = op_graph("Gather", [table, ids], {"axis": 0}, const=(0,), grad=False, feed=(1,))
    want, got, exe = run_both(graph, feeds, backend=backend, fuse=False)
    assert_close(want, got, what="Gather")
    np.testing.assert_array_equal(got["out0"], table[ids])
    assert sum(1 for st in exe.plan.steps if any(w is not None for w in st.kernel.windows)) >= 2


def test_a_kernel_whose_writes_pass_the_buffer_count_is_a_clear_error():
    """Planned against made-up caps (no GPU): BatchNorm's statistics kernel writes 4 buffers."""
    from anygrad.backends.wgpu.fusion.passes import prepare
    from anygrad.backends.wgpu.kernels.kernel import AdapterCaps
    from anygrad.backends.wgpu.planning.planner import make_plan
    from anygrad.errors import DeviceError
    x = np.random.default_rng(0).standard_normal((4, 3, 5, 5)).astype(np.float32)
    graph, _ = op_graph("BatchNormalization", [x, np.ones(3, np.float32), np.zeros(3, np.float32),
                                               np.zeros(3, np.float32), np.ones(3, np.float32)],
                        {"training_mode": 1}, const=(1, 2, 3, 4), n_outputs=3, grad=False)
    caps = AdapterCaps(max_storage_buffers_per_stage=3)
    with pytest.raises(DeviceError, match=r"BatchNormalization node .* binds \d storage buffers \(\d written\); "
                                          r"this adapter's max-storage-buffers-per-shader-stage is 3"):
        make_plan(prepare(graph, caps, set()), caps, set(graph.state_names))


def test_a_profile_lowered_limit_by_limit_from_the_environment(monkeypatch):
    """ANYGRAD_WGPU_LIMITS=webgpu-default:LIMIT=VALUE,... lowers a profile further (CI, tests)."""
    from anygrad.backends.wgpu import WgpuBackend
    from anygrad.backends.wgpu.planning.limits import get_profile
    from anygrad.errors import ConfigError
    monkeypatch.setenv("ANYGRAD_WGPU_LIMITS", "webgpu-default:max-storage-buffers-per-shader-stage=4,"
                                              "max-storage-buffer-binding-size=64KiB")
    prof = get_profile(None)
    assert prof.max_storage_buffers_per_shader_stage == 4 and prof.max_storage_buffer_binding_size == 65536
    backend = WgpuBackend("wgpu")
    assert backend.device.limits["max-storage-buffers-per-shader-stage"] == 4
    assert backend.caps.max_storage_binding_size == 65536
    with pytest.raises(ConfigError, match="override 'max-bogus=3': write LIMIT=VALUE"):
        get_profile("webgpu-default:max-bogus=3")
