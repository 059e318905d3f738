"""PyTorch training scripts' own recipes, converted whole: the model's forward returns (logits,
loss), the optimizer has parameter groups (decay on matrices only), the schedule is a per-step
LambdaLR, gradients are clipped; all converted with anygrad.from_torch / anygrad.optim.from_torch
and trained with loss="output". Each must match the same PyTorch loop
(`loss.backward(); clip; opt.step(); sched.step()`) step for step."""
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import anygrad

VOCAB, T, D, BATCH, STEPS, CLIP = 64, 16, 32, 2, 10, 1.0


# -- a GPT as nanoGPT's model.py writes it ----------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.h = nn.ModuleList([Block(D), Block(D)])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT ties them

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        """nanoGPT's: decay on every tensor of two or more dimensions, none on biases and norms."""
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        nodecay = [p for p in params.values() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": nodecay, "weight_decay": 0.0}], lr=learning_rate, betas=betas)


def get_lr_factor(it, warmup=3, decay_iters=10, min_ratio=0.1):
    """nanoGPT's get_lr(it) / learning_rate: linear warmup, then cosine down to min_ratio."""
    if it < warmup:
        return (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / (decay_iters - warmup))
    return min_ratio + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1 - min_ratio)


def _batches(seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, VOCAB, (STEPS, BATCH, T))
    targets = rng.integers(0, VOCAB, (STEPS, BATCH, T))
    targets[:, :, -3:] = -1  # ignored positions, as a padded batch has
    return idx.astype(np.int64), targets.astype(np.int64)


def _torch_loop(net, opt, sched, forward):
    """The training script's loop; returns the loss of every step and the rates it used."""
    losses, rates = [], []
    for i in range(STEPS):
        rates.append([g["lr"] for g in opt.param_groups])
        loss = forward(net, i)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, rates


def _anygrad_loop(model, inputs):
    losses, rates = [], []
    for i in range(STEPS):
        rates.append(model.group_lrs)
        losses.append(model.train_on_batch(inputs(i)))
    return losses, rates


def _gpt_run(device):
    idx, targets = _batches()
    torch.manual_seed(0)
    net = GPT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = anygrad.from_torch(net, (torch.from_numpy(idx[0]), torch.from_numpy(targets[0])))
    opt = net.configure_optimizers(0.1, 3e-3, (0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, get_lr_factor)
    model.compile(loss="output", optimizer=anygrad.optim.from_torch(opt, net), device=device, clip_norm=CLIP,
                  scheduler=anygrad.optim.from_torch(sched, net))
    ours = _anygrad_loop(model, lambda i: {"idx": idx[i], "targets": targets[i]})
    theirs = _torch_loop(net, opt, sched,
                         lambda m, i: m(torch.from_numpy(idx[i]), torch.from_numpy(targets[i]))[1])
    return model, net, ours, theirs


def _check(model, net, ours, theirs, rtol):
    (our_losses, our_rates), (their_losses, their_rates) = ours, theirs
    assert len(model.group_lrs) == 2
    np.testing.assert_allclose(our_rates, np.float32(their_rates), rtol=1e-7)
    assert len({r[0] for r in their_rates}) > 5, "the schedule should move every step"
    np.testing.assert_allclose(our_losses, their_losses, rtol=rtol)
    # The weights agree to within a fraction of one Adam step (lr 2e-3/3e-3): attention's key bias
    # gets a gradient of pure rounding noise (softmax ignores a shift per query), which Adam's
    # normalisation turns into steps of up to lr in either direction, in torch as here.
    trained = model.to_torch_state_dict()
    for name, p in net.state_dict().items():
        if name in trained:
            np.testing.assert_allclose(trained[name].numpy(), p.numpy(), rtol=0, atol=1e-3, err_msg=name)


def test_gpt_with_loss_second_groups_lambdalr_and_clipping_matches_pytorch_cpu():
    model, net, ours, theirs = _gpt_run("cpu")
    assert model.heads[0].output == model.output_names[1]  # the loss, where the model put it
    _check(model, net, ours, theirs, rtol=1e-5)
    # the groups are nanoGPT's: decay on the matrices, none on the 1-D tensors
    decay, nodecay = model.param_groups
    assert (decay.optimizer.weight_decay, nodecay.optimizer.weight_decay) == (0.1, 0.0)
    shapes = {n: model.graph.initializers[n].shape for n in model.param_names}
    assert all(len(shapes[n]) >= 2 for n in decay.params) and all(len(shapes[n]) < 2 for n in nodecay.params)


@pytest.mark.wgpu
def test_gpt_recipe_matches_pytorch_on_wgpu():
    from wgpu_util import wgpu_backend
    model, net, ours, theirs = _gpt_run(wgpu_backend())
    _check(model, net, ours, theirs, rtol=1e-5)


# -- a Hugging Face model with its Trainer's groups and get_linear_schedule_with_warmup ---------------
def _hf_run(device):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=D, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0, use_cache=False)
    idx, _ = _batches(1)
    labels = idx.copy()
    labels[:, :, :2] = -100  # the usual ignored prompt positions
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        example = {"input_ids": torch.from_numpy(idx[0]), "labels": torch.from_numpy(labels[0])}
        model = anygrad.from_torch(net, example)
    # transformers.Trainer.create_optimizer: no decay on biases and LayerNorm weights
    forbidden = (torch.nn.LayerNorm,)
    no_decay = {f"{mn}.{pn}" if mn else pn for mn, m in net.named_modules()
                for pn, _ in m.named_parameters(recurse=False)
                if isinstance(m, forbidden) or pn.endswith("bias")}
    named = list(net.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n not in no_decay], "weight_decay": 0.01},
                             {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.999), eps=1e-8)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=STEPS)
    model.compile(loss="output", optimizer=anygrad.optim.from_torch(opt, net), device=device, clip_norm=CLIP,
                  scheduler=anygrad.optim.from_torch(sched, net))
    ours = _anygrad_loop(model, lambda i: {"input_ids": idx[i], "labels": labels[i]})
    theirs = _torch_loop(net, opt, sched, lambda m, i: m(input_ids=torch.from_numpy(idx[i]),
                                                         labels=torch.from_numpy(labels[i])).loss)
    return model, net, ours, theirs


def test_hf_gpt2_with_trainer_groups_and_linear_warmup_matches_pytorch_cpu():
    model, net, ours, theirs = _hf_run("cpu")
    _check(model, net, ours, theirs, rtol=1e-5)


@pytest.mark.wgpu
def test_hf_recipe_matches_pytorch_on_wgpu():
    from wgpu_util import wgpu_backend
    model, net, ours, theirs = _hf_run(wgpu_backend())
    _check(model, net, ours, theirs, rtol=1e-5)
