"""The subscriber's side of the link to a publisher, without I/O: decisions, not sockets.

A `Link` takes decoded messages and the time, and returns what to do. The subscriber's
agent thread owns the sockets: it decodes each frame (``_protocol.decode``), passes the
message to `Link.on_event` with the time it read, calls `Link.tick` once `Link.next_tick`
has passed, and carries out what they return. Tests drive a Link directly with an
explicit `now`. Nothing here reads a clock, a socket or shared memory: the version the
shared-memory header names as the latest is handed in (`welcome`, `repair`).

States::

    NEW --welcome--> ACTIVE --silence, STOP, eviction, a new publisher--> LOST
                       ^                                                 |
                       +--welcome (a handshake at once, then once a beat)-+
    LOST --a final refusal ("taken:")--> REFUSED
    any state --close--> CLOSED

Invariants (the ZeroMQ Guide's Clone client, with liveness):

1. **Each event once, in order.** An event (RECEIVE, STOP) with ``seq <= last_seq`` is
   dropped; ``last_seq`` starts at ``WELCOME.seq``, so a late joiner never applies twice
   what the WELCOME already covered. A jump in seq is counted (``gaps``).
2. **A missed event is repaired, never replayed.** A publisher HEARTBEAT carrying a seq
   newer than ``last_seq`` means an event was lost: the repair is the version the
   shared-memory header names as the latest, which is always the newest whole one.
3. **Only the bus joined counts.** A message of another bus is counted (``foreign``) and
   ignored, except a publisher's HEARTBEAT: a new publisher answers at the address, so
   the link is lost and the next handshake joins the new bus.
4. **Slots are checked against the bus.** A RECEIVE, or a header's latest, naming a slot
   outside ``[0, slots)`` is dropped and counted (``rejected``): it would index past the
   mapping.
5. **Liveness.** Any message of our bus is proof of life. An ACTIVE link becomes LOST
   when the publisher is silent for more than ``LOST_AFTER_BEATS`` heartbeats, on STOP
   for the bus (``stopped``) or for our session (evicted). LOST keeps the last whole
   version and asks for a handshake at once, then once per heartbeat (a worker that
   got CPU back after a long pause is back within a handshake, whatever the heartbeat),
   each with a deadline that grows while they fail (`rejoin_deadline`). Every HELLO
   carries the session held now and the worker's `nonce` (a secret drawn once per
   subscriber): they prove to the publisher that a re-join comes from this same
   process, also when the WELCOME of an earlier HELLO never arrived.
6. **Heartbeats only while ACTIVE,** one per heartbeat interval.
7. **A final refusal ends the re-joining.** A re-join refused with ``taken:`` (another
   process holds the worker id now, see `Registry.claim`) makes the link REFUSED:
   ``stopped``, the reason in ``refusal``, no session, no more handshakes. Any other
   refusal (``busy:``, ``bus full``) is retried on the next beat.
8. **CLOSED is final** and ignores everything.

Threads: one thread drives a Link (the agent's). Other threads only read single
attributes (`state`, `stopped`, `bus_id`, `session`, the counters).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TypeAlias

from ._config import FIRST_WORD_S, LOST_AFTER_BEATS, REJOIN_MIN_S
from ._protocol import Bye, Heartbeat, Hello, Message, Receive, Stop, Welcome
from ._worker_state import WorkerState

__all__ = [
    "FINAL_REFUSAL",
    "Action",
    "Handshake",
    "Link",
    "LinkState",
    "Lost",
    "Offer",
    "Rejected",
    "Repair",
    "Stopped",
]

_COUNTERS = ("rejected", "foreign", "gaps")
# What a publisher's ERROR starts with when no later HELLO of this process can succeed.
FINAL_REFUSAL = "taken:"


class LinkState(enum.Enum):
    # NEW: no WELCOME adopted yet.
    NEW = 0
    # ACTIVE: a WELCOME adopted; events applied in seq order, heartbeats both ways.
    ACTIVE = 1
    # LOST: silence, STOP or eviction: keep the last whole version, report
    #       connected == False, try a handshake at once, then once per heartbeat.
    LOST = 2
    # CLOSED: final; nothing more is done or sent.
    CLOSED = 3
    # REFUSED: a re-join was refused for good (the worker id belongs to another process
    #          now): keep the last whole version, stopped, no more handshakes.
    REFUSED = 4


_QUIET = (LinkState.NEW, LinkState.CLOSED, LinkState.REFUSED)  # no beats, no handshakes


# --- what a Link asks its owner to do ------------------------------------------------------


@dataclass(slots=True)  # not frozen: that costs ~0.25 us per version; never changed
class Offer:
    """Apply version `version` from slot `slot` of bus `bus` (or a newer one the header
    names), then ACK the version applied. `changed`: RECEIVE's bitmap of the tensors
    that changed since the version before (empty: all of them)."""

    bus: str
    version: int
    slot: int
    changed: bytes = b""


@dataclass(frozen=True, slots=True)
class Repair:
    """An event was missed: read the header's latest and pass it to `Link.repair`."""


@dataclass(frozen=True, slots=True)
class Lost:
    """The link went from ACTIVE to LOST just now, for `reason` (peer text: print it
    escaped). Waiters must look again: ``connected`` is False (and maybe ``stopped``)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Stopped:
    """The publisher closed the bus while the link was already LOST: ``stopped`` is True
    now, so waiters must look again."""

    reason: str


@dataclass(frozen=True, slots=True)
class Rejected:
    """A message of our bus broke a rule and was dropped (counted): `reason`, for a log."""

    reason: str


@dataclass(frozen=True, slots=True)
class Handshake:
    """LOST: try a handshake now (HELLO from `Link.hello`, then `Link.welcome`)."""


# A Heartbeat in what `tick` returns is a message to send on the acks socket.
Action: TypeAlias = Offer | Repair | Lost | Stopped | Rejected | Handshake | Heartbeat


class Link:
    """The subscriber's side of one link: session, bus, seq, slots, liveness, state.

    Args:
        worker_id: this worker's id (in HELLO, HEARTBEAT and BYE).
        mode: "copy" or "alias" (in HELLO).
        counters: where to count ``rejected``, ``foreign`` and ``gaps`` (the keys are
            added if missing); None: a new dict.
        nonce: the secret this worker sends in every HELLO (32 hex digits, drawn once by
            its owner): proves to the publisher that each HELLO comes from this process.
        shared: where ``last_seq`` and ``last_heard`` live (its owner's, which the
            native follower writes too); None: a new one.
    """

    def __init__(
        self,
        worker_id: str,
        mode: str,
        counters: dict[str, int] | None = None,
        nonce: str = "",
        shared: WorkerState | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.mode = mode
        self.nonce = nonce
        self.state = LinkState.NEW
        self.bus_id = ""  # of the WELCOME adopted last
        self.session = ""  # ours on that bus: proves a re-join, echoed in ACK/HEARTBEAT/BYE
        # last_seq (events up to it are covered) and last_heard (when a message of our
        # bus last arrived) live in `shared`, which the native follower writes too
        self.shared = shared if shared is not None else WorkerState()
        self.slots = 0  # of that bus: a slot outside [0, slots) is not ours to read
        self.heartbeat = 0.5  # interval, seconds (the publisher's)
        self.next_tick = 0.0  # `tick` has nothing to do before this
        self.stopped = False  # the publisher closed the bus (until a WELCOME), or refused us
        self.refusal = ""  # REFUSED: the publisher's reason
        self._rejoin_s = 0.0  # the next re-join's deadline, once one failed (0: the floor)
        self.counters = counters if counters is not None else {}
        for key in _COUNTERS:
            self.counters.setdefault(key, 0)

    @property
    def last_seq(self) -> int:
        """Events up to this seq are covered."""
        return self.shared.last_seq

    @last_seq.setter
    def last_seq(self, seq: int) -> None:
        self.shared.last_seq = seq

    @property
    def last_heard(self) -> float:
        """When a message of our bus last arrived (monotonic seconds)."""
        return self.shared.last_heard

    @last_heard.setter
    def last_heard(self, now: float) -> None:
        self.shared.last_heard = now

    @property
    def connected(self) -> bool:
        return self.state is LinkState.ACTIVE

    # --- handshake -------------------------------------------------------------------------

    def hello(self, pid: int, host: str, transport: str, note: str) -> Hello:
        """The HELLO to send now: the session held now ("" before the first WELCOME) and
        the nonce, the same in every HELLO."""
        return Hello(
            "", self.worker_id, pid, host, self.mode, transport, note, self.session, self.nonce
        )

    def rejoin_deadline(self) -> float:
        """Seconds the re-join asked for now may take (see invariant 5).

        Two beats, but at least REJOIN_MIN_S: on a loaded host a handshake (a WELCOME of
        thousands of tensors decoded, the buffers mapped, the subscription confirmed)
        takes longer than two short beats. Doubled after each attempt that failed
        (`rejoin_failed`), up to what the publisher waits for a new session's first word
        (FIRST_WORD_S, or six beats if longer): a re-join that had to fit in a fixed
        time might never converge, and one that takes longer than that would be
        dropped before it could say a word.
        """
        floor = max(2 * self.heartbeat, REJOIN_MIN_S)
        ceiling = max(FIRST_WORD_S, LOST_AFTER_BEATS * self.heartbeat)
        return min(max(floor, self._rejoin_s), ceiling)

    def rejoin_failed(self, seconds: float) -> None:
        """A re-join given `seconds` failed: the next one gets twice as long."""
        self._rejoin_s = 2 * seconds

    def refused(self, reason: str) -> Stopped | None:
        """A handshake was refused with `reason`. Stopped when that is final (a re-join
        told ``taken:``): the link is REFUSED, holds no session and asks for no more
        handshakes. None otherwise: the next beat tries again (or start() reports it)."""
        if self.state is not LinkState.LOST or not reason.startswith(FINAL_REFUSAL):
            return None
        self.state, self.stopped, self.refusal, self.session = LinkState.REFUSED, True, reason, ""
        return Stopped(reason)

    def fallback_hello(self, hello: Hello, welcome: Welcome, transport: str, note: str) -> Hello:
        """A second HELLO registering another transport (the CUDA buffer `welcome` offered
        cannot be mapped here; `note` says why). It carries the session that `welcome`
        gave: the worker id is that session's now, and only it may claim the id again."""
        return dataclasses.replace(
            hello, transport=transport, transport_note=note, session=welcome.session
        )

    def welcome(self, welcome: Welcome, now: float, latest: tuple[int, int] | None) -> Offer | None:
        """Adopt a WELCOME whose buffers are mapped: the link is ACTIVE on its bus.

        Args:
            welcome: the publisher's answer to the last HELLO.
            now: the time (monotonic seconds).
            latest: (version, slot) the bus's header names as the latest, or None.

        Returns:
            The version to apply and ACK: the WELCOME's, or a newer one the header
            already names (its RECEIVE may have gone out before the subscription was
            live). None when CLOSED.
        """
        if self.state is LinkState.CLOSED:
            return None
        self.state, self.stopped, self._rejoin_s = LinkState.ACTIVE, False, 0.0
        self.bus_id, self.session, self.slots = welcome.bus, welcome.session, welcome.slots
        self.last_seq, self.heartbeat, self.last_heard = welcome.seq, welcome.heartbeat, now
        self.next_tick = min(self.next_tick, now + welcome.heartbeat)
        newer = self._latest(latest)
        if newer is not None and newer.version > welcome.version:
            return newer
        return Offer(welcome.bus, welcome.version, welcome.slot)

    # --- events ----------------------------------------------------------------------------

    def on_event(
        self, msg: Message, now: float
    ) -> Offer | Repair | Lost | Stopped | Rejected | None:
        """What to do with a message from the events socket, received at `now`."""
        if self.state is LinkState.CLOSED:
            return None
        if msg.bus != self.bus_id:
            self.counters["foreign"] += 1
            if isinstance(msg, Heartbeat) and not msg.worker_id:
                return self._lose("a new publisher answers at the address")
            return None
        if isinstance(msg, Receive):  # first: one per version
            return self.on_receive(msg.seq, msg.version, msg.slot, msg.changed, now)
        self.last_heard = now
        if isinstance(msg, Stop):
            if self._seen(msg.seq):
                return None
            if not msg.session:
                self.stopped = True
                why = f"publisher sent STOP ({msg.reason})"
                lost = self._lose(why)
                return lost if lost is not None else Stopped(why)
            if msg.session == self.session:
                return self._lose(f"evicted ({msg.reason})")
            return None  # another worker was evicted
        if isinstance(msg, Heartbeat) and msg.seq > self.last_seq:
            self.counters["gaps"] += 1  # missed an event: the header names the latest
            self.last_seq = msg.seq
            return Repair()
        return None

    def on_receive(
        self, seq: int, version: int, slot: int, changed: bytes, now: float
    ) -> Offer | Rejected | None:
        """What to do with a RECEIVE of our bus (its fields, from `read_receive`, or
        from `on_event`), received at `now`. One per version: the rule of `_seen` is
        written out here rather than called. Mirrored in C by Follower.next
        (``_follower.c``) for the RECEIVEs it takes."""
        if self.state is LinkState.CLOSED:
            return None
        shared = self.shared
        shared.last_heard = now
        if slot >= self.slots:
            self.counters["rejected"] += 1
            return Rejected(f"RECEIVE v{version} for slot {slot} of {self.slots}")
        last = shared.last_seq
        if seq <= last:
            return None
        if seq > last + 1:
            self.counters["gaps"] += 1
        shared.last_seq = seq
        return Offer(self.bus_id, version, slot, changed)

    def on_invalid(self) -> None:
        """A frame on the events socket that is not a valid message: count it."""
        if self.state is not LinkState.CLOSED:
            self.counters["rejected"] += 1

    def repair(self, latest: tuple[int, int] | None) -> Offer | None:
        """After `Repair`: the version to offer, given the header's (version, slot)."""
        if self.state is LinkState.CLOSED:
            return None
        return self._latest(latest)

    # --- the clock -------------------------------------------------------------------------

    def tick(self, now: float, version: int) -> tuple[Heartbeat | Lost | Handshake, ...]:
        """What is due at `now` (nothing before `next_tick`); `version` is the one the
        worker computes with, for its HEARTBEAT."""
        if now < self.next_tick or self.state in _QUIET:
            return ()
        self.next_tick = now + self.heartbeat
        if self.state is LinkState.LOST:
            return (Handshake(),)
        beat = Heartbeat(self.bus_id, 0, self.worker_id, self.session, max(version, -1))
        if now - self.last_heard > self.heartbeat * LOST_AFTER_BEATS:
            lost = self._lose("publisher silent")
            assert lost is not None
            return (beat, lost)
        return (beat,)

    # --- the end ---------------------------------------------------------------------------

    def close(self) -> Bye | None:
        """CLOSED from now on. Returns the BYE to send, if this worker holds a session."""
        if self.state is LinkState.CLOSED:
            return None
        self.state = LinkState.CLOSED
        return Bye(self.bus_id, self.worker_id, self.session) if self.session else None

    # --- rules -----------------------------------------------------------------------------

    def _seen(self, seq: int) -> bool:
        """Whether the event numbered `seq` is covered already; if not, it is the last."""
        if seq <= self.last_seq:
            return True
        if seq > self.last_seq + 1:
            self.counters["gaps"] += 1
        self.last_seq = seq
        return False

    def _latest(self, latest: tuple[int, int] | None) -> Offer | None:
        if latest is None:
            return None
        version, slot = latest
        if slot >= self.slots:
            self.counters["rejected"] += 1
            return None
        return Offer(self.bus_id, version, slot)

    def _lose(self, reason: str) -> Lost | None:
        if self.state is not LinkState.ACTIVE:
            return None
        self.state = LinkState.LOST
        self.next_tick = 0.0  # the first handshake at once: a beat may be long
        return Lost(reason)
