"""The trainer side: `Publisher` and the `Publish` handle returned by `publish()`.

Invariants:

* **A slot a live subscriber holds is never written** (`Registry.free_slot`); with
  slots=1 alias readers are protected by the seqlock instead.
* Versions strictly increase; `start()` publishes version 0.
* The events, acks and tap sockets are used under `_io` by one thread at a time. A
  publishing thread takes it to send RECEIVE itself, and a waiting thread to read the
  acks it waits for itself: a thread hand-off per message cost more than the rest of the
  round trip on 2 cores. The agent thread owns the control socket, and takes `_io` every
  SERVICE_S and per heartbeat for the rest (heartbeats, evictions, BYEs, acks nobody
  waits for). Registry updates happen under one lock and condition.
* Every wait has a deadline: a publish builds one and spends it on finding a free slot
  and on collecting every ack.
* CUDA weights (see docs/cuda.md) go into one dedicated CUDA buffer per device, shared
  over CUDA IPC; the publisher synchronizes its stream before the header calls a slot
  complete, so a RECEIVE never precedes its bytes. The CPU segment always exists (it
  holds the header) and has room for every tensor: while a worker that reads the CPU
  copy is on the bus, each version's CUDA tensors are copied there too (device to host),
  and a joining one gets the current version copied before its WELCOME. Both happen
  under `_write_lock`, so no such worker ever sees a slot without its copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import zmq

from . import _config, _lifecycle
from ._buffers import CpuSegment, CudaBuffer, collect_garbage, segment_name
from ._config import DEFAULT
from ._config import XPUB_WELCOME as XPUB_WELCOME  # until _subscriber imports it from _config
from ._connections import connection_budget, open_descriptors, raise_fd_limit
from ._deadline import Deadline
from ._errors import ClosedError, LayoutMismatch, PublishTimeout, ZmqSyncError
from ._fast_frames import template
from ._layout import (
    Key,
    Layout,
    ModuleReader,
    _is_tensordict,
    flatten,
)
from ._overlap import Pending, StepGuard, Writer
from ._protocol import Inspect, Receive, encode
from ._publisher_agent import IO_LOCK_S, Agent, Shared
from ._publisher_role import PublisherRole
from ._registry import Meant, WorkerInfo
from ._security import (
    CurveServer,
    forget_keys,
    is_loopback,
    issue_keys,
    require_security,
)
from ._slots import Slots
from ._sockets import (
    connect,
)
from ._text import printable

__all__ = ["DEFAULT", "Publish", "Publisher"]

log = logging.getLogger(__name__)


# How long a publishing thread reads acks itself before leaving the rest to the agent.
# The agent's heartbeats and evictions wait that long at most; fast publishes never leave.
FAST_COLLECT_S = 0.02
# close() with timeout=None: how long it waits for a version still copied in the background
_CLOSE_WAIT_S = 60.0


def _tensor_device(tensor: torch.Tensor) -> str:
    """The buffer a tensor goes to: "cpu" or "cuda:<index>" (a seam for CPU-only tests)."""
    return str(tensor.device)


# Makes the buffer of one CUDA device (a seam: tests without a GPU put a fake here).
_DEVICE_BUFFER: Any = CudaBuffer


class Publish:
    """The handle of one published version: who acked, who is missing, how long it took.

    Its targets are worker ids *and* the processes that held them when it was published:
    an ack from another process that took one of those ids since does not count.
    """

    def __init__(
        self,
        ledger: _Ledger,
        version: int,
        meant: tuple[Meant, ...],
        started: float,
        pending: Pending | None = None,
    ) -> None:
        self.version = version
        self.targets = tuple(w for w, _ in meant)
        self._meant = meant
        self._ledger = ledger
        self._started = started
        self._returned = time.perf_counter()  # when publish() handed this back
        self._pending = pending  # the background copy, with optimizer=
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
        the return, or for a free slot) plus, with optimizer=, inside ``step()`` for its
        background copy. What publishing cost the training loop."""
        guard = self._pending.guard_wait if self._pending is not None else 0.0
        return self._returned - self._started + guard

    @property
    def acked(self) -> tuple[str, ...]:
        """Targets that acknowledged this version (before leaving, if they left)."""
        if self._acked is not None:
            return self._acked
        return self._ledger.acked(self.version, self._meant)

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

    def done(self) -> bool:
        """True once no target still on the bus is missing."""
        if self._finished is not None:
            return True
        return not self._ledger.missing(self.version, self._meant)

    def wait(self, timeout: float | None = DEFAULT) -> Publish:
        """Block until every target acked, then return self.

        Args:
            timeout: seconds; left out: the publisher's `timeout`; None: no limit.

        Raises:
            PublishTimeout: with on_timeout="raise", some targets did not ack in time
                (`.missing` names them). With "evict" they are dropped instead, listed in
                `.missing`, and wait() returns.
        """
        ledger = self._ledger
        deadline = Deadline(ledger.timeout if timeout is DEFAULT else timeout)
        if self._pending is not None:  # announced only once written
            self._pending.wait(deadline.remaining())
        acked = ledger.wait(self.version, self._meant, deadline)
        if self._finished is None:
            self._finished = time.perf_counter()
            self._acked = acked
        return self

    def __repr__(self) -> str:
        state = "done" if self.done() else f"waiting for {len(self.missing)}"
        return f"<Publish v{self.version} {state} {self.seconds * 1e3:.2f} ms>"


@dataclasses.dataclass(frozen=True)
class _Ledger:
    """What a `Publish` handle asks its publisher: who acked a version, who is missing,
    and to wait for the rest (with the publisher's default timeout)."""

    acked: Callable[[int, tuple[Meant, ...]], tuple[str, ...]]
    missing: Callable[[int, tuple[Meant, ...]], list[str]]
    wait: Callable[[int, tuple[Meant, ...], Deadline], tuple[str, ...]]
    timeout: float | None


class Publisher:
    """Publishes versions of a model's weights to every subscriber on the host.

    Args:
        weights: an nn.Module (parameters and buffers are re-read at each publish), a
            TensorDict or a state_dict.
        address: control address; None: ``ipc://<runtime dir>/<name>.sock``.
        name: bus name, used for the default address and segment names.
        slots: copies of the model in the shared buffer (>= 1). More slots let
            publishes overlap slow alias-mode workers.
        timeout: default deadline (s) for a publish to collect its acks.
        on_timeout: "raise" (PublishTimeout) or "evict" (drop the missing workers).
        heartbeat: heartbeat interval (s); a worker silent for ~6 beats is dropped.
        shm_dir: tmpfs directory for segments (default $ZMQSYNC_SHM_DIR or /dev/shm).
        tap: open the tap socket that mirrors every message for `zmqsync sniff`;
            None: on when the environment variable ZMQSYNC_TAP is "1".
        curve: True: make keys for this bus and leave the client's in the runtime dir,
            where subscribers of this name find them; or a CurveServer (keys and client
            allowlist). Required for a tcp:// address that is not loopback; on loopback
            tcp without it any local user can join (see docs/security.md).
        insecure: allow a non-loopback tcp:// address without CURVE (explicit opt-in).
        group: a group name or gid that may use the bus (socket files and segments
            become 0660 with that group), for containers running as different uids.
        max_workers: more HELLOs from new worker ids are refused ("bus full").
        handshake_rate: HELLOs per second accepted (a HELLO storm is refused, counted).
        optimizer: the optimizer (or several) whose ``step()`` writes the published
            tensors. Then a publish copies them in the background while the trainer runs
            its next forward and backward, and ``step()`` waits only while that copy is
            unfinished (see `publish`). Without it, a publish copies everything first.
        dtype: the dtype the slots hold floating-point tensors in (e.g. torch.bfloat16
            for a float32 trainer: half the bytes written, mapped and copied); the
            trainer's tensors are cast on the way. None: as they are.
        skip_unchanged: False (default): a publish without ``keys=`` writes every
            tensor. True: only tensors whose torch version counter moved since the last
            publish (a partial publish chosen for you); writes that bypass the counter
            (through ``.data``, numpy views, another process) are not seen. "verify":
            the same, and every skipped tensor is compared byte for byte with the last
            version; one that differs is published anyway, with a warning.
        live: move the trainer's tensors into the shared segment (one slot): their
            storage becomes a view of it, alias-mode workers see every in-place change
            at once, and a publish only announces a version (no copy, at any size).
            Versions are then not atomic (see docs/guide.md). CPU tensors only; not
            with `dtype` or `optimizer`. On close the trainer gets private copies back.
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
        shm_dir: str | None = None,
        tap: bool | None = None,
        curve: CurveServer | bool | None = None,
        insecure: bool = False,
        group: str | int | None = None,
        max_workers: int = 1024,
        handshake_rate: float = 200.0,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        dtype: torch.dtype | None = None,
        skip_unchanged: bool | str = False,
        live: bool = False,
    ) -> None:
        self.name = _config.check_name(name)
        if live and (dtype is not None or optimizer is not None):
            raise ValueError("live=True shares the trainer's tensors: no dtype= or optimizer=")
        self._live = live
        self._moved: list[tuple[torch.Tensor, int]] = []  # live: (trainer tensor, its view)
        if not 1 <= slots <= 64:
            raise ValueError(f"slots must be between 1 and 64, not {slots}")
        if on_timeout not in ("raise", "evict"):
            raise ValueError(f'on_timeout must be "raise" or "evict", not {on_timeout!r}')
        if not 0.001 <= heartbeat <= 3600:
            raise ValueError(f"heartbeat must be in [0.001, 3600] seconds, not {heartbeat}")
        Deadline(timeout)  # validates
        self._source = weights
        # a module is re-read at each publish; the reader keeps where its tensors live
        flat = flatten(weights)
        placed = {key: _tensor_device(t) for key, t in flat.items()}
        self._devices = set(placed.values())
        other = sorted(d for d in self._devices if d != "cpu" and not d.startswith("cuda:"))
        if other:
            raise NotImplementedError(
                f"weights on {other}: zmqsync publishes CPU and CUDA tensors; move them "
                "to one of those"
            )
        cuda = sorted(self._devices - {"cpu"}, key=lambda d: int(d.split(":")[1]))
        if live and cuda:
            raise NotImplementedError("live=True shares CPU tensors; these are on a GPU")
        if len(cuda) > 15:
            raise ValueError(f"weights on {len(cuda)} GPUs: at most 15 per bus")
        index = {device: i + 1 for i, device in enumerate(cuda)}
        self._cuda_devices = cuda
        buffers = {key: index[d] for key, d in placed.items() if d != "cpu"} if cuda else None
        # What publish() reads is checked against the trainer's tensors; the slots hold
        # them cast to `dtype` when one is given.
        self._source_layout = Layout.of(flat, buffers)
        self._layout = Layout.of(_cast(flat, dtype), buffers) if dtype else self._source_layout
        # what publish(keys=...) may name: key tuples and dotted names
        self._key_of: dict[str | Key, Key] = {spec.key: spec.key for spec in self._layout.specs}
        self._key_of.update({spec.name: spec.key for spec in self._layout.specs})
        self._reader = (
            ModuleReader(weights, (spec.key for spec in self._layout.specs))
            if isinstance(weights, torch.nn.Module)
            else None
        )
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = (optimizer,)
        if skip_unchanged not in (False, True, "verify"):
            raise ValueError(
                f'skip_unchanged must be False, True or "verify", not {skip_unchanged!r}'
            )
        self._skip_unchanged = skip_unchanged
        # per tensor: (address, torch version counter) when it was last published
        self._published_at: dict[Key, tuple[int, int]] = {}
        self._optimizers = tuple(optimizer or ())
        self._guard: StepGuard | None = None  # with optimizers, once started
        self._writer: Writer | None = None
        self._pending: tuple[int, Pending] | None = None  # (version, its background copy)
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}  # the writer's
        self._address_arg = address
        self._slot_count = 1 if live else slots  # live: the trainer's tensors are slot 0
        self._timeout = timeout
        self._on_timeout = on_timeout
        self._heartbeat = heartbeat
        self._shm_dir = _config.shm_dir(shm_dir)
        self._tap = tap if tap is not None else os.environ.get("ZMQSYNC_TAP") == "1"
        self._curve_arg = curve
        self._curve = curve if isinstance(curve, CurveServer) else None
        self._insecure = insecure
        self._gid = _config.resolve_group(group)
        if max_workers < 1 or handshake_rate <= 0:
            raise ValueError("max_workers must be >= 1 and handshake_rate > 0")
        self._max_workers = max_workers
        self._handshake_rate = handshake_rate
        self.bus_id = secrets.token_hex(8)  # new at every start of a publisher
        # (seq, version, slot, changed) -> frame
        self._receive = template(Receive, bus=self.bus_id)
        self._bits: dict[frozenset[Key], bytes] = {}  # tensors named -> RECEIVE.changed
        self.address = ""
        self._role = PublisherRole(
            name=self.name,
            bus_id=self.bus_id,
            slots=self._slot_count,
            heartbeat=heartbeat,
            slot_bytes=self._layout.slot_bytes,
            manifest=self._layout.specs,
            max_workers=max_workers,
            handshake_rate=handshake_rate,
            now=time.monotonic(),
        )
        self._shared = Shared(self._role, curve=self._curve, gid=self._gid, tap=self._tap)
        # The same objects as the agent's (see `Shared`), under the names used here.
        self._registry = self._role.registry
        self._counters = self._role.counters
        self._lock = self._shared.lock
        self._cond = self._shared.cond
        self._io = self._shared.io  # the events, acks and tap sockets (see the module doc)
        self._write_lock = self._shared.write_lock
        self._publish_lock = threading.Lock()
        self._ledger = _Ledger(self._acked_now, self._missing_now, self._wait_for_acks, timeout)
        self._state = "new"  # new -> started -> closed
        self._agent: Agent | None = None
        self._slots: Slots | None = None  # the buffers, once started
        self._resources = contextlib.ExitStack()
        self._pid = os.getpid()

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> Publisher:
        """Create the buffer, bind the sockets, publish version 0. Returns self.

        Raises:
            SharedMemoryFull: the shm dir has no room for `slots` copies of the model.
            ZmqSyncError: another publisher already serves this address.
            ClosedError: the publisher was closed (create a new one).
        """
        if self._state == "closed":
            raise ClosedError(f"Publisher {self.name!r} is closed; create a new one")
        if self._state == "started":
            return self
        with contextlib.ExitStack() as stack:
            self.address = self._address_arg or _config.default_address(self.name)
            self._shared.address = self.address
            _refuse_if_served(self.address)
            if self._curve_arg is True:
                self._curve = self._shared.curve = issue_keys(self.name, self._gid)
                stack.callback(forget_keys, self.name)
            elif self._address_arg is None:  # keys a killed publisher left for this name
                forget_keys(self.name)
            require_security(self.address, self._curve, self._insecure)
            self._shared.fd_limit = raise_fd_limit()
            self._shared.max_connections = connection_budget(
                self._shared.fd_limit, open_descriptors()
            )
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
            cuda = [
                stack.enter_context(
                    _DEVICE_BUFFER(
                        device, slots=self._slot_count, slot_bytes=self._layout.slot_bytes
                    )
                )
                for device in self._cuda_devices  # one dedicated buffer per GPU
            ]
            cast = self._layout is not self._source_layout
            slots = self._slots = Slots(self._layout, segment, cuda, cast=cast)
            initial = flatten(self._source)
            slots.write(0, 0, initial, mirror=False)
            if self._skip_unchanged:
                self._note_published(initial, None)
            if self._live:  # undone on close, or if a later step fails
                stack.callback(self._move_out)
                _move_into(self._source, slots.views(0), self._moved)
            self._registry.record(0, 0)
            self._role.cuda = slots.cuda
            self._shared.buffers = slots.describe()
            self._shared.fill_mirror = slots.fill_mirror if slots.cuda else None
            self._agent = Agent(self._shared)
            self._agent.start()
            stack.callback(self._agent.stop)
            if self._optimizers:  # closed before the agent: a pending version goes out
                self._guard = StepGuard(self._optimizers, self._timeout)
                stack.callback(self._guard.remove)
                self._writer = Writer(self.name)
                stack.callback(self._writer.close)
            self._resources = stack.pop_all()
        self._state = "started"
        self._pid = os.getpid()
        _lifecycle.track(self)
        log.info(
            "publisher %r started at %s (%d tensors, %.1f MiB, %d slots)",
            self.name,
            self.address,
            len(self._layout.specs),
            self._layout.nbytes / 2**20,
            self._slot_count,
        )
        if self.address.startswith("tcp://") and self._curve is None:
            who = "any local user" if is_loopback(self.address) else "anyone who reaches it"
            log.warning(
                "publisher %r at %s has no CURVE: %s can inspect this bus, join it and "
                "stall every publish; pass curve=True (see docs/security.md)",
                self.name,
                self.address,
                who,
            )
        return self

    def close(self) -> None:
        """Broadcast STOP, wait briefly for BYEs, unlink the segments. Idempotent."""
        if self._state != "started":
            self._state = "closed"
            return
        if self._pending is not None and os.getpid() == self._pid:
            # a version still being written in the background goes out before STOP
            _, pending = self._pending
            with contextlib.suppress(Exception):  # bounded even with timeout=None
                pending.wait(self._timeout if self._timeout is not None else _CLOSE_WAIT_S)
            self._pending = None
        self._state = "closed"
        if os.getpid() != self._pid:
            # A forked child inherited this object: the segment, sockets and thread
            # belong to the parent. Closing them here would break the parent's bus.
            return
        if self._agent is not None:
            self._agent.command(b"stop")
        self._resources.close()
        self._slots = None
        log.info("publisher %r closed at version %d", self.name, self._registry.latest)

    def __enter__(self) -> Publisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Close first, warn after: with warnings turned into errors the warning would
        # otherwise end __del__ before anything is released.
        if getattr(self, "_state", "closed") == "started":
            unclosed = f"unclosed {self!r}"
            with contextlib.suppress(Exception):
                self.close()
            warnings.warn(
                f"{unclosed}: closed by the garbage collector (use `with` or call close())",
                ResourceWarning,
                stacklevel=1,
            )

    def __repr__(self) -> str:
        return (
            f"<Publisher {self.name!r} v{self._registry.latest} {self.address or '-'} "
            f"{len(self._registry.members)} workers {self._state}>"
        )

    # --- publishing ----------------------------------------------------------------

    @property
    def bus(self) -> str:
        """The bus id (`bus_id`), under its older name."""
        return self.bus_id

    @property
    def version(self) -> int:
        """The last published version."""
        return self._registry.latest

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        """Snapshot of the workers on the bus."""
        with self._lock:
            return self._registry.infos(time.time() - time.monotonic())

    @property
    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def publish(
        self,
        weights: Any = None,
        *,
        wait: bool = True,
        workers: Iterable[str] | None = None,
        timeout: float | None = DEFAULT,
        version: int | None = None,
        keys: Iterable[str | Key] | None = None,
        fill: Callable[[torch.Tensor], None] | None = None,
        slot: int | None = None,
    ) -> Publish:
        """Write a new version into a free slot, announce it, and (by default) wait for acks.

        The steps, in order: read and check the weights; claim a slot no worker holds
        (waiting for acks if need be); write it under the seqlock; announce it (RECEIVE);
        wait for the acks. With ``optimizer=`` the write of the optimizer's tensors and
        the announcement happen in the background: ``publish(wait=False)`` returns once
        the rest is copied, and the next ``optimizer.step()`` waits only if that copy
        has not finished (`Publish.blocked` says how long the training thread waited).

        Args:
            weights: tensors to publish instead of re-reading the source (same keys,
                shapes, dtypes; with `keys`, at least those).
            wait: False returns at once; call `Publish.wait` later.
            workers: only these workers must ack (the others still get the version).
            timeout: one deadline for the whole publish; left out: the publisher's.
            version: the number to publish under (default: the last one + 1); it must be
                greater than the last. A relay uses this to keep the root's numbering.
            keys: publish only these tensors (dotted names or key tuples, e.g. an
                adapter's) as the new version; every other tensor keeps the value it had
                in the last version, in every slot.
            fill: write the version's bytes yourself: called with the slot's bytes (a
                flat uint8 tensor, laid out as the manifest says) instead of copying
                `weights`. A relay lands bytes received from the network this way.
            slot: the slot to write (from `reserve_slot`), instead of the one the
                publisher would claim; only with `fill`.

        Raises:
            LayoutMismatch: `weights` has other keys, shapes or dtypes.
            PublishTimeout: with on_timeout="raise", workers did not ack (or still held
                every slot) before the deadline.
            ClosedError: the publisher is not started.
        """
        self._check_usable()
        started = time.perf_counter()
        deadline = Deadline(self._timeout if timeout is DEFAULT else timeout)
        named = self._named(keys)
        if self._live and (fill is not None or slot is not None):
            raise ValueError("a live publisher's slot holds the trainer's tensors: no fill=")
        reads = fill is None and not (self._live and weights is None)
        flat = self._read(weights, named) if reads else {}
        if self._skip_unchanged and named is None and reads:
            named = self._written_since(flat)
        if slot is not None and fill is None:
            raise ValueError("slot= needs fill=: the slot's bytes are yours to write")
        with self._publish_lock:
            self._settle(deadline)  # the version before this one is out first
            latest = self._registry.latest
            if version is None:
                version = latest + 1
            elif version <= latest:
                raise ValueError(f"version {version} is not greater than the last ({latest})")
            if self._live:
                slot = 0
            else:
                slot = self._claim_slot(deadline) if slot is None else self._reserved(slot)
            with self._cond:
                ids = self._registry.members if workers is None else workers
                targets = self._registry.meant(ids)
            pending = None
            if self._writer is not None and fill is None:
                pending = self._write_overlapped(slot, version, flat, named)
            else:
                with self._write_lock:  # a worker reading the CPU copy joins before or after
                    self._write(slot, version, flat, named, fill)
                    self._record(version, slot)
                self._announce(version, slot, named)
            if self._skip_unchanged and reads:
                self._note_published(flat, named)
        handle = Publish(self._ledger, version, targets, started, pending)
        log.debug("published v%d into slot %d for %d workers", version, slot, len(targets))
        if wait:
            handle.wait(deadline.remaining())
        return handle

    def reserve_slot(self) -> int | None:
        """A slot that a `publish(fill=..., slot=...)` may write, or None while every slot
        is held. It stays free until then: only a publish makes a slot held (workers join
        at the latest version, and acks only release)."""
        self._check_usable()
        with self._cond:
            return self._registry.free_slot()

    def open_slot(self, slot: int) -> torch.Tensor:
        """`slot` (from `reserve_slot`) as flat bytes, marked as being written already:
        for bytes that land long before the publish that announces them."""
        self._check_usable()
        assert self._slots is not None
        return self._slots.open(slot)

    def wait_for_workers(self, n: int, timeout: float | None = DEFAULT) -> bool:
        """Block until `n` workers are on the bus; False if the deadline passed first."""
        deadline = Deadline(self._timeout if timeout is DEFAULT else timeout)
        with self._cond:
            while len(self._registry.members) < n:
                self._check_usable()
                if deadline.expired():
                    return False
                self._cond.wait(deadline.wait_s(0.5))
        return True

    # --- internals (user thread) ---------------------------------------------------

    def _check_usable(self) -> None:
        failure = self._shared.failure
        if failure is not None:
            raise ZmqSyncError(f"publisher {self.name!r} agent failed: {failure!r}") from failure
        if self._state != "started":
            state = "closed" if self._state == "closed" else "not started"
            raise ClosedError(f"Publisher {self.name!r} is {state}; call start() on a new one")

    def _named(self, keys: Iterable[str | Key] | None) -> frozenset[Key] | None:
        """`keys` as the layout's key tuples (None: every tensor)."""
        if keys is None:
            return None
        known = self._key_of
        named = []
        for key in [keys] if isinstance(keys, str) else keys:
            found = known.get(key if isinstance(key, str) else tuple(key))
            if found is None:
                raise LayoutMismatch(
                    f"keys: {key!r} is not a tensor of this bus; name tensors as the "
                    "manifest does (dotted names, e.g. 'head.weight', or key tuples)"
                )
            named.append(found)
        if not named:
            raise ValueError("keys= names no tensor: leave it out to publish all of them")
        return frozenset(named)

    def _read(self, weights: Any, named: frozenset[Key] | None) -> dict[Key, torch.Tensor]:
        """The tensors to publish: `weights`, or the source re-read; checked."""
        if weights is None and self._reader is not None:
            flat = self._reader.read()
        else:
            flat = flatten(self._source if weights is None else weights, detach=False)
        if named is None:
            self._source_layout.check(flat)
        else:  # a partial publish reads only the named tensors: only they are checked
            self._source_layout.check_keys(flat, named)
        return flat

    def _written_since(self, flat: dict[Key, torch.Tensor]) -> frozenset[Key] | None:
        """With skip_unchanged: the tensors written since they were last published, by
        their torch version counters (None: all of them). "verify" also compares the
        others with the latest version and adds those that differ."""
        seen = self._published_at
        moved = {k for k, t in flat.items() if seen.get(k) != _stamp(t)}
        if self._skip_unchanged == "verify" and len(moved) < len(flat):
            assert self._slots is not None
            with self._write_lock:
                latest = self._slots.latest_views()
                missed = sorted(
                    k for k, t in flat.items() if k not in moved and not _same(t, latest[k])
                )
            if missed:
                names = ", ".join(printable(".".join(k)) for k in missed[:5])
                log.warning(
                    "publisher %r: %d tensors changed without their version counter moving "
                    "(%s%s); published them anyway. Written through .data or a numpy view? "
                    "skip_unchanged=True would have missed them",
                    self.name, len(missed), names, ", ..." if len(missed) > 5 else "",
                )  # fmt: skip
                moved.update(missed)
        return None if len(moved) == len(flat) else frozenset(moved)

    def _note_published(self, flat: dict[Key, torch.Tensor], named: frozenset[Key] | None) -> None:
        for key in flat if named is None else named:
            self._published_at[key] = _stamp(flat[key])

    def _reserved(self, slot: int) -> int:
        with self._cond:
            if not 0 <= slot < self._slot_count or self._registry.holders(slot):
                raise ZmqSyncError(f"slot {slot} is not free: take one from reserve_slot()")
        return slot

    def _write(
        self,
        slot: int,
        version: int,
        flat: dict[Key, torch.Tensor],
        named: frozenset[Key] | None,
        fill: Callable[[torch.Tensor], None] | None,
    ) -> None:
        """Write `slot` (caller holds `_write_lock`): `flat` (its `named` tensors, and
        the others the slot holds old values of), or whatever `fill` lands."""
        slots = self._slots
        assert slots is not None
        if self._live:  # the trainer's tensors are the slot: copy only what was given
            slots.begin(slot)
            _copy_unless_same(flat, slots.views(slot))
            slots.finish(slot, version, named)
        elif fill is not None:
            with slots.writing(slot, version):
                fill(slots.flat(slot))
        elif named is None:
            slots.write(slot, version, flat, mirror=self._needs_mirror())
        else:
            mirror = self._needs_mirror()
            slots.begin(slot)
            slots.copy(slot, flat, named, mirror=mirror)
            slots.refresh(slot, slots.stale(slot, named))
            slots.finish(slot, version, named, mirror=mirror)

    def _move_out(self) -> None:
        """Live: give the trainer's tensors private copies before the segment goes."""
        moved, self._moved = self._moved, []
        with torch.no_grad():
            for tensor, view_ptr in moved:
                if tensor.data_ptr() == view_ptr:  # not replaced by the trainer since
                    tensor.data = tensor.data.clone()

    def _write_overlapped(
        self, slot: int, version: int, flat: dict[Key, torch.Tensor], named: frozenset[Key] | None
    ) -> Pending:
        """Copy now what the optimizer does not write; leave the rest to the writer thread,
        which then records and announces the version (see `_overlap`)."""
        slots, guard, writer = self._slots, self._guard, self._writer
        assert slots is not None and guard is not None and writer is not None
        every = slots.key_set if named is None else named
        owned = guard.owned()
        late = frozenset(k for k in every if id(flat[k]) in owned)
        with self._write_lock:
            mirror = self._needs_mirror()
            slots.begin(slot)
            slots.copy(slot, flat, every - late, mirror=mirror)
            if named is not None:
                slots.refresh(slot, slots.stale(slot, named))
        # CUDA: the side streams start after what the trainer queued so far (the copies
        # just made included), and every copy of this version is on them
        devices = sorted({flat[k].device for k in every if flat[k].is_cuda}, key=str)
        before = self._stream_events(devices)
        on_gpu = bool(late) and all(flat[k].is_cuda for k in late) and not mirror

        def finish(pending: Pending) -> None:  # on the writer thread
            with self._write_lock, self._on_side_streams(devices):
                self._wait_for_trainer(before)
                slots.copy(slot, flat, late, mirror=mirror)
                if pending.on_gpu:  # a step may go on once its streams wait for these
                    pending.copied = self._stream_events(devices)
                    pending.queued.set()
                slots.finish(slot, version, named, mirror=mirror)  # syncs the side streams
                self._record(version, slot)
            self._announce(version, slot, named)

        pending = writer.submit(finish, on_gpu=on_gpu)
        guard.pending = pending
        self._pending = (version, pending)
        return pending

    @staticmethod
    def _stream_events(devices: Iterable[torch.device]) -> list[torch.cuda.Event]:
        """An event on each device's current stream now: recorded by the trainer, the
        writer's copy starts after the kernels queued before publish(); recorded by the
        writer, a step's kernels start after the copy."""
        events = []
        for device in devices:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return events

    @contextlib.contextmanager
    def _on_side_streams(self, devices: list[torch.device]) -> Iterator[None]:
        """The writer thread's CUDA work goes to one side stream per device (made once),
        so the copy runs beside the trainer's next forward and backward."""
        with contextlib.ExitStack() as stack:
            for device in devices:
                stream = self._side_streams.get(device)
                if stream is None:
                    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                    self._side_streams[device] = stream
                stack.enter_context(torch.cuda.stream(stream))
            yield

    @staticmethod
    def _wait_for_trainer(events: list[torch.cuda.Event]) -> None:
        for event in events:
            torch.cuda.current_stream(event.device).wait_event(event)

    def _changed_bits(self, named: frozenset[Key]) -> bytes:
        """RECEIVE's bitmap of `named` over the manifest (bit i: entry i), computed once
        per set of keys (a trainer publishes the same few subsets again and again)."""
        bits = self._bits.get(named)
        if bits is None:
            mask = sum(1 << i for i, spec in enumerate(self._layout.specs) if spec.key in named)
            bits = mask.to_bytes((len(self._layout.specs) + 7) // 8, "little")
            if len(self._bits) > 64:
                self._bits.clear()
            self._bits[named] = bits
        return bits

    def _settle(self, deadline: Deadline) -> None:
        """Wait for the version still being written in the background, if any."""
        if self._pending is not None:
            _, pending = self._pending
            pending.wait(deadline.remaining())
            self._pending = None

    def _record(self, version: int, slot: int) -> None:
        with self._cond:
            self._registry.record(version, slot)
            self._counters["publishes"] += 1

    def _needs_mirror(self) -> bool:
        """Whether a worker reading the CPU copy of CUDA weights is on the bus."""
        if not self._role.cuda:
            return False
        with self._cond:
            return any(m.transport == "cpu" for m in self._registry.members.values())

    def _claim_slot(self, deadline: Deadline) -> int:
        with self._cond:  # the common case: a slot is free now
            slot = self._registry.free_slot()
        if slot is not None:
            return slot
        free: list[int | None] = [None]

        def found() -> bool:
            free[0] = self._registry.free_slot()
            return free[0] is not None

        while True:
            self._await(found, deadline)
            with self._cond:
                if found():
                    return free[0]  # type: ignore[return-value]
                self._check_usable()
                blockers = self._registry.blockers()
                self._on_deadline(self._registry.latest + 1, (), blockers, "still hold every slot")

    def _wait_for_acks(
        self, version: int, targets: tuple[Meant, ...], deadline: Deadline
    ) -> tuple[str, ...]:
        """Wait for every target's ack of `version`; the targets that acked (see
        `_on_deadline` for what happens to the others)."""
        self._await(self._all_acked(version, targets), deadline)
        with self._cond:
            if missing := self._registry.missing(version, targets):
                self._check_usable()
                acked = self._registry.acked(version, targets)
                self._on_deadline(version, acked, missing, "did not ack")
            return tuple(self._registry.acked(version, targets))

    def _acked_now(self, version: int, targets: tuple[Meant, ...]) -> tuple[str, ...]:
        with self._cond:
            return tuple(self._registry.acked(version, targets))

    def _missing_now(self, version: int, targets: tuple[Meant, ...]) -> list[str]:
        with self._cond:
            return self._registry.missing(version, targets)

    def _all_acked(self, version: int, targets: tuple[Meant, ...]) -> Callable[[], bool]:
        """A check, asked after every ack (under `_cond`), of whether no target is missing.

        Asking `Registry.missing` each time costs O(targets) per ack, O(N^2) per publish
        (64 workers: 4,096 lookups). This one keeps the targets not yet seen done and looks
        at the last of them: one lookup per ack while it has not acked, each target
        dropped once. Acks only grow and members only leave, so a dropped target stays
        done, except one that re-joins meanwhile: the full check runs once at the end.
        """
        registry, pending = self._registry, list(targets)

        def ready() -> bool:
            members = registry.members
            while pending:
                worker_id, process = pending[-1]
                member = members.get(worker_id)
                if member is not None and member.acked < version:
                    if not process or member.process == process:
                        return False
                pending.pop()
            missing = set(registry.missing(version, targets))
            pending.extend(t for t in targets if t[0] in missing)
            return not pending

        return ready

    def _await(self, ready: Callable[[], bool], deadline: Deadline) -> None:
        """Block until `ready()` (called under `_cond`) or the deadline; reads acks itself.

        The waiting thread takes the sockets (`_io`) and handles acks as they arrive, in
        turns of FAST_COLLECT_S so the agent can still send heartbeats: no thread
        hand-off per ack. A thread that finds the sockets taken (another waiter, or the
        agent for a moment) waits on the condition, which every registry change wakes.
        """
        agent = self._agent
        assert agent is not None
        while True:
            with self._cond:
                if ready():
                    return
                self._check_usable()
            if deadline.expired():
                return
            if self._io.acquire(blocking=False):
                try:
                    if agent.closed:
                        raise ClosedError(f"Publisher {self.name!r} was closed while waiting")
                    agent.collect(ready, Deadline(deadline.wait_s(FAST_COLLECT_S)))
                finally:
                    self._io.release()
            else:
                with self._cond:
                    if not ready():
                        self._cond.wait(deadline.wait_s(FAST_COLLECT_S))

    def _announce(self, version: int, slot: int, named: frozenset[Key] | None = None) -> None:
        """Send RECEIVE from this thread (see the module doc: no hand-off to the agent);
        `named`: the tensors it changed, for copy-mode workers (None: all of them)."""
        changed = b"" if named is None else self._changed_bits(named)
        agent = self._agent
        assert agent is not None
        if not self._io.acquire(timeout=IO_LOCK_S):
            raise ZmqSyncError(f"publisher {self.name!r}: its agent thread is stuck; close it")
        try:
            if agent.closed:
                raise ClosedError(f"Publisher {self.name!r} was closed while publishing")
            agent.send_frame(self._receive(self._role.next_seq(), version, slot, changed))
        finally:
            self._io.release()

    def _on_deadline(
        self, version: int, acked: Iterable[str], missing: list[str], what: str
    ) -> None:
        """trio's fail_after ("raise") versus move_on_after ("evict"): same deadline."""
        self._counters["timeouts"] += 1
        if self._on_timeout == "raise":
            raise PublishTimeout(
                f"version {version}: {len(missing)} worker(s) {what} in time "
                f"({', '.join(missing[:8])}); they may have died or be stuck — pass "
                'on_timeout="evict" to continue without them',
                version=version,
                acked=acked,
                missing=missing,
            )
        evicted = self._role.evict(missing)
        log.info(
            "evicted %d worker(s) at version %d: %s", len(evicted), version, ", ".join(missing)
        )
        for member in evicted:
            cmd = b"evict %s %s" % (member.session.encode(), member.worker_id.encode())
            self._agent.command(cmd)  # type: ignore[union-attr]
        self._cond.notify_all()


def _stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's bytes are and how often torch saw them written in place."""
    return tensor.data_ptr(), tensor._version  # noqa: SLF001 - torch's version counter


def _same(source: torch.Tensor, slot_view: torch.Tensor) -> bool:
    """Whether `source` holds, byte for byte, what the slot holds (cast as the slot is);
    a CUDA tensor counts as changed (its slot copy is on the device)."""
    if source.device.type != "cpu" or slot_view.device.type != "cpu":
        return False
    value = source.detach().to(slot_view.dtype).reshape(-1)
    if value.dtype == torch.bool:
        return torch.equal(value, slot_view.reshape(-1))
    return torch.equal(value.view(torch.uint8), slot_view.reshape(-1).view(torch.uint8))


def _cast(flat: dict[Key, torch.Tensor], dtype: torch.dtype) -> dict[Key, torch.Tensor]:
    """What the slots hold for `flat` with floating tensors in `dtype` (no memory: meta)."""
    return {
        key: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
        for key, t in flat.items()
    }


def _trainer_tensors(weights: Any) -> dict[Key, torch.Tensor]:
    """The trainer's own tensor objects (not detached copies), keyed as `flatten` does."""
    if isinstance(weights, torch.nn.Module):
        return flatten(weights, detach=False)
    keys = list(flatten(weights))  # checks the kinds and gives the keys, in order
    if _is_tensordict(weights):
        leaves = weights.values(include_nested=True, leaves_only=True)
        return dict(zip(keys, leaves, strict=True))
    return dict(zip(keys, weights.values(), strict=True))


def _move_into(
    weights: Any, views: Mapping[Key, torch.Tensor], moved: list[tuple[torch.Tensor, int]]
) -> None:
    """Live: each trainer tensor's storage becomes its view in the slot (which holds its
    values already); a Parameter stays the same object, so optimizers keep working.
    `moved` lists each one as it goes, so that a failure half-way is undone too."""
    with torch.no_grad():
        for key, tensor in _trainer_tensors(weights).items():
            view = views[key]
            tensor.data = view
            moved.append((tensor, view.data_ptr()))


def _copy_unless_same(flat: Mapping[Key, torch.Tensor], views: Mapping[Key, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, tensor in flat.items():
            view = views[key]
            if tensor.data_ptr() != view.data_ptr():
                view.copy_(tensor)


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
