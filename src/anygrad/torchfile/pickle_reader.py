"""A restricted pickle machine: reads data, never runs code it was not given.

Python's own Unpickler resolves any global the stream names and calls whatever the stream asks it to
call. This one is a separate, small implementation of the pickle opcodes (protocols 0-5):

- GLOBAL / STACK_GLOBAL resolve only through the `allowed` table handed in by the caller, whose values
  are anygrad's own replacements; any other (module, name) is refused with its name.
- REDUCE calls only `SafeGlobal`s from that table; BUILD applies state only to `Buildable` objects the
  replacements created; NEWOBJ, OBJ, INST, EXT* and out-of-band buffers are refused outright.
- Every length is checked against the bytes that are really there, so a corrupt stream ends in a
  `FormatError` instead of a huge allocation.
- Containers are measured as they are built: nesting deeper than MAX_DEPTH is refused at once (hashing
  a tuple nested a million deep overflows the C stack: a crash no `except` can catch), and every dict
  key or set member is hashed by the machine first, against a budget (a tuple of tuples shared through
  the memo costs exponential time to hash) and against hash collisions (ints that differ by 2**61-1
  hash alike: 50k of them make a dict take quadratic time).
"""
from __future__ import annotations

import _compat_pickle
import codecs
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .tensors import FormatError


class SafeGlobal:
    """An allowlisted global: a plain function the pickle may call through REDUCE.

    `keys_of(*args)` names what `fn` will hash (the keys of an OrderedDict, the members of a set),
    so that the machine can vet them (see `Unpickler.admit`) before `fn` runs."""

    def __init__(self, qualname: str, fn: Callable[..., Any],
                 keys_of: Callable[..., Iterable[Any]] | None = None):
        self.qualname, self.fn, self.keys_of = qualname, fn, keys_of

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

# Far beyond any real checkpoint (a state_dict nests a few levels), far below what overflows the C stack.
MAX_DEPTH = 200
# Distinct keys of one dict or set that share one hash value: CPython compares each new one with all
# the others, so n such keys cost n**2 / 2 comparisons. Random string hashes almost never share one.
MAX_COLLISIONS = 32
# Hashing work (tuple elements and int digits visited) a pickle may cause: a multiple of its size.
HASH_WORK_PER_BYTE, HASH_WORK_FLOOR = 64, 1 << 22
_SATURATE = 1 << 62
_CONTAINERS = (tuple, list, dict, set, frozenset)
_OPS: dict[int, Callable[[Unpickler], None]] = {}


def _op(code: bytes) -> Callable:
    def register(fn: Callable) -> Callable:
        _OPS[code[0]] = fn
        return fn
    return register


class Unpickler:
    """Run one pickle from `buf[pos:]`; `load()` returns the object and leaves `pos` after STOP."""

    def __init__(self, buf: bytes | bytearray, allowed: Mapping[tuple[str, str], Any],
                 persistent_load: Callable[[Any], Any], pos: int = 0, encoding: str = "utf-8"):
        self.buf, self.pos = buf if isinstance(buf, (bytes, bytearray)) else bytes(buf), pos
        self.view = memoryview(self.buf)  # slices of it copy once, to bytes
        self.allowed, self.persistent_load, self.encoding = allowed, persistent_load, encoding
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[Any, Any] = {}
        self.result: Any = _MARK
        # id -> (container, nesting depth, hashing work): the container is held so its id stays its own
        self.shapes: dict[int, tuple[Any, int, int]] = {}
        self.hash_counts: dict[int, tuple[Any, dict[int, int]]] = {}  # id -> (dict/set, hash -> #keys)
        self.hash_budget = HASH_WORK_PER_BYTE * len(self.buf) + HASH_WORK_FLOOR

    # ---- the byte stream -------------------------------------------------------------------------
    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise FormatError(f"pickle data is truncated (wanted {n} bytes at offset {self.pos})")
        out = bytes(self.view[self.pos:self.pos + n])
        self.pos += n
        return out

    def readline(self) -> bytes:
        end = self.buf.find(b"\n", self.pos)
        if end < 0:
            raise FormatError("pickle data is truncated (unterminated text argument)")
        line, self.pos = bytes(self.view[self.pos:end]), end + 1
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

    # ---- measuring containers and vetting keys -----------------------------------------------------
    def measure(self, x: Any) -> tuple[int, int]:
        """(nesting depth, work to hash it) of a value on the stack."""
        if type(x) is int:
            return 0, x.bit_length() // 30 + 1  # ints do not cache their hash: each hash reads every digit
        known = self.shapes.get(id(x))
        if known is not None:
            return known[1], known[2]
        if isinstance(x, _CONTAINERS):
            return self.record(x, x.values() if isinstance(x, dict) else x)
        return 0, 1

    def record(self, container: Any, items: Iterable[Any]) -> tuple[int, int]:
        """Measure a container as it is built from `items` (refusing one nested too deep)."""
        depth, work = 1, 1
        shapes = self.shapes
        for item in items:
            if type(item) is int:
                work += item.bit_length() // 30 + 1
                continue
            known = shapes.get(id(item))
            d, w = (known[1], known[2]) if known is not None else self.measure(item)
            if d >= depth:
                depth = d + 1
            work += w
        work = min(work, _SATURATE)
        if depth > MAX_DEPTH:
            self.check_depth(depth)
        shapes[id(container)] = (container, depth, work)
        return depth, work

    def grow(self, container: Any, item: Any) -> None:
        """`item` was put into the mutable `container`: it is at least one level deeper than it."""
        depth, work = self.measure(container)
        d, w = self.measure(item)
        if d + 1 > depth:
            self.check_depth(d + 1)
        self.shapes[id(container)] = (container, max(depth, d + 1), min(work + w, _SATURATE))

    @staticmethod
    def check_depth(depth: int) -> None:
        if depth > MAX_DEPTH:
            raise FormatError(f"pickle containers are nested more than {MAX_DEPTH} levels deep; a checkpoint "
                              "nests a few (is the file corrupt or hostile?)")

    def admit(self, target: dict | set, key: Any) -> None:
        """Vet `key` before it is hashed into `target`: bounded depth (tuples hash recursively in C),
        bounded total hashing work, and few keys sharing one hash value."""
        _, work = self.measure(key)
        self.hash_budget -= work
        if self.hash_budget < 0:
            raise FormatError("pickle dict keys or set members take too long to hash (deeply shared tuples "
                              "or huge ints used as keys); is the file corrupt or hostile?")
        try:
            h = hash(key)
        except TypeError:
            raise FormatError(f"pickle uses an unhashable {type(key).__name__} as a dict key or set member") from None
        if key in target:
            return
        counts = self.hash_counts.setdefault(id(target), (target, {}))[1]
        n = counts.get(h, 0) + 1
        if n > MAX_COLLISIONS:
            raise FormatError(f"pickle dict or set has more than {MAX_COLLISIONS} keys with one hash value "
                              "(a hash-collision attack); refusing it")
        counts[h] = n
        self.hash_budget -= work * n  # comparing with the others that share the hash

    def hashed(self, kind: type, keys: Iterable[Any]) -> Any:
        """A set or frozenset of `keys`, each vetted by `admit`."""
        out: set = set()
        for k in keys:
            self.admit(out, k)
            out.add(k)
        result = out if kind is set else frozenset(out)
        self.record(result, result)
        return result

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


_MEMO_MAX = 1 << 32  # binary opcodes cannot name more; a text PUT/GET could name colliding huge ints


def _memo_key(key: int) -> int:
    if not 0 <= key < _MEMO_MAX:
        raise FormatError(f"pickle memo index {str(key)[:40]} is out of range")
    return key


def _get(u: Unpickler, key: Any) -> None:
    if key not in u.memo:
        raise FormatError(f"pickle memo entry {key!r:.40} is missing")
    u.stack.append(u.memo[key])


def _put(u: Unpickler, key: Any) -> None:
    u.memo[key] = u.top()


_op(b"g")(lambda u: _get(u, _memo_key(int(u.readline()))))
_op(b"h")(lambda u: _get(u, u.read(1)[0]))
_op(b"j")(lambda u: _get(u, u.unpack("<I")))
_op(b"p")(lambda u: _put(u, _memo_key(int(u.readline()))))
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
def _new(u: Unpickler, container: Any, items: Iterable[Any] = ()) -> None:
    u.record(container, items)
    u.stack.append(container)


_op(b")")(lambda u: _new(u, ()))
_op(b"]")(lambda u: _new(u, []))
_op(b"}")(lambda u: _new(u, {}))
_op(b"\x8f")(lambda u: _new(u, set()))


@_op(b"t")
def _tuple(u: Unpickler) -> None:
    t = tuple(u.pop_mark())
    _new(u, t, t)


@_op(b"l")
def _list(u: Unpickler) -> None:
    items = u.pop_mark()
    _new(u, items, items)


@_op(b"\x91")
def _frozenset(u: Unpickler) -> None:
    u.stack.append(u.hashed(frozenset, u.pop_mark()))


@_op(b"\x85")
def _tuple1(u: Unpickler) -> None:
    t = (u.pop(),)
    _new(u, t, t)


@_op(b"\x86")
def _tuple2(u: Unpickler) -> None:
    b, a = u.pop(), u.pop()
    t = (a, b)
    _new(u, t, t)


@_op(b"\x87")
def _tuple3(u: Unpickler) -> None:
    c, b, a = u.pop(), u.pop(), u.pop()
    t = (a, b, c)
    _new(u, t, t)


def _target(u: Unpickler, kind: type | tuple[type, ...]) -> Any:
    target = u.top()
    if not isinstance(target, kind):
        raise FormatError(f"pickle tries to add items to a {type(target).__name__}")
    return target


@_op(b"a")
def _append(u: Unpickler) -> None:
    item = u.pop()
    target = _target(u, list)
    u.grow(target, item)
    target.append(item)


@_op(b"e")
def _appends(u: Unpickler) -> None:
    items = u.pop_mark()
    target = _target(u, list)
    for item in items:
        u.grow(target, item)
    target.extend(items)


def _set_items(u: Unpickler, items: list[Any]) -> None:
    if len(items) % 2:
        raise FormatError("pickle SETITEMS has an odd number of entries")
    target = _target(u, dict)
    for k, v in zip(items[::2], items[1::2]):
        u.admit(target, k)
        u.grow(target, k)
        u.grow(target, v)
        target[k] = v


@_op(b"s")
def _setitem(u: Unpickler) -> None:
    v, k = u.pop(), u.pop()
    _set_items(u, [k, v])


_op(b"u")(lambda u: _set_items(u, u.pop_mark()))


@_op(b"d")
def _dict(u: Unpickler) -> None:
    items = u.pop_mark()
    _new(u, {})
    _set_items(u, items)


@_op(b"\x90")
def _additems(u: Unpickler) -> None:
    items = u.pop_mark()
    target = _target(u, set)
    for item in items:
        u.admit(target, item)
        u.grow(target, item)
        target.add(item)


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
    if func.keys_of is not None:
        scratch: set = set()
        for key in func.keys_of(*args):
            u.admit(scratch, key)
            scratch.add(key)
    out = func(*args)
    if isinstance(out, _CONTAINERS):
        u.record(out, out.values() if isinstance(out, dict) else out)
    u.stack.append(out)


@_op(b"b")
def _build(u: Unpickler) -> None:
    state = u.pop()
    target = u.top()
    if not isinstance(target, Buildable):
        raise FormatError(f"pickle BUILD on {type(target).__name__} is not allowed")
    target.__setstate__(state)


_op(b"P")(lambda u: _push(u, u.persistent_load(u.readline().decode("ascii"))))
_op(b"Q")(lambda u: _push(u, u.persistent_load(u.pop())))
