"""A relay: republishes the root's versions on this host's bus.

Three threads, each with what it alone touches:

* the **agent** (`RelayAgent`) owns the control DEALER: joins, heartbeats, root liveness;
* the **data thread** (`Relay._serve`) joins generations, receives versions (into a free
  slot of the local bus, posted ahead; see `Wire`), publishes them under the root's
  number, reports "received" on its data DEALER and posts the next receives;
* the **wait thread** (`Relay._wait_loop`) waits for the local workers' acks of each
  version and reports "acked" on a DEALER of its own; every `_SWEEP_S` it also removes
  the segments nobody maps from the host's shm dir (the bus of a relay that was killed
  is still mapped by its workers when its successor opens a bus, so the start's own
  collection cannot remove it; once they moved to the new bus, this sweep does).

What the bus holds (`Holding`) is shared: the data and wait threads change it under the
relay's lock, the agent reads it for its heartbeats.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from .. import _config
from .._deadline import Deadline
from .._errors import ProtocolError, PublishTimeout, ZmqSyncError
from .._gc import collect_garbage
from .._lifecycle import Lifecycle
from .._protocol import TensorSpec
from .._publisher import Publish, Publisher
from .._security import Security
from .._sockets import NOBLOCK
from .._write_modes import Landing
from ._data_channel import DataLink
from ._host_agent import Holding, Inbox, RelayAgent
from ._messages import RELAY, Commit, Prepare, Report, Send
from ._options import Branch, check_relay_id, require
from ._rendezvous import data_identity, rendezvous, require_trusted
from ._wire import (
    Posted,
    Wire,
    WireError,
    check_backend,
    layout_of,
    new_process_group,
    payload_bytes,
    release,
    views_of,
)

__all__ = ["Relay"]

log = logging.getLogger(__name__)
DEFAULT_SECURITY = Security()
DEFAULT_BRANCH = Branch()

_INBOX_POLL_S = 0.01  # the data thread: agent messages wait at most this long
_SWEEP_S = 5.0  # the wait thread removes segments nobody maps this often


def _written(slot: torch.Tensor) -> None:
    """The `fill` of a version whose bytes were received into its slot already."""


def _copier(source: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def copy(slot: torch.Tensor) -> None:
        slot[: source.numel()].copy_(source)  # the payload; the slot's tail is padding

    return copy


class _LocalBus:
    """The relay's publisher on this host: a version's bytes land in a free slot straight
    from the network.

    A plain `Publisher` over the root's manifest, writing through a `Landing` (the
    private seam that lets bytes land in a slot): `publish_received` stages a version
    and runs the publisher's whole publish (free-slot choice, seqlock, RECEIVE, acks)
    with the bytes written by `fill(slot bytes)`. If `fill` raises, the slot stays
    marked incomplete and the version is never announced.
    """

    def __init__(
        self, manifest: Sequence[TensorSpec], first: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        # Version 0 holds the first version's bytes (received into `first`): the
        # publisher's weights are views of them, and start() copies them into slot 0.
        self._landing = Landing()
        self.publisher = Publisher(views_of(manifest, first), *args, writes=self._landing, **kwargs)

    @property
    def address(self) -> str:
        return self.publisher.address

    @property
    def version(self) -> int:
        return self.publisher.version

    def start(self) -> _LocalBus:
        self.publisher.start()
        return self

    def close(self) -> None:
        self.publisher.close()

    def reserve_slot(self) -> int | None:
        """A slot the next `publish_received(slot=...)` may write, or None if all are held."""
        return self._landing.reserve()

    def open_slot(self, slot: int) -> torch.Tensor:
        """`slot` (from `reserve_slot`) as flat bytes, marked as being written first."""
        return self._landing.open(slot)

    def publish_received(
        self,
        version: int,
        fill: Callable[[torch.Tensor], None],
        timeout: float | None,
        slot: int | None = None,
    ) -> Publish:
        """Publish `version`, its bytes written by `fill(flat slot)`, into `slot` if given
        (from `reserve_slot`), else into the slot the publisher claims."""
        self._landing.stage(version, fill, slot)
        return self.publisher.publish(max_lag=None, timeout=timeout)


@dataclass
class _RelayGroup:
    """The generation the data thread is in, and its process group."""

    gen: int
    rank: int
    world: int
    root_bus: str
    wire: Wire
    pg: Any
    slot_bytes: int  # the bytes of a version: the payload_bytes of the manifest


class Relay(Lifecycle):
    """Republishes a root's versions on this host's bus, under the same version numbers.

    One per host. It finds the root through the rendezvous (``env://``: MASTER_ADDR and
    MASTER_PORT; or ``tcp://HOST:PORT``), joins its tree, and owns the host's bus `name`
    (created when the first version arrives): local workers are ordinary
    ``Subscriber(name=...)`` processes. When the root is gone it keeps its bus (workers
    keep their last version) and re-joins the next root by itself.

    Args:
        address: this host's bus address; None: the default address for `name`.
        name: bus name (the root's bus name too).
        tree: how this relay finds the tree and joins it, a `Branch`: the root's
            rendezvous (``env://`` by default), its id on the tree (default: the host
            name), its NCCL staging device, how long `start` waits for a root.
        slots: slots of the local bus (>= 2).
        timeout: the local bus's publish deadline (keep it below the root's timeout in
            tree mode).
        on_timeout: the local bus's: "evict" (default) or "raise" (report its missing
            workers to the root either way).
        heartbeat: heartbeat interval (s) towards the root and on the local bus.
        shm_dir: for the local bus (see `Publisher`).
        on_update: callable(version) run after each version is on the local bus.
        security: the local bus's, as a `Publisher` takes it (``curve=True`` makes keys
            and leaves the client's in this host's runtime dir for the local workers, or
            a CurveServer; ``tap=``, ``max_workers=``, ...); its ``insecure=True`` also
            allows a non-loopback rendezvous address (see `RelayRoot`).

    Attributes:
        relay_id: this relay's id on the tree (the `Branch`'s, or the host name).

    Raises:
        TypeError: `tree` is not a `Branch`, or `security` not a `Security`.
        ValueError: an option out of range, or a rendezvous other hosts can reach
            without ``insecure=True``.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        name: str = "weights",
        tree: Branch = DEFAULT_BRANCH,
        slots: int = 2,
        timeout: float = 10.0,
        on_timeout: str = "evict",
        heartbeat: float = 0.5,
        shm_dir: str | None = None,
        on_update: Callable[[int], None] | None = None,
        security: Security = DEFAULT_SECURITY,
    ) -> None:
        require(tree, Branch, "Relay")
        if not isinstance(security, Security):
            raise TypeError(f"security= takes a zmqsync.Security, not {security!r}")
        security.bus_side("a Relay")
        self.name = _config.check_name(name)
        self.relay_id = check_relay_id(tree.relay_id or socket.gethostname())
        if slots < 2:
            raise ValueError(
                f"a relay's bus needs slots >= 2 (it writes while workers read), not {slots}"
            )
        if on_timeout not in ("raise", "evict"):
            raise ValueError(f'on_timeout must be "raise" or "evict", not {on_timeout!r}')
        if not timeout > 0 or math.isinf(timeout):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
        self._host, self._port = rendezvous(tree.init_method)
        require_trusted(self._host, security.insecure)
        self._device_arg = tree.device
        self._address_arg = address
        self.address = ""
        self._slots, self._timeout, self._on_timeout = slots, float(timeout), on_timeout
        self._heartbeat, self._shm_dir = float(heartbeat), shm_dir
        self._security = security
        self._on_update = on_update
        join = tree.join_timeout
        self._join_timeout = self._timeout if join is None else float(join)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._local: _LocalBus | None = None
        self._manifest: tuple[TensorSpec, ...] = ()
        self._holding = Holding()
        self._group: _RelayGroup | None = None
        self._prepared = -1
        self._stage: torch.Tensor | None = None
        self._inbox: Inbox = queue.SimpleQueue()
        self._waits: queue.SimpleQueue[tuple[Publish, str, int] | None] = queue.SimpleQueue()
        self._agent: RelayAgent | None = None
        self._data_ctx: zmq.Context[zmq.Socket[bytes]] | None = None  # made by start()
        self._data_link: DataLink | None = None  # the data thread's
        self._posted: Posted | None = None  # the data thread's: receives posted ahead
        self._threads: list[threading.Thread] = []
        self.counters: Counter[str] = Counter()
        self._pid = os.getpid()

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> Relay:
        """Join the root's tree (the local bus opens with the first version). Returns self.

        Raises:
            ConnectTimeout: no root accepted this relay within `timeout`.
            ClosedError: closed already (create a new one).
        """
        if not self._starting():
            return self
        self.address = self._address_arg or _config.default_address(self.name)
        self._data_ctx = zmq.Context()
        self._agent = RelayAgent(
            relay_id=self.relay_id,
            name=self.name,
            host=self._host,
            port=self._port,
            heartbeat=self._heartbeat,
            holding=self._holding,
            inbox=self._inbox,
            counters=self.counters,
        )
        self._threads = [
            threading.Thread(
                target=self._data_loop, name=f"zmqsync-relay-data-{self.name}", daemon=True
            ),
            threading.Thread(
                target=self._wait_loop, name=f"zmqsync-relay-wait-{self.name}", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()
        self._started()  # the threads run: a failed join closes them
        try:
            self._agent.start()
            self._agent.wait_accepted(Deadline(self._join_timeout))
        except BaseException:
            self.close()
            raise
        log.info("relay %s joined %s:%d", self.relay_id, self._host, self._port)
        return self

    def close(self) -> None:
        """Leave the tree, drop the group, close the local bus (STOP). Idempotent."""
        if not self._closing():
            return
        self._stopping.set()
        if self._agent is not None:
            self._agent.stop()
        self._inbox.put(("stop", None))
        self._threads[0].join(self._timeout + _config.THREAD_JOIN_S)  # data: may be in a collective
        self._set_group(None)
        self._posted = None
        local, self._local = self._local, None
        self._holding.publisher = None
        if local is not None:
            local.close()  # STOP to the local workers; a pending wait ends with ClosedError
        self._waits.put(None)
        self._threads[1].join(_config.THREAD_JOIN_S)
        self._sweep()
        if any(thread.is_alive() for thread in self._threads):
            log.warning("relay %s: a thread did not stop within its deadline", self.relay_id)
        elif self._data_ctx is not None:  # their DEALERs are closed
            self._data_ctx.destroy(linger=0)
        with self._cond:
            self._cond.notify_all()
        log.info("relay %s closed at version %d", self.relay_id, self.version)

    def _title(self) -> str:
        return f"Relay {self.relay_id!r}"

    def __enter__(self) -> Relay:
        return self.start()

    def __repr__(self) -> str:
        link = "connected" if self.connected else "disconnected"
        return (
            f"<Relay {self.relay_id!r} {self.name!r} v{self.version} gen {self.generation} "
            f"{link} {self._state.value}>"
        )

    # --- what the user sees --------------------------------------------------------

    @property
    def version(self) -> int:
        """The last root version on this host's bus (-1 before the first)."""
        return self._holding.have[1]

    @property
    def connected(self) -> bool:
        """True while the root accepts this relay and is heard from."""
        return self._agent is not None and self._agent.connected

    @property
    def generation(self) -> int:
        group = self._group
        return group.gen if group is not None else -1

    @property
    def publisher(self) -> Publisher | None:
        """The local bus (None until the first version arrived)."""
        return self._local.publisher if self._local is not None else None

    def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until the local bus holds `version` or newer; False on timeout."""
        deadline = Deadline(self._timeout if timeout is None else timeout)
        with self._cond:
            while self.version < version:
                if deadline.expired() or self._stopping.is_set():
                    return False
                self._cond.wait(deadline.wait_s(0.2))
        return True

    # --- data thread ---------------------------------------------------------------

    def _report(
        self,
        stage: str,
        gen: int,
        version: int = -1,
        missing: Sequence[str] = (),
        reason: str = "",
        have: tuple[str, int] | None = None,
        link: DataLink | None = None,
    ) -> None:
        """To the root: straight on `link` (the calling thread's data DEALER) when it is
        connected, else through the agent's control channel."""
        bus, have_version = have if have is not None else self._holding.have
        agent = self._agent
        if agent is None:
            return
        fields = (stage, gen, version, bus, have_version, tuple(missing), reason[:512])
        session = agent.session
        if link is not None and session and link.send(RELAY.encode(Report(session, *fields))):
            return
        agent.report(lambda session: Report(session, *fields))

    def _set_group(self, group: _RelayGroup | None) -> None:
        self._group = group
        self._holding.gen = group.gen if group is not None else -1

    def _next_item(self, link: DataLink) -> tuple[Prepare | Commit | Send | str, Any] | None:
        """The next thing for the data thread: from the agent (inbox), or a notice on the
        data channel; None after a slice with neither."""
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            pass
        agent = self._agent
        sock = link.ensure(agent.data_endpoint if agent is not None else "")
        if sock is None:
            try:
                return self._inbox.get(timeout=_INBOX_POLL_S)
            except queue.Empty:
                return None
        if not sock.poll(int(_INBOX_POLL_S * 1000)):
            return None
        frame = sock.recv(NOBLOCK)
        try:
            msg = RELAY.decode(frame)
        except ProtocolError as exc:
            self.counters["rejected"] += 1
            log.debug("dropped root data message: %s", exc)
            return None
        if not isinstance(msg, Send):
            self.counters["rejected"] += 1
            return None
        if agent is None or not agent.session or msg.tree != agent.tree:
            self.counters["stale"] += 1
            return None
        return msg, None

    def _data_loop(self) -> None:
        assert self._data_ctx is not None
        link = DataLink(self._data_ctx, data_identity(self.relay_id))
        try:
            self._serve(link)
        finally:
            link.close()

    def _serve(self, link: DataLink) -> None:
        self._data_link = link
        while not self._stopping.is_set():
            got = self._next_item(link)
            if got is None:
                self._prepost()  # once a local worker released a slot, if none was free
                continue
            item, store = got
            try:
                if item == "stop":
                    return
                if item == "lost":
                    self._drop_group("root lost")
                elif isinstance(item, Prepare):  # the root abandoned our group already
                    self._prepared = item.gen
                    self._drop_group("the root forms a new generation")
                    self._report("ready", item.gen)
                elif isinstance(item, Commit):
                    if item.gen == self._prepared:
                        self._join_group(item, store)
                elif isinstance(item, Send):
                    self._receive(item)
            except Exception:
                log.exception("relay %s: data thread failure", self.relay_id)
                self._drop_group("failure")

    def _drop_group(self, why: str) -> None:
        self._posted = None  # its receives fail with the group's sockets, unwaited
        if self._group is not None:
            log.info("relay %s leaves generation %d (%s)", self.relay_id, self._group.gen, why)
            self._set_group(None)
            release()

    def _join_group(self, commit: Commit, store: Any) -> None:
        self._drop_group("new generation")
        try:
            device = check_backend(commit.backend, self._device_arg)
            layout_of(commit.manifest)  # laid out here as on the root, or refused
            payload = payload_bytes(commit.manifest)
            if payload != commit.slot_bytes:
                raise ZmqSyncError("the root's version size differs from this host's layout")
            if self._local is not None and (
                commit.root_bus != self._holding.have[0] or commit.manifest != self._manifest
            ):
                self._restart_local(f"the root bus is now {commit.root_bus}")
            self._manifest = commit.manifest
            pg = new_process_group(
                store,
                f"zmqsync/{self.name}/{commit.tree}/{commit.gen}/",
                commit.rank,
                commit.world,
                backend=commit.backend,
                host=self._host,
                form_timeout=commit.form_timeout,
                op_timeout=commit.timeout,
            )
        except (ZmqSyncError, ValueError, RuntimeError) as exc:
            self._report("failed", commit.gen, reason=f"cannot join: {exc}")
            self.counters["formation_failures"] += 1
            return
        wire = Wire(pg, commit.backend, commit.chunk_bytes, commit.timeout, device)
        self._set_group(
            _RelayGroup(commit.gen, commit.rank, commit.world, commit.root_bus, wire, pg, payload)
        )
        self.counters["generations"] += 1
        self._report("formed", commit.gen)
        log.info(
            "relay %s in generation %d as rank %d of %d",
            self.relay_id,
            commit.gen,
            commit.rank,
            commit.world,
        )

    def _restart_local(self, why: str) -> None:
        self._posted = None
        local, self._local = self._local, None
        self._holding.publisher = None
        if local is not None:
            log.info("relay %s restarts its bus: %s", self.relay_id, why)
            local.close()
        with self._cond:
            self._holding.have = ("", -1)
            self._holding.acked = ("", -1)

    def _receive(self, send: Send) -> None:
        """Receive the version `send` announces, then publish it on this host.

        The bytes usually arrive in receives posted ahead into a free slot (`_prepost`);
        else they are received now, into a free slot or, when local workers hold every
        slot, into a staging buffer that is published (copied) once a slot frees up under
        the local timeout: the transfer never waits for local workers.
        """
        group = self._group
        if group is None or group.gen != send.gen:
            return  # a notice of a generation we left: the root notices the silence
        if send.targets and group.rank not in send.targets:
            return
        if send.root_bus != group.root_bus or send.nbytes != group.slot_bytes:
            self._report("failed", send.gen, send.version, reason="notice does not match the group")
            self._drop_group("bad notice")
            return
        local = self._local
        posted, self._posted = self._posted, None
        handle: Publish | None = None
        try:
            if posted is not None:
                self.counters["preposted"] += 1
            else:
                posted = self._post_into_free_slot(group) or group.wire.post_receive(
                    self._staging(send.nbytes)
                )
            posted.finish(send.gen, send.version, send.nbytes)
            if local is None:
                handle = self._open_local(send, posted.into)
            elif send.version <= local.version:
                pass  # it has this one already: drained
            elif posted.slot is not None:  # the bytes are in the slot already
                handle = local.publish_received(send.version, _written, self._timeout, posted.slot)
            else:
                handle = local.publish_received(send.version, _copier(posted.into), self._timeout)
        except WireError as exc:
            self.counters["receive_failures"] += 1
            self._drop_group(f"receive failed: {exc}")
            self._report("failed", send.gen, send.version, reason=str(exc))
            return
        except RuntimeError as exc:  # posting failed: the group is gone
            self.counters["receive_failures"] += 1
            self._drop_group(f"receive failed: {exc}")
            self._report("failed", send.gen, send.version, reason=str(exc)[:512])
            return
        except (ZmqSyncError, ValueError) as exc:  # the local bus: full, closed, or too slow
            self.counters["local_failures"] += 1
            log.warning(
                "relay %s: version %d not published here: %s", self.relay_id, send.version, exc
            )
            return  # no report: the root's deadline and on_timeout decide
        with self._cond:
            have = self._holding.have
            if handle is not None or send.version > have[1]:
                self._holding.have = (send.root_bus, max(send.version, have[1]))
            self._cond.notify_all()
        self.counters["versions"] += 1
        self._report("received", send.gen, send.version, link=self._data_link)
        if handle is not None:
            self._waits.put((handle, send.root_bus, send.version))
            if self._on_update is not None:
                self._on_update(send.version)
        else:
            with self._cond:
                acked = self._holding.acked
                self._holding.acked = (send.root_bus, max(acked[1], send.version))
            self._report("acked", send.gen, send.version, link=self._data_link)
        self._prepost()

    def _prepost(self) -> None:
        """Post the receives of the next version into a free slot of the local bus.

        A posted gloo receive has no deadline (only waiting for it has one), so it can
        wait for the root's next send as long as the group lives; the root sends without
        waiting for our notice to arrive. Nothing is posted while local workers hold every
        slot (the next notice then receives into a staging buffer), before the local bus
        exists, or with NCCL.
        """
        group = self._group
        if self._posted is not None or group is None or group.wire.device is not None:
            return
        try:
            self._posted = self._post_into_free_slot(group)
        except RuntimeError as exc:  # the group is gone: the root re-forms it
            log.debug("relay %s: cannot post ahead: %s", self.relay_id, exc)

    def _post_into_free_slot(self, group: _RelayGroup) -> Posted | None:
        """Receives posted into a free slot of the local bus; None without bus or slot."""
        local = self._local
        slot = local.reserve_slot() if local is not None else None
        if local is None or slot is None:
            return None
        return group.wire.post_receive(local.open_slot(slot)[: group.slot_bytes], slot)

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A reusable receive buffer (kept: needing one once means needing it again)."""
        if self._stage is None or self._stage.numel() != nbytes:
            self._stage = torch.empty(nbytes, dtype=torch.uint8)
        return self._stage

    def _open_local(self, send: Send, staging: torch.Tensor) -> Publish | None:
        """The first version (received into `staging`): open the bus with it, publish it
        under its number."""
        bus = _LocalBus(
            self._manifest,
            staging,
            self._address_arg,
            name=self.name,
            slots=self._slots,
            timeout=self._timeout,
            on_timeout=self._on_timeout,
            heartbeat=self._heartbeat,
            shm_dir=self._shm_dir,
            security=self._security,
        )
        try:
            bus.start()  # version 0 of the local bus holds these bytes...
            handle = None
            if send.version > 0:  # ...and they go out at once under the root's number
                handle = bus.publish_received(send.version, _copier(staging), self._timeout)
        except BaseException:
            bus.close()
            raise
        self._local = bus
        self._holding.publisher = bus.publisher
        self.address = bus.address
        log.info("relay %s opened bus %r at %s", self.relay_id, self.name, bus.address)
        return handle

    # --- wait thread ---------------------------------------------------------------

    def _wait_loop(self) -> None:
        """Report "acked" once the local workers acked (or the local deadline passed)."""
        assert self._data_ctx is not None
        link = DataLink(self._data_ctx, None)
        try:
            self._report_acks(link)
        finally:
            link.close()

    def _sweep(self) -> None:
        """Remove the segments nobody maps from this host's shm dir (see the module doc)."""
        try:
            collect_garbage(_config.shm_dir(self._shm_dir))
        except OSError as exc:
            log.warning("relay %s: could not sweep the shm dir: %s", self.relay_id, exc)

    def _report_acks(self, link: DataLink) -> None:
        sweep_at = time.monotonic() + _SWEEP_S
        while True:
            if time.monotonic() >= sweep_at:
                self._sweep()
                sweep_at = time.monotonic() + _SWEEP_S
            try:
                item = self._waits.get(timeout=max(0.0, sweep_at - time.monotonic()))
            except queue.Empty:
                continue
            if item is None:
                return
            handle, bus, version = item
            try:
                handle.wait()
                missing = handle.missing
            except PublishTimeout as exc:
                missing = exc.missing
            except ZmqSyncError:  # the local bus closed
                continue
            with self._cond:
                acked = self._holding.acked
                if self._holding.have[0] == bus:
                    self._holding.acked = (bus, max(acked[1], version))
            group = self._group
            agent = self._agent
            link.ensure(agent.data_endpoint if agent is not None else "")
            self._report(
                "acked",
                group.gen if group else 0,
                version,
                missing=missing,
                have=(bus, self.version),
                link=link,
            )
