"""1-byte graph inputs (uint8 images, int8, bool) go to the device as stored, four per u32 word, and
are unpacked by the kernels that read them: the in-graph normalisation of uint8 batches gives the
numpy backend's values to float32 rounding (a GPU may divide by a reciprocal), a whole founding-model training step from uint8 batches matches
numpy, and a batch uploads x.nbytes rounded up to 4 bytes (not 4 bytes per pixel)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wgpu_util import wgpu_backend

import anygrad
from anygrad.backends import NumpyBackend
from anygrad.backends.wgpu.fusion.passes import packed_name
from anygrad.data.graph_input import add_input_normalisation
from anygrad.examples import FOUNDING_MODEL
from anygrad.ir import Graph, Node, TensorInfo, specialize
from anygrad.model import Model
from anygrad.ops._util import ONNX_CODES
from anygrad.optim import SGD

pytestmark = pytest.mark.wgpu
MNIST = ((0.1307,), (0.3081,))


@pytest.fixture(scope="module")
def wb():
    return wgpu_backend()


def _words(nbytes: int) -> int:
    return -(-nbytes // 4) * 4


def _assert_uploaded_packed(exe, name: str, x: np.ndarray) -> None:
    """The input's device buffer holds x's bytes, and one run wrote exactly those (whole words)."""
    to = exe.feed_to[name]
    assert to == packed_name(name) and to in exe.inputs
    assert exe.input_bytes[name] == _words(x.nbytes)
    assert exe.plan.nbytes[exe.plan.root_of[to]] == max(4, _words(x.nbytes))
    assert exe.inputs[to].size == -(-max(4, _words(x.nbytes)) // 16) * 16  # create_buffer's 16-byte rounding


def _normalisation_graph(shape: tuple, mean, std) -> tuple[Graph, str]:
    """The prologue add_input_normalisation puts in front of a model (here an Identity model)."""
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype(np.float32), ("N", *shape[1:]))
    g.nodes = [Node("Identity", ["x"], ["y"])]
    model = add_input_normalisation(Model(g, "identity"), mean, std)
    name = model.graph.inputs[0]
    return specialize(model.graph, {name: shape}), name


@pytest.mark.parametrize("shape,stats", [((3, 1, 5, 7), MNIST), ((1000, 1, 28, 28), MNIST),
                                         ((2, 3, 3, 3), ((0.49, 0.48, 0.45), (0.25, 0.24, 0.26)))])
@pytest.mark.parametrize("fuse", [True, False])
def test_uint8_normalisation_matches_numpy(wb, shape, stats, fuse):
    graph, name = _normalisation_graph(shape, *stats)
    x = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    x.reshape(-1)[:2] = (0, 255)
    want = NumpyBackend().compile(graph).run({name: x})
    exe = wb.compile(graph, fuse=fuse)
    got = exe.run({name: x})
    assert got["y"].dtype == np.float32
    np.testing.assert_allclose(got["y"], want["y"], rtol=2e-6, atol=2e-7)
    _assert_uploaded_packed(exe, name, x)
    kernels = [st.kernel.name for st in exe.plan.steps]
    if fuse:  # the unpack is part of the normalisation's one kernel, which reads the packed words
        assert len(kernels) == 1 and "UnpackBytes" in kernels[0]
        assert exe.plan.steps[0].reads[0].name == packed_name(name)
    # The input itself reads back as it was fed; and a second batch overwrites the first.
    np.testing.assert_array_equal(exe.run({name: x}, [name])[name], x)
    x2 = 255 - x
    np.testing.assert_allclose(exe.run({name: x2})["y"], NumpyBackend().compile(graph).run({name: x2})["y"],
                               rtol=2e-6, atol=2e-7)


def _byte_graph(dtype: np.dtype, shape: tuple, wide: int) -> tuple[Graph, dict]:
    """x (1 byte) read by an elementwise chain, by a broadcast into a wider shape, by a
    non-elementwise op (Transpose) and returned as is: every kind of consumer of the unpacked value."""
    rng = np.random.default_rng(len(shape))
    if dtype == np.bool_:
        x = rng.random(shape) < 0.5
    else:
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max + 1, shape).astype(dtype)
    f32 = ONNX_CODES[np.dtype(np.float32)]
    g = Graph(inputs=["x"], outputs=["scaled", "wide", "t", "x"])
    g.info["x"] = TensorInfo(np.dtype(dtype), shape)
    g.initializers["k"] = np.float32(0.5) + rng.standard_normal((wide, *shape)).astype(np.float32)
    g.nodes = [Node("Cast", ["x"], ["xf"], {"to": f32}),
               Node("Mul", ["xf", "xf"], ["sq"]),
               Node("Sub", ["sq", "xf"], ["scaled"]),
               Node("Mul", ["xf", "k"], ["wide"]),
               Node("Transpose", ["x"], ["t"], {"perm": list(range(len(shape)))[::-1]})]
    return specialize(g, {}), {"x": x}


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from([np.uint8, np.int8, np.bool_]),
       shape=st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple),
       wide=st.integers(1, 3), fuse=st.booleans())
def test_byte_inputs_reach_every_kind_of_consumer(wb, dtype, shape, wide, fuse):
    graph, feeds = _byte_graph(np.dtype(dtype), shape, wide)
    want = NumpyBackend().compile(graph).run(feeds)
    exe = wb.compile(graph, fuse=fuse)
    got = exe.run(feeds)
    for k, w in want.items():
        assert got[k].dtype == w.dtype, k
        np.testing.assert_array_equal(got[k], w, err_msg=k)
    _assert_uploaded_packed(exe, "x", feeds["x"])


def test_wider_inputs_are_not_packed(wb):
    g = Graph(inputs=["x", "i"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype(np.float32), (5,))
    g.info["i"] = TensorInfo(np.dtype(np.int64), (5,))
    g.nodes = [Node("Cast", ["i"], ["f"], {"to": ONNX_CODES[np.dtype(np.float32)]}), Node("Add", ["x", "f"], ["y"])]
    exe = wb.compile(specialize(g, {}))
    x, i = np.arange(5, dtype=np.float32), np.arange(5) * 3
    np.testing.assert_array_equal(exe.run({"x": x, "i": i})["y"], x + i)
    assert exe.feed_to == {"x": "x", "i": "i"} and exe.input_bytes == {"x": 20, "i": 20}


# -- a whole training step of the founding model from uint8 batches --------------------------------
def _batches(steps: int, batch: int = 6):
    rng = np.random.default_rng(1)
    for _ in range(steps):
        yield (rng.integers(0, 256, (batch, 1, 28, 28), dtype=np.uint8),
               rng.integers(0, 10, batch).astype(np.int64))


def _train(device, steps: int):
    model = add_input_normalisation(anygrad.load_onnx(str(FOUNDING_MODEL)), *MNIST)
    model.compile(loss="nll", optimizer=SGD(lr=0.05, momentum=0.9), device=device, seed=3)
    return model, [model.train_on_batch(x, y) for x, y in _batches(steps)]


def test_founding_model_trains_from_uint8_batches_like_numpy(wb):
    mw, lw = _train(wb, 2)
    mn, ln = _train(NumpyBackend(), 2)
    np.testing.assert_allclose(lw, ln, rtol=1e-4, atol=1e-4)
    sw, sn = mw.state_dict(), mn.state_dict()
    assert set(sw) == set(sn)
    for name in sn:
        np.testing.assert_allclose(sw[name], sn[name], rtol=1e-4, atol=1e-4, err_msg=name)
    assert mw.read_metrics() == pytest.approx(mn.read_metrics(), rel=1e-5)
    (exe,) = [e for k, e in mw._programs.items() if k[0] == "train"]
    x, _ = next(_batches(1))
    _assert_uploaded_packed(exe, mw.graph.inputs[0], x)
    # Normalisation and unpacking are one kernel reading the packed batch.
    (first,) = [st for st in exe.plan.steps if any(r.name == packed_name(mw.graph.inputs[0]) for r in st.reads)]
    assert "UnpackBytes" in first.kernel.name and "Div" in first.kernel.name
    np.testing.assert_allclose(mw.predict(x), mn.predict(x), rtol=1e-4, atol=1e-4)
