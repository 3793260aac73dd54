"""Who is on the bus, what each worker holds, which slots may be written. No I/O, no thread.

The publisher's agent thread and its user-facing methods both drive this under one
lock; tests drive it directly with an explicit `now`.

Invariant: **a slot that a live worker may be reading, or (alias mode) computes with, is
never handed out for writing** — except with slots=1, where the only slot must be
rewritten under the seqlock while alias readers hold it (they detect it; see
`Subscriber.reading`).

Identity: a worker id belongs to one live session at a time. A HELLO for an id whose
session is alive is refused (`claim`) unless it carries that session, the proof that it
comes from the same process re-joining; two processes that share an id by accident, or
a peer that forges one, cannot take over a live worker's place. The session a re-join
replaces is *displaced*: it is no longer a member (no acks expected, told STOP), but the
slot it may still compute with stays protected until the new session acks (the process
has moved on) or it goes silent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ._protocol import Hello

__all__ = ["Member", "Registry", "WorkerInfo"]


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A snapshot of one worker, as `Publisher.workers` reports it.

    `version` is the last version it acknowledged (-1 before its first ack);
    `last_seen` is a ``time.time()`` timestamp of its last message.
    """

    worker_id: str
    pid: int
    host: str
    version: int
    mode: str
    transport: str
    last_seen: float


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

    def busy_with(self, version: int, latest: int) -> bool:
        """Whether this worker may be reading `version` now or (alias) computing with it:
        any version after the one it acked (or from its floor) up to `latest`, and in
        alias mode the acked one itself."""
        start = self.floor if self.acked < self.floor else self.acked + 1
        if start <= version <= latest:
            return True
        return self.mode == "alias" and version == self.acked >= 0


class Registry:
    """Members, slot contents and the slot-choice rule."""

    def __init__(self, slots: int) -> None:
        self.members: dict[str, Member] = {}
        self.displaced: dict[str, Member] = {}  # session -> replaced member (see above)
        self.slot_versions = [-1] * slots
        self.latest = -1
        # last acked version of workers that left (for Publish.acked); bounded
        self.departed: dict[str, int] = {}

    # --- membership ---

    def claim(self, hello: Hello, now: float, silent_after: float) -> str | None:
        """Why `hello` may not take its worker id now, or None if it may.

        It may when the id is free, when the HELLO proves it is the same process (it
        carries the live session), or when the live session has been silent for longer
        than `silent_after` (its process is gone; the sweep just has not run yet).
        """
        old = self.members.get(hello.worker_id)
        if old is None or (hello.session and hello.session == old.session):
            return None
        if now - old.last_seen > silent_after:
            return None
        return (
            f"worker id {hello.worker_id!r} is in use by a live worker (pid {old.pid}); "
            "give each worker its own worker_id (the default is unique)"
        )

    def join(self, hello: Hello, session: str, now: float) -> Member:
        """Register a worker welcomed at `latest`, replacing any member of its id.

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
        )
        old = self.members.get(hello.worker_id)
        if old is not None:
            self._remember(old)
            if hello.session == old.session:
                self.displaced[old.session] = old
        self.members[hello.worker_id] = member
        return member

    def find(self, worker_id: str, session: str) -> Member | None:
        """The live member with this id *and* session; stale incarnations get None."""
        member = self.members.get(worker_id)
        return member if member is not None and member.session == session else None

    def ack(self, worker_id: str, session: str, version: int, now: float) -> bool:
        member = self.find(worker_id, session)
        if member is None or version > self.latest:
            return False
        member.last_seen = now
        member.acked = max(member.acked, version)
        if self.displaced:  # the process computes with `version` now: it let go
            for old in [m for m in self.displaced.values() if m.worker_id == worker_id]:
                del self.displaced[old.session]
        return True

    def seen(self, worker_id: str, session: str, now: float) -> bool:
        member = self.find(worker_id, session)
        if member is not None:
            member.last_seen = now
        return member is not None

    def leave(self, worker_id: str, session: str) -> Member | None:
        member = self.find(worker_id, session)
        if member is not None:
            self._remember(self.members.pop(worker_id))
        return member

    def evict(self, worker_ids: Iterable[str]) -> list[Member]:
        gone = [m for w in worker_ids if (m := self.members.pop(w, None)) is not None]
        for member in gone:
            self._remember(member)
        return gone

    def _remember(self, member: Member) -> None:
        if len(self.departed) >= 10_000:
            self.departed.pop(next(iter(self.departed)))
        self.departed[member.worker_id] = member.acked

    def acked(self, version: int, targets: Iterable[str]) -> list[str]:
        """Targets that acknowledged `version`, including ones that left since."""
        out = []
        for w in targets:
            member = self.members.get(w)
            done = member.acked if member is not None else self.departed.get(w, -1)
            if done >= version:
                out.append(w)
        return out

    def silent(self, now: float, limit_s: float) -> list[str]:
        """Members silent for longer than `limit_s`; displaced ones that are go at once."""
        for old in [m for m in self.displaced.values() if now - m.last_seen > limit_s]:
            del self.displaced[old.session]
        return [w for w, m in self.members.items() if now - m.last_seen > limit_s]

    # --- versions and slots ---

    def record(self, version: int, slot: int) -> None:
        self.slot_versions[slot] = version
        self.latest = version

    def slot_of(self, version: int) -> int:
        return self.slot_versions.index(version)

    def holders(self, slot: int) -> list[str]:
        """Workers (members and displaced sessions) that stop `slot` from being written."""
        version = self.slot_versions[slot]
        if version < 0:
            return []
        single = len(self.slot_versions) == 1
        holders = [*self.members.values(), *self.displaced.values()]
        return [
            m.worker_id
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
        """Workers holding slots when none is free (the ones to blame or evict)."""
        return sorted({w for s in range(len(self.slot_versions)) for w in self.holders(s)})

    def missing(self, version: int, targets: Iterable[str]) -> list[str]:
        """Targets still on the bus that have not acknowledged `version`."""
        return [w for w in targets if w in self.members and self.members[w].acked < version]

    def infos(self, wall_offset: float) -> dict[str, WorkerInfo]:
        return {
            w: WorkerInfo(w, m.pid, m.host, m.acked, m.mode, m.transport, m.last_seen + wall_offset)
            for w, m in self.members.items()
        }
