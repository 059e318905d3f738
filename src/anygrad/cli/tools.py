"""The small commands around a model and a run: `anygrad devices` (what it can train on),
`anygrad plot` (a run's curves, anygrad.plot) and `anygrad codegen` (ONNX as PyTorch-style
Python, anygrad.codegen); each a thin call into the library."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import ConfigError
from .common import _not_a_folder


def cmd_settings(args: argparse.Namespace) -> int:
    from .. import settings
    return settings.main(["--markdown"] if args.markdown else ["--update", args.update] if args.update else [])


def cmd_devices(args: argparse.Namespace) -> int:
    from .. import devices
    devices.check_device_settings()  # the limits the adapters are listed under (ANYGRAD_WGPU_LIMITS)
    print("cpu (numpy)")
    list_adapters = getattr(devices, "list_adapters", None)
    if list_adapters is not None:
        for adapter in list_adapters():
            print(adapter)
    from ..backends.wgpu.device.implementation import DAWN, DIST, available
    if not available(DAWN):
        print(f"(Dawn, the WebGPU implementation with subgroup matrices, is not installed: "
              f"pip install '{DIST}[dawn]')")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ..plot import plot_run
    for path in plot_run(args.run_dir, args.output):
        print(f"wrote {path}")
    return 0


def cmd_codegen(args: argparse.Namespace) -> int:
    from ..codegen import write_code
    out = Path(args.output) if args.output else Path(f"{Path(args.model).stem}_model.py")
    # each file codegen writes: the option that names it
    targets: dict[Path, str] = {} if args.weights_only else {out: "-o"}
    if args.no_weights:
        pass
    elif args.weights_out:
        targets[Path(args.weights_out)] = "--weights-out"
    elif out.suffix == ".py":  # beside the module, in the folder -o makes
        targets[out.with_suffix(".safetensors")] = "-o or --weights-out"
    for target, option in targets.items():
        _make_parent(target, option)
    for target, option in targets.items():  # all refused before any is written
        _refuse_existing(target, option, args.overwrite)
    written = write_code(str(_not_a_folder(Path(args.model), "an ONNX model file")), out, weights_out=args.weights_out,
                         write_weights=not args.no_weights, write_module=not args.weights_only)
    print("wrote " + " and ".join(str(p) for p in (written.code, written.weights) if p is not None))
    return 0


def _refuse_existing(path: Path, option: str, overwrite: bool) -> None:
    """An existing file where codegen writes is replaced only with --overwrite (a folder never)."""
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; codegen writes a file there: choose another {option}")
    if os.path.lexists(path) and not overwrite:
        raise ConfigError(f"{path} exists; choose another {option}, or replace it with --overwrite")


def _make_parent(path: Path, option: str) -> None:
    """Create the folder a file option's path names (and its parents), as --artifacts and plot -o do."""
    folder = path.parent
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option} {path}: {existing} is a file, not a folder; choose another path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot create {folder} ({e.strerror or e}); choose a folder you can "
                          "write to") from None
