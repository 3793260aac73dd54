"""Many tensors as views of one private block laid out as a slot: a version is one copy.

A model of thousands of small tensors costs per tensor, not per byte: a copy of each
(2,000 ``copy_`` calls, or one ``_foreach_copy_`` that still dispatches each) and a check
of each (its shape and dtype on the trainer's side, its address on the worker's). When
every tensor lives at its slot offset inside one block of ``slot_bytes``, the whole
version moves as one copy of that block, and the block's gaps (alignment padding) are
the block's own bytes.

`FlatBlock` owns such a block. `adopt` moves tensors into it: each one's values are
copied to its place and the tensor object becomes a view of that place (``.data =``), so
a ``Parameter`` stays the same object (optimizers, hooks and ``state_dict`` keep
working), as live mode does with the segment. In-place writes (an optimizer step,
BatchNorm's running statistics, ``load_state_dict`` without ``assign``) then land in the
block. A tensor its owner re-allocates (``load_state_dict(assign=True)``, ``.to()`` to
another dtype and back, ``.data = other``) leaves the block: `moved` finds it by its
address, and the user of the block falls back to copying tensor by tensor.

The block is private memory (not the shared segment): the tensors keep it alive, and
nothing is to be given back when the bus closes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ._copy import ByteCopies, bytes_are_values
from ._layout import Key, Layout, torch_dtype
from ._places import pack

__all__ = ["FlatBlock"]

_DATA_PTR: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr


class FlatBlock:
    """One block of a slot's size holding tensors at their slot offsets (see the module doc)."""

    __slots__ = ("block", "views", "keys", "_addresses", "_packed", "_base", "_nbytes")

    def __init__(self, layout: Layout) -> None:
        self.block = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
        self.views = layout.views(self.block)
        self.keys = tuple(self.views)
        self._addresses = list(map(_DATA_PTR, self.views.values()))
        self._packed = pack(self._addresses)
        self._base = self.block.data_ptr()
        self._nbytes = layout.slot_bytes

    @staticmethod
    def refusal(tensors: Mapping[Key, torch.Tensor], layout: Layout) -> str | None:
        """Why `tensors` cannot move into a block of `layout` (None: they can): each must
        be a plain contiguous CPU tensor with the layout's shape and dtype."""
        if set(tensors) != {spec.key for spec in layout.specs}:
            return "the tensors are not the layout's"
        for spec in layout.specs:
            t = tensors[spec.key]
            name = ".".join(spec.key)
            if not bytes_are_values(t):
                return f"{name} is not a plain contiguous CPU tensor"
            if t.dtype != torch_dtype(spec.dtype) or tuple(t.shape) != tuple(spec.shape):
                return f"{name} is not {spec.dtype} of shape {tuple(spec.shape)}"
        return None

    def adopt(self, tensors: Mapping[Key, torch.Tensor]) -> None:
        """Copy each tensor's values to its place, then make it a view of that place."""
        with torch.no_grad():
            for key, tensor in tensors.items():
                self.views[key].copy_(tensor)
        self.point(tensors, self.views)

    @staticmethod
    def point(tensors: Mapping[Key, torch.Tensor], views: Mapping[Key, torch.Tensor]) -> None:
        """Make each tensor the view `views[key]` (``.data =``: a ``Parameter`` stays the
        same object), which holds its values already."""
        with torch.no_grad():
            for key, tensor in tensors.items():
                tensor.data = views[key]

    def in_place(self) -> bool:
        """Whether the block's storage is where it was made, at its size (a storage
        resized through one of its views moves or frees it)."""
        return (
            self.block.data_ptr() == self._base
            and self.block.untyped_storage().nbytes() == self._nbytes
        )

    def holds(self, tensors: Mapping[Key, torch.Tensor]) -> bool:
        """Whether `tensors` (every key, in layout order) are still the block's views
        and the block is in place: one address per tensor, read from Python."""
        return list(map(_DATA_PTR, tensors.values())) == self._addresses and self.in_place()

    def addresses(self) -> bytes:
        """Where the block's views are (`_places.pack`ed, layout order): what
        `Source.at` checks the module's tensors against, with `in_place`."""
        return self._packed

    def moved(self, tensors: Mapping[Key, torch.Tensor]) -> list[Key]:
        """The keys of `tensors` that are not at their place in the block."""
        return [
            key
            for key, address in zip(self.keys, self._addresses, strict=True)
            if key not in tensors or tensors[key].data_ptr() != address
        ]

    def copies(self, slot: torch.Tensor, *, into_slot: bool) -> ByteCopies:
        """The one copy between the block and `slot` (a flat uint8 tensor of the same
        size): into it (a publisher's write) or out of it (a worker's apply)."""
        if slot.numel() != self._nbytes or not bytes_are_values(slot):
            raise ValueError(f"a slot of {self._nbytes} contiguous CPU bytes, not {slot.numel()}")
        ends = (slot.data_ptr(), self._base)
        dst, src = ends if into_slot else ends[::-1]
        return ByteCopies([(dst, src, self._nbytes)])
