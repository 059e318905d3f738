"""Where a training step consumes its gradients (issue 13, memory): a float16 weight gradient is
widened and unscaled, and an accumulated gradient added to its sum, right where the backward pass
makes it (Graph.hoist), not after the whole backward. The order changes no bit on the numpy
backend, and the wgpu planner (planning only, no adapter) places fewer bytes."""
from __future__ import annotations

import numpy as np
import pytest

import anygrad
from anygrad import nn
from anygrad.ir.graph import Graph, Node
from anygrad.losses import get_loss
from anygrad.program import build_train_step

BATCH = 16


def _net() -> anygrad.Model:
    rng = np.random.default_rng(0)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(64 * 8 * 8, 10))
    net.load_state_dict({k: (0.1 * rng.standard_normal(np.shape(v))).astype(np.float32)
                         if k.endswith(("weight", "bias")) else np.array(v) for k, v in net.state_dict().items()})
    return net.to_model(input_shape=(None, 3, 8, 8))


def _step(precision: str, phase: str, hoisted: bool, monkeypatch) -> Graph:
    with monkeypatch.context() as m:
        if not hoisted:
            m.setattr(Graph, "hoist", lambda self, values: None)
        g = _net().graph
        return build_train_step(g, {g.inputs[0]: (BATCH, 3, 8, 8)}, (BATCH,), get_loss("cross_entropy"),
                                anygrad.optim.SGD(lr=0.05, momentum=0.9), precision=precision,
                                accumulate=1 if phase == "step" else 2, phase=phase)


def _run(step: Graph, seed: int = 1) -> dict[str, np.ndarray]:
    """Outputs and state updates of one step on the numpy backend, from the step's own initial
    state (accumulated gradients made nonzero so their sums are exercised)."""
    from anygrad.backends import NumpyBackend
    rng = np.random.default_rng(seed)
    nb = NumpyBackend()
    for name in step.state_names:
        value = np.asarray(step.initializers[name])
        if name.startswith("accum."):
            value = (0.01 * rng.standard_normal(value.shape)).astype(value.dtype)
        nb.set_state(name, value)
    feeds = {step.inputs[0]: rng.standard_normal((BATCH, 3, 8, 8)).astype(np.float32),
             step.inputs[1]: rng.integers(0, 10, BATCH).astype(np.int64)}
    out = nb.compile(step).run(feeds, list(step.outputs))
    out.update({t: nb.get_state(t) for t in step.state_updates.values()})
    return out


def _planned_activations(step: Graph) -> int:
    """Activation bytes as the wgpu backend plans the step: fused, gradients in their arenas."""
    from anygrad.backends.wgpu.fusion.passes import prepare
    from anygrad.backends.wgpu.kernels.kernel import AdapterCaps, ops_where
    from anygrad.backends.wgpu.planning.planner import fit_plan, memory_report
    caps = AdapterCaps(has_f16=True, is_cpu=False, max_storage_binding_size=1 << 30)
    _, plan, _ = fit_plan(step.copy(), caps, set(step.state_names),
                          lambda g: prepare(g, caps, ops_where("epilogue")))
    return memory_report(plan).activations


@pytest.mark.parametrize("precision, phase, unscaled", [("f16", "step", True), ("f32", "apply", False),
                                                         ("f16", "apply", True)])
def test_gradients_are_consumed_where_they_are_made(precision, phase, unscaled, monkeypatch):
    hoisted, late = (_step(precision, phase, flag, monkeypatch) for flag in (True, False))
    producer = {o: k for k, n in enumerate(hoisted.nodes) for o in n.outputs}
    consumers, made = [], set()   # unscaling Muls and accumulating Adds, of a gradient or of each other
    for n in hoisted.nodes:
        if n.name.startswith("optim.") and n.op in ("Mul", "Add") and any(
                i.startswith("grad.") or i in made for i in n.inputs):
            consumers.append(n)
            made.update(n.outputs)
    assert len(consumers) >= len(hoisted.params)
    ids = {id(n) for n in consumers}
    for n in consumers:   # each runs right after its gradient is made (after its siblings, at most)
        grad = next(i for i in n.inputs if i.startswith("grad.") or i in made)
        between = hoisted.nodes[producer[grad] + 1:producer[n.outputs[0]]]
        assert all(id(m) in ids for m in between), n.label
    if unscaled:
        assert any(n.op == "Mul" for n in consumers)
    assert [n.label for n in hoisted.nodes] != [n.label for n in late.nodes]
    ours, theirs = _run(hoisted), _run(late)
    assert ours.keys() == theirs.keys()
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    assert _planned_activations(hoisted) < _planned_activations(late)


def test_hoist_moves_a_chain_and_keeps_the_rest_in_order():
    g = Graph(inputs=["x", "s"], outputs=["e", "h"])
    g.nodes = [Node("Relu", ["x"], ["a"], name="a"), Node("Neg", ["a"], ["b"], name="b"),
               Node("Exp", ["b"], ["c"], name="c"), Node("Reciprocal", ["s"], ["inv"], name="inv"),
               Node("Mul", ["a", "inv"], ["h"], name="h"), Node("Add", ["c", "b"], ["e"], name="e")]
    g.hoist(["inv", "h"])
    assert [n.name for n in g.nodes] == ["inv", "a", "h", "b", "c", "e"]
    g.hoist(["nothing"])
    assert [n.name for n in g.nodes] == ["inv", "a", "h", "b", "c", "e"]


@pytest.mark.parametrize("phase", ["step", "apply"])
def test_a_group_that_frees_a_gradient_keeps_its_place(phase, monkeypatch):
    """Horizontal fusion (elementwise._merge_siblings) does not move the kernel that widens and unscales a
    float16 weight gradient to a later sibling's place, which would hold that gradient across the
    kernels in between: each runs before the next convolution gradient. (The threshold is lowered
    to this small net's gradients; with no threshold the two 64x64 convolutions' kernels merge.)"""
    from anygrad.backends.wgpu.fusion import elementwise, passes
    from anygrad.backends.wgpu.kernels.kernel import AdapterCaps, ops_where
    caps = AdapterCaps(has_f16=True, is_cpu=False, max_storage_binding_size=1 << 30)
    step = _step("f16", phase, True, monkeypatch)

    def held_across_a_convolution(limit: int) -> list[str]:
        monkeypatch.setattr(elementwise, "MERGE_FREES_BELOW", limit)
        g = passes.prepare(step.copy(), caps, ops_where("epilogue"))
        made = {o: k for k, n in enumerate(g.nodes) if n.op == "ConvGradWeight" for o in n.outputs}
        readers = [(made[v], k) for k, n in enumerate(g.nodes) if n.op != "ConvGradWeight"
                   for v in n.inputs if v in made]
        assert len(readers) >= 4
        return [g.nodes[last].name for first, last in readers
                if any(n.op.startswith("ConvGrad") for n in g.nodes[first + 1:last])]
    assert held_across_a_convolution(4096) == []
    assert held_across_a_convolution(1 << 62)
