"""Check one op's forward and gradients against a PyTorch reference computed in float64.

    check_op("Conv", [x, w, b], {"pads": [1, 1, 1, 1]}, lambda x, w, b: F.conv2d(x, w, b, padding=1))

Float inputs become graph inputs and get gradients compared; other inputs (int64 shapes, axes) and
the slots listed in `const` become constant initializers. The loss is sum(output * R) with a fixed
random R, so every output element's gradient matters.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from anygrad.autodiff import gradients
from anygrad.backends import NumpyBackend
from anygrad.ir import Builder, Graph, Node, TensorInfo, specialize


def run_op(op: str, inputs: Sequence[np.ndarray | None], attrs: dict | None = None, *, const: Sequence[int] = (),
           n_outputs: int = 1, grad: bool = True, seed: int = 0):
    """Run one op (and its gradient of sum(out0 * R)) on the numpy backend.

    Returns (outputs, grads by input index, R)."""
    g = Graph(name=op)
    names = []
    diff = []
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        a = np.asarray(a)
        if np.issubdtype(a.dtype, np.floating) and i not in const:
            g.inputs.append(name)
            g.info[name] = TensorInfo(a.dtype, a.shape)
            diff.append(i)
        else:
            g.initializers[name] = a
    outs = [f"out{k}" for k in range(n_outputs)]
    g.nodes = [Node(op, names, outs, dict(attrs or {}), name="op")]
    g.outputs = list(outs)
    s = specialize(g, {})
    rng = np.random.default_rng(seed)
    r = None
    grad_names = {}
    if grad and diff:
        b = Builder(s, prefix="check")
        r = rng.standard_normal(b.shape("out0")).astype(np.float32)
        loss = b.op("ReduceSum", [b.op("Mul", ["out0", b.const(r)])], keepdims=0)
        gr = gradients(s, loss, [f"in{i}" for i in diff])
        grad_names = {i: gr[f"in{i}"] for i in diff}
        s.outputs = outs + list(grad_names.values())
    feeds = {f"in{i}": np.asarray(inputs[i]) for i in diff}
    res = NumpyBackend().compile(s).run(feeds)
    return [res[o] for o in outs], {i: res[n] for i, n in grad_names.items()}, r


def check_op(op: str, inputs: Sequence[np.ndarray | None], attrs: dict | None, torch_fn: Callable,
             *, const: Sequence[int] = (), grad: bool = True, rtol: float = 1e-4, atol: float = 1e-5,
             n_outputs: int = 1, seed: int = 0) -> None:
    """Assert forward (output 0) and gradients match torch_fn evaluated in float64."""
    outs, grads, r = run_op(op, inputs, attrs, const=const, n_outputs=n_outputs, grad=grad, seed=seed)
    tensors = []
    for i, a in enumerate(inputs):
        if a is None:
            tensors.append(None)
        elif i in grads:
            tensors.append(torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=True))
        else:
            tensors.append(torch.tensor(np.asarray(a)))
    expected = torch_fn(*tensors)
    if isinstance(expected, (tuple, list)):
        expected = expected[0]
    np.testing.assert_allclose(outs[0], expected.detach().numpy(), rtol=rtol, atol=atol,
                               err_msg=f"{op} forward")
    if grads:
        (expected * torch.tensor(r, dtype=expected.dtype)).sum().backward()
        for i, got in grads.items():
            want = tensors[i].grad
            want = np.zeros_like(got) if want is None else want.numpy()
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * max(1.0, float(np.abs(want).max(initial=0))),
                                       err_msg=f"{op} gradient of input {i}")
