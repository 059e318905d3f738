"""Training throughput of real models: anygrad vs PyTorch on the same device, same weights.

    python benchmarks/models.py --json out.json                        # issue 11's set on the GPU
    python benchmarks/models.py --models gpt2s:8,resnet50:64 --profile  # issue 19's sizes
    python benchmarks/models.py --device cpu --models resnet18:32,gpt:8 --seconds 3   # vs PyTorch CPU
    python benchmarks/models.py --list
    python benchmarks/models.py --implementation dawn --precision f16 --torch-cases eager,amp --profile

Every model is built here, from torchvision or from a small module in this file (no downloads),
with torch.manual_seed(0). anygrad gets the same initial weights through `anygrad.from_torch`;
each PyTorch case starts from a deep copy of the same module. All train with SGD (lr 0.01,
momentum 0.9) and cross-entropy (token-level for the GPTs), dropout 0, on synthetic data (the
speed does not depend on the values). Each (model, batch) runs in a child process of its own, so
that its memory is measured alone and one model's failure does not stop the others.

Per (model, batch), in this order:
- anygrad (`--device wgpu` or `cpu`): export time (from_torch), compile time (the first step:
  planning, shader and pipeline creation, the step itself), the first step's loss, samples/s
  (median of --repeats passes of about --seconds each, after warm-up), the planned device bytes
  of the step (the buffers anygrad allocates) and the process's GPU memory from nvidia-smi
  (peak during the anygrad case minus the level before anygrad opened the device, so the
  Vulkan context counts); with --profile a timestamp GPU profile of one step;
- with --profile on wgpu: the share of the step's GPU time on matrix units (kernels_mma) and the
  op kinds that stay on ALUs;
- PyTorch eager with its defaults (cuDNN convolutions in TF32 on the GPU; matmuls stay FP32,
  PyTorch's default), `eager-fp32` (cuDNN TF32 off; only for models with convolutions, the
  GPTs are FP32 either way), and `compile` (torch.compile, mode --compile-mode, PyTorch
  defaults; its compile time is the warm-up). Each: the first step's loss, samples/s, and
  torch.cuda.max_memory_allocated / max_memory_reserved, plus nvidia-smi's peak minus the level
  before PyTorch's first CUDA call (the CUDA context counts).
The PyTorch cases keep their batches on the device; anygrad uploads each batch from host memory,
as its training loop does. The loss check compares anygrad's first-step loss with PyTorch's
FP32 one (eager-fp32 where it ran, else eager).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


# -- models ------------------------------------------------------------------------------------------
def _gpt_module(vocab: int, seq: int, d: int, heads: int, layers: int):
    """A GPT-2-style decoder (pre-LN blocks, causal attention written out, GELU-tanh MLP, learned
    positions, untied head), logits flattened to (N*T, vocab) for token-level cross-entropy."""
    import torch
    from torch import nn

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads, self.dh = heads, d // heads
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            n, t, _ = x.shape
            q, k, v = self.qkv(x).split(d, dim=2)
            q, k, v = (z.view(n, t, self.heads, self.dh).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.dh))
            causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
            att = torch.softmax(att.masked_fill(causal, float("-inf")), dim=-1)
            return self.proj((att @ v).transpose(1, 2).contiguous().view(n, t, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = CausalSelfAttention()
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(seq, d)
            self.blocks = nn.Sequential(*(Block() for _ in range(layers)))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens):
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.blocks(self.wte(tokens) + self.wpe(pos))
            return self.lm_head(self.ln_f(x)).view(-1, vocab)

    return GPT()


def _hf_gpt2(vocab: int, seq: int, d: int, heads: int, layers: int):
    """Hugging Face's GPT2LMHeadModel as users fine-tune it (Conv1D layers, scaled dot-product
    attention, head tied to the token embedding), dropout 0, logits flattened to (N*T, vocab)."""
    import torch
    import transformers

    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=max(seq, 1024), n_embd=d, n_layer=layers,
                                  n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.GPT2LMHeadModel(cfg)

        def forward(self, tokens):
            return self.m(tokens).logits.reshape(-1, vocab)

    return LM()


def _hf_llama(vocab: int, seq: int, d: int, heads: int, kv_heads: int, mlp: int, layers: int):
    """Hugging Face's LlamaForCausalLM (RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query
    attention, untied head) at the given sizes, logits flattened to (N*T, vocab)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=mlp, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=max(seq, 1024), tie_word_embeddings=False)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.LlamaForCausalLM(cfg)

        def forward(self, tokens):
            return self.m(input_ids=tokens).logits.reshape(-1, vocab)

    return LM()


@dataclass(frozen=True)
class Spec:
    """One benchmark model: how to build it and what one batch of it looks like."""

    build: Callable[[], object]
    kind: str                  # "image" (C, H, W float input) or "tokens" (T int64 input)
    shape: tuple               # one sample's input shape
    classes: int               # classes (images) or vocabulary (tokens)
    batches: tuple[int, ...]   # default batch sizes on the GPU
    convs: bool                # has convolutions (cuDNN's TF32 default matters)
    compile: bool              # torch.compile by default (issue 11's table)
    about: str
    cpu_batches: tuple[int, ...] = ()

    def batch(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if self.kind == "tokens":
            return (rng.integers(0, self.classes, (n, *self.shape)).astype(np.int64),
                    rng.integers(0, self.classes, (n, *self.shape)).astype(np.int64))
        return (rng.standard_normal((n, *self.shape), dtype=np.float32),
                rng.integers(0, self.classes, n).astype(np.int64))


def _tv(name: str, **kw):
    def build():
        import torchvision
        return getattr(torchvision.models, name)(**kw)
    return build


def _vit_tiny():
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=4, num_layers=12, num_heads=3, hidden_dim=192,
                             mlp_dim=768, num_classes=10, dropout=0.0, attention_dropout=0.0)


def _founding_cnn():
    import importlib.util
    spec = importlib.util.spec_from_file_location("mnist_model", ROOT / "examples/mnist/model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Net()


MODELS: dict[str, Spec] = {
    "cnn": Spec(_founding_cnn, "image", (1, 28, 28), 10, (1000, 64), True, False,
                "the founding MNIST CNN (examples/mnist; its dropout stays on), cross-entropy over its log_softmax",
                (64,)),
    "resnet18": Spec(_tv("resnet18", num_classes=10), "image", (3, 32, 32), 10, (128, 512), True, True,
                     "torchvision ResNet-18, 32x32 input, 10 classes", (32,)),
    "mobilenetv2": Spec(_tv("mobilenet_v2", num_classes=10, dropout=0.0), "image", (3, 32, 32), 10, (128,),
                        True, False, "torchvision MobileNetV2, 32x32 input, 10 classes", (32,)),
    "gpt": Spec(lambda: _gpt_module(2048, 128, 256, 4, 4), "tokens", (128,), 2048, (32, 128), False, True,
                "GPT-style decoder, 4 layers, d 256, 4 heads, T 128, vocab 2048", (8,)),
    "vit": Spec(_vit_tiny, "image", (3, 32, 32), 10, (128,), True, False,
                "ViT-tiny (torchvision VisionTransformer: patch 4, 12 layers, d 192, 3 heads, MLP 768), 32x32",
                (32,)),
    "gpt2s": Spec(lambda: _gpt_module(50257, 256, 768, 12, 12), "tokens", (256,), 50257, (8,), False, False,
                  "GPT-2 small shape: 12 layers, d 768, 12 heads, vocab 50,257, T 256, untied head", (2,)),
    "resnet50": Spec(_tv("resnet50", num_classes=1000), "image", (3, 224, 224), 1000, (64,), True, False,
                     "torchvision ResNet-50, 224x224 input, 1000 classes", (8,)),
    "hfgpt": Spec(lambda: _hf_gpt2(2048, 128, 256, 4, 4), "tokens", (128,), 2048, (128,), False, False,
                  "Hugging Face GPT2LMHeadModel with the GPT's sizes (4 layers, d 256, 4 heads, T 128, vocab 2048, "
                  "tied head)", (8,)),
    "hfgpt2s": Spec(lambda: _hf_gpt2(50257, 256, 768, 12, 12), "tokens", (256,), 50257, (8,), False, False,
                    "Hugging Face GPT2LMHeadModel, GPT-2 small (12 layers, d 768, 12 heads, vocab 50,257, T 256, "
                    "tied head)", (2,)),
    "hfllama": Spec(lambda: _hf_llama(2048, 128, 256, 4, 2, 688, 4), "tokens", (128,), 2048, (128,), False, False,
                    "Hugging Face LlamaForCausalLM with the GPT's sizes (4 layers, d 256, 4 heads, 2 KV heads, "
                    "SwiGLU 688, T 128, vocab 2048)", (8,)),
}
ISSUE11 = ("resnet18", "mobilenetv2", "gpt", "vit")
LR, MOMENTUM = 0.01, 0.9
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "ANYGRAD_NUMPY_THREADS")


# -- GPU memory --------------------------------------------------------------------------------------
class GpuMemory:
    """nvidia-smi's used memory of the GPU (MiB), sampled every 20 ms in a thread; peak since mark()."""

    def __init__(self, index: int = 0):
        self.ok = True
        self.now = self._read(index)
        self.peak = self.now or 0
        self.index = index
        if self.now is None:
            self.ok = False
            return
        self._stop = False
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    @staticmethod
    def _read(index: int) -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=False)
            return int(out.stdout.split()[0])
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return None

    def _loop(self) -> None:
        while not self._stop:
            v = self._read(self.index)
            if v is not None:
                self.now = v
                self.peak = max(self.peak, v)
            time.sleep(0.02)

    def mark(self) -> int | None:
        """Settle, then start a new peak window; returns the level now (MiB)."""
        if not self.ok:
            return None
        time.sleep(0.3)
        v = self._read(self.index)
        self.now = self.peak = v
        return v

    def peak_since(self) -> int | None:
        if not self.ok:
            return None
        time.sleep(0.3)
        return self.peak

    def stop(self) -> None:
        if self.ok:
            self._stop = True


def on_cpu(device: str) -> bool:
    """anygrad's device runs on the CPU (numpy, or torch's CPU): PyTorch runs there too, else on CUDA."""
    return device.partition("+")[0] in ("cpu", "torch:cpu")


# -- timing ------------------------------------------------------------------------------------------
# Steps (each waited for) before the timed passes: a GPU that idled while the model compiled
# runs at a fraction of its clock until about 0.2 s of load raise it (an H200: 345 of 1,980 MHz;
# anygrad's tuning/profiling.py). Two warm-up steps were not enough: ViT-tiny's first pass of 0.3 s
# read 7,945 samples/s and its second 11,338 (2026-12-04), and PyTorch eager's 4,689 and 7,269.
WARM_S = 0.5


def _timed(step: Callable[[int], None], wait: Callable[[], None], batch: int, seconds: float,
           repeats: int, min_steps: int = 2) -> dict:
    """Warm (steps for WARM_S, then two timed to size the passes), then `repeats` passes of
    ~`seconds` each."""
    until = time.perf_counter() + WARM_S
    k = 0
    while k < 1 or time.perf_counter() < until:
        step(k)
        wait()
        k += 1
    t0 = time.perf_counter()
    step(0)
    step(1)
    wait()
    per = max((time.perf_counter() - t0) / 2, 1e-4)
    steps = max(min_steps, int(seconds / per))
    rates, host = [], 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(steps):
            h0 = time.perf_counter()
            step(i)
            host += time.perf_counter() - h0
        wait()
        rates.append(steps * batch / (time.perf_counter() - t0))
    med = statistics.median(rates)
    return {"samples_per_s": med, "samples_per_s_min": min(rates), "samples_per_s_max": max(rates),
            "samples_per_s_all": rates, "ms_per_step": 1e3 * batch / med, "steps_per_pass": steps,
            "host_us_per_step": 1e6 * host / (steps * repeats)}


def cuda_profile(step: Callable[[int], None], wait: Callable[[], None], steps: int = 10, top: int = 15) -> dict:
    """torch.profiler over `steps` steps on CUDA: GPU time and launches per step, the kernels and
    the aten operations (with the GPU time of the kernels each launched) that take the most."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    for i in range(3):
        step(i)
    wait()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        wait()
    wall = (time.perf_counter() - t0) / steps
    avgs = prof.key_averages()
    kernels = sorted((e for e in avgs if e.device_type == DeviceType.CUDA), key=lambda e: -e.self_device_time_total)
    ops = sorted((e for e in avgs if e.device_type == DeviceType.CPU and e.key.startswith("aten::")
                  and e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    gpu_us = sum(e.self_device_time_total for e in kernels) / steps
    return {"steps": steps, "wall_ms": 1e3 * wall, "gpu_ms": gpu_us / 1e3,
            "launches": sum(e.count for e in kernels) / steps,
            "kernels": [(e.key[:90], e.self_device_time_total / steps, e.count / steps) for e in kernels[:top]],
            "ops": [(e.key, e.self_device_time_total / steps, e.count / steps) for e in ops[:top]]}


def format_cuda_profile(title: str, d: dict) -> str:
    head = (f"### {title}: wall {d['wall_ms']:.2f} ms/step (profiled), GPU {d['gpu_ms']:.2f} ms, "
            f"{d['launches']:.0f} launches per step")
    lines = [head, "", "| aten op | GPU us/step | calls/step |", "| --- | --- | --- |"]
    lines += [f"| {k} | {us:.0f} | {n:g} |" for k, us, n in d["ops"]]
    lines += ["", "| kernel | GPU us/step | launches/step |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {us:.0f} | {n:g} |" for k, us, n in d["kernels"]]
    return "\n".join(lines)


# -- one (model, batch) --------------------------------------------------------------------------------
def run_anygrad(spec: Spec, module, batches, device: str, args, mem: GpuMemory | None) -> dict:
    import torch

    import anygrad
    from anygrad.optim import SGD

    x0, y0 = batches[0]
    level = mem.mark() if mem else None
    t0 = time.perf_counter()
    model = anygrad.from_torch(module, torch.from_numpy(x0[:2]), check=False)
    export_s = time.perf_counter() - t0
    name, plus, options = device.partition("+")  # torch:cuda+eager, +compile, +inductor (as seed_cnn.py)
    if plus:
        from anygrad.backends.torch import TorchBackend
        opts = set(options.split("+"))
        device = TorchBackend(name, cuda_graph="eager" not in opts, torch_compile=bool(opts & {"compile", "inductor"}))
    model.compile(loss="cross_entropy", optimizer=SGD(lr=LR, momentum=MOMENTUM), device=device,
                  precision=args.precision)
    t0 = time.perf_counter()
    loss0 = model.train_on_batch(x0, y0)  # returns after the step ran: compile + first step
    compile_s = time.perf_counter() - t0
    n = len(batches)
    out = {"framework": "anygrad", "case": args.device + ("-f16" if model.precision == "f16" else ""),
           "precision": model.precision, "export_s": export_s, "compile_s": compile_s,
           "first_loss": loss0, "device_name": model.backend.description}
    out |= _timed(lambda i: model.train_step(*batches[i % n]), lambda: model.read_metrics(reset=True),
                  len(x0), args.seconds, args.repeats)
    if args.profile and model.backend.name.startswith("torch") and model.backend.device.type == "cuda":
        import torch
        out["cuda_profile"] = cuda_profile(lambda i: model.train_step(*batches[i % n]), torch.cuda.synchronize,
                                           top=args.top)
    inputs0, targets0 = model._batch(x0, y0)
    exe = model.train_program(inputs0, targets0)
    if model.backend.name == "wgpu":
        from anygrad.backends.wgpu.planning.planner import memory_report
        rep = memory_report(exe.plan)
        out["planned_mib"] = rep.total / 2**20
        out["planned"] = {k: getattr(rep, k) / 2**20 for k in
                          ("parameters", "optimizer_state", "buffers", "activations", "inputs", "constants")}
        out["kernels"] = exe.n_kernels
        out["compile_times"] = exe.compile_times.as_dict()
        if mem and level is not None:
            out["smi_peak_mib"] = mem.peak_since() - level
        if args.profile and "timestamp-query" in model.backend.device.features:
            prof = exe.step_profile({**inputs0, **targets0}, repeat=3)
            out["profile"] = prof.as_dict()
            out["matrix_units"] = matrix_unit_share(prof.kernels)
        from anygrad.backends.wgpu.tuning import autotune
        out["tuned"] = [asdict(p) for p in autotune.picks]   # what timing chose over the rules, per shape
    return out  # the model's buffers go with this frame (the worker collects after each case)


def compiled_model(case: str, device: str, precision: str = "f32"):
    """(model, x, y): MODEL:BATCH's module through from_torch, compiled as run_anygrad compiles
    it (the benchmark's loss and optimizer), and one batch; for the probes (benchmarks/probes)."""
    import torch

    import anygrad
    from anygrad.optim import SGD
    name, batch = case.split(":")
    spec = MODELS[name]
    torch.manual_seed(0)
    x, y = spec.batch(int(batch), np.random.default_rng(0))
    model = anygrad.from_torch(spec.build(), torch.from_numpy(x[:2]), check=False)
    model.compile(loss="cross_entropy", optimizer=SGD(lr=LR, momentum=MOMENTUM), device=device, precision=precision)
    return model, x, y


def matrix_unit_share(kernels: list[tuple[str, float]], top: int = 8) -> dict:
    """Of a step profile's (kernel, ns): the share of GPU time in kernels on matrix units
    (kernels_mma: '[mma ' in the name), and the op kinds that stay on ALUs with their shares."""
    from anygrad.backends.wgpu.tuning.profiling import op_kind
    total = sum(ns for _, ns in kernels) or 1.0
    mma = sum(ns for name, ns in kernels if "[mma " in name)
    alu: dict[str, float] = {}
    for name, ns in kernels:
        if "[mma " not in name:
            alu[op_kind(name)] = alu.get(op_kind(name), 0.0) + ns
    kinds = sorted(alu.items(), key=lambda kv: -kv[1])[:top]
    return {"mma_share": mma / total, "mma_kernels": sum("[mma " in name for name, _ in kernels),
            "kernels": len(kernels), "alu_top": [(k, ns / total) for k, ns in kinds]}


def with_implementation(device: str, implementation: str | None) -> str:
    """`wgpu` (or `wgpu:<n|api>`) on the chosen WebGPU implementation: wgpu:dawn / wgpu:native
    (--implementation); other devices unchanged."""
    if not implementation or not device.startswith("wgpu") or device in ("wgpu:dawn", "wgpu:native"):
        return device
    return f"wgpu:{implementation}"


def run_torch(spec: Spec, module, batches, case: str, args, mem: GpuMemory | None) -> dict:
    import torch
    import torch.nn.functional as F

    cuda = not on_cpu(args.device)
    dev = "cuda" if cuda else "cpu"
    torch.backends.cudnn.benchmark = False  # PyTorch's default, said out loud
    if cuda:
        torch.backends.cudnn.allow_tf32 = case != "eager-fp32"  # default True: convolutions in TF32
        torch.backends.cuda.matmul.allow_tf32 = False          # PyTorch's default
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    level = mem.mark() if mem else None
    model = copy.deepcopy(module).to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = [(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)) for x, y in batches]
    fwd = model
    t0 = time.perf_counter()
    if case == "compile":
        fwd = torch.compile(model, mode=args.compile_mode)
    last = {}
    amp = case == "amp"  # torch.autocast float16 + GradScaler: the baseline for anygrad --precision f16
    scaler = torch.amp.GradScaler(dev) if amp else None

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        if amp:
            with torch.autocast(dev, dtype=torch.float16):
                loss = F.cross_entropy(fwd(x), y.reshape(-1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss = F.cross_entropy(fwd(x), y.reshape(-1))
            loss.backward()
            opt.step()
        last["loss"] = loss.detach()

    def wait() -> None:
        if cuda:
            torch.cuda.synchronize()

    step(0)
    first = float(last["loss"])
    if case == "compile":  # compiles the backward too on the first step; a few more for cudagraphs
        for i in range(3):
            step(i)
        wait()
    out = {"framework": "pytorch", "case": case, "first_loss": first,
           "device_name": torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    if case == "compile":
        out["compile_s"] = time.perf_counter() - t0
    out |= _timed(step, wait, len(batches[0][0]), args.seconds, args.repeats)
    if args.profile and cuda:
        out["cuda_profile"] = cuda_profile(step, wait, top=args.top)
    if cuda:
        out["max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        if mem and level is not None:
            out["smi_peak_mib"] = mem.peak_since() - level
    return out  # the worker collects and empties the CUDA cache after each case


def worker(name: str, batch: int, args) -> dict:
    if "compile" in args.torch_cases and not on_cpu(args.device):
        import triton  # noqa: F401  (before any Vulkan adapter: its LLVM can clash with lavapipe's)
    import torch
    spec = MODELS[name]
    rng = np.random.default_rng(0)
    batches = [spec.batch(batch, rng) for _ in range(args.data_batches)]
    torch.manual_seed(0)
    module = spec.build().train()
    res = {"model": name, "about": spec.about, "batch": batch, "device": args.device,
           "params": sum(p.numel() for p in module.parameters()), "cases": []}
    mem = GpuMemory() if not on_cpu(args.device) else None
    if on_cpu(args.device) and args.threads:
        torch.set_num_threads(args.threads)
    cases = [c for c in args.torch_cases if c != "eager-fp32" or (spec.convs and not on_cpu(args.device))]
    if on_cpu(args.device):
        cases = [c for c in cases if c != "compile"]
    if "compile" in cases and not (spec.compile or args.compile_all):
        cases.remove("compile")
    todo = ([("anygrad", None)] if not args.no_anygrad else []) + [("pytorch", c) for c in cases]
    for fw, case in todo:
        t0 = time.perf_counter()
        try:
            r = (run_anygrad(spec, module, batches, args.device, args, mem) if fw == "anygrad"
                 else run_torch(spec, module, batches, case, args, mem))
        except Exception as e:  # noqa: BLE001  (any failure: keep the other cases' numbers)
            import traceback
            traceback.print_exc()
            r = {"framework": fw, "case": case or args.device, "error": f"{type(e).__name__}: {e}"[:2000]}
        gc.collect()
        if fw == "pytorch" and not on_cpu(args.device):
            torch.cuda.empty_cache()
        r["wall_s"] = time.perf_counter() - t0
        res["cases"].append(r)
        print(f"  {name} b{batch} {fw} {r.get('case')}: " + (f"{r['samples_per_s']:.1f}/s" if "samples_per_s" in r
              else r.get("error", "?")), file=sys.stderr, flush=True)
    if mem:
        mem.stop()
    _derive(res)
    return res


def _derive(res: dict) -> None:
    """Ratios anygrad / each PyTorch case, and the first-step loss check."""
    ag = next((c for c in res["cases"] if c["framework"] == "anygrad" and "samples_per_s" in c), None)
    ref = next((c for c in res["cases"] if c.get("case") == "eager-fp32" and "first_loss" in c), None) or \
        next((c for c in res["cases"] if c.get("case") == "eager" and "first_loss" in c), None)
    if ag is None:
        return
    for c in res["cases"]:
        if c["framework"] == "pytorch" and "samples_per_s" in c:
            res[f"ratio_vs_{c['case']}"] = ag["samples_per_s"] / c["samples_per_s"]
    if ref is not None:
        res["loss_ref"] = ref["case"]
        res["first_loss_abs_diff"] = abs(ag["first_loss"] - ref["first_loss"])
        res["first_loss_rel_diff"] = res["first_loss_abs_diff"] / max(abs(ref["first_loss"]), 1e-12)


# -- driver ------------------------------------------------------------------------------------------
def parse_models(text: str, device: str) -> list[tuple[str, int]]:
    """'resnet18:128,512 gpt' -> [(resnet18, 128), (resnet18, 512), (gpt, default batches...)]."""
    out = []
    for item in text.replace(";", " ").split():
        name, _, bs = item.partition(":")
        if name not in MODELS:
            sys.exit(f"--models: unknown model '{name}'; choose from {', '.join(MODELS)}")
        spec = MODELS[name]
        sizes = [int(b) for b in bs.split(",") if b] or list(spec.cpu_batches if on_cpu(device) else spec.batches)
        out += [(name, b) for b in sizes]
    return out


def machine() -> dict:
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "node": platform.node(),
            "python": platform.python_version(), "cpus": os.cpu_count(), "numpy": np.__version__}
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10, check=False)
        info["gpu"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for mod in ("wgpu", "wgpudawn", "torch", "torchvision"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return info


def table(results: list[dict]) -> str:
    header = ("| model | batch | anygrad samples/s | PyTorch eager | ratio | eager TF32 off | ratio | "
              "torch.compile | ratio | AMP | ratio | peak MiB anygrad (planned) / PyTorch (allocated) | "
              "anygrad export + compile s | first-loss rel diff |")
    lines = [header, "| --- " * 14 + "|"]
    for r in results:
        c = {x.get("case"): x for x in r.get("cases", [])}
        ag = next((x for x in r.get("cases", []) if x["framework"] == "anygrad"), {})

        def rate(x):
            if not x:
                return "-"
            return f"{x['samples_per_s']:,.1f}" if "samples_per_s" in x else "error"

        def ratio(key, r=r):
            return f"{r[key]:.2f}" if key in r else "-"
        eager = c.get("eager", {})
        mem_ag = (f"{ag.get('smi_peak_mib', float('nan')):,.0f} ({ag['planned_mib']:,.0f})"
                  if "planned_mib" in ag else "-")
        mem_pt = (f"{eager.get('smi_peak_mib', float('nan')):,.0f} ({eager['max_allocated_mib']:,.0f})"
                  if "max_allocated_mib" in eager else "-")
        comp = (f"{ag['export_s']:.1f} + {ag['compile_s']:.1f}" if "compile_s" in ag else "-")
        lines.append(f"| {r['model']} | {r['batch']} | {rate(ag)} | {rate(eager)} | {ratio('ratio_vs_eager')} | "
                     f"{rate(c.get('eager-fp32'))} | {ratio('ratio_vs_eager-fp32')} | {rate(c.get('compile'))} | "
                     f"{ratio('ratio_vs_compile')} | {rate(c.get('amp'))} | {ratio('ratio_vs_amp')} | "
                     f"{mem_ag} / {mem_pt} | {comp} | "
                     f"{r.get('first_loss_rel_diff', float('nan')):.1e} |")
    times = [(r, x["compile_times"]) for r in results for x in r.get("cases", []) if x.get("compile_times")]
    if times:  # where the compile went (runtime.CompileTimes); the rest is autodiff, uploads, the first step
        head = "| model | batch | compile s | planning | tuning (shapes, candidates) | step pipelines (built) |"
        lines += ["", head, "| --- " * 6 + "|"]
        for r, t in times:
            ag = next(x for x in r["cases"] if x.get("compile_times") is t)
            lines.append(f"| {r['model']} | {r['batch']} | {ag['compile_s']:.1f} | {t['plan_s']:.1f} | "
                         f"{t['tune_s']:.1f} ({t['tuned_shapes']}, "
                         f"{t['tune_candidates']}) | {t['pipelines_s']:.1f} ({t['pipelines_built']}) |")
    return "\n".join(lines)


def profiles(results: list[dict], top: int) -> str:
    from anygrad.backends.wgpu.tuning.profiling import StepProfile
    text = []
    for r in results:
        for c in r.get("cases", []):
            if c.get("cuda_profile"):
                text.append(format_cuda_profile(f"{r['model']} b{r['batch']} {c['framework']} {c.get('case')}",
                                                c["cuda_profile"]))
            d = c.get("profile")
            if d:
                prof = StepProfile([tuple(k) for k in d["kernels"]], d["runs"], d["step_ns"], d["wall_ms"])
                text.append(prof.format(f"{r['model']} training step, batch {r['batch']}", top=top))
    return "\n\n".join(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=" ".join(ISSUE11),
                   help=f"models with optional batch sizes, e.g. 'resnet18:128,512 gpt:32' (from {', '.join(MODELS)}); "
                   "default: issue 11's set at their default batches")
    p.add_argument("--device", default="wgpu", help="anygrad device: wgpu or torch:cuda (vs PyTorch CUDA; torch:cuda+eager without CUDA "
                   "graphs, +compile as --compile, +inductor torch.compile alone), cpu or "
                   "torch:cpu (vs PyTorch CPU)")
    p.add_argument("--implementation", choices=("dawn", "native"), default=None,
                   help="WebGPU implementation for --device wgpu: dawn (wgpudawn: matrix units where the adapter "
                   "lists them) or native (wgpu-native); the device becomes wgpu:dawn / wgpu:native")
    p.add_argument("--torch-cases", default="eager,eager-fp32,compile",
                   help="PyTorch cases: eager (defaults), eager-fp32 (cuDNN TF32 off), compile, amp (autocast "
                   "float16 + GradScaler); 'none' for none")
    p.add_argument("--precision", choices=("f32", "f16"), default="f32",
                   help="anygrad's precision (f16: mixed precision, compile(precision='f16'))")
    p.add_argument("--compile-mode", default="reduce-overhead", help="torch.compile mode (default reduce-overhead)")
    p.add_argument("--compile-all", action="store_true", help="torch.compile every model (default: issue 11's)")
    p.add_argument("--no-anygrad", action="store_true")
    p.add_argument("--seconds", type=float, default=1.5, help="about this long per timed pass")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per case (median reported)")
    p.add_argument("--data-batches", type=int, default=4, help="distinct synthetic batches cycled through")
    p.add_argument("--threads", type=int, default=None,
                   help="--device cpu: CPU threads for both frameworks (torch.set_num_threads; OMP/OpenBLAS/MKL and "
                   "ANYGRAD_NUMPY_THREADS in the children's environment, read when numpy loads)")
    p.add_argument("--profile", action="store_true", help="GPU profile of one anygrad step (wgpu: timestamp queries); on CUDA, "
                   "torch.profiler tables of anygrad's torch backend and each PyTorch case")
    p.add_argument("--top", type=int, default=12, help="kernels listed per profile")
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # MODEL:BATCH, in a child process
    p.add_argument("--timeout", type=float, default=900, help="seconds per (model, batch) child")
    args = p.parse_args(argv)
    args.torch_cases = [] if args.torch_cases == "none" else [c for c in args.torch_cases.split(",") if c]
    args.device = with_implementation(args.device, args.implementation)

    if args.list:
        for name, s in MODELS.items():
            print(f"{name:12s} batches {s.batches} (cpu {s.cpu_batches}): {s.about}")
        return 0
    if args.worker:
        name, _, b = args.worker.partition(":")
        print(json.dumps(worker(name, int(b), args)))
        return 0

    if args.threads:  # the children load numpy after this: their BLAS pools take it
        os.environ.update({k: str(args.threads) for k in THREAD_ENV})
    meta = machine() | {"device": args.device, "seconds": args.seconds, "repeats": args.repeats,
                        "threads": args.threads,
                        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
                        "optimizer": f"SGD(lr={LR}, momentum={MOMENTUM})", "loss": "cross_entropy"}
    print(json.dumps(meta), file=sys.stderr)
    rest = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = []
    for name, batch in parse_models(args.models, args.device):
        t0 = time.perf_counter()
        print(f"{name} batch {batch} ...", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--worker", f"{name}:{batch}"],
                                  stdout=subprocess.PIPE, text=True, timeout=args.timeout,
                                  check=False)
            res = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
                {"model": name, "batch": batch, "error": f"child exited {proc.returncode}"}
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
            res = {"model": name, "batch": batch, "error": f"{type(e).__name__}: {e}"[:500]}
        res["child_s"] = time.perf_counter() - t0
        results.append(res)
        if args.json:  # after each model: a later failure keeps what ran
            # compact: benchmarks/results keeps under 2 MB (tests/test_docs.py), profiles are most of it
            args.json.write_text(json.dumps({"machine": meta, "results": results}, separators=(",", ":")))
    if args.profile:
        print("\n" + profiles(results, args.top))
    print(f"\n{meta.get('gpu', meta.get('cpu'))}; anygrad --device {args.device}; "
          f"median of {args.repeats} passes of ~{args.seconds}s\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
