"""The wire protocol: frozen messages, `encode`, `decode`. No sockets, no clock, no torch.

This is the only place where bytes from a socket become objects. `decode` either
returns a valid message or raises `ProtocolError`; any other exception is a bug.

**Nothing received is ever unpickled.** Pickle turns bytes into code execution (the
ShadowMQ family of CVEs in inference servers was exactly a ``recv_pyobj`` on a reachable
socket). Every message is a msgpack map of plain values, validated field by field
(type, range, length) against the tables below; buffer handles travel as plain fields
and are rebuilt by fixed local code.

Every message carries ``proto`` (`PROTO`), ``type`` and ``bus`` (a random id chosen when
a publisher starts). A HELLO or INSPECT may carry an empty ``bus``: the sender does not
know the bus yet. The field tables (`FIELDS`) are the specification; ``docs/protocol.md``
is generated from them by ``tools/gen_protocol_doc.py`` and a test keeps the two equal.

Other channels (the relays' control channel) define their messages with the same
machinery: `MessageSet`, with tables built from the same public field checks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from itertools import pairwise
from typing import Any, ClassVar, Generic, Protocol, TypeAlias, TypeVar

import msgpack

from ._errors import ProtocolError

__all__ = [
    "DTYPES",
    "FIELDS",
    "MAX_EVENT",
    "MESSAGE_TYPES",
    "PROTO",
    "Ack",
    "BufferInfo",
    "Bye",
    "Check",
    "Error",
    "Heartbeat",
    "Hello",
    "Inspect",
    "Message",
    "MessageSet",
    "Receive",
    "State",
    "Tap",
    "Stop",
    "TensorSpec",
    "contiguous_stride",
    "Welcome",
    "WorkerState",
    "ack_pattern",
    "binary",
    "choice",
    "counters",
    "decode",
    "encode",
    "integer",
    "list_of",
    "max_encoded",
    "number",
    "read_ack",
    "read_receive",
    "receive_pattern",
    "record",
    "template",
    "template_pieces",
    "text",
    "to_plain",
]

PROTO = 1
ALIGN = 256  # every tensor starts at a multiple of this inside a slot
MAX_MESSAGE = 16 * 1024 * 1024
MAX_TENSORS = 100_000
# Tensor views a subscriber builds when it adopts a WELCOME: one per tensor per slot, at
# ~0.7 KB and 2-7 us each. The largest manifest in the default two slots fits; a WELCOME
# of 100,000 empty tensors in 64 slots (4.9 GB, 45 s) does not.
MAX_SLOT_VIEWS = 2 * MAX_TENSORS
MAX_SLOTS = 64
MAX_BYTES = 1 << 48  # 256 TiB: far above any model, far below int64 overflow
MAX_NDIM = 16
MAX_KEY_DEPTH = 32
MAX_WORKERS = 100_000
MAX_U63 = (1 << 63) - 1
CUDA_IPC_HANDLE = 64  # sizeof(cudaIpcMemHandle_t)

# dtype name on the wire -> item size in bytes. A fixed table: a name received is looked
# up here, never resolved with getattr on a module.
DTYPES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

_HEX16 = re.compile(r"^[0-9a-f]{16}\Z")  # \Z: "$" would let a final "\n" in
_HEX32 = re.compile(r"^[0-9a-f]{32}\Z")
_SEGMENT = re.compile(r"^zmqsync-[A-Za-z0-9_.-]{1,160}\Z")


class Check(Protocol):
    """A field check: the value (possibly converted), or ProtocolError.

    It gets where the value sits as the enclosing path and the field's name (or list
    index), and formats the path only when it fails: a decode runs several checks per
    message, and building their paths cost as much as the checks themselves.
    """

    def __call__(self, value: Any, where: str, name: str | int = "", /) -> Any: ...


# --- field checks: each returns the (possibly converted) value or raises ProtocolError ---


def _fail(where: str, why: str) -> ProtocolError:
    return ProtocolError(f"{where}: {why}")


def _at(where: str, name: str | int) -> str:
    """The path of a field (``where.name``) or list item (``where[name]``)."""
    if type(name) is int:
        return f"{where}[{name}]"
    return f"{where}.{name}" if name != "" else where


def _show(value: Any, limit: int) -> str:
    """A received value, cut short, for an error message. Containers are named by type:
    the repr of a deeply nested list would itself raise RecursionError."""
    if type(value) in (str, bytes):
        return str(value[:limit])
    if value is None or type(value) in (bool, int, float):
        return str(value)[:limit]
    return type(value).__name__


# What the fast decode of the hot messages needs to know about a field's check.
_INT_RANGES: dict[Check, tuple[int, int]] = {}
_BIN_MAX: dict[Check, int] = {}
_TEXT_PASSED: dict[Check, set[str]] = {}
# What `max_encoded` needs: per flat check, a value encoded at least as long as any the
# check accepts (made on demand: a binary field may allow 16 MiB).
_LONGEST: dict[Check, Callable[[], Any]] = {}


def _int(lo: int = 0, hi: int = MAX_U63) -> Check:
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


def _float(lo: float, hi: float) -> Check:
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


def _text(max_len: int, pattern: re.Pattern[str] | None = None, empty: bool = True) -> Check:
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


def _choice(*options: str) -> Check:
    def check(value: Any, where: str, name: str | int = "") -> str:
        if type(value) is not str or value not in options:
            raise _fail(_at(where, name), f"expected one of {options}, got {_show(value, 40)!r}")
        return value

    check.__doc__ = "one of " + ", ".join(f'"{o}"' for o in options)
    _LONGEST[check] = lambda: max(options, key=lambda o: len(o.encode()))
    return check


def _bin(max_len: int) -> Check:
    def check(value: Any, where: str, name: str | int = "") -> bytes:
        if type(value) is not bytes or len(value) > max_len:
            raise _fail(_at(where, name), f"expected at most {max_len} bytes")
        return value

    check.__doc__ = f"bytes, at most {max_len}"
    _BIN_MAX[check] = max_len
    _LONGEST[check] = lambda: bytes(max_len)
    return check


def _list(item: Check, max_len: int) -> Check:
    def check(value: Any, where: str, name: str | int = "") -> tuple[Any, ...]:
        if type(value) is not list:
            raise _fail(_at(where, name), f"expected a list, got {type(value).__name__}")
        if len(value) > max_len:
            raise _fail(_at(where, name), f"list of {len(value)} items (at most {max_len})")
        path = _at(where, name)
        return tuple(item(v, path, i) for i, v in enumerate(value))

    check.__doc__ = f"list (at most {max_len}) of {item.__doc__}"
    return check


def _counters(value: Any, where: str, name: str | int = "") -> dict[str, int]:
    """map str -> int >= 0 (at most 256 entries)"""
    path = _at(where, name)
    if type(value) is not dict or len(value) > 256:
        raise _fail(path, "expected a map of at most 256 counters")
    return {_COUNTER_NAME(k, path): _COUNTER(v, path, k) for k, v in value.items()}


def _record(
    cls: type[Any], build: Callable[[type[Any], dict[Any, Any], str], Any] | None = None
) -> Check:
    """A map decoded as `cls` by `build` (default: this module's `_build` and FIELDS)."""

    def check(value: Any, where: str, name: str | int = "") -> Any:
        if type(value) is not dict:
            raise _fail(_at(where, name), f"expected a map, got {type(value).__name__}")
        return (build or _build)(cls, value, _at(where, name))

    check.__doc__ = f"map: {cls.__name__}"
    return check


def _build(cls: type[Any], raw: dict[Any, Any], where: str, skip: tuple[str, ...] = ()) -> Any:
    table = _PLANS.get(cls) or _PLANS.setdefault(cls, _plan(cls))
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


_PLANS: dict[type[Any], tuple[tuple[str, Check], ...]] = {}

# (name, strings that passed its check (text), else None and the int's range, or for
# bytes the range (-1, max length))
_FastPlan = tuple[tuple[str, set[str] | None, int, int], ...]


def _fast_plan(cls: type[Any]) -> _FastPlan:
    plan = []
    for name, check in _plan(cls):
        passed = _TEXT_PASSED.get(check)
        lo, hi = _INT_RANGES.get(check, (0, -1))
        if check in _BIN_MAX:
            lo, hi = -1, _BIN_MAX[check]
        if passed is None and lo > hi:  # a field check the fast path does not know
            raise TypeError(f"{cls.__name__}.{name}: no fast check; decode it with _build")
        plan.append((name, passed, lo, hi))
    return tuple(plan)


def _build_fast(cls: type[Any], raw: dict[Any, Any], plan: _FastPlan) -> Any:
    """`cls` from `raw` if every field is one `_build` would accept without a second look
    (an int in range, a string its check passed before), else None: then `_build` decides.

    RECEIVE and ACK are decoded once per version by every worker and once per worker by
    the publisher, on threads that come to them with cold caches; the generic walk (a
    closure call per field) cost ~2 us more per message there.
    """
    if len(raw) != len(plan) + 2:  # + proto and type
        return None
    values = []
    for name, passed, lo, hi in plan:
        value = raw.get(name)
        if passed is not None:
            if type(value) is not str or value not in passed:
                return None
        elif lo < 0:  # bytes
            if type(value) is not bytes or len(value) > hi:
                return None
        elif type(value) is not int or not lo <= value <= hi:
            return None
        values.append(value)
    return cls(*values)


def _plan(cls: type[Any]) -> tuple[tuple[str, Check], ...]:
    """`cls`'s field checks in the order of its constructor's arguments."""
    table = FIELDS[cls]
    return tuple((f.name, table[f.name][0]) for f in fields(cls))


# --- messages --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor lives inside a slot: a contiguous, 256-byte-aligned run of bytes."""

    key: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int
    buffer: int = 0

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("empty key")
        numel = math.prod(self.shape)
        if numel * DTYPES[self.dtype] != self.nbytes:
            raise ValueError(f"{'.'.join(self.key)}: shape x itemsize != nbytes")
        if self.stride != contiguous_stride(self.shape):
            raise ValueError(f"{'.'.join(self.key)}: stride is not contiguous")
        if self.offset % ALIGN:
            raise ValueError(f"{'.'.join(self.key)}: offset not {ALIGN}-byte aligned")

    @property
    def name(self) -> str:
        return ".".join(self.key)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """One shared buffer (one per device): how a subscriber maps it, without unpickling."""

    kind: str
    device: str
    segment: str
    size: int
    header_bytes: int
    handle: bytes = b""
    device_uuid: str = ""
    pid_ns: int = 0
    ipc_note: str = ""

    def __post_init__(self) -> None:
        if self.kind == "cuda" and len(self.handle) not in (0, CUDA_IPC_HANDLE):
            raise ValueError(
                f"a CUDA IPC handle is {CUDA_IPC_HANDLE} bytes, not {len(self.handle)}"
            )


@dataclass(frozen=True, slots=True)
class WorkerState:
    """A worker as the publisher sees it (in STATE)."""

    worker_id: str
    pid: int
    host: str
    mode: str
    transport: str
    version: int
    last_seen: float
    transport_note: str = ""


@dataclass(frozen=True, slots=True)
class Hello:
    """Subscriber -> publisher (control): I want to join; tell me where everything is."""

    TYPE: ClassVar[str] = "hello"
    bus: str
    worker_id: str
    pid: int
    host: str
    mode: str
    transport: str
    transport_note: str = ""
    session: str = ""
    nonce: str = ""


@dataclass(frozen=True, slots=True)
class Welcome:
    """Publisher -> subscriber (control): endpoints, buffers, manifest, current version."""

    TYPE: ClassVar[str] = "welcome"
    bus: str
    session: str
    seq: int
    version: int
    slot: int
    slots: int
    slot_bytes: int
    heartbeat: float
    events: str
    acks: str
    tap: str
    buffers: tuple[BufferInfo, ...]
    manifest: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        if not self.buffers:
            raise ValueError("no buffers")
        if self.slot >= self.slots:
            raise ValueError(f"slot {self.slot} >= slots {self.slots}")
        for buf in self.buffers:
            if buf.header_bytes + self.slots * self.slot_bytes > buf.size:
                raise ValueError(f"segment {buf.segment}: slots exceed its size")
        _check_placement(self.manifest, len(self.buffers), self.slot_bytes)


def _check_placement(manifest: tuple[TensorSpec, ...], buffers: int, slot_bytes: int) -> None:
    """Every tensor inside the slot, none overlapping another of its buffer, and all of
    them together no bigger than one slot.

    This bounds what a WELCOME can make a subscriber allocate by what the publisher
    reserved (the segment's size, checked against the file when it is mapped): a
    copy-mode subscriber without a model allocates every tensor, and one reading the CPU
    copy of CUDA weights finds them all in the CPU slot. Without it, 200 overlapping
    entries of 64 MiB in a 64 MiB slot asked a subscriber for 12.5 GiB. A publisher's
    own layout has its offsets growing in manifest order, and is checked in one pass;
    any other order costs a sort. Empty tensors hold no bytes and may sit anywhere.

    Raises:
        ValueError: the first rule broken (decode turns it into ProtocolError).
    """
    total, ordered = 0, True
    ends = [0] * buffers  # per buffer: where its last tensor, in manifest order, ended
    for spec in manifest:
        if spec.buffer >= buffers:
            raise ValueError(f"{spec.name}: buffer index {spec.buffer} out of range")
        end = spec.offset + spec.nbytes
        if end > slot_bytes:
            raise ValueError(f"{spec.name}: offset + nbytes past the slot")
        if spec.nbytes:
            total += spec.nbytes
            ordered = ordered and spec.offset >= ends[spec.buffer]
            ends[spec.buffer] = end
    if not ordered:
        _refuse_overlaps(manifest)
    if total > slot_bytes:
        raise ValueError(
            f"the tensors add up to {total} bytes, more than one slot ({slot_bytes} bytes)"
        )


def _refuse_overlaps(manifest: tuple[TensorSpec, ...]) -> None:
    """ValueError naming two tensors of one buffer whose bytes overlap, if there are any."""
    runs = sorted(
        (spec.buffer, spec.offset, spec.offset + spec.nbytes, i)
        for i, spec in enumerate(manifest)
        if spec.nbytes
    )
    for (buffer, start, end, i), (next_buffer, next_start, next_end, j) in pairwise(runs):
        if buffer == next_buffer and next_start < end:
            raise ValueError(
                f"{manifest[i].name} (bytes {start} to {end}) and {manifest[j].name} "
                f"(bytes {next_start} to {next_end}) overlap in buffer {buffer}; a "
                "publisher places each tensor of a buffer after the previous one"
            )


@dataclass(frozen=True, slots=True)
class Receive:
    """Publisher -> all (events): version `version` is complete in `slot`; apply it, ACK."""

    TYPE: ClassVar[str] = "receive"
    bus: str
    seq: int
    version: int
    slot: int
    changed: bytes = b""


@dataclass(frozen=True, slots=True)
class Stop:
    """Publisher -> all (events): the bus closes (`session` empty) or one worker is evicted."""

    TYPE: ClassVar[str] = "stop"
    bus: str
    seq: int
    session: str
    reason: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Either way: I am alive. From the publisher `seq` is the last event seq sent."""

    TYPE: ClassVar[str] = "heartbeat"
    bus: str
    seq: int
    worker_id: str
    session: str
    version: int


@dataclass(frozen=True, slots=True)
class Ack:
    """Subscriber -> publisher (acks): my model now computes with `version`."""

    TYPE: ClassVar[str] = "ack"
    bus: str
    worker_id: str
    session: str
    version: int


@dataclass(frozen=True, slots=True)
class Bye:
    """Subscriber -> publisher (acks): I am leaving; forget me and free my slot."""

    TYPE: ClassVar[str] = "bye"
    bus: str
    worker_id: str
    session: str


@dataclass(frozen=True, slots=True)
class Inspect:
    """Anyone -> publisher (control): describe the bus (answered with STATE)."""

    TYPE: ClassVar[str] = "inspect"
    bus: str


@dataclass(frozen=True, slots=True)
class State:
    """Publisher -> inspector (control): manifest, buffers, workers, counters."""

    TYPE: ClassVar[str] = "state"
    bus: str
    name: str
    pid: int
    version: int
    seq: int
    slots: int
    slot_versions: tuple[int, ...]
    heartbeat: float
    tap: str
    events: str
    buffers: tuple[BufferInfo, ...]
    manifest: tuple[TensorSpec, ...]
    workers: tuple[WorkerState, ...]
    counters: dict[str, int]


@dataclass(frozen=True, slots=True)
class Error:
    """Publisher -> requester (control): your request was refused, and why."""

    TYPE: ClassVar[str] = "error"
    bus: str
    reason: str


@dataclass(frozen=True, slots=True)
class Tap:
    """Publisher -> sniffers (tap): a copy of one frame the publisher sent or received."""

    TYPE: ClassVar[str] = "tap"
    bus: str
    ts: float
    dir: str
    peer: str
    frame: bytes


Message: TypeAlias = (
    Hello | Welcome | Receive | Stop | Heartbeat | Ack | Bye | Inspect | State | Error | Tap
)

_BUS = _text(16, _HEX16, empty=False)
_BUS_OR_EMPTY = _text(16, _HEX16)
_SESSION = _text(16, _HEX16)
_ID = _text(128, re.compile(r"^[\x21-\x7e]+\Z"), empty=False)
_VERSION = _int()
_COUNTER_NAME = _text(64)
_COUNTER = _int()
_SLOT = _int(0, MAX_SLOTS - 1)
_KEY_PART = _text(256, empty=False)
_CHANGED = _bin((MAX_TENSORS + 7) // 8)
_ENDPOINT = _text(512, re.compile(r"^(ipc|tcp|inproc)://"), empty=False)

# name -> (check, description). The specification; docs/protocol.md is generated from it.
FIELDS: dict[type[Any], dict[str, tuple[Check, str]]] = {
    TensorSpec: {
        "key": (_list(_KEY_PART, MAX_KEY_DEPTH), 'path of the tensor, e.g. ["0", "weight"]'),
        "dtype": (_choice(*DTYPES), "element type"),
        "shape": (_list(_int(0, MAX_BYTES), MAX_NDIM), "sizes"),
        "stride": (_list(_int(0, MAX_BYTES), MAX_NDIM), "contiguous strides, in elements"),
        "offset": (_int(0, MAX_BYTES), "byte offset inside a slot; a multiple of 256"),
        "nbytes": (_int(0, MAX_BYTES), "byte length; equals prod(shape) x itemsize"),
        "buffer": (_int(0, 15), "index into `buffers` (one buffer per device)"),
    },
    BufferInfo: {
        "kind": (_choice("cpu", "cuda"), "transport of this buffer"),
        "device": (_text(32, empty=False), "torch device of the publisher's buffer"),
        "segment": (_text(200, _SEGMENT), "file name in the shm dir (never a path)"),
        "size": (_int(0, MAX_BYTES), "bytes of the whole segment"),
        "header_bytes": (_int(0, 1 << 20), "bytes of the header page before slot 0"),
        "handle": (_bin(256), "CUDA IPC handle bytes; empty for cpu"),
        "device_uuid": (_text(64), "CUDA device UUID; empty for cpu"),
        "pid_ns": (_int(), "publisher's PID namespace inode (0: unknown); CUDA IPC needs the same"),
        "ipc_note": (_text(256), "why a cuda buffer has no handle (then read the cpu copy)"),
    },
    WorkerState: {
        "worker_id": (_ID, "worker id"),
        "pid": (_int(), "process id in the worker's namespace"),
        "host": (_text(255), "host name"),
        "mode": (_choice("copy", "alias"), "apply mode"),
        "transport": (_choice("cpu", "cuda"), "how the worker reads the buffer"),
        "version": (_int(-1), "last acked version; -1 before the first ack"),
        "last_seen": (_float(0, 1e12), "seconds since the last message from it"),
        "transport_note": (_text(256), "why it reads the cpu copy of cuda weights, if it does"),
    },
    Hello: {
        "bus": (_BUS_OR_EMPTY, "empty, or the bus the sender last knew"),
        "worker_id": (_ID, "stable name of the worker (default host-pid-random)"),
        "pid": (_int(), "process id"),
        "host": (_text(255), "host name"),
        "mode": (_choice("copy", "alias"), "how it applies versions"),
        "transport": (_choice("cpu", "cuda"), "buffer transport it will use"),
        "transport_note": (_text(256), "empty, or why it falls back to the cpu copy"),
        "session": (
            _SESSION,
            "empty, or the session it holds now: proves a re-join of the same process",
        ),
        "nonce": (
            _text(32, _HEX32),
            "a secret the worker drew once, the same in every HELLO it sends: proves it is "
            "the same process; empty: no proof but the session",
        ),
    },
    Welcome: {
        "bus": (_BUS, "bus id"),
        "session": (_SESSION, "id of this worker's membership; echoed in ACK/HEARTBEAT/BYE"),
        "seq": (_int(), "seq of the last event sent; drop events with seq <= this"),
        "version": (_VERSION, "current version"),
        "slot": (_SLOT, "slot holding the current version"),
        "slots": (_int(1, MAX_SLOTS), "number of slots"),
        "slot_bytes": (_int(0, MAX_BYTES), "bytes per slot (page multiple)"),
        "heartbeat": (_float(0.001, 3600), "heartbeat interval in seconds"),
        "events": (_ENDPOINT, "PUB endpoint to connect a SUB to"),
        "acks": (_ENDPOINT, "PULL endpoint to connect a PUSH to"),
        "tap": (_text(512), "tap endpoint, empty when the tap is off"),
        "buffers": (_list(_record(BufferInfo), 16), "one per device"),
        "manifest": (_list(_record(TensorSpec), MAX_TENSORS), "every tensor"),
    },
    Receive: {
        "bus": (_BUS, "bus id"),
        "seq": (_int(1), "event sequence number, +1 per RECEIVE/STOP"),
        "version": (_VERSION, "the new version"),
        "slot": (_SLOT, "slot it was written to"),
        "changed": (
            _CHANGED,
            "tensors changed since the version before: bit i (byte i // 8, bit i % 8) for "
            "manifest entry i; empty: take every tensor as changed",
        ),
    },
    Stop: {
        "bus": (_BUS, "bus id"),
        "seq": (_int(1), "event sequence number"),
        "session": (_text(16, _HEX16), "empty: the bus closes; else that worker is evicted"),
        "reason": (_text(256), "why, for humans"),
    },
    Heartbeat: {
        "bus": (_BUS, "bus id"),
        "seq": (_int(), "publisher: last event seq sent (gap detection); worker: 0"),
        "worker_id": (_text(128), "empty from the publisher"),
        "session": (_text(16, _HEX16), "the worker's session; empty from the publisher"),
        "version": (_int(-1), "sender's current version"),
    },
    Ack: {
        "bus": (_BUS, "bus id"),
        "worker_id": (_ID, "worker id"),
        "session": (_SESSION, "session from WELCOME"),
        "version": (_VERSION, "version the model now computes with"),
    },
    Bye: {
        "bus": (_BUS, "bus id"),
        "worker_id": (_ID, "worker id"),
        "session": (_SESSION, "session from WELCOME"),
    },
    Inspect: {"bus": (_BUS_OR_EMPTY, "empty or the bus id")},
    State: {
        "bus": (_BUS, "bus id"),
        "name": (_text(64), "bus name"),
        "pid": (_int(), "publisher process id"),
        "version": (_VERSION, "current version"),
        "seq": (_int(), "last event seq"),
        "slots": (_int(1, MAX_SLOTS), "number of slots"),
        "slot_versions": (_list(_int(-1), MAX_SLOTS), "version in each slot, -1 empty"),
        "heartbeat": (_float(0.001, 3600), "heartbeat interval in seconds"),
        "tap": (_text(512), "tap endpoint, empty when off"),
        "events": (_ENDPOINT, "events endpoint (for sniffers when the tap is off)"),
        "buffers": (_list(_record(BufferInfo), 16), "as in WELCOME"),
        "manifest": (_list(_record(TensorSpec), MAX_TENSORS), "as in WELCOME"),
        "workers": (_list(_record(WorkerState), MAX_WORKERS), "live workers"),
        "counters": (_counters, "publishes, acks, timeouts, evictions, rejected, ..."),
    },
    Tap: {
        "bus": (_BUS, "bus id"),
        "ts": (_float(0, 1e12), "unix time when the publisher sent or received the frame"),
        "dir": (_choice("out", "in"), "out: sent by the publisher; in: received by it"),
        "peer": (_text(128), "worker id (empty for broadcasts and unknown senders)"),
        "frame": (_bin(MAX_MESSAGE), "the frame itself (handle bytes redacted)"),
    },
    Error: {"bus": (_BUS, "bus id"), "reason": (_text(1024), "why the request was refused")},
}

MESSAGE_TYPES: dict[str, type[Any]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Receive, Stop, Heartbeat, Ack, Bye, Inspect, State, Error, Tap)
}


def to_plain(obj: Any) -> Any:
    """A message (or part of one) as plain msgpack/JSON-safe values."""
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


_FAST = {cls: _fast_plan(cls) for cls in (Receive, Ack)}  # one per version and worker
_FLAT = (Receive, Stop, Heartbeat, Ack, Bye, Inspect, Error)  # no nested records
_BYTES = (bytes, bytearray, memoryview)  # a tuple: ``bytes | ...`` builds a union per call
_NAMES: dict[type[Any], tuple[str, ...]] = {}


def encode(msg: Message) -> bytes:
    """Bytes for `msg`. Our own messages are valid by construction."""
    cls = type(msg)
    if cls in _FLAT:  # the hot path (RECEIVE, ACK, HEARTBEAT): no recursion
        names = _NAMES.get(cls) or _NAMES.setdefault(cls, tuple(f.name for f in fields(msg)))
        body = {name: getattr(msg, name) for name in names}
    else:
        body = to_plain(msg)
    body["proto"] = PROTO
    body["type"] = msg.TYPE
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def max_encoded(*classes: type[Message]) -> int:
    """The most bytes `encode` can write for a valid message of any of `classes`.

    Derived from the field table (every field at its longest), so that a socket sized
    with it accepts every message a peer may legally send, whatever a field's limit
    becomes: a smaller frame limit makes libzmq drop an honest peer. Text counts four
    bytes per character, so the bound may exceed the longest real message a little.

    Raises:
        TypeError: a class has nested records or lists (no flat bound is derived).
    """
    longest = 0
    for cls in classes:
        body: dict[str, Any] = {}
        for name, (check, _) in FIELDS[cls].items():
            if check not in _LONGEST:
                raise TypeError(f"{cls.__name__}.{name} is not a flat field")
            body[name] = _LONGEST[check]()
        body["proto"], body["type"] = PROTO, cls.TYPE
        longest = max(longest, len(msgpack.packb(body, use_bin_type=True)))
    return longest


# The largest frame on the events socket (~12.3 KiB): a RECEIVE whose `changed` bitmap
# has a bit for each of MAX_TENSORS tensors. A subscriber refuses larger ones.
MAX_EVENT = max_encoded(Receive, Stop, Heartbeat)


def template_pieces(cls: type[Message], **fixed: Any) -> tuple[bytes, ...]:
    """The bytes `encode` writes for `cls` messages that share the `fixed` fields, in
    pieces: what comes before the first other field, between each two, and after the
    last (every other field is packed between two pieces, in field order)."""
    if cls not in _FLAT:
        raise TypeError(f"{cls.__name__} has nested records: use encode()")
    names = [f.name for f in fields(cls)]
    if unknown := set(fixed) - set(names):
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    pieces: list[bytes] = []
    literal = msgpack.Packer().pack_map_header(len(names) + 2)
    for name in names:
        literal += msgpack.packb(name)
        if name in fixed:
            literal += msgpack.packb(fixed[name], use_bin_type=True)
        else:
            pieces.append(literal)
            literal = b""
    pieces.append(literal + msgpack.packb({"proto": PROTO, "type": cls.TYPE})[1:])
    return tuple(pieces)


def template(cls: type[Message], **fixed: Any) -> Callable[..., bytes]:
    """`encode` for `cls` messages that share the `fixed` fields; the others are given
    positionally, in field order, and only they are packed per message.

    A worker's ACKs differ only in the version, the publisher's RECEIVEs only in seq,
    version and slot; packing the rest again cost a cold thread ~4 us per message. The
    bytes are `encode`'s for the same message.
    """
    head, *tails = template_pieces(cls, **fixed)
    # One Packer per template, not msgpack.packb (a Python function that builds a Packer
    # and its buffer per call). Its pack() of an int, str or bytes runs in C without
    # releasing the GIL or calling back into Python, so threads that share a template
    # (a worker's agent and, in manual mode, the user's thread) cannot interleave in it.
    pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
    if len(tails) == 1:
        tail = tails[0]
        return lambda value: head + pack(value) + tail

    def frame(*values: Any) -> bytes:
        out = [head]
        for value, tail in zip(values, tails, strict=True):
            out += (pack(value), tail)
        return b"".join(out)

    return frame


def _build_message(cls: type[Any], raw: dict[Any, Any], kind: str) -> Message:
    """`cls` from `raw` by the field checks, then what a receiver will spend on it.

    The view budget is checked here, not in `Welcome.__post_init__`: a publisher that
    builds such a WELCOME is consistent, just more than a subscriber will adopt, and a
    ValueError there would stop the publisher's handshake thread instead.
    """
    msg: Message = _build(cls, raw, kind, skip=("proto", "type"))
    if isinstance(msg, Welcome) and msg.slots * len(msg.manifest) > MAX_SLOT_VIEWS:
        raise ProtocolError(
            f"{kind}: {msg.slots} slots x {len(msg.manifest)} tensors = "
            f"{msg.slots * len(msg.manifest)} tensor views for a subscriber to build, more "
            f"than {MAX_SLOT_VIEWS}; a publisher of that many tensors must use fewer slots"
        )
    return msg


def decode(data: bytes, *, bus: str | None = None) -> Message:
    """Turn bytes from a socket into a message. Never unpickles.

    Args:
        data: one frame as received.
        bus: when given, a message of another bus is refused (HELLO and INSPECT may
            carry an empty bus).

    Raises:
        ProtocolError: `data` is not a valid message of this protocol (malformed
            msgpack, wrong `proto`, foreign `bus`, unknown `type`, field of the wrong
            type or out of range). Any other exception is a bug.
    """
    if not isinstance(data, _BYTES):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, RecursionError, BufferError) as exc:
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}: {exc}") from exc
    if type(raw) is not dict:
        raise ProtocolError(f"expected a msgpack map, got {type(raw).__name__}")
    proto = raw.get("proto")
    if proto != PROTO or type(proto) is not int:
        raise ProtocolError(f"protocol {_show(proto, 20)!r}, expected {PROTO}")
    kind = raw.get("type")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_show(kind, 40)!r}")
    fast = _FAST.get(cls)
    msg: Message = (fast is not None and _build_fast(cls, raw, fast)) or _build_message(
        cls, raw, str(kind)
    )
    if (
        bus is not None
        and msg.bus != bus
        and not (isinstance(msg, Hello | Inspect) and not msg.bus)
    ):
        raise ProtocolError(f"{kind} from foreign bus {msg.bus!r} (this bus is {bus!r})")
    return msg


_SEQ_LO, _SEQ_HI = _INT_RANGES[FIELDS[Receive]["seq"][0]]
_VERSION_LO, _VERSION_HI = _INT_RANGES[_VERSION]
_SLOT_LO, _SLOT_HI = _INT_RANGES[_SLOT]
_CHANGED_MAX = _BIN_MAX[_CHANGED]
_RECEIVE_KEYS = len(fields(Receive)) + 2  # + proto and type
_ACK_KEYS = len(fields(Ack)) + 2
_IDS_PASSED, _SESSIONS_PASSED = _TEXT_PASSED[_ID], _TEXT_PASSED[_SESSION]


def ack_pattern(bus: str) -> tuple[tuple[bytes, ...], tuple[int, int], set[str], set[str]]:
    """An ACK of `bus` as workers write it, for a native reader: the pieces around
    worker_id, session and version (`template_pieces`), the version's range, and the
    worker ids and sessions that passed their checks before (the sets `read_ack` looks
    in, kept up to date here). A frame made of these, whose ids are in those sets, is
    one `read_ack` takes, with the same values; any other frame is left to `decode`."""
    pieces = template_pieces(Ack, bus=bus)
    return pieces, (_VERSION_LO, _VERSION_HI), _IDS_PASSED, _SESSIONS_PASSED


def receive_pattern(bus: str) -> tuple[tuple[bytes, ...], tuple[int, ...]]:
    """A RECEIVE of `bus` as the publisher writes it, for a native reader: the pieces
    around seq, version, slot and changed (`template_pieces`), and the ranges
    `read_receive` checks (seq, version and slot low and high, changed's longest). A
    frame made of these pieces, with fields in these ranges, is one `read_receive`
    takes, with the same values; any other frame is left to it."""
    ranges = (_SEQ_LO, _SEQ_HI, _VERSION_LO, _VERSION_HI, _SLOT_LO, _SLOT_HI, _CHANGED_MAX)
    return template_pieces(Receive, bus=bus), ranges


def read_receive(data: bytes, bus: str) -> tuple[int, int, int, bytes] | None:
    """``(seq, version, slot, changed)`` of a RECEIVE of `bus`, or None for anything else.

    None means "not that": another message, another bus, or bytes that are not a valid
    message; `decode` then says which. What it returns is exactly what `decode` would
    accept as such a RECEIVE (the same checks, done inline), given a `bus` that is valid
    itself (one a decoded WELCOME named). A worker reads one RECEIVE per version, on a
    thread that comes to it with cold caches: no message object, and no call per field.
    """
    if type(data) is not bytes or len(data) > MAX_MESSAGE:
        return None
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, RecursionError, BufferError):
        return None
    if type(raw) is not dict or len(raw) != _RECEIVE_KEYS:
        return None
    try:
        if raw["type"] != "receive" or raw["bus"] != bus:
            return None
        proto, seq, version, slot = raw["proto"], raw["seq"], raw["version"], raw["slot"]
        changed = raw["changed"]
    except KeyError:
        return None
    if (
        type(proto) is not int
        or proto != PROTO
        or type(seq) is not int
        or not _SEQ_LO <= seq <= _SEQ_HI
        or type(version) is not int
        or not _VERSION_LO <= version <= _VERSION_HI
        or type(slot) is not int
        or not _SLOT_LO <= slot <= _SLOT_HI
        or type(changed) is not bytes
        or len(changed) > _CHANGED_MAX
    ):
        return None
    return seq, version, slot, changed


def read_ack(data: bytes, bus: str) -> tuple[str, str, int] | None:
    """``(worker_id, session, version)`` of an ACK of `bus`, or None for anything else.

    As `read_receive`, for the publisher's side: one ACK per worker per version, read by
    the publishing thread between two waits. Worker ids and sessions are taken only if
    their checks passed them before (every worker's WELCOME did); anything else goes to
    `decode`.
    """
    if type(data) is not bytes or len(data) > MAX_MESSAGE:
        return None
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, RecursionError, BufferError):
        return None
    if type(raw) is not dict or len(raw) != _ACK_KEYS:
        return None
    try:
        if raw["type"] != "ack" or raw["bus"] != bus:
            return None
        proto, worker_id, session, version = (
            raw["proto"],
            raw["worker_id"],
            raw["session"],
            raw["version"],
        )
    except KeyError:
        return None
    if (
        type(proto) is not int
        or proto != PROTO
        or type(worker_id) is not str
        or worker_id not in _IDS_PASSED
        or type(session) is not str
        or session not in _SESSIONS_PASSED
        or type(version) is not int
        or not _VERSION_LO <= version <= _VERSION_HI
    ):
        return None
    return worker_id, session, version


# --- message sets of other channels ------------------------------------------------------
#
# The relay's control channel (zmqsync/relay) speaks messages of its own, with their own
# `proto` and type names, through the same machinery: a field table that is the
# specification, frozen dataclasses, one `decode` that returns a message or raises
# ProtocolError. The checks below are the ones FIELDS is built from.


def integer(lo: int = 0, hi: int = MAX_U63) -> Check:
    """A field check: a msgpack integer (not a float, not a bool) in [`lo`, `hi`]."""
    return _int(lo, hi)


def number(lo: float, hi: float) -> Check:
    """A field check: a finite number in [`lo`, `hi`], decoded as a float."""
    return _float(lo, hi)


def text(max_len: int, pattern: re.Pattern[str] | None = None, empty: bool = True) -> Check:
    """A field check: a str of at most `max_len` characters matching `pattern` (use
    ``\\Z``, not ``$``), empty only if `empty`."""
    return _text(max_len, pattern, empty)


def choice(*options: str) -> Check:
    """A field check: one of these strings."""
    return _choice(*options)


def binary(max_len: int) -> Check:
    """A field check: msgpack bin of at most `max_len` bytes."""
    return _bin(max_len)


def list_of(item: Check, max_len: int) -> Check:
    """A field check: a list of at most `max_len` items, each passing `item`; a tuple."""
    return _list(item, max_len)


def record(cls: type[Any]) -> Check:
    """A field check: a map decoded as `cls`, a record of `FIELDS` (`TensorSpec`,
    `WorkerState`, ...) or a class defined in a `MessageSet`."""
    return _record(cls)


counters: Check = _counters  # a map of counter names (str) to ints >= 0


M = TypeVar("M")


class MessageSet(Generic[M]):
    """The messages of a channel other than the bus, defined and checked like the bus's.

    Each class is a frozen dataclass; a message class has a ``TYPE`` class attribute, a
    record (a map inside messages, see `record`) has none. Its table maps every field to
    ``(check, description)`` exactly as `FIELDS` does: the table is the specification,
    and a generator renders it as ``tools/gen_protocol_doc.py`` renders `FIELDS`. A frame
    is a msgpack map with ``proto`` (this set's number), ``type`` and exactly the fields.

    `decode` is the set's one parse point, with the rules of the bus's `decode`: it returns
    a message of this set or raises `ProtocolError`, never anything else, and never
    unpickles. The bus's own messages are untouched by any set (their fast paths stay).

    Args:
        name: the channel's name in errors ("relay protocol 2, expected 1").
        proto: the version number every frame of the set carries.
    """

    def __init__(self, name: str, proto: int) -> None:
        self.name, self.proto = name, proto
        self.fields: dict[type[Any], dict[str, tuple[Check, str]]] = {}
        self.types: dict[str, type[Any]] = {}

    def define(self, cls: type[Any], table: Mapping[str, tuple[Check, str]]) -> None:
        """Add `cls` (a message if it has ``TYPE``, else a record) with its field table.

        Raises:
            ValueError: the table does not name exactly the dataclass's fields, the class
                is defined already (here, in another set or in `FIELDS`), or its ``TYPE``
                is taken in this set.
            TypeError: `cls` is not a frozen dataclass.
        """
        params = getattr(cls, "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        if cls in FIELDS or cls in _PLANS:
            raise ValueError(f"{cls.__name__} is defined already")
        names = [f.name for f in fields(cls)]
        if sorted(table) != sorted(names):
            raise ValueError(f"{cls.__name__}: the table names {sorted(table)}, not {names}")
        kind = getattr(cls, "TYPE", None)
        if kind is not None and (type(kind) is not str or kind in self.types):
            raise ValueError(f"{cls.__name__}: type {kind!r} is not a new type name")
        self.fields[cls] = dict(table)
        _PLANS[cls] = tuple((name, table[name][0]) for name in names)
        if kind is not None:
            self.types[kind] = cls

    def encode(self, msg: M) -> bytes:
        """Bytes for `msg`, a message of this set (ours are valid by construction)."""
        kind = getattr(msg, "TYPE", None)
        if not isinstance(kind, str) or self.types.get(kind) is not type(msg):
            raise TypeError(f"{type(msg).__name__} is not a {self.name} message")
        body = to_plain(msg)
        body["proto"] = self.proto
        body["type"] = kind
        return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]

    def decode(self, data: bytes) -> M:
        """Turn one frame into a message of this set. Never unpickles.

        Raises:
            ProtocolError: `data` is not a valid message of this set (too long, not a
                msgpack map, another `proto`, an unknown `type`, a field missing, extra,
                of the wrong type or out of range). Any other exception is a bug.
        """
        if not isinstance(data, _BYTES):
            raise ProtocolError(f"expected bytes, got {type(data).__name__}")
        if len(data) > MAX_MESSAGE:
            raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except (ValueError, msgpack.UnpackException, RecursionError, BufferError) as exc:
            raise ProtocolError(f"not a msgpack message: {type(exc).__name__}: {exc}") from exc
        if type(raw) is not dict:
            raise ProtocolError(f"expected a msgpack map, got {type(raw).__name__}")
        proto = raw.get("proto")
        if proto != self.proto or type(proto) is not int:
            raise ProtocolError(f"{self.name} protocol {_show(proto, 20)!r}, expected {self.proto}")
        kind = raw.get("type")
        cls = self.types.get(kind) if type(kind) is str else None
        if cls is None:
            raise ProtocolError(f"unknown {self.name} message type {_show(kind, 40)!r}")
        msg: M = _build(cls, raw, str(kind), skip=("proto", "type"))
        return msg
