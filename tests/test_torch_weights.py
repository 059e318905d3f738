"""PyTorch weights in and out of models imported from ONNX (anygrad.frontends.torch_weights,
anygrad.from_torch). PyTorch is the reference: its eval output with the same weights."""
from __future__ import annotations

import importlib.util
import itertools
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import torch.nn.functional as F
from zoo_util import zoo_modules

import anygrad
from anygrad.errors import AnygradError, ModelError
from anygrad.examples import FOUNDING_MODEL

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "mnist"
TOL = 1e-5


def _export_module():
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec = importlib.util.spec_from_file_location("mnist_export_tw", EXAMPLE / "export.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLE))


export_mod = _export_module()
Net = export_mod.Net


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


@pytest.fixture(scope="module")
def onnx_files(tmp_path_factory) -> dict[str, Path]:
    """The packaged founding model, and the same Net exported by both exporters (training mode)."""
    folder = tmp_path_factory.mktemp("onnx")
    files = {"packaged": FOUNDING_MODEL}
    for name, dynamo in (("torchscript", False), ("dynamo", True)):
        files[name] = folder / f"{name}.onnx"
        quiet(export_mod.export, files[name], dynamo=dynamo, seed=0)
    return files


def reference_net(seed: int = 7) -> Net:
    """A Net unlike the exported one (other seed, non-trivial BatchNorm statistics), in eval mode."""
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        for bn in (net.norm1, net.norm2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.num_batches_tracked.fill_(5)
    return net.eval()


def torch_out(net: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return net.eval()(torch.from_numpy(x)).numpy()


def images(n: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 1, 28, 28)).astype(np.float32)


def fresh(path: Path) -> anygrad.Model:
    return anygrad.load_onnx(path, init="fresh", seed=3)


def as_numpy(sd) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in sd.items()}


# -- loading ----------------------------------------------------------------------------------------
WRITERS = {
    "zip": lambda sd, p: torch.save(sd, p),
    "legacy": lambda sd, p: torch.save(sd, p, _use_new_zipfile_serialization=False),
    "wrapped": lambda sd, p: torch.save({"model": sd, "epoch": 3}, p),
    "safetensors": lambda sd, p: safetensors.torch.save_file(sd, p),
    "npz": lambda sd, p: np.savez(p, **as_numpy(sd)),
}
SUFFIX = {"safetensors": ".safetensors", "npz": ".npz"}


@pytest.mark.parametrize("fmt", list(WRITERS))
@pytest.mark.parametrize("which", ["packaged", "torchscript", "dynamo"])
def test_load_file_matches_pytorch(onnx_files, tmp_path, which, fmt):
    net = reference_net()
    path = tmp_path / f"weights{SUFFIX.get(fmt, '.pt')}"
    WRITERS[fmt](net.state_dict(), path)
    model = fresh(onnx_files[which])
    result = model.load_state_dict(path)
    assert result.missing == result.unexpected == result.mismatched == []
    assert len(result.loaded) == 18  # 14 params + 4 running stats; num_batches_tracked accepted
    x = images()
    model.compile(loss="nll")
    np.testing.assert_allclose(model.predict(x), torch_out(net, x), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["tensors", "numpy", "wrapped tensors", "module. prefix"])
def test_load_dict_values(onnx_files, kind):
    net = reference_net()
    sd = net.state_dict()
    given = {"tensors": sd, "numpy": as_numpy(sd), "wrapped tensors": {"state_dict": sd, "step": 9},
             "module. prefix": {f"module.{k}": v for k, v in sd.items()}}[kind]
    model = fresh(onnx_files["packaged"]).compile(loss="nll")
    model.load_state_dict(given)
    x = images()
    np.testing.assert_allclose(model.predict(x), torch_out(net, x), atol=TOL, rtol=0)


def test_key_picks_the_checkpoint_entry(onnx_files, tmp_path):
    net = reference_net()
    torch.save({"model": Net().state_dict(), "ema": net.state_dict()}, tmp_path / "ckpt.pt")
    model = fresh(onnx_files["packaged"]).compile(loss="nll")
    model.load_state_dict(tmp_path / "ckpt.pt", key="ema")
    x = images()
    np.testing.assert_allclose(model.predict(x), torch_out(net, x), atol=TOL, rtol=0)


def test_load_after_compile_updates_device_state(onnx_files):
    """Programs compiled and run before the load see the new weights (backend state and graph)."""
    net = reference_net()
    model = fresh(onnx_files["torchscript"]).compile(loss="nll")
    x = images()
    before = model.predict(x)
    model.load_state_dict(net.state_dict())
    after = model.predict(x)
    assert np.abs(before - after).max() > 1e-2
    np.testing.assert_allclose(after, torch_out(net, x), atol=TOL, rtol=0)
    np.testing.assert_array_equal(model.graph.initializers["conv1.weight"], net.conv1.weight.detach().numpy())


@pytest.mark.wgpu
def test_load_into_compiled_wgpu_model():
    from wgpu_util import wgpu_backend
    net = reference_net()
    model = fresh(FOUNDING_MODEL).compile(loss="nll", device=wgpu_backend())
    x = images(2)
    model.predict(x)
    model.load_state_dict(net.state_dict())
    np.testing.assert_allclose(model.predict(x), torch_out(net, x), atol=TOL, rtol=0)


def broken_state_dict() -> dict[str, torch.Tensor]:
    sd = dict(reference_net().state_dict())
    del sd["fc2.bias"]
    sd["extra.weight"] = torch.zeros(3)
    sd["fc1.weight"] = torch.zeros(32, 100)
    return sd


@pytest.mark.parametrize("which", ["packaged", "dynamo"])
def test_strict_lists_every_problem_and_loads_nothing(onnx_files, which):
    model = fresh(onnx_files[which])
    before = model.state_dict()
    with pytest.raises(ModelError) as err:
        model.load_state_dict(broken_state_dict())
    msg = str(err.value)
    for expected in ("missing (1): fc2.bias (10)", "unexpected (1): extra.weight (3)",
                     "mis-shaped (1): fc1.weight: checkpoint has (32, 100), the model needs (32, 11616)",
                     "strict=False"):
        assert expected in msg, msg
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_non_strict_loads_what_matches(onnx_files):
    model = fresh(onnx_files["packaged"])
    before = model.state_dict()
    result = model.load_state_dict(broken_state_dict(), strict=False)
    assert result.missing == ["fc2.bias"] and result.unexpected == ["extra.weight"]
    assert result.mismatched == ["fc1.weight"]
    state, ref = model.state_dict(), reference_net().state_dict()
    for k in ("fc2.bias", "fc1.weight"):
        np.testing.assert_array_equal(state[k], before[k])
    for k in ("conv1.weight", "norm2.running_var", "fc2.weight"):
        np.testing.assert_array_equal(state[k], ref[k].numpy())


def test_nothing_matching_is_an_error_even_when_not_strict(onnx_files):
    with pytest.raises(ModelError, match="no entry matches"):
        fresh(onnx_files["packaged"]).load_state_dict({"a.weight": np.zeros(3, np.float32)}, strict=False)


@pytest.mark.parametrize("bad", [42, "/nonexistent/weights.pt", {"epoch": 3}])
def test_bad_sources(onnx_files, bad):
    with pytest.raises(ModelError):
        fresh(onnx_files["packaged"]).load_state_dict(bad)


def test_an_onnx_file_as_weights_is_named(onnx_files):
    with pytest.raises(ModelError, match="not a PyTorch checkpoint .* looks like an ONNX model") as e:
        fresh(onnx_files["packaged"]).load_state_dict(FOUNDING_MODEL)
    assert "pickle" not in str(e.value)


# -- names the importer could not record --------------------------------------------------------------
class MLP(torch.nn.Module):
    def __init__(self, widths=(8, 16, 4)):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.relu(x))
        return x


def export_folded(net: torch.nn.Module, path: Path, dynamo: bool) -> Path:
    """A plain eval export: constant folding turns Linear weights into MatMul operands holding
    weight.T, named `onnx::MatMul_12` (TorchScript) or `val_0` (dynamo's optimizer)."""
    quiet(torch.onnx.export, net, (torch.zeros(2, 5, 8),), str(path), dynamo=dynamo, opset_version=17,
          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    return path


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("widths", [(8, 16, 4), (8, 8, 4)], ids=["rect", "square"])
def test_renamed_transposed_weights(tmp_path, dynamo, widths):
    torch.manual_seed(0)
    path = export_folded(MLP(widths), tmp_path / "mlp.onnx", dynamo)
    torch.manual_seed(1)
    net = MLP(widths).eval()
    model = anygrad.load_onnx(path)
    assert not any(k.endswith(".weight") for k in model.graph.params)  # renamed by the exporter
    model.load_state_dict(net.state_dict())
    x = np.random.default_rng(0).standard_normal((3, 5, 8)).astype(np.float32)
    model.compile(loss="mse")
    np.testing.assert_allclose(model.predict(x), torch_out(net, x), atol=TOL, rtol=0)
    # a weights.npz of the graph's own names loads too, and does not unlearn the PyTorch names
    np.savez(tmp_path / "weights.npz", **model.state_dict())
    model.load_state_dict(tmp_path / "weights.npz")
    # ...and the names learnt by the load take the weights back out, transposed back
    back = model.to_torch_state_dict()
    other = MLP(widths)
    other.load_state_dict(back, strict=True)
    np.testing.assert_allclose(torch_out(other, x), torch_out(net, x), atol=TOL, rtol=0)


def test_same_shaped_unnamed_weights_are_ambiguous(tmp_path):
    """Two unnamed (8, 8) weights: shape matching refuses to guess, and says which."""
    torch.manual_seed(0)
    net = MLP((8, 8, 8, 4)).eval()
    model = anygrad.load_onnx(export_folded(net, tmp_path / "mlp.onnx", dynamo=True))
    with pytest.raises(ModelError) as err:
        model.load_state_dict(net.state_dict())
    msg = str(err.value)
    assert "missing (2)" in msg and "unexpected (2): layers.0.weight (8, 8); layers.1.weight (8, 8)" in msg
    assert "ambiguous (2;" in msg and "fits layers.0.weight, layers.1.weight" in msg
    result = model.load_state_dict(net.state_dict(), strict=False)
    assert "layers.2.weight" in result.loaded and len(result.missing) == 2


@pytest.mark.parametrize("which", ["packaged", "torchscript", "dynamo"])
def test_strict_refuses_a_renamed_key(onnx_files, which):
    """A graph tensor that knows its PyTorch name is never paired with another key by shape (the
    only same-shaped leftover here): PyTorch refuses the renamed key, so does anygrad."""
    sd = dict(reference_net().state_dict())
    sd["totally_other.weight"] = sd.pop("fc2.weight")
    with pytest.raises(RuntimeError, match="totally_other.weight"):
        Net().load_state_dict(sd, strict=True)  # the reference
    model = fresh(onnx_files[which])
    before = model.state_dict()["fc2.weight"].copy()
    with pytest.raises(ModelError) as err:
        model.load_state_dict(sd)
    msg = str(err.value)
    assert "missing (1): fc2.weight (10, 32)" in msg and "unexpected (1): totally_other.weight (10, 32)" in msg
    result = model.load_state_dict(sd, strict=False)
    assert result.missing == ["fc2.weight"] and result.unexpected == ["totally_other.weight"]
    np.testing.assert_array_equal(model.state_dict()["fc2.weight"], before)
    # and the name stays certain after a load: the next file cannot rename it either
    with pytest.raises(ModelError, match="missing .1.: fc2.weight"):
        model.load_state_dict(sd)


def test_strict_refuses_a_renamed_key_in_an_nn_model():
    """A model traced from anygrad.nn names its tensors by their PyTorch names: equally certain."""
    class Two(anygrad.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = anygrad.nn.Linear(4, 8), anygrad.nn.Linear(8, 3)

        def forward(self, x):
            return self.fc2(self.fc1(x))

    torch.manual_seed(0)
    ref = torch.nn.Sequential()
    ref.fc1, ref.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
    model = Two().to_model((None, 4))
    sd = dict(ref.state_dict())
    sd["other.weight"] = sd.pop("fc2.weight")
    with pytest.raises(ModelError, match=r"missing \(1\): fc2.weight \(3, 8\)\n  unexpected \(1\): other.weight"):
        model.load_state_dict(sd)
    model.load_state_dict(ref.state_dict())
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(model.compile(loss="mse").predict(x), torch_out(ref, x), atol=TOL, rtol=0)


def rename_state(model: anygrad.Model, rename) -> None:
    """Rename the graph's state tensors (as another exporter version might) and forget the record."""
    g = model.graph
    names = {n: rename(n) for n in g.state_names}
    g.initializers = {names.get(k, k): v for k, v in g.initializers.items()}
    for node in g.nodes:
        node.inputs = [names.get(i, i) for i in node.inputs]
    g.params = [names[p] for p in g.params]
    g.buffers = [names[b] for b in g.buffers]
    model.origin.torch_names = {}


def test_dynamo_placeholder_names(onnx_files):
    net = reference_net()
    model = fresh(onnx_files["dynamo"])
    rename_state(model, lambda n: ("b_" if "running" in n else "p_") + n.replace(".", "_"))
    assert "p_conv1_weight" in model.graph.params
    model.load_state_dict(net.state_dict())
    x = images()
    np.testing.assert_allclose(model.compile(loss="nll").predict(x), torch_out(net, x), atol=TOL, rtol=0)
    assert set(model.to_torch_state_dict(as_numpy=True)) == set(net.state_dict())


def test_unknown_names_export_under_graph_names_with_a_warning(onnx_files):
    model = fresh(onnx_files["packaged"])
    rename_state(model, lambda n: f"w{abs(hash(n))}")
    with pytest.warns(UserWarning, match="no PyTorch name known"):
        sd = model.to_torch_state_dict(as_numpy=True)
    assert set(sd) >= set(model.graph.state_names)


# -- exporting ------------------------------------------------------------------------------------------
def train_a_few_steps(model: anygrad.Model, steps: int = 3) -> None:
    model.compile(loss="nll", optimizer=anygrad.optim.SGD(lr=0.05, momentum=0.9))
    rng = np.random.default_rng(1)
    for _ in range(steps):
        model.train_on_batch(rng.standard_normal((8, 1, 28, 28)).astype(np.float32),
                             rng.integers(0, 10, 8).astype(np.int64))


@pytest.mark.parametrize("which", ["packaged", "torchscript", "dynamo"])
def test_trained_state_dict_loads_into_pytorch(onnx_files, which):
    model = fresh(onnx_files[which])
    model.load_state_dict(reference_net().state_dict())  # num_batches_tracked 5
    train_a_few_steps(model, 3)
    sd = model.to_torch_state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    net = Net()
    net.load_state_dict(sd, strict=True)
    assert int(net.norm1.num_batches_tracked) == int(net.norm2.num_batches_tracked) == 8  # 5 loaded + 3 steps
    assert not np.allclose(net.conv1.weight.detach().numpy(), reference_net().conv1.weight.detach().numpy())
    x = images(5, seed=2)
    np.testing.assert_allclose(model.predict(x), torch_out(net, x), atol=TOL, rtol=0)


def test_num_batches_tracked_counts_steps_without_a_load(onnx_files):
    model = anygrad.load_onnx(onnx_files["torchscript"])
    assert int(model.to_torch_state_dict(as_numpy=True)["norm1.num_batches_tracked"]) == 0
    train_a_few_steps(model, 2)
    sd = model.to_torch_state_dict(as_numpy=True)
    assert sd["norm2.num_batches_tracked"].dtype == np.int64 and int(sd["norm2.num_batches_tracked"]) == 2


def test_save_safetensors_loads_into_pytorch(onnx_files, tmp_path):
    model = fresh(onnx_files["dynamo"])
    model.load_state_dict(reference_net().state_dict())
    train_a_few_steps(model, 2)
    path = model.save_safetensors(tmp_path / "weights.safetensors")
    loaded = safetensors.torch.load_file(str(path))
    assert loaded["norm1.num_batches_tracked"].shape == () and int(loaded["norm1.num_batches_tracked"]) == 7
    net = Net()
    net.load_state_dict(loaded, strict=True)
    x = images(3, seed=4)
    np.testing.assert_allclose(model.predict(x), torch_out(net, x), atol=TOL, rtol=0)
    # and back into a fresh anygrad model, through the same file
    again = fresh(onnx_files["packaged"]).compile(loss="nll")
    again.load_state_dict(path)
    np.testing.assert_allclose(again.predict(x), model.predict(x), atol=TOL, rtol=0)


# -- from_torch -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_from_torch_matches_module(dynamo):
    net = reference_net().train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = anygrad.from_torch(net, torch.zeros(2, 1, 28, 28), dynamo=dynamo)
    assert net.training  # mode and state as they were (tracing in training mode moves BN stats)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    x = images()
    np.testing.assert_allclose(model.compile(loss="nll").predict(x), torch_out(net, x), atol=TOL, rtol=0)


@pytest.mark.parametrize("top", [True, False], ids=["train", "eval"])
def test_from_torch_restores_every_submodule_mode(top):
    net = reference_net().train(top)
    net.norm1.eval()  # a frozen BatchNorm inside a training model, and the other way round
    net.fc2.train()
    modes = {name: m.training for name, m in net.named_modules()}
    assert len(set(modes.values())) == 2
    quiet(anygrad.from_torch, net, torch.zeros(2, 1, 28, 28))
    assert {name: m.training for name, m in net.named_modules()} == modes


def test_from_torch_train_and_back():
    """Train through anygrad, load the result into the module: PyTorch then computes the same."""
    class WithUnused(Net):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Linear(2, 2)  # never called: not in the graph, still in the state_dict

    torch.manual_seed(0)
    net = WithUnused()
    model = anygrad.from_torch(net, torch.zeros(2, 1, 28, 28))
    train_a_few_steps(model, 2)
    net.load_state_dict(model.to_torch_state_dict(), strict=True)
    x = images(3, seed=5)
    np.testing.assert_allclose(model.predict(x), torch_out(net, x), atol=TOL, rtol=0)
    # a training step in PyTorch from there is an ordinary step (the state is complete and usable)
    net.train()
    F.nll_loss(net(torch.from_numpy(x)), torch.zeros(3, dtype=torch.long)).backward()


def test_from_torch_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(AnygradError, match=r"pip install 'anygrad-train\[torch\]'"):
        anygrad.from_torch(object(), None)
    model = anygrad.load_onnx(FOUNDING_MODEL)
    with pytest.raises(AnygradError, match=r"pip install 'anygrad-train\[torch\]'"):
        model.to_torch_state_dict()
    assert "conv1.weight" in model.to_torch_state_dict(as_numpy=True)


def test_from_torch_rejects_non_modules():
    with pytest.raises(AnygradError, match="nn.Module"):
        anygrad.from_torch(lambda x: x, torch.zeros(2, 3))


# -- tied weights (a GPT whose lm_head.weight IS wte.weight) ---------------------------------------------
def _zoo_family(name: str):
    """A family of the model zoo (tests/zoo/zoo_models.py): its GPT ties lm_head to wte."""
    (zoo_models,) = zoo_modules("zoo_models")
    return zoo_models.FAMILIES[name]


GPT_FAMILY = _zoo_family("gpt")
EXPORTERS = {"torchscript": False, "dynamo": True}


def gpt(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = GPT_FAMILY.make()
    assert net.lm_head.weight is net.wte.weight
    return net


def gpt_example() -> torch.Tensor:
    return torch.from_numpy(GPT_FAMILY.batches(1, seed=123)[0][0])


def train_gpt(model: anygrad.Model, steps: int = 3) -> list[float]:
    model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=GPT_FAMILY.lr))
    return [model.train_on_batch(x, y) for x, y in GPT_FAMILY.batches(steps)]


def train_gpt_in_torch(net: torch.nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(net.parameters(), lr=GPT_FAMILY.lr)
    losses = []
    for x, y in GPT_FAMILY.batches(steps):
        opt.zero_grad()
        loss = GPT_FAMILY.torch_loss(net.train()(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_tied_weights_train_and_back(exporter):
    """from_torch -> train -> to_torch_state_dict -> strict load: the tied storage holds the trained
    weight (not the stale copy of the second name), equal to PyTorch training the same module."""
    net = gpt()
    model = quiet(anygrad.from_torch, net, gpt_example(), dynamo=EXPORTERS[exporter])
    graph_name = "lm_head.weight" if EXPORTERS[exporter] else "wte.weight"  # one graph tensor, either name
    assert graph_name in model.param_names and len(model.param_names) == len(list(net.parameters()))
    reference = gpt()
    torch_losses = train_gpt_in_torch(reference)
    losses = train_gpt(model)
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    trained = model.state_dict()[graph_name]
    sd = model.to_torch_state_dict()
    assert set(sd) == set(net.state_dict())
    torch.testing.assert_close(sd["wte.weight"], sd["lm_head.weight"], rtol=0, atol=0)
    net.load_state_dict(sd, strict=True)  # both names, in PyTorch's order of loading
    assert net.lm_head.weight is net.wte.weight
    np.testing.assert_array_equal(net.wte.weight.detach().numpy(), trained)
    np.testing.assert_allclose(trained, reference.wte.weight.detach().numpy(), atol=1e-5, rtol=0)
    assert not np.allclose(trained, gpt().wte.weight.detach().numpy(), atol=1e-4)  # training moved it
    x = GPT_FAMILY.batches(1, seed=9)[0][0]
    np.testing.assert_allclose(model.predict(x), torch_out(net, x), atol=TOL, rtol=0)


WEIGHT_FILES = {
    "pt": lambda sd, p: torch.save(sd, p),
    "legacy": lambda sd, p: torch.save(sd, p, _use_new_zipfile_serialization=False),
    "tensors": None,
    "npz": lambda sd, p: np.savez(p, **as_numpy(sd)),  # copies: ties are told by value
}


@pytest.mark.parametrize("fmt", WEIGHT_FILES)
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_tied_state_dict_loads_strictly_into_the_onnx_file(tmp_path, exporter, fmt):
    """torch.save(gpt.state_dict()) into load_onnx(gpt.onnx) with strict=True (`anygrad train
    --weights`): the second name of the tied tensor is accepted, and exported again."""
    path = tmp_path / "gpt.onnx"
    quiet(anygrad.from_torch, gpt(0), gpt_example(), dynamo=EXPORTERS[exporter], path=path)
    other = gpt(5)
    source = other.state_dict()
    if WEIGHT_FILES[fmt] is not None:
        source = tmp_path / f"gpt.{'npz' if fmt == 'npz' else 'pt'}"
        WEIGHT_FILES[fmt](other.state_dict(), source)
    model = anygrad.load_onnx(path)
    result = model.load_state_dict(source, strict=True)
    assert {"wte.weight", "lm_head.weight"} <= set(result.loaded) and result.unexpected == []
    x = GPT_FAMILY.batches(1, seed=9)[0][0]
    np.testing.assert_allclose(model.compile(loss="cross_entropy").predict(x), torch_out(other, x),
                               atol=TOL, rtol=0)
    train_gpt(model, 2)
    target = gpt(7)
    target.load_state_dict(model.to_torch_state_dict(), strict=True)
    trained = model.state_dict()["lm_head.weight" if EXPORTERS[exporter] else "wte.weight"]
    np.testing.assert_array_equal(target.wte.weight.detach().numpy(), trained)


def test_ties_by_value_need_exact_non_constant_equality(tmp_path):
    """Without storage to compare (.npz, .safetensors), a leftover key is another name of a used one
    only if its values are exactly equal (same shape and dtype) and not all alike."""
    net = reference_net()
    base = as_numpy(net.state_dict())
    cases = {"copy": (base["fc2.weight"].copy(), True),
             "off by one ulp": (np.nextafter(base["fc2.weight"], np.inf), False),
             "float64": (base["fc2.weight"].astype(np.float64), False),
             "constant": (np.ones_like(base["norm2.weight"]), False)}
    for name, (value, tied) in cases.items():
        sd = dict(base, **{"norm2.weight": np.ones_like(base["norm2.weight"])}, extra=value)
        safetensors.numpy.save_file(sd, str(tmp_path / "w.safetensors"))
        model = fresh(FOUNDING_MODEL)
        result = model.load_state_dict(tmp_path / "w.safetensors", strict=False)
        assert (result.unexpected == []) == tied, name
        assert ("extra" in model.to_torch_state_dict(as_numpy=True)) == tied, name
    # a .pt file says which names are one tensor: equal values in separate storages are not tied
    sd = dict(net.state_dict(), extra=net.fc2.weight.detach().clone())
    torch.save(sd, tmp_path / "w.pt")
    with pytest.raises(ModelError, match="unexpected .1.: extra"):
        fresh(FOUNDING_MODEL).load_state_dict(tmp_path / "w.pt")


# -- buffers (register_buffer) stay buffers ---------------------------------------------------------------
class WithBuffers(torch.nn.Module):
    """Float buffers on the gradient path: persistent (`shift`, `pe` in a submodule) and not (`scale`)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("shift", torch.arange(4.0))
        self.register_buffer("scale", torch.full((4,), 0.5), persistent=False)
        self.pos = torch.nn.Module()
        self.pos.register_buffer("pe", torch.randn(3, 4))

    def forward(self, x):
        return self.fc((x - self.shift) * self.scale + self.pos.pe.sum(0))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_from_torch_buffers_are_not_trained(exporter):
    torch.manual_seed(0)
    net = WithBuffers()
    model = quiet(anygrad.from_torch, net, torch.zeros(2, 4), dynamo=EXPORTERS[exporter])
    assert sorted(model.param_names) == ["fc.bias", "fc.weight"]
    assert model.num_parameters() == sum(p.numel() for p in net.parameters())
    reference = WithBuffers()
    reference.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model.compile(loss="mse", optimizer=anygrad.optim.SGD(lr=0.1, momentum=0.9))
    rng = np.random.default_rng(0)
    for _ in range(4):
        x, y = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
        opt.zero_grad()
        loss = F.mse_loss(reference(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        assert abs(model.train_on_batch(x, y) - loss.item()) <= 1e-5
    sd = model.to_torch_state_dict(as_numpy=True)
    assert set(sd) == set(net.state_dict()) == {"fc.weight", "fc.bias", "shift", "pos.pe"}
    for k, v in reference.state_dict().items():
        np.testing.assert_allclose(sd[k], v.numpy(), atol=1e-6, rtol=0, err_msg=k)
    np.testing.assert_array_equal(sd["shift"], net.shift.numpy())  # unchanged, bit for bit
    np.testing.assert_array_equal(sd["pos.pe"], net.pos.pe.numpy())
    assert not np.allclose(sd["fc.weight"], net.fc.weight.detach().numpy())
    back = WithBuffers()
    back.load_state_dict(model.to_torch_state_dict(), strict=True)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(model.predict(x), torch_out(back, x), atol=TOL, rtol=0)


def test_from_torch_prints_no_exporter_traceback(capfd, caplog):
    """The dynamo exporter's down-conversion to an older opset fails on a training-mode BatchNorm
    network and prints that traceback (the export goes on): from_torch asks for the exporter's own
    opset, so a user sees none; an explicit opset is still honoured."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    x = torch.randn(2, 3, 8, 8)
    model = anygrad.from_torch(net, x)
    out = capfd.readouterr()
    assert "Traceback" not in out.out + out.err
    assert not [r.getMessage() for r in caplog.records if r.exc_info]  # (the exporter logs it)
    net.eval()
    np.testing.assert_allclose(model.predict(x.numpy()), net(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    older = anygrad.from_torch(net, x, opset=17, dynamo=False)
    np.testing.assert_allclose(older.predict(x.numpy()), net(x).detach().numpy(), rtol=1e-4, atol=1e-5)
