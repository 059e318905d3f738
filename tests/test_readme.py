"""README's Python examples run as written (data paths pointed at the shared MNIST subset)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SUBSET = REPO.parent / "shared/datasets/mnist-subset"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def _block(containing: str) -> str:
    (block,) = [b for b in _python_blocks() if containing in b]
    return block


@pytest.mark.slow
@pytest.mark.skipif(not SUBSET.is_dir(), reason="shared MNIST subset not checked out next to the repo")
def test_python_api_example(tmp_path, monkeypatch):
    import anygrad
    from anygrad.data import load_mnist
    from anygrad.examples import FOUNDING_MODEL

    monkeypatch.chdir(tmp_path)
    small = load_mnist(SUBSET)

    class Subset:  # the example's data, cut down so the test stays quick
        def train(self):
            x, y = small.train()
            return x[:600], y[:600]

        def test(self):
            x, y = small.test()
            return x[:300], y[:300]

    code = _block("model.fit(").replace('"my_model.onnx"', repr(str(FOUNDING_MODEL)))
    code = code.replace("load_mnist()", "Subset()")
    scope = {"Subset": Subset}
    exec(compile(code, "README.md", "exec"), scope)
    assert (tmp_path / "runs/demo/metrics.jsonl").is_file() and (tmp_path / "trained.onnx").is_file()
    assert scope["result"].last.epoch == 2
    assert scope["log_probs"].shape == (8, 10)
    assert isinstance(scope["model"], anygrad.Model)


def test_nn_example_loads_a_torch_checkpoint(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    code = _block("class Net(nn.Module)")

    class TorchNet(torch.nn.Module):  # the same network in PyTorch, saved with torch.save
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 8, 3)
            self.fc = torch.nn.Linear(8 * 26 * 26, 10)

        def forward(self, x):
            return torch.log_softmax(self.fc(torch.relu(self.conv(x)).flatten(1)), dim=1)

    reference = TorchNet()
    torch.save(reference.state_dict(), tmp_path / "net.pt")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    x = np.random.default_rng(0).standard_normal((3, 1, 28, 28)).astype(np.float32)
    with torch.no_grad():
        expected = reference(torch.tensor(x)).numpy()
    np.testing.assert_allclose(scope["model"].predict(x), expected, rtol=1e-4, atol=1e-5)
