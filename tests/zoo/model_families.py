"""The model-family zoo: the architectures people download, from the libraries they come from
(torchvision, timm, Hugging Face transformers), in tiny random-init configs built in code -- no
weights or configs are downloaded.

Each family is a factory of an nn.Module returning one tensor of logits, shape (rows, classes),
trained with cross-entropy against one class per row. Sizes are tiny (a few blocks, widths of
8-64, 16x16 to 32x32 images, 8 tokens) so that the zoo runs on two CPU cores in minutes. Dropout,
stochastic depth and SpecAugment are off: the comparison with PyTorch must be deterministic.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

BATCH = 4
CLASSES = 5
VOCAB, SEQ = 64, 8
PAD = 1  # the padding token of the text families; their inputs hold it, so padding_idx matters


@dataclass(frozen=True)
class ModelFamily:
    name: str                                       # library-architecture, the test id
    make: Callable[[], nn.Module]
    inputs: Callable[[np.random.Generator], np.ndarray]
    classes: int                                    # logits per row; the targets are rows of classes
    lr: float = 0.1                                 # of the five SGD steps after the lr-1 step
    exporters: tuple[str, ...] = ("dynamo", "torchscript")
    slow: bool = False                              # the costliest cases (they still run in CI)
    # exporter -> why it cannot export this family; from_torch falls back to the other one (the
    # test asserts that it did, and that the model still matches PyTorch)
    falls_back: dict[str, str] = field(default_factory=dict)

    @property
    def file_exporter(self) -> str:
        """The exporter whose file the load_state_dict route loads: the first that can export."""
        return next(e for e in self.exporters if e not in self.falls_back)

    def batch(self, seed: int) -> np.ndarray:
        """An input batch; its targets are drawn once the number of output rows is known."""
        return self.inputs(np.random.default_rng(seed))

    def targets(self, rows: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed + 1000).integers(0, self.classes, rows).astype(np.int64)


def _images(size: int, channels: int = 3):
    return lambda rng: rng.standard_normal((BATCH, channels, size, size)).astype(np.float32)


def _tokens(rng):
    ids = rng.integers(PAD + 1, VOCAB, (BATCH, SEQ)).astype(np.int64)
    ids[1:, -2:] = PAD  # padded sequences (no attention mask: the pad tokens are attended to)
    return ids


def _audio(rng):
    return rng.standard_normal((BATCH, 400)).astype(np.float32)


class Rows(nn.Module):
    """The wrapped model's logits as (rows, classes): a classifier's (B, C) as is, a token model's
    (B, T, V) as (B*T, V). Hugging Face models return ModelOutput objects; their logits are taken."""

    def __init__(self, inner: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.m = inner
        self.call = call

    def forward(self, x):
        out = self.call(self.m, x) if self.call else self.m(x)
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(-1, out.shape[-1])


# -- torchvision -----------------------------------------------------------------------------------
def tv_resnet():
    from torchvision.models.resnet import BasicBlock, ResNet
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)  # layer4 runs BatchNorm on 1x1 maps


def tv_mobilenet_v3():
    from torchvision.models.mobilenetv3 import InvertedResidualConfig as C
    from torchvision.models.mobilenetv3 import MobileNetV3
    setting = [C(16, 3, 16, 16, True, "RE", 2, 1, 1.0), C(16, 3, 32, 24, False, "HS", 2, 1, 1.0),
               C(24, 5, 48, 24, True, "HS", 1, 1, 1.0)]
    return MobileNetV3(setting, last_channel=32, num_classes=CLASSES, dropout=0.0)


def tv_efficientnet():
    from torchvision.models.efficientnet import EfficientNet, FusedMBConvConfig, MBConvConfig
    setting = [FusedMBConvConfig(1, 3, 1, 8, 8, 1),          # EfficientNetV2's fused block
               MBConvConfig(4, 3, 2, 8, 16, 2), MBConvConfig(4, 5, 2, 16, 24, 1)]  # V1's, with SE
    return EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=CLASSES, last_channel=32)


def tv_convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    # layer_scale 0.5 rather than 1e-6: the blocks' branches must weigh in the output and gradients
    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], stochastic_depth_prob=0.0,
                    layer_scale=0.5, num_classes=CLASSES)


def tv_vit():
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
                             num_classes=CLASSES)


def tv_swin():
    from torchvision.models.swin_transformer import SwinTransformer
    # 16x16 images, 4x4 patches: stage 1 on 4x4 tokens in 2x2 windows, its second block shifted
    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 1], num_heads=[1, 2], window_size=[2, 2],
                           stochastic_depth_prob=0.0, num_classes=CLASSES)


# -- timm --------------------------------------------------------------------------------------------
def _timm(name: str, **kwargs):
    import timm
    return lambda: timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)


def timm_mixer():
    # timm's mixer_* entry points fix num_blocks and embed_dim (a second value is a TypeError): the
    # class itself, as they build it
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(num_classes=CLASSES, img_size=32, patch_size=8, num_blocks=1, embed_dim=16)


# -- Hugging Face transformers -----------------------------------------------------------------------
_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def hf_bert():
    import transformers as t
    cfg = t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=16, pad_token_id=PAD, **_NO_DROPOUT)
    return Rows(t.BertForMaskedLM(cfg), lambda m, ids: m(input_ids=ids).logits)  # decoder tied to embeddings


def hf_gpt2():
    import transformers as t
    cfg = t.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return Rows(t.GPT2LMHeadModel(cfg), lambda m, ids: m(ids).logits)


def _causal_lm(config_cls, model_cls, **extra):
    def make():
        cfg = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         pad_token_id=PAD, bos_token_id=0, eos_token_id=0, **extra)
        return Rows(model_cls(cfg), lambda m, ids: m(input_ids=ids).logits)
    return make


def hf_llama():
    import transformers as t  # SDPA with grouped-query attention (2 key/value heads for 4 query heads)
    return _causal_lm(t.LlamaConfig, t.LlamaForCausalLM, tie_word_embeddings=False)()


def hf_qwen2():
    import transformers as t  # biased q/k/v projections, tied embeddings, the eager attention code path
    return _causal_lm(t.Qwen2Config, t.Qwen2ForCausalLM, tie_word_embeddings=True, attn_implementation="eager")()


def hf_t5():
    import transformers as t
    cfg = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                     pad_token_id=PAD, eos_token_id=0, decoder_start_token_id=PAD)
    return Rows(t.T5ForConditionalGeneration(cfg), lambda m, ids: m(input_ids=ids, decoder_input_ids=ids).logits)


def hf_bart():
    import transformers as t
    cfg = t.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                       decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD, bos_token_id=0,
                       eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return Rows(t.BartForConditionalGeneration(cfg), lambda m, ids: m(input_ids=ids, decoder_input_ids=ids).logits)


def hf_vit():
    import transformers as t
    cfg = t.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, num_labels=CLASSES, **_NO_DROPOUT)
    return Rows(t.ViTForImageClassification(cfg), lambda m, x: m(pixel_values=x).logits)


def hf_wav2vec2():
    import transformers as t
    cfg = t.Wav2Vec2Config(vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2),
                           num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, feat_extract_norm="group",
                           hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
                           final_dropout=0.0, layerdrop=0.0, apply_spec_augment=False, mask_time_prob=0.0,
                           pad_token_id=0)
    return Rows(t.Wav2Vec2ForCTC(cfg), lambda m, x: m(input_values=x).logits)  # CTC logits per frame


FAMILIES: dict[str, ModelFamily] = {f.name: f for f in [
    ModelFamily("torchvision-resnet", tv_resnet, _images(32), CLASSES, lr=0.05, slow=True),
    ModelFamily("torchvision-mobilenet_v3", tv_mobilenet_v3, _images(32), CLASSES),
    ModelFamily("torchvision-efficientnet", tv_efficientnet, _images(32), CLASSES, slow=True),
    ModelFamily("torchvision-convnext", tv_convnext, _images(32), CLASSES),
    ModelFamily("torchvision-vit", tv_vit, _images(32), CLASSES),
    ModelFamily("torchvision-swin", tv_swin, _images(16), CLASSES, slow=True),
    ModelFamily("timm-resnet", _timm("resnet18d", layers=(1, 1, 1, 1), channels=(8, 16, 24, 32), stem_width=8),
                _images(32), CLASSES),
    ModelFamily("timm-efficientnet", _timm("test_efficientnet"), _images(32), CLASSES, slow=True),
    ModelFamily("timm-mobilenetv3", _timm("mobilenetv3_small_050", depth_multiplier=0.1), _images(32), CLASSES, slow=True),
    ModelFamily("timm-convnext", _timm("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32)),
                _images(32), CLASSES),
    ModelFamily("timm-vit", _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=16, depth=1,
                                  num_heads=2), _images(32), CLASSES),
    ModelFamily("timm-deit", _timm("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, embed_dim=16,
                                   depth=1, num_heads=2), _images(32), CLASSES),
    ModelFamily("timm-mixer", timm_mixer, _images(32), CLASSES),
    ModelFamily("timm-regnet", _timm("regnety_002", depth=4, w0=8, wa=12.0, wm=1.5, group_size=8, stem_width=8),
                _images(32), CLASSES, slow=True),
    ModelFamily("hf-bert", hf_bert, _tokens, VOCAB),
    ModelFamily("hf-gpt2", hf_gpt2, _tokens, VOCAB),
    ModelFamily("hf-llama", hf_llama, _tokens, VOCAB, falls_back={"torchscript": (
        "torch.onnx's TorchScript exporter cannot convert scaled_dot_product_attention with enable_gqa=True "
        "(its AssertionError); the dynamo exporter can")}),
    ModelFamily("hf-qwen2", hf_qwen2, _tokens, VOCAB),
    ModelFamily("hf-t5", hf_t5, _tokens, VOCAB, falls_back={"dynamo": (
        "torch.onnx's dynamo exporter (torch 2.14.1) fails in its decomposition step: T5Attention's "
        "reshape of the transposed attention output becomes an aten.view the strides refuse; torch.export "
        "itself succeeds, and the TorchScript exporter exports T5")}),
    ModelFamily("hf-bart", hf_bart, _tokens, VOCAB, slow=True),
    ModelFamily("hf-vit", hf_vit, _images(32), CLASSES),
    ModelFamily("hf-wav2vec2", hf_wav2vec2, _audio, 8, slow=True),
]}
