"""from_torch(..., dynamic=...): dims past the batch kept symbolic, so one model trains on several
sequence lengths like PyTorch does; without it the example fixes them, and a batch of another
length is a ShapeError that says where the length came from and what to do."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import anygrad
from anygrad.errors import ConfigError, ShapeError

torch = pytest.importorskip("torch")
VOCAB, D = 20, 8


class CausalLM(torch.nn.Module):
    """forward(input_ids, labels) -> {'loss', 'logits'}, as a Hugging Face causal LM is called:
    one causal self-attention layer whose mask is built from the sequence length."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        q, k, v = self.qkv(h).split(D, dim=2)
        t = input_ids.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        att = torch.softmax((q @ k.transpose(1, 2) / math.sqrt(D)).masked_fill(causal, float("-inf")), dim=-1)
        logits = self.head(h + att @ v)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (2, t), generator=g) for t in (8, 12, 5, 8)]
    return [{"input_ids": x, "labels": x} for x in ids]


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_dynamic_lengths_train_like_pytorch(dynamo):
    torch.manual_seed(0)
    net = CausalLM()
    ref = copy.deepcopy(net)
    data = _batches()
    model = anygrad.from_torch(net, data[0], dynamo=dynamo, dynamic={"input_ids": {1: "seq"}, "labels": {1: "seq"}})
    assert model.torch_binding.exporter == ("dynamo" if dynamo else "torchscript")
    shape = model.graph.info["input_ids"].shape
    assert len(shape) == 2 and all(isinstance(d, str) for d in shape)  # (batch, seq)
    model.compile(loss="output", optimizer=anygrad.optim.SGD(lr=0.5), device="cpu")
    ours = [model.train_on_batch({k: v.numpy() for k, v in b.items()}) for b in data]

    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    theirs = []
    for b in data:
        opt.zero_grad()
        loss = ref(**b)["loss"]
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    out = model.predict({"input_ids": data[1]["input_ids"].numpy(), "labels": data[1]["labels"].numpy()})
    assert out["logits"].shape == (2, 12, VOCAB)


def test_a_fixed_length_says_where_it_came_from_and_what_to_do():
    torch.manual_seed(0)
    data = _batches()
    model = anygrad.from_torch(CausalLM(), data[0], dynamo=False)
    model.compile(loss="output", optimizer=anygrad.optim.SGD(lr=0.1), device="cpu")
    with pytest.raises(ShapeError) as e:
        model.train_on_batch({k: v.numpy() for k, v in data[1].items()})
    text = str(e.value)
    assert "input 'input_ids' takes shape (batch, 8), got (2, 12)" in text
    assert "takes size 8 on axis 1, the data has 12" in text and "pad or crop the data to 8" in text
    assert "if the model came from from_torch" in text and "dynamic={'input_ids': {1: 'seq'}}" in text


@pytest.mark.parametrize("dynamic, words", [
    ({"ids": {1: "seq"}}, "no tensor input"),
    ({"input_ids": {0: "seq"}}, "axis 0, the batch"),
    ({"input_ids": {2: "seq"}}, "from 1 to 1"),
    ({"input_ids": {1: "batch"}}, "names the dim"),
    ({"input_ids": {1: 3}}, "names the dim"),
    ({"input_ids": [1]}, r"takes \{axis: name\}"),
    ([("input_ids", {1: "seq"})], "takes {input name"),
])
def test_bad_dynamic_specs_are_config_errors(dynamic, words):
    with pytest.raises(ConfigError, match=words):
        anygrad.from_torch(CausalLM(), _batches()[0], dynamic=dynamic)
