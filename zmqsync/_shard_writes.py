"""The host rank's way of writing a sharded trainer's versions (a `Mode`).

The host is the rank that owns the bus (sockets, segment, slots). Each publish is the
usual five steps (`Publisher.publish`), with the other ranks joining in the write
(`_rank_page` has the whole exchange): read and check this rank's tensors; claim a slot
no worker holds; mark it being written and post it to the peers; write this rank's
pieces and every plain tensor while the peers write theirs; once every rank wrote,
complete the slot and announce the version. A rank that dies, stalls or fails leaves
the slot incomplete and unannounced: workers keep the last complete version, and every
rank's publish() raises, naming it.

Publish numbers: every call of publish() on every rank is one number, counted the same
everywhere (start's version 0 is number 0), failed ones included.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ._deadline import Deadline
from ._layout import Key, Layout
from ._lifecycle import signals_held
from ._overlap import Pending
from ._rank_page import RankPage, RanksFailed, page_name
from ._shard_peer import ShardPeer
from ._shards import Shards, ShardWriter
from ._slots import Slots
from ._source import Source, cast_to
from ._write_modes import Flat, Mode, Named
from ._writes import Copy, Writes

__all__ = ["ShardedWrites", "sharded_mode"]


class ShardedWrites(Mode):
    """The host's mode for DTensor weights (see the module doc). CPU meshes; written as
    ``Copy()`` writes (every tensor re-read and written at each publish), cast on the way
    with ``Copy(dtype=...)``."""

    def __init__(
        self, source: Source, shards: Shards, layout: Layout, shm_dir: str, timeout: float | None
    ) -> None:
        """`layout`: what the slots hold (`source`'s, or cast by ``Copy(dtype=)``)."""
        super().__init__(source)
        self.layout = layout
        self.shards = shards
        self._shm_dir = shm_dir
        self._timeout = timeout
        self._writer = ShardWriter(self.layout, shards)
        self._page: RankPage | None = None
        self._number = 0  # the publish being written
        self._deadline = Deadline(timeout)

    def peer(self, name: str, slots: int) -> ShardPeer | None:
        """What this rank is, if it does not host the bus: a writer of its shards."""
        if self.shards.host:
            return None
        return ShardPeer(name, self.source, self.layout, self.shards, slots, self._shm_dir,
                         self._timeout)  # fmt: skip

    @property
    def page(self) -> RankPage:
        if self._page is None:
            raise RanksFailed("the sharded publisher is not started")
        return self._page

    def start(self, name: str, slots: Slots, stack: contextlib.ExitStack) -> None:
        """Open the page (the peers wait for it), then write version 0 with them."""
        with signals_held():  # the page's file is made and handed to `stack` as one step
            page = RankPage.create(
                self._shm_dir, page_name(name, self.shards.bus_id), len(self.shards.ranks),
                self.shards.digest,
            )  # fmt: skip
            stack.callback(page.close, unlink=True)
        self._page = page
        slots.begin(0)
        page.go(0, 0, 0)
        self._write_and_wait(slots.views(0), self.source.read(None, None), 0, 0)
        slots.finish(0, 0)
        page.outcome(0)

    def read(self, weights: Any, named: Named) -> tuple[Flat, Named]:
        self._number += 1
        try:
            if named is not None:
                raise NotImplementedError(
                    "a sharded publisher publishes every tensor: publish(keys=...) is not "
                    "supported with DTensor weights"
                )
            return self.source.read(weights, None), None
        except BaseException:
            self.page.outcome(self._number, 0)  # the peers stop waiting for a slot
            raise

    def claim(self, deadline: Deadline) -> int:
        self._deadline = deadline
        try:
            return super().claim(deadline)
        except BaseException:
            self.page.outcome(self._number, 0)
            raise

    def write(
        self, slot: int, version: int, flat: Flat, named: frozenset[Key] | None
    ) -> Pending | None:
        bound, page, number = self.bound, self.page, self._number
        deadline = self._deadline
        if deadline.expired():  # the claim evicted at its deadline: the write gets it anew
            deadline = Deadline(deadline.total)
        with bound.write_lock:
            bound.slots.begin(slot)
            page.go(number, slot, version)
            self._write_and_wait(bound.slots.views(slot), flat, number, version, deadline)
            bound.slots.finish(slot, version)
            # every rank wrote its part: the version's bytes are written, as in any mode
            bound.announcer.record(version, slot, bound.announcer.size_of(None))
        page.outcome(number)
        bound.announcer.send(version, slot, None)
        return None

    def _write_and_wait(
        self,
        views: Any,
        flat: Flat,
        number: int,
        version: int,
        deadline: Deadline | None = None,
    ) -> None:
        """Write this rank's part, then wait for every peer's; a failure of either is
        posted as the outcome (the peers raise too) and raised here."""
        page = self.page
        try:
            self._writer.write(views, flat)
        except BaseException:
            page.outcome(number, 0)
            raise
        page.wait_written(number, version, deadline or Deadline(self._timeout))


def sharded_mode(
    source: Source, writes: Writes, bus_id: str, shm_dir: str, timeout: float | None
) -> ShardedWrites | None:
    """The mode of a publisher built from DTensors (None for plain weights), once every
    rank agreed on the host's bus id: a collective, so every rank builds its Publisher.

    Raises:
        NotImplementedError: DTensor weights with another `writes=` than ``Copy()``.
        TypeError: DTensors that cannot be published (see `Shards`).
    """
    if not source.sharded:
        return None
    if not isinstance(writes, Copy) or writes.skip_unchanged or writes.flat:
        raise NotImplementedError(
            f"DTensor weights are written with Copy() or Copy(dtype=...) (each rank its "
            f"shards), not {writes!r}; leave writes= out"
        )
    layout = cast_to(source, writes.dtype) if writes.dtype is not None else source.layout
    shards = Shards.of(source.flat, layout)
    shards.agree(bus_id)
    return ShardedWrites(source, shards, layout, shm_dir, timeout)
