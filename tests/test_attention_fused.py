"""Fused attention: the FusedAttention / FusedAttentionGrad reference kernels against PyTorch's
scaled_dot_product_attention (float64), the IR pass (ir/attention.py) on what both exporters emit
for hand-written attention, F.scaled_dot_product_attention, nn.MultiheadAttention and HF
GPT-2 / BERT / ViT blocks (fused graphs give the unfused graphs' outputs and gradients), the
wgpu kernels against numpy on shapes that take every tile path, and a tiny GPT's training
losses against PyTorch's with the pass on."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from anygrad.ir.graph import Node
from anygrad.ir.registry import get_op

torch = pytest.importorskip("torch")
F = torch.nn.functional
nn = torch.nn

RNG = np.random.default_rng(5)



@pytest.fixture(autouse=True)
def _fusion_on(monkeypatch):
    """The pass is off by default (slow kernels, see ir/attention.py): these tests turn it on."""
    monkeypatch.setenv("ANYGRAD_FUSE_ATTENTION", "1")

def _node(scale: float, causal: int = 0, offset: int = 0, mask: bool = False) -> Node:
    return Node("FusedAttention", ["q", "k", "v"] + (["m"] if mask else []), ["o", "lse"],
                {"scale": scale, "causal": causal, "causal_offset": offset}, name="fa")


def _torch_ref(q, k, v, bias, scale, causal, offset):
    """PyTorch float64: SDPA forward and backward of sum(out * r)."""
    tq, tk, tv = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    mask = None if bias is None else torch.tensor(bias, dtype=torch.float64)
    if causal:
        t, s = q.shape[-2], k.shape[-2]
        hide = torch.ones(t, s, dtype=torch.bool).tril(diagonal=offset).logical_not()
        causal_bias = torch.zeros(t, s, dtype=torch.float64).masked_fill(hide, float("-inf"))
        mask = causal_bias if mask is None else mask + causal_bias
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale)
    r = torch.tensor(RNG.standard_normal(out.shape))
    (out * r).sum().backward()
    return out.detach().numpy(), r.numpy(), [t.grad.numpy() for t in (tq, tk, tv)]


@pytest.mark.parametrize("shape", [(2, 3, 5, 7, 8, 8), (1, 2, 9, 4, 16, 12), (2, 1, 6, 6, 64, 64),
                                   (1, 1, 3, 11, 32, 8)])
@pytest.mark.parametrize("kind", ["plain", "mask", "bool", "causal", "causal_offset", "causal+mask"])
def test_reference_matches_pytorch_sdpa(shape, kind):
    b, h, t, s, d, dv = shape
    q, k, v = RNG.standard_normal((b, h, t, d)), RNG.standard_normal((b, h, s, d)), RNG.standard_normal((b, h, s, dv))
    bias = None
    if kind in ("mask", "causal+mask"):
        bias = RNG.standard_normal((b, 1, t, s))
    elif kind == "bool":
        keep = RNG.random((1, h, t, s)) > 0.3
        keep[..., 0] = True  # no row without a key (PyTorch's math SDPA gives zeros there too, checked below)
        bias = np.where(keep, 0.0, -np.inf)
    causal = int(kind.startswith("causal"))
    offset = max(s - t, 1) if kind == "causal_offset" else 0  # bottom-right aligned, or one key ahead
    scale = 1.0 / math.sqrt(d) * (1.3 if kind == "plain" else 1.0)
    out, r, grads = _torch_ref(q, k, v, bias, scale, causal, offset)
    node = _node(scale, causal, offset, bias is not None)
    ins = [q, k, v] + ([bias] if bias is not None else [])
    got, lse = get_op("FusedAttention").run(node, ins)
    np.testing.assert_allclose(got, out, rtol=1e-10, atol=1e-12)
    assert lse.shape == (b, h, t) and lse.dtype == np.float32
    dq, dk, dv_ = get_op("FusedAttentionGrad").run(node, [r, q, k, v, got, lse] + ins[3:])
    # lse is float32 (a backend's buffer): the recomputed probabilities carry its rounding
    for name, want, have in zip("qkv", grads, (dq, dk, dv_)):
        np.testing.assert_allclose(have, want, rtol=2e-6, atol=2e-6, err_msg=f"d{name}")


def test_fully_masked_rows_give_zeros():
    q, k, v = (RNG.standard_normal((1, 1, 3, 4)) for _ in range(3))
    bias = np.zeros((1, 1, 3, 3))
    bias[0, 0, 1, :] = -np.inf
    node = _node(0.5, mask=True)
    out, lse = get_op("FusedAttention").run(node, [q, k, v, bias])
    assert np.all(out[0, 0, 1] == 0) and np.isinf(lse[0, 0, 1]) and np.all(np.isfinite(out))
    want = F.scaled_dot_product_attention(*(torch.tensor(a) for a in (q, k, v)), attn_mask=torch.tensor(bias), scale=0.5)
    np.testing.assert_allclose(out, want.numpy(), atol=1e-12)
    grads = get_op("FusedAttentionGrad").run(node, [np.ones_like(out), q, k, v, out, lse, bias])
    assert all(np.all(np.isfinite(g)) for g in grads) and np.all(grads[0][0, 0, 1] == 0)


# -- the pass on exported modules --------------------------------------------------------------
class _Heads(nn.Module):
    """q, k, v from one Linear, heads split as GPTs do, then one of the attention forms."""

    def __init__(self, form: str, d: int = 16, heads: int = 2):
        super().__init__()
        self.form, self.heads = form, heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        hd = c // self.heads
        if self.form == "hand":  # nanoGPT: masked_fill of a tril buffer with -inf
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = att.masked_fill(torch.tril(torch.ones(t, t)).view(1, 1, t, t) == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        elif self.form == "hand_div":  # scores / sqrt(d) + an additive float mask, no causal shape
            bias = torch.linspace(-1, 1, t * t).view(t, t)
            y = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + bias, dim=-1) @ v
        elif self.form == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v)
        elif self.form == "sdpa_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.form == "sdpa_bool":
            keep = torch.ones(t, t, dtype=torch.bool).tril(diagonal=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            raise ValueError(self.form)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Mha(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.m(x, x, x, need_weights=False)[0]


def _hf(kind: str):
    import transformers as tf
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16, attn_pdrop=0.0,
                            resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        inner, example = tf.GPT2LMHeadModel(cfg), torch.randint(0, 40, (2, 6))
    elif kind == "bert":
        cfg = tf.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                            vocab_size=40, max_position_embeddings=16, attention_probs_dropout_prob=0.0,
                            hidden_dropout_prob=0.0)
        inner = tf.BertModel(cfg, add_pooling_layer=False)
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, 4:] = 0  # padding: a mask computed from an input, not a constant
        example = (torch.randint(0, 40, (2, 6)), mask)
    else:
        cfg = tf.ViTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                           image_size=8, patch_size=4, num_channels=3, attention_probs_dropout_prob=0.0,
                           hidden_dropout_prob=0.0)
        inner, example = tf.ViTModel(cfg, add_pooling_layer=False), torch.randn(2, 3, 8, 8)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = inner

        def forward(self, x, mask=None):
            out = self.m(x) if mask is None else self.m(x, attention_mask=mask)
            return out.logits if hasattr(out, "logits") else out.last_hidden_state

    torch.manual_seed(0)
    return Wrap().eval(), example


def _count_fused(model, shapes) -> int:
    from anygrad.program import training_forward
    g = training_forward(model.graph, shapes)
    return sum(n.op == "FusedAttention" for n in g.nodes)


def _step(model, module, x, y, monkeypatch, fuse: str):
    """One SGD(lr=1) step on numpy: (loss, parameters after it), i.e. the gradients."""
    from anygrad.optim import SGD
    monkeypatch.setenv("ANYGRAD_FUSE_ATTENTION", fuse)
    model.compile("mse", SGD(lr=1.0), device="cpu")
    model.load_state_dict({k: v.detach().numpy() for k, v in module.state_dict().items()}, strict=False)
    out = model.predict(x)
    loss = model.train_on_batch(x, y)
    return out, loss, model.state_dict()


def _check_fused_matches_unfused(module, example, dynamo, monkeypatch, fused: int, opset: int = 17):
    from anygrad.frontends.from_torch import from_torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_torch(module, example, dynamo=dynamo, opset=opset)
    examples = example if isinstance(example, tuple) else (example,)
    feeds = {name: t.numpy() for name, t in zip(model.input_names, examples)}
    shapes = {name: a.shape for name, a in feeds.items()}
    assert _count_fused(model, shapes) == fused
    monkeypatch.setenv("ANYGRAD_FUSE_ATTENTION", "0")
    assert _count_fused(model, shapes) == 0
    x = feeds if len(feeds) > 1 else feeds[model.input_names[0]]
    with torch.no_grad():
        want = module(*examples).numpy()
    y = want + RNG.standard_normal(want.shape).astype(np.float32)
    out_f, loss_f, sd_f = _step(model, module, x, y, monkeypatch, "1")
    out_u, loss_u, sd_u = _step(model, module, x, y, monkeypatch, "0")
    np.testing.assert_allclose(out_f, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out_f, out_u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss_f, loss_u, rtol=1e-5)
    for name in sd_u:
        np.testing.assert_allclose(sd_f[name], sd_u[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("form", ["hand", "hand_div", "sdpa", "sdpa_causal", "sdpa_bool", "mha"])
def test_pass_fuses_exported_attention(form, dynamo, monkeypatch):
    torch.manual_seed(0)
    module = _Mha() if form == "mha" else _Heads(form)
    _check_fused_matches_unfused(module, torch.randn(2, 6, 16), dynamo, monkeypatch, fused=1)


@pytest.mark.parametrize("form", ["sdpa", "sdpa_causal", "sdpa_bool"])
def test_pass_fuses_the_expanded_onnx_attention_op(form, monkeypatch):
    """At opset 23 the dynamo exporter writes SDPA as ONNX's Attention op; its expansion fuses."""
    torch.manual_seed(0)
    _check_fused_matches_unfused(_Heads(form), torch.randn(2, 6, 16), True, monkeypatch, fused=1, opset=23)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("kind", ["gpt2", "bert", "vit"])
def test_pass_fuses_hf_attention(kind, dynamo, monkeypatch):
    module, example = _hf(kind)
    _check_fused_matches_unfused(module, example, dynamo, monkeypatch, fused=1)


# -- backends against numpy ---------------------------------------------------------------------
def _attention_case(b, h, t, s, d, dv, mask: str | None):
    q = RNG.standard_normal((b, h, t, d)).astype(np.float32)
    k = RNG.standard_normal((b, h, s, d)).astype(np.float32)
    v = RNG.standard_normal((b, h, s, dv)).astype(np.float32)
    ins = [q, k, v]
    if mask == "float":  # per sample, broadcast over heads
        ins.append(RNG.standard_normal((b, 1, t, s)).astype(np.float32))
    elif mask == "hide":  # -inf entries, one row with no key at all
        m = np.where(RNG.random((t, s)) > 0.4, 0.0, -np.inf).astype(np.float32)
        m[0, :] = -np.inf
        ins.append(m)
    return ins


CASES = {  # (b, h, t, s, d, dv, mask, causal, offset)
    "plain": (1, 2, 5, 7, 8, 8, None, 0, 0),
    "float-mask": (2, 1, 6, 9, 4, 12, "float", 0, 0),
    "hidden-rows": (1, 1, 5, 6, 8, 4, "hide", 0, 0),
    "causal": (1, 2, 9, 9, 8, 8, None, 1, 0),
    "causal-offset": (1, 1, 5, 11, 4, 4, None, 1, 6),
    "causal+mask": (2, 1, 7, 7, 4, 4, "float", 1, 0),
    "odd-dims": (1, 2, 5, 6, 6, 3, "float", 1, 0),  # scalar rows (head dims not multiples of 4)
}


def _close(want: dict, got: dict, rtol: float, atol: float, what: str) -> None:
    """Outputs and gradients agree; lse's +inf (rows with no key) at the same places."""
    assert set(want) == set(got)
    for key, w in want.items():
        w, g = np.asarray(w), np.asarray(got[key])
        inf = np.isinf(w)
        np.testing.assert_array_equal(np.isinf(g), inf, err_msg=f"{what} {key}: infinities")
        scale = max(1.0, float(np.abs(w[~inf]).max(initial=0)))
        np.testing.assert_allclose(g[~inf], w[~inf], rtol=rtol, atol=atol * scale, err_msg=f"{what} {key}")


def _run_case(case, backend_run):
    from wgpu_util import op_graph
    b, h, t, s, d, dv, mask, causal, offset = case
    ins = _attention_case(b, h, t, s, d, dv, mask)
    attrs = {"scale": 0.7, "causal": causal, "causal_offset": offset}
    graph, feeds = op_graph("FusedAttention", ins, attrs, n_outputs=2, const=[3])
    return backend_run(graph, feeds)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_matches_numpy(case):
    from anygrad.backends import NumpyBackend
    from anygrad.backends.torch import TorchBackend

    def run(graph, feeds):
        want = NumpyBackend().compile(graph).run(feeds)
        exe = TorchBackend("torch:cpu").compile(graph)
        assert not exe.fallback_ops, exe.fallback_ops  # torch's own kernels, not the numpy reference
        got = exe.run(feeds)
        _close(want, got, 1e-5, 1e-6, what=case)
    _run_case(CASES[case], run)


@pytest.fixture(scope="module")
def wgpu():
    from wgpu_util import wgpu_backend
    return wgpu_backend()


@pytest.fixture(params=["one-tile", "tiles"])
def tiles(request, monkeypatch):
    """'tiles': 4 rows per workgroup and per tile, so every small case crosses query blocks and
    key tiles, with ragged last ones."""
    from anygrad.backends.wgpu.kernels import kernels_attention
    if request.param == "tiles":
        monkeypatch.setattr(kernels_attention, "BLOCK_Q", 4)
        monkeypatch.setattr(kernels_attention, "MAX_BLOCK_K", 4)
    return request.param


@pytest.mark.wgpu
@pytest.mark.parametrize("case", list(CASES))
def test_wgpu_kernels_match_numpy(case, wgpu, tiles):
    from wgpu_util import run_both

    def run(graph, feeds):
        want, got, exe = run_both(graph, feeds, backend=wgpu)
        _close(want, got, 1e-4, 1e-5, what=case)
        names = [st.kernel.name for st in exe.plan.steps]
        vec = "-vec4" if case != "odd-dims" else ""
        assert f"FusedAttention:fwd{vec}" in names and f"FusedAttentionGrad:dkdv{vec}" in names, names
        again = exe.run(feeds)
        for key, value in got.items():
            np.testing.assert_array_equal(np.asarray(again[key]), np.asarray(value), err_msg=f"{key}: second run")
    _run_case(CASES[case], run)


# -- training a tiny GPT with the pass on ---------------------------------------------------------
class _TinyGpt(nn.Module):
    def __init__(self, vocab: int = 16, t: int = 8, d: int = 16, layers: int = 2):
        super().__init__()
        self.vocab = vocab
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.lns = nn.ModuleList(nn.LayerNorm(d) for _ in range(2 * layers))
        self.attn = nn.ModuleList(_Heads("hand", d) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(approximate="tanh"), nn.Linear(2 * d, d))
                                 for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(self.lns[2 * i](x))
            x = x + mlp(self.lns[2 * i + 1](x))
        return self.head(x).view(-1, self.vocab)


def _gpt_losses(device, steps: int = 3):
    """(anygrad's losses and final parameters, PyTorch's losses) for `steps` SGD steps."""
    from anygrad.frontends.from_torch import from_torch
    from anygrad.optim import SGD
    torch.manual_seed(0)
    module = _TinyGpt()
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, 16, (2, 8)), rng.integers(0, 16, (2, 8))) for _ in range(steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_torch(module, torch.from_numpy(data[0][0]))
    model.compile("cross_entropy", SGD(lr=0.1, momentum=0.9), device=device)
    ours = [model.train_on_batch(x, y) for x, y in data]
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    theirs = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y).reshape(-1))
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    return ours, model.state_dict(), theirs, model


def test_tiny_gpt_trains_like_pytorch_with_the_pass():
    from anygrad.program import build_train_step
    ours, _, theirs, model = _gpt_losses("cpu")
    step = build_train_step(model.graph, {model.input_names[0]: (2, 8)}, (16,), model.loss, model.optimizer)
    ops = [n.op for n in step.nodes]
    assert ops.count("FusedAttention") == 2 and ops.count("FusedAttentionGrad") == 2
    assert "Softmax" not in ops and "SoftmaxGrad" not in ops
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.wgpu
def test_tiny_gpt_on_wgpu_like_pytorch_and_same_bits(wgpu):
    from wgpu_util import wgpu_backend
    ours, params, theirs, _ = _gpt_losses(wgpu)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    again, params2, _, _ = _gpt_losses(wgpu_backend())
    assert ours == again
    for name, value in params.items():
        np.testing.assert_array_equal(params2[name], value, err_msg=name)


class _Unfusable(nn.Module):
    """Attention the pass must leave alone: a learned bias on the scores (it needs a gradient),
    probabilities also returned, an active dropout on them, a head dim over MAX_HEAD_DIM."""

    def __init__(self, form: str, t: int = 6):
        super().__init__()
        self.form = form
        d = 160 if form == "wide" else 16
        self.qkv = nn.Linear(d, 3 * d)
        self.rel = nn.Parameter(torch.randn(t, t) * 0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if self.form == "learned_bias":
            att = att + self.rel
        p = torch.softmax(att, dim=-1)
        if self.form == "dropout":
            p = F.dropout(p, 0.5, training=True)
        y = p @ v
        return y + p.sum() if self.form == "probs_used" else y


@pytest.mark.parametrize("form", ["learned_bias", "probs_used", "dropout", "wide"])
def test_pass_leaves_what_it_cannot_fuse(form):
    from anygrad.frontends.from_torch import from_torch
    torch.manual_seed(0)
    module = _Unfusable(form)
    x = torch.randn(2, 6, 160 if form == "wide" else 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_torch(module, x, check=form != "dropout")
    assert _count_fused(model, {model.input_names[0]: tuple(x.shape)}) == 0


@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (8, 8), (96, 32), (5, 7)])
def test_wgpu_kernels_fit_the_weakest_adapter(dims):
    """At the WebGPU minimums (16 KiB workgroup memory, 256 invocations, 8 storage buffers per
    stage) every attention kernel fits, up to MAX_HEAD_DIM, with a mask (the most bindings)."""
    import re

    from wgpu_util import op_graph

    from anygrad.backends.wgpu.kernels import kernels_attention as ka
    from anygrad.backends.wgpu.kernels.kernel import AdapterCaps
    d, dv = dims
    ins = _attention_case(2, 3, 70, 130, d, dv, "float")
    graph, _ = op_graph("FusedAttention", ins, {"scale": 0.1, "causal": 1, "causal_offset": 60}, n_outputs=2,
                        const=[3])
    caps = AdapterCaps()
    kernels = []
    for node in graph.nodes:
        if node.op == "FusedAttention":
            kernels += ka.lower_fused_attention(node, graph, caps)
        elif node.op == "FusedAttentionGrad":
            kernels += ka.lower_fused_attention_grad(node, graph, caps)
    assert len(kernels) == 4
    for k in kernels:
        sizes = re.findall(r"var<workgroup> \w+: array<(f32|vec4<f32>), (\d+)>;", k.wgsl)
        used = sum(int(n) * (16 if ty.startswith("vec4") else 4) for ty, n in sizes)
        assert used <= caps.max_workgroup_storage, (k.name, used)
        wg = int(re.search(r"@workgroup_size\((\d+)\)", k.wgsl).group(1))
        assert wg <= caps.max_invocations_per_workgroup
        assert len(k.reads) + len(k.writes) <= caps.max_storage_buffers_per_stage, k.name
