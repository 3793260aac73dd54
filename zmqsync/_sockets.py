"""Socket factory and the one request/reply exchange that cannot hang (Lazy Pirate).

Every socket is made with linger=0 (close never blocks on unsent messages) and
MAXMSGSIZE sized for what it receives (an oversized frame makes libzmq drop the peer,
never buffer it). Bound sockets also get a small receive HWM per connection and a
handshake deadline (a peer that connects and says nothing is dropped), and CURVE server
options when the bus has keys; ipc:// socket files get mode 0600 (0660 and the bus's
group when one is configured).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Callable

import zmq

from ._config import (
    DRAIN_BYTES,
    DRAIN_MAX,
    DRAIN_S,
    HANDSHAKE_ATTEMPTS,
    HANDSHAKE_IVL_S,
    MAX_MESSAGE_BYTES,
)
from ._deadline import Deadline
from ._errors import ConnectTimeout, ProtocolError
from ._protocol import Message, decode, encode

__all__ = [
    "NOBLOCK",
    "Drain",
    "Secure",
    "bind",
    "connect",
    "duplicate",
    "shut_down",
    "socket_peer",
    "source_fd",
    "post",
    "protect_ipc",
    "readable",
    "request",
    "resolve_endpoint",
    "send_bytes",
    "sibling_endpoint",
]

log = logging.getLogger(__name__)

Secure = Callable[[zmq.Socket[bytes]], None] | None  # applies CURVE options, or None

# Plain ints for the hot paths: zmq.POLLIN and friends are IntFlag members, and `&` or a
# flag argument built from one is a Python-level call per message.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)

# `send_bytes(sock, frame, flags)`: the socket's own send, without pyzmq's Python-level
# wrapper around it (routing ids and groups of draft sockets, which zmqsync never uses).
# The hot paths (a worker's ACK, the publisher's RECEIVE) send one frame per message on
# threads that come to it with cold caches: one Python frame less each time.
send_bytes: Callable[[zmq.Socket[bytes], bytes, int], None] = zmq.backend.Socket.send


def post(sock: zmq.Socket[bytes], *frames: bytes) -> bool:
    """Send on an inproc pipe to an agent thread without blocking; False if it was not
    taken. A PAIR send blocks for good once the agent thread has exited (its end of the
    pipe is closed), and a caller cannot know that it has not: `is_alive()` then
    `send()` races with the agent leaving on its own (after a close's STOP)."""
    try:
        sock.send_multipart(frames, NOBLOCK)
    except zmq.Again:
        return False
    return True


def readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether a frame waits on `sock`. Asking first is cheaper than ending every drain
    with a raised zmq.Again (that exception was ~9% of a worker's CPU per version)."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)  # type: ignore[operator]


def connect(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    address: str,
    secure: Secure = None,
    routing_id: bytes | None = None,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> zmq.Socket[bytes]:
    """A socket connected to `address`, refusing frames over `max_bytes` from it."""
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if secure is not None:
        secure(sock)
    sock.connect(address)
    return sock


def bind(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    address: str,
    secure: Secure = None,
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    rcvhwm: int = 1000,
) -> zmq.Socket[bytes]:
    """A bound socket at `address` (read the real one from LAST_ENDPOINT).

    Each connection may queue at most `rcvhwm` frames of at most `max_bytes` here; a
    larger frame drops the connection. Connections that have not completed the ZMTP
    handshake within HANDSHAKE_IVL_S are dropped too.
    """
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_IVL_S * 1000))
    if secure is not None:
        secure(sock)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close()
        if address not in (exc.strerror or ""):  # pyzmq 27 names the address itself
            exc.strerror = f"{exc.strerror} (addr={address!r})"
        if address.startswith("ipc://") and exc.errno in (errno.EACCES, errno.ENOENT, errno.EROFS):
            exc.strerror = (
                f"{exc.strerror}; bind the bus in a directory this user may write: set "
                "ZMQSYNC_RUNTIME_DIR or pass another ipc:// address"
            )
        raise
    return sock


class Drain:
    """The budget of one drain of a socket: a number of frames, of bytes and of seconds.

    A peer decides how much waits on a socket; the thread that reads it decides how much
    it reads per turn. Counting frames alone let frames just under the size limit hold a
    thread for seconds.
    """

    __slots__ = ("_frames", "_bytes", "_until")

    def __init__(
        self, frames: int = DRAIN_MAX, nbytes: int = DRAIN_BYTES, seconds: float = DRAIN_S
    ) -> None:
        self._frames, self._bytes = frames, nbytes
        self._until = time.monotonic() + seconds

    def spend(self, nbytes: int) -> bool:
        """Count one frame of `nbytes`; False once the budget is spent (stop reading)."""
        self._frames -= 1
        self._bytes -= nbytes
        return self._frames > 0 and self._bytes > 0 and time.monotonic() < self._until


def source_fd(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection `frame` came in on (its metadata), if known.

    libzmq has no call to disconnect one peer of a bound socket; this, `duplicate` and
    `shut_down` do it (see `Gate.drop`). None for frames libzmq made itself.
    """
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return None


def duplicate(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of descriptor `fd`; None if `fd` is closed or not
    a socket. The duplicate keeps that connection open (and its number taken) however
    libzmq goes on with `fd`: what is checked on it and what is done to it concern one
    connection, even if libzmq closes `fd` meanwhile and the number is reused."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:  # not a socket
        os.close(dup)
        return None


def shut_down(sock: socket.socket, local: str) -> bool:
    """Shut down the connection `sock` holds, if it was accepted on the socket bound at
    `local` (never another file or socket of the process); libzmq then sees the peer
    leave and frees everything the peer made it hold."""
    try:
        if not _is_local(sock.getsockname(), local):
            return False
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    return True


def socket_peer(sock: socket.socket) -> str:
    """The peer of a connection, named as `_admission.peer_of` names it: ``pid N`` for a
    unix socket (SO_PEERCRED), the source IP address for tcp; ``?`` if unknown."""
    try:
        if sock.family == socket.AF_UNIX:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            return f"pid {_UCRED.unpack(creds)[0]}"
        return str(sock.getpeername()[0])
    except OSError:
        return "?"


_UCRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid


def _is_local(name: object, endpoint: str) -> bool:
    """Whether a socket's own address (getsockname) is the bound `endpoint`."""
    if endpoint.startswith("ipc://"):
        return name == endpoint[len("ipc://") :]
    if endpoint.startswith("tcp://") and isinstance(name, tuple):
        port = endpoint.rsplit(":", 1)[1]
        return port.isdigit() and name[1] == int(port)
    return False


def protect_ipc(sock: zmq.Socket[bytes], gid: int | None) -> None:
    """0600 on an ipc:// socket file (0660 and group `gid` when containers share it)."""
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://") :]
    if gid is None:
        os.chmod(path, 0o600)
    else:
        os.chown(path, -1, gid)
        os.chmod(path, 0o660)


def sibling_endpoint(control: str, role: str) -> str:
    """Where to bind the `role` socket next to a control address (ipc path or tcp port)."""
    if control.startswith("ipc://"):
        return f"{control}.{role}"
    if control.startswith("tcp://"):
        host = control[len("tcp://") :].rsplit(":", 1)[0]
        return f"tcp://{host}:*"
    raise ValueError(f"address {control!r} must start with ipc:// or tcp://")


def resolve_endpoint(address: str, endpoint: str) -> str:
    """Where to connect for `endpoint` named by a publisher; only next to `address`.

    A publisher bound to a wildcard (tcp://0.0.0.0:*) reports that wildcard; we connect
    to the host we reached it at instead. Anything away from the address we chose to
    trust (another directory, another host) is a hostile or broken answer.

    Raises:
        ProtocolError: `endpoint` is not next to `address`.
    """
    if address.startswith("ipc://"):
        if endpoint.startswith("ipc://") and os.path.dirname(endpoint) == os.path.dirname(address):
            return endpoint
    elif endpoint.startswith("tcp://") and ":" in endpoint[len("tcp://") :]:
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        their_host, port = endpoint[len("tcp://") :].rsplit(":", 1)
        if their_host in ("0.0.0.0", "*", "[::]"):
            their_host = host
        if their_host == host and port.isdigit():
            return f"tcp://{host}:{port}"
    raise ProtocolError(f"the publisher names endpoint {endpoint!r} away from {address!r}")


def request(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    msg: Message,
    *,
    deadline: Deadline,
    attempts: int = HANDSHAKE_ATTEMPTS,
    secure: Secure = None,
    cancelled: Callable[[], bool] | None = None,
) -> Message:
    """One REQ/REP exchange that cannot hang: Lazy Pirate.

    A REQ socket that got no reply is stuck in its send/recv lockstep, so it is closed
    (linger=0) and replaced before the next attempt. The attempts share one deadline.

    Args:
        cancelled: asked every CANCEL_CHECK_S while waiting for the reply: True ends
            the wait at once (ConnectTimeout), as for a thread told to stop.

    Raises:
        ConnectTimeout: no reply within the deadline (also what an unauthorized CURVE
            client sees: the publisher never answers it), or `cancelled`.
        ProtocolError: the reply is not a valid message.
    """
    for attempt in range(1, attempts + 1):
        req = connect(ctx, zmq.REQ, address, secure)
        try:
            share = deadline.share_ms(attempts - attempt + 1)
            req.sndtimeo = share if share < 0 else max(share, 1)  # a send nobody takes
            with contextlib.suppress(zmq.Again):
                req.send(encode(msg))
                if _reply_within(req, share, cancelled):
                    return decode(req.recv())
        finally:
            req.close()
        if cancelled is not None and cancelled():
            raise ConnectTimeout(f"the request to {address} was cancelled")
        log.debug("no reply from %s (attempt %d/%d)", address, attempt, attempts)
    if address.startswith("ipc://"):  # where the two sides look for the socket file
        same = "with the same name (or address) and the same ZMQSYNC_RUNTIME_DIR on both sides"
    else:
        same = "listening on this address, reachable from here"
    raise ConnectTimeout(
        f"no publisher answered at {address} within {deadline.total:.1f} s; is it started, "
        f"{same} (and, for CURVE, with your public key allowed)?"
    )


CANCEL_CHECK_S = 0.1  # how often a cancellable wait asks whether it was cancelled


def _reply_within(req: zmq.Socket[bytes], ms: int, cancelled: Callable[[], bool] | None) -> bool:
    """Whether a reply is readable on `req` within `ms` (-1: no limit), asking
    `cancelled` in between."""
    if cancelled is None:
        return bool(req.poll(ms) & zmq.POLLIN)
    end = None if ms < 0 else time.monotonic() + ms / 1000
    while not cancelled():
        left = CANCEL_CHECK_S if end is None else min(CANCEL_CHECK_S, end - time.monotonic())
        if req.poll(max(0, math.ceil(left * 1000))) & zmq.POLLIN:
            return True
        if end is not None and time.monotonic() >= end:
            return False
    return False
