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
- `Reader` (``_read_modes.py``, built from ``reads=Copies(...)`` or ``Aliases(...)``):
  how this worker applies a version. It owns the mapped buffers, the model's `Target`
  and the follower. The agent reaches it through a `Port` (weak, see there).
- `Subscriber`: what the worker uses, over the three; it never touches the sockets and
  applies nothing itself. With ``manual=True`` the agent only records the newest
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
import logging
import os
import secrets
import threading
import time
import types
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import _config
from ._config import DEFAULT
from ._deadline import Deadline
from ._errors import ClosedError, ProtocolError, ZmqSyncError
from ._follow import GATE
from ._layout import Key
from ._lifecycle import Lifecycle, State
from ._link import Link
from ._read_modes import Reader, Where, build
from ._reads import Copies, Reads
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
        reads: how versions are applied: ``Copies()`` (the default: into the model's own
            tensors; ``device=``, ``flat=``) or ``Aliases()`` (zero-copy views of the
            slot); each takes ``manual=True`` (apply in `poll()`, at a point the user's
            thread chooses) and ``on_update=callable(version)`` (run after each apply,
            before the ack). See `Copies` and `Aliases`.
        worker_id: default "<hostname>-<pid>-<random>" (unique; see docs/guide.md).
        timeout: handshake deadline (s); also the default for waits.
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
        shm_dir: where the publisher's segments are (default $ZMQSYNC_SHM_DIR or /dev/shm).
    """

    def __init__(
        self,
        address: str | None = None,
        model: Any = None,
        *,
        name: str = "weights",
        reads: Reads = Copies(),
        worker_id: str | None = None,
        timeout: float | None = 10.0,
        security: Security = DEFAULT_SECURITY,
        shm_dir: str | None = None,
    ) -> None:
        if not isinstance(security, Security):
            raise TypeError(f"security= takes a zmqsync.Security, not {security!r}")
        curve = security.worker_side("a Subscriber")
        self.name = _config.check_name(name)
        self._address_arg = address
        self.address = ""
        self.model = model
        self.worker_id = worker_id or _config.default_worker_id()
        self._timeout = timeout
        self._pid = os.getpid()
        self._secure = curve.apply if curve is not None else found_keys(self.name)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiters = Waiters(self._cond, GATE() if GATE is not None else None)
        self._failure: BaseException | None = None
        # version, its bus, held (slot, seqlock counter aliased now), the Link's last_seq
        # and last_heard, applied/native: written by both followers (see `_worker_state`)
        self._worker = WorkerState()
        # the Link's counts (applied and native are the state's, see `counters`)
        self._counts: dict[str, int] = {"rejected": 0, "foreign": 0, "gaps": 0}
        where = Where(
            shm_dir=_config.shm_dir(shm_dir),
            owner=security.publisher_uid,
            worker_id=self.worker_id,
            state=self._worker,
            lock=self._lock,
            cond=self._cond,
            waiters=self._waiters,
            counts=self._counts,
        )
        self._reader: Reader = build(reads, model, where)  # checks `reads`
        self.reads = reads
        self._agent: Agent | None = None
        # Driven by the agent thread only (from start()); this thread reads its state. The
        # nonce, drawn once, proves to the publisher that every HELLO of this Subscriber
        # comes from the same process (see `Registry.claim`); the tap never shows it.
        self._link = Link(
            self.worker_id,
            self._reader.mode,
            self._counts,
            nonce=secrets.token_hex(16),
            shared=self._worker,
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
        self._reader.address = self.address
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
            self._reader.mode,
            "manual" if self._reader.manual else "background",
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
        self._reader.close()
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
        how = f"{self._reader.mode}{'/manual' if self._reader.manual else ''}"
        return f"<Subscriber {self.name!r} v{self._worker.version} {how} {link}>"

    # --- what the worker uses ------------------------------------------------------

    @property
    def version(self) -> int:
        """The version the model now computes with (-1 before start)."""
        return self._worker.version

    @property
    def lag(self) -> int:
        """Versions written after the one applied (the header names the newest one)."""
        state = self._worker
        mine = state.version if state.bus == self._reader.bus_id else -1
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
        return self._worker.bus

    @property
    def connected(self) -> bool:
        """False while the publisher is unreachable (the last version stays in use)."""
        return not self.closed and self._link.connected and not self._bus_closed()

    @property
    def transport(self) -> str:
        """How this worker reads the weights: "cuda" (CUDA IPC) or "cpu" (the CPU segment)."""
        return self._reader.transport.transport

    @property
    def transport_note(self) -> str:
        """Why it reads the CPU copy of CUDA weights (or why the bus is CPU-only), or ""."""
        return self._reader.transport.reason

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
        target = self._reader.target
        if target is None:
            raise ClosedError(f"Subscriber {self.name!r} is not started")
        return target.weights()

    @property
    def tensors(self) -> Mapping[Key, torch.Tensor]:
        """The same tensors as `weights`, as a read-only ``{key tuple: tensor}`` mapping.

        What `on_update` callbacks and relays read per version: building the TensorDict
        of `weights` costs microseconds per tensor, and a first one imports tensordict.
        """
        target = self._reader.target
        if target is None:
            raise ClosedError(f"Subscriber {self.name!r} is not started")
        return types.MappingProxyType(target.tensors)

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Manual mode: apply the newest pending version. True if one was applied.

        Args:
            timeout: how long to wait for a version to arrive (0: do not wait).

        Raises:
            ProtocolError: the publisher refused this worker for good (see `refusal`).
        """
        self._check_usable()
        reader = self._reader
        if not reader.manual:
            return False
        deadline = Deadline(timeout)
        while (offer := reader.take_pending(deadline.wait_s(0.5))) is None:
            if deadline.expired() or self.closed:
                return False
            self._check_usable()
        applied = reader.apply(offer)
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
        manual = self._reader.manual
        gate = None if manual else self._waiters.gate
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
            elif manual:
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
        reader = self._reader
        with self._lock:
            held, version, attachment = self._worker.held, self._worker.version, reader.attachment
        reading = Reading(version)
        try:
            yield reading
        finally:
            reading.torn = reader.torn(held, attachment)

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
        reader = self._reader
        # background: straight to the apply (it drops a stale offer itself)
        offer = weakly_1(reader, type(reader).offer if reader.manual else type(reader).apply)
        return Port(
            address=self.address,
            secure=self._secure,
            timeout=self._timeout,
            reader=weakref.proxy(reader),
            offer=offer,
            follows=reader.follows,
            state=self._worker,
            fail=weakly(self, Subscriber._fail),
            notify=weakly(self, Subscriber._notify),
            waiters=self._waiters,
        )

    def _bus_closed(self) -> bool:
        """Whether the publisher of the segment mapped now marked the bus closed."""
        return not self.closed and self._reader.bus_closed()

    def _latest(self) -> tuple[int, int] | None:
        return self._reader.latest()

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()
        self._waiters.kick()
