"""The slots of a bus: where each version's bytes are written, under the seqlock.

A publisher owns one CPU segment (a header page, then `count` slots of `slot_bytes`)
and, for CUDA weights, one CUDA buffer per device with the same slots. `Slots` is the
one place that writes them:

* A write happens inside `writing(slot, version)`: the slot's seqlock counter is odd
  from before the first byte lands until after the last one (CUDA work included: the
  streams are synchronized first), then the slot is marked as holding `version` and the
  header names it the latest. A reader that saw the counter move discards what it read.
  An exception inside leaves the slot marked incomplete: the version is never announced.
* Which slot may be written is not decided here: that is the registry's rule (a slot a
  live worker holds is never written), applied by the publisher before it calls in.
* CUDA weights have a CPU copy in the segment only while a worker reads the CPU
  segment (`mirrored`): every write then makes it, and a joining worker gets one made
  for the current slot first (`fill_mirror`).
* A write may come in parts (`begin`, `copy` as often as needed, `finish`): tensors the
  optimizer writes are copied in the background while the rest is copied at once.
* A trainer whose tensors live in a `FlatBlock` (the flat layout: laid out as a slot)
  is written whole by one copy of the block (`write_block`). One whose block is a slot
  itself (`HomeBlock`) writes that slot directly: a publish only `finish`es it, and
  `begin`s the next home.
* **Slots stay exact under partial publishes.** A version may change only some tensors
  (`keys=`); the others keep their values. A slot about to be reused gets the named
  tensors from the trainer and every other tensor that changed since the version it
  last held from the latest slot (`stale`), so each slot holds one whole version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from ._buffers import CpuSegment, SharedBuffer
from ._copy import ByteCopies, WritePlan, write_plan
from ._flat import FlatBlock
from ._layout import Key, Layout
from ._protocol import BufferInfo

__all__ = ["Slots"]


class Slots:
    """The segment's slots (and their CUDA twins): views, writes, the latest version."""

    def __init__(
        self,
        layout: Layout,
        segment: CpuSegment,
        cuda: Sequence[SharedBuffer] = (),
        *,
        cast: bool = False,
    ) -> None:
        """`cast`: what is written has other dtypes than the slots hold (torch casts)."""
        self.layout = layout
        self.count = segment.slots
        self.header = segment.header  # the seqlock and the latest version
        self._segment = segment
        self._cuda = list(cuda)
        self._views = [layout.views(segment.slot(i)) for i in range(self.count)]
        self._cuda_views: list[dict[Key, torch.Tensor]] = []
        if self._cuda:
            self._cuda_views = [
                {
                    key: view
                    for index, buffer in enumerate(self._cuda, start=1)
                    for key, view in layout.views(buffer.slot(slot), index).items()
                }
                for slot in range(self.count)
            ]
        # per slot: the CPU segment holds a copy of its CUDA tensors
        self.mirrored = [False] * self.count
        gpu_views = self._cuda_views[0].values() if self._cuda_views else ()
        self._streams = sorted({v.device for v in gpu_views if v.is_cuda}, key=str)
        self._cast = cast
        self._plans: list[WritePlan] = [
            write_plan(self._views[s], self._cuda_views[s] if self._cuda_views else None, cast=cast)
            for s in range(self.count)
        ]
        self._subset_plans: dict[tuple[int, frozenset[Key]], WritePlan] = {}
        self._block_plans: dict[int, tuple[FlatBlock, ByteCopies]] = {}
        self.keys = tuple(self._views[0]) if self._views else ()
        self.key_set = frozenset(self.keys)
        self._whole_at = -1  # the last version written whole
        self._changed_at: dict[Key, int] = {}  # since then: the version a tensor changed in
        self._holds = [-1] * self.count  # the version each slot holds (-1: none yet)
        self._latest_slot = -1

    @property
    def cuda(self) -> bool:
        """Whether some tensors live in CUDA buffers."""
        return bool(self._cuda)

    def latest_views(self) -> dict[Key, torch.Tensor]:
        """The CPU views of the slot that holds the latest version."""
        return self._views[self._latest_slot]

    def views(self, slot: int) -> dict[Key, torch.Tensor]:
        """Every tensor of `slot` in the CPU segment (CUDA tensors: their CPU copies)."""
        return self._views[slot]

    def flat(self, slot: int) -> torch.Tensor:
        """`slot`'s bytes in the CPU segment, as one flat uint8 tensor."""
        return self._segment.slot(slot)

    def describe(self) -> tuple[BufferInfo, ...]:
        """What a WELCOME says of the buffers: the CPU segment first, then each GPU's."""
        return (self._segment.describe(), *(b.describe() for b in self._cuda))

    @contextlib.contextmanager
    def writing(self, slot: int, version: int) -> Iterator[Mapping[Key, torch.Tensor]]:
        """Write `slot` inside the block (it yields the slot's CPU views); on leaving it,
        mark the slot as holding `version` and name it the latest (see the module doc)."""
        self.begin(slot)
        yield self._views[slot]
        self.finish(slot, version)

    def write(
        self, slot: int, version: int, flat: Mapping[Key, torch.Tensor], *, mirror: bool
    ) -> None:
        """Write `flat` (checked against the layout) into `slot` as `version`; `mirror`:
        CUDA tensors to the CPU segment too (a worker reads it)."""
        self.begin(slot)
        self.copy(slot, flat, mirror=mirror)
        self.finish(slot, version, mirror=mirror)

    def write_block(self, slot: int, version: int, block: FlatBlock) -> None:
        """Write `block` (the trainer's tensors, laid out as a slot) into `slot` as
        `version`: one copy of the slot's bytes. CPU slots of the block's dtypes only."""
        if self._cuda or self._cast:
            raise ValueError("a flat block is written into CPU slots of its own dtypes only")
        plan = self._block_plans.get(slot)
        if plan is None or plan[0] is not block:
            plan = (block, block.copies(self.flat(slot), into_slot=True))
            self._block_plans[slot] = plan
        self.begin(slot)
        # one native copy (shared among threads from SHARED_COPY_MIN up to SHARED_COPY_MAX,
        # whole past it), not torch's
        # copy_: its OpenMP threads took 6-7 ms for these 4 MB beside a copy-mode worker
        # (0.28 ms here)
        plan[1].run()
        self.finish(slot, version)

    # --- a write in parts -------------------------------------------------------------

    def begin(self, slot: int) -> None:
        """Mark `slot` as being written (odd counter) before its first byte lands."""
        self.header.begin_write(slot)

    def copy(
        self,
        slot: int,
        flat: Mapping[Key, torch.Tensor],
        keys: frozenset[Key] | None = None,
        *,
        mirror: bool,
    ) -> None:
        """Copy `flat`'s tensors (only `keys`, if given) into `slot` (after `begin`)."""
        if keys is not None and not keys:
            return
        plan = self._plans[slot] if keys is None else self._subset(slot, keys)
        plan.run(flat, mirror=mirror)

    def stale(self, slot: int, named: frozenset[Key]) -> frozenset[Key]:
        """Tensors not in `named` that `slot` holds older values of than the latest."""
        held = self._holds[slot]
        if self._whole_at > held:
            return self.key_set - named
        return frozenset(k for k, v in self._changed_at.items() if k not in named and v > held)

    def refresh(self, slot: int, keys: frozenset[Key]) -> None:
        """Copy `keys` into `slot` from the latest slot (they did not change since)."""
        if not keys:
            return
        source = self._latest_slot
        with torch.no_grad():
            for key in keys:
                self._views[slot][key].copy_(self._views[source][key])
                if self._cuda_views and key in self._cuda_views[slot]:
                    self._cuda_views[slot][key].copy_(self._cuda_views[source][key])

    def finish(
        self,
        slot: int,
        version: int,
        changed: frozenset[Key] | None = None,
        *,
        mirror: bool = False,
    ) -> None:
        """End a write: the bytes are in place (GPU work included), `slot` holds
        `version`, which is the latest; `changed`: the tensors it changed (None: all)."""
        if self._cuda_views and mirror and changed is not None and changed != self.key_set:
            self._mirror_all(slot)  # a partial write: every tensor's CPU copy, not just its
        for device in self._streams:  # the bytes are in place before the header says so
            torch.cuda.current_stream(device).synchronize()
        self.header.end_write(slot, version)
        self.header.set_latest(version, slot)
        if changed is None or changed == self.key_set:
            self._whole_at = version  # older per-tensor versions no longer decide anything
            self._changed_at.clear()
        else:
            for key in changed:
                self._changed_at[key] = version
        self._holds[slot], self._latest_slot = version, slot
        if self._cuda_views:
            self.mirrored[slot] = mirror

    def _subset(self, slot: int, keys: frozenset[Key]) -> WritePlan:
        plan = self._subset_plans.get((slot, keys))
        if plan is None:
            if len(self._subset_plans) > 64:  # the few subsets a trainer uses, not all
                self._subset_plans.clear()
            views = {k: v for k, v in self._views[slot].items() if k in keys}
            gpu = self._cuda_views[slot] if self._cuda_views else {}
            gpu_views = {k: v for k, v in gpu.items() if k in keys} or None
            plan = write_plan(views, gpu_views, cast=self._cast)
            self._subset_plans[(slot, keys)] = plan
        return plan

    def open(self, slot: int) -> torch.Tensor:
        """`slot`'s flat bytes, marked as being written from now on.

        For bytes that land long before the version is published (a relay receives
        them from the network): a reader that is not a holder (an evicted worker
        finishing a copy) must see the seqlock move, as for any write.
        """
        self.header.begin_write(slot)
        return self.flat(slot)

    def fill_mirror(self, slot: int) -> None:
        """Copy `slot`'s CUDA tensors into the CPU segment, once (under the write lock).

        Nobody reads that copy yet: the worker it is for gets its WELCOME afterwards, and
        while another such worker was on the bus every version was copied already.
        """
        if not self._cuda_views or self.mirrored[slot]:
            return
        self._mirror_all(slot)
        self.mirrored[slot] = True

    def _mirror_all(self, slot: int) -> None:
        views = self._views[slot]
        with torch.no_grad():
            for key, view in self._cuda_views[slot].items():
                views[key].copy_(view)
