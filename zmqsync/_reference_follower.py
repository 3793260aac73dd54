"""A worker's per-version path in Python: the reference the native Follower is a twin of.

`ReferenceFollower.next` has the contract of ``_native.Follower.next``
(``_follower.c``): the same inputs, the same results, the same writes to the same
`WorkerState` under the same lock (but for the ``native`` counter, which counts the
versions the C took). It takes the next RECEIVE of the bus when the Link's
rule (`Link.on_receive`), the slot's seqlock (`Header.read_begin`) and the switch
(`Switch.point_at`, with the slot's holder already built; in copy mode the Target's
whole-slot copy and the seqlock read again) allow it, records it as
`Reader.apply` does, ACKs it and opens the waiters; anything else goes back
to the caller as the frame's bytes. tests/test_twin.py runs one frame stream through
both followers and compares the state after every frame.

It is what the agent uses when the extension is not there (or ZMQSYNC_NATIVE=0), so
the agent's loop has one way for both, and `can_take` says in one place whether either
may be used.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from ._apply import Switch
from ._buffers.header import Header
from ._fast_frames import read_receive
from ._worker_state import WorkerState

__all__ = ["ReferenceFollower", "can_take"]


def can_take(
    switch: Switch | None,
    *,
    copying: bool = False,
    mapped: bool,
    syncs_devices: bool,
    bus_id: str,
    applied_bus: str,
    link_bus: str,
    session: str,
) -> bool:
    """Whether a follower may take the versions that follow, now: the model is aliased
    on the CPU through a live `Switch` (a version is one pointer swap) or, `copying`, a
    copy-mode model is copied into, the buffers are mapped, no GPU must be synchronised,
    and a version of the mapped bus was applied on the session the Link holds. The one
    place this is decided, for both followers."""
    return (
        (copying or (switch is not None and switch.active and switch.swap is not None))
        and mapped
        and not syncs_devices
        and bool(bus_id)
        and applied_bus == bus_id
        and link_bus == bus_id
        and bool(session)
    )


class ReferenceFollower:
    """The native Follower's twin, in Python (see the module's docstring).

    Args:
        events: the agent's SUB socket (its RCVTIMEO bounds a `next`).
        acks: the agent's PUSH socket for ACKs.
        bus: the bus the RECEIVEs must name.
        ack_head: an ACK's bytes before its version (`template_pieces`).
        ack_tail: an ACK's bytes after its version.
        header: the mapped segment's header.
        slots: how many slots the bus has.
        switch: the model's `Switch` (None in copy mode).
        state: the worker's state, which this writes.
        lock: the Subscriber's lock, under which both followers record.
        opened: wakes the threads waiting for a version (a `Gate`'s open, or the
            waiters' wake).
        copy: copy mode: ``copy(slot)`` copies the whole slot into the model (False:
            it cannot, the Python way must); None in alias mode.
    """

    def __init__(
        self,
        *,
        events: zmq.Socket[bytes],
        acks: zmq.Socket[bytes],
        bus: str,
        ack_head: bytes,
        ack_tail: bytes,
        header: Header,
        slots: int,
        switch: Switch | None,
        state: WorkerState,
        lock: threading.RLock | threading.Lock,
        opened: Callable[[int], Any],
        copy: Callable[[int], bool] | None = None,
    ) -> None:
        self.events, self.acks, self.bus = events, acks, bus
        self.ack_head, self.ack_tail = ack_head, ack_tail
        self.header, self.slots, self.switch = header, slots, switch
        self.state, self.lock, self.opened = state, lock, opened
        self.copy = copy

    def next(
        self, last_seq: int, version: int, next_tick: float
    ) -> None | int | tuple[int] | bytes:
        """Receive on the events socket until there is something for the caller.

        Mirrors ``Follower.next`` (``_follower.c``): None when the receive timed out,
        the version last applied here when the clock reached `next_tick`, (version,)
        when its ACK could not be queued (the caller sends it again), or a frame's
        bytes for the caller to handle.
        """
        acking = False
        while True:
            if acking:
                if not self._ack(version):
                    return (version,)
                self.opened(version)
                acking = False
            try:
                frame = self.events.recv()
            except zmq.Again:
                return None
            taken = self._take(frame, last_seq, version)
            if taken is None:
                return frame
            last_seq, version = taken
            if time.monotonic() < next_tick:
                acking = True  # on the way back into the receive
                continue
            if not self._ack(version):
                return (version,)
            self.opened(version)
            return version

    def _take(self, frame: bytes, last_seq: int, version: int) -> tuple[int, int] | None:
        """Apply and record `frame` if it is the next RECEIVE and needs nothing but a
        switch; (seq, version) then, else None."""
        fields = read_receive(frame, self.bus)
        if fields is None:
            return None
        seq, new, slot, changed = fields
        if seq != last_seq + 1 or new <= version or slot >= self.slots:
            return None
        counter = self.header.read_begin(slot, new)
        if counter is None:
            return None
        held: tuple[int, int] | None = (slot, counter)
        if self.copy is not None:  # copy mode: whole versions, copied and still whole
            if changed or not self.copy(slot) or not self.header.read_valid(slot, counter):
                return None
            held = None
        elif not self._switch(slot):
            return None
        now = time.monotonic()
        with self.lock:  # as Reader.apply records, and Link.on_receive
            self.state.followed(new, held, seq, now)
        return seq, new

    def _switch(self, slot: int) -> bool:
        """Alias mode: point the model at `slot` if its holder is built (else False)."""
        switch = self.switch
        if switch is None or not switch.active or not 0 <= switch.at < self.slots:
            return False
        if slot != switch.at and (
            len(switch.holders) != self.slots or switch.holders[slot] is None
        ):
            return False  # its holder is not built yet: the Python way builds it
        switch.point_at(slot, {})
        return True

    def _ack(self, version: int) -> bool:
        frame = self.ack_head + msgpack.packb(version) + self.ack_tail
        try:
            self.acks.send(frame, zmq.DONTWAIT)
        except zmq.Again:
            return False
        return True
