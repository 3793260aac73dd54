"""Socket factory and the one request/reply exchange that cannot hang (Lazy Pirate).

Every socket is made with linger=0 (close never blocks on unsent messages) and, when
bound, with MAXMSGSIZE (an oversized frame is dropped by libzmq, never buffered).
"""

from __future__ import annotations

import logging
import os

import zmq

from ._config import HANDSHAKE_ATTEMPTS, MAX_MESSAGE_BYTES
from ._deadline import Deadline
from ._errors import ConnectTimeout
from ._protocol import Message, decode, encode

__all__ = ["bind", "connect", "request", "sibling_endpoint"]

log = logging.getLogger(__name__)


def connect(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, address: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.connect(address)
    return sock


def bind(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, address: str) -> zmq.Socket[bytes]:
    """A bound socket at `address`; returns it with ``last_endpoint`` resolved."""
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close()
        exc.strerror = f"{exc.strerror} (addr={address!r})"
        raise
    if address.startswith("ipc://"):
        os.chmod(address[len("ipc://") :], 0o600)
    return sock


def sibling_endpoint(control: str, role: str) -> str:
    """Where to bind the `role` socket next to a control address (ipc path or tcp port)."""
    if control.startswith("ipc://"):
        return f"{control}.{role}"
    if control.startswith("tcp://"):
        host = control[len("tcp://") :].rsplit(":", 1)[0]
        return f"tcp://{host}:*"
    raise ValueError(f"address {control!r} must start with ipc:// or tcp://")


def request(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    msg: Message,
    *,
    deadline: Deadline,
    attempts: int = HANDSHAKE_ATTEMPTS,
) -> Message:
    """One REQ/REP exchange that cannot hang: Lazy Pirate.

    A REQ socket that got no reply is stuck in its send/recv lockstep, so it is closed
    (linger=0) and replaced before the next attempt. The attempts share one deadline.

    Raises:
        ConnectTimeout: no reply within the deadline.
        ProtocolError: the reply is not a valid message.
    """
    for attempt in range(1, attempts + 1):
        req = connect(ctx, zmq.REQ, address)
        try:
            req.send(encode(msg))
            if req.poll(deadline.share_ms(attempts - attempt + 1)) & zmq.POLLIN:
                return decode(req.recv())
        finally:
            req.close()
        log.debug("no reply from %s (attempt %d/%d)", address, attempt, attempts)
    raise ConnectTimeout(
        f"no publisher answered at {address} within {deadline.total:.1f} s; is it started, "
        "with the same name (or address) and the same ZMQSYNC_RUNTIME_DIR on both sides?"
    )
