"""Parameter groups with torch.optim's semantics: per-group hyperparameters, chosen by name or shape.

An optimizer's `param_groups` list entries like torch.optim's: {"params": SELECTOR, "lr": ...,
"weight_decay": ...}, where SELECTOR is a glob over graph and PyTorch names ('*.bias'), a list
of them, or a predicate `(name, shape) -> bool`. Settings a group leaves out are the optimizer's
own; parameters no group selects form the default group, after the others. A parameter that two
groups select is an error, and frozen parameters are never in a group.

Each group has its own learning-rate buffer on the device (the first keeps LR_STATE's name, so a
one-group model's checkpoints are what they always were) and its hyperparameters become the
attributes of its parameters' update nodes; backends fuse the updates of equal attributes and
rate, so each group is one fused update.
"""
from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

# the learning rate's device buffer, of the first (or only) group; group i > 0: LR_STATE.i
LR_STATE = "anygrad.lr"

if TYPE_CHECKING:
    from .base import Optimizer

Predicate = Callable[[str, tuple], bool]
Selector = str | Sequence[str] | Predicate


def match_names(aliases: Mapping[str, Iterable[str]], patterns: Iterable[str], what: str) -> list[str]:
    """The keys of `aliases` one of whose names matches one of the fnmatch `patterns`, in the
    order of `aliases`. A pattern matching nothing is a ConfigError naming a few close names."""
    matched: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{what}: patterns are non-empty strings such as 'conv1.*', got {short_repr(pattern)}")
        hits = {key for key, names in aliases.items() if any(fnmatch.fnmatchcase(n, pattern) for n in names)}
        if not hits:
            every = sorted({n for names in aliases.values() for n in names})
            close = difflib.get_close_matches(pattern.replace("*", "").replace("?", ""), every, n=5, cutoff=0.3)
            raise ConfigError(f"{what}: '{pattern}' matches no parameter; "
                              + (f"close names: {', '.join(close or every[:5])}" if every else "there are none")
                              + " (fnmatch globs over graph and PyTorch names, e.g. 'conv1.*')")
        matched |= hits
    return [key for key in aliases if key in matched]


def exact(name: str) -> str:
    """A glob matching exactly `name` (its *, ? and [ bracketed)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


@dataclass
class ParamGroup:
    """One entry of `param_groups`: which parameters (`params`) and the settings they get."""

    params: Selector
    options: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # what errors and `anygrad info` call it besides its index (a "name" key, as torch allows)

    def describe(self) -> Any:
        """The selector as JSON: the globs, or the predicate's name."""
        if callable(self.params):
            return f"<{getattr(self.params, '__qualname__', type(self.params).__name__)}>"
        return [self.params] if isinstance(self.params, str) else list(self.params)


def no_decay(*patterns: str, **options: Any) -> dict[str, Any]:
    """A group without weight decay: the parameters matching `patterns`, or with none the tensors
    of fewer than two dimensions (biases and norm weights, as nanoGPT and Hugging Face's Trainer
    choose). `AdamW(param_groups=[no_decay()])` decays only the matrices and kernels."""
    params: Selector = list(patterns) if patterns else _below_2d
    return {"params": params, "weight_decay": 0.0, "name": "no_decay", **options}


def _below_2d(name: str, shape: tuple) -> bool:
    return len(shape) < 2


def as_group(entry: Any, index: int) -> ParamGroup:
    """A ParamGroup from a dict entry {"params": ..., setting: value} (or a ParamGroup)."""
    where = f"param_groups[{index}]"
    if isinstance(entry, ParamGroup):
        group = entry
    elif isinstance(entry, Mapping):
        where += f" ({entry['name']})" if isinstance(entry.get("name"), str) else ""
        if "params" not in entry:
            raise ConfigError(f"{where}: a group is a dict with 'params' (a glob, a list of globs, or a predicate "
                              f"(name, shape) -> bool) and settings such as 'weight_decay'; got keys {sorted(entry)}")
        group = ParamGroup(entry["params"], {k: v for k, v in entry.items() if k not in ("params", "name")},
                           str(entry.get("name") or ""))
    else:
        raise ConfigError(f"{where}: a group is a dict such as {{'params': '*.bias', 'weight_decay': 0.0}}, "
                          f"got {type(entry).__name__}")
    p = group.params
    ok = callable(p) or (isinstance(p, str) and p) or (
        isinstance(p, (list, tuple)) and all(isinstance(s, str) and s for s in p))
    if not ok:
        raise ConfigError(f"{where}: 'params' must be a glob, a list of globs or a predicate (name, shape) -> bool, "
                          f"got {short_repr(p)}")
    return group


def short_repr(value: Any, limit: int = 80) -> str:
    """`value` for an error message: its repr when short, else its type and length (a list of
    torch Parameters or arrays would otherwise dump every number)."""
    text = repr(value)
    if len(text) <= limit and "\n" not in text:
        return text
    if isinstance(value, (list, tuple, set)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {len(value)} ({', '.join(kinds)})" if kinds else f"an empty {type(value).__name__}"
    size = f" of length {len(value)}" if hasattr(value, "__len__") else ""
    return f"a {type(value).__name__}{size}"


@dataclass
class ResolvedGroup:
    """A group as one model's training step uses it: its parameters (graph names, in the graph's
    order), its settings as an optimizer of their own, and its learning-rate buffer."""

    index: int
    label: str                 # "param_groups[0]" or "default"
    params: list[str]
    optimizer: Optimizer       # the group's settings (param_groups empty)
    lr_state: str
    selector: Any = None       # ParamGroup.describe(), None for the default group

    @property
    def base_lr(self) -> float:
        """The group's initial rate, which schedulers scale (torch's group['initial_lr'])."""
        return float(self.optimizer.lr)

    def settings(self) -> dict[str, Any]:
        """The group's hyperparameters, as config() lists them (lr included)."""
        return self.optimizer.settings()


def lr_state_name(index: int) -> str:
    """The device buffer of group `index`'s learning rate: LR_STATE for the first group."""
    return LR_STATE if index == 0 else f"{LR_STATE}.{index}"


def group_optimizer(optimizer: Optimizer, options: Mapping[str, Any], where: str) -> Optimizer:
    """`optimizer` with a group's settings (its own checks run again, errors naming the group)."""
    names = [f.name for f in fields(optimizer) if f.name != "param_groups"]
    unknown = [k for k in options if k not in names]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, 1)
        raise ConfigError(f"{where}: {optimizer.name} has no setting '{unknown[0]}'"
                          + (f" (did you mean '{close[0]}'?)" if close else "") + f"; its settings are "
                          f"{', '.join(names)}")
    try:
        return replace(optimizer, **dict(options), param_groups=[])
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {optimizer.name}: bad setting ({e})") from None


def resolve_groups(optimizer: Optimizer, params: Sequence[str], shapes: Mapping[str, tuple],
                   aliases: Mapping[str, Iterable[str]] | None = None) -> list[ResolvedGroup]:
    """The optimizer's groups over the trainable `params` (graph names; `aliases`: graph name ->
    every name a pattern may use for it, default the graph name alone; frozen parameters are not
    among the keys that count). Explicit groups come first, in their order, even when a predicate
    selects none; the default group follows when some parameter falls in it, or when there are no
    explicit groups. A predicate sees each parameter's PyTorch name (else its graph name)."""
    names = {p: set(aliases.get(p, ())) | {p} if aliases else {p} for p in params}
    every = dict(aliases or {})
    for p in params:
        every.setdefault(p, {p})
    trainable = set(params)
    owner: dict[str, int] = {}
    out: list[ResolvedGroup] = []
    groups = [as_group(e, i) for i, e in enumerate(optimizer.param_groups)]
    for i, group in enumerate(groups):
        where = f"param_groups[{i}]" + (f" ({group.name})" if group.name else "")
        if callable(group.params):
            chosen = [p for p in params if _call(group.params, _shown(p, names), tuple(shapes[p]), where)]
        else:
            patterns = [group.params] if isinstance(group.params, str) else list(group.params)
            chosen = [p for p in match_names(every, patterns, where) if p in trainable]
        for p in chosen:
            if p in owner:
                raise ConfigError(f"parameter '{_shown(p, names)}' is in {out[owner[p]].label} and {where}; "
                                  "a parameter belongs to one group (narrow one group's pattern)")
            owner[p] = i
        out.append(ResolvedGroup(i, where, chosen, group_optimizer(optimizer, group.options, where),
                                 lr_state_name(i), group.describe()))
    rest = [p for p in params if p not in owner]
    if rest or not out:
        out.append(ResolvedGroup(len(out), "default", rest, replace(optimizer, param_groups=[]),
                                 lr_state_name(len(out))))
    return out


def _shown(param: str, names: Mapping[str, set[str]]) -> str:
    """The name a user knows a parameter by: its PyTorch name when it has one, else the graph's."""
    return min(names[param] - {param}, default=param)


def _call(predicate: Predicate, name: str, shape: tuple, where: str) -> bool:
    try:
        return bool(predicate(name, shape))
    except Exception as e:  # noqa: BLE001  (the user's function: say which group's failed)
        raise ConfigError(f"{where}: the params predicate failed on '{name}' {list(shape)}: "
                          f"{type(e).__name__}: {e}") from None


def describe_groups(groups: Sequence[ResolvedGroup]) -> list[dict[str, Any]]:
    """Groups as JSON (checkpoints, `anygrad info`): label, selector, parameters, settings."""
    import json
    return [json.loads(json.dumps({"group": g.label, "selector": g.selector, "params": list(g.params),
                                   "settings": g.settings()})) for g in groups]


# -- the CLI and config.json form -------------------------------------------------------------------
def parse_group_spec(spec: Any, option: str = "--param-group") -> dict[str, Any]:
    """A config.json / CLI group as {"params": [globs], setting: value}: a dict of that form, or
    'PATTERN[|PATTERN...]:KEY=VALUE[,KEY=VALUE...]' (betas as 0.9;0.95). Errors name `option`."""
    if isinstance(spec, Mapping):
        params = spec.get("params")
        if isinstance(params, str):
            params = [params]
        if not (isinstance(params, list) and params and all(isinstance(p, str) and p for p in params)):
            raise ConfigError(f"{option}: a group's 'params' is a glob or a list of globs, got {short_repr(params)}")
        if not isinstance(spec.get("name", ""), str):
            raise ConfigError(f"{option}: a group's 'name' is a string, got {short_repr(spec['name'])}")
        options = {k: v for k, v in spec.items() if k != "params"}
        for k, v in options.items():
            if k != "name":
                _check_value(option, k, v)
        return {"params": params, **options}
    if not isinstance(spec, str):
        raise ConfigError(f"{option}: expected 'PATTERN:KEY=VALUE,...' or a dict, got {short_repr(spec)}")
    pattern, sep, rest = spec.rpartition(":")
    if not sep or not pattern.strip() or not rest.strip():
        raise ConfigError(f"{option}: expected 'PATTERN:KEY=VALUE,...' such as '*.bias:weight_decay=0' "
                          f"(patterns joined by |), got {spec!r}")
    options: dict[str, Any] = {}
    for pair in rest.split(","):
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip():
            raise ConfigError(f"{option}: '{pair}' in {spec!r} is not KEY=VALUE (e.g. lr=1e-3,weight_decay=0)")
        options[key] = _value(option, key, value.strip())
    return {"params": [p.strip() for p in pattern.split("|") if p.strip()], "name": f"--param-group {spec}",
            **options}


def _value(option: str, key: str, text: str) -> Any:
    words = {"true": True, "false": False}
    if text.lower() in words:
        return words[text.lower()]
    try:
        if ";" in text:
            return [float(t) for t in text.split(";")]
        number = float(text)
    except ValueError:
        raise ConfigError(f"{option}: {key}={text} is not a number (or true/false, or numbers joined by ;)") from None
    _check_value(option, key, number)
    return number


def _check_value(option: str, key: str, value: Any) -> None:
    import math
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool):
            continue
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{option}: {key} must be a finite number, got {short_repr(v)}")


def config_groups(param_groups: Sequence[Mapping[str, Any]], no_decay_patterns: Sequence[str]) -> list[dict]:
    """The optimizer's param_groups for a run's settings: its --param-group entries, then one
    group without weight decay for the --no-decay patterns."""
    out = [dict(parse_group_spec(g)) for g in param_groups]
    if no_decay_patterns:
        out.append(no_decay(*no_decay_patterns, name="--no-decay"))
    return out


__all__ = [
    "ParamGroup",
    "ResolvedGroup",
    "as_group",
    "config_groups",
    "describe_groups",
    "exact",
    "lr_state_name",
    "match_names",
    "no_decay",
    "parse_group_spec",
    "resolve_groups",
]
