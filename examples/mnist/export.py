"""Export the founding model (model.py) to ONNX, keeping BatchNorm and Dropout for training.

    python examples/mnist/export.py            # TorchScript exporter -> src/anygrad/examples/mnist.onnx
    python examples/mnist/export.py --dynamo   # the dynamo exporter (needs onnxscript) -> mnist_dynamo.onnx(.data)
    python examples/mnist/export.py --out my.onnx

The default output is the copy anygrad ships as package data; examples/mnist/mnist.onnx is a
relative symlink to it, so the file is committed once.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from model import Net

PACKAGED = HERE.parents[1] / "src" / "anygrad" / "examples" / "mnist.onnx"
LINK = HERE / "mnist.onnx"


def export(path: Path, dynamo: bool = False, seed: int = 0, dropout: float | None = None,
           training: bool = True, batch: int = 2) -> Net:
    """Export a freshly initialised (seeded) Net to `path`; returns the PyTorch model, whose
    state equals the file's.

    Tracing in training mode runs one forward pass, which moves BatchNorm's running statistics;
    the pristine ones are written back so the file holds exactly `Net()` after manual_seed(seed).
    A batch of 2, because BatchNorm1d cannot normalise a batch of one in training mode.
    """
    torch.manual_seed(seed)
    model = Net()
    if dropout is not None:
        model.dropout1.p = dropout
    model.train(training)
    pristine = {k: v.clone() for k, v in model.state_dict().items()}
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    options = {"optimize": False} if dynamo else {}  # the dynamo optimizer fuses BatchNorm into Gemm
    torch.onnx.export(
        model, (torch.zeros(batch, 1, 28, 28),), str(path),
        dynamo=dynamo, opset_version=17, training=mode, do_constant_folding=False,
        input_names=["input"], output_names=["log_probs"],
        dynamic_axes={"input": {0: "batch"}, "log_probs": {0: "batch"}}, **options,
    )
    model.load_state_dict(pristine)
    _restore_initializers(Path(path), pristine)
    return model


def _restore_initializers(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Overwrite initializers named like state_dict entries with the given values."""
    proto = onnx.load(str(path))
    changed = False
    for t in proto.graph.initializer:
        if t.name in state:
            value = state[t.name].numpy()
            if not np.array_equal(numpy_helper.to_array(t), value):
                t.CopyFrom(numpy_helper.from_array(value, t.name))
                changed = True
    if changed:
        external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in onnx.load(str(path), load_external_data=False).graph.initializer)
        onnx.save_model(proto, str(path), save_as_external_data=external, location=f"{path.name}.data")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dynamo", action="store_true", help="use the torch.export-based exporter")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out is None:  # only the TorchScript export (one self-contained file) is shipped
        args.out = HERE / "mnist_dynamo.onnx" if args.dynamo else PACKAGED
    export(args.out, dynamo=args.dynamo, seed=args.seed)
    if args.out.resolve() == PACKAGED.resolve():
        if LINK.is_symlink() or LINK.exists():
            LINK.unlink()
        LINK.symlink_to(os.path.relpath(PACKAGED, HERE))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
