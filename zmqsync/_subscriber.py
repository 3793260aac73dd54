"""The worker side: `Subscriber`.

The link to the publisher is the ZeroMQ Guide's Clone client:

1. HELLO -> WELCOME over a fresh REQ socket per attempt (Lazy Pirate): endpoints,
   manifest, buffer, current version and the seq of the last event sent.
2. Connect SUB to the events endpoint and wait for the publisher's XPUB welcome frame:
   from then on no event can be missed. Map the buffer read-only.
3. ``last_seq = WELCOME.seq``; apply the current version (or a newer one the header
   already announces: it may have gone out before the subscription was live); ACK.
4. In the loop drop events with ``seq <= last_seq``; a gap (a heartbeat announcing a
   newer seq) is repaired from the header, which always names the latest version. Any
   message resets the liveness deadline; silence or STOP makes the link LOST, and the
   agent re-handshakes by itself when a publisher answers again (a new ``bus`` id means
   new buffers).

Three objects, one concern each:

- `Link` (``_link.py``): the rules of steps 1, 3 and 4 and the link's state, without
  I/O. It takes decoded messages and the time and says what to do.
- `Agent` (``_subscriber_agent.py``): the thread that owns the sockets. It decodes each
  frame, hands the message to the Link and carries out the answer: apply through its
  `Port`, send on ``acks``.
- `Subscriber`: what the worker uses; it owns the mapped buffers and the model, and
  applies versions. It gives the agent a `Port` (weak calls, see there) and never
  touches the sockets. In ``apply="manual"`` mode the agent only records the newest
  version; the user's thread applies it inside `poll()` and asks the agent to ACK.

Transport (see ``_buffers/transport.py`` and docs/cuda.md): the HELLO says which transport the
worker asks for; after WELCOME `choose_transport` decides with what the bus offers,
and a worker that cannot map a CUDA buffer after all (GPU not visible, other PID
namespace, handle refused) sends a second HELLO saying it reads the CPU copy, and why,
before it applies anything. A CUDA handle is opened only while adopting a WELCOME.
Whatever reads GPU memory is synchronized before the seqlock check and before an ACK.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from . import _config
from ._apply import Target, slot_views
from ._buffers import CpuAttachment, CudaAttachment
from ._buffers import cuda as _cuda
from ._buffers.header import FIRST_SLOT_WORD, HEADER_BYTES
from ._buffers.transport import (
    Decision,
    Facts,
    choose_transport,
    initial_transport,
    ipc_disabled,
    local_index,
    pid_namespace,
    registered,
)
from ._config import DEFAULT
from ._deadline import Deadline
from ._errors import ClosedError, ProtocolError, ZmqSyncError
from ._fast_frames import receive_pattern, template_pieces
from ._follow import FOLLOWER, GATE, libzmq_path, zmq_error
from ._histogram import APPLY, record
from ._layout import Key, Layout, flatten
from ._lifecycle import Lifecycle, State
from ._link import Link, Offer
from ._protocol import Ack, Hello, Welcome
from ._reference_follower import ReferenceFollower, can_take
from ._security import Security, found_keys
from ._subscriber_agent import Agent, Port, Waiters
from ._text import printable
from ._weakly import weakly, weakly_1
from ._worker_state import WorkerState

__all__ = ["Reading", "Subscriber"]

log = logging.getLogger(__name__)
DEFAULT_SECURITY = Security()
# Said once by a worker whose handshake is not answered at first (the CLI's worker shows
# this line at its default level): bus name, address, how long it waits.
WAITING = "waiting for bus %r at %s %s"
_APPLY_ATTEMPTS = 100


@dataclass
class Reading:
    """What `Subscriber.reading()` yields: the version read and, afterwards, `torn`."""

    version: int
    torn: bool = False


class Subscriber(Lifecycle):
    """Receives versions of a model's weights from a `Publisher` on this host.

    Args:
        address: control address; None: the default address for `name`.
        model: nn.Module or TensorDict to keep updated; None: use `weights`.
        name: bus name (for the default address).
        mode: "copy" (the model keeps its tensors) or "alias" (zero-copy views).
        apply: "background" (a thread applies on arrival) or "manual" (`poll()`).
        worker_id: default "<hostname>-<pid>-<random>" (unique; see docs/guide.md).
        device: where tensors live when `model` is None (copy mode).
        timeout: handshake deadline (s); also the default for waits.
        on_update: callable(version) run after each apply, before the ack.
        shm_dir: where the publisher's segments are (default $ZMQSYNC_SHM_DIR or /dev/shm).
        security: whom this worker trusts (`Security`; a worker uses two of its options).
            ``curve=CurveClient(...)``: this worker's CURVE keys and the publisher's
            public key, for a publisher that requires CURVE (see docs/security.md);
            left out: $ZMQSYNC_CURVE_CLIENT, or the keys a ``curve=True`` publisher of
            `name` left in the runtime dir, read again at each handshake (a restarted
            publisher has new ones). ``publisher_uid=``: the uid the publisher's segments
            must belong to; left out: the owner of an ipc:// control socket, else this
            process's uid. Set it for a tcp:// bus whose publisher runs as another uid of
            a shared group (see ``group=``): a segment another user owns could be
            truncated under the mapping (SIGBUS).
        flat: copy mode: the model's CPU tensors move into one block laid out as a slot
            (Parameters stay the same objects): a version is one copy (see `_flat`).
    """

    def __init__(
        self,
        address: str | None = None,
        model: Any = None,
        *,
        name: str = "weights",
        mode: str = "copy",
        apply: str = "background",
        worker_id: str | None = None,
        device: str | None = None,
        timeout: float | None = 10.0,
        on_update: Callable[[int], None] | None = None,
        shm_dir: str | None = None,
        security: Security = DEFAULT_SECURITY,
        flat: bool = False,
    ) -> None:
        if not isinstance(security, Security):
            raise TypeError(f"security= takes a zmqsync.Security, not {security!r}")
        curve = security.worker_side("a Subscriber")
        if mode not in ("copy", "alias"):
            raise ValueError(f'mode must be "copy" or "alias", not {mode!r}')
        if apply not in ("background", "manual"):
            raise ValueError(f'apply must be "background" or "manual", not {apply!r}')
        self.name = _config.check_name(name)
        self._address_arg = address
        self.address = ""
        self.model = model
        self.mode = mode
        self.flat = flat
        self.apply = apply
        self.worker_id = worker_id or _config.default_worker_id()
        self._device = device
        self._timeout = timeout
        self._on_update = on_update
        self._shm_dir = _config.shm_dir(shm_dir)
        self._publisher_uid = security.publisher_uid
        self._pid = os.getpid()
        self._secure = curve.apply if curve is not None else found_keys(self.name)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiters = Waiters(self._cond, GATE() if GATE is not None else None)
        self._apply_lock = threading.Lock()
        self._failure: BaseException | None = None
        self._bus_id = ""  # of the buffers mapped now
        # version, held (slot, seqlock counter aliased now), the Link's last_seq and
        # last_heard, applied/native: written by both followers (see `_worker_state`)
        self._worker = WorkerState()
        self._version_bus_id = ""
        self._pending: Offer | None = None
        self._target: Target | None = None
        self._attachment: CpuAttachment | None = None
        self._gpus: list[CudaAttachment] = []
        self._views: list[dict[Key, torch.Tensor]] = []
        self._manifest_keys: tuple[Key, ...] = ()  # in manifest order (RECEIVE.changed)
        self._changed_keys: dict[bytes, frozenset[Key]] = {}
        self._sync_devices: tuple[torch.device, ...] = ()  # GPUs the apply reads or writes
        self._transport = Decision("", "")
        self._agent: Agent | None = None
        # the Link's counts (applied and native are the state's, see `counters`)
        self._counts: dict[str, int] = {"rejected": 0, "foreign": 0, "gaps": 0}
        # Driven by the agent thread only (from start()); this thread reads its state. The
        # nonce, drawn once, proves to the publisher that every HELLO of this Subscriber
        # comes from the same process (see `Registry.claim`); the tap never shows it.
        self._link = Link(
            self.worker_id, mode, self._counts, nonce=secrets.token_hex(16), shared=self._worker
        )

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> Subscriber:
        """Handshake, apply the current version, then ack. Returns self.

        Raises:
            ConnectTimeout: no publisher answered within `timeout`.
            LayoutMismatch: `model` does not match what the bus carries.
            ProtocolError: the publisher's answer is not valid (or it refused us).
            BufferUnavailable: its segment cannot be mapped here (shm dir differs).
        """
        if not self._starting():
            return self
        self.address = self._address_arg or _config.default_address(self.name)
        self._agent = Agent(self._link, self._port(), f"zmqsync-sub-{self.name}")
        try:
            self._agent.start(Deadline(self._timeout), self._say_waiting)
        except BaseException:  # nothing stays open, and the object is done with
            self._closing()
            self._release()
            raise
        self._started()
        log.info(
            "subscriber %s joined %s at version %d (%s/%s)",
            self.worker_id,
            self.address,
            self._worker.version,
            self.mode,
            self.apply,
        )
        return self

    def _say_waiting(self) -> None:
        """No publisher answered yet: say so once, rather than nothing until the timeout."""
        limit = "with no limit" if self._timeout is None else f"up to {self._timeout:g} s"
        log.info(WAITING, self.name, self.address, limit)

    def close(self) -> None:
        """Send BYE, release the slot, unmap. Idempotent; the model keeps its weights."""
        if self._closing():  # never started, closed already, or a forked child's: nothing
            self._release()

    def _release(self) -> None:
        if self._agent is not None:
            self._agent.stop()
        if self._attachment is not None:
            self._attachment.close()
        for gpu in self._gpus:
            gpu.close()
        self._notify()

    def _title(self) -> str:
        return f"Subscriber {self.name!r}"

    def __enter__(self) -> Subscriber:
        return self.start()

    def __repr__(self) -> str:
        if self.closed:
            link = "closed"
        else:
            link = "connected" if self.connected else self._link.state.name.lower()
        return f"<Subscriber {self.name!r} v{self._worker.version} {self.mode}/{self.apply} {link}>"

    # --- what the worker uses ------------------------------------------------------

    @property
    def version(self) -> int:
        """The version the model now computes with (-1 before start)."""
        return self._worker.version

    @property
    def lag(self) -> int:
        """Versions written after the one applied (the header names the newest one)."""
        mine = self._worker.version if self._version_bus_id == self._bus_id else -1
        return max(0, latest[0] - mine) if (latest := self._latest()) else 0

    @property
    def counters(self) -> dict[str, int]:
        """A new dict of what this worker counted: ``applied`` (versions applied), ``native``
        (by the native follower), ``rejected``, ``foreign``, ``gaps`` (the Link's) and
        ``apply_us_*`` (how long the others took, see `_histogram`)."""
        state = self._worker
        return {"applied": state.applied, "native": state.native, **self._counts}

    @property
    def bus_id(self) -> str:
        """The bus the current version came from ("" before the first). A restarted
        publisher is a new bus whose versions start over: (bus_id, version) names one."""
        return self._version_bus_id

    @property
    def connected(self) -> bool:
        """False while the publisher is unreachable (the last version stays in use)."""
        return not self.closed and self._link.connected and not self._bus_closed()

    @property
    def transport(self) -> str:
        """How this worker reads the weights: "cuda" (CUDA IPC) or "cpu" (the CPU segment)."""
        return self._transport.transport

    @property
    def transport_note(self) -> str:
        """Why it reads the CPU copy of CUDA weights (or why the bus is CPU-only), or ""."""
        return self._transport.reason

    @property
    def stopped(self) -> bool:
        """True after the publisher closed the bus (until a new publisher answers), and
        for good once it refused this worker (see `refusal`).

        Read from the segment's header too, where the publisher marks the bus closed
        before its STOP: a worker whose thread is busy in `on_update` is told at once.
        """
        return self._link.stopped or self._bus_closed()

    @property
    def refusal(self) -> str:
        """Why the publisher refused this worker for good, or "" (it has not).

        A worker paused (or starved of CPU) for longer than the publisher waits for a
        silent one loses its worker id, and another process may take it (a supervisor
        that restarted "the same" worker, or a second process with the same fixed id).
        When this one comes back, the publisher says so (``taken: worker id ... belongs
        to another process now ...``): from then on this Subscriber is `stopped`, keeps
        its last version, and its waits raise ProtocolError with that reason.
        """
        return self._link.refusal

    @property
    def weights(self) -> Any:
        """TensorDict of the current weights (the model's own tensors, or views)."""
        if self._target is None:
            raise ClosedError(f"Subscriber {self.name!r} is not started")
        return self._target.weights()

    @property
    def tensors(self) -> Mapping[Key, torch.Tensor]:
        """The same tensors as `weights`, as a read-only ``{key tuple: tensor}`` mapping.

        What `on_update` callbacks and relays read per version: building the TensorDict
        of `weights` costs microseconds per tensor, and a first one imports tensordict.
        """
        if self._target is None:
            raise ClosedError(f"Subscriber {self.name!r} is not started")
        return types.MappingProxyType(self._target.tensors)

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Manual mode: apply the newest pending version. True if one was applied.

        Args:
            timeout: how long to wait for a version to arrive (0: do not wait).

        Raises:
            ProtocolError: the publisher refused this worker for good (see `refusal`).
        """
        self._check_usable()
        if self.apply != "manual":
            return False
        deadline = Deadline(timeout)
        with self._cond:
            while self._pending is None:
                if deadline.expired() or self.closed:
                    return False
                self._cond.wait(deadline.wait_s(0.5))
                self._check_usable()
            offer, self._pending = self._pending, None
        applied = self._apply_offer(offer)
        if applied is not None and self._agent is not None:
            self._agent.ack_from_user(applied, offer.bus)
        if applied is not None:
            self._waiters.wake(applied)
        return applied is not None

    def wait_for_version(self, version: int, timeout: float | None = DEFAULT) -> bool:
        """Block until `version` (or newer) is applied; False if the deadline passed.

        In manual mode this applies pending versions itself (it is a safe point).

        Raises:
            ProtocolError: the publisher refused this worker for good (see `refusal`):
                no version will come.
        """
        if self._worker.version >= version:  # first: a thread that waits for each next version
            return True  # comes here once per version, with cold caches
        seconds = self._timeout if timeout is DEFAULT else timeout
        gate = self._waiters.gate if self.apply == "background" else None
        if gate is not None and (seconds is None or seconds >= 0):
            # One wait per version, and nothing else: the gate opens once the version is
            # acked; a kick (closed, stopped, lost) ends it early, and the loop below
            # looks at why with the time left.
            start = time.monotonic()
            self._check_usable()
            if gate.wait(version, seconds) and self._worker.version >= version:
                return True
            if seconds is not None:
                seconds = max(0.0, seconds - (time.monotonic() - start))
        deadline = Deadline(seconds)
        while self._worker.version < version:
            self._check_usable()
            if deadline.expired():
                return False
            if gate is not None:
                gate.wait(version, deadline.remaining())
            elif self.apply == "manual":
                self.poll(deadline.wait_s(0.5))
            else:
                with self._cond:
                    if self._worker.version < version:
                        self._waiters.add(version)
                        try:
                            self._cond.wait(deadline.wait_s(0.5))
                        finally:
                            self._waiters.remove(version)
        return True

    def wait_for_stop(self, timeout: float | None = DEFAULT) -> bool:
        """Block until the publisher closes the bus; False if the deadline passed first."""
        deadline = Deadline(self._timeout if timeout is DEFAULT else timeout)
        with self._cond:
            while not self.stopped:
                self._check_usable()
                if deadline.expired():
                    return False
                self._cond.wait(deadline.wait_s(0.5))
        return True

    @contextlib.contextmanager
    def reading(self) -> Iterator[Reading]:
        """Check that aliased weights were not rewritten while the block read them.

        Only needed in alias mode with slots=1 (or after this worker was evicted): then
        the publisher may rewrite the slot this worker computes with, and ``torn`` tells
        that the block's results must be discarded. Copy mode is never torn.
        """
        with self._lock:
            held, version, attachment = self._worker.held, self._worker.version, self._attachment
            devices = self._sync_devices
        reading = Reading(version)
        try:
            yield reading
        finally:
            if self.mode == "alias" and held is not None and attachment is not None:
                _synchronize(devices)  # the block's GPU work has read the weights by now
                reading.torn = not attachment.header.read_valid(*held)

    # --- internals -----------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ZmqSyncError(f"subscriber agent failed: {self._failure!r}") from self._failure
        if refusal := self._link.refusal:
            raise ProtocolError(
                f"worker {self.worker_id!r} was refused by the publisher at {self.address}: "
                f"{printable(refusal)}"
            )
        if self._state is not State.STARTED:
            state = "closed" if self.closed else "not started"
            raise ClosedError(f"Subscriber {self.name!r} is {state}")

    # --- what the agent may ask (see Port) ---

    def _port(self) -> Port:
        return Port(
            address=self.address,
            secure=self._secure,
            timeout=self._timeout,
            transport=weakly(self, Subscriber._initial_transport),
            adopt=weakly(self, Subscriber._adopt),
            latest=weakly(self, Subscriber._latest),
            join=weakly(self, Subscriber._join),
            # background: straight to the apply (it drops a stale offer itself)
            offer=weakly_1(
                self, Subscriber._apply_offer if self.apply == "background" else Subscriber._offer
            ),
            version=weakly(self, Subscriber._current_version),
            fail=weakly(self, Subscriber._fail),
            notify=weakly(self, Subscriber._notify),
            waiters=self._waiters,
            follow=weakly(self, Subscriber._follower)
            if self.apply == "background" and self._on_update is None
            else None,
        )

    def _bus_closed(self) -> bool:
        """Whether the publisher of the segment mapped now marked the bus closed."""
        attachment = self._attachment
        if self.closed or attachment is None:
            return False
        try:
            return attachment.header.closed()
        except ValueError:  # replaced and unmapped meanwhile (a re-join): not closed
            return False

    def _latest(self) -> tuple[int, int] | None:
        attachment = self._attachment
        return attachment.header.latest() if attachment is not None else None

    def _current_version(self) -> int:
        return self._worker.version

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()
        self._waiters.kick()

    def _join(self, offer: Offer) -> int | None:
        """After a WELCOME: the version to ACK, if any. The first join applies `offer`
        whatever the apply mode (start() returns computing with it); a re-join offers it
        like any version, and one that finds its bus's version applied ACKs it again."""
        first = not self._version_bus_id
        applied = self._apply_offer(offer) if first else self._offer(offer)
        if applied is None and self._version_bus_id == offer.bus:
            applied = self._worker.version  # re-joined the same bus: already computing with it
        return applied

    def _offer(self, offer: Offer) -> int | None:
        """A version arrived (agent thread). Background: apply it now. Manual: keep it."""
        if offer.bus == self._version_bus_id and offer.version <= self._worker.version:
            return None
        if self.apply == "background":
            return self._apply_offer(offer)
        with self._cond:
            self._pending = offer
            self._cond.notify_all()
        return None

    def _apply_offer(self, offer: Offer) -> int | None:
        """Apply `offer` or a newer version; the version applied, or None (stale).

        Mirrored in C by Follower.next (``_follower.c``) and in `ReferenceFollower`, for
        the versions they take: the same writes to the `WorkerState`, under this lock."""
        with self._apply_lock:
            started = time.perf_counter()  # the ``apply`` histogram of `counters`
            attachment, views, target = self._attachment, self._views, self._target
            if attachment is None or target is None or offer.bus != self._bus_id:
                return None  # re-handshaken since: a newer offer follows
            header, version, slot = attachment.header, offer.version, offer.slot
            for _ in range(_APPLY_ATTEMPTS):
                if offer.bus == self._version_bus_id and version <= self._worker.version:
                    return None
                counter = header.read_begin(slot, version)
                if counter is None:  # the slot moved on: take the newest version
                    latest = header.latest()
                    if latest is None or (latest[0], latest[1]) == (version, slot):
                        return None
                    version, slot = latest
                    continue
                if self.mode == "copy":
                    # the version right after ours, as RECEIVE described it: only what changed
                    keys = (
                        self._changed(offer.changed)
                        if offer.changed
                        and version == offer.version
                        and version == self._worker.version + 1
                        and offer.bus == self._version_bus_id
                        else None
                    )
                    target.copy_from(views[slot], keys)
                    if self._sync_devices:  # GPU copies have read the slot
                        _synchronize(self._sync_devices)
                    if not header.read_valid(slot, counter):
                        continue
                else:
                    target.alias_to(views, slot)
                    if self._sync_devices:  # no queued work reads the old slot
                        _synchronize(self._sync_devices)
                with self._lock:  # waiters are woken once the ACK is out (see Waiters)
                    if offer.bus != self._version_bus_id and self._waiters.gate is not None:
                        self._waiters.gate.open(version)  # a new bus: its numbers start over
                    self._worker.held = (slot, counter) if self.mode == "alias" else None
                    self._worker.version, self._version_bus_id = version, offer.bus
                    self._worker.applied += 1
                    record(self._counts, APPLY, time.perf_counter() - started)
                if self._on_update is not None:
                    self._on_update(version)
                return version
        raise ZmqSyncError(f"could not read a whole version after {_APPLY_ATTEMPTS} attempts")

    def _follower(self, events: zmq.Socket[bytes], acks: zmq.Socket[bytes]) -> Any:
        """A follower for the versions on these sockets (agent thread): the native one
        where the extension is built, else its twin (`ReferenceFollower`); None where
        `can_take` says neither may take them now."""
        link = self._link
        with self._apply_lock:
            target, attachment = self._target, self._attachment
            switch = target.switch if target is not None else None
            copying = self.mode == "copy" and target is not None
            if (
                (switch is None and not copying)
                or target is None
                or attachment is None
                or not can_take(
                    switch,
                    copying=copying,
                    mapped=True,
                    syncs_devices=bool(self._sync_devices),
                    bus_id=self._bus_id,
                    applied_bus=self._version_bus_id,
                    link_bus=link.bus_id,
                    session=link.session,
                )
            ):
                return None
            ack_head, ack_tail = template_pieces(
                Ack, bus=self._bus_id, worker_id=link.worker_id, session=link.session
            )
            gate = self._waiters.gate
            copy = target.copier(self._views) if copying else None
            if FOLLOWER is None or gate is None:
                return ReferenceFollower(
                    events=events,
                    acks=acks,
                    bus=self._bus_id,
                    ack_head=ack_head,
                    ack_tail=ack_tail,
                    header=attachment.header,
                    slots=len(self._views),
                    switch=switch,
                    state=self._worker,
                    lock=self._lock,
                    opened=self._waiters.wake,
                    copy=copy,
                )
            pieces, ranges = receive_pattern(self._bus_id, partial=not copying)
            return FOLLOWER(
                libzmq=libzmq_path(),
                events=events,
                acks=acks,
                pieces=pieces,
                ranges=ranges,
                ack_head=ack_head,
                ack_tail=ack_tail,
                header=attachment.header_address(),
                header_words=HEADER_BYTES // 8,
                first_slot_word=FIRST_SLOT_WORD,
                slots=len(self._views),
                switch=switch,
                state=self._worker,
                lock=self._lock,
                gate=gate,
                error=zmq_error,
                copy=copy,
            )

    def _changed(self, bits: bytes) -> frozenset[Key]:
        """RECEIVE's bitmap as tensor keys (bit i: manifest entry i), decoded once."""
        keys = self._changed_keys.get(bits)
        if keys is None:
            mask, order = int.from_bytes(bits, "little"), self._manifest_keys
            keys = frozenset(order[i] for i in range(len(order)) if mask >> i & 1)
            if len(self._changed_keys) > 64:
                self._changed_keys.clear()
            self._changed_keys[bits] = keys
        return keys

    def _prefers(self) -> str:
        """Where this worker computes: "cuda", "cpu", or "any" (no model, no device)."""
        if self.model is not None:
            return "cuda" if any(t.is_cuda for t in flatten(self.model).values()) else "cpu"
        if self._device is not None:
            return "cuda" if torch.device(self._device).type == "cuda" else "cpu"
        return "any"

    def _facts(self) -> Facts:
        return Facts(
            prefers=self._prefers(),
            cuda_available=_cuda.cuda_available(),
            ipc_disabled=ipc_disabled(os.environ),
        )

    def _initial_transport(self) -> Decision:
        facts = self._facts()
        return initial_transport(facts.prefers, facts.cuda_available, facts.ipc_disabled)

    def _choose(self, welcome: Welcome) -> tuple[Decision, dict[int, CudaAttachment]]:
        """Decide the transport for this bus; open its CUDA handles if it is "cuda"."""
        gpus = [(i, b) for i, b in enumerate(welcome.buffers) if b.kind == "cuda"]
        facts = dataclasses.replace(self._facts(), publisher_cuda=bool(gpus))
        wanted = initial_transport(facts.prefers, facts.cuda_available, facts.ipc_disabled)
        if not gpus or wanted.transport == "cpu":
            return choose_transport(facts), {}
        visible, pid_ns = _cuda.visible_uuids(), pid_namespace()
        mapped = {gpu.handle: gpu for gpu in self._gpus}  # same bus again: no new open
        opened: dict[int, CudaAttachment] = {}
        for index, info in gpus:
            local = local_index(info.device_uuid, visible)
            facts = dataclasses.replace(
                facts,
                has_handle=bool(info.handle),
                ipc_note=info.ipc_note,
                device_uuid=info.device_uuid,
                local_index=local,
                pid_ns=pid_ns,
                publisher_pid_ns=info.pid_ns,
            )
            decision = choose_transport(facts)
            if decision.transport == "cuda":
                try:
                    opened[index] = mapped.get(info.handle) or CudaAttachment.attach(
                        info,
                        slots=welcome.slots,
                        slot_bytes=welcome.slot_bytes,
                        device_index=local,
                    )
                except _cuda.IpcOpenFailed as exc:
                    decision = choose_transport(dataclasses.replace(facts, open_error=str(exc)))
            if decision.transport != "cuda":
                self._close_unused(opened.values())
                return decision, {}
        return decision, opened

    def _close_unused(self, gpus: Iterable[CudaAttachment]) -> None:
        """Close attachments that are not the ones in use (those stay mapped)."""
        for gpu in gpus:
            if all(gpu is not used for used in self._gpus):
                gpu.close()

    def _adopt(
        self, welcome: Welcome, hello: Hello, forced: Decision | None = None
    ) -> Decision | None:
        """Map the buffers a WELCOME names and bind the model to its layout.

        Returns None once adopted, or, without adopting anything, the transport to
        register in a second HELLO when the one `hello` registered cannot be used here
        (a CUDA handle that cannot be opened: read the CPU copy instead). `forced` is
        that decision, for the WELCOME that answers the second HELLO.
        """
        info = welcome.buffers[0]
        if info.kind != "cpu":
            raise ProtocolError(f"buffer kind {info.kind} is not supported by this subscriber")
        if any(b.kind != "cuda" for b in welcome.buffers[1:]):
            raise ProtocolError("only the first buffer may be a cpu segment")
        attachment = CpuAttachment.attach(
            info,
            slots=welcome.slots,
            slot_bytes=welcome.slot_bytes,
            shm_dir=self._shm_dir,
            owner=self._publisher_uid,
            control=self.address,
        )
        gpus: dict[int, CudaAttachment] = {}
        try:
            layout = Layout(welcome.manifest, welcome.slot_bytes)
            decision, gpus = (forced, {}) if forced is not None else self._choose(welcome)
            expected = registered(hello.transport, hello.transport_note, len(welcome.buffers) > 1)
            if forced is None and decision != expected:
                attachment.close()
                return decision
            views = [slot_views(layout, attachment, gpus, i) for i in range(welcome.slots)]
            target = self._target
            if target is None or welcome.bus != self._bus_id:
                where = {key: view.device for key, view in views[0].items()}
                target = Target(self.model, layout, self.mode, self._device, where, flat=self.flat)
        except BaseException:
            attachment.close()
            self._close_unused(gpus.values())
            raise
        devices = {t.device for t in (*views[0].values(), *target.tensors.values()) if t.is_cuda}
        with self._apply_lock:
            target.forget_views()
            old, self._attachment = self._attachment, attachment
            old_gpus, self._gpus = self._gpus, list(gpus.values())
            self._views, self._target, self._bus_id = views, target, welcome.bus
            self._manifest_keys = tuple(spec.key for spec in welcome.manifest)
            self._changed_keys.clear()
            self._sync_devices = tuple(sorted(devices, key=str))
            self._transport = decision
        if old is not None:
            old.close()
        for gpu in old_gpus:
            if all(gpu is not kept for kept in gpus.values()):
                gpu.close()
        if decision.reason:
            level = logging.WARNING if forced is not None else logging.INFO
            log.log(
                level, "subscriber %s reads the CPU buffer: %s", self.worker_id, decision.reason
            )
        return None


def _synchronize(devices: tuple[torch.device, ...]) -> None:
    for device in devices:
        torch.cuda.synchronize(device)
