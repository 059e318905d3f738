"""A backend object holds one Model's training state: state lives on a backend by name and a
compile initialises only what it lacks, so a second model compiled on the same object used to
start from the first one's optimizer state (its momentum buffers and step count), silently."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from wgpu_util import wgpu_backend

import anygrad
from anygrad import nn
from anygrad.backends.numpy import NumpyBackend
from anygrad.errors import ConfigError

RNG = np.random.default_rng(0)
X = RNG.standard_normal((16, 8)).astype(np.float32)
Y = RNG.integers(0, 4, 16)


@pytest.fixture(scope="module")
def base():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to_model(input_shape=(None, 8))


def _losses(base, device, steps: int = 4) -> list[float]:
    m = anygrad.Model(base.graph.copy()).compile("cross_entropy", anygrad.optim.SGD(lr=0.1, momentum=0.9),
                                                 device=device)
    return [m.train_on_batch(X, Y) for _ in range(steps)]


@pytest.mark.parametrize("make", [NumpyBackend, pytest.param(wgpu_backend, marks=pytest.mark.wgpu)],
                         ids=["numpy", "wgpu"])
def test_a_model_after_another_on_one_backend_trains_as_on_a_fresh_one(base, make):
    shared = make()
    first = _losses(base, shared)
    gc.collect()  # the first model is gone; its state on the backend must not seed the next one
    assert _losses(base, shared) == first == _losses(base, make())


def test_two_live_models_cannot_share_a_backend_object(base):
    shared = NumpyBackend()
    keep = anygrad.Model(base.graph.copy()).compile("cross_entropy", device=shared)
    keep.train_on_batch(X, Y)
    with pytest.raises(ConfigError, match="already holds another Model's training state"):
        anygrad.Model(base.graph.copy()).compile("cross_entropy", device=shared)
    keep.compile("cross_entropy", device=shared)  # the same model again: its own backend
