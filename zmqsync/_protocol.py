"""The wire protocol: frozen messages, `encode`, `decode`. No sockets, no clock, no torch.

This is the only place where bytes from a socket become objects. `decode` either
returns a valid message or raises `ProtocolError`; any other exception is a bug. (The
two hot messages also have readers that build no object, in `_fast_frames`; they take
only frames `decode` takes, with the same values, and leave the rest to it.)

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
machinery: `MessageSet`, with tables built from the same field checks (`_checks`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from itertools import pairwise
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar

import msgpack

from ._checks import (
    Check,
    binary,
    build,
    choice,
    counters,
    define,
    defined,
    integer,
    list_of,
    longest,
    number,
    record,
    show,
    text,
)
from ._errors import ProtocolError

__all__ = [
    "DTYPES",
    "FIELDS",
    "FLAT",
    "MAX_EVENT",
    "MESSAGE_TYPES",
    "PROTO",
    "Ack",
    "BufferInfo",
    "Bye",
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
    "WorkerEntry",
    "decode",
    "encode",
    "max_encoded",
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
class WorkerEntry:
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
    workers: tuple[WorkerEntry, ...]
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

_BUS = text(16, _HEX16, empty=False)
_BUS_OR_EMPTY = text(16, _HEX16)
_SESSION = text(16, _HEX16)
_ID = text(128, re.compile(r"^[\x21-\x7e]+\Z"), empty=False)
_VERSION = integer()
_SLOT = integer(0, MAX_SLOTS - 1)
_KEY_PART = text(256, empty=False)
_CHANGED = binary((MAX_TENSORS + 7) // 8)
_ENDPOINT = text(512, re.compile(r"^(ipc|tcp|inproc)://"), empty=False)

# name -> (check, description). The specification; docs/protocol.md is generated from it.
FIELDS: dict[type[Any], dict[str, tuple[Check, str]]] = {
    TensorSpec: {
        "key": (list_of(_KEY_PART, MAX_KEY_DEPTH), 'path of the tensor, e.g. ["0", "weight"]'),
        "dtype": (choice(*DTYPES), "element type"),
        "shape": (list_of(integer(0, MAX_BYTES), MAX_NDIM), "sizes"),
        "stride": (list_of(integer(0, MAX_BYTES), MAX_NDIM), "contiguous strides, in elements"),
        "offset": (integer(0, MAX_BYTES), "byte offset inside a slot; a multiple of 256"),
        "nbytes": (integer(0, MAX_BYTES), "byte length; equals prod(shape) x itemsize"),
        "buffer": (integer(0, 15), "index into `buffers` (one buffer per device)"),
    },
    BufferInfo: {
        "kind": (choice("cpu", "cuda"), "transport of this buffer"),
        "device": (text(32, empty=False), "torch device of the publisher's buffer"),
        "segment": (text(200, _SEGMENT), "file name in the shm dir (never a path)"),
        "size": (integer(0, MAX_BYTES), "bytes of the whole segment"),
        "header_bytes": (integer(0, 1 << 20), "bytes of the header page before slot 0"),
        "handle": (binary(256), "CUDA IPC handle bytes; empty for cpu"),
        "device_uuid": (text(64), "CUDA device UUID; empty for cpu"),
        "pid_ns": (
            integer(),
            "publisher's PID namespace inode (0: unknown); CUDA IPC needs the same",
        ),
        "ipc_note": (text(256), "why a cuda buffer has no handle (then read the cpu copy)"),
    },
    WorkerEntry: {
        "worker_id": (_ID, "worker id"),
        "pid": (integer(), "process id in the worker's namespace"),
        "host": (text(255), "host name"),
        "mode": (choice("copy", "alias"), "apply mode"),
        "transport": (choice("cpu", "cuda"), "how the worker reads the buffer"),
        "version": (integer(-1), "last acked version; -1 before the first ack"),
        "last_seen": (number(0, 1e12), "seconds since the last message from it"),
        "transport_note": (text(256), "why it reads the cpu copy of cuda weights, if it does"),
    },
    Hello: {
        "bus": (_BUS_OR_EMPTY, "empty, or the bus the sender last knew"),
        "worker_id": (_ID, "stable name of the worker (default host-pid-random)"),
        "pid": (integer(), "process id"),
        "host": (text(255), "host name"),
        "mode": (choice("copy", "alias"), "how it applies versions"),
        "transport": (choice("cpu", "cuda"), "buffer transport it will use"),
        "transport_note": (text(256), "empty, or why it falls back to the cpu copy"),
        "session": (
            _SESSION,
            "empty, or the session it holds now: proves a re-join of the same process",
        ),
        "nonce": (
            text(32, _HEX32),
            "a secret the worker drew once, the same in every HELLO it sends: proves it is "
            "the same process; empty: no proof but the session",
        ),
    },
    Welcome: {
        "bus": (_BUS, "bus id"),
        "session": (_SESSION, "id of this worker's membership; echoed in ACK/HEARTBEAT/BYE"),
        "seq": (integer(), "seq of the last event sent; drop events with seq <= this"),
        "version": (_VERSION, "current version"),
        "slot": (_SLOT, "slot holding the current version"),
        "slots": (integer(1, MAX_SLOTS), "number of slots"),
        "slot_bytes": (integer(0, MAX_BYTES), "bytes per slot (page multiple)"),
        "heartbeat": (number(0.001, 3600), "heartbeat interval in seconds"),
        "events": (_ENDPOINT, "PUB endpoint to connect a SUB to"),
        "acks": (_ENDPOINT, "PULL endpoint to connect a PUSH to"),
        "tap": (text(512), "tap endpoint, empty when the tap is off"),
        "buffers": (list_of(record(BufferInfo), 16), "one per device"),
        "manifest": (list_of(record(TensorSpec), MAX_TENSORS), "every tensor"),
    },
    Receive: {
        "bus": (_BUS, "bus id"),
        "seq": (integer(1), "event sequence number, +1 per RECEIVE/STOP"),
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
        "seq": (integer(1), "event sequence number"),
        "session": (text(16, _HEX16), "empty: the bus closes; else that worker is evicted"),
        "reason": (text(256), "why, for humans"),
    },
    Heartbeat: {
        "bus": (_BUS, "bus id"),
        "seq": (integer(), "publisher: last event seq sent (gap detection); worker: 0"),
        "worker_id": (text(128), "empty from the publisher"),
        "session": (text(16, _HEX16), "the worker's session; empty from the publisher"),
        "version": (integer(-1), "sender's current version"),
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
        "name": (text(64), "bus name"),
        "pid": (integer(), "publisher process id"),
        "version": (_VERSION, "current version"),
        "seq": (integer(), "last event seq"),
        "slots": (integer(1, MAX_SLOTS), "number of slots"),
        "slot_versions": (list_of(integer(-1), MAX_SLOTS), "version in each slot, -1 empty"),
        "heartbeat": (number(0.001, 3600), "heartbeat interval in seconds"),
        "tap": (text(512), "tap endpoint, empty when off"),
        "events": (_ENDPOINT, "events endpoint (for sniffers when the tap is off)"),
        "buffers": (list_of(record(BufferInfo), 16), "as in WELCOME"),
        "manifest": (list_of(record(TensorSpec), MAX_TENSORS), "as in WELCOME"),
        "workers": (list_of(record(WorkerEntry), MAX_WORKERS), "live workers"),
        "counters": (counters, "publishes, acks, timeouts, evictions, rejected, ..."),
    },
    Tap: {
        "bus": (_BUS, "bus id"),
        "ts": (number(0, 1e12), "unix time when the publisher sent or received the frame"),
        "dir": (choice("out", "in"), "out: sent by the publisher; in: received by it"),
        "peer": (text(128), "worker id (empty for broadcasts and unknown senders)"),
        "frame": (binary(MAX_MESSAGE), "the frame itself (handle bytes redacted)"),
    },
    Error: {"bus": (_BUS, "bus id"), "reason": (text(1024), "why the request was refused")},
}

MESSAGE_TYPES: dict[str, type[Any]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Receive, Stop, Heartbeat, Ack, Bye, Inspect, State, Error, Tap)
}
for _cls, _table in FIELDS.items():
    define(_cls, tuple((f.name, _table[f.name][0]) for f in fields(_cls)))

# Messages whose fields are all plain values (no nested records): `encode` packs them
# without recursion, and a template can hold their bytes (`_fast_frames`).
FLAT = (Receive, Stop, Heartbeat, Ack, Bye, Inspect, Error)


def to_plain(obj: Any) -> Any:
    """A message (or part of one) as plain msgpack/JSON-safe values."""
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


_BYTES = (bytes, bytearray, memoryview)  # a tuple: ``bytes | ...`` builds a union per call
_NAMES: dict[type[Any], tuple[str, ...]] = {}
# A long tuple field (a manifest) as `encode` last packed it, per field name: (the tuple,
# its plain form). A bus's manifest is one tuple of frozen records for its whole life,
# in every WELCOME and STATE, and its plain form cost ~14 us per tensor (27 ms for
# 2,000 tensors, at every join and every scrape of an exporter): built once. Held by
# identity with a reference, so an id is never reused; the plain form is only packed.
_PLAIN_ONCE = 64  # shorter tuples are rebuilt each time
_plain_of: dict[str, tuple[Any, Any]] = {}


def _plain_field(name: str, value: Any) -> Any:
    if type(value) is not tuple or len(value) < _PLAIN_ONCE:
        return to_plain(value)
    last = _plain_of.get(name)
    if last is not None and last[0] is value:
        return last[1]
    plain = to_plain(value)
    _plain_of[name] = (value, plain)
    return plain


def encode(msg: Message) -> bytes:
    """Bytes for `msg`. Our own messages are valid by construction."""
    cls = type(msg)
    if cls in FLAT:  # the hot path (RECEIVE, ACK, HEARTBEAT): no recursion
        names = _NAMES.get(cls) or _NAMES.setdefault(cls, tuple(f.name for f in fields(msg)))
        body = {name: getattr(msg, name) for name in names}
    else:
        body = {f.name: _plain_field(f.name, getattr(msg, f.name)) for f in fields(msg)}
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
    most = 0
    for cls in classes:
        body: dict[str, Any] = {}
        for name, (check, _) in FIELDS[cls].items():
            try:
                body[name] = longest(check)
            except TypeError:
                raise TypeError(f"{cls.__name__}.{name} is not a flat field") from None
        body["proto"], body["type"] = PROTO, cls.TYPE
        most = max(most, len(msgpack.packb(body, use_bin_type=True)))
    return most


# The largest frame on the events socket (~12.3 KiB): a RECEIVE whose `changed` bitmap
# has a bit for each of MAX_TENSORS tensors. A subscriber refuses larger ones.
MAX_EVENT = max_encoded(Receive, Stop, Heartbeat)


def _build_message(cls: type[Any], raw: dict[Any, Any], kind: str) -> Message:
    """`cls` from `raw` by the field checks, then what a receiver will spend on it.

    The view budget is checked here, not in `Welcome.__post_init__`: a publisher that
    builds such a WELCOME is consistent, just more than a subscriber will adopt, and a
    ValueError there would stop the publisher's handshake thread instead.
    """
    msg: Message = build(cls, raw, kind, skip=("proto", "type"))
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
        raise ProtocolError(f"protocol {show(proto, 20)!r}, expected {PROTO}")
    kind = raw.get("type")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {show(kind, 40)!r}")
    msg = _build_message(cls, raw, str(kind))
    if (
        bus is not None
        and msg.bus != bus
        and not (isinstance(msg, Hello | Inspect) and not msg.bus)
    ):
        raise ProtocolError(f"{kind} from foreign bus {msg.bus!r} (this bus is {bus!r})")
    return msg


# --- message sets of other channels ------------------------------------------------------
#
# The relay's control channel (zmqsync/relay) speaks messages of its own, with their own
# `proto` and type names, through the same machinery: a field table that is the
# specification, frozen dataclasses, one `decode` that returns a message or raises
# ProtocolError. The checks below are the ones FIELDS is built from.


M = TypeVar("M")


class MessageSet(Generic[M]):
    """The messages of a channel other than the bus, defined and checked like the bus's.

    Each class is a frozen dataclass; a message class has a ``TYPE`` class attribute, a
    record (a map inside messages, see `_checks.record`) has none. Its table maps every field to
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
        if defined(cls):
            raise ValueError(f"{cls.__name__} is defined already")
        names = [f.name for f in fields(cls)]
        if sorted(table) != sorted(names):
            raise ValueError(f"{cls.__name__}: the table names {sorted(table)}, not {names}")
        kind = getattr(cls, "TYPE", None)
        if kind is not None and (type(kind) is not str or kind in self.types):
            raise ValueError(f"{cls.__name__}: type {kind!r} is not a new type name")
        define(cls, tuple((name, table[name][0]) for name in names))
        self.fields[cls] = dict(table)
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
            raise ProtocolError(f"{self.name} protocol {show(proto, 20)!r}, expected {self.proto}")
        kind = raw.get("type")
        cls = self.types.get(kind) if type(kind) is str else None
        if cls is None:
            raise ProtocolError(f"unknown {self.name} message type {show(kind, 40)!r}")
        msg: M = build(cls, raw, str(kind), skip=("proto", "type"))
        return msg
