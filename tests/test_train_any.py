"""Training any model a PyTorch user brings: several inputs (a dict by name or a tuple), several
outputs with a loss each, the loss computed by the model itself (loss="output"), ignore_index and
targets of any rank, and the metrics each task calls for.

The examples (a BERT classifier with padding masks, a VAE, a two-tower contrastive model, a U-Net,
a token-level language model, a two-headed model) go through `from_torch` and train 5 SGD steps
on cpu and on wgpu (lavapipe in CI), matching PyTorch's losses to float32 noise.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wgpu_util import wgpu_backend

import anygrad
from anygrad import AnygradError
from anygrad.batch import length, parse_inputs, take
from anygrad.errors import ConfigError, DataError, ShapeError
from anygrad.ir import Graph, TensorInfo

DEVICES = ["cpu", "wgpu"]
STEPS = 5
TOL = {"atol": 1e-5, "rtol": 1e-5}  # float32 noise over 5 steps of these tiny models


def quiet(fn, *args, **kwargs):
    """Exporter chatter (deprecations, progress lines) is not the test's business."""
    import contextlib
    import io
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def device(name: str):
    return "cpu" if name == "cpu" else wgpu_backend()


def torch_losses(net: tnn.Module, loss_of, lr: float, steps: int = STEPS) -> list[float]:
    """PyTorch's SGD losses on a copy of `net`: loss_of(net) gives the batch's loss tensor."""
    net = copy.deepcopy(net).train()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(net)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def fresh(model: anygrad.Model) -> anygrad.Model:
    """An untrained copy of an imported model (compile keeps the state of a compiled one)."""
    return copy.deepcopy(model)


# -- the batch-structure parser ---------------------------------------------------------------------
def two_input_graph() -> Graph:
    g = Graph(inputs=["ids", "mask"], outputs=[], name="two")
    g.info["ids"] = TensorInfo(np.dtype(np.int64), ("batch", 5))
    g.info["mask"] = TensorInfo(np.dtype(np.float32), ("batch", 5))
    return g


def test_parser_takes_dicts_tuples_and_tensors():
    g = two_input_graph()
    ids, mask = np.arange(10).reshape(2, 5), np.ones((2, 5), np.float32)
    for batch in ({"mask": mask, "ids": ids}, (ids, mask), [ids, mask],
                  {"ids": torch.from_numpy(ids), "mask": torch.from_numpy(mask)}):
        got = parse_inputs(batch, g)
        assert list(got) == ["ids", "mask"]
        np.testing.assert_array_equal(got["ids"], ids)
        np.testing.assert_array_equal(got["mask"], mask)
    t = torch.arange(10).reshape(2, 5)
    assert np.shares_memory(parse_inputs((t, mask), g)["ids"], t.numpy())  # a CPU tensor is not copied
    one = Graph(inputs=["x"], outputs=[], name="one")
    one.info["x"] = TensorInfo(np.dtype(np.float32), ("batch", 3))
    x = np.zeros((4, 3), np.float32)
    for batch in (x, (x,), {"x": x}, torch.zeros(4, 3), [[0.0, 1.0, 2.0]]):
        assert parse_inputs(batch, one)["x"].shape[1] == 3
    # batches of any structure slice alike (what a loader does with in-memory data)
    assert length({"a": np.zeros((6, 2)), "b": (np.zeros(6), np.zeros((6, 1)))}) == 6
    part = take({"a": np.arange(6), "b": (np.arange(6), np.arange(6) * 2)}, slice(1, 3))
    np.testing.assert_array_equal(part["b"][1], [2, 4])


@pytest.mark.parametrize("batch, error, match", [
    ({"ids": np.zeros((2, 5), np.int64)}, DataError, r"input 'mask' is missing: the model's inputs are \['ids', 'mask'\]"),
    ({"ids": 0, "mask": 0, "idz": 0}, DataError, r"no input named 'idz' \(did you mean 'ids'\?\)"),
    (np.zeros((2, 5)), DataError, r"model with 2 inputs \['ids', 'mask'\]; pass a dict \{'ids': ..., 'mask': ...\}"),
    ((np.zeros((2, 5)),), DataError, "got 1 inputs in a tuple, but the model has 2"),
    ({"ids": np.zeros((2, 5), np.float32), "mask": np.zeros((2, 5))}, DataError, "input 'ids' takes int64 values, got float32"),
    ({"ids": np.zeros((2, 5), np.int64), "mask": np.zeros((3, 5))}, DataError, "inputs 'ids' and 'mask' disagree on the dimension 'batch': 2 vs 3"),
    ({"ids": np.zeros((2, 4), np.int64), "mask": np.zeros((2, 5))}, ShapeError, r"input 'ids' takes shape \(batch, 5\), got \(2, 4\)"),
    ({"ids": "hello", "mask": np.zeros((2, 5))}, DataError, "input 'ids': expected an array or tensor, got a str"),
    ({1: np.zeros(2), "mask": np.zeros((2, 5))}, DataError, "keys must be strings"),
])
def test_parser_errors_name_the_input(batch, error, match):
    with pytest.raises(error, match=match):
        parse_inputs(batch, two_input_graph())


leaves = st.one_of(
    st.none(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3), st.binary(max_size=2),
    st.builds(lambda shape, kind: np.zeros(shape, kind),
              st.lists(st.integers(0, 6), max_size=3), st.sampled_from([np.int64, np.float32, np.bool_, np.uint8, object])),
    st.builds(lambda shape: torch.zeros(shape, dtype=torch.long), st.lists(st.integers(0, 6), max_size=3)),
)


def structures_of(names: list[str]):
    """Nested dicts (keys mostly the given names), lists and tuples of arrays, tensors and junk."""
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.sampled_from(names), st.integers(0, 2)), inner, max_size=3)),
        max_leaves=6)


structures = structures_of(["ids", "mask", "x"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=structures)
def test_parser_fuzz_raises_only_anygrad_errors(batch):
    """Whatever a loader or a user hands over, the parser answers with a batch or an AnygradError."""
    try:
        got = parse_inputs(batch, two_input_graph())
    except AnygradError:
        return
    assert list(got) == ["ids", "mask"] and got["ids"].shape[0] == got["mask"].shape[0]


# -- a BERT classifier with padding masks -----------------------------------------------------------
@pytest.fixture(scope="module")
def bert():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                     max_position_embeddings=8, num_labels=3, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, type_vocab_size=1)
    net = BertForSequenceClassification(cfg).train()
    ids = torch.randint(1, 30, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = mask[3, 2:] = 0  # padded sequences
    ids[mask == 0] = 0
    y = torch.tensor([0, 2, 1, 2])
    model = quiet(anygrad.from_torch, net, {"input_ids": ids, "attention_mask": mask}, dynamo=False)
    ref = torch_losses(net, lambda m: F.cross_entropy(m(input_ids=ids, attention_mask=mask).logits, y), 0.5)
    return model, ids, mask, y, ref, net


@pytest.mark.parametrize("dev", DEVICES)
def test_bert_classifier_with_padding_masks(bert, dev):
    model, ids, mask, y, ref, _ = bert
    assert model.input_names == ["input_ids", "attention_mask"]
    model = fresh(model).compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.5), device=device(dev))
    got = [model.train_on_batch({"input_ids": ids, "attention_mask": mask}, y) for _ in range(STEPS)]
    np.testing.assert_allclose(got, ref, **TOL)
    metrics = model.read_metrics()
    assert metrics["count"] == 4 * STEPS and set(metrics) == {"count", "loss", "accuracy"}


def test_hugging_face_labels_as_an_input(bert):
    """A Hugging Face model given labels= computes its loss: its outputs are named after the
    ModelOutput's keys ('loss', 'logits'), and loss="output" trains it with the labels as an input."""
    _, ids, mask, y, _, net = bert
    batch = {"input_ids": ids, "attention_mask": mask, "labels": y}
    model = quiet(anygrad.from_torch, net, batch, dynamo=False)
    assert model.input_names == ["input_ids", "attention_mask", "labels"] and model.output_names == ["loss", "logits"]
    ref = torch_losses(net, lambda m: m(**batch).loss, 0.5)
    model.compile(loss="output", optimizer=anygrad.optim.SGD(lr=0.5))
    np.testing.assert_allclose([model.train_on_batch(batch) for _ in range(STEPS)], ref, **TOL)


# -- a VAE whose forward returns its loss ---------------------------------------------------------
class VAE(tnn.Module):
    def __init__(self):
        super().__init__()
        self.enc = tnn.Linear(6, 8)
        self.mu = tnn.Linear(8, 2)
        self.logvar = tnn.Linear(8, 2)
        self.dec = tnn.Sequential(tnn.Linear(2, 8), tnn.ReLU(), tnn.Linear(8, 6))

    def forward(self, x, eps):  # eps: the reparametrisation noise, an input so both sides draw the same
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        recon = self.dec(mu + eps * torch.exp(0.5 * logvar))
        rec = ((recon - x) ** 2).sum(1).mean()
        kl = (-0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(1)).mean()
        return {"loss": rec + kl, "recon": rec, "kl": kl}


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(1)
    net = VAE()
    x, eps = torch.randn(5, 6), torch.randn(5, 2)
    model = quiet(anygrad.from_torch, net, (x, eps), dynamo=False)
    ref = torch_losses(net, lambda m: m(x, eps)["loss"], 0.1)
    return model, x, eps, ref


@pytest.mark.parametrize("dev", DEVICES)
def test_vae_trains_on_its_own_loss(vae, dev):
    model, x, eps, ref = vae
    assert model.output_names == ["loss", "recon", "kl"]
    model = fresh(model).compile(loss="output", optimizer=anygrad.optim.SGD(lr=0.1), device=device(dev))
    got = [model.train_on_batch({"x": x, "eps": eps}) for _ in range(STEPS)]
    np.testing.assert_allclose(got, ref, **TOL)
    metrics = model.read_metrics(reset=True)
    assert set(metrics) == {"count", "loss", "recon", "kl"}  # the other outputs, reported like metrics
    assert metrics["loss"] == pytest.approx(np.mean(ref), rel=1e-5)
    assert metrics["recon"] + metrics["kl"] == pytest.approx(metrics["loss"], rel=1e-5)
    ev = model.evaluate((x.numpy(), eps.numpy()))  # no targets: the loss is the model's
    assert ev["count"] == 5 and ev["loss"] == pytest.approx(ev["recon"] + ev["kl"], rel=1e-5)


# -- a two-tower contrastive model: two inputs, the loss in the graph -------------------------------
class Towers(tnn.Module):
    def __init__(self):
        super().__init__()
        self.left = tnn.Sequential(tnn.Linear(6, 8), tnn.Tanh(), tnn.Linear(8, 4))
        self.right = tnn.Sequential(tnn.Linear(5, 8), tnn.Tanh(), tnn.Linear(8, 4))

    def forward(self, query, doc):
        a = F.normalize(self.left(query), dim=1)
        b = F.normalize(self.right(doc), dim=1)
        logits = a @ b.T / 0.5
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


@pytest.fixture(scope="module")
def towers():
    torch.manual_seed(2)
    net = Towers()
    q, d = torch.randn(4, 6), torch.randn(4, 5)
    model = quiet(anygrad.from_torch, net, (q, d), dynamo=False)
    ref = torch_losses(net, lambda m: m(q, d), 0.5)
    return model, q, d, ref


@pytest.mark.parametrize("dev", DEVICES)
def test_two_tower_contrastive(towers, dev):
    model, q, d, ref = towers
    model = fresh(model).compile(loss="output", optimizer=anygrad.optim.SGD(lr=0.5), device=device(dev))
    got = [model.train_on_batch((q, d)) for _ in range(STEPS)]  # a tuple, in the forward's order
    np.testing.assert_allclose(got, ref, **TOL)


# -- a small U-Net with per-pixel cross-entropy ----------------------------------------------------
class UNet(tnn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.down1 = tnn.Conv2d(2, 4, 3, padding=1)
        self.down2 = tnn.Conv2d(4, 6, 3, padding=1)
        self.up = tnn.ConvTranspose2d(6, 4, 2, stride=2)
        self.mix = tnn.Conv2d(8, 4, 3, padding=1)
        self.head = tnn.Conv2d(4, classes, 1)

    def forward(self, x):
        a = torch.relu(self.down1(x))
        b = torch.relu(self.down2(F.max_pool2d(a, 2)))
        h = torch.relu(self.mix(torch.cat([self.up(b), a], 1)))
        return self.head(h)


@pytest.fixture(scope="module")
def unet():
    torch.manual_seed(3)
    net = UNet()
    x = torch.randn(2, 2, 4, 4)
    y = torch.randint(0, 3, (2, 4, 4))
    y[0, 0, :2] = -100  # unlabelled pixels
    model = quiet(anygrad.from_torch, net, x, dynamo=False)
    ref = torch_losses(net, lambda m: F.cross_entropy(m(x), y), 0.5)
    return model, net, x, y, ref


@pytest.mark.parametrize("dev", DEVICES)
def test_unet_segmentation(unet, dev):
    model, _net, x, y, ref = unet
    model = fresh(model).compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.5), device=device(dev))
    got = [model.train_on_batch(x, y) for _ in range(STEPS)]
    np.testing.assert_allclose(got, ref, **TOL)
    if dev != "cpu":
        return  # the metrics' kernels on wgpu: test_token_level_lm_ignores_minus_100
    ev = model.evaluate(x, y)
    pred = model.predict(x).argmax(1)
    keep = y.numpy() != -100
    assert set(ev) == {"count", "loss", "pixel_accuracy"}
    assert ev["pixel_accuracy"] == pytest.approx((pred == y.numpy())[keep].mean())


# -- a token-level language model: (B, T, V) logits, labels with -100 ------------------------------
class TinyLM(tnn.Module):
    def __init__(self, vocab: int = 11):
        super().__init__()
        self.emb = tnn.Embedding(vocab, 8)
        self.mix = tnn.Linear(8, 8)
        self.out = tnn.Linear(8, vocab)

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.emb(ids))))


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(4)
    net = TinyLM()
    ids = torch.randint(0, 11, (3, 7))
    labels = torch.randint(0, 11, (3, 7))
    labels[0, :3] = -100  # a prompt that is not trained on
    labels[2, 5:] = -100  # padding
    model = quiet(anygrad.from_torch, net, ids, dynamo=False)
    ref = torch_losses(net, lambda m: F.cross_entropy(m(ids).reshape(-1, 11), labels.reshape(-1)), 1.0)
    return model, net, ids, labels, ref


@pytest.mark.parametrize("dev", DEVICES)
def test_token_level_lm_ignores_minus_100(lm, dev):
    model, _net, ids, labels, ref = lm
    model = fresh(model).compile(loss="cross_entropy", ignore_index=-100, optimizer=anygrad.optim.SGD(lr=1.0),
                                 device=device(dev))
    got = [model.train_on_batch({"ids": ids}, labels) for _ in range(STEPS)]
    np.testing.assert_allclose(got, ref, **TOL)
    ev = model.evaluate(ids, labels)
    logits = model.predict(ids).astype(np.float64)
    y, keep = labels.numpy(), labels.numpy() != -100
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token_nll = -np.take_along_axis(logp, np.where(keep, y, 0)[..., None], -1)[..., 0][keep]
    assert set(ev) == {"count", "loss", "accuracy", "perplexity"}
    assert ev["loss"] == pytest.approx(token_nll.mean(), rel=1e-4)
    assert ev["perplexity"] == pytest.approx(np.exp(token_nll.mean()), rel=1e-4)
    assert ev["accuracy"] == pytest.approx((logits.argmax(-1) == y)[keep].mean())


def test_class_axis_and_reduction_options(lm):
    model, net, ids, labels, _ = lm
    # reduction="sum" as F.cross_entropy(reduction="sum"); another ignore_index
    lab = labels.clone()
    lab[lab == -100] = 3
    ref = torch_losses(net, lambda m: F.cross_entropy(m(ids).reshape(-1, 11), lab.reshape(-1), ignore_index=3,
                                                      reduction="sum"), 0.05)
    m = fresh(model).compile(loss="cross_entropy", ignore_index=3, reduction="sum", optimizer=anygrad.optim.SGD(lr=0.05))
    np.testing.assert_allclose([m.train_on_batch(ids, lab) for _ in range(STEPS)], ref, rtol=1e-5, atol=1e-4)
    # (B, T, V) read with the classes on axis 1 (PyTorch's layout) only when asked: V != T here
    with pytest.raises(ShapeError, match=r"targets of shape \(3, 7\) do not fit the model output \(3, 7, 11\)"):
        fresh(model).compile(loss="cross_entropy", class_axis=1).train_on_batch(ids, labels)
    with pytest.raises(ConfigError, match="reduction must be 'mean' or 'sum'"):
        model.compile(loss="cross_entropy", reduction="none")
    with pytest.raises(ConfigError, match="ignore_index must be an integer"):
        model.compile(loss="nll", ignore_index=0.5)


# -- several outputs, a loss each -------------------------------------------------------------------
class TwoHeads(tnn.Module):
    def __init__(self):
        super().__init__()
        self.body = tnn.Linear(5, 8)
        self.cls = tnn.Linear(8, 3)
        self.box = tnn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return {"logits": self.cls(h), "box": self.box(h)}


@pytest.fixture(scope="module")
def heads():
    torch.manual_seed(5)
    net = TwoHeads()
    x, y, box = torch.randn(6, 5), torch.randint(0, 3, (6,)), torch.randn(6, 4)
    model = quiet(anygrad.from_torch, net, x, dynamo=False)

    def loss_of(m):
        out = m(x)
        return F.cross_entropy(out["logits"], y) + 0.5 * F.l1_loss(out["box"], box)
    return model, x, y, box, torch_losses(net, loss_of, 0.3)


@pytest.mark.parametrize("dev", DEVICES)
def test_several_outputs_with_a_loss_each(heads, dev):
    model, x, y, box, ref = heads
    assert model.output_names == ["logits", "box"]
    model = fresh(model).compile(loss={"logits": "cross_entropy", "box": "l1"}, loss_weights={"box": 0.5},
                                 optimizer=anygrad.optim.SGD(lr=0.3), device=device(dev))
    got = [model.train_on_batch(x, {"box": box, "logits": y}) for _ in range(STEPS)]
    np.testing.assert_allclose(got, ref, **TOL)
    ev = model.evaluate(x, (y, box))  # a tuple, in output order
    out = model.predict(x)
    assert set(out) == {"logits", "box"}
    d = out["box"] - box.numpy()
    assert ev["box_mae"] == pytest.approx(np.abs(d).mean(), rel=1e-5)
    assert ev["box_mse"] == pytest.approx((d ** 2).mean(), rel=1e-5)
    assert ev["logits_accuracy"] == pytest.approx((out["logits"].argmax(1) == y.numpy()).mean())
    assert ev["loss"] == pytest.approx(ev["logits_loss"] + 0.5 * ev["box_loss"], rel=1e-5)


def test_only_outputs_with_a_loss_train(heads):
    """A head without a loss gets no gradient: its weights stay as imported."""
    model, x, y, _box, _ = heads
    m = fresh(model).compile(loss={"logits": "cross_entropy"}, optimizer=anygrad.optim.SGD(lr=0.3))
    before = m.to_torch_state_dict(as_numpy=True)
    m.train_on_batch(x, y)
    after = m.to_torch_state_dict(as_numpy=True)
    assert np.array_equal(before["box.weight"], after["box.weight"])
    assert not np.array_equal(before["cls.weight"], after["cls.weight"])
    assert m.target_names == ["logits"]


def test_loss_and_target_errors(heads, vae):
    model, x, y, box, _ = heads
    with pytest.raises(ConfigError, match=r"no output named 'boxes'; its outputs are \['logits', 'box'\]"):
        fresh(model).compile(loss={"logits": "cross_entropy", "boxes": "l1"})
    with pytest.raises(ConfigError, match="loss_weights: 'box' is not an output with a loss"):
        fresh(model).compile(loss={"logits": "cross_entropy"}, loss_weights={"box": 2.0})
    m = fresh(model).compile(loss={"logits": "cross_entropy", "box": "l1"}, ignore_index=-1)  # options go where they fit
    assert m.heads[0].loss.ignore_index == -1
    with pytest.raises(DataError, match=r"target 'box' is missing: the model's targets are \['logits', 'box'\]"):
        m.train_on_batch(x, {"logits": y})
    with pytest.raises(ConfigError, match="needs targets"):
        m.train_on_batch(x)
    with pytest.raises(ShapeError, match=r"targets of shape \(4,\) do not fit the model output \(6, 3\)"):
        m.train_on_batch(x, {"logits": y[:4], "box": box[:4]})
    with pytest.raises(DataError, match="batch sizes disagree"):
        m.train_on_batch(x, {"logits": y, "box": box[:4]})
    with pytest.raises(ConfigError, match="label_smoothing.* taken by none"):
        fresh(model).compile(loss={"box": "l1"}, label_smoothing=0.1)
    # loss="output" on a model whose output is not a scalar
    with pytest.raises(ConfigError, match=r"loss='output' minimises the model's first output 'logits', but it has shape \(6, 3\)"):
        fresh(model).compile(loss="output").train_on_batch(x)
    v, vx, eps, _ = vae
    m = fresh(v).compile(loss="output")
    with pytest.raises(ConfigError, match="loss='output' takes no targets"):
        m.train_on_batch((vx, eps), vx)


# -- metrics by task -----------------------------------------------------------------------------------
def linear_model(n_in: int, n_out: int) -> anygrad.Model:
    from anygrad import nn
    return nn.Linear(n_in, n_out).to_model(("batch", n_in))


def test_regression_and_multilabel_metrics():
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((10, 4)).astype(np.float32), rng.standard_normal((10, 3)).astype(np.float32)
    m = linear_model(4, 3).compile(loss="mse")
    ev = m.evaluate(x, t, batch_size=4)
    d = m.predict(x) - t
    assert set(ev) == {"count", "loss", "mse", "mae"}
    assert ev["mse"] == pytest.approx((d ** 2).mean(), rel=1e-5) and ev["mae"] == pytest.approx(np.abs(d).mean(), rel=1e-5)
    labels = (rng.random((10, 3)) > 0.5).astype(np.float32)
    m = linear_model(4, 3).compile(loss="bce_with_logits")
    ev = m.evaluate(torch.from_numpy(x), torch.from_numpy(labels))
    assert set(ev) == {"count", "loss", "label_accuracy"}
    assert ev["label_accuracy"] == pytest.approx(((m.predict(x) > 0) == (labels > 0.5)).mean())
    assert m.metric_names == ["loss", "label_accuracy"]


def test_classifier_metrics_skip_ignored_samples():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.integers(0, 7, 8)
    y[:3] = -100
    m = linear_model(4, 7).compile(loss="cross_entropy")
    ev = m.evaluate(x, y)
    pred = m.predict(x)
    keep = y != -100
    assert set(ev) == {"count", "loss", "accuracy", "top5"}
    assert ev["accuracy"] == pytest.approx((pred.argmax(1) == y)[keep].mean())
    ref = F.cross_entropy(torch.from_numpy(pred), torch.from_numpy(y)).item()
    assert ev["loss"] == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_ignore_index_counts_alike_on_wgpu(fused):
    """A non-negative ignore_index (a padding class) on wgpu: the loss, its gradient and the
    accuracy counts skip those targets as on the cpu, through the loss's fused counts and through
    a CountCorrect node of its own (a Loss whose value is not the CrossEntropy node's)."""
    import dataclasses

    from anygrad.losses import cross_entropy
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, 4)).astype(np.float32)
    y = rng.integers(0, 7, 9)
    y[::3] = 2
    loss = cross_entropy(ignore_index=2)
    if not fused:
        build = loss.build
        loss = dataclasses.replace(loss, build=lambda b, out, t: b.op("Mul", [build(b, out, t), b.const(1.0)]))
    results, model = [], linear_model(4, 7)
    for dev in DEVICES:
        m = fresh(model).compile(loss=loss, optimizer=anygrad.optim.SGD(lr=0.5), device=device(dev))
        losses = [m.train_on_batch(x, y) for _ in range(3)]
        results.append((losses, m.evaluate(x, y), m.predict(x)))
    (cpu_losses, cpu_ev, pred), (gpu_losses, gpu_ev, _) = results
    np.testing.assert_allclose(gpu_losses, cpu_losses, **TOL)
    assert gpu_ev["accuracy"] == cpu_ev["accuracy"] == pytest.approx((pred.argmax(1) == y)[y != 2].mean())
    assert gpu_ev["top5"] == cpu_ev["top5"]
    assert gpu_ev["loss"] == pytest.approx(cpu_ev["loss"], rel=1e-5)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(targets=structures_of(["logits", "box", "x"]))
def test_target_parser_fuzz_raises_only_anygrad_errors(heads, targets):
    """Targets of any structure for a two-headed model: parsed, or an AnygradError."""
    model = fresh(heads[0]).compile(loss={"logits": "cross_entropy", "box": "l1"})
    try:
        got = model.parse_targets(targets)
    except AnygradError:
        return
    assert set(got) == {h.target for h in model.heads}
