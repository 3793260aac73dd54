"""How a worker applies versions (`Copies`, `Aliases`), behind one interface.

A version reaches a worker the same way whatever the mode: the agent hands an `Offer`
(or a follower takes it, see `_reference_follower`), the slot's seqlock is read, the
slot is applied, the `WorkerState` records it. The mode decides the apply: `CopyReader`
copies the slot into the model's tensors and reads the seqlock again; `AliasReader`
points the model at the slot. Built once by `build`, as `_write_modes.build` builds a
publisher's; the `Subscriber` holds one and keeps no apply logic of its own.

A reader owns what applying needs: the mapped buffers (adopted from a WELCOME, with the
transport chosen for them), the `Target` the model is bound to, the manual mode's
pending offer, and the follower built over them. The agent thread reaches it through a
weak proxy (see `Port`): a reader never holds its Subscriber.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
import zmq

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
from ._errors import ProtocolError, ZmqSyncError
from ._fast_frames import receive_pattern, template_pieces
from ._follow import FOLLOWER, libzmq_path, zmq_error
from ._histogram import APPLY, record
from ._layout import Key, Layout, flatten
from ._link import Link, Offer
from ._protocol import Ack, Hello, Welcome
from ._reads import Aliases, Copies, Reads
from ._reference_follower import ReferenceFollower, can_take
from ._subscriber_agent import Waiters
from ._worker_state import WorkerState

__all__ = ["AliasReader", "CopyReader", "Reader", "Where", "build"]

log = logging.getLogger(__name__)
_APPLY_ATTEMPTS = 100
# what `Reader._read` returns for a copy rewritten while it was read (compared by identity)
TORN: tuple[int, int] = (-1, -1)


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a worker's buffers come from and whom it shares its state with."""

    shm_dir: str
    owner: int | None  # the uid the publisher's segments must belong to (None: found)
    worker_id: str  # for what it logs
    state: WorkerState  # what every apply records (see `_worker_state`)
    lock: threading.RLock  # the Subscriber's: state is recorded and read under it
    cond: threading.Condition  # over `lock`: manual mode's pending offer
    waiters: Waiters
    counts: dict[str, int]  # the ``apply`` histogram goes here


class Reader:
    """One worker's way of applying versions (see the module doc)."""

    copying = False

    def __init__(self, reads: Reads, model: Any, where: Where) -> None:
        self.reads = reads
        self.model = model
        self.where = where
        self.manual = reads.manual
        self.on_update = reads.on_update
        self.address = ""  # the control address, once the Subscriber starts
        self.bus_id = ""  # of the buffers mapped now
        self.attachment: CpuAttachment | None = None
        self.gpus: list[CudaAttachment] = []
        self.views: list[dict[Key, torch.Tensor]] = []
        self.target: Target | None = None
        self.sync_devices: tuple[torch.device, ...] = ()  # GPUs the apply reads or writes
        self.transport = Decision("", "")
        self._manifest_keys: tuple[Key, ...] = ()  # in manifest order (RECEIVE.changed)
        self._changed_keys: dict[bytes, frozenset[Key]] = {}
        self._pending: Offer | None = None  # manual mode: the newest offer not applied
        self._apply_lock = threading.Lock()

    @property
    def mode(self) -> str:
        """The mode's name on the wire (HELLO) and in what the tap shows."""
        return "copy" if self.copying else "alias"

    @property
    def follows(self) -> bool:
        """Whether a follower may ever take this worker's versions: the worker's thread
        applies them (not the user's) and no user code runs between apply and ACK."""
        return not self.manual and self.on_update is None

    # --- what the agent thread asks -------------------------------------------------

    def initial_transport(self) -> Decision:
        facts = self._facts()
        return initial_transport(facts.prefers, facts.cuda_available, facts.ipc_disabled)

    def latest(self) -> tuple[int, int] | None:
        attachment = self.attachment
        return attachment.header.latest() if attachment is not None else None

    def join(self, offer: Offer) -> int | None:
        """After a WELCOME: the version to ACK, if any. The first join applies `offer`
        whatever the apply mode (start() returns computing with it); a re-join offers it
        like any version, and one that finds its bus's version applied ACKs it again."""
        state = self.where.state
        first = not state.bus
        applied = self.apply(offer) if first else self.offer(offer)
        if applied is None and state.bus == offer.bus:
            applied = state.version  # re-joined the same bus: already computing with it
        return applied

    def offer(self, offer: Offer) -> int | None:
        """A version arrived (agent thread). Background: apply it now. Manual: keep it."""
        if not self.manual:
            return self.apply(offer)
        state = self.where.state
        if offer.bus == state.bus and offer.version <= state.version:
            return None
        with self.where.cond:
            self._pending = offer
            self.where.cond.notify_all()
        return None

    def take_pending(self, wait_s: float | None) -> Offer | None:
        """Manual mode (user's thread): the pending offer, waiting up to `wait_s` for one
        (once: the caller looks at why it got none, and waits again)."""
        cond = self.where.cond
        with cond:
            if self._pending is None and (wait_s is None or wait_s > 0):
                cond.wait(wait_s)
            offer, self._pending = self._pending, None
        return offer

    def apply(self, offer: Offer) -> int | None:
        """Apply `offer` or a newer version; the version applied, or None (stale).

        Mirrored in C by Follower.next (``_follower.c``) and in `ReferenceFollower`, for
        the versions they take: the same record in the `WorkerState`, under its lock."""
        where = self.where
        state = where.state
        with self._apply_lock:
            started = time.perf_counter()  # the ``apply`` histogram of `counters`
            attachment, target = self.attachment, self.target
            if attachment is None or target is None or offer.bus != self.bus_id:
                return None  # re-handshaken since: a newer offer follows
            header, version, slot = attachment.header, offer.version, offer.slot
            for _ in range(_APPLY_ATTEMPTS):
                if offer.bus == state.bus and version <= state.version:
                    return None
                counter = header.read_begin(slot, version)
                if counter is None:  # the slot moved on: take the newest version
                    latest = header.latest()
                    if latest is None or (latest[0], latest[1]) == (version, slot):
                        return None
                    version, slot = latest
                    continue
                held = self._read(target, offer, version, slot, counter)
                if held is TORN:
                    continue  # rewritten while copied: read again
                with where.lock:  # waiters are woken once the ACK is out (see Waiters)
                    if offer.bus != state.bus and where.waiters.gate is not None:
                        where.waiters.gate.open(version)  # a new bus: its numbers start over
                    state.record(version, held, offer.bus)
                    record(where.counts, APPLY, time.perf_counter() - started)
                if self.on_update is not None:
                    self.on_update(version)
                return version
        raise ZmqSyncError(f"could not read a whole version after {_APPLY_ATTEMPTS} attempts")

    def _read(
        self, target: Target, offer: Offer, version: int, slot: int, counter: int
    ) -> tuple[int, int] | None:
        """Apply `slot` (whose seqlock read `counter`) to `target`: what the state holds
        then (alias: the slot and counter; copy: None), or `TORN`."""
        raise NotImplementedError

    def follower(self, link: Link, events: zmq.Socket[bytes], acks: zmq.Socket[bytes]) -> Any:
        """A follower for the versions on these sockets (agent thread): the native one
        where the extension is built, else its twin (`ReferenceFollower`); None where
        `can_take` says neither may take them now."""
        where = self.where
        with self._apply_lock:
            target, attachment = self.target, self.attachment
            if target is None or attachment is None:
                return None
            switch = target.switch
            if not can_take(
                switch,
                copying=self.copying,
                mapped=True,
                syncs_devices=bool(self.sync_devices),
                bus_id=self.bus_id,
                applied_bus=where.state.bus,
                link_bus=link.bus_id,
                session=link.session,
            ):
                return None
            ack_head, ack_tail = template_pieces(
                Ack, bus=self.bus_id, worker_id=link.worker_id, session=link.session
            )
            gate = where.waiters.gate
            copy = target.copier(self.views) if self.copying else None
            if FOLLOWER is None or gate is None:
                return ReferenceFollower(
                    events=events,
                    acks=acks,
                    bus=self.bus_id,
                    ack_head=ack_head,
                    ack_tail=ack_tail,
                    header=attachment.header,
                    slots=len(self.views),
                    switch=switch,
                    state=where.state,
                    lock=where.lock,
                    opened=where.waiters.wake,
                    copy=copy,
                )
            pieces, ranges = receive_pattern(self.bus_id, partial=not self.copying)
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
                slots=len(self.views),
                switch=switch,
                state=where.state,
                lock=where.lock,
                gate=gate,
                error=zmq_error,
                copy=copy,
            )

    def adopt(
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
            shm_dir=self.where.shm_dir,
            owner=self.where.owner,
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
            target = self.target
            if target is None or welcome.bus != self.bus_id:
                where = {key: view.device for key, view in views[0].items()}
                target = self._bind(layout, where)
        except BaseException:
            attachment.close()
            self._close_unused(gpus.values())
            raise
        devices = {t.device for t in (*views[0].values(), *target.tensors.values()) if t.is_cuda}
        with self._apply_lock:
            target.forget_views()
            old, self.attachment = self.attachment, attachment
            old_gpus, self.gpus = self.gpus, list(gpus.values())
            self.views, self.target, self.bus_id = views, target, welcome.bus
            self._manifest_keys = tuple(spec.key for spec in welcome.manifest)
            self._changed_keys.clear()
            self.sync_devices = tuple(sorted(devices, key=str))
            self.transport = decision
        if old is not None:
            old.close()
        for gpu in old_gpus:
            if all(gpu is not kept for kept in gpus.values()):
                gpu.close()
        if decision.reason:
            level = logging.WARNING if forced is not None else logging.INFO
            log.log(
                level,
                "subscriber %s reads the CPU buffer: %s",
                self.where.worker_id,
                decision.reason,
            )
        return None

    def _bind(self, layout: Layout, views: dict[Key, torch.device]) -> Target:
        raise NotImplementedError

    # --- what the user's thread asks ------------------------------------------------

    def bus_closed(self) -> bool:
        """Whether the publisher of the segment mapped now marked the bus closed."""
        attachment = self.attachment
        if attachment is None:
            return False
        try:
            return attachment.header.closed()
        except ValueError:  # replaced and unmapped meanwhile (a re-join): not closed
            return False

    def torn(self, held: tuple[int, int] | None, attachment: CpuAttachment | None) -> bool:
        """Whether the slot `held` (aliased when a block began) was rewritten since."""
        return False

    def close(self) -> None:
        if self.attachment is not None:
            self.attachment.close()
        for gpu in self.gpus:
            gpu.close()

    # --- the transport ----------------------------------------------------------------

    def _prefers(self) -> str:
        """Where this worker computes: "cuda", "cpu", or "any" (no model, no device)."""
        if self.model is not None:
            tensors = flatten(self.model, sharded=True).values()  # DTensors: a TP worker
            return "cuda" if any(t.is_cuda for t in tensors) else "cpu"
        device = self.reads.device
        if device is not None:
            return "cuda" if torch.device(device).type == "cuda" else "cpu"
        return "any"

    def _facts(self) -> Facts:
        return Facts(
            prefers=self._prefers(),
            cuda_available=_cuda.cuda_available(),
            ipc_disabled=ipc_disabled(os.environ),
        )

    def _choose(self, welcome: Welcome) -> tuple[Decision, dict[int, CudaAttachment]]:
        """Decide the transport for this bus; open its CUDA handles if it is "cuda"."""
        gpus = [(i, b) for i, b in enumerate(welcome.buffers) if b.kind == "cuda"]
        facts = dataclasses.replace(self._facts(), publisher_cuda=bool(gpus))
        wanted = initial_transport(facts.prefers, facts.cuda_available, facts.ipc_disabled)
        if not gpus or wanted.transport == "cpu":
            return choose_transport(facts), {}
        visible, pid_ns = _cuda.visible_uuids(), pid_namespace()
        mapped = {gpu.handle: gpu for gpu in self.gpus}  # same bus again: no new open
        opened: dict[int, CudaAttachment] = {}
        decision = choose_transport(facts)
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
            if all(gpu is not used for used in self.gpus):
                gpu.close()


class CopyReader(Reader):
    """`Copies`: each version is copied into the model's own tensors, then the seqlock
    is read again (a version rewritten meanwhile is read again)."""

    copying = True

    def _bind(self, layout: Layout, views: dict[Key, torch.device]) -> Target:
        reads = self.reads
        assert isinstance(reads, Copies)
        return Target(self.model, layout, "copy", reads.device, views, flat=reads.flat)

    def _read(
        self, target: Target, offer: Offer, version: int, slot: int, counter: int
    ) -> tuple[int, int] | None:
        state = self.where.state
        # the version right after ours, as RECEIVE described it: only what changed
        keys = (
            self._changed(offer.changed)
            if offer.changed
            and version == offer.version
            and version == state.version + 1
            and offer.bus == state.bus
            else None
        )
        target.copy_from(self.views[slot], keys)
        if self.sync_devices:  # GPU copies have read the slot
            synchronize(self.sync_devices)
        assert self.attachment is not None
        if not self.attachment.header.read_valid(slot, counter):
            return TORN
        return None

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


class AliasReader(Reader):
    """`Aliases`: the model points at the slot a version is in (a pointer swap)."""

    def _bind(self, layout: Layout, views: dict[Key, torch.device]) -> Target:
        return Target(self.model, layout, "alias", None, views)

    def _read(
        self, target: Target, offer: Offer, version: int, slot: int, counter: int
    ) -> tuple[int, int] | None:
        target.alias_to(self.views, slot)
        if self.sync_devices:  # no queued work reads the old slot
            synchronize(self.sync_devices)
        if target.copies_slices:  # DTensor slices copied, not aliased: rewritten since?
            assert self.attachment is not None
            if not self.attachment.header.read_valid(slot, counter):
                return TORN
        return (slot, counter)

    def torn(self, held: tuple[int, int] | None, attachment: CpuAttachment | None) -> bool:
        if held is None or attachment is None:
            return False
        synchronize(self.sync_devices)  # the block's GPU work has read the weights by now
        return not attachment.header.read_valid(*held)


def build(reads: Reads, model: Any, where: Where) -> Reader:
    """The reader a `Reads` option asks for."""
    if model is not None and isinstance(reads, Reads) and reads.device is not None:
        raise ValueError(
            f"reads={reads!r} names a device, which is for a Subscriber without a model: "
            "the model's tensors stay where they are (move the model to change it)"
        )
    if isinstance(reads, Copies):
        return CopyReader(reads, model, where)
    if isinstance(reads, Aliases):
        return AliasReader(reads, model, where)
    raise TypeError(f"reads= takes zmqsync.Copies() or zmqsync.Aliases(), not {reads!r}")


def synchronize(devices: tuple[torch.device, ...]) -> None:
    for device in devices:
        torch.cuda.synchronize(device)
