"""Who is on the bus, what each worker holds, which slots may be written. No I/O, no thread.

The publisher's agent thread and its user-facing methods both drive this under one
lock; tests drive it directly with an explicit `now`.

Invariant: **a slot that a live worker may be reading, or (alias mode) computes with, is
never handed out for writing** — except with slots=1, where the only slot must be
rewritten under the seqlock while alias readers hold it (they detect it; see
`Subscriber.reading`).

Identity: a worker id belongs to one live session at a time, and each member remembers
the *process* it belongs to: the secret `nonce` its subscriber drew once and sends in
every HELLO (or, from a peer that sends none, its session). A HELLO for an id whose
session is alive is refused (`claim`) unless it proves it comes from that same process,
by its nonce or by the live session: two processes that share an id by accident, or a
peer that forges one, cannot take over a live worker's place, and a process is never
refused because of a session it registered itself but never learnt of (a WELCOME lost
on the way). A process that held the id earlier (its nonce is among those that left it)
and finds another process holding it now is told so: ``taken:``, final.

**An id stays with its process for a while after it is dropped.** A worker evicted by a
deadline, or dropped after a pause just past liveness, is usually alive and about to
re-join; worker ids are public (INSPECT lists them), so a peer that HELLOs for a live
worker's id would otherwise win it the moment its holder is dropped, and the holder's
re-join would be told ``taken:``. A worker that spoke at least once is therefore
*reserved* for `reserve_s` after it is dropped (or, not yet swept, after it went
silent): only its own process (nonce or session) may claim the id meanwhile; every
other claimant is told ``busy:``, which real subscribers retry. Where the publisher can
see that the process is gone (`alive`: an ipc peer in its pid namespace), nothing is
reserved and a replacement gets in at once; a process that never spoke after its WELCOME
(a container restarted mid-handshake) holds its id for the first-word time only.

**No peer fills the bus.** A peer (what libzmq tells apart: a process on ipc://, a host
on tcp://) holds at most `max_per_peer` members; the seats past it are kept for others.

The session a re-join of the same process replaces is *displaced*: it is no longer a
member (no acks expected, told STOP), but the slot it may still compute with stays
protected until the new session acks (the process has moved on) or it goes silent.

Acks are counted per process: a publish remembers which process each target was
(`meant`), and an ack of the same worker id from another process does not count for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ._protocol import Hello

__all__ = ["Meant", "Member", "Registry", "WorkerInfo", "lag"]

# A publish's target: the worker id and the process it meant by it ("": whoever holds it).
Meant = tuple[str, str]
_DEPARTED_IDS = 10_000  # worker ids whose last processes are remembered (for acked/claim)
_DEPARTED_PER_ID = 8  # processes remembered per worker id
_ALIVE_TTL_S = 0.2  # how long an answer of `alive` about a peer is taken as still true


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A snapshot of one worker, as `Publisher.workers` reports it.

    `version` is the last version it acknowledged (-1 before its first ack);
    `last_seen` is a ``time.time()`` timestamp of its last message; `lag` is how many
    versions it is behind the latest published one (0: it computes with the latest;
    None before its first ack, see `lag`).
    """

    worker_id: str
    pid: int
    host: str
    version: int
    mode: str
    transport: str
    last_seen: float
    lag: int | None = None


def lag(latest: int, acked: int) -> int | None:
    """How many versions a worker that acked `acked` is behind `latest` (never negative);
    None before its first ack (`acked` -1).

    The one formula behind every lag shown: ``Publisher.workers[id].lag``, inspect's
    lag column, ``zmqsync_worker_lag`` and top. It takes only what STATE carries too (the
    acked version, not the version a worker was welcomed with), so a reader in another
    process computes the same number as the publisher; a worker between its WELCOME and
    its first ACK (or stuck there) has no known lag, rather than looking as far behind
    as the bus is old.
    """
    return None if acked < 0 else max(0, latest - acked)


@dataclass(slots=True)
class Member:
    worker_id: str
    session: str
    pid: int
    host: str
    mode: str
    transport: str
    floor: int  # the version it was welcomed with: it never reads anything older
    acked: int = -1
    last_seen: float = 0.0  # monotonic
    process: str = ""  # the HELLO's nonce, else the session: which process this is
    heard: bool = False  # a message came from this session since its WELCOME
    peer: str = ""  # the connection's peer as libzmq saw it (see `_admission.peer_of`)

    @property
    def applied(self) -> int:
        """The newest version it is known to compute with: the one it acked, else (no
        ack yet) the one before its welcome, which it is about to replace."""
        return self.acked if self.acked >= 0 else self.floor - 1

    def busy_with(self, version: int, latest: int) -> bool:
        """Whether this worker may be reading `version` now or (alias) computing with it:
        any version after the one it acked (or from its floor) up to `latest`, and in
        alias mode the acked one itself."""
        start = self.floor if self.acked < self.floor else self.acked + 1
        if start <= version <= latest:
            return True
        return self.mode == "alias" and version == self.acked >= 0


def _always(peer: str) -> bool:
    return True


class Registry:
    """Members, slot contents and the slot-choice rule.

    Args:
        slots: slots in the buffer.
        first_word_s: a member not heard from since its WELCOME is dropped as silent only
            after this long at least (its handshake may take longer than a few short
            beats on a loaded host), and another process may claim its id after this
            long (0: the silence limit, as for any member).
        reserve_s: how long a dropped worker's id stays reserved for its process.
        max_per_peer: members one peer may hold (None: no limit).
        alive: whether the process behind a peer may still be running (False only when
            that is known: it lets a replacement in without waiting).
    """

    def __init__(
        self,
        slots: int,
        first_word_s: float = 0.0,
        *,
        reserve_s: float = 0.0,
        max_per_peer: int | None = None,
        alive: Callable[[str], bool] = _always,
    ) -> None:
        self.first_word_s, self.reserve_s = first_word_s, reserve_s
        self.max_per_peer, self._alive = max_per_peer, alive
        self.members: dict[str, Member] = {}
        self.per_peer: Counter[str] = Counter()  # peer -> members it holds
        self._liveness: dict[str, tuple[float, bool]] = {}  # peer -> (asked at, alive)
        # worker id -> (the member dropped, until when only its process may claim the id)
        self.reserved: dict[str, tuple[Member, float]] = {}
        self.displaced: dict[str, Member] = {}  # session -> replaced member (see above)
        self.slot_versions = [-1] * slots
        self.latest = -1
        self.home: int | None = None  # the trainer's own slot, never handed out (`reserve`)
        # worker id -> {process: last acked version} of the processes that held it and
        # left (for Publish.acked, and to tell a former holder its id is taken); bounded
        self.departed: dict[str, dict[str, int]] = {}
        # session -> worker id of the sessions dropped, replaced or gone; bounded (see
        # `PublisherRole.gone`: one still heard from missed its STOP)
        self.gone_sessions: dict[str, str] = {}

    # --- membership ---

    def claim(self, hello: Hello, now: float, silent_after: float) -> str | None:
        """Why `hello` may not take its worker id now (the ERROR reason), or None if it may.

        It may when the id is free and reserved for no other process, when the HELLO
        proves it comes from the process holding (or reserved) the id (its nonce, or the
        session), or when the holder is gone: known dead, silent past its reserve, or
        never heard from for `first_word_s`. Otherwise ``busy:`` (retried by real
        subscribers: the holder may still go), or ``taken:`` for a process that held the
        id before and finds another holding it now (final).
        """
        old = self.members.get(hello.worker_id)
        if old is None:
            kept = self.reserved.get(hello.worker_id)
            if kept is None or _same_process(hello, kept[0]):
                return None
            if now >= kept[1]:
                del self.reserved[hello.worker_id]
                return None
            return (
                f"busy: worker id {hello.worker_id!r} is kept for the process that held it "
                f"(pid {kept[0].pid}) for {kept[1] - now:.1f} s more, in case it re-joins; "
                "give each worker its own worker_id (the default is unique)"
            )
        if _same_process(hello, old) or self._gone(old, now, silent_after):
            return None
        if hello.nonce and hello.nonce in self.departed.get(hello.worker_id, ()):
            return (
                f"taken: worker id {hello.worker_id!r} belongs to another process now (pid "
                f"{old.pid}), which took it after this one was silent for longer than its "
                "id was kept; this worker's acks no longer count: restart it (under a "
                "worker_id of its own)"
            )
        return (
            f"busy: worker id {hello.worker_id!r} is in use by a live worker (pid {old.pid}); "
            "give each worker its own worker_id (the default is unique)"
        )

    def _gone(self, member: Member, now: float, silent_after: float) -> bool:
        """Whether another process may take `member`'s id now (see `claim`)."""
        if self._known_dead(member.peer, now):
            return True
        if not member.heard:
            return now - member.last_seen > (self.first_word_s or silent_after)
        return now - member.last_seen > silent_after + self.reserve_s

    def _known_dead(self, peer: str, now: float) -> bool:
        """`alive`, asked at most once per _ALIVE_TTL_S per peer: a storm of HELLOs for a
        live worker's id asks about its holder on every one (a /proc read each)."""
        seen = self._liveness.get(peer)
        if seen is None or now - seen[0] > _ALIVE_TTL_S or now < seen[0]:
            if len(self._liveness) >= _DEPARTED_IDS:
                self._liveness.clear()
            seen = self._liveness[peer] = (now, self._alive(peer))
        return not seen[1]

    def room_for(self, peer: str) -> bool:
        """Whether `peer` may hold one more member (see `max_per_peer`)."""
        return self.max_per_peer is None or self.per_peer[peer] < self.max_per_peer

    def join(self, hello: Hello, session: str, now: float, peer: str = "") -> Member:
        """Register a worker welcomed at `latest` from `peer`, replacing any member of its
        id.

        Call `claim` first. A replaced member that proved to be this same process is kept
        as displaced (its slot stays protected); one that went silent is simply gone.
        """
        member = Member(
            hello.worker_id,
            session,
            hello.pid,
            hello.host,
            hello.mode,
            hello.transport,
            floor=self.latest,
            last_seen=now,
            process=hello.nonce or session,
            peer=peer,
        )
        old = self.members.get(hello.worker_id)
        if old is not None:
            self._remember(old)
            if _same_process(hello, old):
                self.displaced[old.session] = old
        self.reserved.pop(hello.worker_id, None)
        self.members[hello.worker_id] = member
        self.per_peer[peer] += 1
        return member

    def meant(self, worker_ids: Iterable[str]) -> tuple[Meant, ...]:
        """Targets for a publish: each worker id with the process that holds it now."""
        members = self.members
        return tuple(
            (w, m.process if (m := members.get(w)) is not None else "") for w in worker_ids
        )

    def find(self, worker_id: str, session: str) -> Member | None:
        """The live member with this id *and* session; stale incarnations get None."""
        member = self.members.get(worker_id)
        return member if member is not None and member.session == session else None

    def ack(self, worker_id: str, session: str, version: int, now: float) -> bool:
        member = self.find(worker_id, session)
        if member is None or version > self.latest:
            return False
        member.last_seen, member.heard = now, True
        member.acked = max(member.acked, version)
        if self.displaced:  # the process computes with `version` now: it let go
            for old in [m for m in self.displaced.values() if m.worker_id == worker_id]:
                del self.displaced[old.session]
        return True

    def seen(self, worker_id: str, session: str, now: float) -> bool:
        member = self.find(worker_id, session)
        if member is not None:
            member.last_seen, member.heard = now, True
        return member is not None

    def leave(self, worker_id: str, session: str) -> Member | None:
        """A worker said BYE: gone, its id free for anyone at once."""
        member = self.find(worker_id, session)
        if member is not None:
            self._remember(self.members.pop(worker_id))
        return member

    def evict(self, worker_ids: Iterable[str], now: float) -> list[Member]:
        """Drop workers (a deadline gave up on them, or they went silent); the id of each
        that spoke and may be alive is reserved for its process until `now + reserve_s`."""
        gone = [m for w in worker_ids if (m := self.members.pop(w, None)) is not None]
        for member in gone:
            self._remember(member)
            if self.reserve_s > 0 and member.heard and self._alive(member.peer):
                if len(self.reserved) >= _DEPARTED_IDS:
                    self.reserved.pop(next(iter(self.reserved)))
                self.reserved[member.worker_id] = (member, now + self.reserve_s)
        return gone

    def _remember(self, member: Member) -> None:
        self.per_peer[member.peer] -= 1
        if self.per_peer[member.peer] <= 0:
            del self.per_peer[member.peer]
        gone = self.gone_sessions
        if len(gone) >= _DEPARTED_IDS:
            gone.pop(next(iter(gone)))
        gone[member.session] = member.worker_id
        departed = self.departed
        kept = departed.pop(member.worker_id, None)  # back in at the end: the newest
        if kept is None:
            kept = {}
            if len(departed) >= _DEPARTED_IDS:
                departed.pop(next(iter(departed)))
        kept.pop(member.process, None)
        kept[member.process] = member.acked
        if len(kept) > _DEPARTED_PER_ID:
            kept.pop(next(iter(kept)))
        departed[member.worker_id] = kept

    def acked(self, version: int, targets: Iterable[Meant]) -> list[str]:
        """Targets whose meant process acknowledged `version`, including ones that left
        since; an ack from another process holding the same worker id does not count."""
        out = []
        for w, process in targets:
            member = self.members.get(w)
            if member is not None and (not process or member.process == process):
                done = member.acked
            else:
                gone = self.departed.get(w, {})
                done = gone.get(process, -1) if process else max(gone.values(), default=-1)
            if done >= version:
                out.append(w)
        return out

    def silent(self, now: float, limit_s: float) -> list[str]:
        """Members silent for longer than `limit_s` (one never heard from since its
        WELCOME: `first_word_s` at least); displaced ones that are go at once."""
        for old in [m for m in self.displaced.values() if now - m.last_seen > limit_s]:
            del self.displaced[old.session]
        return [w for w, m in self.members.items() if self._silent(m, now, limit_s)]

    def _silent(self, member: Member, now: float, limit_s: float) -> bool:
        if not member.heard:
            limit_s = max(limit_s, self.first_word_s)
        return now - member.last_seen > limit_s

    # --- versions and slots ---

    def record(self, version: int, slot: int) -> None:
        self.slot_versions[slot] = version
        self.latest = version

    def reserve(self, slot: int | None) -> None:
        """Make `slot` the trainer's home (the flat layout kept in a slot: `_home`): it
        holds no version from now on and is never handed out; None: no home any more."""
        if slot is not None:
            self.slot_versions[slot] = -1
        self.home = slot

    def slot_of(self, version: int) -> int:
        return self.slot_versions.index(version)

    def holders(self, slot: int) -> list[str]:
        """Workers (members and displaced sessions) that stop `slot` from being written."""
        return [m.worker_id for m in self._holding(slot)]

    def _holding(self, slot: int) -> list[Member]:
        version = self.slot_versions[slot]
        if version < 0:
            return []
        single = len(self.slot_versions) == 1
        holders = [*self.members.values(), *self.displaced.values()]
        return [
            m
            for m in holders
            if m.busy_with(version, self.latest)
            and not (single and m.mode == "alias" and m.acked == version)
        ]

    def free_slot(self) -> int | None:
        """A slot that may be written now, oldest version first; None if all are held.

        Asked once per publish, over every member: the rule of `holders` (`busy_with`)
        is written out here, without a call or a list per member (64 workers: ~60 us
        less per publish on a cold trainer thread).
        """
        versions, latest = self.slot_versions, self.latest
        single = len(versions) == 1
        for slot in sorted(range(len(versions)), key=versions.__getitem__):
            if slot == self.home:
                continue
            version = versions[slot]
            if version < 0:
                return slot
            for m in (*self.members.values(), *self.displaced.values()):
                acked = m.acked
                if (m.floor if acked < m.floor else acked + 1) <= version <= latest or (
                    not single and version == acked >= 0 and m.mode == "alias"
                ):
                    break  # held
            else:
                return slot
        return None

    def blockers(self) -> list[str]:
        """Workers to blame or evict when no slot is free: the holders of the one slot
        that the fewest workers pin, so that a deadline drops only what blocks the next
        write. A slot is chosen by, in order: how many holders compute with its version
        (alias workers that acked it: the workers that did their part), how many hold it
        at all, and its version (oldest first)."""
        versions = self.slot_versions
        held = {s: self._holding(s) for s in range(len(versions)) if s != self.home}
        if not held:
            return []

        def cost(slot: int) -> tuple[int, int, int]:
            pinning = sum(1 for m in held[slot] if m.acked == versions[slot])
            return pinning, len(held[slot]), versions[slot]

        return sorted({m.worker_id for m in held[min(held, key=cost)]})

    def missing(self, version: int, targets: Iterable[Meant]) -> list[str]:
        """Targets whose meant process is still on the bus and has not acknowledged
        `version` (one whose id another process holds now is gone, not missing)."""
        members, out = self.members, []
        for w, process in targets:
            member = members.get(w)
            if member is not None and member.acked < version:
                if not process or member.process == process:
                    out.append(w)
        return out

    def lags(self, version: int, targets: Iterable[Meant]) -> dict[str, int]:
        """How many versions each target still on the bus is behind `version` (0: it
        applied `version` or a newer one); targets gone, or whose id another process
        holds now, are left out."""
        members, out = self.members, {}
        for w, process in targets:
            member = members.get(w)
            if member is not None and (not process or member.process == process):
                out[w] = max(0, version - member.applied)
        return out

    def alias_readers(self) -> bool:
        """Whether an alias-mode worker (member or displaced) is on the bus: each pins
        the slot it computes with, one slot less for versions in flight."""
        return any(m.mode == "alias" for m in (*self.members.values(), *self.displaced.values()))

    def copy_readers(self) -> bool:
        """Whether a copy-mode worker is a member: it copies each version out of its
        slot, which a publish from the flat layout's home slot runs beside its own copy."""
        return any(m.mode == "copy" for m in self.members.values())

    def infos(self, wall_offset: float) -> dict[str, WorkerInfo]:
        latest = self.latest
        return {
            w: WorkerInfo(
                w,
                m.pid,
                m.host,
                m.acked,
                m.mode,
                m.transport,
                m.last_seen + wall_offset,
                lag(latest, m.acked),
            )
            for w, m in self.members.items()
        }


def _same_process(hello: Hello, member: Member) -> bool:
    """Whether `hello` proves it comes from `member`'s process: its nonce, or the session."""
    if hello.nonce and hello.nonce == member.process:
        return True
    return bool(hello.session) and hello.session == member.session
