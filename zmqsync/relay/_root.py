"""The relay root: reads every version of the trainer's bus and carries it to the relays.

Three threads, each with what it alone touches:

* the **relay thread** (`RelayRoot._run`) applies versions of the bus (its subscriber is
  in manual mode, so a version cannot change under it) and carries each one through the
  tree (`Carrier`): forms generations, posts the sends, writes the per-version notices
  and reads the relays' reports on the data channel itself (each thread hand-off cost
  0.1–0.3 ms on two busy cores);
* the **agent thread** (`RootAgent`) owns the control channel and feeds the membership;
* one **executor thread** per generation (`GroupThread`) is the only one that blocks in
  torch.distributed; the others wait for it with a deadline.

The bookkeeping they share is a `Membership` (no I/O), read and changed under one lock.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import zmq

from .. import _config
from .._deadline import Deadline
from .._errors import ClosedError, ProtocolError, ZmqSyncError
from .._lifecycle import Lifecycle, signals_held
from .._protocol import Inspect, State, TensorSpec
from .._reads import Aliases
from .._security import Security, found_keys
from .._sockets import request
from .._subscriber import Subscriber
from ._carrier import Carrier, Relayed, Settings
from ._data_channel import DataChannel
from ._membership import Membership
from ._messages import RelayInfo
from ._options import Tree, require
from ._rendezvous import control_key, data_key, rendezvous, require_trusted
from ._root_agent import RootAgent
from ._wire import check_backend, flat_slot, layout_of, on_cpu, payload_bytes

__all__ = ["RelayRoot"]

log = logging.getLogger(__name__)
DEFAULT_SECURITY = Security()
DEFAULT_TREE = Tree()


class RelayRoot(Lifecycle):
    """Carries every version of a bus on this host to the relays of other hosts.

    It joins the bus as an ordinary alias-mode subscriber (worker id `worker_id`), so the
    trainer's ``Publisher.publish()`` waits for its ack like any worker's; it acks a
    version once the tree has it (see `ack`). Run it in the trainer's process or as its
    own process (``zmqsync relay --root``; recommended with NCCL, whose failures can end
    a process).

    Args:
        address: the bus's control address; None: the default address for `name`.
        name: bus name; relays use the same name for their own buses.
        tree: how this root forms the tree, a `Tree`: the rendezvous it hosts
            (``env://`` by default; port 0: any free port, see `init_method_url`), the
            collective backend and its device, the chunk size, the collectives' timeout.
        ack: "tree" (ack once every relay's local workers acked) or "relays" (once every
            relay announced the version on its bus).
        timeout: one deadline (s) per version for the whole tree.
        on_timeout: at the deadline, "evict" drops the late relays and acks (they re-join
            by themselves); "raise" records a `PublishTimeout` in `last_error`, keeps them
            and acks only once they have the version, so a trainer whose own `timeout` is
            shorter gets PublishTimeout naming `worker_id` (a silent relay is dropped
            either way, after ~6 heartbeats, as the bus drops a silent worker).
        heartbeat: heartbeat interval (s); a relay silent for ~6 beats is lost.
        worker_id: this subscriber's worker id on the bus.
        on_relayed: callable(Relayed) run after each version (on the relay thread).
        security: ``curve=CurveClient(...)``: the CURVE keys for a trainer's bus that
            has them, used both to inspect the bus and to subscribe to it; left out:
            found as a `Subscriber` finds them ($ZMQSYNC_CURVE_CLIENT, else the keys a
            ``curve=True`` trainer of `name` left in the runtime dir), at each
            handshake. ``insecure=True``: allow a non-loopback rendezvous address
            (torch.distributed has no authentication; say that the network is trusted).

    Attributes:
        tree: this root's tree id (hex, new for every root): relays tell its messages
            from those of a root they followed before. Not the `Tree` options.

    Raises:
        TypeError: `tree` is not a `Tree`, or `security` not a `Security`.
        ValueError: an option out of range, a rendezvous other hosts can reach without
            ``insecure=True``, or NCCL without CUDA here.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        name: str = "weights",
        tree: Tree = DEFAULT_TREE,
        ack: str = "tree",
        timeout: float = 10.0,
        on_timeout: str = "evict",
        heartbeat: float = 0.5,
        worker_id: str = "relay-root",
        on_relayed: Callable[[Relayed], None] | None = None,
        security: Security = DEFAULT_SECURITY,
    ) -> None:
        require(tree, Tree, "RelayRoot")
        if not isinstance(security, Security):
            raise TypeError(f"security= takes a zmqsync.Security, not {security!r}")
        curve = security.worker_side("a RelayRoot", insecure=True)
        self.name = _config.check_name(name)
        if ack not in ("tree", "relays"):
            raise ValueError(f'ack must be "tree" or "relays", not {ack!r}')
        if on_timeout not in ("raise", "evict"):
            raise ValueError(f'on_timeout must be "raise" or "evict", not {on_timeout!r}')
        if not 0.001 <= heartbeat <= 3600:
            raise ValueError(f"heartbeat must be in [0.001, 3600] seconds, not {heartbeat}")
        if not timeout > 0 or math.isinf(timeout):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
        self._host, self._port = rendezvous(tree.init_method)
        require_trusted(self._host, security.insecure)
        self._device = check_backend(tree.backend, tree.device)
        self._address_arg = address
        self.address = ""
        self._curve = curve
        self._backend, self._ack, self._on_timeout = tree.backend, ack, on_timeout
        self._timeout, self._heartbeat = float(timeout), float(heartbeat)
        lost_after = self._heartbeat * _config.LOST_AFTER_BEATS
        op = tree.collective_timeout
        op = max(1.0, lost_after) if op is None else float(op)  # positive: Tree checked it
        self._op_timeout = min(self._timeout, op)
        # how long to wait for READYs: a healthy relay may still sit in a dead group's op
        self._form_wait = self._op_timeout + 2 * self._heartbeat
        self._form_timeout = min(self._timeout, max(2.0, self._form_wait))
        self._chunk_bytes = max(4096, int(tree.chunk_mb * 2**20) // 4096 * 4096)
        self._worker_id = worker_id
        self._on_relayed = on_relayed
        self.tree = secrets.token_hex(8)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._membership = Membership(
            self.tree,
            heartbeat=self._heartbeat,
            form_wait=self._form_wait,
            ack=ack,
            on_timeout=on_timeout,
        )
        self._settings = Settings(
            tree=self.tree,
            name=self.name,
            host=self._host,
            backend=tree.backend,
            device=self._device,
            ack=ack,
            on_timeout=on_timeout,
            timeout=self._timeout,
            heartbeat=self._heartbeat,
            op_timeout=self._op_timeout,
            form_wait=self._form_wait,
            form_timeout=self._form_timeout,
            chunk_bytes=self._chunk_bytes,
        )
        self._carrier: Carrier | None = None  # made by start()
        self._stopping = threading.Event()
        self._resources = contextlib.ExitStack()
        self._store: Any = None
        self._agent: RootAgent | None = None
        self._data: DataChannel | None = None  # the relay thread's alone
        self._data_endpoint = ""
        self._feed: Subscriber | None = None
        self._thread: threading.Thread | None = None
        self._manifest: tuple[TensorSpec, ...] = ()
        self._manifest_bus = ""
        self._payload_bytes = 0  # the bytes of a slot that travel (see payload_bytes)
        self.last: Relayed | None = None
        self.last_error: BaseException | None = None
        self._pid = os.getpid()

    # --- lifecycle -----------------------------------------------------------------

    @property
    def init_method_url(self) -> str:
        """``tcp://HOST:PORT`` of the TCPStore, with the real port once started."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"tcp://{host}:{self._port}"

    def start(self) -> RelayRoot:
        """Host the rendezvous, open the control socket, join the bus. Returns self.

        Raises:
            ConnectTimeout: no publisher answered at the bus address within `timeout`.
            ZmqSyncError: the bus has one slot (a relay needs two), another relay root
                serves it, or the rendezvous port is taken.
            ClosedError: closed already (create a new one).
        """
        if not self._starting():
            return self
        with contextlib.ExitStack() as stack:
            self.address = self._address_arg or _config.default_address(self.name)
            self._adopt_bus(self._inspect_bus(refuse_duplicate=True))
            try:
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    self._host,
                    self._port,
                    None,
                    True,
                    datetime.timedelta(seconds=self._timeout),
                    wait_for_workers=False,
                )
            except (RuntimeError, OSError) as exc:
                raise ZmqSyncError(
                    f"cannot host the rendezvous at {self._host}:{self._port} ({exc}); is the "
                    "port taken (another root)? choose another MASTER_PORT"
                ) from exc
            stack.callback(self._drop_store)
            self._port = int(self._store.port)
            self._agent = RootAgent(
                self._membership,
                self._cond,
                host=self._host,
                address=self.address,
                name=self.name,
                ack=self._ack,
            )
            stack.callback(self._agent.stop)  # tells the relays goodbye...
            self._agent.start()
            stack.callback(self._drop_store)  # ...once the store no longer answers them
            self._store.set(control_key(self.name), self._agent.endpoint)
            self._open_data_channel()
            stack.callback(self._close_data_channel)  # after the relay thread stopped
            self._store.set(data_key(self.name), self._data_endpoint)
            self._carrier = Carrier(
                self._settings,
                self._membership,
                self._cond,
                self._stopping,
                agent=self._agent,
                data=self._data,
                store=self._store,
                relayed=self._relayed,
                failed=self._failed,
            )
            feed = Subscriber(
                self.address,
                name=self.name,
                # views of the CPU segment (the publisher mirrors GPU weights there)
                reads=Aliases(device="cpu", manual=True, on_update=self._on_version),
                worker_id=self._worker_id,
                timeout=self._timeout,
                security=Security(curve=self._curve),
            )
            self._feed = feed.start()
            stack.callback(feed.close)
            self._thread = threading.Thread(
                target=self._run, name=f"zmqsync-relayroot-{self.name}", daemon=True
            )
            self._thread.start()
            stack.callback(self._stop_thread)
            with signals_held():  # held from `stack` to `_resources` and STARTED (closable)
                self._resources = stack.pop_all()
                self._started()
        log.info(
            "relay root %s for bus %r at %s (rendezvous %s:%d, %s, ack=%s)",
            self.tree,
            self.name,
            self.address,
            self._host,
            self._port,
            self._backend,
            self._ack,
        )
        return self

    def close(self) -> None:
        """Tell the relays, leave the bus, drop the group and the rendezvous. Idempotent."""
        with signals_held():  # every resource goes, even if a signal arrives meanwhile
            if not self._closing():
                return
            try:
                self._stopping.set()
                with self._cond:
                    self._cond.notify_all()
            finally:
                self._resources.close()
        log.info("relay root %s closed at version %d", self.tree, self._membership.version)

    def _title(self) -> str:
        return f"RelayRoot {self.name!r}"

    def __enter__(self) -> RelayRoot:
        return self.start()

    def __repr__(self) -> str:
        m = self._membership
        active = sum(r.state == "active" for r in m.members.values())
        return (
            f"<RelayRoot {self.name!r} v{m.version} gen {m.gen} {active} relays "
            f"ack={self._ack} {self._state.value}>"
        )

    def _drop_store(self) -> None:
        self._store = None

    def _open_data_channel(self) -> None:
        self._data = DataChannel(self._host)
        self._data_endpoint = self._data.endpoint

    def _close_data_channel(self) -> None:
        data, self._data = self._data, None
        if data is not None:
            data.close()

    def _stop_thread(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self._timeout + _config.THREAD_JOIN_S)
        if self._carrier is not None:
            self._carrier.close(_config.THREAD_JOIN_S)

    # --- what the user sees --------------------------------------------------------

    @property
    def version(self) -> int:
        """The version of the bus this root holds now (-1 before start)."""
        return self._feed.version if self._feed is not None else -1

    @property
    def generation(self) -> int:
        """The number of the last generation formed (or being formed); 0 before any."""
        return self._membership.gen

    @property
    def relays(self) -> dict[str, RelayInfo]:
        """Snapshot of the relays, by relay id."""
        with self._lock:
            return {i.relay_id: i for i in self._membership.infos(time.monotonic())}

    @property
    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._membership.counters)

    def wait_for_relays(self, n: int, timeout: float | None = None) -> bool:
        """Block until `n` relays are active and hold the current version; False on timeout.

        Args:
            timeout: seconds; None: the root's `timeout`.
        """
        deadline = Deadline(self._timeout if timeout is None else timeout)
        with self._cond:
            while self._membership.active_with_version() < n:
                if deadline.expired() or self._stopping.is_set():
                    return False
                self._cond.wait(deadline.wait_s(0.2))
        return True

    # --- the bus side --------------------------------------------------------------

    def _inspect_bus(self, refuse_duplicate: bool = False) -> State:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            secure = self._curve.apply if self._curve is not None else found_keys(self.name)
            reply = request(
                ctx, self.address, Inspect(""), deadline=Deadline(self._timeout), secure=secure
            )
        finally:
            ctx.destroy(linger=0)
        if not isinstance(reply, State):
            raise ProtocolError(f"expected STATE from {self.address}, got {reply.TYPE}")
        if reply.slots < 2:
            raise ZmqSyncError(
                f"bus {reply.name!r} has 1 slot: a relay root sends from the slot it holds "
                "while the trainer writes the next version, which needs slots >= 2"
            )
        if refuse_duplicate and any(w.worker_id == self._worker_id for w in reply.workers):
            raise ZmqSyncError(
                f"worker {self._worker_id!r} is already on bus {reply.name!r}: another relay "
                "root serves it; close it, or pass another worker_id"
            )
        return reply

    def _adopt_bus(self, state: State) -> None:
        manifest = on_cpu(state.manifest)
        layout = layout_of(manifest)
        buf = state.buffers[0]
        if (buf.size - buf.header_bytes) // state.slots != layout.slot_bytes:
            raise ZmqSyncError("the bus's segment size does not match its manifest")
        self._manifest, self._payload_bytes = manifest, payload_bytes(manifest)
        self._manifest_bus = state.bus

    def _on_version(self, version: int) -> None:
        """The feed applied `version` (aliased). On our thread: carry it, then return (ack)."""
        if threading.current_thread() is not self._thread:
            return  # the first apply, in start(): nobody to send to yet
        self._distribute()

    def _feed_view(self) -> tuple[str, int, torch.Tensor]:
        """(bus, version, flat slot) of what the feed aliases now.

        Read on the thread that applies versions (manual mode), where the feed cannot
        change underneath; the slot cannot be rewritten while it is held.
        """
        feed = self._feed
        assert feed is not None
        # The version number alone starts over when the trainer restarts: (bus, version)
        # names one. Read on the applying thread (manual mode): it cannot change here.
        bus = feed.bus_id
        version = feed.version
        if bus != self._manifest_bus:  # the trainer restarted: new buffers, maybe a new model
            state = self._inspect_bus()
            if state.bus != bus:
                raise ZmqSyncError("the bus changed while reading its manifest; retrying")
            self._adopt_bus(state)
            if self._carrier is not None:
                self._carrier.bus_changed()
        first = self._manifest[0]
        flat = flat_slot(feed.tensors[first.key], first, self._payload_bytes)
        with self._cond:
            self._membership.hold(bus, version)
        return bus, version, flat

    # --- the relay thread ----------------------------------------------------------

    def _run(self) -> None:
        feed = self._feed
        assert feed is not None
        while not self._stopping.is_set():
            try:
                if not feed.poll(self._heartbeat):
                    self._maintain()
            except ClosedError as exc:
                if not self._stopping.is_set():  # the feed was closed under us: nothing to do
                    self.last_error = exc
                    log.error("relay root: the bus subscriber closed: %s", exc)
                return
            except ZmqSyncError as exc:
                self.last_error = exc
                log.warning("relay root: %s", exc)
                self._stopping.wait(self._heartbeat)
            except Exception as exc:
                self.last_error = exc
                log.exception("relay root: unexpected failure")
                self._stopping.wait(self._heartbeat)

    def _maintain(self) -> None:
        """Idle: bring new or lagging relays up to the current version."""
        if self._feed is None or self._feed.version < 0:
            return
        if self._carrier is not None and self._carrier.needs_work():
            self._distribute()

    def _distribute(self) -> None:
        """Carry the version the feed holds to every relay (see `Carrier.carry`).

        At the deadline, "evict" drops the late relays and returns (the feed acks);
        "raise" records a PublishTimeout and keeps waiting for them (bounded: each relay's
        own wait has its local timeout, a silent relay is lost after ~6 heartbeats, and
        after a few more deadlines the version is acked without them).
        """
        _bus, version, flat = self._feed_view()
        assert self._carrier is not None
        self._carrier.carry(version, flat, self._manifest)

    def _relayed(self, record: Relayed) -> None:
        self.last = record
        if self._on_relayed is not None:
            self._on_relayed(record)

    def _failed(self, exc: BaseException) -> None:
        self.last_error = exc
