"""Hugging Face models whose PyTorch semantics ONNX does not carry: GPT-2's Conv1D weights, stored
(in, out), and BART's nn.Embedding(padding_idx). Each goes through `from_torch` (both exporters)
and through `load_onnx` + `load_state_dict(torch.save(...))`, and must match PyTorch in outputs,
every parameter after one SGD step (lr 1: the gradient itself), 5-step losses, and the exported
state_dict. Tiny random-init configs, no downloads."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import anygrad
from anygrad.errors import ConfigError, ModelError

transformers = pytest.importorskip("transformers")

VOCAB, T, BATCH = 64, 8, 2
PAD = 1


class GPT2Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
        self.m = transformers.GPT2LMHeadModel(cfg)

    def forward(self, ids):
        return self.m(ids, return_dict=False)[0].reshape(-1, VOCAB)


class BartLogits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, max_position_embeddings=16, dropout=0.0,
                                      attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD,
                                      bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                                      forced_eos_token_id=None)
        self.m = transformers.BartForConditionalGeneration(cfg)

    def forward(self, ids):
        return self.m(input_ids=ids, decoder_input_ids=ids, return_dict=False)[0].reshape(-1, VOCAB)


FAMILIES = {"gpt2": GPT2Logits, "bart": BartLogits}


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, T), generator=g)
    ids[:, -3:] = PAD  # padded sequences: BART's padding row must get no gradient
    return ids, torch.randint(0, VOCAB, (BATCH * T,), generator=g)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def build(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = FAMILIES[family]()
    with torch.no_grad():  # weights of a trained model: padding rows and biases not at their init
        for p in net.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return net


def torch_losses(net: torch.nn.Module, ids, y, steps: int, lr: float) -> list[float]:
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    out = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(net(ids), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def imported(family: str, route: str, tmp_path) -> anygrad.Model:
    """The model through `route`, holding the weights of build(family, seed=0)."""
    net = build(family)
    ids, _ = batch()
    if route.startswith("from_torch"):
        return quiet(anygrad.from_torch, net, ids, dynamo=route.endswith("dynamo"))
    # load_state_dict: an ONNX file of other weights, then the checkpoint by PyTorch names
    path = tmp_path / "model.onnx"
    quiet(anygrad.from_torch, build(family, seed=1), ids, dynamo=True, path=path)
    torch.save(net.state_dict(), tmp_path / "weights.pt")
    model = anygrad.load_onnx(path)
    model.load_state_dict(tmp_path / "weights.pt")
    if family == "bart":  # by any name of the tied table, once the checkpoint has told them
        model.set_padding_idx("m.model.encoder.embed_tokens.weight", PAD)
        model.freeze("m.final_logits_bias")  # a registered buffer, which ONNX cannot tell from a weight
    return model


ROUTES = ["from_torch-dynamo", "from_torch-torchscript", "load_state_dict"]


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_pytorch(tmp_path, family, route):
    model = imported(family, route, tmp_path)
    ids, y = batch()
    net = build(family).eval()
    with torch.no_grad():
        expected = net(ids).numpy()
    np.testing.assert_allclose(model.predict(ids.numpy()), expected, atol=2e-5, rtol=0)

    # one SGD step with lr 1: every parameter moves by exactly its gradient
    model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=1.0), device="cpu")
    net = build(family)
    torch_losses(net, ids, y, 1, 1.0)
    theirs = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    model.train_on_batch(ids.numpy(), y.numpy())
    ours = model.to_torch_state_dict(as_numpy=True)
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert ours[k].shape == v.shape, k
        np.testing.assert_allclose(ours[k], v, atol=2e-5, rtol=0, err_msg=k)

    # five more steps: the losses follow PyTorch's
    model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.5), device="cpu")
    expected_losses = torch_losses(net, ids, y, 5, 0.5)
    got = [model.train_on_batch(ids.numpy(), y.numpy()) for _ in range(5)]
    np.testing.assert_allclose(got, expected_losses, atol=1e-5, rtol=0)
    # and the trained weights load back into the module, strictly
    net.load_state_dict(model.to_torch_state_dict(), strict=True)


def test_conv1d_weight_keeps_its_layout():
    """GPT-2's Conv1D weight is (in, out) and exported as stored: bound as is, exported as is, and a
    checkpoint holding it the other way round is refused rather than transposed to fit."""
    net = build("gpt2")
    model = quiet(anygrad.from_torch, net, batch()[0], dynamo=True)
    sd = model.to_torch_state_dict(as_numpy=True)
    for k, v in net.state_dict().items():
        assert sd[k].shape == tuple(v.shape), k
    flipped = {k: (v.T if k.endswith("c_attn.weight") else v) for k, v in net.state_dict().items()}
    with pytest.raises(ModelError, match=r"mis-shaped .*c_attn\.weight: checkpoint has \(96, 32\), the model needs \(32, 96\)"):
        model.load_state_dict(flipped)


def test_padding_row_gets_no_gradient_but_keeps_its_value(tmp_path):
    """Tied BART embeddings: the lookups skip the padding row, the tied output layer still trains it."""
    model = imported("bart", "from_torch-dynamo", tmp_path)
    lookups = [n for n in model.graph.nodes if n.op == "Gather" and n.attr("padding_idx") is not None]
    assert lookups and all(n.attr("padding_idx") == PAD for n in lookups)
    # the exported inference file does not carry the attribute (ONNX has no such thing)
    reloaded = anygrad.load_onnx(anygrad.save_onnx(model, tmp_path / "out.onnx"))
    assert not any(n.attr("padding_idx") is not None for n in reloaded.graph.nodes)


def test_set_padding_idx_errors():
    net = build("gpt2")
    model = quiet(anygrad.from_torch, net, batch()[0], dynamo=True)
    with pytest.raises(ConfigError, match="not a row of its 64 embeddings"):
        model.set_padding_idx("m.transformer.wte.weight", 64)
    with pytest.raises(ConfigError, match="no Gather on axis 0 reads it"):
        model.set_padding_idx("m.transformer.h.0.ln_1.weight", 0)
    with pytest.raises(ConfigError, match="matches no parameter"):
        model.set_padding_idx("no.such.table", 0)


def test_padding_idx_from_the_command_line(tmp_path):
    from anygrad.train.run import padding_spec
    assert padding_spec("m.model.shared.weight:1") == ("m.model.shared.weight", 1)
    with pytest.raises(ConfigError, match="TABLE:ROW"):
        padding_spec("m.model.shared.weight")


def test_from_torch_refuses_a_model_that_computes_differently(monkeypatch):
    """The forward check: a binding gone wrong is an error naming the parameter, not a silent model."""
    import anygrad.frontends.from_torch as ft
    real = ft.load_state_dict

    def swapped(model, state, strict=True):
        result = real(model, state, strict=strict)
        g = next(g for g in model.graph.params if model.graph.initializers[g].ndim == 2
                 and model.graph.initializers[g].shape[0] == model.graph.initializers[g].shape[1])
        model.graph.initializers[g] = np.ascontiguousarray(model.graph.initializers[g].T)
        return result

    monkeypatch.setattr(ft, "load_state_dict", swapped)
    with pytest.raises(ModelError, match=r"differs from the module by .* parameter '.*' .* is bound differently"):
        quiet(anygrad.from_torch, build("gpt2"), batch()[0], dynamo=True)


def test_from_torch_names_inputs_after_forward():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)

        def forward(self, ids, mask):
            return (self.emb(ids) * mask.unsqueeze(-1)).sum(1)

    ids, mask = torch.randint(0, 10, (2, 5)), torch.ones(2, 5)
    model = quiet(anygrad.from_torch, Two(), (ids, mask), dynamo=True)
    assert model.graph.inputs == ["ids", "mask"]
    model = quiet(anygrad.from_torch, Two(), {"mask": mask, "ids": ids}, dynamo=True)
    assert model.graph.inputs == ["ids", "mask"]
    with pytest.raises(ConfigError, match="takes no argument named 'other'"):
        anygrad.from_torch(Two(), {"ids": ids, "other": mask})
