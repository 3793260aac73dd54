"""A tensor-parallel worker's slice of a slot (`zmqsync._shard_reads`): the byte copies
fill exactly the local shard, and the alias view is the slice, where it is one range."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from zmqsync._copy import ByteCopies
from zmqsync._shard_reads import slice_moves, slice_view
from zmqsync._shards import Piece
from zmqsync._slices import Replicate, Shard, StridedShard, held

pytestmark = pytest.mark.timeout(60)

CASES = [
    ((30, 13), (Shard(0),), (4,)),  # ColwiseParallel's weight, uneven: 8, 8, 8, 6
    ((7, 30), (Shard(1),), (4,)),  # RowwiseParallel's weight: columns
    ((7,), (Replicate(),), (4,)),  # its bias
    ((10, 6), (StridedShard(0, 2), Shard(0)), (2, 2)),  # FSDP over TP
    ((9, 5), (Shard(0), Shard(1)), (2, 2)),
]


def _expected(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    runs = held(tuple(full.shape), piece.placements, piece.mesh, piece.coordinate)
    index = [torch.tensor([i for a, b in r for i in range(a, b)], dtype=torch.long) for r in runs]
    return full[torch.meshgrid(*index, indexing="ij")]


@pytest.mark.parametrize(("shape", "placements", "mesh"), CASES)
def test_the_copies_fill_the_local_shard_and_nothing_else(shape, placements, mesh):
    full = torch.randn(shape).to(torch.bfloat16)  # a 2-byte dtype: offsets in bytes
    slot = torch.zeros(full.numel() + 64, dtype=torch.bfloat16)
    view = slot[32 : 32 + full.numel()].view(shape)  # the full tensor inside a slot
    view.copy_(full)
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        piece = Piece(placements, mesh, coordinate)
        want = _expected(full, piece)
        local = torch.full(want.shape, -1.0, dtype=torch.bfloat16)
        moves = slice_moves(view, local, piece)
        assert sum(n for _, _, n in moves) == want.numel() * 2  # its slice's bytes only
        ByteCopies(moves).run()
        assert torch.equal(local, want), coordinate
        aliased = slice_view(view, piece)
        if aliased is None:
            assert len(moves) > 1
        else:
            assert torch.equal(aliased, want)
            assert aliased.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()


def test_a_row_shard_aliases_and_a_column_shard_does_not():
    view = torch.arange(30 * 13, dtype=torch.float32).view(30, 13)
    rows = slice_view(view, Piece((Shard(0),), (4,), (3,)))
    assert rows is not None and rows.shape == (6, 13) and rows[0, 0] == 24 * 13
    assert slice_view(view, Piece((Shard(1),), (4,), (0,))) is None
    empty = slice_view(torch.zeros(3, 2), Piece((Shard(0),), (4,), (3,)))
    assert empty is not None and math.prod(empty.shape) == 0


def test_a_local_tensor_of_another_shape_is_refused():
    view = torch.zeros(30, 13)
    with pytest.raises(ValueError, match=r"a slice of \[8, 13\]"):
        slice_moves(view, torch.zeros(7, 13), Piece((Shard(0),), (4,), (0,)))
