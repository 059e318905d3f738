"""Hugging Face models as their scripts call them, `model(input_ids=..., attention_mask=...,
labels=...)`: the loss the model computes from `labels` is the graph's first output, and
`loss="output"` trains on it like PyTorch over a few AdamW steps. Sequence classification, causal
LM and masked LM (labels -100 where nothing is masked), tiny random-init configs, dynamo exports.
Without labels the ModelOutput has one key, and the output is still named by it."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import anygrad

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

VOCAB, T, BATCH, STEPS, CLASSES = 100, 10, 4, 3, 3


def bert_config() -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=32, num_labels=CLASSES,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def classifier() -> torch.nn.Module:
    return transformers.BertForSequenceClassification(bert_config())


def masked_lm() -> torch.nn.Module:
    return transformers.BertForMaskedLM(bert_config())


def causal_lm() -> torch.nn.Module:
    # use_cache as configured by default: the ModelOutput's DynamicCache is no graph output
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def batch(task: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, T), generator=g)
    mask = torch.ones(BATCH, T, dtype=torch.int64)
    mask[1:, -3:] = 0  # padded sequences
    if task == "classification":
        labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
    elif task == "masked":
        labels = torch.full_like(ids, -100)  # the loss only where a token was masked
        labels[:, ::3] = ids[:, ::3]
        ids = ids.clone()
        ids[:, ::3] = 0
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


TASKS = {"classification": classifier, "causal": causal_lm, "masked": masked_lm}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_labels_train_like_pytorch(task):
    torch.manual_seed(0)
    net = TASKS[task]()
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    data = [batch(task, g) for _ in range(STEPS)]
    model = anygrad.from_torch(net, data[0])
    assert model.torch_binding.exporter == "dynamo"
    assert model.input_names == ["input_ids", "attention_mask", "labels"]
    assert model.output_names == ["loss", "logits"]
    model.compile(loss="output", optimizer=anygrad.optim.AdamW(lr=1e-2), device="cpu")
    ours = [model.train_on_batch({k: v.numpy() for k, v in b.items()}) for b in data]

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref.train()
    theirs = []
    for b in data:
        opt.zero_grad()
        loss = ref(**b).loss
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def test_a_model_output_with_one_key_names_its_output():
    torch.manual_seed(0)
    net = classifier()
    ref = copy.deepcopy(net)
    b = batch("classification", torch.Generator().manual_seed(1))
    inputs = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    model = anygrad.from_torch(net, inputs)
    assert model.output_names == ["logits"]  # a ModelOutput of 'logits' alone
    model.compile(loss={"logits": "cross_entropy"}, optimizer=anygrad.optim.SGD(lr=0.1), device="cpu")
    loss = model.train_on_batch({k: v.numpy() for k, v in inputs.items()}, {"logits": b["labels"].numpy()})
    ref.train()
    expected = torch.nn.functional.cross_entropy(ref(**inputs).logits, b["labels"]).item()
    assert loss == pytest.approx(expected, rel=1e-5)
