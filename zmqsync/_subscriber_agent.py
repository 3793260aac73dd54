"""The worker's agent thread: the socket loop around its `Link` (see `Subscriber`).

`Agent` owns the subscriber's sockets (handshake REQ, events SUB, acks PUSH). It decodes
each frame, hands the message to the `Link` and carries out the answer: apply through
its `Port`, send on ``acks``. Where `can_take` allows, a follower (the native one or its
Python twin, see `_reference_follower`) takes the versions from RECEIVE to ACK, and the
loop handles what it leaves. `Waiters` are the user's threads in
``Subscriber.wait_for_version``; the agent wakes them once a version's ACK is out.

It never holds the `Subscriber`, only a `Port` of weak calls: a Subscriber collected
without close() must still be able to stop it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from . import _config
from ._config import XPUB_WELCOME
from ._deadline import Deadline
from ._errors import BufferUnavailable, ConnectTimeout, LayoutMismatch, ProtocolError
from ._fast_frames import read_receive, template
from ._link import Action, Handshake, Link, Lost, Offer, Rejected, Repair, Stopped
from ._protocol import (
    MAX_EVENT,
    Ack,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Welcome,
    decode,
    encode,
)
from ._sockets import (
    CANCEL_CHECK_S,
    NOBLOCK,
    Secure,
    connect,
    request,
    resolve_endpoint,
    send_bytes,
)
from ._text import printable
from ._worker_state import WorkerState

__all__ = ["SUBSCRIBE_TURN_S", "WAITING_NOTE_S", "Agent", "Port", "Waiters"]

log = logging.getLogger(__name__)
_WAKE = b"\x01"  # from the subscriber's own inproc PUB: look at the flags (never a message)
_WAIT_CAP_S = 0.1
WAITING_NOTE_S = 1.0  # a handshake not answered by then is said to wait (see `start`)
_BYE_WAIT_MS = 500  # a BYE after a failed join: how long to wait to send it, and to flush
_RETRIED = ("busy:", "bus full")  # refusals a handshake retries within its deadline
# The first turn of the wait for a subscription's confirmation (then a new connection).
SUBSCRIBE_TURN_S = 1.0
NEVER = 1 << 63  # above any version: nobody waits for one


class Waiters:
    """The versions the user's threads wait for in `wait_for_version`.

    With the native extension they sleep on a `gate` (a futex, see `_follow`), opened
    with every version once its ACK is out. Else on the condition: the agent wakes them
    only once a version they wait for is applied, and only after its ACK went out: a
    thread woken on every version (one in ``wait_for_version`` of a far version, or in
    ``wait_for_stop``) took the GIL from the agent before its ACK was sent, and added a
    thread wake-up per version to what every worker on the cores pays. `awaited` is
    read without the lock: a waiter registers under the Subscriber's lock before it
    sleeps, and the agent stores the version under that lock before it reads.
    """

    def __init__(self, cond: threading.Condition, gate: Any) -> None:
        self.cond = cond
        self.gate = gate  # a `_native.Gate`, or None
        self.awaited = NEVER  # the lowest version a thread waits for on the condition
        self._wanted: list[int] = []

    def add(self, version: int) -> None:
        """A thread waits for `version` on the condition (caller holds `cond`)."""
        self._wanted.append(version)
        self.awaited = min(self.awaited, version)

    def remove(self, version: int) -> None:
        """It no longer does (caller holds `cond`)."""
        self._wanted.remove(version)
        self.awaited = min(self._wanted, default=NEVER)

    def wake(self, version: int) -> None:
        """`version` is applied and acked: wake the threads that wait for it, if any."""
        if self.gate is not None:
            self.gate.open(version)
        if version >= self.awaited:
            with self.cond:
                self.cond.notify_all()

    def kick(self) -> None:
        """Wake every waiter to look again (closed, stopped, failed)."""
        if self.gate is not None:
            self.gate.kick()


@dataclass(frozen=True, slots=True)
class Port:
    """Everything the agent thread may ask of its Subscriber, and nothing else.

    The reader and the calls are weak: the thread never keeps an unclosed Subscriber
    alive (a reader's ``on_update`` may hold it). When one is collected (in a reference
    cycle its weak references die before its finalizer runs), a call raises
    ReferenceError; the thread then says BYE with what the Link holds.
    """

    address: str  # the control address
    secure: Secure  # CURVE for every socket, or None
    timeout: float | None  # the handshake's (caps the wait for the subscription)
    # the worker's `Reader` (a weak proxy): transport, buffers, apply, follower
    reader: Any
    offer: Callable[[Offer], int | None]  # a version arrived: the version to ACK (weak)
    follows: bool  # whether a follower may ever take the versions (`Reader.follows`)
    state: WorkerState  # what the model computes with
    fail: Callable[[BaseException], None]  # the thread failed: raise it to the user
    notify: Callable[[], None]  # the link changed: wake whoever waits on it
    waiters: Waiters  # wake those waiting for a version once it is acked


class Agent:
    """The thread that owns the subscriber's sockets (handshake REQ, events SUB, acks PUSH).

    A socket loop: what to do with each message and each beat is the `Link`'s decision;
    applying is the Subscriber's (through `port`).
    """

    def __init__(self, link: Link, port: Port, name: str) -> None:
        self.link = link
        self.port = port
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.events: zmq.Socket[bytes] | None = None
        self.acks: zmq.Socket[bytes] | None = None
        self._started = threading.Event()
        self._startup: BaseException | None = None
        self._deadline = Deadline(10.0)
        self._terminating = False
        self._answered = False  # a publisher answered a HELLO (see `start`)
        # `acks` is used by the agent and, in manual mode, by the user's thread (ACK after
        # poll()); both send under this lock.
        self._send_lock = threading.Lock()
        self._acks: tuple[str, str, Callable[[int], bytes]] | None = None  # session, bus
        # The native path (see `_follow`), built for one handshake's sockets and session.
        self._follower: Any = None
        # The agent blocks in recv() on its SUB socket, which is also connected to this
        # inproc PUB: close() wakes it with one frame (see `_loop`).
        self._wake = self.ctx.socket(zmq.PUB)
        self._wake.linger = 0
        self._wake_addr = f"inproc://zmqsync-sub-wake-{id(self)}"
        self._wake.bind(self._wake_addr)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def session(self) -> str:
        """This worker's session on the bus joined ("" before the first WELCOME)."""
        return self.link.session

    def start(self, deadline: Deadline, waiting: Callable[[], None] | None = None) -> None:
        """Handshake and apply the current version on the agent thread, waiting for it
        here; `waiting` is called once if no publisher answered within WAITING_NOTE_S
        (a worker started before its trainer says so, rather than nothing for long)."""
        self._deadline = deadline
        self._thread.start()
        if waiting is not None and not self._started.wait(deadline.wait_s(WAITING_NOTE_S)):
            if not self._answered and not deadline.expired():
                waiting()
        # The handshake itself is bounded by `deadline`; FIRST_APPLY_S covers the apply.
        margin = deadline.remaining()
        self._started.wait(None if margin is None else margin + _config.FIRST_APPLY_S)
        if self._startup is not None or not self._started.is_set():
            failure = self._startup or ConnectTimeout("subscriber did not start in time")
            self.stop()
            raise failure

    def wake(self) -> None:
        with self._send_lock:
            if not self._wake.closed:
                self._wake.send(_WAKE)

    def ack_from_user(self, version: int, bus: str) -> None:
        """Manual mode: ACK what the user's thread just applied (if still on that bus)."""
        if bus == self.link.bus_id:
            self._ack(version)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._terminating = True
            self.wake()
            self._thread.join(_config.THREAD_JOIN_S)
        with self._send_lock:
            self._wake.close()
        if not self._thread.is_alive():
            self.ctx.destroy(linger=0)
            return
        # Still inside a libzmq call (a REQ send no peer takes blocks for good): closing
        # its sockets from this thread may abort the process. Terminating the context
        # makes that call raise ContextTerminated instead; the agent then closes its
        # sockets, which the term (on a thread of its own) waits for.
        log.warning("subscriber agent thread did not stop within its deadline")
        threading.Thread(target=self.ctx.term, name="zmqsync-sub-term", daemon=True).start()

    # --- agent thread ---

    def _run(self) -> None:
        try:
            self._handshake(self._deadline, attempts=_config.HANDSHAKE_ATTEMPTS)
        except BaseException as exc:
            self._startup = exc
            self._close_sockets()
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except ReferenceError:
            pass  # the Subscriber was collected; its finalizer is stopping this thread
        except zmq.ContextTerminated:
            pass  # stop() gave up waiting and terminated the context (see there)
        except BaseException as exc:
            log.exception("subscriber agent failed")
            with contextlib.suppress(ReferenceError):
                self.port.fail(exc)
        finally:
            bye = self.link.close()
            if bye is not None:
                self._send(bye, linger_ms=200)
            self._close_sockets()
            with contextlib.suppress(ReferenceError):
                self.port.notify()

    def _close_sockets(self) -> None:
        self._follower = None
        with self._send_lock:
            for sock in (self.events, self.acks):
                if sock is not None:
                    sock.close()

    def _handshake(self, deadline: Deadline, attempts: int) -> None:
        link, port = self.link, self.port
        self._follower = None  # its sockets and session go
        transport, note = port.reader.initial_transport()
        hello = link.hello(os.getpid(), socket.gethostname()[:255], transport, note)
        reply = self._request_welcome(hello, deadline, attempts)
        self._answered = True
        # map and check the buffers first: a hostile WELCOME stops here
        try:
            fallback = port.reader.adopt(reply, hello, None)
            if fallback is not None:  # what the HELLO asked for cannot work here: say why
                hello = link.fallback_hello(hello, reply, fallback.transport, fallback.reason)
                reply = self._request_welcome(hello, deadline, attempts)
                port.reader.adopt(reply, hello, fallback)
        except LayoutMismatch:
            self._leave(reply)
            raise
        events = resolve_endpoint(port.address, reply.events)
        self._subscribe(events, deadline, reply.heartbeat)
        acks = connect(self.ctx, zmq.PUSH, resolve_endpoint(port.address, reply.acks), port.secure)
        acks.setsockopt(zmq.SNDHWM, 10_000)
        with self._send_lock:  # the user's thread may be sending a manual-mode ACK
            if self.acks is not None:
                self.acks.close()
            self.acks = acks
        offer = link.welcome(reply, time.monotonic(), port.reader.latest())
        port.notify()  # connected, and not stopped
        if offer is None or self._terminating:
            return
        applied = port.reader.join(offer)
        if applied is not None:
            self._applied(applied)

    def _request_welcome(self, hello: Hello, deadline: Deadline, attempts: int) -> Welcome:
        """HELLO -> WELCOME (Lazy Pirate), retried while the publisher says it is busy or
        full (both pass: a storm ends, a silent holder is dropped, members leave)."""
        address = self.port.address
        while True:
            reply = request(
                self.ctx,
                address,
                hello,
                deadline=deadline,
                attempts=attempts,
                secure=self.port.secure,
                cancelled=self._cancelled,
            )
            if not (isinstance(reply, Error) and reply.reason.startswith(_RETRIED)):
                break
            # Busy (a HELLO storm, or our worker id still held or kept for a process that
            # may come back) or full: retry while a retry can still get an answer in time,
            # then report the refusal rather than a timeout.
            left = deadline.remaining()
            if (left is not None and left < 0.25) or self._terminating:
                break
            time.sleep(0.05)
        if isinstance(reply, Error):
            final = self.link.refused(reply.reason)
            if final is not None:
                self._give_up(final)
            raise ProtocolError(f"the publisher at {address} refused us: {reply.reason}")
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"expected WELCOME, got {reply.TYPE}")
        # endpoints first: a WELCOME pointing elsewhere is refused before anything is mapped
        resolve_endpoint(address, reply.events)
        resolve_endpoint(address, reply.acks)
        return reply

    def _leave(self, welcome: Welcome) -> None:
        """BYE for a session whose version this worker cannot apply (its model has
        another layout): the publisher forgets it now, and logs that it left without
        applying, rather than after waiting for it to go silent."""
        endpoint = resolve_endpoint(self.port.address, welcome.acks)
        sock = connect(self.ctx, zmq.PUSH, endpoint, self.port.secure)
        try:
            if sock.poll(_BYE_WAIT_MS, zmq.POLLOUT):
                sock.linger = _BYE_WAIT_MS
                bye = Bye(welcome.bus, self.link.worker_id, welcome.session)
                send_bytes(sock, encode(bye), NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("no BYE after a failed join: %s", exc)
        finally:
            sock.close()

    def _subscribe(self, endpoint: str, deadline: Deadline, heartbeat: float) -> None:
        """Connect SUB and wait until the publisher confirms the subscription is live.

        The wait is in turns (SUBSCRIBE_TURN_S or two beats, doubling each turn): a
        connection whose confirmation has not come by the end of a turn is replaced by a
        new one, rather than waited on for the whole deadline (on a saturated host a
        worker once waited its whole timeout on one that never confirmed).
        """
        turn = max(SUBSCRIBE_TURN_S, 2 * heartbeat)
        while True:
            events = self._connect_events(endpoint, heartbeat)
            this_turn = Deadline(deadline.wait_s(turn))
            while not this_turn.expired() and not self._terminating:
                if events.poll(this_turn.poll_ms(cap_s=CANCEL_CHECK_S)) & zmq.POLLIN:
                    if events.recv() == XPUB_WELCOME:
                        return
            if deadline.expired() or self._terminating:
                raise ConnectTimeout(f"no subscription confirmation from {endpoint} in time")
            log.debug(
                "no subscription confirmation from %s in %.1f s: reconnecting", endpoint, turn
            )
            turn *= 2

    def _connect_events(self, endpoint: str, heartbeat: float) -> zmq.Socket[bytes]:
        """A new SUB on `endpoint` (and on the wake-up pipe), replacing the one there was."""
        if self.events is not None:
            self.events.close()
        # The largest legal event: a RECEIVE of the largest bus, with its `changed` bitmap
        self.events = connect(self.ctx, zmq.SUB, endpoint, self.port.secure, max_bytes=MAX_EVENT)
        self.events.setsockopt(zmq.SUBSCRIBE, b"")
        self.events.setsockopt(zmq.RCVHWM, 100_000)
        self.events.connect(self._wake_addr)
        # The loop's longest wait: a fraction of a beat, and short enough that a lost
        # wake-up frame still lets close() finish soon.
        self.events.rcvtimeo = max(1, int(min(heartbeat / 2, _WAIT_CAP_S) * 1000))
        return self.events

    def _loop(self) -> None:
        # One blocking recv() on the SUB socket, not a poller over several sockets: a
        # zmq_poll per version cost a worker ~20 us of CPU, as much as the rest of a raw
        # round trip. The socket's RCVTIMEO bounds the wait (heartbeats, the LOST
        # state's retries), and close() wakes it through the inproc PUB it is also
        # connected to. The clock is read again after a frame: an apply may have taken
        # a while, and a beat due since must not wait for the next frame or timeout.
        #
        # A RECEIVE of our bus, one per version, takes the short way: its fields read in
        # one call (no message object), the Link's rule for it, the apply, the ACK. On
        # a machine where every worker's thread comes to its version with cold caches,
        # each call and object on this way costs microseconds, and every worker's pay
        # adds up before the last ACK is in. Where the native Follower can be used (see
        # `_follow`), it blocks in the receive instead and takes those versions itself;
        # what it leaves comes here as a frame, as from recv().
        link, port = self.link, self.port
        while not self._terminating:
            events = self.events
            if events is None:  # not subscribed (between handshake attempts)
                time.sleep(min(link.heartbeat, _WAIT_CAP_S))
                frame = None
            elif self._follower is not None:  # the native path: it hands us what it left
                frame = self._follow(self._follower, port)
            else:
                try:
                    frame = events.recv()
                except zmq.Again:  # RCVTIMEO: time to look at the clock
                    frame = None
            if frame is not None:  # a frame queued behind it is the next recv()'s, at once
                fields = read_receive(frame, link.bus_id)
                if fields is not None:
                    seq, version, slot, changed = fields
                    action = link.on_receive(seq, version, slot, changed, time.monotonic())
                    if type(action) is Offer:
                        applied = port.offer(action)
                        if applied is not None:
                            self._applied(applied)
                    elif action is not None:
                        self._do(action)
                elif frame != XPUB_WELCOME and frame != _WAKE:
                    self._on_frame(frame, time.monotonic())
            now = time.monotonic()
            if now >= link.next_tick:
                for due in link.tick(now, port.state.version):
                    self._do(due)

    def _follow(self, follower: Any, port: Port) -> bytes | None:
        """Let the Follower take the versions it can; the frame it left for us, if any."""
        link = self.link
        got = follower.next(link.last_seq, port.state.version, link.next_tick)
        if type(got) is int:  # applied and acked there, the gate opened: a beat is due
            return None
        if type(got) is tuple:  # applied there; its ACK did not fit in the queue
            self._applied(got[0])
            return None
        return got  # type: ignore[no-any-return]

    def _on_frame(self, frame: bytes, now: float) -> None:
        try:
            msg = decode(frame)
        except ProtocolError as exc:
            self.link.on_invalid()
            log.debug("dropped event: %s", printable(exc))
            return
        action = self.link.on_event(msg, now)
        if action is not None:
            self._do(action)

    def _applied(self, version: int) -> None:
        """`version` is what the model computes with now: ACK it, then wake its waiters.
        Applied the Python way: a follower may take the versions that follow from now
        on, if `can_take` says so (asked after every such version, so one applied before
        the model was bound to a `Switch` is no reason to stay on this way; a handful of
        attribute reads, on a port that may follow at all: alias mode, background apply).
        """
        self._ack(version)
        self.port.waiters.wake(version)
        port = self.port
        if port.follows and self._follower is None:
            events, acks = self.events, self.acks
            if events is not None and acks is not None:
                self._follower = port.reader.follower(self.link, events, acks)

    def _do(self, action: Action) -> None:
        """Carry out what the Link decided."""
        if isinstance(action, Offer):  # first: one per version
            applied = self.port.offer(action)
            if applied is not None:
                self._applied(applied)
        elif isinstance(action, Heartbeat):
            self._send(action)
        elif isinstance(action, Repair):
            offer = self.link.repair(self.port.reader.latest())
            if offer is not None:
                self._do(offer)
        elif isinstance(action, Lost):
            log.info(
                "subscriber %s lost the publisher: %s",
                self.link.worker_id,
                printable(action.reason),
            )
            self.port.notify()
        elif isinstance(action, Stopped):
            self.port.notify()
        elif isinstance(action, Rejected):
            log.debug("dropped %s", action.reason)
        elif isinstance(action, Handshake):
            self._rejoin()

    def _rejoin(self) -> None:
        """LOST: one handshake attempt (the Link asks at once, then once per beat), with
        the deadline the Link gives it (`Link.rejoin_deadline`: not shorter than a
        handshake on a loaded host, growing while attempts fail). An attempt cut short
        costs nothing but time: the next HELLO carries the same nonce, so the session
        the publisher registered for the one given up on never stands in its way. Every
        wait in it ends at once when the Subscriber closes.
        """
        seconds = self.link.rejoin_deadline()
        try:
            self._handshake(Deadline(seconds), attempts=1)
            log.info(
                "subscriber %s re-joined %s at version %d",
                self.link.worker_id,
                self.port.address,
                self.port.state.version,
            )
        except (ConnectTimeout, ProtocolError, BufferUnavailable) as exc:
            # BufferUnavailable: the segment a WELCOME named is gone — its publisher was
            # killed and the next one's start collected it. The next attempt gets the
            # new publisher's WELCOME; giving up here would strand the worker for good.
            self.link.rejoin_failed(seconds)
            log.debug("re-handshake failed: %s", printable(exc))

    def _cancelled(self) -> bool:
        return self._terminating

    def _give_up(self, refused: Stopped) -> None:
        """A final refusal (the Link is REFUSED): close the bus's sockets, wake waiters."""
        log.warning("subscriber %s stops: %s", self.link.worker_id, printable(refused.reason))
        self._follower = None
        with self._send_lock:
            for sock in (self.events, self.acks):
                if sock is not None:
                    sock.close()
            self.events = self.acks = None
        self._do(refused)

    def _ack(self, version: int) -> None:
        """ACK from a template: bus and session change only on a re-join (the worker id
        never does)."""
        link = self.link
        acks = self._acks
        if acks is None or acks[0] != link.session or acks[1] != link.bus_id:
            bus, session = link.bus_id, link.session  # a race only builds it twice
            ack = template(Ack, bus=bus, worker_id=link.worker_id, session=session)
            acks = self._acks = (session, bus, ack)
        self._send_frame(acks[2](version), Ack.TYPE)

    def _send(self, msg: Bye | Heartbeat, linger_ms: int = 0) -> None:
        self._send_frame(encode(msg), msg.TYPE, linger_ms)

    def _send_frame(self, frame: bytes, kind: str, linger_ms: int = 0) -> None:
        with self._send_lock:
            if self.acks is None or self.acks.closed or not self.link.session:
                return
            try:
                send_bytes(self.acks, frame, NOBLOCK)
            except zmq.Again:
                log.debug("acks queue full: %s dropped", kind)
            except zmq.ContextTerminated:  # stop() gave up on this thread
                return
            if linger_ms:
                self.acks.linger = linger_ms
