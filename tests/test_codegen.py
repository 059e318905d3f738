"""`anygrad codegen`: ONNX -> readable anygrad.nn Python that computes and trains like the import.

References: the ONNX import itself (outputs and training losses of the generated Model must equal
it), PyTorch (a torch.save'd state_dict loaded into the generated founding model gives PyTorch's
eval output), ruff and py_compile (the generated file is clean Python)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper
from torch import nn as tnn
from zoo_util import zoo_modules

import anygrad
from anygrad import AnygradError, cli
from anygrad.codegen import write_code
from anygrad.examples import FOUNDING_MODEL

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples/mnist"
REGENERATE = "anygrad codegen examples/mnist/mnist.onnx -o examples/mnist/generated_model.py --no-weights"


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"generated_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_clean(path: Path, long_lines: bool = True, cwd: Path | None = None) -> None:
    """The generated file passes py_compile, ruff's default rules (no project config) and the
    pycodestyle/pyflakes/isort ones (E, W, F, I; lines up to 110 unless long paths are allowed).
    ruff runs in the file's folder, as in a user's project (anygrad is a third-party package)."""
    subprocess.run([sys.executable, "-m", "py_compile", str(path)], check=True)
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    strict = ["--select", "E,F,W,I", "--line-length", "110"] + (["--ignore", "E501"] if long_lines else [])
    for rules in ([], strict):
        r = subprocess.run(
            [ruff, "check", "--isolated", *rules, str(path)],
            check=False,
            capture_output=True,
            text=True,
            cwd=cwd or path.parent,
        )
        assert r.returncode == 0, r.stdout + r.stderr


def generated(onnx_path: Path, tmp_path: Path, name: str = "model_code.py"):
    written = write_code(onnx_path, tmp_path / name)
    return load_module(written.code), written


def same_training(onnx_path: Path, generated_model, x: np.ndarray, ys: list[np.ndarray], loss: str) -> None:
    """Same predictions, then the same losses over a few SGD steps (gradients agree)."""
    imported = anygrad.load_onnx(onnx_path)
    ours = generated_model.to_model()
    for m in (imported, ours):
        m.compile(loss=loss, optimizer=anygrad.optim.SGD(lr=0.05, momentum=0.9), device="cpu", seed=3)
    np.testing.assert_allclose(ours.predict(x), imported.predict(x), rtol=1e-5, atol=1e-5)
    a = [imported.train_on_batch(x, y) for y in ys]
    b = [ours.train_on_batch(x, y) for y in ys]
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.predict(x), imported.predict(x), rtol=1e-4, atol=1e-5)


# -- the founding model ------------------------------------------------------------------------------
def test_founding_model_code_computes_and_trains_like_the_import(tmp_path):
    module, written = generated(Path(FOUNDING_MODEL), tmp_path)
    check_clean(written.code)
    code = written.code.read_text()
    for line in (
        "self.conv1 = nn.Conv2d(1, 8, 3)",
        "self.norm1 = nn.BatchNorm2d(24)",
        "self.dropout1 = nn.Dropout(0.3)",
        "self.fc1 = nn.Linear(11616, 32)",
        "self.norm2 = nn.BatchNorm1d(10)",
        "relu = F.relu(conv1)",
        "log_probs = F.log_softmax(norm2, dim=1)",
    ):
        assert line in code, line
    assert "onnx_op" not in code  # everything in the founding model has a PyTorch form
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 1, 28, 28)).astype(np.float32)
    ys = [rng.integers(0, 10, 6) for _ in range(3)]
    same_training(Path(FOUNDING_MODEL), module.Model.from_file(), x, ys, "nll")


def _torch_net():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from model import Net
    finally:
        sys.path.remove(str(EXAMPLE))
    return Net


def test_founding_model_code_loads_a_torch_state_dict_and_matches_pytorch(tmp_path):
    torch.manual_seed(5)
    net = _torch_net()()
    for bn in (net.norm1, net.norm2):  # non-trivial running statistics, so eval mode is tested
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.num_batches_tracked.fill_(7)
    torch.save(net.state_dict(), tmp_path / "net.pt")
    module = load_module(
        write_code(Path(FOUNDING_MODEL), tmp_path / "mnist_model.py", write_weights=False).code
    )
    fresh = module.Model()
    assert list(fresh.state_dict()) == list(net.state_dict())  # PyTorch's names, PyTorch's order
    assert all(fresh.state_dict()[k].shape == tuple(v.shape) for k, v in net.state_dict().items())
    model = module.Model.from_file(tmp_path / "net.pt").to_model().compile(loss="nll", device="cpu")
    x = np.random.default_rng(1).standard_normal((5, 1, 28, 28)).astype(np.float32)
    with torch.no_grad():
        expected = net.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-5, atol=1e-5)


def test_checked_in_example_is_up_to_date(tmp_path):
    """examples/mnist/generated_model.py is what codegen writes today."""
    out = tmp_path / "generated_model.py"
    write_code(EXAMPLE / "mnist.onnx", out, write_weights=False)
    checked_in = EXAMPLE / "generated_model.py"
    assert checked_in.is_file(), f"examples/mnist/generated_model.py is missing; create it with: {REGENERATE}"
    assert out.read_text() == checked_in.read_text(), (
        f"examples/mnist/generated_model.py differs from what `anygrad codegen` writes now; regenerate it "
        f"from the repository root with: {REGENERATE}"
    )
    check_clean(checked_in, long_lines=False, cwd=REPO)  # the repository's view: anygrad is first-party


# -- a small ResNet ---------------------------------------------------------------------------------
class Block(tnn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = tnn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = tnn.BatchNorm2d(cout)
        self.conv2 = tnn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = tnn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = tnn.Sequential(
                tnn.Conv2d(cin, cout, 1, stride=stride, bias=False), tnn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = TF.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return TF.relu(out + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(tnn.Module):
    def __init__(self):
        super().__init__()
        self.stem = tnn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = tnn.BatchNorm2d(8)
        self.relu = tnn.ReLU()
        self.layer1 = tnn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.pool = tnn.AdaptiveAvgPool2d(1)
        self.fc = tnn.Linear(16, 10)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def export(module: tnn.Module, path: Path, example: torch.Tensor, output: str = "out") -> Path:
    module.train()
    state = {k: v.clone() for k, v in module.state_dict().items()}
    torch.onnx.export(
        module,
        (example,),
        str(path),
        training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False,
        dynamo=False,
        opset_version=17,
        input_names=["input"],
        output_names=[output],
        dynamic_axes={"input": {0: "batch"}, output: {0: "batch"}},
    )
    module.load_state_dict(state)  # tracing ran a training-mode forward
    return path


def test_resnet_code_is_nested_like_pytorch_and_trains_like_the_import(tmp_path):
    torch.manual_seed(0)
    net = TinyResNet()
    path = export(net, tmp_path / "resnet.onnx", torch.zeros(2, 3, 8, 8), "logits")
    module, written = generated(path, tmp_path, "resnet_model.py")
    check_clean(written.code)
    code = written.code.read_text()
    for text in (
        "self.relu = nn.ReLU()",
        "self.pool = nn.AdaptiveAvgPool2d(1)",
        "nn.Conv2d(8, 16, 1, stride=2, bias=False)",
        "self.layer1[1].downsample[0](",
        "layer1_0_add = layer1_0_bn2 + relu",
        "logits = self.fc(flatten)",
    ):
        assert text in code, text
    model = module.Model.from_file()
    # the state_dict is PyTorch's (names, order, shapes) with the file's values (the export's
    # training-mode forward moved the running statistics in the file, not the weights)
    theirs = {k: v.numpy() for k, v in net.state_dict().items()}
    in_file = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    ours = model.state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == v.shape for k, v in theirs.items())
    for k, v in theirs.items():
        if not k.endswith(("num_batches_tracked", "running_mean", "running_var")):
            np.testing.assert_array_equal(ours[k], v, err_msg=k)
        if k in in_file:
            np.testing.assert_array_equal(ours[k], in_file[k], err_msg=k)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    same_training(path, model, x, [rng.integers(0, 10, 4) for _ in range(3)], "cross_entropy")


# -- other layers, the generic path ---------------------------------------------------------------------
class Mixed(tnn.Module):
    """Linear over 3-D input (MatMul + Add), LayerNorm, GELU (Erf), cat/permute/unsqueeze, a free
    Parameter, a pool, and x.reshape(x.shape[0], -1) (a Shape/Gather/Concat chain: generic ops)."""

    def __init__(self):
        super().__init__()
        self.proj = tnn.Linear(6, 8)
        self.norm = tnn.LayerNorm(8)
        self.scale = tnn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.head = tnn.Linear(2 * 4 * 8, 5, bias=False)
        self.pool = tnn.MaxPool2d(2)

    def forward(self, x):  # (N, 4, 6)
        h = TF.gelu(self.norm(self.proj(x))) * self.scale
        h = torch.cat([h, torch.sigmoid(h) - 0.5], dim=1)  # (N, 8, 8)
        h = self.pool(h.unsqueeze(1)).permute(0, 2, 1, 3)  # (N, 4, 1, 4)
        h = torch.cat([h, h * 2.0], dim=1).reshape(x.shape[0], -1)
        return TF.log_softmax(self.head(torch.cat([h, h], dim=1)), dim=-1)


class UpDown(tnn.Module):
    """ConvTranspose2d, slicing, padded average pooling, an nn.GELU inside a Sequential, and a
    weight used twice (by its Linear and by F.linear)."""

    def __init__(self):
        super().__init__()
        self.enc = tnn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.dec = tnn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)
        self.fc = tnn.Linear(2 * 8 * 8, 10)
        self.blocks = tnn.Sequential(tnn.Linear(10, 10), tnn.GELU(), tnn.Linear(10, 10))

    def forward(self, x):  # (N, 1, 8, 8)
        h = self.dec(TF.leaky_relu(self.enc(x), 0.2))
        h = TF.avg_pool2d(h, 2, stride=1, padding=1)[:, :, :8, :8]
        h = self.fc(h.flatten(1))
        return TF.log_softmax(self.blocks(h) + TF.linear(h, self.blocks[0].weight), dim=1)


class Bag(tnn.Module):
    """Embedding over int64 token ids, a mean, a Linear."""

    def __init__(self):
        super().__init__()
        self.tokens = tnn.Embedding(20, 6)
        self.out = tnn.Linear(6, 4)

    def forward(self, ids):  # (N, 5) int64
        return TF.log_softmax(self.out(self.tokens(ids).mean(dim=1)), dim=1)


CASES = {
    "mixed": (
        Mixed,
        (2, 4, 6),
        [
            "self.proj = nn.Linear(6, 8)",
            "self.norm = nn.LayerNorm(8)",
            "self.scale = nn.Parameter(",
            "F.gelu(norm)",
            "F.cat([",
            "F.reshape(concat_1, [x.shape[0], -1])",
        ],
    ),
    "updown": (
        UpDown,
        (2, 1, 8, 8),
        [
            "nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)",
            "            nn.GELU(),\n",
            "blocks_1 = self.blocks[1](blocks_0)",
            "average_pool[:, :, :8]",
            "F.permute(self.blocks[0].weight, [1, 0])",
        ],
    ),
    "bag": (
        Bag,
        (2, 5),
        ["self.tokens = nn.Embedding(20, 6)", "tokens = self.tokens(x)", "F.mean(tokens, [1])"],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_other_graphs_are_generated_and_train_like_the_import(tmp_path, case):
    cls, shape, expected_code = CASES[case]
    torch.manual_seed(2)
    net = cls()
    example = torch.zeros(shape, dtype=torch.int64) if case == "bag" else torch.zeros(shape)
    path = export(net, tmp_path / f"{case}.onnx", example)
    module, written = generated(path, tmp_path, f"{case}_model.py")
    check_clean(written.code)
    code = written.code.read_text()
    for text in expected_code:
        assert text in code, text
    model = module.Model.from_file()
    assert list(model.state_dict()) == list(net.state_dict())
    rng = np.random.default_rng(4)
    n = 3
    x = (
        rng.integers(0, 20, (n,) + shape[1:])
        if case == "bag"
        else rng.standard_normal((n,) + shape[1:]).astype(np.float32)
    )
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(
        module.Model.from_file().to_model().compile(device="cpu").predict(x), expected, rtol=1e-5, atol=1e-5
    )
    classes = expected.shape[1]
    same_training(path, model, x, [rng.integers(0, classes, n) for _ in range(3)], "nll")


# -- the command -----------------------------------------------------------------------------------
def test_cli_codegen_writes_code_and_weights(tmp_path, capsys):
    out = tmp_path / "mnist_model.py"
    assert cli.main(["codegen", str(FOUNDING_MODEL), "-o", str(out)]) == 0
    assert out.is_file() and out.with_suffix(".safetensors").is_file()
    assert str(out) in capsys.readouterr().out
    other = tmp_path / "w" / "weights.safetensors"
    other.parent.mkdir()
    assert cli.main(["codegen", str(FOUNDING_MODEL), "-o", str(out), "--weights-out", str(other)]) == cli.EXIT_ERROR
    assert cli.main(["codegen", str(FOUNDING_MODEL), "-o", str(out), "--weights-out", str(other), "--overwrite"]) == 0
    assert 'Path(__file__).parent / "w/weights.safetensors"' in out.read_text()
    model = load_module(out).Model.from_file()  # the default path is the one written
    assert model.state_dict()["conv1.weight"].shape == (8, 1, 3, 3)


@pytest.mark.parametrize(
    "args, message",
    [
        (["-o", "model.txt"], ".py name"),
        (["-o", "model.py", "--weights-out", "w.pt"], "safetensors"),
    ],
)
def test_cli_codegen_errors_are_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["codegen", str(FOUNDING_MODEL), *args]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error:") and message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_cli_codegen_refuses_a_file_that_is_not_onnx(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert cli.main(["codegen", str(bad), "-o", str(tmp_path / "m.py")]) == cli.EXIT_ERROR
    assert "bad.onnx" in capsys.readouterr().err and not (tmp_path / "m.py").exists()


def test_generated_code_errors_are_anygrad_errors(tmp_path):
    module = load_module(write_code(Path(FOUNDING_MODEL), tmp_path / "m.py", write_weights=False).code)
    with pytest.raises(AnygradError, match="m.safetensors"):
        module.Model.from_file()  # not written


def test_code_written_without_weights_says_how_to_get_them(tmp_path, monkeypatch):
    """The docstring of --no-weights code (the checked-in example's) gives a command that writes
    the weights Model.from_file() reads, and a run's weights.safetensors loads too."""
    from anygrad.train.trainer import save_weights

    monkeypatch.chdir(tmp_path)
    shutil.copy(FOUNDING_MODEL, "mnist.onnx")
    code = write_code("mnist.onnx", "mnist_model.py", write_weights=False).code.read_text()
    assert "Regenerate it with: anygrad codegen mnist.onnx -o mnist_model.py --no-weights" in code
    docstring = code.split('"""')[1]
    command = re.search(r"^    (anygrad codegen .*)$", docstring, re.MULTILINE).group(1)
    assert "--no-weights" not in command and "mnist_model.safetensors" in docstring
    before = Path("mnist_model.py").read_bytes()
    assert cli.main(command.split()[1:]) == 0  # what the docstring says to run
    assert Path("mnist_model.py").read_bytes() == before  # the weights only: the module as it was
    assert cli.main(command.split()[1:]) == cli.EXIT_ERROR  # and not again over them, silently
    module = load_module(tmp_path / "mnist_model.py")
    imported = anygrad.load_onnx("mnist.onnx")
    x = np.random.default_rng(0).standard_normal((3, 1, 28, 28)).astype(np.float32)
    expected = imported.predict(x)
    np.testing.assert_allclose(module.Model.from_file().to_model().predict(x), expected, rtol=1e-6, atol=1e-6)
    assert 'Model.from_file("runs/<run>/weights.safetensors")' in docstring
    save_weights(imported, tmp_path)  # as a run writes them
    model = module.Model.from_file(tmp_path / "weights.safetensors").to_model()
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-6, atol=1e-6)


# -- fine-tuning: anygrad train --weights ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory) -> Path:
    from mnist_util import write_tiny_mnist
    return write_tiny_mnist(tmp_path_factory.mktemp("tiny-mnist"), 40, 20, learnable=False)


def test_train_starts_from_weights_and_records_them(tmp_path, tiny_mnist, capsys):
    torch.manual_seed(0)
    mlp = tnn.Sequential(tnn.Flatten(), tnn.Linear(784, 16), tnn.ReLU(), tnn.Linear(16, 10))
    path = export(mlp, tmp_path / "mlp.onnx", torch.zeros(2, 1, 28, 28))
    torch.manual_seed(1)
    other = tnn.Sequential(tnn.Flatten(), tnn.Linear(784, 16), tnn.ReLU(), tnn.Linear(16, 10))
    torch.save(other.state_dict(), tmp_path / "start.pt")
    run = tmp_path / "run"
    args = [
        "train",
        str(path),
        "--weights",
        str(tmp_path / "start.pt"),
        "--data-dir",
        str(tiny_mnist),
        "--device",
        "cpu",
        "--epochs",
        "1",
        "--batch-size",
        "20",
        "--optimizer",
        "sgd",
        "--lr",
        "1e-9",
        "--artifacts",
        str(run),
        "--quiet",
    ]
    assert cli.main(args) == 0
    assert "from weights start.pt" in capsys.readouterr().out
    trained = np.load(run / "weights.npz")
    for k, v in other.state_dict().items():  # started from start.pt (lr ~ 0: still there), not the file
        np.testing.assert_allclose(trained[k], v.numpy(), rtol=1e-6, atol=1e-7, err_msg=k)
    config = json.loads((run / "config.json").read_text())
    assert config["weights"] == str((tmp_path / "start.pt").resolve())
    # a rerun from the config starts from the same weights
    assert (
        cli.main(
            ["train", "--config", str(run / "config.json"), "--artifacts", str(tmp_path / "again"), "--quiet"]
        )
        == 0
    )
    np.testing.assert_array_equal(np.load(tmp_path / "again/weights.npz")["1.weight"], trained["1.weight"])


def test_train_weights_are_strict(tmp_path, tiny_mnist, capsys):
    torch.manual_seed(0)
    mlp = tnn.Sequential(tnn.Flatten(), tnn.Linear(784, 16), tnn.ReLU(), tnn.Linear(16, 10))
    path = export(mlp, tmp_path / "mlp.onnx", torch.zeros(2, 1, 28, 28))
    state = mlp.state_dict()
    del state["3.bias"]
    state["extra.weight"] = torch.zeros(3)
    torch.save(state, tmp_path / "partial.pt")
    args = [
        "train",
        str(path),
        "--data-dir",
        str(tiny_mnist),
        "--device",
        "cpu",
        "--artifacts",
        str(tmp_path / "r"),
    ]
    assert cli.main([*args, "--weights", str(tmp_path / "partial.pt")]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("anygrad: error:") and "3.bias" in err and "extra.weight" in err
    assert cli.main([*args, "--weights", str(tmp_path / "missing.pt")]) == cli.EXIT_ERROR
    assert "missing.pt" in capsys.readouterr().err


def test_constants_operators_and_generic_ops(tmp_path):
    """Hand-built ONNX (no PyTorch): constants on either side of operators (negative numbers
    parenthesised), a vector constant, an op without a PyTorch form, a folded constant chain."""
    from onnx import TensorProto, helper

    def const(name, value, dtype=np.float32):
        return numpy_helper.from_array(np.asarray(value, dtype), name)

    inits = [
        const("neg", -1.5),
        const("two", 2.0),
        const("vec", [0.5, -1.0, 2.0, 3.0]),
        const("axes", [0], np.int64),
        const("w", np.linspace(-1, 1, 12).reshape(4, 3)),
    ]
    nodes = [
        helper.make_node("Sub", ["neg", "x"], ["a"]),
        helper.make_node("Pow", ["a", "two"], ["b"]),
        helper.make_node("Mul", ["b", "vec"], ["c"]),
        helper.make_node("Unsqueeze", ["two", "axes"], ["two1"]),  # constants only: folded
        helper.make_node("Div", ["two1", "c"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),  # no PyTorch form here: onnx_op
        helper.make_node("MatMul", ["e", "w"], ["y"]),  # a Linear without bias (W.T stored)
    ]
    graph = helper.make_graph(
        nodes,
        "ops",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "ops.onnx"))
    module, written = generated(tmp_path / "ops.onnx", tmp_path, "ops_model.py")
    check_clean(written.code)
    code = written.code.read_text()
    # 0-d initializers are constants, the others parameters (as the importer classifies them)
    for text in (
        "sub = (-1.5) - x",
        "pow_ = sub ** 2.0",
        "mul = pow_ * self.vec",
        "self.vec = nn.Parameter(",
        "div = F.constant(np.array([2.0], dtype=np.float32), mul) / mul",
        'F.onnx_op("Erf", div)',
        "self.linear = nn.Linear(4, 3, bias=False)",
    ):
        assert text in code, text
    assert "Unsqueeze" not in code
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    same_training(
        tmp_path / "ops.onnx",
        module.Model.from_file(),
        x,
        [np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)],
        "mse",
    )


# -- layer options round-trip (hypothesis) ----------------------------------------------------------------
class ConvPool(tnn.Module):
    def __init__(self, conv: dict, pool: tuple[str, dict], slope: float):
        super().__init__()
        self.conv = tnn.Conv2d(4, 6, **conv)
        self.pool = (tnn.MaxPool2d if pool[0] == "max" else tnn.AvgPool2d)(**pool[1])
        self.slope = slope

    def forward(self, x):
        return self.pool(TF.leaky_relu(self.conv(x), self.slope))


@settings(max_examples=8, deadline=None)
@given(
    kernel=st.sampled_from([1, 2, 3, (3, 1)]),
    stride=st.sampled_from([1, 2, (2, 1)]),
    padding=st.sampled_from([0, 1, (1, 0)]),
    dilation=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]),
    bias=st.booleans(),
    pool=st.sampled_from(
        [
            ("max", {"kernel_size": 2}),
            ("max", {"kernel_size": 3, "stride": 1, "padding": 1}),
            ("max", {"kernel_size": 2, "ceil_mode": True}),
            ("avg", {"kernel_size": 2, "stride": 1}),
            ("avg", {"kernel_size": 3, "padding": 1, "count_include_pad": False}),
        ]
    ),
    slope=st.sampled_from([0.01, 0.2]),
)
def test_layer_options_survive_codegen(
    tmp_path_factory, kernel, stride, padding, dilation, groups, bias, pool, slope
):
    tmp = tmp_path_factory.mktemp("options")
    conv = {
        "kernel_size": kernel,
        "stride": stride,
        "padding": padding,
        "dilation": dilation,
        "groups": groups,
        "bias": bias,
    }
    torch.manual_seed(0)
    net = ConvPool(conv, pool, slope)
    path = export(net, tmp / "convpool.onnx", torch.zeros(2, 4, 9, 9))
    module, written = generated(path, tmp, "convpool_model.py")
    code = written.code.read_text()
    assert "self.conv = nn.Conv2d(" in code and "onnx_op" not in code
    x = np.random.default_rng(0).standard_normal((2, 4, 9, 9)).astype(np.float32)
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    model = module.Model.from_file()
    assert list(model.state_dict()) == list(net.state_dict())
    got = model.to_model().compile(loss="mse", device="cpu").predict(x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


# -- the exporters' idioms (tests/zoo families, both exporters) -------------------------------------
# family -> (lines every exporter's code holds, the most F.onnx_op calls it may need). The dynamo
# exporter writes a bias-free conv with a zero bias Expand(CastLike(0, x), Shape(W)[:1]), ReLU6
# as Clip(x, CastLike(0), CastLike(6)), one shared batch-size chain for every view, and the
# attention scale from Shape(q)[-1]: all of it folds or becomes layers and functions.
ZOO_CODE = {
    "resnet": ([r"nn\.Conv2d\(3, 8, 3, padding=1, bias=False\)", r"nn\.Conv2d\(8, 16, 1, stride=2, bias=False\)"], 0),
    "mobilenet": ([r"nn\.Conv2d\(16, 16, 3, padding=1, groups=16, bias=False\)", r"F\.hardsigmoid\(",
                   r"nn\.ReLU6\(\)|F\.relu6\(", r"nn\.Hardswish\(\)|F\.hardswish\("], 0),
    # the masks and nn.MultiheadAttention's internals stay generic
    "transformer": ([r"nn\.GELU\(\)|F\.gelu\(", r"\.shape\[\d\] \* 2, 8\]\)"], 22),
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("family", sorted(ZOO_CODE))
def test_zoo_exports_become_layers_and_train_like_the_import(tmp_path, family, exporter):
    harness, models = zoo_modules("zoo_harness", "zoo_models")
    fam = models.FAMILIES[family]
    net = harness.export(fam, tmp_path / "model.onnx", exporter)
    module, written = generated(tmp_path / "model.onnx", tmp_path, f"{family}_model.py")
    check_clean(written.code)
    code = written.code.read_text()
    lines, most_generic = ZOO_CODE[family]
    for pattern in lines:
        assert re.search(pattern, code), pattern
    generic = re.findall(r'F\.onnx_op\(\s*"(\w+)"', code)
    assert len(generic) <= most_generic, generic
    assert not {"Conv", "CastLike"} & set(generic)
    model = module.Model.from_file()
    if family != "transformer":  # every weight is a layer's: PyTorch's names (the dynamo file
        ours, theirs = list(model.state_dict()), list(net.state_dict())  # orders its weights its own way)
        assert ours == theirs if exporter == "torchscript" else sorted(ours) == sorted(theirs)
    x, y = fam.batches(1, seed=5)[0]
    same_training(tmp_path / "model.onnx", model, x, [y, y], fam.loss)


@pytest.mark.parametrize("bias", [0.0, 0.5])
def test_a_constant_bias_is_dropped_only_when_zero(tmp_path, bias):
    """Conv(x, W, Expand(CastLike(b, x), Shape(W)[:1])), hand-built: b = 0 is nn.Conv2d(bias=False),
    another b stays a constant the conv adds."""
    from onnx import TensorProto, helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 2, 3, 3)).astype(np.float32), "conv.weight")
    consts = [numpy_helper.from_array(np.array(bias, np.float32), "b")]
    nodes = [
        helper.make_node("Shape", ["conv.weight"], ["s"], start=0, end=1),
        helper.make_node("CastLike", ["b", "x"], ["b_like"]),
        helper.make_node("Expand", ["b_like", "s"], ["zeros"]),
        helper.make_node("Conv", ["x", "conv.weight", "zeros"], ["y"], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 5, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 5, 5])], [w] + consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "conv.onnx"))
    module, written = generated(tmp_path / "conv.onnx", tmp_path, "conv_model.py")
    check_clean(written.code)
    code = written.code.read_text()
    assert ("nn.Conv2d(2, 4, 3, padding=1, bias=False)" in code) == (bias == 0.0)
    assert "Shape" not in code and "CastLike" not in code  # folded either way
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 5, 5)).astype(np.float32)
    same_training(tmp_path / "conv.onnx", module.Model.from_file(), x,
                  [rng.standard_normal((3, 4, 5, 5)).astype(np.float32)], "mse")
