"""How each way of writing a version (`_writes`) does it, behind one interface.

A publish is the same five steps whatever the mode (`Publisher.publish`): read, claim a
slot, write, announce, wait. The mode decides the first three and when the fourth
happens; the wait is `AckWait`'s. One class per mode:

* `CopyWrites`: read and check the weights, claim a free slot, copy them in under the
  seqlock, announce. With `skip_unchanged`, only the tensors that changed. With `flat`,
  the trainer's tensors live in one block laid out as a slot, kept in a slot of the
  segment (`HomeBlock`; `FlatBlock` in private memory without torch's pointer swap): a
  publish of every tensor checks one address per tensor, announces the home slot and
  moves the trainer on to the claimed one (`_write_home`).
* `OverlappedWrites`: the same, but what the optimizer writes is copied, and the version
  announced, by a writer thread while the trainer goes on (see `_overlap`).
* `LiveWrites`: the trainer's tensors are slot 0; a publish announces (and copies only
  tensors given to it that are not the slot's own).
* `Landing`: a relay's bytes land in a slot straight from the network; the relay stages
  each version (number, slot, bytes) and then publishes it. Private to relays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._acks import AckWait
from ._announcer import Announcer
from ._deadline import Deadline
from ._errors import ZmqSyncError
from ._flat import FlatBlock
from ._home import SWAP_DATA_PTR, HomeBlock
from ._layout import Key, flatten
from ._overlap import Pending, SideStreams, StepGuard, Writer
from ._slots import Slots
from ._source import Source, cast_to, trainer_tensors
from ._text import printable
from ._unchanged import Unchanged
from ._writes import Copy, Live, Overlapped, Writes

__all__ = ["Bound", "Landing", "Mode", "build"]

log = logging.getLogger(__name__)

Flat = dict[Key, torch.Tensor]
Named = frozenset[Key] | None  # the tensors a version changes (None: all of them)


@dataclasses.dataclass(frozen=True)
class Bound:
    """What a mode writes with, once its publisher started."""

    name: str
    slots: Slots
    announcer: Announcer
    acks: AckWait
    write_lock: threading.Lock  # also taken by the agent to copy a slot for a CPU reader
    timeout: float | None  # the publisher's default deadline


class Mode:
    """One publisher's way of writing versions (see the module doc)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.layout = source.layout  # what the slots hold
        self._bound: Bound | None = None

    @property
    def bound(self) -> Bound:
        if self._bound is None:
            raise ZmqSyncError("the publisher is not started")
        return self._bound

    def slot_count(self, asked: int) -> int:
        return asked

    def lag_room(self, slots: int, alias: bool) -> int | None:
        """The largest ``max_lag`` under which the next publish still finds a free slot at
        once (None: any). A worker `k` versions behind may be reading any of the `k`
        versions after the one it applied, and an alias worker also pins that one: the
        oldest slot is free only if ``k <= slots - 1`` (``slots - 2`` with alias workers).
        """
        return max(0, slots - 1 - alias)

    def start(self, name: str, slots: Slots, stack: contextlib.ExitStack) -> None:
        """Write version 0 into slot 0, before the bus opens (`stack` undoes on close
        what needs undoing)."""
        slots.write(0, 0, flatten(self.source.weights), mirror=False)

    def bind(self, bound: Bound, stack: contextlib.ExitStack) -> None:
        """The bus is open: from now on versions are written with `bound`."""
        self._bound = bound

    def read(self, weights: Any, named: Named) -> tuple[Flat, Named]:
        """The tensors a publish writes, checked, and which of them changed (None: all)."""
        return self.source.read(weights, named), named

    def version(self, latest: int) -> int:
        return latest + 1

    def claim(self, deadline: Deadline) -> int:
        return self.bound.acks.claim_slot(deadline)

    def write(
        self, slot: int, version: int, flat: Flat, named: frozenset[Key] | None
    ) -> Pending | None:
        """Write and announce `version`; a `Pending` when that finishes in the background."""
        raise NotImplementedError

    def settle(self, deadline: Deadline) -> None:
        """Wait until no version is still being written in the background."""


class CopyWrites(Mode):
    def __init__(
        self,
        source: Source,
        dtype: torch.dtype | None,
        skip_unchanged: bool | str,
        flat: bool = False,
    ) -> None:
        super().__init__(source)
        if dtype is not None:
            self.layout = cast_to(source, dtype)
        self.cast = dtype is not None
        self._unchanged: Unchanged | None = None
        self._verify = skip_unchanged == "verify"
        self._skip = bool(skip_unchanged)
        self._flat = flat
        self._block: FlatBlock | HomeBlock | None = None  # the flat layout's, while it holds
        self._whole: Flat | None = None  # the read that the block holds, to write whole
        self._refusal = self._why_not_flat() if flat else None
        # the block kept in a slot of its own (`_home`): one slot more than asked
        self._homed = flat and self._refusal is None and SWAP_DATA_PTR is not None

    def _why_not_flat(self) -> str | None:
        if self.source.cuda_devices:
            return "weights on a GPU"
        return FlatBlock.refusal(trainer_tensors(self.source.weights), self.layout)

    def slot_count(self, asked: int) -> int:
        # Asked once, before start. With one slot asked, that slot is rewritten in place
        # under alias readers (see `Registry`): a home beside it would leave a publish no
        # slot to claim while an alias worker holds the other, so the block stays private.
        self._homed = self._homed and asked >= 2
        return asked + 1 if self._homed else asked

    def lag_room(self, slots: int, alias: bool) -> int | None:
        return super().lag_room(slots - 1 if self._homed else slots, alias)

    def start(self, name: str, slots: Slots, stack: contextlib.ExitStack) -> None:
        super().start(name, slots, stack)
        if self._skip:
            self._unchanged = Unchanged(name, self._verify)
            self._unchanged.note(flatten(self.source.weights, detach=False), None)
        if self._flat:
            self._adopt(name, slots, stack)

    def _adopt(self, name: str, slots: Slots, stack: contextlib.ExitStack) -> None:
        """The flat layout: the trainer's tensors move into one block, kept in slot 1
        (`HomeBlock`, which version 0 in slot 0 is copied into) or, without torch's
        pointer swap, in private memory (`FlatBlock`)."""
        if self._refusal is not None:
            log.warning("publisher %r: no flat layout (%s); publishes copy tensor by "
                        "tensor", name, printable(self._refusal))  # fmt: skip
            return
        tensors = trainer_tensors(self.source.weights)
        if not self._homed:
            block = FlatBlock(self.layout)
            block.adopt(tensors)
            self._block = block
            return
        slots.begin(1)
        slots.flat(1).copy_(slots.flat(0))
        home = HomeBlock(self.layout, [slots.flat(i) for i in range(slots.count)], 1)
        stack.callback(home.move_out)  # before the segment goes, or if a later step fails
        home.adopt(tensors)
        self._block = home

    def bind(self, bound: Bound, stack: contextlib.ExitStack) -> None:
        super().bind(bound, stack)
        if isinstance(self._block, HomeBlock):
            bound.announcer.reserve(self._block.slot)

    def read(self, weights: Any, named: Named) -> tuple[Flat, Named]:
        self._whole = None
        block = self._block
        if block is not None and weights is None and named is None:
            if self._unchanged is None and block.in_place() and self.source.at(block.addresses()):
                self._whole = {}  # the block is the version: nothing else is read
                return self._whole, None
            flat = self.source.reread()
            if block.holds(flat):  # every tensor where adopt put it: the block is the version
                self._whole = flat
                return self._read_changed(flat, named)
            self._leave(block, flat)
        return self._read_changed(self.source.read(weights, named), named)

    def _leave(self, block: FlatBlock | HomeBlock, flat: Flat) -> None:
        """A tensor left the block: from now on every publish copies tensor by tensor."""
        moved = block.moved(flat)
        names = ", ".join(printable(".".join(k)) for k in moved[:5])
        log.warning(
            "publisher %r: %d tensors were re-allocated by the trainer and left the flat "
            "layout (%s%s); publishing tensor by tensor from now on. Update tensors in "
            "place (load_state_dict without assign=True, copy_) to keep it",
            self.bound.name, len(moved) or 1, names or "its block moved",
            ", ..." if len(moved) > 5 else "",
        )  # fmt: skip
        self._block = None
        if isinstance(block, HomeBlock):  # what stayed in the home slot moves out; the
            block.move_out()  # slot is an ordinary one again
            self.bound.announcer.reserve(None)

    def _read_changed(self, flat: Flat, named: Named) -> tuple[Flat, Named]:
        if self._unchanged is not None and named is None:
            bound = self.bound

            def latest() -> Mapping[Key, torch.Tensor]:
                return bound.slots.latest_views()

            with bound.write_lock:
                named = self._unchanged.written_since(flat, latest)
        return flat, named

    def write(
        self, slot: int, version: int, flat: Flat, named: frozenset[Key] | None
    ) -> Pending | None:
        slots, announcer = self.bound.slots, self.bound.announcer
        block, whole = self._block, self._whole is flat
        if named is None and whole and isinstance(block, HomeBlock):
            self._write_home(block, slot, version)
            self._note(flat, None)
            return None
        with self.bound.write_lock:  # a worker reading the CPU copy joins before or after
            mirror = announcer.needs_mirror()
            if named is None and whole and isinstance(block, FlatBlock):
                slots.write_block(slot, version, block)
            elif named is None:
                slots.write(slot, version, flat, mirror=mirror)
            else:
                slots.begin(slot)
                slots.copy(slot, flat, named, mirror=mirror)
                slots.refresh(slot, slots.stale(slot, named))
                slots.finish(slot, version, named, mirror=mirror)
            announcer.record(version, slot, announcer.size_of(named))
        announcer.send(version, slot, named)
        self._note(flat, named)
        return None

    def _write_home(self, home: HomeBlock, slot: int, version: int) -> None:
        """Announce the home slot as `version`, as the trainer wrote it, and make `slot`
        (claimed: no worker holds it) the new home, with the home's bytes.

        With a copy-mode worker on the bus the copy into `slot` runs after the
        announcement, beside the workers' copies out of the old home. With none (alias
        workers only) nothing would run beside it: the copy comes first, on free cores,
        as a write into a free slot would.
        """
        slots, announcer, lock = self.bound.slots, self.bound.announcer, self.bound.write_lock
        announced, beside = home.slot, announcer.copy_readers()
        with lock:
            slots.begin(slot)
        if not beside:
            home.move_to(slot, alone=True)  # a failure leaves the trainer home, unannounced
        with lock:
            slots.finish(announced, version)
            announcer.record(version, announced, announcer.size_of(None))
            announcer.reserve(slot)
        try:
            announcer.send(version, announced, None)
        finally:
            if beside:  # the trainer never writes a slot announced as a version
                home.move_to(slot, alone=False)

    def _note(self, flat: Flat, named: frozenset[Key] | None) -> None:
        if self._unchanged is not None:
            self._unchanged.note(flat, named)


class OverlappedWrites(CopyWrites):
    def __init__(
        self,
        source: Source,
        optimizers: tuple[torch.optim.Optimizer, ...],
        dtype: torch.dtype | None,
        skip_unchanged: bool | str,
    ) -> None:
        super().__init__(source, dtype, skip_unchanged)
        self._optimizers = optimizers
        self._guard: StepGuard | None = None
        self._writer: Writer | None = None
        self._pending: Pending | None = None  # the version copied in the background
        self._streams = SideStreams()

    def bind(self, bound: Bound, stack: contextlib.ExitStack) -> None:
        super().bind(bound, stack)
        # closed before the agent stops: a version still pending goes out first
        self._guard = StepGuard(
            self._optimizers, bound.timeout, functools.partial(bound.acks.blocked, in_step=True)
        )
        stack.callback(self._guard.remove)
        self._writer = Writer(bound.name)
        stack.callback(self._writer.close)

    def settle(self, deadline: Deadline) -> None:
        if self._pending is not None:
            self._pending.wait(deadline.remaining())
            self._pending = None

    def write(
        self, slot: int, version: int, flat: Flat, named: frozenset[Key] | None
    ) -> Pending | None:
        """Copy now what the optimizer does not write; leave the rest to the writer thread,
        which then records and announces the version (see `_overlap`)."""
        bound, guard, writer = self.bound, self._guard, self._writer
        assert guard is not None and writer is not None
        slots, announcer, streams = bound.slots, bound.announcer, self._streams
        every = slots.key_set if named is None else named
        owned = guard.owned()
        late = frozenset(k for k in every if id(flat[k]) in owned)
        with bound.write_lock:
            mirror = announcer.needs_mirror()
            slots.begin(slot)
            slots.copy(slot, flat, every - late, mirror=mirror)
            if named is not None:
                slots.refresh(slot, slots.stale(slot, named))
        # CUDA: the side streams start after what the trainer queued so far (the copies
        # just made included), and every copy of this version is on them
        devices = sorted({flat[k].device for k in every if flat[k].is_cuda}, key=str)
        before = streams.events(devices)
        on_gpu = bool(late) and all(flat[k].is_cuda for k in late) and not mirror

        def finish(pending: Pending) -> None:  # on the writer thread
            with bound.write_lock, streams.on(devices, after=before):
                slots.copy(slot, flat, late, mirror=mirror)
                if pending.on_gpu:  # a step may go on once its streams wait for these
                    pending.copied = streams.events(devices)
                    pending.queued.set()
                slots.finish(slot, version, named, mirror=mirror)  # syncs the side streams
                announcer.record(version, slot, announcer.size_of(named))
            announcer.send(version, slot, named)

        pending = writer.submit(finish, on_gpu=on_gpu)
        guard.pending = self._pending = pending
        self._note(flat, named)
        return pending


class LiveWrites(Mode):
    def __init__(self, source: Source) -> None:
        super().__init__(source)
        if source.cuda_devices:
            raise NotImplementedError("Live() shares CPU tensors; these are on a GPU")
        self._moved: list[tuple[torch.Tensor, int]] = []  # (trainer tensor, its view)

    def slot_count(self, asked: int) -> int:
        return 1  # the trainer's tensors are slot 0

    def lag_room(self, slots: int, alias: bool) -> int | None:
        return None  # slot 0 is the trainer's tensors, rewritten in place: none to wait for

    def start(self, name: str, slots: Slots, stack: contextlib.ExitStack) -> None:
        super().start(name, slots, stack)
        stack.callback(self._move_out)  # undone on close, or if a later step fails
        self._move_in(slots.views(0))

    def read(self, weights: Any, named: Named) -> tuple[Flat, Named]:
        if weights is None:  # the slot is the trainer's tensors: nothing to read
            return {}, named
        return super().read(weights, named)

    def claim(self, deadline: Deadline) -> int:
        return 0

    def write(
        self, slot: int, version: int, flat: Flat, named: frozenset[Key] | None
    ) -> Pending | None:
        bound = self.bound
        written = 0  # the trainer writes the slot itself: only copies made here count
        with bound.write_lock:  # copy only what was given and is not the slot's own
            bound.slots.begin(slot)
            views = bound.slots.views(slot)
            with torch.no_grad():
                for key, tensor in flat.items():
                    if tensor.data_ptr() != views[key].data_ptr():
                        views[key].copy_(tensor)
                        written += views[key].nbytes
            bound.slots.finish(slot, version, named)
            bound.announcer.record(version, slot, written)
        bound.announcer.send(version, slot, named)
        return None

    def _move_in(self, views: Mapping[Key, torch.Tensor]) -> None:
        """Each trainer tensor's storage becomes its view in the slot (which holds its
        values already); a Parameter stays the same object, so optimizers keep working.
        `_moved` lists each one as it goes, so that a failure half-way is undone too."""
        with torch.no_grad():
            for key, tensor in trainer_tensors(self.source.weights).items():
                view = views[key]
                tensor.data = view
                self._moved.append((tensor, view.data_ptr()))

    def _move_out(self) -> None:
        """Give the trainer's tensors private copies before the segment goes."""
        moved, self._moved = self._moved, []
        with torch.no_grad():
            for tensor, view_ptr in moved:
                if tensor.data_ptr() == view_ptr:  # not replaced by the trainer since
                    tensor.data = tensor.data.clone()


@dataclasses.dataclass(frozen=True)
class _Staged:
    version: int
    fill: Callable[[torch.Tensor], None]
    slot: int | None


class Landing(Writes, Mode):
    """A relay's publisher: each version's bytes are written by the relay (`stage`),
    often straight from the network into a slot it reserved long before.

    Not for trainers (it is not exported): a relay calls `reserve`, `open` and `stage`,
    then its publisher's ``publish(max_lag=None)``; the version keeps the root's number.
    """

    def __init__(self) -> None:
        self._staged: _Staged | None = None
        self._bound = None

    def adopt(self, source: Source) -> Landing:
        Mode.__init__(self, source)
        return self

    def reserve(self) -> int | None:
        """A slot the next staged version may name, or None while every slot is held. It
        stays free until then: only a publish makes a slot held (workers join at the
        latest version, and acks only release)."""
        return self.bound.acks.free_slot()

    def open(self, slot: int) -> torch.Tensor:
        """`slot` (from `reserve`) as flat bytes, marked as being written already."""
        return self.bound.slots.open(slot)

    def stage(
        self, version: int, fill: Callable[[torch.Tensor], None], slot: int | None = None
    ) -> None:
        """The next publish writes `version` with `fill(slot bytes)`, into `slot` (from
        `reserve`) if given, else into the slot the publisher claims."""
        self._staged = _Staged(version, fill, slot)

    def _take(self) -> _Staged:
        if self._staged is None:
            raise ZmqSyncError("a relay's bus publishes only what it received: stage() first")
        return self._staged

    def read(self, weights: Any, named: Named) -> tuple[Flat, Named]:
        if weights is not None or named is not None:
            raise ValueError("a relay's bus publishes the bytes it received: no weights or keys")
        return {}, None

    def version(self, latest: int) -> int:
        version = self._take().version
        if version <= latest:
            raise ValueError(f"version {version} is not greater than the last ({latest})")
        return version

    def claim(self, deadline: Deadline) -> int:
        slot = self._take().slot
        if slot is None:
            return super().claim(deadline)
        if not (0 <= slot < self.bound.slots.count and self.bound.acks.is_free(slot)):
            raise ZmqSyncError(f"slot {slot} is not free: take one from reserve()")
        return slot

    def write(
        self, slot: int, version: int, flat: Flat, named: frozenset[Key] | None
    ) -> Pending | None:
        staged, self._staged = self._take(), None
        bound = self.bound
        with bound.write_lock:
            with bound.slots.writing(slot, version):
                staged.fill(bound.slots.flat(slot))
            bound.announcer.record(version, slot, bound.announcer.size_of(None))
        bound.announcer.send(version, slot, None)
        return None


def build(writes: Writes, source: Source) -> Mode:
    """The mode a `Writes` option asks for, over `source`."""
    if isinstance(writes, Copy):
        return CopyWrites(source, writes.dtype, writes.skip_unchanged, writes.flat)
    if isinstance(writes, Overlapped):
        return OverlappedWrites(source, writes.optimizers, writes.dtype, writes.skip_unchanged)
    if isinstance(writes, Live):
        return LiveWrites(source)
    if isinstance(writes, Landing):
        return writes.adopt(source)
    raise TypeError(f"writes= takes Copy(), Overlapped(optimizer) or Live(), not {writes!r}")
