"""A relay's control channel: joins, heartbeats, reports, the root's liveness.

`RelayAgent` owns the relay's DEALER to the root's control ROUTER. It finds the root
through the rendezvous store, sends JOIN (again, whenever the root is lost or ends the
session), a STATUS every heartbeat, and the reports other threads hand it; what the
data thread must act on (PREPARE, COMMIT, a notice that missed the data channel, "the
root is lost") goes into that thread's inbox.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import zmq

from .. import _config
from .._agent_thread import AgentThread
from .._deadline import Deadline
from .._errors import ConnectTimeout, ProtocolError
from .._protocol import WorkerEntry
from .._publisher import Publisher
from .._sockets import connect
from ._messages import (
    MAX_RELAY_WORKERS,
    RELAY,
    Accept,
    Bye,
    Commit,
    Evict,
    Join,
    Prepare,
    Refuse,
    Report,
    Send,
    Status,
)
from ._rendezvous import control_key, data_key, ip
from ._root_agent import ROOT_CLOSED

__all__ = ["Holding", "Inbox", "RelayAgent"]

log = logging.getLogger(__name__)
BYE_S = 2.0  # what a relay's stop waits beyond THREAD_JOIN_S: its BYE to the root

# What the data thread is told: a message from the root with the store its group is
# built on, or "lost" (the root is gone or ended our session) or "stop".
Inbox = queue.SimpleQueue[tuple[Prepare | Commit | Send | str, Any]]


@dataclass(eq=False)
class Holding:
    """What a relay's bus holds, as its threads share it (tuples: read whole, unlocked).

    `have` is (root bus, root version) of the last version on the local bus; `acked`
    the last one its local workers acked; `gen` the generation the data thread is in
    (-1: none); `publisher` the local bus once it exists.
    """

    have: tuple[str, int] = ("", -1)
    acked: tuple[str, int] = ("", -1)
    gen: int = -1
    publisher: Publisher | None = None

    def status(self, session: str) -> Status:
        """The heartbeat a relay sends: what it holds, and its local workers."""
        bus, version = self.have
        acked = self.acked[1] if self.acked[0] == bus else -1
        return Status(session, self.gen, bus, version, acked, local_workers(self.publisher))


def local_workers(pub: Publisher | None) -> tuple[WorkerEntry, ...]:
    """The local bus's workers as a STATUS reports them (`last_seen`: seconds ago)."""
    if pub is None:
        return ()
    now = time.time()
    return tuple(
        WorkerEntry(
            w.worker_id,
            w.pid,
            w.host[:255],
            w.mode,
            w.transport,
            w.version,
            max(0.0, now - w.last_seen),
        )
        for w in list(pub.workers.values())[:MAX_RELAY_WORKERS]
    )


class RelayAgent(AgentThread):
    """The thread that owns the relay's DEALER (see the module doc); its thread, pipe and
    stop are `AgentThread`'s (the stop waits BYE_S more: the relay says BYE first).

    Args:
        relay_id, name: the relay's id on the tree, the bus name (the store's keys).
        host, port: the rendezvous (the root's TCPStore).
        heartbeat: seconds between STATUS messages; the root is lost after ~6 silent ones.
        holding: what the relay's bus holds (read for JOIN and STATUS).
        inbox: the data thread's queue.
        counters: the relay's counters (rejected and stale messages are counted there).
    """

    def __init__(
        self,
        *,
        relay_id: str,
        name: str,
        host: str,
        port: int,
        heartbeat: float,
        holding: Holding,
        inbox: Inbox,
        counters: Counter[str],
    ) -> None:
        super().__init__(
            f"zmqsync-relay-ctl-{name}", "relay agent", stop_s=_config.THREAD_JOIN_S + BYE_S
        )
        self.relay_id, self.name, self.host, self.port = relay_id, name, host, port
        self.heartbeat = heartbeat
        self.holding, self.inbox, self.counters = holding, inbox, counters
        self.dealer: zmq.Socket[bytes] | None = None
        self.store: Any = None
        self.data_endpoint = ""  # the root's data ROUTER (the data and wait threads connect)
        self.session = ""
        self.tree = ""
        self.last_heard = 0.0
        self._joining_since = 0.0
        self._next_attempt = 0.0
        self._accepted = threading.Event()
        self._reports: queue.SimpleQueue[Callable[[str], Report]] = queue.SimpleQueue()

    @property
    def silent_after(self) -> float:
        return self.heartbeat * _config.LOST_AFTER_BEATS

    @property
    def connected(self) -> bool:
        return bool(self.session) and time.monotonic() - self.last_heard < self.silent_after

    def wait_accepted(self, deadline: Deadline) -> None:
        """Return once a root accepted this relay (after `start`).

        Raises:
            ConnectTimeout: no root accepted it before `deadline`.
        """
        if not self._accepted.wait(deadline.wait_s()):
            raise ConnectTimeout(
                f"no relay root accepted relay {self.relay_id!r} at "
                f"{self.host}:{self.port} within {deadline.total} s; is the root "
                "started, with the same bus name and MASTER_ADDR/MASTER_PORT?"
            )

    def report(self, make: Callable[[str], Report]) -> None:
        """Send the report `make(session)` on the control channel (from any thread)."""
        self._reports.put(make)
        self._poke(b"r")

    def _poke(self, cmd: bytes) -> None:
        self.post(cmd)

    # --- agent thread ---

    def _finish(self) -> None:
        self._disconnect()
        self.pipe.close()

    def _loop(self) -> None:
        next_beat = time.monotonic()
        while True:
            poller = zmq.Poller()
            poller.register(self.pipe, zmq.POLLIN)
            if self.dealer is not None:
                poller.register(self.dealer, zmq.POLLIN)
            ready = dict(poller.poll(max(0, int((next_beat - time.monotonic()) * 1000)) + 1))
            if self.pipe in ready and not self._on_pipe():
                return
            if self.dealer is not None and self.dealer in ready:
                self._on_dealer()
            now = time.monotonic()
            if now >= next_beat:
                self._tick(now)
                next_beat = time.monotonic() + self.heartbeat

    def _tick(self, now: float) -> None:
        if self.session:
            if now - self.last_heard > self.silent_after:
                log.info(
                    "relay %s lost the root: silent for %.1f s", self.relay_id, self.silent_after
                )
                self._lost()
                return
            self._send(RELAY.encode(self.holding.status(self.session)))
            return
        if self.dealer is not None and now - self._joining_since < 2 * self.silent_after:
            return  # JOIN sent, waiting for ACCEPT
        if now < self._next_attempt:
            return
        self._next_attempt = now + max(1.0, 2 * self.heartbeat)
        self._connect()

    def _lost(self) -> None:
        self.session = ""
        self._disconnect()
        self.inbox.put(("lost", None))

    def _disconnect(self) -> None:
        if self.dealer is not None:
            self.dealer.close()
            self.dealer = None
        self.store = None

    def _connect(self) -> None:
        """Find the root through the store, connect the DEALER, send JOIN (one attempt)."""
        self._disconnect()
        host, port = self.host, self.port
        try:  # a silent probe first: a TCPStore client logs a stack trace per failed try
            with socket.create_connection((host, port), timeout=min(1.0, self.heartbeat * 2)):
                pass
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, None, False, datetime.timedelta(seconds=max(1.0, 2 * self.heartbeat))
            )
            endpoint = store.get(control_key(self.name)).decode()
            data = store.get(data_key(self.name)).decode()
        except (OSError, RuntimeError, UnicodeDecodeError) as exc:
            log.debug("relay %s: root not reachable at %s:%d: %s", self.relay_id, host, port, exc)
            return
        port_text = endpoint.rsplit(":", 1)[-1]
        if not endpoint.startswith("tcp://") or not port_text.isdigit():
            log.warning(
                "relay %s: the store names a bad control endpoint %r", self.relay_id, endpoint[:80]
            )
            return
        self.store = store
        data_port = data.rsplit(":", 1)[-1]
        self.data_endpoint = f"tcp://{ip(host)}:{data_port}" if data_port.isdigit() else ""
        self.dealer = connect(self.ctx, zmq.DEALER, f"tcp://{ip(host)}:{port_text}")
        self._joining_since = time.monotonic()
        bus, version = self.holding.have
        join = Join(self.relay_id, socket.gethostname()[:255], os.getpid(), bus, version)
        self._send(RELAY.encode(join))

    def _send(self, frame: bytes) -> None:
        if self.dealer is None:
            return
        with contextlib.suppress(zmq.Again):
            self.dealer.send(frame, zmq.NOBLOCK)

    def _on_pipe(self) -> bool:
        while self.pipe.poll(0):
            if self.pipe.recv() == b"stop":
                if self.session:
                    self._send(RELAY.encode(Bye(self.session)))
                    if self.dealer is not None:
                        self.dealer.linger = 200
                return False
        while True:
            try:
                make = self._reports.get_nowait()
            except queue.Empty:
                break
            if self.session:
                self._send(RELAY.encode(make(self.session)))
        return True

    def _on_dealer(self) -> None:
        assert self.dealer is not None
        for _ in range(_config.ACK_DRAIN_MAX):
            try:
                frame = self.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = RELAY.decode(frame)
            except ProtocolError as exc:
                self.counters["rejected"] += 1
                log.debug("dropped root message: %s", exc)
                continue
            if isinstance(msg, Accept):
                self.session, self.tree, self.last_heard = msg.session, msg.tree, time.monotonic()
                self._accepted.set()
                log.info("relay %s accepted by root %s", self.relay_id, msg.tree)
                continue
            if isinstance(msg, Refuse):
                log.warning("relay %s refused by the root: %s", self.relay_id, msg.reason)
                continue
            if not self.session or getattr(msg, "tree", "") != self.tree:
                self.counters["stale"] += 1
                continue
            self.last_heard = time.monotonic()
            if isinstance(msg, Evict):
                log.info("relay %s: %s; joining again", self.relay_id, msg.reason)
                self.session = ""
                self.inbox.put(("lost", None))
                self._disconnect()
                if msg.reason != ROOT_CLOSED:
                    self._connect()
                return
            if isinstance(msg, Prepare | Commit | Send):
                self.inbox.put((msg, self.store))
