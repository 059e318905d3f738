"""The wgpu planner's adapter-limit errors, planned against made-up limits: no GPU needed.

make_plan only decides (kernels, storage, slots), so an AdapterCaps with small limits stands in
for a small adapter, and the error it raises is checked for what a user needs: which value or
parameter is too large, whether a smaller batch helps, and which batch then fits.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from wgpu_util import make_graph

from anygrad.backends.wgpu.fusion.passes import prepare
from anygrad.backends.wgpu.kernels.kernel import AdapterCaps
from anygrad.backends.wgpu.planning.planner import make_plan
from anygrad.errors import DeviceError
from anygrad.ir import Graph, Node

F32 = np.dtype(np.float32)


def _plan(g: Graph, caps: AdapterCaps, fuse: bool = True):
    return make_plan(prepare(g, caps, set(), fuse=fuse), caps, set(g.buffers) | set(g.state_names))


def _exp(batch: int, width: int = 1000, dtype=F32, op: str = "Exp") -> Graph:
    nodes = [Node(op, ["x"], ["y"])] if dtype == F32 else \
        [Node("Cast", ["x"], ["xf"], {"to": 1}), Node(op, ["xf"], ["y"])]
    return make_graph(nodes, ["x"], ["y"], {"x": (dtype, (batch, width))})


def test_batch_scaled_value_names_the_largest_batch_that_fits():
    caps = AdapterCaps(max_storage_binding_size=100_000)  # 25 samples of 1000 floats
    with pytest.raises(DeviceError, match=r"at batch 64 .* largest batch that fits is about 25") as e:
        _plan(_exp(64, op="Transpose"), caps)
    assert "needs 250 KiB" in str(e.value)
    assert "max-storage-buffer-binding-size is 100000 bytes" in str(e.value)  # the limit exactly
    _plan(_exp(25, op="Transpose"), caps)  # the number it names does fit
    with pytest.raises(DeviceError):
        _plan(_exp(26, op="Transpose"), caps)


def test_packed_byte_input_counts_its_batch_not_its_words():
    """A uint8 batch is uploaded as u32 words (shape (batch*width/4,)): the batch is still 64."""
    caps = AdapterCaps(max_storage_binding_size=100_000)
    with pytest.raises(DeviceError, match=r"at batch 64 .* about 25"):
        _plan(_exp(64, dtype=np.dtype(np.uint8), op="Transpose"), caps)


def test_mib_figures_never_read_as_equal():
    """Just over a 128 MiB limit says 128.1 MiB, not 'needs 128 MiB but ... is 128 MiB'; a limit
    of 2 GiB - 1 byte reads so, as `anygrad devices` writes it."""
    rows = (128 << 20) // (4 * 1024) + 1  # 128 MiB + 4 KiB of float32 rows of 1024
    with pytest.raises(DeviceError, match=r"needs 128\.1 MiB at batch .* is 128 MiB\."):
        _plan(_exp(rows, 1024, op="Transpose"), AdapterCaps(max_storage_binding_size=128 << 20))
    with pytest.raises(DeviceError, match=r"needs 2048\.1 MiB at batch .* is 2 GiB - 1 byte\."):
        _plan(_exp(2 * rows * 8, 1024, op="Transpose"), AdapterCaps(max_storage_binding_size=(2 << 30) - 1))


@pytest.mark.parametrize("as_state", [True, False])
def test_oversized_parameter_says_no_batch_fits(as_state):
    g = make_graph([Node("MatMul", ["x", "w"], ["y"])], ["x"], ["y"], {"x": (F32, (2, 100))},
               {"w": np.zeros((100, 300), np.float32)}, buffers=["w"] if as_state else ())
    with pytest.raises(DeviceError) as e:
        _plan(g, AdapterCaps(max_storage_binding_size=100_000))
    msg = str(e.value)
    assert ("parameter/state tensor 'w'" if as_state else "constant 'w'") in msg
    assert "(100, 300)" in msg and "no batch size fits" in msg and "largest batch" not in msg
    assert "max-storage-buffer-binding-size" in msg and "anygrad devices" in msg


def _founding_step(batch: int, caps: AdapterCaps):
    import anygrad
    from anygrad.examples import FOUNDING_MODEL
    from anygrad.losses import get_loss
    from anygrad.optim import Adagrad
    from anygrad.program import build_train_step
    model = anygrad.load_onnx(FOUNDING_MODEL)
    step = build_train_step(model.graph, {model.input_name: (batch, 1, 28, 28)}, (batch,), get_loss("nll"),
                            Adagrad(lr=0.01))
    return make_plan(prepare(step, caps, set()), caps, set(step.state_names))


def test_training_step_parameter_too_large_is_named():
    """fc1.weight (11616 x 32 floats, 1.42 MiB) lives in a fused optimizer arena; the error names
    the parameter, not the arena, and no batch is suggested (the old hint said 'about 1')."""
    with pytest.raises(DeviceError) as e:
        _founding_step(2, AdapterCaps(max_storage_binding_size=1 << 20))
    msg = str(e.value)
    assert "fc1.weight" in msg and "no batch size fits" in msg and "@arena" not in msg, msg
    assert "largest batch" not in msg


def test_training_step_largest_batch_is_right():
    """The largest activations are conv3's, 24*22*22 = 11616 floats a sample: 90 samples fit 4 MiB,
    91 do not, and the planner agrees at both batch sizes."""
    caps = AdapterCaps(max_storage_binding_size=4 << 20)
    with pytest.raises(DeviceError, match=r"at batch 1000 .* largest batch that fits is about (\d+)") as e:
        _founding_step(1000, caps)
    fit = int(re.search(r"about (\d+)", str(e.value)).group(1))
    assert fit == (4 << 20) // (11616 * 4) == 90
    _founding_step(fit, caps)
    with pytest.raises(DeviceError):
        _founding_step(fit + 1, caps)


def test_workgroup_grid_limit_names_a_batch_when_the_grid_scales():
    # Exp over 64 x 999 (not a multiple of 4: one element per invocation): 250 workgroups of 256;
    # grids fold into 3-D, so 5 per dimension hold 125.
    caps = AdapterCaps(max_workgroups_per_dim=5)
    with pytest.raises(DeviceError, match=r"max-compute-workgroups-per-dimension is 5, .*\(64 now\)\. The "
                                          r"largest batch that fits is about 32") as e:
        _plan(_exp(64, 999), caps, fuse=False)
    assert "Exp node" in str(e.value)
    _plan(_exp(32, 999), caps, fuse=False)
    with pytest.raises(DeviceError):
        _plan(_exp(33, 999), caps, fuse=False)


def test_workgroup_grid_limit_that_does_not_scale_says_what_is_too_large():
    # 999 is not a multiple of 4, so one element per invocation: 391 workgroups
    g = make_graph([Node("Exp", ["w"], ["e"]), Node("ReduceSum", ["e"], ["s"], {"keepdims": 0}),
                Node("Add", ["x", "s"], ["y"])], ["x"], ["y"], {"x": (F32, (2,))},
               {"w": np.zeros((100, 999), np.float32)}, buffers=["w"])
    with pytest.raises(DeviceError) as e:
        _plan(g, AdapterCaps(max_workgroups_per_dim=5), fuse=False)
    msg = str(e.value)
    assert "'e' (100, 999)" in msg and "does not depend on the batch" in msg and "largest batch" not in msg

def test_a_gradient_written_into_its_arena_is_written_before_the_update_reads_it():
    """The fused optimizer update reads each gradient from its arena slice (through its attrs, not
    its inputs). An elementwise node computing a gradient there must not be carried past the
    update by fusion: here its kernel could merge with a same-shape node that comes after the
    update, and was emitted at that node's place, after the update had read the slice."""
    attrs = {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": 0, "maximize": 0}
    nodes = [Node("Mul", ["a", "b"], ["g"]), Node("SGDUpdate", ["p", "g", "lr", "step"], ["p2"], attrs),
             Node("Add", ["c", "d"], ["z"])]
    info = {k: (F32, (4,)) for k in ("a", "b", "c", "d", "g", "z", "p", "p2")} | {"lr": (F32, ()), "step": (F32, ())}
    g = make_graph(nodes, ["a", "b", "c", "d"], ["z"], info, updates={"p2": "p"},
                   inits={"p": np.zeros(4, np.float32), "lr": np.array(0.1, np.float32),
                          "step": np.array(1.0, np.float32)})
    g.params = ["p"]
    g.nodes = sorted(g.nodes, key=lambda n: ["Mul", "SGDUpdate", "Add"].index(n.op))  # the add after the update
    out = prepare(g, AdapterCaps(), set())
    ops = [(n.op, n.outputs) for n in out.nodes]
    writer = next(k for k, (_, outs) in enumerate(ops) if "g" in outs)
    update = next(k for k, (op, _) in enumerate(ops) if op == "wgpu.FusedUpdate")
    assert writer < update, ops
