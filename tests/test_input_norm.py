"""The IR pass ir/input_norm.py on a bare Graph (no Model): uint8 in, per-channel normalisation in
the graph, checked against numpy float64; and taken out again for exports."""
import numpy as np
import pytest

from anygrad.backends import NumpyBackend
from anygrad.errors import ConfigError
from anygrad.ir import Graph, Node, TensorInfo, specialize
from anygrad.ir.input_norm import (
    add_input_normalisation,
    can_normalise_in_graph,
    find_input_normalisation,
    input_statistics,
    without_input_normalisation,
)


def _identity(shape: tuple) -> Graph:
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype(np.float32), shape)
    g.nodes = [Node("Identity", ["x"], ["y"])]
    return g


def test_the_pass_normalises_uint8_per_channel_like_float64():
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    g = _identity(("N", 3, 4, 5))
    assert can_normalise_in_graph(g, mean)
    assert add_input_normalisation(g, mean, std) is g
    assert g.info[g.inputs[0]].dtype == np.uint8 and input_statistics(g) == (mean, std)
    x = np.random.default_rng(0).integers(0, 256, (2, 3, 4, 5), dtype=np.uint8)
    spec = specialize(g, {g.inputs[0]: (2, 3, 4, 5)})
    got = NumpyBackend().compile(spec).run({g.inputs[0]: x})["y"]
    want = (x / 255.0 - np.reshape(mean, (1, 3, 1, 1))) / np.reshape(std, (1, 3, 1, 1))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_without_the_prologue_the_graph_is_the_float_one_again():
    g = _identity(("N", 784))
    add_input_normalisation(g, [0.1307], [0.3081])
    plain = without_input_normalisation(g)
    assert plain.inputs == ["x"] and [n.op for n in plain.nodes] == ["Identity"]
    assert find_input_normalisation(plain) is None and without_input_normalisation(plain) is plain
    assert find_input_normalisation(g) is not None  # the original keeps its prologue


@pytest.mark.parametrize("mean, std, message", [([0.5, 0.5], [0.5, 0.5], "one mean/std per channel"),
                                                ([0.5], [0.0], "std must be positive")])
def test_bad_statistics_are_refused(mean, std, message):
    with pytest.raises(ConfigError, match=message):
        add_input_normalisation(_identity(("N", 3, 4, 4)), mean, std)
