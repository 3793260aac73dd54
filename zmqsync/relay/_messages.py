"""The relay control channel's messages: frozen dataclasses and their field tables.

Root and relays exchange msgpack maps on ZeroMQ (ROUTER at the root, DEALERs at the
relays; see ``docs/multi-host.md``). They are defined here as a `MessageSet` of the
protocol module: the tables below are the specification (``docs/protocol.md`` renders
them), and `RELAY.decode` is the one place where the channel's bytes become objects.
It returns a message or raises `ProtocolError`; nothing received is ever unpickled.
The records inside them (`TensorSpec`, `WorkerEntry`) are the bus protocol's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

from .._checks import choice, counters, integer, list_of, number, record, text
from .._protocol import MAX_TENSORS, MessageSet, TensorSpec, WorkerEntry

__all__ = [
    "MAX_RELAYS",
    "MAX_RELAY_WORKERS",
    "RELAY",
    "RELAY_ID",
    "RELAY_PROTO",
    "Accept",
    "Beat",
    "Bye",
    "Commit",
    "Evict",
    "Join",
    "Prepare",
    "Refuse",
    "RelayInfo",
    "RelayMessage",
    "RelayState",
    "Report",
    "Send",
    "Status",
]

RELAY_PROTO = 1  # version of the relay control channel (the bus protocol is separate)
MAX_RELAY_WORKERS = 1000  # local workers reported per relay heartbeat
MAX_RELAYS = 4096
STAGES = ("ready", "formed", "received", "acked", "failed")
STATES = ("pending", "active", "lost", "evicted")


@dataclass(frozen=True, slots=True)
class RelayInfo:
    """A relay as the root sees it (`RelayRoot.relays`, ``zmqsync inspect``).

    `state`: "pending" (connected, not in the current generation), "active", "lost"
    (silent for ~6 heartbeats) or "evicted". `version` is the last root version on its
    bus, `acked` the last one all its local workers acked (-1: none yet); `last_seen` is
    seconds since its last message; `workers` are its local workers.
    """

    relay_id: str
    host: str
    pid: int
    state: str
    rank: int
    generation: int
    version: int
    acked: int
    last_seen: float
    workers: tuple[WorkerEntry, ...]


@dataclass(frozen=True, slots=True)
class Join:
    """relay -> root: let me in (answered with ACCEPT or REFUSE)."""

    TYPE: ClassVar[str] = "relay_join"
    relay_id: str
    host: str
    pid: int
    have_bus: str
    have_version: int


@dataclass(frozen=True, slots=True)
class Accept:
    """root -> relay: you are a member; echo `session` in everything you send."""

    TYPE: ClassVar[str] = "relay_accept"
    tree: str
    session: str
    heartbeat: float


@dataclass(frozen=True, slots=True)
class Refuse:
    """root -> relay: you are not let in, and why."""

    TYPE: ClassVar[str] = "relay_refuse"
    tree: str
    reason: str


@dataclass(frozen=True, slots=True)
class Prepare:
    """root -> relay: generation `gen` is being formed; answer READY when free."""

    TYPE: ClassVar[str] = "relay_prepare"
    tree: str
    gen: int


@dataclass(frozen=True, slots=True)
class Commit:
    """root -> relay: build the process group of generation `gen` as `rank` of `world`."""

    TYPE: ClassVar[str] = "relay_commit"
    tree: str
    gen: int
    rank: int
    world: int
    backend: str
    timeout: float
    form_timeout: float
    root_bus: str
    slot_bytes: int
    chunk_bytes: int
    manifest: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class Send:
    """root -> relay: version `version` follows on the group (to `targets`; empty: all)."""

    TYPE: ClassVar[str] = "relay_send"
    tree: str
    gen: int
    version: int
    root_bus: str
    targets: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Beat:
    """root -> relay: I am alive (every heartbeat)."""

    TYPE: ClassVar[str] = "relay_beat"
    tree: str
    gen: int


@dataclass(frozen=True, slots=True)
class Evict:
    """root -> relay: your session ended (evicted, lost, root closing); join again."""

    TYPE: ClassVar[str] = "relay_evict"
    tree: str
    reason: str


@dataclass(frozen=True, slots=True)
class Status:
    """relay -> root: heartbeat with what its bus holds and its local workers."""

    TYPE: ClassVar[str] = "relay_status"
    session: str
    gen: int
    have_bus: str
    have_version: int
    acked: int
    workers: tuple[WorkerEntry, ...]


@dataclass(frozen=True, slots=True)
class Report:
    """relay -> root: a step done (ready, formed, received, acked) or failed."""

    TYPE: ClassVar[str] = "relay_report"
    session: str
    stage: str
    gen: int
    version: int
    have_bus: str
    have_version: int
    missing: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Bye:
    """relay -> root: I am leaving."""

    TYPE: ClassVar[str] = "relay_bye"
    session: str


@dataclass(frozen=True, slots=True)
class RelayState:
    """root -> inspector: the tree (answer to a bus INSPECT on ``<address>.relay``)."""

    TYPE: ClassVar[str] = "relay_state"
    tree: str
    name: str
    pid: int
    root_bus: str
    version: int
    generation: int
    ack: str
    relays: tuple[RelayInfo, ...]
    counters: dict[str, int]


RelayMessage: TypeAlias = (
    Join
    | Accept
    | Refuse
    | Prepare
    | Commit
    | Send
    | Beat
    | Evict
    | Status
    | Report
    | Bye
    | RelayState
)

_HEX16 = re.compile(r"^[0-9a-f]{16}\Z")
TREE = text(16, _HEX16, empty=False)
SESSION = text(16, _HEX16, empty=False)
BUS = text(16, _HEX16)
ROOT_BUS = text(16, _HEX16, empty=False)
RELAY_ID = text(128, re.compile(r"^[\x21-\x7e]+\Z"), empty=False)
VERSION = integer(-1)
GEN = integer(0)
REASON = text(512)
WORKERS = list_of(record(WorkerEntry), MAX_RELAY_WORKERS)

_TREE = (TREE, "id of the root's tree (16 hex digits, new each time a root starts)")
_SESSION = (SESSION, "the relay's session, from ACCEPT")
_HAVE_BUS = (BUS, "root bus id of the version its bus holds; empty: none yet")
_HAVE_VERSION = (VERSION, "root version its bus holds; -1: none yet")

RELAY: MessageSet[RelayMessage] = MessageSet("relay", RELAY_PROTO)
RELAY.define(
    RelayInfo,
    {
        "relay_id": (RELAY_ID, "the relay's id on the tree (default: its host name)"),
        "host": (text(255), "host name"),
        "pid": (integer(), "process id"),
        "state": (
            choice(*STATES),
            "pending (not in the current generation), active, lost, evicted",
        ),
        "rank": (integer(-1), "rank in the current generation; -1 unless active"),
        "generation": (integer(-1), "last generation it was in; -1: none"),
        "version": (VERSION, "last root version on its bus; -1: none"),
        "acked": (VERSION, "last root version all its local workers acked; -1: none"),
        "last_seen": (number(0, 1e12), "seconds since its last message"),
        "workers": (WORKERS, "its local workers"),
    },
)
RELAY.define(
    Join,
    {
        "relay_id": (RELAY_ID, "id on the tree; a JOIN with a known id replaces that relay"),
        "host": (text(255), "host name"),
        "pid": (integer(), "process id"),
        "have_bus": _HAVE_BUS,
        "have_version": _HAVE_VERSION,
    },
)
RELAY.define(
    Accept,
    {
        "tree": _TREE,
        "session": (SESSION, "the relay's session: echoed in everything it sends"),
        "heartbeat": (number(0.001, 3600), "heartbeat interval in seconds"),
    },
)
RELAY.define(Refuse, {"tree": _TREE, "reason": (REASON, "why, for humans")})
RELAY.define(Prepare, {"tree": _TREE, "gen": (GEN, "the generation being formed")})
RELAY.define(
    Commit,
    {
        "tree": _TREE,
        "gen": (GEN, "the generation (as in its PREPARE)"),
        "rank": (integer(1, MAX_RELAYS), "the relay's rank in the group (the root is 0)"),
        "world": (integer(2, MAX_RELAYS + 1), "the group's size"),
        "backend": (choice("gloo", "nccl"), "torch.distributed backend"),
        "timeout": (number(0.001, 86400), "timeout of each collective (s)"),
        "form_timeout": (number(0.001, 86400), "timeout of building the group (s)"),
        "root_bus": (ROOT_BUS, "bus id of the root bus"),
        "slot_bytes": (integer(1, 1 << 48), "bytes of one version"),
        "chunk_bytes": (integer(1, 1 << 40), "bytes per send/recv pair"),
        "manifest": (list_of(record(TensorSpec), MAX_TENSORS), "the root bus's tensors"),
    },
)
RELAY.define(
    Send,
    {
        "tree": _TREE,
        "gen": (GEN, "the generation whose group carries it"),
        "version": (integer(), "the root version"),
        "root_bus": (ROOT_BUS, "bus id of the root bus"),
        "targets": (
            list_of(integer(1, MAX_RELAYS), MAX_RELAYS),
            "ranks it is sent to; empty: every relay of the generation",
        ),
        "nbytes": (integer(1, 1 << 48), "bytes that follow (the slot)"),
    },
)
RELAY.define(Beat, {"tree": _TREE, "gen": (GEN, "current generation")})
RELAY.define(Evict, {"tree": _TREE, "reason": (REASON, "why the session ended")})
RELAY.define(
    Status,
    {
        "session": _SESSION,
        "gen": (integer(-1), "generation it is in; -1: none"),
        "have_bus": _HAVE_BUS,
        "have_version": _HAVE_VERSION,
        "acked": (VERSION, "last version all its local workers acked; -1: none"),
        "workers": (WORKERS, "its local workers"),
    },
)
RELAY.define(
    Report,
    {
        "session": _SESSION,
        "stage": (choice(*STAGES), "the step done, or failed"),
        "gen": (GEN, "the generation"),
        "version": (VERSION, "the version (received, acked, failed); else -1"),
        "have_bus": _HAVE_BUS,
        "have_version": _HAVE_VERSION,
        "missing": (list_of(RELAY_ID, MAX_RELAY_WORKERS), "acked: local workers that did not"),
        "reason": (REASON, "failed: why"),
    },
)
RELAY.define(Bye, {"session": _SESSION})
RELAY.define(
    RelayState,
    {
        "tree": _TREE,
        "name": (text(64), "bus name"),
        "pid": (integer(), "the root's process id"),
        "root_bus": (BUS, "bus id of the root bus; empty before its first version"),
        "version": (VERSION, "the root's version"),
        "generation": (integer(-1), "current generation"),
        "ack": (choice("tree", "relays"), "what the root's ack means"),
        "relays": (list_of(record(RelayInfo), MAX_RELAYS), "every relay"),
        "counters": (counters, "joins, generations, relayed, timeouts, rejected, ..."),
    },
)
