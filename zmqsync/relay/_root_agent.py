"""The root's control channel: a socket loop that feeds the `Membership`.

`RootAgent` owns the ROUTER the relays' DEALERs talk to and the REP ``zmqsync inspect``
asks (at ``<bus address>.relay``, ipc:// buses only). It decodes each frame (`RELAY`),
hands the message to the membership with the time, sends the answer, and every
heartbeat lets the membership mark silent relays lost and beats the others. Other
threads send through it with `send_to` (an inproc pipe: its sockets are its alone).
`inspect_relays` is the client side of the REP.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

import zmq

from .. import _config
from .._agent_thread import AgentThread
from .._errors import ProtocolError, ZmqSyncError
from .._protocol import Inspect, decode, encode, to_plain
from .._sockets import bind, connect, protect_ipc, sibling_endpoint
from ._membership import Membership
from ._messages import RELAY, Beat, Evict, Refuse, RelayMessage, RelayState
from ._rendezvous import ip

__all__ = ["ROOT_CLOSED", "RootAgent", "inspect_relays"]

log = logging.getLogger(__name__)

ROOT_CLOSED = "relay root closed"  # the EVICT reason that tells relays not to re-join here


class RootAgent(AgentThread):
    """The thread that owns the root's control sockets (see the module doc); its thread,
    pipe, start and stop are `AgentThread`'s.

    Args:
        membership: the tree it feeds; read and changed only under `cond`.
        cond: the root's condition: notified after every change.
        host: the rendezvous host (the ROUTER binds there, on a port the system picks).
        address: the bus address (the inspect REP binds next to ipc:// ones).
        name: the bus name (thread names, the inspect answer).
        ack: the root's ack mode (the inspect answer).
    """

    router: zmq.Socket[bytes]  # bound by `_bind`, on the agent thread

    def __init__(
        self,
        membership: Membership,
        cond: threading.Condition,
        *,
        host: str,
        address: str,
        name: str,
        ack: str,
    ) -> None:
        self.membership, self.cond = membership, cond
        self.host, self.address, self.name, self.ack = host, address, name, ack
        super().__init__(f"zmqsync-relayroot-ctl-{name}", "relay root agent")
        self.endpoint = ""
        self._inspect_addr = ""
        self.inspect: zmq.Socket[bytes] | None = None

    def send_to(self, identity: bytes, msg: RelayMessage) -> None:
        """Send `msg` to the relay whose control DEALER has routing id `identity`."""
        if not self.post(b"to", identity, RELAY.encode(msg)):
            log.debug("relay root agent gone: %s dropped", msg.TYPE)

    # --- agent thread ---

    def _bind(self) -> None:
        """The ROUTER for the relays, the inspect REP (raises for start(): another relay
        root answers at the inspect address; the rendezvous host does not resolve)."""
        self.router = bind(self.ctx, zmq.ROUTER, f"tcp://{ip(self.host)}:*")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bind_inspect()

    def _finish(self) -> None:
        router = getattr(self, "router", None)  # absent when _bind failed before it
        for sock in (self.pipe, router, self.inspect):
            if sock is not None:
                sock.close()
        if self._inspect_addr:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._inspect_addr[len("ipc://") :])

    def _bind_inspect(self) -> None:
        """REP at ``<bus address>.relay`` (ipc:// buses), where ``zmqsync inspect`` looks."""
        if not self.address.startswith("ipc://"):
            return
        endpoint = sibling_endpoint(self.address, "relay")
        if inspect_relays(self.address, 0.2) is not None:
            raise ZmqSyncError(f"another relay root already answers at {endpoint}")
        self.inspect = bind(self.ctx, zmq.REP, endpoint)
        protect_ipc(self.inspect, None)
        self._inspect_addr = endpoint

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self.pipe, self.router, self.inspect):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        next_beat = time.monotonic()
        while True:
            ready = dict(poller.poll(max(0, int((next_beat - time.monotonic()) * 1000)) + 1))
            if self.pipe in ready and not self._on_pipe():
                self._goodbye()
                return
            if self.router in ready:
                self._on_router()
            if self.inspect is not None and self.inspect in ready:
                self._on_inspect()
            now = time.monotonic()
            if now >= next_beat:
                with self.cond:
                    targets = self.membership.tick(now)
                    beat = RELAY.encode(Beat(self.membership.tree, self.membership.gen))
                    self.cond.notify_all()  # a relay lost ends waits for it
                for identity in targets:
                    self._send(identity, beat)
                next_beat = now + self.membership.heartbeat

    def _send(self, identity: bytes, frame: bytes) -> None:
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            self.router.send_multipart([identity, frame], zmq.NOBLOCK)

    def _on_pipe(self) -> bool:
        while self.pipe.poll(0):
            frames = self.pipe.recv_multipart()
            if frames[0] == b"stop":
                return False
            if frames[0] == b"to":
                self._send(frames[1], frames[2])
        return True

    def _on_router(self) -> None:
        for _ in range(_config.ACK_DRAIN_MAX):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"{len(frames)} frames")
                msg = RELAY.decode(frames[1])
            except ProtocolError as exc:
                with self.cond:
                    self.membership.counters["rejected"] += 1
                log.debug("dropped relay message: %s", exc)
                continue
            with self.cond:
                answer = self.membership.on_message(frames[0], msg, time.monotonic())
                self.cond.notify_all()
            if answer is not None:
                self._send(frames[0], RELAY.encode(answer))

    def _on_inspect(self) -> None:
        assert self.inspect is not None
        frame = self.inspect.recv()
        try:
            msg = decode(frame)
            if not isinstance(msg, Inspect):
                raise ProtocolError(f"{msg.TYPE} is not a request")
            reply = RELAY.encode(self._state())
        except ProtocolError as exc:
            reply = RELAY.encode(Refuse(self.membership.tree, str(exc)[:512]))
        self.inspect.send(reply)

    def _state(self) -> RelayState:
        m = self.membership
        with self.cond:
            return RelayState(
                m.tree,
                self.name,
                os.getpid(),
                m.bus,
                max(m.version, -1),
                m.gen,
                self.ack,
                m.infos(time.monotonic()),
                dict(m.counters),
            )

    def _goodbye(self) -> None:
        """Tell every relay the root is going (they re-join the next root by themselves)."""
        with self.cond:
            targets = self.membership.reachable()
        bye = RELAY.encode(Evict(self.membership.tree, ROOT_CLOSED))
        for identity in targets:
            self._send(identity, bye)


def inspect_relays(address: str, timeout: float = 1.0) -> dict[str, Any] | None:
    """The relay tree of the bus at `address`, as plain values; None when it has none.

    Only ipc:// buses are followed: the relay root answers at ``<address>.relay``.

    Raises:
        ProtocolError: the answer is not a relay message.
    """
    if not address.startswith("ipc://"):
        return None
    endpoint = sibling_endpoint(address, "relay")
    if not os.path.exists(endpoint[len("ipc://") :]):
        return None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        req = connect(ctx, zmq.REQ, endpoint)
        try:
            req.send(encode(Inspect("")))
            if not req.poll(max(1, int(timeout * 1000))) & zmq.POLLIN:
                return None
            reply = RELAY.decode(req.recv())
        finally:
            req.close()
    finally:
        ctx.destroy(linger=0)
    if not isinstance(reply, RelayState):
        return None
    plain: dict[str, Any] = to_plain(reply)
    return plain
