"""Field checks: the vocabulary every field table of the wire is written in.

A field table maps each field of a frozen dataclass to ``(check, description)``; the
bus's table (`_protocol.FIELDS`) and every `_protocol.MessageSet` (the relays' control
channel) are built from the checks here. A check returns the value (possibly
converted) or raises `ProtocolError`, never anything else, so a `build` made of them
keeps `decode`'s contract. No sockets, no clock, no torch.

Each check also records what readers that inline it need to know: an integer's range,
a binary field's limit, the strings a text check passed before (`int_range`,
`bin_limit`, `passed_strings`), and a value at least as long as any it accepts
(`longest`), from which socket frame limits are derived.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Protocol

import msgpack

from ._errors import ProtocolError

__all__ = [
    "MAX_U63",
    "Check",
    "bin_limit",
    "binary",
    "build",
    "choice",
    "counters",
    "define",
    "defined",
    "int_range",
    "integer",
    "list_of",
    "longest",
    "number",
    "passed_strings",
    "record",
    "show",
    "text",
]

MAX_U63 = (1 << 63) - 1


class Check(Protocol):
    """A field check: the value (possibly converted), or ProtocolError.

    It gets where the value sits as the enclosing path and the field's name (or list
    index), and formats the path only when it fails: a decode runs several checks per
    message, and building their paths cost as much as the checks themselves.
    """

    def __call__(self, value: Any, where: str, name: str | int = "", /) -> Any: ...


def _fail(where: str, why: str) -> ProtocolError:
    return ProtocolError(f"{where}: {why}")


def _at(where: str, name: str | int) -> str:
    """The path of a field (``where.name``) or list item (``where[name]``)."""
    if type(name) is int:
        return f"{where}[{name}]"
    return f"{where}.{name}" if name != "" else where


def show(value: Any, limit: int) -> str:
    """A received value, cut short, for an error message. Containers are named by type:
    the repr of a deeply nested list would itself raise RecursionError."""
    if type(value) in (str, bytes):
        return str(value[:limit])
    if value is None or type(value) in (bool, int, float):
        return str(value)[:limit]
    return type(value).__name__


# What readers that inline a check (the fast frames) need to know about it.
_INT_RANGES: dict[Check, tuple[int, int]] = {}
_BIN_MAX: dict[Check, int] = {}
_TEXT_PASSED: dict[Check, set[str]] = {}
# What `longest` needs: per flat check, a value encoded at least as long as any the
# check accepts (made on demand: a binary field may allow 16 MiB).
_LONGEST: dict[Check, Callable[[], Any]] = {}


def int_range(check: Check) -> tuple[int, int]:
    """``(lo, hi)`` of an `integer` check, for a reader that compares inline."""
    return _INT_RANGES[check]


def bin_limit(check: Check) -> int:
    """The most bytes a `binary` check accepts."""
    return _BIN_MAX[check]


def passed_strings(check: Check) -> set[str]:
    """The live set of strings a `text` check passed before (it grows and is cleared
    by the check): a reader that takes only strings in it takes only valid ones."""
    return _TEXT_PASSED[check]


def longest(check: Check) -> Any:
    """A value encoded at least as long as any `check` accepts.

    Raises:
        TypeError: `check` is not flat (a list, a record or counters): no bound.
    """
    make = _LONGEST.get(check)
    if make is None:
        raise TypeError(f"{check.__doc__} is not a flat field")
    return make()


# --- the checks ---------------------------------------------------------------------------


def integer(lo: int = 0, hi: int = MAX_U63) -> Check:
    """A field check: a msgpack integer (not a float, not a bool) in [`lo`, `hi`]."""

    def check(value: Any, where: str, name: str | int = "") -> int:
        if type(value) is not int:
            raise _fail(_at(where, name), f"expected an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise _fail(_at(where, name), f"{value} is outside [{lo}, {hi}]")
        return value

    check.__doc__ = f"int in [{lo}, {hi}]"
    _INT_RANGES[check] = (lo, hi)
    _LONGEST[check] = lambda: max(lo, hi, key=lambda v: len(msgpack.packb(v)))
    return check


def number(lo: float, hi: float) -> Check:
    """A field check: a finite number in [`lo`, `hi`], decoded as a float."""

    def check(value: Any, where: str, name: str | int = "") -> float:
        # ints are finite; math.isfinite(int) would overflow above ~1e308
        if type(value) is not int and (type(value) is not float or not math.isfinite(value)):
            raise _fail(_at(where, name), "expected a finite number")
        if not lo <= value <= hi:
            raise _fail(_at(where, name), f"{value} is outside [{lo}, {hi}]")
        return float(value)

    check.__doc__ = f"float in [{lo}, {hi}]"
    _LONGEST[check] = lambda: float(hi)  # a float64 (an int in range packs no longer)
    return check


_PASSED_MAX = 1024  # strings a text check remembers as valid (then it starts over)


def text(max_len: int, pattern: re.Pattern[str] | None = None, empty: bool = True) -> Check:
    """A field check: a str of at most `max_len` characters matching `pattern` (use
    ``\\Z``, not ``$``), empty only if `empty`."""
    # The same few strings (bus, worker ids, sessions) come in every message: one set
    # lookup instead of a regex match. Bounded, so junk cannot grow it.
    passed: set[str] = set()

    def check(value: Any, where: str, name: str | int = "") -> str:
        if type(value) is not str:
            raise _fail(_at(where, name), f"expected a string, got {type(value).__name__}")
        if value in passed:
            return value
        if len(value) > max_len or (not value and not empty):
            raise _fail(_at(where, name), f"string length {len(value)} not allowed")
        if value and pattern is not None and not pattern.match(value):
            raise _fail(_at(where, name), f"{value[:80]!r} does not match {pattern.pattern}")
        if len(passed) >= _PASSED_MAX:
            passed.clear()
        passed.add(value)
        return value

    _TEXT_PASSED[check] = passed
    _LONGEST[check] = lambda: "\U0010ffff" * max_len  # 4 bytes of UTF-8 per character
    rule = f", matching {pattern.pattern}" if pattern is not None else ""
    check.__doc__ = f"str, at most {max_len} chars{rule}" + ("" if empty else ", not empty")
    return check


def choice(*options: str) -> Check:
    """A field check: one of these strings."""

    def check(value: Any, where: str, name: str | int = "") -> str:
        if type(value) is not str or value not in options:
            raise _fail(_at(where, name), f"expected one of {options}, got {show(value, 40)!r}")
        return value

    check.__doc__ = "one of " + ", ".join(f'"{o}"' for o in options)
    _LONGEST[check] = lambda: max(options, key=lambda o: len(o.encode()))
    return check


def binary(max_len: int) -> Check:
    """A field check: msgpack bin of at most `max_len` bytes."""

    def check(value: Any, where: str, name: str | int = "") -> bytes:
        if type(value) is not bytes or len(value) > max_len:
            raise _fail(_at(where, name), f"expected at most {max_len} bytes")
        return value

    check.__doc__ = f"bytes, at most {max_len}"
    _BIN_MAX[check] = max_len
    _LONGEST[check] = lambda: bytes(max_len)
    return check


def list_of(item: Check, max_len: int) -> Check:
    """A field check: a list of at most `max_len` items, each passing `item`; a tuple."""

    def check(value: Any, where: str, name: str | int = "") -> tuple[Any, ...]:
        if type(value) is not list:
            raise _fail(_at(where, name), f"expected a list, got {type(value).__name__}")
        if len(value) > max_len:
            raise _fail(_at(where, name), f"list of {len(value)} items (at most {max_len})")
        path = _at(where, name)
        return tuple(item(v, path, i) for i, v in enumerate(value))

    check.__doc__ = f"list (at most {max_len}) of {item.__doc__}"
    return check


_COUNTER_NAME = text(64)
_COUNTER = integer()


def counters(value: Any, where: str, name: str | int = "") -> dict[str, int]:
    """map str -> int >= 0 (at most 256 entries)"""
    path = _at(where, name)
    if type(value) is not dict or len(value) > 256:
        raise _fail(path, "expected a map of at most 256 counters")
    return {_COUNTER_NAME(k, path): _COUNTER(v, path, k) for k, v in value.items()}


def record(cls: type[Any]) -> Check:
    """A field check: a map decoded as `cls`, a class given to `define` (the records of
    `_protocol.FIELDS`, such as `TensorSpec`, or a class of a `MessageSet`)."""

    def check(value: Any, where: str, name: str | int = "") -> Any:
        if type(value) is not dict:
            raise _fail(_at(where, name), f"expected a map, got {type(value).__name__}")
        return build(cls, value, _at(where, name))

    check.__doc__ = f"map: {cls.__name__}"
    return check


# --- building a class from a map ----------------------------------------------------------

# Each defined class's checks, in the order of its constructor's arguments.
_PLANS: dict[type[Any], tuple[tuple[str, Check], ...]] = {}


def define(cls: type[Any], plan: tuple[tuple[str, Check], ...]) -> None:
    """Make `cls` buildable from a map: `plan` names each constructor argument, in
    order, with its check.

    Raises:
        ValueError: `cls` is defined already (a class belongs to one table).
    """
    if cls in _PLANS:
        raise ValueError(f"{cls.__name__} is defined already")
    _PLANS[cls] = plan


def defined(cls: type[Any]) -> bool:
    """Whether `define` was given `cls` (by any table)."""
    return cls in _PLANS


def build(cls: type[Any], raw: dict[Any, Any], where: str, skip: tuple[str, ...] = ()) -> Any:
    """`cls` from `raw` through its checks, or ProtocolError naming the field at `where`.

    `skip` names keys `raw` may carry besides the fields (``proto`` and ``type`` of a
    message); a missing, extra or invalid field, or a cross-field check of the class
    (a ValueError from ``__post_init__``), is a ProtocolError.
    """
    table = _PLANS[cls]
    if len(raw) != len(table) + len(skip):  # exact field sets are the common case
        extra = set(raw) - {name for name, _ in table} - set(skip)
        if extra:
            raise _fail(where, f"unknown field(s) {sorted(map(str, extra))[:5]}")
    try:
        values = [check(raw[name], where, name) for name, check in table]
    except KeyError:
        missing = [name for name, _ in table if name not in raw]
        if not missing:
            raise  # not a missing field: a bug in a check
        raise _fail(where, f"missing field {missing[0]!r}") from None
    try:
        return cls(*values)
    except ValueError as exc:  # cross-field checks in __post_init__
        raise _fail(where, str(exc)) from exc
