"""Every environment variable anygrad reads, declared once: name, type, default, doc and kind.

A setting is read when the code needs it (`SETTING.get()`), never at import, so a test or a
long-lived process sees a change at once. The value is converted by the declared type; a value
that does not convert is a `ConfigError` naming the variable and the values it takes. An empty
variable counts as unset. Tests flip settings with `override(...)`, which wins over the
environment for the duration of a `with` block (process-wide, like the environment itself,
so threads a test starts see it too).

Kinds:
- "user": something a user sets on purpose (cache folder, limits to emulate, threads, mirrors).
- "tuning": changes how a step is compiled (fusions, kernel variants, tilings), never what it
  computes beyond float rounding. The wgpu plan cache's key holds every tuning value
  (`tuning_values`), so flipping one never reuses a plan compiled under another value.
- "debug": diagnostics and switches for comparing against an older way (profiles, timelines,
  checks); they do not change a compiled plan.

This module is the only place that reads `os.environ` (`external` reads the variables other
programs set, such as torchrun's). `anygrad settings --markdown` prints the table
that docs/settings.md holds (tests/test_settings.py keeps the two equal).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

KINDS = ("user", "tuning", "debug")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_UNSET = object()


@dataclass(frozen=True)
class Setting:
    """One environment variable. `default` None: unset, the code decides (e.g. per adapter).
    `choices`: the only values a str setting takes. `minimum`: the least value of a number;
    `positive`: a number above 0."""
    name: str
    type: type
    default: Any
    doc: str
    kind: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    positive: bool = False

    def __post_init__(self) -> None:
        if not self.name.startswith("ANYGRAD_"):
            raise ValueError(f"setting {self.name}: names start with ANYGRAD_")
        if self.kind not in KINDS:
            raise ValueError(f"setting {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.type not in _PARSERS:
            raise ValueError(f"setting {self.name}: type {self.type!r} is not one of {list(_PARSERS)}")

    def raw(self) -> str | None:
        """The text set for this setting (an override first, then the environment); None if unset."""
        over = _overrides.get(self.name, _UNSET)  # (one dict read: atomic, no lock needed)
        if over is not _UNSET:
            return None if over is None else _text(over)
        text = os.environ.get(self.name)
        return text if text is not None and text.strip() != "" else None

    def is_set(self) -> bool:
        return self.raw() is not None

    def get(self) -> Any:
        """The current value, converted by type; the default when unset. ConfigError for a bad value."""
        text = self.raw()
        if text is None:
            return self.default
        return self.parse(text)

    def parse(self, text: str) -> Any:
        value = _PARSERS[self.type](self, text.strip())
        if self.choices and value not in self.choices:
            raise self._bad(text)
        if (self.minimum is not None and value < self.minimum) or (self.positive and not value > 0):
            raise self._bad(text)
        return value

    def allowed(self) -> str:
        """The values this setting takes, in words (for errors and the docs table)."""
        if self.choices:
            return " | ".join(self.choices)
        if self.type is bool:
            return "0 | 1" + (" | auto" if self.default is None else "")
        what = {int: "a whole number", float: "a number", str: "text"}[self.type]
        bound = f" >= {self.minimum:g}" if self.minimum is not None else " > 0" if self.positive else ""
        return what + bound

    def _bad(self, text: str) -> ConfigError:
        default = "unset" if self.default is None else _text(self.default)
        return ConfigError(f"{self.name}={text!r}: give {self.allowed()}, or unset it (default {default}); "
                           f"it sets: {self.doc}")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _parse_bool(s: Setting, text: str) -> bool | None:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    if low == "auto" and s.default is None:
        return None
    raise s._bad(text)


def _parse_number(kind: type) -> Any:
    def parse(s: Setting, text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise s._bad(text) from None
        if isinstance(value, float) and math.isnan(value):
            raise s._bad(text)
        return value
    return parse


def _parse_str(s: Setting, text: str) -> str:
    return text.lower() if s.choices else text


_PARSERS = {bool: _parse_bool, int: _parse_number(int), float: _parse_number(float), str: _parse_str}

_lock = threading.Lock()
_overrides: dict[str, Any] = {}


# -- the declarations ---------------------------------------------------------------------------
# One table. Append a declaration here (and nowhere else) for a new variable; the docs page is
# generated from it. Keep `doc` to one line: what it does and what its values mean.
def _s(name: str, type_: type, default: Any, kind: str, doc: str, **kw: Any) -> Setting:
    return Setting(name, type_, default, doc, kind, **kw)


DECLARED: tuple[Setting, ...] = (
    # user settings
    _s("ANYGRAD_CACHE", str, None, "user",
       "anygrad's cache folder (datasets, wgpu plans, autotune results); unset: ~/.cache/anygrad "
       "($XDG_CACHE_HOME/anygrad for datasets). Never a folder others can write to (plans are pickles)"),
    _s("ANYGRAD_WGPU_LIMITS", str, None, "user",
       "emulate a weaker adapter's limits on every wgpu device: a profile name, optionally with "
       "`:limit=value,...` (e.g. webgpu-default:max-storage-buffers-per-shader-stage=4)"),
    _s("ANYGRAD_PIPELINE_CACHE", bool, True, "user",
       "keep compiled wgpu plans on disk in $ANYGRAD_CACHE/wgpu-plans; 0: compile every time"),
    _s("ANYGRAD_PIPELINE_THREADS", int, 0, "user",
       "threads creating wgpu pipelines in parallel; 0: one per core, up to 16", minimum=0),
    _s("ANYGRAD_AUTOTUNE", bool, None, "user",
       "time GEMM tilings per shape and keep the fastest (cached per adapter); auto: on for real GPUs only"),
    _s("ANYGRAD_AUTOTUNE_SECONDS", float, None, "user",
       "seconds of autotuning per compile; unset: the built-in budget (more tunes a whole model at once)",
       minimum=0),
    _s("ANYGRAD_NUMPY_THREADS", int, None, "user",
       "threads the numpy backend splits an op over (BLAS then runs single-threaded inside each); "
       "unset: the CPUs this process may use", minimum=1),
    _s("ANYGRAD_MNIST_MIRRORS", str, None, "user",
       "MNIST download mirrors (base URLs, separated by commas or spaces) replacing the built-in ones"),
    _s("ANYGRAD_FASHION_MNIST_MIRRORS", str, None, "user",
       "Fashion-MNIST download mirrors (base URLs, separated by commas or spaces)"),
    _s("ANYGRAD_CIFAR_10_MIRRORS", str, None, "user",
       "CIFAR-10 download mirrors (base URLs, separated by commas or spaces)"),
    _s("ANYGRAD_TORCH_COMPILE", str, "0", "user",
       "torch backend: trace each step with torch.compile: 1 (inductor) or a torch.compile backend "
       "name (e.g. aot_eager); 0: no"),
    _s("ANYGRAD_TORCH_CUDA_GRAPH", bool, True, "user",
       "torch backend on CUDA: capture each step as a CUDA graph on its third run and replay it"),
    _s("ANYGRAD_BUCKET_MB", float, None, "user",
       "data parallel: gradient bucket size in MB; unset: 8, with other sizes timed over the first updates",
       positive=True),
    _s("ANYGRAD_GLOO_GROUPS", int, 4, "user",
       "data parallel: gloo process groups the gradient buckets take turns on", minimum=1),
    _s("ANYGRAD_GLOO_PIECE_MB", float, None, "user",
       "data parallel: a 2-8 MB bucket sum is cut into pieces of this many MB, one a gloo group; unset: 1",
       positive=True),
    # tuning: how a step is compiled (all of them are part of the wgpu plan cache's key)
    _s("ANYGRAD_FUSE_GELU", bool, True, "tuning",
       "rewrite a written-out GELU (erf or tanh form) into one Gelu node; 0: keep it written out"),
    _s("ANYGRAD_FUSE_RMSNORM", bool, True, "tuning",
       "rewrite a written-out RMS norm into one RMSNormalization node; 0: keep it written out"),
    _s("ANYGRAD_FUSE_ROTARY", bool, True, "tuning",
       "rewrite rotary embeddings' rotate_half (Slice, Slice, Neg, Concat) into one gather; 0: keep it"),
    _s("ANYGRAD_FUSE_ATTENTION", bool, False, "tuning",
       "experimental: rewrite the attention pattern into fused attention kernels (slower on an H200)"),
    _s("ANYGRAD_F16_MATH", bool, None, "tuning",
       "float16 GEMMs sum products in f16 within a K tile: 1 wherever possible, 0 never; auto: where "
       "the autotuner timed it faster"),
    _s("ANYGRAD_F16_LOSS_READS_HALF", bool, True, "tuning",
       "float16 steps: the loss reads the float16 logits; 0: through a float32 copy (for comparison)"),
    _s("ANYGRAD_F16_SOFTMAX_GRAD_READS_HALF", bool, True, "tuning",
       "float16 steps: the softmax gradient reads the float16 output; 0: a float32 copy (for comparison)"),
    _s("ANYGRAD_RECOMPUTE_ELEMENTWISE", bool, True, "tuning",
       "recompute cheap elementwise results in the backward instead of storing them; 0: store them"),
    _s("ANYGRAD_AUTOTUNE_SPLITS", bool, True, "tuning",
       "the autotuner also times a shape's leading tiling at other K splits; 0: the rule's split count"),
    _s("ANYGRAD_DAWN_TOGGLES", str, None, "tuning",
       "more Dawn toggles to enable, comma-separated (e.g. disable_robustness,disable_workgroup_init: "
       "what Tint's index clamping and workgroup zeroing cost); unset: only those anygrad needs"),
    _s("ANYGRAD_WGPU_SHARED_BUFFER", str, None, "tuning",
       "largest buffer holding many temporaries, a size such as 128MiB; unset or 'binding': the "
       "adapter's binding limit"),
    _s("ANYGRAD_WGPU_SUBGROUPS", bool, True, "tuning",
       "use subgroup operations where the adapter has them; 0: workgroup memory only (a driver whose "
       "subgroup ops misbehave)"),
    _s("ANYGRAD_WGPU_BN_SPLIT", bool, True, "tuning",
       "split a training BatchNorm+ReLU into statistics and apply kernels; 0: keep the node whole"),
    _s("ANYGRAD_WGPU_RESIDUAL", bool, True, "tuning",
       "a residual Add after a GEMM becomes the GEMM's epilogue; 0: a kernel of its own"),
    _s("ANYGRAD_WGPU_GRAD_EPILOGUE", bool, True, "tuning",
       "an activation gradient after a GEMM becomes the GEMM's epilogue; 0: a kernel of its own"),
    _s("ANYGRAD_WGPU_WHERE_EPILOGUE", bool, True, "tuning",
       "a masked_fill of a GEMM's result becomes the GEMM's epilogue; 0: a kernel of its own"),
    _s("ANYGRAD_WGPU_F16_EPILOGUES", bool, True, "tuning",
       "GEMM epilogues and operand-load activations also on float16 tensors; 0: float32 only"),
    _s("ANYGRAD_WGPU_CAST_FOLD", bool, True, "tuning",
       "float Casts on the edges of float32 islands fold into their neighbours; 0: Cast kernels"),
    _s("ANYGRAD_WGPU_PROLOGUE", str, "auto", "tuning",
       "an activation read only by GEMMs is applied in their operand loads: auto (except where the GEMM "
       "runs on matrix units), 1 (every GEMM), 0 (never: a kernel of its own)", choices=("auto", "1", "0")),
    _s("ANYGRAD_WGPU_F16_ARENA", bool, True, "tuning",
       "float16 steps: per-tensor loss-scaler and optimizer work runs over one arena; 0: per tensor"),
    _s("ANYGRAD_WGPU_SCALE_FOLD", bool, True, "tuning",
       "constant scales next to MatMuls fold into the GEMM; 0: separate multiplications"),
    _s("ANYGRAD_WGPU_SLICE_VIEWS", bool, True, "tuning",
       "slices, transposes and gathers next to MatMuls and fused elementwise kernels become views in "
       "their loads and stores; 0: copy kernels"),
    # debug: diagnostics and comparisons; they do not change a compiled plan
    _s("ANYGRAD_WGPU_CHECKS", bool, False, "debug",
       "keep naga's bounds checks (wgpu-native) and Tint's robustness (Dawn) in shaders (to tell a "
       "kernel bug from a driver bug)"),
    _s("ANYGRAD_WGPU_PROFILE", bool, False, "debug",
       "record GPU time per kernel on every wgpu run and print a summary at exit"),
    _s("ANYGRAD_WGPU_POLL", str, "free", "debug",
       "wgpu device polling: free (anygrad's non-blocking poll thread) or block (wgpu-py's own)",
       choices=("free", "block")),
    _s("ANYGRAD_WGPU_STAGED_UPLOAD", bool, True, "debug",
       "wgpu: inputs of 16 MiB and more go up through mapped buffers filled over the host's threads; "
       "0: plain queue writes"),
    _s("ANYGRAD_WGPU_HOLD_PARTS", int, None, "debug",
       "data parallel on wgpu: parts of a step held back so buckets map mid-step; unset: timed",
       minimum=0),
    _s("ANYGRAD_DP_SUM_MAPPED", bool, True, "debug",
       "data parallel with one device a rank: all-reduce a bucket in place in mapped memory; 0: copy it"),
    _s("ANYGRAD_DP_TIMELINE", str, None, "debug",
       "data parallel: write a Chrome trace of each phase to this path (ranks insert .rank<N>)"),
    _s("ANYGRAD_DP_TIMELINE_STEPS", int, 50, "debug",
       "steps the data-parallel timeline keeps", minimum=1),
    _s("ANYGRAD_NUMPY_PROFILE", bool, False, "debug",
       "numpy backend: record seconds per op type (executable.profile)"),
    _s("ANYGRAD_NUMPY_MALLOC", bool, True, "debug",
       "numpy backend on Linux: tune glibc malloc to keep freed large arrays mapped (faster steps, "
       "higher peak memory); 0: leave malloc alone"),
    _s("ANYGRAD_TORCH_FUSED_NORMS", bool, None, "debug",
       "torch backend: batch norm through aten's fused kernels: 1 always, 0 never; auto: on GPUs only"),
)

_BY_NAME: dict[str, Setting] = {s.name: s for s in DECLARED}
if len(_BY_NAME) != len(DECLARED):
    raise RuntimeError("a setting is declared twice")


def by_name(name: str) -> Setting:
    """The declared setting `name`; KeyError names the undeclared variable."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in anygrad.settings") from None


def get(name: str) -> Any:
    """The current value of the declared setting `name` (by_name(name).get())."""
    return by_name(name).get()


def is_set(name: str) -> bool:
    """Whether the setting `name` is set (by an override or a non-empty variable)."""
    return by_name(name).is_set()


def all_settings() -> tuple[Setting, ...]:
    return DECLARED


def tuning_values() -> list[tuple[str, Any]]:
    """(name, current value) of every tuning setting: what a compiled plan depends on."""
    return [(s.name, s.get()) for s in DECLARED if s.kind == "tuning"]


def external(name: str, default: str | None = None) -> str | None:
    """A variable another program sets (torchrun's RANK, MASTER_ADDR...; XDG_CACHE_HOME): read
    here so that os.environ is read in one module only. Not for ANYGRAD_* names (declare those)."""
    if name.startswith("ANYGRAD_"):
        raise KeyError(f"{name}: declare ANYGRAD_ variables in anygrad.settings and call .get()")
    return os.environ.get(name, default)


def environment() -> dict[str, str]:
    """A copy of the whole environment (to hand to a child process or to scan torchrun's variables)."""
    return dict(os.environ)


@contextlib.contextmanager
def override(values: dict[Setting | str, Any] | None = None, **by_name_: Any) -> Iterator[None]:
    """Within the block, the given settings have these values whatever the environment says
    (None: as if unset). Keys are Setting objects or names; values are checked like the
    environment's text, so a bad one raises ConfigError at once. Nested blocks restore the outer."""
    pairs = {**(values or {}), **by_name_}
    new: dict[str, Any] = {}
    for key, value in pairs.items():
        s = key if isinstance(key, Setting) else by_name(key)
        if value is not None:
            s.parse(_text(value))
        new[s.name] = value
    with _lock:
        saved = {k: _overrides.get(k, _UNSET) for k in new}
        _overrides.update(new)
    try:
        yield
    finally:
        with _lock:
            for k, v in saved.items():
                if v is _UNSET:
                    _overrides.pop(k, None)
                else:
                    _overrides[k] = v


def markdown_table() -> str:
    """The table docs/settings.md holds: one row per setting, in declaration order."""
    rows = ["| Name | Type | Default | Kind | Values | What it does |",
            "|---|---|---|---|---|---|"]
    for s in DECLARED:
        default = "unset" if s.default is None else f"`{_text(s.default)}`"
        doc = s.doc.replace("|", "\\|")
        values = s.allowed().replace("|", "\\|")
        rows.append(f"| `{s.name}` | {s.type.__name__} | {default} | {s.kind} | {values} | {doc} |")
    return "\n".join(rows) + "\n"


TABLE_START = "<!-- settings table: generated by `anygrad settings --update docs/settings.md` -->"
TABLE_END = "<!-- end of the settings table -->"


def with_table(page: str) -> str:
    """`page` with the text between TABLE_START and TABLE_END replaced by markdown_table()."""
    head, start, rest = page.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not start or not end:
        raise ConfigError(f"the page lacks the markers {TABLE_START!r} and {TABLE_END!r}")
    return f"{head}{TABLE_START}\n\n{markdown_table()}\n{TABLE_END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """No arguments: every setting's current value. --markdown: the docs table. --update FILE:
    rewrite the table between the markers in FILE (docs/settings.md)."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        sys.stdout.write(markdown_table())
        return 0
    if len(args) == 2 and args[0] == "--update":
        from pathlib import Path

        from .fsutil import atomic_write
        path = Path(args[1])
        try:
            page = with_table(path.read_text())
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        atomic_write(path, page)
        print(f"{path}: settings table updated ({len(DECLARED)} settings)")
        return 0
    if not args:  # every setting, a bad value flagged in its row (what this listing is for)
        bad = 0
        for s in DECLARED:
            try:
                value = s.get()
            except ConfigError as e:
                bad += 1
                print(f"{s.name}={s.raw()}  ({s.kind})  error: {e}")
                continue
            print(f"{s.name}={'' if value is None else _text(value)}  ({s.kind})")
        return 2 if bad else 0
    print("usage: anygrad settings [--markdown | --update FILE]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
