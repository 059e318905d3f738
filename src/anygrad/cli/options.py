"""Every command's arguments and their help text: what `anygrad COMMAND --help` prints, and
what README's command lines are parsed against. Apart from the commands so that the options read
as one reference, and the commands hold only what they do."""
from __future__ import annotations

import argparse

from .config import FOUNDING_DEFAULTS, MODEL_DEFAULTS

# predict and eval: the CPU, for both (a trained model's forward pass is quick there, and no shader
# compilation comes first); --device auto picks a GPU.
INFERENCE_DEVICE = "cpu"


def _float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers (one per channel), got {text!r}") \
            from None


def _add_group_args(p: argparse.ArgumentParser) -> None:
    """--no-decay and --param-group (optim/groups.py), for train and info alike."""
    p.add_argument("--no-decay", action="append", metavar="PATTERN", help="no weight decay for the parameters "
                   "matching this glob over graph or PyTorch names (repeatable), e.g. '*.bias' '*norm*'")
    p.add_argument("--param-group", dest="param_groups", action="append", metavar="PATTERN:KEY=VALUE,...",
                   help="a parameter group with its own optimizer settings, as torch.optim's param_groups "
                   "(repeatable), e.g. 'head.*:lr=1e-3,weight_decay=0' (patterns joined by |, betas=0.9;0.95)")


def _add_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX file to describe")
    p.add_argument("--freeze", action="append", metavar="PATTERN", help="count the parameters matching this "
                   "glob as frozen, as `anygrad train --freeze` would (repeatable)")
    p.add_argument("--batch-size", type=int, metavar="N", help="also plan the training step at this batch and "
                   "print its device memory: parameters, optimizer state, activations, workspace")
    p.add_argument("--device", help="the wgpu device to plan for (default: wgpu)")
    p.add_argument("--limits", metavar="PROFILE", help="plan under a limits profile: webgpu-default, uhd630, m1-8gb")
    p.add_argument("--memory-budget", metavar="SIZE", help="plan within this much device memory, e.g. 1.5GB "
                   "(default: the limits profile's); recomputes activations to fit, else names the batch that fits")
    p.add_argument("--optimizer", help="the optimizer whose state to count (default: the one `train` gives this "
                   f"model: {MODEL_DEFAULTS['optimizer']}, {FOUNDING_DEFAULTS['optimizer']} for the founding example)")
    _add_group_args(p)
    p.add_argument("--precision", choices=("f32", "f16"), default="f32", help="plan the step at this precision "
                   "(f16: float16 activations, half their bytes)")
    p.add_argument("--loss", help="the loss (default: nll after LogSoftmax, else cross_entropy)")


def _add_train(p: argparse.ArgumentParser) -> None:
    founding = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in FOUNDING_DEFAULTS.items())
    own = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in MODEL_DEFAULTS.items())
    p.description = (f"Train an ONNX model. Without MODEL: the bundled founding example (MNIST convnet) with "
                     f"its founding settings ({founding}). With MODEL: {own} unless given. "
                     "Every run writes config.json: `anygrad train --config RUN/config.json` repeats it (flags "
                     "override), `anygrad train --resume RUN` continues it from its last checkpoint.")
    p.add_argument("model", metavar="MODEL.onnx", nargs="?", help="ONNX file (default: the founding example)")
    p.add_argument("--config", metavar="FILE", help="take every setting from a run's config.json (flags override)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR (its --artifacts folder) from its "
                   "newest checkpoint; --epochs may extend it")
    p.add_argument("--dataset", help="mnist, fashion-mnist, cifar-10, npz, imagefolder or tokens (default: mnist); "
                   "tokens: a language model on a flat token "
                   "file (--data-dir FILE.bin of uint16 ids as nanoGPT writes, or FILE.npy of any integer "
                   "dtype; --block-size T)")
    p.add_argument("--data-dir", metavar="DIR", help="folder holding the dataset files (default: cache, "
                   "downloading when missing)")
    p.add_argument("--valid-fraction", type=float, metavar="F", help="hold out this part of the training data "
                   "for validation (default: the set's own test split, else 0.1; 0: no validation)")
    p.add_argument("--augment", metavar="SPEC", help="training-batch augmentation: crop:PADDING (random crop "
                   "after zero padding), hflip (random horizontal flip), comma-separated, e.g. crop:4,hflip; "
                   "none (default)")
    p.add_argument("--normalize", choices=("device", "host", "none"), help="per-channel normalisation: on the "
                   "device, uint8 images uploaded as they are (default); on the host (float32 batches); none")
    p.add_argument("--mean", type=_float_list, metavar="M[,M...]", help="per-channel mean in [0, 1] pixel units "
                   "(default: the dataset's)")
    p.add_argument("--std", type=_float_list, metavar="S[,S...]", help="per-channel std (default: the dataset's)")
    p.add_argument("--block-size", type=int, metavar="T", help="tokens dataset: tokens per training window "
                   "(the model's sequence length); windows of T + 1 tokens give inputs w[:-1], targets w[1:]")
    p.add_argument("--npz-keys", metavar="X,Y", help="array names of inputs and targets in an .npz dataset "
                   "(default: x,y)")
    p.add_argument("--prefetch", action="store_true", default=None, help="prepare the next batch in a background "
                   "thread while the device works")
    p.add_argument("--epochs", type=int, metavar="N", help="epochs to train (default: 1; founding example 8)")
    p.add_argument("--batch-size", type=int, metavar="N", help="samples per step (default: 64; founding example "
                   "1000)")
    p.add_argument("--valid-batch-size", type=int, metavar="N", help="validation batch size (default: batch-size)")
    p.add_argument("--optimizer", metavar="NAME", help="sgd, adam, adamw, adagrad, adadelta, rmsprop")
    p.add_argument("--lr", type=float, help="learning rate")
    _add_group_args(p)
    p.add_argument("--loss", metavar="NAME", help="nll, cross_entropy, mse, l1, bce_with_logits; output: the "
                   "model's own scalar loss output (output:NAME picks one of several)")
    p.add_argument("--device", help="auto, cpu, wgpu, wgpu:N, wgpu:vulkan|metal|dx12|gl, wgpu:native or "
                   "wgpu:dawn (the WebGPU implementation; Dawn needs anygrad-train[dawn]), or with "
                   "anygrad-train[torch] torch, torch:cuda, torch:mps, torch:cpu (default: auto: a wgpu GPU through "
                   "wgpu-native, else torch's CUDA/MPS, else the CPU; choose Dawn with wgpu:dawn)")
    p.add_argument("--compile", dest="torch_compile", action="store_true", default=None,
                   help="torch devices: the training step goes through torch.compile (inductor; a C++ compiler "
                   "on the CPU), with CUDA graphs on CUDA; the first steps compile (seconds to minutes)")
    p.add_argument("--seed", type=int, help="seed of the shuffles and dropout (default: 0)")
    p.add_argument("--artifacts", metavar="DIR", help="output folder (default: runs/<model>-<timestamp>); one "
                   "that holds another run is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --artifacts (its "
                   "config, metrics, weights and checkpoints)")
    p.add_argument("--on-nan", choices=("stop", "skip", "warn"), help="when the loss, a weight or a statistic "
                   "turns NaN or infinite: stop (default; keeps the last finite checkpoint, exit code 3), skip "
                   "(go back to the last finite state and go on), warn (go on)")
    p.add_argument("--export", choices=("best", "last"), help="which weights weights.* and model.onnx hold at "
                   "the end: the best epoch's by --monitor (default), or the last epoch's")
    p.add_argument("--init", choices=("onnx", "fresh"),
                   help="start from the file's weights (onnx, default) or PyTorch's default initialisation (fresh)")
    p.add_argument("--weights", metavar="FILE", help="fine-tune: start from the weights in a PyTorch state_dict "
                   "(.pt/.pth from torch.save, read without torch) or .safetensors; names must match (strict)")
    p.add_argument("--weights-partial", action="store_true", default=None, help="--weights: load the entries "
                   "that match and keep the model's own values for the rest, as load_state_dict(strict=False)")
    p.add_argument("--weights-key", metavar="KEY", help="--weights: the entry of a checkpoint dict that holds "
                   "the state_dict (default: searched for, e.g. 'model' or 'state_dict')")
    p.add_argument("--freeze", action="append", metavar="PATTERN", help="do not train the parameters matching "
                   "this glob over graph or PyTorch names (repeatable), e.g. 'conv1.*' or a buffer such as 'pe'")
    p.add_argument("--limits", metavar="PROFILE", help="train within a weaker adapter's limits on this one: "
                   "webgpu-default, uhd630, m1-8gb (binding and buffer sizes, workgroup limits, a memory budget)")
    p.add_argument("--memory-budget", metavar="SIZE", help="fit the training step in this much device memory, "
                   "e.g. 1.5GB (default: the limits profile's): tighter reuse, then activations recomputed in the "
                   "backward, else an error naming the largest batch that fits")
    p.add_argument("--precision", choices=("f32", "f16"), help="f32 (default), or f16: mixed precision as "
                   "torch.autocast + GradScaler (float16 activations and matmul/conv operands, float32 weights, "
                   "optimizer state, softmax, norms and losses; dynamic loss scaling); wgpu needs shader-f16")
    p.add_argument("--padding-idx", action="append", metavar="TABLE:ROW", help="give lookups of this row of this "
                   "embedding table no gradient, as nn.Embedding(padding_idx=ROW) does (ONNX cannot say so; "
                   "repeatable), e.g. 'embed_tokens.weight:1'")
    p.add_argument("--sync-batchnorm", action="store_true", default=None, help="data parallel (several devices, or "
                   "torchrun ranks): BatchNorm statistics over the whole global batch, as torch's SyncBatchNorm "
                   "(default: per device, as DDP)")
    p.add_argument("--grad-compression", choices=("none", "bf16"), help="torchrun ranks: send the gradients as "
                   "bfloat16 (half the bytes over gloo, summed in bfloat16, as DDP's bf16_compress_hook; default "
                   "none: float32)")
    p.add_argument("--drop-last", action="store_true", default=None, help="skip the last partial batch of each epoch")
    p.add_argument("--clip-grad-norm", type=float, metavar="MAX", help="scale the gradients down to this global "
                   "2-norm (torch.nn.utils.clip_grad_norm_)")
    p.add_argument("--accumulate", type=int, metavar="N", help="one optimizer step every N batches (gradients "
                   "summed, loss divided by N)")
    p.add_argument("--scheduler", metavar="NAME", help="learning-rate schedule: step, multistep, exponential, "
                   "cosine, linear, onecycle, plateau")
    p.add_argument("--scheduler-opt", action="append", metavar="KEY=VALUE", help="a scheduler option with "
                   "torch's name (repeatable), e.g. T_max=10, step_size=2, gamma=0.5, interval=step")
    p.add_argument("--monitor", metavar="METRIC", help="metric for the best checkpoint, early stopping and "
                   "plateau: a metrics.jsonl column: valid_loss (default), valid_accuracy, valid_top5, valid_perplexity, "
                   "valid_mse, valid_mae, valid_pixel_accuracy, valid_label_accuracy, with several outputs "
                   "valid_<output>_<metric>, train_... alike")
    p.add_argument("--mode", choices=("min", "max", "auto"), help="whether the monitored metric should go down "
                   "(min) or up (max); default auto: max for accuracies and top5, min for the rest (losses, "
                   "perplexity, mse, mae)")
    p.add_argument("--patience", type=int, metavar="EPOCHS", help="early stopping: stop after this many epochs "
                   "without improvement of the monitored metric")
    p.add_argument("--min-delta", type=float, help="smallest change that counts as an improvement (default 0)")
    p.add_argument("--keep-checkpoints", type=int, metavar="N", help="keep the newest N checkpoints (default 2; "
                   "the best one is kept apart)")
    p.add_argument("--checkpoint-every", type=int, metavar="STEPS", help="also checkpoint every STEPS steps "
                   "within an epoch")
    p.add_argument("--log-every", type=int, metavar="STEPS",
                   help="progress every STEPS steps (default: about ten times per epoch)")
    p.add_argument("--quiet", action="store_true", help="no progress lines, only a summary")


def _add_inference_args(p: argparse.ArgumentParser, device: str) -> None:
    p.add_argument("model", metavar="MODEL", help="a run folder (its model.onnx or checkpoints), an .onnx file, "
                   "a checkpoint .json or weights.npz")
    p.add_argument("--dataset", help="mnist, fashion-mnist, cifar-10, npz, imagefolder, or tokens for eval (default: the run's, "
                   "else mnist)")
    p.add_argument("--data-dir", metavar="DIR", help="folder (or .npz file) holding the dataset")
    p.add_argument("--split", choices=("valid", "train"), default="valid",
                   help="valid: the test split (or held-out part) of the dataset (default)")
    p.add_argument("--device", default=device, help=f"cpu, wgpu, torch, auto, ... (default: {device})")


def _add_plot(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="DIR", help="a run folder with metrics.jsonl (or the metrics.jsonl itself)")
    p.add_argument("-o", "--output", metavar="OUT", help="folder for loss.png, accuracy.png and one png per other metric "
                   "(perplexity.png, mae.png, ...) (default: DIR)")


def _add_predict(p: argparse.ArgumentParser) -> None:
    _add_inference_args(p, INFERENCE_DEVICE)
    p.add_argument("--index", type=int, default=0, help="which sample of the split (default: 0)")
    p.add_argument("--image", metavar="FILE", help="classify your own image (PNG/JPEG; needs anygrad-train[image]): "
                   "resized to the model's input, greyscale for one channel, inverted when the background is "
                   "white, normalised as the run was trained (its config.json)")
    p.add_argument("--top", type=int, default=3, help="how many classes to list (default: 3)")


def _add_eval(p: argparse.ArgumentParser) -> None:
    _add_inference_args(p, INFERENCE_DEVICE)
    p.add_argument("--batch-size", type=int, default=500, metavar="N", help="samples per forward pass (default: 500)")


def _add_codegen(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX file to write as Python")
    p.add_argument("-o", "--output", metavar="FILE.py", help="the module to write (default: <model>_model.py)")
    p.add_argument("--weights-out", metavar="W.safetensors", help="where to write the weights, under the "
                   "generated module's state_dict names (default: beside FILE.py, same name)")
    p.add_argument("--no-weights", action="store_true", help="write the code only")
    p.add_argument("--weights-only", action="store_true", help="write the weights only, where the module at -o "
                   "reads them (a module written with --no-weights stays as it is)")
    p.add_argument("--overwrite", action="store_true", help="replace the files already at -o and --weights-out "
                   "(the module and its weights); without it, an existing file is refused")


def _add_settings(p: argparse.ArgumentParser) -> None:
    how = p.add_mutually_exclusive_group()
    how.add_argument("--markdown", action="store_true", help="print the docs' table of every setting instead")
    how.add_argument("--update", metavar="FILE", help="rewrite the settings table between its markers in FILE "
                     "(docs/settings.md)")
