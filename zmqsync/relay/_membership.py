"""The relay root's bookkeeping of its tree. No I/O, no thread, no clock.

Who is on the tree (joins, sessions, leaves, silence), which generation the relays form
(prepare, ready, commit), what each relay's bus holds and what its local workers acked,
and what happens at a version's deadline. The root's agent thread feeds it the control
channel's messages, its relay thread the data channel's reports, each with ``now``
(``time.monotonic()``) and under the root's lock; tests drive it directly.

The rules:

1. **Sessions.** A relay is known by its relay id; the session its ACCEPT gave it proves
   that a message comes from its current process. A JOIN with a known id replaces the
   old process (a new session). Messages of an ended session (replaced, lost, evicted)
   change nothing and are answered EVICT, "join again".
2. **Silence.** A relay silent for ``LOST_AFTER_BEATS`` heartbeats is lost. Lost and
   evicted relays stay listed (``zmqsync inspect`` shows them) until they join again.
3. **Generations.** A generation is a fixed member list (relay id -> session, rank) with
   a fresh process group. It is formed from every connected relay that answers READY to
   the generation's PREPARE in time; one that does not is left out, and wants in again
   once it answers READY late or reports itself idle. A generation that lost a member
   finishes the version at hand and is re-formed; one whose member reported a failure
   is re-formed at once.
4. **Versions** count per root bus: a relay *has* a version when its bus holds it or a
   newer one of the same root bus, and has *acked* it when its local workers did.
   Numbers never go backwards within a bus; a new root bus starts them over.
5. **The deadline** of a version: the relays that do not have it (``ack="relays"``) or
   did not ack it (``ack="tree"``) miss it. ``on_timeout="evict"`` evicts them (told
   EVICT, they join again by themselves, as new members); ``"raise"`` keeps them.

Not thread-safe on its own: the root holds its lock for every call.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._config import LOST_AFTER_BEATS
from .._protocol import WorkerEntry
from ._messages import (
    MAX_RELAYS,
    Accept,
    Bye,
    Evict,
    Join,
    Refuse,
    RelayInfo,
    RelayMessage,
    Report,
    Status,
)

__all__ = ["Formation", "Generation", "Member", "Membership", "Verdict"]

log = logging.getLogger(__name__)

_CONNECTED = ("pending", "active")


@dataclass(eq=False)
class Member:
    """One relay process on the tree (compared by identity: a re-join is a new member)."""

    relay_id: str
    identity: bytes  # routing id of its control DEALER (where answers go)
    session: str
    host: str
    pid: int
    order: int  # join order: ranks follow it
    last_seen: float  # monotonic
    state: str = "pending"  # pending, active, lost, evicted
    wants: bool = True  # wants into the next generation (joined, or answered READY late)
    rank: int = -1
    generation: int = -1
    ready_gen: int = -1  # the last generation it answered READY to
    have_bus: str = ""
    have_version: int = -1
    acked_bus: str = ""
    acked_version: int = -1
    failed: tuple[int, int] = (-1, -1)  # (gen, version) of its last failure report
    retry_at: float = 0.0  # not taken into a generation before this time
    missing: tuple[str, ...] = ()  # local workers that missed its last acked version
    workers: tuple[WorkerEntry, ...] = ()

    @property
    def connected(self) -> bool:
        return self.state in _CONNECTED

    def has(self, bus: str, version: int) -> bool:
        return self.have_bus == bus and self.have_version >= version

    def acked(self, bus: str, version: int) -> bool:
        return self.acked_bus == bus and self.acked_version >= version


@dataclass(eq=False)
class Generation:
    """A formed generation: its members by relay id, as (session, rank)."""

    number: int
    bus: str  # the root bus it was formed for
    members: dict[str, tuple[str, int]]
    broken: bool = False  # ended: the next version re-forms first


@dataclass(frozen=True, eq=False)
class Formation:
    """A generation being formed: the relays asked to PREPARE."""

    number: int
    candidates: tuple[Member, ...]


@dataclass(frozen=True)
class Verdict:
    """What a version's deadline decided: who has it, who missed it, and whether the
    late ones were evicted (then `evicted` are the routing ids to tell)."""

    done: tuple[str, ...]
    missing: tuple[str, ...]
    evicted: tuple[bytes, ...]


class Membership:
    """The tree as the root knows it (see the module doc).

    Args:
        tree: the root's tree id (in the answers it makes).
        heartbeat: the root's heartbeat (s): silence, retries and ACCEPT derive from it.
        form_wait: how long a formation waits for READYs (s); a relay late for one is
            not asked again before this much time passed.
        ack: "tree" (a version counts once a relay's workers acked it) or "relays"
            (once the relay has it on its bus).
        on_timeout: "evict" or "raise": what a missed deadline does to the late relays.
        max_relays: relays on the tree at most; a JOIN beyond is refused.
        new_session: makes session ids (random; tests pass their own).
    """

    def __init__(
        self,
        tree: str,
        *,
        heartbeat: float,
        form_wait: float,
        ack: str = "tree",
        on_timeout: str = "evict",
        max_relays: int = MAX_RELAYS,
        new_session: Callable[[], str] = lambda: secrets.token_hex(8),
    ) -> None:
        self.tree = tree
        self.heartbeat, self.form_wait = heartbeat, form_wait
        self.ack, self.on_timeout = ack, on_timeout
        self.max_relays = max_relays
        self.members: dict[str, Member] = {}
        self.sessions: dict[str, str] = {}  # session -> relay id
        self.counters: Counter[str] = Counter()
        self.gen = 0  # the last generation number handed out
        self.bus, self.version = "", -1  # what the root holds now
        self._new_session = new_session
        self._order = 0

    @property
    def silent_after(self) -> float:
        """Seconds without a message after which a relay is lost."""
        return self.heartbeat * LOST_AFTER_BEATS

    # --- the control channel --------------------------------------------------------

    def on_message(self, identity: bytes, msg: RelayMessage, now: float) -> RelayMessage | None:
        """A message from a relay on the control channel; the answer to send back, if any.

        JOIN is answered ACCEPT or REFUSE; a message of an unknown or ended session is
        answered EVICT (except BYE); STATUS, REPORT and BYE update the relay.
        """
        if isinstance(msg, Join):
            return self.join(identity, msg, now)
        if not isinstance(msg, Status | Report | Bye):
            self.counters["rejected"] += 1
            return None
        member = self.member_of(msg.session)
        if member is None:
            if isinstance(msg, Bye):
                return None
            self.counters["stale"] += 1
            return Evict(self.tree, "unknown or ended session: join again")
        member.last_seen, member.identity = now, identity
        if isinstance(msg, Bye):
            self.members.pop(member.relay_id, None)
            self.sessions.pop(msg.session, None)
            log.info("relay %s left", member.relay_id)
        elif isinstance(msg, Status):
            if msg.gen < 0 and member.state == "pending" and member.retry_at <= now:
                member.wants = True  # idle and outside any group (a PREPARE may have been lost)
            _have(member, msg.have_bus, msg.have_version)
            if msg.have_bus and msg.acked >= 0:
                _acked(member, msg.have_bus, msg.acked)
            member.workers = msg.workers
        else:
            self._on_report(member, msg, now)
        return None

    def join(self, identity: bytes, msg: Join, now: float) -> Accept | Refuse:
        """Admit a relay (a new session), replacing a process of the same relay id."""
        old = self.members.get(msg.relay_id)
        if old is None and len(self.members) >= self.max_relays:
            return Refuse(self.tree, f"tree full: {self.max_relays} relays")
        if old is not None:
            self.sessions.pop(old.session, None)
        session = self._new_session()
        self._order += 1
        member = Member(msg.relay_id, identity, session, msg.host, msg.pid, self._order, now)
        _have(member, msg.have_bus, msg.have_version)
        self.members[msg.relay_id] = member
        self.sessions[session] = msg.relay_id
        self.counters["joins"] += 1
        log.info(
            "relay %s joined (pid %d on %s)%s",
            msg.relay_id,
            msg.pid,
            msg.host,
            " replacing an older process" if old is not None else "",
        )
        return Accept(self.tree, session, self.heartbeat)

    def report(self, msg: Report, now: float) -> bool:
        """A REPORT from the data channel; False (counted as stale) if its session ended."""
        member = self.member_of(msg.session)
        if member is None:
            self.counters["stale"] += 1
            return False
        member.last_seen = now
        self._on_report(member, msg, now)
        return True

    def member_of(self, session: str) -> Member | None:
        """The member of a live session, or None (unknown, ended, lost or evicted)."""
        rid = self.sessions.get(session)
        member = self.members.get(rid) if rid is not None else None
        if member is None or member.session != session or not member.connected:
            return None
        return member

    def _on_report(self, member: Member, msg: Report, now: float) -> None:
        _have(member, msg.have_bus, msg.have_version)
        if msg.stage == "ready":  # its data thread is free: it wants in (again)
            member.ready_gen = max(member.ready_gen, msg.gen)
            if member.state == "pending":
                member.wants = True
        elif msg.stage == "acked":
            _acked(member, msg.have_bus, msg.version)
            member.missing = msg.missing
        elif msg.stage == "failed":
            member.failed = (msg.gen, msg.version)
            member.retry_at = now + self.heartbeat
            log.info("relay %s: generation %d failed: %s", member.relay_id, msg.gen, msg.reason)

    def tick(self, now: float) -> list[bytes]:
        """Mark relays silent for too long lost; the routing ids of those to send a BEAT."""
        beats = []
        for m in self.members.values():
            if not m.connected:
                continue
            if now - m.last_seen > self.silent_after:
                m.state = "lost"
                self.counters["lost"] += 1
                log.info("relay %s silent for %.1f s: lost", m.relay_id, self.silent_after)
            else:
                beats.append(m.identity)
        return beats

    def reachable(self) -> list[bytes]:
        """Routing ids of every connected relay (to tell them the root is going)."""
        return [m.identity for m in self.members.values() if m.connected]

    # --- generations ----------------------------------------------------------------

    def candidates(self) -> list[Member]:
        """Relays that may be in the next generation: connected, not lost or evicted."""
        return [m for m in self.members.values() if m.connected]

    def wanting(self, now: float) -> bool:
        """A connected relay outside the generation wants in (and may be asked now)."""
        return any(
            m.wants and m.state == "pending" and m.retry_at <= now for m in self.members.values()
        )

    def alive(self, gen: Generation) -> list[Member]:
        """Members of `gen` still on the tree in the same session (lost ones excluded)."""
        out = []
        for rid, (session, _rank) in gen.members.items():
            m = self.members.get(rid)
            if m is not None and m.session == session and m.state == "active":
                out.append(m)
        return out

    def needs_reform(self, gen: Generation, now: float) -> bool:
        """`gen` cannot carry the next version: it ended, was formed for another root
        bus, lost a member, or a relay wants in."""
        if gen.broken or gen.bus != self.bus:
            return True
        if len(self.alive(gen)) != len(gen.members):
            return True
        return self.wanting(now)

    def prepare(self) -> Formation | None:
        """Start forming the next generation from every candidate (PREPARE each one);
        None when no relay is connected."""
        candidates = self.candidates()
        if not candidates:
            return None
        self.gen += 1
        return Formation(self.gen, tuple(candidates))

    def answered(self, formation: Formation) -> bool:
        """Every candidate answered READY to `formation`, or is gone."""
        return all(m.ready_gen == formation.number or not m.connected for m in formation.candidates)

    def settle(self, formation: Formation, now: float) -> Generation | None:
        """The generation `formation` becomes, with the candidates READY now, in join
        order (ranks 1, 2, ...); None if there are none. The late ones are left out and
        not asked again before `form_wait` passed (an active one becomes pending)."""
        ready = sorted(
            (m for m in formation.candidates if m.ready_gen == formation.number and m.connected),
            key=lambda m: m.order,
        )
        late = [m for m in formation.candidates if m not in ready]
        for m in late:  # in again when it answers READY late, or reports itself idle
            m.wants, m.retry_at = False, now + self.form_wait
            if m.state == "active":
                m.state = "pending"
        if late:
            log.info(
                "generation %d: no READY from %s in time; forming without",
                formation.number,
                ", ".join(m.relay_id for m in late),
            )
        if not ready:
            return None
        members = {m.relay_id: (m.session, rank) for rank, m in enumerate(ready, 1)}
        return Generation(formation.number, self.bus, members)

    def formed(self, gen: Generation) -> None:
        """`gen`'s process group exists: its members (still in the same session and
        connected) are active in it."""
        for rid, (session, rank) in gen.members.items():
            m = self.members.get(rid)
            if m is not None and m.session == session and m.connected:
                m.state, m.rank, m.generation, m.wants = "active", rank, gen.number, False
        self.counters["generations"] += 1

    def identities(self, gen: Generation) -> list[tuple[bytes, int]]:
        """(routing id, rank) of the members of `gen`, in the same session still."""
        out = []
        for rid, (session, rank) in gen.members.items():
            m = self.members.get(rid)
            if m is not None and m.session == session:
                out.append((m.identity, rank))
        return out

    # --- versions -------------------------------------------------------------------

    def hold(self, bus: str, version: int) -> None:
        """The root holds `version` of root bus `bus` now."""
        self.bus, self.version = bus, version

    def lagging(self, gen: Generation) -> list[Member]:
        """Live members of `gen` that do not have the version the root holds."""
        return [m for m in self.alive(gen) if not m.has(self.bus, self.version)]

    def needs_distribution(self, gen: Generation | None, now: float) -> bool:
        """Between versions: whether the root must act (re-form, or bring relays that
        joined or fell behind up to its version)."""
        if not self.members or (gen is None and not self.wanting(now)):
            return False
        if gen is None or self.needs_reform(gen, now):
            return True
        return any(
            m is not None and m.retry_at <= now and not m.has(self.bus, self.version)
            for m in (self.members.get(rid) for rid in gen.members)
        )

    def arrived(self, gen: Generation, targets: Sequence[Member]) -> bool:
        """Every live one of `targets` has the version the root holds."""
        alive = self.alive(gen)
        return all(m.has(self.bus, self.version) for m in alive if m in targets)

    def failing(self, gen: Generation) -> bool:
        """`gen` lost a member or one reported a failure in it: stop waiting for it."""
        alive = self.alive(gen)
        return len(alive) != len(gen.members) or any(m.failed[0] == gen.number for m in alive)

    def reached(self, m: Member) -> bool:
        """`m` has the version the root holds (ack="relays") or acked it (ack="tree")."""
        if self.ack == "tree":
            return m.acked(self.bus, self.version)
        return m.has(self.bus, self.version)

    def complete(self, gen: Generation) -> bool:
        """Every live member of `gen` reached the version; a generation that lost members
        on the way is marked broken (re-formed without them before the next version)."""
        alive = self.alive(gen)
        if not all(self.reached(m) for m in alive):
            return False
        self.finished(gen)
        return True

    def finished(self, gen: Generation) -> None:
        """The version is through `gen`: if it lost members, it ends now."""
        if len(self.alive(gen)) != len(gen.members):
            gen.broken = True

    def done_by(self, gen: Generation) -> tuple[str, ...]:
        """Relay ids of the live members of `gen`."""
        return tuple(m.relay_id for m in self.alive(gen))

    def deadline(self, gen: Generation | None, now: float) -> Verdict:
        """The version's deadline passed: who reached it among the members of `gen`
        (every candidate if there is no intact generation), and who missed it; with
        on_timeout="evict" the late ones are evicted and `gen` ends."""
        pool = self.alive(gen) if gen is not None and not gen.broken else self.candidates()
        done = [m for m in pool if self.reached(m)]
        missing = [m for m in pool if m not in done]
        self.counters["timeouts"] += 1
        evicted: list[bytes] = []
        if self.on_timeout == "evict":
            for m in missing:  # they join again by themselves
                m.state, m.wants, m.retry_at = "evicted", False, now + self.silent_after
                evicted.append(m.identity)
            self.counters["evictions"] += len(missing)
            if missing and gen is not None:
                gen.broken = True
        return Verdict(
            tuple(m.relay_id for m in done), tuple(m.relay_id for m in missing), tuple(evicted)
        )

    def active_with_version(self) -> int:
        """Active relays that have the version the root holds (`wait_for_relays`)."""
        return sum(
            m.state == "active" and m.has(self.bus, self.version) for m in self.members.values()
        )

    # --- what inspect shows ---------------------------------------------------------

    def info(self, m: Member, now: float) -> RelayInfo:
        """`m` as `RelayRoot.relays` and ``zmqsync inspect`` show it."""
        return RelayInfo(
            m.relay_id,
            m.host,
            m.pid,
            m.state,
            m.rank if m.state == "active" else -1,
            m.generation,
            m.have_version if m.have_bus == self.bus else -1,
            m.acked_version if m.acked_bus == self.bus else -1,
            max(0.0, now - m.last_seen),
            m.workers,
        )

    def infos(self, now: float) -> tuple[RelayInfo, ...]:
        return tuple(self.info(m, now) for m in self.members.values())


def _have(m: Member, bus: str, version: int) -> None:
    if bus and (bus != m.have_bus or version > m.have_version):
        m.have_bus, m.have_version = bus, version


def _acked(m: Member, bus: str, version: int) -> None:
    if bus and (bus != m.acked_bus or version > m.acked_version):
        m.acked_bus, m.acked_version = bus, version
