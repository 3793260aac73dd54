"""Relays: carry a bus's versions to the buses of other hosts over torch.distributed.

Shared memory ends at the host. A `RelayRoot` on the trainer's host and one `Relay` per
other host form a *tree*: the root reads each version of the root bus and sends its
flat slot bytes to every relay with torch.distributed (gloo for CPU tensors, NCCL through
a CUDA staging buffer); each relay lands the bytes in a free slot of its own host's bus
and publishes them there under the same version number::

    host A (root)                             host B, C, ... (one relay each)
    trainer: Publisher("policy")              Relay(name="policy")
        |  shared memory                        |  owns Publisher("policy") on this host
    RelayRoot: Subscriber "relay-root"          |  shared memory
        (alias, manual)  ==== torch.distributed ====>  local workers: Subscriber("policy")

Three planes, each with the tool made for it:

* **rendezvous**: a torch ``TCPStore`` hosted by the root at ``MASTER_ADDR:MASTER_PORT``
  (``init_method="env://"``, the default, or ``"tcp://host:port"``). It also tells relays
  where the two ZeroMQ sockets are.
* **control**: ZeroMQ, ROUTER at the root, DEALER at each relay, both owned by agent
  threads: join, generations, heartbeats, reports. Per version, a second pair carries
  the "version v is on its way" notice and the relay's reports straight between the
  threads that act on them (the root's relay thread, the relay's data and wait threads):
  each thread hand-off cost 0.1–0.3 ms on two busy cores, and a 4 MiB version had five.
  msgpack maps validated field by field below; nothing received is ever unpickled. The
  TCPStore and gloo themselves have no authentication: run relays on a trusted cluster
  network (a non-loopback address needs ``insecure=True``, stated explicitly).
* **data**: one torch.distributed process group per *generation*, built directly on a
  ``PrefixStore`` (never the global default group, which the trainer may use for its own
  training): a small header tensor, then the slot bytes in chunks, each a send/recv pair
  from the root to each relay, each wait with a timeout. A relay posts the receives of
  the next version ahead, into a free slot (a posted gloo receive has no deadline; only
  waiting for it has), so the bytes move the moment the root sends them, not once the
  notice crossed two processes.

Theory of operation (the invariants the code keeps):

1. **Collectives are never waited for on a thread that must stay responsive.**
   torch.distributed collectives do not time out gracefully on their own (gloo raises
   after the group's timeout and leaves the group unusable; NCCL, without its watchdog,
   waits forever; ``abort()`` on a gloo group hangs). So the root runs them on a
   per-generation executor thread and waits for them with a `Deadline`; a relay waits
   on its data thread. Every wait carries a timeout (``collective_timeout``, by default about
   the time it takes to declare a silent relay lost), which bounds how long a hung peer
   can hold the others. Liveness and reports travel on ZeroMQ, so a stuck collective
   never silences a heartbeat.
2. **A generation is a fixed member list with a fresh process group.** Any failure (a
   relay dead or silent for ~6 heartbeats, a collective error or timeout, an eviction,
   a join) ends the generation: the root drops its group (gloo then closes its sockets,
   so the survivors' pending receives fail at once instead of at their timeout), asks
   every connected relay to PREPARE, and COMMITs the next generation with those that
   answered READY in time. A relay that answers late, or restarts, joins the next one.
3. **The root acks a version on its bus only when the tree has it**: with
   ``ack="relays"`` once every relay of the generation announced it on its own bus; with
   ``ack="tree"`` once every relay's local workers acked it (each relay reports after
   its own publish's wait, under its own `timeout` and `on_timeout`). A relay that
   misses the root's deadline is evicted (``on_timeout="evict"``: the root acks without
   it and the relay re-joins) or kept (``"raise"``: the root records a PublishTimeout and
   acks once the relay has the version, so a trainer with a shorter deadline sees its
   ``publish()`` time out on the relay-root worker).
4. **Bytes are never torn.** The root sends from the slot its subscriber aliases, which
   the root publisher does not rewrite while it is held (the root bus needs slots >= 2).
   A relay receives straight into a slot of its bus that no local worker holds (the core
   publisher's rule, so the relay costs no extra copy; the slot's seqlock is marked
   "being written" before its receives are posted, so even a reader that is no longer a
   holder, an evicted worker finishing a copy, sees the bytes change under it; when
   local alias workers hold every slot it receives into a staging buffer instead, so
   that the transfer never waits for local workers). A header that precedes the data,
   checked before the slot is marked complete, proves the bytes belong to the announced
   version; a version whose transfer fails is never announced.

Local workers of a relay that dies keep their last version (the ordinary
dead-publisher behaviour) and re-join when the relay restarts on the host.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import math
import os
import queue
import re
import secrets
import signal
import socket
import sys
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from functools import partial
from types import FrameType
from typing import Any, ClassVar, TypeAlias

import msgpack
import torch
import torch.distributed as dist
import zmq

from . import _config, _lifecycle
from ._deadline import Deadline
from ._errors import ClosedError, ConnectTimeout, ProtocolError, PublishTimeout, ZmqSyncError
from ._layout import Key, Layout, torch_dtype
from ._protocol import (
    MAX_TENSORS,
    Check,
    Inspect,
    State,
    TensorSpec,
    WorkerState,
    _choice,
    _counters,
    _float,
    _int,
    _list,
    _record,
    _text,
    decode,
    encode,
    to_plain,
)
from ._publisher import Publish, Publisher
from ._security import is_loopback
from ._sockets import (
    NOBLOCK,
    bind,
    connect,
    post,
    protect_ipc,
    readable,
    request,
    sibling_endpoint,
)
from ._subscriber import Subscriber

__all__ = ["Relay", "RelayInfo", "RelayRoot", "Relayed", "inspect_relays"]

log = logging.getLogger(__name__)

RELAY_PROTO = 1  # version of the relay control channel (the bus protocol is separate)
HEADER_MAGIC = 0x59414C4552535A  # b"ZSRELAY" little-endian: first word of every header
DEFAULT_CHUNK_MB = 16.0
MAX_RELAY_WORKERS = 1000  # local workers reported per relay heartbeat
MAX_RELAYS = 4096
_OPS_IN_FLIGHT = 2  # chunk collectives posted ahead (gloo runs them on its own threads)
_ROOT_CLOSED = "relay root closed"
_LATE_FACTOR = 3  # on_timeout="raise": how many more deadlines to wait for late relays
# The relay thread waits for reports on the data channel in slices this long, then looks
# at what the agent thread changed (a relay lost, a failure reported on the control channel)
_REPORT_POLL_S = 0.005
_FINISH_POLL_S = 0.0005  # every relay has the version; gloo's send is finishing
_INBOX_POLL_S = 0.01  # a relay's data thread: agent messages wait at most this long


# --- the control channel: messages, encode, decode --------------------------------------

_HEX16 = re.compile(r"^[0-9a-f]{16}\Z")
_TREE = _text(16, _HEX16, empty=False)
_SESSION = _text(16, _HEX16, empty=False)
_BUS = _text(16, _HEX16)
_RELAY_ID = _text(128, re.compile(r"^[\x21-\x7e]+\Z"), empty=False)
_VERSION = _int(-1)
_GEN = _int(0)
_REASON = _text(512)


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
    workers: tuple[WorkerState, ...]


@dataclass(frozen=True, slots=True)
class _Join:
    """relay -> root: let me in (answered with ACCEPT or REFUSE)."""

    TYPE: ClassVar[str] = "relay_join"
    relay_id: str
    host: str
    pid: int
    have_bus: str
    have_version: int


@dataclass(frozen=True, slots=True)
class _Accept:
    """root -> relay: you are a member; echo `session` in everything you send."""

    TYPE: ClassVar[str] = "relay_accept"
    tree: str
    session: str
    heartbeat: float


@dataclass(frozen=True, slots=True)
class _Refuse:
    """root -> relay: you are not let in, and why."""

    TYPE: ClassVar[str] = "relay_refuse"
    tree: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Prepare:
    """root -> relay: generation `gen` is being formed; answer READY when free."""

    TYPE: ClassVar[str] = "relay_prepare"
    tree: str
    gen: int


@dataclass(frozen=True, slots=True)
class _Commit:
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
class _Send:
    """root -> relay: version `version` follows on the group (to `targets`; empty: all)."""

    TYPE: ClassVar[str] = "relay_send"
    tree: str
    gen: int
    version: int
    root_bus: str
    targets: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Beat:
    """root -> relay: I am alive (every heartbeat)."""

    TYPE: ClassVar[str] = "relay_beat"
    tree: str
    gen: int


@dataclass(frozen=True, slots=True)
class _Evict:
    """root -> relay: your session ended (evicted, lost, root closing); join again."""

    TYPE: ClassVar[str] = "relay_evict"
    tree: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Status:
    """relay -> root: heartbeat with what its bus holds and its local workers."""

    TYPE: ClassVar[str] = "relay_status"
    session: str
    gen: int
    have_bus: str
    have_version: int
    acked: int
    workers: tuple[WorkerState, ...]


@dataclass(frozen=True, slots=True)
class _Report:
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
class _Bye:
    """relay -> root: I am leaving."""

    TYPE: ClassVar[str] = "relay_bye"
    session: str


@dataclass(frozen=True, slots=True)
class _RelayState:
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


_Message: TypeAlias = (
    _Join
    | _Accept
    | _Refuse
    | _Prepare
    | _Commit
    | _Send
    | _Beat
    | _Evict
    | _Status
    | _Report
    | _Bye
    | _RelayState
)


_WORKERS = _list(_record(WorkerState), MAX_RELAY_WORKERS)
_FIELDS: dict[type[Any], dict[str, Check]] = {
    RelayInfo: {
        "relay_id": _RELAY_ID,
        "host": _text(255),
        "pid": _int(),
        "state": _choice("pending", "active", "lost", "evicted"),
        "rank": _int(-1),
        "generation": _int(-1),
        "version": _VERSION,
        "acked": _VERSION,
        "last_seen": _float(0, 1e12),
        "workers": _WORKERS,
    },
    _Join: {
        "relay_id": _RELAY_ID,
        "host": _text(255),
        "pid": _int(),
        "have_bus": _BUS,
        "have_version": _VERSION,
    },
    _Accept: {"tree": _TREE, "session": _SESSION, "heartbeat": _float(0.001, 3600)},
    _Refuse: {"tree": _TREE, "reason": _REASON},
    _Prepare: {"tree": _TREE, "gen": _GEN},
    _Commit: {
        "tree": _TREE,
        "gen": _GEN,
        "rank": _int(1, MAX_RELAYS),
        "world": _int(2, MAX_RELAYS + 1),
        "backend": _choice("gloo", "nccl"),
        "timeout": _float(0.001, 86400),
        "form_timeout": _float(0.001, 86400),
        "root_bus": _text(16, _HEX16, empty=False),
        "slot_bytes": _int(1, 1 << 48),
        "chunk_bytes": _int(1, 1 << 40),
        "manifest": _list(_record(TensorSpec), MAX_TENSORS),
    },
    _Send: {
        "tree": _TREE,
        "gen": _GEN,
        "version": _int(),
        "root_bus": _text(16, _HEX16, empty=False),
        "targets": _list(_int(1, MAX_RELAYS), MAX_RELAYS),
        "nbytes": _int(1, 1 << 48),
    },
    _Beat: {"tree": _TREE, "gen": _GEN},
    _Evict: {"tree": _TREE, "reason": _REASON},
    _Status: {
        "session": _SESSION,
        "gen": _int(-1),
        "have_bus": _BUS,
        "have_version": _VERSION,
        "acked": _VERSION,
        "workers": _WORKERS,
    },
    _Report: {
        "session": _SESSION,
        "stage": _choice("ready", "formed", "received", "acked", "failed"),
        "gen": _GEN,
        "version": _VERSION,
        "have_bus": _BUS,
        "have_version": _VERSION,
        "missing": _list(_RELAY_ID, MAX_RELAY_WORKERS),
        "reason": _REASON,
    },
    _Bye: {"session": _SESSION},
    _RelayState: {
        "tree": _TREE,
        "name": _text(64),
        "pid": _int(),
        "root_bus": _BUS,
        "version": _VERSION,
        "generation": _int(-1),
        "ack": _choice("tree", "relays"),
        "relays": _list(  # relay records go through this module's _build (defined below)
            _record(RelayInfo, lambda cls, raw, where: _build(cls, raw, where)), MAX_RELAYS
        ),
        "counters": _counters,
    },
}
_TYPES: dict[str, type[Any]] = {
    cls.TYPE: cls for cls in _FIELDS if isinstance(getattr(cls, "TYPE", None), str)
}


def _build(cls: type[Any], raw: dict[Any, Any], where: str, skip: tuple[str, ...] = ()) -> Any:
    table = _FIELDS[cls]
    extra = set(raw) - set(table) - set(skip)
    if extra:
        raise ProtocolError(f"{where}: unknown field(s) {sorted(map(str, extra))[:5]}")
    values = {}
    for name, check in table.items():
        if name not in raw:
            raise ProtocolError(f"{where}: missing field {name!r}")
        values[name] = check(raw[name], where, name)
    return cls(**values)


def _encode(msg: _Message) -> bytes:
    body = {f.name: to_plain(getattr(msg, f.name)) for f in fields(msg)}
    body["proto"] = RELAY_PROTO
    body["type"] = msg.TYPE
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def _decode(data: bytes) -> _Message:
    """Bytes from the relay channel to a message; never unpickles.

    Raises:
        ProtocolError: not a valid relay message (any other exception is a bug).
    """
    if len(data) > _config.MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes is too long")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, RecursionError, BufferError) as exc:
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}") from exc
    if type(raw) is not dict:
        raise ProtocolError(f"expected a msgpack map, got {type(raw).__name__}")
    if type(raw.get("proto")) is not int or raw["proto"] != RELAY_PROTO:
        raise ProtocolError(f"relay protocol {str(raw.get('proto'))[:20]!r}, expected 1")
    kind = raw.get("type")
    cls = _TYPES.get(kind) if type(kind) is str else None
    if cls is None or cls is RelayInfo:
        raise ProtocolError(f"unknown relay message type {str(kind)[:40]!r}")
    msg: _Message = _build(cls, raw, str(kind), skip=("proto", "type"))
    return msg


# --- shared helpers -----------------------------------------------------------------------


def _rendezvous(init_method: str | None) -> tuple[str, int]:
    """(host, port) of the root's TCPStore from ``env://`` or ``tcp://host:port``.

    Raises:
        ValueError: the URL or the environment variables are missing or malformed.
    """
    url = init_method or "env://"
    if url == "env://":
        host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        if not host or not port:
            raise ValueError(
                "init_method env:// needs MASTER_ADDR and MASTER_PORT (the root's address "
                "and a free port on it), or pass init_method='tcp://HOST:PORT'"
            )
    elif url.startswith("tcp://") and ":" in url[len("tcp://") :]:
        host, port = url[len("tcp://") :].rsplit(":", 1)
        host = host.strip("[]")
    else:
        raise ValueError(f"init_method {url!r}: use 'env://' or 'tcp://HOST:PORT'")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"rendezvous port {port!r} is not a TCP port number")
    return host, int(port)


def _require_trusted(host: str, insecure: bool) -> None:
    if not insecure and not is_loopback(f"tcp://{host}:0"):
        raise ValueError(
            f"rendezvous address {host} is reachable from other hosts, and torch.distributed "
            "(TCPStore, gloo, NCCL) has no authentication: run relays on a trusted cluster "
            "network and pass insecure=True (--insecure) to say so, or use 127.0.0.1"
        )


def _ip(host: str) -> str:
    """An address ZeroMQ can bind/connect (it does not resolve names on bind)."""
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"cannot resolve rendezvous host {host!r}: {exc}") from exc


def _control_key(name: str) -> str:
    return f"zmqsync/{name}/control"


def _data_key(name: str) -> str:
    return f"zmqsync/{name}/data"


def _data_identity(relay_id: str) -> bytes:
    """The routing id of a relay's data-thread DEALER on the root's data ROUTER."""
    return relay_id.encode()


def _template(manifest: Sequence[TensorSpec]) -> dict[Key, torch.Tensor]:
    """Zero-memory tensors with the manifest's keys, dtypes and shapes (stride-0 views)."""
    return {
        spec.key: torch.empty((), dtype=torch_dtype(spec.dtype)).expand(spec.shape)
        for spec in manifest
    }


def _on_cpu(manifest: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
    """The manifest of a CPU bus with the same bytes: every buffer uses the same offsets,
    and the root sends the CPU segment's slot (which holds a copy of GPU tensors while a
    CPU-transport worker, the relay root, is on the bus)."""
    return tuple(spec if spec.buffer == 0 else replace(spec, buffer=0) for spec in manifest)


def _layout_of(manifest: Sequence[TensorSpec]) -> Layout:
    """The layout a Publisher builds for these tensors; it must equal the root's."""
    layout = Layout.of(_template(manifest))
    if layout.specs != tuple(manifest):
        raise ZmqSyncError(
            "the root's manifest is not laid out the way this zmqsync lays it out (offsets "
            "differ); run the same zmqsync version on every host"
        )
    return layout


def _flat_slot(
    views: Mapping[Key, torch.Tensor], first: TensorSpec, slot_bytes: int
) -> torch.Tensor:
    """The whole slot, as flat uint8, that `views` (one version's tensors) live in."""
    view = views[first.key]
    storage = view.untyped_storage()
    start = view.storage_offset() * view.element_size() - first.offset
    if start < 0 or start + slot_bytes > storage.nbytes():
        raise ZmqSyncError("the tensors are not views into one shared slot")
    flat: torch.Tensor = torch.empty(0, dtype=torch.uint8).set_(storage, start, (slot_bytes,), (1,))
    return flat


def _gloo_device(host: str) -> Any:
    """Loopback rendezvous: keep gloo on loopback. Else torch's default (GLOO_SOCKET_IFNAME)."""
    if is_loopback(f"tcp://{host}:0") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def _new_process_group(
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    *,
    backend: str,
    host: str,
    form_timeout: float,
    op_timeout: float,
) -> Any:
    """A process group of its own (not the global default group) for one generation."""
    prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    pg: Any
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = datetime.timedelta(seconds=form_timeout)
        opts._devices = [_gloo_device(host)]
        pg = dist.ProcessGroupGloo(prefixed, rank, world, opts)
    else:
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = datetime.timedelta(seconds=form_timeout)
        pg = dist.ProcessGroupNCCL(prefixed, rank, world, nccl_opts)
    pg.set_timeout(datetime.timedelta(seconds=op_timeout))
    return pg


def _check_backend(backend: str, device: str | None) -> torch.device | None:
    if backend == "gloo":
        return None
    if backend != "nccl":
        raise ValueError(f'backend must be "gloo" or "nccl", not {backend!r}')
    if not dist.is_nccl_available() or not torch.cuda.is_available():
        raise ValueError(
            'backend="nccl" needs a CUDA build of torch with NCCL and a GPU on this host; '
            'use backend="gloo"'
        )
    return torch.device(device or f"cuda:{torch.cuda.current_device()}")


class _Wire:
    """The transfer of one version: a header, then the slot bytes in chunks, each a
    send/recv pair from rank 0 to every target rank (tags 0, 1, ...).

    Point to point, not broadcast: a relay posts the receives of the next version into
    a free slot *before* the root announces it (a posted gloo receive has no timeout;
    only waiting for it has), so the bytes flow the moment the root sends them instead of
    after a notice crossed two processes; a broadcast cannot be posted ahead like that.
    gloo moves the slot bytes directly; NCCL moves them through a CUDA staging buffer of
    one chunk (the buses are CPU buffers) and cannot post ahead. Every wait has a timeout.
    """

    def __init__(
        self,
        pg: Any,
        backend: str,
        chunk_bytes: int,
        op_timeout: float,
        device: torch.device | None,
    ) -> None:
        self.pg, self.backend, self.chunk = pg, backend, chunk_bytes
        self.timeout = datetime.timedelta(seconds=op_timeout)
        self.device = device
        self._stage: torch.Tensor | None = None

    def header(self, gen: int, version: int, nbytes: int) -> torch.Tensor:
        return torch.tensor([HEADER_MAGIC, gen, version, nbytes], dtype=torch.int64)

    def post_send(
        self, flat: torch.Tensor, header: torch.Tensor, ranks: Sequence[int]
    ) -> Callable[[], None]:
        """Root side: post the first sends of `header`, then `flat`, to every rank in
        `ranks` now (posting never blocks); the returned call posts the rest chunk by
        chunk and waits (on the group's executor thread: waiting may block)."""
        tensors = [header, *self._chunks(flat)]
        if self.device is not None:
            return partial(self._run_staged, tensors, ranks, send=True)
        ops = [(t, rank, tag) for tag, t in enumerate(tensors) for rank in ranks]
        return _Ops(self, ops, send=True, window=_OPS_IN_FLIGHT * len(ranks)).finish

    def post_receive(self, into: torch.Tensor, slot: int | None = None) -> _Posted:
        """Relay side: post the receives of a header and of `into` (local bus slot `slot`,
        or a staging buffer), all at once with gloo; NCCL receives them in `finish`."""
        got = torch.zeros(4, dtype=torch.int64)
        tensors = [got, *self._chunks(into)]
        if self.device is not None:
            wait: Callable[[], None] = partial(self._run_staged, tensors, (0,), send=False)
        else:
            ops = [(t, 0, tag) for tag, t in enumerate(tensors)]
            wait = _Ops(self, ops, send=False, window=len(ops)).finish
        return _Posted(self, into, slot, got, wait)

    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[off : off + self.chunk] for off in range(0, flat.numel(), self.chunk)]

    def _run_staged(self, tensors: list[torch.Tensor], ranks: Sequence[int], *, send: bool) -> None:
        for tag, tensor in enumerate(tensors):
            stage = self._staging(tensor)
            if send:
                stage.copy_(tensor)
            for rank in ranks:
                self._op(stage, rank, tag, send=send).wait(self.timeout)
            if not send:
                tensor.copy_(stage)

    def _staging(self, like: torch.Tensor) -> torch.Tensor:
        """A CUDA buffer of one chunk, as bytes (the header fits in it too)."""
        if self._stage is None:
            self._stage = torch.empty(self.chunk, dtype=torch.uint8, device=self.device)
        return self._stage.view(torch.uint8)[: like.numel() * like.element_size()].view(like.dtype)

    def _op(self, tensor: torch.Tensor, peer: int, tag: int, *, send: bool) -> Any:
        if send:
            return self.pg.send([tensor], peer, tag)
        return self.pg.recv([tensor], peer, tag)


class _Ops:
    """Operations (tensor, peer, tag) in order, at most `window` outstanding; the first
    `window` are posted at once. Each wait carries the wire's timeout."""

    def __init__(
        self, wire: _Wire, ops: list[tuple[torch.Tensor, int, int]], *, send: bool, window: int
    ) -> None:
        self.wire, self.ops, self.send, self.window = wire, ops, send, max(1, window)
        self.pending: list[Any] = []
        self.posted = 0
        self._post()

    def _post(self) -> None:
        while self.posted < len(self.ops) and len(self.pending) < self.window:
            tensor, peer, tag = self.ops[self.posted]
            self.pending.append(self.wire._op(tensor, peer, tag, send=self.send))
            self.posted += 1

    def finish(self) -> None:
        while self.pending:
            self.pending.pop(0).wait(self.wire.timeout)
            self._post()


@dataclass
class _Posted:
    """A relay's receives of one version, posted (gloo) or to run (NCCL) into `into`."""

    wire: _Wire
    into: torch.Tensor
    slot: int | None  # the local bus slot `into` is, if it is one
    got: torch.Tensor  # the header lands here
    wait: Callable[[], None]

    def finish(self, gen: int, version: int, nbytes: int) -> None:
        """Wait for the bytes, then check that the header names this version.

        Raises:
            _WireError: the header names another generation, version or size, or the
                transfer failed or timed out.
        """
        try:
            self.wait()
        except RuntimeError as exc:  # torch.distributed: error or timeout
            raise _WireError(str(exc)) from None
        expect = self.wire.header(gen, version, nbytes)
        if not torch.equal(self.got, expect):
            raise _WireError(
                f"header {self.got.tolist()} does not match the announced {expect.tolist()}"
            )


class _Group:
    """One generation on the root: its process group and the thread that runs its collectives.

    The executor thread is the only one that blocks inside torch.distributed; others wait
    on the `Future` with a deadline. `close()` never blocks: the thread drops the process
    group as soon as its current operation returns (gloo then closes its sockets).
    """

    def __init__(self, gen: int, bus: str, members: dict[str, tuple[str, int]], name: str) -> None:
        self.gen, self.bus, self.members = gen, bus, members  # relay_id -> (session, rank)
        self.pg: Any = None
        self.wire: _Wire | None = None
        self.broken = False
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(
            target=self._run, name=f"zmqsync-relay-{name}-g{gen}", daemon=True
        )
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        self.broken = True
        self._jobs.put(None)
        pg = self.pg
        if pg is not None and pg.name() == "nccl":
            with contextlib.suppress(Exception):  # unblocks a stuck NCCL collective
                pg.abort()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # reported to the waiting thread, without
                    future.set_exception(exc.with_traceback(None))  # frames that hold the pg
            del job, fn, future
        self.pg = self.wire = None
        _release()  # no cycle keeps the group alive: gloo closes its sockets now


def _release() -> None:
    """Collect now: a dropped process group must close its sockets at once (peers blocked
    in a receive then fail immediately instead of at their timeout)."""
    gc.collect()


def _local_workers(pub: Publisher | None) -> tuple[WorkerState, ...]:
    if pub is None:
        return ()
    now = time.time()
    return tuple(
        WorkerState(
            w.worker_id,
            w.pid,
            w.host[:255],
            w.mode,
            w.transport,
            w.version,
            max(0.0, now - w.last_seen),
        )
        for w in list(pub.workers.values())[:MAX_RELAY_WORKERS]
    )


# --- the root ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Relayed:
    """One version carried to the relays: who has it, who is missing, how long it took."""

    version: int
    generation: int
    relays: tuple[str, ...]
    missing: tuple[str, ...]
    seconds: float
    nbytes: int


@dataclass
class _Member:
    relay_id: str
    identity: bytes
    session: str
    host: str
    pid: int
    order: int
    last_seen: float  # monotonic
    state: str = "pending"
    wants: bool = True  # wants into the next generation (joined, or answered READY late)
    rank: int = -1
    generation: int = -1
    ready_gen: int = -1
    have_bus: str = ""
    have_version: int = -1
    acked_bus: str = ""
    acked_version: int = -1
    failed: tuple[int, int] = (-1, -1)  # (gen, version) of its last failure report
    retry_at: float = 0.0
    missing: tuple[str, ...] = ()
    workers: tuple[WorkerState, ...] = ()

    def has(self, bus: str, version: int) -> bool:
        return self.have_bus == bus and self.have_version >= version

    def acked(self, bus: str, version: int) -> bool:
        return self.acked_bus == bus and self.acked_version >= version


class RelayRoot:
    """Carries every version of a bus on this host to the relays of other hosts.

    It joins the bus as an ordinary alias-mode subscriber (worker id `worker_id`), so the
    trainer's ``Publisher.publish()`` waits for its ack like any worker's; it acks a
    version once the tree has it (see `ack`). Run it in the trainer's process or as its
    own process (``zmqsync relay --root``; recommended with NCCL, whose failures can end
    a process).

    Args:
        address: the bus's control address; None: the default address for `name`.
        name: bus name; relays use the same name for their own buses.
        init_method: rendezvous: ``"env://"`` (MASTER_ADDR/MASTER_PORT; the default) or
            ``"tcp://HOST:PORT"``; this process hosts the TCPStore there (port 0: any
            free port, see `init_method_url`).
        backend: "gloo" (CPU) or "nccl" (through a CUDA staging buffer on `device`).
        ack: "tree" (ack once every relay's local workers acked) or "relays" (once every
            relay announced the version on its bus).
        timeout: one deadline (s) per version for the whole tree.
        collective_timeout: the timeout (s) of every collective (each chunk) and of
            building a group; None: about the time to declare a silent relay lost
            (6 heartbeats, at least 1 s, at most `timeout`). A hung relay blocks the
            collective it is part of, and nothing can cancel a collective, so this bounds
            how long the others wait before the group is re-formed without it.
        on_timeout: at the deadline, "evict" drops the late relays and acks (they re-join
            by themselves); "raise" records a `PublishTimeout` in `last_error`, keeps them
            and acks only once they have the version, so a trainer whose own `timeout` is
            shorter gets PublishTimeout naming `worker_id` (a silent relay is dropped
            either way, after ~6 heartbeats, as the bus drops a silent worker).
        heartbeat: heartbeat interval (s); a relay silent for ~6 beats is lost.
        chunk_mb: MiB per collective when the slot is sent.
        worker_id: this subscriber's worker id on the bus.
        device: CUDA device of the NCCL staging buffer.
        insecure: allow a non-loopback rendezvous address (torch.distributed has no
            authentication; say that the network is trusted).
        on_relayed: callable(Relayed) run after each version (on the relay thread).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        name: str = "weights",
        init_method: str | None = None,
        backend: str = "gloo",
        ack: str = "tree",
        timeout: float = 10.0,
        on_timeout: str = "evict",
        heartbeat: float = 0.5,
        chunk_mb: float = DEFAULT_CHUNK_MB,
        collective_timeout: float | None = None,
        worker_id: str = "relay-root",
        device: str | None = None,
        insecure: bool = False,
        on_relayed: Callable[[Relayed], None] | None = None,
    ) -> None:
        self.name = _config.check_name(name)
        if ack not in ("tree", "relays"):
            raise ValueError(f'ack must be "tree" or "relays", not {ack!r}')
        if on_timeout not in ("raise", "evict"):
            raise ValueError(f'on_timeout must be "raise" or "evict", not {on_timeout!r}')
        if not 0.001 <= heartbeat <= 3600:
            raise ValueError(f"heartbeat must be in [0.001, 3600] seconds, not {heartbeat}")
        if not timeout > 0 or math.isinf(timeout):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
        if not chunk_mb > 0:
            raise ValueError(f"chunk_mb must be positive, not {chunk_mb}")
        self._host, self._port = _rendezvous(init_method)
        _require_trusted(self._host, insecure)
        self._device = _check_backend(backend, device)
        self._address_arg = address
        self.address = ""
        self._backend, self._ack, self._on_timeout = backend, ack, on_timeout
        self._timeout, self._heartbeat = float(timeout), float(heartbeat)
        lost_after = self._heartbeat * _config.LOST_AFTER_BEATS
        op = max(1.0, lost_after) if collective_timeout is None else float(collective_timeout)
        if not op > 0:
            raise ValueError(f"collective_timeout must be positive, not {collective_timeout}")
        self._op_timeout = min(self._timeout, op)
        # how long to wait for READYs: a healthy relay may still sit in a dead group's op
        self._form_wait = self._op_timeout + 2 * self._heartbeat
        self._form_timeout = min(self._timeout, max(2.0, self._form_wait))
        self._chunk_bytes = max(4096, int(chunk_mb * 2**20) // 4096 * 4096)
        self._worker_id = worker_id
        self._on_relayed = on_relayed
        self.tree = secrets.token_hex(8)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._members: dict[str, _Member] = {}
        self._sessions: dict[str, str] = {}  # session -> relay_id
        self._order = 0
        self._gen = 0
        self._group: _Group | None = None
        self._counters: Counter[str] = Counter()
        self._state = "new"
        self._stopping = threading.Event()
        self._resources = contextlib.ExitStack()
        self._store: Any = None
        self._agent: _RootAgent | None = None
        self._data_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._data: zmq.Socket[bytes] | None = None  # the relay thread's alone
        self._data_endpoint = ""
        self._feed: Subscriber | None = None
        self._thread: threading.Thread | None = None
        self._manifest: tuple[TensorSpec, ...] = ()
        self._manifest_bus = ""
        self._slot_bytes = 0
        self._version = -1
        self._bus = ""
        self.last: Relayed | None = None
        self.last_error: BaseException | None = None
        self._pid = os.getpid()

    # --- lifecycle -----------------------------------------------------------------

    @property
    def init_method_url(self) -> str:
        """``tcp://HOST:PORT`` of the TCPStore, with the real port once started."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"tcp://{host}:{self._port}"

    def start(self) -> RelayRoot:
        """Host the rendezvous, open the control socket, join the bus. Returns self.

        Raises:
            ConnectTimeout: no publisher answered at the bus address within `timeout`.
            ZmqSyncError: the bus has one slot (a relay needs two), another relay root
                serves it, or the rendezvous port is taken.
            ClosedError: closed already (create a new one).
        """
        if self._state == "closed":
            raise ClosedError(f"RelayRoot {self.name!r} is closed; create a new one")
        if self._state == "started":
            return self
        with contextlib.ExitStack() as stack:
            self.address = self._address_arg or _config.default_address(self.name)
            self._adopt_bus(self._inspect_bus(refuse_duplicate=True))
            try:
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    self._host,
                    self._port,
                    None,
                    True,
                    datetime.timedelta(seconds=self._timeout),
                    wait_for_workers=False,
                )
            except (RuntimeError, OSError) as exc:
                raise ZmqSyncError(
                    f"cannot host the rendezvous at {self._host}:{self._port} ({exc}); is the "
                    "port taken (another root)? choose another MASTER_PORT"
                ) from exc
            stack.callback(self._drop_store)
            self._port = int(self._store.port)
            self._agent = _RootAgent(self)
            self._agent.start()
            stack.callback(self._agent.stop)  # tells the relays goodbye...
            stack.callback(self._drop_store)  # ...once the store no longer answers them
            self._store.set(_control_key(self.name), self._agent.endpoint)
            self._open_data_channel()
            stack.callback(self._close_data_channel)  # after the relay thread stopped
            self._store.set(_data_key(self.name), self._data_endpoint)
            feed = Subscriber(
                self.address,
                name=self.name,
                mode="alias",
                apply="manual",
                worker_id=self._worker_id,
                device="cpu",  # read the CPU segment (the publisher mirrors GPU weights there)
                timeout=self._timeout,
                on_update=self._on_version,
            )
            self._feed = feed.start()
            stack.callback(feed.close)
            self._thread = threading.Thread(
                target=self._run, name=f"zmqsync-relayroot-{self.name}", daemon=True
            )
            self._thread.start()
            stack.callback(self._stop_thread)
            self._resources = stack.pop_all()
        self._state = "started"
        self._pid = os.getpid()
        _lifecycle.track(self)
        log.info(
            "relay root %s for bus %r at %s (rendezvous %s:%d, %s, ack=%s)",
            self.tree,
            self.name,
            self.address,
            self._host,
            self._port,
            self._backend,
            self._ack,
        )
        return self

    def close(self) -> None:
        """Tell the relays, leave the bus, drop the group and the rendezvous. Idempotent."""
        if self._state != "started":
            self._state = "closed"
            return
        self._state = "closed"
        if os.getpid() != self._pid:
            return
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        self._resources.close()
        log.info("relay root %s closed at version %d", self.tree, self._version)

    def __enter__(self) -> RelayRoot:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_state", "closed") == "started":
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        active = sum(m.state == "active" for m in self._members.values())
        return (
            f"<RelayRoot {self.name!r} v{self._version} gen {self._gen} {active} relays "
            f"ack={self._ack} {self._state}>"
        )

    def _drop_store(self) -> None:
        self._store = None

    def _open_data_channel(self) -> None:
        """The ROUTER of the per-version messages (notices out, reports in).

        Owned by the relay thread, so a notice leaves and a report is read without a
        hand-off to the agent thread (each hand-off cost 0.1-0.3 ms on two busy cores).
        Relays' data DEALERs name themselves by relay id; a restarted relay takes its
        route over (ROUTER_HANDOVER); a notice to a relay not connected (yet) raises
        (ROUTER_MANDATORY) and goes through the control channel instead.
        """
        self._data_ctx = zmq.Context()
        self._data = bind(self._data_ctx, zmq.ROUTER, f"tcp://{_ip(self._host)}:*")
        self._data.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._data.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._data_endpoint = self._data.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_data_channel(self) -> None:
        data, self._data = self._data, None
        if data is not None:
            data.close()
        if self._data_ctx is not None:
            self._data_ctx.destroy(linger=0)
            self._data_ctx = None

    def _stop_thread(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self._timeout + _config.THREAD_JOIN_S)
        with self._cond:
            group, self._group = self._group, None
        if group is not None:
            group.close()
            group.join(_config.THREAD_JOIN_S)

    # --- what the user sees --------------------------------------------------------

    @property
    def version(self) -> int:
        """The version of the bus this root holds now (-1 before start)."""
        return self._feed.version if self._feed is not None else -1

    @property
    def generation(self) -> int:
        return self._gen

    @property
    def relays(self) -> dict[str, RelayInfo]:
        """Snapshot of the relays, by relay id."""
        with self._lock:
            return {m.relay_id: self._info(m, time.monotonic()) for m in self._members.values()}

    @property
    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def wait_for_relays(self, n: int, timeout: float | None = None) -> bool:
        """Block until `n` relays are active and hold the current version; False on timeout.

        Args:
            timeout: seconds; None: the root's `timeout`.
        """
        deadline = Deadline(self._timeout if timeout is None else timeout)
        with self._cond:
            while True:
                ready = [
                    m
                    for m in self._members.values()
                    if m.state == "active" and m.has(self._bus, self._version)
                ]
                if len(ready) >= n:
                    return True
                if deadline.expired() or self._stopping.is_set():
                    return False
                self._cond.wait(deadline.wait_s(0.2))

    def _info(self, m: _Member, now: float) -> RelayInfo:
        return RelayInfo(
            m.relay_id,
            m.host,
            m.pid,
            m.state,
            m.rank if m.state == "active" else -1,
            m.generation,
            m.have_version if m.have_bus == self._bus else -1,
            m.acked_version if m.acked_bus == self._bus else -1,
            max(0.0, now - m.last_seen),
            m.workers,
        )

    def _relay_state(self) -> _RelayState:
        now = time.monotonic()
        with self._lock:
            infos = tuple(self._info(m, now) for m in self._members.values())
            return _RelayState(
                self.tree,
                self.name,
                os.getpid(),
                self._bus,
                max(self._version, -1),
                self._gen,
                self._ack,
                infos,
                dict(self._counters),
            )

    # --- the bus side --------------------------------------------------------------

    def _inspect_bus(self, refuse_duplicate: bool = False) -> State:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            reply = request(ctx, self.address, Inspect(""), deadline=Deadline(self._timeout))
        finally:
            ctx.destroy(linger=0)
        if not isinstance(reply, State):
            raise ProtocolError(f"expected STATE from {self.address}, got {reply.TYPE}")
        if reply.slots < 2:
            raise ZmqSyncError(
                f"bus {reply.name!r} has 1 slot: a relay root sends from the slot it holds "
                "while the trainer writes the next version, which needs slots >= 2"
            )
        if refuse_duplicate and any(w.worker_id == self._worker_id for w in reply.workers):
            raise ZmqSyncError(
                f"worker {self._worker_id!r} is already on bus {reply.name!r}: another relay "
                "root serves it; close it, or pass another worker_id"
            )
        return reply

    def _adopt_bus(self, state: State) -> None:
        manifest = _on_cpu(state.manifest)
        layout = _layout_of(manifest)
        buf = state.buffers[0]
        if (buf.size - buf.header_bytes) // state.slots != layout.slot_bytes:
            raise ZmqSyncError("the bus's segment size does not match its manifest")
        self._manifest, self._slot_bytes, self._manifest_bus = (
            manifest,
            layout.slot_bytes,
            state.bus,
        )

    def _on_version(self, version: int) -> None:
        """The feed applied `version` (aliased). On our thread: carry it, then return (ack)."""
        if threading.current_thread() is not self._thread:
            return  # the first apply, in start(): nobody to send to yet
        self._distribute()

    def _feed_view(self) -> tuple[str, int, torch.Tensor]:
        """(bus, version, flat slot) of what the feed aliases now.

        Reads the Subscriber's state on the thread that applies versions (manual mode),
        where it cannot change underneath; the slot cannot be rewritten while it is held.
        """
        feed = self._feed
        assert feed is not None and feed._target is not None
        bus, version = feed._version_bus, feed._version
        if bus != self._manifest_bus:  # the trainer restarted: new buffers, maybe a new model
            state = self._inspect_bus()
            if state.bus != bus:
                raise ZmqSyncError("the bus changed while reading its manifest; retrying")
            self._adopt_bus(state)
            with self._cond:
                if self._group is not None:
                    self._group.broken = True
        flat = _flat_slot(feed._target.tensors, self._manifest[0], self._slot_bytes)
        with self._cond:
            self._bus, self._version = bus, version
        return bus, version, flat

    # --- the relay thread ----------------------------------------------------------

    def _run(self) -> None:
        feed = self._feed
        assert feed is not None
        while not self._stopping.is_set():
            try:
                if not feed.poll(self._heartbeat):
                    self._maintain()
            except ClosedError as exc:
                if not self._stopping.is_set():  # the feed was closed under us: nothing to do
                    self.last_error = exc
                    log.error("relay root: the bus subscriber closed: %s", exc)
                return
            except ZmqSyncError as exc:
                self.last_error = exc
                log.warning("relay root: %s", exc)
                self._stopping.wait(self._heartbeat)
            except Exception as exc:
                self.last_error = exc
                log.exception("relay root: unexpected failure")
                self._stopping.wait(self._heartbeat)

    def _maintain(self) -> None:
        """Idle: bring new or lagging relays up to the current version."""
        if self._feed is None or self._feed.version < 0:
            return
        now = time.monotonic()
        with self._cond:
            group = self._group
            if not self._members or (group is None and not self._wanting(now)):
                return
            if group is not None and not self._needs_reform(group, self._bus):
                lagging = [
                    m
                    for rid in group.members
                    if (m := self._members.get(rid)) is not None
                    and m.retry_at <= now
                    and not m.has(self._bus, self._version)
                ]
                if not lagging:
                    return
        self._distribute()

    def _wanting(self, now: float) -> bool:
        return any(
            m.wants and m.state == "pending" and m.retry_at <= now for m in self._members.values()
        )

    def _distribute(self) -> None:
        """Carry the version the feed holds to every relay, against one deadline.

        At the deadline, "evict" drops the late relays and returns (the feed acks);
        "raise" records a PublishTimeout and keeps waiting for them (bounded: each relay's
        own wait has its local timeout, a silent relay is lost after ~6 heartbeats, and
        after `_LATE_FACTOR` more deadlines the version is acked without them).
        """
        bus, version, flat = self._feed_view()
        deadline = Deadline(self._timeout)
        started = time.perf_counter()
        need = "acked" if self._ack == "tree" else "have"
        late: list[str] | None = None  # raise mode, past the deadline: who was late

        def expired(group: _Group | None) -> bool:
            """The deadline passed: True when the version is finished (return)."""
            nonlocal late, deadline
            if late is None:
                late = self._on_deadline(version, bus, need, group, started, flat.numel())
                if self._on_timeout == "evict":
                    return True
                deadline = Deadline(_LATE_FACTOR * self._timeout)
                return False
            log.warning(
                "version %d: relay(s) %s still late after %.1f s more; acked without them",
                version,
                ", ".join(late),
                _LATE_FACTOR * self._timeout,
            )
            self._finish(version, group.gen if group else 0, (), tuple(late), started, flat.numel())
            return True

        while True:
            if self._stopping.is_set():
                raise ClosedError("relay root closing")
            with self._cond:
                group = self._group
                reform = group is None or self._needs_reform(group, bus)
            if reform:
                group = self._form(bus, deadline)
                if group is None:
                    with self._cond:
                        candidates = self._candidates()
                    if not candidates:
                        self._finish(version, 0, (), (), started, flat.numel())
                        return
                    if deadline.expired() and expired(None):
                        return
                    continue
            assert group is not None
            with self._cond:
                lagging = [m for m in self._group_members(group) if not m.has(bus, version)]
            if lagging and not self._transfer(group, lagging, bus, version, flat, deadline):
                self._break(group)
                if deadline.expired() and expired(group):
                    return
                continue
            outcome = self._await(group, bus, version, need, deadline)
            if outcome == "done":
                with self._cond:
                    done = tuple(m.relay_id for m in self._group_members(group))
                self._finish(version, group.gen, done, (), started, flat.numel())
                return
            if outcome == "expired" and expired(group):
                return

    def _candidates(self) -> list[_Member]:
        """Relays that may be in the next generation: connected, not lost or evicted."""
        return [m for m in self._members.values() if m.state in ("pending", "active")]

    def _group_members(self, group: _Group) -> list[_Member]:
        """Members of `group` still on the tree in the same session (lost ones excluded)."""
        out = []
        for rid, (session, _rank) in group.members.items():
            m = self._members.get(rid)
            if m is not None and m.session == session and m.state == "active":
                out.append(m)
        return out

    def _needs_reform(self, group: _Group, bus: str) -> bool:
        if group.broken or group.bus != bus or group is not self._group:
            return True
        if len(self._group_members(group)) != len(group.members):
            return True
        return self._wanting(time.monotonic())

    def _break(self, group: _Group) -> None:
        with self._cond:
            group.broken = True
            if self._group is group:
                self._group = None
        group.close()

    def _form(self, bus: str, deadline: Deadline) -> _Group | None:
        """PREPARE every connected relay, COMMIT those READY in time, build the group."""
        with self._cond:
            old, self._group = self._group, None
        if old is not None:
            old.close()  # first: its sockets close, so the relays' pending receives end now
        with self._cond:
            candidates = self._candidates()
            if not candidates:
                return None
            self._gen += 1
            gen = self._gen
            targets = [(m.identity, m.session) for m in candidates]
        agent = self._agent
        assert agent is not None
        for identity, _session in targets:
            agent.send_to(identity, _Prepare(self.tree, gen))
        wait = Deadline(min(deadline.remaining() or 0.0, self._form_wait))
        with self._cond:
            while not all(
                m.ready_gen == gen or m.state not in ("pending", "active") for m in candidates
            ):
                if wait.expired() or self._stopping.is_set():
                    break
                self._cond.wait(wait.wait_s(self._heartbeat))
            ready = sorted(
                (m for m in candidates if m.ready_gen == gen and m.state in ("pending", "active")),
                key=lambda m: m.order,
            )
            late = [m for m in candidates if m not in ready]
            retry = time.monotonic() + self._form_wait
            for m in late:  # in again when it answers READY late, or reports itself idle
                m.wants, m.retry_at = False, retry
                if m.state == "active":
                    m.state = "pending"
            if late:
                log.info(
                    "generation %d: no READY from %s in time; forming without",
                    gen,
                    ", ".join(m.relay_id for m in late),
                )
            if not ready:
                return None
            world = len(ready) + 1
            members = {m.relay_id: (m.session, rank) for rank, m in enumerate(ready, 1)}
            commits = [(m.identity, members[m.relay_id][1]) for m in ready]
        manifest = self._manifest
        for identity, rank in commits:
            agent.send_to(
                identity,
                _Commit(
                    self.tree,
                    gen,
                    rank,
                    world,
                    self._backend,
                    self._op_timeout,
                    self._form_timeout,
                    bus,
                    self._slot_bytes,
                    self._chunk_bytes,
                    manifest,
                ),
            )
        group = _Group(gen, bus, members, self.name)
        future = group.submit(
            lambda: _new_process_group(
                self._store,
                f"zmqsync/{self.name}/{self.tree}/{gen}/",
                0,
                world,
                backend=self._backend,
                host=self._host,
                form_timeout=self._form_timeout,
                op_timeout=self._op_timeout,
            )
        )
        if not self._wait_future(future, deadline) or future.exception() is not None:
            reason = future.exception() if future.done() else "deadline"
            log.info("generation %d could not form: %s", gen, reason)
            group.close()
            with self._cond:
                self._counters["formation_failures"] += 1
            return None
        group.pg = future.result()
        group.wire = _Wire(
            group.pg, self._backend, self._chunk_bytes, self._op_timeout, self._device
        )
        with self._cond:
            for m in ready:
                if m.session == members[m.relay_id][0] and m.state in ("pending", "active"):
                    m.state, m.rank, m.generation, m.wants = (
                        "active",
                        members[m.relay_id][1],
                        gen,
                        False,
                    )
            self._group = group
            self._counters["generations"] += 1
            self._cond.notify_all()
        log.info("generation %d: %d relay(s): %s", gen, len(ready), ", ".join(members))
        return group

    def _wait_future(self, future: Future[Any], deadline: Deadline) -> bool:
        future.add_done_callback(lambda _f: self._notify())
        with self._cond:
            while not future.done():
                if deadline.expired() or self._stopping.is_set():
                    return False
                self._cond.wait(deadline.wait_s(self._heartbeat))
        return True

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _transfer(
        self,
        group: _Group,
        lagging: list[_Member],
        bus: str,
        version: int,
        flat: torch.Tensor,
        deadline: Deadline,
    ) -> bool:
        """Send the bytes and announce them; True once every target reported it has them.

        The sends go first, posted on this thread: a relay has usually posted its receives
        already (see `_Wire`), so the bytes flow while the notices travel.
        """
        everyone = len(lagging) == len(group.members)
        ranks = sorted(m.rank for m in lagging)
        wire = group.wire
        assert wire is not None
        header = wire.header(group.gen, version, flat.numel())
        try:  # posted here, waited for on the executor: no thread hand-off before the bytes
            finish = wire.post_send(flat, header, ranks)
        except RuntimeError as exc:  # the group's connections are gone
            log.info("generation %d: sending v%d failed: %s", group.gen, version, exc)
            with self._cond:
                self._counters["transfer_failures"] += 1
            return False
        future = group.submit(finish)
        notice = _Send(
            self.tree, group.gen, version, bus, () if everyone else tuple(ranks), flat.numel()
        )
        frame = _encode(notice)
        for m in lagging:
            self._send_notice(m, notice, frame)
        while True:
            with self._cond:
                if self._stopping.is_set():
                    raise ClosedError("relay root closing")
                if future.done() and future.exception() is not None:
                    log.info(
                        "generation %d: sending v%d failed: %s",
                        group.gen,
                        version,
                        future.exception(),
                    )
                    self._counters["transfer_failures"] += 1
                    return False
                alive = self._group_members(group)
                arrived = all(m.has(bus, version) for m in alive if m in lagging)
                if future.done() and arrived:
                    if len(alive) != len(group.members):
                        group.broken = True  # re-form without the lost ones next time
                    return True
                if len(alive) != len(group.members) or any(m.failed[0] == group.gen for m in alive):
                    return False
                if deadline.expired():
                    return False
            # once every relay has it, only gloo's send is left to finish: look again soon
            self._read_reports(deadline.poll_ms(_FINISH_POLL_S if arrived else _REPORT_POLL_S))

    def _send_notice(self, m: _Member, notice: _Send, frame: bytes) -> None:
        """On the data channel when the relay's data thread is connected to it; else on
        the control channel (through the agent), which every relay reads."""
        if self._data is not None:
            try:
                self._data.send_multipart([_data_identity(m.relay_id), frame], NOBLOCK)
            except zmq.ZMQError:  # EHOSTUNREACH: not connected (yet); EAGAIN: full
                pass
            else:
                with self._cond:
                    self._counters["data_notices"] += 1
                return
        agent = self._agent
        assert agent is not None
        agent.send_to(m.identity, notice)
        with self._cond:
            self._counters["control_notices"] += 1

    def _read_reports(self, timeout_ms: int) -> None:
        """Wait up to `timeout_ms` for reports on the data channel and apply them (relay thread).

        Reports also arrive on the control channel (the agent applies those and notifies
        the condition); the callers look at the member table again after each slice.
        """
        data = self._data
        if data is None:
            with self._cond:
                self._cond.wait(timeout_ms / 1000)
            return
        if not data.poll(timeout_ms):
            return
        now = time.monotonic()
        for _ in range(_config.ACK_DRAIN_MAX):  # bounded: a flood cannot hold this thread
            if not readable(data):
                break
            frames = data.recv_multipart(NOBLOCK)
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"{len(frames)} frames")
                msg = _decode(frames[1])
                if not isinstance(msg, _Report):
                    raise ProtocolError(f"{msg.TYPE} on the data channel")
            except ProtocolError as exc:
                with self._cond:
                    self._counters["rejected"] += 1
                log.debug("dropped relay data message: %s", exc)
                continue
            with self._cond:
                member = self._member_of(msg.session)
                if member is None:
                    self._counters["stale"] += 1
                    continue
                member.last_seen = now
                self._on_report(member, msg, now)

    def _await(self, group: _Group, bus: str, version: int, need: str, deadline: Deadline) -> str:
        """Wait until every member reached `need`: "done", "reform" or "expired"."""
        while True:
            with self._cond:
                if self._stopping.is_set():
                    raise ClosedError("relay root closing")
                alive = self._group_members(group)
                if all(
                    m.acked(bus, version) if need == "acked" else m.has(bus, version) for m in alive
                ):
                    if len(alive) != len(group.members):
                        group.broken = True  # re-form without the lost ones next time
                    return "done"
                if group.broken or group is not self._group:
                    return "reform"
                if deadline.expired():
                    return "expired"
            self._read_reports(deadline.poll_ms(_REPORT_POLL_S))

    def _on_deadline(
        self,
        version: int,
        bus: str,
        need: str,
        group: _Group | None,
        started: float,
        nbytes: int,
    ) -> list[str]:
        """trio's fail_after ("raise") versus move_on_after ("evict"): same deadline.

        Returns the relays that missed it. "evict" drops them and finishes the version;
        "raise" records a PublishTimeout in `last_error` and leaves them in the tree.
        """
        agent = self._agent
        assert agent is not None
        with self._cond:
            pool = (
                self._group_members(group)
                if group is not None and not group.broken
                else self._candidates()
            )
            done = [
                m
                for m in pool
                if (m.acked(bus, version) if need == "acked" else m.has(bus, version))
            ]
            missing = [m for m in pool if m not in done]
            self._counters["timeouts"] += 1
            if self._on_timeout == "evict":
                retry = time.monotonic() + self._heartbeat * _config.LOST_AFTER_BEATS
                for m in missing:
                    m.state, m.wants, m.retry_at = "evicted", False, retry
                    agent.send_to(m.identity, _Evict(self.tree, f"evicted at version {version}"))
                self._counters["evictions"] += len(missing)
                if missing and self._group is not None:
                    self._group.broken = True
        ids = [m.relay_id for m in missing]
        if self._on_timeout == "raise":
            verb = "have its workers ack" if need == "acked" else "receive"
            self.last_error = PublishTimeout(
                f"version {version}: {len(ids)} relay(s) did not {verb} it within "
                f"{self._timeout:.1f} s ({', '.join(ids[:8])}); the relay root acks the version "
                'to its bus only once they have it — pass on_timeout="evict" to drop late relays',
                version=version,
                acked=[m.relay_id for m in done],
                missing=ids,
            )
            log.warning("relay root: %s", self.last_error)
            return ids
        if ids:
            log.info("evicted %d relay(s) at version %d: %s", len(ids), version, ", ".join(ids))
        self._finish(
            version,
            group.gen if group else 0,
            tuple(m.relay_id for m in done),
            tuple(ids),
            started,
            nbytes,
        )
        return ids

    def _finish(
        self,
        version: int,
        gen: int,
        done: tuple[str, ...],
        missing: tuple[str, ...],
        started: float,
        nbytes: int,
    ) -> None:
        record = Relayed(version, gen, done, missing, time.perf_counter() - started, nbytes)
        self.last = record
        with self._cond:
            self._counters["relayed"] += 1
        if self._on_relayed is not None:
            self._on_relayed(record)

    # --- control messages (agent thread) --------------------------------------------

    def _on_message(self, identity: bytes, msg: _Message, now: float) -> _Message | None:
        """Update the member table; the answer to send back, if any (agent thread)."""
        if isinstance(msg, _Join):
            return self._join(identity, msg, now)
        session = getattr(msg, "session", "")
        member = self._member_of(session)
        if member is None:
            if isinstance(msg, _Bye):
                return None
            self._counters["stale"] += 1
            return _Evict(self.tree, "unknown or ended session: join again")
        member.last_seen, member.identity = now, identity
        if isinstance(msg, _Bye):
            self._members.pop(member.relay_id, None)
            self._sessions.pop(session, None)
            log.info("relay %s left", member.relay_id)
        elif isinstance(msg, _Status):
            if msg.gen < 0 and member.state == "pending" and member.retry_at <= now:
                member.wants = True  # idle and outside any group (a PREPARE may have been lost)
            self._have(member, msg.have_bus, msg.have_version)
            if msg.have_bus and msg.acked >= 0:
                self._acked(member, msg.have_bus, msg.acked)
            member.workers = msg.workers
        elif isinstance(msg, _Report):
            self._on_report(member, msg, now)
        self._cond.notify_all()
        return None

    def _member_of(self, session: str) -> _Member | None:
        """The member of a live session, or None (unknown, ended, lost or evicted)."""
        rid = self._sessions.get(session)
        member = self._members.get(rid) if rid is not None else None
        if member is None or member.session != session or member.state in ("lost", "evicted"):
            return None
        return member

    def _on_report(self, member: _Member, msg: _Report, now: float) -> None:
        self._have(member, msg.have_bus, msg.have_version)
        if msg.stage == "ready":  # its data thread is free: it wants in (again)
            member.ready_gen = max(member.ready_gen, msg.gen)
            if member.state == "pending":
                member.wants = True
        elif msg.stage == "acked":
            self._acked(member, msg.have_bus, msg.version)
            member.missing = msg.missing
        elif msg.stage == "failed":
            member.failed = (msg.gen, msg.version)
            member.retry_at = now + self._heartbeat
            log.info("relay %s: generation %d failed: %s", member.relay_id, msg.gen, msg.reason)

    def _have(self, m: _Member, bus: str, version: int) -> None:
        if bus and (bus != m.have_bus or version > m.have_version):
            m.have_bus, m.have_version = bus, version

    def _acked(self, m: _Member, bus: str, version: int) -> None:
        if bus and (bus != m.acked_bus or version > m.acked_version):
            m.acked_bus, m.acked_version = bus, version

    def _join(self, identity: bytes, msg: _Join, now: float) -> _Message:
        old = self._members.get(msg.relay_id)
        if old is None and len(self._members) >= MAX_RELAYS:
            return _Refuse(self.tree, f"tree full: {MAX_RELAYS} relays")
        if old is not None:
            self._sessions.pop(old.session, None)
        session = secrets.token_hex(8)
        self._order += 1
        member = _Member(msg.relay_id, identity, session, msg.host, msg.pid, self._order, now)
        self._have(member, msg.have_bus, msg.have_version)
        self._members[msg.relay_id] = member
        self._sessions[session] = msg.relay_id
        self._counters["joins"] += 1
        self._cond.notify_all()
        log.info(
            "relay %s joined (pid %d on %s)%s",
            msg.relay_id,
            msg.pid,
            msg.host,
            " replacing an older process" if old is not None else "",
        )
        return _Accept(self.tree, session, self._heartbeat)

    def _check_liveness(self, now: float) -> list[bytes]:
        """Mark relays silent for ~6 beats lost; identities to send a beat to."""
        limit = self._heartbeat * _config.LOST_AFTER_BEATS
        beats = []
        for m in self._members.values():
            if m.state in ("pending", "active"):
                if now - m.last_seen > limit:
                    m.state = "lost"
                    self._counters["lost"] += 1
                    log.info("relay %s silent for %.1f s: lost", m.relay_id, limit)
                    self._cond.notify_all()
                else:
                    beats.append(m.identity)
        return beats


class _RootAgent:
    """The thread that owns the root's sockets: ROUTER (relays) and REP (inspect)."""

    def __init__(self, root: RelayRoot) -> None:
        self.root: RelayRoot = weakref.proxy(root)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.endpoint = ""
        self._inspect_addr = ""
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._pipe_lock = threading.Lock()
        self._pipe_in = self.ctx.socket(zmq.PAIR)
        self._pipe_in.linger = 0
        self._pipe_addr = f"inproc://zmqsync-relayroot-{id(self)}"
        self._pipe_in.bind(self._pipe_addr)
        self._thread = threading.Thread(
            target=self._run, name=f"zmqsync-relayroot-ctl-{root.name}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(10.0) or self._failure is not None:
            failure = self._failure
            self.stop()
            raise failure or ZmqSyncError("relay root agent did not start within 10 s")

    def send_to(self, identity: bytes, msg: _Message) -> None:
        with self._pipe_lock:
            if not self._pipe_in.closed and not post(self._pipe_in, b"to", identity, _encode(msg)):
                log.debug("relay root agent gone: %s dropped", msg.TYPE)

    def stop(self) -> None:
        if self._thread.is_alive():
            with self._pipe_lock:
                if not self._pipe_in.closed:
                    post(self._pipe_in, b"stop")
            self._thread.join(_config.THREAD_JOIN_S)
            if self._thread.is_alive():
                log.warning("relay root agent thread did not stop within its deadline")
        with self._pipe_lock:
            self._pipe_in.close()
        self.ctx.destroy(linger=0)

    def _run(self) -> None:
        self.pipe = self.ctx.socket(zmq.PAIR)
        self.pipe.linger = 0
        self.pipe.connect(self._pipe_addr)
        self.inspect: zmq.Socket[bytes] | None = None
        try:
            self.router = bind(self.ctx, zmq.ROUTER, f"tcp://{_ip(self.root._host)}:*")
            self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._bind_inspect()
        except BaseException as exc:  # reported to start()
            self._failure = exc
            self.pipe.close()
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except BaseException:
            log.exception("relay root agent failed")
        finally:
            for sock in (self.pipe, self.router, self.inspect):
                if sock is not None:
                    sock.close()
            if self._inspect_addr:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._inspect_addr[len("ipc://") :])

    def _bind_inspect(self) -> None:
        """REP at ``<bus address>.relay`` (ipc:// buses), where ``zmqsync inspect`` looks."""
        address = self.root.address
        if not address.startswith("ipc://"):
            return
        endpoint = sibling_endpoint(address, "relay")
        if inspect_relays(address, 0.2) is not None:
            raise ZmqSyncError(f"another relay root already answers at {endpoint}")
        self.inspect = bind(self.ctx, zmq.REP, endpoint)
        protect_ipc(self.inspect, None)
        self._inspect_addr = endpoint

    def _loop(self) -> None:
        root = self.root
        poller = zmq.Poller()
        for sock in (self.pipe, self.router, self.inspect):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        next_beat = time.monotonic()
        while True:
            ready = dict(poller.poll(max(0, int((next_beat - time.monotonic()) * 1000)) + 1))
            if self.pipe in ready and not self._on_pipe():
                self._goodbye()
                return
            if self.router in ready:
                self._on_router()
            if self.inspect is not None and self.inspect in ready:
                self._on_inspect()
            now = time.monotonic()
            if now >= next_beat:
                with root._cond:
                    targets = root._check_liveness(now)
                    gen = root._gen
                beat = _encode(_Beat(root.tree, gen))
                for identity in targets:
                    self._send(identity, beat)
                next_beat = now + root._heartbeat

    def _send(self, identity: bytes, frame: bytes) -> None:
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            self.router.send_multipart([identity, frame], zmq.NOBLOCK)

    def _on_pipe(self) -> bool:
        while self.pipe.poll(0):
            frames = self.pipe.recv_multipart()
            if frames[0] == b"stop":
                return False
            if frames[0] == b"to":
                self._send(frames[1], frames[2])
        return True

    def _on_router(self) -> None:
        root = self.root
        for _ in range(_config.ACK_DRAIN_MAX):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                root._counters["rejected"] += 1
                continue
            try:
                msg = _decode(frames[1])
            except ProtocolError as exc:
                with root._cond:
                    root._counters["rejected"] += 1
                log.debug("dropped relay message: %s", exc)
                continue
            if not isinstance(msg, _Join | _Status | _Report | _Bye):
                with root._cond:
                    root._counters["rejected"] += 1
                continue
            with root._cond:
                answer = root._on_message(frames[0], msg, time.monotonic())
            if answer is not None:
                self._send(frames[0], _encode(answer))

    def _on_inspect(self) -> None:
        frame = self.inspect.recv() if self.inspect is not None else b""
        try:
            msg = decode(frame)
            if not isinstance(msg, Inspect):
                raise ProtocolError(f"{msg.TYPE} is not a request")
            reply = _encode(self.root._relay_state())
        except ProtocolError as exc:
            reply = _encode(_Refuse(self.root.tree, str(exc)[:512]))
        assert self.inspect is not None
        self.inspect.send(reply)

    def _goodbye(self) -> None:
        """Tell every relay the root is going (they re-join the next root by themselves)."""
        root = self.root
        with root._cond:
            targets = [
                m.identity for m in root._members.values() if m.state in ("pending", "active")
            ]
        bye = _encode(_Evict(root.tree, _ROOT_CLOSED))
        for identity in targets:
            self._send(identity, bye)


def inspect_relays(address: str, timeout: float = 1.0) -> dict[str, Any] | None:
    """The relay tree of the bus at `address`, as plain values; None when it has none.

    Only ipc:// buses are followed: the relay root answers at ``<address>.relay``.
    """
    if not address.startswith("ipc://"):
        return None
    endpoint = sibling_endpoint(address, "relay")
    if not os.path.exists(endpoint[len("ipc://") :]):
        return None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        req = connect(ctx, zmq.REQ, endpoint)
        try:
            req.send(encode(Inspect("")))
            if not req.poll(max(1, int(timeout * 1000))) & zmq.POLLIN:
                return None
            reply = _decode(req.recv())
        finally:
            req.close()
    finally:
        ctx.destroy(linger=0)
    if not isinstance(reply, _RelayState):
        return None
    plain: dict[str, Any] = to_plain(reply)
    return plain


def print_relays(tree: Mapping[str, Any]) -> None:
    """Rich tables for ``zmqsync inspect``: the relays, then each relay's workers."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]relay root[/bold] {tree['tree']} pid {tree['pid']}  version {tree['version']}  "
        f"generation {tree['generation']}  ack={tree['ack']}"
    )
    relays = Table(title=f"relays ({len(tree['relays'])})")
    for col in (
        "relay",
        "host",
        "pid",
        "state",
        "rank",
        "gen",
        "version",
        "acked",
        "workers",
        "last seen",
    ):
        relays.add_column(col)
    for r in tree["relays"]:
        relays.add_row(
            r["relay_id"],
            r["host"],
            str(r["pid"]),
            r["state"],
            str(r["rank"]),
            str(r["generation"]),
            str(r["version"]),
            str(r["acked"]),
            str(len(r["workers"])),
            f"{r['last_seen']:.2f} s ago",
        )
    console.print(relays)
    for r in tree["relays"]:
        if not r["workers"]:
            continue
        table = Table(title=f"workers of relay {r['relay_id']} ({len(r['workers'])})")
        for col in ("worker", "pid", "host", "mode", "version", "last seen"):
            table.add_column(col)
        for w in r["workers"]:
            table.add_row(
                w["worker_id"],
                str(w["pid"]),
                w["host"],
                w["mode"],
                str(w["version"]),
                f"{w['last_seen']:.2f} s ago",
            )
        console.print(table)


# --- a relay -------------------------------------------------------------------------------


class _WireError(ZmqSyncError):
    """A collective failed or timed out, or brought a header for another version."""


def _written(slot: torch.Tensor) -> None:
    """The `fill` of a version whose bytes were received into its slot already."""


def _copier(source: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def copy(slot: torch.Tensor) -> None:
        slot.copy_(source)

    return copy


class _LocalBus:
    """The relay's publisher on this host: a version's bytes land in a free slot straight
    from the network.

    A plain `Publisher` over the root's manifest; `publish_received` runs its whole
    publish (free-slot choice, seqlock, RECEIVE, acks) with the bytes written by
    `fill(slot bytes)` (the publisher's fill seam). If `fill` raises, the slot stays
    marked incomplete and the version is never announced.
    """

    def __init__(
        self, manifest: Sequence[TensorSpec], first: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        # Version 0 holds the first version's bytes (received into `first`): the
        # publisher's weights are views of them, and start() copies them into slot 0.
        self.publisher = Publisher(_views_of(manifest, first), *args, **kwargs)

    @property
    def address(self) -> str:
        return self.publisher.address

    @property
    def version(self) -> int:
        return self.publisher.version

    def start(self) -> _LocalBus:
        self.publisher.start()
        return self

    def close(self) -> None:
        self.publisher.close()

    def reserve_slot(self) -> int | None:
        """A slot the next `publish_received(slot=...)` may write, or None if all are held."""
        return self.publisher.reserve_slot()

    def open_slot(self, slot: int) -> torch.Tensor:
        """`slot` (from `reserve_slot`) as flat bytes, marked as being written first."""
        return self.publisher.open_slot(slot)

    def publish_received(
        self,
        version: int,
        fill: Callable[[torch.Tensor], None],
        timeout: float | None,
        slot: int | None = None,
    ) -> Publish:
        """Publish `version`, its bytes written by `fill(flat slot)`, into `slot` if given
        (from `reserve_slot`), else into the slot the publisher claims."""
        return self.publisher.publish(
            version=version, wait=False, timeout=timeout, fill=fill, slot=slot
        )


def _views_of(manifest: Sequence[TensorSpec], flat: torch.Tensor) -> dict[Key, torch.Tensor]:
    """The manifest's tensors as views of `flat`, bytes laid out as in a slot."""
    return {
        spec.key: flat[spec.offset : spec.offset + spec.nbytes]
        .view(torch_dtype(spec.dtype))
        .view(spec.shape)
        for spec in manifest
    }


class _DataLink:
    """One relay thread's DEALER to the root's data ROUTER (used by that thread only).

    The data thread's carries its relay id as routing id (the root sends it notices);
    the wait thread's is anonymous (it only sends "acked" reports).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], identity: bytes | None) -> None:
        self.ctx, self.identity = ctx, identity
        self.endpoint = ""
        self.sock: zmq.Socket[bytes] | None = None

    def ensure(self, endpoint: str) -> zmq.Socket[bytes] | None:
        """The socket connected to `endpoint` (reconnected when the root changed)."""
        if endpoint != self.endpoint:
            self.close()
            self.endpoint = endpoint
            if endpoint:
                self.sock = connect(self.ctx, zmq.DEALER, endpoint, routing_id=self.identity)
        return self.sock

    def send(self, frame: bytes) -> bool:
        if self.sock is None:
            return False
        try:
            self.sock.send(frame, NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.endpoint = ""


@dataclass
class _RelayGroup:
    gen: int
    rank: int
    world: int
    root_bus: str
    wire: _Wire
    pg: Any
    slot_bytes: int


class Relay:
    """Republishes a root's versions on this host's bus, under the same version numbers.

    One per host. It finds the root through the rendezvous (``env://``: MASTER_ADDR and
    MASTER_PORT; or ``tcp://HOST:PORT``), joins its tree, and owns the host's bus `name`
    (created when the first version arrives): local workers are ordinary
    ``Subscriber(name=...)`` processes. When the root is gone it keeps its bus (workers
    keep their last version) and re-joins the next root by itself.

    Args:
        address: this host's bus address; None: the default address for `name`.
        name: bus name (the root's bus name too).
        init_method: ``"env://"`` (default) or ``"tcp://HOST:PORT"`` of the root's store.
        relay_id: id on the tree (default: the host name); a relay that restarts with
            the same id replaces the old one.
        slots: slots of the local bus (>= 2).
        timeout: the local bus's publish deadline (keep it below the root's timeout in
            tree mode).
        on_timeout: the local bus's: "evict" (default) or "raise" (report its missing
            workers to the root either way).
        heartbeat: heartbeat interval (s) towards the root and on the local bus.
        shm_dir, tap: for the local bus (see `Publisher`).
        device: CUDA device for the NCCL staging buffer.
        insecure: allow a non-loopback rendezvous address (see `RelayRoot`).
        on_update: callable(version) run after each version is on the local bus.
        join_timeout: start() deadline for the first join (default: `timeout`); a relay
            started before its root waits this long.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        name: str = "weights",
        init_method: str | None = None,
        relay_id: str | None = None,
        slots: int = 2,
        timeout: float = 10.0,
        on_timeout: str = "evict",
        heartbeat: float = 0.5,
        shm_dir: str | None = None,
        tap: bool | None = None,
        device: str | None = None,
        insecure: bool = False,
        on_update: Callable[[int], None] | None = None,
        join_timeout: float | None = None,
    ) -> None:
        self.name = _config.check_name(name)
        self.relay_id = relay_id or socket.gethostname()
        _RELAY_ID(self.relay_id, "relay_id")
        if slots < 2:
            raise ValueError(
                f"a relay's bus needs slots >= 2 (it writes while workers read), not {slots}"
            )
        if on_timeout not in ("raise", "evict"):
            raise ValueError(f'on_timeout must be "raise" or "evict", not {on_timeout!r}')
        if not timeout > 0 or math.isinf(timeout):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
        self._host, self._port = _rendezvous(init_method)
        _require_trusted(self._host, insecure)
        self._device_arg = device
        self._address_arg = address
        self.address = ""
        self._slots, self._timeout, self._on_timeout = slots, float(timeout), on_timeout
        self._heartbeat, self._shm_dir, self._tap = float(heartbeat), shm_dir, tap
        self._on_update = on_update
        self._join_timeout = self._timeout if join_timeout is None else join_timeout
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._state = "new"
        self._stopping = threading.Event()
        self._local: _LocalBus | None = None
        self._manifest: tuple[TensorSpec, ...] = ()
        self._have: tuple[str, int] = ("", -1)
        self._acked: tuple[str, int] = ("", -1)
        self._group: _RelayGroup | None = None
        self._prepared = -1
        self._stage: torch.Tensor | None = None
        self._inbox: queue.SimpleQueue[tuple[_Message | str, Any]] = queue.SimpleQueue()
        self._waits: queue.SimpleQueue[tuple[Publish, str, int] | None] = queue.SimpleQueue()
        self._agent: _RelayAgent | None = None
        self._data_ctx: zmq.Context[zmq.Socket[bytes]] | None = None  # made by start()
        self._data_link: _DataLink | None = None  # the data thread's
        self._posted: _Posted | None = None  # the data thread's: receives posted ahead
        self._threads: list[threading.Thread] = []
        self.counters: Counter[str] = Counter()
        self._pid = os.getpid()

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> Relay:
        """Join the root's tree (the local bus opens with the first version). Returns self.

        Raises:
            ConnectTimeout: no root accepted this relay within `timeout`.
            ClosedError: closed already (create a new one).
        """
        if self._state == "closed":
            raise ClosedError(f"Relay {self.relay_id!r} is closed; create a new one")
        if self._state == "started":
            return self
        self.address = self._address_arg or _config.default_address(self.name)
        self._pid = os.getpid()
        self._data_ctx = zmq.Context()
        self._agent = _RelayAgent(self)
        self._threads = [
            threading.Thread(
                target=self._data_loop, name=f"zmqsync-relay-data-{self.name}", daemon=True
            ),
            threading.Thread(
                target=self._wait_loop, name=f"zmqsync-relay-wait-{self.name}", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()
        self._state = "started"
        try:
            self._agent.start(Deadline(self._join_timeout))
        except BaseException:
            self.close()
            raise
        _lifecycle.track(self)
        log.info("relay %s joined %s:%d", self.relay_id, self._host, self._port)
        return self

    def close(self) -> None:
        """Leave the tree, drop the group, close the local bus (STOP). Idempotent."""
        if self._state != "started":
            self._state = "closed"
            return
        self._state = "closed"
        if os.getpid() != self._pid:
            return
        self._stopping.set()
        if self._agent is not None:
            self._agent.stop()
        self._inbox.put(("stop", None))
        self._threads[0].join(self._timeout + _config.THREAD_JOIN_S)  # data: may be in a collective
        self._group, self._posted = None, None
        local, self._local = self._local, None
        if local is not None:
            local.close()  # STOP to the local workers; a pending wait ends with ClosedError
        self._waits.put(None)
        self._threads[1].join(_config.THREAD_JOIN_S)
        if any(thread.is_alive() for thread in self._threads):
            log.warning("relay %s: a thread did not stop within its deadline", self.relay_id)
        elif self._data_ctx is not None:  # their DEALERs are closed
            self._data_ctx.destroy(linger=0)
        with self._cond:
            self._cond.notify_all()
        log.info("relay %s closed at version %d", self.relay_id, self._have[1])

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_state", "closed") == "started":
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        link = "connected" if self.connected else "disconnected"
        gen = self._group.gen if self._group is not None else -1
        return (
            f"<Relay {self.relay_id!r} {self.name!r} v{self._have[1]} gen {gen} {link} "
            f"{self._state}>"
        )

    # --- what the user sees --------------------------------------------------------

    @property
    def version(self) -> int:
        """The last root version on this host's bus (-1 before the first)."""
        return self._have[1]

    @property
    def connected(self) -> bool:
        """True while the root accepts this relay and is heard from."""
        return self._agent is not None and self._agent.connected

    @property
    def generation(self) -> int:
        group = self._group
        return group.gen if group is not None else -1

    @property
    def publisher(self) -> Publisher | None:
        """The local bus (None until the first version arrived)."""
        return self._local.publisher if self._local is not None else None

    def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until the local bus holds `version` or newer; False on timeout."""
        deadline = Deadline(self._timeout if timeout is None else timeout)
        with self._cond:
            while self._have[1] < version:
                if deadline.expired() or self._stopping.is_set():
                    return False
                self._cond.wait(deadline.wait_s(0.2))
        return True

    # --- data thread ---------------------------------------------------------------

    def _report(
        self,
        stage: str,
        gen: int,
        version: int = -1,
        missing: Sequence[str] = (),
        reason: str = "",
        have: tuple[str, int] | None = None,
        link: _DataLink | None = None,
    ) -> None:
        """To the root: straight on `link` (the calling thread's data DEALER) when it is
        connected, else through the agent's control channel."""
        bus, have_version = have if have is not None else self._have
        agent = self._agent
        if agent is None:
            return
        fields_ = (stage, gen, version, bus, have_version, tuple(missing), reason[:512])
        session = agent.session
        if link is not None and session and link.send(_encode(_Report(session, *fields_))):
            return
        agent.report(*fields_)

    def _next_item(self, link: _DataLink) -> tuple[_Message | str, Any] | None:
        """The next thing for the data thread: from the agent (inbox), or a notice on the
        data channel; None after a slice with neither."""
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            pass
        agent = self._agent
        sock = link.ensure(agent.data_endpoint if agent is not None else "")
        if sock is None:
            try:
                return self._inbox.get(timeout=_INBOX_POLL_S)
            except queue.Empty:
                return None
        if not sock.poll(int(_INBOX_POLL_S * 1000)):
            return None
        frame = sock.recv(NOBLOCK)
        try:
            msg = _decode(frame)
        except ProtocolError as exc:
            self.counters["rejected"] += 1
            log.debug("dropped root data message: %s", exc)
            return None
        if not isinstance(msg, _Send):
            self.counters["rejected"] += 1
            return None
        if agent is None or not agent.session or msg.tree != agent.tree:
            self.counters["stale"] += 1
            return None
        return msg, None

    def _data_loop(self) -> None:
        assert self._data_ctx is not None
        link = _DataLink(self._data_ctx, _data_identity(self.relay_id))
        try:
            self._serve(link)
        finally:
            link.close()

    def _serve(self, link: _DataLink) -> None:
        self._data_link = link
        while not self._stopping.is_set():
            got = self._next_item(link)
            if got is None:
                self._prepost()  # once a local worker released a slot, if none was free
                continue
            item, store = got
            try:
                if item == "stop":
                    return
                if item == "lost":
                    self._drop_group("root lost")
                elif isinstance(item, _Prepare):  # the root abandoned our group already
                    self._prepared = item.gen
                    self._drop_group("the root forms a new generation")
                    self._report("ready", item.gen)
                elif isinstance(item, _Commit):
                    if item.gen == self._prepared:
                        self._join_group(item, store)
                elif isinstance(item, _Send):
                    self._receive(item)
            except Exception:
                log.exception("relay %s: data thread failure", self.relay_id)
                self._drop_group("failure")

    def _drop_group(self, why: str) -> None:
        self._posted = None  # its receives fail with the group's sockets, unwaited
        if self._group is not None:
            log.info("relay %s leaves generation %d (%s)", self.relay_id, self._group.gen, why)
            self._group = None
            _release()

    def _join_group(self, commit: _Commit, store: Any) -> None:
        self._drop_group("new generation")
        try:
            device = _check_backend(commit.backend, self._device_arg)
            layout = _layout_of(commit.manifest)
            if layout.slot_bytes != commit.slot_bytes:
                raise ZmqSyncError("the root's slot size differs from this host's layout")
            if self._local is not None and (
                commit.root_bus != self._have[0] or commit.manifest != self._manifest
            ):
                self._restart_local(f"the root bus is now {commit.root_bus}")
            self._manifest = commit.manifest
            pg = _new_process_group(
                store,
                f"zmqsync/{self.name}/{commit.tree}/{commit.gen}/",
                commit.rank,
                commit.world,
                backend=commit.backend,
                host=self._host,
                form_timeout=commit.form_timeout,
                op_timeout=commit.timeout,
            )
        except (ZmqSyncError, ValueError, RuntimeError) as exc:
            self._report("failed", commit.gen, reason=f"cannot join: {exc}")
            self.counters["formation_failures"] += 1
            return
        wire = _Wire(pg, commit.backend, commit.chunk_bytes, commit.timeout, device)
        self._group = _RelayGroup(
            commit.gen, commit.rank, commit.world, commit.root_bus, wire, pg, layout.slot_bytes
        )
        self.counters["generations"] += 1
        self._report("formed", commit.gen)
        log.info(
            "relay %s in generation %d as rank %d of %d",
            self.relay_id,
            commit.gen,
            commit.rank,
            commit.world,
        )

    def _restart_local(self, why: str) -> None:
        self._posted = None
        local, self._local = self._local, None
        if local is not None:
            log.info("relay %s restarts its bus: %s", self.relay_id, why)
            local.close()
        with self._cond:
            self._have = ("", -1)
            self._acked = ("", -1)

    def _receive(self, send: _Send) -> None:
        """Receive the version `send` announces, then publish it on this host.

        The bytes usually arrive in receives posted ahead into a free slot (`_prepost`);
        else they are received now, into a free slot or, when local workers hold every
        slot, into a staging buffer that is published (copied) once a slot frees up under
        the local timeout: the transfer never waits for local workers.
        """
        group = self._group
        if group is None or group.gen != send.gen:
            return  # a notice of a generation we left: the root notices the silence
        if send.targets and group.rank not in send.targets:
            return
        if send.root_bus != group.root_bus or send.nbytes != group.slot_bytes:
            self._report("failed", send.gen, send.version, reason="notice does not match the group")
            self._drop_group("bad notice")
            return
        local = self._local
        posted, self._posted = self._posted, None
        handle: Publish | None = None
        try:
            if posted is not None:
                self.counters["preposted"] += 1
            else:
                posted = self._post_into_free_slot(group) or group.wire.post_receive(
                    self._staging(send.nbytes)
                )
            posted.finish(send.gen, send.version, send.nbytes)
            if local is None:
                handle = self._open_local(send, posted.into)
            elif send.version <= local.version:
                pass  # it has this one already: drained
            elif posted.slot is not None:  # the bytes are in the slot already
                handle = local.publish_received(send.version, _written, self._timeout, posted.slot)
            else:
                handle = local.publish_received(send.version, _copier(posted.into), self._timeout)
        except _WireError as exc:
            self.counters["receive_failures"] += 1
            self._drop_group(f"receive failed: {exc}")
            self._report("failed", send.gen, send.version, reason=str(exc))
            return
        except RuntimeError as exc:  # posting failed: the group is gone
            self.counters["receive_failures"] += 1
            self._drop_group(f"receive failed: {exc}")
            self._report("failed", send.gen, send.version, reason=str(exc)[:512])
            return
        except (ZmqSyncError, ValueError) as exc:  # the local bus: full, closed, or too slow
            self.counters["local_failures"] += 1
            log.warning(
                "relay %s: version %d not published here: %s", self.relay_id, send.version, exc
            )
            return  # no report: the root's deadline and on_timeout decide
        with self._cond:
            if handle is not None or send.version > self._have[1]:
                self._have = (send.root_bus, max(send.version, self._have[1]))
            self._cond.notify_all()
        self.counters["versions"] += 1
        self._report("received", send.gen, send.version, link=self._data_link)
        if handle is not None:
            self._waits.put((handle, send.root_bus, send.version))
            if self._on_update is not None:
                self._on_update(send.version)
        else:
            with self._cond:
                self._acked = (send.root_bus, max(self._acked[1], send.version))
            self._report("acked", send.gen, send.version, link=self._data_link)
        self._prepost()

    def _prepost(self) -> None:
        """Post the receives of the next version into a free slot of the local bus.

        A posted gloo receive has no deadline (only waiting for it has one), so it can
        wait for the root's next send as long as the group lives; the root sends without
        waiting for our notice to arrive. Nothing is posted while local workers hold every
        slot (the next notice then receives into a staging buffer), before the local bus
        exists, or with NCCL.
        """
        group = self._group
        if self._posted is not None or group is None or group.wire.device is not None:
            return
        try:
            self._posted = self._post_into_free_slot(group)
        except RuntimeError as exc:  # the group is gone: the root re-forms it
            log.debug("relay %s: cannot post ahead: %s", self.relay_id, exc)

    def _post_into_free_slot(self, group: _RelayGroup) -> _Posted | None:
        """Receives posted into a free slot of the local bus; None without bus or slot."""
        local = self._local
        slot = local.reserve_slot() if local is not None else None
        if local is None or slot is None:
            return None
        return group.wire.post_receive(local.open_slot(slot), slot)

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A reusable receive buffer (kept: needing one once means needing it again)."""
        if self._stage is None or self._stage.numel() != nbytes:
            self._stage = torch.empty(nbytes, dtype=torch.uint8)
        return self._stage

    def _open_local(self, send: _Send, staging: torch.Tensor) -> Publish | None:
        """The first version (received into `staging`): open the bus with it, publish it
        under its number."""
        bus = _LocalBus(
            self._manifest,
            staging,
            self._address_arg,
            name=self.name,
            slots=self._slots,
            timeout=self._timeout,
            on_timeout=self._on_timeout,
            heartbeat=self._heartbeat,
            shm_dir=self._shm_dir,
            tap=self._tap,
        )
        try:
            bus.start()  # version 0 of the local bus holds these bytes...
            handle = None
            if send.version > 0:  # ...and they go out at once under the root's number
                handle = bus.publish_received(send.version, _copier(staging), self._timeout)
        except BaseException:
            bus.close()
            raise
        self._local = bus
        self.address = bus.address
        log.info("relay %s opened bus %r at %s", self.relay_id, self.name, bus.address)
        return handle

    def _wait_loop(self) -> None:
        """Report "acked" once the local workers acked (or the local deadline passed)."""
        assert self._data_ctx is not None
        link = _DataLink(self._data_ctx, None)
        try:
            self._report_acks(link)
        finally:
            link.close()

    def _report_acks(self, link: _DataLink) -> None:
        while (item := self._waits.get()) is not None:
            handle, bus, version = item
            try:
                handle.wait()
                missing = handle.missing
            except PublishTimeout as exc:
                missing = exc.missing
            except ZmqSyncError:  # the local bus closed
                continue
            with self._cond:
                if self._have[0] == bus:
                    self._acked = (bus, max(self._acked[1], version))
            group = self._group
            agent = self._agent
            link.ensure(agent.data_endpoint if agent is not None else "")
            self._report(
                "acked",
                group.gen if group else 0,
                version,
                missing=missing,
                have=(bus, self._have[1]),
                link=link,
            )


class _RelayAgent:
    """The thread that owns the relay's DEALER: joins, heartbeats, reports, root liveness."""

    def __init__(self, relay: Relay) -> None:
        self.relay: Relay = weakref.proxy(relay)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.dealer: zmq.Socket[bytes] | None = None
        self.store: Any = None
        self.data_endpoint = ""  # the root's data ROUTER (the data and wait threads connect)
        self.session = ""
        self.tree = ""
        self.last_heard = 0.0
        self._joining_since = 0.0
        self._next_attempt = 0.0
        self._accepted = threading.Event()
        self._reports: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._pipe_lock = threading.Lock()
        self._pipe_in = self.ctx.socket(zmq.PAIR)
        self._pipe_in.linger = 0
        self._pipe_addr = f"inproc://zmqsync-relay-{id(self)}"
        self._pipe_in.bind(self._pipe_addr)
        self._thread = threading.Thread(
            target=self._run, name=f"zmqsync-relay-ctl-{relay.name}", daemon=True
        )

    @property
    def connected(self) -> bool:
        limit = self.relay._heartbeat * _config.LOST_AFTER_BEATS
        return bool(self.session) and time.monotonic() - self.last_heard < limit

    def start(self, deadline: Deadline) -> None:
        self._thread.start()
        if not self._accepted.wait(deadline.wait_s()):
            raise ConnectTimeout(
                f"no relay root accepted relay {self.relay.relay_id!r} at "
                f"{self.relay._host}:{self.relay._port} within {deadline.total} s; is the root "
                "started, with the same bus name and MASTER_ADDR/MASTER_PORT?"
            )

    def report(self, *fields_: Any) -> None:
        self._reports.put(fields_)
        self._poke(b"r")

    def _poke(self, cmd: bytes) -> None:
        with self._pipe_lock:
            if not self._pipe_in.closed:
                post(self._pipe_in, cmd)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._poke(b"stop")
            self._thread.join(_config.THREAD_JOIN_S + 2.0)
            if self._thread.is_alive():
                log.warning("relay agent thread did not stop within its deadline")
        with self._pipe_lock:
            self._pipe_in.close()
        self.ctx.destroy(linger=0)

    # --- agent thread ---

    def _run(self) -> None:
        self.pipe = self.ctx.socket(zmq.PAIR)
        self.pipe.linger = 0
        self.pipe.connect(self._pipe_addr)
        try:
            self._loop()
        except BaseException:
            log.exception("relay agent failed")
        finally:
            self._disconnect()
            self.pipe.close()

    def _loop(self) -> None:
        relay = self.relay
        next_beat = time.monotonic()
        while True:
            poller = zmq.Poller()
            poller.register(self.pipe, zmq.POLLIN)
            if self.dealer is not None:
                poller.register(self.dealer, zmq.POLLIN)
            ready = dict(poller.poll(max(0, int((next_beat - time.monotonic()) * 1000)) + 1))
            if self.pipe in ready and not self._on_pipe():
                return
            if self.dealer is not None and self.dealer in ready:
                self._on_dealer()
            now = time.monotonic()
            if now >= next_beat:
                self._tick(now)
                next_beat = time.monotonic() + relay._heartbeat

    def _tick(self, now: float) -> None:
        relay = self.relay
        limit = relay._heartbeat * _config.LOST_AFTER_BEATS
        if self.session:
            if now - self.last_heard > limit:
                log.info("relay %s lost the root: silent for %.1f s", relay.relay_id, limit)
                self._lost()
                return
            group = relay._group
            status = _Status(
                self.session,
                group.gen if group is not None else -1,
                relay._have[0],
                relay._have[1],
                relay._acked[1] if relay._acked[0] == relay._have[0] else -1,
                _local_workers(relay.publisher),
            )
            self._send(_encode(status))
            return
        if self.dealer is not None and now - self._joining_since < 2 * limit:
            return  # JOIN sent, waiting for ACCEPT
        if now < self._next_attempt:
            return
        self._next_attempt = now + max(1.0, 2 * relay._heartbeat)
        self._connect()

    def _lost(self) -> None:
        self.session = ""
        self._disconnect()
        self.relay._inbox.put(("lost", None))

    def _disconnect(self) -> None:
        if self.dealer is not None:
            self.dealer.close()
            self.dealer = None
        self.store = None

    def _connect(self) -> None:
        """Find the root through the store, connect the DEALER, send JOIN (one attempt)."""
        relay = self.relay
        self._disconnect()
        host, port = relay._host, relay._port
        try:  # a silent probe first: a TCPStore client logs a stack trace per failed try
            with socket.create_connection((host, port), timeout=min(1.0, relay._heartbeat * 2)):
                pass
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, None, False, datetime.timedelta(seconds=max(1.0, 2 * relay._heartbeat))
            )
            endpoint = store.get(_control_key(relay.name)).decode()
            data = store.get(_data_key(relay.name)).decode()
        except (OSError, RuntimeError, UnicodeDecodeError) as exc:
            log.debug("relay %s: root not reachable at %s:%d: %s", relay.relay_id, host, port, exc)
            return
        port_text = endpoint.rsplit(":", 1)[-1]
        if not endpoint.startswith("tcp://") or not port_text.isdigit():
            log.warning(
                "relay %s: the store names a bad control endpoint %r", relay.relay_id, endpoint[:80]
            )
            return
        self.store = store
        data_port = data.rsplit(":", 1)[-1]
        self.data_endpoint = f"tcp://{_ip(host)}:{data_port}" if data_port.isdigit() else ""
        self.dealer = connect(self.ctx, zmq.DEALER, f"tcp://{_ip(host)}:{port_text}")
        self._joining_since = time.monotonic()
        self._send(
            _encode(
                _Join(
                    relay.relay_id,
                    socket.gethostname()[:255],
                    os.getpid(),
                    relay._have[0],
                    relay._have[1],
                )
            )
        )

    def _send(self, frame: bytes) -> None:
        if self.dealer is None:
            return
        with contextlib.suppress(zmq.Again):
            self.dealer.send(frame, zmq.NOBLOCK)

    def _on_pipe(self) -> bool:
        while self.pipe.poll(0):
            if self.pipe.recv() == b"stop":
                if self.session:
                    self._send(_encode(_Bye(self.session)))
                    if self.dealer is not None:
                        self.dealer.linger = 200
                return False
        while True:
            try:
                stage, gen, version, bus, have, missing, reason = self._reports.get_nowait()
            except queue.Empty:
                break
            if self.session:
                self._send(
                    _encode(_Report(self.session, stage, gen, version, bus, have, missing, reason))
                )
        return True

    def _on_dealer(self) -> None:
        relay = self.relay
        assert self.dealer is not None
        for _ in range(_config.ACK_DRAIN_MAX):
            try:
                frame = self.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = _decode(frame)
            except ProtocolError as exc:
                relay.counters["rejected"] += 1
                log.debug("dropped root message: %s", exc)
                continue
            if isinstance(msg, _Accept):
                self.session, self.tree, self.last_heard = msg.session, msg.tree, time.monotonic()
                self._accepted.set()
                log.info("relay %s accepted by root %s", relay.relay_id, msg.tree)
                continue
            if isinstance(msg, _Refuse):
                log.warning("relay %s refused by the root: %s", relay.relay_id, msg.reason)
                continue
            if not self.session or getattr(msg, "tree", "") != self.tree:
                relay.counters["stale"] += 1
                continue
            self.last_heard = time.monotonic()
            if isinstance(msg, _Evict):
                log.info("relay %s: %s; joining again", relay.relay_id, msg.reason)
                self.session = ""
                relay._inbox.put(("lost", None))
                self._disconnect()
                if msg.reason != _ROOT_CLOSED:
                    self._connect()
                return
            if isinstance(msg, _Prepare | _Commit | _Send):
                relay._inbox.put((msg, self.store))


# --- command line --------------------------------------------------------------------------


def add_arguments(p: Any) -> None:
    """The ``zmqsync relay`` options (cli.py adds the subparser)."""
    p.add_argument("address", nargs="?", help="this host's bus address (default: from --name)")
    p.add_argument("--name", default="weights", help="bus name (default: weights)")
    p.add_argument("--root", action="store_true", help="run the root, next to the trainer's bus")
    p.add_argument("--init-method", default=None, help="env:// (default) or tcp://HOST:PORT")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--ack", choices=("tree", "relays"), default="tree", help="root: what acks mean")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per version (s)")
    p.add_argument("--on-timeout", choices=("evict", "raise"), default="evict")
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument(
        "--chunk-mb", type=float, default=DEFAULT_CHUNK_MB, help="root: MiB per collective"
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        help="root: timeout of each collective (s); default: ~6 heartbeats, at least 1 s",
    )
    p.add_argument("--relay-id", default=None, help="relay: id on the tree (default: host name)")
    p.add_argument("--slots", type=int, default=2, help="relay: slots of the local bus")
    p.add_argument("--device", default=None, help="CUDA device of the NCCL staging buffer")
    p.add_argument("--connect-timeout", type=float, default=60.0, help="relay: wait for a root (s)")
    p.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback rendezvous address"
    )
    p.add_argument("--json", action="store_true", help="one JSON line per event")


def run_cli(args: Any) -> int:
    """``zmqsync relay``: run a root or a relay until SIGTERM/SIGINT."""
    stop = threading.Event()

    def emit(record: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(record), flush=True)

    node: RelayRoot | Relay
    if args.root:
        node = RelayRoot(
            args.address,
            name=args.name,
            init_method=args.init_method,
            backend=args.backend,
            ack=args.ack,
            timeout=args.timeout,
            on_timeout=args.on_timeout,
            heartbeat=args.heartbeat,
            chunk_mb=args.chunk_mb,
            collective_timeout=args.collective_timeout,
            device=args.device,
            insecure=args.insecure,
            on_relayed=lambda r: emit(
                {
                    "event": "relayed",
                    "version": r.version,
                    "generation": r.generation,
                    "relays": list(r.relays),
                    "missing": list(r.missing),
                    "seconds": r.seconds,
                }
            ),
        )
    else:
        node = Relay(
            args.address,
            name=args.name,
            init_method=args.init_method,
            relay_id=args.relay_id,
            slots=args.slots,
            timeout=args.timeout,
            on_timeout=args.on_timeout,
            heartbeat=args.heartbeat,
            device=args.device,
            insecure=args.insecure,
            on_update=lambda v: emit({"event": "published", "version": v}),
            join_timeout=args.connect_timeout,
        )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    with contextlib.ExitStack() as stack:
        for signum in (signal.SIGTERM, signal.SIGINT):
            stack.callback(signal.signal, signum, signal.signal(signum, on_signal))
        stack.enter_context(node)
        started: dict[str, Any] = {"event": "started", "role": "root" if args.root else "relay"}
        if isinstance(node, RelayRoot):
            started.update(tree=node.tree, init_method=node.init_method_url, address=node.address)
        else:
            started.update(relay_id=node.relay_id)
        emit(started)
        while not stop.wait(0.2):
            pass
    emit({"event": "closed", "version": node.version})
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: zmqsync relay --help")
