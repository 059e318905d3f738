"""Slices of one value that tile an axis get one Concat as their gradient (ops/shape.py
merge_slice_grads, applied by autodiff): no SliceGrad zero-fill + Add. Checked against PyTorch
(numpy backend) and wgpu (lavapipe) against numpy."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from wgpu_util import assert_close, has_adapter, make_graph, no_adapter, run_both

from anygrad.autodiff import gradients
from anygrad.backends import NumpyBackend
from anygrad.ir import Node, infer_shapes

I64 = np.int64
# (start, end) per slice on the last axis of a (2, 3, 9) input
CASES = {"qkv": [(0, 3), (3, 6), (6, 9)], "gap": [(6, 9), (0, 2)], "overlap": [(0, 5), (3, 9)],
         "one": [(2, 7)]}


def _graph(bounds):
    nodes, inits, terms = [], {}, []
    rng = np.random.default_rng(0)
    for k, (s, e) in enumerate(bounds):
        inits |= {f"s{k}": np.array([s], I64), f"e{k}": np.array([e], I64), f"a{k}": np.array([-1], I64),
                  f"r{k}": rng.standard_normal((2, 3, e - s)).astype(np.float32)}
        nodes += [Node("Slice", ["x", f"s{k}", f"e{k}", f"a{k}"], [f"p{k}"], {}),
                  Node("Mul", [f"p{k}", f"p{k}"], [f"sq{k}"], {}),   # a nonlinear use of each part
                  Node("Mul", [f"sq{k}", f"r{k}"], [f"m{k}"], {}),
                  Node("ReduceSum", [f"m{k}"], [f"l{k}"], {"keepdims": 0})]
        terms.append(f"l{k}")
    for k in range(1, len(terms)):
        nodes.append(Node("Add", [terms[k - 1], terms[k]], [f"t{k}"], {}))
        terms[k] = f"t{k}"
    g = make_graph(nodes, ["x"], [terms[-1]], {"x": (np.float32, (2, 3, 9))}, inits)
    (dx,) = gradients(g, terms[-1], ["x"]).values()
    g.outputs.append(dx)
    infer_shapes(g)
    return g, inits, dx


def _torch_grad(bounds, inits, x):
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    loss = sum((t[..., s:e] ** 2 * torch.tensor(inits[f"r{k}"], dtype=torch.float64)).sum()
               for k, (s, e) in enumerate(bounds))
    loss.backward()
    return t.grad.numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_matches_torch_and_uses_one_concat(case):
    bounds = CASES[case]
    g, inits, dx = _graph(bounds)
    ops = collections.Counter(n.op for n in g.nodes)
    if case in ("qkv", "gap"):
        assert ops["SliceGrad"] == 0 and ops["Concat"] == 1
    else:  # overlapping slices, or just one: the zero-fill scatter stays
        assert ops["SliceGrad"] == len(bounds) and ops["Concat"] == 0
    x = np.random.default_rng(1).standard_normal((2, 3, 9)).astype(np.float32)
    got = NumpyBackend().compile(g).run({"x": x})[dx]
    np.testing.assert_allclose(got, _torch_grad(bounds, inits, x), rtol=1e-5, atol=1e-5)


@pytest.mark.wgpu
@pytest.mark.parametrize("case", ["qkv", "gap"])
def test_wgpu_matches_numpy(case):
    if not has_adapter():
        no_adapter()
    g, _, _ = _graph(CASES[case])
    x = np.random.default_rng(2).standard_normal((2, 3, 9)).astype(np.float32)
    want, got, _ = run_both(g, {"x": x})
    assert_close(want, got)
