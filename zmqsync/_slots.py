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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from ._buffers import CpuSegment, SharedBuffer
from ._copy import WritePlan, write_plan
from ._layout import Key, Layout
from ._protocol import BufferInfo

__all__ = ["Slots"]


class Slots:
    """The segment's slots (and their CUDA twins): views, writes, the latest version."""

    def __init__(
        self, layout: Layout, segment: CpuSegment, cuda: Sequence[SharedBuffer] = ()
    ) -> None:
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
        self._plans: list[WritePlan] = [
            write_plan(self._views[s], self._cuda_views[s] if self._cuda_views else None)
            for s in range(self.count)
        ]

    @property
    def cuda(self) -> bool:
        """Whether some tensors live in CUDA buffers."""
        return bool(self._cuda)

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
        header = self.header
        header.begin_write(slot)
        yield self._views[slot]
        for device in self._streams:  # the bytes are in place before the header says so
            torch.cuda.current_stream(device).synchronize()
        header.end_write(slot, version)
        header.set_latest(version, slot)

    def write(
        self, slot: int, version: int, flat: Mapping[Key, torch.Tensor], *, mirror: bool
    ) -> None:
        """Write `flat` (checked against the layout) into `slot` as `version`; `mirror`:
        CUDA tensors to the CPU segment too (a worker reads it)."""
        plan = self._plans[slot]
        with self.writing(slot, version):
            plan.run(flat, mirror=mirror)
        if plan.gpu:
            self.mirrored[slot] = mirror

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
        views = self._views[slot]
        with torch.no_grad():
            for key, view in self._cuda_views[slot].items():
                views[key].copy_(view)
        self.mirrored[slot] = True
