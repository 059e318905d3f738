"""Settings that arrive as JSON values or command-line strings, converted to a dataclass field's type.

One mechanism for every settings dataclass (TrainConfig, the learning-rate schedulers): the field's
annotation (a string under `from __future__ import annotations`, e.g. "int | None", "list[float]",
"dict[str, Any]") is parsed into a converter plus a description of what it accepts, so a wrong
value is an error that names the setting and the expected type instead of a TypeError deep inside
the loop. Numbers may come as strings ("3", "1e-3": what a config file or `KEY=VALUE` holds); an
integer setting takes 2.0 but not 1.5; booleans are never numbers.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import fields
from typing import Any

Converter = Callable[[Any], Any]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def to_float(v: Any) -> float:
    if _is_number(v) or isinstance(v, str):
        return float(v)
    raise TypeError


def to_int(v: Any) -> int:
    if isinstance(v, str):
        v = float(v) if any(c in v for c in ".eE") else int(v)
    if _is_number(v) and float(v).is_integer():
        return int(v)
    raise TypeError


def to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if isinstance(v, str) and v.strip().lower() in words:
        return words[v.strip().lower()]
    if _is_number(v) and v in (0, 1):
        return bool(v)
    raise TypeError


def to_str(v: Any) -> str:
    if isinstance(v, (str, os.PathLike)):  # a pathlib.Path for a file setting
        return os.fspath(v)
    raise TypeError


def to_lower_str(v: Any) -> str:
    """For option words (mode, interval, ...): 'Max' means 'max'."""
    return to_str(v).strip().lower()


def _any(v: Any) -> Any:
    return v


def _list_of(item: Converter) -> Converter:
    def convert(v: Any) -> list:
        if isinstance(v, str):  # "0.5,0.4" as on the command line
            v = [p for p in v.replace(";", ",").split(",") if p.strip()]
        elif _is_number(v):
            v = [v]
        if isinstance(v, (list, tuple)):
            return [item(x) for x in v]
        raise TypeError
    return convert


def _dict_of(value: Converter) -> Converter:
    def convert(v: Any) -> dict:
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {k: value(x) for k, x in v.items()}
        raise TypeError
    return convert


def _optional(conv: Converter) -> Converter:
    return lambda v: None if v is None else conv(v)


BASE_TYPES: dict[str, tuple[Converter, str, str]] = {  # name -> (converter, one, many)
    "float": (to_float, "a number", "numbers"),
    "int": (to_int, "an integer", "integers"),
    "bool": (to_bool, "true or false", "booleans"),
    "str": (to_str, "a string", "strings"),
    "Any": (_any, "any value", "values"),
}


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside brackets ("dict[str, Any] | None" at '|')."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()]


def converter(annotation: str, base: dict[str, tuple[Converter, str, str]] | None = None) -> tuple[Converter, str]:
    """(convert, description) for a field annotation; `base` replaces entries of BASE_TYPES
    (e.g. lower-cased strings for option words). convert raises TypeError/ValueError."""
    table = {**BASE_TYPES, **(base or {})}
    annotation = annotation.strip()
    alternatives = _split_top(annotation, "|")
    if len(alternatives) > 1 and "None" in alternatives:
        rest = " | ".join(a for a in alternatives if a != "None")
        conv, what = converter(rest, base)
        return _optional(conv), f"{what} or null"
    if annotation.startswith("list[") and annotation.endswith("]"):
        inner = annotation[5:-1].strip()
        item, _ = converter(inner, base)
        many = table[inner][2] if inner in table else "values"
        return _list_of(item), f"a list of {many}"
    if annotation.startswith("dict[") and annotation.endswith("]"):
        _key, value = _split_top(annotation[5:-1], ",")
        conv, _ = converter(value, base)
        return _dict_of(conv), "an object of names and values"
    if annotation in table:
        conv, one, _ = table[annotation]
        return conv, one
    raise NotImplementedError(f"no converter for the annotation {annotation!r}")


ErrorBuilder = Callable[[str, str, Any], Exception]  # (name, expected, value) -> the exception to raise


def convert(name: str, annotation: str, value: Any, error: ErrorBuilder,
            base: dict[str, tuple[Converter, str, str]] | None = None) -> Any:
    """The setting `name`'s `value` converted to the type `annotation` names (see `converter`);
    `error(name, expected, value)` builds the exception when it does not convert."""
    conv, what = converter(annotation, base)
    try:
        return conv(value)
    except (TypeError, ValueError, OverflowError):
        raise error(name, what, value) from None


def coerce_fields(obj: Any, error: ErrorBuilder, base: dict[str, tuple[Converter, str, str]] | None = None) -> None:
    """Convert every field of the dataclass instance `obj` in place to its annotated type;
    `error(name, expected, value)` builds the exception for a value that does not convert."""
    for f in fields(obj):
        setattr(obj, f.name, convert(f.name, str(f.type), getattr(obj, f.name), error, base))


def json_text(value: Any) -> str:
    """A value as a config file spells it (null, true, "x"), for error messages."""
    import json
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
