"""The trainer side: `Publisher` and the `Publish` handle returned by `publish()`.

A publish reads the weights, claims a slot, writes and announces the version, then waits
for the acks: the first three and the announcement are the write mode's (`_write_modes`,
chosen once from `writes=`), the wait is `AckWait`'s (`_acks`), and this module strings
them together.

Invariants:

* **A slot a live subscriber holds is never written** (`Registry.free_slot`); with
  slots=1 alias readers are protected by the seqlock instead.
* Versions strictly increase; `start()` publishes version 0.
* The events, acks and tap sockets are used under `io` by one thread at a time. A
  publishing thread takes it to send RECEIVE itself (`Announcer`), and a waiting thread
  to read the acks it waits for itself (`AckWait`): a thread hand-off per message cost
  more than the rest of the round trip on 2 cores. The agent thread owns the control
  socket, and takes `io` every SERVICE_S and per heartbeat for the rest (heartbeats,
  evictions, BYEs, acks nobody waits for). Registry updates happen under one lock and
  condition.
* Every wait has a deadline: a publish builds one and spends it on finding a free slot
  and on collecting every ack. With on_timeout="evict", a slot freed at the deadline by
  evicting its holders (only the holders of that one slot: `Registry.blockers`) starts
  the wait for acks anew: the workers that did their part are never evicted for it.
* CUDA weights (see docs/cuda.md) go into one dedicated CUDA buffer per device, shared
  over CUDA IPC; the publisher synchronizes its stream before the header calls a slot
  complete, so a RECEIVE never precedes its bytes. The CPU segment always exists (it
  holds the header) and has room for every tensor: while a worker that reads the CPU
  copy is on the bus, each version's CUDA tensors are copied there too (device to host),
  and a joining one gets the current version copied before its WELCOME. Both happen
  under the write lock, so no such worker ever sees a slot without its copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable
from typing import Any

import zmq

from . import _config
from ._acks import AckWait
from ._announcer import Announcer
from ._buffers import CpuSegment, CudaBuffer, collect_garbage, segment_name
from ._config import DEFAULT
from ._connections import connection_budget, open_descriptors, peer_alive, raise_fd_limit
from ._deadline import Deadline
from ._errors import ClosedError, ZmqSyncError
from ._layout import Key
from ._lifecycle import Lifecycle, State, signals_held
from ._overlap import Pending
from ._protocol import Inspect, encode
from ._publisher_agent import Agent, Shared
from ._publisher_role import PublisherRole
from ._registry import Meant, WorkerInfo
from ._security import CurveServer, Security, forget_keys, is_loopback, issue_keys, require_security
from ._shard_writes import sharded_mode
from ._slots import Slots
from ._sockets import connect
from ._source import Source
from ._write_modes import Bound, build
from ._writes import Copy, Writes

__all__ = ["DEFAULT", "Publish", "Publisher"]

log = logging.getLogger(__name__)

# close() with timeout=None: how long it waits for a version still copied in the background
_CLOSE_WAIT_S = 60.0

# Makes the buffer of one CUDA device (a seam: tests without a GPU put a fake here).
_DEVICE_BUFFER: Any = CudaBuffer


class Publish:
    """The handle of one published version: who acked, who is missing, how long it took.

    Its targets are worker ids *and* the processes that held them when it was published:
    an ack from another process that took one of those ids since does not count.
    """

    def __init__(
        self,
        acks: AckWait,
        version: int,
        meant: tuple[Meant, ...],
        started: float,
        pending: Pending | None = None,
        max_lag: int | None = 0,
    ) -> None:
        self.version = version
        self.max_lag = max_lag  # the bound publish() applied (None: it did not wait)
        self.targets = tuple(w for w, _ in meant)
        self._meant = meant
        self._acks = acks
        self._started = started
        self._returned = time.perf_counter()  # when publish() handed this back
        acks.blocked(self._returned - started)  # `blocked`'s share known now (metrics)
        self._pending = pending  # the background copy, with Overlapped writes
        self._finished: float | None = None
        self._acked: tuple[str, ...] | None = None

    @property
    def written(self) -> bool:
        """True once every byte of this version is in its slot and it was announced."""
        return self._pending is None or self._pending.done.is_set()

    @property
    def write_seconds(self) -> float | None:
        """From publish() to the version being announced (None while it is written)."""
        if self._pending is None:
            return self._returned - self._started
        at = self._pending.written_at
        return None if at is None else at - self._started

    @property
    def blocked(self) -> float:
        """Seconds the publishing thread waited for this version: inside publish() (to
        the return, or for a free slot) plus, with Overlapped writes, inside ``step()`` for its
        background copy. What publishing cost the training loop."""
        guard = self._pending.guard_wait if self._pending is not None else 0.0
        return self._returned - self._started + guard

    @property
    def acked(self) -> tuple[str, ...]:
        """Targets that acknowledged this version (before leaving, if they left)."""
        if self._acked is not None:
            return self._acked
        return self._acks.acked(self.version, self._meant)

    @property
    def missing(self) -> tuple[str, ...]:
        """Targets that did not ack: still on the bus, evicted, dropped as silent, gone, or
        whose id another process holds now."""
        acked = set(self.acked)
        return tuple(w for w in self.targets if w not in acked)

    @property
    def seconds(self) -> float:
        """From publish() to the last ack (or to now, while in flight)."""
        end = self._finished if self._finished is not None else time.perf_counter()
        return end - self._started

    @property
    def lags(self) -> dict[str, int]:
        """How many versions each target still on the bus is behind this one, now (0: it
        applied this version or a newer one). Read right after ``publish(max_lag=k)``
        returns, none is above k."""
        return self._acks.lags(self.version, self._meant)

    @property
    def slowest(self) -> tuple[str, int] | None:
        """The target furthest behind this version now, and by how many versions (None:
        no target is on the bus)."""
        lags = self.lags
        return max(lags.items(), key=lambda item: item[1]) if lags else None

    def done(self) -> bool:
        """True once no target still on the bus is missing."""
        if self._finished is not None:
            return True
        return not self._acks.missing(self.version, self._meant)

    def wait(self, timeout: float | None = DEFAULT, *, max_lag: int = 0) -> Publish:
        """Block until every target acked (or, with `max_lag`, applied at least
        ``version - max_lag``), then return self.

        Args:
            timeout: seconds; left out: the publisher's `timeout`; None: no limit.
            max_lag: how many versions behind this one a target may still be.

        Raises:
            PublishTimeout: with on_timeout="raise", some targets did not ack in time
                (`.missing` names them). With "evict" they are dropped instead, listed in
                `.missing`, and wait() returns.
        """
        acks = self._acks
        deadline = Deadline(acks.timeout if timeout is DEFAULT else timeout)
        if self._pending is not None:  # announced only once written
            self._pending.wait(deadline.remaining())
        acked = acks.wait(self.version, self._meant, deadline, max_lag)
        if self._finished is None and max_lag == 0:
            self._finished, self._acked = time.perf_counter(), acked
            acks.took(self._finished - self._started)
        return self

    def __repr__(self) -> str:
        state = "done" if self.done() else f"waiting for {len(self.missing)}"
        return f"<Publish v{self.version} {state} {self.seconds * 1e3:.2f} ms>"


class Publisher(Lifecycle):
    """Publishes versions of a model's weights to every subscriber on the host.

    The common case is one line, ``Publisher(model, name="policy")``; the rest is
    grouped: how versions are written (`writes=`), who may reach the bus (`security=`).

    Args:
        weights: an nn.Module (parameters and buffers are re-read at each publish), a
            TensorDict or a state_dict. Of DTensors (FSDP2, tensor parallel, both), the
            publisher is collective over their mesh: every rank builds one and calls
            publish(); each writes its own shards, the lowest rank hosts the bus (see
            docs/guide.md, "Sharded trainers and tensor-parallel workers").
        address: control address; None: ``ipc://<runtime dir>/<name>.sock``.
        name: bus name, used for the default address and segment names.
        slots: copies of the model in the shared buffer (>= 1). More slots let
            publishes overlap slow alias-mode workers. ``Live()`` writes use one;
            ``Copy(flat=True)`` one more, where the trainer's tensors live.
        timeout: default deadline (s) for a publish to collect its acks.
        on_timeout: "raise" (PublishTimeout) or "evict" (drop the missing workers).
        heartbeat: heartbeat interval (s); a worker silent for ~6 beats is dropped.
        writes: how versions are written, chosen once:
            ``Copy()`` (default; ``Copy(dtype=torch.bfloat16)`` casts,
            ``skip_unchanged=True`` writes only what changed, and ``flat=True`` keeps
            the trainer's tensors in a slot, copied beside the workers' copies),
            ``Overlapped(optimizer)`` (the optimizer's tensors are copied in the
            background, beside the next forward and backward), or
            ``Live()`` (the trainer's tensors move into the shared segment; a publish
            only announces). See `zmqsync.Copy`, `zmqsync.Overlapped`, `zmqsync.Live`.
        security: CURVE keys, the insecure opt-in, the group that may use the bus, the
            tap for `zmqsync sniff`, and the admission limits (max_workers,
            handshake_rate): see `zmqsync.Security` and docs/security.md.
        shm_dir: tmpfs directory for segments (default $ZMQSYNC_SHM_DIR or /dev/shm).
    """

    def __init__(
        self,
        weights: Any,
        address: str | None = None,
        *,
        name: str = "weights",
        slots: int = 2,
        timeout: float | None = 10.0,
        on_timeout: str = "raise",
        heartbeat: float = 0.5,
        writes: Writes = Copy(),
        security: Security = Security(),
        shm_dir: str | None = None,
    ) -> None:
        self.name = _config.check_name(name)
        check_options(slots, timeout, on_timeout, heartbeat, writes, security)
        self._source = Source(weights)
        self._shm_dir = _config.shm_dir(shm_dir)
        self.bus_id = secrets.token_hex(8)  # new at every start of a publisher
        # DTensor weights: collective over their mesh, the host rank's bus id agreed
        sharded = sharded_mode(self._source, writes, self.bus_id, self._shm_dir, timeout)
        self._mode = sharded or build(writes, self._source)  # with the layout the slots hold
        self._layout = self._mode.layout
        self._address_arg = address
        self._slot_count = self._mode.slot_count(slots)
        self._timeout = timeout
        self._on_timeout = on_timeout
        self._security = security
        curve = security.curve
        self._gid = _config.resolve_group(security.group)
        tap = security.tap if security.tap is not None else os.environ.get("ZMQSYNC_TAP") == "1"
        self.bus_id = sharded.shards.bus_id if sharded else self.bus_id
        self.address = ""
        self._role = PublisherRole(
            name=self.name,
            bus_id=self.bus_id,
            slots=self._slot_count,
            heartbeat=heartbeat,
            slot_bytes=self._layout.slot_bytes,
            manifest=self._layout.specs,
            max_workers=security.max_workers,
            max_workers_per_peer=security.max_workers_per_peer,
            handshake_rate=security.handshake_rate,
            now=time.monotonic(),
            alive=peer_alive,
        )
        server = curve if isinstance(curve, CurveServer) else None
        self._shared = Shared(self._role, curve=server, gid=self._gid, tap=tap)
        self._publish_lock = threading.Lock()
        self._agent: Agent | None = None
        self._acks: AckWait | None = None  # once started
        self._segment: CpuSegment | None = None  # its header says when the bus closes
        self._resources = contextlib.ExitStack()
        self._pid = os.getpid()
        # a sharded trainer's rank that does not host the bus only writes its shards
        self._peer = sharded.peer(self.name, self._slot_count) if sharded else None

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> Publisher:
        """Create the buffer, bind the sockets, publish version 0. Returns self.

        Raises:
            SharedMemoryFull: the shm dir has no room for `slots` copies of the model.
            ZmqSyncError: another publisher already serves this address.
            ClosedError: the publisher was closed (create a new one).
        """
        if not self._starting():
            return self
        if self._peer is not None:
            self._peer.start()
            self._started()
            return self
        shared = self._shared
        with contextlib.ExitStack() as stack:
            self.address = shared.address = self._address_arg or _config.default_address(self.name)
            _refuse_if_served(self.address)
            if self._security.curve is True:
                with signals_held():  # each file is made and handed to `stack` as one step
                    shared.curve = issue_keys(self.name, self._gid)
                    stack.callback(forget_keys, self.name)
            elif self._address_arg is None:  # keys a killed publisher left for this name
                forget_keys(self.name)
            require_security(self.address, shared.curve, self._security.insecure)
            shared.fd_limit = raise_fd_limit()
            shared.max_connections = connection_budget(shared.fd_limit, open_descriptors())
            with signals_held():
                slots = self._open_buffers(stack)
            self._mode.start(self.name, slots, stack)  # version 0, before anyone can join
            self._role.record(0, 0)
            with signals_held():
                agent = self._agent = Agent(shared)
                stack.callback(agent.stop)  # first: a start cut short closes what it bound
            agent.start()  # interruptible while it waits for the binding
            self._acks = AckWait(shared, agent, self._on_timeout, self._timeout)
            announcer = Announcer(shared, agent, self._layout, self.bus_id)
            bound = Bound(self.name, slots, announcer, self._acks, shared.write_lock, self._timeout)
            self._mode.bind(bound, stack)
            with signals_held():  # held from `stack` to `_resources` and STARTED (closable)
                self._resources = stack.pop_all()
                self._started()
        log.info(
            "publisher %r started at %s (%d tensors, %.1f MiB, %d slots)",
            self.name,
            self.address,
            len(self._layout.specs),
            self._layout.nbytes / 2**20,
            self._slot_count,
        )
        if self.address.startswith("tcp://") and shared.curve is None:
            who = "any local user" if is_loopback(self.address) else "anyone who reaches it"
            log.warning(
                "publisher %r at %s has no CURVE: %s can inspect this bus, join it and "
                "stall every publish; pass security=zmqsync.Security(curve=True) (see "
                "docs/security.md)",
                self.name,
                self.address,
                who,
            )
        return self

    def _open_buffers(self, stack: contextlib.ExitStack) -> Slots:
        """The CPU segment and one buffer per GPU, their slots; `stack` removes them."""
        os.makedirs(self._shm_dir, exist_ok=True)
        collect_garbage(self._shm_dir)
        segment = CpuSegment(
            self._shm_dir,
            segment_name(self.name, self.bus_id),
            slots=self._slot_count,
            slot_bytes=self._layout.slot_bytes,
            gid=self._gid,
        )
        stack.enter_context(segment)
        self._segment = segment
        cuda = [
            stack.enter_context(
                _DEVICE_BUFFER(device, slots=self._slot_count, slot_bytes=self._layout.slot_bytes)
            )
            for device in self._source.cuda_devices  # one dedicated buffer per GPU
        ]
        slots = Slots(self._layout, segment, cuda, cast=self._layout is not self._source.layout)
        self._role.cuda = slots.cuda
        self._shared.buffers = slots.describe()
        self._shared.fill_mirror = slots.fill_mirror if slots.cuda else None
        return slots

    def close(self) -> None:
        """Broadcast STOP, wait briefly for BYEs, unlink the segments. Idempotent."""
        if self._state is State.STARTED and os.getpid() == self._pid:
            # a version still being written in the background goes out before STOP
            wait_s = self._timeout if self._timeout is not None else _CLOSE_WAIT_S
            with contextlib.suppress(Exception):  # bounded even with timeout=None
                self._mode.settle(Deadline(wait_s))
        with signals_held():
            if not self._closing():  # never started, closed already, or a forked child's
                return
            if self._peer is not None:
                self._peer.close()
                return
            try:
                if self._acks is not None:
                    self._acks.closed = True
                if self._segment is not None:  # seen at once, also by a worker busy applying
                    self._segment.header.mark_closed()
                if self._agent is not None:
                    self._agent.command(b"stop")
            finally:
                self._resources.close()
        log.info("publisher %r closed at version %d", self.name, self._role.latest)

    def _title(self) -> str:
        return f"Publisher {self.name!r}"

    def __enter__(self) -> Publisher:
        return self.start()

    def __repr__(self) -> str:
        return (
            f"<Publisher {self.name!r} v{self._role.latest} {self.address or '-'} "
            f"{len(self._role.members)} workers {self._state.value}>"
        )

    # --- publishing ----------------------------------------------------------------

    @property
    def bus(self) -> str:
        """The bus id (`bus_id`), under its older name."""
        return self.bus_id

    @property
    def version(self) -> int:
        """The last published version."""
        return self._role.latest if self._peer is None else self._peer.version

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        """Snapshot of the workers on the bus."""
        with self._shared.lock:
            return self._role.infos(time.time() - time.monotonic())

    @property
    def max_lag_allowed(self) -> int | None:
        """The largest ``max_lag`` publish() accepts: ``slots - 1`` (None: any, with
        ``Live()`` writes, which never wait for a slot). While an alias worker is on the
        bus a publish applies at most ``slots - 2``: each pins the slot it computes with."""
        return self._mode.lag_room(self._slot_count, False)

    @property
    def counters(self) -> dict[str, int]:
        with self._shared.lock:
            return dict(self._role.counters)

    def publish(
        self,
        weights: Any = None,
        *,
        max_lag: int | None = 0,
        workers: Iterable[str] | None = None,
        timeout: float | None = DEFAULT,
        keys: Iterable[str | Key] | None = None,
    ) -> Publish:
        """Write a new version into a free slot, announce it, and (by default) wait for acks.

        The steps, in order: read and check the weights; claim a slot no worker holds
        (waiting for acks if need be); write it under the seqlock; announce it (RECEIVE);
        wait for the acks. With ``Overlapped`` writes the copy of the optimizer's tensors
        and the announcement happen in the background: ``publish(max_lag=None)`` returns
        once the rest is copied, and the next ``optimizer.step()`` waits only if that
        copy has not finished (`Publish.blocked` says how long the training thread waited).

        Args:
            weights: tensors to publish instead of re-reading the source (same keys,
                shapes, dtypes; with `keys`, at least those).
            max_lag: how far behind this version the targets may still be when publish()
                returns: 0 (the default) waits until every target acked it; k returns
                once every target applied at least ``version - k`` (bounded staleness);
                None returns at once (call `Publish.wait` later). A bound must leave the
                next publish a free slot: at most ``slots - 1``; while an alias worker is
                on the bus the bound applied is at most ``slots - 2`` (`Publish.max_lag`
                says which). See docs/guide.md, "Staleness".
            workers: only these workers must ack (the others still get the version).
            timeout: one deadline for the whole publish; left out: the publisher's.
            keys: publish only these tensors (dotted names or key tuples, e.g. an
                adapter's) as the new version; every other tensor keeps the value it had
                in the last version, in every slot.

        Raises:
            LayoutMismatch: `weights` has other keys, shapes or dtypes.
            PublishTimeout: with on_timeout="raise", workers did not ack (or still held
                every slot, or stayed more than `max_lag` versions behind) before the
                deadline.
            ValueError: `max_lag` is negative or above ``slots - 1``.
            ClosedError: the publisher is not started.
        """
        if self._peer is not None:  # a sharded trainer's other rank: its shards only
            self._check_lag(max_lag)
            wait_s = self._timeout if timeout is DEFAULT else timeout
            return self._peer.publish(weights, keys, wait_s)  # type: ignore[return-value]
        acks = self._usable()
        started = time.perf_counter()
        lag = self._check_lag(max_lag)
        deadline = Deadline(self._timeout if timeout is DEFAULT else timeout)
        mode = self._mode
        flat, named = mode.read(weights, self._source.named(keys))
        with self._publish_lock:
            mode.settle(deadline)  # the version before this one is out first
            version = mode.version(self._role.latest)
            slot = mode.claim(deadline)
            if deadline.expired():  # "evict": the slot's holders were dropped at the
                # deadline; the version written now gets the whole timeout for its acks,
                # so that no worker is evicted for a wait it could not shorten
                deadline = Deadline(deadline.total)
            with self._shared.cond:
                targets = self._role.targets(workers)
                if lag and self._role.alias_readers():  # each pins one slot more
                    room = mode.lag_room(self._slot_count, True)
                    lag = lag if room is None else min(lag, room)
            pending = mode.write(slot, version, flat, named)
        handle = Publish(acks, version, targets, started, pending, lag)
        log.debug("published v%d into slot %d for %d workers", version, slot, len(targets))
        if lag is not None:
            handle.wait(deadline.remaining(), max_lag=lag)
        return handle

    def _check_lag(self, max_lag: int | None) -> int | None:
        """The bound a publish waits for (None: none), or ValueError for one that cannot
        hold: with more versions in flight than slots, the claim of a free slot would
        become the real bound, unseen."""
        if max_lag is None:
            return None
        if max_lag == 0 and type(max_lag) is int:  # the default, on every publish: no more
            return 0
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
            raise ValueError(f"max_lag must be an int >= 0 or None, not {max_lag!r}")
        room = self.max_lag_allowed
        if room is not None and max_lag > room:
            raise ValueError(
                f"max_lag={max_lag} needs slots >= {max_lag + 1} ({max_lag + 2} with alias "
                f"workers): publisher {self.name!r} has {self._slot_count}; pass "
                f"Publisher(slots={max_lag + 1}) or more, or a smaller max_lag"
            )
        return max_lag

    def wait_for_workers(self, n: int, timeout: float | None = DEFAULT) -> bool:
        """Block until `n` workers are on the bus and have applied a version; False if
        the deadline passed first.

        A worker counts once it acked a version (`WorkerInfo.version` >= 0): one welcomed
        but unable to apply (its model has another layout, it raised `LayoutMismatch`)
        never counts, and the publisher logs a warning when it leaves.
        """
        acks = self._usable()
        deadline = Deadline(self._timeout if timeout is DEFAULT else timeout)
        with self._shared.cond:
            while self._applied_workers() < n:
                acks.check()
                if deadline.expired():
                    return False
                self._shared.cond.wait(deadline.wait_s(0.5))
        return True

    def _applied_workers(self) -> int:
        """Members that acked a version (caller holds `_shared.cond`)."""
        return self._role.applied_workers()

    def _usable(self) -> AckWait:
        """The started publisher's waits; raises what the user should hear otherwise."""
        if self._peer is not None:
            host = self._peer.shards.ranks[0]
            raise ZmqSyncError(
                f"Publisher {self.name!r} on rank {self._peer.shards.rank} writes its shards "
                f"only: workers and acks are the bus host's (rank {host})"
            )
        acks = self._acks
        if self._state is not State.STARTED or acks is None:
            state = "closed" if self._state is State.CLOSED else "not started"
            raise ClosedError(f"Publisher {self.name!r} is {state}; call start() on a new one")
        acks.check()
        return acks


def check_options(
    slots: int,
    timeout: float | None,
    on_timeout: str,
    heartbeat: float,
    writes: Writes,
    security: Security,
) -> None:
    """Raise what a Publisher given these options raises (shared with those who pass
    options through to one, so that a bad value fails where it was given)."""
    if not 1 <= slots <= 64:
        raise ValueError(f"slots must be between 1 and 64, not {slots}")
    if on_timeout not in ("raise", "evict"):
        raise ValueError(f'on_timeout must be "raise" or "evict", not {on_timeout!r}')
    if not 0.001 <= heartbeat <= 3600:
        raise ValueError(f"heartbeat must be in [0.001, 3600] seconds, not {heartbeat}")
    if not isinstance(writes, Writes):
        raise TypeError(f"writes= takes Copy(), Overlapped(optimizer) or Live(), not {writes!r}")
    if not isinstance(security, Security):
        raise TypeError(f"security= takes a zmqsync.Security, not {security!r}")
    security.bus_side("a Publisher")
    Deadline(timeout)  # validates


def _refuse_if_served(address: str) -> None:
    """Binding an ipc:// path silently steals it; ask first whether someone answers."""
    if not address.startswith("ipc://") or not os.path.exists(address[len("ipc://") :]):
        return
    ctx = zmq.Context()
    try:
        req = connect(ctx, zmq.REQ, address)
        req.send(encode(Inspect("")))
        answered = bool(req.poll(200) & zmq.POLLIN)
        req.close()
    finally:
        ctx.destroy(linger=0)
    if answered:
        raise ZmqSyncError(
            f"a publisher already serves {address}; close it, or use another name/address"
        )
