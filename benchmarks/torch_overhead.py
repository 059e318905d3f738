"""Host (Python) overhead of the torch backend's step, measured on torch:cpu with tiny shapes.

    python benchmarks/torch_overhead.py                      # CNN batch 8 + tiny GPT, 1 thread
    python benchmarks/torch_overhead.py --models cnn --steps 200 --profile 25
    python benchmarks/torch_overhead.py --device torch:cuda  # the same on a GPU (native on cuda)

At these sizes the kernels take microseconds, so a step's time is mostly host time: Python per
graph node and per step. That is what bounds the torch backend on a GPU at small batches (the
GPU waits for the host). Per model it reports

- native: a PyTorch eager step of the same model (examples/mnist/model.py for the founding CNN,
  benchmarks/models.py's GPT builder for the GPT; torch.optim and torch.autograd);
- anygrad: `Model.train_step` on the torch backend, and its parts: `exe.run` (the executable
  alone) and the action loop alone (`_execute` over the precompiled plan, inputs already set);
- the number of graph nodes and plan actions, and microseconds per action of the loop;
- the action loop with every kernel replaced by a no-op that returns its cached outputs
  (`null loop`): the loop's own Python cost per action, without torch; the same for the
  straight-line function the executable generates from the plan (`null straight`, where the
  runtime has one; `straight` with the real kernels);
- with --profile N: a cProfile top list over N anygrad steps.

Times are the fastest of --repeats passes of --steps steps each, one torch thread (a shared machine).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import pstats
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def aten_ops(fn: Callable[[], None]) -> tuple[int, dict[str, int]]:
    """The aten operations one call of fn dispatches (autograd's backward ones included): each
    is a kernel launch, or at least a dispatch, on a GPU."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode
    seen: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return sum(seen.values()), dict(seen.most_common())


def _median_us(fn: Callable[[int], None], steps: int, repeats: int, sync: Callable[[], None]) -> float:
    for i in range(3):
        fn(i)
    sync()
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(steps):
            fn(i)
        sync()
        passes.append((time.perf_counter() - t0) / steps)
    return 1e6 * min(passes)  # the least disturbed pass: other jobs only ever add time


# -- the models: (anygrad model, torch module, optimizer factory, loss, batches) ----------------------
def cnn(batch: int):
    import torch

    import anygrad
    from anygrad.examples import FOUNDING_MODEL
    r = np.random.default_rng(0)
    batches = [(r.standard_normal((batch, 1, 28, 28)).astype(np.float32), r.integers(0, 10, batch))
               for _ in range(4)]
    torch.manual_seed(0)
    net = _load("mnist_model", ROOT / "examples/mnist/model.py").Net().train()
    model = anygrad.load_onnx(FOUNDING_MODEL, init="fresh")
    return (model, "nll", lambda: anygrad.optim.Adagrad(lr=1.0), net,
            lambda p: torch.optim.Adagrad(p, lr=1.0), torch.nn.functional.nll_loss, batches)


def gpt(batch: int):
    import torch

    import anygrad
    models = _load("bench_models", ROOT / "benchmarks/models.py")
    vocab, seq = 64, 16
    r = np.random.default_rng(0)
    batches = [(r.integers(0, vocab, (batch, seq)), r.integers(0, vocab, (batch * seq,))) for _ in range(4)]
    torch.manual_seed(0)
    module = models._gpt_module(vocab, seq, 32, 2, 2).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = anygrad.from_torch(module, torch.from_numpy(batches[0][0]), dynamo=False)
    return (model, "cross_entropy", lambda: anygrad.optim.SGD(lr=0.01, momentum=0.9), module,
            lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), torch.nn.functional.cross_entropy, batches)


MODELS = {"cnn": (cnn, 8), "gpt": (gpt, 2)}


def measure(name: str, batch: int, device: str, steps: int, repeats: int, profile: int) -> dict:
    import torch

    from anygrad.backends.torch import runtime
    model, loss, make_opt, module, torch_opt, torch_loss, batches = MODELS[name][0](batch)
    tdev = device.partition(":")[2] or "cpu"
    cuda = tdev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = len(batches)

    # native PyTorch eager, same model
    net = module.to(tdev)
    opt = torch_opt(net.parameters())
    data = [(torch.from_numpy(x).to(tdev), torch.from_numpy(np.asarray(y)).to(tdev)) for x, y in batches]

    def native(i: int) -> None:
        x, y = data[i % n]
        opt.zero_grad(set_to_none=True)
        torch_loss(net(x), y).backward()
        opt.step()

    out = {"model": name, "batch": batch, "device": device}
    out["native_us"] = _median_us(native, steps, repeats, sync)

    # anygrad on the torch backend
    model.compile(loss=loss, optimizer=make_opt(), device=device)
    out["anygrad_us"] = _median_us(lambda i: model.train_step(*batches[i % n]), steps, repeats, sync)
    inputs, targets = model._batch(*batches[0])
    exe = model.train_program(inputs, targets, flush=False)
    feeds = {**inputs, **targets}
    out["run_us"] = _median_us(lambda i: exe.run(feeds, fetch=[]), steps, repeats, sync)
    vals = exe._values(feeds)
    out["values_us"] = _median_us(lambda i: exe._values(feeds), steps, repeats, sync)
    out["loop_us"] = _median_us(lambda i: runtime._execute(exe.actions, vals), steps, repeats, sync)
    if hasattr(runtime, "_straight_line"):  # the generated step function the executable runs
        counts: list[int] = []
        runtime._execute(exe.actions, vals, counts)
        fn = runtime._straight_line(exe.actions, counts)
        out["straight_us"] = _median_us(lambda i: fn(vals), steps, repeats, sync)
    out["nodes"] = len(exe.graph.nodes)
    out["actions"] = len(exe.actions)
    out["fallback_ops"] = list(exe.fallback_ops)

    # the loop's own cost: every kernel a no-op returning the outputs it made last time
    cached = []
    for fn, ins, outs, casts in exe.actions:
        res = [vals[o] for o in outs]
        cached.append(((lambda _ins, res=res: res), ins, outs, casts))
    nvals = list(vals)
    out["null_loop_us"] = _median_us(lambda i: runtime._execute(cached, nvals), steps, repeats, sync)
    if hasattr(runtime, "_straight_line"):
        null_fn = runtime._straight_line(cached, [len(a[2]) for a in cached])
        out["null_straight_us"] = _median_us(lambda i: null_fn(nvals), steps, repeats, sync)
    out["us_per_action"] = out["loop_us"] / max(out["actions"], 1)
    out["null_us_per_action"] = out["null_loop_us"] / max(out["actions"], 1)
    out["ratio"] = out["native_us"] / out["anygrad_us"]
    out["native_aten"], out["native_aten_ops"] = aten_ops(lambda: native(0))
    # counted outside inference mode, where torch decomposes composite ops (reshape, to, matmul)
    # as it does for the native step: the same granularity on both sides
    mode = getattr(exe, "_inference_mode", None)
    if mode is not None:
        exe._inference_mode = contextlib.nullcontext
    out["anygrad_aten"], out["anygrad_aten_ops"] = aten_ops(lambda: model.train_step(*batches[0]))
    if mode is not None:
        exe._inference_mode = mode
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(profile):
            model.train_step(*batches[i % n])
        sync()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        out["profile"] = s.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn,gpt", help="comma list of cnn[:batch], gpt[:batch]")
    p.add_argument("--device", default="torch:cpu", help="anygrad torch device (native PyTorch runs on its device)")
    p.add_argument("--steps", type=int, default=50, help="steps per timed pass")
    p.add_argument("--repeats", type=int, default=5, help="timed passes (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--profile", type=int, default=0, help="cProfile this many anygrad steps per model")
    p.add_argument("--ops", action="store_true", help="list the aten ops of one step, native and anygrad")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.device}, {args.threads} thread(s); times in us per step (fastest pass)")
    print("| model | batch | native eager | anygrad train_step | ratio | exe.run | _values | action loop | "
          "nodes | actions | us/action | null loop | null us/action | straight | null straight | "
          "aten ops native / anygrad | fallbacks |")
    print("|" + " --- |" * 17)
    results = []
    for item in args.models.split(","):
        name, _, b = item.partition(":")
        r = measure(name, int(b) if b else MODELS[name][1], args.device, args.steps, args.repeats, args.profile)
        results.append(r)
        print(f"| {name} | {r['batch']} | {r['native_us']:.0f} | {r['anygrad_us']:.0f} | {r['ratio']:.2f} | "
              f"{r['run_us']:.0f} | {r['values_us']:.0f} | {r['loop_us']:.0f} | {r['nodes']} | {r['actions']} | "
              f"{r['us_per_action']:.1f} | {r['null_loop_us']:.0f} | {r['null_us_per_action']:.2f} | "
              f"{r.get('straight_us', float('nan')):.0f} | {r.get('null_straight_us', float('nan')):.0f} | "
              f"{r['native_aten']} / {r['anygrad_aten']} | "
              f"{','.join(r['fallback_ops']) or '-'} |", flush=True)
    if args.ops:
        for r in results:
            print(f"\n## aten ops per step, {r['model']}: native {r['native_aten_ops']}\n  anygrad {r['anygrad_aten_ops']}")
    for r in results:
        if "profile" in r:
            print(f"\n## cProfile, {r['model']} batch {r['batch']}, {args.profile} steps\n{r['profile']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
