"""How many connections a publisher holds, and which ones it keeps: the socket side.

Every connection to a bound socket is one file descriptor. libzmq accepts connections on
its own thread, as many as peers make, and when the process runs out of descriptors its
ipc:// listener aborts the whole process (an assertion on EMFILE in accept). A bus must
therefore never let connections take the last descriptors:

* At start the soft RLIMIT_NOFILE is raised to the hard limit, as long-running servers
  do (the soft default of 1024 cannot hold the default `max_workers=1024`: each worker
  holds two connections). A limit that cannot hold a bus at all is an error at start
  (`FdLimitTooLow`), never an abort later.
* The budget for connections is the soft limit minus the descriptors already open and a
  reserve for the process itself (files, torch, the user's own sockets).

`Gate` carries out the rules of `_admission` (read that module's doc first): it feeds
the monitor events of every bound socket to the `Budget` and shuts down what it refuses
only once proven to be that connection, and it answers libzmq's ZAP requests (the CURVE
allowlist, and `Admission`'s per-peer rates on the events and tap sockets), which decide
for exactly one connection each. Only the thread that owns the sockets uses it.
"""

from __future__ import annotations

import collections
import logging
import os
import resource
import struct
import time
from collections.abc import Callable

import zmq

from ._admission import UNKNOWN_PEER, Admission, Budget, Refusal, Verdict, peer_of
from ._config import CONTROL_CONNECTIONS, FD_RESERVE_MIN
from ._errors import FdLimitTooLow
from ._sockets import NOBLOCK, duplicate, shut_down, socket_peer

__all__ = [
    "Gate",
    "connection_budget",
    "open_descriptors",
    "peer_alive",
    "raise_fd_limit",
]

log = logging.getLogger(__name__)

_FD_CEILING = 1 << 20  # soft limits above this only make descriptor tables bigger
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_ACCEPTED, _DISCONNECTED = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED)
_EVENT = struct.Struct("=HI")  # a monitor event's first frame: event, value (the fd)
_WARN_EVERY_S = 10.0
_EVENTS_PER_TURN = 4096  # monitor events read per turn (a proof reads on to the end)
_REFUSALS_PER_TURN = 256  # refusals carried out per turn; the rest wait for the next
_ZAP_PER_TURN = 256  # ZAP requests answered per turn
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq sends them (RFC 27)
MIN_CONNECTIONS = CONTROL_CONNECTIONS + 8  # what a bus needs: control, and a few workers
HEADROOM = FD_RESERVE_MIN // 2  # members' connections past the budget, out of the reserve


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE toward the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _FD_CEILING if hard == resource.RLIM_INFINITY else min(hard, _FD_CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # a container may forbid it
            log.debug("could not raise the file descriptor limit to %d: %s", target, exc)
        else:
            log.debug("raised the file descriptor limit from %d to %d", soft, target)
            soft = target
    return _FD_CEILING if soft == resource.RLIM_INFINITY else soft


def _reserve(soft_limit: int) -> int:
    # A quarter: libzmq keeps accepting while the agent thread waits for a CPU, and on
    # a loaded machine a same-uid process connecting in a tight loop filled an eighth.
    return max(FD_RESERVE_MIN, soft_limit // 4)


def connection_budget(soft_limit: int, in_use: int) -> int:
    """How many connections a bus may hold with `in_use` descriptors open already.

    Raises:
        FdLimitTooLow: the limit leaves fewer than MIN_CONNECTIONS after the reserve. A
            smaller budget would not fit the control connections, and a floor above the
            limit let a connection storm take the last descriptor: libzmq's abort.
    """
    budget = soft_limit - in_use - _reserve(soft_limit)
    if budget >= MIN_CONNECTIONS:
        return budget
    needed = in_use + MIN_CONNECTIONS + FD_RESERVE_MIN
    while needed - in_use - _reserve(needed) < MIN_CONNECTIONS:
        needed += 1
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    raise FdLimitTooLow(
        f"the file descriptor limit ({soft_limit}, hard limit {hard_text}) cannot hold a "
        f"bus: it needs at least {needed} ({in_use} open now, {_reserve(needed)} kept free, "
        f"{MIN_CONNECTIONS} for connections). Raise the hard limit before starting the "
        "publisher (`ulimit -n 4096` in its shell, LimitNOFILE= in a systemd unit, "
        "--ulimit nofile= for docker)",
        limit=soft_limit,
        needed=needed,
    )


def open_descriptors() -> int:
    """Descriptors open in this process now (once, at start: listing them costs O(n))."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return FD_RESERVE_MIN


def peer_alive(peer: str) -> bool:
    """Whether the process behind `peer` (see `_admission.peer_of`) may still run: False
    only for an ipc:// peer of this pid namespace whose process has exited (a zombie
    included). A host, pid 0 (another pid namespace) or an unknown peer may be alive.

    It lets a worker's replacement in at once (a restarted worker keeping its id) instead
    of after the id's reserve; read only when a worker is dropped or its id claimed.
    """
    if not peer.startswith("pid ") or not peer[4:].isdigit() or int(peer[4:]) <= 0:
        return True
    try:
        with open(f"/proc/{int(peer[4:])}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[:1]
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return state not in ([b"Z"], [b"X"])


class Gate:
    """The connection rules of `_admission`, carried out on a publisher's bound sockets.

    Args:
        limit: workers' connections (events, acks, tap) the budget holds together.
        control_limit: control connections open at once (a new one closes the oldest).
        fd_limit: the soft descriptor limit (for the warning that names it).
        connect_rate: connections a second one peer may make to the events or tap
            socket, counted at the handshake (members have their own, larger one).
        headroom: connections members may have past `limit`.
    """

    def __init__(
        self,
        limit: int,
        control_limit: int,
        fd_limit: int,
        connect_rate: float,
        *,
        headroom: int = HEADROOM,
    ) -> None:
        self.fd_limit = fd_limit
        self.connect_rate = connect_rate
        self.budget = Budget(limit, control_limit, headroom)
        self.admission = Admission(connect_rate, now=time.monotonic())
        self.refused = 0  # connections shut down or denied by this gate
        self.zap: zmq.Socket[bytes] | None = None
        self._allows: Callable[[bytes], bool] | None = None  # CURVE: is this key allowed
        self._monitors: dict[zmq.Socket[bytes], str] = {}  # monitor -> bound endpoint
        self._by_endpoint: dict[str, zmq.Socket[bytes]] = {}  # endpoint -> monitor
        self._rated: dict[bytes, tuple[str, bool]] = {}  # ZAP domain -> (endpoint, ipc)
        self._pending: collections.deque[Refusal] = collections.deque()
        self._safe: dict[str, int] = {}  # endpoint -> serial before its last full drain
        self._warned_at = -_WARN_EVERY_S

    @property
    def limit(self) -> int:
        return self.budget.limit

    @property
    def count(self) -> int:
        """Workers' connections (control connections are counted apart)."""
        return self.budget.count

    @property
    def total(self) -> int:
        return self.budget.total

    def full(self, more: int = 0) -> bool:
        """Whether `more` new worker connections would go past the budget."""
        return self.budget.full(more)

    def serve_zap(
        self, ctx: zmq.Context[zmq.Socket[bytes]], allows: Callable[[bytes], bool] | None
    ) -> zmq.Socket[bytes]:
        """Answer the ZAP requests of `ctx`'s sockets from now on (bind before them);
        `allows` says whether a CURVE client key may connect (None: no CURVE)."""
        zap = ctx.socket(zmq.ROUTER)
        zap.linger = 0
        zap.bind(_ZAP_ENDPOINT)
        self.zap, self._allows = zap, allows
        return zap

    def watch(
        self,
        sock: zmq.Socket[bytes],
        endpoint: str,
        *,
        control: bool = False,
        rate_limited: bool = False,
    ) -> zmq.Socket[bytes]:
        """Start counting `sock`'s connections; returns the monitor socket to poll.

        A `rate_limited` socket must have been bound with a ZAP domain of its own: its
        connections' handshakes come to `on_zap` under that name.
        """
        monitor = sock.get_monitor_socket(_WATCHED)
        self._monitors[monitor] = endpoint
        self._by_endpoint[endpoint] = monitor
        self.budget.watch(endpoint, control=control)
        if rate_limited:
            domain = sock.getsockopt(zmq.ZAP_DOMAIN)
            if not isinstance(domain, bytes) or not domain or domain in self._rated:
                raise ValueError(f"{endpoint}: a rate-limited socket needs its own ZAP domain")
            self._rated[domain] = (endpoint, endpoint.startswith("ipc://"))
        return monitor

    def monitors(self) -> list[zmq.Socket[bytes]]:
        return list(self._monitors)

    def welcomed(self, peer: str) -> None:
        """A worker from `peer` was welcomed, or is still on the bus (see `Admission`)."""
        self.admission.welcome(peer, time.monotonic())

    # --- monitor events: the descriptor budget ---

    def on_event(self, monitor: zmq.Socket[bytes]) -> None:
        """Handle what waits on `monitor`, then carry out the refusals it brought."""
        self._pump(monitor)
        self._settle()

    def _pump(self, monitor: zmq.Socket[bytes]) -> bool:
        """Feed the events waiting on `monitor` to the budget; True if it read them all
        (then every event libzmq reported before this call is counted)."""
        endpoint, budget, pending = self._monitors[monitor], self.budget, self._pending
        for _ in range(_EVENTS_PER_TURN):
            try:
                frames = monitor.recv_multipart(NOBLOCK)
            except zmq.Again:
                return True
            event, fd = _EVENT.unpack_from(frames[0])
            if event == _ACCEPTED:
                refusal = budget.accepted(endpoint, fd)
                if refusal is not None:
                    pending.append(refusal)
            elif event == _DISCONNECTED:
                budget.disconnected(endpoint, fd)
        return False

    def _settle(self) -> None:
        """Shut down what the budget refused, each connection only once it is proven to
        be the one on its number: after taking a duplicate of the descriptor (which
        holds whatever connection is on it now), every event up to now is read, and the
        last one about that number must still be the one the refusal was decided on."""
        for _ in range(_REFUSALS_PER_TURN):
            if not self._pending:
                return
            refusal = self._pending.popleft()
            if not self.budget.current(refusal):
                continue  # it left: its number may be another connection's now
            held = duplicate(refusal.fd)
            if held is None:
                continue  # closed meanwhile; its disconnection is on its way
            with held:
                if not self._pump(self._by_endpoint[refusal.socket]):
                    self._pending.append(refusal)  # more events to read before deciding
                    continue
                if not self.budget.current(refusal):
                    continue
                peer = socket_peer(held)
                if self.admission.is_member(peer, time.monotonic()) and self.budget.keep(refusal):
                    continue
                if shut_down(held, refusal.socket):
                    self._count_refusal(refusal, peer)

    @property
    def pending(self) -> bool:
        """Refusals wait to be carried out (the owner calls `settle` again soon)."""
        return bool(self._pending)

    def settle(self) -> None:
        """Carry out the refusals left from the last turn."""
        self._settle()

    def _count_refusal(self, refusal: Refusal, peer: str) -> None:
        self.refused += 1
        if not self._may_warn():
            return
        if refusal.oldest:
            what = "the oldest control connection closed to make room"
        else:
            what = "new connections are dropped"
        log.warning(
            "bus at %s is full: %d connections, the most its file descriptor limit "
            "(%d) allows; %s (the last from %s; %d so far). Raise `ulimit -n` (the hard "
            "limit) or run fewer workers",
            refusal.socket,
            self.total,
            self.fd_limit,
            what,
            peer,
            self.refused,
        )

    def _may_warn(self) -> bool:
        now = time.monotonic()
        if now - self._warned_at < _WARN_EVERY_S:
            return False
        self._warned_at = now
        return True

    # --- frames from a peer that broke the protocol ---

    def mark(self, endpoint: str) -> int | None:
        """Before reading `endpoint`'s frames: read every event reported so far; the
        serial after them (None if too many wait: then no proof can start here)."""
        if not self._pump(self._by_endpoint[endpoint]):
            return None
        return self.budget.serial

    def drained(self, endpoint: str, mark: int | None, emptied: bool) -> None:
        """After reading: if the socket was left empty, every frame read from now on was
        sent after `mark` (see `drop`)."""
        if emptied and mark is not None:
            self._safe[endpoint] = mark

    def drop(self, endpoint: str, fd: int, address: str) -> bool:
        """Shut down the connection that sent a frame on `endpoint` (the frame's source
        descriptor and Peer-Address), if it is proven to be the one on `fd` now.

        A frame may be read after the connection that sent it has gone and its number
        was reused. It was sent after the last drain that left the socket empty, hence
        after that drain's mark: if no connection came or went on `fd` since the mark,
        the one on `fd` is the sender. On ipc:// the sender's process is known too (its
        Peer-Address ends in the pid), and any connection of that process may go.

        Returns:
            Whether a connection was shut down.
        """
        held = duplicate(fd)
        if held is None:
            return False
        with held:
            if not self._pump(self._by_endpoint[endpoint]):
                return False
            since = self._safe.get(endpoint)
            proven = since is not None and not self.budget.changed_after(endpoint, fd, since)
            if not proven and endpoint.startswith("ipc://"):
                sender = peer_of(address, ipc=True)
                proven = sender not in (UNKNOWN_PEER, "pid 0") and socket_peer(held) == sender
            return proven and shut_down(held, endpoint)

    # --- ZAP: one connection at its handshake ---

    def on_zap(self) -> None:
        """Answer the ZAP requests waiting (a bounded number per turn)."""
        zap = self.zap
        assert zap is not None
        now = time.monotonic()
        for _ in range(_ZAP_PER_TURN):
            try:
                frames = zap.recv_multipart(NOBLOCK)
            except zmq.Again:
                return
            reply = self._answer(frames, now)
            if reply is not None:  # a ROUTER drops what it cannot route; it never blocks
                zap.send_multipart(reply, NOBLOCK)

    def _answer(self, frames: list[bytes], now: float) -> list[bytes] | None:
        """The reply to one ZAP request (RFC 27): envelope, version, request id, status
        code and text, user id, metadata."""
        try:
            split = frames.index(b"")
        except ValueError:
            return None
        request = frames[split + 1 :]
        if len(request) < 6:
            return None
        request_id, domain, address, mechanism = request[1], request[2], request[3], request[5]
        status, text = self._decide(domain, address, mechanism, request[6:], now)
        # The User-Id stays empty. Given one, libzmq (4.3.5, ``pipe_t::read``) queues a
        # credential message at the head of the connection's receive pipe, counted
        # against RCVHWM by the writer but not by the reader: one queue place lost for
        # good, and the events socket queues one subscription per connection
        # (SUBSCRIPTION_RCVHWM = 1), so no CURVE subscriber would ever hear an event.
        return [*frames[: split + 1], b"1.0", request_id, status, text, b"", b""]

    def _decide(
        self, domain: bytes, address: bytes, mechanism: bytes, creds: list[bytes], now: float
    ) -> tuple[bytes, bytes]:
        if mechanism == b"CURVE":
            if self._allows is None or not creds or not self._allows(creds[0]):
                return b"400", b"client key not allowed"
        elif mechanism != b"NULL":
            return b"400", b"security mechanism not used on this bus"
        rated = self._rated.get(domain)
        if rated is None:
            return b"200", b"OK"
        endpoint, ipc = rated
        peer = peer_of(address.decode("utf-8", "replace"), ipc=ipc)
        verdict = self.admission.admit(peer, now)
        if verdict is Verdict.ALLOW:
            return b"200", b"OK"
        self.refused += 1
        if self._may_warn():
            log.warning(
                "bus at %s: a connection from %s refused: %s (%.0f per second and peer; "
                "%d refused so far)",
                endpoint,
                peer,
                verdict.value,
                self.connect_rate,
                self.refused,
            )
        return b"400", verdict.value.encode()

    def close(self) -> None:
        """Close the monitors (first: the bound sockets may still be closing)."""
        for monitor in self._monitors:
            monitor.close()
        self._monitors.clear()
        self._by_endpoint.clear()

    def close_zap(self) -> None:
        """Close the ZAP socket, after every bound socket: a CURVE socket's handshakes
        fail without it (they enforce the domain); a NULL one's would go unchecked."""
        if self.zap is not None:
            self.zap.close()
            self.zap = None
