"""The flat layout's block kept in a slot: a version is announced where the trainer wrote it.

With the block in private memory (`FlatBlock`) a publish is two copies in a row: the
trainer's block into a free slot, then each copy-mode worker's copy out of it. When the
block is a slot of the segment itself, the *home* slot, a publish announces that slot as
it is and, while the workers read it, copies it into the next free slot, which becomes
the home: the trainer's tensors move there with one swap of their storage's data pointer
(torch's ``_swap_data_ptr_``, as an alias worker's `Switch` switches versions). The two
copies run side by side, as the N+1-copies floor runs them.

What holds:

* The home slot is never announced while it is the home, and the registry never hands it
  out (`Registry.reserve`). Its seqlock counter is odd from the moment it becomes the
  home until the publish that announces it: a reader that thinks it holds an older
  version sees it move.
* The trainer's tensors view one storage, `model`, which holds the home slot's pointer.
  Every other slot's pointer is held by a storage of its own (`_holders`, made by
  ``torch.from_dlpack`` over a view of the mapping, so that whichever storage holds a
  slot's pointer keeps the mapping alive). A rotation swaps `model` with the next
  home's holder: the ``Parameter`` objects, their storage object and every view of it
  stay the same; only their addresses change, at every publish.
* A rotation happens on the publishing thread, inside the publish: between the
  announcement and the swap nothing but the copy touches the old home.
* Before the segment goes (the bus closes, or a tensor the trainer re-allocated ends the
  flat layout), `move_out` moves the model to private memory, by the same swap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.dlpack import from_dlpack

from ._copy import SHARED_COPY_MAX, SHARED_COPY_MIN, STREAM_COPY_MIN, ByteCopies
from ._flat import FlatBlock
from ._layout import Key, Layout
from ._places import pack

__all__ = ["HomeBlock", "SWAP_DATA_PTR"]

# torch's own swap of two storages' data pointers (a private method of UntypedStorage,
# present in the torch of constraints.txt), shared with alias mode's `Switch`. Without
# it the flat layout keeps its block in private memory (`FlatBlock`).
SWAP_DATA_PTR: Callable[[Any, Any], None] | None = getattr(
    torch.UntypedStorage, "_swap_data_ptr_", None
)

_DATA_PTR: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr


class HomeBlock:
    """The trainer's tensors as views of the home slot, moved along the slots (module doc)."""

    __slots__ = ("model", "views", "keys", "slot", "_slots", "_holders", "_bases", "_offsets",
                 "_addresses", "_packed", "_nbytes", "_copies")  # fmt: skip

    def __init__(self, layout: Layout, slots: Sequence[torch.Tensor], home: int) -> None:
        """`slots`: every slot's flat uint8 bytes; the model starts at slot `home`."""
        assert SWAP_DATA_PTR is not None
        self._nbytes = layout.slot_bytes
        self._slots = list(slots)
        self._holders: list[torch.UntypedStorage | None] = [
            from_dlpack(slot).untyped_storage() for slot in slots
        ]
        self._bases = [slot.data_ptr() for slot in slots]
        model = self._holders[home]
        assert model is not None
        self.model = model
        self._holders[home] = None
        block = torch.empty(0, dtype=torch.uint8).set_(model, 0, (self._nbytes,), (1,))
        self.views = layout.views(block)
        self.keys = tuple(self.views)
        self._offsets = [view.data_ptr() - self._bases[home] for view in self.views.values()]
        self._addresses: dict[int, list[int]] = {}  # per slot, as `_DATA_PTR` reads them
        self._packed: dict[int, bytes] = {}  # per slot, as `Source.at` checks them
        self._copies: dict[tuple[int, int, bool], ByteCopies] = {}
        self.slot = home  # -1 once moved out

    def adopt(self, tensors: Mapping[Key, torch.Tensor]) -> None:
        """Make each tensor a view of its place in the home slot (which holds its values
        already)."""
        FlatBlock.point(tensors, self.views)

    def _listed(self) -> list[int]:
        """Where the trainer's tensors are while the model is at its slot (layout order)."""
        found = self._addresses.get(self.slot)
        if found is None:
            base = self._bases[self.slot]
            found = self._addresses[self.slot] = [base + offset for offset in self._offsets]
        return found

    def addresses(self) -> bytes:
        """The same, `_places.pack`ed: what `Source.at` checks the module's tensors
        against, with `in_place`."""
        found = self._packed.get(self.slot)
        if found is None:
            found = self._packed[self.slot] = pack(self._listed())
        return found

    def in_place(self) -> bool:
        """Whether the model is at the home slot, whole (its storage was not resized
        through a view, nor moved out)."""
        at = self.slot
        return (
            at >= 0
            and self.model.data_ptr() == self._bases[at]
            and self.model.nbytes() == self._nbytes
        )

    def holds(self, tensors: Mapping[Key, torch.Tensor]) -> bool:
        """Whether `tensors` (every key, in layout order) are the model's views and the
        model is in place: one address per tensor, read from Python."""
        return self.in_place() and list(map(_DATA_PTR, tensors.values())) == self._listed()

    def moved(self, tensors: Mapping[Key, torch.Tensor]) -> list[Key]:
        """The keys of `tensors` that are not at their place in the home slot."""
        return [
            key
            for key, address in zip(self.keys, self._listed(), strict=True)
            if key not in tensors or tensors[key].data_ptr() != address
        ]

    def move_to(self, slot: int, *, alone: bool) -> None:
        """Copy the home slot into `slot` (marked as being written) and make it the home.

        `alone`: nothing runs beside the copy, and it takes every core: from
        SHARED_COPY_MIN to STREAM_COPY_MIN torch's ``copy_`` (64 MiB slot to slot after
        another 64 MiB copy, as a trainer's step leaves the caches: 5.0 ms against 7.9 by
        the native loop on two threads), above it pieces the native loop shares among
        threads and streams (512 MiB: 37 ms against 42 by torch, 47 whole). Smaller, one
        native copy on this thread: torch's threads wait for each other when a core is
        busy (in the bench's 2,000-tensor alias rows at 16 workers and more its
        default-threads copy of 4 MiB took 45-380 ms where one thread took 0.7).
        Beside workers' copies it runs as one native copy: one core for a big one, the
        others' to the workers.
        """
        at, size = self.slot, self._nbytes
        if alone and SHARED_COPY_MIN <= size < STREAM_COPY_MIN:
            self._slots[slot].copy_(self._slots[at])
        else:
            copies = self._copies.get((at, slot, alone))
            if copies is None:
                dst, src = self._bases[slot], self._bases[at]
                step = SHARED_COPY_MAX if alone else size
                moves = [(dst + o, src + o, min(step, size - o)) for o in range(0, size, step)]
                copies = self._copies[(at, slot, alone)] = ByteCopies(moves)
            copies.run()
        holder = self._holders[slot]
        assert holder is not None and SWAP_DATA_PTR is not None
        SWAP_DATA_PTR(self.model, holder)  # the holder now holds the old home's pointer
        self._holders[at], self._holders[slot] = holder, None
        self.slot = slot

    def move_out(self) -> None:
        """Give the model private memory with the home slot's bytes (before the segment
        goes); the trainer's tensors stay where they are in it. Idempotent."""
        at = self.slot
        if at < 0:
            return
        private = torch.empty(self._nbytes, dtype=torch.uint8)
        ByteCopies([(private.data_ptr(), self._bases[at], self._nbytes)]).run()
        assert SWAP_DATA_PTR is not None
        SWAP_DATA_PTR(self.model, private.untyped_storage())
        self._holders = [None] * len(self._holders)  # the mapping may go now
        self.slot = -1
