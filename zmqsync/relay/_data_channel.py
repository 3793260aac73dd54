"""The data channel: per-version notices and reports, straight between the threads that
act on them.

A second ROUTER on the root (`DataChannel`, owned by the root's relay thread) and two
DEALERs per relay (`DataLink`: the data thread's, whose routing id is the relay id, and
the wait thread's). It carries only RELAY_SEND (root -> relay) and RELAY_REPORT
(relay -> root): on the control channel each of them cost a hand-off through an agent
thread, 0.1-0.3 ms each on two busy cores. A notice the data channel cannot route (the
relay's DEALER is not connected yet) goes on the control channel instead.
"""

from __future__ import annotations

import logging

import zmq

from .. import _config
from .._errors import ProtocolError
from .._sockets import NOBLOCK, bind, connect, readable
from ._messages import RELAY, Report
from ._rendezvous import data_identity, ip

__all__ = ["DataChannel", "DataLink"]

log = logging.getLogger(__name__)


class DataChannel:
    """The root's data ROUTER (one thread uses it: the root's relay thread).

    Relays' data DEALERs name themselves by relay id; a restarted relay takes its route
    over (ROUTER_HANDOVER); a notice to a relay not connected (yet) fails at once
    (ROUTER_MANDATORY) instead of being dropped silently.
    """

    def __init__(self, host: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            self.router = bind(self.ctx, zmq.ROUTER, f"tcp://{ip(host)}:*")
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    def notify(self, relay_id: str, frame: bytes) -> bool:
        """Send `frame` to the relay's data thread; False if it is not connected (or full)."""
        try:
            self.router.send_multipart([data_identity(relay_id), frame], NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH: not connected (yet); EAGAIN: full
            return False
        return True

    def reports(self, timeout_ms: int) -> tuple[list[Report], int]:
        """The reports that arrive within `timeout_ms` (a bounded drain once the first
        does), and how many frames were not reports (dropped)."""
        if not self.router.poll(timeout_ms):
            return [], 0
        out: list[Report] = []
        rejected = 0
        for _ in range(_config.ACK_DRAIN_MAX):  # bounded: a flood cannot hold this thread
            if not readable(self.router):
                break
            frames = self.router.recv_multipart(NOBLOCK)
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"{len(frames)} frames")
                msg = RELAY.decode(frames[1])
                if not isinstance(msg, Report):
                    raise ProtocolError(f"{msg.TYPE} on the data channel")
            except ProtocolError as exc:
                rejected += 1
                log.debug("dropped relay data message: %s", exc)
                continue
            out.append(msg)
        return out, rejected

    def close(self) -> None:
        self.router.close()
        self.ctx.destroy(linger=0)


class DataLink:
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
