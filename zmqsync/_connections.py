"""How many connections a publisher holds, against the file descriptors it may open.

Every connection to a bound socket is one file descriptor. libzmq accepts connections on
its own thread, as many as peers make, and when the process runs out of descriptors its
ipc:// listener aborts the whole process (an assertion on EMFILE in accept). A bus must
therefore never let connections take the last descriptors:

* At start the soft RLIMIT_NOFILE is raised to the hard limit, as long-running servers
  do (the soft default of 1024 cannot hold the default `max_workers=1024`: each worker
  holds two connections).
* The budget for connections is the soft limit minus the descriptors already open and a
  reserve for the process itself (files, torch, the user's own sockets).
* `Gate` counts each bound socket's connections from libzmq's monitor events (accepted,
  disconnected) and shuts one down at once when the budget is spent: the peer is
  dropped and counted, the bus goes on. The reserve absorbs the connections accepted
  while the agent thread gets to the event.
"""

from __future__ import annotations

import logging
import os
import resource
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from ._config import CONTROL_CONNECTIONS, FD_RESERVE_MIN
from ._sockets import shutdown_fd

__all__ = ["Gate", "connection_budget", "open_descriptors", "raise_fd_limit"]

log = logging.getLogger(__name__)

_FD_CEILING = 1 << 20  # soft limits above this only make descriptor tables bigger
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_WARN_EVERY_S = 10.0


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


def connection_budget(soft_limit: int, in_use: int) -> int:
    """How many connections a bus may hold with `in_use` descriptors open already."""
    # A quarter: libzmq keeps accepting while the agent thread waits for a CPU, and on
    # a loaded machine a same-uid process connecting in a tight loop filled an eighth.
    reserve = max(FD_RESERVE_MIN, soft_limit // 4)
    return max(CONTROL_CONNECTIONS + 8, soft_limit - in_use - reserve)


def open_descriptors() -> int:
    """Descriptors open in this process now (once, at start: listing them costs O(n))."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return FD_RESERVE_MIN


class Gate:
    """Connection accounting for a publisher's bound sockets, from their monitor sockets.

    Two rules, because connections mean two things. A worker's connections (events,
    acks, tap) last as long as it is on the bus: past `limit` together, a new one is
    refused, and the workers already there keep theirs. On the XPUB sockets (events,
    tap) new connections are also rate-limited: a peer there can make libzmq keep
    subscriptions until it is dropped, so one that reconnects as fast as it is dropped
    must not get a fresh allowance faster than `connect_rate` per second. A control
    connection carries one request and its reply (a handshake, an inspection): past
    `control_limit`, the *oldest* one is closed to make room, so a peer holding control
    connections open cannot keep a new worker from hearing "bus full" or an operator
    from inspecting.

    Only the thread that owns the sockets uses it.
    """

    def __init__(self, limit: int, control_limit: int, fd_limit: int, connect_rate: float) -> None:
        self.limit = limit
        self.connect_rate = connect_rate
        self._tokens: dict[zmq.Socket[bytes], tuple[float, float]] = {}  # (tokens, at)
        self.control_limit = control_limit
        self.fd_limit = fd_limit
        self.refused = 0  # connections closed by this gate, of either kind
        # monitor -> accepted descriptors, oldest first (a dict keeps insertion order)
        self._live: dict[zmq.Socket[bytes], dict[int, None]] = {}
        self._local: dict[zmq.Socket[bytes], str] = {}  # monitor -> bound endpoint
        self._control: zmq.Socket[bytes] | None = None
        self._warned_at = -_WARN_EVERY_S

    @property
    def count(self) -> int:
        """Workers' connections (control connections are counted apart)."""
        return sum(len(fds) for m, fds in self._live.items() if m is not self._control)

    @property
    def total(self) -> int:
        return sum(len(fds) for fds in self._live.values())

    def full(self, more: int = 0) -> bool:
        """Whether `more` new worker connections would go past the budget."""
        return self.count + more > self.limit

    def watch(
        self,
        sock: zmq.Socket[bytes],
        endpoint: str,
        *,
        control: bool = False,
        rate_limited: bool = False,
    ) -> zmq.Socket[bytes]:
        """Start counting `sock`'s connections; returns the monitor socket to poll."""
        monitor = sock.get_monitor_socket(_WATCHED)
        self._live[monitor] = {}
        self._local[monitor] = endpoint
        if control:
            self._control = monitor
        if rate_limited:
            self._tokens[monitor] = (2 * self.connect_rate, time.monotonic())
        return monitor

    def _admit(self, monitor: zmq.Socket[bytes]) -> bool:
        """Take one of `monitor`'s connection tokens (a bucket of 2 s worth), if any."""
        if monitor not in self._tokens:
            return True
        tokens, at = self._tokens[monitor]
        now = time.monotonic()
        tokens = min(2 * self.connect_rate, tokens + (now - at) * self.connect_rate)
        self._tokens[monitor] = (tokens - 1, now) if tokens >= 1 else (tokens, now)
        return tokens >= 1

    def monitors(self) -> list[zmq.Socket[bytes]]:
        return list(self._live)

    def on_event(self, monitor: zmq.Socket[bytes]) -> None:
        """Handle what waits on `monitor` (one turn: a bounded number of events)."""
        live, endpoint = self._live[monitor], self._local[monitor]
        for _ in range(1024):
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_DISCONNECTED:
                live.pop(fd, None)
            elif event["event"] != zmq.EVENT_ACCEPTED:
                continue
            elif monitor is self._control:
                if len(live) >= self.control_limit:
                    oldest = next(iter(live))
                    del live[oldest]
                    self._refuse(oldest, endpoint, "the oldest control connection closed")
                live[fd] = None
            elif self.count >= self.limit:
                self._refuse(fd, endpoint, "new connections are dropped")
            elif not self._admit(monitor):
                self._refuse(fd, endpoint, "connecting faster than allowed", full=False)
            else:
                live[fd] = None

    def _refuse(self, fd: int, endpoint: str, what: str, full: bool = True) -> None:
        shutdown_fd(fd, endpoint)
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at < _WARN_EVERY_S:
            return
        self._warned_at = now
        if not full:
            log.warning(
                "bus at %s: new connections refused, %s (%.0f per second; %d so far)",
                endpoint,
                what,
                self.connect_rate,
                self.refused,
            )
            return
        log.warning(
            "bus at %s is full: %d connections, the most its file descriptor limit "
            "(%d) allows; %s (%d so far). Raise `ulimit -n` (the hard limit) or run "
            "fewer workers",
            endpoint,
            self.total,
            self.fd_limit,
            what,
            self.refused,
        )

    def close(self) -> None:
        for monitor in self._live:
            monitor.close()
        self._live.clear()
