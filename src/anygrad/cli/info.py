"""`anygrad info`: an ONNX model's inputs, outputs, parameters and ops, how far anygrad supports
them, and with --batch-size the training step's device memory and parameter groups, planned as
`train` would compile it. Exits 1 when the model uses ops anygrad cannot run yet."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .common import EXIT_UNSUPPORTED, _not_a_folder
from .config import model_defaults


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def cmd_info(args: argparse.Namespace) -> int:
    from ..frontends.onnx_import import summarize
    unused = [f"--{k.replace('_', '-')}" for k in ("device", "limits", "loss", "optimizer", "memory_budget")
              if getattr(args, k) is not None]
    if args.no_decay or args.param_groups:  # --optimizer also names the optimizer whose groups are listed
        unused = [k for k in unused if k != "--optimizer"]
    if unused and args.batch_size is None:
        verb = "describes" if len(unused) == 1 else "describe"
        raise ConfigError(f"{', '.join(unused)} {verb} the training step whose memory `info` plans at "
                          "--batch-size N; give --batch-size too")
    s = summarize(str(_not_a_folder(Path(args.model), "an ONNX model file")), freeze=args.freeze or ())
    out = [f"model: {s.path}" + (f"  (producer {s.producer}, opset {s.opset})" if s.producer else
                                 f"  (opset {s.opset})")]
    for title, values in (("inputs", s.inputs), ("outputs", s.outputs)):
        out.append(f"{title}:")
        out += [f"  {v.name}  {v.dtype}  {_shape(v.shape)}" for v in values]
    out.append(f"parameters: {s.num_parameters:,} trainable" + (f", {s.num_frozen:,} frozen" if s.num_frozen else "")
               + (f"  (+ {s.num_buffers:,} in buffers)" if s.num_buffers else ""))
    out.append(f"ops ({sum(s.op_histogram.values())} nodes):")
    width = max((len(op) for op in s.op_histogram), default=0)
    out += [f"  {op:<{width}}  {n}" for op, n in sorted(s.op_histogram.items(), key=lambda kv: (-kv[1], kv[0]))]
    if not s.opset_supported:
        out.append(f"unsupported opset: {s.opset}")
    out += _support_lines(s)
    if s.unsupported:
        out.append("unsupported ops: " + _node_counts(s.unsupported))
        out.append("anygrad cannot run or train this model until these ops are supported")
    else:
        out.append("unsupported ops: none")
        if s.inference_only:
            out.append("anygrad can run this model (predict, eval) but cannot train it: a parameter's gradient "
                       "would have to pass through ops without a gradient rule")
    if args.no_decay or args.param_groups:
        out += _group_lines(args)
    if args.batch_size is not None and s.supported and not s.inference_only:
        out += _memory_lines(args)
    print("\n".join(out))
    return 0 if s.supported else EXIT_UNSUPPORTED


def _info_optimizer(args: argparse.Namespace, model: Any) -> tuple[Any, list[Any]]:
    """The optimizer `train` would give this model with these groups, and its groups over it."""
    from ..optim import get_optimizer
    from ..optim.groups import config_groups, resolve_groups
    from ..train import TrainConfig
    settings = TrainConfig(param_groups=args.param_groups or [], no_decay=args.no_decay or [])
    optimizer = get_optimizer(args.optimizer or model_defaults(args.model)["optimizer"],
                              param_groups=config_groups(settings.param_groups, settings.no_decay))
    g = model.graph
    shapes = {p: tuple(g.initializers[p].shape) for p in g.params}
    return optimizer, resolve_groups(optimizer, g.params, shapes, model.parameter_aliases())


def _group_lines(args: argparse.Namespace) -> list[str]:
    """The parameter groups --no-decay and --param-group make: tensors, parameters, settings."""
    from ..frontends import load_onnx
    model = load_onnx(args.model, freeze=args.freeze or ())
    optimizer, groups = _info_optimizer(args, model)
    own = optimizer.settings()
    out = [f"parameter groups ({optimizer.name}; settings besides its own {_settings_text(own)}):"]
    for grp in groups:
        n = sum(int(model.graph.initializers[p].size) for p in grp.params)
        changed = {k: v for k, v in grp.settings().items() if own.get(k) != v}
        out.append(f"  {grp.label}: {len(grp.params)} tensors, {n:,} parameters"
                   + (f"; {_settings_text(changed)}" if changed else ""))
    return out


def _settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in settings.items())


def _memory_lines(args: argparse.Namespace) -> list[str]:
    """The training step's device memory at --batch-size, planned as `train` would compile it."""
    from ..devices import check_device_settings, get_backend
    from ..frontends import load_onnx
    from ..losses import get_loss
    from ..program import build_train_step
    from ..train.run import auto_loss
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    check_device_settings(args.limits, args.memory_budget, flags=True)
    backend = get_backend(args.device or "wgpu", limits=args.limits, memory_budget=args.memory_budget)
    if not hasattr(backend, "memory_report"):
        return [f"memory: the report needs a wgpu device; {backend.name} has no device memory to plan"]
    model = load_onnx(args.model, freeze=args.freeze or ())
    loss = get_loss(args.loss or auto_loss(model))
    out = model.graph.info[model.graph.outputs[0]].shape
    shape = (args.batch_size,) + tuple(model.input_shape[1:])
    target = ((args.batch_size,) + tuple(out[2:])) if loss.classification else (args.batch_size,) + tuple(out[1:])
    if any(not isinstance(d, int) for d in shape + target):
        return ["memory: the model's input or output has symbolic dims besides the batch; no report"]
    precision = backend.check_precision(args.precision)
    opt, groups = _info_optimizer(args, model)  # the one `train` would use, with its groups
    optimizer = opt.name
    step = build_train_step(model.graph, {model.input_name: shape}, target, loss, opt, precision=precision,
                            groups=groups)
    report = backend.memory_report(step)
    mixed = ", f16" if precision == "f16" else ""
    return [f"training step at batch {args.batch_size} on {backend.description} ({optimizer}, {loss.name}{mixed}):"] + [
        f"  {line}" for line in report.lines()]


def _node_counts(ops: dict[str, Any]) -> str:
    return ", ".join(f"{op} ({len(nodes)} node{'s' * (len(nodes) != 1)})" for op, nodes in sorted(ops.items()))


def _support_lines(s: Any) -> list[str]:
    """Ops by how far anygrad supports them: training, inference only, not at all."""
    from ..frontends.op_support import INFERENCE, LEVELS, by_level
    out = ["support:"]
    for level in LEVELS:  # inference-only ops with the nodes a gradient would have to cross
        listing = _node_counts(s.inference_only) if level == INFERENCE else ", ".join(by_level(s.support, level))
        out.append(f"  {level + ':':<15} {listing or 'none'}")
    return out
