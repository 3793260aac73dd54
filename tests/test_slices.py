"""The slice arithmetic of sharded tensors (`zmqsync._slices`): exact answers, and the
pieces of every coordinate tiling the full tensor exactly once."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from zmqsync._slices import (
    Replicate,
    Shard,
    StridedShard,
    boxes,
    byte_ranges,
    chunk,
    contiguous,
    held,
    local_shape,
    writes,
)

pytestmark = pytest.mark.timeout(60)


def test_chunk_cuts_as_torch_chunk_and_pads_with_empty_pieces():
    for size in range(12):
        for parts in range(1, 6):
            pieces = [chunk(size, parts, i) for i in range(parts)]
            got = [b - a for a, b in pieces]
            want = [len(c) for c in torch.arange(size).chunk(parts)]
            assert got == want + [0] * (parts - len(want)), (size, parts)
    with pytest.raises(ValueError):
        chunk(4, 2, 2)


def test_fsdp_uneven_last_shard():
    # 7 rows on 2 ranks: 4 and 3; 3 rows on 2 ranks: 2 and 1; 5 rows on 4 ranks: 2,2,1,0
    assert held((7, 5), [Shard(0)], [2], [1]) == (((4, 7),), ((0, 5),))
    assert local_shape((3, 7), [Shard(0)], [2], [1]) == (1, 7)
    assert [local_shape((5,), [Shard(0)], [4], [i]) for i in range(4)] == [(2,), (2,), (1,), (0,)]
    assert byte_ranges((7, 5), 4, [Shard(0)], [2], [1]) == [(80, 60)]
    assert byte_ranges((5,), 4, [Shard(0)], [4], [3]) == []
    assert boxes((5,), [Shard(0)], [4], [3]) == []


def test_column_shard_is_one_range_per_row():
    ranges = byte_ranges((3, 10), 2, [Shard(1)], [2], [1])
    assert ranges == [(10, 10), (30, 10), (50, 10)]
    assert not contiguous((3, 10), [Shard(1)], [2], [1])
    assert contiguous((1, 10), [Shard(1)], [2], [1])  # one row: one range
    assert contiguous((3, 10), [Shard(0)], [2], [1])


def test_replicate_holds_everything_and_only_coordinate_zero_writes():
    assert held((4, 6), [Replicate()], [3], [2]) == (((0, 4),), ((0, 6),))
    assert byte_ranges((4, 6), 4, [Replicate()], [3], [2]) == [(0, 96)]
    assert writes([Replicate()], [0]) and not writes([Replicate()], [1])
    assert writes([Shard(0), Replicate()], [1, 0])
    assert not writes([Shard(0), Replicate()], [1, 1])


def test_strided_shard_matches_tp_then_fsdp():
    # FSDP2 over a TP mesh (dp=2, tp=2): [_StridedShard(0, sf=2), Shard(0)]; rows of 10:
    # tp first (5 and 5), then dp over each TP piece (3 and 2)
    placements = [StridedShard(0, 2), Shard(0)]
    got = {
        c: held((10, 6), placements, [2, 2], c)[0] for c in itertools.product(range(2), range(2))
    }
    assert got == {(0, 0): ((0, 3),), (0, 1): ((5, 8),), (1, 0): ((3, 5),), (1, 1): ((8, 10),)}
    # the strided piece alone (a mesh dim that is not sharded after it) is two runs
    assert held((10,), [StridedShard(0, 2)], [2], [1]) == (((3, 5), (8, 10)),)
    assert byte_ranges((10, 3), 1, [StridedShard(0, 2)], [2], [1]) == [(9, 6), (24, 6)]


def _right_to_left(size: int, dp: int, tp: int, d: int, t: int) -> list[int]:
    """FSDP2 over TP as it happens: tp cuts first, dp cuts the TP piece."""
    tp_piece = list(range(size))[slice(*chunk(size, tp, t))]
    return tp_piece[slice(*chunk(len(tp_piece), dp, d))]


@pytest.mark.parametrize("size", range(14))
def test_strided_shard_uneven_sizes_match_tp_then_fsdp(size):
    for dp, tp in [(2, 2), (2, 3), (3, 2)]:
        for d, t in itertools.product(range(dp), range(tp)):
            runs = held((size,), [StridedShard(0, tp), Shard(0)], [dp, tp], [d, t])[0]
            assert [i for a, b in runs for i in range(a, b)] == _right_to_left(size, dp, tp, d, t)


CASES = [
    ((7, 5), [Shard(0)], [2]),
    ((5, 9), [Shard(1)], [4]),
    ((6, 4, 3), [Shard(1), Shard(2)], [2, 3]),
    ((10, 6), [StridedShard(0, 2), Shard(0)], [2, 2]),
    ((9, 7), [Shard(0), Shard(1)], [2, 2]),
    ((5, 10), [Shard(0), Replicate()], [2, 2]),
    ((3,), [Replicate(), Shard(0)], [2, 4]),
    ((), [Replicate()], [2]),
]


@pytest.mark.parametrize(("shape", "placements", "mesh"), CASES)
def test_pieces_tile_the_full_tensor_and_rebuild_each_local_tensor(shape, placements, mesh):
    full = torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)
    raw = full.reshape(-1).view(torch.uint8)
    covered = torch.zeros(math.prod(shape), dtype=torch.int32)
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        runs = held(shape, placements, mesh, coordinate)
        index = [
            torch.tensor([i for a, b in r for i in range(a, b)], dtype=torch.long) for r in runs
        ]
        local = full[torch.meshgrid(*index, indexing="ij")] if shape else full
        assert tuple(local.shape) == local_shape(shape, placements, mesh, coordinate)
        # the byte ranges, copied in order, are the local tensor's bytes
        ranges = byte_ranges(shape, 4, placements, mesh, coordinate)
        got = torch.cat([raw[o : o + n] for o, n in ranges]) if ranges else raw[:0]
        assert torch.equal(got, local.contiguous().reshape(-1).view(torch.uint8))
        assert contiguous(shape, placements, mesh, coordinate) == (len(ranges) <= 1)
        # the boxes map local places to full places
        for box in boxes(shape, placements, mesh, coordinate):
            f = tuple(slice(a, b) for a, b in box.full)
            loc = tuple(slice(a, b) for a, b in box.local)
            assert torch.equal(full[f], local[loc])
            if writes(placements, coordinate):
                covered.view(shape)[f] += 1
    assert bool((covered == 1).all()), "every element written exactly once"


def test_disagreeing_inputs_are_value_errors():
    with pytest.raises(ValueError, match="must agree"):
        held((4,), [Shard(0)], [2, 2], [0, 0])
    with pytest.raises(ValueError, match="outside the mesh"):
        held((4,), [Shard(0)], [2], [2])
    with pytest.raises(ValueError, match="of a tensor of 1 dims"):
        held((4,), [Shard(1)], [2], [0])


def test_the_slice_arithmetic_loads_no_torch():
    """Either side may use it without torch: imported alone (the package's `__init__`
    replaced by an empty package, as tests/test_architecture.py does), it loads none."""
    import subprocess
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "zmqsync"
    code = (
        "import importlib, sys, types\n"
        "root = types.ModuleType('zmqsync')\n"
        f"root.__path__ = [{str(package)!r}]\n"
        "sys.modules['zmqsync'] = root\n"
        "importlib.import_module('zmqsync._slices')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
