"""Machinery of the model-family zoo: PyTorch's reference run (in float32 and float64), and the
same run in anygrad through one route: `from_torch` with either exporter, or `load_onnx` +
`load_state_dict` of a torch.save'd state_dict by PyTorch names.

The run: the output in eval mode; one SGD step with lr 1 (every parameter moves by exactly its
gradient, and BatchNorm's running statistics by one update), compared as the whole state_dict;
then five SGD steps at the family's lr, compared by their losses.

Tolerances are float32 noise measured on PyTorch itself: anygrad (float32) is compared with the
float64 run, and may differ from it by a small multiple of what PyTorch's float32 runs differ from
it, plus 2e-5 of the value's scale. BatchNorm over four values (a 1x1 map of a batch of 4) or
softmax over near-ties amplifies rounding a thousandfold; the float64 run shows how much. PyTorch
runs float32 twice, in its default memory format and in channels_last, whose convolutions sum in
another order: one order alone can be lucky on a given CPU (torchvision's ResNet, conv1's weight
after one step on an AMD EPYC host with torch 2.14.1: 5.5e-5 from float64 by default, 9.1e-4 in
channels_last, anygrad 9.6e-4).
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from model_families import ModelFamily

import anygrad

STEPS = 5
BASE_TOL = 2e-5     # relative to max(1, |value|): float32 noise of the shallow nets
NOISE_FACTOR = 8    # times PyTorch's own float32-vs-float64 difference


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter deprecations and tracer notes, not the model's
        return fn(*args, **kwargs)


def build(family: ModelFamily, seed: int = 0) -> torch.nn.Module:
    """A seeded instance with the weights of a trained model: no parameter at its init constant
    (zero-initialised last BatchNorm gammas, layer scales, padding rows, biases)."""
    torch.manual_seed(seed)
    net = family.make()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return net


def state_arrays(net: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in net.state_dict().items()}


@dataclass
class Run:
    output: np.ndarray                  # eval-mode output on the batch
    stepped: dict[str, np.ndarray]      # the state_dict after one SGD step with lr 1
    losses: np.ndarray                  # of the STEPS steps after it


def torch_run(family: ModelFamily, net: torch.nn.Module, x: np.ndarray, y: np.ndarray,
              dtype: torch.dtype, channels_last: bool = False) -> Run:
    net = copy.deepcopy(net).to(dtype)
    xt = torch.from_numpy(x)
    xt = xt.to(dtype) if xt.is_floating_point() else xt
    if channels_last:  # 4-d weights and images only; other tensors keep their layout
        net = net.to(memory_format=torch.channels_last)
        xt = xt.contiguous(memory_format=torch.channels_last) if xt.dim() == 4 else xt
    yt = torch.from_numpy(y)
    with torch.no_grad():
        output = net.eval()(xt).double().numpy()
    net.train()

    def step(opt) -> float:
        loss = torch.nn.functional.cross_entropy(net(xt), yt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    step(torch.optim.SGD(net.parameters(), lr=1.0))
    stepped = state_arrays(net)
    opt = torch.optim.SGD(net.parameters(), lr=family.lr)
    losses = np.array([step(opt) for _ in range(STEPS)])
    return Run(output, stepped, losses)


@dataclass
class Reference:
    x: np.ndarray
    y: np.ndarray
    f32: tuple[Run, ...]                # PyTorch's float32 runs: default memory format, channels_last
    f64: Run
    keys: list[str]                     # the module's state_dict keys


def torch_reference(family: ModelFamily) -> Reference:
    net = build(family)
    x = family.batch(0)
    with torch.no_grad():
        rows = net.eval()(torch.from_numpy(x)).shape[0]
    y = family.targets(rows, 0)
    f32 = tuple(torch_run(family, net, x, y, torch.float32, channels_last=cl) for cl in (False, True))
    return Reference(x, y, f32, torch_run(family, net, x, y, torch.float64),
                     list(net.state_dict()))


def export_file(family: ModelFamily, exporter: str, path: Path) -> anygrad.Model:
    """from_torch of the seeded module with `exporter`, keeping the ONNX file at `path`."""
    net = build(family)
    return quiet(anygrad.from_torch, net, torch.from_numpy(family.batch(0)), dynamo=exporter == "dynamo", path=path)


def module_semantics(net: torch.nn.Module) -> tuple[dict[str, int], set[str], set[str]]:
    """What a module says that its ONNX file cannot: (embedding table key -> padding_idx, float
    buffers in the state_dict, buffers not in it (non-persistent: HF's rotary inv_freq))."""
    keys = set(net.state_dict())
    names_of: dict[int, list[str]] = {}
    for name, p in net.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    padding = {names_of[id(m.weight)][0]: m.padding_idx for m in net.modules()
               if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None}
    buffers = dict(net.named_buffers())
    return (padding, {k for k, b in buffers.items() if k in keys and b.is_floating_point()},
            set(buffers) - keys)


def load_by_names(family: ModelFamily, onnx_path: Path, tmp: Path) -> tuple[anygrad.Model, set[str]]:
    """`load_onnx` of the file, every float tensor of its state overwritten with noise, then the
    module's state_dict loaded back by PyTorch names from a torch.save file: whatever the check
    finds afterwards came through the names. What ONNX cannot say is declared from the module, as
    a user of load_onnx must: padding rows, buffers (not trained), and non-persistent buffers,
    which no checkpoint holds (kept from the file, frozen). Returns the model and the keys that
    to_torch_state_dict will hold beyond the module's state_dict (those non-persistent buffers)."""
    net = build(family)
    padding, buffers, transient = module_semantics(net)
    model = anygrad.load_onnx(onnx_path)
    rng = np.random.default_rng(7)
    for g in model.graph.state_names:
        value = model.graph.initializers[g]
        if value.dtype.kind == "f" and g not in transient:
            model.graph.initializers[g] = rng.standard_normal(value.shape).astype(value.dtype)
    torch.save(net.state_dict(), tmp / "weights.pt")
    result = model.load_state_dict(tmp / "weights.pt", strict=not transient)
    assert not (result.unexpected or result.mismatched), result
    assert set(result.missing) <= transient, f"missing {result.missing}"
    trainable = {k for keys in model.parameter_aliases().values() for k in keys}
    frozen = (buffers | set(result.missing)) & trainable
    if frozen:
        model.freeze(*sorted(frozen))
    for table, row in padding.items():
        model.set_padding_idx(table, row)
    return model, set(result.missing)


def close(ours: np.ndarray, f32: list[np.ndarray], f64: np.ndarray, what: str) -> None:
    """ours within float32 noise (the larger of PyTorch's float32 runs' differences `f32` from
    float64) of the float64 reference (see the module doc)."""
    ours, f64 = np.asarray(ours), np.asarray(f64)
    assert ours.shape == f64.shape, f"{what}: shape {ours.shape}, PyTorch's {f64.shape}"
    if f64.dtype.kind in "biu":
        np.testing.assert_array_equal(ours, f64, err_msg=what)
        return
    err = float(np.abs(ours.astype(np.float64) - f64).max(initial=0.0))
    noise = max(float(np.abs(np.asarray(run, np.float64) - f64).max(initial=0.0)) for run in f32)
    scale = max(1.0, float(np.abs(f64).max(initial=0.0)))
    tol = BASE_TOL * scale + NOISE_FACTOR * noise
    assert err <= tol, (f"{what}: differs from PyTorch (float64) by {err:.3g}, beyond {tol:.3g} "
                        f"(PyTorch's float32 noise {noise:.3g}, scale {scale:.3g})")


def check_route(model: anygrad.Model, family: ModelFamily, ref: Reference, device, extra_keys=frozenset()) -> Run:
    """Output, the state after one lr-1 step, and five losses, against PyTorch's. `extra_keys`:
    what to_torch_state_dict may hold beyond the module's state_dict. Returns anygrad's run."""
    output = model.predict(ref.x)
    close(output, [r.output for r in ref.f32], ref.f64.output, "eval output")

    model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=1.0), device=device)
    model.train_on_batch(ref.x, ref.y)
    ours = model.to_torch_state_dict(as_numpy=True)
    assert set(ref.keys) <= set(ours) <= set(ref.keys) | set(extra_keys), \
        f"to_torch_state_dict's keys are not the module's: {sorted(set(ours) ^ set(ref.keys))}"
    for k in ref.keys:
        close(ours[k], [r.stepped[k] for r in ref.f32], ref.f64.stepped[k], f"{k} after one step")

    model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=family.lr), device=device)
    losses = np.array([model.train_on_batch(ref.x, ref.y) for _ in range(STEPS)])
    close(losses, [r.losses for r in ref.f32], ref.f64.losses, f"losses of {STEPS} steps")
    assert not np.allclose(ref.f64.losses, ref.f64.losses[0], rtol=1e-4), "the reference should move"
    return Run(output, {k: ours[k] for k in ref.keys}, losses)
