"""The publisher's side of the protocol, without I/O: messages and a clock in, messages out.

Like h11's `Connection`, `PublisherRole` knows every rule and touches no socket, thread or
clock: the agent thread decodes what arrives, hands it over with `now`, and sends what
comes back. The rules, in the order a worker meets them:

* **Admission** (`admit`): no HELLO while closing; a worker id whose session is alive,
  or that is still kept for the process it was dropped from (`reserve_s`), gets
  ``busy:`` unless the HELLO proves it is that process, or ``taken:`` if it comes from a
  process that held the id before (see `Registry.claim`); a new worker id beyond
  `max_workers`, beyond `max_workers_per_peer` from one peer, or beyond what the
  connection budget allows, gets ``bus full``. Only then is a handshake token spent:
  beyond `handshake_rate` per second the HELLO gets ``busy:`` (retried by real
  subscribers) and its id a place in line (see `HandshakeQueue`). Refusals that cost
  nothing more than their answer come first, so a flood of them never spends the budget
  honest workers need.
* **Welcome** (`welcome`): a new session, the member registered at the latest version,
  a WELCOME naming the endpoints, buffers and manifest; the session it replaces (if
  any) is told STOP, under the next event seq.
* **Worker messages** (`on_worker_message`): ACK, HEARTBEAT and BYE count only with the
  sender's current session; anything else is counted and changes nothing. A worker that
  still beats with a session this bus dropped missed its STOP: `gone` sends it again.
* **Liveness** (`drop_silent`): a HEARTBEAT carrying the last event seq (gap detection
  for subscribers), and a STOP for every worker silent for LOST_AFTER_BEATS heartbeats
  (a worker not heard from since its WELCOME: FIRST_WORD_S at least, and more for a
  manifest of many tensors, for its handshake), counted once what workers sent is read.
* **Events** are numbered here (`seq`): whoever sends them holds the lock that orders
  the sends on the events socket, and takes the next number under it.
* **Publishes** ask the role, never its registry: a slot to write (`free_slot`,
  `holders`, `blockers`), the version written (`published`), who acked or is missing
  (`acked`, `missing`, `lags`, `all_acked`), and what a deadline costs (`timed_out`,
  `evict`). The registry is the role's alone, and so are its counters: every other
  module bumps one through a method of the role.

Not thread-safe on its own: callers hold the publisher's registry lock for everything
that reads or changes the registry, and its sockets lock for `seq`.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from ._config import FIRST_WORD_PER_TENSOR_S, FIRST_WORD_S, LOST_AFTER_BEATS, RESERVE_MIN_S
from ._errors import ProtocolError
from ._handshake_queue import HandshakeQueue
from ._histogram import BLOCKED_IN_PUBLISH, BLOCKED_IN_STEP, PUBLISH, record
from ._protocol import (
    Ack,
    BufferInfo,
    Bye,
    Heartbeat,
    Hello,
    Message,
    State,
    Stop,
    TensorSpec,
    Welcome,
    WorkerEntry,
)
from ._registration import registered
from ._registry import Meant, Member, Registry, WorkerInfo

__all__ = ["Endpoints", "PublisherRole", "per_peer_default"]


def per_peer_default(max_workers: int) -> int:
    """Members one peer may hold unless told otherwise: three quarters of the seats, so
    that one process (or one host over tcp) cycling worker ids cannot fill the bus."""
    return max(1, 3 * max_workers // 4)


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """Where a WELCOME sends a worker, and what it maps (known once the bus is bound)."""

    events: str
    acks: str
    tap: str
    buffers: tuple[BufferInfo, ...]


class PublisherRole:
    """Admission, welcome, state and liveness of one bus (see the module doc)."""

    def __init__(
        self,
        *,
        name: str,
        bus_id: str,
        slots: int,
        heartbeat: float,
        slot_bytes: int,
        manifest: tuple[TensorSpec, ...],
        max_workers: int = 1024,
        max_workers_per_peer: int | None = None,
        handshake_rate: float = 200.0,
        now: float = 0.0,
        new_session: Callable[[], str] = lambda: secrets.token_hex(8),
        alive: Callable[[str], bool] = lambda peer: True,
    ) -> None:
        self.name, self.bus_id, self.slots = name, bus_id, slots
        self.heartbeat = heartbeat
        self.slot_bytes, self.manifest = slot_bytes, manifest
        self.max_workers, self.handshake_rate = max_workers, handshake_rate
        self.max_workers_per_peer = max_workers_per_peer or per_peer_default(max_workers)
        first_word_s = FIRST_WORD_S + FIRST_WORD_PER_TENSOR_S * len(manifest)
        self.registry = Registry(
            slots,
            first_word_s=first_word_s,
            reserve_s=max(RESERVE_MIN_S, self.silent_after),
            max_per_peer=self.max_workers_per_peer,
            alive=alive,
        )
        self.counters: Counter[str] = Counter()
        self.seq = 0  # of the last event sent (RECEIVE or STOP)
        self.endpoints = Endpoints("", "", "", ())
        self.cuda = False  # some tensors live in CUDA buffers (set once they exist)
        self.closing = False
        self._new_session = new_session
        self.queue = HandshakeQueue(handshake_rate, now, places=max(max_workers, 64))
        self._notes: dict[str, tuple[str, str]] = {}  # worker id -> (session, transport note)
        self._sweeps_put_off = 0  # liveness sweeps in a row left for unread frames
        self._told: dict[str, float] = {}  # gone session -> when `gone` last told it

    @property
    def silent_after(self) -> float:
        """Seconds without a message after which a peer counts as gone."""
        return self.heartbeat * LOST_AFTER_BEATS

    def next_seq(self) -> int:
        """The number of the next event (RECEIVE or STOP): take it just before sending."""
        self.seq += 1
        return self.seq

    # --- handshakes ---------------------------------------------------------------

    def admit(
        self, hello: Hello, now: float, *, peer: str = "", connections_full: bool = False
    ) -> Hello:
        """`hello` as it will be registered (its transport as the bus offers it), or
        ProtocolError with the reason the ERROR reply gives.

        Args:
            peer: the connection's peer as libzmq saw it (see `_admission.peer_of`).
            connections_full: the connection budget has no room for a new worker's two
                connections (see `Gate`).
        """
        if self.closing:
            raise ProtocolError("the publisher is closing")
        if refusal := self.registry.claim(hello, now, self.silent_after):
            self.counters["refused_ids"] += 1
            raise ProtocolError(refusal)  # "busy:" is retried: the holder may go silent
        known = hello.worker_id in self.registry.members
        if not known and len(self.registry.members) >= self.max_workers:
            raise ProtocolError(f"bus full: {self.max_workers} workers (max_workers)")
        if not known and not self.registry.room_for(peer):
            self.counters["refused_full_peer"] += 1
            raise ProtocolError(
                f"bus full: {peer} holds {self.max_workers_per_peer} workers, as many as one "
                "peer may (max_workers_per_peer); the other seats are kept for other peers"
            )
        if not known and connections_full:
            raise ProtocolError(
                "bus full: no room for more connections under the publisher's file "
                "descriptor limit; raise its `ulimit -n`"
            )
        if not self.queue.take(hello.worker_id, now):
            self.counters["throttled"] += 1
            raise ProtocolError("busy: too many handshakes, retry later")
        transport, note = registered(hello.transport, hello.transport_note, self.cuda)
        return dataclasses.replace(hello, transport=transport, transport_note=note)

    def welcome(self, hello: Hello, now: float, peer: str = "") -> tuple[Welcome, Member | None]:
        """Register the worker `hello` (from `admit`) names, from `peer`; its WELCOME, and
        the member it replaced (tell that session with `stop_for(old.session, "replaced")`).

        Raises:
            ProtocolError: the worker id belongs to a live session of another process
                now (``busy:`` or ``taken:``, see `Registry.claim`).
        """
        if refusal := self.registry.claim(hello, now, self.silent_after):
            self.counters["refused_ids"] += 1
            raise ProtocolError(refusal)
        session = self._new_session()
        old = self.registry.members.get(hello.worker_id)
        self.registry.join(hello, session, now, peer)
        self._remember_note(hello.worker_id, session, hello.transport_note)
        self.counters["handshakes"] += 1
        version = self.registry.latest
        welcome = Welcome(
            bus=self.bus_id,
            session=session,
            seq=self.seq,
            version=version,
            slot=self.registry.slot_of(version),
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            heartbeat=self.heartbeat,
            events=self.endpoints.events,
            acks=self.endpoints.acks,
            tap=self.endpoints.tap,
            buffers=self.endpoints.buffers,
            manifest=self.manifest,
        )
        return welcome, old

    def _remember_note(self, worker_id: str, session: str, note: str) -> None:
        """Keep a worker's transport note for STATE (only current members are shown)."""
        members = self.registry.members
        if len(self._notes) > 2 * max(len(members), 1024):
            for gone in [w for w in self._notes if w not in members]:
                del self._notes[gone]
        self._notes[worker_id] = (session, note)

    def _note_of(self, member: Member) -> str:
        kept = self._notes.get(member.worker_id)
        return kept[1] if kept is not None and kept[0] == member.session else ""

    def state(self, now: float, *, pid: int, extra: dict[str, int] | None = None) -> State:
        """What INSPECT gets: the bus, its buffers and manifest, workers and counters."""
        workers = tuple(
            WorkerEntry(
                m.worker_id,
                m.pid,
                m.host,
                m.mode,
                m.transport,
                m.acked,
                max(0.0, now - m.last_seen),
                self._note_of(m),
            )
            for m in self.registry.members.values()
        )
        return State(
            bus=self.bus_id,
            name=self.name,
            pid=pid,
            version=self.registry.latest,
            seq=self.seq,
            slots=self.slots,
            slot_versions=tuple(self.registry.slot_versions),
            heartbeat=self.heartbeat,
            tap=self.endpoints.tap,
            events=self.endpoints.events,
            buffers=self.endpoints.buffers,
            manifest=self.manifest,
            workers=workers,
            counters={**self.counters, **(extra or {})},
        )

    # --- what workers send --------------------------------------------------------

    def on_worker_message(self, msg: Message, now: float) -> bool:
        """Apply one message from the acks socket; True if a waiter should look again
        (an ack counted, a worker left)."""
        registry = self.registry
        if isinstance(msg, Ack):
            return self.on_ack(msg.worker_id, msg.session, msg.version, now)
        if isinstance(msg, Heartbeat):
            if not registry.seen(msg.worker_id, msg.session, now):
                self.counters["stale"] += 1
            return False
        if isinstance(msg, Bye):
            return registry.leave(msg.worker_id, msg.session) is not None
        self.counters["rejected"] += 1
        return False

    def gone(self, worker_id: str, session: str, now: float) -> Stop | None:
        """The STOP to send (again) to `session` of `worker_id` if this bus dropped it
        while its worker still speaks (a HEARTBEAT came): it missed its STOP, which went
        out before its subscription was live (the STOP of a session dropped while its
        worker was still in its handshake). At most once per beat per session; None for
        a live session and for one this bus never issued (forged: it gets nothing)."""
        if self.registry.gone_sessions.get(session) != worker_id:
            return None
        if now - self._told.get(session, -self.heartbeat) < self.heartbeat:
            return None
        if len(self._told) >= 4096:
            self._told.clear()
        self._told[session] = now
        self.counters["told_gone"] += 1
        return self.stop_for(session, "not on the bus")

    def on_ack(self, worker_id: str, session: str, version: int, now: float) -> bool:
        """An ACK of this bus (its fields, from `read_ack`, or from `on_worker_message`);
        True if it counted."""
        ok = self.registry.ack(worker_id, session, version, now)
        self.counters["acks" if ok else "stale"] += 1
        return ok

    # --- liveness and goodbyes ----------------------------------------------------

    def heartbeat_event(self) -> Heartbeat:
        """The publisher's HEARTBEAT: the last event seq, for subscribers' gap checks."""
        return Heartbeat(self.bus_id, self.seq, "", "", self.registry.latest)

    def drop_silent(self, now: float, *, unread: bool = False) -> list[Member]:
        """Workers silent for too long, removed (tell each with `stop_for`).

        Args:
            unread: frames the last drain left on the acks socket (its budget ran out):
                a worker may look silent only because its last words are not read yet,
                as on a host where the publisher got no CPU for a while. The sweep waits
                for them, at most LOST_AFTER_BEATS beats in a row (so that a flood of
                frames cannot keep the dead on the bus).
        """
        if unread and self._sweeps_put_off < LOST_AFTER_BEATS:
            self._sweeps_put_off += 1
            return []
        self._sweeps_put_off = 0
        lost = self.registry.evict(self.registry.silent(now, self.silent_after), now)
        self.counters["lost"] += len(lost)
        return lost

    def stop_for(self, session: str, reason: str) -> Stop:
        """A STOP for one session (evicted, silent, replaced): the next event."""
        return Stop(self.bus_id, self.next_seq(), session, reason)

    # --- publishes ------------------------------------------------------------------

    @property
    def latest(self) -> int:
        """The last version recorded (-1 before the first)."""
        return self.registry.latest

    @property
    def members(self) -> Mapping[str, Member]:
        """The workers on the bus, by worker id: to read (the role changes them)."""
        return self.registry.members

    def member(self, worker_id: str, session: str) -> Member | None:
        """The member with this id and session (None for a stale or unknown one)."""
        return self.registry.find(worker_id, session)

    def targets(self, worker_ids: Iterable[str] | None = None) -> tuple[Meant, ...]:
        """A publish's targets: the workers named (None: every member), each with the
        process that holds its id now (see `Registry.meant`)."""
        registry = self.registry
        return registry.meant(registry.members if worker_ids is None else worker_ids)

    def record(self, version: int, slot: int) -> None:
        """`version` is in `slot` and the latest, with no publish counted (version 0,
        written before the bus starts)."""
        self.registry.record(version, slot)

    def published(self, version: int, slot: int, written: int) -> None:
        """A publish wrote `version` into `slot`, copying `written` bytes there (the
        ``written_bytes`` counter: a partial publish writes less than a version)."""
        self.registry.record(version, slot)
        counters = self.counters
        counters["publishes"] += 1
        counters["written_bytes"] += written

    def reserve_home(self, slot: int | None) -> None:
        """`slot` is the trainer's home from now on (None: none): see `Registry.reserve`."""
        self.registry.reserve(slot)

    def free_slot(self) -> int | None:
        """A slot no worker holds now, oldest version first; None if all are held."""
        return self.registry.free_slot()

    def holders(self, slot: int) -> list[str]:
        """The workers that stop `slot` from being written."""
        return self.registry.holders(slot)

    def blockers(self) -> list[str]:
        """The workers to blame (or evict) when no slot is free (`Registry.blockers`)."""
        return self.registry.blockers()

    def alias_readers(self) -> bool:
        """Whether an alias-mode worker is on the bus (each pins one slot more)."""
        return self.registry.alias_readers()

    def copy_readers(self) -> bool:
        """Whether a copy-mode worker is on the bus (`Registry.copy_readers`)."""
        return self.registry.copy_readers()

    def cpu_readers(self) -> bool:
        """Whether a worker reads the CPU segment (of CUDA weights: it needs the mirror)."""
        return any(m.transport == "cpu" for m in self.registry.members.values())

    def applied_workers(self) -> int:
        """Members that acked a version."""
        return sum(m.acked >= 0 for m in self.registry.members.values())

    def infos(self, wall_offset: float) -> dict[str, WorkerInfo]:
        """`Publisher.workers`: a snapshot of every member, times on the wall clock."""
        return self.registry.infos(wall_offset)

    def acked(self, version: int, targets: tuple[Meant, ...]) -> list[str]:
        """Targets whose process acked `version` (see `Registry.acked`)."""
        return self.registry.acked(version, targets)

    def missing(self, version: int, targets: tuple[Meant, ...]) -> list[str]:
        """Targets still on the bus that have not acked `version`."""
        return self.registry.missing(version, targets)

    def lags(self, version: int, targets: tuple[Meant, ...]) -> dict[str, int]:
        """How many versions each target still on the bus is behind `version`."""
        return self.registry.lags(version, targets)

    def all_acked(self, version: int, targets: tuple[Meant, ...]) -> Callable[[], bool]:
        """A check, asked after every ack (under the registry lock), of whether no target
        is missing `version`.

        Asking `missing` each time costs O(targets) per ack, O(N^2) per publish (64
        workers: 4,096 lookups). This one keeps the targets not yet seen done and looks
        at the last of them: one lookup per ack while it has not acked, each target
        dropped once. Acks only grow and members only leave, so a dropped target stays
        done, except one that re-joins meanwhile: the full check runs once at the end.
        """
        registry, pending = self.registry, list(targets)

        def ready() -> bool:
            members = registry.members
            while pending:
                worker_id, process = pending[-1]
                member = members.get(worker_id)
                if member is not None and member.acked < version:
                    if not process or member.process == process:
                        return False
                pending.pop()
            missing = set(registry.missing(version, targets))
            pending.extend(t for t in targets if t[0] in missing)
            return not pending

        return ready

    def timed_out(self) -> None:
        """A publish's deadline passed with workers late (the ``timeouts`` counter)."""
        self.counters["timeouts"] += 1

    def count(self, what: str, n: int = 1) -> None:
        """Add `n` to the counter `what`: what the agent's socket loop counts itself
        (frames rejected before they reach the role, peers dropped, tap frames lost)."""
        self.counters[what] += n

    def took(self, seconds: float) -> None:
        """A publish ended (its last ack, or its deadline with on_timeout="evict")
        `seconds` after publish() was called: count it in the ``publish`` histogram of
        `counters` (see `_histogram`). The one call here that needs no lock: only the
        threads that finish publishes write those keys."""
        record(self.counters, PUBLISH, seconds)

    def blocked(self, seconds: float, in_step: bool) -> None:
        """The training thread waited `seconds` for a version: inside publish(), or
        (`in_step`, Overlapped writes) in an optimizer step, for the version's background
        copy. Summed in whole microseconds (``blocked_publish_us``, ``blocked_step_us``),
        what `Publish.blocked` adds up per version; one add, unlocked as `took` is (only
        the training thread writes these keys)."""
        self.counters[BLOCKED_IN_STEP if in_step else BLOCKED_IN_PUBLISH] += int(seconds * 1e6)

    def evict(self, worker_ids: Iterable[str], now: float) -> list[Member]:
        """Drop workers a publish gave up on (on_timeout="evict") at `now`."""
        evicted = self.registry.evict(worker_ids, now)
        self.counters["evictions"] += len(evicted)
        return evicted

    def close(self) -> Stop:
        """The bus closes: no more handshakes; the STOP that says so to everyone."""
        self.closing = True
        return Stop(self.bus_id, self.next_seq(), "", "publisher closed")
