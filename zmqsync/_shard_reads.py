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

The slot views are the full tensors' (`Layout.views`); the pieces come from
`_shards.piece_of`. No zmq, no sockets; nothing here knows about versions.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _slices
from ._shards import Piece

__all__ = ["slice_moves", "slice_view"]


def _args(view: torch.Tensor, piece: Piece) -> tuple[Any, ...]:
    return (tuple(view.shape), view.element_size(), piece.placements, piece.mesh, piece.coordinate)


def slice_moves(
    view: torch.Tensor, local: torch.Tensor, piece: Piece
) -> list[tuple[int, int, int]]:
    """The byte copies that fill `local` (this rank's contiguous CPU shard) with its
    slice of `view` (the full tensor in a slot).

    Raises:
        ValueError: `local` is not a contiguous tensor of the slice's shape and dtype.
    """
    shape = _slices.local_shape(tuple(view.shape), piece.placements, piece.mesh, piece.coordinate)
    if tuple(local.shape) != shape or local.dtype != view.dtype or not local.is_contiguous():
        raise ValueError(
            f"a slice of {list(shape)} {view.dtype} goes into a contiguous tensor of that shape "
            f"and dtype, not {list(local.shape)} {local.dtype}"
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
