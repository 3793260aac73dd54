"""The relay root: reads every version of the trainer's bus and carries it to the relays.

Three threads, each with what it alone touches:

* the **relay thread** (`RelayRoot._run`) applies versions of the bus (its subscriber is
  in manual mode, so a version cannot change under it), forms generations, posts the
  sends, writes the per-version notices and reads the relays' reports on the data
  channel itself (each thread hand-off cost 0.1–0.3 ms on two busy cores);
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
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import zmq

from .. import _config, _lifecycle
from .._deadline import Deadline
from .._errors import ClosedError, ProtocolError, PublishTimeout, ZmqSyncError
from .._protocol import Inspect, State, TensorSpec
from .._sockets import request
from .._subscriber import Subscriber
from ._data_channel import DataChannel
from ._membership import Generation, Member, Membership, Verdict
from ._messages import RELAY, Commit, Evict, Prepare, RelayInfo, Send
from ._rendezvous import control_key, data_key, rendezvous, require_trusted
from ._root_agent import RootAgent
from ._wire import (
    GroupThread,
    Wire,
    check_backend,
    flat_slot,
    layout_of,
    new_process_group,
    on_cpu,
)

__all__ = ["DEFAULT_CHUNK_MB", "RelayRoot", "Relayed"]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_MB = 16.0
_LATE_FACTOR = 3  # on_timeout="raise": how many more deadlines to wait for late relays
# The relay thread waits for reports on the data channel in slices this long, then looks
# at what the agent thread changed (a relay lost, a failure reported on the control channel)
_REPORT_POLL_S = 0.005
_FINISH_POLL_S = 0.0005  # every relay has the version; gloo's send is finishing


@dataclass(frozen=True)
class Relayed:
    """One version carried to the relays: who has it, who is missing, how long it took."""

    version: int
    generation: int
    relays: tuple[str, ...]
    missing: tuple[str, ...]
    seconds: float
    nbytes: int


@dataclass(frozen=True, eq=False)
class _Group:
    """The current generation: its members (bookkeeping) and its process group (runner)."""

    generation: Generation
    runner: GroupThread

    @property
    def wire(self) -> Wire:
        wire = self.runner.wire
        assert wire is not None, "a formed group has its wire"
        return wire

    def close(self) -> None:
        self.generation.broken = True
        self.runner.close()


class RelayRoot:
    """Carries every version of a bus on this host to the relays of other hosts.

    It joins the bus as an ordinary alias-mode subscriber (worker id `worker_id`), so the
    trainer's ``Publisher.publish()`` waits for its ack like any worker's; it acks a
    version once the tree has it (see `ack`). Run it in the trainer's process or as its
    own process (``zmqsync relay --root``; recommended with NCCL, whose failures can end
    a process).

    Args:
        address: the bus's control address; None: the default address for `name`.
        name: bus name; relays use the same name for their own buses.
        init_method: rendezvous: ``"env://"`` (MASTER_ADDR/MASTER_PORT; the default) or
            ``"tcp://HOST:PORT"``; this process hosts the TCPStore there (port 0: any
            free port, see `init_method_url`).
        backend: "gloo" (CPU) or "nccl" (through a CUDA staging buffer on `device`).
        ack: "tree" (ack once every relay's local workers acked) or "relays" (once every
            relay announced the version on its bus).
        timeout: one deadline (s) per version for the whole tree.
        collective_timeout: the timeout (s) of every collective (each chunk) and of
            building a group; None: about the time to declare a silent relay lost
            (6 heartbeats, at least 1 s, at most `timeout`). A hung relay blocks the
            collective it is part of, and nothing can cancel a collective, so this bounds
            how long the others wait before the group is re-formed without it.
        on_timeout: at the deadline, "evict" drops the late relays and acks (they re-join
            by themselves); "raise" records a `PublishTimeout` in `last_error`, keeps them
            and acks only once they have the version, so a trainer whose own `timeout` is
            shorter gets PublishTimeout naming `worker_id` (a silent relay is dropped
            either way, after ~6 heartbeats, as the bus drops a silent worker).
        heartbeat: heartbeat interval (s); a relay silent for ~6 beats is lost.
        chunk_mb: MiB per collective when the slot is sent.
        worker_id: this subscriber's worker id on the bus.
        device: CUDA device of the NCCL staging buffer.
        insecure: allow a non-loopback rendezvous address (torch.distributed has no
            authentication; say that the network is trusted).
        on_relayed: callable(Relayed) run after each version (on the relay thread).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        name: str = "weights",
        init_method: str | None = None,
        backend: str = "gloo",
        ack: str = "tree",
        timeout: float = 10.0,
        on_timeout: str = "evict",
        heartbeat: float = 0.5,
        chunk_mb: float = DEFAULT_CHUNK_MB,
        collective_timeout: float | None = None,
        worker_id: str = "relay-root",
        device: str | None = None,
        insecure: bool = False,
        on_relayed: Callable[[Relayed], None] | None = None,
    ) -> None:
        self.name = _config.check_name(name)
        if ack not in ("tree", "relays"):
            raise ValueError(f'ack must be "tree" or "relays", not {ack!r}')
        if on_timeout not in ("raise", "evict"):
            raise ValueError(f'on_timeout must be "raise" or "evict", not {on_timeout!r}')
        if not 0.001 <= heartbeat <= 3600:
            raise ValueError(f"heartbeat must be in [0.001, 3600] seconds, not {heartbeat}")
        if not timeout > 0 or math.isinf(timeout):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
        if not chunk_mb > 0:
            raise ValueError(f"chunk_mb must be positive, not {chunk_mb}")
        self._host, self._port = rendezvous(init_method)
        require_trusted(self._host, insecure)
        self._device = check_backend(backend, device)
        self._address_arg = address
        self.address = ""
        self._backend, self._ack, self._on_timeout = backend, ack, on_timeout
        self._timeout, self._heartbeat = float(timeout), float(heartbeat)
        lost_after = self._heartbeat * _config.LOST_AFTER_BEATS
        op = max(1.0, lost_after) if collective_timeout is None else float(collective_timeout)
        if not op > 0:
            raise ValueError(f"collective_timeout must be positive, not {collective_timeout}")
        self._op_timeout = min(self._timeout, op)
        # how long to wait for READYs: a healthy relay may still sit in a dead group's op
        self._form_wait = self._op_timeout + 2 * self._heartbeat
        self._form_timeout = min(self._timeout, max(2.0, self._form_wait))
        self._chunk_bytes = max(4096, int(chunk_mb * 2**20) // 4096 * 4096)
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
        self._group: _Group | None = None
        self._state = "new"
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
        self._slot_bytes = 0
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
        if self._state == "closed":
            raise ClosedError(f"RelayRoot {self.name!r} is closed; create a new one")
        if self._state == "started":
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
            self._agent.start()
            stack.callback(self._agent.stop)  # tells the relays goodbye...
            stack.callback(self._drop_store)  # ...once the store no longer answers them
            self._store.set(control_key(self.name), self._agent.endpoint)
            self._open_data_channel()
            stack.callback(self._close_data_channel)  # after the relay thread stopped
            self._store.set(data_key(self.name), self._data_endpoint)
            feed = Subscriber(
                self.address,
                name=self.name,
                mode="alias",
                apply="manual",
                worker_id=self._worker_id,
                device="cpu",  # read the CPU segment (the publisher mirrors GPU weights there)
                timeout=self._timeout,
                on_update=self._on_version,
            )
            self._feed = feed.start()
            stack.callback(feed.close)
            self._thread = threading.Thread(
                target=self._run, name=f"zmqsync-relayroot-{self.name}", daemon=True
            )
            self._thread.start()
            stack.callback(self._stop_thread)
            self._resources = stack.pop_all()
        self._state = "started"
        self._pid = os.getpid()
        _lifecycle.track(self)
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
        if self._state != "started":
            self._state = "closed"
            return
        self._state = "closed"
        if os.getpid() != self._pid:
            return
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        self._resources.close()
        log.info("relay root %s closed at version %d", self.tree, self._membership.version)

    def __enter__(self) -> RelayRoot:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_state", "closed") == "started":
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        m = self._membership
        active = sum(r.state == "active" for r in m.members.values())
        return (
            f"<RelayRoot {self.name!r} v{m.version} gen {m.gen} {active} relays "
            f"ack={self._ack} {self._state}>"
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
        with self._cond:
            group, self._group = self._group, None
        if group is not None:
            group.close()
            group.runner.join(_config.THREAD_JOIN_S)

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
            reply = request(ctx, self.address, Inspect(""), deadline=Deadline(self._timeout))
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
        self._manifest, self._slot_bytes = manifest, layout.slot_bytes
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
        # The bus id of the version the feed computes with: a Subscriber has no public
        # accessor for it, and the version number alone starts over when the trainer
        # restarts. Read on the applying thread (manual mode): it cannot change here.
        bus = feed._version_bus  # noqa: SLF001 (see above)
        version = feed.version
        if bus != self._manifest_bus:  # the trainer restarted: new buffers, maybe a new model
            state = self._inspect_bus()
            if state.bus != bus:
                raise ZmqSyncError("the bus changed while reading its manifest; retrying")
            self._adopt_bus(state)
            with self._cond:
                if self._group is not None:
                    self._group.generation.broken = True
        first = self._manifest[0]
        flat = flat_slot(feed.weights.get(first.key), first, self._slot_bytes)
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
        with self._cond:
            group = self._group
            gen = group.generation if group is not None else None
            if not self._membership.needs_distribution(gen, time.monotonic()):
                return
        self._distribute()

    def _distribute(self) -> None:
        """Carry the version the feed holds to every relay, against one deadline.

        At the deadline, "evict" drops the late relays and returns (the feed acks);
        "raise" records a PublishTimeout and keeps waiting for them (bounded: each relay's
        own wait has its local timeout, a silent relay is lost after ~6 heartbeats, and
        after `_LATE_FACTOR` more deadlines the version is acked without them).
        """
        m = self._membership
        _bus, version, flat = self._feed_view()
        deadline = Deadline(self._timeout)
        started = time.perf_counter()
        late: tuple[str, ...] | None = None  # raise mode, past the deadline: who was late

        def finish(group: _Group | None, done: tuple[str, ...], missing: tuple[str, ...]) -> None:
            gen = group.generation.number if group is not None else 0
            self._finish(version, gen, done, missing, started, flat.numel())

        def expired(group: _Group | None) -> bool:
            """The deadline passed: True when the version is finished (return)."""
            nonlocal late, deadline
            if late is None:
                verdict = self._on_deadline(version, group)
                late = verdict.missing
                if self._on_timeout == "evict":
                    finish(group, verdict.done, verdict.missing)
                    return True
                deadline = Deadline(_LATE_FACTOR * self._timeout)
                return False
            log.warning(
                "version %d: relay(s) %s still late after %.1f s more; acked without them",
                version,
                ", ".join(late),
                _LATE_FACTOR * self._timeout,
            )
            finish(group, (), late)
            return True

        while True:
            if self._stopping.is_set():
                raise ClosedError("relay root closing")
            with self._cond:
                group = self._group
                reform = group is None or m.needs_reform(group.generation, time.monotonic())
            if reform:
                group = self._form(deadline)
                if group is None:
                    with self._cond:
                        nobody = not m.candidates()
                    if nobody:
                        finish(None, (), ())
                        return
                    if deadline.expired() and expired(None):
                        return
                    continue
            assert group is not None
            with self._cond:
                lagging = m.lagging(group.generation)
            if lagging and not self._transfer(group, lagging, version, flat, deadline):
                self._break(group)
                if deadline.expired() and expired(group):
                    return
                continue
            outcome = self._await(group, deadline)
            if outcome == "done":
                with self._cond:
                    done = m.done_by(group.generation)
                finish(group, done, ())
                return
            if outcome == "expired" and expired(group):
                return

    def _break(self, group: _Group) -> None:
        with self._cond:
            group.generation.broken = True
            if self._group is group:
                self._group = None
        group.close()

    def _form(self, deadline: Deadline) -> _Group | None:
        """PREPARE every connected relay, COMMIT those READY in time, build the group."""
        m = self._membership
        with self._cond:
            old, self._group = self._group, None
        if old is not None:
            old.close()  # first: its sockets close, so the relays' pending receives end now
        with self._cond:
            formation = m.prepare()
            if formation is None:
                return None
            prepares = [c.identity for c in formation.candidates]
        agent = self._agent
        assert agent is not None
        for identity in prepares:
            agent.send_to(identity, Prepare(self.tree, formation.number))
        wait = Deadline(min(deadline.remaining() or 0.0, self._form_wait))
        with self._cond:
            while not m.answered(formation):
                if wait.expired() or self._stopping.is_set():
                    break
                self._cond.wait(wait.wait_s(self._heartbeat))
            gen = m.settle(formation, time.monotonic())
            if gen is None:
                return None
            commits = m.identities(gen)
        world = len(gen.members) + 1
        for identity, rank in commits:
            agent.send_to(identity, self._commit(gen, rank, world))
        runner = GroupThread(f"zmqsync-relay-{self.name}-g{gen.number}")
        store, prefix = self._store, f"zmqsync/{self.name}/{self.tree}/{gen.number}/"
        future = runner.submit(
            lambda: new_process_group(
                store,
                prefix,
                0,
                world,
                backend=self._backend,
                host=self._host,
                form_timeout=self._form_timeout,
                op_timeout=self._op_timeout,
            )
        )
        if not self._wait_future(future, deadline) or future.exception() is not None:
            reason = future.exception() if future.done() else "deadline"
            log.info("generation %d could not form: %s", gen.number, reason)
            runner.close()
            with self._cond:
                m.counters["formation_failures"] += 1
            return None
        runner.pg = future.result()
        runner.wire = Wire(
            runner.pg, self._backend, self._chunk_bytes, self._op_timeout, self._device
        )
        group = _Group(gen, runner)
        with self._cond:
            m.formed(gen)
            self._group = group
            self._cond.notify_all()
        log.info("generation %d: %d relay(s): %s", gen.number, len(commits), ", ".join(gen.members))
        return group

    def _commit(self, gen: Generation, rank: int, world: int) -> Commit:
        return Commit(
            self.tree,
            gen.number,
            rank,
            world,
            self._backend,
            self._op_timeout,
            self._form_timeout,
            gen.bus,
            self._slot_bytes,
            self._chunk_bytes,
            self._manifest,
        )

    def _wait_future(self, future: Future[Any], deadline: Deadline) -> bool:
        future.add_done_callback(lambda _f: self._notify())
        with self._cond:
            while not future.done():
                if deadline.expired() or self._stopping.is_set():
                    return False
                self._cond.wait(deadline.wait_s(self._heartbeat))
        return True

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _transfer(
        self,
        group: _Group,
        lagging: list[Member],
        version: int,
        flat: torch.Tensor,
        deadline: Deadline,
    ) -> bool:
        """Send the bytes and announce them; True once every target reported it has them.

        The sends go first, posted on this thread: a relay has usually posted its receives
        already (see `Wire`), so the bytes flow while the notices travel.
        """
        m, gen = self._membership, group.generation
        everyone = len(lagging) == len(gen.members)
        ranks = sorted(r.rank for r in lagging)
        header = group.wire.header(gen.number, version, flat.numel())
        try:  # posted here, waited for on the executor: no thread hand-off before the bytes
            finish = group.wire.post_send(flat, header, ranks)
        except RuntimeError as exc:  # the group's connections are gone
            log.info("generation %d: sending v%d failed: %s", gen.number, version, exc)
            with self._cond:
                m.counters["transfer_failures"] += 1
            return False
        future = group.runner.submit(finish)
        notice = Send(
            self.tree, gen.number, version, gen.bus, () if everyone else tuple(ranks), flat.numel()
        )
        frame = RELAY.encode(notice)
        for r in lagging:
            self._send_notice(r, notice, frame)
        while True:
            with self._cond:
                if self._stopping.is_set():
                    raise ClosedError("relay root closing")
                if future.done() and future.exception() is not None:
                    log.info(
                        "generation %d: sending v%d failed: %s",
                        gen.number,
                        version,
                        future.exception(),
                    )
                    m.counters["transfer_failures"] += 1
                    return False
                arrived = m.arrived(gen, lagging)
                if future.done() and arrived:
                    m.finished(gen)  # re-form without the lost ones next time
                    return True
                if m.failing(gen) or deadline.expired():
                    return False
            # once every relay has it, only gloo's send is left to finish: look again soon
            self._read_reports(deadline.poll_ms(_FINISH_POLL_S if arrived else _REPORT_POLL_S))

    def _send_notice(self, relay: Member, notice: Send, frame: bytes) -> None:
        """On the data channel when the relay's data thread is connected to it; else on
        the control channel (through the agent), which every relay reads."""
        if self._data is not None and self._data.notify(relay.relay_id, frame):
            with self._cond:
                self._membership.counters["data_notices"] += 1
            return
        agent = self._agent
        assert agent is not None
        agent.send_to(relay.identity, notice)
        with self._cond:
            self._membership.counters["control_notices"] += 1

    def _read_reports(self, timeout_ms: int) -> None:
        """Wait up to `timeout_ms` for reports on the data channel and apply them (relay thread).

        Reports also arrive on the control channel (the agent applies those and notifies
        the condition); the callers look at the membership again after each slice.
        """
        data = self._data
        if data is None:
            with self._cond:
                self._cond.wait(timeout_ms / 1000)
            return
        reports, rejected = data.reports(timeout_ms)
        if not reports and not rejected:
            return
        now = time.monotonic()
        with self._cond:
            if rejected:
                self._membership.counters["rejected"] += rejected
            for report in reports:
                self._membership.report(report, now)

    def _await(self, group: _Group, deadline: Deadline) -> str:
        """Wait until every member reached the version: "done", "reform" or "expired"."""
        while True:
            with self._cond:
                if self._stopping.is_set():
                    raise ClosedError("relay root closing")
                if self._membership.complete(group.generation):
                    return "done"
                if group.generation.broken or group is not self._group:
                    return "reform"
                if deadline.expired():
                    return "expired"
            self._read_reports(deadline.poll_ms(_REPORT_POLL_S))

    def _on_deadline(self, version: int, group: _Group | None) -> Verdict:
        """trio's fail_after ("raise") versus move_on_after ("evict"): same deadline.

        Returns who reached the version and who missed it. "evict" drops the late relays
        (the caller finishes the version); "raise" records a PublishTimeout in
        `last_error` and leaves them in the tree.
        """
        agent = self._agent
        assert agent is not None
        with self._cond:
            verdict = self._membership.deadline(
                group.generation if group is not None else None, time.monotonic()
            )
            for identity in verdict.evicted:
                agent.send_to(identity, Evict(self.tree, f"evicted at version {version}"))
            if verdict.evicted and self._group is not None:
                self._group.generation.broken = True
        ids = verdict.missing
        if self._on_timeout == "raise":
            verb = "have its workers ack" if self._ack == "tree" else "receive"
            self.last_error = PublishTimeout(
                f"version {version}: {len(ids)} relay(s) did not {verb} it within "
                f"{self._timeout:.1f} s ({', '.join(ids[:8])}); the relay root acks the version "
                'to its bus only once they have it — pass on_timeout="evict" to drop late relays',
                version=version,
                acked=list(verdict.done),
                missing=list(ids),
            )
            log.warning("relay root: %s", self.last_error)
        elif ids:
            log.info("evicted %d relay(s) at version %d: %s", len(ids), version, ", ".join(ids))
        return verdict

    def _finish(
        self,
        version: int,
        gen: int,
        done: tuple[str, ...],
        missing: tuple[str, ...],
        started: float,
        nbytes: int,
    ) -> None:
        record = Relayed(version, gen, done, missing, time.perf_counter() - started, nbytes)
        self.last = record
        with self._cond:
            self._membership.counters["relayed"] += 1
        if self._on_relayed is not None:
            self._on_relayed(record)
