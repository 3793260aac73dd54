"""Socket factory and the one request/reply exchange that cannot hang (Lazy Pirate).

Every socket is made with linger=0 (close never blocks on unsent messages) and
MAXMSGSIZE (an oversized frame makes libzmq drop the peer, never buffer it). Bound
sockets get CURVE server options when the bus has keys; ipc:// socket files get mode
0600 (0660 and the bus's group when one is configured).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import zmq

from ._config import HANDSHAKE_ATTEMPTS, MAX_MESSAGE_BYTES
from ._deadline import Deadline
from ._errors import ConnectTimeout, ProtocolError
from ._protocol import Message, decode, encode

__all__ = [
    "NOBLOCK",
    "Secure",
    "bind",
    "connect",
    "post",
    "protect_ipc",
    "readable",
    "request",
    "resolve_endpoint",
    "sibling_endpoint",
]

log = logging.getLogger(__name__)

Secure = Callable[[zmq.Socket[bytes]], None] | None  # applies CURVE options, or None

# Plain ints for the hot paths: zmq.POLLIN and friends are IntFlag members, and `&` or a
# flag argument built from one is a Python-level call per message.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)


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
) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if secure is not None:
        secure(sock)
    sock.connect(address)
    return sock


def bind(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: int, address: str, secure: Secure = None
) -> zmq.Socket[bytes]:
    """A bound socket at `address` (read the real one from LAST_ENDPOINT)."""
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if secure is not None:
        secure(sock)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close()
        exc.strerror = f"{exc.strerror} (addr={address!r})"
        raise
    return sock


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
) -> Message:
    """One REQ/REP exchange that cannot hang: Lazy Pirate.

    A REQ socket that got no reply is stuck in its send/recv lockstep, so it is closed
    (linger=0) and replaced before the next attempt. The attempts share one deadline.

    Raises:
        ConnectTimeout: no reply within the deadline (also what an unauthorized CURVE
            client sees: the publisher never answers it).
        ProtocolError: the reply is not a valid message.
    """
    for attempt in range(1, attempts + 1):
        req = connect(ctx, zmq.REQ, address, secure)
        try:
            req.send(encode(msg))
            if req.poll(deadline.share_ms(attempts - attempt + 1)) & zmq.POLLIN:
                return decode(req.recv())
        finally:
            req.close()
        log.debug("no reply from %s (attempt %d/%d)", address, attempt, attempts)
    raise ConnectTimeout(
        f"no publisher answered at {address} within {deadline.total:.1f} s; is it started, "
        "with the same name (or address) and the same ZMQSYNC_RUNTIME_DIR on both sides "
        "(and, for CURVE, with your public key allowed)?"
    )
