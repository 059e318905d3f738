"""The model zoo: small PyTorch models of the families people train and export, with their data.

Each Family holds a model factory, a batch generator and the loss on both sides (anygrad's loss
name and PyTorch's functional loss). Sizes are tiny so that eight training steps of every family
run on lavapipe (software Vulkan) in seconds. Dropout is p=0 everywhere: the comparison with
PyTorch must be deterministic; BatchNorm trains on batch statistics on both sides.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BATCH = 4


# -- ResNet: residual adds, strided 1x1 downsampling, BatchNorm ----------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


# -- MobileNet (v2/v3 style): depthwise + pointwise, ReLU6, HardSwish, squeeze-excite -------------
class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, expand: int, stride: int):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.expand = nn.Sequential(nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6())
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                                       nn.BatchNorm2d(hidden), nn.Hardswish())
        self.se_reduce = nn.Conv2d(hidden, 4, 1)
        self.se_expand = nn.Conv2d(4, hidden, 1)
        self.project = nn.Sequential(nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = self.depthwise(self.expand(x))
        s = F.hardsigmoid(self.se_expand(F.relu(self.se_reduce(F.adaptive_avg_pool2d(h, 1)))))
        out = self.project(h * s)
        return x + out if self.use_res else out


class MobileNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.block1 = InvertedResidual(8, 8, expand=2, stride=1)
        self.block2 = InvertedResidual(8, 12, expand=2, stride=2)
        self.head = nn.Linear(12, classes)

    def forward(self, x):
        x = self.block2(self.block1(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


# -- Transformer encoder classifier --------------------------------------------------------------
PAD = 0


class HandAttention(nn.Module):
    """Multi-head attention written out: q/k/v projections, softmax(QK^T/sqrt(d)) V, padding mask."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, pad):  # pad: (N, T) True where the token is padding
        n, t, d = x.shape
        split = lambda z: z.view(n, t, self.heads, self.dh).transpose(1, 2)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.dh)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(n, t, d))


class SDPAttention(HandAttention):
    """The same projections through F.scaled_dot_product_attention with a boolean keep-mask."""

    def forward(self, x, pad):
        n, t, d = x.shape
        split = lambda z: z.view(n, t, self.heads, self.dh).transpose(1, 2)
        keep = ~pad[:, None, None, :]
        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), attn_mask=keep)
        return self.o(out.transpose(1, 2).reshape(n, t, d))


class EncoderBlock(nn.Module):
    """Pre-norm encoder block; attention: "module" (nn.MultiheadAttention), "hand" or "sdpa"."""

    def __init__(self, d: int, heads: int, attention: str):
        super().__init__()
        self.attention = attention
        self.attn = {"module": lambda: nn.MultiheadAttention(d, heads, dropout=0.0, batch_first=True),
                     "hand": lambda: HandAttention(d, heads), "sdpa": lambda: SDPAttention(d, heads)}[attention]()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, pad):
        h = self.ln1(x)
        if self.attention == "module":
            h = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        else:
            h = self.attn(h, pad)
        x = x + h
        return x + self.ff(self.ln2(x))


class TransformerClassifier(nn.Module):
    def __init__(self, vocab: int = 20, seq: int = 8, d: int = 16, heads: int = 2, classes: int = 3):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, seq, d) * 0.1)
        self.blocks = nn.ModuleList([EncoderBlock(d, heads, a) for a in ("module", "hand", "sdpa")])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        pad = tokens == PAD
        x = self.tok(tokens) + self.pos
        for block in self.blocks:
            x = block(x, pad)
        keep = (~pad).unsqueeze(-1).to(x.dtype)  # mean over the real tokens
        pooled = (self.ln(x) * keep).sum(1) / keep.sum(1)
        return self.head(pooled)


# -- GPT-style decoder: causal mask, tied embeddings, token-level cross entropy --------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(n, t, self.heads, self.dh).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.dh))
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        att = torch.softmax(att.masked_fill(causal, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).contiguous().view(n, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 24, seq: int = 8, d: int = 16, heads: int = 2, layers: int = 2):
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*(GPTBlock(d, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, tokens):
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.blocks(self.wte(tokens) + self.wpe(pos))
        logits = self.lm_head(self.ln_f(x))
        return logits.view(-1, self.vocab)  # (N*T, vocab): cross entropy over every token


# -- U-Net: ConvTranspose upsampling, skip concatenation, per-pixel sigmoid + BCE ------------------
def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc1 = conv_block(1, 8)
        self.enc2 = conv_block(8, 16)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec1 = conv_block(16, 8)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        d1 = self.dec1(torch.cat([self.up(e2), e1], dim=1))
        return self.out(d1)  # logits; the loss applies the sigmoid (BCEWithLogits)


# -- Recurrent sequence classifiers --------------------------------------------------------------
class RecurrentClassifier(nn.Module):
    def __init__(self, cell: str, features: int = 6, hidden: int = 12, classes: int = 3, layers: int = 1,
                 bidirectional: bool = False):
        super().__init__()
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn(features, hidden, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), classes)

    def forward(self, x):  # x: (N, T, features)
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


# -- MLP regressor -------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)


# -- the families --------------------------------------------------------------------------------
def _images(shape):
    return lambda rng: rng.standard_normal((BATCH, *shape)).astype(np.float32)


def _classes(k, per_sample=()):
    return lambda rng: rng.integers(0, k, (BATCH, *per_sample)).astype(np.int64)


def _padded_tokens(vocab: int, seq: int):
    def make(rng):
        tokens = rng.integers(1, vocab, (BATCH, seq)).astype(np.int64)
        lengths = rng.integers(seq // 2, seq + 1, BATCH)  # every row keeps at least half its tokens
        tokens[np.arange(seq)[None, :] >= lengths[:, None]] = PAD
        return tokens
    return make


def _masks(rng):
    return (rng.random((BATCH, 1, 8, 8)) < 0.5).astype(np.float32)


@dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[np.random.Generator], np.ndarray]
    targets: Callable[[np.random.Generator], np.ndarray]
    loss: str                                   # anygrad loss name
    torch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ops: frozenset[str]                         # ONNX ops both exporters must write for this family
    lr: float = 0.05

    def batches(self, steps: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        return [(self.inputs(rng), self.targets(rng)) for _ in range(steps)]


def _ce(out, y):
    return F.cross_entropy(out, y.reshape(-1))


FAMILIES = {f.name: f for f in [
    Family("resnet", ResNet, _images((3, 8, 8)), _classes(5), "cross_entropy", _ce,
           frozenset({"Conv", "BatchNormalization", "Add", "Relu"})),
    Family("mobilenet", MobileNet, _images((3, 8, 8)), _classes(5), "cross_entropy", _ce,
           frozenset({"Conv", "BatchNormalization", "Clip", "HardSwish", "HardSigmoid"})),  # Clip: ReLU6
    Family("transformer", TransformerClassifier, _padded_tokens(20, 8), _classes(3), "cross_entropy", _ce,
           frozenset({"Gather", "LayerNormalization", "MatMul", "Softmax", "Where", "Erf"})),
    Family("gpt", GPT, _classes(24, (8,)), _classes(24, (8,)), "cross_entropy", _ce,
           frozenset({"Gather", "Trilu", "Where", "Softmax", "LayerNormalization", "Tanh"}), lr=0.1),
    Family("unet", UNet, _images((1, 8, 8)), _masks, "bce_with_logits", F.binary_cross_entropy_with_logits,
           frozenset({"ConvTranspose", "Concat", "MaxPool", "BatchNormalization"})),
    Family("lstm", lambda: RecurrentClassifier("lstm", layers=2, bidirectional=True), _images((5, 6)),
           _classes(3), "cross_entropy", _ce, frozenset({"LSTM"}), lr=0.1),
    Family("gru", lambda: RecurrentClassifier("gru"), _images((5, 6)), _classes(3), "cross_entropy", _ce,
           frozenset({"GRU"}), lr=0.1),
    Family("mlp", MLP, _images((10,)), lambda rng: rng.standard_normal((BATCH, 2)).astype(np.float32),
           "mse", F.mse_loss, frozenset({"Gemm", "Tanh", "Relu"})),
]}
