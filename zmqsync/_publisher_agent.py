"""The publisher's agent thread: the socket loop around `PublisherRole`.

It owns the control socket and takes the bus sockets (events, acks, tap) under the
`io` lock for one bounded step at a time: a publishing thread takes the same lock to
send RECEIVE and to read the acks it waits for itself (see `Publisher`). What arrives is
decoded (only `_protocol.decode` turns bytes into messages), handed to the role with the
time, and what the role returns is sent. Connections are counted by `Gate`; junk is
drained within budgets (see docs/security.md for every bound).

It never holds the `Publisher`, only `Shared`: a Publisher collected without close()
must still be able to stop it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

from . import _config
from ._ack_reader import ACK_READER
from ._admission import peer_of
from ._agent_thread import AgentThread
from ._config import XPUB_WELCOME
from ._connections import Gate
from ._deadline import Deadline
from ._errors import ProtocolError, ZmqSyncError
from ._fast_frames import ack_pattern, read_ack
from ._member_log import Refusals, departure, rejoin_note
from ._native_lib import libzmq_path, zmq_error
from ._protocol import (
    BufferInfo,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Inspect,
    Message,
    State,
    Stop,
    Tap,
    Welcome,
    decode,
    encode,
)
from ._publisher_role import Endpoints, PublisherRole
from ._security import CurveServer
from ._sockets import (
    NOBLOCK,
    Drain,
    bind,
    protect_ipc,
    readable,
    send_bytes,
    sibling_endpoint,
    source_fd,
)
from ._text import printable

__all__ = ["IO_LOCK_S", "Agent", "Shared"]

log = logging.getLogger(__name__)

_SUBSCRIBE_ALL = b"\x01"  # the only subscription the protocol uses: to every event
IO_LOCK_S = 30.0  # the agent holds `io` for one bounded step; longer means it is stuck
_COLLECT_WAIT_S = 0.005  # longest blocking recv while collecting acks
_BATCH_MAX = 256  # frames read per turn by the native reader (then the lock, done())
# ZAP domains of the sockets whose connections are rate-limited per peer (see Gate): a
# domain of their own tells the gate which socket a handshake is for.
_EVENTS_DOMAIN, _TAP_DOMAIN = b"zmqsync.events", b"zmqsync.tap"


@dataclasses.dataclass(eq=False)
class Shared:
    """What a publisher's agent thread shares with its `Publisher`.

    The agent holds this and never the Publisher. A Publisher dropped without `close()`
    (torchrl never closes its schemes) is finalized by the garbage collector, after
    every weak reference to it is dead when it sits in a reference cycle; its agent must
    still be able to say STOP, close its sockets and remove their files then.
    """

    role: PublisherRole  # the protocol's rules (under `cond`; `seq` under `io`)
    curve: CurveServer | None
    gid: int | None
    tap: bool
    address: str = ""
    buffers: tuple[BufferInfo, ...] = ()  # what a WELCOME names (set once they exist)
    fill_mirror: Callable[[int], None] | None = None  # CUDA weights: copy a slot to the CPU
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    cond: threading.Condition = dataclasses.field(init=False)
    io: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    pipe_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    write_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    failure: BaseException | None = None
    fd_limit: int = 1024  # the soft RLIMIT_NOFILE once raised at start
    max_connections: int = 1024  # what the bound sockets may hold together (see Gate)

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)


class Agent(AgentThread):
    """The thread that owns the publisher's sockets (control, events, acks); its thread,
    pipe and start are `AgentThread`'s."""

    def __init__(self, shared: Shared) -> None:
        super().__init__(
            f"zmqsync-pub-{shared.role.name}",
            "publisher agent",
            stop_s=_config.CLOSE_BYE_WAIT_S + _config.THREAD_JOIN_S,
            pipe_lock=shared.pipe_lock,
        )
        self.shared = shared
        self.role = shared.role
        self._closing: Deadline | None = None
        self.tap: zmq.Socket[bytes] | None = None
        self._ack_reader: Any = None  # `_native.AckReader` over `acks` (see `collect`)
        self.endpoints: dict[str, str] = {}  # cached: LAST_ENDPOINT is a socket call
        self.closed = False  # the sockets are closed (set under `_io`)
        self._member_peers: dict[str, str] = {}  # worker id -> the peer it was welcomed from
        self._control_ipc = shared.address.startswith("ipc://")
        self._tap_key = secrets.token_bytes(16)  # see `_redacted`
        self._orphaned = False  # stop() was called on this thread (see stop)
        self._unread = False  # the last drain of the acks socket left frames there
        self._stops: list[tuple[Stop, str]] = []  # to send once the registry lock is free
        self._refusals = Refusals()  # a warning once per worker and reason

    def command(self, cmd: bytes) -> None:
        if not self.post(cmd):
            log.debug("publisher agent gone: command %r dropped", cmd[:16])

    def stop(self) -> None:
        if self.on_agent_thread:
            # The garbage collector finalized an unclosed Publisher on this very thread:
            # the loop sees the command, says STOP, closes the sockets on its way out and
            # releases the rest itself (it cannot wait for itself here).
            self._orphaned = True
            self.command(b"stop")
            return
        stuck = False
        if self._thread.is_alive():
            self.command(b"stop")
            self._thread.join(self.stop_s)
            stuck = self._thread.is_alive()
            if stuck:
                log.warning("publisher agent thread did not stop within its deadline; its "
                            "sockets are closed and their files removed from here")  # fmt: skip
        self._release()
        if stuck:  # the process may end before the thread gets to its own removal
            self.remove_socket_files()

    def remove_socket_files(self) -> None:
        """Remove the ipc:// socket files this agent bound (libzmq leaves them behind).
        Idempotent; from either thread: the endpoints were read when they were bound."""
        for endpoint in list(self.endpoints.values()):
            if endpoint.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(endpoint[len("ipc://") :])

    def _release(self) -> None:
        self._ack_reader = None  # it uses the acks socket, which goes with the context
        super()._release()

    # --- the loop (agent thread) ---

    def _failed(self, exc: BaseException) -> None:
        self.shared.failure = exc
        with self.shared.cond:
            self.shared.cond.notify_all()

    def _finish(self) -> None:
        self.gate.close()
        bound = [self.control, *self._bus_sockets()]
        # A publishing thread may be using them; it holds `_io` for one bounded step.
        if self.shared.io.acquire(timeout=IO_LOCK_S):
            try:
                self.closed = True
                self._ack_reader = None
                for sock in (self.pipe, *bound):
                    sock.close()
                self.gate.close_zap()  # after them (see there)
            finally:
                self.shared.io.release()
        else:  # left to the context's destroy in stop()
            log.warning("publisher agent: sockets still in use at exit; not closed here")
        self.remove_socket_files()
        if self._orphaned:
            self._release()

    def _bind(self) -> None:
        address, shared = self.shared.address, self.shared
        secure = shared.curve.apply if shared.curve is not None else None
        self.gate = Gate(
            shared.max_connections - _config.CONTROL_CONNECTIONS,
            _config.CONTROL_CONNECTIONS,
            shared.fd_limit,
            shared.role.handshake_rate,  # a worker connects to events once per handshake
        )
        # Bound before any socket: every handshake on a rate-limited or CURVE socket
        # waits for its answer (the allowlist, and the per-peer rates).
        self.gate.serve_zap(self.ctx, shared.curve.allows if shared.curve is not None else None)
        self.control = bind(
            self.ctx,
            zmq.REP,
            address,
            secure,
            max_bytes=_config.CONTROL_MAX_BYTES,
            rcvhwm=_config.CONTROL_RCVHWM,
        )

        def events_options(sock: zmq.Socket[bytes]) -> None:
            sock.setsockopt(zmq.XPUB_WELCOME_MSG, XPUB_WELCOME)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            if secure is not None:
                secure(sock)
            sock.zap_domain = _EVENTS_DOMAIN

        def tap_options(sock: zmq.Socket[bytes]) -> None:
            # Small HWM and NODROP: a slow or stopped sniffer makes send() fail at once
            # (counted as tap_dropped); the bus itself never waits for a sniffer.
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.XPUB_NODROP, 1)
            if secure is not None:
                secure(sock)
            sock.zap_domain = _TAP_DOMAIN

        # Subscribers only ever subscribe to everything: an empty prefix (see
        # `_drain_subscriptions`), so subscription frames are tiny.
        subscriptions = {
            "max_bytes": _config.SUBSCRIPTION_MAX_BYTES,
            "rcvhwm": _config.SUBSCRIPTION_RCVHWM,
        }
        self.events = bind(
            self.ctx,
            zmq.XPUB,
            sibling_endpoint(address, "events"),
            events_options,
            **subscriptions,
        )
        self.acks = bind(
            self.ctx,
            zmq.PULL,
            sibling_endpoint(address, "acks"),
            secure,
            max_bytes=_config.WORKER_MAX_BYTES,
            rcvhwm=_config.WORKER_RCVHWM,
        )
        if shared.tap:
            self.tap = bind(
                self.ctx, zmq.XPUB, sibling_endpoint(address, "tap"), tap_options, **subscriptions
            )
        for sock in (self.control, self.events, self.acks, self.tap):
            if sock is not None:
                protect_ipc(sock, shared.gid)
                endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                xpub = sock is self.events or sock is self.tap
                self.gate.watch(sock, endpoint, control=sock is self.control, rate_limited=xpub)
        self._ack_poller = zmq.Poller()  # for the thread that holds `_io`
        self._ack_poller.register(self.acks, zmq.POLLIN)
        self.acks.rcvtimeo = int(_COLLECT_WAIT_S * 1000)  # only `collect` blocks in recv
        if ACK_READER is not None and self.tap is None:  # a tap sees every message decoded
            pieces, versions, ids, sessions = ack_pattern(self.role.bus_id)
            self._ack_reader = ACK_READER(
                libzmq=libzmq_path(),
                socket=self.acks,
                pieces=pieces,
                versions=versions,
                ids=ids,
                sessions=sessions,
                error=zmq_error,
            )
        self.endpoints = {
            "control": self.control.getsockopt_string(zmq.LAST_ENDPOINT),
            "events": self.events.getsockopt_string(zmq.LAST_ENDPOINT),
            "acks": self.acks.getsockopt_string(zmq.LAST_ENDPOINT),
            "tap": "" if self.tap is None else self.tap.getsockopt_string(zmq.LAST_ENDPOINT),
        }
        with shared.cond:
            self.role.endpoints = Endpoints(
                self.endpoints["events"],
                self.endpoints["acks"],
                self.endpoints["tap"],
                shared.buffers,
            )

    def _loop(self) -> None:
        # The shared sockets (acks, events, tap) are not polled here: a publishing thread
        # reads the acks it waits for itself (see `Publisher._await`), and the agent
        # drains them every SERVICE_S (heartbeats, BYEs, acks nobody waits for). Waiting
        # on them here would wake this thread on every ack, to fight the publishing
        # thread for the GIL.
        poller = zmq.Poller()
        poller.register(self.pipe, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        gate = self.gate
        monitors = gate.monitors()
        for monitor in monitors:  # connections come and go: counted at once (see Gate)
            poller.register(monitor, zmq.POLLIN)
        assert gate.zap is not None
        poller.register(gate.zap, zmq.POLLIN)  # handshakes wait for it: answered at once
        io, beat = self.shared.io, self.role.heartbeat
        next_beat = next_service = time.monotonic()
        while True:
            wake = min(next_beat, next_service)
            wait_ms = 0 if gate.pending else max(0, int((wake - time.monotonic()) * 1000)) + 1
            ready = dict(poller.poll(wait_ms))
            # None of this needs a socket of the bus: not under `_io`.
            if gate.zap in ready:
                gate.on_zap()
            for monitor in monitors:
                if monitor in ready:
                    gate.on_event(monitor)
            if gate.pending:
                gate.settle()
            now = time.monotonic()
            if self.pipe in ready or self.control in ready or now >= next_beat:
                if not io.acquire(timeout=IO_LOCK_S):
                    raise ZmqSyncError("a publishing thread held the sockets for too long")
            elif now < next_service:
                continue  # woken only by connections: leave `_io` to a publishing thread
            elif not io.acquire(blocking=False):
                # A publishing thread holds the sockets and reads the acks itself: taking
                # them the moment it lets go would put this thread's drain (and its turn
                # with the GIL) right where that thread's next publish begins.
                next_service = now + _config.SERVICE_S
                continue
            try:
                if self.pipe in ready and not self._on_commands():
                    return
                if self.control in ready:
                    self._on_request()
                now = time.monotonic()
                if now >= next_service:
                    self._service()
                    next_service = now + _config.SERVICE_S
                if now >= next_beat:
                    self._beat(now)
                    next_beat = now + beat
            finally:
                io.release()
            if self._closing is not None and (self._closing.expired() or not self.role.members):
                return

    def _bus_sockets(self) -> list[zmq.Socket[bytes]]:
        return [s for s in (self.acks, self.events, self.tap) if s is not None]

    def _service(self) -> None:
        """Drain the shared sockets (caller holds `_io`)."""
        self._on_acks()
        self._drain_subscriptions(self.events, self.endpoints["events"])
        if self.tap is not None:
            self._drain_subscriptions(self.tap, self.endpoints["tap"])

    def collect(self, done: Callable[[], bool], deadline: Deadline) -> None:
        """Handle acks on the calling thread until `done()` or the deadline (caller holds `_io`).

        One blocking recv per ack, and one turn under the lock per ack (apply it, then ask
        `done()`). A recv finds a queued ack without a system call; asking the socket
        first whether one is there (ZMQ_EVENTS) makes one every time, and this thread
        comes to each ack with cold caches after the workers ran, so every step counts:
        an ACK is read by `read_ack` (no message object) unless a tap must see it, the
        registry's lock is taken as the plain lock, and other waiters on the condition
        are woken once, when this turn ends, rather than per ack (they wait in turns of
        at most FAST_COLLECT_S and look again). With the native extension the acks
        already queued are read in one call per turn instead (`_collect_batches`).
        """
        if self._ack_reader is not None:
            self._collect_batches(self._ack_reader, done, deadline)
            return
        shared, acks, role = self.shared, self.acks, self.role
        lock, bus = shared.lock, role.bus_id
        ack: tuple[str, str, int] | None = None
        msg: Message | None = None
        changed = False
        now = 0.0
        try:
            while True:
                with lock:
                    if ack is not None:
                        changed |= role.on_ack(ack[0], ack[1], ack[2], now)
                    elif msg is not None:
                        changed |= self._on_worker_message(msg, now)
                    if done():
                        return
                ack = msg = None
                left = deadline.remaining()
                if left is not None and left < _COLLECT_WAIT_S:
                    if left <= 0:
                        return
                    if not self._ack_poller.poll(deadline.poll_ms()):
                        continue
                try:  # a blocking recv (RCVTIMEO) costs less per ack than a poll, then a recv
                    part = acks.recv(copy=False)
                except zmq.Again:
                    continue
                now = time.monotonic()
                if self.tap is None and not part.more:
                    ack = read_ack(part.bytes, bus)
                if ack is None:
                    msg = self._read(part)
        finally:
            if changed:
                with shared.cond:
                    shared.cond.notify_all()
            self._send_stops()

    def _collect_batches(self, reader: Any, done: Callable[[], bool], deadline: Deadline) -> None:
        """`collect` with the native reader: every turn takes what is queued (at least
        one message, waiting up to the socket's RCVTIMEO for it), applies its ACKs under
        one lock, then asks `done()`. Other messages are decoded as `_read` does; a
        multipart one (never ours) comes whole from the reader, dropped, counted once."""
        shared, role = self.shared, self.role
        lock = shared.lock
        batch: list[tuple[Any, ...]] = []
        msgs: list[Message] = []
        changed = False
        now = 0.0
        try:
            while True:
                with lock:
                    for item in batch:
                        if type(item[0]) is str:
                            changed |= role.on_ack(item[0], item[1], item[2], now)
                    for msg in msgs:
                        changed |= self._on_worker_message(msg, now)
                    if done():
                        return
                left = deadline.remaining()
                if left is not None and left < _COLLECT_WAIT_S:
                    if left <= 0:
                        return
                    if not self._ack_poller.poll(deadline.poll_ms()):
                        batch, msgs = [], []
                        continue
                batch = reader.read(_BATCH_MAX)
                now = time.monotonic()
                msgs = [m for m in map(self._read_part, batch) if m is not None]
        finally:
            if changed:
                with shared.cond:
                    shared.cond.notify_all()
            self._send_stops()

    def _read_part(self, item: tuple[Any, ...]) -> Message | None:
        """A message the native reader did not take as an ACK, as a message (or None).

        The reader returns whole messages (a multipart one as its first frame), so
        nothing here depends on an earlier read: whatever read the socket before, this
        thread or the agent's Python drain, no honest frame is taken for a part.
        """
        if type(item[0]) is str:
            return None  # an ACK, applied as it is
        frame, multipart = item
        if multipart:
            self._dropped_multipart(frame)
            return None
        return self._message(frame)

    def send_event(self, msg: Message, peer: str = "") -> None:
        """Send on the events socket (caller holds `_io`)."""
        frame = encode(msg)
        self.events.send(frame)
        if self.tap is not None:
            self._mirror("out", peer, self._redacted(msg, frame))

    def send_frame(self, frame: bytes, peer: str = "") -> None:
        """Send an encoded event (caller holds `_io`)."""
        send_bytes(self.events, frame, 0)
        if self.tap is not None:
            self._mirror("out", peer, frame)

    def _redacted(self, msg: Message, frame: bytes) -> bytes:
        """`frame` as a sniffer may see it: sessions and nonces replaced by a keyed hash.

        A session is a worker's capability: whoever knows it can ACK (or BYE) as that
        worker, or re-join in its place; a HELLO's nonce proves a worker's process, so
        whoever knows it can take that worker's place too. The tap shows the same
        stand-in for the same secret, so a capture still tells one session's (or one
        process's) messages apart from another's.
        """
        session = getattr(msg, "session", None)
        if session is None:  # a message without a session field is shown as it is
            return frame
        secrets_of = {"session": self._stand_in(session)}
        if isinstance(msg, Hello):
            secrets_of["nonce"] = self._stand_in(msg.nonce)
        return encode(dataclasses.replace(cast(Any, msg), **secrets_of))

    def _stand_in(self, secret: str) -> str:
        """A keyed hash of `secret` ("" stays ""), in hex as long as the secret (so the
        redacted message still passes the field's check)."""
        if not secret:
            return ""
        size = max(1, len(secret) // 2)
        return hashlib.blake2b(secret.encode(), key=self._tap_key, digest_size=size).hexdigest()

    def _mirror(self, direction: str, peer: str, frame: bytes) -> None:
        """Copy a frame to the tap, if open; never blocks (drops are counted)."""
        if self.tap is None:
            return
        record = Tap(self.role.bus_id, time.time(), direction, peer[:128], frame)
        try:
            self.tap.send(encode(record), zmq.NOBLOCK)
        except zmq.Again:
            self._count("tap_dropped")

    def _on_commands(self) -> bool:
        while self.pipe.poll(0):
            cmd = self.pipe.recv().split()
            if cmd[0] == b"evict":
                self.send_event(self.role.stop_for(cmd[1].decode(), "evicted"), cmd[2].decode())
            elif cmd[0] == b"stop" and self._closing is None:
                with self.shared.cond:
                    stop = self.role.close()
                self.send_event(stop)
                self._closing = Deadline(_config.CLOSE_BYE_WAIT_S)
        return True

    def _on_request(self) -> None:
        # Never a blocking recv: REP skips a message without the envelope delimiter and
        # waits for the next one, so a peer sending such messages kept a blocking recv
        # (and the heartbeats behind it) waiting for as long as it liked.
        try:
            first = self.control.recv(NOBLOCK, copy=False)
            frames = [first.bytes]
            while self.control.rcvmore:  # a request is one frame; the rest is not kept
                self.control.recv(NOBLOCK, copy=False)
                frames.append(b"")
        except zmq.Again:
            return
        reply: Message
        msg: Message | None = None
        peer = ""
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one frame, got {len(frames)}")
            msg = decode(frames[0], bus=self.role.bus_id)
            peer = msg.worker_id if isinstance(msg, Hello) else "inspector"
            if self.tap is not None:
                self._mirror("in", peer, self._redacted(msg, frames[0]))
            if isinstance(msg, Hello):
                reply = self._welcome(msg, self._peer(first))
            elif isinstance(msg, Inspect):
                reply = self._state()
            else:
                raise ProtocolError(f"{msg.TYPE} is not a request")
        except ProtocolError as exc:
            self._count("rejected")
            hello = isinstance(msg, Hello)  # a worker the operator waits for: a warning
            level = self._refusals.level(peer, str(exc), self.role.closing, hello)
            log.log(level, "%s%s refused: %s", "worker " * hello, printable(peer or "request"),
                    printable(exc))  # fmt: skip
            if not peer:
                self._mirror("in", "", frames[0][:4096] if frames else b"")
            reply = Error(self.role.bus_id, str(exc)[:1024])
        frame = encode(reply)
        self.control.send(frame)
        if self.tap is not None:
            if isinstance(reply, Welcome):  # handle bytes never reach a sniffer
                redacted = tuple(dataclasses.replace(b, handle=b"") for b in reply.buffers)
                reply = dataclasses.replace(reply, buffers=redacted)
            self._mirror("out", peer, self._redacted(reply, frame))

    def _peer(self, frame: zmq.Frame) -> str:
        """The peer a control request came from, as libzmq saw the connection (its
        process on ipc://, its host on tcp://), never as the request says."""
        try:
            address = frame.get("Peer-Address")
        except zmq.ZMQError:
            address = ""
        return peer_of(str(address), ipc=self._control_ipc)

    def _welcome(self, hello: Hello, peer: str) -> Welcome:
        """Admit and register a worker (see `PublisherRole`); a worker that reads the CPU
        copy of CUDA weights gets the current slot's copy made before its WELCOME. Its
        peer becomes a member (see `Gate`): its events and acks connects, which follow,
        are never refused."""
        shared, role = self.shared, self.role
        with shared.cond:
            full = self.gate.full(2)
            hello = role.admit(hello, time.monotonic(), peer=peer, connections_full=full)
        copy = role.cuda and hello.transport == "cpu"
        with shared.write_lock if copy else contextlib.nullcontext():
            with shared.cond:
                welcome, old = role.welcome(hello, time.monotonic(), peer)
                shared.cond.notify_all()
            if copy and shared.fill_mirror is not None:
                shared.fill_mirror(welcome.slot)
        self.gate.welcomed(peer)
        self._member_peers[hello.worker_id] = peer
        if old is not None:  # whoever still holds the old session learns it is over
            self.send_event(role.stop_for(old.session, "replaced"), old.worker_id)
        again = rejoin_note(hello.transport, hello.session, old)
        log.info("worker %s joined (pid %d, %s, %s)%s", hello.worker_id, hello.pid,
                 printable(hello.host), hello.mode, again)  # fmt: skip
        if role.cuda:
            note = hello.transport_note
            log.info(
                "worker %s reads the %s buffer%s",
                hello.worker_id,
                hello.transport,
                f": {printable(note)}" if note else "",
            )
        return welcome

    def _state(self) -> State:
        connections = {"connections": self.gate.total, "refused_connections": self.gate.refused}
        with self.shared.lock:
            return self.role.state(time.monotonic(), pid=os.getpid(), extra=connections)

    def _on_acks(self) -> None:
        """Handle what waits on the acks socket (the caller holds `_io`).

        Worker messages are decoded first and applied to the registry under one lock.
        """
        shared, acks, now = self.shared, self.acks, time.monotonic()
        messages: list[Message] = []
        budget = Drain()
        while readable(acks):
            part = acks.recv(copy=False)
            msg = self._read(part)
            if msg is not None:
                messages.append(msg)
            if not budget.spend(len(part)):
                break
        self._unread = readable(acks)  # the liveness sweep waits for what is left
        if messages:
            with shared.cond:
                changed = False
                for msg in messages:
                    changed |= self._on_worker_message(msg, now)
                if changed:
                    shared.cond.notify_all()
            self._send_stops()

    def _read(self, part: zmq.Frame) -> Message | None:
        """A frame from the acks socket as a message; None (counted) if it is not one.

        The frame says itself whether more parts follow (asking the socket, RCVMORE,
        cost ~4 us more per ack on a cold thread).
        """
        frame, more = part.bytes, part.more
        # Multipart is not ours: read and drop (its parts come together). A tail longer
        # than the budget is left: each of its frames is then junk on its own to the next
        # reader, which keeps no state about it (see `_read_part`).
        if more:
            tail, budget = True, Drain()
            while tail:
                try:
                    rest = self.acks.recv(copy=False)
                except zmq.Again:
                    break
                tail = rest.more and budget.spend(len(rest))
            self._dropped_multipart(frame)
            return None
        return self._message(frame)

    def _dropped_multipart(self, frame: bytes) -> None:
        """A multipart message on the acks socket (never ours): counted, dropped."""
        self._count("rejected")
        log.debug("dropped message on acks: expected one frame, got several")
        self._mirror("in", "", frame[:4096])

    def _message(self, frame: bytes) -> Message | None:
        """One whole frame from the acks socket as a message; None (counted) if it is not."""
        try:
            msg = decode(frame, bus=self.role.bus_id)
        except ProtocolError as exc:
            self._count("rejected")
            log.debug("dropped message on acks: %s", printable(exc))
            self._mirror("in", "", frame[:4096])
            return None
        if self.tap is not None:
            self._mirror("in", getattr(msg, "worker_id", ""), self._redacted(msg, frame))
        return msg

    def _on_worker_message(self, msg: Message, now: float) -> bool:
        """Apply one worker message (caller holds `cond`); True if waiters should look.
        A STOP for a dropped session still beating is sent by `_send_stops`, after."""
        left = self.role.member(msg.worker_id, msg.session) if type(msg) is Bye else None
        changed = self.role.on_worker_message(msg, now)
        if changed and left is not None:  # a warning if it never applied a version
            level, note = departure(left)
            log.log(level, "worker %s left%s", left.worker_id, note)
        elif isinstance(msg, Heartbeat) and msg.worker_id:
            stop = self.role.gone(msg.worker_id, msg.session, now)
            if stop is not None:
                self._stops.append((stop, msg.worker_id))
        return changed

    def _send_stops(self) -> None:
        """Send the STOPs `_on_worker_message` decided on (caller holds `_io`)."""
        while self._stops:
            stop, worker_id = self._stops.pop(0)
            log.info("worker %s beats with a session no longer on the bus: told", worker_id)
            self.send_event(stop, worker_id)

    def _beat(self, now: float) -> None:
        role = self.role
        self.send_event(role.heartbeat_event())
        with self.shared.cond:
            lost = role.drop_silent(now, unread=self._unread)
            if lost:
                self.shared.cond.notify_all()
            members = role.members
            gone = [wid for wid in self._member_peers if wid not in members]
        for wid in gone:
            del self._member_peers[wid]
        for peer in set(self._member_peers.values()):  # members while on the bus
            self.gate.welcomed(peer)
        for member in lost:
            level, note = departure(member)  # a warning if it never applied a version
            log.log(level, "worker %s silent for %.1f s%s: dropped", member.worker_id,
                    role.silent_after, note)  # fmt: skip
            self.send_event(role.stop_for(member.session, "silent too long"), member.worker_id)

    def _drain_subscriptions(self, sock: zmq.Socket[bytes], endpoint: str) -> None:
        """Read what peers sent an XPUB socket; drop anyone who sent more than the protocol.

        A subscriber subscribes to everything (an empty prefix), once per connection,
        and the welcome frame did the rest. libzmq keeps every other subscription a peer
        sends in a tree, ~1 KiB per distinct prefix, until that peer leaves: a peer that
        sends one is disconnected here, once, which frees it. Unsubscriptions cost
        nothing (libzmq also makes them itself when a peer leaves). A flood is read as
        fast as it comes: per frame one recv and a comparison.
        """
        # Read all there is (up to a bound): each junk frame left waiting is a peer not
        # dropped yet, feeding libzmq more subscriptions with every socket call.
        budget, rejected, dropped, seen = Drain(frames=16 * _config.DRAIN_MAX), 0, 0, set()
        mark, emptied = self.gate.mark(endpoint), True
        while readable(sock):
            frame = sock.recv(copy=False)
            data = frame.bytes
            if data[:1] != b"\x00" and data != _SUBSCRIBE_ALL:
                rejected += 1
                fd = source_fd(frame)
                if fd is not None and fd not in seen:
                    seen.add(fd)  # dropped only if proven to be the sender (see Gate.drop)
                    dropped += self.gate.drop(endpoint, fd, _peer_address(frame))
            if not budget.spend(len(data)):
                emptied = False
                break
        self.gate.drained(endpoint, mark, emptied)
        if rejected:
            with self.shared.lock:
                self.role.count("rejected", rejected)
                self.role.count("dropped_peers", dropped)

    def _count(self, what: str) -> None:
        with self.shared.lock:
            self.role.count(what)


def _peer_address(frame: zmq.Frame) -> str:
    """libzmq's Peer-Address of the connection a frame came in on ("" if none)."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return ""
