"""A tensor-parallel worker's slice of a slot: the copies, or the view, that take it.

A slot holds every tensor at its full shape; a worker whose parameter is a DTensor needs
only its own slice (`_slices` says which bytes). This module turns that into what the
worker's two ways of applying a version use, for one tensor:

* `slice_moves`: the byte copies (destination, source, bytes) that fill the worker's
  local tensor from the slot, in order: a copy-mode worker copies its slice's bytes and
  nothing else, by the native copy loop (`_copy.ByteCopies`).
* `slice_view`: the local tensor as a view of the slot, when the slice is one byte
  range (a row shard of a row-major tensor, a replica): what alias mode needs. None
  otherwise: that tensor is then copied.
* `Slices.of`: a worker model's DTensors, found once when a `Target` binds it: each
  one's piece, the local tensor a copy writes into, and (for alias mode) the tensor
  the DTensor itself computes with, whose ``.data`` a version rebinds.

The slot views are the full tensors' (`Layout.views`); the pieces come from
`_shards.piece_of`. No zmq, no sockets; nothing here knows about versions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import _slices
from ._copy import bytes_are_values
from ._layout import Key
from ._shards import Piece, piece_of
from ._tensor_kinds import is_dtensor

__all__ = ["Slices", "inner_local", "slice_moves", "slice_view"]


def _args(view: torch.Tensor, piece: Piece) -> tuple[Any, ...]:
    return (tuple(view.shape), view.element_size(), piece.placements, piece.mesh, piece.coordinate)


def slice_moves(
    view: torch.Tensor, local: torch.Tensor, piece: Piece
) -> list[tuple[int, int, int]]:
    """The byte copies that fill `local` (this rank's contiguous CPU shard) with its
    slice of `view` (the full tensor in a slot).

    Raises:
        ValueError: `local` is not a contiguous tensor of the slice's shape and dtype, or
            either is not in CPU memory (the copies go by address).
    """
    shape = _slices.local_shape(tuple(view.shape), piece.placements, piece.mesh, piece.coordinate)
    if tuple(local.shape) != shape or local.dtype != view.dtype or not local.is_contiguous():
        raise ValueError(
            f"a slice of {list(shape)} {view.dtype} goes into a contiguous tensor of that shape "
            f"and dtype, not {list(local.shape)} {local.dtype}"
        )
    if not (view.is_cpu and local.is_cpu):
        raise ValueError(
            f"a slice is copied by address between CPU tensors, not from {view.device} "
            f"to {local.device}"
        )
    moves, at = [], 0
    src, dst = view.data_ptr(), local.data_ptr()
    for offset, nbytes in _slices.byte_ranges(*_args(view, piece)):
        moves.append((dst + at, src + offset, nbytes))
        at += nbytes
    return moves


def slice_view(view: torch.Tensor, piece: Piece) -> torch.Tensor | None:
    """This rank's slice of `view` as a view of the same memory, shaped as the local
    tensor, if it is one byte range (None: it is not; copy it)."""
    ranges = _slices.byte_ranges(*_args(view, piece))
    shape = _slices.local_shape(tuple(view.shape), piece.placements, piece.mesh, piece.coordinate)
    if len(ranges) > 1:
        return None
    item = view.element_size()
    start = ranges[0][0] // item if ranges else 0
    return view.reshape(-1)[start : start + math.prod(shape)].view(shape)


def inner_local(dtensor: Any) -> torch.Tensor:
    """The tensor `dtensor` computes with (its local shard), as an object whose ``.data``
    can be set: ``to_local()`` returns a new alias of it each call, and setting the
    alias's ``.data`` (or the DTensor's own) leaves the DTensor's shard where it was. It
    is found through the traceable-subclass protocol (``__tensor_flatten__`` names the
    inner tensors), as the one of them sharing the shard's memory.

    Raises:
        TypeError: no inner tensor holds the shard (a DTensor that works otherwise).
    """
    with torch.no_grad():
        address = dtensor.to_local().data_ptr()
    names, _ = dtensor.__tensor_flatten__()
    for name in names:
        inner = getattr(dtensor, name)
        if isinstance(inner, torch.Tensor) and inner.data_ptr() == address:
            return inner
    raise TypeError("this DTensor does not expose its local shard through __tensor_flatten__")


@dataclass(frozen=True)
class Slices:
    """A worker model's DTensors (see the module doc); empty for a plain model.

    Attributes:
        pieces: each DTensor's piece of its full tensor.
        locals: what a copy writes into: each DTensor's local shard (its memory).
        inner: alias mode: what a version rebinds (`inner_local`); copy mode: empty.
        owned: alias mode: the model's own DTensors (what the worker computes with).
    """

    pieces: dict[Key, Piece]
    locals: dict[Key, torch.Tensor]
    inner: dict[Key, torch.Tensor]
    owned: dict[Key, torch.Tensor]

    @classmethod
    def of(cls, flat: Mapping[Key, torch.Tensor], owners: Mapping[Key, Any] | None) -> Slices:
        """`flat`: the model's tensors (detached); `owners`: alias mode, the model's own
        tensor objects (a DTensor parameter's ``.data`` cannot be rebound, its shard can).

        Raises:
            TypeError: naming the tensor: a DTensor whose mesh is not a CPU mesh or
                leaves this rank out, a Partial placement, or a local shard a byte copy
                cannot fill (not contiguous, or another dtype than its DTensor).
        """
        pieces: dict[Key, Piece] = {}
        local: dict[Key, torch.Tensor] = {}
        inner: dict[Key, torch.Tensor] = {}
        owned: dict[Key, torch.Tensor] = {}
        for key, tensor in flat.items():
            if not is_dtensor(tensor):
                continue
            pieces[key] = piece_of(key, tensor)
            with torch.no_grad():
                local[key] = tensor.to_local()  # type: ignore[attr-defined]
            if not bytes_are_values(local[key]) or local[key].dtype != tensor.dtype:
                raise TypeError(
                    f"{'.'.join(key)!r} is a DTensor whose local shard is not a contiguous "
                    f"CPU tensor of its dtype; make it one (contiguous()) before binding"
                )
            if owners is not None:
                owned[key] = owners[key]
                inner[key] = inner_local(owned[key])
        return cls(pieces, local, inner, owned)
