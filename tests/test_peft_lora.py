"""LoRA through peft, the usual way to fine-tune on a small GPU: the PeftModel itself goes through
`from_torch` (its forward is `(*args, **kwargs)`), trains only its adapters with the losses
PyTorch gets over 5 AdamW steps, keeps every base weight bit-identical and without optimizer
state, and `save_adapters` writes peft's adapter_model.safetensors and adapter_config.json,
which peft loads back. Tiny random-init configs, no downloads; dynamo exports."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import anygrad

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

VOCAB, T, BATCH, STEPS = 100, 8, 2, 5


def gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


# (base model, LoRA targets, whether the targets store their weights (in, out) as GPT-2's Conv1D does)
FAMILIES = {"gpt2": (gpt2, ["c_attn"], True), "llama": (llama, ["q_proj", "v_proj"], False)}


def base_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family][0]()


def lora_model(family: str) -> torch.nn.Module:
    _, targets, fan_in_fan_out = FAMILIES[family]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                             fan_in_fan_out=fan_in_fan_out)
    net = peft.get_peft_model(base_model(family), config)
    with torch.no_grad():  # a LoRA part way through training: B is no longer zero
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return net


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, T), generator=g) for _ in range(STEPS)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(request):
    """(family, the trained anygrad model, the same PeftModel trained by PyTorch, both losses)."""
    family = request.param
    net = lora_model(family)
    ref = copy.deepcopy(net)
    data = batches()
    model = anygrad.from_torch(net, {"input_ids": data[0], "labels": data[0]})
    model.compile(loss="output", optimizer=anygrad.optim.AdamW(lr=1e-2), device="cpu")
    ours = [model.train_on_batch({"input_ids": ids.numpy(), "labels": ids.numpy()}) for ids in data]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)  # peft set requires_grad=False on the base
    ref.train()
    theirs = []
    for ids in data:
        opt.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    return family, model, ref, ours, theirs


def test_the_peft_model_exports_with_dynamo_and_only_its_adapters_train(trained):
    _, model, ref, _, _ = trained
    assert model.torch_binding.exporter == "dynamo"
    assert model.input_names == ["input_ids", "labels"] and model.output_names[:2] == ["loss", "logits"]
    lora = {k for k, p in ref.named_parameters() if p.requires_grad}
    assert lora and all(".lora_" in k for k in lora)
    named = model.parameter_aliases()
    assert {k for g in model.param_names for k in named[g]} & set(ref.state_dict()) == lora
    assert model.num_parameters() == sum(p.numel() for p in ref.parameters() if p.requires_grad)
    slots = {k for k in model.full_state() if k.startswith("optim.") and k != "optim.step"}
    assert slots and all(".lora_" in k for k in slots), sorted(slots)[:5]


def test_losses_match_pytorch_and_the_base_stays_bit_identical(trained):
    family, model, ref, ours, theirs = trained
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert len(set(np.round(ours, 4))) > 1  # the steps trained something
    state = model.to_torch_state_dict(as_numpy=True)
    untouched = base_model(family).state_dict()
    for key, p in ref.named_parameters():
        if p.requires_grad:
            np.testing.assert_allclose(state[key], p.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=key)
        else:
            assert np.array_equal(state[key], p.detach().numpy()), f"{key} moved"
            base_key = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert np.array_equal(state[key], untouched[base_key].numpy()), f"{key} is not the base's"


def test_saved_adapters_are_peft_files_that_peft_loads(trained, tmp_path):
    family, model, ref, _, _ = trained
    from safetensors.torch import load_file
    path = model.save_adapters(tmp_path / "ours")
    assert path == tmp_path / "ours" / "adapter_model.safetensors"
    ref.save_pretrained(tmp_path / "peft")  # peft's own files, from the PyTorch-trained twin
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    ours = load_file(path)
    assert set(ours) == set(theirs)
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-6)
    ours_config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    theirs_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    for config in (ours_config, theirs_config):  # peft writes the set in its iteration order
        config["target_modules"] = sorted(config["target_modules"])
    assert ours_config == theirs_config

    loaded = peft.PeftModel.from_pretrained(base_model(family), tmp_path / "ours")
    trained_sd = model.to_torch_state_dict()
    for key, value in loaded.state_dict().items():  # every tensor: base from the model, adapters from our file
        assert torch.equal(value, trained_sd[key]), key
    ids = batches()[0]
    loaded.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
