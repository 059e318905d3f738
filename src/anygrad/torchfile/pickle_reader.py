"""A restricted pickle machine: reads data, never runs code it was not given.

Python's own Unpickler resolves any global the stream names and calls whatever the stream asks it to
call. This one is a separate, small implementation of the pickle opcodes (protocols 0-5):

- GLOBAL / STACK_GLOBAL resolve only through the `allowed` table handed in by the caller, whose values
  are anygrad's own replacements; any other (module, name) is refused with its name.
- REDUCE calls only `SafeGlobal`s from that table; BUILD applies state only to `Buildable` objects the
  replacements created; NEWOBJ, OBJ, INST, EXT* and out-of-band buffers are refused outright.
- Every length is checked against the bytes that are really there, so a corrupt stream ends in a
  `FormatError` instead of a huge allocation.
"""
from __future__ import annotations

import _compat_pickle
import codecs
import struct
from collections.abc import Callable, Mapping
from typing import Any

from .tensors import FormatError


class SafeGlobal:
    """An allowlisted global: a plain function the pickle may call through REDUCE."""

    def __init__(self, qualname: str, fn: Callable[..., Any]):
        self.qualname, self.fn = qualname, fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"<safe {self.qualname}>"


class Buildable:
    """Base of the objects that accept a BUILD (a pickled __setstate__)."""

    def __setstate__(self, state: Any) -> None:  # pragma: no cover - overridden
        raise FormatError(f"{type(self).__name__} takes no pickled state")


class _Mark:
    """The MARK sentinel on the stack."""


_MARK = _Mark()
_PROTO_MAX = 5
_OPS: dict[int, Callable[[Unpickler], None]] = {}


def _op(code: bytes) -> Callable:
    def register(fn: Callable) -> Callable:
        _OPS[code[0]] = fn
        return fn
    return register


class Unpickler:
    """Run one pickle from `buf[pos:]`; `load()` returns the object and leaves `pos` after STOP."""

    def __init__(self, buf: bytes, allowed: Mapping[tuple[str, str], Any],
                 persistent_load: Callable[[Any], Any], pos: int = 0, encoding: str = "utf-8"):
        self.buf, self.pos = bytes(buf), pos
        self.allowed, self.persistent_load, self.encoding = allowed, persistent_load, encoding
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[Any, Any] = {}
        self.result: Any = _MARK

    # ---- the byte stream -------------------------------------------------------------------------
    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise FormatError(f"pickle data is truncated (wanted {n} bytes at offset {self.pos})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def readline(self) -> bytes:
        end = self.buf.find(b"\n", self.pos)
        if end < 0:
            raise FormatError("pickle data is truncated (unterminated text argument)")
        line, self.pos = self.buf[self.pos:end], end + 1
        return line

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    # ---- the machine -----------------------------------------------------------------------------
    def load(self) -> Any:
        while self.result is _MARK:
            code = self.read(1)[0]
            handler = _OPS.get(code)
            if handler is None:
                raise FormatError(f"pickle opcode {bytes([code])!r} at offset {self.pos - 1} is not allowed")
            handler(self)
        return self.result

    def pop(self) -> Any:
        if not self.stack:
            raise FormatError("pickle stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise FormatError("pickle stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise FormatError("pickle MARK missing")
        items, self.stack = self.stack, self.metastack.pop()
        return items

    def resolve(self, module: Any, name: Any) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise FormatError("pickle global names must be strings")
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise FormatError(
                f"refused global '{module}.{name}'{_py3_alias(module, name)}: only tensor and container "
                f"types may appear in a checkpoint (anygrad never runs code from a model file; for a whole "
                f"model saved with torch.save(model), save model.state_dict() instead)") from None


def _py3_alias(module: str, name: str) -> str:
    """Protocol-2 pickles use python-2 names (commands.Popen for subprocess.Popen): show both."""
    mod3, name3 = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    mod3 = _compat_pickle.IMPORT_MAPPING.get(mod3, mod3)
    return "" if (mod3, name3) == (module, name) else f" ({mod3}.{name3})"


def _push(u: Unpickler, value: Any) -> None:
    # a function, so that `value` (which may pop a MARK and swap u.stack) is computed first
    u.stack.append(value)


# ---- framing, stack and memo ---------------------------------------------------------------------
@_op(b"\x80")
def _proto(u: Unpickler) -> None:
    if u.read(1)[0] > _PROTO_MAX:
        raise FormatError("unsupported pickle protocol")


@_op(b"\x95")
def _frame(u: Unpickler) -> None:
    u.unpack("<Q")  # frames are only a read-ahead hint


@_op(b".")
def _stop(u: Unpickler) -> None:
    u.result = u.pop()


@_op(b"(")
def _mark(u: Unpickler) -> None:
    u.metastack.append(u.stack)
    u.stack = []


@_op(b"0")
def _pop(u: Unpickler) -> None:
    if u.stack:
        u.stack.pop()
    else:
        u.pop_mark()


@_op(b"1")
def _pop_mark(u: Unpickler) -> None:
    u.pop_mark()


@_op(b"2")
def _dup(u: Unpickler) -> None:
    u.stack.append(u.top())


def _get(u: Unpickler, key: Any) -> None:
    if key not in u.memo:
        raise FormatError(f"pickle memo entry {key!r:.40} is missing")
    u.stack.append(u.memo[key])


def _put(u: Unpickler, key: Any) -> None:
    u.memo[key] = u.top()


_op(b"g")(lambda u: _get(u, int(u.readline())))
_op(b"h")(lambda u: _get(u, u.read(1)[0]))
_op(b"j")(lambda u: _get(u, u.unpack("<I")))
_op(b"p")(lambda u: _put(u, int(u.readline())))
_op(b"q")(lambda u: _put(u, u.read(1)[0]))
_op(b"r")(lambda u: _put(u, u.unpack("<I")))
_op(b"\x94")(lambda u: _put(u, len(u.memo)))  # MEMOIZE

# ---- scalars -------------------------------------------------------------------------------------
_op(b"N")(lambda u: _push(u, None))
_op(b"\x88")(lambda u: _push(u, True))
_op(b"\x89")(lambda u: _push(u, False))
_op(b"K")(lambda u: _push(u, u.read(1)[0]))
_op(b"M")(lambda u: _push(u, u.unpack("<H")))
_op(b"J")(lambda u: _push(u, u.unpack("<i")))
_op(b"G")(lambda u: _push(u, u.unpack(">d")))
_op(b"F")(lambda u: _push(u, float(u.readline())))
_op(b"\x8a")(lambda u: _push(u, int.from_bytes(u.read(u.read(1)[0]), "little", signed=True)))
_op(b"\x8b")(lambda u: _push(u, int.from_bytes(u.read(u.unpack("<i")), "little", signed=True)))


@_op(b"I")
def _int(u: Unpickler) -> None:
    line = u.readline()
    u.stack.append(True if line == b"01" else False if line == b"00" else int(line))


@_op(b"L")
def _long(u: Unpickler) -> None:
    line = u.readline()
    u.stack.append(int(line[:-1] if line.endswith(b"L") else line))


# ---- strings and bytes ---------------------------------------------------------------------------
def _decode_str(u: Unpickler, data: bytes) -> str:
    return data.decode(u.encoding)  # python-2 str, decoded like torch.load does (utf-8)


@_op(b"S")
def _string(u: Unpickler) -> None:
    line = u.readline().rstrip()
    if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b'"', b"'"):
        raise FormatError("pickle STRING argument must be quoted")
    u.stack.append(_decode_str(u, codecs.escape_decode(line[1:-1])[0]))


_op(b"T")(lambda u: _push(u, _decode_str(u, u.read(u.unpack("<i")))))
_op(b"U")(lambda u: _push(u, _decode_str(u, u.read(u.read(1)[0]))))
_op(b"B")(lambda u: _push(u, u.read(u.unpack("<I"))))
_op(b"C")(lambda u: _push(u, u.read(u.read(1)[0])))
_op(b"\x8e")(lambda u: _push(u, u.read(u.unpack("<Q"))))
_op(b"\x96")(lambda u: _push(u, bytearray(u.read(u.unpack("<Q")))))
_op(b"V")(lambda u: _push(u, u.readline().decode("raw-unicode-escape")))
_op(b"X")(lambda u: _push(u, u.read(u.unpack("<I")).decode("utf-8", "surrogatepass")))
_op(b"\x8c")(lambda u: _push(u, u.read(u.read(1)[0]).decode("utf-8", "surrogatepass")))
_op(b"\x8d")(lambda u: _push(u, u.read(u.unpack("<Q")).decode("utf-8", "surrogatepass")))

# ---- containers ----------------------------------------------------------------------------------
_op(b")")(lambda u: _push(u, ()))
_op(b"]")(lambda u: _push(u, []))
_op(b"}")(lambda u: _push(u, {}))
_op(b"\x8f")(lambda u: _push(u, set()))
_op(b"t")(lambda u: _push(u, tuple(u.pop_mark())))
_op(b"l")(lambda u: _push(u, u.pop_mark()))
_op(b"\x91")(lambda u: _push(u, frozenset(u.pop_mark())))


@_op(b"\x85")
def _tuple1(u: Unpickler) -> None:
    u.stack.append((u.pop(),))


@_op(b"\x86")
def _tuple2(u: Unpickler) -> None:
    b, a = u.pop(), u.pop()
    u.stack.append((a, b))


@_op(b"\x87")
def _tuple3(u: Unpickler) -> None:
    c, b, a = u.pop(), u.pop(), u.pop()
    u.stack.append((a, b, c))


def _target(u: Unpickler, kind: type | tuple[type, ...]) -> Any:
    target = u.top()
    if not isinstance(target, kind):
        raise FormatError(f"pickle tries to add items to a {type(target).__name__}")
    return target


@_op(b"a")
def _append(u: Unpickler) -> None:
    item = u.pop()
    _target(u, list).append(item)


@_op(b"e")
def _appends(u: Unpickler) -> None:
    items = u.pop_mark()
    _target(u, list).extend(items)


def _set_items(u: Unpickler, items: list[Any]) -> None:
    if len(items) % 2:
        raise FormatError("pickle SETITEMS has an odd number of entries")
    target = _target(u, dict)
    for k, v in zip(items[::2], items[1::2]):
        target[k] = v


@_op(b"s")
def _setitem(u: Unpickler) -> None:
    v, k = u.pop(), u.pop()
    _set_items(u, [k, v])


_op(b"u")(lambda u: _set_items(u, u.pop_mark()))


@_op(b"d")
def _dict(u: Unpickler) -> None:
    items = u.pop_mark()
    u.stack.append({})
    _set_items(u, items)


@_op(b"\x90")
def _additems(u: Unpickler) -> None:
    items = u.pop_mark()
    _target(u, set).update(items)


# ---- the only places where the stream names or calls anything ------------------------------------
@_op(b"c")
def _global(u: Unpickler) -> None:
    module, name = u.readline().decode("utf-8"), u.readline().decode("utf-8")
    u.stack.append(u.resolve(module, name))


@_op(b"i")
def _inst(u: Unpickler) -> None:
    # INST names its class inline: resolving it first reports a forbidden name as such
    u.resolve(u.readline().decode("utf-8"), u.readline().decode("utf-8"))
    raise FormatError("pickle INST (building class instances) is not allowed")


@_op(b"\x93")
def _stack_global(u: Unpickler) -> None:
    name, module = u.pop(), u.pop()
    u.stack.append(u.resolve(module, name))


@_op(b"R")
def _reduce(u: Unpickler) -> None:
    args, func = u.pop(), u.pop()
    if not isinstance(func, SafeGlobal):
        raise FormatError(f"pickle REDUCE on {type(func).__name__}, which is not an allowed global")
    if not isinstance(args, tuple):
        raise FormatError(f"pickle REDUCE arguments for {func.qualname} must be a tuple")
    u.stack.append(func(*args))


@_op(b"b")
def _build(u: Unpickler) -> None:
    state = u.pop()
    target = u.top()
    if not isinstance(target, Buildable):
        raise FormatError(f"pickle BUILD on {type(target).__name__} is not allowed")
    target.__setstate__(state)


_op(b"P")(lambda u: _push(u, u.persistent_load(u.readline().decode("ascii"))))
_op(b"Q")(lambda u: _push(u, u.persistent_load(u.pop())))
