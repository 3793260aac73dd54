"""Which connections a publisher's bound sockets keep: the rules, without I/O.

libzmq tells a publisher about a connection at two moments, and each moment can decide
something different:

* **At accept**, a monitor event names the connection by its descriptor number, and it
  comes late: by the time it is read, that connection may be gone and its number
  reused by a newer one. Descriptors are what the process runs out of, so this is where
  the **file descriptor budget** is kept (`Budget`): every accepted connection counts,
  handshake or not. A connection past the budget must be shut down, and the only handle
  on it is its number, so a refusal is a `Refusal` that names the number *and* the last
  event seen about it: the socket loop acts on it only once it has proven that no event
  about that number came since (libzmq reports a disconnection before it closes the
  descriptor, so "no event since, after taking a duplicate of the descriptor" means the
  duplicate is that very connection). Never a number alone.
* **At the handshake**, libzmq asks a ZAP handler about exactly one connection, once its
  ZMTP greeting (or, with CURVE, the client's proof of its key) is done, and closes it
  itself on a "no". The peer comes with the request: for ipc:// its process id (libzmq
  reads SO_PEERCRED), for tcp:// its source address. This is where **connection rates**
  are kept (`Admission`), per peer, so that only connections that got this far count: a
  process that connects and closes in a tight loop, or a client without the CURVE keys,
  never reaches it and costs no worker anything.

What a *peer* is follows from what the transport tells apart. On ipc:// it is a process
(SO_PEERCRED's pid as this pid namespace sees it; 0 for processes it cannot see, which
then share one peer). On tcp:// it is the source IP address: a host. On loopback tcp
every local process is the same peer, 127.0.0.1; telling them apart would mean mapping
each connection's port to a process through /proc (an O(processes x descriptors) scan
per connection), which costs more than the storm it would stop. So on loopback tcp the
guarantee below holds for the whole host, and a local process can spend the rate of
the local processes that are not workers (sniffers): use ipc://, or CURVE, where a
process needs the keys to get this far.

The guarantees:

* **A welcomed worker is not refused at its events or acks connect.** A peer from which
  a HELLO was welcomed is a *member* for `grace` seconds (the agent renews it while that
  worker is on the bus): its connections are counted apart from everyone else's, at
  MEMBER_FACTOR times one peer's rate (a worker connects once per handshake: honest
  members never come near it), and past the descriptor budget it still gets `headroom`
  connections that nobody else can take (the budget keeps a reserve of descriptors for
  exactly such overshoots). A member is not exempt: a process that joined once as a
  worker, and then storms, is held to the member rate like anyone to theirs. The peer of
  a HELLO is the one libzmq saw on that control connection, not what the HELLO says.
* **No group of peers locks a newcomer out.** Peers that are not members share a total
  rate (TOTAL_FACTOR times one peer's), which bounds what cycling through many process
  ids can buy. Many peers storming together spend that total as fast as it refills; a
  peer that has been quiet (its own bucket full: it is new, or made no connection for
  the last two seconds, as a sniffer or a worker's first connect) then still gets in
  through a lane of its own, as large as the total again, which a storming peer (its
  bucket never full) cannot use. Only a storm that starts new processes faster than
  that lane refills spends it, one process per connection.

Everything here is bounded: peers tracked (least recently seen forgotten first; a
forgotten peer comes back with a full bucket, so the total and the quiet lane bound what
cycling through many process ids can buy), members, connections counted (by the
descriptor budget itself).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict

__all__ = ["Admission", "Budget", "Refusal", "Verdict", "peer_of"]

MAX_PEERS = 4096  # peers (and member peers) remembered at once
TOTAL_FACTOR = 4  # every non-member peer together: this many times one peer's rate
QUIET_FACTOR = TOTAL_FACTOR  # the quiet peers' own lane, when the total is spent
MEMBER_FACTOR = 4  # one member peer: this many times a non-member peer's rate
UNKNOWN_PEER = "?"


def peer_of(address: str, *, ipc: bool) -> str:
    """The peer named by libzmq's address of a connection (a ZAP request's address, a
    message's Peer-Address property): ``pid N`` on ipc:// (libzmq appends
    ``:uid:gid:pid`` from SO_PEERCRED), the source IP address on tcp://."""
    if ipc:
        parts = address.rsplit(":", 3)
        if len(parts) == 4 and parts[3].isdigit():
            return f"pid {int(parts[3])}"
        return UNKNOWN_PEER
    return address or UNKNOWN_PEER


class Verdict(enum.Enum):
    """What `Admission.admit` says about one connection."""

    ALLOW = "allowed"
    PEER_RATE = "its peer connects faster than allowed"
    TOTAL_RATE = "peers that are not workers connect faster than allowed together"
    MEMBER_RATE = "its peer, a worker's, connects faster than a worker's allowance"

    @property
    def allowed(self) -> bool:
        return self is Verdict.ALLOW


class _Bucket:
    """A token bucket: `rate` tokens a second, at most `burst` kept, starts full."""

    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def ready(self, now: float) -> bool:
        """Whether a token is there (refilled up to `now`; a clock going back adds none)."""
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
        return self.tokens >= 1

    def take(self) -> None:
        self.tokens -= 1

    @property
    def full(self) -> bool:
        """Whether it holds all but at most one token (read after `ready`): its peer
        made no connection to speak of for a whole burst's worth of time."""
        return self.tokens >= self.burst - 1


class Admission:
    """Connection rates per peer at the handshake, members apart (see module doc).

    Args:
        rate: connections a second one peer may make (a burst of two seconds' worth).
        now: the clock's value at creation (any monotonic clock, in seconds).
        grace: how long a peer stays a member after its last welcome or renewal.
        max_peers: peers remembered at once, and member peers at once.
    """

    def __init__(
        self, rate: float, *, now: float, grace: float = 30.0, max_peers: int = MAX_PEERS
    ) -> None:
        if rate <= 0 or grace <= 0 or max_peers < 1:
            raise ValueError("rate and grace must be > 0 and max_peers >= 1")
        self.rate, self.grace, self.max_peers = rate, grace, max_peers
        self._peers: OrderedDict[str, _Bucket] = OrderedDict()  # least recently seen first
        # member peer -> (member until, its own bucket at MEMBER_FACTOR * rate)
        self._members: OrderedDict[str, tuple[float, _Bucket]] = OrderedDict()
        self._total = _Bucket(TOTAL_FACTOR * rate, 2 * TOTAL_FACTOR * rate, now)
        self._quiet = _Bucket(QUIET_FACTOR * rate, 2 * QUIET_FACTOR * rate, now)
        self.refused: dict[Verdict, int] = {v: 0 for v in Verdict if v is not Verdict.ALLOW}

    def welcome(self, peer: str, now: float) -> None:
        """A worker from `peer` was welcomed, or is still on the bus: a member until
        `now + grace`."""
        if peer == UNKNOWN_PEER:
            return
        kept = self._members.pop(peer, None)
        if kept is None:
            member_rate = MEMBER_FACTOR * self.rate
            bucket = _Bucket(member_rate, 2 * member_rate, now)
        else:
            bucket = kept[1]
        self._members[peer] = (now + self.grace, bucket)
        while len(self._members) > self.max_peers:
            self._members.popitem(last=False)

    def is_member(self, peer: str, now: float) -> bool:
        return self._membership(peer, now) is not None

    def _membership(self, peer: str, now: float) -> _Bucket | None:
        kept = self._members.get(peer)
        if kept is None:
            return None
        if now > kept[0]:
            del self._members[peer]
            return None
        return kept[1]

    def admit(self, peer: str, now: float) -> Verdict:
        """May one more connection from `peer` (whose handshake is done) stay?"""
        verdict = self._verdict(peer, now)
        if verdict is not Verdict.ALLOW:
            self.refused[verdict] += 1
        return verdict

    def _verdict(self, peer: str, now: float) -> Verdict:
        member = self._membership(peer, now)
        if member is not None:
            if not member.ready(now):
                return Verdict.MEMBER_RATE
            member.take()
            return Verdict.ALLOW
        bucket = self._peers.get(peer)
        if bucket is None:
            bucket = self._peers[peer] = _Bucket(self.rate, 2 * self.rate, now)
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
        if not bucket.ready(now):
            return Verdict.PEER_RATE
        if self._total.ready(now):
            self._total.take()
        elif bucket.full and self._quiet.ready(now):
            self._quiet.take()  # the total is spent by others: a quiet peer's own lane
        else:
            return Verdict.TOTAL_RATE
        bucket.take()
        return Verdict.ALLOW

    @property
    def peers(self) -> int:
        """Peers remembered now (bounded by `max_peers`)."""
        return len(self._peers)

    @property
    def members(self) -> int:
        """Member peers remembered now, expired ones included until looked at."""
        return len(self._members)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A connection to shut down, named so that a reused number is never taken for it.

    Attributes:
        socket: the bound socket's key (its endpoint).
        fd: the connection's descriptor number when it was reported.
        serial: the serial of the last event about `fd` on `socket` when this was
            decided; while it is still the last one (`Budget.current`), the connection
            on `fd` is the one meant.
        oldest: it is the oldest control connection, closed to make room (else a
            connection past the budget, which a member may still keep: `Budget.keep`).
    """

    socket: str
    fd: int
    serial: int
    oldest: bool = False


class Budget:
    """The file descriptor budget: connections per bound socket, from monitor events.

    Worker sockets (events, acks, tap) share `limit`; past it a new connection is refused,
    and the ones already there stay. Control connections carry one request each and are
    counted apart: past `control_limit` the *oldest* is refused to make room, so a peer
    holding control connections open cannot keep a worker from hearing "bus full".
    Members may go past `limit` by `headroom` connections (see `keep`).

    Events are numbered (`serial`) as they are fed, and the last number per descriptor
    is kept, which is what `current` and `changed_after` compare.
    """

    def __init__(self, limit: int, control_limit: int, headroom: int = 0) -> None:
        self.limit, self.control_limit, self.headroom = limit, control_limit, headroom
        self.serial = 0
        # socket -> descriptors counted, oldest first (a dict keeps insertion order)
        self._live: dict[str, dict[int, None]] = {}
        self._last: dict[str, dict[int, int]] = {}  # socket -> descriptor -> last serial
        self._control: set[str] = set()

    def watch(self, socket: str, *, control: bool = False) -> None:
        self._live[socket] = {}
        self._last[socket] = {}
        if control:
            self._control.add(socket)

    @property
    def count(self) -> int:
        """Workers' connections (control connections are counted apart)."""
        return sum(len(fds) for s, fds in self._live.items() if s not in self._control)

    @property
    def total(self) -> int:
        return sum(len(fds) for fds in self._live.values())

    def full(self, more: int = 0) -> bool:
        """Whether `more` new worker connections would go past the budget."""
        return self.count + more > self.limit

    def accepted(self, socket: str, fd: int) -> Refusal | None:
        """A connection accepted on `socket` as `fd`: counted, or a refusal."""
        self.serial += 1
        self._last[socket][fd] = self.serial
        live = self._live[socket]
        if socket in self._control:
            refusal = None
            if len(live) >= self.control_limit:
                oldest = next(iter(live))
                del live[oldest]
                refusal = Refusal(socket, oldest, self._last[socket][oldest], oldest=True)
            live[fd] = None
            return refusal
        if self.count >= self.limit:
            return Refusal(socket, fd, self.serial)
        live[fd] = None
        return None

    def disconnected(self, socket: str, fd: int) -> None:
        """The connection on `fd` left `socket` (libzmq closes the descriptor next)."""
        self.serial += 1
        self._last[socket][fd] = self.serial
        self._live[socket].pop(fd, None)

    def current(self, refusal: Refusal) -> bool:
        """Whether no event about the refused connection's number came since: then the
        connection on that number is still the one the refusal means."""
        return self._last[refusal.socket].get(refusal.fd) == refusal.serial

    def changed_after(self, socket: str, fd: int, serial: int) -> bool:
        """Whether a connection was accepted or left on `fd` after event `serial`."""
        return self._last[socket].get(fd, 0) > serial

    def keep(self, refusal: Refusal) -> bool:
        """A refused connection turned out to be a member's: kept (and counted) if the
        headroom past the limit has room and it is still the one meant."""
        if refusal.oldest or not self.current(refusal):
            return False
        if self.count >= self.limit + self.headroom:
            return False
        self._live[refusal.socket][refusal.fd] = None
        return True
